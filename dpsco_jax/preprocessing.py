"""Private preprocessing: feature standardization whose epsilon joins the run's.

Standardizing features with the training rows' own mean and variance is a
release of those rows that no accountant sees. Two private ways instead:

* `public_standardization(lower, upper)`: scale by public bounds alone
  (known before the data, e.g. a sensor's range): nothing is computed from
  the data, and no privacy is spent;
* `dp_standardization(x, lower, upper, ...)`: clip every feature to its
  public bounds, release the features' sums and sums of squares with
  Gaussian noise (one Gaussian mechanism), and standardize with the noisy
  mean and variance. Its `release` (an `accounting.GaussianRelease`) goes to
  the run's plan (`plans.dpsgd(..., releases=[std.release])`): the steps'
  noise is calibrated to what it leaves of the target epsilon, and the
  ledger reports it from step 0 on, so the run with its preprocessing is
  (epsilon, delta)-DP.

    std = preprocessing.dp_standardization(
        train_x, lower, upper, epsilon=0.2, delta=1e-6, key=key_pre)
    plan = plans.dpsgd(loss_fn, ..., epsilon=2.0, delta=1e-6,
                       releases=[std.release])
    data = {'x': std.apply(train_x), 'y': train_y}

The mechanism. With `m = (lower + upper) / 2` and `h = (upper - lower) / 2`,
each row becomes `u = (clip(x, lower, upper) - m) / h` in `[-1, 1]^d`, and
the statistic is `S = sum_i (u_i, u_i^2)` in `R^{2d}`. One row moves `S` by
the vector `(u, u^2)` (add/remove, zero-out: the row, or a zero row, is
there or not) or `(u - u', u^2 - u'^2)` (replace-one), whose squared norms are

* add/remove, zero-out: `sum_j u_j^2 + u_j^4 <= 2d` (each term at most 2,
  at `|u_j| = 1`), so the l2 sensitivity is `sqrt(2d)`;
* replace-one: `sum_j (u_j - u'_j)^2 (1 + (u_j + u'_j)^2)`. With
  `p = u_j - u'_j`, `q = u_j + u'_j` and `|p| + |q| <= 2` (both in
  `[-1, 1]`), `p^2 (1 + q^2) <= (2 - |q|)^2 (1 + q^2) <= 4` (it decreases
  from 4 at `q = 0` on `[0, 2]`: its derivative there is
  `-2 (2 - q) (1 + q^2) + 2 q (2 - q)^2 = -2 (2 - q)(1 - 2 q + 2 q^2) < 0`),
  so the sensitivity is `2 sqrt(d)`.

`statistics_sensitivity` gives these; the noise std is
`noise_multiplier * sensitivity`, so the release is
`GaussianDpEvent(noise_multiplier)`. The number of rows n is treated as
public, as every plan does (`num_examples`). The noisy variance is clamped
to `[min_scale^2, 1]` in u units (a variable in `[-1, 1]` has variance at
most 1) and the noisy mean to `[-1, 1]`: post-processing, no privacy cost.
"""

from typing import NamedTuple, Optional

import jax
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import estimators
from dpsco_jax import keys
from dpsco_jax import neighboring
from dpsco_jax import noise

Relation = neighboring.NeighboringRelation

RELEASE_NAME = 'feature mean and variance'


class Standardization(NamedTuple):
  """A feature standardization: `(clip(x, lower, upper) - mean) / scale`.

  Attributes:
    mean: `[d]`, the center subtracted.
    scale: `[d]`, > 0, the divisor.
    lower: `[d]`, the public lower bounds rows are clipped to.
    upper: `[d]`, the public upper bounds.
    release: the `accounting.GaussianRelease` that made `mean` and `scale`
      (give it to the run's plan), or None when they come from public
      bounds alone.
  """

  mean: np.ndarray
  scale: np.ndarray
  lower: np.ndarray
  upper: np.ndarray
  release: Optional[accounting.GaussianRelease]

  def apply(self, x) -> np.ndarray:
    """Rows `x` `[n, d]` clipped to the bounds, then standardized.

    Example:
      >>> train = {'x': std.apply(train_x), 'y': train_y}

    Args:
      x: rows, `[n, d]` (training or test: the same map for both).

    Returns:
      float32 `[n, d]`.

    Raises:
      ValueError: if the rows do not have `d` features.
    """
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or x.shape[1] != self.mean.shape[0]:
      raise ValueError(f'expected rows [n, {self.mean.shape[0]}], got shape '
                       f'{x.shape}')
    clipped = np.clip(x, self.lower, self.upper)
    return ((clipped - self.mean) / self.scale).astype(np.float32)


def _bounds(lower, upper) -> tuple[np.ndarray, np.ndarray]:
  lower = np.atleast_1d(np.asarray(lower, np.float64))
  upper = np.atleast_1d(np.asarray(upper, np.float64))
  if lower.ndim != 1 or lower.shape != upper.shape:
    raise ValueError(f'lower and upper must be [d] vectors of one shape, got '
                     f'{lower.shape} and {upper.shape}')
  if not (np.all(np.isfinite(lower)) and np.all(np.isfinite(upper))
          and np.all(upper > lower)):
    raise ValueError('the bounds must be finite with upper > lower for every '
                     'feature (public values, fixed before seeing the data)')
  return lower, upper


def public_standardization(lower, upper) -> Standardization:
  """Scaling by public bounds alone: `[lower, upper]` maps to `[-1, 1]`.

  Nothing is computed from the data, so nothing is spent.

  Example:
    >>> std = public_standardization([0.0, -40.0], [15.0, 50.0])
    >>> std.apply(np.array([[7.5, 5.0]]))
    array([[0., 0.]], dtype=float32)

  Args:
    lower: `[d]` public lower bounds.
    upper: `[d]` public upper bounds.

  Returns:
    A `Standardization` without a release.

  Raises:
    ValueError: for bounds that are not finite `[d]` vectors with
      upper > lower.
  """
  lower, upper = _bounds(lower, upper)
  return Standardization(mean=(lower + upper) / 2, scale=(upper - lower) / 2,
                         lower=lower, upper=upper, release=None)


def statistics_sensitivity(dim: int, neighboring_relation: Relation = (
    Relation.ADD_OR_REMOVE)) -> float:
  """The l2 sensitivity of `sum_i (u_i, u_i^2)` for rows in `[-1, 1]^dim`.

  Derived in the module docstring: `sqrt(2 dim)` under add/remove and
  zero-out, `2 sqrt(dim)` under replace-one.

  Example:
    >>> statistics_sensitivity(4)
    2.828...

  Args:
    dim: d, the number of features.
    neighboring_relation: the run's relation.

  Returns:
    The sensitivity.
  """
  dim = checks.positive_int(dim, 'dim')
  if Relation(neighboring_relation) is Relation.REPLACE_ONE:
    return 2.0 * np.sqrt(dim)
  return float(np.sqrt(2.0 * dim))


def dp_standardization(
    x,
    lower,
    upper,
    *,
    key: estimators.KeyLike = None,
    noise_multiplier: Optional[float] = None,
    epsilon: Optional[float] = None,
    delta: Optional[float] = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ADD_OR_REMOVE,
    min_scale: float = 1e-2,
) -> Standardization:
  """A standardization from the features' noisy mean and variance.

  One Gaussian mechanism on `sum_i (u_i, u_i^2)` (module docstring). Give
  either `noise_multiplier`, or `epsilon` and `delta` for the release alone
  (it is then calibrated as a single Gaussian mechanism under `method`);
  the run's plan takes `release` and spends it with the steps.

  Example:
    >>> std = dp_standardization(train_x, lower, upper, epsilon=0.2,
    ...                          delta=1e-6, key=jax.random.key(11))
    >>> plan = plans.dpsgd(loss_fn, ..., epsilon=2.0, delta=1e-6,
    ...                    releases=[std.release])

  Args:
    x: the training rows, `[n, d]` (the rows the run trains on).
    lower: `[d]` public lower bounds; rows are clipped to them.
    upper: `[d]` public upper bounds.
    key: the noise key (its own: not the run's noise key; None draws a
      fresh one).
    noise_multiplier: noise std over the statistic's sensitivity.
    epsilon: the release's own epsilon (instead of `noise_multiplier`).
    delta: the release's delta (with `epsilon`).
    method: accounting method for calibrating to `epsilon`.
    neighboring_relation: the run's relation (it decides the sensitivity,
      and the run's plan refuses a release made for another).
    min_scale: the smallest scale kept, as a fraction of `(upper - lower)
      / 2` (a noisy variance can come out 0 or negative).

  Returns:
    A `Standardization` with its `release`.

  Raises:
    ValueError: for bad rows or bounds, both or neither of
      `noise_multiplier` and `epsilon`, or `min_scale` outside (0, 1].
  """
  lower, upper = _bounds(lower, upper)
  x = np.asarray(x, np.float64)
  if x.ndim != 2 or x.shape[1] != lower.shape[0] or x.shape[0] < 1:
    raise ValueError(f'expected rows [n >= 1, {lower.shape[0]}] (one bound per '
                     f'feature), got shape {x.shape}')
  if not np.all(np.isfinite(x)):
    raise ValueError('the rows hold NaN or infinite values: clean them first '
                     '(clipping would hide them inside the bounds)')
  if not 0.0 < float(min_scale) <= 1.0:
    raise ValueError(f'min_scale must be in (0, 1], got {min_scale!r}')
  relation = Relation(neighboring_relation)
  if (noise_multiplier is None) == (epsilon is None):
    raise ValueError('give exactly one of noise_multiplier= and epsilon= '
                     '(with delta=)')
  if epsilon is not None:
    if delta is None:
      raise ValueError('epsilon= needs delta=')
    accounting.validate_epsilon_delta(epsilon, delta)
    checks.warn_large_delta(delta, x.shape[0])
    # One Gaussian mechanism, used once: a one-step i.i.d. Gaussian run.
    noise_multiplier = accounting.calibrate_noise_multiplier(
        noise.gaussian(1), accounting.single_epoch(1), epsilon, delta,
        method=method)
  release = accounting.GaussianRelease(RELEASE_NAME, noise_multiplier,
                                       relation.value)
  n, dim = x.shape
  half = (upper - lower) / 2
  # Clipped again after the arithmetic: its rounding may leave |u| a few
  # ulp above 1, and the sensitivity assumes |u| <= 1 exactly. (The sums
  # below are numpy's pairwise float64 sums: their rounding, about
  # log2(n) 1e-16 per unit of sensitivity, is far below anything the
  # Gaussian's calibration resolves.)
  u = np.clip((np.clip(x, lower, upper) - (lower + upper) / 2) / half,
              -1.0, 1.0)
  statistic = np.concatenate([u.sum(axis=0), (u ** 2).sum(axis=0)])
  std = release.noise_multiplier * statistics_sensitivity(dim, relation)
  draw = jax.random.normal(keys.noise_key(key, 'dp_standardization'),
                           (2 * dim,))
  noisy = statistic + std * np.asarray(draw, np.float64)
  mean_u = np.clip(noisy[:dim] / n, -1.0, 1.0)
  variance_u = np.clip(noisy[dim:] / n - mean_u ** 2, float(min_scale) ** 2,
                       1.0)
  return Standardization(mean=(lower + upper) / 2 + half * mean_u,
                         scale=half * np.sqrt(variance_u), lower=lower,
                         upper=upper, release=release)
