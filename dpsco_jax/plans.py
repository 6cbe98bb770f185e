"""Plans: one call from a privacy target to everything a private run needs.

A plan is built from ONE description of a run (algorithm, privacy target,
data size, batching, epochs, restarts) and derives from it, so they cannot
disagree:

* the calibrated private transformation, chained with your optimizer
  (private part first: the order cannot be wrong) and followed by the
  in-step check of the batches the accounting assumes
  (`batching.participation_guard`);
* the batch sampler, whose batches are the ones accounted for;
* the noise mechanism, the noise multiplier, the participation pattern and
  the `dp_accounting` event;
* the `ledger.PrivacyLedger` of the run, which the loop asks for the
  epsilon spent so far (`plan.epsilon_at(step)`) and checkpoints store.

    plan = plans.dpftrl(loss_fn, optimizer=optax.sgd(0.1, momentum=0.9),
                        epsilon=2.0, delta=1e-5, num_examples=n,
                        batch_size=100, epochs=10, l2_clip=1.0)
    opt_state = plan.init(params)
    for inputs in plan.batches_of(data):
      params, opt_state = plan.step(params, opt_state, inputs)  # jitted
    print(plan.epsilon)            # spent by the whole run, <= 2.0

Every family has a plan: `dpsgd` (Poisson, shuffled or fixed-order
batches), `dpftrl` (tree noise, restarts), `dpmemf` (matrix factorization,
paper 001 Algorithm 2), `accelerated_dp_srgd` and `unaccelerated_dp_srg`
(papers 000/001 Algorithm 1 and its ablation), `dp_srg_memf` (paper 001
Algorithm 3), `diff2_gd` and `dp_gd` (paper 003 across clients),
`user_level_dpsgd` (users as the privacy unit, paper 002's baseline),
`nonsmooth_single_pass` and `nonsmooth_multi_pass` (private O2NC, paper
004). The
lower-level pieces they compose stay public; a transformation built by
hand is checked against its accounting with `ledger.check_state`.

A plan is either calibrated (`epsilon=`: the smallest noise multiplier
that meets it) or given its noise (`noise_multiplier=`: the epsilon it
spends is computed); exactly one of the two.

How a plan is assembled: each plan function gathers its keywords into the
validated configs of `dpsco_jax.plan_config` (privacy target, sampling,
clipping, devices, noise key; each keyword documented there once),
describes its algorithm as a `Family` (the mechanism, built once; the
private transformation built given it; what follows it), and hands both to
an `accountants.Accountant` (calibration, epsilon, event, ledger) and to
`build`, the one place a `Plan` is made.
"""

import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import jax
import numpy as np
import optax

from dpsco_jax import accountants
from dpsco_jax import accounting
from dpsco_jax import adaptive_clipping as adaptive_lib
from dpsco_jax import batching
from dpsco_jax import blt
from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import data as data_lib
from dpsco_jax import estimators
from dpsco_jax import guards
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax import physical
from dpsco_jax import plan_config
from dpsco_jax import progress
from dpsco_jax import runs
from dpsco_jax import smoothing
from dpsco_jax import strategies
from dpsco_jax.algorithms import baselines
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms import diff2_accounting
from dpsco_jax.algorithms import mf
from dpsco_jax.algorithms import nonsmooth
from dpsco_jax.algorithms import srg
from dpsco_jax.algorithms import user_level

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
Sampler = plan_config.Sampler
Relation = neighboring.NeighboringRelation

SAMPLINGS = plan_config.SAMPLINGS


def _accounted(name: str, doc: str) -> property:
  """A `Plan` attribute its accountant answers."""
  return property(lambda self: getattr(self.accountant, name), doc=doc)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a private run needs, derived from one description.

  Attributes:
    algorithm: the family, e.g. 'dpftrl'.
    transformation: the whole update: the private estimator, the batch
      check and your optimizer, in that order. Call
      `update(None, opt_state, params, **inputs)` with `inputs` from
      `batches_of`.
    private_transformation: the calibrated private estimator alone (the
      lower-level piece; `transformation` is built from it).
    batches: the batch sampler whose batches are accounted for (None for
      the full-batch DIFF2 family, where each round uses all local data).
    mechanism: the noise mechanism the private transformation draws from.
    noise_multiplier: the calibrated (or given) noise multiplier; for
      DIFF2, its `Diff2NoiseMultipliers`.
    participation: how the sampler forms batches (None for DIFF2).
    event: the `dp_accounting` event of the whole run.
    ledger: the run's `PrivacyLedger` (None for DIFF2, accounted by
      `algorithms.diff2_accounting`: its two multipliers are not one
      mechanism's).
    accountant: the `accountants.Accountant` that calibrated the noise and
      answers the privacy attributes here (`noise_multiplier`,
      `participation`, `event`, `ledger`, `epsilon`, `target_epsilon`,
      `delta`, `method`, `num_steps`) and `epsilon_at`.
    epsilon: the epsilon the whole run spends (at most `target_epsilon`).
    target_epsilon: the epsilon asked for, or None when the noise was given.
    delta: the run's delta.
    method: the accounting method.
    num_steps: the steps (rounds) of the run.
    num_examples: the training set size.
    hyperparameters: the description's other values (clip, batch size,
      restarts...), for run records.
    physical_form: how the private estimator's statistic is evaluated over
      physical batches (`dpsco_jax.physical`), when the plan was built with
      `physical_batch_size`; None otherwise.
  """

  algorithm: str
  transformation: optax.GradientTransformationExtraArgs = dataclasses.field(
      repr=False)
  private_transformation: optax.GradientTransformationExtraArgs = (
      dataclasses.field(repr=False))
  # Not in the repr: a sampler's seed decides which examples are in which
  # batch (Poisson amplification needs it secret), and reprs end up in logs.
  batches: Optional[Sampler] = dataclasses.field(repr=False)
  mechanism: noise.NoiseMechanism = dataclasses.field(repr=False)
  accountant: accountants.Accountant
  num_examples: int
  hyperparameters: Mapping[str, Any]
  physical_form: Optional[physical.PhysicalForm] = dataclasses.field(
      default=None, repr=False)
  # The clipped statistics the private transformation computes: they record
  # the clipping path each step took (`describe()['clipping_path']`).
  _statistics: tuple[clipping.ClippedStatistic, ...] = dataclasses.field(
      default=(), repr=False)

  # What the accountant says of the run, read as before.
  noise_multiplier = _accounted(
      'noise_multiplier', 'The calibrated (or given) noise multiplier; for '
      'DIFF2, its `Diff2NoiseMultipliers`.')
  participation = _accounted(
      'participation', 'How the sampler forms batches (None for DIFF2).')
  event = _accounted('event', 'The `dp_accounting` event of the whole run.')
  ledger = _accounted(
      'ledger', "The run's `PrivacyLedger` (None for DIFF2).")
  epsilon = _accounted(
      'epsilon', 'The epsilon the whole run spends (at most '
      '`target_epsilon`).')
  target_epsilon = _accounted(
      'target_epsilon', 'The epsilon asked for, or None when the noise was '
      'given.')
  delta = _accounted('delta', "The run's delta.")
  method = _accounted('method', 'The accounting method.')
  num_steps = _accounted('num_steps', 'The steps (rounds) of the run.')

  # The repr's fields, as before the accountant held them. Not the
  # sampler (its seed decides the batches) nor the key.
  _REPR = ('algorithm', 'noise_multiplier', 'participation', 'epsilon',
           'target_epsilon', 'delta', 'method', 'num_steps', 'num_examples',
           'hyperparameters')

  def __repr__(self) -> str:
    return 'Plan(' + ', '.join(f'{name}={getattr(self, name)!r}'
                               for name in self._REPR) + ')'

  def init(self, params: PyTree) -> PyTree:
    """The optimizer state of step 0, checked against the accounting.

    Example:
      >>> opt_state = plan.init(params)

    Args:
      params: the initial params.

    Returns:
      `transformation.init(params)`.
    """
    opt_state = self.transformation.init(params)
    self.accountant.check_state(opt_state)
    return opt_state

  def epsilon_at(self, step: int) -> float:
    """The epsilon spent by the first `step` steps (what to log as you go).

    Example:
      >>> plan.epsilon_at(100)

    Args:
      step: in `[0, num_steps]`.

    Returns:
      epsilon; `epsilon` at `num_steps`.
    """
    return self.accountant.epsilon_at(step)

  def batches_of(self, data: PyTree, start_step: int = 0
                 ) -> Iterator[dict[str, Any]]:
    """The inputs of each step's `update`, from the sampler's batches.

    Example:
      >>> for inputs in plan.batches_of({'x': x, 'y': y}):
      ...   updates, state = plan.transformation.update(None, state, params,
      ...                                               **inputs)

    Args:
      data: a pytree of arrays whose leading axis indexes the
        `num_examples` training examples.
      start_step: the first step (to resume a run at step k).

    Returns:
      An iterator of dicts with `batch` (the examples, leading axis the
      batch), `example_ids` and, for Poisson batches, `batch_mask`.

    Raises:
      ValueError: if the data's leading axes are not `num_examples`, or the
        plan has no sampler (DIFF2 rounds use all local data).
      TypeError: for data a plan cannot train on, with the fix: the
        `data.Table` itself (give `table.train`), a DataFrame, strings
        (labels not encoded as numbers) or a leaf that is not an array.

    Warns:
      NonFiniteDataWarning: once per data object whose rows hold NaN or
        infinite values (`checks.warn_non_finite`: their contributions
        would be zeroed by the clipping, silently).
    """
    if self.batches is None:
      raise ValueError(f'{self.algorithm} uses all local data every round: '
                       'pass batch=local_data to update')
    _check_training_rows(data, self.num_examples)
    checks.warn_non_finite(data, 'plan.batches_of')
    take = lambda indices: jax.tree_util.tree_map(lambda x: x[indices], data)
    for drawn in self.batches.iterate(start_step):
      if isinstance(drawn, tuple):
        indices, mask = drawn
        yield {'batch': take(indices), 'batch_mask': mask,
               'example_ids': indices}
      else:
        yield {'batch': take(drawn), 'example_ids': drawn}

  def describe(self) -> dict[str, Any]:
    """The plan as JSON-compatible values (for a run record).

    `'clipping_path'` is the path the clipped sums of the steps took:
    'ghost' (ghost norms), 'vmap' (per-example gradients), 'ghost and vmap'
    (batches of different shapes took different paths), 'not traced yet'
    before the first step, or None for a plan whose private transformation
    computes no clipped statistic of the library. `clipping_method='auto'`
    decides per batch shape, so this, not `ghost_plan(...) is not None`
    (which says only that the ghost path applies), is what ran.

    Example:
      >>> params, opt_state = plan.step(params, opt_state, inputs)
      >>> plan.describe()['clipping_path']
      'ghost'
      >>> json.dumps(plan.describe())

    Returns:
      A dict; the noise key never appears in it.
    """
    return {
        'algorithm': self.algorithm,
        'mechanism': self.mechanism.name,
        'mechanism_identity': self.mechanism.identity,
        'noise_multiplier': self.accountant.noise_record(),
        'participation': (None if self.participation is None else {
            'kind': type(self.participation).__name__,
            **dataclasses.asdict(self.participation)}),
        'epsilon': self.epsilon, 'target_epsilon': self.target_epsilon,
        'delta': self.delta, 'method': self.method,
        'num_steps': self.num_steps, 'num_examples': self.num_examples,
        'hyperparameters': dict(self.hyperparameters),
        # The noise state's memory, in params-sized buffers.
        'noise_buffers': noise.noise_buffer_count(self.mechanism),
        'releases': [dataclasses.asdict(release)
                     for release in self.accountant.releases],
        'clipping_path': _clipping_path(self._statistics),
    }

  # ------------------------------------------------- the compiled step

  @functools.cached_property
  def _compiled_update(self) -> Callable[..., tuple[PyTree, PyTree]]:
    # Built on first use and kept: every call of `step` runs the same
    # compiled program (a frozen dataclass still has an instance __dict__,
    # which is where cached_property stores it).
    transformation = self.transformation

    def update(params, opt_state, batch_inputs):
      updates, opt_state = transformation.update(None, opt_state, params,
                                                 **batch_inputs)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(update)

  # How many steps late `step` may raise a refusal (see its docstring).
  REFUSAL_LAG = 2

  @functools.cached_property
  def _refusal_monitor(self) -> guards.RefusalMonitor:
    return guards.RefusalMonitor(max_lag=self.REFUSAL_LAG)

  def _plan_error(self, error: guards.PrivacyGuardError
                  ) -> guards.PrivacyGuardError:
    """`error` with the plan keyword that fixes it, for a plan's user."""
    advice = {
        'capacity': (
            f'This plan is accounted for {self.num_steps} steps: to train '
            'longer, build the plan with more epochs= (its noise is then '
            'calibrated, and its epsilon accounted, for the longer run), '
            'and start a fresh run from its init.'),
        'batch': (
            'Feed the step the items of plan.batches_of(data), in order, '
            'once each: the plan accounts for the batches its own sampler '
            'forms.'),
        'mechanism': (
            'Use the optimizer state of this plan\'s init (or of a '
            'checkpoint of this plan\'s run).'),
    }.get(error.kind)
    if advice is None:
      return error
    return guards.PrivacyGuardError(
        f'{error} {advice}', check=error.check, step=error.step,
        kind=error.kind)

  def check_refusals(self, opt_state: PyTree) -> None:
    """Raises the refusal recorded in `opt_state`, if any (waits for it).

    What `finish`, the ledger's reads and checkpoint saves do; call it
    wherever your loop wants to know for sure.

    Example:
      >>> plan.check_refusals(opt_state)

    Args:
      opt_state: the optimizer state of a run of this plan.

    Raises:
      PrivacyGuardError: a step of the run was refused; the message names
        the check, the step, and the plan keyword that fixes it.
    """
    try:
      guards.raise_if_refused(opt_state)
    except guards.PrivacyGuardError as error:
      raise self._plan_error(error) from None

  def finish(self, opt_state: PyTree) -> None:
    """The end of a run: waits for every step and raises any refusal.

    `step` raises a refusal up to `REFUSAL_LAG` steps late; call `finish`
    after the last step so that none goes unreported.

    Example:
      >>> for inputs in plan.batches_of(data):
      ...   params, opt_state = plan.step(params, opt_state, inputs)
      >>> plan.finish(opt_state)

    Args:
      opt_state: the run's final optimizer state.

    Raises:
      PrivacyGuardError: a step of the run was refused.
    """
    try:
      self._refusal_monitor.flush()
    except guards.PrivacyGuardError as error:
      raise self._plan_error(error) from None
    self.check_refusals(opt_state)

  def step(self, params: PyTree, opt_state: PyTree,
           batch_inputs: Mapping[str, Any], *, block: bool = False
           ) -> tuple[PyTree, PyTree]:
    """One compiled training step: `(params, opt_state)` after `inputs`.

    Runs `transformation.update` and `optax.apply_updates` as ONE program,
    compiled at the first call and reused after. The program makes no host
    round trip: its checks (a step past `num_steps`, a batch the plan's
    accounting does not describe, a state of another mechanism) poison the
    outputs with NaN on the device and record the refusal in `opt_state`
    (`dpsco_jax.guards`); the record is sticky, so every later step is
    poisoned too and nothing after a refusal is released.

    The call does not wait for the device (JAX's asynchronous dispatch
    keeps the device busy while the host forms the next batch). It reads
    the records of earlier steps once they are ready, and waits for one
    only when it is `REFUSAL_LAG` (2) steps old: a refused step raises
    `PrivacyGuardError` from this call or from one of the next
    `REFUSAL_LAG` calls at the latest, and `finish(opt_state)` at the end
    of the run raises any refusal left. `block=True` waits for this step
    and raises its refusal at once (at the cost of the overlap).

    A plan built with `physical_batch_size=` runs each logical batch as
    fixed-size physical batches (`dpsco_jax.physical`: each size compiled
    once, the clipped statistic summed on the device, at most one
    microbatch of padding), then the noise, the batch checks (on the whole
    logical batch) and the optimizer once: the same update up to float
    summation order, with the same accounting, at the cost of the realized
    batch, and for logical batches larger than memory.

    The step runs on one device, or on arrays already sharded over several
    under `jit`; a plan built with `axis_name=` runs under `jax.pmap` or
    `jax.shard_map`, in your own step (check its records with
    `guards.raise_if_refused`). A plan built with both `axis_name=` and
    `physical_batch_size=` runs here, under `jax.shard_map` over a mesh of
    all devices on that axis: each device evaluates its shard of every
    physical batch, and the clipped statistic is summed over the devices
    and noised once per logical batch (for another mesh,
    `physical.LogicalStep(plan.transformation, plan.physical_form,
    mesh=mesh)`).

    Example:
      >>> opt_state = plan.init(params)
      >>> for inputs in plan.batches_of(data):
      ...   params, opt_state = plan.step(params, opt_state, inputs)
      >>> plan.finish(opt_state)

    Args:
      params: the current params.
      opt_state: the current optimizer state (from `init`, then from the
        previous step).
      batch_inputs: one item of `batches_of(data)` (for DIFF2 plans, whose
        rounds use all local data: `{'batch': ..., 'batch_mask': ...}`).
      block: wait for this step and raise its refusal at once.

    Returns:
      `(params, opt_state)` after the step.

    Raises:
      PrivacyGuardError: this step (with `block=True`) or an earlier one was
        refused; the message names the check, the step, and the plan keyword
        that fixes it.
      TypeError: `batch_inputs` is not a mapping of `update`'s inputs.
    """
    if not isinstance(batch_inputs, Mapping):
      raise TypeError('batch_inputs must be a mapping of update\'s inputs '
                      '(an item of plan.batches_of(data)), got '
                      f'{type(batch_inputs).__name__}')
    run = (self._compiled_update if self.physical_form is None else
           self._logical_step)
    try:
      if self.physical_form is not None or getattr(
          self._compiled_update, '_cache_size', lambda: 0)():
        outputs = run(params, opt_state, dict(batch_inputs))
      else:
        # The first call compiles (seconds to minutes for a big model): say
        # so on stderr if it takes long.
        with progress.task(
            f'dpsco_jax: compiling the {self.algorithm} step'):
          outputs = run(params, opt_state, dict(batch_inputs))
      if block:
        self._refusal_monitor.flush()
        guards.raise_if_refused(outputs[1])
      else:
        self._refusal_monitor.watch(outputs[1])
    except guards.PrivacyGuardError as error:
      raise self._plan_error(error) from None
    return outputs

  def run(self, params: PyTree, data: PyTree, **options: Any) -> Any:
    """The whole run as ONE compiled program, guards on (`runs.whole_run`).

    Example:
      >>> result = plan.run(params, {'x': x, 'y': y})
      >>> result.params, result.opt_state

    Args:
      params: the initial params.
      data: the training set (leading axis `num_examples`).
      **options: `runs.whole_run`'s keywords (`seed`, `key`, `num_runs`,
        `metric_fn`).

    Returns:
      A `runs.RunResult`.

    Raises:
      PrivacyGuardError: a step was refused.
    """
    return runs.whole_run(self, params, data, **options)

  @functools.cached_property
  def _logical_step(self) -> physical.LogicalStep:
    if self.physical_form is None:
      raise ValueError(
          f'this {self.algorithm} plan was built without physical_batch_size='
          ': build it with one to run logical batches as physical batches')
    return physical.LogicalStep(self.transformation, self.physical_form)


# ---------------------------------------------------------------- shared


def _check_training_rows(data: PyTree, num_examples: int) -> None:
  """Refuses data `batches_of` cannot batch, naming the fix.

  Raises:
    TypeError: for a `data.Table` (its `train` is meant), a DataFrame, a
      leaf of strings or objects, or a leaf that is not an array.
    ValueError: if the leaves' leading axes are not `num_examples`.
  """
  if isinstance(data, data_lib.Table):
    raise TypeError(
        'batches_of takes the training rows, not the Table load_table '
        'returns: pass table.train (its {\'x\', \'y\'} arrays), e.g. '
        '`for inputs in plan.batches_of(table.train):`, and build the plan '
        'with num_examples=table.num_examples')
  if hasattr(data, 'iloc') and hasattr(data, 'columns'):
    raise TypeError(
        'batches_of takes a dict (pytree) of arrays whose leading axis indexes '
        'the examples, not a DataFrame: use dpsco_jax.data.load_table(df, '
        "target=..., features=[...]) and pass table.train, or {'x': "
        "df[features].to_numpy(np.float32), 'y': df[target].to_numpy()}")
  leaves = jax.tree_util.tree_leaves_with_path(data)
  if not leaves:
    raise ValueError('batches_of got no arrays: pass a dict (pytree) of '
                     'arrays whose leading axis indexes the examples')
  sizes = {}
  for path, leaf in leaves:
    where = 'data' + jax.tree_util.keystr(path)
    dtype = getattr(leaf, 'dtype', None)
    if dtype is None:
      dtype = np.asarray(leaf).dtype
    # Extended dtypes (typed keys) have no kind: they are not strings.
    if getattr(dtype, 'kind', '') in ('U', 'S', 'O'):
      raise TypeError(
          f'{where} holds {dtype} values (strings or objects, '
          'e.g. class names): a plan trains on numbers. Encode labels as '
          'class indices, e.g. `classes, y = np.unique(labels, '
          'return_inverse=True)`, or load the table with '
          'dpsco_jax.data.load_table, which encodes them (table.classes[y] '
          'is the name); leave identifiers and free text out of the data')
    if not np.ndim(leaf):
      raise TypeError(
          f'{where} is a {type(leaf).__name__}, not an array with one row '
          f'per example (num_examples = {num_examples}): pass only the '
          'arrays to batch')
    sizes[where] = np.shape(leaf)[0]
  if set(sizes.values()) != {num_examples}:
    raise ValueError(
        'the data\'s leading axes are ' + ', '.join(
            f'{size} ({where})' for where, size in sizes.items()) +
        f'; the plan is for num_examples = {num_examples} (privacy is '
        'accounted for that data set size): every array needs one row per '
        'training example')


def _clipping_path(statistics: Sequence[clipping.ClippedStatistic]
                   ) -> Optional[str]:
  """The paths the statistics' calls took, for `Plan.describe`."""
  if not statistics:
    return None
  paths = set().union(*(stat.paths_taken for stat in statistics))
  return ' and '.join(sorted(paths)) if paths else 'not traced yet'


def _check_relation(algorithm: str, relation: Relation,
                    participation: accounting.Participation) -> None:
  """Refuses add/remove neighbours for a fixed or shuffled batch order.

  The accounting of such an order bounds what ONE example changes at the
  steps it takes part in. Adding or removing an example moves every later
  one to another batch (and changes the order's permutation), which it does
  not describe; zero-out (the example replaced by one with zero gradient)
  and replace-one keep the batches.
  """
  if (relation is Relation.ADD_OR_REMOVE and
      not isinstance(participation, accounting.PoissonSampling)):
    raise ValueError(
        f'{algorithm}: a {type(participation).__name__} batch order is '
        'accounted for zero-out or replace-one neighbours, not add/remove '
        '(adding or removing an example would move every later example to '
        "another batch); use neighboring_relation='zero_out' (the same noise "
        "and epsilon) or Poisson sampling")


@dataclasses.dataclass(frozen=True)
class Family:
  """One algorithm's part of a plan; the builder adds the rest.

  The mechanism is built once, by the family; the accountant calibrates
  its noise and the private transformation is built GIVEN it (never
  rebuilding it), so what runs is what was accounted.

  Example:
    >>> family = Family('dpsgd', mechanism, private=lambda z, divisor: ...,
    ...                 output=(optax.sgd(0.1),))

  Attributes:
    algorithm: the plan's name, e.g. 'dpftrl'.
    mechanism: the noise mechanism the private transformation draws from.
    private: `private(noise_multiplier, normalize_by)`, the calibrated
      private transformation (`normalize_by`: the sampler's public batch
      size, None without a sampler).
    output: what follows the private transformation and the batch check
      (your optimizer, or the algorithm's outer loop).
    before: what precedes the private transformation (DIFF2's output
      selector).
    hyperparameters: the family's other values, for run records.
    physical_form: the private statistic over physical batches, or None.
  """

  algorithm: str
  mechanism: noise.NoiseMechanism
  private: Callable[[Any, Optional[float]],
                    optax.GradientTransformationExtraArgs]
  output: Sequence[Optional[optax.GradientTransformation]] = ()
  before: Sequence[optax.GradientTransformation] = ()
  hyperparameters: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  physical_form: Optional[physical.PhysicalForm] = None


def build(family: Family, accountant: accountants.Accountant, *,
          sampler: Optional[Sampler], num_examples: int,
          devices: plan_config.Devices) -> Plan:
  """The plan of `family`, accounted by `accountant`: the one place a `Plan`
  is made.

  The transformation is `chain(*before, private, batch check, *output)`;
  the batch check (`batching.participation_guard`) is there whenever the
  plan has a sampler.

  Example:
    >>> plan = build(family, accountant, sampler=sampler, num_examples=n,
    ...              devices=plan_config.Devices())

  Args:
    family: the algorithm's part.
    accountant: the calibrated accounting of the run.
    sampler: the batch sampler, or None (full-batch rounds).
    num_examples: the training set size (users for a user-level plan).
    devices: the device axis.

  Returns:
    The `Plan`.

  Raises:
    ValueError: for an output (optimizer) that is not an optax
      transformation.
  """
  accountant.target.warn_for(
      num_examples, family.hyperparameters.get('privacy_unit', 'example'))
  with clipping.recording_statistics() as statistics:
    private = family.private(
        accountant.noise_multiplier,
        None if sampler is None else plan_config.normalize_by(sampler))
  guard = [] if sampler is None else [batching.participation_guard(
      accountant.participation, num_examples=num_examples,
      batch_size=getattr(sampler, 'batch_size', None),
      pad_to_multiple=getattr(sampler, 'pad_to_multiple', None),
      axis_name=devices.axis_name)]
  output = [part for part in family.output if part is not None]
  for part in output:
    if not hasattr(part, 'update'):
      raise ValueError(f'optimizer must be an optax GradientTransformation, '
                       f'got {type(part).__name__}')
  return Plan(
      algorithm=family.algorithm,
      transformation=optax.chain(*family.before, private, *guard, *output),
      private_transformation=private, batches=sampler,
      mechanism=family.mechanism, accountant=accountant,
      num_examples=num_examples, hyperparameters=family.hyperparameters,
      physical_form=family.physical_form, _statistics=tuple(statistics))


def _batched_plan(family: Family, sampler: Sampler,
                  target: plan_config.PrivacyTarget, relation: Relation,
                  clip: plan_config.Clipping,
                  devices: plan_config.Devices) -> Plan:
  """The plan of a family whose batches come from `sampler`, accounted as
  one Gaussian mechanism under its participation (calibrated to what the
  target's `releases` leave of it; the ledger spends them too)."""
  relation = Relation(relation)
  _check_relation(family.algorithm, relation, sampler.participation)
  accountant = accountants.GaussianAccountant.create(
      family.mechanism, sampler.participation, target, relation)
  family = dataclasses.replace(family, hyperparameters={
      'sampling': type(sampler).__name__,
      'batch_size': plan_config.normalize_by(sampler),
      'l2_clip': clip.l2_clip, **family.hyperparameters,
      'physical_batch_size': clip.physical_batch_size,
      **clip.hyperparameters})
  return build(family, accountant, sampler=sampler,
               num_examples=sampler.num_examples, devices=devices)


# ----------------------------------------------------------------- plans

# The configs every plan function gathers from its keywords.
_SHARED = (plan_config.PrivacyTarget, plan_config.Sampling,
           plan_config.Clipping, plan_config.Devices, plan_config.NoiseKey)


def _noisy_gradient_family(
    algorithm: str, loss_fn: LossFn, mechanism: noise.NoiseMechanism, *,
    clip: plan_config.Clipping, noise_key: plan_config.NoiseKey,
    relation: Relation, devices: plan_config.Devices,
    optimizer: optax.GradientTransformation,
    hyperparameters: Mapping[str, Any]) -> Family:
  """DP-SGD and DP-FTRL: `estimators.noisy_gradient` with `mechanism`."""
  return Family(
      algorithm, mechanism,
      private=lambda z, divisor: estimators.noisy_gradient(
          loss_fn, l2_clip=clip.l2_clip, noise_multiplier=z,
          mechanism=mechanism, key=noise_key.key,
          neighboring_relation=relation, normalize_by=divisor,
          axis_name=devices.axis_name, **clip.estimator_keywords),
      output=(optimizer,), hyperparameters=hyperparameters,
      physical_form=clip.gradient_form(loss_fn, devices))


@keywords.checked
def dpsgd(
    loss_fn: LossFn,
    *,
    optimizer: optax.GradientTransformation,
    num_examples: int,
    batch_size: int,
    epochs: int,
    l2_clip: float,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    sampling: str = 'poisson',
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Optional[Relation] = None,
    releases: Sequence[accounting.GaussianRelease] = (),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
    automatic_clipping: Optional[float] = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> Plan:
  """A DP-SGD run (`dpsco_jax.dpsgd`), calibrated to (epsilon, delta).

  With `sampling='poisson'` (default) every example joins each of
  `round(epochs * num_examples / batch_size)` batches with probability
  `batch_size / num_examples` (amplified accounting, noisy sum divided by
  the expected batch size). 'shuffled' reshuffles every epoch and 'fixed'
  keeps one public order (no amplification claimed for either), each
  `epochs * (num_examples // batch_size)` steps of full batches (the
  `num_examples % batch_size` left over are not used in an epoch).

  The keywords every plan shares are documented once, in
  `dpsco_jax.plan_config`: the privacy target (`PrivacyTarget`), the
  batches (`Sampling`), the clipping (`Clipping`), the device axis
  (`Devices`) and the noise key (`NoiseKey`).

  Example:
    >>> plan = plans.dpsgd(loss_fn, optimizer=optax.sgd(0.1),
    ...                    num_examples=60_000, batch_size=256, epochs=3,
    ...                    l2_clip=1.0, epsilon=2.0, delta=1e-5)
    >>> opt_state = plan.init(params)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    optimizer: the optax optimizer the private gradient feeds.
    num_examples, batch_size, epochs, sampling, seed: `Sampling`.
    l2_clip, microbatch_size, clipping_method, physical_batch_size,
      automatic_clipping, adaptive_clipping: `Clipping`.
    delta, epsilon, noise_multiplier, method, releases: `PrivacyTarget`.
    neighboring_relation: `PrivacyTarget`; default add/remove under Poisson
      sampling, zero-out for 'shuffled' and 'fixed' (what their accounting
      assumes; add/remove is refused there).
    key: `NoiseKey`.
    axis_name: `Devices`.

  Returns:
    A `Plan`.
  """
  target, batches, clip, devices, noise_key = plan_config.from_keywords(
      locals(), *_SHARED)
  sampler = batches.sampler()
  relation = target.relation(Relation.ADD_OR_REMOVE if sampling == 'poisson'
                             else Relation.ZERO_OUT)
  family = _noisy_gradient_family(
      'dpsgd', loss_fn, baselines.dpsgd_mechanism(sampler.num_steps),
      clip=clip, noise_key=noise_key, relation=relation, devices=devices,
      optimizer=optimizer, hyperparameters={'epochs': epochs})
  return _batched_plan(family, sampler, target, relation, clip, devices)


def _restart_every(restart: Union[None, str, int], steps_per_epoch: int
                   ) -> Optional[int]:
  if restart is None:
    return None
  if restart == 'epoch':
    return steps_per_epoch
  return checks.positive_int(restart, 'restart')


@keywords.checked
def dpftrl(
    loss_fn: LossFn,
    *,
    optimizer: optax.GradientTransformation,
    num_examples: int,
    batch_size: int,
    epochs: int,
    l2_clip: float,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    restart: Union[None, str, int] = 'epoch',
    honaker: bool = False,
    sampling: str = 'fixed',
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ZERO_OUT,
    releases: Sequence[accounting.GaussianRelease] = (),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
    automatic_clipping: Optional[float] = None,
) -> Plan:
  """A DP-FTRL run (`dpsco_jax.dpftrl`, tree noise), calibrated.

  Batches in one public order every epoch (`sampling='fixed'`, accounted
  as `FixedOrder`, checked in every step) or reshuffled each epoch
  ('shuffled': exact with a restart every epoch, an upper bound
  otherwise). A fresh tree starts every epoch by default (`restart=
  'epoch'`), every `restart` steps for an int, never for None. Shared
  keywords: `dpsco_jax.plan_config` (as for `dpsgd`).

  Example:
    >>> plan = plans.dpftrl(loss_fn, optimizer=optax.sgd(0.1, momentum=0.9),
    ...                     num_examples=n, batch_size=100, epochs=10,
    ...                     l2_clip=1.0, epsilon=2.0, delta=1e-5)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    optimizer: the optax optimizer (DP-FTRL is `optax.sgd`, with momentum
      its momentum variant).
    restart: 'epoch', an int number of steps, or None.
    honaker: Honaker's variance-reduced tree estimates.
    sampling: 'fixed' or 'shuffled' (`Sampling`, with num_examples,
      batch_size, epochs, seed).
    noise_multiplier: the tree-node noise to use (or give `epsilon`; with
      delta, method, releases: `PrivacyTarget`).
    neighboring_relation: default zero-out, what a fixed or shuffled
      order's accounting assumes (same sensitivity as add/remove, which is
      refused here).
    l2_clip, microbatch_size, clipping_method, physical_batch_size,
      automatic_clipping: `Clipping` (adaptive clipping needs noise
      independent across steps: `dpsgd`).
    key, axis_name: `NoiseKey`, `Devices`.

  Returns:
    A `Plan`.
  """
  if sampling not in ('fixed', 'shuffled'):
    raise ValueError("DP-FTRL's tree noise is not amplified by sampling: "
                     f"sampling must be 'fixed' or 'shuffled', got {sampling!r}")
  target, batches, clip, devices, noise_key = plan_config.from_keywords(
      locals(), *_SHARED)
  sampler = batches.sampler()
  restart_every = _restart_every(restart, sampler.steps_per_epoch)
  family = _noisy_gradient_family(
      'dpftrl', loss_fn,
      baselines.dpftrl_mechanism(sampler.num_steps, restart_every, honaker),
      clip=clip, noise_key=noise_key, relation=neighboring_relation,
      devices=devices, optimizer=optimizer,
      hyperparameters={'epochs': epochs, 'restart_every': restart_every,
                       'honaker': honaker})
  return _batched_plan(family, sampler, target, neighboring_relation, clip,
                       devices)


# The default cap on the noise state of an MF plan, in params-sized buffers.
MAX_NOISE_BUFFERS = 64


MF_SAMPLINGS = ('fixed', 'cyclic_poisson')

# Closed-form strategies for the plan's workload (`strategies`).
CLOSED_FORMS = ('banded_sqrt', 'banded_inverse_sqrt')
MF_STRATEGIES = ('banded', 'blt') + CLOSED_FORMS


def _cyclic_poisson_sampler(batches: plan_config.Sampling,
                            bands: Optional[int]
                            ) -> batching.CyclicPoissonBatches:
  """Cyclic Poisson batches over `bands` partitions, `epochs` expected
  passes: q = B b / n, T = round(k n / B)."""
  num_examples, batch_size = batches.num_examples, batches.batch_size
  if bands is None:
    raise ValueError("sampling='cyclic_poisson' needs bands=b: the examples "
                     'are split into b partitions and the banded strategy '
                     'keeps at most b bands (Amplified BandMF)')
  bands = checks.positive_int(bands, 'bands')
  q = batch_size * bands / num_examples
  if q > 1.0:
    raise ValueError(
        f'batch_size {batch_size} x bands {bands} exceeds num_examples '
        f'{num_examples}: a partition of n / b examples cannot give batches '
        'of that expected size; lower bands or batch_size')
  steps = max(1, round(batches.epochs * num_examples / batch_size))
  return batching.CyclicPoissonBatches(
      num_examples, q, steps, bands, seed=plan_config.fresh_seed(batches.seed))


def _matrix_factorization(batches: plan_config.Sampling,
                          strategy: Union[np.ndarray, str, None],
                          momentum: float, decay: float, bands: Optional[int],
                          n_buffers: int, max_noise_buffers: int
                          ) -> tuple[Sampler, noise.NoiseMechanism]:
  """The sampler and mechanism of an MF plan.

  Returns:
    `(sampler, mechanism)`. The mechanism's strategy: for `strategy=None`
    or 'banded', a matrix optimized for `workload(T, 'true', momentum,
    decay)` (under `FixedOrder(k, b)`, or with unit column norms and
    `bands` bands for cyclic Poisson sampling); for 'banded_sqrt' the
    closed-form `strategies.banded_square_root` of that workload; for
    'banded_inverse_sqrt', `strategies.banded_inverse_square_root` (noise
    streamed from its banded inverse); for 'blt', a BLT strategy optimized
    for the same workload under `FixedOrder(k, b)` (`blt.optimize`); a
    given matrix is used as is.

  Raises:
    ValueError: if the noise state would keep more than `max_noise_buffers`
      params-sized buffers (checked before a dense strategy is optimized).
  """
  sampling = batches.sampling
  if sampling not in MF_SAMPLINGS:
    raise ValueError(f'sampling must be one of {MF_SAMPLINGS}, got '
                     f'{sampling!r}')
  max_noise_buffers = checks.positive_int(max_noise_buffers,
                                          'max_noise_buffers')
  if isinstance(strategy, str) and strategy not in MF_STRATEGIES:
    raise ValueError("strategy must be a matrix, None (optimized here) or "
                     f"one of {MF_STRATEGIES}, got {strategy!r}")
  kind = strategy if isinstance(strategy, str) else None
  if kind in ('banded',) + CLOSED_FORMS and bands is None:
    raise ValueError(f"strategy={kind!r} needs bands=")
  if sampling == 'cyclic_poisson':
    if kind == 'banded_inverse_sqrt':
      raise ValueError(
          "strategy='banded_inverse_sqrt' cannot be amplified by "
          "sampling='cyclic_poisson': its C^-1 is banded but C itself is "
          'dense, so one step\'s contribution reaches every later row of '
          'C x + z and the steps of one partition are not independent '
          "Poisson-sampled Gaussians. Use strategy='banded_sqrt' or "
          "'banded' (C with at most bands diagonals), or sampling='fixed'")
    if strategy is None or kind == 'blt':
      raise ValueError(
          "sampling='cyclic_poisson' is accounted for a banded strategy "
          "(Amplified BandMF): use strategy='banded' or 'banded_sqrt' with "
          'bands=b, or a given matrix of at most b bands')
    sampler = _cyclic_poisson_sampler(batches, bands)
    steps = sampler.num_steps
    if kind == 'banded':
      _check_noise_buffers(None, max_noise_buffers, steps,
                           planned=min(bands, steps) - 1)
      # One participation per column in the amplified accounting: unit
      # column norms (k = 1), at most b bands.
      strategy = strategies.optimize_strategy(
          strategies.workload(steps, 'true', momentum=momentum, decay=decay),
          1, bands=bands)
    elif kind == 'banded_sqrt':
      # The accountant divides by the largest column norm, so C needs no
      # normalization.
      strategy = strategies.banded_square_root(steps, bands,
                                               momentum=momentum, decay=decay)
    mechanism = mf.epoch_mechanism(np.asarray(strategy), 'buffer', steps)
    if mechanism.num_steps != steps:
      raise ValueError(f'the strategy covers {mechanism.num_steps} steps; '
                       f'the run has {steps}')
    _check_noise_buffers(mechanism, max_noise_buffers, steps)
    return sampler, mechanism
  if kind == 'banded':
    strategy = None
  sampler = batches.sampler()
  epochs = batches.epochs
  steps, b = sampler.num_steps, sampler.steps_per_epoch
  if kind == 'banded_sqrt':
    # The sensitivity under FixedOrder(k, b) is computed from this C by the
    # accountant (exact: its entries are positive).
    strategy = strategies.banded_square_root(steps, bands, momentum=momentum,
                                             decay=decay)
  elif kind == 'banded_inverse_sqrt':
    c, c_inverse = strategies.banded_inverse_square_root(
        steps, bands, momentum=momentum, decay=decay, with_inverse=True)
    # C is dense; its banded inverse streams the noise from the last
    # bands - 1 draws.
    mechanism = mf.epoch_mechanism(
        None, 'buffer', b, noise.matrix_factorization(c, inverse=c_inverse))
    _check_noise_buffers(mechanism, max_noise_buffers, steps)
    return sampler, mechanism
  if isinstance(strategy, str):
    if bands is not None:
      raise ValueError("bands applies to an optimized matrix strategy, not "
                       "strategy='blt' (set n_buffers)")
    params = blt.optimize(
        steps, n_buffers, max_participations=epochs, min_separation=b,
        workload_column=blt.toeplitz_workload_column(
            steps, momentum=momentum, decay=decay), cache_dir=True)
    mechanism = blt.mechanism(params, steps)
    _check_noise_buffers(mechanism, max_noise_buffers, steps)
    return sampler, mechanism
  if strategy is None:
    _check_noise_buffers(None, max_noise_buffers, steps,
                         planned=min(bands or steps, steps) - 1)
    strategy = strategies.optimize_strategy(
        strategies.workload(steps, 'true', momentum=momentum, decay=decay),
        epochs, bands=bands)
  strategy = np.asarray(strategy)
  mechanism = mf.epoch_mechanism(strategy, 'buffer', b)
  if mechanism.num_steps != steps:
    raise ValueError(f'the strategy covers {mechanism.num_steps} steps; the '
                     f'run has {steps} ({epochs} epochs of {b})')
  _check_noise_buffers(mechanism, max_noise_buffers, steps)
  return sampler, mechanism


def _check_noise_buffers(mechanism: Optional[noise.NoiseMechanism],
                         limit: int, steps: int,
                         planned: Optional[int] = None) -> None:
  """Refuses a noise state of more than `limit` params-sized buffers."""
  count = planned if mechanism is None else noise.noise_buffer_count(
      mechanism)
  if count > limit:
    raise ValueError(
        f'the matrix-factorization noise of this plan keeps {count} '
        f'params-sized buffers ({count} x the params\' memory, in float32), '
        f'over max_noise_buffers={limit}. Use strategy=\'blt\' (n_buffers '
        f'buffers, near the dense error), a banded strategy (bands=b keeps '
        f'b - 1), or raise max_noise_buffers to at least {count} when the '
        f'memory is there ({steps} steps).')


def _mf_hyperparameters(strategy: Union[np.ndarray, str, None],
                        momentum: float, bands: Optional[int],
                        n_buffers: int, max_noise_buffers: int
                        ) -> dict[str, Any]:
  """The strategy choices of an MF plan, for run records."""
  return {'strategy_given': not (strategy is None or
                                 isinstance(strategy, str)),
          'strategy': strategy if isinstance(strategy, str) else None,
          'momentum': momentum, 'bands': bands,
          'n_buffers': (n_buffers if isinstance(strategy, str)
                        and strategy == 'blt' else None),
          'max_noise_buffers': max_noise_buffers}


@keywords.checked
def dpmemf(
    loss_fn: LossFn,
    *,
    optimizer: optax.GradientTransformation,
    num_examples: int,
    batch_size: int,
    epochs: int,
    l2_clip: float,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    strategy: Union[np.ndarray, str, None] = None,
    momentum: float = 0.0,
    bands: Optional[int] = None,
    n_buffers: int = 4,
    max_noise_buffers: int = MAX_NOISE_BUFFERS,
    sampling: str = 'fixed',
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ZERO_OUT,
    releases: Sequence[accounting.GaussianRelease] = (),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
    automatic_clipping: Optional[float] = None,
) -> Plan:
  """A DP-MEMF run (paper 001 Algorithm 2), calibrated.

  Batches in one public order every epoch (`FixedOrder(k, b)`, checked in
  every step). Without `strategy`, one is optimized for the workload of SGD
  with `momentum` (`strategies.workload(k b, 'true', momentum=...)`; set it
  to your optimizer's; with Adam, its b1 or 0: docs/choosing.md says which
  and why) under (k, b)-participation, `bands` making it banded. Shared
  keywords: `dpsco_jax.plan_config` (as for `dpsgd`).

  Example:
    >>> plan = plans.dpmemf(loss_fn, optimizer=optax.sgd(0.5, momentum=0.9),
    ...                     num_examples=n, batch_size=500, epochs=6,
    ...                     l2_clip=1.0, epsilon=4.0, delta=1e-5,
    ...                     momentum=0.9)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    optimizer: the optax optimizer.
    strategy: the lower-triangular `[k b, k b]` strategy; None (optimized
      here, dense or with `bands`); 'banded' (optimized here with `bands`
      bands; with 'banded_sqrt' and a given matrix, the choices for
      `sampling='cyclic_poisson'`); 'banded_sqrt' or 'banded_inverse_sqrt': the closed
      forms `strategies.banded_square_root` / `banded_inverse_square_root`
      of the same workload with `bands` bands (of C, resp. of C^-1; no
      optimization, `bands - 1` noise buffers; 'banded_sqrt' also with
      `sampling='cyclic_poisson'`); or 'blt': a buffered-linear-Toeplitz
      strategy optimized here for the same workload under (k, b)
      participation (`dpsco_jax.blt`), whose noise keeps `n_buffers`
      params-sized buffers instead of `k b - 1`.
    momentum: the workload's momentum when the strategy is optimized or
      built here: your SGD's momentum; with Adam, b1 (its first moment, if
      its second moment changes slowly) or 0 (the hedge; docs/choosing.md).
    bands: bands of the optimized strategy (None: dense), or of the
      closed form.
    n_buffers: buffers of the BLT strategy (2 to 5 come within a few
      percent of the dense error).
    max_noise_buffers: the most params-sized noise buffers the plan may
      keep (`Plan.describe()['noise_buffers']`); a dense strategy keeps
      `k b - 1` and is refused above it. Raise it when the memory is there.
    sampling: 'fixed' (the same batches every epoch, `FixedOrder(k, b)`) or
      'cyclic_poisson' (Amplified BandMF: `bands` partitions, step t draws
      partition t mod b with probability B b / n for round(k n / B) steps,
      accounted with amplification, `accounting.CyclicPoissonSampling`;
      with strategy='banded', 'banded_sqrt' or a matrix of at most `bands`
      bands); with num_examples, batch_size, epochs (k), seed: `Sampling`.
    neighboring_relation: default ZERO_OUT, the papers' (000/001): a fixed
      batch order's accounting assumes it (same sensitivity as add/remove);
      with delta, epsilon, noise_multiplier, method, releases:
      `PrivacyTarget`.
    l2_clip, microbatch_size, clipping_method, physical_batch_size,
      automatic_clipping: `Clipping` (adaptive clipping needs noise
      independent across steps: `dpsgd`).
    key, axis_name: `NoiseKey`, `Devices`.

  Returns:
    A `Plan`.
  """
  target, batches, clip, devices, noise_key = plan_config.from_keywords(
      locals(), *_SHARED)
  sampler, mechanism = _matrix_factorization(
      batches, strategy, momentum, 0.0, bands, n_buffers, max_noise_buffers)
  b = getattr(sampler, 'steps_per_epoch', sampler.num_steps)
  family = Family(
      'dpmemf', mechanism,
      private=lambda z, divisor: mf.dpmemf(
          loss_fn, l2_clip=l2_clip, noise_multiplier=z, mechanism=mechanism,
          steps_per_epoch=b, key=noise_key.key, check_order=False,
          neighboring_relation=neighboring_relation, normalize_by=divisor,
          axis_name=devices.axis_name, **clip.statistic_keywords),
      output=(optimizer,),
      hyperparameters={'epochs': epochs, **_mf_hyperparameters(
          strategy, momentum, bands, n_buffers, max_noise_buffers)},
      physical_form=clip.gradient_form(loss_fn, devices))
  return _batched_plan(family, sampler, target, neighboring_relation, clip,
                       devices)


def _single_pass(algorithm: str, loss_fn: LossFn, keywords: Mapping[str, Any],
                 *, beta: float, radius: Optional[float], gradient: str
                 ) -> Plan:
  """The plans of Algorithm 1 and its unaccelerated ablation: one pass in a
  public order, the SRG (or independent) noise given to the estimator."""
  target, batches, clip, devices, noise_key = plan_config.from_keywords(
      {**keywords, 'sampling': 'fixed'}, *_SHARED)
  sampler = batches.sampler()
  steps = sampler.num_steps
  if gradient == 'srg':
    mechanism = srg.srg_mechanism(steps)
  elif gradient == 'independent' and algorithm == 'accelerated_dp_srgd':
    mechanism = noise.gaussian(steps)
  else:
    raise ValueError("gradient must be 'srg'"
                     + (" or 'independent'" if algorithm ==
                        'accelerated_dp_srgd' else '') + f', got {gradient!r}')
  relation = target.neighboring_relation
  estimator = functools.partial(
      srg.accelerated_dp_srgd, gradient=gradient) if (
          algorithm == 'accelerated_dp_srgd') else srg.unaccelerated_dp_srg
  family = Family(
      algorithm, mechanism,
      private=lambda z, divisor: estimator(
          loss_fn, l2_clip=clip.l2_clip, noise_multiplier=z, num_steps=steps,
          beta=beta, radius=radius, key=noise_key.key, mechanism=mechanism,
          neighboring_relation=relation, normalize_by=divisor,
          axis_name=devices.axis_name, **clip.statistic_keywords),
      hyperparameters={'beta': beta, 'radius': radius, 'gradient': gradient},
      physical_form=_srg_form(algorithm, loss_fn, clip, devices, steps,
                              gradient))
  return _batched_plan(family, sampler, target, relation, clip, devices)


def _srg_form(algorithm: str, loss_fn: LossFn, clip: plan_config.Clipping,
              devices: plan_config.Devices, num_steps: int, gradient: str
              ) -> Optional[physical.PhysicalForm]:
  """The physical form of a single-pass SRG plan's transformation.

  `accelerated_dp_srgd`'s gradients are taken at the query point x_t,
  which the coupling's update made the params (`optax.apply_updates` moves
  them to x_{t+1}), and, for `gradient='srg'`, at the previous query point
  x_{t-1} that the estimator's state keeps, weighted by the state's step
  count: the arguments come from `chain(nesterov_coupling(estimator),
  guard)`'s state, `opt_state[0].estimator`. The independent variant's
  statistic is the clipped gradient sum at x_t. `unaccelerated_dp_srg`'s
  chain is `chain(chain(srg_gradient, sgd, projection), guard)`.
  """
  if clip.physical_batch_size is None:
    return None
  if gradient == 'independent':
    return clip.gradient_form(loss_fn, devices)
  state_of = ((lambda opt_state: opt_state[0].estimator)
              if algorithm == 'accelerated_dp_srgd' else
              (lambda opt_state: opt_state[0][0]))
  form = srg.srg_physical_form(
      loss_fn, l2_clip=clip.l2_clip, num_steps=num_steps,
      physical_batch_size=clip.physical_batch_size, state_of=state_of,
      **clip.statistic_keywords)
  # The estimator's device axis: the physical batches run sharded.
  return dataclasses.replace(form, axis_name=devices.axis_name)


@keywords.checked
def accelerated_dp_srgd(
    loss_fn: LossFn,
    *,
    num_examples: int,
    batch_size: int,
    beta: float,
    radius: Optional[float],
    l2_clip: float,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    gradient: str = 'srg',
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ZERO_OUT,
    releases: Sequence[accounting.GaussianRelease] = (),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
) -> Plan:
  """An Accelerated-DP-SRGD run (papers 000/001 Algorithm 1), calibrated.

  One pass in `num_examples // batch_size` fresh batches (single epoch,
  checked in every step). The transformation is the whole optimizer (no
  optax optimizer after it); the algorithm's output is
  `final_params(opt_state)` after the last step. `srgd_preset` gives the
  theorems' beta, clip and batch size.

  Example:
    >>> plan = plans.accelerated_dp_srgd(
    ...     loss_fn, num_examples=10_000, batch_size=100, beta=10.0,
    ...     radius=1.0, l2_clip=1.0, epsilon=1.0, delta=1e-6)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    beta: the scaling beta.
    radius: the l2-ball radius R, or None.
    gradient: 'srg' (Algorithm 1) or 'independent' (Theorem 5.13 ablation).
    num_examples, batch_size, seed: the one pass (B = batch_size) in a
      public order (`Sampling`).
    l2_clip: clip norm of each per-example difference; with
      microbatch_size, clipping_method and physical_batch_size (the clipped
      differences at the query point x_t, the params, and at x_{t-1}, the
      state's: the same update as one call): `Clipping`.
    method: accounting method ('gdp_paper' is the papers' route); with
      delta, epsilon, noise_multiplier, releases and neighboring_relation
      (default ZERO_OUT, the papers' (000/001): a fixed batch order's
      accounting assumes it): `PrivacyTarget`.
    key, axis_name: `NoiseKey`, `Devices`.

  Returns:
    A `Plan`.
  """
  return _single_pass('accelerated_dp_srgd', loss_fn, locals(), beta=beta,
                      radius=radius, gradient=gradient)


@keywords.checked
def unaccelerated_dp_srg(
    loss_fn: LossFn,
    *,
    num_examples: int,
    batch_size: int,
    beta: float,
    radius: Optional[float],
    l2_clip: float,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ZERO_OUT,
    releases: Sequence[accounting.GaussianRelease] = (),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
) -> Plan:
  """An unaccelerated SRG run (the §4.3 ablation of Algorithm 1), calibrated.

  Example:
    >>> plan = plans.unaccelerated_dp_srg(
    ...     loss_fn, num_examples=10_000, batch_size=100, beta=10.0,
    ...     radius=1.0, l2_clip=1.0, epsilon=1.0, delta=1e-6)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    beta: inverse step size.
    radius: the l2-ball radius, or None.
    num_examples, batch_size, seed, l2_clip, microbatch_size,
      clipping_method, physical_batch_size, delta, epsilon,
      noise_multiplier, method, neighboring_relation, releases, key,
      axis_name: as in `accelerated_dp_srgd` (`dpsco_jax.plan_config`).

  Returns:
    A `Plan`.
  """
  return _single_pass('unaccelerated_dp_srg', loss_fn, locals(), beta=beta,
                      radius=radius, gradient='srg')


@keywords.checked
def dp_srg_memf(
    loss_fn: LossFn,
    *,
    optimizer: optax.GradientTransformation,
    num_examples: int,
    batch_size: int,
    epochs: int,
    l2_clip: float,
    decay: float,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    strategy: Union[np.ndarray, str, None] = None,
    momentum: float = 0.0,
    bands: Optional[int] = None,
    n_buffers: int = 4,
    max_noise_buffers: int = MAX_NOISE_BUFFERS,
    sampling: str = 'fixed',
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ZERO_OUT,
    releases: Sequence[accounting.GaussianRelease] = (),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
) -> Plan:
  """A DP-SRG-MEMF run (paper 001 Algorithm 3), calibrated.

  Fixed order every epoch (checked in every step); without `strategy`, one
  is optimized for `strategies.workload(k b, 'true', momentum=momentum,
  decay=decay)` (= M A L) under (k, b)-participation.

  Example:
    >>> plan = plans.dp_srg_memf(
    ...     loss_fn, optimizer=optax.sgd(0.5, momentum=0.9), num_examples=n,
    ...     batch_size=500, epochs=6, l2_clip=1.0, decay=math.exp(-2.5),
    ...     epsilon=4.0, delta=1e-5, momentum=0.9)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    optimizer: the optax optimizer.
    decay: c in [0, 1].
    l2_clip: clip norm of each per-example difference (`Clipping`, with
      microbatch_size, clipping_method, physical_batch_size).
    strategy, momentum, bands, n_buffers, max_noise_buffers, sampling:
      the strategy and its batches, as in `dpmemf` (momentum and decay
      make the workload).
    num_examples, batch_size, epochs, seed, delta, epsilon,
      noise_multiplier, method, neighboring_relation, releases, key,
      axis_name: as in `dpmemf` (`dpsco_jax.plan_config`).

  Returns:
    A `Plan`.
  """
  decay = srg.validate_decay(decay)
  target, batches, clip, devices, noise_key = plan_config.from_keywords(
      locals(), *_SHARED)
  sampler, mechanism = _matrix_factorization(
      batches, strategy, momentum, decay, bands, n_buffers, max_noise_buffers)
  b = getattr(sampler, 'steps_per_epoch', sampler.num_steps)
  physical_form = None
  if physical_batch_size is not None:
    physical_form = dataclasses.replace(srg.memf_physical_form(
        loss_fn, l2_clip=l2_clip, decay=decay,
        physical_batch_size=physical_batch_size,
        # The estimator is first in the plan's chain.
        state_of=lambda opt_state: opt_state[0], **clip.statistic_keywords),
                                        axis_name=axis_name)
  family = Family(
      'dp_srg_memf', mechanism,
      private=lambda z, divisor: srg.dp_srg_memf(
          loss_fn, l2_clip=l2_clip, noise_multiplier=z, mechanism=mechanism,
          steps_per_epoch=b, decay=decay, key=noise_key.key,
          check_order=False, neighboring_relation=neighboring_relation,
          normalize_by=divisor, axis_name=devices.axis_name,
          **clip.statistic_keywords),
      output=(optimizer,),
      hyperparameters={'epochs': epochs, 'decay': decay, **_mf_hyperparameters(
          strategy, momentum, bands, n_buffers, max_noise_buffers)},
      physical_form=physical_form)
  return _batched_plan(family, sampler, target, neighboring_relation, clip,
                       devices)


@keywords.checked
def diff2_gd(
    loss_fn: LossFn,
    *,
    learning_rate: float,
    num_rounds: int,
    restart_interval: int,
    grad_clip: float,
    diff_clip_factor: float,
    num_examples: int,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multipliers: Optional[diff2.Diff2NoiseMultipliers] = None,
    method: Optional[str] = None,
    budget_split: Optional[float] = None,
    key: estimators.KeyLike = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    output: str = 'last',
    output_key: estimators.KeyLike = None,
    physical_batch_size: Optional[int] = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> Plan:
  """A DIFF2-GD run across clients (paper 003 Algorithms 1 and 3), calibrated.

  Every round uses all of each client's data (`update(None, state, params,
  batch=local_data, batch_mask=local_mask)`, one client per device on
  `axis_name`); replace-one item-level privacy, accounted by
  `algorithms.diff2_accounting` (Proposition 4.1's split of the budget
  between the restart and difference rounds, then a common scale).

  Example:
    >>> plan = plans.diff2_gd(loss_fn, learning_rate=0.125, num_rounds=2000,
    ...                       restart_interval=20, grad_clip=1.0,
    ...                       diff_clip_factor=1.5, num_examples=n,
    ...                       epsilon=3.0, delta=1e-5, axis_name='clients')

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    learning_rate: eta.
    num_rounds: R.
    restart_interval: T (1 is DP-GD).
    grad_clip: C_1.
    diff_clip_factor: C_2 (differences are clipped to
      `C_2 ||x_t - x_{t-1}||`; `algorithms.diff2.step_size_stability` says
      whether `learning_rate` meets Theorem 4.3's bound).
    num_examples: the total number of examples over the clients (recorded;
      the accounting is per example and does not depend on it).
    noise_multipliers: `Diff2NoiseMultipliers(z_1, z_2)` to use (or give
      `epsilon`); with delta, epsilon and method ('pld' (default), 'rdp'
      or 'paper'): `plan_config.PrivacyTarget`.
    budget_split: u of Proposition 4.1 (default 1.25).
    key: the server noise key (`plan_config.NoiseKey`).
    microbatch_size, clipping_method: `plan_config.Clipping`.
    axis_name: the client axis (`plan_config.Devices`).
    output: 'last', or 'random_iterate' to also keep Algorithm 1's output
      `x_{t_hat}` (`algorithms.diff2.random_output_iterate`, first in the
      chain; read it with `algorithms.diff2.selected_iterate(state)`).
    output_key: key or seed of t_hat (None: fresh).
    physical_batch_size: run each round's local data as physical batches
      of at most this many examples, noised once (`Plan.step`,
      `dpsco_jax.physical`); one client only (no `axis_name`). None
      (default): one call per round.
    adaptive_clipping: None (fixed clips), or an
      `adaptive_clipping.AdaptiveClipping`: C_2 (`diff_clip_factor`, its
      initial value; C_1 when T = 1) follows a private quantile of the
      per-example difference norms on the difference rounds, restarts
      leave it unchanged (`algorithms.diff2.diff2_estimator`); its count
      noise defaults to 0.05 x `num_examples`. The accounting, the event
      and epsilon are those of the fixed clip.

  Returns:
    A `Plan` (no sampler, no ledger: see `Plan`).

  Raises:
    ValueError: `physical_batch_size` with `axis_name` (each client's data
      is its own logical batch, with its own size n_p; the physical step
      splits one logical batch over the devices).
  """
  target = plan_config.PrivacyTarget(
      delta=delta, epsilon=epsilon, noise_multiplier=noise_multipliers,
      method=method)
  num_examples = checks.positive_int(num_examples, 'num_examples')
  clip, devices, noise_key = plan_config.from_keywords(
      {**locals(), 'l2_clip': grad_clip,
       'adaptive_clipping': _count_noise_of(adaptive_clipping, num_examples)},
      plan_config.Clipping, plan_config.Devices, plan_config.NoiseKey)
  num_rounds = checks.positive_int(num_rounds, 'num_rounds')
  selector = diff2.output_selector(output, num_rounds, output_key)
  restart_interval = checks.positive_int(restart_interval, 'restart_interval')
  accountant = accountants.Diff2Accountant.create(
      num_rounds, restart_interval, target, budget_split=budget_split)
  physical_form = None
  if clip.physical_batch_size is not None:
    physical_form = physical.client_form(diff2.diff2_physical_form(
        loss_fn, grad_clip=clip.l2_clip, diff_clip_factor=diff_clip_factor,
        restart_interval=restart_interval,
        physical_batch_size=clip.physical_batch_size,
        state_of=lambda opt_state: opt_state[len(selector)],
        **clip.statistic_keywords), devices.axis_name)
  family = Family(
      'diff2_gd' if restart_interval > 1 else 'dp_gd',
      diff2.diff2_mechanism(num_rounds),
      private=lambda z, _: diff2.diff2_estimator(
          loss_fn, grad_clip=clip.l2_clip, diff_clip_factor=diff_clip_factor,
          restart_interval=restart_interval, num_rounds=num_rounds,
          noise_multipliers=z, key=noise_key.key,
          axis_name=devices.axis_name, **clip.estimator_keywords),
      before=tuple(selector), output=(optax.sgd(learning_rate),),
      physical_form=physical_form,
      hyperparameters={'learning_rate': learning_rate,
                       'restart_interval': restart_interval,
                       'grad_clip': grad_clip,
                       'diff_clip_factor': diff_clip_factor,
                       'output': output,
                       # Only when set: plans without it describe
                       # themselves as before.
                       **({} if clip.physical_batch_size is None else
                          {'physical_batch_size': clip.physical_batch_size}),
                       **clip.hyperparameters})
  return build(family, accountant, sampler=None, num_examples=num_examples,
               devices=devices)


def _count_noise_of(config: Optional[adaptive_lib.AdaptiveClipping],
                    num_examples: int
                    ) -> Optional[adaptive_lib.AdaptiveClipping]:
  """The DIFF2 plans' adaptive clipping with its count noise filled in.

  A round's count runs over every client's examples, `num_examples` in
  all: its default noise is 0.05 x that (`adaptive_clipping.count_stddev`),
  the DP-SGD default with the round as the batch.
  """
  if config is None:
    return None
  config = adaptive_lib.validate(config)
  return config._replace(count_stddev=adaptive_lib.count_stddev(
      config, num_examples))


@keywords.checked
def dp_gd(
    loss_fn: LossFn,
    *,
    learning_rate: float,
    num_rounds: int,
    grad_clip: float,
    num_examples: int,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    method: Optional[str] = None,
    key: estimators.KeyLike = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> Plan:
  """A DP-GD run across clients (paper 003's baseline: DIFF2 with T = 1).

  Example:
    >>> plan = plans.dp_gd(loss_fn, learning_rate=0.25, num_rounds=2000,
    ...                    grad_clip=1.0, num_examples=n, epsilon=3.0,
    ...                    delta=1e-5, axis_name='clients')

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    learning_rate: eta.
    num_rounds: R.
    grad_clip: C_1.
    noise_multiplier: the noise of every round (or give `epsilon`).
    num_examples, delta, epsilon, method, key, microbatch_size,
      clipping_method, axis_name, physical_batch_size: as in `diff2_gd`.
    adaptive_clipping: None, or an `adaptive_clipping.AdaptiveClipping`:
      C_1 (`grad_clip`, its initial value) follows a private quantile of
      the gradient norms every round, as in DP-SGD; epsilon unchanged.

  Returns:
    A `Plan`.
  """
  return diff2_gd(
      loss_fn, learning_rate=learning_rate, num_rounds=num_rounds,
      restart_interval=1, grad_clip=grad_clip, diff_clip_factor=1.0,
      num_examples=num_examples, delta=delta, epsilon=epsilon,
      noise_multipliers=(None if noise_multiplier is None else
                         diff2.Diff2NoiseMultipliers(noise_multiplier, 0.0)),
      method=method, key=key, microbatch_size=microbatch_size,
      clipping_method=clipping_method, axis_name=axis_name,
      physical_batch_size=physical_batch_size,
      adaptive_clipping=adaptive_clipping)


@keywords.checked
def user_level_dpsgd(
    loss_fn: LossFn,
    *,
    optimizer: optax.GradientTransformation,
    num_users: int,
    users_per_batch: int,
    epochs: int,
    l2_clip: float,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ADD_OR_REMOVE,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
    automatic_clipping: Optional[float] = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> Plan:
  """A user-level DP-SGD run (`algorithms.user_level`), calibrated per USER.

  Every user joins each of `round(epochs * num_users / users_per_batch)`
  batches with probability `users_per_batch / num_users` (Poisson over
  users, checked in every step); each sampled user contributes its clipped
  mean gradient over its items. The guarantee protects one user's whole
  data. `batches_of(users)` takes the `clipping.UserBatch` of all users
  (`batching.group_by_user`); the plan's `num_examples` counts users.

  Example:
    >>> users = batching.group_by_user(data, user_ids, max_items=16)
    >>> plan = plans.user_level_dpsgd(
    ...     loss_fn, optimizer=optax.sgd(0.1), num_users=3000,
    ...     users_per_batch=100, epochs=5, l2_clip=1.0, epsilon=2.0,
    ...     delta=1e-6)
    >>> for inputs in plan.batches_of(users): ...

  Args:
    loss_fn: `loss_fn(params, item) -> scalar` for ONE item.
    optimizer: the optax optimizer.
    num_users: the number of users (`Sampling.num_examples`).
    users_per_batch: the expected number of users per batch
      (`Sampling.batch_size`; with epochs and seed, Poisson over users).
    l2_clip: clip norm of each user's mean gradient (`Clipping`, with
      microbatch_size (users processed at once), clipping_method,
      physical_batch_size (users per physical batch), automatic_clipping
      and adaptive_clipping (the clip follows a private quantile of the
      users' norms)).
    delta: target delta (per user); with epsilon, noise_multiplier and
      method ('pld' or 'rdp'): `PrivacyTarget`.
    neighboring_relation: add/remove one user (replace-one is not accounted
      under Poisson sampling).
    key, axis_name: `NoiseKey`, `Devices`.

  Returns:
    A `Plan`.

  References:
    Paper 002, §5 (the user-level DP-SGD baseline).
  """
  target, batches, clip, devices, noise_key = plan_config.from_keywords(
      {**locals(), 'num_examples': num_users, 'batch_size': users_per_batch,
       'sampling': 'poisson'}, *_SHARED)
  sampler = batches.sampler()
  mechanism = user_level.user_level_dpsgd_mechanism(sampler.num_steps)
  statistic = lambda: clipping.clipped_user_grad_sum(
      loss_fn, l2_clip, **clip.statistic_keywords)
  family = Family(
      'user_level_dpsgd', mechanism,
      # `user_level.user_level_dpsgd`, given the mechanism built here.
      private=lambda z, divisor: estimators.noisy_statistic(
          statistic(), noise_multiplier=z, mechanism=mechanism,
          key=noise_key.key, neighboring_relation=neighboring_relation,
          normalize_by=divisor, axis_name=axis_name,
          name='user_level_dpsgd', adaptive_clipping=adaptive_clipping),
      output=(optimizer,),
      hyperparameters={'epochs': epochs, 'privacy_unit': 'user'},
      physical_form=(None if physical_batch_size is None else
                     clip.form(statistic(), devices)))
  return _batched_plan(family, sampler, target, neighboring_relation, clip,
                       devices)


# ----------------------------------------------- nonsmooth (paper 004)

SENSITIVITIES = ('effective', 'worst_case')


def _nonsmooth_clips(sensitivity, *, order, lipschitz, dimension,
                     smoothing_radius, movement_radius, num_directions,
                     anchor_directions, failure_probability, num_estimates):
  if sensitivity == 'worst_case':
    return smoothing.worst_case_clips(order=order, lipschitz=lipschitz,
                                      dimension=dimension)
  if sensitivity != 'effective':
    raise ValueError(f'sensitivity must be one of {SENSITIVITIES}, got '
                     f'{sensitivity!r}')
  return smoothing.effective_clips(
      order=order, lipschitz=lipschitz, dimension=dimension,
      smoothing_radius=smoothing_radius, movement_radius=movement_radius,
      num_directions=num_directions, anchor_directions=anchor_directions,
      failure_probability=failure_probability, num_estimates=num_estimates)


def _o2nc_learning_rate(learning_rate: Union[float, str], scale: float, *,
                        movement_radius: float, block_length: int,
                        lipschitz: float, noise_norm: float) -> float:
  """A given eta, or `scale D / ((L + G_0) sqrt(M))` (Proposition 2.6)."""
  if isinstance(learning_rate, str):
    if learning_rate != nonsmooth.PROPOSITION_2_6:
      raise ValueError("learning_rate must be a number or "
                       f"'{nonsmooth.PROPOSITION_2_6}', got {learning_rate!r}")
    return nonsmooth.proposition_2_6_learning_rate(
        movement_radius=movement_radius, block_length=block_length,
        lipschitz=lipschitz, noise_norm=noise_norm, scale=scale)
  if scale != 1.0:
    raise ValueError("learning_rate_scale scales learning_rate="
                     f"'{nonsmooth.PROPOSITION_2_6}' only; got a learning "
                     f'rate {learning_rate!r} and a scale {scale!r}')
  return float(learning_rate)


def _o2nc(learning_rate: float, movement_radius: float, block_length: int,
          reset_delta_each_block: bool) -> optax.GradientTransformation:
  """O2NC's outer loop, after the private estimate."""
  return nonsmooth.o2nc(learning_rate=learning_rate,
                        movement_radius=movement_radius,
                        block_length=block_length,
                        reset_delta_each_block=reset_delta_each_block)


# What both nonsmooth plans record of their run, by local name.
_NONSMOOTH_RECORD = ('order', 'sensitivity', 'clips', 'mechanism_delta',
                     'failure_probability', 'lipschitz', 'dimension',
                     'smoothing_radius', 'movement_radius', 'learning_rate',
                     'block_length', 'period', 'num_directions',
                     'anchor_directions', 'released_noise_norm',
                     'learning_rate_scale')


def _nonsmooth_hyperparameters(values: Mapping[str, Any]) -> dict[str, Any]:
  """The run record of a nonsmooth plan, from its local `values`."""
  return {name: (dict(values[name]._asdict()) if name == 'clips'
                 else values[name]) for name in _NONSMOOTH_RECORD}


# Why the nonsmooth oracles' steps cannot be cut into physical batches.
_NONSMOOTH_UNSPLITTABLE = (
    'its statistic is not a sum over examples alone: each example\'s random '
    'smoothing directions are drawn from its row in the step\'s batch, and '
    'the step\'s kind (anchor or difference), its divisor and its size '
    'check are read from the batch\'s static size')


@keywords.checked
def nonsmooth_single_pass(
    loss_fn: LossFn,
    *,
    order: str,
    num_examples: int,
    dimension: int,
    lipschitz: float,
    smoothing_radius: float,
    movement_radius: float,
    learning_rate: Union[float, str],
    block_length: int,
    period: int,
    anchor_batch_size: int,
    batch_size: int,
    num_directions: int,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    num_steps: Optional[int] = None,
    anchor_directions: Optional[int] = None,
    sensitivity: str = 'effective',
    learning_rate_scale: float = 1.0,
    seed: Optional[int] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.REPLACE_ONE,
    reset_delta_each_block: bool = False,
    microbatch_size: Optional[int] = None,
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
) -> Plan:
  """A single-pass private O2NC run (paper 004 Algorithm 2 with 3 or 5).

  The transformation is `nonsmooth_vr_gradient` (clips from
  `smoothing.effective_clips` or `worst_case_clips`, tree noise calibrated
  by the accountant for `single_epoch(T)`), then the single-pass check
  (`batching.fixed_order_guard`: no example twice), then `o2nc`; the
  params are O2NC's query points and the output is
  `nonsmooth.o2nc_output(opt_state)`. Batches come from
  `batching.AnchoredSinglePass`: B_1 fresh examples every `period` steps,
  B_2 between.

  With `sensitivity='effective'` the run spends half of delta on the
  event that some clip binds for an L-Lipschitz loss (so that the
  guarantee also covers the paper's unclipped algorithm); privacy itself
  never rests on L (every estimate is clipped). `hyperparameters` records
  the clips, the mechanism's delta and the failure probability.

  Example:
    >>> plan = plans.nonsmooth_single_pass(
    ...     loss_fn, order='first', num_examples=20_000, dimension=d,
    ...     lipschitz=1.0, smoothing_radius=0.1, movement_radius=2e-3,
    ...     learning_rate=0.02, block_length=10, period=10,
    ...     anchor_batch_size=100, batch_size=10, num_directions=8,
    ...     epsilon=2.0, delta=1e-6)
    >>> opt_state = plan.init(params)
    >>> for inputs in plan.batches_of(data): ...
    >>> x_out = nonsmooth.o2nc_output(opt_state)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    order: 'zero' (Algorithm 3) or 'first' (Algorithm 5).
    num_examples: n.
    dimension: d, the parameter count (checked at `init`).
    lipschitz: L of every per-example loss (sets the clips).
    smoothing_radius: alpha.
    movement_radius: D.
    learning_rate: eta, or 'proposition_2_6': eta = `learning_rate_scale`
      D / ((L + G_0) sqrt(M)) with G_0 the norm of the noise on a released
      estimate (`nonsmooth.released_noise_norm`, from the calibrated noise
      and the clips; recorded as `released_noise_norm`). The practical
      mode: keep M D = alpha, Sigma = M = 10, m = 8 d (zero order) or 4
      (first order), B_2 about B_1 / 2, and tune only the scale
      (docs/nonsmooth_synthetic).
    block_length: M.
    period: Sigma.
    anchor_batch_size: B_1.
    batch_size: B_2.
    num_directions: m.
    delta: the run's delta.
    epsilon: target epsilon (or give `noise_multiplier`).
    noise_multiplier: the tree noise to use (or give `epsilon`).
    num_steps: T (default: the most that n examples allow).
    anchor_directions: directions per anchor estimate (default: 1 first
      order, m zero order).
    sensitivity: 'effective' (concentration radii) or 'worst_case'.
    learning_rate_scale: the multiplier of `learning_rate='proposition_2_6'`.
    seed: the permutation's seed (None: fresh from OS entropy).
    key: the noise key (None: fresh from OS entropy).
    method: accounting method.
    neighboring_relation: replace-one (the paper's) or zero-out (add/remove
      is refused: the single pass is a fixed order).
    reset_delta_each_block: see `nonsmooth.o2nc`.
    microbatch_size: optional cap on examples estimated at once.
    axis_name: the device axis on several devices.
    physical_batch_size: refused (ValueError) unless None: the oracle's
      statistic cannot be split (docs/physical_batches.md).

  Returns:
    A `Plan`.
  """
  physical.refuse_unsplittable(physical_batch_size, 'nonsmooth_single_pass',
                               _NONSMOOTH_UNSPLITTABLE)
  target, clip, devices, noise_key = plan_config.from_keywords(
      locals(), plan_config.PrivacyTarget, plan_config.Clipping,
      plan_config.Devices, plan_config.NoiseKey)
  relation = target.relation(Relation.REPLACE_ONE)
  sampler = batching.AnchoredSinglePass(
      num_examples, anchor_batch_size, batch_size, period,
      seed=plan_config.fresh_seed(seed), num_steps=num_steps)
  steps = sampler.num_steps
  mechanism = nonsmooth.nonsmooth_mechanism(steps, period)
  _check_relation('nonsmooth_single_pass', relation, sampler.participation)
  anchors = -(-steps // period)
  if anchor_directions is None:
    anchor_directions = 1 if order == 'first' else num_directions
  accountant = accountants.GaussianAccountant.create(
      mechanism, sampler.participation, target, relation,
      accounting_delta=accountants.clip_event_budget(
          sensitivity, 0.0, delta)[0])
  mechanism_delta, failure_probability = accountants.clip_event_budget(
      sensitivity, accountant.epsilon, delta)
  clips = _nonsmooth_clips(
      sensitivity, order=order, lipschitz=lipschitz, dimension=dimension,
      smoothing_radius=smoothing_radius, movement_radius=movement_radius,
      num_directions=num_directions, anchor_directions=anchor_directions,
      failure_probability=failure_probability,
      num_estimates=anchors * anchor_batch_size +
      2 * (steps - anchors) * batch_size)
  released_noise_norm = nonsmooth.released_noise_norm(
      noise_multiplier=accountant.noise_multiplier, dimension=dimension,
      period=period,
      sensitivity=neighboring.sensitivity_factor(relation) * max(
          clips.anchor / anchor_batch_size, clips.difference / batch_size))
  learning_rate = _o2nc_learning_rate(
      learning_rate, learning_rate_scale, movement_radius=movement_radius,
      block_length=block_length, lipschitz=lipschitz,
      noise_norm=released_noise_norm)
  family = Family(
      f'nonsmooth_single_pass_{order}_order', mechanism,
      private=lambda z, _: nonsmooth.nonsmooth_vr_gradient(
          loss_fn, order=order, smoothing_radius=smoothing_radius,
          num_directions=num_directions, clips=clips, period=period,
          anchor_batch_size=anchor_batch_size, batch_size=batch_size,
          noise_multiplier=z, num_steps=steps,
          anchor_directions=anchor_directions, key=noise_key.key,
          neighboring_relation=relation, microbatch_size=clip.microbatch_size,
          axis_name=devices.axis_name, dimension=dimension),
      output=(_o2nc(learning_rate, movement_radius, block_length,
                    reset_delta_each_block),),
      hyperparameters={**_nonsmooth_hyperparameters(locals()),
                       'anchor_batch_size': anchor_batch_size,
                       'batch_size': batch_size})
  return build(family, accountant, sampler=sampler,
               num_examples=sampler.num_examples, devices=devices)


@keywords.checked
def nonsmooth_multi_pass(
    loss_fn: LossFn,
    *,
    order: str,
    num_examples: int,
    num_steps: int,
    dimension: int,
    lipschitz: float,
    smoothing_radius: float,
    movement_radius: float,
    learning_rate: Union[float, str],
    block_length: int,
    period: int,
    num_directions: int,
    delta: float,
    epsilon: Optional[float] = None,
    noise_multipliers: Optional[diff2.Diff2NoiseMultipliers] = None,
    anchor_directions: Optional[int] = None,
    sensitivity: str = 'effective',
    learning_rate_scale: float = 1.0,
    budget_split: float = 2.0,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    reset_delta_each_block: bool = False,
    microbatch_size: Optional[int] = None,
    axis_name: Optional[str] = None,
    physical_batch_size: Optional[int] = None,
) -> Plan:
  """A multi-pass private O2NC run on the empirical loss (paper 004 Alg. 2 + 4).

  Every step uses the whole data set (`update(None, state, params,
  batch=data)`); `nonsmooth_multipass_gradient` releases a Gaussian per step
  (z_1 on anchors, z_2 on differences), calibrated by the accountant for
  the composition of `ceil(T / Sigma)` Gaussian(z_1) and the rest
  Gaussian(z_2) (replace-one; `budget_split` u gives the anchors 1/u of the
  budget, as `diff2_accounting.calibrate`; the paper's Lemma 4.3 splits in
  halves, u = 2). Clips and the delta split as in `nonsmooth_single_pass`,
  with the union bound over the `n (2T - ceil(T / Sigma))` estimates.

  Example:
    >>> plan = plans.nonsmooth_multi_pass(
    ...     loss_fn, order='zero', num_examples=n, num_steps=400,
    ...     dimension=d, lipschitz=1.0, smoothing_radius=0.1,
    ...     movement_radius=2e-3, learning_rate=0.02, block_length=10,
    ...     period=10, num_directions=64, epsilon=2.0, delta=1e-6)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    order: 'zero' (Algorithm 4) or 'first' (its first-order variant).
    num_examples: n (the batch of every step).
    num_steps: T.
    dimension, lipschitz, smoothing_radius, movement_radius, learning_rate,
      block_length, period, num_directions, anchor_directions, sensitivity,
      learning_rate_scale, key, method, reset_delta_each_block,
      microbatch_size, axis_name: as in `nonsmooth_single_pass` (G_0 here is
      the larger of the two Gaussians' norms, `2 z C sqrt(d) / n`).
    delta: the run's delta.
    epsilon: target epsilon (or give `noise_multipliers`).
    noise_multipliers: `Diff2NoiseMultipliers(z_1, z_2)` (or `epsilon`).
    budget_split: u > 1.
    physical_batch_size: refused (ValueError) unless None, as in
      `nonsmooth_single_pass`.

  Returns:
    A `Plan` (no sampler: pass the whole data set every step).
  """
  physical.refuse_unsplittable(physical_batch_size, 'nonsmooth_multi_pass',
                               _NONSMOOTH_UNSPLITTABLE)
  target = plan_config.PrivacyTarget(
      delta=delta, epsilon=epsilon, noise_multiplier=noise_multipliers,
      method=method)
  clip, devices, noise_key = plan_config.from_keywords(
      locals(), plan_config.Clipping, plan_config.Devices,
      plan_config.NoiseKey)
  steps = checks.positive_int(num_steps, 'num_steps')
  period = checks.positive_int(period, 'period')
  n = checks.positive_int(num_examples, 'num_examples')
  accountant = accountants.Diff2Accountant.create(
      steps, period, target, budget_split=budget_split,
      accounting_delta=accountants.clip_event_budget(
          sensitivity, 0.0, delta)[0])
  z = accountant.noise_multiplier
  mechanism_delta, failure_probability = accountants.clip_event_budget(
      sensitivity, accountant.epsilon, delta)
  anchors = diff2_accounting.num_restarts(steps, period)
  if anchor_directions is None:
    anchor_directions = num_directions
  clips = _nonsmooth_clips(
      sensitivity, order=order, lipschitz=lipschitz, dimension=dimension,
      smoothing_radius=smoothing_radius, movement_radius=movement_radius,
      num_directions=num_directions, anchor_directions=anchor_directions,
      failure_probability=failure_probability,
      num_estimates=n * (anchors + 2 * (steps - anchors)))
  # Replace-one (Algorithm 4's relation): an increment moves by f C / n.
  released_noise_norm = nonsmooth.released_noise_norm(
      noise_multiplier=1.0, dimension=dimension,
      sensitivity=neighboring.sensitivity_factor(Relation.REPLACE_ONE) * max(
          z.restart * clips.anchor, z.difference * clips.difference) / n)
  learning_rate = _o2nc_learning_rate(
      learning_rate, learning_rate_scale, movement_radius=movement_radius,
      block_length=block_length, lipschitz=lipschitz,
      noise_norm=released_noise_norm)
  family = Family(
      f'nonsmooth_multi_pass_{order}_order', noise.gaussian(steps),
      private=lambda z, _: nonsmooth.nonsmooth_multipass_gradient(
          loss_fn, order=order, smoothing_radius=smoothing_radius,
          num_directions=num_directions, clips=clips, period=period,
          num_examples=n, noise_multipliers=z, num_steps=steps,
          anchor_directions=anchor_directions, key=noise_key.key,
          microbatch_size=clip.microbatch_size, axis_name=devices.axis_name,
          dimension=dimension),
      output=(_o2nc(learning_rate, movement_radius, block_length,
                    reset_delta_each_block),),
      hyperparameters={**_nonsmooth_hyperparameters(locals()),
                       'budget_split': budget_split})
  return build(family, accountant, sampler=None, num_examples=n,
               devices=devices)


__all__ = ('Plan', 'accelerated_dp_srgd', 'diff2_gd', 'dp_gd', 'dp_srg_memf',
           'dpftrl', 'dpmemf', 'dpsgd', 'nonsmooth_multi_pass',
           'nonsmooth_single_pass', 'unaccelerated_dp_srg',
           'user_level_dpsgd')
