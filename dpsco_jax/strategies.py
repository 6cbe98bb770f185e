"""Matrix-factorization strategies: workloads, optimization and their errors.

A matrix-factorization mechanism releases `W (x + C^-1 z)` for a workload `W`
(what the optimizer does with the gradients), a lower-triangular strategy `C`
and Gaussian `z`; its error is `||W C^-1||` and its privacy is that of the
Gaussian mechanism `C x + z`, whose sensitivity depends on how often one
example takes part (`dpsco_jax.accounting.participation_sensitivity`).

This module builds the workloads of paper 001 §5 (prefix sums "ones", and the
"true" workloads with momentum and SRG decay), optimizes a strategy for a
workload under multi-epoch fixed-order (k, b)-participation (the Gram-matrix
formulation of multi-epoch matrix factorization, Choquette-Choo et al. 2023,
which paper 001 Algorithm 2 uses), gives closed-form banded strategies for
the "true" workloads (`banded_square_root`, `banded_inverse_square_root`),
and measures the error of any mechanism
at equal sensitivity, for the comparison of identity, trees and optimized
strategies. All computations are float64 NumPy/SciPy on the host: strategies
are computed once, before training, and cached on disk.
"""

import contextlib
import hashlib
import json
import math
import os
import tempfile
import time
from typing import Any, Callable, Optional, Union

from absl import logging
import numpy as np
from scipy import linalg
from scipy import signal
import threadpoolctl

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import noise as noise_lib
from dpsco_jax import progress as progress_lib

# Bumped whenever the optimizer changes what it returns, so stale cache
# entries are never reused.
_CACHE_VERSION = 1
CACHE_ENV_VAR = 'DPSCO_JAX_CACHE'


def prefix_workload(num_steps: int) -> np.ndarray:
  """`A`: the all-ones lower-triangular prefix-sum matrix ("ones" workload).

  Args:
    num_steps: T.

  Returns:
    `[T, T]` float64 with `A[t, s] = 1` for `s <= t`.
  """
  return np.tri(checks.positive_int(num_steps, 'num_steps'))


def _geometric_toeplitz(num_steps: int, ratio: float,
                        name: str) -> np.ndarray:
  """Lower-triangular Toeplitz `R[t, s] = ratio^(t - s)` for `s <= t`."""
  num_steps = checks.positive_int(num_steps, 'num_steps')
  ratio = float(ratio)
  if not 0.0 <= ratio < 1.0:
    raise ValueError(f'{name} must be in [0, 1), got {ratio!r}')
  lags = np.subtract.outer(np.arange(num_steps), np.arange(num_steps))
  # 0^0 = 1 on the diagonal; lags < 0 are masked out.
  return np.where(lags >= 0, ratio ** np.maximum(lags, 0), 0.0)


def momentum_matrix(num_steps: int, momentum: float) -> np.ndarray:
  """`M`: heavy-ball momentum as a matrix, `M[t, s] = momentum^(t - s)`.

  SGD with momentum (`m_t = momentum m_{t-1} + g_t`, `x_{t+1} = x_t - lr m_t`)
  gives `x_{t+1} = x_0 - lr (A M g)_t` (paper 001 §5, "true" workload).

  Args:
    num_steps: T.
    momentum: the momentum coefficient in [0, 1).

  Returns:
    `[T, T]` float64, lower-triangular Toeplitz.
  """
  return _geometric_toeplitz(num_steps, momentum, 'momentum')


def decay_matrix(num_steps: int, decay: float) -> np.ndarray:
  """`L`: the SRG decay of DP-SRG-MEMF as a matrix, `L[t, s] = decay^(t - s)`.

  Paper 001 Algorithm 3 with constant `c_t = decay` (and `c_0 = 0`):
  `Grad_t = decay Grad_{t-1} + Delta_t` is `Grad = L Delta`.

  Args:
    num_steps: T.
    decay: c in [0, 1).

  Returns:
    `[T, T]` float64, lower-triangular Toeplitz.
  """
  return _geometric_toeplitz(num_steps, decay, 'decay')


def workload(num_steps: int, kind: str = 'ones', *, momentum: float = 0.0,
             decay: float = 0.0, iterate_decay: float = 1.0) -> np.ndarray:
  """The workloads of paper 001 §5.

  * 'ones': `A`, the prefix sums of the gradients;
  * 'true': `M A L`, the iterates of SGD with `momentum` fed by the SRG
    recursion with `decay` (`M A` for DP-MEMF, decay 0; `M A L` for
    DP-SRG-MEMF). The three matrices are lower-triangular Toeplitz, so they
    commute. With weight decay lambda (`x_(t+1) = (1 - lr lambda) x_t - lr
    m_t`), give `iterate_decay` alpha = 1 - lr lambda: A becomes the
    decayed prefix sums `A[t, s] = alpha^(t - s)` (the workload of Kalinin
    & Lampert 2024 with momentum and weight decay).

  Example:
    >>> w = workload(600, 'true', momentum=0.9)        # DP-MEMF
    >>> w = workload(600, 'true', momentum=0.9, decay=math.exp(-2.5))

  Args:
    num_steps: T.
    kind: 'ones' or 'true'.
    momentum: momentum of the optimizer ('true' only).
    decay: the SRG decay c ('true' only).
    iterate_decay: alpha in (0, 1], `1 - lr x weight decay` ('true' only;
      1: no weight decay).

  Returns:
    `[T, T]` float64 workload.
  """
  iterate_decay = _check_iterate_decay(iterate_decay)
  if kind == 'ones':
    if momentum or decay or iterate_decay != 1.0:
      raise ValueError("the 'ones' workload takes no momentum, decay or "
                       "iterate_decay; use kind='true'")
    return prefix_workload(num_steps)
  if kind == 'true':
    prefix = (prefix_workload(num_steps) if iterate_decay == 1.0 else
              _geometric_toeplitz(num_steps, iterate_decay, 'iterate_decay'))
    return (momentum_matrix(num_steps, momentum) @ prefix
            @ decay_matrix(num_steps, decay))
  raise ValueError(f"kind must be 'ones' or 'true', got {kind!r}")


def _check_iterate_decay(iterate_decay: float) -> float:
  iterate_decay = float(iterate_decay)
  if not 0.0 < iterate_decay <= 1.0:  # Also refuses NaN.
    raise ValueError(f'iterate_decay must be in (0, 1] (1 - learning rate x '
                     f'weight decay; 1: none), got {iterate_decay!r}')
  return iterate_decay


def _workload_ratios(momentum: float, decay: float,
                     iterate_decay: float = 1.0) -> tuple[float, ...]:
  """The ratios r of the geometric factors `1 / (1 - r x)` of `M A L`."""
  # A, the prefix sums (ratio 1), or their weight-decayed form.
  ratios = [_check_iterate_decay(iterate_decay)]
  for name, value in (('momentum', momentum), ('decay', decay)):
    value = float(value)
    if not 0.0 <= value < 1.0:  # Also refuses NaN.
      raise ValueError(f'{name} must be in [0, 1), got {value!r}')
    if value:
      ratios.append(value)
  return tuple(ratios)


def _workload_power_series(num_steps: int, momentum: float, decay: float,
                           exponent: float,
                           iterate_decay: float = 1.0) -> np.ndarray:
  """The first T coefficients of `w(x)^exponent`, `w` the symbol of `M A L`.

  `w(x) = prod_r 1 / (1 - r x)` over r in (alpha, momentum, decay) (alpha
  the iterate decay, 1 without weight decay), so
  `w(x)^p = prod_r (1 - r x)^(-p)`. The coefficients of one factor
  `(1 - r x)^(-p)` are `binom(-p, k) (-r)^k`, whose ratio gives the
  recursion `f_0 = 1`, `f_k = f_(k-1) r (k - 1 + p) / k`: one
  multiplication per coefficient, so each has a relative error of at most
  about k ulps (no subtraction). The factors are then multiplied as
  truncated power series (`np.convolve`): for `p = 1/2` every term is
  positive (no cancellation, relative error O(T) ulps); for `p = -1/2` the
  absolute error is at most O(T) ulps of `prod_r sum_k |f_k| <= 2^3`.

  Args:
    num_steps: T.
    momentum: r of M, in [0, 1).
    decay: r of L, in [0, 1).
    exponent: p, the power of the workload's series (1/2: the square
      root; -1/2: the inverse square root).
    iterate_decay: alpha, r of the (weight-decayed) prefix sums, in (0, 1].

  Returns:
    float64 `[T]`.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  series = np.zeros(num_steps)
  series[0] = 1.0
  lags = np.arange(1, num_steps)
  for ratio in _workload_ratios(momentum, decay, iterate_decay):
    factor = np.ones(num_steps)
    factor[1:] = np.cumprod(ratio * (lags - 1 + exponent) / lags)
    series = np.convolve(series, factor)[:num_steps]
  return series


def series_quotient(numerator, denominator, num_steps: int) -> np.ndarray:
  """The first T coefficients of the power series `numerator(x) / denominator(x)`.

  A lower-triangular Toeplitz `[T, T]` matrix is a power series modulo
  `x^T`; a rational one (a BLT, the inverse of a banded matrix) is the
  impulse response of a linear recurrence, computed in O(T d).

  Example:
    >>> series_quotient([1.0], [1.0, -0.5], 4)   # 1 / (1 - x / 2)
    array([1.   , 0.5  , 0.25 , 0.125])

  Args:
    numerator: ascending coefficients.
    denominator: ascending coefficients, the constant term non-zero.
    num_steps: T.

  Returns:
    float64 `[T]`.

  Raises:
    ValueError: for a non-positive T or a zero constant term.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  denominator = np.atleast_1d(np.asarray(denominator, np.float64))
  if not denominator[0]:
    raise ValueError('the denominator needs a non-zero constant term')
  impulse = np.zeros(num_steps)
  impulse[0] = 1.0
  return signal.lfilter(np.asarray(numerator, np.float64), denominator,
                        impulse)


def _lower_toeplitz(column: np.ndarray) -> np.ndarray:
  """The lower-triangular Toeplitz matrix with first column `column`."""
  return linalg.toeplitz(column, np.zeros(len(column)))


def _check_bands(num_steps: int, bands: int) -> tuple[int, int]:
  num_steps = checks.positive_int(num_steps, 'num_steps')
  bands = checks.positive_int(bands, 'bands')
  if bands > num_steps:
    raise ValueError(f'bands={bands} exceeds num_steps={num_steps}: a '
                     f'[T, T] strategy has at most T diagonals')
  return num_steps, bands


def banded_square_root(num_steps: int, bands: int, *, momentum: float = 0.0,
                       decay: float = 0.0,
                       iterate_decay: float = 1.0) -> np.ndarray:
  r"""Banded square root (BSR) of the workload `M A L`: a closed-form `C`.

  The workload `W = workload(T, 'true', momentum=beta, decay=c) = M A L`
  (SGD with heavy-ball momentum beta on the gradients, or on DP-SRG-MEMF's
  recursive gradients with decay c) is lower-triangular Toeplitz, and so is
  every product or power of such matrices: the `[T, T]` lower-triangular
  Toeplitz matrix with first column `f_0, f_1, ...` is the power series
  `f(x) = sum_k f_k x^k` modulo `x^T`, and matrix products are products of
  series. `M`, `A` and `L` have the series `1 / (1 - beta x)`,
  `1 / (1 - x)` and `1 / (1 - c x)`, so the square root `R` of W (the
  unique lower-triangular one with a positive diagonal, which is also the
  principal square root `scipy.linalg.sqrtm(W)`) has the series

      r(x) = (1 - x)^(-1/2) (1 - beta x)^(-1/2) (1 - c x)^(-1/2),

  where `(1 - rho x)^(-1/2) = sum_k binom(2k, k) / 4^k rho^k x^k`. For
  prefix sums (beta = c = 0) `r_k = binom(2k, k) / 4^k`; otherwise r is the
  convolution of the three factors' coefficients. Each factor's
  coefficients are computed by the recursion `a_0 = 1`,
  `a_k = a_(k-1) rho (2k - 1) / (2k)` and the factors are multiplied as
  series, in float64, all terms positive (no cancellation).

  BSR keeps the first `bands` diagonals of R (Kalinin & Lampert 2024): `C`
  is lower-triangular Toeplitz with column `r_0, ..., r_(bands - 1), 0...`,
  so its noise `C^-1 z` streams with `bands - 1` params-sized buffers
  (`noise.matrix_factorization`), and with `bands <= b` it suits
  b-min-separated participation, including cyclic Poisson sampling
  (`accounting.CyclicPoissonSampling`). `C` is not normalized: the
  accountant computes its sensitivity under the run's participation
  (`accounting.mechanism_sensitivity`), which makes the scale irrelevant.
  Its entries are positive, so that sensitivity is exact.

  Example:
    >>> c = banded_square_root(600, 16, momentum=0.9)
    >>> # SGD(lr=0.1, momentum=0.9) with weight decay 5e-4: pass the matrix
    >>> # to a plan as `plans.dpmemf(..., strategy=c_wd)` (15 buffers).
    >>> c_wd = banded_square_root(600, 16, momentum=0.9,
    ...                           iterate_decay=1 - 0.1 * 5e-4)
    >>> mech = noise.matrix_factorization(c)      # 15 noise buffers
    >>> banded_square_root(4, 4)[:, 0]            # binom(2k, k) / 4^k
    array([1.    , 0.5   , 0.375 , 0.3125])

  Args:
    num_steps: T.
    bands: b, the number of non-zero diagonals of C, in [1, T] (T: the
      square root itself, `C C = W`).
    momentum: beta in [0, 1).
    decay: c in [0, 1) (0: DP-MEMF's workload `M A`).
    iterate_decay: alpha in (0, 1], `1 - lr x weight decay` (1: none); the
      factor `(1 - x)^(-1/2)` above becomes `(1 - alpha x)^(-1/2)`.

  Returns:
    `C`, lower-triangular Toeplitz float64 `[T, T]` with exactly `bands`
    non-zero diagonals.

  Raises:
    ValueError: if T or bands is not a positive integer, bands > T, or
      momentum or decay is outside [0, 1), or iterate_decay outside
      (0, 1].

  References:
    Kalinin & Lampert, "Banded Square Root Matrix Factorization for
    Differentially Private Model Training", NeurIPS 2024
    (arXiv:2405.13763).
  """
  num_steps, bands = _check_bands(num_steps, bands)
  column = _workload_power_series(num_steps, momentum, decay, 0.5,
                                  iterate_decay)
  column[bands:] = 0.0
  return _lower_toeplitz(column)


def banded_inverse_square_root(num_steps: int, bands: int, *,
                               momentum: float = 0.0, decay: float = 0.0,
                               iterate_decay: float = 1.0,
                               with_inverse: bool = False):
  r"""Banded inverse square root (BISR) of `M A L`: a closed-form `C`.

  With the series notation of `banded_square_root` (lower-triangular
  Toeplitz `[T, T]` matrices are power series modulo `x^T`), the inverse
  square root of `W = M A L` has the series

      s(x) = 1 / r(x) = (1 - x)^(1/2) (1 - beta x)^(1/2) (1 - c x)^(1/2),

  each factor `(1 - rho x)^(1/2) = sum_k b_k x^k` with `b_0 = 1`,
  `b_k = b_(k-1) rho (2k - 3) / (2k)` (so `b_k = -binom(2k, k) rho^k /
  (4^k (2k - 1))`, negative for k >= 1). BISR (Kalinin, McKenna, Upadhyay
  & Lampert 2025) makes the INVERSE of the strategy banded: `C^-1` is
  lower-triangular Toeplitz with column `s_0, ..., s_(bands - 1), 0...` (the
  polynomial `d(x)`, s truncated to degree bands - 1), and C is its inverse,
  the series `1 / d(x)`, whose coefficients follow from `d(x) c(x) = 1`:
  `c_0 = 1 / d_0`, `c_k = -(sum_(j=1)^(min(k, bands-1)) d_j c_(k-j)) / d_0`
  (a linear recurrence of order bands - 1, run by `scipy.signal.lfilter`).
  With `bands = T`, `C^-1 C^-1 = W^-1` (C is then the square root R).

  C is dense, but its noise `C^-1 z` needs only the last `bands - 1` draws
  z: pass the returned inverse to `noise.matrix_factorization(c,
  inverse=c_inv)` to stream it with `bands - 1` params-sized buffers. A
  dense C spreads one step's contribution over all later rows, so cyclic
  Poisson amplification does not apply (`plans` refuse that combination);
  under a fixed order (`accounting.FixedOrder`) the sensitivity is
  computed from C (`accounting.participation_sensitivity`; exact when the
  Gram entries are non-negative, an upper bound otherwise).

  Example:
    >>> c, c_inv = banded_inverse_square_root(600, 16, momentum=0.9,
    ...                                       with_inverse=True)
    >>> mech = noise.matrix_factorization(c, inverse=c_inv)  # 15 buffers

  Args:
    num_steps: T.
    bands: the number of non-zero diagonals of `C^-1`, in [1, T].
    momentum: beta in [0, 1).
    decay: c in [0, 1).
    iterate_decay: alpha in (0, 1], `1 - lr x weight decay` (1: none).
    with_inverse: also return the banded `C^-1`.

  Returns:
    `C`, lower-triangular Toeplitz float64 `[T, T]`; with `with_inverse`,
    `(C, C^-1)`, `C^-1` with exactly `bands` non-zero diagonals.

  Raises:
    ValueError: if T or bands is not a positive integer, bands > T, or
      momentum or decay is outside [0, 1), or iterate_decay outside
      (0, 1].

  References:
    Kalinin, McKenna, Upadhyay & Lampert, "Back to Square Roots: An Optimal
    Bound on the Matrix Factorization Error for Multi-Epoch Differentially
    Private SGD" (arXiv:2505.12128, 2025).
  """
  num_steps, bands = _check_bands(num_steps, bands)
  band = _workload_power_series(bands, momentum, decay, -0.5,
                                iterate_decay)
  column = series_quotient([1.0], band, num_steps)
  strategy = _lower_toeplitz(column)
  if not with_inverse:
    return strategy
  inverse_column = np.zeros(num_steps)
  inverse_column[:bands] = band
  return strategy, _lower_toeplitz(inverse_column)


def orthogonality_mask(num_steps: int, num_epochs: int = 1) -> np.ndarray:
  """Entries of the Gram matrix `X = C^T C` left free by the optimizer.

  Under (k, b)-participation an example takes part at steps `j, b + j, ...`;
  forcing `X[s, t] = 0` for two distinct such steps (`s = t mod b`) makes the
  sensitivity depend only on the diagonal of X, exactly, whatever the signs
  of C (Choquette-Choo et al. 2023).

  Args:
    num_steps: T = k b.
    num_epochs: k.

  Returns:
    `[T, T]` bool, False where X is forced to zero.
  """
  steps_per_epoch = _steps_per_epoch(num_steps, num_epochs)
  index = np.arange(num_steps)
  same_class = np.equal.outer(index % steps_per_epoch,
                              index % steps_per_epoch)
  return ~same_class | np.eye(num_steps, dtype=bool)


def _steps_per_epoch(num_steps: int, num_epochs: int) -> int:
  num_steps = checks.positive_int(num_steps, 'num_steps')
  num_epochs = checks.positive_int(num_epochs, 'num_epochs')
  if num_steps % num_epochs:
    raise ValueError(f'{num_steps} steps do not split into {num_epochs} '
                     'equal epochs')
  return num_steps // num_epochs


def strategy_from_gram(gram: np.ndarray) -> np.ndarray:
  """The lower-triangular `C` with `C^T C = gram` (a reversed Cholesky).

  With J the reversal permutation and `J X J = L L^T` (L lower-triangular),
  `C = J L^T J` is lower-triangular and `C^T C = J L L^T J = X`. A plain
  Cholesky factor would be upper-triangular once transposed, i.e. not
  streamable.

  Args:
    gram: symmetric positive-definite `[T, T]`.

  Returns:
    Lower-triangular `[T, T]` float64 `C`.
  """
  gram = np.asarray(gram, np.float64)
  lower = linalg.cholesky(gram[::-1, ::-1], lower=True)
  return np.ascontiguousarray(lower.T[::-1, ::-1])


def _band_mask(num_steps: int, bands: int) -> np.ndarray:
  lags = np.abs(np.subtract.outer(np.arange(num_steps), np.arange(num_steps)))
  return lags < bands


# Iterations over which the relative improvement is judged.
_WINDOW = 10


class _GramObjective:
  """`tr(W^T W X^-1)` over the free entries of a feasible Gram matrix X.

  Feasible X: symmetric, zero outside `mask`, and for every residue class of
  steps one example shares, the diagonal sums to 1 (squared sensitivity 1).
  The optimizer works on the vector of free entries (upper triangle inside
  the mask, off-diagonal entries scaled by sqrt(2) so that the Euclidean
  inner product is the Frobenius one): half the memory traffic of full
  matrices, and the constraints are linear in it.
  """

  def __init__(self, workload_matrix: np.ndarray, mask: np.ndarray,
               num_epochs: int):
    num_steps = workload_matrix.shape[0]
    self.workload_t = np.asfortranarray(workload_matrix.T)
    self.num_steps = num_steps
    self.num_epochs = num_epochs
    rows, cols = np.nonzero(np.triu(mask, 1))
    self.rows, self.cols = rows, cols
    self.num_off = len(rows)

  def to_vector(self, gram: np.ndarray) -> np.ndarray:
    return np.concatenate([math.sqrt(2.0) * gram[self.rows, self.cols],
                           np.diag(gram)])

  def to_matrix(self, vector: np.ndarray) -> np.ndarray:
    gram = np.zeros((self.num_steps, self.num_steps))
    off = vector[:self.num_off] / math.sqrt(2.0)
    gram[self.rows, self.cols] = off
    gram[self.cols, self.rows] = off
    np.fill_diagonal(gram, vector[self.num_off:])
    return gram

  def value_and_grad(self, vector: np.ndarray):
    """The loss and its projected gradient, or (inf, None) if X is not PD."""
    try:
      factor = linalg.cho_factor(self.to_matrix(vector), lower=True,
                                 check_finite=False)
    except linalg.LinAlgError:
      return math.inf, None
    # H = X^-1 W^T: loss = tr(W H), gradient = -H H^T.
    solved = linalg.cho_solve(factor, self.workload_t, check_finite=False)
    value = float(np.einsum('ij,ij->', self.workload_t, solved))
    if not np.isfinite(value) or value <= 0:
      return math.inf, None
    grad = self.to_vector(-(solved @ solved.T))
    # An off-diagonal entry v = sqrt(2) X_ij moves X_ij and X_ji, so its
    # derivative is sqrt(2) G_ij: exactly what to_vector gives.
    diagonal = grad[self.num_off:].reshape(self.num_epochs, -1)
    # Keep each residue class's diagonal sum fixed (the sensitivity).
    diagonal -= diagonal.mean(axis=0, keepdims=True)
    return value, grad


def _lbfgs(objective: _GramObjective, start: np.ndarray, *,
           max_iterations: int, tolerance: float, history: int = 10,
           progress: Optional[Callable[[int, float], None]] = None
           ) -> tuple[np.ndarray, int]:
  """Projected L-BFGS with a backtracking line search that stays PD.

  The constraints are linear, so projecting every gradient onto their
  subspace keeps every L-BFGS direction feasible; the line search halves the
  step until X is positive-definite and the Armijo condition holds.

  Args:
    objective: the loss over the free entries.
    start: a feasible, positive-definite starting vector.
    max_iterations: iteration cap.
    tolerance: stop when `_WINDOW` iterations improve the loss by less than
      this relative amount.
    history: number of L-BFGS correction pairs.
    progress: called with (iteration, loss) after every iteration.

  Returns:
    The optimized vector and the number of iterations.
  """
  x = start
  value, grad = objective.value_and_grad(x)
  if grad is None:
    raise ValueError('the starting Gram matrix is not positive-definite')
  steps, changes, inverse_curvatures = [], [], []
  values = [value]
  iteration = 0
  for iteration in range(1, max_iterations + 1):
    # Two-loop recursion, in place to limit memory traffic.
    direction = -grad
    alphas = []
    for s, y, rho in zip(reversed(steps), reversed(changes),
                         reversed(inverse_curvatures)):
      alpha = rho * np.dot(s, direction)
      direction -= alpha * y
      alphas.append(alpha)
    if steps:
      direction *= np.dot(steps[-1], changes[-1]) / np.dot(changes[-1],
                                                           changes[-1])
    else:
      direction *= np.abs(x).max() / max(np.abs(grad).max(), 1e-300)
    for s, y, rho, alpha in zip(steps, changes, inverse_curvatures,
                                reversed(alphas)):
      direction += (alpha - rho * np.dot(y, direction)) * s
    slope = np.dot(grad, direction)
    if slope >= 0:  # Not a descent direction: restart from the gradient.
      steps, changes, inverse_curvatures = [], [], []
      direction = -grad * (np.abs(x).max() / max(np.abs(grad).max(), 1e-300))
      slope = np.dot(grad, direction)
    size = 1.0
    while True:
      candidate = x + size * direction
      new_value, new_grad = objective.value_and_grad(candidate)
      if new_grad is not None and new_value <= value + 1e-4 * size * slope:
        break
      size *= 0.5
      if size < 1e-20:
        return x, iteration
    if progress is not None:
      progress(iteration, float(new_value))
    s, y = candidate - x, new_grad - grad
    curvature = np.dot(s, y)
    if curvature > 1e-12 * np.dot(y, y):
      steps.append(s)
      changes.append(y)
      inverse_curvatures.append(1.0 / curvature)
      if len(steps) > history:
        del steps[0], changes[0], inverse_curvatures[0]
    x, value, grad = candidate, new_value, new_grad
    values.append(value)
    # Single iterations can stall while the next ones still make progress:
    # judge the improvement over a window of iterations.
    if (len(values) > _WINDOW and
        values[-_WINDOW - 1] - value < tolerance * value):
      break
  return x, iteration


def _toeplitz_square_root_start(workload_matrix: np.ndarray, num_epochs: int,
                                bands: int) -> Optional[np.ndarray]:
  """A feasible starting Gram matrix from the banded square root of W.

  For a lower-triangular Toeplitz workload the Toeplitz square root `R`
  (`R R = W`) is a good single-participation strategy (banded square-root
  factorization, Kalinin & Lampert 2024); truncated to at most b bands it
  satisfies the orthogonality mask, and rescaling its columns sets every
  diagonal entry of X to 1/k. Starting there instead of from the identity
  cuts the initial loss by 5-10x on the paper's workloads. For `M A L` this
  root is the closed form `banded_square_root` (equal to 1e-15, so
  starting from the closed form changes nothing); the recursion here also
  serves any other Toeplitz workload.

  Returns:
    The starting Gram matrix, or None when W is not lower-triangular
    Toeplitz with a positive corner (start from the identity then).
  """
  num_steps = workload_matrix.shape[0]
  column = workload_matrix[:, 0]
  if column[0] <= 0 or not np.allclose(
      workload_matrix, linalg.toeplitz(column, np.zeros(num_steps))):
    return None
  root = np.zeros(num_steps)
  root[0] = math.sqrt(column[0])
  for t in range(1, num_steps):
    root[t] = (column[t] - np.dot(root[1:t], root[t - 1:0:-1])) / (2 * root[0])
  strategy = np.where(_band_mask(num_steps, bands),
                      linalg.toeplitz(root, np.zeros(num_steps)), 0.0)
  gram = strategy.T @ strategy
  scale = 1.0 / np.sqrt(num_epochs * np.diag(gram))
  return gram * np.outer(scale, scale)


def _cache_path(cache_dir: str, key_parts: tuple) -> str:
  digest = hashlib.sha256()
  for part in key_parts:
    if isinstance(part, np.ndarray):
      digest.update(str(part.shape).encode())
      digest.update(np.ascontiguousarray(part, np.float64).tobytes())
    else:
      digest.update(repr(part).encode())
  return os.path.join(cache_dir, f'strategy-{digest.hexdigest()[:32]}.npy')


def cache_root() -> str:
  """The library's on-disk cache: `$DPSCO_JAX_CACHE`, or `~/.cache/dpsco_jax`.

  It holds optimized strategies (`strategies/`) and calibrated noise
  multipliers (`calibrations/`), both recomputed when missing: delete the
  directory to clear it.

  Example:
    >>> shutil.rmtree(strategies.cache_root(), ignore_errors=True)

  Returns:
    The directory (it may not exist yet).
  """
  return os.environ.get(CACHE_ENV_VAR) or os.path.join(
      os.path.expanduser('~'), '.cache', 'dpsco_jax')


def calibration_file(kind: str, key: dict[str, Any]) -> str:
  """The cache file of a calibrated number, keyed by everything it depends on.

  Example:
    >>> calibration_file('noise', {'epsilon': 2.0, 'delta': 1e-5})

  Args:
    kind: the file name's prefix (what was calibrated).
    key: JSON-able description of the inputs (versions included).

  Returns:
    `cache_root()/calibrations/<kind>-<digest>.json`.
  """
  text = json.dumps(key, sort_keys=True, default=repr)
  digest = hashlib.sha256(text.encode()).hexdigest()[:32]
  return os.path.join(cache_root(), 'calibrations', f'{kind}-{digest}.json')


def cached_calibration(path: str, compute: Callable[[], float]) -> float:
  """`compute()`, remembered in the JSON file `path` (a positive float).

  A cached value only saves time: callers whose privacy rests on the value
  re-account it (a plan's ledger recomputes the epsilon it spends). An
  unreadable, non-finite or non-positive entry is computed again, and a
  cache that cannot be written costs only the next caller the computation.
  The file is written under a temporary name and renamed, so concurrent
  processes read a whole entry or none.

  Example:
    >>> cached_calibration(calibration_file('noise', key), calibrate)

  Args:
    path: the cache file (see `calibration_file`).
    compute: computes the value when it is not cached.

  Returns:
    The value.
  """
  try:
    with open(path) as handle:
      cached = float(json.load(handle)['noise_multiplier'])
    if math.isfinite(cached) and cached > 0:
      return cached
  except (OSError, ValueError, KeyError, TypeError):
    pass
  value = compute()
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile('w', dir=os.path.dirname(path),
                                     suffix='.json', delete=False) as f:
      json.dump({'noise_multiplier': value}, f)
    os.replace(f.name, path)
  except OSError:
    pass
  return value


def default_cache_dir() -> str:
  """Where optimized strategies are cached: `$DPSCO_JAX_CACHE/strategies`.

  Returns:
    The directory (default `~/.cache/dpsco_jax/strategies`).
  """
  return os.path.join(cache_root(), 'strategies')


def _cached_strategy(path: str, num_epochs: int,
                     bands: Optional[int]) -> Optional[np.ndarray]:
  """The strategy cached at `path` when it is readable and feasible."""
  if not os.path.exists(path):
    return None
  try:
    cached = np.load(path)
  except (OSError, ValueError):
    cached = None
  if cached is not None and _is_feasible(cached, num_epochs, bands):
    return cached
  logging.warning('ignoring an unreadable or infeasible cached strategy '
                  'at %s', path)
  return None


def _lbfgs_progress(stack: contextlib.ExitStack, progress: Any, what: str,
                    max_iterations: int) -> Callable[[int, float], None]:
  """The L-BFGS callback `optimize_strategy`'s `progress=` asks for."""
  if progress is None or isinstance(progress, bool):
    report = stack.enter_context(progress_lib.task(what, progress=progress))

    def callback(iteration: int, loss: float) -> None:
      report(f'L-BFGS iteration {iteration} (at most {max_iterations}), '
             f'loss {loss:.6g}')

    return callback
  if callable(progress):
    return progress
  raise TypeError('progress must be None, a bool or a callable, got '
                  f'{progress!r}')


def _strategy_of_gram(gram: np.ndarray, mask: np.ndarray, num_epochs: int,
                      bands: Optional[int]) -> np.ndarray:
  """The strategy of an optimized Gram, of sensitivity 1 under
  `FixedOrder(k, T / k)`."""
  num_steps = gram.shape[0]
  steps_per_epoch = num_steps // num_epochs
  # Remove the round-off drift of the linear constraints before factoring.
  gram = np.where(mask, (gram + gram.T) / 2, 0.0)
  diagonal = np.diag(gram).reshape(num_epochs, steps_per_epoch)
  np.fill_diagonal(gram, (diagonal / diagonal.sum(axis=0)).ravel())
  strategy = strategy_from_gram(gram)
  if bands is not None:
    strategy = np.where(_band_mask(num_steps, bands), strategy, 0.0)
  strategy /= accounting.participation_sensitivity(
      strategy, accounting.FixedOrder(num_epochs, steps_per_epoch))
  return strategy


def optimize_strategy(
    workload_matrix: np.ndarray,
    num_epochs: int = 1,
    *,
    bands: Optional[int] = None,
    max_iterations: int = 5000,
    tolerance: float = 1e-4,
    cache_dir: Union[str, None, bool] = True,
    progress: Union[None, bool, Callable[[int, float], None]] = None,
) -> np.ndarray:
  """A strategy `C` minimizing `||W C^-1||_F` under (k, b)-participation.

  Optimizes the Gram matrix `X = C^T C` (Choquette-Choo et al. 2023, used by
  paper 001 Algorithm 2 / §5): minimize `tr(W^T W X^-1) = ||W C^-1||_F^2`
  subject to `X[s, t] = 0` for distinct steps one example shares
  (`orthogonality_mask`) and, for every batch position j,
  `sum_i X[i b + j, i b + j] = 1`, by projected L-BFGS in float64 (from the
  banded Toeplitz square root of W when W is Toeplitz, else from
  `X = I / k`); then `C = strategy_from_gram(X)`. With the mask, the
  sensitivity under `FixedOrder(k, b)` is exactly 1 whatever the signs of C,
  so `max_j ||sum_i C[:, i b + j]||_2 = 1` (the constraint of Algorithm 2).
  With `bands`, X (hence C) is also banded (banded matrix factorization,
  streaming state of `bands - 1` noise vectors); `bands <= b` keeps the mask
  automatic.

  C is not constrained to be entrywise non-negative (Algorithm 2 assumes it
  is, so that its column-sum constraint is the sensitivity): for k > 1 the
  optimum has small negative entries (about -0.09 for k = 6, b = 100). The
  orthogonality makes the column-sum norm equal the exact sensitivity all
  the same, and the accountant recomputes it from C
  (`accounting.participation_sensitivity`).

  Results are cached on disk (`default_cache_dir()`, or `cache_dir`), keyed
  by everything that determines them: the workload matrix itself (its
  bytes, so T, the kind, momentum and decay), k, bands, the optimizer
  settings and a version of this optimizer; delete the directory to clear
  it. A cached strategy is checked (lower-triangular, sensitivity at most 1
  under `FixedOrder(k, T / k)`) before it is used. Cost: one Cholesky
  solve per iteration, on one BLAS thread (measured faster than two); the
  600x600 strategies of paper 001 take 100 to 1,000 iterations
  (`benchmarks/mf_noise.py`).

  Example:
    >>> w = workload(600, 'true', momentum=0.9)
    >>> c = optimize_strategy(w, num_epochs=6)          # b = 100
    >>> mech = noise.matrix_factorization(c)

  Args:
    workload_matrix: `W`, `[T, T]` (e.g. from `workload`).
    num_epochs: k; the participation is `FixedOrder(k, T / k)`.
    bands: number of non-zero diagonals of C (None: dense).
    max_iterations: L-BFGS iteration cap.
    tolerance: stop when ten iterations improve the loss by less than this
      relative amount.
    cache_dir: a directory, True for `default_cache_dir()`, or None/False to
      disable the cache.
    progress: None (default) or True: a progress line on stderr with the
      L-BFGS iteration and loss once the optimization has run a second
      (`dpsco_jax.progress`; None follows `$DPSCO_JAX_PROGRESS`, so
      `DPSCO_JAX_PROGRESS=0` silences it), so long optimizations (a minute
      for 600 x 600) are not silent and short ones stay quiet. False: no
      line. A callable: called with (iteration, loss) after every L-BFGS
      iteration instead.

  Returns:
    Lower-triangular float64 `C` `[T, T]` with sensitivity 1 under
    `FixedOrder(k, T / k)`.
  """
  workload_matrix = np.asarray(workload_matrix, np.float64)
  if (workload_matrix.ndim != 2 or
      workload_matrix.shape[0] != workload_matrix.shape[1]):
    raise ValueError('the workload must be a square matrix, got shape '
                     f'{workload_matrix.shape}')
  if not np.all(np.isfinite(workload_matrix)):
    raise ValueError('the workload has non-finite entries')
  num_steps = workload_matrix.shape[0]
  steps_per_epoch = _steps_per_epoch(num_steps, num_epochs)
  if bands is not None:
    bands = checks.positive_int(bands, 'bands')
  checks.positive_int(max_iterations, 'max_iterations')
  if not tolerance > 0:
    raise ValueError(f'tolerance must be positive, got {tolerance!r}')

  path = None
  if cache_dir is True:
    cache_dir = default_cache_dir()
  if cache_dir:
    path = _cache_path(cache_dir, (_CACHE_VERSION, workload_matrix, num_epochs,
                                   bands, max_iterations, tolerance))
    cached = _cached_strategy(path, num_epochs, bands)
    if cached is not None:
      return cached

  mask = orthogonality_mask(num_steps, num_epochs)
  if bands is not None:
    mask &= _band_mask(num_steps, bands)
  objective = _GramObjective(workload_matrix, mask, num_epochs)
  start_time = time.perf_counter()
  start = _toeplitz_square_root_start(
      workload_matrix, num_epochs, min(bands or num_steps, steps_per_epoch))
  if start is None:
    start = np.eye(num_steps) / num_epochs
  what = (f'dpsco_jax: optimizing a {num_steps}x{num_steps} strategy (k='
          f'{num_epochs}, bands={bands}'
          + ('; cached for the next run)' if path else ')'))
  with contextlib.ExitStack() as stack:
    callback = _lbfgs_progress(stack, progress, what, max_iterations)
    # One BLAS thread: the Cholesky solves of a few hundred rows run about
    # 2x faster than with two threads on a 2-core CPU
    # (benchmarks/mf_noise.py), and far faster when other jobs share them.
    stack.enter_context(
        threadpoolctl.threadpool_limits(limits=1, user_api='blas'))
    optimum, iterations = _lbfgs(objective, objective.to_vector(start),
                                 max_iterations=max_iterations,
                                 tolerance=tolerance, progress=callback)
  strategy = _strategy_of_gram(objective.to_matrix(optimum), mask,
                              num_epochs, bands)
  logging.info('optimized a %dx%d strategy (k=%d, bands=%s) in %d L-BFGS '
               'iterations, %.1f s', num_steps, num_steps, num_epochs, bands,
               iterations, time.perf_counter() - start_time)
  if path is not None:
    _store(path, strategy)
  return strategy


def _store(path: str, strategy: np.ndarray) -> None:
  """Writes a cache entry atomically; a read-only cache is not an error."""
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix='.npy',
                                     delete=False) as handle:
      np.save(handle, strategy)
    os.replace(handle.name, path)
  except OSError as error:
    logging.warning('could not cache the strategy at %s: %s', path, error)


def _is_feasible(strategy: np.ndarray, num_epochs: int,
                 bands: Optional[int]) -> bool:
  try:
    noise_lib.validate_strategy(strategy)
  except ValueError:
    return False
  num_steps = strategy.shape[0]
  if bands is not None and np.any(strategy[~_band_mask(num_steps, bands)]):
    return False
  sensitivity = accounting.participation_sensitivity(
      strategy, accounting.FixedOrder(num_epochs, num_steps // num_epochs))
  return sensitivity <= 1.0 + 1e-9


def workload_errors(workload_matrix: np.ndarray,
                    mechanism: noise_lib.NoiseMechanism,
                    participation: accounting.Participation
                    ) -> tuple[float, float]:
  """Errors of a mechanism on a workload, at unit sensitivity.

  The mechanism's per-step noise is `N xi` (`mechanism.decoder_matrix()`),
  so the workload sees `W N xi`. At equal privacy the noise multiplier
  scales with the sensitivity under `participation`, so both errors are
  multiplied by it: the numbers compare mechanisms at equal privacy.

  Example:
    >>> w = workload(120, 'ones')
    >>> workload_errors(w, noise.tree(120), accounting.single_epoch(120))

  Args:
    workload_matrix: W `[T, T]`.
    mechanism: a mechanism with a per-step release over T steps.
    participation: how one example takes part (`FixedOrder(k, b)`).

  Returns:
    `(||W N||_F, max_t ||(W N)_t||_2)` times the sensitivity: the total and
    the worst-step root-squared error for a unit noise multiplier.
  """
  if mechanism.release != 'per_step':
    raise ValueError('workload_errors expects the per-step release: the '
                     'workload applies the prefix sums itself')
  if mechanism.decoder_matrix is None:
    raise ValueError(f'{mechanism.name} does not expose its decoder matrix')
  sensitivity = accounting.mechanism_sensitivity(mechanism, participation)
  product = np.asarray(workload_matrix, np.float64) @ mechanism.decoder_matrix()
  rows = np.sqrt(np.sum(product ** 2, axis=1))
  return (float(sensitivity * np.sqrt(np.sum(rows ** 2))),
          float(sensitivity * rows.max()))
