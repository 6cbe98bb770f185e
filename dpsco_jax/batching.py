"""Batch formation that matches the accounting.

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
  masked like `PoissonBatches`, checked by `poisson_batch_guard(...,
  num_partitions=b)`;
* `AnchoredSinglePass` -> `accounting.single_epoch`: one pass with anchor
  batches every `period` steps and smaller batches between (paper 004).

`fixed_order_guard` checks, inside the training step, that batches really
come in the fixed order a `FixedOrder` accounting claims: every example in
one batch of the first epoch, at most once, and the same batches in the same
order in every later epoch.

Every sampler is deterministic given its seed and can resume mid-run:
`sampler.iterate(start_step=k)` yields exactly the batches `k, k + 1, ...`
that iterating from the start would have yielded (what a run restored from a
checkpoint at step k needs, see `dpsco_jax.checkpoint`), and the epoch
samplers also give any single batch with `batch_at(step)`.
"""

import abc
import dataclasses
import math
import warnings
from typing import Any, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import guards
from dpsco_jax import parallel


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


class FixedOrderGuardState(NamedTuple):
  """State of `fixed_order_guard`.

  Attributes:
    step: steps seen so far.
    fingerprints: `[steps_per_epoch, 2]` uint32, an order-invariant hash of
      the example ids of each batch position in the first epoch.
    seen: `[ceil(num_examples / 32)]` uint32, one bit per example: set once
      the example has taken part in a first-epoch batch.
    refusal: the `guards.Refusal` record of the guard's checks: once set,
      every later update is NaN, and `guards.raise_if_refused` reports it.

  The fingerprints and the bitmap are functions of the ids of the training
  examples (which examples were used, and when): not noised, do not publish.
  """

  step: jax.Array
  fingerprints: jax.Array
  seen: jax.Array
  refusal: Optional[guards.Refusal] = None


def _mix(ids: jax.Array, seed: int) -> jax.Array:
  """A 32-bit avalanche hash of each id (the MurmurHash3 finalizer)."""
  x = ids.astype(jnp.uint32) ^ jnp.uint32(seed)
  x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
  x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _ids_and_mask(example_ids: jax.Array, mask: Optional[jax.Array]
                  ) -> tuple[jax.Array, jax.Array]:
  """Flat integer ids and a flat bool mask of the same size, or a ValueError."""
  example_ids = jnp.ravel(jnp.asarray(example_ids))
  if not jnp.issubdtype(example_ids.dtype, jnp.integer):
    raise ValueError(f'example_ids must be integers, got {example_ids.dtype}')
  keep = (jnp.ones(example_ids.shape, bool) if mask is None else
          jnp.ravel(jnp.asarray(mask, bool)))
  if keep.shape != example_ids.shape:
    raise ValueError(f'batch_mask has {keep.size} entries for '
                     f'{example_ids.size} example ids')
  return example_ids, keep


def batch_fingerprint(example_ids: jax.Array,
                      mask: Optional[jax.Array] = None,
                      axis_name: Optional[str] = None) -> jax.Array:
  """An order-invariant 64-bit fingerprint of a batch's set of example ids.

  Two independent 32-bit hashes of every id, summed (mod 2^32) over the ids
  the mask keeps and over devices: equal sets give equal fingerprints in any
  order or device layout, different sets almost never do.

  Args:
    example_ids: integer ids of the batch's examples (this device's shard).
    mask: optional bool mask, False on padding.
    axis_name: the device axis, or None.

  Returns:
    `[2]` uint32.
  """
  example_ids, keep = _ids_and_mask(example_ids, mask)
  hashes = jnp.stack([_mix(example_ids, 0x9E3779B9),
                      _mix(example_ids, 0x7F4A7C15)], axis=-1)
  local = jnp.sum(jnp.where(keep[:, None], hashes, jnp.uint32(0)), axis=0,
                  dtype=jnp.uint32)
  return parallel.psum(local, axis_name)


class _IdChecks(NamedTuple):
  """What `_check_ids` found in one (global) batch."""

  out_of_range: jax.Array  # a kept id outside [0, num_examples)
  repeated: jax.Array      # a kept id twice in the batch
  seen_before: jax.Array   # a kept id already set in the bitmap
  seen: jax.Array          # the bitmap with the batch's ids set


def _check_ids(ids: jax.Array, keep: jax.Array, seen: jax.Array,
               num_examples: int) -> _IdChecks:
  """Range, within-batch repeats and the seen-bitmap for one batch's ids."""
  # Sorted by id, then by the mask (padding first among equal ids): the kept
  # copies of an id are neighbours, whatever padding shares their value.
  ids, keep_sorted = jax.lax.sort((ids, keep.astype(jnp.int32)), num_keys=2)
  keep = keep_sorted.astype(bool)
  in_range = ids >= 0
  if num_examples <= jnp.iinfo(ids.dtype).max:
    in_range &= ids < num_examples
  same_as_previous = jnp.concatenate([
      jnp.zeros((1,), bool),
      (ids[1:] == ids[:-1]) & keep[1:] & keep[:-1]])
  # Each kept, in-range id once: setting its bit by an addition is then an
  # exact OR (no carries), also when the batch itself is refused.
  valid = keep & in_range & ~same_as_previous
  safe = jnp.where(valid, ids, 0)
  word = (safe >> 5).astype(jnp.int32)
  bit = jnp.left_shift(jnp.uint32(1), (safe & 31).astype(jnp.uint32))
  already = valid & ((seen[word] & bit) != 0)
  seen = seen.at[word].add(jnp.where(valid & ~already, bit, jnp.uint32(0)))
  return _IdChecks(out_of_range=jnp.any(keep & ~in_range),
                   repeated=jnp.any(same_as_previous),
                   seen_before=jnp.any(already), seen=seen)


def fixed_order_guard(
    steps_per_epoch: int,
    *,
    num_examples: int,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Refuses batches that break the `FixedOrder(k, b)` participation.

  `FixedOrder(k, b)` accounting (DP-MF, DP-MEMF: paper 001 Algorithms 2-3,
  notes pitfall 15) assumes that the example in batch j takes part exactly
  at steps `j, b + j, ..., (k-1) b + j`, and at no other step. The guard
  refuses (`dpsco_jax.guards.record`: ValueError when eager; under jit
  NaN-poisoned updates and the refusal recorded in the guard's state,
  raised by `guards.raise_if_refused`) a step whose batch

  * holds an id outside `[0, num_examples)`;
  * holds the same id twice (the example would count twice in one sum);
  * in the first epoch, holds an id that an earlier batch of the first
    epoch already held (kept in a bitmap of `num_examples` bits): the
    example would take part at two positions of every epoch;
  * in a later epoch, is not the set of ids at the same position of the
    first epoch (a pipeline that reshuffles between epochs: an example can
    then meet strategy columns whose cross terms the sensitivity never
    counted). Batches are compared by fingerprint; the order of examples
    within a batch does not matter.

  Ids where `batch_mask` is False (padding) are ignored by every check, so
  padding may repeat any id. With `axis_name`, the ids of all devices are
  gathered, so a repeat across two devices is caught too.

  Place it after the private estimator in the chain, so it guards the
  updates that estimator produced.

  Example:
    >>> tx = optax.chain(
    ...     noisy_gradient(loss_fn, ..., mechanism=noise.matrix_factorization(c)),
    ...     fixed_order_guard(steps_per_epoch=100, num_examples=50_000),
    ...     optax.sgd(0.1, momentum=0.9))
    >>> for indices in FixedOrderBatches(50_000, 500, num_epochs=6):
    ...   updates, state = tx.update(None, state, params,
    ...                              batch=data[indices],
    ...                              example_ids=indices)

  Args:
    steps_per_epoch: b, the batches per epoch.
    num_examples: the size of the training set the ids index (ids are in
      `[0, num_examples)`). Required: the first-epoch bitmap needs it, and
      without it a repeated example would go unnoticed. The state holds
      `ceil(num_examples / 32)` uint32 words.
    axis_name: the device axis when each device holds a shard of the batch
      (and of its ids).

  Returns:
    An `optax.GradientTransformationExtraArgs`: `update(updates, state,
    params=None, *, example_ids, batch_mask=None)`.

  Raises:
    ValueError: for a non-positive `steps_per_epoch` or `num_examples`; at
      update time, see above.
  """
  steps_per_epoch = checks.positive_int(steps_per_epoch, 'steps_per_epoch')
  num_examples = checks.positive_int(num_examples, 'num_examples')
  words = -(-num_examples // 32)

  def init_fn(params):
    del params
    return FixedOrderGuardState(
        step=jnp.zeros((), jnp.int32),
        fingerprints=jnp.zeros((steps_per_epoch, 2), jnp.uint32),
        seen=jnp.zeros((words,), jnp.uint32), refusal=guards.no_refusal())

  def update_fn(updates, state, params=None, *, example_ids=None,
                batch_mask=None, **extra_args):
    del params, extra_args
    checks.state_type(state, FixedOrderGuardState, 'fixed_order_guard')
    if updates is None:
      raise ValueError('fixed_order_guard guards the updates of a private '
                       'estimator: place it after the estimator in the chain')
    if example_ids is None:
      raise ValueError(
          'the fixed-order check needs the ids of the batch examples: '
          'update(..., example_ids=indices) (e.g. the indices yielded by '
          'batching.FixedOrderBatches); its accounting assumes the same '
          'batches in the same order every epoch')
    ids, keep = _ids_and_mask(example_ids, batch_mask)
    fingerprint = batch_fingerprint(ids, keep, axis_name)
    # The whole batch, on every device: repeats across devices count.
    found = _check_ids(parallel.gather(ids, axis_name),
                       parallel.gather(keep, axis_name), state.seen,
                       num_examples)
    position = state.step % steps_per_epoch
    first_epoch = state.step < steps_per_epoch
    stored = state.fingerprints[position]
    changed = jnp.logical_and(~first_epoch, jnp.any(fingerprint != stored))
    seen_before = jnp.logical_and(first_epoch, found.seen_before)
    fingerprints = jnp.where(
        first_epoch, state.fingerprints.at[position].set(fingerprint),
        state.fingerprints)
    seen = jnp.where(first_epoch, found.seen, state.seen)
    where = 'a step'
    if not isinstance(changed, jax.core.Tracer):
      where = f'step {int(state.step)}'
    messages = (
        f'the batch at {where} holds an example id outside [0, '
        f'{num_examples}): ids must index the training set of num_examples '
        f'= {num_examples} examples.',
        f'the batch at {where} holds the same example id twice: the example '
        'would count twice in one clipped sum, which FixedOrder accounting '
        'does not assume (mask padding out with batch_mask).',
        f'the batch at {where} holds an example that an earlier batch of '
        'the first epoch already held: FixedOrder accounting assumes every '
        'example in one batch per epoch, at the same position every epoch. '
        'Use batching.FixedOrderBatches.',
        f'the batch at {where} is not the batch at the same position of the '
        f'first epoch (position = step mod {steps_per_epoch}): FixedOrder '
        'accounting assumes the same batches in the same order every epoch, '
        'and a pipeline that reshuffles between epochs invalidates it. Use '
        'batching.FixedOrderBatches, or account for the run as Shuffled.')
    updates, refusal = guards.record(
        list(zip((found.out_of_range, found.repeated, seen_before, changed),
                 messages)), updates, _record_of(state), state.step,
        kind='batch')
    return updates, FixedOrderGuardState(
        step=state.step + 1, fingerprints=fingerprints, seen=seen,
        refusal=refusal)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class EpochGuardState(NamedTuple):
  """State of `shuffled_order_guard`.

  Attributes:
    step: steps seen so far.
    seen: `[ceil(num_examples / 32)]` uint32, one bit per example that has
      taken part in the current epoch (cleared at each epoch's first step).
    refusal: the `guards.Refusal` record of the guard's checks: once set,
      every later update is NaN, and `guards.raise_if_refused` reports it.

  The bitmap is a function of which training examples were used: not
  noised, do not publish.
  """

  step: jax.Array
  seen: jax.Array
  refusal: Optional[guards.Refusal] = None


class PoissonGuardState(NamedTuple):
  """State of `poisson_batch_guard`.

  Attributes:
    step: steps seen so far.
    refusal: the `guards.Refusal` record of the guard's checks: once set,
      every later update is NaN, and `guards.raise_if_refused` reports it.
  """

  step: jax.Array
  refusal: Optional[guards.Refusal] = None


def _record_of(state) -> guards.Refusal:
  """A guard state's record (a clear one for a state made without it)."""
  return state.refusal if state.refusal is not None else guards.no_refusal()


def _require_updates_and_ids(updates, example_ids, guard: str,
                             accounted: str) -> None:
  if updates is None:
    raise ValueError(f'{guard} guards the updates of a private estimator: '
                     'place it after the estimator in the chain')
  if example_ids is None:
    raise ValueError(
        f'{guard} needs the ids of the batch examples: update(..., '
        f'example_ids=indices) (the indices the run\'s sampler yielded); '
        f'the run is accounted as {accounted}')


def _gathered_ids(example_ids, batch_mask, axis_name):
  """The batch's ids and mask over every device (repeats across devices
  count)."""
  ids, keep = _ids_and_mask(example_ids, batch_mask)
  return parallel.gather(ids, axis_name), parallel.gather(keep, axis_name)


def _id_refusals(found: '_IdChecks', where: str, num_examples: int,
                 repeated_because: str) -> list[tuple[jax.Array, str]]:
  """The refusals every batch guard makes: ids out of range, ids repeated."""
  return [
      (found.out_of_range, f'the batch at {where} holds an example id '
       f'outside [0, {num_examples}).'),
      (found.repeated, f'the batch at {where} holds the same example id '
       f'twice{repeated_because}.'),
  ]


def _where(step: jax.Array) -> str:
  return ('a step' if isinstance(step, jax.core.Tracer) else
          f'step {int(step)}')


def shuffled_order_guard(
    steps_per_epoch: int,
    *,
    num_examples: int,
    batch_size: int,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Refuses batches that break the `Shuffled(k, b)` participation.

  `Shuffled(k, b)` accounting assumes every example in at most one batch of
  each epoch of b steps, at any position, and batches of the accounted
  size. The guard refuses (`dpsco_jax.guards`) a step whose batch holds an
  id outside `[0, num_examples)`, an id twice, an id an earlier batch of the
  same epoch held, or a number of examples other than `batch_size` (the
  padded ids `batch_mask` drops are not counted). With `axis_name` the ids
  of all devices are checked together.

  Example:
    >>> tx = optax.chain(
    ...     dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=T),
    ...     shuffled_order_guard(100, num_examples=50_000, batch_size=500),
    ...     optax.sgd(0.1))

  Args:
    steps_per_epoch: b.
    num_examples: the training set size the ids index.
    batch_size: examples per batch, as accounted.
    axis_name: the device axis when each device holds a shard of the batch.

  Returns:
    An `optax.GradientTransformationExtraArgs`: `update(updates, state,
    params=None, *, example_ids, batch_mask=None)`.
  """
  steps_per_epoch = checks.positive_int(steps_per_epoch, 'steps_per_epoch')
  num_examples = checks.positive_int(num_examples, 'num_examples')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  words = -(-num_examples // 32)

  def init_fn(params):
    del params
    return EpochGuardState(step=jnp.zeros((), jnp.int32),
                           seen=jnp.zeros((words,), jnp.uint32),
                           refusal=guards.no_refusal())

  def update_fn(updates, state, params=None, *, example_ids=None,
                batch_mask=None, **extra_args):
    del params, extra_args
    checks.state_type(state, EpochGuardState, 'shuffled_order_guard')
    _require_updates_and_ids(updates, example_ids, 'shuffled_order_guard',
                             'Shuffled (each example once per epoch)')
    ids, keep = _gathered_ids(example_ids, batch_mask, axis_name)
    epoch_start = state.step % steps_per_epoch == 0
    found = _check_ids(ids, keep, jnp.where(epoch_start, 0, state.seen),
                       num_examples)
    size = jnp.sum(keep)
    where = _where(state.step)
    updates, refusal = guards.record(_id_refusals(
        found, where, num_examples,
        ' (mask padding out with batch_mask)') + [
        (found.seen_before,
         f'the batch at {where} holds an example that an earlier batch of '
         'the same epoch held: Shuffled accounting assumes each example at '
         'most once per epoch. Use batching.ShuffledBatches.'),
        (size != batch_size,
         f'the batch at {where} has a number of examples other than the '
         f'{batch_size} the run is accounted for.'),
    ], updates, _record_of(state), state.step, kind='batch')
    return updates, EpochGuardState(step=state.step + 1, seen=found.seen,
                                    refusal=refusal)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def poisson_size_bound(num_examples: int, sampling_probability: float,
                       false_refusal: float = 1e-12) -> int:
  """The largest Poisson batch `poisson_batch_guard` accepts.

  The smallest m with `P(Binomial(n, q) > m) <= false_refusal`: a run
  that really samples with probability q is refused with probability at
  most `false_refusal` per step (and a refusal only stops the run; it never
  weakens privacy).

  Example:
    >>> poisson_size_bound(60_000, 0.01)   # about 600 + 7.1 * 24

  Args:
    num_examples: n.
    sampling_probability: q.
    false_refusal: the per-step probability of refusing a true Poisson batch.

  Returns:
    m, an int.
  """
  return int(stats.binom.isf(false_refusal, num_examples,
                             sampling_probability))


def poisson_batch_guard(
    *,
    num_examples: int,
    sampling_probability: float,
    pad_to_multiple: int,
    axis_name: Optional[str] = None,
    num_partitions: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """Refuses batches that a `PoissonBatches` sampler could not have made.

  Poisson accounting (`PoissonSampling(q, T)`) assumes each example in
  each batch independently with probability q, the noisy sum divided by the
  expected size `q n`. A fixed-size batch of 1,000 from 2,000 examples at
  q = 0.05 is not such a batch, and its epsilon is not the one accounted.
  The guard refuses a step

  * without `batch_mask` (Poisson batches are padded and masked), or whose
    padded size is not a multiple of `pad_to_multiple` (checked when the
    step is traced: the shape is static);
  * whose number of real examples exceeds `poisson_size_bound(n, q)` (a
    true Poisson batch does so with probability below 1e-12 per step);
  * holding an id outside `[0, num_examples)` or a real id twice;
  * with `num_partitions` (b, cyclic Poisson sampling,
    `CyclicPoissonBatches`): holding an example of another partition than
    `step mod b` (example i is in partition `i mod b`); the size bound is
    then that of one partition.

  It cannot tell a Poisson batch from another random batch of a plausible
  size: use `batching.PoissonBatches` (or a plan) to form them.

  Example:
    >>> batches = PoissonBatches(50_000, 0.01, num_steps=1000, seed=1)
    >>> guard = poisson_batch_guard(
    ...     num_examples=50_000, sampling_probability=0.01,
    ...     pad_to_multiple=batches.pad_to_multiple)

  Args:
    num_examples: n.
    sampling_probability: q.
    pad_to_multiple: the sampler's `pad_to_multiple`.
    axis_name: the device axis when each device holds a shard of the batch.
    num_partitions: b for cyclic Poisson sampling (None: plain Poisson).

  Returns:
    An `optax.GradientTransformationExtraArgs`: `update(updates, state,
    params=None, *, example_ids, batch_mask)`.
  """
  num_examples = checks.positive_int(num_examples, 'num_examples')
  pad_to_multiple = checks.positive_int(pad_to_multiple, 'pad_to_multiple')
  if not 0.0 < float(sampling_probability) <= 1.0:
    raise ValueError('sampling_probability must be in (0, 1], got '
                     f'{sampling_probability!r}')
  population = num_examples
  if num_partitions is not None:
    num_partitions = checks.positive_int(num_partitions, 'num_partitions')
    population = -(-num_examples // num_partitions)
  largest = poisson_size_bound(population, float(sampling_probability))

  def init_fn(params):
    del params
    return PoissonGuardState(step=jnp.zeros((), jnp.int32),
                             refusal=guards.no_refusal())

  def update_fn(updates, state, params=None, *, example_ids=None,
                batch_mask=None, **extra_args):
    del params, extra_args
    checks.state_type(state, PoissonGuardState, 'poisson_batch_guard')
    _require_updates_and_ids(updates, example_ids, 'poisson_batch_guard',
                             f'Poisson sampling at q = {sampling_probability}')
    if batch_mask is None:
      raise ValueError(
          'a Poisson-sampled run needs batch_mask: its batches are padded to '
          'a multiple of a fixed size and masked (batching.PoissonBatches '
          'yields (indices, mask)); a batch without a mask is not a Poisson '
          'batch')
    ids, keep = _gathered_ids(example_ids, batch_mask, axis_name)
    if ids.shape[0] % pad_to_multiple:
      raise ValueError(
          f'the batch is padded to {ids.shape[0]} entries, not a multiple of '
          f'{pad_to_multiple} (the sampler\'s pad_to_multiple): it was not '
          'formed by the Poisson sampler the run is accounted for')
    found = _check_ids(ids, keep, jnp.zeros((-(-num_examples // 32),),
                                            jnp.uint32), num_examples)
    where = _where(state.step)
    refusals = _id_refusals(
        found, where, num_examples,
        ': Poisson sampling includes an example at most once') + [
        (jnp.sum(keep) > largest,
         f'the batch at {where} holds more than {largest} examples, which a '
         f'Poisson batch at q = {sampling_probability} of {population} '
         'examples practically never does: it was not formed by Poisson '
         'sampling, and its epsilon is not the one accounted.'),
    ]
    if num_partitions is not None:
      partition = state.step % num_partitions
      refusals.append((
          jnp.any(keep & (ids % num_partitions != partition)),
          f'the batch at {where} holds an example of another partition than '
          f'step mod {num_partitions}: cyclic Poisson accounting assumes '
          'example i only in the steps t with t = i (mod b), at least b '
          'apart. Use batching.CyclicPoissonBatches.'))
    updates, refusal = guards.record(refusals, updates, _record_of(state),
                                     state.step, kind='batch')
    return updates, PoissonGuardState(step=state.step + 1, refusal=refusal)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def participation_guard(
    participation: accounting.Participation,
    *,
    num_examples: int,
    batch_size: Optional[int] = None,
    pad_to_multiple: Optional[int] = None,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """The in-step check of the batches an accounting assumes.

  `FixedOrder` -> `fixed_order_guard`; `Shuffled` -> `shuffled_order_guard`
  (needs `batch_size`); `PoissonSampling` and `CyclicPoissonSampling` ->
  `poisson_batch_guard` (needs `pad_to_multiple`).

  Example:
    >>> guard = participation_guard(sampler.participation, num_examples=n,
    ...                             batch_size=sampler.batch_size)

  Args:
    participation: the accounted participation pattern.
    num_examples: the training set size.
    batch_size: examples per batch (fixed-size patterns).
    pad_to_multiple: the Poisson sampler's padding multiple.
    axis_name: the device axis, or None.

  Returns:
    The guard transformation; chain it right after the private estimator.

  Raises:
    ValueError: if a needed argument is missing or the pattern is unknown.
  """
  if isinstance(participation, accounting.FixedOrder):
    return fixed_order_guard(participation.steps_per_epoch,
                             num_examples=num_examples, axis_name=axis_name)
  if isinstance(participation, accounting.Shuffled):
    if batch_size is None:
      raise ValueError('the Shuffled guard needs batch_size')
    return shuffled_order_guard(participation.steps_per_epoch,
                                num_examples=num_examples,
                                batch_size=batch_size, axis_name=axis_name)
  if isinstance(participation, (accounting.PoissonSampling,
                                accounting.CyclicPoissonSampling)):
    if pad_to_multiple is None:
      raise ValueError('the Poisson guard needs pad_to_multiple')
    return poisson_batch_guard(
        num_examples=num_examples,
        sampling_probability=participation.sampling_probability,
        pad_to_multiple=pad_to_multiple, axis_name=axis_name,
        num_partitions=getattr(participation, 'num_partitions', None))
  raise ValueError(f'unknown participation pattern {participation!r}')


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
