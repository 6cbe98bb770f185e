"""The validated configs a plan is built from: one per concern every run shares.

The plan functions (`dpsco_jax.plans`) take flat keywords; each keyword
they share lives in ONE frozen config below, documented and validated
there, and `from_keywords` gathers a plan function's keywords into them:

* `PrivacyTarget`: epsilon or a given noise, delta, accounting method,
  neighbouring relation and earlier releases of the same data;
* `Sampling`: how batches are drawn (sampling, data size, batch size,
  epochs, seed);
* `Clipping`: the clip norm and how the clipped statistic is computed
  (microbatches, clipping path, physical batches);
* `Devices`: the device axis;
* `NoiseKey`: the key the noise is drawn from.

Adding an option shared by the plans is a field of one config (its doc and
check included) and a keyword in the signatures of the plans that offer
it; `from_keywords` passes it on.

    privacy, clip = plan_config.from_keywords(
        dict(epsilon=2.0, delta=1e-5, l2_clip=1.0),
        plan_config.PrivacyTarget, plan_config.Clipping)
"""

import dataclasses
import secrets
from typing import Any, Mapping, Optional, Sequence, Union

from dpsco_jax import accounting
from dpsco_jax import adaptive_clipping as adaptive_lib
from dpsco_jax import batching
from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import neighboring
from dpsco_jax import physical

Relation = neighboring.NeighboringRelation
Sampler = Union[batching.FixedOrderBatches, batching.ShuffledBatches,
                batching.PoissonBatches, batching.CyclicPoissonBatches]

SAMPLINGS = ('poisson', 'shuffled', 'fixed')


@dataclasses.dataclass(frozen=True)
class PrivacyTarget:
  """What the run must guarantee, and how it is accounted.

  Exactly one of `epsilon` (the noise is calibrated to it) and
  `noise_multiplier` (its epsilon is computed).

  Example:
    >>> target = PrivacyTarget(delta=1e-5, epsilon=2.0)

  Attributes:
    delta: the run's delta, in (0, 1).
    epsilon: target epsilon (or give `noise_multiplier`).
    noise_multiplier: the noise to use (or give `epsilon`): noise std over
      one step's sensitivity; for DIFF2-accounted plans, their
      `Diff2NoiseMultipliers` (the keyword `noise_multipliers`).
    method: accounting method (`accounting.METHODS`; 'gdp_paper' is the
      papers' route for the SRG plans; None: the family's default).
    neighboring_relation: the relation the noise is calibrated for (None:
      the family's default, e.g. add/remove under Poisson sampling and
      zero-out for a fixed or shuffled order, whose accounting assumes it;
      add/remove is refused there).
    releases: private preprocessing of the same data
      (`preprocessing.dp_standardization(...).release`): the noise is
      calibrated to what they leave of `epsilon`, and the ledger and
      `epsilon_at` spend them from step 0 on.

  Raises:
    ValueError: for both or neither of epsilon and noise_multiplier, or an
      epsilon or delta out of range.
  """

  delta: float
  epsilon: Optional[float] = None
  noise_multiplier: Any = None
  method: Optional[str] = 'pld'
  neighboring_relation: Optional[Relation] = None
  releases: Sequence[accounting.GaussianRelease] = ()

  def __post_init__(self):
    if (self.epsilon is None) == (self.noise_multiplier is None):
      raise ValueError('give exactly one of epsilon= (the noise is '
                       'calibrated to it) and noise_multiplier= (its epsilon '
                       'is computed)')
    accounting.validate_epsilon_delta(self.epsilon, self.delta)
    object.__setattr__(self, 'releases', tuple(self.releases or ()))

  def warn_for(self, num_units: int, unit: str = 'example') -> None:
    """Warns if delta means little for `num_units` privacy units.

    Example:
      >>> target.warn_for(60_000)

    Args:
      num_units: the number of examples (or users) protected.
      unit: what one unit is, for the warning.
    """
    checks.warn_large_delta(self.delta, num_units, unit)

  @property
  def target_epsilon(self) -> Optional[float]:
    """The epsilon asked for as a float, or None when the noise was given."""
    return None if self.epsilon is None else float(self.epsilon)

  def relation(self, default: Relation) -> Relation:
    """The neighbouring relation, `default` when none was given.

    Example:
      >>> target.relation(Relation.ZERO_OUT)

    Args:
      default: the family's relation.

    Returns:
      A `NeighboringRelation`.
    """
    return Relation(default if self.neighboring_relation is None
                    else self.neighboring_relation)


def fresh_seed(seed: Optional[int]) -> int:
  """The sampler seed: given, or fresh from OS entropy.

  It decides who is in which batch, so a guessable one would weaken nothing
  accounted but leak the batches: keep it as private as the data.

  Example:
    >>> fresh_seed(None)

  Args:
    seed: an int, or None.

  Returns:
    An int seed.
  """
  return secrets.randbits(63) if seed is None else int(seed)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the batches the accounting describes are drawn.

  Example:
    >>> Sampling(num_examples=600, batch_size=60, epochs=2).sampler()

  Attributes:
    num_examples: training set size n (users, for a user-level plan).
    batch_size: examples per batch (the expected size under Poisson
      sampling).
    epochs: passes over the data (expected passes under Poisson sampling).
    sampling: 'poisson' (every example joins each of
      `round(epochs * n / batch_size)` batches with probability
      `batch_size / n`: amplified accounting, the noisy sum divided by the
      expected batch size), 'shuffled' (reshuffled every epoch) or 'fixed'
      (one public order; no amplification claimed for either, each
      `epochs * (n // batch_size)` steps of full batches). The MF plans
      also take 'cyclic_poisson' (`plans.dpmemf`).
    seed: the sampler's seed (None: fresh from OS entropy; it decides which
      examples are in which batch: keep it private).

  Raises:
    ValueError: for a size that is not a positive int, or a batch larger
      than the data set.
  """

  num_examples: int
  batch_size: int
  epochs: int = 1
  sampling: str = 'poisson'
  seed: Optional[int] = None

  def __post_init__(self):
    for name in ('num_examples', 'batch_size', 'epochs'):
      object.__setattr__(self, name,
                         checks.positive_int(getattr(self, name), name))
    if self.batch_size > self.num_examples:
      raise ValueError(f'batch_size {self.batch_size} exceeds num_examples '
                       f'{self.num_examples}')

  def sampler(self) -> Sampler:
    """The batch sampler (a fresh seed drawn here when none was given).

    Example:
      >>> sampler = Sampling(600, 60, 2, 'fixed', seed=0).sampler()

    Returns:
      `FixedOrderBatches`, `ShuffledBatches` or `PoissonBatches`.

    Raises:
      ValueError: for a `sampling` not in `SAMPLINGS`.
    """
    n, size, epochs = self.num_examples, self.batch_size, self.epochs
    if self.sampling == 'fixed':
      return batching.FixedOrderBatches(n, size, epochs,
                                        seed=fresh_seed(self.seed))
    if self.sampling == 'shuffled':
      return batching.ShuffledBatches(n, size, epochs,
                                      seed=fresh_seed(self.seed))
    if self.sampling == 'poisson':
      # As many expected passes: T q = epochs.
      steps = max(1, round(epochs * n / size))
      return batching.PoissonBatches(n, size / n, steps,
                                     fresh_seed(self.seed))
    raise ValueError(f'sampling must be one of {SAMPLINGS}, got '
                     f'{self.sampling!r}')


def normalize_by(sampler: Sampler) -> float:
  """The public batch size a sampler's noisy sums are divided by.

  Example:
    >>> normalize_by(Sampling(600, 60).sampler())
    60.0

  Args:
    sampler: a batch sampler.

  Returns:
    The expected batch size under Poisson sampling, else the batch size.
  """
  if isinstance(sampler, (batching.PoissonBatches,
                          batching.CyclicPoissonBatches)):
    return sampler.expected_batch_size
  return float(sampler.batch_size)


@dataclasses.dataclass(frozen=True)
class Clipping:
  """The clip norm and how the clipped statistic is computed.

  Example:
    >>> clip = Clipping(l2_clip=1.0, physical_batch_size=64)

  Attributes:
    l2_clip: clip norm of each per-example value (gradient, or gradient
      difference for the SRG plans, user mean gradient for user-level
      plans, C_1 for the DIFF2 plans' `grad_clip`); None for the nonsmooth
      plans, whose clips are derived (`smoothing.effective_clips`).
    microbatch_size: optional cap on per-example values held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    physical_batch_size: run each logical batch as physical batches of at
      most this many examples, noised once (`Plan.step`,
      `dpsco_jax.physical`): Poisson batches at the cost of their realized
      size, and logical batches larger than memory; for the SRG plans the
      clipped differences at the query point x_t (the params) and at
      x_{t-1} (the state's). None (default): one call per batch only.
    automatic_clipping: None (default: clip to `l2_clip`), or the stability
      constant r >= 0 of automatic clipping (Bu et al., NeurIPS 2023): each
      contribution g is scaled to `l2_clip * g / (||g|| + r)`, no clip to
      tune (`l2_clip` only rescales the step), the same sensitivity
      (`clipping.ClippedStatistic.automatic_clipping`). Offered by the
      plans of DP-SGD, DP-FTRL, DP-MEMF and user-level DP-SGD.
    adaptive_clipping: None (default: a fixed clip), or an
      `adaptive_clipping.AdaptiveClipping`: `l2_clip` is the initial clip,
      which then follows a private quantile of the norms (Andrew et al.,
      NeurIPS 2021); the count it needs is noised from the same privacy
      budget (one Gaussian mechanism of the calibrated multiplier, the
      sum's share larger), so the plan's epsilon is unchanged. Needs noise
      independent across steps: offered by the plans of DP-SGD,
      user-level DP-SGD, DP-GD (C_1) and DIFF2-GD (the difference clip
      C_2, adapted on difference rounds only).
  """

  l2_clip: Optional[float] = None
  microbatch_size: Optional[int] = None
  clipping_method: str = 'auto'
  physical_batch_size: Optional[int] = None
  automatic_clipping: Optional[float] = None
  adaptive_clipping: Optional[Any] = None

  def __post_init__(self):
    object.__setattr__(self, 'automatic_clipping', clipping.validate_stability(
        self.automatic_clipping))
    if self.adaptive_clipping is not None:
      object.__setattr__(self, 'adaptive_clipping', adaptive_lib.validate(
          self.adaptive_clipping))

  @property
  def statistic_keywords(self) -> dict[str, Any]:
    """The keywords every private estimator takes from this config."""
    keywords = dict(microbatch_size=self.microbatch_size,
                    clipping_method=self.clipping_method)
    if self.automatic_clipping is not None:
      keywords['automatic_clipping'] = self.automatic_clipping
    return keywords

  @property
  def estimator_keywords(self) -> dict[str, Any]:
    """`statistic_keywords`, and `adaptive_clipping` when set (for the
    estimators that hold the clip: `estimators.noisy_gradient`,
    `noisy_statistic` and `algorithms.diff2.diff2_estimator`)."""
    keywords = self.statistic_keywords
    if self.adaptive_clipping is not None:
      keywords['adaptive_clipping'] = self.adaptive_clipping
    return keywords

  @property
  def hyperparameters(self) -> dict[str, Any]:
    """The clipping choices for a plan's run record (only those set, so
    that a plan without them describes itself as before)."""
    record = {}
    if self.automatic_clipping is not None:
      record['automatic_clipping'] = self.automatic_clipping
    if self.adaptive_clipping is not None:
      record['adaptive_clipping'] = dict(self.adaptive_clipping._asdict())
    return record

  def form(self, statistic: clipping.ClippedStatistic,
           devices: 'Devices') -> Optional[physical.PhysicalForm]:
    """The physical form of a statistic, or None without a physical size.

    Example:
      >>> clip.form(clipping.clipped_grad_sum(loss_fn, 1.0), Devices())

    Args:
      statistic: the clipped statistic the private estimator computes,
        built with this config.
      devices: the device axis the physical batches are sharded over.

    Returns:
      A `physical.PhysicalForm`, or None.
    """
    if self.physical_batch_size is None:
      return None
    return physical.statistic_form(statistic, self.physical_batch_size,
                                   axis_name=devices.axis_name)

  def gradient_form(self, loss_fn, devices: 'Devices'
                    ) -> Optional[physical.PhysicalForm]:
    """The physical form of `estimators.noisy_gradient` built with this config.

    Example:
      >>> clip.gradient_form(loss_fn, Devices())

    Args:
      loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
      devices: the device axis.

    Returns:
      A `physical.PhysicalForm`, or None without a physical size.
    """
    if self.physical_batch_size is None:
      return None
    return self.form(clipping.clipped_grad_sum(
        loss_fn, self.l2_clip, **self.statistic_keywords), devices)


@dataclasses.dataclass(frozen=True)
class Devices:
  """Where the run's batches are split.

  Example:
    >>> Devices(axis_name='batch')

  Attributes:
    axis_name: the device axis (`jax.pmap` / `jax.shard_map`) on several
      devices: clipped sums are summed over it before the noise, drawn
      once; for the DIFF2 plans, the client axis.
  """

  axis_name: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class NoiseKey:
  """The key the noise is drawn from.

  Example:
    >>> NoiseKey(key=0)

  Attributes:
    key: PRNG key or int seed of the noise, replicated across devices
      (None: fresh from OS entropy, `dpsco_jax.keys`; an int seed makes the
      noise known to anyone who knows it: never give one key to two runs).
  """

  key: estimators.KeyLike = None


def from_keywords(keywords: Mapping[str, Any], *configs: type) -> tuple:
  """The configs built from a plan function's keywords (its `locals()`).

  Each config takes the keywords named like its fields; a keyword a plan
  function does not offer keeps the config's default.

  Example:
    >>> privacy, clip = from_keywords(locals(), PrivacyTarget, Clipping)

  Args:
    keywords: the plan function's keyword values.
    *configs: the config classes to build.

  Returns:
    One instance per class, in order.
  """
  return tuple(config(**{
      field.name: keywords[field.name]
      for field in dataclasses.fields(config) if field.name in keywords})
               for config in configs)
