"""A private training run that survives being killed: checkpoint and resume.

Logistic regression on scikit-learn's digits (the quickstart's model) with
DP-MEMF (matrix-factorization noise with its buffer of past noise), DP-FTRL
(tree noise) or DP-SGD (Poisson sampling), followed by SGD with momentum. A
checkpoint (`dpsco_jax.checkpoint`) is written every `--checkpoint_every`
steps; run the same command again after an interruption (even SIGKILL) and
it resumes from the last checkpoint, with the same batches and the same
noise, to the same final params bit for bit:

    python -m experiments.resumable --algorithm=dpmemf \
        --checkpoint=results/resumable/checkpoint \
        --release=results/resumable/release

The checkpoint is a directory (orbax-checkpoint arrays and a JSON manifest
with the privacy ledger, replaced atomically at each save) holding
non-private state (noise key and buffers, batch fingerprints, the sampler
seed): keep it private. The release directory
(`checkpoint.export_release`) holds only the final params and the privacy
ledger with the epsilon spent, and is the one to publish.
"""

import dataclasses
import time
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np
import optax

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import checkpoint
from dpsco_jax import noise
from dpsco_jax import strategies
from experiments import datasets
from experiments import quickstart

ALGORITHMS = ('dpmemf', 'dpftrl', 'dpsgd')


def define_flags() -> None:
  """Defines the command-line flags.

  Called only when the module runs as a program, so that importing it (e.g.
  in tests) defines no flags.

  Example:
    >>> define_flags(); flags.FLAGS(['resumable', '--checkpoint=run/ckpt'])
  """
  flags.DEFINE_enum('algorithm', 'dpmemf', ALGORITHMS, 'The private algorithm.')
  flags.DEFINE_string(
      'checkpoint', None, 'Checkpoint directory (NON-PRIVATE: keep it '
      'private); resumed from when it holds a checkpoint.')
  flags.DEFINE_string(
      'release', None, 'Directory to export the final params and privacy '
      'ledger to (safe to publish).')
  flags.DEFINE_integer(
      'checkpoint_every', 4, 'Save a checkpoint every this many steps (and at '
      'the last step).')
  flags.DEFINE_integer('num_epochs', 4, 'Passes over the data.')
  flags.DEFINE_integer('batch_size', 239,
                       'Fixed-order batch size (DP-MEMF, DP-FTRL).')
  flags.DEFINE_integer('expected_batch_size', 128,
                       'Expected Poisson batch size (DP-SGD).')
  flags.DEFINE_float('learning_rate', 0.5, 'SGD step size.')
  flags.DEFINE_float('momentum', 0.9, 'SGD momentum.')
  flags.DEFINE_float('clip', 1.0, 'Per-example l2 clip norm.')
  flags.DEFINE_integer('seed', 0, 'Seeds batch order, sampling and noise key.')
  flags.DEFINE_float('epsilon', 2.0, 'Target epsilon.')
  flags.DEFINE_float('delta', 1e-5, 'Target delta.')
  flags.DEFINE_float(
      'noise_multiplier', None, 'Use this noise multiplier instead of '
      'calibrating one to --epsilon (the ledger then has no target).')
  flags.DEFINE_enum('accounting_method', 'pld', accounting.METHODS,
                    'Accounting method.')


@dataclasses.dataclass(frozen=True)
class Settings:
  """A run's configuration (the flags above, with the same defaults).

  Attributes:
    algorithm: 'dpmemf', 'dpftrl' or 'dpsgd'.
    checkpoint_every: steps between checkpoints.
    num_epochs: passes over the data (expected passes for DP-SGD).
    batch_size: fixed-order batch size.
    expected_batch_size: expected Poisson batch size.
    learning_rate: SGD step size.
    momentum: SGD momentum.
    clip: per-example clip norm.
    seed: seeds the batch order, the sampling and the noise key.
    epsilon: target epsilon (used when `noise_multiplier` is None).
    delta: delta.
    noise_multiplier: fixed noise multiplier, or None to calibrate.
    method: accounting method.
  """

  algorithm: str = 'dpmemf'
  checkpoint_every: int = 4
  num_epochs: int = 4
  batch_size: int = 239
  expected_batch_size: int = 128
  learning_rate: float = 0.5
  momentum: float = 0.9
  clip: float = 1.0
  seed: int = 0
  epsilon: float = 2.0
  delta: float = 1e-5
  noise_multiplier: Optional[float] = None
  method: str = 'pld'

  @classmethod
  def from_flags(cls) -> 'Settings':
    """The settings given on the command line (`define_flags`).

    Example:
      >>> settings = Settings.from_flags()   # inside absl's app.run

    Returns:
      The `Settings`.
    """
    f = flags.FLAGS
    return cls(algorithm=f.algorithm, checkpoint_every=f.checkpoint_every,
               num_epochs=f.num_epochs, batch_size=f.batch_size,
               expected_batch_size=f.expected_batch_size,
               learning_rate=f.learning_rate, momentum=f.momentum,
               clip=f.clip, seed=f.seed, epsilon=f.epsilon, delta=f.delta,
               noise_multiplier=f.noise_multiplier,
               method=f.accounting_method)


class Run(NamedTuple):
  """Everything a run needs, rebuilt identically on every (re)start.

  Attributes:
    tx: the transformation chain.
    step: the jitted step `(params, opt_state, batch, mask, indices)`.
    sampler: the batch sampler.
    batches: `start_step -> iterator of (indices, mask)`.
    mechanism: the noise mechanism the transformation builds.
    ledger: the run's ledger at step 0.
  """

  tx: optax.GradientTransformation
  step: quickstart.StepFn
  sampler: checkpoint.Sampler
  batches: Callable[[int], Iterator[tuple[np.ndarray, Optional[np.ndarray]]]]
  mechanism: noise.NoiseMechanism
  ledger: checkpoint.PrivacyLedger


class Result(NamedTuple):
  """What `train` did.

  Attributes:
    params: the params at the last step run.
    ledger: the ledger at the last step run.
    start_step: the step it started (resumed) at.
    step: the last step run.
  """

  params: quickstart.Params
  ledger: checkpoint.PrivacyLedger
  start_step: int
  step: int


def build(settings: Settings, num_examples: int) -> Run:
  """The transformation, sampler, mechanism and ledger of a run.

  Everything is a function of `settings`, so a resumed process rebuilds the
  same run (the checkpoint refuses to resume a different one).

  Example:
    >>> run = build(Settings(algorithm='dpftrl'), num_examples=1437)
    >>> run.ledger.planned_epsilon

  Args:
    settings: the configuration.
    num_examples: training set size.

  Returns:
    The `Run`.

  Raises:
    ValueError: for an unknown algorithm.
  """
  if settings.algorithm not in ALGORITHMS:
    raise ValueError(f'algorithm must be one of {ALGORITHMS}, got '
                     f'{settings.algorithm!r}')
  key = jax.random.key(quickstart.seed_for(settings.seed,
                                           f'{settings.algorithm}/noise'))
  normalize_by = None
  if settings.algorithm == 'dpsgd':
    num_steps = round(settings.num_epochs * num_examples /
                      settings.expected_batch_size)
    sampler = batching.PoissonBatches(
        num_examples, settings.expected_batch_size / num_examples, num_steps,
        seed=quickstart.seed_for(settings.seed, 'dpsgd/sampling'))
    mechanism = dpsco_jax.dpsgd_mechanism(num_steps)
    normalize_by = sampler.expected_batch_size
    batches = sampler.iterate
  else:
    sampler = batching.FixedOrderBatches(
        num_examples, settings.batch_size, settings.num_epochs,
        order_seed=quickstart.seed_for(settings.seed, 'fixed_order'))
    num_steps = sampler.num_steps

    def batches(start_step):
      for indices in sampler.iterate(start_step):
        yield indices, None

    if settings.algorithm == 'dpftrl':
      mechanism = dpsco_jax.dpftrl_mechanism(num_steps,
                                             sampler.steps_per_epoch)
    else:
      strategy = strategies.optimize_strategy(
          strategies.workload(num_steps, 'true', momentum=settings.momentum),
          sampler.num_epochs)
      mechanism = dpsco_jax.dpmemf_mechanism(strategy)
  target = None
  noise_multiplier = settings.noise_multiplier
  if noise_multiplier is None:
    target = settings.epsilon
    noise_multiplier = dpsco_jax.calibrate_noise_multiplier(
        mechanism, sampler.participation, settings.epsilon, settings.delta,
        method=settings.method)
  common = dict(l2_clip=settings.clip, noise_multiplier=noise_multiplier,
                key=key, normalize_by=normalize_by)
  if settings.algorithm == 'dpsgd':
    private = dpsco_jax.dpsgd(quickstart.example_loss, num_steps=num_steps,
                              **common)
  elif settings.algorithm == 'dpftrl':
    private = dpsco_jax.dpftrl(quickstart.example_loss, num_steps=num_steps,
                               restart_every=sampler.steps_per_epoch,
                               **common)
  else:
    private = dpsco_jax.dpmemf(quickstart.example_loss, strategy=strategy,
                               steps_per_epoch=sampler.steps_per_epoch,
                               num_examples=num_examples, **common)
  tx = optax.chain(private, optax.sgd(settings.learning_rate,
                                      momentum=settings.momentum))
  ledger = checkpoint.PrivacyLedger.create(
      mechanism, noise_multiplier, sampler.participation, settings.delta,
      key=key, target_epsilon=target, method=settings.method)
  return Run(tx, quickstart.private_step(tx), sampler, batches, mechanism,
             ledger)


def train(settings: Settings, checkpoint_path: str,
          release_path: Optional[str] = None, *,
          on_step: Optional[Callable[[int], None]] = None,
          stop_after: Optional[int] = None) -> Result:
  """Trains from the checkpoint at `checkpoint_path` (or from scratch).

  Example:
    >>> train(Settings(algorithm='dpftrl'), 'run/checkpoint', 'run/release')

  Args:
    settings: the configuration (the same on every restart).
    checkpoint_path: the checkpoint directory, written every
      `settings.checkpoint_every` steps and at the last step.
    release_path: the directory to export the final params and ledger
      to, or None.
    on_step: called with each completed step number (after any checkpoint).
    stop_after: return after this step, as an interrupted run would (no
      release is written).

  Returns:
    The `Result`.

  Raises:
    checkpoint.CheckpointMismatchError: if the checkpoint belongs to a
      differently configured run.
  """
  train_data, test_data = datasets.load_digits()
  run = build(settings, len(train_data['y']))
  params = quickstart.init_params()
  restored = checkpoint.restore_or_init(
      checkpoint_path, params=params, opt_state=run.tx.init(params),
      ledger=run.ledger, sampler=run.sampler)
  params, opt_state, ledger = (restored.params, restored.opt_state,
                               restored.ledger)
  if restored.step:
    logging.info('%s: resumed from step %d of %d', settings.algorithm,
                 restored.step, ledger.num_steps)
  else:
    logging.info('%s: starting at step 0 of %d (noise multiplier %.4f)',
                 settings.algorithm, ledger.num_steps,
                 ledger.noise_multiplier)
  step = restored.step
  for step, (indices, mask) in enumerate(run.batches(restored.step),
                                         start=restored.step + 1):
    batch, mask = jax.device_put(({'x': train_data['x'][indices],
                                   'y': train_data['y'][indices]}, mask))
    params, opt_state = run.step(params, opt_state, batch, mask, indices)
    if step % settings.checkpoint_every == 0 or step == ledger.num_steps:
      ledger = checkpoint.save(
          checkpoint_path, params=params, opt_state=opt_state, step=step,
          ledger=ledger, sampler_state=run.sampler)
      # The exact epsilon of a partial run costs an accounting call; the
      # ledger computes it on demand (ledger.epsilon_spent(mechanism)).
      logging.info('%s: checkpoint at step %d of %d', settings.algorithm,
                   step, ledger.num_steps)
    if on_step is not None:
      on_step(step)
    if step == stop_after:
      return Result(params, ledger, restored.step, step)
  _, correct = quickstart.evaluate(params, jax.device_put(train_data),
                                   jax.device_put(test_data))
  accuracy = int(correct) / len(test_data['y'])
  logging.info('%s: done, test accuracy %.4f, epsilon spent %.4f at delta %g',
               settings.algorithm, accuracy,
               ledger.epsilon_spent(run.mechanism), ledger.delta)
  if release_path is not None:
    checkpoint.export_release(release_path, params, ledger,
                              mechanism=run.mechanism,
                              metadata={'test_accuracy': accuracy})
  return Result(params, ledger, restored.step, step)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  start = time.perf_counter()
  train(Settings.from_flags(), flags.FLAGS.checkpoint, flags.FLAGS.release)
  logging.info('wall time %.1f s', time.perf_counter() - start)


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['checkpoint'])
  app.run(main)
