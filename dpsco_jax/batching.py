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
  of a fixed size with a mask, so only a few shapes are ever compiled.
"""

import dataclasses
import math
from typing import Iterator, Optional

import numpy as np

from dpsco_jax import accounting
from dpsco_jax import checks


@dataclasses.dataclass(frozen=True)
class _EpochBatches:
  """Fixed-size batches over `num_epochs` passes of `num_examples // batch_size`.

  The leftover `num_examples % batch_size` examples of an epoch are not used.

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

  @property
  def steps_per_epoch(self) -> int:
    return self.num_examples // self.batch_size

  @property
  def num_steps(self) -> int:
    return self.num_epochs * self.steps_per_epoch

  def _batches_of(self, order: np.ndarray) -> np.ndarray:
    used = self.steps_per_epoch * self.batch_size
    return order[:used].reshape(self.steps_per_epoch, self.batch_size)


@dataclasses.dataclass(frozen=True)
class FixedOrderBatches(_EpochBatches):
  """The same batches, in the same order, every epoch.

  The order is a permutation drawn once from `order_seed` (a public choice,
  made before seeing the data).

  Example:
    >>> batches = FixedOrderBatches(1000, batch_size=100, num_epochs=2)
    >>> batches.participation          # FixedOrder(2, 10)
    >>> for indices in batches: ...     # 20 arrays of 100 indices

  Attributes:
    order_seed: seed of the public order (None: natural order 0..n-1).
  """

  order_seed: Optional[int] = dataclasses.field(default=None, kw_only=True)

  @property
  def participation(self) -> accounting.FixedOrder:
    return accounting.FixedOrder(self.num_epochs, self.steps_per_epoch)

  def __iter__(self) -> Iterator[np.ndarray]:
    if self.order_seed is None:
      order = np.arange(self.num_examples)
    else:
      order = np.random.default_rng(self.order_seed).permutation(
          self.num_examples)
    batches = self._batches_of(order)
    for _ in range(self.num_epochs):
      yield from batches


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
    return accounting.Shuffled(self.num_epochs, self.steps_per_epoch)

  def __iter__(self) -> Iterator[np.ndarray]:
    rng = np.random.default_rng(self.seed)
    for _ in range(self.num_epochs):
      yield from self._batches_of(rng.permutation(self.num_examples))


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
    return self.sampling_probability * self.num_examples

  @property
  def participation(self) -> accounting.PoissonSampling:
    return accounting.PoissonSampling(self.sampling_probability,
                                      self.num_steps)

  def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(self.seed)
    for _ in range(self.num_steps):
      chosen = np.flatnonzero(
          rng.random(self.num_examples) < self.sampling_probability)
      size = max(1, -(-len(chosen) // self.pad_to_multiple)) * (
          self.pad_to_multiple)
      indices = np.zeros(size, dtype=np.int64)
      indices[:len(chosen)] = chosen
      mask = np.arange(size) < len(chosen)
      yield indices, mask
