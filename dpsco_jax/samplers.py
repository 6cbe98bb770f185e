"""Host samplers: batch formation that matches the accounting.

Each sampler yields example indices (host-side NumPy) and names the
participation pattern its batches really follow, so the epsilon a run reports
is computed for the batches it actually used:

* `FixedOrderBatches` -> `accounting.FixedOrder`: one public order, the same
  batches in the same order every epoch (DP-FTRL, DP-MF, papers 000/001);
* `ShuffledBatches` -> `accounting.Shuffled`: a fresh permutation every epoch,
  no amplification claimed;
* `PoissonBatches` -> `accounting.PoissonSampling`: every example joins every
  batch independently with probability q; batches are padded to a multiple
  of a fixed size with a mask, so only a few shapes are ever compiled;
* `CyclicPoissonBatches` -> `accounting.CyclicPoissonSampling`: example i
  in partition i mod b, step t samples partition t mod b with probability
  q (Amplified BandMF, with a strategy of at most b bands); padded and
  masked like `PoissonBatches`;
* `AnchoredSinglePass` -> `accounting.single_epoch`: one pass with anchor
  batches every `period` steps and smaller batches between (paper 004);
* `group_by_user` arranges examples by user for user-level DP.

Every sampler is deterministic given its seed and can resume mid-run:
`sampler.iterate(start_step=k)` yields exactly the batches `k, k + 1, ...`
that iterating from the start would have yielded (what a run restored from a
checkpoint at step k needs, see `dpsco_jax.checkpoint`), and the epoch
samplers also give any single batch with `batch_at(step)`; `reseeded` gives
the same sampler under another seed.

The in-step checks that batches really follow these patterns are in
`dpsco_jax.batch_guards`; `dpsco_jax.batching` re-exports both modules.
"""

import abc
import dataclasses
import math
import warnings
from typing import Any, Iterator, Optional

import jax
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import clipping


class RemainderWarning(UserWarning):
  """Fixed-size batches leave `num_examples % batch_size` examples unused.

  Said once per process for each kind of sampler, data set size and batch
  size: building several plans over the same data (the quick start builds
  three) repeats nothing new.
  """


# The (sampler kind, num_examples, batch_size) whose remainder was announced.
_REMAINDERS_ANNOUNCED: set[tuple[str, int, int]] = set()


@dataclasses.dataclass(frozen=True)
class _EpochBatches(abc.ABC):
  """Fixed-size batches over `num_epochs` passes of `num_examples // batch_size`.

  The leftover `num_examples % batch_size` examples of an epoch are not used
  (`unused_per_epoch`), and a `RemainderWarning` says so when the first
  sampler of this kind, size and batch size is made in the process.

  Attributes:
    num_examples: data set size.
    batch_size: examples per batch.
    num_epochs: passes over the data.
  """

  num_examples: int
  batch_size: int
  num_epochs: int = 1

  def __post_init__(self):
    checks.positive_int(self.num_examples, 'num_examples')
    checks.positive_int(self.batch_size, 'batch_size')
    checks.positive_int(self.num_epochs, 'num_epochs')
    if self.batch_size > self.num_examples:
      raise ValueError(f'batch_size {self.batch_size} exceeds num_examples '
                       f'{self.num_examples}')
    announced = (type(self).__name__, self.num_examples, self.batch_size)
    if self.unused_per_epoch and announced not in _REMAINDERS_ANNOUNCED:
      # Once, by our own record: Python's once-per-place filter forgets what
      # it said whenever any code enters `warnings.catch_warnings()`.
      _REMAINDERS_ANNOUNCED.add(announced)
      warnings.warn(
          f'{type(self).__name__}: {self.num_examples} examples make '
          f'{self.steps_per_epoch} batches of {self.batch_size}; '
          f'{self.unused_per_epoch} example(s) per epoch are not used '
          '(the accounting is unaffected: an unused example spends nothing). '
          'Pick a batch size that divides the data set to use them all.',
          RemainderWarning, stacklevel=3)

  @property
  def unused_per_epoch(self) -> int:
    """Examples left out of every epoch (`num_examples % batch_size`)."""
    return self.num_examples % self.batch_size

  @property
  def steps_per_epoch(self) -> int:
    return self.num_examples // self.batch_size

  @property
  def num_steps(self) -> int:
    return self.num_epochs * self.steps_per_epoch

  def _batches_of(self, order: np.ndarray) -> np.ndarray:
    used = self.steps_per_epoch * self.batch_size
    return order[:used].reshape(self.steps_per_epoch, self.batch_size)

  @abc.abstractmethod
  def _epoch_batches(self, epoch: int) -> np.ndarray:
    """`[steps_per_epoch, batch_size]` indices of epoch `epoch`."""

  def iterate(self, start_step: int = 0) -> Iterator[np.ndarray]:
    """The batches from `start_step` on, as iterating from 0 would give them.

    Example:
      >>> batches = FixedOrderBatches(1000, batch_size=100, num_epochs=2)
      >>> rest = list(batches.iterate(start_step=15))  # steps 15..19

    Args:
      start_step: the first step to yield, in `[0, num_steps]` (`num_steps`
        yields nothing: the run is over).

    Returns:
      An iterator over `[batch_size]` int arrays of example indices.

    Raises:
      ValueError: if `start_step` is out of range.
    """
    start_step = _check_start_step(start_step, self.num_steps)
    first_epoch, position = divmod(start_step, self.steps_per_epoch)
    for epoch in range(first_epoch, self.num_epochs):
      batches = self._epoch_batches(epoch)
      yield from batches[position if epoch == first_epoch else 0:]

  def batch_at(self, step: int) -> np.ndarray:
    """The batch of step `step` (0-indexed), as iterating would yield it.

    Example:
      >>> FixedOrderBatches(1000, batch_size=100).batch_at(3)

    Args:
      step: in `[0, num_steps)`.

    Returns:
      `[batch_size]` int array of example indices.

    Raises:
      ValueError: if `step` is out of range.
    """
    step = _check_start_step(step, self.num_steps - 1)
    epoch, position = divmod(step, self.steps_per_epoch)
    return self._epoch_batches(epoch)[position]

  def __iter__(self) -> Iterator[np.ndarray]:
    return self.iterate()


def _check_start_step(start_step: int, largest: int) -> int:
  """`start_step` as an int in `[0, largest]`, or a ValueError."""
  try:
    integral = (not isinstance(start_step, bool) and
                int(start_step) == start_step)
  except (TypeError, ValueError):
    integral = False
  if not integral or not 0 <= start_step <= largest:
    raise ValueError(f'step must be an integer in [0, {largest}], got '
                     f'{start_step!r}')
  return int(start_step)


@dataclasses.dataclass(frozen=True)
class FixedOrderBatches(_EpochBatches):
  """The same batches, in the same order, every epoch.

  The order is a permutation drawn once from `seed` (a public choice,
  made before seeing the data).

  Example:
    >>> batches = FixedOrderBatches(1000, batch_size=100, num_epochs=2)
    >>> batches.participation          # FixedOrder(2, 10)
    >>> for indices in batches: ...     # 20 arrays of 100 indices

  Attributes:
    seed: seed of the public order (None: natural order 0..n-1); the same
      field name as every other sampler's seed. Its old spelling
      `order_seed=` is accepted with a `DeprecationWarning` until dpsco_jax
      0.3.0.
  """

  seed: Optional[int] = dataclasses.field(default=None, kw_only=True)
  order_seed: dataclasses.InitVar[Optional[int]] = dataclasses.field(
      default=None, kw_only=True)

  def __post_init__(self, order_seed=None):
    if order_seed is not None:
      if self.seed is not None:
        raise TypeError('FixedOrderBatches got seed= and its old spelling '
                        'order_seed=: give seed= alone')
      warnings.warn('FixedOrderBatches(order_seed=) is now seed= (the name '
                    'every sampler uses); order_seed= stops working in '
                    'dpsco_jax 0.3.0', DeprecationWarning, stacklevel=3)
      object.__setattr__(self, 'seed', order_seed)
    super().__post_init__()

  @property
  def participation(self) -> accounting.FixedOrder:
    """The participation pattern these batches are accounted with."""
    return accounting.FixedOrder(self.num_epochs, self.steps_per_epoch)

  def _epoch_batches(self, epoch: int) -> np.ndarray:
    del epoch  # The same order every epoch.
    if self.seed is None:
      order = np.arange(self.num_examples)
    else:
      order = np.random.default_rng(self.seed).permutation(
          self.num_examples)
    return self._batches_of(order)


@dataclasses.dataclass(frozen=True)
class ShuffledBatches(_EpochBatches):
  """A fresh random permutation each epoch, cut into fixed-size batches.

  Accounted as `Shuffled` (each example at most once per epoch), without
  amplification by shuffling.

  Example:
    >>> batches = ShuffledBatches(1000, batch_size=100, num_epochs=3, seed=0)

  Attributes:
    seed: seed of the shuffles.
  """

  seed: int = dataclasses.field(kw_only=True)

  @property
  def participation(self) -> accounting.Shuffled:
    """The participation pattern these batches are accounted with."""
    return accounting.Shuffled(self.num_epochs, self.steps_per_epoch)

  def _epoch_batches(self, epoch: int) -> np.ndarray:
    # Epoch e's permutation is the (e+1)-th draw of one generator, as when
    # iterating from the start: redraw the earlier ones (one permutation per
    # epoch, cheap next to the training they stand for).
    rng = np.random.default_rng(self.seed)
    for _ in range(epoch):
      rng.permutation(self.num_examples)
    return self._batches_of(rng.permutation(self.num_examples))

  def iterate(self, start_step: int = 0) -> Iterator[np.ndarray]:
    """The batches from `start_step` on, as iterating from 0 would give them.

    Example:
      >>> batches = ShuffledBatches(1000, batch_size=100, num_epochs=3, seed=0)
      >>> rest = list(batches.iterate(start_step=15))  # steps 15..29

    Args:
      start_step: the first step to yield, in `[0, num_steps]`.

    Returns:
      An iterator over `[batch_size]` int arrays of example indices.

    Raises:
      ValueError: if `start_step` is out of range.
    """
    start_step = _check_start_step(start_step, self.num_steps)
    first_epoch, position = divmod(start_step, self.steps_per_epoch)
    rng = np.random.default_rng(self.seed)
    for epoch in range(self.num_epochs):
      # Every epoch's permutation is drawn, skipped ones included, so the
      # generator is where it would be without the interruption.
      batches = self._batches_of(rng.permutation(self.num_examples))
      if epoch >= first_epoch:
        yield from batches[position if epoch == first_epoch else 0:]


@dataclasses.dataclass(frozen=True)
class PoissonBatches:
  """Poisson sampling: each example in each batch independently w.p. q.

  Yields `(indices, mask)`: the sampled indices padded (with index 0) up to a
  multiple of `pad_to_multiple`, and a bool mask that is False on padding.
  Every distinct padded size is compiled anew, so the default pads to the
  expected size plus four standard deviations (rounded up to a multiple of
  32): almost every batch fits one shape, and a larger batch (probability
  ~3e-5 per step) is padded to the next multiple, never truncated.
  Each example gets its own Bernoulli draw (not a Binomial batch size
  followed by sampling without replacement, which is a different mechanism).
  Divide the noisy sum by the EXPECTED batch size `q * num_examples`
  (`expected_batch_size`), never by the realized one.

  Example:
    >>> batches = PoissonBatches(1000, sampling_probability=0.1,
    ...                          num_steps=50, seed=0)
    >>> for indices, mask in batches: ...

  Attributes:
    num_examples: data set size.
    sampling_probability: q in (0, 1].
    num_steps: number of batches.
    seed: sampling seed (use a fresh one per run).
    pad_to_multiple: batches are padded to a multiple of this (default:
      see above).
  """

  num_examples: int
  sampling_probability: float
  num_steps: int
  seed: int
  pad_to_multiple: Optional[int] = None

  def __post_init__(self):
    checks.positive_int(self.num_examples, 'num_examples')
    checks.positive_int(self.num_steps, 'num_steps')
    if not 0.0 < float(self.sampling_probability) <= 1.0:
      raise ValueError('sampling_probability must be in (0, 1], got '
                       f'{self.sampling_probability!r}')
    if self.pad_to_multiple is None:
      q = self.sampling_probability
      std = math.sqrt(self.num_examples * q * (1.0 - q))
      object.__setattr__(self, 'pad_to_multiple', 32 * math.ceil(
          (self.expected_batch_size + 4.0 * std) / 32))
    checks.positive_int(self.pad_to_multiple, 'pad_to_multiple')

  @property
  def expected_batch_size(self) -> float:
    """The expected batch size q n, which the noisy sum is divided by."""
    return self.sampling_probability * self.num_examples

  @property
  def participation(self) -> accounting.PoissonSampling:
    """The participation pattern these batches are accounted with."""
    return accounting.PoissonSampling(self.sampling_probability,
                                      self.num_steps)

  def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    return self.iterate()

  def iterate(self, start_step: int = 0
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The batches from `start_step` on, as iterating from 0 would give them.

    The skipped steps' draws are made and discarded (`num_examples` uniforms
    per step), so the generator continues exactly where an uninterrupted
    run's would: resumed batches are the same batches, not fresh ones that
    could coincide with earlier draws.

    Example:
      >>> batches = PoissonBatches(1000, 0.1, num_steps=50, seed=0)
      >>> for indices, mask in batches.iterate(start_step=20): ...

    Args:
      start_step: the first step to yield, in `[0, num_steps]`.

    Returns:
      An iterator over `(indices, mask)` pairs (see the class docstring).

    Raises:
      ValueError: if `start_step` is out of range.
    """
    start_step = _check_start_step(start_step, self.num_steps)
    rng = np.random.default_rng(self.seed)
    for _ in range(start_step):
      rng.random(self.num_examples)
    for _ in range(start_step, self.num_steps):
      chosen = np.flatnonzero(
          rng.random(self.num_examples) < self.sampling_probability)
      size = max(1, -(-len(chosen) // self.pad_to_multiple)) * (
          self.pad_to_multiple)
      indices = np.zeros(size, dtype=np.int64)
      indices[:len(chosen)] = chosen
      mask = np.arange(size) < len(chosen)
      yield indices, mask


def reseeded(sampler: Any, seed: int) -> Any:
  """The same sampler with another seed: one more run of the same plan.

  Every sampler names its seed `seed`; the sizes, padding and so the
  participation the run is accounted for are unchanged (checked).

  Example:
    >>> runs = [reseeded(plan.batches, seed) for seed in (1, 2, 3)]

  Args:
    sampler: a `batching` sampler.
    seed: the new seed.

  Returns:
    A sampler of the same class with `seed` replaced.

  Raises:
    ValueError: for a sampler without a seed field.
  """
  if not dataclasses.is_dataclass(sampler) or 'seed' not in {
      field.name for field in dataclasses.fields(sampler)}:
    raise ValueError(f'{type(sampler).__name__} has no seed to replace')
  with warnings.catch_warnings():
    # Said once already, when the sampler was first made.
    warnings.simplefilter('ignore', RemainderWarning)
    other = dataclasses.replace(sampler, seed=int(seed))
  if other.participation != sampler.participation:
    raise AssertionError('re-seeding changed the participation')
  return other


def _padded(chosen: np.ndarray, pad_to_multiple: int
            ) -> tuple[np.ndarray, np.ndarray]:
  """`(indices, mask)`: `chosen` padded with index 0 to a multiple."""
  size = max(1, -(-len(chosen) // pad_to_multiple)) * pad_to_multiple
  indices = np.zeros(size, dtype=np.int64)
  indices[:len(chosen)] = chosen
  return indices, np.arange(size) < len(chosen)


@dataclasses.dataclass(frozen=True)
class CyclicPoissonBatches:
  """Cyclic Poisson sampling: partition t mod b, each member w.p. q.

  Example i belongs to partition `i mod num_partitions` (public and fixed:
  shuffle the data once beforehand if its order means something); step t
  draws each example of partition `t mod num_partitions` independently with
  probability q. Accounted as `accounting.CyclicPoissonSampling` (Amplified
  BandMF, Choquette-Choo et al. 2023): with a strategy of at most b bands,
  DP-SGD's amplification for `ceil(T / b)` steps. Yields `(indices, mask)`
  padded like `PoissonBatches`; divide by `expected_batch_size`.

  Example:
    >>> batches = CyclicPoissonBatches(1000, sampling_probability=0.5,
    ...                                num_steps=40, num_partitions=10,
    ...                                seed=0)
    >>> for indices, mask in batches: ...

  Attributes:
    num_examples: data set size.
    sampling_probability: q in (0, 1].
    num_steps: number of batches.
    num_partitions: b, the minimum separation between two steps of one
      example.
    seed: sampling seed (use a fresh one per run).
    pad_to_multiple: batches are padded to a multiple of this (default: the
      expected size plus four standard deviations, as `PoissonBatches`).
  """

  num_examples: int
  sampling_probability: float
  num_steps: int
  num_partitions: int
  seed: int
  pad_to_multiple: Optional[int] = None

  def __post_init__(self):
    checks.positive_int(self.num_examples, 'num_examples')
    checks.positive_int(self.num_steps, 'num_steps')
    checks.positive_int(self.num_partitions, 'num_partitions')
    if self.num_partitions > self.num_examples:
      raise ValueError(f'{self.num_partitions} partitions of '
                       f'{self.num_examples} examples leave some empty')
    if not 0.0 < float(self.sampling_probability) <= 1.0:
      raise ValueError('sampling_probability must be in (0, 1], got '
                       f'{self.sampling_probability!r}')
    if self.pad_to_multiple is None:
      q, size = self.sampling_probability, self.largest_partition
      std = math.sqrt(size * q * (1.0 - q))
      object.__setattr__(self, 'pad_to_multiple', 32 * math.ceil(
          (q * size + 4.0 * std) / 32))
    checks.positive_int(self.pad_to_multiple, 'pad_to_multiple')

  @property
  def largest_partition(self) -> int:
    """The size of the largest of the partitions, ceil(n / b)."""
    return -(-self.num_examples // self.num_partitions)

  @property
  def expected_batch_size(self) -> float:
    """The mean over steps of the expected batch size, q n / b."""
    return self.sampling_probability * self.num_examples / self.num_partitions

  @property
  def participation(self) -> accounting.CyclicPoissonSampling:
    """The participation pattern these batches are accounted with."""
    return accounting.CyclicPoissonSampling(
        self.sampling_probability, self.num_steps, self.num_partitions)

  def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    return self.iterate()

  def iterate(self, start_step: int = 0
              ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The batches from `start_step` on, as iterating from 0 would give them.

    Skipped steps' draws are made and discarded, as in `PoissonBatches`.

    Example:
      >>> for indices, mask in batches.iterate(start_step=20): ...

    Args:
      start_step: the first step to yield, in `[0, num_steps]`.

    Returns:
      An iterator over `(indices, mask)` pairs.
    """
    start_step = _check_start_step(start_step, self.num_steps)
    rng = np.random.default_rng(self.seed)
    for step in range(self.num_steps):
      members = np.arange(step % self.num_partitions, self.num_examples,
                          self.num_partitions)
      draws = rng.random(len(members))
      if step >= start_step:
        yield _padded(members[draws < self.sampling_probability],
                      self.pad_to_multiple)


@dataclasses.dataclass(frozen=True)
class AnchoredSinglePass:
  """One pass in batches of two sizes: B_1 every `period` steps, B_2 between.

  The batches of paper 004's single-pass oracles (Algorithms 3 and 5): step
  c (0-based) takes `anchor_batch_size` fresh examples when `c % period ==
  0` and `batch_size` fresh examples otherwise, consecutive slices of one
  permutation drawn from `seed`, so no example is used twice. Accounted as
  `accounting.single_epoch(num_steps)` (each example in at most one step;
  checked in every step by `fixed_order_guard`). The examples after the
  last step are not used.

  Example:
    >>> batches = AnchoredSinglePass(10_000, anchor_batch_size=100,
    ...                              batch_size=10, period=10, seed=0)
    >>> batches.num_steps          # as many steps as 10,000 examples allow
    >>> for indices in batches: ...

  Attributes:
    num_examples: n.
    anchor_batch_size: B_1.
    batch_size: B_2.
    period: Sigma.
    seed: the permutation's seed.
    num_steps: T; None (default): the most steps n examples allow.
  """

  num_examples: int
  anchor_batch_size: int
  batch_size: int
  period: int
  seed: int
  num_steps: Optional[int] = None

  def __post_init__(self):
    for name in ('num_examples', 'anchor_batch_size', 'batch_size', 'period'):
      checks.positive_int(getattr(self, name), name)
    if self.num_steps is None:
      object.__setattr__(self, 'num_steps', self._most_steps())
      if self.num_steps == 0:
        raise ValueError(
            f'{self.num_examples} examples cannot fill one anchor batch of '
            f'{self.anchor_batch_size}')
    checks.positive_int(self.num_steps, 'num_steps')
    if self.examples_used(self.num_steps) > self.num_examples:
      raise ValueError(
          f'{self.num_steps} steps need {self.examples_used(self.num_steps)} '
          f'fresh examples (anchors of {self.anchor_batch_size} every '
          f'{self.period} steps, {self.batch_size} otherwise), more than the '
          f'{self.num_examples} there are: a single pass never reuses one')

  def examples_used(self, num_steps: int) -> int:
    """Examples the first `num_steps` steps take."""
    anchors = -(-num_steps // self.period)
    return (anchors * self.anchor_batch_size +
            (num_steps - anchors) * self.batch_size)

  def _most_steps(self) -> int:
    low, high = 0, self.num_examples + 1
    while high - low > 1:
      middle = (low + high) // 2
      if self.examples_used(middle) <= self.num_examples:
        low = middle
      else:
        high = middle
    return low

  def is_anchor(self, step: int) -> bool:
    """Whether step `step` (0-based) is an anchor step."""
    return step % self.period == 0

  @property
  def participation(self) -> accounting.FixedOrder:
    """The participation pattern these batches are accounted with."""
    return accounting.single_epoch(self.num_steps)

  def batch_at(self, step: int) -> np.ndarray:
    """The indices of step `step` (0-based).

    Args:
      step: in `[0, num_steps)`.

    Returns:
      `[B_1]` or `[B_2]` int indices.
    """
    step = _check_start_step(step, self.num_steps - 1)
    order = np.random.default_rng(self.seed).permutation(self.num_examples)
    start = self.examples_used(step)
    size = self.anchor_batch_size if self.is_anchor(step) else self.batch_size
    return order[start:start + size]

  def iterate(self, start_step: int = 0) -> Iterator[np.ndarray]:
    """The batches from `start_step` on, as iterating from 0 gives them.

    Args:
      start_step: in `[0, num_steps]`.

    Returns:
      An iterator of int index arrays.
    """
    start_step = _check_start_step(start_step, self.num_steps)
    order = np.random.default_rng(self.seed).permutation(self.num_examples)
    for step in range(start_step, self.num_steps):
      start = self.examples_used(step)
      size = (self.anchor_batch_size if self.is_anchor(step) else
              self.batch_size)
      yield order[start:start + size]

  def __iter__(self) -> Iterator[np.ndarray]:
    return self.iterate()


def group_by_user(examples: Any, user_ids: Any, *, max_items: int,
                  num_users: Optional[int] = None) -> clipping.UserBatch:
  """Examples grouped by user, `[users, max_items, ...]`, for user-level DP.

  Users with more than `max_items` examples keep their FIRST `max_items` in
  data order (the rest are dropped: a public rule, fixed before training);
  users with fewer are padded with copies of their first example, masked
  out. The privacy unit is then the user: one user's whole data (up to
  `max_items` examples) may change.

  Example:
    >>> users = group_by_user({'x': x, 'y': y}, user_ids, max_items=16)
    >>> users.items['x'].shape        # (num_users, 16, ...)
    >>> users.item_mask.sum(axis=1)   # examples kept per user

  Args:
    examples: a pytree of arrays with a leading example axis.
    user_ids: `[num_examples]` integer user of each example, in
      `[0, num_users)`.
    max_items: m, the examples kept per user (> 0).
    num_users: the number of users (default: `max(user_ids) + 1`); every
      user must own at least one example.

  Returns:
    A `clipping.UserBatch` over all users (leading axis: user id).

  Raises:
    ValueError: for m < 1, ids out of range, a user without examples, or
      leaves whose leading axis is not the number of examples.
  """
  max_items = checks.positive_int(max_items, 'max_items')
  user_ids = np.asarray(user_ids)
  if user_ids.ndim != 1 or not np.issubdtype(user_ids.dtype, np.integer):
    raise ValueError('user_ids must be a 1-D integer array, one id per '
                     'example')
  leaves = jax.tree_util.tree_leaves(examples)
  if any(np.shape(leaf)[:1] != user_ids.shape for leaf in leaves):
    raise ValueError(f'every leaf needs a leading axis of {len(user_ids)} '
                     'examples, one per user id')
  if num_users is None:
    num_users = int(user_ids.max()) + 1 if len(user_ids) else 0
  num_users = checks.positive_int(num_users, 'num_users')
  if user_ids.min() < 0 or user_ids.max() >= num_users:
    raise ValueError(f'user ids must be in [0, {num_users})')
  # Stable sort: each user's examples stay in data order.
  order = np.argsort(user_ids, kind='stable')
  counts = np.bincount(user_ids, minlength=num_users)
  if np.any(counts == 0):
    raise ValueError(
        f'{int(np.sum(counts == 0))} user(s) own no example (e.g. user '
        f'{int(np.argmax(counts == 0))}): pass num_users for the users that '
        'exist, or drop the empty ones')
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  slot = np.arange(max_items)
  kept = slot[None, :] < counts[:, None]
  # Padding repeats a user's first example (finite, same shapes), masked.
  index = order[starts[:, None] + np.where(kept, slot[None, :], 0)]
  items = jax.tree_util.tree_map(lambda x: np.asarray(x)[index], examples)
  return clipping.UserBatch(items=items, item_mask=kept)
