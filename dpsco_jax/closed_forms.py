"""The papers' closed forms: zCDP and Gaussian differential privacy.

* rho-zCDP (paper 001 §2.4): `zcdp_epsilon`, its inverse `zcdp_rho`;
* mu-GDP: the papers' conversion `paper_gdp_mu` (paper 001 Lemma 4.3 / §2.3,
  000 Cor 5.7), and the exact one (Dong, Roth, Su 2019): `gdp_delta`,
  `epsilon_for_gdp`.

`dpsco_jax.accounting` uses them for `method='zcdp'` and `'gdp_paper'` and
re-exports every public name here.
"""

import math

from scipy import optimize
from scipy import stats

from dpsco_jax import checks
from dpsco_jax.participation import validate_epsilon_delta


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


def _closed_form_multiplier(method: str, sensitivity: float, epsilon: float,
                            delta: float, release_mu: float = 0.0) -> float:
  """The noise multiplier of 'zcdp' or 'gdp_paper' for (epsilon, delta).

  The steps get the rest of the Gaussian budget once releases of GDP
  parameter `release_mu` are spent: `mu^2 = mu_steps^2 + release_mu^2`.
  """
  mu = (math.sqrt(2.0 * zcdp_rho(epsilon, delta)) if method == 'zcdp'
        else paper_gdp_mu(epsilon, delta))
  value = sensitivity / math.sqrt(mu ** 2 - release_mu ** 2)
  # The closed form inverts `_closed_form_epsilon` exactly on paper, but
  # rounding can leave the multiplier an ulp too small (epsilon 2 + 2e-15 for
  # a target of 2): step up until the guarantee holds.
  while _closed_form_epsilon(method, sensitivity, value, delta,
                             release_mu) > epsilon:
    value = math.nextafter(value, math.inf)
  return value
