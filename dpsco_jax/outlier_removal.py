"""The outlier-removal private mean of paper 002 (its Algorithms 1 and 2).

K points `v_1..v_K` (one per user, or one per group of users) are averaged
privately with noise that scales with a CONCENTRATION radius tau instead of
a clip norm: when the points sit within tau of each other (i.i.d. users'
mean gradients sit within about L/sqrt(m) of their mean), the released mean
needs noise of order tau/K, not L/K. The steps (paper 002, Algorithms 1-2,
§2.0 of the implementation notes):

1. Distances: `d_jj' = ||v_j - v_j'||` for all pairs, from coordinate
   differences (blocked over rows, per leaf, no concatenation), as
   certified upper bounds (Rounding, below).
2. Score: `s = (1/K) sum_{j,j'} 1(d_jj' <= score_radius)`, in [0, K].
   Replacing one point moves it by less than 2.
3. Test: `s + Lap(b) >= threshold` (paper: 4K/5). A failed test HALTS: the
   release is a data-independent `halt_value`, nothing else.
4. Soft inclusion: `h_j = #{j': d_jj' <= 2 tau}` (self included) and
   `p_j = clip((h_j - K/2) / (K/6), 0, 1)`.
5. Mean: `'weighted'` (the default) releases `sum_j p_j v_j / sum_j p_j`;
   `'sampled'` (the paper's) keeps point j when `u_j < p_j` for shared
   uniforms u and averages the kept points.
6. Release: the mean plus `N(0, sigma^2 I)`.

Privacy. The paper's sensitivity of step 5 (its Lemmas B.2/C.2, quoting
AL24 Lemma 3.5) hides its constant; `mean_sensitivity` derives an explicit
one (docs/user_level.md has the proof) for any score cutoff `s_cut >= 2K/3`
(a pass with a score below it is a failure event charged to delta):

* every point of positive weight, on either neighbour, lies within 4 tau
  of a shared point a (two points with h > K/2 share a neighbour; a has
  h_a >= (s_cut - 1) K/(K - 1));
* each shared point's weight moves by at most 6/K, so their total moves by
  P = 6 (K - 1)/K < 6;
* the total weight is at least W = 2 s_cut - K (the convex minorant of the
  inclusion ramp is max(0, 2h/K - 1));

so the weighted mean moves by at most `4 tau (2 P + 3) / W`: 180 tau/K at
the paper's cutoff 2K/3, for EVERY input and every draw. The sampled mean's
bound replaces P by a Chernoff quantile of the number of inclusions that
differ under the shared uniforms and W by a lower quantile of the kept
count; both failure probabilities join delta (`calibrate`).

The whole release is the Laplace score (pure, sensitivity 2) composed with
the Gaussian mean, accounted together by dp_accounting's PLD
(`accounting.laplace_and_gaussian_delta`), plus the tails: a pass below the
cutoff, P(Lap(b) >= threshold - s_cut - 2) and the coupling failure.
`calibrate` turns (K, tau, epsilon, delta) into every noise level; no
constant of the paper (its 100 and 1000 multipliers) is used.

Rounding. The proof (docs/user_level.md §2) reasons about the relation
"j and j' are close" through three facts: it depends on the two points
only (Facts 1 and 4), it implies that they are truly within the radius
(Facts 2 and 3, via the triangle inequality), and a closer radius implies
a wider one (score pairs within the inclusion radius). The computed
relation has all three, in float32 or bfloat16 and at ANY offset from the
origin:

* a distance is computed from `fl(a_i - b_i)`, whose error is relative to
  the difference itself (not to `|a|` or `|b|`, as the Gram form's
  `|a|^2 + |b|^2 - 2 a.b` is: far from the origin its terms cancel and
  points far apart came out at distance 0, a release moving 2.8 times
  its sensitivity);
* a sum of n non-negative terms, each through at most N roundings (the
  difference, the square, sqrt(n)-sized block sums in whatever order XLA
  adds, the leaves), is at least `(1 - u)^N` times the exact sum, so
  `fl(sum) (1 + 2 (N + 3) u) + 4 n tiny` (tiny: the smallest normal
  number, for squares that underflow) is an upper bound on the exact
  squared distance even after its own roundings;
* a pair counts as close when that bound is at most `fl(r^2)` rounded
  DOWN: a counted pair is truly within r. Rounding can only make the
  tests stricter (a pair within about `r (1 - N u)` still counts).

Counts are exact int32 sums; the score is `c // K + (c mod K)/K` with only
the fraction rounded (2^-25), and the Laplace noise joins the fraction
before the whole part is added, so Fact 1's bound `2 (K - 1)/K < 2` keeps
its slack for K < 2^24. Weights `clip((6 h - 3K)/K, 0, 1)` are one
division from exact integers (relative error u); `mean_sensitivity` adds
2u per changed weight and the factor 1 - u on the total weight. The mean
is formed as a kept point plus the weighted mean of the kept points'
differences from it (pairwise sums), so its rounding is at most
`mean_rounding_bound` = 8 tau gamma_{2L+4} (L = ceil(log2 K)) whatever the
offset; `mean_sensitivity` adds it for both neighbours. The Gaussian
noise is added to that difference mean before the kept point is added
back, and the result is cast to the points' dtype last: the roundings after
the noise are post-processing of the noisy value (up to the relative-u
rounding of the noisy offset itself, the floating-point caveat that every
float Gaussian or Laplace sample carries). A caller's `center` is no longer
used: privacy never rested on it, and differences need none.

Robustness: a point with a NaN or Inf coordinate (or whose squared norm
overflows) is at distance +inf from every other point, so its weight is 0
and it can never reach the mean, and the score still moves by less than 2.

References:
  Paper 002 (Lowy, Liu, Asi: user-level DP-SCO), Algorithm 1 lines 13-22,
  Algorithm 2 lines 4-14, Lemmas B.2 and C.2; Asi & Liu (AISTATS 2024),
  Lemma 3.5; Dwork & Roth (2014), the Laplace mechanism.
"""

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence
import warnings

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import keys as keys_lib
from dpsco_jax import parallel
from dpsco_jax import rounding
from dpsco_jax import strategies

PyTree = Any

INCLUSIONS = ('weighted', 'sampled')

# The paper's test threshold (4K/5) and the score the analysis needs on a
# pass (2K/3): Algorithm 1, line 13, and the proof of Lemma B.2.
PAPER_THRESHOLD_FRACTION = 0.8
PAPER_CUTOFF_FRACTION = 2.0 / 3.0
FLOAT32_ROUNDOFF = rounding.FLOAT32_ROUNDOFF


class OutlierRemovalCalibration(NamedTuple):
  """Every constant of a phase of private robust means, from `calibrate`.

  One phase is either ONE release with a fixed threshold (Algorithm 1) or
  up to `num_steps` releases on K points sampled without replacement from
  `population` each step, tested by AboveThreshold with one threshold
  noise per phase (Algorithm 2).

  Attributes:
    num_points: K, the number of points averaged per release.
    tau: the concentration radius; inclusion counts neighbours within
      2 tau.
    score_radius: the score counts pairs within this radius (Algorithm 1:
      tau; Algorithm 2: 2 tau).
    threshold: the test threshold on the score, in [0, K] (paper: 4K/5).
    cutoff: the score the analysis needs on a pass (>= 2K/3); a pass below
      cutoff + 2 is a failure event, charged to delta.
    laplace_scale: the scale of the Laplace noise on each score.
    threshold_scale: the scale of AboveThreshold's threshold noise, drawn
      once per phase (0 for a fixed threshold: one release).
    inclusion: 'weighted' or 'sampled'.
    sensitivity: the l2 sensitivity of the pre-noise mean on a pass
      (`mean_sensitivity`).
    noise_std: sigma of the Gaussian noise on the mean.
    num_steps: the releases the phase is calibrated for.
    population: the users each step's K are sampled from without
      replacement (None: the K points are all there is).
    epsilon: the phase's epsilon.
    delta: the phase's delta, all parts below included.
    score_epsilon: the epsilon of the score tests (Laplace, or
      AboveThreshold: 2/threshold_scale + 4/laplace_scale).
    tail_delta: the part of delta for score noise large enough to pass a
      test below the cutoff.
    coupling_delta: the part for the sampled coupling failing (0 for
      'weighted').
    gaussian_delta: the delta of the score-and-Gaussian composition.
  """

  num_points: int
  tau: float
  score_radius: float
  threshold: float
  cutoff: float
  laplace_scale: float
  threshold_scale: float
  inclusion: str
  sensitivity: float
  noise_std: float
  num_steps: int
  population: Optional[int]
  epsilon: float
  delta: float
  score_epsilon: float
  tail_delta: float
  coupling_delta: float
  gaussian_delta: float


class RobustMeanRelease(NamedTuple):
  """What one private robust mean releases (all of it is private).

  Attributes:
    value: the noisy mean, or the `halt_value` when the test failed.
    passed: whether the noisy score passed the threshold.
    noisy_score: the score plus its Laplace noise (the test is computed
      from it, so releasing it costs nothing more).
    not_replicated: under `axis_name` inside a compiled program, True when
      the key differed across devices (then `value` is NaN): a caller with
      a state records it (`guards.record`), as `outlier_removal_gradient`
      does; None when not checked on the device.
  """

  value: PyTree
  passed: jax.Array
  noisy_score: jax.Array
  not_replicated: Optional[jax.Array] = None


def _check_inclusion(inclusion: str) -> str:
  if inclusion not in INCLUSIONS:
    raise ValueError(f'inclusion must be one of {INCLUSIONS}, got '
                     f'{inclusion!r}')
  return inclusion



def _check_probability(value: float, name: str) -> float:
  if not 0.0 < value < 1.0:
    raise ValueError(f'{name} must be in (0, 1), got {value!r}')
  return float(value)


def _anchor_exists(num_points: int, cutoff: float) -> bool:
  """Whether every positive-weight point of D and D' is within 4 tau of a.

  a is a shared point with the most score neighbours: h_a(D) >=
  ceil((cutoff - 1) K / (K - 1)), so h_a(D') >= that - 1; a positive point
  has h >= floor(K/2) + 1. Two neighbour sets whose sizes add to more than
  K intersect, and a common neighbour puts both within 2 tau + 2 tau.
  """
  k = num_points
  h_anchor = math.ceil((cutoff - 1.0) * k / (k - 1) - 1e-9) - 1
  return h_anchor + k // 2 + 1 >= k + 1


def _poisson_binomial_quantile(mean: float, failure: float) -> int:
  """Smallest r with Chernoff's P(X >= r) <= failure, for E X <= mean.

  For a sum of independent Bernoullis with mean mu < r,
  P(X >= r) <= e^-mu (e mu / r)^r, increasing in mu, so the bound at the
  largest possible mean holds for every smaller one.
  """
  r = math.floor(mean) + 1
  while -mean + r * (1.0 + math.log(mean / r)) > math.log(failure):
    r += 1
  return r


def mean_sensitivity(num_points: int, tau: float, *,
                     cutoff_fraction: float = PAPER_CUTOFF_FRACTION,
                     inclusion: str = 'weighted',
                     failure_probability: Optional[float] = None
                     ) -> float:
  """The l2 sensitivity of the pre-noise robust mean on a passed test.

  Valid whenever the score of the dataset is at least the cutoff (the
  calibration charges passes below it to delta). For `'weighted'`:
  `4 tau (2 P + 3) / W + 2 mean_rounding_bound(K, tau)` with
  `P = 6 (K - 1)/K + 2 u K` and `W = (2 s_cut - K)(1 - u)`, u = 2^-24, for
  every input and the computation as it runs in float32 (derivation in the
  module docstring, "Rounding", and docs/user_level.md). For
  `'sampled'`, P becomes the Chernoff quantile r of the inclusions that
  differ under shared uniforms and the weight the lower Chernoff quantile
  of the kept count, each failing with probability `failure_probability/2`.

  Example:
    >>> mean_sensitivity(500, tau=0.1)   # 180 tau / K at the paper's cutoff
    0.035...

  Args:
    num_points: K >= 9.
    tau: the concentration radius (> 0).
    cutoff_fraction: s_cut / K, at least 2/3 (the proof's requirement).
    inclusion: 'weighted' or 'sampled'.
    failure_probability: for 'sampled', the probability that the coupled
      bound fails (it is charged to delta); unused for 'weighted'.

  Returns:
    The sensitivity, in the units of the points.

  Raises:
    ValueError: for K < 9, a cutoff below 2K/3 (or too close to it for
      this K), a bad tau or a missing failure probability.
  """
  k = checks.positive_int(num_points, 'num_points')
  tau = checks.positive_finite(tau, 'tau')
  inclusion = _check_inclusion(inclusion)
  if k < 9:
    raise ValueError(f'the outlier-removal mean needs at least 9 points (the '
                     f'sensitivity proof needs K >= 9), got {k}')
  if not PAPER_CUTOFF_FRACTION - 1e-12 <= cutoff_fraction <= 1.0:
    raise ValueError('cutoff_fraction must be in [2/3, 1]: the sensitivity '
                     f'proof needs passes at score >= 2K/3, got '
                     f'{cutoff_fraction!r}')
  cutoff = cutoff_fraction * k
  if not _anchor_exists(k, cutoff):
    raise ValueError(f'with K = {k} the cutoff {cutoff:.2f} does not leave a '
                     'shared anchor point; raise cutoff_fraction or K')
  # Computed weights are p_j (1 + theta_j), |theta_j| <= u
  # (`inclusion_probabilities`): each change grows by at most 2u, the total
  # weight (or, sampled, the mean kept count) shrinks by at most 1 - u.
  weight = (2.0 * cutoff - k) * (1.0 - FLOAT32_ROUNDOFF)
  changed = 6.0 * (k - 1) / k + 2.0 * FLOAT32_ROUNDOFF * k
  if inclusion == 'sampled':
    if failure_probability is None:
      raise ValueError("inclusion='sampled' needs failure_probability")
    failure = _check_probability(failure_probability, 'failure_probability')
    changed = float(_poisson_binomial_quantile(changed, failure / 2.0))
    slack = math.sqrt(2.0 * weight * math.log(2.0 / failure))
    if slack >= weight:
      raise ValueError(f'K = {k} is too small for the sampled inclusion at '
                       f'failure probability {failure}: the kept count is '
                       'not bounded away from 0; use more points or '
                       "inclusion='weighted'")
    weight -= slack
  return (4.0 * tau * (2.0 * changed + 3.0) / weight +
          2.0 * mean_rounding_bound(k, tau))


def mean_rounding_bound(num_points: int, tau: float) -> float:
  """How far the computed pre-noise mean can sit from the exact one, on a pass.

  The mean is `base + offset` (`weighted_mean`): base a kept point, offset
  the weighted mean of the kept points' differences from it, summed as
  balanced trees of depth L = ceil(log2 K). On a pass every kept point is
  within 8 tau of base (module docstring, Fact 3), so each coordinate of
  the offset is within `gamma_{2L+4} sum_j w_j |x_j| / W` of the exact one
  (one rounding in each difference and product, L in each tree, one in the
  division), and in l2 the error is at most `8 tau gamma_{2L+4}`,
  `gamma_n = n u / (1 - n u)` with float32's u = 2^-24 (a float64
  computation rounds less). `mean_sensitivity` adds it twice, once per
  neighbour.

  Example:
    >>> mean_rounding_bound(1000, 1.0)   # in units of tau: ~2e-5
    1.4...e-05

  Args:
    num_points: K.
    tau: the concentration radius.

  Returns:
    The bound, in the units of the points.
  """
  depth = max(1, math.ceil(math.log2(max(2, num_points))))
  terms = 2 * depth + 4
  gamma = terms * FLOAT32_ROUNDOFF / (1.0 - terms * FLOAT32_ROUNDOFF)
  return 8.0 * tau * gamma


def calibrate(num_points: int, tau: float, epsilon: float, delta: float, *,
              num_steps: int = 1,
              population: Optional[int] = None,
              score_radius: Optional[float] = None,
              threshold_fraction: float = PAPER_THRESHOLD_FRACTION,
              cutoff_fraction: float = PAPER_CUTOFF_FRACTION,
              inclusion: str = 'weighted',
              tail_share: float = 0.25,
              coupling_share: float = 0.25) -> OutlierRemovalCalibration:
  """Every noise level of a phase of private robust means (epsilon, delta).

  The argument (docs/user_level.md §3): let G be the event that the score
  noise never lets a test pass below `cutoff + 2` (and, for 'sampled', that
  the coupled inclusions stay within their bound). On G the phase equals a
  mechanism whose Gaussian part has sensitivity `mean_sensitivity` for
  every pair of neighbours, so the phase is (epsilon, gaussian_delta +
  (1 + e^eps) P(not G))-DP. The split of delta: `tail_share` for the score
  noise, `coupling_share` for the coupling ('sampled' only), the rest for
  the composition.

  * One release (`num_steps=1`, no `population`; Algorithm 1): a fixed
    threshold, score noise Lap(b) with the largest b whose tail fits; the
    Laplace score (epsilon 2/b) and the Gaussian mean are composed by the
    PLD (`accounting.laplace_and_gaussian_delta`).
  * `num_steps` releases on K of `population` users sampled without
    replacement (Algorithm 2): AboveThreshold with threshold noise
    Lap(4/eps_AT) drawn once per phase and per-step noise Lap(8/eps_AT)
    (the paper's 1:2 ratio; scores have sensitivity 2, so it is
    eps_AT-DP), eps_AT the smallest whose tails over the T tests fit; the
    Gaussian part is the T-fold subsampled Gaussian, accounted by
    dp_accounting's RDP under replace-one, with epsilon - eps_AT.

  sigma is the smallest (bisection) that meets the target.

  Example:
    >>> one = calibrate(num_points=600, tau=0.05, epsilon=2.0, delta=1e-6)
    >>> phase = calibrate(3000, tau=0.05, epsilon=2.0, delta=1e-6,
    ...                   num_steps=20, population=12000, score_radius=0.1)

  Args:
    num_points: K, the points averaged per release.
    tau: the concentration radius (privacy holds for any tau; utility needs
      the points within tau of each other).
    epsilon: the phase's target epsilon.
    delta: the phase's target delta.
    num_steps: T, the releases of the phase.
    population: the users each step's K are drawn from without
      replacement (>= K; None or K: no sampling).
    score_radius: the score's pair radius; default tau (Algorithm 1);
      Algorithm 2 uses 2 tau. At most 2 tau.
    threshold_fraction: the test threshold over K (paper: 4/5).
    cutoff_fraction: the score the analysis needs on a pass, over K
      (paper: 2/3; at least that).
    inclusion: 'weighted' (default) or 'sampled' (the paper's).
    tail_share: the fraction of delta for the score noise's tails.
    coupling_share: for 'sampled', the fraction for the coupling failure.

  Returns:
    An `OutlierRemovalCalibration`.

  Raises:
    ValueError: for bad arguments, or when K is too small for the score
      tests to cost less than epsilon (the message gives the fewest K).
  """
  k = checks.positive_int(num_points, 'num_points')
  tau = checks.positive_finite(tau, 'tau')
  steps = checks.positive_int(num_steps, 'num_steps')
  if population is not None:
    population = checks.positive_int(population, 'population')
    if population < k:
      raise ValueError(f'population ({population}) must be at least '
                       f'num_points ({k})')
  score_radius = tau if score_radius is None else checks.positive_finite(
      score_radius, 'score_radius')
  if score_radius > 2.0 * tau:
    raise ValueError('score_radius must be at most 2 tau (the proof bounds '
                     'inclusion counts by score counts)')
  accounting.validate_epsilon_delta(epsilon, delta)
  inclusion = _check_inclusion(inclusion)
  tail_share = _check_probability(tail_share, 'tail_share')
  coupling_share = (_check_probability(coupling_share, 'coupling_share')
                    if inclusion == 'sampled' else 0.0)
  if tail_share + coupling_share >= 1.0:
    raise ValueError('tail_share + coupling_share must be below 1')
  if not cutoff_fraction < threshold_fraction < 1.0:
    raise ValueError('threshold_fraction must lie between cutoff_fraction '
                     f'and 1, got {threshold_fraction!r}')
  tail_delta = tail_share * delta
  coupling_delta = coupling_share * delta
  gaussian_delta = delta - tail_delta - coupling_delta
  blowup = 1.0 + math.exp(epsilon)
  sensitivity = mean_sensitivity(
      k, tau, cutoff_fraction=cutoff_fraction, inclusion=inclusion,
      failure_probability=(coupling_delta / (blowup * steps)
                           if coupling_delta else None))
  threshold = threshold_fraction * k
  cutoff = cutoff_fraction * k
  one_release = steps == 1 and population in (None, k)
  score_epsilon = score_test_epsilon(
      k, epsilon, delta, num_steps=steps, one_release=one_release,
      threshold_fraction=threshold_fraction, cutoff_fraction=cutoff_fraction,
      tail_share=tail_share)
  if score_epsilon >= epsilon:
    fewest = fewest_points(epsilon, delta, num_steps=steps,
                           one_release=one_release, score_share=1.0,
                           threshold_fraction=threshold_fraction,
                           cutoff_fraction=cutoff_fraction,
                           tail_share=tail_share)
    raise ValueError(
        f'K = {k} points are too few: the score tests alone cost epsilon '
        f'{score_epsilon:.3g} >= {epsilon} (threshold {threshold:.1f}, '
        f'cutoff {cutoff:.1f}, {steps} tests). Use at least {fewest} '
        'points, a larger epsilon or delta')
  if one_release:
    laplace_scale, threshold_scale = 2.0 / score_epsilon, 0.0
    multiplier = _gaussian_multiplier(laplace_scale / 2.0, epsilon,
                                      gaussian_delta)
  else:
    threshold_scale = 4.0 / score_epsilon
    laplace_scale = 8.0 / score_epsilon
    multiplier = _sampled_gaussian_multiplier(
        epsilon - score_epsilon, gaussian_delta, steps,
        population if population is not None else k, k)
  return OutlierRemovalCalibration(
      num_points=k, tau=tau, score_radius=score_radius, threshold=threshold,
      cutoff=cutoff, laplace_scale=laplace_scale,
      threshold_scale=threshold_scale, inclusion=inclusion,
      sensitivity=sensitivity, noise_std=multiplier * sensitivity,
      num_steps=steps, population=population, epsilon=float(epsilon),
      delta=float(delta), score_epsilon=score_epsilon,
      tail_delta=tail_delta, coupling_delta=coupling_delta,
      gaussian_delta=gaussian_delta)


def score_noise_tail(gap: float, laplace_scale: float,
                     threshold_scale: float = 0.0,
                     num_steps: int = 1) -> float:
  """P(the score noise lets some test pass a score `gap` below threshold).

  A fixed threshold (`threshold_scale=0`): P(Lap(b) >= gap) = e^(-gap/b)/2.
  AboveThreshold: a pass needs `v_t - xi >= gap` for threshold noise xi and
  step noise v_t; for any split a1 + a2 = gap it is at most
  P(xi <= -a1) + T P(v >= a2); the best split on a fine grid is returned.

  Example:
    >>> score_noise_tail(60.0, laplace_scale=4.0)

  Args:
    gap: threshold - cutoff - 2 (> 0).
    laplace_scale: the step noise's scale.
    threshold_scale: the threshold noise's scale (0: fixed threshold).
    num_steps: T, the tests.

  Returns:
    The probability bound.
  """
  if gap <= 0:
    return 1.0
  if threshold_scale == 0:
    return num_steps * 0.5 * math.exp(-gap / laplace_scale)
  splits = np.linspace(0.0, gap, 2001)
  tails = (0.5 * np.exp(-splits / threshold_scale) +
           num_steps * 0.5 * np.exp(-(gap - splits) / laplace_scale))
  return float(min(1.0, tails.min()))


def score_test_epsilon(num_points: int, epsilon: float, delta: float, *,
                       num_steps: int = 1, one_release: bool = True,
                       threshold_fraction: float = PAPER_THRESHOLD_FRACTION,
                       cutoff_fraction: float = PAPER_CUTOFF_FRACTION,
                       tail_share: float = 0.25) -> float:
  """The epsilon the score tests of `calibrate` cost.

  The smallest epsilon whose noise tails (`score_noise_tail`, times
  1 + e^eps) fit `tail_share * delta`: K points leave a gap of
  `(threshold_fraction - cutoff_fraction) K - 2` for the noise to cross.
  One release: 2/b for the Laplace scale b; several: AboveThreshold's
  eps_AT with scales 4/eps_AT (threshold) and 8/eps_AT (steps).

  Example:
    >>> score_test_epsilon(600, epsilon=2.0, delta=1e-6)
    0.43...

  Args:
    num_points: K.
    epsilon: the phase's target epsilon (it enters the tail bound).
    delta: the phase's target delta.
    num_steps: T, the tests of the phase.
    one_release: a fixed threshold and one test (Algorithm 1); False:
      AboveThreshold.
    threshold_fraction: the test threshold over K.
    cutoff_fraction: the cutoff over K.
    tail_share: the fraction of delta for the tails.

  Returns:
    The score tests' epsilon (inf when the gap is not positive).
  """
  gap = (threshold_fraction - cutoff_fraction) * num_points - 2.0
  if gap <= 0:
    return math.inf
  budget = tail_share * delta / (1.0 + math.exp(epsilon))
  if one_release:
    return 2.0 * math.log(0.5 / budget) / gap

  return _smallest_passing(
      lambda score_epsilon: score_noise_tail(
          gap, 8.0 / score_epsilon, 4.0 / score_epsilon, num_steps),
      budget, relative_tolerance=1e-12)


def fewest_points(epsilon: float, delta: float, *, score_share: float = 0.5,
                  **kwargs: Any) -> int:
  """The fewest points K whose score tests cost under score_share * eps.

  Example:
    >>> fewest_points(2.0, 1e-6)        # one release, tests within eps / 2
    >>> fewest_points(2.0, 1e-6, num_steps=50, one_release=False)

  Args:
    epsilon: the phase's target epsilon.
    delta: the phase's target delta.
    score_share: the fraction of epsilon the tests may cost, in (0, 1].
    **kwargs: `num_steps`, `one_release`, `threshold_fraction`,
      `cutoff_fraction`, `tail_share` as for `score_test_epsilon`.

  Returns:
    K (at least 9, the proof's minimum).

  Raises:
    ValueError: for a bad score_share.
  """
  if not 0 < score_share <= 1:
    raise ValueError(f'score_share must be in (0, 1], got {score_share!r}')

  def fits(k):
    return score_test_epsilon(k, epsilon, delta, **kwargs) < (
        score_share * epsilon)

  low, high = 8, 16
  while not fits(high):
    low, high = high, 2 * high
    if high > 10 ** 9:
      raise ValueError('no number of points fits this (epsilon, delta)')
  while high - low > 1:
    middle = (low + high) // 2
    if fits(middle):
      high = middle
    else:
      low = middle
  return high


def _smallest_passing(value: Callable[[float], float], target: float, *,
                      relative_tolerance: float = 1e-4,
                      limit: float = 1e6) -> float:
  """The smallest positive x (to `relative_tolerance`) with value(x) <= target.

  `value` must be decreasing in x (above `target` below some point, at most
  `target` above it). The answer is the plain bisection's: double x from 1
  until it passes, then halve the bracket until it is narrower than
  `relative_tolerance` of its top, and return the top. Most of that
  bisection's questions are answered without calling `value`: once a
  failing and a passing point are known, a safeguarded secant search
  (Illinois) on log(value / target) narrows the crossing far inside the
  bisection's last interval, and every point outside the narrowed bracket
  is answered by monotonicity alone. A PLD evaluation at a large epsilon
  takes about a second; the plain bisection needs 15-18 of them.

  Args:
    value: decreasing in x; compared with `target`.
    target: the largest passing value.
    relative_tolerance: the bisection's stopping width, over its top.
    limit: the largest x tried.

  Returns:
    x, or inf when even `limit` fails.
  """
  # Evaluated ends: the largest failing and the smallest passing point, with
  # their log(value / target) (> 0 failing, <= 0 passing; inf/-inf where the
  # value is inf or 0).
  failing, passing = [0.0, math.inf], [math.inf, -math.inf]

  def evaluate(x: float) -> bool:
    """Evaluates x, strictly inside the known bracket, and moves an end."""
    v = float(value(x))
    log_ratio = (math.log(v / target) if 0.0 < v < math.inf and target > 0
                 else (math.inf if v > target else -math.inf))
    if v > target:
      failing[:] = [x, max(log_ratio, 1e-300)]
      return True
    passing[:] = [x, log_ratio]
    return False

  def narrow() -> None:
    """Illinois steps until the bracket is far inside the bisection's step."""
    (low, low_log), (high, high_log) = failing, passing
    if not (low > 0 and math.isfinite(low_log) and math.isfinite(high_log)):
      return
    kept = None
    for _ in range(16):
      width, enough = high - low, relative_tolerance / 16 * high
      if width <= enough:
        return
      guess = high - high_log * width / (high_log - low_log)
      # At least half the wanted width from either end (as Brent's method
      # steps at least its tolerance): a guess next to the crossing then
      # brackets it in one evaluation.
      margin = max(1e-3 * width, 0.5 * enough)
      guess = min(max(guess, low + margin), high - margin)
      # Illinois: an end kept twice in a row counts half, so that both ends
      # move (plain regula falsi creeps up on the crossing from one side).
      if evaluate(guess):
        (low, low_log), high_log = failing, (
            0.5 * high_log if kept == 'high' else high_log)
        kept = 'high'
      else:
        (high, high_log), low_log = passing, (
            0.5 * low_log if kept == 'low' else low_log)
        kept = 'low'
      if not (math.isfinite(low_log) and math.isfinite(high_log)):
        return

  def fails(x: float) -> bool:
    if x <= failing[0]:
      return True
    if x >= passing[0]:
      return False
    narrow()
    if x <= failing[0]:
      return True
    if x >= passing[0]:
      return False
    return evaluate(x)

  low, high = 0.0, 1.0
  while fails(high):
    low, high = high, 2.0 * high
    if high > limit:
      return math.inf
  for _ in range(60):
    middle = 0.5 * (low + high)
    if fails(middle):
      low = middle
    else:
      high = middle
    if high - low < relative_tolerance * high:
      break
  return high


def _bisect_multiplier(value: Callable[[float], float], target: float
                       ) -> float:
  """The smallest noise multiplier (to 1e-4 relative) with value <= target."""
  multiplier = _smallest_passing(value, target)
  if multiplier == math.inf:
    raise ValueError('no Gaussian noise meets this (epsilon, delta) after '
                     'the score tests')
  return multiplier


# Bumped whenever these multipliers' computation changes what it returns.
_CALIBRATION_CACHE_VERSION = 1


def _cached_multiplier(kind: str, key: dict[str, Any],
                       value: Callable[[float], float],
                       target: float) -> float:
  """`_bisect_multiplier(value, target)`, cached on disk under `key`.

  Privacy never rests on the cache alone: a cached multiplier that does not
  meet the target is refused (one PLD evaluation) and computed again.
  """
  key = dict(key, version=_CALIBRATION_CACHE_VERSION,
             dp_accounting=getattr(dp_accounting, '__version__', None))
  computed = []

  def compute() -> float:
    computed.append(_bisect_multiplier(value, target))
    return computed[0]

  multiplier = strategies.cached_calibration(
      strategies.calibration_file(kind, key), compute)
  if not computed and value(multiplier) > target:
    multiplier = compute()
  return multiplier


# Cached: every phase of a run (and every run of a sweep) with the same K,
# epsilon and delta needs the same multiplier; tau only scales the noise.
@functools.lru_cache(maxsize=256)
def _gaussian_multiplier(laplace_multiplier: float, epsilon: float,
                         delta: float) -> float:
  """One release: the Gaussian multiplier composed with the Laplace score."""
  return _cached_multiplier(
      'outlier-removal', {
          'laplace_multiplier': float(laplace_multiplier),
          'epsilon': float(epsilon), 'delta': float(delta)},
      lambda z: accounting.laplace_and_gaussian_delta(
          laplace_multiplier, z, epsilon), delta)


@functools.lru_cache(maxsize=256)
def _sampled_gaussian_multiplier(epsilon: float, delta: float,
                                 num_steps: int, population: int,
                                 sample_size: int) -> float:
  """T subsampled releases: the multiplier meeting (epsilon, delta)."""
  return _cached_multiplier(
      'outlier-removal-sampled', {
          'epsilon': float(epsilon), 'delta': float(delta),
          'num_steps': int(num_steps), 'population': int(population),
          'sample_size': int(sample_size)},
      lambda z: accounting.subsampled_gaussian_epsilon(
          z, num_steps, population, sample_size, delta), epsilon)


def _leaves_as_rows(points: PyTree) -> list[jax.Array]:
  leaves = jax.tree_util.tree_leaves(points)
  if not leaves:
    raise ValueError('points has no leaves')
  size = jnp.shape(leaves[0])[0] if jnp.ndim(leaves[0]) else None
  for leaf in leaves:
    if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != size:
      raise ValueError('every leaf of points needs the same leading axis '
                       '(one row per point)')
  return [jnp.reshape(leaf, (size, -1)) for leaf in leaves]


def _warn_ignored_center(center: Optional[PyTree], caller: str) -> None:
  if center is not None:
    warnings.warn(f'{caller}: center= is ignored (distances come from '
                  'coordinate differences, exact at any offset, and privacy '
                  'never rests on a center); drop the argument',
                  DeprecationWarning, stacklevel=3)


def pairwise_squared_distances(points: PyTree,
                               center: Optional[PyTree] = None, *,
                               block_elements: int = 2 ** 24) -> jax.Array:
  """`[K, K]` certified UPPER BOUNDS on the squared l2 distances of the rows.

  Each entry is computed from the coordinate differences of its two points
  (never from the Gram form `|a|^2 + |b|^2 - 2 a.b`, whose three terms
  cancel far from the origin) and then raised by a bound on its rounding
  error, so that it is never below the exact squared distance of the two
  points as given (module docstring, "Rounding"):

      d2 = fl(sum_i fl(fl(a_i - b_i)^2)) (1 + 2 (N + 3) u) + 4 n tiny,

  with u the unit roundoff of the accumulation dtype (float32, or float64
  for float64 points), N = `rounding.squared_norm_roundings(sizes,
  extra=1)` (about 2 sqrt(n) for n coordinates: each leaf is summed in
  sqrt(n)-sized blocks), and `tiny` the smallest normal number (squares
  that underflow; `rounding.upper_bound`). So `d2 <= r^2`
  implies that the points are truly within r. An entry depends on its two
  points only, is symmetric, and is exact to within the factor at any
  offset from the origin. Pairs with a non-finite coordinate, or whose
  distance overflows, are at +inf; the diagonal is 0. bfloat16 and float16
  points are compared in float32 (exactly converted).

  Memory is bounded: rows are processed in blocks of about
  `block_elements / (K n)` rows (at least one).

  Example:
    >>> d2 = pairwise_squared_distances({'w': grads_w, 'b': grads_b})

  Args:
    points: pytree whose leaves are `[K, ...]`.
    center: DEPRECATED and ignored: distances from differences need no
      center, and privacy never rests on one.
    block_elements: the work-array size that sets the row block.

  Returns:
    `[K, K]` in the accumulation dtype, symmetric, non-negative.
  """
  _warn_ignored_center(center, 'pairwise_squared_distances')
  rows = _leaves_as_rows(points)
  dtype = rounding.accumulation_dtype(*[r.dtype for r in rows])
  size = rows[0].shape[0]
  sizes = [r.shape[1] for r in rows]
  rows = [jnp.asarray(r, dtype) for r in rows]
  finite = jnp.ones((size,), bool)
  for r in rows:
    finite &= jnp.all(jnp.isfinite(r), axis=1)
  rows = [jnp.where(finite[:, None], r, 0.0) for r in rows]

  def from_one(point_rows):
    total = None
    for mine, theirs in zip(point_rows, rows):
      part = rounding.blocked_sum_of_squares(theirs - mine[None])
      total = part if total is None else total + part
    return total

  per_row = max(1, block_elements // max(1, size * sum(sizes)))
  computed = jax.lax.map(from_one, rows, batch_size=min(per_row, size))
  # One more rounding per term: its difference.
  bound = rounding.upper_bound(
      computed, rounding.squared_norm_roundings(sizes, extra=1), sum(sizes),
      dtype)
  # Both orders are upper bounds (their roundings may differ by the row
  # block a point falls in); the larger keeps the matrix symmetric.
  bound = jnp.maximum(bound, bound.T)
  pair_ok = finite[:, None] & finite[None, :] & jnp.isfinite(bound)
  bound = jnp.where(pair_ok, bound, jnp.inf)
  return jnp.where(jnp.eye(size, dtype=bool), 0.0, bound)


def _within(squared_distances: jax.Array, radius: Any) -> jax.Array:
  """`[K, K]` bool: pairs certified to lie within `radius`."""
  return squared_distances <= rounding.square_below(
      radius, squared_distances.dtype)


def _close_pairs(squared_distances: jax.Array, radius: Any) -> jax.Array:
  """The exact number of certified pairs within radius (diagonal included)."""
  return jnp.sum(_within(squared_distances, radius), dtype=jnp.int32)


def _score_parts(squared_distances: jax.Array,
                 radius: Any) -> tuple[jax.Array, jax.Array]:
  """The score as `whole + fraction` with only the fraction rounded.

  The count c of close pairs is an exact int32; `c // K` is exact in
  float32 (it is at most K), and `(c mod K) / K` is rounded by at most
  2^-25. A float32 `c / K` would round by up to K 2^-24 before any noise is
  added, more than the 1/K of slack in Fact 1 once K passes about 2,900.
  """
  size = squared_distances.shape[0]
  count = _close_pairs(squared_distances, radius)
  whole = (count // size).astype(jnp.float32)
  fraction = (count % size).astype(jnp.float32) / jnp.float32(size)
  return whole, fraction


def concentration_score(squared_distances: jax.Array,
                        radius: float) -> jax.Array:
  """`(1/K) sum_{j,j'} 1(||v_j - v_j'|| <= radius)`, diagonal included.

  Pairs count when their certified distance bound
  (`pairwise_squared_distances`) is within the radius, so every counted
  pair is truly within it.

  Example:
    >>> concentration_score(pairwise_squared_distances(points), 0.1)

  Args:
    squared_distances: `[K, K]` from `pairwise_squared_distances`.
    radius: the pair radius.

  Returns:
    A float32 scalar in [1, K], the exact count over K to float32
    rounding; replacing one point moves it by less than 2.
    (`private_robust_mean` adds the score noise before the final rounding
    of the whole part: `_score_parts`.)
  """
  whole, fraction = _score_parts(squared_distances, radius)
  return whole + fraction


def neighbour_counts(squared_distances: jax.Array, tau: float) -> jax.Array:
  """`h_j = #{j' : ||v_j - v_j'|| <= 2 tau}` (self included), exact int32.

  Example:
    >>> h = neighbour_counts(pairwise_squared_distances(points), 0.1)

  Args:
    squared_distances: `[K, K]` from `pairwise_squared_distances`.
    tau: the concentration radius.

  Returns:
    int32 `[K]`.
  """
  return jnp.sum(_within(squared_distances, 2.0 * tau), axis=1,
                 dtype=jnp.int32)


def inclusion_probabilities(squared_distances: jax.Array,
                            tau: float) -> jax.Array:
  """`p_j = clip((h_j - K/2) / (K/6), 0, 1)`, `h_j` = points within 2 tau.

  Paper 002, Algorithm 1 line 17 and Algorithm 2 line 10. Computed as
  `clip((6 h_j - 3K) / K, 0, 1)`: an exact integer numerator and ONE
  rounding (relative u), which `mean_sensitivity` allows for.

  Example:
    >>> p = inclusion_probabilities(pairwise_squared_distances(points), 0.1)

  Args:
    squared_distances: `[K, K]` from `pairwise_squared_distances`.
    tau: the concentration radius.

  Returns:
    float32 `[K]` in [0, 1].
  """
  size = squared_distances.shape[0]
  counts = neighbour_counts(squared_distances, tau)
  numerator = (6 * counts - 3 * size).astype(jnp.float32)
  return jnp.clip(numerator / jnp.float32(size), 0.0, 1.0)


def inclusion_weights(squared_distances: jax.Array, tau: float, *,
                      inclusion: str = 'weighted',
                      key: Optional[jax.Array] = None) -> jax.Array:
  """The weight of each point in the robust mean (NOT private: a diagnostic).

  Args:
    squared_distances: `[K, K]` from `pairwise_squared_distances`.
    tau: the concentration radius.
    inclusion: 'weighted' (weights p_j) or 'sampled' (1 if `u_j < p_j`).
    key: for 'sampled', the key of the uniforms u.

  Returns:
    float32 `[K]`.
  """
  probabilities = inclusion_probabilities(squared_distances, tau)
  if _check_inclusion(inclusion) == 'weighted':
    return probabilities
  if key is None:
    raise ValueError("inclusion='sampled' needs a key for its uniforms")
  uniforms = jax.random.uniform(keys_lib.as_key(key),
                                probabilities.shape)
  return (uniforms < probabilities).astype(jnp.float32)


class _FramedMean(NamedTuple):
  """The weighted mean as `base + offset` (both in the accumulation dtype).

  `base` is one point of positive weight (zeros when every weight is 0) and
  `offset` the weighted mean of the other points' differences from it, so
  the rounding of the mean scales with the spread of the kept points (at
  most 8 tau on a pass), not with their distance from the origin.
  """

  base: list
  offset: list
  treedef: Any
  dtypes: list


def _framed_mean(points: PyTree, weights: jax.Array) -> _FramedMean:
  leaves, treedef = jax.tree_util.tree_flatten(points)
  weights = jnp.asarray(weights, jnp.float32)
  total = rounding.pairwise_sum(weights)
  some = total > 0
  reference = jnp.argmax(weights)
  base, offset = [], []
  for leaf in leaves:
    dtype = jnp.promote_types(leaf.dtype, jnp.float32)
    leaf = jnp.asarray(leaf, dtype)
    anchor = leaf[reference]
    w = jnp.reshape(weights, (-1,) + (1,) * (leaf.ndim - 1)).astype(dtype)
    # `where`, not a zero weight: 0 * NaN is NaN.
    kept = jnp.where(w > 0, leaf - anchor[None], 0.0)
    mean = rounding.pairwise_sum(w * kept) / jnp.maximum(total, 1e-30).astype(dtype)
    base.append(jnp.where(some, anchor, 0.0))
    offset.append(jnp.where(some, mean, 0.0))
  return _FramedMean(base, offset, treedef,
                     [leaf.dtype for leaf in leaves])


def weighted_mean(points: PyTree, weights: jax.Array) -> PyTree:
  """`sum_j w_j v_j / sum_j w_j`; a point of weight 0 never enters (even NaN).

  Computed in the frame of a kept point (`base + offset`, pairwise sums):
  its rounding error is relative to the kept points' spread, not to their
  distance from the origin.

  Example:
    >>> weighted_mean(points, inclusion_probabilities(d2, tau))

  Args:
    points: pytree whose leaves are `[K, ...]`.
    weights: `[K]`, non-negative.

  Returns:
    A pytree like one point (zeros when every weight is 0).
  """
  framed = _framed_mean(points, weights)
  return jax.tree_util.tree_unflatten(framed.treedef, [
      (b + o).astype(dtype)
      for b, o, dtype in zip(framed.base, framed.offset, framed.dtypes)])


def robust_mean(points: PyTree, tau: float, *, inclusion: str = 'weighted',
                key: Optional[jax.Array] = None,
                center: Optional[PyTree] = None) -> PyTree:
  """The pre-noise outlier-removal mean (NOT private: no test, no noise).

  With every pair within 2 tau it is the plain mean.

  Example:
    >>> robust_mean(points, tau=0.1)

  Args:
    points: pytree whose leaves are `[K, ...]`.
    tau: the concentration radius.
    inclusion: 'weighted' or 'sampled'.
    key: the uniforms' key for 'sampled'.
    center: DEPRECATED and ignored (`pairwise_squared_distances`).

  Returns:
    A pytree like one point.
  """
  _warn_ignored_center(center, 'robust_mean')
  d2 = pairwise_squared_distances(points)
  return weighted_mean(points,
                       inclusion_weights(d2, tau, inclusion=inclusion,
                                         key=key))


def _gathered(points: PyTree, axis_name: Optional[str]) -> PyTree:
  if axis_name is None:
    return points
  return jax.tree_util.tree_map(lambda x: parallel.gather(x, axis_name),
                                points)


def draw_threshold_noise(calibration: OutlierRemovalCalibration,
                         key: keys_lib.KeyLike) -> jax.Array:
  """AboveThreshold's threshold noise: ONE draw per phase, kept in state.

  Zero for a one-release calibration (its threshold is fixed).

  Example:
    >>> xi = draw_threshold_noise(calibration, phase_key)

  Args:
    calibration: from `calibrate`.
    key: the phase's threshold key (use it for nothing else).

  Returns:
    A float32 scalar.
  """
  return calibration.threshold_scale * jax.random.laplace(
      keys_lib.as_key(key), (), jnp.float32)


def private_robust_mean(points: PyTree,
                        calibration: OutlierRemovalCalibration,
                        key: keys_lib.KeyLike, *,
                        threshold_noise: Any = 0.0,
                        halt_value: Optional[PyTree] = None,
                        center: Optional[PyTree] = None,
                        axis_name: Optional[str] = None) -> RobustMeanRelease:
  """One (epsilon, delta) release of the outlier-removal mean.

  The score test, the inclusion and the Gaussian noise use three keys split
  from `key`; under `axis_name` the points are sharded across devices,
  gathered, and every device computes the same release from the same
  replicated key (a key that differs across devices is refused: at once
  when eager, else the value poisoned and `not_replicated` set for the
  caller's state to record, `guards.record`).

  Example:
    >>> cal = calibrate(600, tau=0.05, epsilon=2.0, delta=1e-6)
    >>> out = private_robust_mean(user_means, cal, key, halt_value=anchor)
    >>> new_point = out.value     # anchor itself when out.passed is False

  Args:
    points: pytree whose leaves are `[K, ...]` (`[K / devices, ...]` per
      device under `axis_name`), K = `calibration.num_points`.
    calibration: from `calibrate`.
    key: the release's key, used once.
    threshold_noise: AboveThreshold's threshold noise for the phase
      (`draw_threshold_noise`; 0 for one release): the test is
      `score + Lap(laplace_scale) >= threshold + threshold_noise`.
    halt_value: the data-independent value released when the test fails
      (default zeros, the paper's 0; the previous released point is also
      fine: it is public).
    center: DEPRECATED and ignored (`pairwise_squared_distances`): privacy
      and accuracy no longer depend on a center.
    axis_name: the device axis, or None.

  Returns:
    A `RobustMeanRelease`.

  Raises:
    ValueError: if the number of points differs from the calibration's.
  """
  if not isinstance(calibration, OutlierRemovalCalibration):
    raise TypeError('calibration must come from outlier_removal.calibrate')
  key = keys_lib.as_key(key)
  points = _gathered(points, axis_name)
  size = _leaves_as_rows(points)[0].shape[0]
  if size != calibration.num_points:
    raise ValueError(f'the calibration is for K = {calibration.num_points} '
                     f'points, got {size}')
  replicated_flag = parallel.check_replicated(key, axis_name)
  score_key, inclusion_key, noise_key = jax.random.split(key, 3)
  _warn_ignored_center(center, 'private_robust_mean')
  d2 = pairwise_squared_distances(points)
  # The noise joins the score before its last rounding (`_score_parts`).
  whole, fraction = _score_parts(d2, calibration.score_radius)
  noisy_score = whole + (fraction + calibration.laplace_scale *
                         jax.random.laplace(score_key, (), jnp.float32))
  passed = noisy_score >= calibration.threshold + threshold_noise
  weights = inclusion_weights(d2, calibration.tau,
                              inclusion=calibration.inclusion,
                              key=inclusion_key)
  # The noise joins the mean's offset from a kept point before that point
  # is added back, and the result is cast to the points' dtype last: every
  # rounding after the noise is post-processing (module docstring).
  framed = _framed_mean(points, weights)
  noisy = [(b + (o + (calibration.noise_std * jax.random.normal(
      jax.random.fold_in(noise_key, index), o.shape, o.dtype)))
            ).astype(dtype)
           for index, (b, o, dtype) in enumerate(
               zip(framed.base, framed.offset, framed.dtypes))]
  treedef = framed.treedef
  if halt_value is None:
    halt_leaves = [jnp.zeros_like(leaf) for leaf in noisy]
  else:
    halt_leaves = jax.tree_util.tree_leaves(halt_value)
    if len(halt_leaves) != len(noisy):
      raise ValueError('halt_value must have the structure of one point')
  released = [jnp.where(passed, n, jnp.asarray(h, n.dtype))
              for n, h in zip(noisy, halt_leaves)]
  value = jax.tree_util.tree_unflatten(treedef, released)
  if replicated_flag is not None:
    if not isinstance(replicated_flag, jax.core.Tracer):
      guards.refuse(replicated_flag, value, parallel.NOT_REPLICATED_MESSAGE)
    # Poisoned on the device, no host round trip: the flag goes back to
    # the caller to record (`RobustMeanRelease.not_replicated`).
    value = jax.tree_util.tree_map(
        lambda x: jnp.where(replicated_flag, jnp.nan, x), value)
  return RobustMeanRelease(
      value=value, passed=passed, noisy_score=noisy_score,
      not_replicated=replicated_flag)


def sensitivity_table(num_points: Any, *, inclusion: str = 'weighted',
                      failure_probability: Optional[float] = None
                      ) -> np.ndarray:
  """`mean_sensitivity / tau * K` for each K (the constant c of c tau/K).

  Example:
    >>> sensitivity_table([100, 1000, 10000])

  Args:
    num_points: an iterable of K values.
    inclusion: 'weighted' or 'sampled'.
    failure_probability: for 'sampled'.

  Returns:
    float64 array, one constant per K.
  """
  return np.array([
      mean_sensitivity(int(k), 1.0, inclusion=inclusion,
                       failure_probability=failure_probability) * int(k)
      for k in num_points])
