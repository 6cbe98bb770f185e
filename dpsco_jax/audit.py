"""Empirical privacy auditing: lower bounds on the epsilon a run really has.

An audit attacks a training run with a canary and measures how well the
attacker tells "the canary was in the data" from "it was not". Differential
privacy caps that: an (epsilon, delta)-DP run has, for every test,

    TPR <= e^eps FPR + delta   and   1 - FPR <= e^eps (1 - TPR) + delta.

Observed rates (with confidence intervals) that break these for a given
epsilon prove, at the stated confidence, that the run is NOT (epsilon,
delta)-DP: the largest such epsilon is an empirical LOWER bound. It never
proves a run private; it catches bugs that make the real epsilon much larger
than the claim (noise on the mean instead of the sum, sigma off by a factor,
a key reused, a sensitivity undercounted).

Statistics (NumPy/SciPy, on the host):

* `clopper_pearson_lower` / `clopper_pearson_upper`: exact one-sided
  binomial confidence bounds.
* `epsilon_lower_bound(scores_in, scores_out, delta, thresholds=...)`: the
  many-run bound, with thresholds fixed in advance and a Bonferroni
  correction over them.
* `one_run_epsilon_lower_bound(scores, included, ...)`: the one-run bound of
  Steinke, Nasr and Jagielski (2023), Theorem 3.1 (with its delta term).

Runners (one vmapped, jit-compiled program for all runs):

* `audit_plan(plan, ...)`: a `plans.Plan` as it runs (its transformation,
  its sampler reseeded per run, Poisson sampling included, its noise with
  a key per run), your data and a canary row; the bound beside
  `plan.epsilon`. Its program is called on chunks of runs of bounded
  memory, with a progress line.
* `run_canary_audit(train_fn, ...)`: any whole run written as a pure
  function `train_fn(key, include) -> observations`; this is how to audit
  your own training loop.
* `run_gradient_canary_audit(make_transformation, ...)`: white-box gradient
  canary against any transformation of the library (or your own).
* `run_input_canary_audit(make_transformation, ...)`: black-box input
  canary with your loss, data and score.
* `run_one_run_gradient_audit(make_transformation, ...)`: many gradient
  canaries in ONE run.

Run i's noise key is `fold_in(key, i)` (`run_keys`); even runs have the
canary, odd runs do not.

Results are `AuditReport`s (`to_markdown`, `plot_roc`). See docs/audit.md.
"""

import dataclasses
import functools
import math
import time
from typing import Any, Callable, Optional, Sequence, Union
import warnings

import jax
from jax import flatten_util
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats

from dpsco_jax import batching
from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import keys as keys_lib
from dpsco_jax import neighboring
from dpsco_jax import noise as noise_lib
from dpsco_jax import progress as progress_lib
from dpsco_jax import runs
from dpsco_jax.algorithms import nonsmooth
from dpsco_jax.algorithms import srg

PyTree = Any
ArrayLike = Union[np.ndarray, Sequence[float]]
MakeTransformation = Callable[[Callable[[PyTree, PyTree], jax.Array],
                               jax.Array], optax.GradientTransformation]


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


def _scores(values: ArrayLike, name: str) -> np.ndarray:
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
  scores_in = _scores(scores_in, 'scores_in')
  scores_out = _scores(scores_out, 'scores_out')
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
  scores_in = _scores(scores_in, 'scores_in')
  scores_out = _scores(scores_out, 'scores_out')
  thresholds = _scores(thresholds, 'thresholds')
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
  scores = _scores(scores, 'scores')
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


# ---------------------------------------------------------------------------
# Reports.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The result of an audit: a lower bound beside the claimed epsilon.

  Attributes:
    name: what was audited (e.g. 'DP-SGD, white-box gradient canary').
    method: 'many-run' or 'one-run'.
    claimed_epsilon: the epsilon the run claims (from the accountant).
    epsilon_lower_bound: the empirical lower bound, >= 0.
    delta: the delta of the claim (and of the bound).
    alpha: error probability; the bound holds with confidence `1 - alpha`.
    num_runs: runs per arm (many-run: with and without the canary), or
      canaries (one-run).
    num_calibration_runs: runs per arm held out to fit the score and choose
      the thresholds (not used by the bound).
    bound: the many-run `EpsilonBound` (TPR/FPR table, ROC), or None.
    one_run: the `OneRunBound`, or None.
  """

  name: str
  method: str
  claimed_epsilon: float
  epsilon_lower_bound: float
  delta: float
  alpha: float
  num_runs: int
  num_calibration_runs: int = 0
  bound: Optional[EpsilonBound] = None
  one_run: Optional[OneRunBound] = None

  @property
  def confidence(self) -> float:
    """`1 - alpha`."""
    return 1.0 - self.alpha

  @property
  def exceeds_claim(self) -> bool:
    """Whether the lower bound is above the claimed epsilon, at confidence
    `1 - alpha`: a privacy bug (or a wrong claim)."""
    return self.epsilon_lower_bound > self.claimed_epsilon

  def verdict(self) -> str:
    """One line: whether the measurement contradicts the claim."""
    if self.exceeds_claim:
      return (f'VIOLATION: the run is not ({self.claimed_epsilon:.3g}, '
              f'{self.delta:.3g})-DP (confidence {self.confidence:.0%}); '
              'look for a privacy bug')
    return ('consistent with the claim (a lower bound below the claim '
            'never proves it)')

  def to_markdown(self) -> str:
    """The report as Markdown: summary, then the TPR/FPR table.

    Example:
      >>> print(report.to_markdown())

    Returns:
      A Markdown string.
    """
    lines = [f'### {self.name}', '', '| | |', '|---|---|',
             f'| method | {self.method} |',
             f'| claimed epsilon | {self.claimed_epsilon:.3f} '
             f'(delta = {self.delta:.3g}) |',
             f'| epsilon lower bound | {self.epsilon_lower_bound:.3f} '
             f'({self.confidence:.0%} confidence) |']
    if self.one_run is not None:
      one = self.one_run
      lines += [f'| canaries | {one.num_canaries} (each in with '
                'probability 1/2) |',
                f'| guesses | {one.num_correct} correct of '
                f'{one.num_guesses} |']
    else:
      lines += [f'| runs | {self.num_runs} with the canary, '
                f'{self.num_runs} without ({self.num_calibration_runs} of '
                'each held out to fit the score and pick thresholds) |']
      if self.bound is not None and self.bound.epsilon > 0:
        lines.append(f'| threshold | {self.bound.threshold:.4g} |')
    lines += [f'| verdict | {self.verdict()} |', '']
    if self.bound is not None:
      lines += ['| threshold | TPR | FPR | TPR lower | FPR upper | '
                'epsilon |', '|---|---|---|---|---|---|']
      b = self.bound
      for row in zip(b.thresholds, b.tpr, b.fpr, b.tpr_lower, b.fpr_upper,
                     b.epsilons):
        lines.append('| {:.4g} | {:.4f} | {:.4f} | {:.4f} | {:.4f} | '
                     '{:.3f} |'.format(*row))
      lines.append('')
    return '\n'.join(lines)


def _dp_boundary(fpr: np.ndarray, epsilon: float, delta: float) -> np.ndarray:
  """The largest TPR an (epsilon, delta)-DP run allows at each FPR."""
  return np.clip(np.minimum(math.exp(epsilon) * fpr + delta,
                            1.0 - math.exp(-epsilon) * (1.0 - fpr - delta)),
                 0.0, 1.0)


def plot_roc(reports: Union[AuditReport, Sequence[AuditReport]],
             path: str, *, title: Optional[str] = None,
             log_scale: bool = True) -> None:
  """Writes ROC curves of many-run audits, one panel per report, to `path`.

  Each panel shows the empirical ROC curve, the largest ROC that the
  claimed (epsilon, delta) allows, and the one that the measured lower
  bound allows. Log-log axes (the default) show the low-FPR corner, where
  `TPR <= e^eps FPR + delta` is broken and where rates rest on a few runs;
  linear axes show the whole curve at a glance. matplotlib is imported here
  (it is in the `experiments` and `test` extras, not a core dependency).

  Example:
    >>> plot_roc(report, 'docs/audit/roc.png')
    >>> plot_roc([report_a, report_b], 'roc_linear.png', log_scale=False)

  Args:
    reports: one report or several (many-run reports with a `bound`).
    path: the image file to write (format from the extension).
    title: an optional figure title.
    log_scale: log-log axes (True) or linear axes from 0 to 1 (False).

  Raises:
    ValueError: if a report has no ROC (a one-run report).
  """
  # A bare Figure (no pyplot) leaves the caller's backend and open figures
  # alone.
  from matplotlib import figure as mpl_figure  # pylint: disable=g-import-not-at-top

  if isinstance(reports, AuditReport):
    reports = [reports]
  for report in reports:
    if report.bound is None:
      raise ValueError(f'{report.name}: a one-run report has no ROC curve')
  columns = 2 if len(reports) == 4 else min(3, len(reports))
  rows = -(-len(reports) // columns)
  figure = mpl_figure.Figure(figsize=(4.6 * columns, 4.4 * rows))
  axes = figure.subplots(rows, columns, squeeze=False)
  for axis, report in zip(axes.ravel(), reports):
    bound = report.bound
    # On log axes, zero rates are drawn at half a run (a log axis has no 0).
    floor = 0.5 / max(bound.num_out, 1) if log_scale else 0.0
    grid = (np.geomspace(floor, 1.0, 200) if log_scale else
            np.linspace(0.0, 1.0, 201))
    axis.plot(np.maximum(bound.roc_fpr, floor), np.maximum(bound.roc_tpr,
                                                           floor),
              color='C0', lw=2, label='measured ROC')
    axis.plot(grid, np.maximum(_dp_boundary(grid, report.claimed_epsilon,
                                            report.delta), floor),
              color='C3', ls='--',
              label=f'claimed eps = {report.claimed_epsilon:.2f}')
    axis.plot(grid, np.maximum(_dp_boundary(grid, report.epsilon_lower_bound,
                                            report.delta), floor),
              color='C2', ls=':', lw=2,
              label=f'lower bound eps = {report.epsilon_lower_bound:.2f}')
    axis.plot(grid, grid, color='0.6', lw=1, label='chance')
    if log_scale:
      axis.set_xscale('log')
      axis.set_yscale('log')
      axis.set_xlim(floor, 1.0)
      axis.set_ylim(floor, 1.05)
    else:
      axis.set_xlim(0.0, 1.0)
      axis.set_ylim(0.0, 1.01)
      axis.set_aspect('equal')
    axis.set_xlabel('false positive rate (canary absent, guessed in)')
    axis.set_ylabel('true positive rate (canary present, guessed in)')
    axis.set_title(report.name, fontsize=10)
    axis.grid(True, which='major', alpha=0.3)
    axis.legend(loc='lower right', fontsize=8)
  for axis in axes.ravel()[len(reports):]:
    axis.set_visible(False)
  if title:
    figure.suptitle(title)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


# ---------------------------------------------------------------------------
# Many runs as one program.
# ---------------------------------------------------------------------------

TrainFn = Callable[[jax.Array, jax.Array], jax.Array]


def simulate_runs(train_fn: TrainFn, keys: jax.Array, includes: jax.Array, *,
                  max_parallel: Optional[int] = None) -> np.ndarray:
  """Runs `train_fn(key, include)` for every pair as ONE compiled program.

  Example:
    >>> obs = simulate_runs(train_fn, run_keys(0, 8),
    ...                     jnp.arange(8) < 4)

  Args:
    train_fn: a whole run (e.g. a `lax.scan` over the steps) as a pure
      function of its noise key and a bool scalar: whether the canary is
      in. Returns its observations (a scalar or a vector).
    keys: one key per run, `[runs]`.
    includes: one bool per run, `[runs]`.
    max_parallel: runs vmapped at once (`lax.map` in chunks of this size, to
      cap memory); None runs them all at once.

  Returns:
    The observations, `[runs, m]` float64 (m = 1 for scalar scores).
  """
  def run_all(keys, includes):
    if max_parallel is None:
      return jax.vmap(train_fn)(keys, includes)
    return jax.lax.map(lambda args: train_fn(*args), (keys, includes),
                       batch_size=int(max_parallel))

  observations = np.asarray(jax.jit(run_all)(keys, includes), np.float64)
  return observations.reshape(observations.shape[0], -1)


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
  calibration_in = _scores(calibration_in, 'calibration_in')
  calibration_out = _scores(calibration_out, 'calibration_out')
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


def audit_observations(
    observations_in: np.ndarray,
    observations_out: np.ndarray,
    *,
    claimed_epsilon: float,
    delta: float,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    name: str = 'canary audit',
) -> AuditReport:
  """Turns per-run observations of both arms into an `AuditReport`.

  The first `calibration_fraction` of each arm is held out: there, a
  linear score is fitted (`fit_linear_score`, when runs observe more than
  one number) and the thresholds are chosen (`candidate_thresholds`). The
  remaining runs are scored with them and give the bound
  (`epsilon_lower_bound`), so nothing the bound's confidence rests on was
  tuned on the runs it counts.

  Example:
    >>> report = audit_observations(obs[:n], obs[n:], claimed_epsilon=2.0,
    ...                             delta=1e-5)

  Args:
    observations_in: `[n, m]` (or `[n]`) observations with the canary.
    observations_out: `[n', m]` (or `[n']`) observations without it.
    claimed_epsilon: the epsilon the run claims.
    delta: the delta of the claim.
    alpha: error probability of the bound.
    calibration_fraction: the share of each arm held out, in (0, 1).
    num_thresholds: thresholds kept (Bonferroni over them).
    name: what was audited.

  Returns:
    The `AuditReport`.

  Raises:
    ValueError: on non-finite observations or a split leaving an arm empty.
  """
  obs_in = np.asarray(observations_in, np.float64)
  obs_out = np.asarray(observations_out, np.float64)
  obs_in = obs_in.reshape(len(obs_in), -1)
  obs_out = obs_out.reshape(len(obs_out), -1)
  _scores(obs_in, 'the observations with the canary')
  _scores(obs_out, 'the observations without the canary')
  if not 0.0 < calibration_fraction < 1.0:
    raise ValueError('calibration_fraction must be in (0, 1), got '
                     f'{calibration_fraction!r}')
  held_in = int(round(calibration_fraction * len(obs_in)))
  held_out = int(round(calibration_fraction * len(obs_out)))
  if min(held_in, held_out) < 2 or held_in >= len(obs_in) or (
      held_out >= len(obs_out)):
    raise ValueError('too few runs for the held-out split: use more runs')
  if obs_in.shape[1] == 1:
    weights = np.ones(1)
  else:
    weights = fit_linear_score(obs_in[:held_in], obs_out[:held_out])
  scores_in, scores_out = obs_in @ weights, obs_out @ weights
  thresholds = candidate_thresholds(
      scores_in[:held_in], scores_out[:held_out], delta=delta, alpha=alpha,
      num_thresholds=num_thresholds, num_eval_in=len(obs_in) - held_in,
      num_eval_out=len(obs_out) - held_out)
  bound = epsilon_lower_bound(scores_in[held_in:], scores_out[held_out:],
                              delta, alpha, thresholds=thresholds)
  return AuditReport(
      name=name, method='many-run', claimed_epsilon=float(claimed_epsilon),
      epsilon_lower_bound=bound.epsilon, delta=float(delta),
      alpha=float(alpha), num_runs=min(len(obs_in), len(obs_out)),
      num_calibration_runs=min(held_in, held_out), bound=bound)


run_keys = runs.run_keys


def run_canary_audit(
    train_fn: TrainFn,
    *,
    num_runs: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    name: str = 'canary audit',
) -> AuditReport:
  """Audits any training run written as `train_fn(key, include)`.

  Runs `num_runs` runs with the canary and `num_runs` without, each with
  its own noise key, as one vmapped, jit-compiled program, then reports
  (`audit_observations`). This is how to audit your own training loop: put
  the loop (a `lax.scan` over the steps) in `train_fn`, insert the canary
  when `include` is True and the neighbouring example (or nothing) when it
  is False, build the private transformation from `key`, and return what
  an attacker sees (a score, or per-step observations that a linear score
  is fitted to on held-out runs).

  Example:
    >>> def train_fn(key, include):
    ...   tx = dpsco_jax.dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=z,
    ...                        num_steps=T, key=key)
    ...   ...                               # scan over T steps
    ...   return -loss_fn(final_params, canary)
    >>> report = run_canary_audit(train_fn, num_runs=1000,
    ...                           claimed_epsilon=2.0, delta=1e-5, key=0)

  Args:
    train_fn: `(key, include) -> observations` (scalar or `[m]`), pure and
      traceable; the key is traced, so the library's key-reuse check does
      not apply to it (run i's key is `fold_in(key, i)`, all distinct; see
      `run_keys`).
    num_runs: runs per arm.
    claimed_epsilon: the epsilon the run claims, from the accountant.
    delta: the delta of the claim.
    key: key or int seed; run i's noise key is `fold_in(key, i)`, even
      runs with the canary, odd runs without.
    alpha: error probability of the bound (confidence `1 - alpha`).
    calibration_fraction: the share of each arm held out to fit the score
      and choose the thresholds.
    num_thresholds: thresholds kept (Bonferroni over them).
    max_parallel: runs vmapped at once (None: all).
    name: what was audited, for the report.

  Returns:
    The `AuditReport`.
  """
  num_runs = checks.positive_int(num_runs, 'num_runs')
  keys = run_keys(key, 2 * num_runs)
  # Even runs have the canary, odd runs do not: run i's key and arm depend
  # on i only, so a larger audit extends a smaller one.
  includes = jnp.arange(2 * num_runs) % 2 == 0
  observations = simulate_runs(train_fn, keys, includes,
                               max_parallel=max_parallel)
  return audit_observations(
      observations[0::2], observations[1::2],
      claimed_epsilon=claimed_epsilon, delta=delta, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds, name=name)


# ---------------------------------------------------------------------------
# White-box gradient canaries.
# ---------------------------------------------------------------------------


def linear_loss(params: jax.Array, example: PyTree) -> jax.Array:
  """The white-box canary loss `<params, x>`: its gradient is `x` everywhere.

  Example:
    >>> linear_loss(jnp.ones(3), {'x': jnp.array([1.0, 2.0, 3.0])})   # 6.0

  Args:
    params: a flat parameter vector `[d]`.
    example: `{'x': [d]}`.

  Returns:
    The scalar loss.
  """
  return jnp.vdot(params, example['x'])


def _steps_per_epoch(steps_per_epoch: Optional[int], num_steps: int) -> int:
  if steps_per_epoch is None:
    return num_steps
  return checks.positive_int(steps_per_epoch, 'steps_per_epoch')


def _release_vector(release: PyTree) -> jax.Array:
  return flatten_util.ravel_pytree(release)[0]


def _example_ids(steps_per_epoch: int, batch_size: int) -> jax.Array:
  """`[steps_per_epoch, batch_size]` ids of the fixed-order batches."""
  return jnp.arange(steps_per_epoch * batch_size, dtype=jnp.int32).reshape(
      steps_per_epoch, batch_size)


def _run_fixed_order(tx, params, *, num_steps: int, steps_per_epoch: int,
                     update_args: Callable[[jax.Array], dict],
                     release_fn=None, record: bool = True):
  """Runs `tx` from `params` over batches in a fixed order (`lax.scan`).

  Step t calls `tx.update(None, state, params, **update_args(t mod
  steps_per_epoch))`. Returns `(final params, final state, releases)`,
  releases the `[num_steps, ...]` flattened release of each step (the
  updates, or `release_fn(updates, state)`), or None without `record`.
  """

  def step(carry, t):
    params, state = carry
    updates, state = tx.update(None, state, params,
                               **update_args(t % steps_per_epoch))
    release = None
    if record:
      release = _release_vector(
          updates if release_fn is None else release_fn(updates, state))
    return (optax.apply_updates(params, updates), state), release

  (params, state), releases = jax.lax.scan(
      step, (params, tx.init(params)), jnp.arange(num_steps))
  return params, state, releases


def gradient_canary_train_fn(
    make_transformation: MakeTransformation,
    *,
    num_steps: int,
    batch_size: int,
    steps_per_epoch: Optional[int] = None,
    dimension: int = 4,
    canary_norm: float = 1e3,
    canary_batch: int = 0,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    data_gradient_norm: float = 0.0,
    release_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    data_key: Any = 0,
) -> TrainFn:
  """The white-box gradient-canary run as `train_fn(key, include)`.

  The model is a vector of `dimension` parameters (zeros at the start) and
  the loss is `linear_loss`, so every example's gradient is its `x`,
  wherever the params are. The data are `steps_per_epoch` batches of
  `batch_size` examples taken in a fixed order (step t uses batch
  `t mod steps_per_epoch`, with `example_ids`), whose gradients are zero
  (or, with `data_gradient_norm`, random and orthogonal to the canary). The
  canary is the first example of batch `canary_batch`: gradient
  `canary_norm e_0`, which the transformation clips to its clip norm.

  The neighbouring data set (include = False) puts, in the canary's slot:

  * ADD_OR_REMOVE / ZERO_OUT: a zero-gradient example. With the batch size
    (the public normalizer) the same in both arms, a zero-gradient example
    adds exactly nothing to the clipped sum, so the run is, bit for bit,
    the run on the data set without the canary: that IS the add/remove
    neighbour (and the zero-out one).
  * REPLACE_ONE: the negated canary, `-canary_norm e_0`: the clipped sum
    moves by twice the clip norm, the whole replace-one sensitivity.

  Each step observes the projection of what the step releases (the updates,
  or `release_fn(updates, state)`) on the canary direction e_0; the
  observations are the `[num_steps]` projections. Noise of the library is
  isotropic and data gradients are orthogonal to e_0, so nothing else in
  the release carries information about the canary.

  Args:
    make_transformation: `(loss_fn, key) -> transformation`: builds the
      private transformation audited, with the given loss and noise key.
      It is called inside the vmapped program with a traced key.
    num_steps: steps per run.
    batch_size: examples per batch (the same in both arms).
    steps_per_epoch: batches per epoch (default `num_steps`: one pass).
    dimension: number of parameters (>= 2 when `data_gradient_norm` > 0).
    canary_norm: the canary gradient's norm; larger than the clip norm so
      the canary is clipped to exactly the clip norm. 0 gives a null audit
      (no canary in either arm).
    canary_batch: the batch holding the canary.
    neighboring_relation: which neighbour the out arm runs on.
    data_gradient_norm: norm of the data examples' gradients (orthogonal to
      the canary); 0 for zero gradients.
    release_fn: `(updates, state) -> pytree` of what the step releases
      (default: the updates).
    data_key: key or seed of the data gradients (the same for every run).

  Returns:
    `train_fn(key, include) -> [num_steps]` projections.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  steps_per_epoch = _steps_per_epoch(steps_per_epoch, num_steps)
  dimension = checks.positive_int(dimension, 'dimension')
  if not 0 <= canary_batch < steps_per_epoch:
    raise ValueError(f'canary_batch must be in [0, {steps_per_epoch}), got '
                     f'{canary_batch!r}')
  relation = neighboring.NeighboringRelation(neighboring_relation)
  canary = jnp.zeros(dimension, jnp.float32).at[0].set(canary_norm)
  neighbour = -canary if relation is (
      neighboring.NeighboringRelation.REPLACE_ONE) else jnp.zeros_like(canary)
  data = jnp.zeros((steps_per_epoch, batch_size, dimension), jnp.float32)
  if data_gradient_norm:
    if dimension < 2:
      raise ValueError('data gradients orthogonal to the canary need '
                       'dimension >= 2')
    data_key = jax.random.key(data_key) if isinstance(
        data_key, (int, np.integer)) else data_key
    directions = jax.random.normal(data_key, data.shape).at[..., 0].set(0.0)
    directions /= jnp.linalg.norm(directions, axis=-1, keepdims=True)
    data = data_gradient_norm * directions
  example_ids = _example_ids(steps_per_epoch, batch_size)

  def train_fn(key, include):
    slot = jnp.where(include, canary, neighbour)
    run_data = data.at[canary_batch, 0].set(slot)
    _, _, releases = _run_fixed_order(
        make_transformation(linear_loss, key),
        jnp.zeros(dimension, jnp.float32), num_steps=num_steps,
        steps_per_epoch=steps_per_epoch, release_fn=release_fn,
        update_args=lambda position: dict(
            batch={'x': run_data[position]},
            example_ids=example_ids[position]))
    return releases[:, 0]

  return train_fn


def run_gradient_canary_audit(
    make_transformation: MakeTransformation,
    *,
    num_steps: int,
    batch_size: int,
    num_runs: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    steps_per_epoch: Optional[int] = None,
    dimension: int = 4,
    canary_norm: float = 1e3,
    canary_batch: int = 0,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    data_gradient_norm: float = 0.0,
    release_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    name: str = 'white-box gradient canary',
) -> AuditReport:
  """White-box gradient-canary audit of any private transformation.

  `2 num_runs` runs (half with the canary, half on the neighbouring data
  set, see `gradient_canary_train_fn`) as one vmapped, jit-compiled
  program; each run observes its per-step releases projected on the canary
  direction. The score is the linear combination of those projections that
  separates the arms best on held-out runs (`fit_linear_score`): for i.i.d.
  noise (DP-SGD) it weighs the steps where the canary took part; for
  correlated noise (trees, matrix factorization, recursive gradients,
  DIFF2) it also undoes the noise correlation across steps, which is the
  likelihood-ratio test of the Gaussian mechanism. The bound is valid
  whatever the score; a better score only makes it tighter.

  Example:
    >>> T, b, z = 8, 4, 2.82
    >>> report = run_gradient_canary_audit(
    ...     lambda loss_fn, key: dpsco_jax.dpsgd(
    ...         loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=T,
    ...         key=key),
    ...     num_steps=T, steps_per_epoch=b, batch_size=8, num_runs=2000,
    ...     claimed_epsilon=2.0, delta=1e-5, key=0)
    >>> report.epsilon_lower_bound <= report.claimed_epsilon

  Args:
    make_transformation: `(loss_fn, key) -> transformation` (see
      `gradient_canary_train_fn`).
    num_steps, batch_size, steps_per_epoch, dimension, canary_norm,
      canary_batch, neighboring_relation, data_gradient_norm, release_fn:
      see `gradient_canary_train_fn`.
    num_runs: runs per arm.
    claimed_epsilon: the epsilon the transformation claims for this
      participation (from `dpsco_jax.accounting`).
    delta: the delta of the claim.
    key: key or int seed the runs' noise keys are folded from (`run_keys`).
    alpha, calibration_fraction, num_thresholds, max_parallel, name: see
      `run_canary_audit`.

  Returns:
    The `AuditReport`.
  """
  train_fn = gradient_canary_train_fn(
      make_transformation, num_steps=num_steps, batch_size=batch_size,
      steps_per_epoch=steps_per_epoch, dimension=dimension,
      canary_norm=canary_norm, canary_batch=canary_batch,
      neighboring_relation=neighboring_relation,
      data_gradient_norm=data_gradient_norm, release_fn=release_fn)
  return run_canary_audit(
      train_fn, num_runs=num_runs, claimed_epsilon=claimed_epsilon,
      delta=delta, key=key, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds, max_parallel=max_parallel, name=name)


# ---------------------------------------------------------------------------
# Black-box input canaries.
# ---------------------------------------------------------------------------


def _batched(data: PyTree, steps_per_epoch: int, batch_size: int) -> PyTree:
  def reshape(leaf):
    leaf = jnp.asarray(leaf)
    if leaf.ndim < 1 or leaf.shape[0] != steps_per_epoch * batch_size:
      raise ValueError(
          f'the data must hold steps_per_epoch * batch_size = '
          f'{steps_per_epoch * batch_size} examples (leading axis), got a '
          f'leaf of shape {leaf.shape}')
    return leaf.reshape((steps_per_epoch, batch_size) + leaf.shape[1:])
  return jax.tree_util.tree_map(reshape, data)


def input_canary_train_fn(
    make_transformation: MakeTransformation,
    *,
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    data: PyTree,
    canary: PyTree,
    score_fn: Callable[[PyTree, PyTree], jax.Array],
    num_steps: int,
    batch_size: int,
    steps_per_epoch: Optional[int] = None,
    canary_batch: int = 0,
    replacement: Optional[PyTree] = None,
    output_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
) -> TrainFn:
  """The black-box input-canary run as `train_fn(key, include)`.

  Trains from `params` on `data` (`steps_per_epoch * batch_size` examples
  taken in a fixed order of batches, step t using batch
  `t mod steps_per_epoch`, with `example_ids`) and scores the final params.
  The canary takes the first slot of batch `canary_batch`; that slot's
  own data example is never used by either arm. The neighbouring data set:

  * `replacement=None` (add/remove): the canary's slot is masked out
    (`batch_mask`), so the run sees the data set WITHOUT the canary. Build
    the transformation with `normalize_by=batch_size`: the library refuses
    a mask without a public normalizer, and the normalizer is then the same
    in both arms.
  * `replacement` given (replace-one): that example takes the slot.

  Args:
    make_transformation: `(loss_fn, key) -> transformation`.
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    params: the initial params (the same in every run).
    data: a pytree of examples with leading axis
      `steps_per_epoch * batch_size`.
    canary: one example (the data's structure without the leading axis),
      e.g. mislabeled or out of distribution.
    score_fn: `(final_params, canary) -> scalar`, higher meaning "more
      likely trained on the canary", e.g. `-loss_fn(params, canary)`.
    num_steps: steps per run.
    batch_size: examples per batch.
    steps_per_epoch: batches per epoch (default `num_steps`: one pass).
    canary_batch: the batch holding the canary.
    replacement: the example replacing the canary in the out arm
      (replace-one), or None (add/remove, masked out).
    output_fn: `(params, state) -> final params` to score (default: the
      params after the last step; e.g. `lambda p, s: final_params(s)` for
      Accelerated-DP-SRGD's y_T).

  Returns:
    `train_fn(key, include) -> score`.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  steps_per_epoch = _steps_per_epoch(steps_per_epoch, num_steps)
  if not 0 <= canary_batch < steps_per_epoch:
    raise ValueError(f'canary_batch must be in [0, {steps_per_epoch}), got '
                     f'{canary_batch!r}')
  batches = _batched(data, steps_per_epoch, batch_size)
  example_ids = _example_ids(steps_per_epoch, batch_size)
  masked = replacement is None
  neighbour = canary if masked else replacement

  def train_fn(key, include):
    slot = jax.tree_util.tree_map(
        lambda c, n: jnp.where(include, jnp.asarray(c), jnp.asarray(n)),
        canary, neighbour)
    run_batches = jax.tree_util.tree_map(
        lambda leaf, s: leaf.at[canary_batch, 0].set(s.astype(leaf.dtype)),
        batches, slot)
    masks = jnp.ones((steps_per_epoch, batch_size), bool).at[
        canary_batch, 0].set(include)
    def update_args(position):
      batch = jax.tree_util.tree_map(lambda leaf: leaf[position], run_batches)
      extra = {'batch_mask': masks[position]} if masked else {}
      return dict(batch=batch, example_ids=example_ids[position], **extra)

    final, state, _ = _run_fixed_order(
        make_transformation(loss_fn, key), params, num_steps=num_steps,
        steps_per_epoch=steps_per_epoch, update_args=update_args,
        record=False)
    if output_fn is not None:
      final = output_fn(final, state)
    return jnp.asarray(score_fn(final, canary), jnp.float32)

  return train_fn


def run_input_canary_audit(
    make_transformation: MakeTransformation,
    *,
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    data: PyTree,
    canary: PyTree,
    score_fn: Callable[[PyTree, PyTree], jax.Array],
    num_steps: int,
    batch_size: int,
    num_runs: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    steps_per_epoch: Optional[int] = None,
    canary_batch: int = 0,
    replacement: Optional[PyTree] = None,
    output_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    name: str = 'black-box input canary',
) -> AuditReport:
  """Black-box input-canary audit: your loss, data, canary and score.

  Only the final params are scored (what a model's user sees), so the bound
  is usually far below the white-box one (`run_gradient_canary_audit`):
  noise from steps the canary missed, and data gradients along the
  canary's, hide it. A bound above the claim is still proof of a bug.

  Example:
    >>> report = run_input_canary_audit(
    ...     lambda loss_fn, key: dpsco_jax.dpsgd(
    ...         loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=4,
    ...         normalize_by=8, key=key),
    ...     loss_fn=loss_fn, params=params, data=data, canary=canary,
    ...     score_fn=lambda p, c: -loss_fn(p, c), num_steps=4, batch_size=8,
    ...     steps_per_epoch=1, num_runs=2000, claimed_epsilon=2.0,
    ...     delta=1e-5, key=0)

  Args:
    make_transformation, loss_fn, params, data, canary, score_fn,
      num_steps, batch_size, steps_per_epoch, canary_batch, replacement,
      output_fn: see `input_canary_train_fn`.
    num_runs: runs per arm.
    claimed_epsilon: the epsilon claimed for this run.
    delta: the delta of the claim.
    key: key or int seed the runs' noise keys are folded from (`run_keys`).
    alpha, calibration_fraction, num_thresholds, max_parallel, name: see
      `run_canary_audit`.

  Returns:
    The `AuditReport`.
  """
  train_fn = input_canary_train_fn(
      make_transformation, loss_fn=loss_fn, params=params, data=data,
      canary=canary, score_fn=score_fn, num_steps=num_steps,
      batch_size=batch_size, steps_per_epoch=steps_per_epoch,
      canary_batch=canary_batch, replacement=replacement,
      output_fn=output_fn)
  return run_canary_audit(
      train_fn, num_runs=num_runs, claimed_epsilon=claimed_epsilon,
      delta=delta, key=key, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds, max_parallel=max_parallel, name=name)


# ---------------------------------------------------------------------------
# One run, many canaries.
# ---------------------------------------------------------------------------


def run_one_run_gradient_audit(
    make_transformation: MakeTransformation,
    *,
    num_canaries: int,
    num_steps: int,
    batch_size: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    steps_per_epoch: Optional[int] = None,
    canary_norm: float = 1e3,
    score_sign: float = 1.0,
    release_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    num_positive_guesses: Optional[int] = None,
    num_negative_guesses: Optional[int] = None,
    alpha: float = 0.05,
    name: str = 'one-run gradient canaries',
) -> AuditReport:
  """One-run audit (Steinke, Nasr, Jagielski 2023) with gradient canaries.

  ONE run of `make_transformation` on a model of `num_canaries` parameters:
  canary i has gradient `canary_norm e_i` and sits in batch
  `i mod steps_per_epoch`; each is included independently with
  probability 1/2 (drawn from a key independent of the noise key), an
  excluded canary's slot holding a zero-gradient example (the add/remove
  neighbour, as in `gradient_canary_train_fn`). Canary i's score is
  `score_sign` times the sum, over the steps where its batch was used, of
  the released update's coordinate i; then `one_run_epsilon_lower_bound`.

  The score weighs the canary's own steps only (right for i.i.d. noise;
  valid but looser for correlated noise). Use `score_sign=-1` when the
  release is a descent step (an optimizer such as `optax.sgd` chained after
  the estimator). Needs `steps_per_epoch * batch_size >= num_canaries`.

  Example:
    >>> report = run_one_run_gradient_audit(
    ...     lambda loss_fn, key: dpsco_jax.dpsgd(
    ...         loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=4,
    ...         key=key),
    ...     num_canaries=1000, num_steps=4, batch_size=250,
    ...     claimed_epsilon=2.0, delta=1e-5, key=0)

  Args:
    make_transformation: `(loss_fn, key) -> transformation`.
    num_canaries: m.
    num_steps: steps of the run.
    batch_size: examples per batch (canaries and zero-gradient fillers).
    claimed_epsilon: the epsilon claimed for this run.
    delta: the delta of the claim.
    key: key or int seed (`run_keys(key, 2)`: the inclusion key, then the
      noise key).
    steps_per_epoch: batches per epoch (default `num_steps`).
    canary_norm: the canaries' gradient norm (above the clip norm).
    score_sign: +1 when the release moves along the gradient (a raw
      estimator output), -1 after a descent step.
    release_fn: `(updates, state) -> pytree` released (default: updates).
    num_positive_guesses, num_negative_guesses: k+ and k- (default m // 10
      each), fixed in advance.
    alpha: error probability (confidence `1 - alpha`).
    name: what was audited.

  Returns:
    An `AuditReport` with `method='one-run'` and its `one_run` bound.
  """
  m = checks.positive_int(num_canaries, 'num_canaries')
  num_steps = checks.positive_int(num_steps, 'num_steps')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  steps_per_epoch = _steps_per_epoch(steps_per_epoch, num_steps)
  if steps_per_epoch * batch_size < m:
    raise ValueError(f'{m} canaries need steps_per_epoch * batch_size >= '
                     f'{m}, got {steps_per_epoch * batch_size}')
  inclusion_key, noise_key = run_keys(key, 2)
  included = jax.random.bernoulli(inclusion_key, 0.5, (m,))
  canaries = jnp.arange(m)
  batch_of = canaries % steps_per_epoch
  data = jnp.zeros((steps_per_epoch, batch_size, m), jnp.float32).at[
      batch_of, canaries // steps_per_epoch, canaries].set(
          canary_norm * included.astype(jnp.float32))
  example_ids = _example_ids(steps_per_epoch, batch_size)

  def run(key, data):
    _, _, releases = _run_fixed_order(
        make_transformation(linear_loss, key), jnp.zeros(m, jnp.float32),
        num_steps=num_steps, steps_per_epoch=steps_per_epoch,
        release_fn=release_fn,
        update_args=lambda position: dict(
            batch={'x': data[position]}, example_ids=example_ids[position]))
    return releases

  # The noise key is an argument of the compiled program (traced), like
  # every run's key in the many-run audits.
  releases = np.asarray(jax.jit(run)(noise_key, data), np.float64)
  own_steps = (np.arange(num_steps)[:, None] % steps_per_epoch ==
               np.asarray(batch_of)[None, :])
  scores = float(score_sign) * (releases * own_steps).sum(axis=0)
  bound = one_run_epsilon_lower_bound(
      scores, np.asarray(included), delta=delta, alpha=alpha,
      num_positive_guesses=num_positive_guesses,
      num_negative_guesses=num_negative_guesses)
  return AuditReport(
      name=name, method='one-run', claimed_epsilon=float(claimed_epsilon),
      epsilon_lower_bound=bound.epsilon, delta=float(delta),
      alpha=float(alpha), num_runs=m, one_run=bound)


# ---------------------------------------------------------------------------
# Auditing a plan.
# ---------------------------------------------------------------------------


# The chunk size `audit_plan` starts from: enough runs to vectorize the
# step over, few enough that progress is reported often and a chunk's
# batches stay small on the host.
_DEFAULT_RUNS_PER_CHUNK = 64
# `audit_plan`'s default bound on one chunk's memory.
DEFAULT_AUDIT_MEMORY_BYTES = 2**30


def _poisson_chunk(sampler: Any, seeds: Sequence[int], run_ids: np.ndarray,
                   width: int) -> tuple[np.ndarray, Any, list[Any]]:
  """A chunk of Poisson runs: those that fit `width`, and the others.

  Returns `(ids, (indices, masks) or None, wide)`: the runs whose batches
  all fit `width`, their batches padded to it (`runs.padded_runs`), and for
  every other run `(id, batches, needed width)`, its batches compacted to
  their real examples until they run at a wider size.
  """
  drawn = [runs.drawn_batches(sampler, seed) for seed in seeds]
  needed = [runs.needed_width(b, sampler.pad_to_multiple) for b in drawn]
  fits = [k for k, size in enumerate(needed) if size <= width]
  wide = [(run_ids[k], [(ids[keep].astype(np.int32),
                         np.ones(int(np.sum(keep)), bool))
                        for ids, keep in drawn[k]], needed[k])
          for k in range(len(run_ids)) if needed[k] > width]
  batches = runs.padded_runs([drawn[k] for k in fits], width) if fits else None
  return run_ids[fits], batches, wide


def _even_chunks(total: int, most: int) -> int:
  """The chunk size, at most `most`, that splits `total` runs most evenly
  into the fewest chunks (the last chunk is filled with discarded runs)."""
  chunks = -(-total // min(total, most))
  return -(-total // chunks)


def _chunk_size(memory_of: Callable[[int], Optional[int]], total: int, *,
                max_parallel: Optional[int], max_memory_bytes: int,
                data_bytes: int) -> tuple[int, Optional[int]]:
  """`(runs per chunk, its program's bytes)` for `audit_plan`.

  `max_parallel` if given; else from `_DEFAULT_RUNS_PER_CHUNK` down until
  `memory_of(runs)` (a compilation) is at most `max_memory_bytes`, the
  memory beyond the data taken as proportional to the runs. Warns when
  even one run takes more.
  """
  count = _even_chunks(total, max_parallel or _DEFAULT_RUNS_PER_CHUNK)
  memory = memory_of(count)
  if max_parallel is not None or memory is None:
    return count, memory
  while count > 1 and memory > max_memory_bytes:
    per_run = max(1.0, (memory - data_bytes) / count)
    count = _even_chunks(total, max(1, min(
        count - 1, int((max_memory_bytes - data_bytes) // per_run))))
    memory = memory_of(count)
  if memory > max_memory_bytes:
    warnings.warn(
        f'one run of the audit takes {memory / 2**20:.0f} MiB, more than '
        f'max_memory_bytes = {max_memory_bytes}: the runs go one at a time',
        stacklevel=4)
  return count, memory


def _program_bytes(compiled: Any) -> Optional[int]:
  """What XLA says a compiled program holds at once: its arguments,
  outputs and temporaries (None where the backend does not say)."""
  try:
    memory = compiled.memory_analysis()
  except (AttributeError, NotImplementedError, RuntimeError):
    return None
  if memory is None:
    return None
  return int(memory.argument_size_in_bytes + memory.output_size_in_bytes +
             memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def _tree_bytes(tree: PyTree) -> int:
  return sum(int(np.prod(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree_util.tree_leaves(tree))


def _plan_relation(plan: Any) -> neighboring.NeighboringRelation:
  if plan.ledger is not None:
    return neighboring.NeighboringRelation(plan.ledger.neighboring_relation)
  # The full-batch families (DIFF2, DP-GD, multi-pass O2NC) are replace-one.
  return neighboring.NeighboringRelation.REPLACE_ONE


def _plan_scores(plan: Any, *, params: PyTree, data: PyTree, canary: PyTree,
                 replacement: PyTree, canary_index: int, masked: bool,
                 score_fn: Callable[[PyTree, PyTree], jax.Array],
                 output_fn: Callable[[PyTree, PyTree], PyTree],
                 num_runs: int, key: Any, max_parallel: Optional[int],
                 max_memory_bytes: int, progress: Optional[bool]
                 ) -> np.ndarray:
  """`audit_plan`'s runs: the score of run i at index i, `[2 num_runs]`.

  `data` holds jnp arrays, `replacement` the neighbour's row (ignored where
  `masked`: the row is then masked out of the runs without the canary).
  """
  n = plan.num_examples
  tx = plan.transformation
  # The plan's own initial state (its checks run here, on the host); each
  # run swaps in its own noise keys.
  initial_state = tx.init(params)

  def batch_of(data, indices, include):
    # The rows at `indices` (None: all) of this run's data set: the canary's
    # row holds the canary or its neighbour (masked out of every batch when
    # `masked`, so then its value is never used). Gathered per step, so no
    # run holds a copy of the data.
    if indices is None:
      batch, at_row = data, jnp.arange(n) == canary_index
    else:
      batch = jax.tree_util.tree_map(lambda leaf: leaf[indices], data)
      at_row = indices == canary_index

    def patch(leaf, inserted, neighbour):
      row = jnp.where(include, jnp.asarray(inserted, leaf.dtype),
                      jnp.asarray(neighbour, leaf.dtype))
      return jnp.where(at_row.reshape(at_row.shape + (1,) * (
          leaf.ndim - at_row.ndim)), row, leaf)

    return jax.tree_util.tree_map(patch, batch, canary, replacement)

  def step_inputs(data, include, indices, mask):
    if indices is None:              # full batch: every row, every step
      return {'batch': batch_of(data, None, include)}
    inputs = {'batch': batch_of(data, indices, include),
              'example_ids': indices}
    keep = jnp.ones(indices.shape, bool) if mask is None else mask
    if masked:
      keep = keep & ~((indices == canary_index) & ~include)
    if mask is not None or masked:
      inputs['batch_mask'] = keep
    return inputs

  def train_fn(data, run_key, include, batches):
    (p, s), _ = runs.scan_steps(
        tx, params, runs.fresh_run_keys(initial_state, run_key), batches,
        inputs_fn=functools.partial(step_inputs, data, include),
        num_steps=plan.num_steps)
    # The guards' records come back with the score: a refused run raises.
    return (jnp.asarray(score_fn(output_fn(p, s), canary), jnp.float32),
            guards.refusals_in(s))

  def run_chunk(data, run_key_array, includes, batches):
    return jax.vmap(train_fn, in_axes=(None, 0, 0, 0))(
        data, run_key_array, includes, batches)

  total = 2 * num_runs
  run_key_array = run_keys(key, total)
  includes = np.arange(total) % 2 == 0
  sampler = plan.batches
  seeds = None if sampler is None else runs.sampler_seeds(key, total)
  widths = None if sampler is None else runs.poisson_widths(sampler)
  compiled = {}

  def program(width, count):
    # One compilation per (padded size, chunk size): the common size, and
    # the widest only if some run needs it.
    if (width, count) not in compiled:
      if sampler is None:
        batches = None
      elif widths is None:
        batches = runs.run_batches(sampler, seeds[:1])
      else:
        batches = (np.zeros((1, plan.num_steps, width), np.int32),
                   np.zeros((1, plan.num_steps, width), bool))
      specs = jax.tree_util.tree_map(
          lambda a: jax.ShapeDtypeStruct((count,) + a.shape[1:], a.dtype),
          (run_key_array[:1], includes[:1], batches))
      compiled[(width, count)] = jax.jit(run_chunk).lower(
          data, *specs).compile()
    return compiled[(width, count)]

  what = (f'dpsco_jax: auditing the {plan.algorithm} plan ({total} runs of '
          f'{plan.num_steps} steps)')
  with progress_lib.task(what, progress=progress) as report:
    report('compiling')
    common = None if widths is None else widths[0]
    count, memory = _chunk_size(
        lambda count: _program_bytes(program(common, count)), total,
        max_parallel=max_parallel, max_memory_bytes=max_memory_bytes,
        data_bytes=_tree_bytes(data))
    chunk_note = f'{count} runs per chunk' + (
        '' if memory is None else f' of about {memory / 2**20:.0f} MiB')
    scores = np.full(total, np.nan)
    in_flight, wide = [], []
    timing = {'done': 0, 'since': None, 'done_since': 0}

    def launch(run_ids, batches, width):
      # A short chunk is filled with repeats of its first run, discarded.
      fill = count - len(run_ids)
      chosen = np.concatenate([run_ids, np.full(fill, run_ids[0])])
      batches = jax.tree_util.tree_map(
          lambda a: np.concatenate([a, np.repeat(a[:1], fill, axis=0)]),
          batches)
      in_flight.append((run_ids, program(width, count)(
          data, run_key_array[chosen], includes[chosen], batches)))

    def collect():
      run_ids, (out, refusals) = in_flight.pop(0)
      plan.check_refusals(refusals)
      scores[run_ids] = np.asarray(out, np.float64)[:len(run_ids)]
      timing['done'] += len(run_ids)
      now = time.perf_counter()
      if timing['since'] is None:     # the first chunk paid the compilation
        timing['since'], timing['done_since'] = now, timing['done']
        eta = ''
      else:
        rate = (timing['done'] - timing['done_since']) / (
            now - timing['since'])
        eta = f', eta {(total - timing["done"]) / rate:.0f} s'
      report(f'{timing["done"]}/{total} runs ({chunk_note}){eta}')

    def launch_wide(group):
      width = max([widths[1]] + [needed for _, _, needed in group])
      launch(np.array([run for run, _, _ in group]),
             runs.padded_runs([batches for _, batches, _ in group], width), width)

    for start in range(0, total, count):
      run_ids = np.arange(start, min(start + count, total))
      if sampler is None:
        batches = None
      elif widths is None:
        batches = runs.run_batches(sampler, [seeds[i] for i in run_ids])
      else:
        run_ids, batches, too_wide = _poisson_chunk(
            sampler, [seeds[i] for i in run_ids], run_ids, common)
        wide += too_wide
      if len(run_ids):
        launch(run_ids, batches, common)
      while len(wide) >= count:
        launch_wide(wide[:count])
        wide = wide[count:]
      while len(in_flight) > 1:
        collect()
    if wide:
      launch_wide(wide)
    while in_flight:
      collect()
  return scores


def audit_plan(
    plan: Any,
    *,
    params: PyTree,
    data: PyTree,
    canary: PyTree,
    num_runs: int,
    key: Any,
    loss_fn: Optional[Callable[[PyTree, PyTree], jax.Array]] = None,
    score_fn: Optional[Callable[[PyTree, PyTree], jax.Array]] = None,
    canary_index: int = 0,
    replacement: Optional[PyTree] = None,
    output_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    max_memory_bytes: int = DEFAULT_AUDIT_MEMORY_BYTES,
    progress: Optional[bool] = None,
    name: Optional[str] = None,
) -> AuditReport:
  """Black-box canary audit of a `plans.Plan`: its lower bound beside its epsilon.

  What is simulated: `2 num_runs` whole runs of the plan, each the plan
  itself with fresh randomness:

  * its transformation (`plan.transformation`: the private estimator with
    the plan's calibrated noise multiplier and clip, the in-step batch
    check, your optimizer), initialized once from `params` and stepped
    `plan.num_steps` times;
  * its noise: the mechanism state the transformation makes, with every
    noise key replaced by one folded from the run's key (`run_keys`), so
    that runs draw independent noise exactly as the plan draws it;
  * its sampler: `plan.batches` (the same class, sizes and padding)
    reseeded per run from the audit's key, iterated on the host; under
    Poisson sampling every run draws its own Bernoulli batches, so the
    amplification the plan's epsilon counts on is what is attacked.
    Full-batch plans (DIFF2, DP-GD, multi-pass O2NC) use all of `data`
    every step.

  How it runs: ONE compiled program (the steps in a `lax.scan`, a chunk of
  runs `jax.vmap`-ed) is called chunk after chunk; the host draws the next
  chunk's batches while the current one runs. Poisson batches are the
  sampler's own, re-padded to one common size: the smallest multiple of
  its `pad_to_multiple` that holds all of a run's batches with probability
  0.99 (usually the sampler's own padded size), so every step has one
  shape. The rare run with a larger batch is run afterwards, in chunks of
  its own, at the padded size of the largest batch the plan's check
  accepts (one more compilation, only if such a run occurs). Padding is
  masked out; the batches are exactly the sampler's. The cost is about
  `2 num_runs x plan.num_steps` steps of the plan's batch (see
  docs/audit.md for measured times), plus the host's draws (under Poisson
  sampling `num_examples` uniforms per run and step).

  Memory: a chunk's program holds `data`, the chunk's batch indices and
  masks (`runs x num_steps x width` int32 and bool) and, for each run, the
  params, the optimizer state and one step's work (e.g. per-example
  gradients, `width x` the params). Without `max_parallel`, the chunk
  starts at 64 runs and is shrunk until the compiled program's memory, as
  XLA reports it (arguments, outputs and temporaries), is at most
  `max_memory_bytes`; two chunks' batches are alive at once on the host.
  The progress line says the chunk size and its memory.

  A faster, looser alternative where it applies: many canaries in ONE run
  (`run_one_run_gradient_audit`, Steinke, Nasr and Jagielski 2023): one
  training run instead of `2 num_runs`, but white-box gradient canaries
  against a transformation (not this plan's sampler) and a bound far below
  this one's for the same mechanism.

  How the canary is inserted: `data` (the plan's `num_examples` rows) gets
  the `canary` at row `canary_index`. The neighbouring data set, for the
  plan's neighbouring relation:

  * add/remove or zero-out: the canary's row is masked out (`batch_mask`
    False) wherever the sampler puts it. Under Poisson sampling this is
    exactly the data set without that row: every other row's draws are
    unchanged, and the canary takes part in a step only when the run's
    sampler draws its row (probability q per step), as any example would.
    The noisy sum is divided by the plan's public normalizer in both arms.
  * replace-one (DIFF2, DP-GD, the nonsmooth plans): the row holds
    `replacement` (default: `data`'s own row at `canary_index`).

  Under add/remove or zero-out, a given `replacement` takes the row instead
  of the mask: it must then be an example whose clipped contribution is
  zero (a zero-gradient example, the zero-out neighbour). A shuffled plan
  needs one, since its batch check refuses a batch with a masked example.

  Each run is scored on what the plan releases as its model (the params
  after the last step; `final_params` for Accelerated-DP-SRGD, the O2NC
  output for the nonsmooth plans; or `output_fn(params, state)`):
  `score_fn(output, canary)`, by default `-loss_fn(output, canary)` (a low
  canary loss says "in"). The claim is `plan.epsilon` at `plan.delta`
  (with any preprocessing releases, which are not simulated: the claim
  is then larger than what is attacked, and the bound still valid).
  A canary the data do not explain (a feature no real row uses, a
  mislabeled outlier) gives the tightest bound.

  Example:
    >>> plan = plans.dpsgd(loss_fn, optimizer=optax.sgd(0.5),
    ...                    num_examples=64, batch_size=48, epochs=2,
    ...                    l2_clip=1.0, epsilon=2.0, delta=1e-5,
    ...                    clipping_method='vmap')
    >>> report = audit_plan(plan, params=params, data=data, canary=canary,
    ...                     loss_fn=loss_fn, num_runs=1000, key=0)
    >>> report.epsilon_lower_bound, report.claimed_epsilon

  Args:
    plan: a `plans.Plan` (any family), built without `axis_name` (the
      runs are vmapped on one device).
    params: the initial params of every run.
    data: the plan's training set: a pytree whose leaves' leading axis is
      `plan.num_examples`.
    canary: one example (the data's structure without the leading axis).
    num_runs: runs per arm.
    key: key or int seed: run i's noise key is `fold_in(key, i)` (even runs
      with the canary, odd runs without) and its sampler seed is derived
      from the key and i; neither depends on the chunking.
    loss_fn: `loss_fn(params, example) -> scalar`, the plan's loss, for the
      default score.
    score_fn: `(output, canary) -> scalar`, higher meaning "in" (instead of
      `loss_fn`).
    canary_index: the row the canary takes.
    replacement: the row's example in the runs without the canary: for
      replace-one plans any example (default: `data`'s own row); for the
      others a zero-contribution example (default: none, the row is masked
      out).
    output_fn: `(params, state) -> output` scored (default: see above).
    alpha, calibration_fraction, num_thresholds: see `run_canary_audit`.
    max_parallel: runs per chunk (vmapped at once); None (default) picks it
      from `max_memory_bytes`.
    max_memory_bytes: the bound on one chunk's compiled program when
      `max_parallel` is None (default `DEFAULT_AUDIT_MEMORY_BYTES`, 1 GiB).
      A single run above it runs alone, with a warning.
    progress: a progress line on stderr (runs done, runs per chunk, time
      left); None follows `$DPSCO_JAX_PROGRESS` (`dpsco_jax.progress`).
    name: what was audited (default: the plan's algorithm).

  Returns:
    The `AuditReport` (`claimed_epsilon` is `plan.epsilon`).

  Raises:
    ValueError: if neither `loss_fn` nor `score_fn` is given, the data do
      not hold `plan.num_examples` rows, `canary_index` is out of range, or
      a shuffled plan is given no `replacement`.
  """
  if (loss_fn is None) == (score_fn is None):
    raise ValueError('give loss_fn= (the score is minus the canary\'s loss) '
                     'or score_fn=, not both')
  if score_fn is None:
    score_fn = lambda output, example: -loss_fn(output, example)
  num_runs = checks.positive_int(num_runs, 'num_runs')
  if max_parallel is not None:
    max_parallel = checks.positive_int(max_parallel, 'max_parallel')
  max_memory_bytes = checks.positive_int(max_memory_bytes, 'max_memory_bytes')
  n = plan.num_examples
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None
           for leaf in jax.tree_util.tree_leaves(data)}
  if sizes != {n}:
    raise ValueError(f'the data\'s leading axes are {sorted(map(str, sizes))};'
                     f' the plan is for num_examples = {n}')
  if not 0 <= int(canary_index) < n:
    raise ValueError(f'canary_index must be in [0, {n}), got '
                     f'{canary_index!r}')
  canary_index = int(canary_index)
  relation = _plan_relation(plan)
  replace_one = relation is neighboring.NeighboringRelation.REPLACE_ONE
  masked = not replace_one and replacement is None
  if masked and isinstance(plan.batches, batching.ShuffledBatches):
    raise ValueError(
        'a shuffled plan checks that every batch holds exactly batch_size '
        'real examples, so the canary\'s row cannot be masked out of it: give '
        'replacement= an example whose clipped contribution is zero for your '
        'loss (the zero-out neighbour), or audit the plan with '
        "sampling='poisson' or 'fixed'")
  data = jax.tree_util.tree_map(jnp.asarray, data)
  if replacement is None:
    replacement = jax.tree_util.tree_map(lambda leaf: leaf[canary_index],
                                         data)
  output_fn = runs.plan_output(plan) if output_fn is None else output_fn
  scores = _plan_scores(
      plan, params=params, data=data, canary=canary, replacement=replacement,
      canary_index=canary_index, masked=masked, score_fn=score_fn,
      output_fn=output_fn, num_runs=num_runs, key=key,
      max_parallel=max_parallel, max_memory_bytes=max_memory_bytes,
      progress=progress)
  return audit_observations(
      scores[0::2], scores[1::2], claimed_epsilon=plan.epsilon,
      delta=plan.delta, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds,
      name=name or f'{plan.algorithm} plan, canary row {canary_index}')
