"""Privacy accounting: epsilon spent and noise calibration for every mechanism.

The accounting follows how the batches were really formed, stated as a
participation pattern:

* `FixedOrder(num_epochs, steps_per_epoch)`: batches in a fixed public order,
  the same order every epoch; the example in batch j takes part at steps
  `j, b + j, ..., (k-1) b + j` (the (k, b)-participation of multi-epoch
  matrix factorization). `single_epoch(T)` is `FixedOrder(1, T)`.
* `Shuffled(num_epochs, steps_per_epoch)`: each example at most once per
  epoch, at a step that may change between epochs (a reshuffle); no
  amplification is claimed.
* `PoissonSampling(sampling_probability, num_steps)`: every example joins
  every batch independently with probability q (privacy amplification), for
  i.i.d. Gaussian noise only.
* `CyclicPoissonSampling(sampling_probability, num_steps, num_partitions)`:
  examples in b fixed partitions (example i in partition i mod b), step t
  samples partition t mod b with probability q: b-min-separation
  participation with amplification, for banded matrix-factorization noise
  (Amplified BandMF; `dp_event` states the events).

Without amplification every mechanism of `dpsco_jax.noise` is ONE Gaussian
mechanism `C x + z` on the whole stream: its sensitivity is derived from the
mechanism's encoder matrix `C` and the participation pattern
(`participation_sensitivity`), and the run is accounted as
`GaussianDpEvent(noise_multiplier / sensitivity)`. Poisson-sampled DP-SGD is
`SelfComposed(PoissonSampled(q, Gaussian(z)), T)`.

Methods (`method=`):

* 'pld' (default): `dp_accounting`'s privacy-loss-distribution accountant;
* 'rdp': `dp_accounting`'s Renyi accountant;
* 'zcdp': the papers' rho-zCDP route (paper 001 §2.4): a Gaussian with
  sensitivity s and std sigma is (s^2 / 2 sigma^2)-zCDP, which gives
  `(rho + 2 sqrt(rho log(1/delta)), delta)`-DP;
* 'gdp_paper': the papers' closed form (paper 001 Lemma 4.3 / §2.3, 000
  Cor 5.7): mu-GDP with `mu = epsilon / sqrt(2 ln(2.5 / delta))`, which gives
  (epsilon, delta/2)-DP and so (epsilon, delta)-DP; conservative. The
  sensitivity is the exact one derived from the encoder (for one tree,
  `sqrt(floor(log2 T) + 1)`), not the papers' bound `sqrt(1 + ceil(log2 T))`,
  which it never exceeds.

The noise multiplier is always the noise std over the sensitivity of ONE
step's clipped sum under the neighbouring relation the noise was calibrated
for (`ClippedStatistic.sensitivity(relation)`): the relation's factor is in
the noise, so the accountant sees a unit-sensitivity mechanism. It must be
finite and >= 0 under every method (`dpsco_jax.checks.noise_multiplier`);
0 is a Gaussian mechanism without noise, whose epsilon is `inf`.
"""

import contextlib
import dataclasses
import functools
import logging
import math
import warnings
from typing import Optional, Union

import dp_accounting
import numpy as np
from scipy import optimize
from scipy import stats

from dpsco_jax import checks
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise as noise_lib

METHODS = ('pld', 'rdp', 'zcdp', 'gdp_paper')


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


def participation_sensitivity(encoder: np.ndarray,
                              participation: Participation) -> float:
  """l2 sensitivity of `x -> C x` when one example changes.

  One example contributes a vector of norm <= 1 (after dividing by the
  per-step sensitivity) at each step it takes part in. With G = C^T C the
  squared sensitivity is the largest `sum_{s,t} |G[s, t]|` over the steps
  s, t one example can share. This is exact when those entries of G can be
  made non-negative by flipping the signs of the example's contributions:
  non-negative C (trees, identity, non-negative factorizations), strategies
  whose Gram is zero between steps an example shares (the orthogonality of
  `strategies.optimize_strategy`), and any C when an example takes part at
  most twice. Otherwise it is an upper bound, never an underestimate. For `Shuffled`, the worst step in each pair of epochs is
  taken, which is exact when G has no cross-epoch entries (e.g. trees
  restarted every epoch) and an upper bound otherwise.

  Args:
    encoder: `C`, shape `[rows, num_steps]`.
    participation: `FixedOrder` or `Shuffled`.

  Returns:
    The sensitivity in units of one step's sensitivity.

  Raises:
    ValueError: if the pattern's step count differs from the encoder's.
  """
  _validate_participation(participation)
  if isinstance(participation, (PoissonSampling, CyclicPoissonSampling)):
    raise ValueError('Poisson sampling has no fixed participation; it is '
                     'accounted by amplification instead')
  encoder = np.asarray(encoder, dtype=np.float64)
  k, b = participation.num_epochs, participation.steps_per_epoch
  if encoder.shape[1] != k * b:
    raise ValueError(
        f'the mechanism covers {encoder.shape[1]} steps but the participation '
        f'pattern has {k} x {b} = {k * b}')
  gram = np.abs(encoder.T @ encoder).reshape(k, b, k, b)
  if isinstance(participation, FixedOrder):
    # Example in batch j: steps (i*b + j) for every epoch i.
    per_batch = np.einsum('ijlj->j', gram)
    return float(np.sqrt(per_batch.max()))
  worst = gram.max(axis=(1, 3))
  return float(np.sqrt(worst.sum()))


def _encoder_for(mechanism: noise_lib.NoiseMechanism,
                 participation: Participation) -> np.ndarray:
  if mechanism.num_steps is None:
    return np.eye(participation.num_steps)
  if mechanism.num_steps != participation.num_steps:
    raise ValueError(
        f'the mechanism was built for {mechanism.num_steps} steps but the '
        f'participation pattern has {participation.num_steps}: account for '
        'exactly the steps the noise allows')
  return mechanism.encoder_matrix()


def _is_iid(mechanism: noise_lib.NoiseMechanism, steps: int) -> bool:
  if mechanism.num_steps is None or mechanism.name == 'gaussian':
    return mechanism.release == 'per_step'
  encoder = mechanism.encoder_matrix()
  return (mechanism.release == 'per_step' and encoder.shape == (steps, steps)
          and np.array_equal(encoder, np.eye(steps)))


def mechanism_sensitivity(mechanism: noise_lib.NoiseMechanism,
                          participation: Participation) -> float:
  """Sensitivity of a whole run of `mechanism` under `participation`.

  Args:
    mechanism: a noise mechanism.
    participation: `FixedOrder` or `Shuffled`.

  Returns:
    The run's l2 sensitivity in units of one step's sensitivity.
  """
  _validate_participation(participation)
  if isinstance(participation, CyclicPoissonSampling):
    return cyclic_poisson_structure(mechanism, participation)[0]
  if (not isinstance(participation, PoissonSampling) and
      participation.num_epochs == 1):
    # One participation per example: the largest column norm of C, exactly.
    # Mechanisms that know it spare building C (T x T for a long i.i.d. run).
    if (mechanism.num_steps is not None and
        mechanism.num_steps != participation.num_steps):
      _encoder_for(mechanism, participation)  # raises the mismatch error
    if mechanism.single_participation_sensitivity is not None:
      return float(mechanism.single_participation_sensitivity())
    encoder = np.asarray(_encoder_for(mechanism, participation), np.float64)
    return float(np.sqrt(np.max(np.sum(encoder ** 2, axis=0))))
  if (isinstance(participation, FixedOrder) and
      mechanism.fixed_order_sensitivity is not None and
      mechanism.num_steps == participation.num_steps):
    value = mechanism.fixed_order_sensitivity(participation.num_epochs,
                                              participation.steps_per_epoch)
    if value is not None:
      return float(value)
  return participation_sensitivity(_encoder_for(mechanism, participation),
                                   participation)


def dp_event(mechanism: noise_lib.NoiseMechanism, noise_multiplier: float,
             participation: Participation, releases=()
             ) -> dp_accounting.DpEvent:
  """The `dp_accounting` event of a whole run.

  Args:
    mechanism: the noise mechanism used by the run.
    noise_multiplier: node/step noise std over one step's sensitivity.
    participation: how batches were formed.
    releases: `GaussianRelease`s of the same data besides the steps.

  Returns:
    A `dp_accounting.DpEvent`: the steps' event, composed after the
    releases' `GaussianDpEvent`s when there are any.

  Raises:
    ValueError: for bad inputs (a negative, NaN or infinite noise
      multiplier among them), Poisson sampling with correlated noise (its
      amplification is not accounted here), or cyclic Poisson sampling with
      an encoder whose columns of one partition overlap
      (`cyclic_poisson_structure`).
  """
  _validate_participation(participation)
  noise_multiplier = checks.noise_multiplier(noise_multiplier)
  if isinstance(participation, PoissonSampling):
    if not _is_iid(mechanism, participation.num_steps):
      raise ValueError(
          'Poisson-sampling amplification is only accounted for i.i.d. '
          f'Gaussian noise, not {mechanism.name}; use FixedOrder or Shuffled')
    if (mechanism.num_steps is not None and
        mechanism.num_steps != participation.num_steps):
      raise ValueError('the mechanism and the participation pattern disagree '
                       'on the number of steps')
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            participation.sampling_probability,
            dp_accounting.GaussianDpEvent(noise_multiplier)),
        participation.num_steps)
  elif isinstance(participation, CyclicPoissonSampling):
    sensitivity, compositions = cyclic_poisson_structure(mechanism,
                                                         participation)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            participation.sampling_probability,
            dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity)),
        compositions)
  else:
    sensitivity = mechanism_sensitivity(mechanism, participation)
    event = dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity)
  releases = _releases(releases)
  if not releases:
    return event
  return dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(r.noise_multiplier) for r in releases]
      + [event])


@functools.lru_cache(maxsize=8)  # Each entry keeps its mechanism's encoder.
def cyclic_poisson_structure(mechanism: noise_lib.NoiseMechanism,
                             participation: CyclicPoissonSampling
                             ) -> tuple[float, int]:
  """What the amplified accounting of cyclic Poisson sampling needs.

  Amplified BandMF (Choquette-Choo et al. 2023, restated here): an
  example of partition j can only contribute at steps
  `S_j = {j, j + b, ...}`. If the encoder's columns for two distinct steps
  of `S_j` never share a non-zero row (true for a lower-triangular C with
  at most b bands), the rows of `C x + z` that depend on the example split
  into disjoint blocks, one per step of `S_j`; the block of step s is a
  Gaussian mechanism of sensitivity `||C e_s||` applied to a contribution
  that is present with probability q, independently across steps (Poisson
  coins), and the other rows are post-processing of what is common to both
  neighbours. The release is then the adaptive composition (rows are
  streamed, later batches may depend on earlier outputs) of at most
  `|S_j|` Poisson-subsampled Gaussians of noise multiplier
  `z / max_s ||C e_s||`: the `dp_accounting` event
  `SelfComposed(PoissonSampled(q, Gaussian(z / s)), m)`, m the largest
  number of non-zero columns of one partition (`ceil(T / b)` for a whole
  run; fewer for the prefix of a run, whose later columns are zero). This
  is DP-SGD's event with the same q for m steps. Valid under add/remove
  or zero-out neighbours of an example whose partition does not move
  (plans use zero-out: the data set keeps its size and order).

  Example:
    >>> cyclic_poisson_structure(noise.matrix_factorization(c),
    ...                          CyclicPoissonSampling(0.1, 100, 10))

  Args:
    mechanism: the noise mechanism (its `encoder_matrix()` is read).
    participation: the cyclic Poisson sampling.

  Returns:
    `(sensitivity, compositions)`: the largest column norm of C and m.

  Raises:
    ValueError: if two steps of one partition share a row of C (e.g. more
      than b bands): the blocks are not disjoint and this accounting does
      not hold.
  """
  _validate_participation(participation)
  encoder = np.asarray(_encoder_for(mechanism, participation), np.float64)
  steps, b = participation.num_steps, participation.num_partitions
  magnitude = np.abs(encoder)
  overlap = magnitude.T @ magnitude
  same_partition = np.equal.outer(np.arange(steps) % b, np.arange(steps) % b)
  np.fill_diagonal(same_partition, False)
  if np.any(overlap[same_partition] > 0):
    raise ValueError(
        f'{mechanism.name}: two steps of one partition (b = {b} apart) share '
        'a row of the encoder, so their noise is correlated and the '
        'amplified cyclic-Poisson accounting does not hold. Use a banded '
        f'strategy with at most {b} bands (optimize_strategy(..., bands=b)).')
  norms = np.sqrt(np.diag(overlap))
  used = norms > 0
  compositions = max(int(np.sum(used[j::b])) for j in range(min(b, steps)))
  return float(norms.max()), max(compositions, 1)


def tree_aggregation_event(noise_multiplier: float, num_steps: int,
                           restart_every: Optional[int] = None
                           ) -> dp_accounting.DpEvent:
  """`dp_accounting`'s own single-epoch tree event (RDP only).

  Each example in at most one step over all trees. Offered as an independent
  cross-check of `dp_event` for trees (they agree under RDP).

  Args:
    noise_multiplier: node noise std over one step's sensitivity.
    num_steps: total steps.
    restart_every: steps per tree (None: one tree).

  Returns:
    A `dp_accounting.SingleEpochTreeAggregationDpEvent`.

  Raises:
    ValueError: for a negative, NaN or infinite noise multiplier (the RDP
      accountant would report epsilon 0 for NaN) or a bad step count.
  """
  noise_multiplier = checks.noise_multiplier(noise_multiplier)
  num_steps = checks.positive_int(num_steps, 'num_steps')
  size = restart_every or num_steps
  counts = [size] * (num_steps // size)
  if num_steps % size:
    counts.append(num_steps % size)
  return dp_accounting.SingleEpochTreeAggregationDpEvent(noise_multiplier,
                                                         counts)


# PLD discretization: the default interval, and its size relative to the
# epsilon (bounded above by RDP's) beyond which it grows with the epsilon.
_PLD_INTERVAL = 1e-4
_PLD_RELATIVE_INTERVAL = 3e-6


def _accountant(method: str, relation: neighboring.NeighboringRelation,
                event: dp_accounting.DpEvent, pld_interval: float = 1e-4):
  if isinstance(event, dp_accounting.SingleEpochTreeAggregationDpEvent):
    return dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
  if isinstance(event, dp_accounting.ComposedDpEvent):
    # Releases first, the steps' event last (`dp_event`): the steps decide
    # the relation; a release's Gaussian is the same under each of them.
    event = event.events[-1]
  amplified = isinstance(event, dp_accounting.SelfComposedDpEvent)
  if amplified and neighboring.NeighboringRelation(relation) is (
      neighboring.NeighboringRelation.REPLACE_ONE):
    raise ValueError('Poisson sampling is accounted under add/remove (or '
                     'zero-out) neighbours, not replace-one')
  dp_relation = (neighboring.to_dp_accounting(relation) if amplified else
                 dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
  if method == 'pld':
    return dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_relation,
        value_discretization_interval=pld_interval)
  return dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_relation)


class _ExcludedOrderFilter(logging.Filter):
  """Drops dp_accounting's notes that it excluded an RDP order."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not ('failed to converge' in message and
                'Excluding this order' in message)


@contextlib.contextmanager
def quiet_excluded_orders():
  """Silences dp_accounting's "failed to converge ... Excluding this order".

  The RDP accountant evaluates many orders and drops those whose series
  does not converge (small orders at large noise and sampling rates); the
  epsilon is then the minimum over the orders that remain, which is still
  a valid bound. It says so with an absl warning per order and
  composition, dozens per calibration: by design, not a user-facing
  problem. Only those records are dropped, only inside the context.

  Example:
    >>> with quiet_excluded_orders():
    ...   accountant.compose(event).get_epsilon(delta)

  Yields:
    Nothing.
  """
  logger = logging.getLogger('absl')
  quiet = _ExcludedOrderFilter()
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


def _check_method(method: str, participation: Participation) -> None:
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}')
  if method in ('zcdp', 'gdp_paper') and isinstance(
      participation, (PoissonSampling, CyclicPoissonSampling)):
    raise ValueError(f"method '{method}' has no Poisson amplification; use "
                     "'pld' or 'rdp'")


def zcdp_epsilon(rho: float, delta: float) -> float:
  """(epsilon, delta) implied by rho-zCDP: `rho + 2 sqrt(rho log(1/delta))`.

  Args:
    rho: the zCDP parameter.
    delta: target delta.

  Returns:
    epsilon.
  """
  rho = checks.noise_multiplier(rho, 'rho')  # finite and >= 0
  validate_epsilon_delta(None, delta)
  return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def zcdp_rho(epsilon: float, delta: float) -> float:
  """The rho whose zCDP conversion gives exactly (epsilon, delta).

  Inverts `zcdp_epsilon`: `sqrt(rho) = sqrt(log(1/delta) + eps) -
  sqrt(log(1/delta))` (paper 001 §2.4: (0.1, 1e-6) -> 1.80304e-4).

  Args:
    epsilon: target epsilon.
    delta: target delta.

  Returns:
    rho.
  """
  validate_epsilon_delta(epsilon, delta)
  log_term = math.log(1.0 / delta)
  return (math.sqrt(log_term + epsilon) - math.sqrt(log_term)) ** 2


def paper_gdp_mu(epsilon: float, delta: float) -> float:
  """The papers' GDP parameter for (epsilon, delta): `eps / sqrt(2 ln(2.5/delta))`.

  Paper 001 §2.3 / Lemma 4.3 and paper 000 Cor 5.7/5.11: mu-GDP with this mu
  implies (epsilon, delta/2)-DP.

  Args:
    epsilon: target epsilon.
    delta: target delta.

  Returns:
    mu.
  """
  validate_epsilon_delta(epsilon, delta)
  return epsilon / math.sqrt(2.0 * math.log(2.5 / delta))


def gdp_delta(mu: float, epsilon: float) -> float:
  """Exact delta(epsilon) of mu-GDP (Dong, Roth, Su 2019).

  Args:
    mu: the GDP parameter.
    epsilon: the epsilon at which delta is evaluated.

  Returns:
    `Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`.

  Raises:
    ValueError: if mu is negative, NaN or infinite.
  """
  mu = checks.noise_multiplier(mu, 'mu')  # finite and >= 0
  if mu == 0.0:
    return 0.0  # 0-GDP is perfect privacy: delta 0 at every epsilon >= 0.
  return float(stats.norm.cdf(-epsilon / mu + mu / 2) -
               math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2))


def _closed_form_epsilon(method: str, sensitivity: float,
                         noise_multiplier: float, delta: float,
                         release_mu: float = 0.0) -> float:
  """epsilon of 'zcdp' or 'gdp_paper' for a run of this sensitivity, with
  releases of GDP parameter `release_mu` (Gaussians compose: mu^2 add)."""
  if noise_multiplier == 0:
    return math.inf
  mu = math.hypot(sensitivity / noise_multiplier, release_mu)
  if method == 'zcdp':
    return zcdp_epsilon(mu ** 2 / 2.0, delta)
  return mu * math.sqrt(2.0 * math.log(2.5 / delta))


@keywords.checked
def epsilon_spent(
    mechanism: noise_lib.NoiseMechanism,
    noise_multiplier: float,
    participation: Participation,
    delta: float,
    *,
    method: str = 'pld',
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    releases=(),
) -> float:
  """The epsilon of a whole run at `delta`.

  Example:
    >>> mech = noise.tree(num_steps=1600)
    >>> epsilon_spent(mech, 8.83, single_epoch(1600), delta=1e-6)

  Args:
    mechanism: the noise mechanism used by the run.
    noise_multiplier: noise std over one step's sensitivity; finite and
      >= 0 (0 means no noise).
    participation: how batches were formed.
    delta: target delta.
    method: 'pld', 'rdp', 'zcdp' or 'gdp_paper' (module docstring).
    neighboring_relation: the relation (matters only under Poisson sampling;
      otherwise it is already in the noise multiplier).
    releases: `GaussianRelease`s of the same data besides the steps (e.g.
      private preprocessing), spent together with them.

  Returns:
    epsilon. A noise multiplier of 0 (a Gaussian mechanism without noise)
    gives `inf` under every method.

  Raises:
    ValueError: for bad inputs: a noise multiplier that is negative, NaN or
      infinite (refused before any method runs, so all four agree), a bad
      delta, method or participation pattern.
  """
  # Checked here, not per method: the closed forms would otherwise turn a
  # negative multiplier into a negative (or mirrored) epsilon and NaN into
  # NaN, while the dp_accounting methods refuse it.
  noise_multiplier = checks.noise_multiplier(noise_multiplier)
  validate_epsilon_delta(None, delta)
  _check_method(method, participation)
  releases = _releases(releases, neighboring_relation)
  if method in ('zcdp', 'gdp_paper'):
    sensitivity = mechanism_sensitivity(mechanism, participation)
    return _closed_form_epsilon(method, sensitivity, noise_multiplier, delta,
                                releases_mu(releases))
  event = dp_event(mechanism, noise_multiplier, participation, releases)
  interval = _PLD_INTERVAL
  if method == 'pld' and noise_multiplier > 0:
    # The PLD's cost grows with the privacy loss it discretizes (12 s at
    # epsilon 460, minutes beyond 1,000 with the default interval): widen
    # the interval with the epsilon, bounded by RDP's (cheap). The PLD
    # stays pessimistic (an upper bound) at any interval, and below epsilon
    # 33 nothing changes.
    rdp = epsilon_spent(mechanism, noise_multiplier, participation, delta,
                        method='rdp',
                        neighboring_relation=neighboring_relation,
                        releases=releases)
    interval = max(_PLD_INTERVAL, _PLD_RELATIVE_INTERVAL * rdp)
  accountant = _accountant(method, neighboring_relation, event, interval)
  with quiet_excluded_orders():
    return float(accountant.compose(event).get_epsilon(delta))


@keywords.checked
def calibrate_noise_multiplier(
    mechanism: noise_lib.NoiseMechanism,
    participation: Participation,
    epsilon: float,
    delta: float,
    *,
    method: str = 'pld',
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    releases=(),
) -> float:
  """The smallest noise multiplier whose run is (epsilon, delta)-DP.

  Example:
    >>> mech = noise.gaussian(num_steps=1000)
    >>> z = calibrate_noise_multiplier(mech, PoissonSampling(0.01, 1000),
    ...                                epsilon=1.0, delta=1e-5)

  Args:
    mechanism: the noise mechanism the run will use.
    participation: how batches will be formed.
    epsilon: target epsilon (> 0).
    delta: target delta in (0, 1).
    method: 'pld', 'rdp', 'zcdp' or 'gdp_paper' (module docstring).
    neighboring_relation: see `epsilon_spent`.
    releases: `GaussianRelease`s of the same data besides the steps: the
      steps get what they leave of (epsilon, delta), so the whole run with
      them is (epsilon, delta)-DP.

  Returns:
    The noise multiplier (node/step noise std over one step's sensitivity),
    finite and > 0, and `epsilon_spent` of it (with the releases) under the
    same method is at most `epsilon`.

  Raises:
    ValueError: for bad inputs, or releases that alone spend `epsilon`.
  """
  validate_epsilon_delta(epsilon, delta)
  _check_method(method, participation)
  releases = _releases(releases, neighboring_relation)
  if releases:
    alone = releases_epsilon(releases, delta, method=method)
    if alone >= epsilon:
      raise ValueError(
          f'the releases {[r.name for r in releases]} alone spend epsilon '
          f'{alone:.4g} (method {method!r}), not less than the target '
          f'{epsilon}: nothing is left for the steps; give the releases more '
          'noise or the run a larger epsilon')
  if epsilon > checks.NOMINAL_EPSILON:
    warnings.warn(
        f'calibrating to epsilon = {epsilon:g}: a guarantee of e^{epsilon:g} '
        'bounds nothing in practice (the run is private in name only). The '
        'noise is calibrated as asked.', checks.NoPrivacyWarning,
        stacklevel=2)
  if method in ('zcdp', 'gdp_paper'):
    sensitivity = mechanism_sensitivity(mechanism, participation)
    mu = (math.sqrt(2.0 * zcdp_rho(epsilon, delta)) if method == 'zcdp'
          else paper_gdp_mu(epsilon, delta))
    # The steps get the rest of the Gaussian budget: mu^2 = mu_s^2 + mu_r^2.
    release_mu = releases_mu(releases)
    value = sensitivity / math.sqrt(mu ** 2 - release_mu ** 2)
    # The closed form inverts `epsilon_spent` exactly on paper, but rounding
    # can leave the multiplier an ulp too small (epsilon 2 + 2e-15 for a
    # target of 2): step up until the guarantee holds, as below.
    while _closed_form_epsilon(method, sensitivity, value, delta,
                               release_mu) > epsilon:
      value = math.nextafter(value, math.inf)
    return value

  @functools.lru_cache(maxsize=None)
  def gap(z: float) -> float:
    return epsilon_spent(mechanism, z, participation, delta, method=method,
                         neighboring_relation=neighboring_relation,
                         releases=releases) - epsilon

  # Bracket with the cheap RDP accountant first: PLD at a tiny multiplier
  # (huge epsilon) needs enormous memory, and RDP's multiplier is an upper
  # bound for PLD's. Without amplification the closed form is a good start.
  if method == 'rdp':
    upper = 1.0
    if not isinstance(participation,
                      (PoissonSampling, CyclicPoissonSampling)):
      with warnings.catch_warnings():  # Announced once, by the outer call.
        warnings.simplefilter('ignore', checks.NoPrivacyWarning)
        # Without the releases: only a start (the doubling below ends it).
        upper = calibrate_noise_multiplier(mechanism, participation, epsilon,
                                           delta, method='gdp_paper')
    while gap(upper) > 0:
      upper *= 2.0
    lower = upper / 2.0
    while lower > 1e-6 and gap(lower) <= 0:
      lower /= 2.0
  else:
    with warnings.catch_warnings():  # Announced once, by the outer call.
      warnings.simplefilter('ignore', checks.NoPrivacyWarning)
      try:
        upper = calibrate_noise_multiplier(
            mechanism, participation, epsilon, delta, method='rdp',
            neighboring_relation=neighboring_relation, releases=releases)
      except ValueError:
        if not releases:
          raise
        # The releases leave PLD some budget but RDP none: start without
        # them (a multiplier too small, doubled below).
        upper = calibrate_noise_multiplier(
            mechanism, participation, epsilon, delta, method='rdp',
            neighboring_relation=neighboring_relation)
    while gap(upper) > 0:
      upper *= 2.0
    lower = upper / 2.0
    while gap(lower) <= 0:
      lower /= 2.0
  value = optimize.brentq(gap, lower, upper, xtol=1e-6 * upper)
  # Brent's method may stop on either side of the target; step up until the
  # guarantee holds so the returned multiplier is never weaker than asked.
  while gap(value) > 0:
    value *= 1.0 + 1e-6
  return float(value)


def releases_epsilon(releases, delta: float, *, method: str = 'pld'
                     ) -> float:
  """The epsilon of `GaussianRelease`s alone (before any step is taken).

  Example:
    >>> releases_epsilon([GaussianRelease('mean', 20.0)], 1e-5)

  Args:
    releases: `GaussianRelease`s.
    delta: target delta.
    method: accounting method, as for the run they belong to.

  Returns:
    epsilon (0 for none).
  """
  releases = _releases(releases)
  validate_epsilon_delta(None, delta)
  _check_method(method, FixedOrder(1, 1))
  if not releases:
    return 0.0
  mu = releases_mu(releases)
  if method == 'zcdp':
    return zcdp_epsilon(mu ** 2 / 2.0, delta)
  if method == 'gdp_paper':
    return mu * math.sqrt(2.0 * math.log(2.5 / delta))
  event = dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(r.noise_multiplier) for r in releases])
  accountant = (dp_accounting.pld.PLDAccountant(
      value_discretization_interval=_PLD_INTERVAL) if method == 'pld'
                else dp_accounting.rdp.RdpAccountant())
  with quiet_excluded_orders():
    return float(accountant.compose(event).get_epsilon(delta))


def epsilon_for_gdp(mu: float, delta: float) -> float:
  """The smallest epsilon with mu-GDP => (epsilon, delta)-DP (exact).

  Args:
    mu: the GDP parameter.
    delta: target delta.

  Returns:
    epsilon.

  Raises:
    ValueError: if mu is negative, NaN or infinite, or delta is bad.
  """
  checks.noise_multiplier(mu, 'mu')
  validate_epsilon_delta(None, delta)
  if gdp_delta(mu, 0.0) <= delta:
    return 0.0
  upper = 1.0
  while gdp_delta(mu, upper) > delta:
    upper *= 2.0
  return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, upper,
                               xtol=1e-12))


def laplace_and_gaussian_delta(laplace_multiplier: float,
                               gaussian_multiplier: float,
                               epsilon: float) -> float:
  """delta(epsilon) of one Laplace release composed with one Gaussian release.

  Both multipliers are the noise scale over the release's l2 (Gaussian) or
  l1 (Laplace) sensitivity, the neighbouring relation already in the
  sensitivity (no subsampling, so the relation matters nowhere else). The
  PLD composition is an upper bound (pessimistic discretization). Used for
  the outlier-removal mean: a Laplace-noised score test and a
  Gaussian-noised mean (`dpsco_jax.outlier_removal`).

  Example:
    >>> laplace_and_gaussian_delta(4.0, 3.0, epsilon=1.0)

  Args:
    laplace_multiplier: Laplace scale over its sensitivity (> 0).
    gaussian_multiplier: Gaussian std over its sensitivity (>= 0).
    epsilon: the epsilon at which delta is wanted (> 0).

  Returns:
    delta, in [0, 1].
  """
  laplace_multiplier = checks.noise_multiplier(laplace_multiplier,
                                               'laplace_multiplier')
  gaussian_multiplier = checks.noise_multiplier(gaussian_multiplier,
                                                'gaussian_multiplier')
  validate_epsilon_delta(epsilon, 0.5)
  if laplace_multiplier == 0 or gaussian_multiplier == 0:
    return 1.0
  event = dp_accounting.ComposedDpEvent([
      dp_accounting.LaplaceDpEvent(laplace_multiplier),
      dp_accounting.GaussianDpEvent(gaussian_multiplier)])
  accountant = dp_accounting.pld.PLDAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
      value_discretization_interval=_PLD_INTERVAL)
  return float(accountant.compose(event).get_delta(epsilon))


def subsampled_gaussian_epsilon(noise_multiplier: float, num_steps: int,
                                population: int, sample_size: int,
                                delta: float) -> float:
  """epsilon of T Gaussian releases on fixed-size samples without replacement.

  Each step releases a function of `sample_size` records drawn without
  replacement from `population` (fresh each step), plus Gaussian noise
  `noise_multiplier` times its sensitivity under replace-one. Accounted by
  dp_accounting's RDP accountant (its sampled-without-replacement bound is
  for replace-one); with `sample_size == population` there is no sampling
  and the T releases compose exactly by the PLD.

  Example:
    >>> subsampled_gaussian_epsilon(2.0, 50, 10000, 3000, delta=1e-6)

  Args:
    noise_multiplier: noise std over the replace-one sensitivity (>= 0).
    num_steps: T.
    population: n, the records sampled from.
    sample_size: K <= n, the records per step.
    delta: target delta.

  Returns:
    epsilon (inf without noise).
  """
  noise_multiplier = checks.noise_multiplier(noise_multiplier)
  validate_epsilon_delta(None, delta)
  steps = checks.positive_int(num_steps, 'num_steps')
  population = checks.positive_int(population, 'population')
  sample_size = checks.positive_int(sample_size, 'sample_size')
  if sample_size > population:
    raise ValueError(f'sample_size ({sample_size}) exceeds population '
                     f'({population})')
  if noise_multiplier == 0:
    return math.inf
  gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
  if sample_size == population:
    accountant = dp_accounting.pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=_PLD_INTERVAL)
    event = dp_accounting.SelfComposedDpEvent(gaussian, steps)
  else:
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            population, sample_size, gaussian), steps)
  with quiet_excluded_orders():
    return float(accountant.compose(event).get_epsilon(delta))
