"""What a run releases, as the accounting states it.

* Participation patterns: how the batches were formed (`FixedOrder`,
  `Shuffled`, `PoissonSampling`, `CyclicPoissonSampling`; `single_epoch`);
  the module docstring of `dpsco_jax.accounting` says what each claims.
* `GaussianRelease`: a Gaussian mechanism run once on the training data
  besides the steps (private preprocessing), composed with them.
* `validate_epsilon_delta`: the checks every (epsilon, delta) target passes.

`dpsco_jax.accounting` re-exports every public name here.
"""

import dataclasses
import math
from typing import Optional, Union

from dpsco_jax import checks
from dpsco_jax import neighboring


@dataclasses.dataclass(frozen=True)
class _Epochs:
  """Participation over epochs of equally many steps.

  Attributes:
    num_epochs: k, passes over the data.
    steps_per_epoch: b, batches per epoch.
  """

  num_epochs: int
  steps_per_epoch: int

  @property
  def num_steps(self) -> int:
    return self.num_epochs * self.steps_per_epoch


@dataclasses.dataclass(frozen=True)
class FixedOrder(_Epochs):
  """Batches in a fixed public order, repeated every epoch ((k, b) pattern)."""


@dataclasses.dataclass(frozen=True)
class Shuffled(_Epochs):
  """Each example at most once per epoch, anywhere in the epoch."""


@dataclasses.dataclass(frozen=True)
class PoissonSampling:
  """Each example joins each batch independently with probability q.

  Attributes:
    sampling_probability: q in (0, 1].
    num_steps: number of steps.
  """

  sampling_probability: float
  num_steps: int


@dataclasses.dataclass(frozen=True)
class CyclicPoissonSampling:
  """Cyclic Poisson sampling over fixed partitions (Amplified BandMF).

  Example i belongs to partition `i mod num_partitions`; step t draws each
  example of partition `t mod num_partitions` independently with
  probability q. Any two steps one example can take part in are at least b
  = `num_partitions` apart (b-min-separation), and it takes part in at most
  `ceil(T / b)` of them, each with probability q (Choquette-Choo et al.
  2023, "(Amplified) banded matrix factorization").

  Attributes:
    sampling_probability: q in (0, 1].
    num_steps: T.
    num_partitions: b.
  """

  sampling_probability: float
  num_steps: int
  num_partitions: int

  @property
  def max_participations(self) -> int:
    """The most steps one partition (so one example) can take part in."""
    return -(-self.num_steps // self.num_partitions)


Participation = Union[FixedOrder, Shuffled, PoissonSampling,
                      CyclicPoissonSampling]


@dataclasses.dataclass(frozen=True)
class GaussianRelease:
  """A Gaussian mechanism run once on the training data besides the steps.

  Private preprocessing (`dpsco_jax.preprocessing.dp_standardization`: the
  features' mean and variance) releases statistics of the same examples
  the run trains on, so its privacy composes with the run's: every
  accounting function takes `releases=` and spends them together with the
  steps (`epsilon_spent`), calibrates the steps' noise to what they leave
  of the target (`calibrate_noise_multiplier`), and the ledger reports
  their epsilon from step 0 on.

  A Gaussian mechanism whose noise std is `noise_multiplier` times its l2
  sensitivity is `GaussianDpEvent(noise_multiplier)`, i.e. mu-GDP with
  `mu = 1 / noise_multiplier`; several compose to one with
  `mu^2 = sum 1 / noise_multiplier_i^2` (`releases_mu`).

  Example:
    >>> release = GaussianRelease('feature mean and variance', 40.0)
    >>> epsilon_spent(mech, z, participation, 1e-5, releases=[release])

  Attributes:
    name: what was released, for records.
    noise_multiplier: the noise std over the release's l2 sensitivity under
      `neighboring_relation`; finite and > 0.
    neighboring_relation: the relation its sensitivity was derived for (the
      value of a `neighboring.NeighboringRelation`); it must be the run's.
  """

  name: str
  noise_multiplier: float
  neighboring_relation: str = neighboring.NeighboringRelation.ADD_OR_REMOVE.value

  def __post_init__(self):
    value = checks.noise_multiplier(self.noise_multiplier,
                                    f'noise_multiplier of {self.name!r}')
    if value == 0.0:
      raise ValueError(f'the release {self.name!r} has no noise: it is not '
                       'private (epsilon inf); give it a noise multiplier > 0')
    object.__setattr__(self, 'noise_multiplier', value)
    object.__setattr__(self, 'neighboring_relation', neighboring.
                       NeighboringRelation(self.neighboring_relation).value)


def _releases(releases, relation=None) -> tuple:
  """The releases as a tuple, checked (and against the run's relation)."""
  releases = tuple(releases or ())
  for release in releases:
    if not isinstance(release, GaussianRelease):
      raise TypeError(f'releases must be GaussianRelease, got {release!r}')
    if relation is not None and release.neighboring_relation != (
        neighboring.NeighboringRelation(relation).value):
      raise ValueError(
          f'the release {release.name!r} was calibrated for '
          f'{release.neighboring_relation} neighbours, the run for '
          f'{neighboring.NeighboringRelation(relation).value}: its sensitivity '
          'would not be the one accounted; compute it for the run\'s relation')
  return releases


def releases_mu(releases) -> float:
  """The GDP parameter of the releases together: `sqrt(sum 1 / z_i^2)`.

  Example:
    >>> releases_mu([GaussianRelease('a', 3.0), GaussianRelease('b', 4.0)])
    0.4166...

  Args:
    releases: `GaussianRelease`s.

  Returns:
    mu (0 for none).
  """
  return math.sqrt(sum(release.noise_multiplier ** -2
                       for release in _releases(releases)))


def single_epoch(num_steps: int) -> FixedOrder:
  """Each example in at most one of `num_steps` steps (one pass).

  Args:
    num_steps: number of steps.

  Returns:
    `FixedOrder(1, num_steps)`.
  """
  return FixedOrder(num_epochs=1, steps_per_epoch=num_steps)


def validate_epsilon_delta(epsilon: Optional[float], delta: float) -> None:
  """Raises ValueError unless epsilon > 0 (when given) and 0 < delta < 1.

  Args:
    epsilon: target epsilon, or None when only delta is checked.
    delta: target delta.
  """
  if epsilon is not None and not (float(epsilon) > 0 and
                                  math.isfinite(float(epsilon))):
    raise ValueError(f'epsilon must be positive and finite, got {epsilon!r}')
  if not 0.0 < float(delta) < 1.0:
    raise ValueError(f'delta must be in (0, 1), got {delta!r}')


def _validate_participation(participation: Participation) -> None:
  if isinstance(participation, (FixedOrder, Shuffled)):
    checks.positive_int(participation.num_epochs, 'num_epochs')
    checks.positive_int(participation.steps_per_epoch, 'steps_per_epoch')
  elif isinstance(participation, (PoissonSampling, CyclicPoissonSampling)):
    checks.positive_int(participation.num_steps, 'num_steps')
    if isinstance(participation, CyclicPoissonSampling):
      checks.positive_int(participation.num_partitions, 'num_partitions')
    q = float(participation.sampling_probability)
    if not 0.0 < q <= 1.0:
      raise ValueError(f'sampling_probability must be in (0, 1], got {q!r}')
  else:
    raise ValueError(f'unknown participation pattern {participation!r}')
