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

The pieces live in their own modules and are re-exported here:
`dpsco_jax.participation` (the patterns, `GaussianRelease`),
`dpsco_jax.dp_events` (sensitivities and `dp_event`) and
`dpsco_jax.closed_forms` (zCDP and GDP); this module computes the epsilon
spent and calibrates the noise.
"""

import contextlib
import functools
import logging
import math
import pickle
import warnings

import dp_accounting
from scipy import optimize

from dpsco_jax import checks
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise as noise_lib
# pylint: disable=unused-import
from dpsco_jax.closed_forms import _closed_form_epsilon
from dpsco_jax.closed_forms import _closed_form_multiplier
from dpsco_jax.closed_forms import epsilon_for_gdp
from dpsco_jax.closed_forms import gdp_delta
from dpsco_jax.closed_forms import paper_gdp_mu
from dpsco_jax.closed_forms import zcdp_epsilon
from dpsco_jax.closed_forms import zcdp_rho
from dpsco_jax.dp_events import cyclic_poisson_structure
from dpsco_jax.dp_events import dp_event
from dpsco_jax.dp_events import mechanism_sensitivity
from dpsco_jax.dp_events import participation_sensitivity
from dpsco_jax.dp_events import tree_aggregation_event
from dpsco_jax.participation import _releases
from dpsco_jax.participation import CyclicPoissonSampling
from dpsco_jax.participation import FixedOrder
from dpsco_jax.participation import GaussianRelease
from dpsco_jax.participation import Participation
from dpsco_jax.participation import PoissonSampling
from dpsco_jax.participation import releases_mu
from dpsco_jax.participation import Shuffled
from dpsco_jax.participation import single_epoch
from dpsco_jax.participation import validate_epsilon_delta
# pylint: enable=unused-import


METHODS = ('pld', 'rdp', 'zcdp', 'gdp_paper')


# PLD discretization: the default interval, and its size relative to the
# epsilon (bounded above by RDP's) beyond which it grows with the epsilon.
_PLD_INTERVAL = 1e-4
_PLD_RELATIVE_INTERVAL = 3e-6


def _accountant(method: str, relation: neighboring.NeighboringRelation,
                event: dp_accounting.DpEvent, pld_interval: float = 1e-4
                ) -> tuple[str, dp_accounting.NeighboringRelation, float]:
  """The accountant (`event_epsilon`'s method, relation, interval) of a run."""
  if isinstance(event, dp_accounting.SingleEpochTreeAggregationDpEvent):
    return ('rdp', dp_accounting.NeighboringRelation.REPLACE_SPECIAL,
            pld_interval)
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
  return method, dp_relation, pld_interval


def event_epsilon(event: dp_accounting.DpEvent, delta: float, *,
                  method: str = 'pld',
                  relation: dp_accounting.NeighboringRelation = (
                      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE),
                  pld_interval: float = _PLD_INTERVAL) -> float:
  """The epsilon at `delta` of a `dp_accounting` event, remembered.

  Every epsilon this library reports goes through here: a plan's epsilon,
  its describe(), its ledger and an auditor's report each ask for the same
  event at the same delta, and one PLD costs seconds. The answer is kept
  (the float alone) under the event itself, by its pickle: every float to
  the last bit and every step count, so two runs share an entry only when
  their events are equal.

  Example:
    >>> event_epsilon(dp_accounting.GaussianDpEvent(1.0), 1e-5)

  Args:
    event: the run's event.
    delta: target delta.
    method: 'pld' (`dp_accounting.pld.PLDAccountant`) or 'rdp'
      (`dp_accounting.rdp.RdpAccountant`).
    relation: the accountant's neighbouring relation.
    pld_interval: the PLD's value discretization interval.

  Returns:
    epsilon.
  """
  if method not in ('pld', 'rdp'):
    raise ValueError(f"method must be 'pld' or 'rdp', got {method!r}")
  return _event_epsilon(method, dp_accounting.NeighboringRelation(relation),
                        float(pld_interval), float(delta),
                        pickle.dumps(event))


@functools.lru_cache(maxsize=4096)
def _event_epsilon(method: str, relation: dp_accounting.NeighboringRelation,
                   pld_interval: float, delta: float, event_bytes: bytes
                   ) -> float:
  if method == 'pld':
    accountant = dp_accounting.pld.PLDAccountant(
        neighboring_relation=relation,
        value_discretization_interval=pld_interval)
  else:
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  with quiet_excluded_orders():
    return float(accountant.compose(pickle.loads(event_bytes))
                 .get_epsilon(delta))


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
  kind, relation, interval = _accountant(method, neighboring_relation, event,
                                         interval)
  return event_epsilon(event, delta, method=kind, relation=relation,
                       pld_interval=interval)


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
    return _closed_form_multiplier(
        method, mechanism_sensitivity(mechanism, participation), epsilon,
        delta, releases_mu(releases))

  @functools.lru_cache(maxsize=None)
  def gap(z: float) -> float:
    return epsilon_spent(mechanism, z, participation, delta, method=method,
                         neighboring_relation=neighboring_relation,
                         releases=releases) - epsilon

  # Bracket with the cheap RDP accountant first: PLD at a tiny multiplier
  # (huge epsilon) needs enormous memory, and RDP's multiplier is an upper
  # bound for PLD's.
  start = _calibration_start(mechanism, participation, epsilon, delta,
                             method, neighboring_relation, releases)
  lower, upper = _bracket(gap, start,
                          lowest=1e-6 if method == 'rdp' else -math.inf)
  value = optimize.brentq(gap, lower, upper, xtol=1e-6 * upper)
  # Brent's method may stop on either side of the target; step up until the
  # guarantee holds so the returned multiplier is never weaker than asked.
  while gap(value) > 0:
    value *= 1.0 + 1e-6
  return float(value)


def _calibration_start(mechanism: noise_lib.NoiseMechanism,
                       participation: Participation, epsilon: float,
                       delta: float, method: str,
                       neighboring_relation: neighboring.NeighboringRelation,
                       releases: tuple) -> float:
  """A first noise multiplier for the search of `calibrate_noise_multiplier`.

  Under 'rdp' the closed form (without amplification) is a good start, and
  1 otherwise; under 'pld' the RDP multiplier, an upper bound of PLD's.
  Warnings of a nominal epsilon are announced once, by the outer call.
  """
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', checks.NoPrivacyWarning)
    if method == 'rdp':
      if isinstance(participation, (PoissonSampling, CyclicPoissonSampling)):
        return 1.0
      # Without the releases: only a start (the doubling in `_bracket` ends
      # it).
      return calibrate_noise_multiplier(mechanism, participation, epsilon,
                                        delta, method='gdp_paper')
    try:
      return calibrate_noise_multiplier(
          mechanism, participation, epsilon, delta, method='rdp',
          neighboring_relation=neighboring_relation, releases=releases)
    except ValueError:
      if not releases:
        raise
      # The releases leave PLD some budget but RDP none: start without them
      # (a multiplier too small, doubled in `_bracket`).
      return calibrate_noise_multiplier(
          mechanism, participation, epsilon, delta, method='rdp',
          neighboring_relation=neighboring_relation)


def _bracket(gap, upper: float, lowest: float) -> tuple[float, float]:
  """`(lower, upper)` with `gap(upper) <= 0 < gap(lower)`, from a start.

  Doubles `upper` until its run is private enough, then halves from
  `upper / 2` until one is not (or `lower` is no longer above `lowest`).
  """
  while gap(upper) > 0:
    upper *= 2.0
  lower = upper / 2.0
  while lower > lowest and gap(lower) <= 0:
    lower /= 2.0
  return lower, upper


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
  return event_epsilon(event, delta, method=method)


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
    return event_epsilon(dp_accounting.SelfComposedDpEvent(gaussian, steps),
                         delta)
  return event_epsilon(
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.SampledWithoutReplacementDpEvent(
              population, sample_size, gaussian), steps), delta,
      method='rdp', relation=dp_accounting.NeighboringRelation.REPLACE_ONE)


__all__ = ('calibrate_noise_multiplier', 'cyclic_poisson_structure',
           'CyclicPoissonSampling', 'dp_event', 'epsilon_for_gdp',
           'event_epsilon',
           'epsilon_spent', 'FixedOrder', 'GaussianRelease', 'gdp_delta',
           'laplace_and_gaussian_delta', 'mechanism_sensitivity',
           'paper_gdp_mu', 'participation_sensitivity', 'PoissonSampling',
           'quiet_excluded_orders', 'releases_epsilon', 'releases_mu',
           'Shuffled', 'single_epoch', 'subsampled_gaussian_epsilon',
           'tree_aggregation_event', 'validate_epsilon_delta', 'zcdp_epsilon',
           'zcdp_rho')
