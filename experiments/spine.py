"""The training loop every experiment shares: a plan's run, with progress.

`run_plan` runs a `dpsco_jax.plans.Plan` to its end on a data set: the
plan's batches, its jitted transformation, a progress line with the
epsilon spent so far, and a metrics row at every evaluation. `run_optimizer`
runs a non-private reference through the same loop. An experiment file then
keeps only what its paper needs (data, models, grid, plots):

    plan = plans.dpftrl(loss_fn, optimizer=optax.sgd(0.5, momentum=0.9),
                        epsilon=2.0, delta=1e-5, num_examples=n, ...)
    result = spine.run_plan('dpftrl', plan, params, train,
                            evaluate=lambda p: {'test_accuracy': acc(p)},
                            eval_every=10)
    outputs.write_csv('metrics.csv', result.rows)

Every row holds `algorithm`, `step`, `epoch`, `epsilon` (spent so far;
`inf` for a non-private run) and the evaluation's metrics. Evaluations are
diagnostics outside the privacy guarantee unless they use public data.
"""

import itertools
import math
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

from absl import logging
import jax
import optax

from dpsco_jax import checkpoint
from dpsco_jax import ledger as ledger_lib
from dpsco_jax import plans
from experiments import outputs

PyTree = Any
Row = dict[str, Any]
Evaluate = Callable[[PyTree], Mapping[str, float]]


class RunResult(NamedTuple):
  """The end of a run.

  Attributes:
    params: the final params (for Algorithm 1: `final_params` of the state
      is the algorithm's output; the params are the last query point).
    opt_state: the final optimizer state (NON-PRIVATE: never publish).
    rows: one metrics row per evaluation.
    wall_seconds: the run's wall time, compilation included.
    first_step: the step the run started (resumed) at.
    last_step: the last step run (`num_steps` unless stopped early).
    ledger: the privacy ledger at `last_step` (with a checkpoint, the one
      the last save wrote, which a release exports); None for plans without
      one.
  """

  params: PyTree
  opt_state: PyTree
  rows: list[Row]
  wall_seconds: float
  first_step: int = 0
  last_step: Optional[int] = None
  ledger: Optional[ledger_lib.PrivacyLedger] = None


def _loop(name: str, num_steps: int, steps_per_epoch: float,
          inputs: Iterable[Mapping[str, Any]], step: Callable, params: PyTree,
          opt_state: PyTree, evaluate: Evaluate, eval_every: int,
          epsilon_at: Callable[[int], float], first_step: int = 0,
          after_step: Optional[Callable[[int, PyTree, PyTree], None]] = None,
          stop_after: Optional[int] = None) -> RunResult:
  """The loop: one jitted step per input, evaluations, progress."""
  if eval_every < 1:
    raise ValueError(f'eval_every must be >= 1, got {eval_every}')
  start = time.perf_counter()
  progress = outputs.Progress(name, num_steps)
  rows = []

  def record(t: int) -> None:
    metrics = {k: float(v) for k, v in evaluate(params).items()}
    rows.append({'algorithm': name, 'step': t,
                 'epoch': t / steps_per_epoch, 'epsilon': epsilon_at(t),
                 **metrics})
    progress.update(t, epsilon=rows[-1]['epsilon'], **metrics)

  record(first_step)
  t = first_step
  for t, batch_inputs in enumerate(inputs, start=first_step + 1):
    params, opt_state = step(params, opt_state, batch_inputs)
    if t % eval_every == 0 or t == num_steps:
      record(t)
    if after_step is not None:
      after_step(t, params, opt_state)
    if t == stop_after:
      break
  if t != num_steps and t != stop_after:
    raise RuntimeError(f'{name}: the batches ended after {t} of {num_steps} '
                       'steps')
  return RunResult(params, opt_state, rows, time.perf_counter() - start,
                   first_step=first_step, last_step=t)


def run_plan(name: str, plan: plans.Plan, params: PyTree, data: PyTree, *,
             evaluate: Evaluate, eval_every: int,
             checkpoint_dir: Optional[str] = None,
             checkpoint_every: int = 100,
             on_step: Optional[Callable[[int], None]] = None,
             stop_after: Optional[int] = None) -> RunResult:
  """Runs `plan` to its end on `data`, resuming from a checkpoint if any.

  With `checkpoint_dir`, the run starts from the checkpoint there when one
  exists (`dpsco_jax.checkpoint.restore_or_init`: the plan's ledger and
  sampler must be the checkpoint's, so build the plan with the same `seed`;
  a fresh noise key is replaced by the saved one) and saves every
  `checkpoint_every` steps and at the end. A run killed and resumed ends
  bit-identical to one that ran through. The checkpoint holds NON-PRIVATE
  state: never publish it.

  Example:
    >>> result = run_plan('dpsgd', plan, params, train,
    ...                   evaluate=lambda p: {'acc': accuracy(p)},
    ...                   eval_every=20)

  Args:
    name: the run's name in rows and logs.
    plan: the plan (its batches index `data`; a plan without a sampler,
      such as DIFF2's or the multi-pass nonsmooth one, gets all of `data`
      every step).
    params: the initial params.
    data: the training set, a pytree with leading axis `num_examples`.
    evaluate: `evaluate(params) -> {metric: value}`, at every evaluation.
    eval_every: evaluate every this many steps (and at step 0 and the end).
    checkpoint_dir: where to checkpoint (None: no checkpoints).
    checkpoint_every: steps between checkpoints.
    on_step: called with each completed step number (after its checkpoint,
      if one is due).
    stop_after: return after this step, as an interrupted run would.

  Returns:
    The `RunResult` (its rows start at the step the run resumed from).
  """
  multiplier = plan.noise_multiplier  # a float, or a named tuple (DIFF2)
  logging.info('%s: noise multiplier %s, %d steps, epsilon %.4g at delta '
               '%g (%s)', name, f'{multiplier:.4g}' if isinstance(
                   multiplier, (int, float)) else multiplier, plan.num_steps,
               plan.epsilon, plan.delta, plan.mechanism.name)

  # The plan's compiled step: no host round trip, and a refusal raised as
  # the library's short PrivacyGuardError at most plan.REFUSAL_LAG steps
  # late (plan.finish below raises any left at the end).
  step = plan.step
  steps_per_epoch = plan.num_examples / plan.hyperparameters.get(
      'batch_size', plan.num_examples)
  opt_state, first, hooks = plan.init(params), 0, []
  ledger = [plan.ledger]
  if checkpoint_dir is not None:
    if plan.ledger is None:
      raise ValueError(f'{plan.algorithm} has no privacy ledger: its runs '
                       'cannot be checkpointed (run without checkpoint_dir)')
    restored = checkpoint.restore_or_init(
        checkpoint_dir, params=params, opt_state=opt_state,
        ledger=plan.ledger, sampler=plan.batches)
    params, opt_state, first = (restored.params, restored.opt_state,
                                restored.step)
    ledger = [restored.ledger]
    if first:
      logging.info('%s: resumed from step %d of %d', name, first,
                   plan.num_steps)

    def save_when_due(t, params, opt_state):
      if t % checkpoint_every == 0 or t == plan.num_steps:
        ledger[0] = checkpoint.save(
            checkpoint_dir, params=params, opt_state=opt_state, step=t,
            ledger=ledger[0], sampler_state=plan.batches)
        logging.info('%s: checkpoint at step %d of %d', name, t,
                     plan.num_steps)

    hooks.append(save_when_due)
  if on_step is not None:
    hooks.append(lambda t, params, opt_state: on_step(t))
  last_state = [opt_state]
  hooks.append(lambda t, params, opt_state: last_state.__setitem__(
      0, opt_state))

  def after_step(t, params, opt_state):
    for hook in hooks:
      hook(t, params, opt_state)

  if plan.batches is None:
    # Full-batch plans (DIFF2, the multi-pass nonsmooth oracle) read the
    # whole data set every step.
    inputs = itertools.repeat({'batch': data}, plan.num_steps - first)
  else:
    inputs = plan.batches_of(data, first)
  result = _loop(name, plan.num_steps, steps_per_epoch, inputs, step, params,
                 opt_state, evaluate, eval_every, plan.epsilon_at, first,
                 after_step, stop_after)
  plan.finish(last_state[0])
  final = ledger[0]
  if final is not None and checkpoint_dir is None:
    final = final.advance_to(result.last_step)
  return result._replace(ledger=final)


def run_optimizer(name: str, optimizer: optax.GradientTransformation,
                  batch_loss: Callable[[PyTree, PyTree], Any], params: PyTree,
                  data: PyTree, batches: Iterable[Any], *, num_steps: int,
                  steps_per_epoch: float, evaluate: Evaluate,
                  eval_every: int) -> RunResult:
  """A non-private reference: `optimizer` on the batch-mean gradient.

  Example:
    >>> result = run_optimizer('sgd', optax.sgd(0.5), mean_loss, params,
    ...                        train, sampler, num_steps=sampler.num_steps,
    ...                        steps_per_epoch=sampler.steps_per_epoch,
    ...                        evaluate=evaluate, eval_every=10)

  Args:
    name: the run's name.
    optimizer: the optax optimizer.
    batch_loss: `batch_loss(params, batch) -> scalar`, the batch mean.
    params: the initial params.
    data: the training set.
    batches: example indices of each step.
    num_steps: the number of batches.
    steps_per_epoch: for the rows' `epoch`.
    evaluate: as in `run_plan`.
    eval_every: as in `run_plan`.

  Returns:
    The `RunResult` (`epsilon` is inf in every row after step 0).
  """

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(batch_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  inputs = (jax.tree_util.tree_map(lambda x, i=indices: x[i], data)
            for indices in batches)
  return _loop(name, num_steps, steps_per_epoch, inputs, step, params,
               optimizer.init(params), evaluate, eval_every,
               lambda t: 0.0 if t == 0 else math.inf)


def privacy_entry(name: str, plan: plans.Plan,
                  spent_steps: Optional[int] = None) -> dict[str, Any]:
  """The run record's privacy entry of a plan's run.

  Example:
    >>> outputs.run_record(config, privacy=[privacy_entry('dpsgd', plan)])

  Args:
    name: the run's name.
    plan: its plan.
    spent_steps: the steps run (default: all of them).

  Returns:
    A JSON-compatible dict: the plan's description, the `dp_accounting`
    event and the epsilon spent.
  """
  steps = plan.num_steps if spent_steps is None else spent_steps
  return {'name': name, **plan.describe(),
          'dp_event': outputs.event_to_dict(plan.event),
          'dp_event_repr': repr(plan.event),
          'epsilon_spent': plan.epsilon_at(steps)}
