"""Buffered-linear-Toeplitz (BLT) matrix-factorization strategies.

A BLT strategy is a lower-triangular Toeplitz `C` whose first column is

    c_0 = 1,   c_k = sum_i w_i theta_i^(k-1)   (k >= 1)

for `d` buffer decays `theta_i` in [0, 1) and output scales `w_i`
(Dvijotham et al. 2024). Its generating function is rational,
`c(x) = 1 + sum_i w_i x / (1 - theta_i x) = P(x) / Q(x)` with
`Q(x) = prod_i (1 - theta_i x)`, so:

* `C z` and `C^-1 z` are linear recursions of order d: the noise
  `C^-1 z` streams with `d` params-sized buffers (`mechanism`), whatever the
  number of steps, where a dense strategy needs `T - 1`;
* `C^-1` is BLT too: `1 / c(x) = Q(x) / P(x)`; its decays are the roots of
  `P` (`inverse`);
* the column norms, the sensitivity under min-separation participation and
  the error on any Toeplitz workload are one `scipy.signal.lfilter` each:
  O(T d) time, so the 2 d parameters are optimized in float64 on the CPU
  in seconds for T = 10,000 (`optimize`).

Streaming `C^-1 z` (derivation): with buffers `b_t` (one per decay,
`b_0 = 0`), `x_t = z_t - sum_i w_i b_{t,i}` and
`b_{t+1,i} = theta_i b_{t,i} + x_t`. Unrolled, `b_{t,i} = sum_{k>=1}
theta_i^(k-1) x_{t-k}`, so `z_t = x_t + sum_{k>=1} c_k x_{t-k} = (C x)_t`:
`x = C^-1 z` exactly, with no need to diagonalize the inverse.

Sensitivity: every column of C is a prefix of the first one, so the
single-participation sensitivity is `||c||_2` (over T entries). Under
min-separation participation (at most k participations, any two at least b
steps apart), when c is non-negative and non-increasing (true for the
parameterization `optimize` uses: `theta_i in (0, 1)`, `w_i > 0`,
`sum_i w_i <= 1`) the Gram entries `G[s, t] = sum_r c_(r-s) c_(r-t)` are
non-negative, larger for earlier steps (more rows) and for closer steps
(`sum_r c_r c_(r+m)` decreases with m), so the worst pattern is the earliest
and densest one, `{0, b, 2b, ...}` with `min(k, ceil(T / b))`
participations (McMahan, Xu & Zhang 2024 use the same argument for BLTs).
`tests/test_blt.py` checks it against a brute-force maximum over all
patterns. That pattern is also batch 0 of `accounting.FixedOrder(k, b)`, so
a fixed-order run is accounted at exactly this sensitivity.

References:
  Dvijotham, McMahan, Pillutla, Steinke & Thakurta, "Efficient and
  near-optimal noise generation for streaming differential privacy",
  FOCS 2024 (BLT strategies, their inverse and streaming).
  McMahan, Xu & Zhang, "A hassle-free algorithm for private learning in
  practice: don't use tree aggregation, use BLTs", EMNLP 2024 (BLTs under
  min-separation participation, their optimization).
"""

import math
import os
from typing import Any, NamedTuple, Optional, Union

from absl import logging

import jax
import jax.numpy as jnp
import numpy as np
from scipy import linalg
from scipy import optimize as scipy_optimize
from scipy import signal
from scipy import special

from dpsco_jax import checks
from dpsco_jax import noise as noise_lib
from dpsco_jax import rounding
from dpsco_jax import strategies as strategies_lib

PyTree = Any

# Bumped whenever `optimize` changes what it returns for the same arguments,
# so that stale cache entries are not reused.
_CACHE_VERSION = 1

# The largest decay `optimize` returns: the largest float32 below 1.
_MAX_DECAY = 1.0 - 2.0**-24


class BltParameters(NamedTuple):
  """The parameters of a BLT strategy (see the module docstring).

  Attributes:
    buffer_decays: theta, float64 `[d]`, each in [0, 1).
    output_scales: w, float64 `[d]`.
  """

  buffer_decays: np.ndarray
  output_scales: np.ndarray

  @property
  def num_buffers(self) -> int:
    """The number of params-sized noise buffers the strategy keeps."""
    return len(self.buffer_decays)


def parameters(buffer_decays, output_scales) -> BltParameters:
  """Checked BLT parameters.

  Example:
    >>> p = parameters([0.9, 0.5], [0.3, 0.2])

  Args:
    buffer_decays: the decays theta_i, each in [0, 1) (a decay of 1 or
      more would let a buffer grow without bound).
    output_scales: the scales w_i, finite, as many as the decays.

  Returns:
    `BltParameters` in float64.

  Raises:
    ValueError: on empty, mismatched, non-finite or out-of-range values.
  """
  decays = np.atleast_1d(np.asarray(buffer_decays, np.float64))
  scales = np.atleast_1d(np.asarray(output_scales, np.float64))
  if decays.ndim != 1 or decays.shape != scales.shape or not len(decays):
    raise ValueError('buffer_decays and output_scales must be non-empty '
                     f'vectors of one length, got shapes {decays.shape} and '
                     f'{scales.shape}')
  if not (np.all(np.isfinite(decays)) and np.all(np.isfinite(scales))):
    raise ValueError('BLT parameters must be finite')
  if np.any(decays < 0) or np.any(decays >= 1):
    raise ValueError(f'buffer decays must be in [0, 1), got {decays}')
  return BltParameters(decays, scales)


def _polynomials(params: BltParameters) -> tuple[np.ndarray, np.ndarray]:
  """`(P, Q)`, ascending coefficients with `c(x) = P(x) / Q(x)`."""
  decays, scales = params
  # np.poly(r) lists prod(y - r_i) in descending powers of y, which are the
  # ascending coefficients of prod(1 - r_i x).
  denominator = np.poly(decays)
  numerator = denominator.copy()
  for i, scale in enumerate(scales):
    others = np.poly(np.delete(decays, i))
    numerator[1:] += scale * others
  return numerator, denominator


def coefficients(params: BltParameters, num_steps: int) -> np.ndarray:
  """The first column of C: `c_0 = 1, c_k = sum_i w_i theta_i^(k-1)`.

  Example:
    >>> coefficients(parameters([0.5], [0.5]), 4)
    array([1.   , 0.5  , 0.25 , 0.125])

  Args:
    params: the BLT parameters.
    num_steps: T.

  Returns:
    float64 `[T]`.
  """
  numerator, denominator = _polynomials(params)
  return strategies_lib.series_quotient(numerator, denominator, num_steps)


def inverse_coefficients(params: BltParameters, num_steps: int) -> np.ndarray:
  """The first column of `C^-1` (Toeplitz too): the impulse response of Q/P.

  Example:
    >>> inverse_coefficients(parameters([0.5], [0.5]), 4)
    array([ 1. , -0.5,  0. ,  0. ])

  Args:
    params: the BLT parameters.
    num_steps: T.

  Returns:
    float64 `[T]`.
  """
  numerator, denominator = _polynomials(params)
  return strategies_lib.series_quotient(denominator, numerator, num_steps)


def materialize(params: BltParameters, num_steps: int) -> np.ndarray:
  """C as an explicit lower-triangular `[T, T]` float64 matrix.

  Example:
    >>> c = materialize(parameters([0.9], [0.4]), 8)

  Args:
    params: the BLT parameters.
    num_steps: T.

  Returns:
    `[T, T]` float64.
  """
  column = coefficients(params, num_steps)
  return linalg.toeplitz(column, np.zeros(num_steps))


def inverse(params: BltParameters) -> BltParameters:
  """The BLT parameters of `C^-1` (Dvijotham et al. 2024).

  `C^-1 z` is the recursion `x_t = z_t - w . b_t`, `b_(t+1) = A b_t + 1 z_t`
  with `A = diag(theta) - 1 w^T`: its impulse response is
  `r_k = -w^T A^(k-1) 1`, so with `A = V diag(lambda) V^-1` the inverse's
  decays are the eigenvalues `lambda` and its scales
  `-(w^T V) * (V^-1 1)`. For `w > 0` the eigenvalues are real (one below
  the smallest theta, one between each pair of consecutive thetas).

  Example:
    >>> inv = inverse(parameters([0.9, 0.5], [0.3, 0.2]))

  Args:
    params: the BLT parameters.

  Returns:
    `BltParameters` of `C^-1` (decays may be negative when w has negative
    entries; complex results are refused).

  Raises:
    ValueError: if the inverse has complex or non-decaying modes (then
      `C^-1` is not a BLT with real decays in (-1, 1)).
  """
  decays, scales = params
  transition = np.diag(decays) - np.outer(np.ones_like(scales), scales)
  eigenvalues, vectors = linalg.eig(transition)
  left = scales @ vectors
  right = linalg.solve(vectors, np.ones_like(scales))
  inverse_scales = -left * right
  if (np.max(np.abs(eigenvalues.imag)) > 1e-9 or
      np.max(np.abs(inverse_scales.imag)) > 1e-9):
    raise ValueError('the inverse of this BLT has complex modes')
  eigenvalues = eigenvalues.real
  if np.any(np.abs(eigenvalues) >= 1):
    raise ValueError(f'the inverse of this BLT does not decay (modes '
                     f'{eigenvalues}): its noise would grow without bound')
  return BltParameters(eigenvalues, inverse_scales.real)


def _monotone(column: np.ndarray) -> bool:
  return bool(np.all(column >= 0) and np.all(np.diff(column) <= 1e-15))


def sensitivity(params: BltParameters, num_steps: int,
                max_participations: int = 1,
                min_separation: Optional[int] = None) -> float:
  """The l2 sensitivity of `x -> C x` under min-separation participation.

  One example takes part at most `max_participations` times, any two at
  least `min_separation` steps apart, each time with a contribution of norm
  at most 1. See the module docstring for why the worst pattern is
  `{0, b, 2b, ...}`.

  Example:
    >>> sensitivity(p, 1000)                       # single participation
    >>> sensitivity(p, 1000, 10, min_separation=100)

  Args:
    params: the BLT parameters.
    num_steps: T.
    max_participations: k.
    min_separation: b (required when k > 1).

  Returns:
    The sensitivity.

  Raises:
    ValueError: for k > 1 when c is negative or increasing somewhere (the
      closed form does not hold; use
      `accounting.participation_sensitivity` on `materialize(...)`).
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  k = checks.positive_int(max_participations, 'max_participations')
  column = coefficients(params, num_steps)
  if k == 1:
    return float(np.sqrt(np.sum(column ** 2)))
  if min_separation is None:
    raise ValueError('min_separation is required with max_participations > 1')
  b = checks.positive_int(min_separation, 'min_separation')
  if not _monotone(column):
    raise ValueError(
        'the min-separation sensitivity of a BLT is computed for non-negative, '
        'non-increasing coefficients; these are not. Compute it from the '
        'materialized strategy with accounting.participation_sensitivity')
  return float(np.sqrt(np.sum(_pattern_response(params, num_steps, k, b)
                              ** 2)))


def _pattern_response(params: BltParameters, num_steps: int, k: int,
                      b: int) -> np.ndarray:
  """`C u` for the worst pattern u = e_0 + e_b + ... (at most k of them)."""
  pattern = np.zeros(num_steps)
  pattern[0:min(k * b, num_steps):b] = 1.0
  numerator, denominator = _polynomials(params)
  return signal.lfilter(numerator, denominator, pattern)


def toeplitz_workload_column(num_steps: int, *, momentum: float = 0.0,
                             decay: float = 0.0) -> np.ndarray:
  """First column of `strategies.workload(T, 'true', momentum, decay)`.

  `M A L` is lower-triangular Toeplitz: its column is the convolution of
  the geometric columns of M and L with the ones of A, built here in
  O(T) without forming the `[T, T]` matrices.

  Example:
    >>> toeplitz_workload_column(4)       # prefix sums: A
    array([1., 1., 1., 1.])

  Args:
    num_steps: T.
    momentum: in [0, 1).
    decay: in [0, 1).

  Returns:
    float64 `[T]`.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  for name, value in (('momentum', momentum), ('decay', decay)):
    if not 0.0 <= float(value) < 1.0:
      raise ValueError(f'{name} must be in [0, 1), got {value!r}')
  ones = np.ones(num_steps)
  # Dividing by (1 - r x) is the recursion y_t = y_(t-1) r + x_t.
  column = signal.lfilter([1.0], [1.0, -float(momentum)], ones)
  return signal.lfilter([1.0], [1.0, -float(decay)], column)


def _error_terms(params: BltParameters, workload_column: np.ndarray
                 ) -> np.ndarray:
  """The first column h of the Toeplitz `W C^-1`."""
  numerator, denominator = _polynomials(params)
  return signal.lfilter(denominator, numerator, workload_column)


def _squared_sensitivity(params: BltParameters, num_steps: int, k: int,
                         b: Optional[int]) -> float:
  """`sensitivity(...) ** 2` without its checks (the optimizer's inner loop)."""
  if k == 1:
    return float(np.sum(coefficients(params, num_steps) ** 2))
  return float(np.sum(_pattern_response(params, num_steps, k, b) ** 2))


def per_step_errors(params: BltParameters,
                    workload_column: np.ndarray) -> np.ndarray:
  """The squared error of every step at unit noise: `||(W C^-1)_t||^2`.

  `B = W C^-1` is Toeplitz with first column h (one `lfilter`), so row t has
  squared norm `sum_(m <= t) h_m^2`: non-decreasing in t, the last row the
  largest. These are the per-iteration errors of the matrix mechanism with
  unit-variance noise, before the sensitivity (jax_privacy calls them the
  per-query errors).

  Example:
    >>> per_step_errors(parameters([0.5], [0.5]), np.ones(3))
    array([1.  , 1.25, 1.5 ])

  Args:
    params: the BLT parameters.
    workload_column: the first column of a lower-triangular Toeplitz W
      (`toeplitz_workload_column`); its length is T.

  Returns:
    float64 `[T]`.
  """
  workload_column = np.asarray(workload_column, np.float64)
  if workload_column.ndim != 1 or not len(workload_column):
    raise ValueError('workload_column must be a non-empty vector, got shape '
                     f'{workload_column.shape}')
  return np.cumsum(_error_terms(params, workload_column) ** 2)


def errors(params: BltParameters, workload_column: np.ndarray,
           max_participations: int = 1,
           min_separation: Optional[int] = None) -> tuple[float, float]:
  """Errors of the BLT on a Toeplitz workload, at unit noise multiplier.

  `W C^-1` is Toeplitz with first column h, so its row t has squared norm
  `sum_(m <= t) h_m^2`: the largest row is the last one. Both errors are
  multiplied by the sensitivity (equal privacy), as in
  `strategies.workload_errors`, which gives the same numbers from the
  materialized matrices. In terms of `loss`: the first is
  `sqrt(T * loss(..., error='mean'))`, the second `sqrt(loss(...,
  error='max'))`.

  Example:
    >>> errors(p, toeplitz_workload_column(1000))

  Args:
    params: the BLT parameters.
    workload_column: the first column of a lower-triangular Toeplitz W
      (`toeplitz_workload_column`); its length is T.
    max_participations: k.
    min_separation: b (with k > 1).

  Returns:
    `(||W C^-1||_F, max_t ||(W C^-1)_t||_2)` times the sensitivity.
  """
  workload_column = np.asarray(workload_column, np.float64)
  num_steps = len(workload_column)
  scale = sensitivity(params, num_steps, max_participations, min_separation)
  terms = _error_terms(params, workload_column) ** 2
  weights = num_steps - np.arange(num_steps)
  return (float(scale * np.sqrt(np.dot(weights, terms))),
          float(scale * np.sqrt(np.sum(terms))))


def loss(params: BltParameters, workload_column: np.ndarray,
         max_participations: int = 1, min_separation: Optional[int] = None,
         *, error: str = 'max') -> float:
  """The max-loss or mean-loss of a BLT: squared error times sensitivity^2.

  With `e_t = ||(W C^-1)_t||^2` (`per_step_errors`, unit noise) and `s` the
  sensitivity of C under min-separation participation (`sensitivity`: at
  most k participations, any two at least b steps apart; k = 1 is single
  participation):

      max-loss  = s^2 * max_t e_t            = s^2 * e_(T-1)
      mean-loss = s^2 * (1 / T) sum_t e_t

  the objectives of McMahan, Xu & Zhang (2024) and of jax_privacy's
  `buffered_toeplitz` (its `max_loss`, and `LossFn.build_min_sep(error=)`
  times the sensitivity squared); `tests/test_blt_jax_privacy.py` checks
  the equality where jax_privacy is installed. At equal privacy the noise
  multiplier scales with s, so the loss is the expected squared error of
  the worst (max) or average (mean) step per unit of noise multiplier.
  `optimize(error=...)` minimizes it.

  Example:
    >>> p = parameters([0.9, 0.5], [0.3, 0.2])
    >>> loss(p, toeplitz_workload_column(1000), 10, 100, error='max')

  Args:
    params: the BLT parameters.
    workload_column: the first column of a lower-triangular Toeplitz W
      (`toeplitz_workload_column`; prefix sums: ones); its length is T.
    max_participations: k.
    min_separation: b (required with k > 1).
    error: 'max' or 'mean'.

  Returns:
    The loss, float.

  Raises:
    ValueError: for an unknown `error`, or a min-separation sensitivity
      that has no closed form (`sensitivity`).
  """
  if error not in ('max', 'mean'):
    raise ValueError(f"error must be 'max' or 'mean', got {error!r}")
  step_errors = per_step_errors(params, workload_column)
  scale = sensitivity(params, len(step_errors), max_participations,
                      min_separation)
  value = step_errors[-1] if error == 'max' else np.mean(step_errors)
  return float(scale ** 2 * value)


def _pack(params: BltParameters) -> np.ndarray:
  """Inverse of `_unpack` (decays in (0, 1), scales > 0 summing below 1)."""
  decays = np.clip(params.buffer_decays, 1e-12, 1 - 1e-12)
  rest = 1.0 - np.sum(params.output_scales)
  return np.concatenate([special.logit(decays),
                         np.log(params.output_scales / rest)])


def _unpack(vector: np.ndarray) -> BltParameters:
  """Unconstrained vector -> theta in (0, 1), w > 0 with sum(w) < 1."""
  d = len(vector) // 2
  # At most the largest float32 below 1: the search can push a decay towards
  # 1 (a buffer that never decays), where expit rounds to exactly 1.0 in
  # float64, which `parameters` refuses; capped, the decay also stays below
  # 1 when the device streams the noise in float32.
  decays = np.minimum(special.expit(vector[:d]), _MAX_DECAY)
  weights = np.exp(vector[d:] - np.max(vector[d:]))
  scales = weights / (np.exp(-np.max(vector[d:])) + np.sum(weights))
  return BltParameters(decays, scales)


def optimize(num_steps: int, num_buffers: int = 4, *,
             max_participations: int = 1,
             min_separation: Optional[int] = None,
             workload_column: Optional[np.ndarray] = None,
             error: str = 'max', max_iterations: int = 500,
             cache_dir: Union[str, None, bool] = None) -> BltParameters:
  """BLT parameters minimizing the max-loss or mean-loss on a workload.

  Minimizes `loss(params, workload_column, k, b, error=error)`: the squared
  error of the worst step (`error='max'`, max-loss) or the mean over steps
  of the squared error (`error='mean'`, mean-loss), times the squared
  sensitivity under min-separation participation (k, b); see `loss` for
  the formulas. The search runs over `theta_i in (0, 1)`, `w_i > 0`,
  `sum_i w_i < 1` (so c is non-negative and non-increasing and the
  min-separation sensitivity is exact), by L-BFGS-B in float64 on the CPU,
  on the log of the loss (of T times the mean-loss for 'mean': the same
  minimizer) over the 2 d unconstrained parameters, with gradients by
  central differences. Buffers are added one at a time: each search starts
  from the best solution with one buffer fewer plus a new buffer at a few
  time scales, and from decays spread over the time scales 1 .. T; when
  all end worse than d - 1 buffers did, the d - 1 solution with a silent
  new buffer is kept (so `optimize(T, d)` never ends worse than
  `optimize(T, d - 1)`). Each evaluation is O(T d); T = 10,000 with 2 to 5
  buffers takes seconds to tens of seconds on a shared CPU core.

  Example:
    >>> p = optimize(1000, 4, max_participations=10, min_separation=100)
    >>> mech = mechanism(p, 1000)

  Args:
    num_steps: T.
    num_buffers: d (2 to 5 come within a few percent of the best dense
      strategy on prefix sums, Dvijotham et al. 2024).
    max_participations: k.
    min_separation: b (required with k > 1).
    workload_column: the first column of a lower-triangular Toeplitz
      workload (default: prefix sums, `toeplitz_workload_column(T)`).
    error: 'max' (max-loss: the worst step's squared error) or 'mean'
      (mean-loss: the mean over steps of the squared error, i.e. the
      squared Frobenius error over T).
    max_iterations: L-BFGS-B iterations per start.
    cache_dir: a directory, True for `default_cache_dir()` (what the plans
      use), or None/False (default) for no cache. A cached result is keyed
      by every argument and checked again when read (an unreadable entry,
      or one outside the region where the sensitivity is exact, is
      recomputed); it only saves time: the accountant computes the
      sensitivity from the parameters it is given, wherever they come from.

  Returns:
    `BltParameters`.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  d = checks.positive_int(num_buffers, 'num_buffers')
  if error not in ('max', 'mean'):
    raise ValueError(f"error must be 'max' or 'mean', got {error!r}")
  if workload_column is None:
    workload_column = toeplitz_workload_column(num_steps)
  workload_column = np.asarray(workload_column, np.float64)
  if workload_column.shape != (num_steps,):
    raise ValueError(f'workload_column must have shape ({num_steps},), got '
                     f'{workload_column.shape}')
  k = checks.positive_int(max_participations, 'max_participations')
  if k > 1:
    checks.positive_int(min_separation, 'min_separation')
  if cache_dir is True:
    cache_dir = default_cache_dir()
  path = None
  if cache_dir:
    path = strategies_lib._cache_path(  # pylint: disable=protected-access
        cache_dir, (_CACHE_VERSION, 'blt', num_steps, d, k,
                    min_separation if k > 1 else None, workload_column, error,
                    max_iterations))
    cached = _read_cached(path, d)
    if cached is not None:
      return cached
  result = _optimize(num_steps, d, k, min_separation, workload_column, error,
                     max_iterations)
  if path:
    strategies_lib._store(  # pylint: disable=protected-access
        path, np.stack([result.buffer_decays, result.output_scales]))
  return result


def default_cache_dir() -> str:
  """Where `optimize` caches BLT parameters: `$DPSCO_JAX_CACHE/blt`.

  Example:
    >>> p = optimize(10_000, 4, cache_dir=default_cache_dir())  # seconds
    >>> p = optimize(10_000, 4, cache_dir=True)                 # read back

  Returns:
    The directory (default `~/.cache/dpsco_jax/blt`; it may not exist).
  """
  return os.path.join(strategies_lib.cache_root(), 'blt')


def _read_cached(path: str, num_buffers: int) -> Optional[BltParameters]:
  """The cached parameters at `path`, or None (missing or not usable)."""
  if not os.path.exists(path):
    return None
  try:
    stored = np.load(path)
    params = parameters(stored[0], stored[1])
  except (OSError, ValueError, IndexError) as error:
    logging.warning('ignoring an unreadable cached BLT at %s: %s', path,
                    error)
    return None
  scales = params.output_scales
  if (params.num_buffers != num_buffers or np.any(scales < 0) or
      np.sum(scales) > 1 or np.any(params.buffer_decays <= 0)):
    logging.warning('ignoring a cached BLT outside the optimized region at '
                    '%s', path)
    return None
  return params


def _optimize(num_steps: int, d: int, k: int, min_separation: Optional[int],
              workload_column: np.ndarray, error: str,
              max_iterations: int) -> BltParameters:
  """`optimize` without its checks and cache."""
  weights = (num_steps - np.arange(num_steps)) if error == 'mean' else None

  def objective(vector):
    # log(loss(...)) without the checks; for 'mean', log(T * mean-loss).
    params = _unpack(vector)
    squared_sensitivity = _squared_sensitivity(params, num_steps, k,
                                               min_separation)
    terms = _error_terms(params, workload_column) ** 2
    squared_error = np.sum(terms) if weights is None else np.dot(weights,
                                                                 terms)
    value = math.log(squared_sensitivity) + math.log(squared_error)
    return value if math.isfinite(value) else 1e300

  def search(starts):
    # Central differences: with forward ones the line search often stops
    # after a few iterations far from the optimum (at T = 10,000 and 4
    # buffers, max-loss 16.1 to 136 from the same starts against 16.02).
    results = [scipy_optimize.minimize(objective, start, method='L-BFGS-B',
                                       jac='3-point',
                                       options={'maxiter': max_iterations})
               for start in starts]
    return min(results, key=lambda result: result.fun)

  def spread(count):
    # Time scales 1/(1 - theta) spread log-uniformly from 2 to T.
    horizons = np.logspace(0.3, math.log10(max(num_steps, 4)), count)
    decays = np.clip(1.0 - 1.0 / np.maximum(horizons, 1.5), 0.05, 1 - 1e-9)
    return np.concatenate([special.logit(decays),
                           np.full(count, math.log(0.5 / count))])

  best = None
  for count in range(1, d + 1):
    # Every count gets the same starts whatever d is, so the d - 1 buffers
    # found on the way to d are those `optimize(T, d - 1)` returns.
    starts = [spread(count)]
    if best is not None:
      previous = _unpack(best.x)
      for horizon in (2.0, math.sqrt(num_steps), float(num_steps)):
        # The previous solution with a new, nearly silent buffer.
        starts.append(_pack(BltParameters(
            np.append(previous.buffer_decays, 1.0 - 1.0 / max(horizon, 1.5)),
            np.append(previous.output_scales * 0.99,
                      0.01 * (1.0 - np.sum(previous.output_scales))))))
    result = search(starts)
    if best is not None:
      # The previous solution with a silent new buffer (weight 1e-9 of the
      # rest) has the previous loss: never end worse with a buffer more.
      previous = _unpack(best.x)
      padded = _pack(BltParameters(
          np.append(previous.buffer_decays,
                    1.0 - 1.0 / max(math.sqrt(num_steps), 1.5)),
          np.append(previous.output_scales,
                    1e-9 * (1.0 - np.sum(previous.output_scales)))))
      if objective(padded) < result.fun:
        result = scipy_optimize.OptimizeResult(x=padded,
                                               fun=objective(padded))
    best = result
  return parameters(*_unpack(best.x))


def mechanism(params: BltParameters, num_steps: int, *,
              release: str = 'per_step',
              sampler: noise_lib.Sampler = jax.random.normal
              ) -> noise_lib.NoiseMechanism:
  """BLT noise `C^-1 z` streamed with `d` params-sized buffers.

  The draws `z_t` are those of `noise.gaussian` and
  `noise.matrix_factorization` (same key, same step), so this mechanism
  releases the same noise as `noise.matrix_factorization(materialize(params,
  T))` up to float32 round-off, with `d` buffers instead of `T - 1`.
  `release='prefix'` releases the running sum (one more buffer).

  Example:
    >>> mech = mechanism(optimize(1000, 4), 1000)
    >>> state = mech.init(params, jax.random.key(0))
    >>> noise, state = mech.next(state, params)

  Args:
    params: the BLT parameters (`parameters`, `optimize`).
    num_steps: T, the capacity.
    release: 'per_step' or 'prefix'.
    sampler: `(key, shape, dtype) -> array` unit-variance sampler (tests
      replace it; keep the default in real use).

  Returns:
    A `noise.NoiseMechanism` whose identity covers the parameters (exact
    float64 values), the capacity, the release and the sampler.
  """
  params = parameters(*params)
  num_steps = checks.positive_int(num_steps, 'num_steps')
  if release not in ('per_step', 'prefix'):
    raise ValueError(f"release must be 'per_step' or 'prefix', got {release!r}")
  d = params.num_buffers
  name = f'blt(T={num_steps}, buffers={d}, release={release})'
  identity = noise_lib.mechanism_identity(
      'blt', num_steps=num_steps, release=release,
      sampler=noise_lib._sampler_name(sampler),  # pylint: disable=protected-access
      buffer_decays=[float(v).hex() for v in params.buffer_decays],
      output_scales=[float(v).hex() for v in params.output_scales])
  decays32 = np.asarray(params.buffer_decays, np.float32)
  scales32 = np.asarray(params.output_scales, np.float32)
  # The accountant reads the BLT the device runs: its float32 coefficients.
  params = parameters(*map(rounding.float32_values, params))

  def init(template, key):
    buffers = {'decaying': jax.tree_util.tree_map(
        lambda leaf: jnp.zeros((d,) + jnp.shape(leaf), _dtype(leaf)),
        template)}
    if release == 'prefix':
      buffers['prefix'] = jax.tree_util.tree_map(
          lambda leaf: jnp.zeros(jnp.shape(leaf), _dtype(leaf)), template)
    return noise_lib.NoiseState(key=key, step=jnp.zeros((), jnp.int32),
                                buffers=buffers)

  def next_noise(state, template):
    noise_lib.check_state(state, identity, name)
    _check_buffers(state.buffers, template, d, release)
    z = noise_lib._draw(jax.random.fold_in(state.key, state.step), template,  # pylint: disable=protected-access
                        sampler)

    scales = jnp.asarray(scales32)

    def output(z_leaf, buffer):
      # x_t = z_t - sum_i w_i b_(t,i)
      return z_leaf - jnp.tensordot(scales.astype(z_leaf.dtype),
                                    buffer.astype(z_leaf.dtype), axes=1,
                                    precision=jax.lax.Precision.HIGHEST)

    def decay(buffer, x):
      # b_(t+1,i) = theta_i b_(t,i) + x_t
      decays = jnp.asarray(decays32, buffer.dtype).reshape(
          (d,) + (1,) * x.ndim)
      return decays * buffer + x.astype(buffer.dtype)[None]

    noise = jax.tree_util.tree_map(output, z, state.buffers['decaying'])
    buffers = {'decaying': jax.tree_util.tree_map(
        decay, state.buffers['decaying'], noise)}
    if release == 'prefix':
      buffers['prefix'] = jax.tree_util.tree_map(
          jnp.add, state.buffers['prefix'], noise)
      noise = buffers['prefix']
    noise, refusal = noise_lib._refuse_invalid(  # pylint: disable=protected-access
        state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, buffers=buffers,
                                 refusal=refusal)

  def decoder_matrix():
    column = inverse_coefficients(params, num_steps)
    decoder = linalg.toeplitz(column, np.zeros(num_steps))
    return np.cumsum(decoder, axis=0) if release == 'prefix' else decoder

  whole = noise_lib.NoiseMechanism(
      init=noise_lib._identified_init(init, identity),  # pylint: disable=protected-access
      next=next_noise, encoder_matrix=lambda: materialize(params, num_steps),
      num_steps=num_steps, release=release, name=name,
      decoder_matrix=decoder_matrix,
      single_participation_sensitivity=lambda: sensitivity(params, num_steps),
      identity=identity,
      fixed_order_sensitivity=lambda k, b: _fixed_order_sensitivity(
          params, num_steps, k, b))
  return whole._replace(
      truncated=lambda steps: _truncated(whole, params, steps))


def _truncated(whole: noise_lib.NoiseMechanism, params: BltParameters,
               steps: int) -> noise_lib.NoiseMechanism:
  """The accounting mechanism of the first `steps` of `num_steps` steps.

  The first `steps` releases read the first `steps` rows of C (its inverse
  and the prefix sums of it are lower-triangular with a unit diagonal), and
  those rows restricted to the first `steps` columns are the BLT's own C for
  `steps` steps. So its single-participation sensitivity is `||c||` over
  `steps` entries, and batch j of `FixedOrder(k, b)` takes part at the steps
  `j, j + b, ...` below `steps`: a min-separation pattern of this shorter
  BLT, the worst being batch 0's, `sensitivity(params, steps, k, b)`
  (module docstring). Both are O(steps d); the encoder (for any other
  participation) is built only when asked for.
  """
  steps = checks.positive_int(steps, 'steps')
  if steps > whole.num_steps:
    raise ValueError(f'steps {steps} is past the {whole.num_steps} steps of '
                     f'{whole.name}')

  def encoder_matrix():
    encoder = np.zeros((steps, whole.num_steps))
    encoder[:, :steps] = materialize(params, steps)
    return encoder

  return noise_lib.NoiseMechanism(
      init=whole.init, next=whole.next, encoder_matrix=encoder_matrix,
      num_steps=whole.num_steps, release=whole.release,
      name=f'{whole.name}, first {steps} steps',
      single_participation_sensitivity=lambda: sensitivity(params, steps),
      fixed_order_sensitivity=lambda k, b: _fixed_order_sensitivity(
          params, steps, k, b))


def _fixed_order_sensitivity(params: BltParameters, num_steps: int, k: int,
                             b: int) -> Optional[float]:
  """`FixedOrder(k, b)` sensitivity in O(T): batch 0's steps 0, b, ...
  are the worst min-separation pattern (module docstring); None when the
  closed form does not apply (the accountant then uses the Gram matrix)."""
  if not _monotone(coefficients(params, num_steps)):
    return None
  return sensitivity(params, num_steps, k, b)


def _dtype(leaf) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def _check_buffers(buffers: Any, template: PyTree, d: int,
                   release: str) -> None:
  expected_keys = {'decaying', 'prefix'} if release == 'prefix' else {
      'decaying'}
  if not isinstance(buffers, dict) or set(buffers) != expected_keys:
    raise ValueError('the noise state\'s buffers are not those of this BLT '
                     'mechanism')
  noise_lib._check_buffers(buffers['decaying'], template, (d,))  # pylint: disable=protected-access
  if release == 'prefix':
    noise_lib._check_buffers(buffers['prefix'], template, ())  # pylint: disable=protected-access
