"""Audit statistics: confidence bounds, epsilon lower bounds, thresholds.

NumPy/SciPy on the host: exact binomial bounds (Clopper-Pearson), the
many-run epsilon bound with thresholds fixed in advance, the one-run bound
of Steinke, Nasr and Jagielski (2023), and the choice of thresholds and
linear scores from calibration runs. Re-exported by `dpsco_jax.audit`.
"""

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np
from scipy import stats

from dpsco_jax import checks


ArrayLike = Union[np.ndarray, Sequence[float]]


# ---------------------------------------------------------------------------
# Statistics.
# ---------------------------------------------------------------------------


def _validate_alpha(alpha: float) -> float:
  alpha = float(alpha)
  if not 0.0 < alpha < 1.0:
    raise ValueError(f'alpha must be in (0, 1), got {alpha!r}')
  return alpha


def _validate_delta(delta: float) -> float:
  delta = float(delta)
  if not 0.0 <= delta < 1.0:
    raise ValueError(f'delta must be in [0, 1), got {delta!r}')
  return delta


def clopper_pearson_upper(successes: ArrayLike, trials: ArrayLike,
                          alpha: float) -> np.ndarray:
  """One-sided Clopper-Pearson upper bound on a binomial proportion.

  With probability at least `1 - alpha` the true proportion is at most the
  returned value.

  Example:
    >>> clopper_pearson_upper(0, 1000, 0.05)   # about 3.0 / 1000

  Args:
    successes: observed successes (array-like of ints).
    trials: number of trials (broadcast against `successes`).
    alpha: one-sided error probability, in (0, 1).

  Returns:
    `Beta(1 - alpha; k + 1, n - k)` quantiles, 1 where `k == n`.

  Raises:
    ValueError: on alpha outside (0, 1) or counts outside [0, trials].
  """
  alpha = _validate_alpha(alpha)
  k, n = np.broadcast_arrays(np.asarray(successes, np.float64),
                             np.asarray(trials, np.float64))
  if np.any(k < 0) or np.any(k > n) or np.any(n < 1):
    raise ValueError('need 0 <= successes <= trials and trials >= 1')
  with np.errstate(invalid='ignore'):
    bound = stats.beta.ppf(1.0 - alpha, k + 1.0, np.maximum(n - k, 1e-300))
  return np.where(k >= n, 1.0, bound)


def clopper_pearson_lower(successes: ArrayLike, trials: ArrayLike,
                          alpha: float) -> np.ndarray:
  """One-sided Clopper-Pearson lower bound on a binomial proportion.

  With probability at least `1 - alpha` the true proportion is at least the
  returned value.

  Example:
    >>> clopper_pearson_lower(1000, 1000, 0.05)   # about 1 - 3.0 / 1000

  Args:
    successes: observed successes (array-like of ints).
    trials: number of trials (broadcast against `successes`).
    alpha: one-sided error probability, in (0, 1).

  Returns:
    `Beta(alpha; k, n - k + 1)` quantiles, 0 where `k == 0`.

  Raises:
    ValueError: on alpha outside (0, 1) or counts outside [0, trials].
  """
  alpha = _validate_alpha(alpha)
  k, n = np.broadcast_arrays(np.asarray(successes, np.float64),
                             np.asarray(trials, np.float64))
  if np.any(k < 0) or np.any(k > n) or np.any(n < 1):
    raise ValueError('need 0 <= successes <= trials and trials >= 1')
  with np.errstate(invalid='ignore'):
    bound = stats.beta.ppf(alpha, np.maximum(k, 1e-300), n - k + 1.0)
  return np.where(k <= 0, 0.0, bound)


def epsilon_from_rates(tpr: ArrayLike, fpr: ArrayLike,
                       delta: float) -> np.ndarray:
  """The smallest epsilon that (epsilon, delta)-DP needs for these rates.

  DP implies `TPR <= e^eps FPR + delta` and `1 - FPR <= e^eps (1 - TPR) +
  delta` for every test, so a test with these rates needs epsilon at least
  `max(ln((TPR - delta) / FPR), ln((1 - FPR - delta) / (1 - TPR)), 0)`.
  Fed with a LOWER bound on TPR and an UPPER bound on FPR it gives a lower
  bound on epsilon.

  Example:
    >>> epsilon_from_rates(0.5, 0.05, 1e-5)   # about ln(10)

  Args:
    tpr: true positive rates (or lower bounds on them).
    fpr: false positive rates (or upper bounds on them).
    delta: the delta of the guarantee being tested.

  Returns:
    Epsilons, >= 0, inf where a rate pair is impossible under any epsilon.
  """
  delta = _validate_delta(delta)
  tpr, fpr = np.broadcast_arrays(np.asarray(tpr, np.float64),
                                 np.asarray(fpr, np.float64))
  with np.errstate(divide='ignore', invalid='ignore'):
    first = np.where(tpr - delta > 0, np.log((tpr - delta) / fpr), 0.0)
    second = np.where(1.0 - fpr - delta > 0,
                      np.log((1.0 - fpr - delta) / (1.0 - tpr)), 0.0)
  first = np.where(np.isnan(first), 0.0, first)
  second = np.where(np.isnan(second), 0.0, second)
  return np.maximum(np.maximum(first, second), 0.0)


@dataclasses.dataclass(frozen=True)
class EpsilonBound:
  """The many-run bound with its evidence (`epsilon_lower_bound`).

  Attributes:
    epsilon: the lower bound on epsilon (>= 0), at confidence `1 - alpha`.
    threshold: the threshold that gave it (NaN when the bound is 0 with no
      threshold above 0).
    delta: the delta of the guarantee tested.
    alpha: the overall error probability (confidence `1 - alpha`), split
      over `2 len(thresholds)` one-sided intervals (Bonferroni).
    num_in: runs with the canary.
    num_out: runs without it.
    thresholds: the thresholds tried, `[K]` (a run is guessed "in" when its
      score is >= the threshold).
    tpr: observed true positive rates, `[K]`.
    fpr: observed false positive rates, `[K]`.
    tpr_lower: Clopper-Pearson lower bounds on the TPRs, `[K]`.
    fpr_upper: Clopper-Pearson upper bounds on the FPRs, `[K]`.
    epsilons: the bound each threshold gives, `[K]`.
    roc_fpr: the empirical ROC curve's false positive rates (every distinct
      score as a threshold; descriptive, not used by the bound).
    roc_tpr: the empirical ROC curve's true positive rates.
  """

  epsilon: float
  threshold: float
  delta: float
  alpha: float
  num_in: int
  num_out: int
  thresholds: np.ndarray
  tpr: np.ndarray
  fpr: np.ndarray
  tpr_lower: np.ndarray
  fpr_upper: np.ndarray
  epsilons: np.ndarray
  roc_fpr: np.ndarray
  roc_tpr: np.ndarray


def checked_scores(values: ArrayLike, name: str) -> np.ndarray:
  """`values` as a flat float64 array of finite scores.

  Example:
    >>> checked_scores([0.5, 1.0], 'scores_in')

  Args:
    values: scores (or observations) of runs.
    name: what they are, for the error.

  Returns:
    The flat array.

  Raises:
    ValueError: if `values` is empty or holds a non-finite value.
  """
  values = np.asarray(values, np.float64).ravel()
  if values.size == 0:
    raise ValueError(f'{name} is empty')
  if not np.all(np.isfinite(values)):
    raise ValueError(
        f'{name} holds non-finite scores: a refused step (NaN-poisoned '
        'output, see dpsco_jax.guards) or a diverged run; fix the run first')
  return values


def roc_curve(scores_in: ArrayLike,
              scores_out: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
  """Empirical ROC curve of "score >= t means in", over every distinct score.

  Example:
    >>> fpr, tpr = roc_curve([1.0, 2.0], [0.0, 1.5])

  Args:
    scores_in: scores of the runs with the canary.
    scores_out: scores of the runs without it.

  Returns:
    `(fpr, tpr)`, both increasing from (0, 0) to (1, 1).
  """
  scores_in = checked_scores(scores_in, 'scores_in')
  scores_out = checked_scores(scores_out, 'scores_out')
  grid = np.unique(np.concatenate([scores_in, scores_out]))[::-1]
  tpr = 1.0 - np.searchsorted(np.sort(scores_in), grid, 'left') / len(
      scores_in)
  fpr = 1.0 - np.searchsorted(np.sort(scores_out), grid, 'left') / len(
      scores_out)
  return np.concatenate([[0.0], fpr]), np.concatenate([[0.0], tpr])


def epsilon_lower_bound(
    scores_in: ArrayLike,
    scores_out: ArrayLike,
    delta: float,
    alpha: float = 0.05,
    *,
    thresholds: ArrayLike,
) -> EpsilonBound:
  """Many-run lower bound on epsilon from canary scores (Clopper-Pearson).

  For each threshold t (a run is guessed "in" when its score is >= t),
  counts the true and false positives, bounds TPR from below and FPR from
  above with one-sided Clopper-Pearson intervals at level `alpha / (2 K)`
  each (Bonferroni over the K thresholds and the two rates, so that ALL
  intervals hold together with probability >= 1 - alpha), and returns

      max over t of max(ln((TPR_lo - delta) / FPR_hi),
                        ln((1 - FPR_hi - delta) / (1 - TPR_lo)), 0).

  The thresholds must be fixed before looking at these scores (a grid, or
  quantiles of a held-out split): choosing them from the same scores would
  void the confidence statement. Higher scores must mean "more likely in".

  Example:
    >>> rng = np.random.default_rng(0)
    >>> bound = epsilon_lower_bound(rng.normal(2, 1, 1000),
    ...                             rng.normal(0, 1, 1000), delta=1e-5,
    ...                             thresholds=np.linspace(0, 3, 7))
    >>> bound.epsilon   # > 0, below the true epsilon of 2-GDP

  Args:
    scores_in: scores of the runs on the data set WITH the canary.
    scores_out: scores of the runs on the neighbouring data set WITHOUT it.
    delta: the delta of the claimed guarantee.
    alpha: overall error probability; the bound holds with confidence
      `1 - alpha`.
    thresholds: the thresholds to try, fixed in advance.

  Returns:
    An `EpsilonBound` (the bound, its threshold, the TPR/FPR table, the ROC
    points).

  Raises:
    ValueError: on empty or non-finite scores or thresholds, delta outside
      [0, 1) or alpha outside (0, 1).
  """
  delta = _validate_delta(delta)
  alpha = _validate_alpha(alpha)
  scores_in = checked_scores(scores_in, 'scores_in')
  scores_out = checked_scores(scores_out, 'scores_out')
  thresholds = checked_scores(thresholds, 'thresholds')
  n_in, n_out = len(scores_in), len(scores_out)
  true_positives = (scores_in[None, :] >= thresholds[:, None]).sum(axis=1)
  false_positives = (scores_out[None, :] >= thresholds[:, None]).sum(axis=1)
  level = alpha / (2 * len(thresholds))
  tpr_lower = clopper_pearson_lower(true_positives, n_in, level)
  fpr_upper = clopper_pearson_upper(false_positives, n_out, level)
  epsilons = epsilon_from_rates(tpr_lower, fpr_upper, delta)
  best = int(np.argmax(epsilons))
  roc_fpr, roc_tpr = roc_curve(scores_in, scores_out)
  return EpsilonBound(
      epsilon=float(epsilons[best]),
      threshold=float(thresholds[best]) if epsilons[best] > 0 else math.nan,
      delta=delta, alpha=alpha, num_in=n_in, num_out=n_out,
      thresholds=thresholds, tpr=true_positives / n_in,
      fpr=false_positives / n_out, tpr_lower=tpr_lower, fpr_upper=fpr_upper,
      epsilons=epsilons, roc_fpr=roc_fpr, roc_tpr=roc_tpr)


# One-run auditing (Steinke, Nasr and Jagielski 2023).


@dataclasses.dataclass(frozen=True)
class OneRunBound:
  """The one-run bound with its evidence (`one_run_epsilon_lower_bound`).

  Attributes:
    epsilon: the lower bound on epsilon (>= 0), at confidence `1 - alpha`.
    delta: the delta of the guarantee tested.
    alpha: the error probability.
    num_canaries: m, canaries each included with probability 1/2.
    num_guesses: r = k+ + k-, guesses made (the rest abstain).
    num_correct: v, correct guesses.
    p_value: the p-value of the observed count at `epsilon` (just below
      `alpha` when `epsilon > 0`).
  """

  epsilon: float
  delta: float
  alpha: float
  num_canaries: int
  num_guesses: int
  num_correct: int
  p_value: float


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int,
                    epsilon: float, delta: float) -> float:
  """P[at least `num_correct` of `num_guesses` right] under (eps, delta)-DP.

  Steinke, Nasr and Jagielski (2023), Theorem 3.1: with m canaries each
  included independently with probability 1/2, any r guesses made from the
  output of an (eps, delta)-DP run have W correct guesses with

      P[W >= v] <= P[B >= v]
                   + 2 m delta max_{1 <= i <= v} P[v - i <= B < v] / i,

  B ~ Binomial(r, e^eps / (1 + e^eps)). With delta = 0 this is the pure-DP
  statement that W is dominated by B.

  Example:
    >>> one_run_p_value(1000, 100, 90, epsilon=1.0, delta=1e-5)   # tiny

  Args:
    num_canaries: m.
    num_guesses: r (<= m).
    num_correct: v (<= r).
    epsilon: the epsilon tested (>= 0).
    delta: the delta tested.

  Returns:
    The p-value, capped at 1.
  """
  m, r, v = int(num_canaries), int(num_guesses), int(num_correct)
  if not 0 <= v <= r <= m:
    raise ValueError(f'need 0 <= num_correct <= num_guesses <= num_canaries, '
                     f'got {v}, {r}, {m}')
  q = 1.0 / (1.0 + math.exp(-float(epsilon)))
  tail = float(stats.binom.sf(v - 1, r, q))
  if delta > 0 and v > 0:
    i = np.arange(1, v + 1)
    below = stats.binom.cdf(v - 1, r, q) - stats.binom.cdf(v - 1 - i, r, q)
    tail += 2.0 * m * float(delta) * float(np.max(below / i))
  return min(tail, 1.0)


def one_run_epsilon_lower_bound(
    scores: ArrayLike,
    included: ArrayLike,
    *,
    delta: float,
    alpha: float = 0.05,
    num_positive_guesses: Optional[int] = None,
    num_negative_guesses: Optional[int] = None,
) -> OneRunBound:
  """One-run lower bound on epsilon (Steinke, Nasr, Jagielski 2023).

  Guesses "in" for the `num_positive_guesses` highest scores and "out" for
  the `num_negative_guesses` lowest, abstains on the rest, counts the
  correct guesses v among the r made, and returns the largest epsilon at
  which `one_run_p_value(m, r, v, epsilon, delta) < alpha` (bisection):
  the run is not (epsilon, delta)-DP at confidence `1 - alpha`.

  What this implements: Theorem 3.1 WITH its delta term (so it is valid
  for (eps, delta)-DP claims, not only pure DP). It is conservative in two
  ways: the domination by a Binomial is the worst case over all (eps,
  delta)-DP mechanisms (randomized response), so a Gaussian mechanism
  audited this way gets a bound well below its epsilon unless m is very
  large; and the delta term `2 m delta` grows with m. The numbers of
  guesses must be fixed in advance (not tuned on these scores).

  Example:
    >>> bound = one_run_epsilon_lower_bound(scores, included, delta=1e-5,
    ...                                     num_positive_guesses=50,
    ...                                     num_negative_guesses=50)

  Args:
    scores: one score per canary, `[m]` (higher = more likely included).
    included: whether each canary was included, `[m]` bool.
    delta: the delta of the claimed guarantee.
    alpha: the error probability (confidence `1 - alpha`).
    num_positive_guesses: k+ (default m // 10).
    num_negative_guesses: k- (default m // 10).

  Returns:
    A `OneRunBound`.

  Raises:
    ValueError: on mismatched shapes, non-finite scores or too many guesses.
  """
  delta = _validate_delta(delta)
  alpha = _validate_alpha(alpha)
  scores = checked_scores(scores, 'scores')
  included = np.asarray(included, bool).ravel()
  if included.shape != scores.shape:
    raise ValueError('scores and included must have one entry per canary')
  m = len(scores)
  k_plus = m // 10 if num_positive_guesses is None else int(
      num_positive_guesses)
  k_minus = m // 10 if num_negative_guesses is None else int(
      num_negative_guesses)
  if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
    raise ValueError(f'need 0 <= k+, k- and k+ + k- <= m = {m}')
  order = np.argsort(scores, kind='stable')
  correct = int(included[order[m - k_plus:]].sum()) if k_plus else 0
  correct += int((~included[order[:k_minus]]).sum()) if k_minus else 0
  guesses = k_plus + k_minus

  def p_value(epsilon):
    return one_run_p_value(m, guesses, correct, epsilon, delta)

  if guesses == 0 or p_value(0.0) >= alpha:
    return OneRunBound(0.0, delta, alpha, m, guesses, correct,
                       p_value(0.0) if guesses else 1.0)
  low, high = 0.0, 1.0
  while p_value(high) < alpha and high < 100.0:
    low, high = high, 2.0 * high
  for _ in range(50):
    middle = 0.5 * (low + high)
    if p_value(middle) < alpha:
      low = middle
    else:
      high = middle
  return OneRunBound(low, delta, alpha, m, guesses, correct, p_value(low))


def fit_linear_score(observations_in: np.ndarray,
                     observations_out: np.ndarray) -> np.ndarray:
  """Weights of the linear score that best separates two Gaussian clouds.

  Fisher's discriminant `(S_in + S_out)^-1 (mean_in - mean_out)`: for a
  Gaussian mechanism (any correlated-noise mechanism of the library on a
  linear canary) the observations are Gaussian with the same covariance in
  both arms, and this is the likelihood-ratio test, the most powerful one.
  Fit it on held-out runs only: weights fitted on the runs that are then
  scored would void the confidence statement.

  Example:
    >>> w = fit_linear_score(calibration_in, calibration_out)

  Args:
    observations_in: `[n_in, m]` observations of runs with the canary.
    observations_out: `[n_out, m]` observations of runs without it.

  Returns:
    Weights `[m]` (higher score = more likely in).
  """
  mean_in = observations_in.mean(axis=0)
  mean_out = observations_out.mean(axis=0)
  scatter = (np.cov(observations_in, rowvar=False, bias=True).reshape(
      len(mean_in), -1) + np.cov(observations_out, rowvar=False,
                                 bias=True).reshape(len(mean_in), -1))
  # A small ridge keeps the solve defined when an observation is constant
  # (a step whose output the canary cannot reach, or a null audit).
  ridge = 1e-9 * max(float(np.trace(scatter)), 1e-30) + 1e-30
  return np.linalg.solve(scatter + ridge * np.eye(len(mean_in)),
                         mean_in - mean_out)


def _expected_bounds(tpr: np.ndarray, fpr: np.ndarray, eval_in: int,
                     eval_out: int, level: float, delta: float) -> np.ndarray:
  """The bound each threshold would give if new runs had these rates."""
  return epsilon_from_rates(
      clopper_pearson_lower(tpr * eval_in, eval_in, level),
      clopper_pearson_upper(fpr * eval_out, eval_out, level), delta)


def _gaussian_tail(scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
  """P[score >= t] under a normal fitted to `scores`."""
  mean, std = scores.mean(), scores.std(ddof=1)
  # Constant scores (a null audit, a deterministic release) make a step.
  std = max(std, 1e-12 * (1.0 + abs(mean)))
  return stats.norm.sf((thresholds - mean) / std)


def candidate_thresholds(calibration_in: np.ndarray,
                         calibration_out: np.ndarray, *, delta: float,
                         alpha: float, num_thresholds: int,
                         num_eval_in: Optional[int] = None,
                         num_eval_out: Optional[int] = None) -> np.ndarray:
  """The `num_thresholds` thresholds expected to do best on new runs.

  Candidates are quantiles of the pooled held-out scores at log-spaced
  levels towards both tails (where privacy is lost). Each is ranked by the
  bound it is expected to give on the evaluation runs: the TPR and FPR of a
  normal fitted to each arm's held-out scores, scaled to the evaluation
  sizes, through the Clopper-Pearson bounds at the level
  `epsilon_lower_bound` will use (`alpha / (2 num_thresholds)`). Ties (all
  0, e.g. a null audit) go to the same expected bound computed from the
  held-out counts (smoothed by half a run).

  Why a normal fit: every mechanism of the library releases Gaussian noise,
  and a linear score of Gaussian releases is Gaussian in both arms. Raw
  held-out counts rank badly: in the tails a handful of held-out runs
  decide, and the best of some 50 candidates is then usually a tail
  threshold that the held-out runs happened to separate perfectly and new
  runs do not (a bound of 0 where 0.4 was there to find). The choice only
  affects tightness: the thresholds never see the evaluation runs, so the
  bound is valid whatever the score's distribution.

  Example:
    >>> thresholds = candidate_thresholds(held_in, held_out, delta=1e-5,
    ...                                   alpha=0.05, num_thresholds=5)

  Args:
    calibration_in: held-out scores with the canary (at least 2).
    calibration_out: held-out scores without it (at least 2).
    delta: the delta tested.
    alpha: the overall error level of the bound that will be computed.
    num_thresholds: how many to keep.
    num_eval_in: runs with the canary the thresholds will be applied to
      (default: as many as held out).
    num_eval_out: runs without it (default: as many as held out).

  Returns:
    Thresholds, `[<= num_thresholds]`, increasing.

  Raises:
    ValueError: on fewer than 2 held-out scores in an arm, or non-finite
      ones.
  """
  calibration_in = checked_scores(calibration_in, 'calibration_in')
  calibration_out = checked_scores(calibration_out, 'calibration_out')
  num_thresholds = checks.positive_int(num_thresholds, 'num_thresholds')
  n_in, n_out = len(calibration_in), len(calibration_out)
  if min(n_in, n_out) < 2:
    raise ValueError('need at least 2 held-out scores per arm')
  eval_in = n_in if num_eval_in is None else int(num_eval_in)
  eval_out = n_out if num_eval_out is None else int(num_eval_out)
  pooled = np.concatenate([calibration_in, calibration_out])
  tails = np.geomspace(1.0 / len(pooled), 0.5, 24)
  levels = np.unique(np.concatenate([tails, 1.0 - tails]))
  candidates = np.unique(np.quantile(pooled, levels))
  level = alpha / (2 * num_thresholds)
  model = _expected_bounds(_gaussian_tail(calibration_in, candidates),
                           _gaussian_tail(calibration_out, candidates),
                           eval_in, eval_out, level, delta)
  hits_in = (calibration_in[None, :] >= candidates[:, None]).sum(axis=1)
  hits_out = (calibration_out[None, :] >= candidates[:, None]).sum(axis=1)
  counted = _expected_bounds((hits_in + 0.5) / (n_in + 1.0),
                             (hits_out + 0.5) / (n_out + 1.0), eval_in,
                             eval_out, level, delta)
  order = np.lexsort((-counted, -model))
  return np.sort(candidates[order[:num_thresholds]])
