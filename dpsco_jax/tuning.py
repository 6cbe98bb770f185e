"""Private hyperparameter tuning: random search with a random number of trials.

Tuning the learning rate or the clip on the private data leaks that data
through the choice made; counting only the chosen run's epsilon leaves that
leak out. This module accounts for the whole search, following Papernot &
Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022,
arXiv:2110.03620; theorem numbers as in arXiv v2, which `dp_accounting`
cites too). The search (their Algorithm 1):

1. draw the number of trials K from a distribution fixed in advance, with a
   secret key (`dpsco_jax.keys`);
2. run K trials, each on a configuration drawn at random from the space and
   each a private run with the same noise multiplier (the trial's "Q", which
   is (lambda, epsilon(lambda))-RDP for every order lambda);
3. release ONLY the best trial (its configuration, score and output).

Distributions of K:

* `TruncatedNegativeBinomial(eta, gamma)` (their Definition 1), eta > -1,
  gamma in (0, 1), on {1, 2, ...}:
  `P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) * prod_{l=0}^{k-1} (l + eta) /
  (l + 1)` for eta != 0, and the logarithmic distribution
  `P[K = k] = (1 - gamma)^k / (k log(1/gamma))` at eta = 0. Its mean is
  `E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta))` (eta != 0) and
  `(1/gamma - 1) / log(1/gamma)` (eta = 0). eta = 1 is the geometric
  distribution `P[K = k] = gamma (1 - gamma)^(k-1)` of Liu & Talwar (STOC
  2019), mean 1/gamma (`geometric(mean)`).
* `Poisson(mean)` (their Section 3.3): K ~ Poisson(mu); K = 0 releases
  nothing (no best trial).
* `FixedTrials(count)`: exactly `count` trials, NOT a random-K search: its
  RDP is the composition of `count` trials, `count * epsilon(lambda)`
  (releasing the best of them is post-processing of all of them). The
  random-K bounds never apply to a fixed K.

RDP of the whole search, at every order lambda > 1 of a grid (`ORDERS`,
`dp_accounting`'s default orders), from the trial's RDP curve `epsilon(.)`
(`trial_rdp`, `dp_accounting`'s RDP accountant on the trial's DpEvent):

* Theorem 2 (truncated negative binomial): if Q is (lambda, epsilon)- and
  (lambda_hat, epsilon_hat)-RDP, lambda > 1, lambda_hat >= 1, the search is
  (lambda, epsilon')-RDP with

      epsilon' = epsilon + (1 + eta) (1 - 1/lambda_hat) epsilon_hat
                 + (1 + eta) log(1/gamma) / lambda_hat
                 + log(E[K]) / (lambda - 1).

  lambda_hat is free: it is chosen, for each lambda, to minimize the bound
  over the same grid of orders (the two middle terms do not depend on
  lambda, so one minimization serves every lambda).
* Theorem 6 (Poisson): if Q is (lambda, epsilon)-RDP and
  (epsilon_hat, delta_hat)-DP with `e^epsilon_hat <= 1 + 1/(lambda - 1)`,
  the search is (lambda, epsilon')-RDP with

      epsilon' = epsilon + mu delta_hat + log(mu) / (lambda - 1).

  delta_hat decreases in epsilon_hat, so epsilon_hat is the largest allowed,
  `log(1 + 1/(lambda - 1))`, and delta_hat is the trial's delta at it from
  its RDP curve (`dp_accounting.rdp.compute_delta`, the conversion below).

Both curves are then made non-decreasing in the order from above
(`epsilon'(lambda) <= epsilon'(lambda')` for lambda <= lambda': Renyi
divergences increase with the order, van Erven & Harremoes 2014, Theorem 3),
and converted to (epsilon, delta)-DP by the improved conversion of
Canonne, Kamath & Steinke (2020, Proposition 12 of arXiv:2004.00010v4), the
one `dp_accounting` uses, minimized over the orders:

    epsilon = min_lambda epsilon'(lambda) + log(1 - 1/lambda)
              - (log(delta) + log(lambda)) / (lambda - 1).

The same numbers come out of `dp_accounting`'s `RepeatAndSelectDpEvent` on
the same orders (an independent implementation, checked in the tests), which
is the search's event (`search_event`) for composing it with other releases.

What is private, and what is not: the guarantee covers the released best
trial only. The number of trials K and the other trials' outputs and scores
(`SearchResult.num_trials`, `SearchResult.trials`) are NOT covered: releasing
them too is a composition of K trials. The score that picks the best trial
must itself be private: computed from data the caller declares public
(`score_source='public'`), or released privately inside the trial
(`score_source='private_release'`, a `PrivateScore` whose event the trial's
accounted event contains, e.g. from `private_score`).
"""

import dataclasses
import json
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant
import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import keys
from dpsco_jax import neighboring

# The RDP orders of the bounds and of lambda_hat: dp_accounting's default
# grid (1.1 to 1024). Order 1 (KL) is left out: dp_accounting's subsampled
# Gaussian is not defined there.
ORDERS: tuple[float, ...] = tuple(
    float(order) for order in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)

SCORE_SOURCES = ('public', 'private_release')


# --------------------------------------------------------- distributions


def _uniform53(key: jax.Array) -> float:
  """A uniform float in [0, 1) with 53 random bits, from `key`.

  float32 uniforms have 24 bits: the tail of K beyond probability ~6e-8
  would never be drawn, so the draw is built from two 32-bit words.
  """
  words = np.asarray(jax.random.bits(key, (2,), jnp.uint32), dtype=np.uint64)
  return float(((int(words[0]) >> 5) * 67108864 + (int(words[1]) >> 6))
               / 9007199254740992.0)


def _inverse_cdf(uniform: float, first: int, probability: float,
                 ratio: Callable[[int], float]) -> int:
  """The smallest k >= first with P[K <= k] > uniform.

  `probability` is P[K = first] and `ratio(k)` is P[K = k+1] / P[K = k].
  The walk stops when the remaining mass is below float64 resolution (a tail
  of probability < 1e-16 is drawn as its first value).
  """
  k, cumulative = first, probability
  while uniform >= cumulative:
    probability *= ratio(k)
    if cumulative + probability == cumulative:
      break
    cumulative += probability
    k += 1
  return k


@dataclasses.dataclass(frozen=True)
class TruncatedNegativeBinomial:
  """The number of trials K ~ D_{eta, gamma} of Papernot & Steinke (2022).

  Definition 1 of the paper, on {1, 2, ...}: eta = 1 is geometric (Liu &
  Talwar 2019), eta = 0 logarithmic, larger eta concentrates K around its
  mean at a higher privacy cost (Theorem 2's factor 1 + eta).

  Example:
    >>> dist = TruncatedNegativeBinomial(eta=1.0, gamma=0.1)
    >>> dist.mean
    10.0

  Attributes:
    eta: the shape, > -1.
    gamma: the halting probability, in (0, 1).
  """

  eta: float
  gamma: float

  def __post_init__(self):
    if not (math.isfinite(self.eta) and self.eta > -1):
      raise ValueError(f'eta must be a finite number > -1, got {self.eta!r}')
    if not 0 < self.gamma < 1:
      raise ValueError(f'gamma must be in (0, 1), got {self.gamma!r}')

  @property
  def mean(self) -> float:
    """E[K] (Papernot & Steinke 2022, after Definition 1)."""
    if self.eta == 0:
      return (1 / self.gamma - 1) / math.log(1 / self.gamma)
    if self.eta == 1:  # Geometric: exactly 1/gamma.
      return 1 / self.gamma
    return (self.eta * (1 - self.gamma) /
            (self.gamma * -math.expm1(self.eta * math.log(self.gamma))))

  def pmf(self, k: int) -> float:
    """P[K = k] (Definition 1)."""
    if k < 1:
      return 0.0
    log_p = k * math.log1p(-self.gamma)
    if self.eta == 0:
      return math.exp(log_p - math.log(k) - math.log(math.log(1 / self.gamma)))
    # prod_{l<k} (l + eta) / (l + 1) = Gamma(k + eta) / (Gamma(eta) k!); for
    # eta in (-1, 0) Gamma(eta) and gamma^-eta - 1 are both negative, so
    # the signs cancel and the magnitudes are taken in log space.
    log_p += (math.lgamma(k + self.eta) - math.lgamma(self.eta) -
              math.lgamma(k + 1))
    return math.exp(log_p - math.log(abs(math.expm1(-self.eta *
                                                     math.log(self.gamma)))))

  def sample(self, key: jax.Array) -> int:
    """K drawn from the distribution with `key` (inverse CDF, float64)."""
    ratio = lambda k: (1 - self.gamma) * (k + self.eta) / (k + 1)
    return _inverse_cdf(_uniform53(key), 1, self.pmf(1), ratio)

  def describe(self) -> dict[str, Any]:
    """The distribution as JSON values."""
    return {'name': 'truncated_negative_binomial', 'eta': self.eta,
            'gamma': self.gamma, 'mean': self.mean}


def geometric(mean: float) -> TruncatedNegativeBinomial:
  """K geometric with the given mean (Liu & Talwar 2019): D_{1, 1/mean}.

  Example:
    >>> geometric(10.0).gamma
    0.1

  Args:
    mean: E[K], > 1.

  Returns:
    `TruncatedNegativeBinomial(eta=1, gamma=1/mean)`.
  """
  if not mean > 1:
    raise ValueError(f'mean must be > 1, got {mean!r}')
  return TruncatedNegativeBinomial(eta=1.0, gamma=1.0 / mean)


def truncated_negative_binomial(eta: float, mean: float
                                ) -> TruncatedNegativeBinomial:
  """D_{eta, gamma} with gamma set so that E[K] is `mean` (to 1e-10).

  E[K] decreases in gamma, from infinity at 0 to 1 at 1: bisection. The
  accounting uses the gamma found, so the bound is exact for it.

  Example:
    >>> truncated_negative_binomial(eta=0.0, mean=10.0).gamma

  Args:
    eta: the shape, > -1.
    mean: the mean number of trials, > 1.

  Returns:
    A `TruncatedNegativeBinomial`.

  Raises:
    ValueError: for eta <= -1 or a mean <= 1.
  """
  if not (math.isfinite(mean) and mean > 1):
    raise ValueError(f'mean must be a finite number > 1, got {mean!r}')
  TruncatedNegativeBinomial(eta, 0.5)  # Checks eta.
  lower, upper = 0.0, 1.0
  while upper - lower > 1e-12 * upper:
    gamma = 0.5 * (lower + upper)
    if TruncatedNegativeBinomial(eta, gamma).mean > mean:
      lower = gamma
    else:
      upper = gamma
  return TruncatedNegativeBinomial(eta, 0.5 * (lower + upper))


@dataclasses.dataclass(frozen=True)
class Poisson:
  """The number of trials K ~ Poisson(mean) (Papernot & Steinke 2022, §3.3).

  K = 0 happens (probability e^-mean): the search then releases nothing.

  Example:
    >>> Poisson(mean=10.0).pmf(0)
    4.5399929762484854e-05

  Attributes:
    mean: mu > 0.
  """

  mean: float

  def __post_init__(self):
    if not (math.isfinite(self.mean) and self.mean > 0):
      raise ValueError(f'mean must be a finite number > 0, got {self.mean!r}')

  def pmf(self, k: int) -> float:
    """P[K = k] = e^-mu mu^k / k!."""
    if k < 0:
      return 0.0
    return math.exp(-self.mean + k * math.log(self.mean) - math.lgamma(k + 1))

  def sample(self, key: jax.Array) -> int:
    """K drawn from the distribution with `key` (inverse CDF, float64)."""
    ratio = lambda k: self.mean / (k + 1)
    return _inverse_cdf(_uniform53(key), 0, self.pmf(0), ratio)

  def describe(self) -> dict[str, Any]:
    """The distribution as JSON values."""
    return {'name': 'poisson', 'mean': self.mean}


@dataclasses.dataclass(frozen=True)
class FixedTrials:
  """Exactly `count` trials: accounted as their composition, never as random.

  Example:
    >>> FixedTrials(5).mean
    5.0

  Attributes:
    count: the number of trials, >= 1.
  """

  count: int

  def __post_init__(self):
    checks.positive_int(self.count, 'count')

  @property
  def mean(self) -> float:
    """The number of trials, as a float."""
    return float(self.count)

  def sample(self, key: jax.Array) -> int:
    """`count` (the key is not used)."""
    del key
    return int(self.count)

  def describe(self) -> dict[str, Any]:
    """The distribution as JSON values."""
    return {'name': 'fixed', 'count': int(self.count)}


Distribution = Union[TruncatedNegativeBinomial, Poisson, FixedTrials]
_DISTRIBUTIONS = (TruncatedNegativeBinomial, Poisson, FixedTrials)


def _check_distribution(distribution: Any) -> None:
  # The exact classes: a subclass could draw K its own way (a forced K)
  # while declaring the parameters that were accounted.
  if type(distribution) not in _DISTRIBUTIONS:  # pylint: disable=unidiomatic-typecheck
    raise TypeError(
        'distribution must be a dpsco_jax.tuning TruncatedNegativeBinomial, '
        f'Poisson or FixedTrials, got {type(distribution).__name__}: the '
        'accounting holds only for K drawn by the library from the declared '
        'distribution')


# ------------------------------------------------------------ accounting


def trial_rdp(event: dp_accounting.DpEvent, *,
              orders: Sequence[float] = ORDERS,
              neighboring_relation: neighboring.NeighboringRelation = (
                  neighboring.NeighboringRelation.ADD_OR_REMOVE)
              ) -> np.ndarray:
  """The RDP curve epsilon(lambda) of one trial, from its DpEvent.

  The accountant is the one `dpsco_jax.accounting` picks for the event and
  relation (tree aggregation under replace-special, Poisson sampling under
  the relation given), on `orders`. An order where dp_accounting's series
  does not converge (NaN) counts as infinite: never used.

  Example:
    >>> rdp = trial_rdp(dp_accounting.GaussianDpEvent(2.0))

  Args:
    event: the trial's event (`plan.event`).
    orders: the Renyi orders, each >= 1.
    neighboring_relation: the relation the trial is private under.

  Returns:
    An array of epsilon(lambda), one per order.

  Raises:
    ValueError: if dp_accounting cannot account for the event.
  """
  with accounting.quiet_excluded_orders():
    _, relation, _ = accounting._accountant('rdp', neighboring_relation, event)  # pylint: disable=protected-access
    accountant = rdp_privacy_accountant.RdpAccountant(
        orders=list(orders), neighboring_relation=relation)
    accountant.compose(event)
  rdp = accountant.rdp
  return np.where(np.isnan(rdp), np.inf, rdp)


def _monotone_from_above(rdp: np.ndarray, orders: np.ndarray) -> np.ndarray:
  """min over orders >= lambda: RDP is non-decreasing in the order."""
  order = np.argsort(orders)
  bounded = np.minimum.accumulate(rdp[order][::-1])[::-1]
  out = np.empty_like(rdp)
  out[order] = bounded
  return out


def search_rdp(distribution: Distribution, rdp: Sequence[float], *,
               orders: Sequence[float] = ORDERS) -> np.ndarray:
  """The RDP curve of the whole search from one trial's RDP curve.

  Theorem 2 (truncated negative binomial, lambda_hat minimized over
  `orders`), Theorem 6 (Poisson, epsilon_hat = log(1 + 1/(lambda - 1))) of
  Papernot & Steinke (2022), or composition for `FixedTrials`; then made
  non-decreasing from above (module docstring). Orders <= 1 get their value
  from the orders above them.

  Example:
    >>> rdp = trial_rdp(dp_accounting.GaussianDpEvent(4.0))
    >>> whole = search_rdp(geometric(10.0), rdp)

  Args:
    distribution: the distribution of K.
    rdp: the trial's epsilon(lambda) at `orders` (`trial_rdp`).
    orders: the orders of `rdp`, each >= 1.

  Returns:
    The search's epsilon'(lambda) at `orders`.

  Raises:
    TypeError: for a distribution that is not one of this module's.
    ValueError: if `rdp` and `orders` differ in length.
  """
  _check_distribution(distribution)
  orders = np.asarray(orders, dtype=np.float64)
  rdp = np.asarray(rdp, dtype=np.float64)
  if rdp.shape != orders.shape:
    raise ValueError(f'{rdp.size} RDP values for {orders.size} orders')
  if np.any(orders < 1):
    raise ValueError('Renyi orders must be >= 1')
  if isinstance(distribution, FixedTrials):
    return distribution.count * rdp
  above_one = orders > 1
  out = np.full_like(rdp, np.inf)
  with np.errstate(divide='ignore', invalid='ignore'):
    if isinstance(distribution, TruncatedNegativeBinomial):
      eta, gamma = distribution.eta, distribution.gamma
      # Theorem 2's terms in lambda_hat, minimized over the grid.
      hat_terms = ((1 + eta) * (1 - 1 / orders) * rdp
                   + (1 + eta) * math.log(1 / gamma) / orders)
      hat_terms = np.where(np.isfinite(rdp), hat_terms, np.inf)
      out[above_one] = (rdp[above_one] + np.min(hat_terms) +
                        math.log(distribution.mean) / (orders[above_one] - 1))
    else:
      mu = distribution.mean
      for i in np.flatnonzero(above_one):
        epsilon_hat = math.log1p(1 / (orders[i] - 1))
        delta_hat, _ = rdp_privacy_accountant.compute_delta(orders, rdp,
                                                            epsilon_hat)
        out[i] = rdp[i] + mu * delta_hat + math.log(mu) / (orders[i] - 1)
  out = np.where(np.isnan(out), np.inf, out)
  return _monotone_from_above(out, orders)


def search_event(distribution: Distribution,
                 trial_event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
  """The whole search as a dp_accounting event (to compose with others).

  `RepeatAndSelectDpEvent(trial_event, mean, shape)` (shape eta, or inf for
  Poisson) for a random K; `SelfComposedDpEvent(trial_event, count)` for
  `FixedTrials`. dp_accounting's RDP accountant reads it with the same
  theorems (it recovers gamma from the mean by bisection, conservatively).
  Its shape must be >= 0: for eta in (-1, 0) dp_accounting refuses the
  event; `search_epsilon` accounts for it.

  Example:
    >>> search_event(geometric(10.0), dp_accounting.GaussianDpEvent(4.0))

  Args:
    distribution: the distribution of K.
    trial_event: one trial's event.

  Returns:
    A DpEvent.
  """
  _check_distribution(distribution)
  if isinstance(distribution, FixedTrials):
    return dp_accounting.SelfComposedDpEvent(trial_event, distribution.count)
  shape = (math.inf if isinstance(distribution, Poisson)
           else distribution.eta)
  return dp_accounting.dp_event.RepeatAndSelectDpEvent(
      trial_event, distribution.mean, shape)


def _method(distribution: Distribution) -> str:
  if isinstance(distribution, TruncatedNegativeBinomial):
    return 'rdp: Papernot & Steinke 2022, Theorem 2'
  if isinstance(distribution, Poisson):
    return 'rdp: Papernot & Steinke 2022, Theorem 6'
  return 'rdp: composition of the trials'


def search_epsilon(distribution: Distribution,
                   trial_event: dp_accounting.DpEvent, delta: float, *,
                   orders: Sequence[float] = ORDERS,
                   neighboring_relation: neighboring.NeighboringRelation = (
                       neighboring.NeighboringRelation.ADD_OR_REMOVE)
                   ) -> float:
  """The epsilon of the whole search at `delta` (module docstring).

  `search_rdp` of `trial_rdp`, converted with `dp_accounting`'s improved
  RDP-to-DP conversion (Canonne, Kamath & Steinke 2020, Prop. 12),
  minimized over `orders`.

  Example:
    >>> search_epsilon(geometric(10.0), dp_accounting.GaussianDpEvent(4.0),
    ...                delta=1e-5)

  Args:
    distribution: the distribution of K.
    trial_event: one trial's event (`plan.event`).
    delta: the search's delta, in (0, 1).
    orders: the Renyi orders (lambda and lambda_hat range over them).
    neighboring_relation: the relation the trial is private under.

  Returns:
    epsilon (inf when no order gives a finite bound).

  Raises:
    ValueError: for a delta outside (0, 1).
  """
  accounting.validate_epsilon_delta(None, delta)
  rdp = trial_rdp(trial_event, orders=orders,
                  neighboring_relation=neighboring_relation)
  whole = search_rdp(distribution, rdp, orders=orders)
  epsilon, _ = rdp_privacy_accountant.compute_epsilon(list(orders),
                                                      list(whole), delta)
  return float(epsilon)


def calibrate_trial_noise(
    epsilon: float, delta: float, distribution: Distribution,
    make_event: Callable[[float], dp_accounting.DpEvent], *,
    orders: Sequence[float] = ORDERS,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    rtol: float = 1e-4,
) -> float:
  """The per-trial noise multiplier whose whole search spends `epsilon`.

  Bisection (on a log scale) of `search_epsilon(distribution,
  make_event(z), delta)` in z, which decreases as z grows; the upper end is
  returned, so the search with it spends at most `epsilon`.

  Example:
    >>> z = calibrate_trial_noise(2.0, 1e-5, geometric(10.0),
    ...                           dp_accounting.GaussianDpEvent)

  Args:
    epsilon: the total epsilon of the search, > 0.
    delta: its delta, in (0, 1).
    distribution: the distribution of K.
    make_event: the event of one trial run with noise multiplier z; for a
      plan, `accounting.dp_event(plan.mechanism, z, plan.participation)` of
      a plan built once (building a plan per bisection step,
      `plans.dpsgd(..., noise_multiplier=z).event`, gives the same event,
      more slowly).
    orders: the Renyi orders.
    neighboring_relation: the relation the trial is private under.
    rtol: relative width of the final bracket.

  Returns:
    z > 0 with `search_epsilon(...) <= epsilon`.

  Raises:
    ValueError: for a bad target, or when no multiplier up to 1e6 reaches it
      (the distribution's own terms alone exceed `epsilon`).
  """
  accounting.validate_epsilon_delta(epsilon, delta)
  _check_distribution(distribution)

  def spent(z: float) -> float:
    return search_epsilon(distribution, make_event(z), delta, orders=orders,
                          neighboring_relation=neighboring_relation)

  upper = 1.0
  while spent(upper) > epsilon:
    upper *= 2.0
    if upper > 1e6:
      raise ValueError(
          f'no noise multiplier up to 1e6 brings the search under epsilon '
          f'{epsilon}: the distribution\'s own cost (the log(E[K]) and '
          'log(1/gamma) terms of the bound) is too large for it; ask for a '
          'larger epsilon or a smaller mean number of trials')
  lower = upper / 2.0
  while lower > 1e-6 and spent(lower) <= epsilon:
    upper, lower = lower, lower / 2.0
  while upper / lower > 1 + rtol:
    middle = math.sqrt(upper * lower)
    if spent(middle) <= epsilon:
      upper = middle
    else:
      lower = middle
  return float(upper)


# ---------------------------------------------------------------- scores


class PrivateScore(NamedTuple):
  """A trial's score released privately, with the event of its release.

  `random_search(score_source='private_release')` accepts only these, and
  only when `event` is part of the trial's accounted event (equal to it, or
  one of the events it composes).

  Example:
    >>> score = PrivateScore(noisy_accuracy, dp_accounting.GaussianDpEvent(5.0))

  Attributes:
    value: the released (noisy) score.
    event: the DpEvent of its release.
  """

  value: float
  event: dp_accounting.DpEvent


def private_score(per_example_scores: Any, *, noise_multiplier: float,
                  key: keys.KeyLike = None) -> PrivateScore:
  """A noisy mean of per-example scores in [0, 1] (e.g. correct or not).

  Each score is clipped to [0, 1], so one example changes the sum by at most
  1 (add/remove or replace-one); the sum gets Gaussian noise of std
  `noise_multiplier`, and is divided by the number of scores, which is
  treated as public (as the library normalizes by a public batch size).

  Example:
    >>> correct = (model_predictions == labels).astype(float)
    >>> score = private_score(correct, noise_multiplier=5.0)
    >>> trial_event = dp_accounting.ComposedDpEvent([plan.event, score.event])

  Args:
    per_example_scores: a 1-D array of per-example scores on private
      validation data.
    noise_multiplier: the noise std on the sum (its sensitivity is 1).
    key: the noise key (None: fresh from OS entropy).

  Returns:
    `PrivateScore(noisy mean, GaussianDpEvent(noise_multiplier))`.

  Raises:
    ValueError: for an empty or non-1-D input or a noise multiplier <= 0.
  """
  scores = jnp.asarray(per_example_scores, dtype=jnp.float32)
  if scores.ndim != 1 or scores.shape[0] == 0:
    raise ValueError('per_example_scores must be a non-empty 1-D array, got '
                     f'shape {scores.shape}')
  if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
    raise ValueError('noise_multiplier must be finite and > 0, got '
                     f'{noise_multiplier!r}')
  key = keys.noise_key(key, 'private_score')
  # NaN scores count as 0: non-finite values must not escape the clip.
  clipped = jnp.clip(jnp.nan_to_num(scores, nan=0.0), 0.0, 1.0)
  noisy = jnp.sum(clipped) + noise_multiplier * jax.random.normal(key, ())
  return PrivateScore(float(noisy) / scores.shape[0],
                      dp_accounting.GaussianDpEvent(noise_multiplier))


def _contains(event: dp_accounting.DpEvent,
              part: dp_accounting.DpEvent) -> bool:
  """Whether `part` is `event` or one of the events it composes."""
  if event == part:
    return True
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return any(_contains(inner, part) for inner in event.events)
  return False


# ---------------------------------------------------------------- search


@dataclasses.dataclass(frozen=True)
class TrialRecord:
  """One trial of a search. NOT covered by the search's epsilon unless it
  is the released best trial.

  Example:
    >>> result.best.config, result.best.score

  Attributes:
    index: the trial's position in the search.
    config: the hyperparameters drawn for it.
    score: the score it was ranked by.
    result: what `run_trial` returned besides the score.
  """

  index: int
  config: Mapping[str, Any]
  score: float
  result: Any = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class SearchRecord:
  """The privacy record of a search: what was accounted, and how.

  Holds nothing the guarantee does not cover (no K, no other trial's score
  or configuration), so it can be published with the best trial.

  Example:
    >>> result.record.epsilon, result.record.method

  Attributes:
    distribution: the distribution of K and its parameters.
    noise_multiplier: each trial's noise multiplier.
    trial_event: the trial's DpEvent, as text.
    epsilon: the whole search's epsilon.
    target_epsilon: the epsilon asked for (None when the noise was given).
    delta: its delta.
    method: the bound used.
    score_source: 'public' or 'private_release'.
    neighboring_relation: the relation the trials are private under.
  """

  distribution: Mapping[str, Any]
  noise_multiplier: float
  trial_event: str
  epsilon: float
  target_epsilon: Optional[float]
  delta: float
  method: str
  score_source: str
  neighboring_relation: str

  def to_json(self) -> dict[str, Any]:
    """The record as JSON-compatible values.

    Example:
      >>> json.dumps(result.record.to_json())

    Returns:
      A dict.
    """
    value = dataclasses.asdict(self)
    value['distribution'] = dict(self.distribution)
    json.dumps(value)  # Fails here, not in the caller's writer.
    return value


@dataclasses.dataclass(frozen=True)
class SearchResult:
  """What `random_search` returns.

  Example:
    >>> result = random_search(space, run_trial, ...)
    >>> publish(result.best.config, result.best.result, result.record)

  Attributes:
    best: the released trial (None when a Poisson K was 0): the only part
      the epsilon covers.
    num_trials: K. Private: not covered by the epsilon, do not publish.
    trials: every trial. Private: not covered, do not publish.
    epsilon: the whole search's epsilon at `record.delta`.
    record: the search's privacy record (`SearchRecord`).
  """

  best: Optional[TrialRecord]
  num_trials: int = dataclasses.field(repr=False)
  trials: tuple[TrialRecord, ...] = dataclasses.field(repr=False)
  epsilon: float
  record: SearchRecord


def _draw_config(space: Any, key: jax.Array) -> dict[str, Any]:
  """One configuration: lists are drawn uniformly, callables get a key."""
  if callable(space):
    config = space(key)
    if not isinstance(config, Mapping):
      raise TypeError('a callable space must return a dict of '
                      f'hyperparameters, got {type(config).__name__}')
    return dict(config)
  config = {}
  for i, (name, values) in enumerate(sorted(space.items())):
    subkey = jax.random.fold_in(key, i)
    if callable(values):
      value = values(subkey)
      config[name] = value.item() if hasattr(value, 'item') else value
    else:
      index = int(jax.random.randint(subkey, (), 0, len(values)))
      config[name] = values[index]
  return config


def _check_space(space: Any) -> None:
  if callable(space):
    return
  if not isinstance(space, Mapping) or not space:
    raise TypeError('space must be a non-empty dict of hyperparameter name '
                    '-> list of values or callable(key), or a callable(key) '
                    f'returning a dict; got {type(space).__name__}')
  for name, values in space.items():
    if callable(values):
      continue
    if isinstance(values, (str, bytes)) or not isinstance(
        values, (Sequence, np.ndarray)):
      raise TypeError(f'space[{name!r}] must be a list of values or a '
                      f'callable(key), got {type(values).__name__}')
    if len(values) == 0:  # pylint: disable=g-explicit-length-test
      raise ValueError(f'space[{name!r}] is empty')


def _score_value(score: Any, score_source: str, trial_event: Any,
                 index: int) -> float:
  if score_source == 'private_release':
    if not isinstance(score, PrivateScore):
      raise guards.PrivacyGuardError(
          f'trial {index} returned a bare score ({type(score).__name__}) '
          "under score_source='private_release': the best trial would be "
          'picked by a value nobody showed to be private. Return a '
          'PrivateScore (tuning.private_score) whose event the trial\'s '
          "event contains, or declare score_source='public' if the score "
          'comes from public data only')
    if not _contains(trial_event, score.event):
      raise guards.PrivacyGuardError(
          f'trial {index}\'s score was released by {score.event}, which the '
          f'trial\'s accounted event {trial_event} does not contain: the '
          'score\'s release is not in the search\'s epsilon. Compose it into '
          'make_event (dp_accounting.ComposedDpEvent([plan_event, '
          'score_event]))')
    value = score.value
  else:
    if isinstance(score, PrivateScore):
      value = score.value
    else:
      value = score
  value = float(value)
  if math.isnan(value):
    raise ValueError(f'trial {index} returned a NaN score')
  return value


def random_search(
    space: Union[Mapping[str, Any], Callable[[jax.Array], Mapping[str, Any]]],
    run_trial: Callable[[Mapping[str, Any], float], tuple[Any, Any]],
    *,
    distribution: Distribution,
    delta: float,
    score_source: str,
    epsilon: Optional[float] = None,
    make_event: Optional[Callable[[float], dp_accounting.DpEvent]] = None,
    noise_multiplier: Optional[float] = None,
    maximize: bool = True,
    key: keys.KeyLike = None,
    orders: Sequence[float] = ORDERS,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
) -> SearchResult:
  """Private random search: K random trials, the best one released.

  Papernot & Steinke (2022), Algorithm 1: K is drawn from `distribution`
  with the secret key, K configurations are drawn from `space` (lists
  uniformly, callables with a key of their own), each trial runs as
  `run_trial(config, noise_multiplier)`, and the trial with the best score
  is returned. The whole search spends `epsilon` (the module docstring's
  bounds); only `best` is covered by it.

  With `epsilon=` the per-trial noise multiplier is calibrated
  (`calibrate_trial_noise`); with `noise_multiplier=` it is used as given
  and the search's epsilon reported. `make_event(z)` is the event of one
  trial run with multiplier z (a plan's event); every trial is checked
  against it where it can be: a `run_trial` result with an `event`
  attribute (a `Plan`) must have exactly that event, else the search is
  refused (a configuration that changes the epochs or batch size changes
  what a trial spends: keep such values out of the space, or account for
  the worst case in `make_event`).

  Example:
    >>> def run_trial(config, noise_multiplier):
    ...   plan = plans.dpsgd(loss_fn, optimizer=optax.sgd(config['lr']),
    ...                      noise_multiplier=noise_multiplier, ...)
    ...   params = train(plan)
    ...   return accuracy_on_public_data(params), plan
    >>> result = random_search(
    ...     {'lr': [0.03, 0.1, 0.3]}, run_trial, distribution=geometric(5.0),
    ...     epsilon=2.0, delta=1e-5, score_source='public',
    ...     make_event=lambda z: plans.dpsgd(..., noise_multiplier=z).event)
    >>> result.best.config, result.epsilon

  Args:
    space: dict of name -> list of values (drawn uniformly) or
      callable(key) -> value; or a callable(key) -> dict.
    run_trial: `(config, noise_multiplier) -> (score, result)`; the score is
      a float (score_source='public') or a `PrivateScore`
      (score_source='private_release').
    distribution: `TruncatedNegativeBinomial`, `geometric(mean)`, `Poisson`
      or `FixedTrials` (composition).
    delta: the search's delta, in (0, 1).
    score_source: where the score comes from, stated by the caller:
      'public' (computed from the trial's release and data the caller
      declares public) or 'private_release' (a `PrivateScore` released
      inside the trial, its event in the trial's event).
    epsilon: the search's total epsilon, to calibrate the noise to.
    make_event: `noise_multiplier -> DpEvent` of one trial (required).
    noise_multiplier: the per-trial noise multiplier, instead of `epsilon`.
    maximize: True to release the highest score, False the lowest.
    key: the secret key of K and the configurations (None: fresh from OS
      entropy; a seed makes K predictable to whoever knows it).
    orders: the Renyi orders of the accounting.
    neighboring_relation: the relation the trials are private under.

  Returns:
    A `SearchResult`.

  Raises:
    TypeError: for a distribution or space this function does not accept.
    ValueError: for bad targets or scores (NaN).
    PrivacyGuardError: a trial's score or event is not what was accounted.
  """
  _check_distribution(distribution)
  _check_space(space)
  if score_source not in SCORE_SOURCES:
    raise ValueError(f'score_source must be one of {SCORE_SOURCES}, got '
                     f'{score_source!r}')
  if make_event is None:
    raise ValueError('make_event (noise_multiplier -> the DpEvent of one '
                     'trial) is required: the search is accounted from it')
  if (epsilon is None) == (noise_multiplier is None):
    raise ValueError('give exactly one of epsilon= (calibrate the noise) '
                     'and noise_multiplier=')
  accounting.validate_epsilon_delta(epsilon, delta)
  if epsilon is not None:
    noise_multiplier = calibrate_trial_noise(
        epsilon, delta, distribution, make_event, orders=orders,
        neighboring_relation=neighboring_relation)
  trial_event = make_event(noise_multiplier)
  spent = search_epsilon(distribution, trial_event, delta, orders=orders,
                         neighboring_relation=neighboring_relation)
  key = keys.noise_key(key, 'random_search')
  count_key, config_key = jax.random.split(key)
  num_trials = distribution.sample(count_key)
  trials = []
  for index in range(num_trials):
    config = _draw_config(space, jax.random.fold_in(config_key, index))
    score, result = run_trial(config, noise_multiplier)
    ran = getattr(result, 'event', None)
    if isinstance(ran, dp_accounting.DpEvent) and ran != trial_event:
      raise guards.PrivacyGuardError(
          f'trial {index} (config {config}) ran with event {ran}, not the '
          f'accounted {trial_event}: the search\'s epsilon does not cover it')
    value = _score_value(score, score_source, trial_event, index)
    trials.append(TrialRecord(index, config, value, result))
  sign = 1.0 if maximize else -1.0
  best = max(trials, key=lambda trial: sign * trial.score, default=None)
  record = SearchRecord(
      distribution=distribution.describe(),
      noise_multiplier=float(noise_multiplier),
      trial_event=str(trial_event), epsilon=spent, target_epsilon=epsilon,
      delta=delta, method=_method(distribution), score_source=score_source,
      neighboring_relation=neighboring.NeighboringRelation(
          neighboring_relation).value)
  return SearchResult(best=best, num_trials=num_trials, trials=tuple(trials),
                      epsilon=spent, record=record)
