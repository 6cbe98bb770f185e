"""Randomized smoothing: smoothed-gradient estimators and their clip radii.

For an L-Lipschitz loss f (not smooth, not convex), paper 004 works with the
uniform-ball smoothing `f_alpha(x) = E_{u ~ Unif(B_alpha)} f(x + u)`, which
is L-Lipschitz, within L alpha of f, and has a gradient that is Lipschitz
(`ball_smoothing_lipschitz`); an (alpha, beta)-Goldstein stationary point of
`f_alpha` is a (2 alpha, beta) one of f (paper 004, Lemma 2.4). The library
estimates `grad f_alpha(x; example)` per example with m random directions:

* zero order (paper 004 eq. (4), with the `y_j` the equation drops; Fact
  2.3(iv)): `(1/m) sum_j (d / 2 alpha) (f(x + alpha y_j) - f(x - alpha y_j))
  y_j`, y_j uniform on the unit sphere of the FLATTENED params (d = number
  of parameters), drawn one at a time from a key inside a `lax.scan`: memory
  O(d) per example, never O(m d);
* first order (paper 004 Algorithm 5 and Fact 2.3(iv); eq. (10)'s sphere is
  an erratum, the ball is what keeps the sqrt(d)): `(1/m) sum_j grad f(x +
  u_j)`, u_j uniform in the ball of radius alpha.

The statistics `clipped_smoothed_grad_sum` (an anchor: one estimate per
example) and `clipped_smoothed_difference_sum` (the estimate at the query
point minus the estimate at the previous one, on the SAME example, with
independent directions, paper 004 Algorithms 3-5) are `ClippedStatistic`s:
every per-example value is clipped, so the sensitivity is exact whatever the
loss (NaN and Inf estimates are dropped by the clipping).

Effective sensitivity (paper 004 Lemmas 3.4 and 6.3, with explicit
constants; derivation in `docs/nonsmooth.md`). Each summand of an estimate
is bounded (zero order: `L d`, first order: `L`) and the estimate
concentrates around `grad f_alpha(x; example)`, whose norm is at most L.
Pinelis' inequality for bounded independent vectors in a Hilbert space
(Pinelis 1994, Theorem 3.5: `P(||sum_j X_j|| >= r) <= 2 exp(-r^2 / (2 sum_j
b_j^2))` for zero-mean `||X_j|| <= b_j`) gives, with probability at least
`1 - g`,

    ||estimate - grad f_alpha|| <= b sqrt(2 log(2 / g) / m),

with `b = (d + 1) L` (zero order) or `2 L` (first order), free of any
log(d). `effective_clips` sets the clips at these radii, with the failure
probability split over every estimate of the run (a union bound):

    anchor      C_1 = min(worst, L + dev)
    difference  C_2 = min(2 worst, kappa_d L 2D / alpha + 2 dev)

where `worst` is the worst case (`L d` zero order, `L` first order),
`kappa_d` the smoothness constant and `2D` the largest move of the query
point between two steps of O2NC. `worst_case_clips` gives the worst-case
radii (the earlier work's `L d`), for comparison.

References:
  G. Kornowski, D. Liu, K. Talwar. Improved sample complexity for private
  nonsmooth nonconvex optimization. Eq. (4), (10), Fact 2.3, Lemma 2.4,
  Lemmas 3.4, 6.3, Algorithms 3-5.
  I. Pinelis. Optimum bounds for the distributions of martingales in Banach
  spaces. Annals of Probability 22(4), 1994. Theorem 3.5.
"""

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import ghost

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

ORDERS = ('zero', 'first')


class SmoothingBatch(NamedTuple):
  """A batch for the smoothed statistics: examples and one key per example.

  Attributes:
    examples: pytree of arrays with a leading example axis.
    keys: `[batch, ...]` raw key data (`jax.random.key_data`, so that
      microbatching can pad it); example i's directions come from `keys[i]`
      alone, independent of the other rows and of the devices
      (`example_keys`).
  """

  examples: PyTree
  keys: jax.Array


def example_keys(key: jax.Array, num_examples: int, offset: Any = 0
                 ) -> jax.Array:
  """Raw per-example keys `fold_in(key, offset + i)`, i < num_examples.

  On several devices pass each device's global row offset, so that an
  example gets the same directions however the batch is sharded.

  Example:
    >>> keys = example_keys(jax.random.key(0), 32)
    >>> batch = SmoothingBatch({'x': x, 'y': y}, keys)

  Args:
    key: a typed PRNG key (one per step).
    num_examples: the rows.
    offset: the global index of the first row (may be traced).

  Returns:
    `[num_examples, ...]` uint32 key data.
  """
  rows = offset + jnp.arange(num_examples)
  return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(
      rows)


def num_parameters(params: PyTree) -> int:
  """d: the number of scalar parameters of a pytree.

  Example:
    >>> num_parameters({'w': jnp.zeros((3, 4)), 'b': jnp.zeros(4)})
    16

  Args:
    params: a pytree of arrays.

  Returns:
    The total size of its leaves.
  """
  return int(sum(math.prod(jnp.shape(leaf))
                 for leaf in jax.tree_util.tree_leaves(params)))


def _float_dtype(leaf) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def sphere_direction(key: jax.Array, like: PyTree) -> PyTree:
  """A direction uniform on the unit sphere of the flattened `like`.

  A Gaussian on every leaf (its own `fold_in` key), divided by the global
  norm over all leaves: uniform on S^{d-1} with d the total parameter count
  (normalizing each leaf on its own would not be).

  Example:
    >>> y = sphere_direction(jax.random.key(0), params)  # ||y|| = 1

  Args:
    key: a PRNG key.
    like: the params (shapes and dtypes; at least float32).

  Returns:
    A pytree like `like` with global l2 norm 1.
  """
  leaves, treedef = jax.tree_util.tree_flatten(like)
  draws = [jax.random.normal(jax.random.fold_in(key, i), jnp.shape(leaf),
                             _float_dtype(leaf))
           for i, leaf in enumerate(leaves)]
  squared = sum(jnp.sum(jnp.square(x)) for x in draws)
  inverse = jax.lax.rsqrt(squared)
  return jax.tree_util.tree_unflatten(
      treedef, [x * inverse.astype(x.dtype) for x in draws])


def ball_point(key: jax.Array, like: PyTree, radius: float) -> PyTree:
  """A point uniform in the l2 ball of `radius` around 0, shaped like `like`.

  A sphere direction times `radius U^(1/d)`, computed as
  `exp(log(U) / d)` (close to `radius` for large d, without underflow).

  Example:
    >>> u = ball_point(jax.random.key(0), params, 0.1)   # ||u|| <= 0.1

  Args:
    key: a PRNG key.
    like: the params.
    radius: the ball's radius alpha.

  Returns:
    A pytree like `like`.
  """
  direction_key, radius_key = jax.random.split(key)
  d = num_parameters(like)
  u = jax.random.uniform(radius_key, (), jnp.float32, minval=1e-38)
  scale = radius * jnp.exp(jnp.log(u) / d)
  return jax.tree_util.tree_map(lambda y: y * scale.astype(y.dtype),
                                sphere_direction(direction_key, like))


def _shifted(params: PyTree, direction: PyTree, scale) -> PyTree:
  return jax.tree_util.tree_map(
      lambda p, y: (p + scale * y).astype(jnp.result_type(p)), params,
      direction)


def _validate_estimator(radius: float, num_directions: int) -> None:
  if not (isinstance(radius, jax.core.Tracer) or
          (float(radius) > 0 and math.isfinite(float(radius)))):
    raise ValueError(f'the smoothing radius must be positive and finite, got '
                     f'{radius!r}')
  if (isinstance(num_directions, bool) or int(num_directions) !=
      num_directions or num_directions < 1):
    raise ValueError('num_directions (m) must be a positive integer, got '
                     f'{num_directions!r}')


def _mean_of_terms(term: Callable[[jax.Array], PyTree],
                   num_directions: int) -> PyTree:
  """`(1/m) sum_{j<m} term(j)`, one term at a time (a `lax.scan`).

  The first term starts the sum, so the carry has the terms' own type
  (under `shard_map` a term varies across devices; a zero carry would not).
  """
  def body(total, j):
    return jax.tree_util.tree_map(jnp.add, total, term(j)), None

  total, _ = jax.lax.scan(body, term(0), jnp.arange(1, num_directions))
  return jax.tree_util.tree_map(lambda t: t / num_directions, total)


def zero_order_estimate(loss_fn: LossFn, params: PyTree, example: PyTree,
                        key: jax.Array, *, radius: float,
                        num_directions: int) -> PyTree:
  """The two-point estimate of `grad f_alpha(params; example)` (eq. (4)).

  `(1/m) sum_j (d / (2 alpha)) (f(x + alpha y_j) - f(x - alpha y_j)) y_j`
  with y_j uniform on the unit sphere, regenerated from `fold_in(key, j)`
  inside a `lax.scan`: 2m loss evaluations, O(d) memory. Unbiased for the
  smoothed gradient (Fact 2.3(iv)); each summand has norm at most `L d` for
  an L-Lipschitz loss. The difference of two close losses loses digits in
  low precision: use float32 at least (float64 for small alpha).

  Example:
    >>> g = zero_order_estimate(loss_fn, params, example, jax.random.key(0),
    ...                         radius=0.1, num_directions=64)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    params: the point x.
    example: one example.
    key: the directions' key.
    radius: alpha.
    num_directions: m.

  Returns:
    A pytree like `params` (at least float32).
  """
  _validate_estimator(radius, num_directions)
  weight = num_parameters(params) / (2.0 * radius)

  def term(j):
    y = sphere_direction(jax.random.fold_in(key, j), params)
    difference = (loss_fn(_shifted(params, y, radius), example) -
                  loss_fn(_shifted(params, y, -radius), example))
    return jax.tree_util.tree_map(
        lambda v: (weight * difference).astype(v.dtype) * v, y)

  return _mean_of_terms(term, num_directions)


def first_order_estimate(loss_fn: LossFn, params: PyTree, example: PyTree,
                         key: jax.Array, *, radius: float,
                         num_directions: int) -> PyTree:
  """The ball-smoothed gradient estimate `(1/m) sum_j grad f(x + u_j)`.

  u_j uniform in the ball of radius alpha (Algorithm 5, Fact 2.3(iv); eq.
  (10) writes the sphere, an erratum: sphere smoothing is only O(L d /
  alpha)-smooth). Unbiased for `grad f_alpha`; each summand has norm at
  most L. One gradient per direction, in a `lax.scan`.

  Example:
    >>> g = first_order_estimate(loss_fn, params, example, jax.random.key(0),
    ...                          radius=0.1, num_directions=4)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    params: the point x.
    example: one example.
    key: the perturbations' key.
    radius: alpha.
    num_directions: m.

  Returns:
    A pytree like `params` (at least float32).
  """
  _validate_estimator(radius, num_directions)
  grad_fn = jax.grad(loss_fn)

  def term(j):
    u = ball_point(jax.random.fold_in(key, j), params, radius)
    gradient = grad_fn(_shifted(params, u, 1.0), example)
    return jax.tree_util.tree_map(
        lambda g, p: g.astype(_float_dtype(p)), gradient, params)

  return _mean_of_terms(term, num_directions)


ESTIMATORS = {'zero': zero_order_estimate, 'first': first_order_estimate}


def _validate_order(order: str) -> str:
  if order not in ORDERS:
    raise ValueError(f"order must be 'zero' or 'first', got {order!r}")
  return order


def _smoothing_signature(batch, *args):
  """`(params, examples)` for the one-example loss check."""
  if not isinstance(batch, SmoothingBatch):
    raise ghost.GhostClippingUnsupported('not a SmoothingBatch')
  return args[0], batch.examples


def _no_ghost_terms(*args):
  raise ghost.GhostClippingUnsupported(
      'smoothed estimates average gradients at perturbed points')


SMOOTHED_FORM = clipping.GhostForm(signature=_smoothing_signature,
                                   terms=_no_ghost_terms)


def _check_batch(batch: Any) -> None:
  if not isinstance(batch, SmoothingBatch):
    raise ValueError('a smoothed statistic takes a SmoothingBatch(examples, '
                     f'keys), got {type(batch).__name__}')


class _SmoothedStatistic(clipping.ClippedStatistic):
  """A `ClippedStatistic` whose batch must be a `SmoothingBatch`."""

  def __call__(self, batch, *args, mask=None, l2_clip=None, axis_name=None):
    _check_batch(batch)
    return super().__call__(batch, *args, mask=mask, l2_clip=l2_clip,
                            axis_name=axis_name)


def clipped_smoothed_grad_sum(
    loss_fn: LossFn,
    l2_clip: float,
    *,
    order: str,
    radius: float,
    num_directions: int,
    microbatch_size: Optional[int] = None,
) -> clipping.ClippedStatistic:
  """Sum over examples of smoothed-gradient estimates, each clipped.

  The anchor statistic of paper 004 Algorithms 3-5 (Algorithm 5 takes one
  perturbation per anchor example: `num_directions=1`). Example i's
  estimate uses `batch.keys[i]` only.

  Example:
    >>> stat = clipped_smoothed_grad_sum(loss_fn, 1.0, order='zero',
    ...                                  radius=0.1, num_directions=64)
    >>> keys = example_keys(jax.random.key(0), len(x))
    >>> out = stat(SmoothingBatch({'x': x, 'y': y}, keys), params)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm per example estimate (`effective_clips`).
    order: 'zero' (function values) or 'first' (gradients).
    radius: alpha, the smoothing radius.
    num_directions: m.
    microbatch_size: optional cap on examples estimated at once.

  Returns:
    A `ClippedStatistic` called as `stat(SmoothingBatch, params, mask=None)`.
  """
  estimate = ESTIMATORS[_validate_order(order)]
  _validate_estimator(radius, num_directions)

  def contribution(unit, params):
    example, key = unit.examples, jax.random.wrap_key_data(unit.keys)
    return estimate(loss_fn, params, example, key, radius=radius,
                    num_directions=num_directions)

  return _SmoothedStatistic(
      contribution_fn=contribution, l2_clip=l2_clip,
      microbatch_size=microbatch_size, loss_fn=loss_fn,
      clipping_method='vmap', ghost_form=SMOOTHED_FORM)


def clipped_smoothed_difference_sum(
    loss_fn: LossFn,
    l2_clip: float,
    *,
    order: str,
    radius: float,
    num_directions: int,
    microbatch_size: Optional[int] = None,
) -> clipping.ClippedStatistic:
  """Sum of per-example smoothed-gradient DIFFERENCES, each clipped.

  Example i contributes `est(x_t; i) - est(x_{t-1}; i)`, the two estimates
  on the SAME example with independent directions (`fold_in(keys[i], 0)`
  and `fold_in(keys[i], 1)`, the paper's j <= m and j > m), and the
  difference is clipped as a whole (paper 004 Algorithms 3 and 5, the
  difference steps).

  Example:
    >>> stat = clipped_smoothed_difference_sum(loss_fn, 0.5, order='first',
    ...                                        radius=0.1, num_directions=4)
    >>> out = stat(SmoothingBatch(examples, keys), params, prev_params)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm per example difference (`effective_clips`).
    order: 'zero' or 'first'.
    radius: alpha.
    num_directions: m, per point.
    microbatch_size: optional cap on examples estimated at once.

  Returns:
    A `ClippedStatistic` called as
    `stat(SmoothingBatch, params, prev_params, mask=None)`.
  """
  estimate = ESTIMATORS[_validate_order(order)]
  _validate_estimator(radius, num_directions)

  def contribution(unit, params, prev_params):
    example, key = unit.examples, jax.random.wrap_key_data(unit.keys)
    current = estimate(loss_fn, params, example, jax.random.fold_in(key, 0),
                       radius=radius, num_directions=num_directions)
    previous = estimate(loss_fn, prev_params, example,
                        jax.random.fold_in(key, 1), radius=radius,
                        num_directions=num_directions)
    return jax.tree_util.tree_map(jnp.subtract, current, previous)

  return _SmoothedStatistic(
      contribution_fn=contribution, l2_clip=l2_clip,
      microbatch_size=microbatch_size, loss_fn=loss_fn,
      clipping_method='vmap', ghost_form=SMOOTHED_FORM)


def clipped_smoothed_step_sum(
    loss_fn: LossFn,
    l2_clip: float,
    *,
    order: str,
    radius: float,
    num_directions: int,
    anchor_directions: int,
    microbatch_size: Optional[int] = None,
) -> clipping.ClippedStatistic:
  """An anchor OR a difference statistic, chosen per call by a traced flag.

  Example i contributes exactly what `clipped_smoothed_grad_sum` (with
  `anchor_directions`) gives when `is_anchor` is true and what
  `clipped_smoothed_difference_sum` gives otherwise, the same keys and the
  same arithmetic, picked by `jnp.where` (a select: a NaN in the value not
  picked cannot leak); then it is clipped like any statistic. Give each call
  its clip with `dataclasses.replace(stat, l2_clip=jnp.where(is_anchor, C_1,
  C_2))` (a traced clip: `dpsco_jax.clipping` counts its rounding to
  float32).

  For an oracle whose anchor and difference steps have batches of the same
  shape, this replaces a `lax.cond` between the two statistics, which would
  make the device read the flag back to the host and synchronize its stream
  every step. The price: both estimates of a difference are evaluated on
  anchor steps too (the previous point's is dropped), and, when
  `anchor_directions != num_directions`, every step also evaluates the
  anchor estimate (`anchor_directions` more directions per example).

  Example:
    >>> stat = clipped_smoothed_step_sum(loss_fn, 1.0, order='zero',
    ...                                  radius=0.1, num_directions=4,
    ...                                  anchor_directions=4)
    >>> stat = dataclasses.replace(stat, l2_clip=jnp.where(anchor, 1.0, 0.5))
    >>> out = stat(SmoothingBatch(examples, keys), params, prev_params,
    ...            anchor)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: a placeholder clip (replace it per call, as above).
    order: 'zero' or 'first'.
    radius: alpha.
    num_directions: m, per point of a difference.
    anchor_directions: directions of an anchor estimate.
    microbatch_size: optional cap on examples estimated at once.

  Returns:
    A `ClippedStatistic` called as
    `stat(SmoothingBatch, params, prev_params, is_anchor, mask=None)`.
  """
  estimate = ESTIMATORS[_validate_order(order)]
  _validate_estimator(radius, num_directions)
  _validate_estimator(radius, anchor_directions)

  def contribution(unit, params, prev_params, is_anchor):
    example, key = unit.examples, jax.random.wrap_key_data(unit.keys)
    # The anchor's key is the example's own, a difference's first estimate
    # uses fold_in(key, 0): with as many directions, one estimate serves both.
    first_key = jax.random.wrap_key_data(jnp.where(
        is_anchor, unit.keys, jax.random.key_data(jax.random.fold_in(key, 0))))
    current = estimate(loss_fn, params, example, first_key, radius=radius,
                       num_directions=num_directions)
    if anchor_directions == num_directions:
      anchor = current
    else:
      anchor = estimate(loss_fn, params, example, key, radius=radius,
                        num_directions=anchor_directions)
    previous = estimate(loss_fn, prev_params, example,
                        jax.random.fold_in(key, 1), radius=radius,
                        num_directions=num_directions)
    return jax.tree_util.tree_map(
        lambda x, y, z: jnp.where(is_anchor, x, y - z), anchor, current,
        previous)

  return _SmoothedStatistic(
      contribution_fn=contribution, l2_clip=l2_clip,
      microbatch_size=microbatch_size, loss_fn=loss_fn,
      clipping_method='vmap', ghost_form=SMOOTHED_FORM)


# ------------------------------------------------------------ constants


def ball_smoothing_lipschitz(dimension: int) -> float:
  """kappa_d: `grad f_alpha` is `kappa_d L / alpha`-Lipschitz for L-Lipschitz f.

  `grad f_alpha(x) - grad f_alpha(x')` is an integral of `grad f` (norm <=
  L) over the symmetric difference of the two balls divided by the ball's
  volume, and that difference has volume at most `2 ||x - x'|| V_{d-1}
  alpha^{d-1}` (the slab the ball sweeps), so

      kappa_d = 2 V_{d-1} / V_d = 2 Gamma(d/2 + 1) / (sqrt(pi) Gamma((d+1)/2)),

  about `sqrt(2 d / pi)` and at most `sqrt(d)` (Fact 2.3(iii) with its
  constant; the paper writes O(L sqrt(d) / alpha)).

  Example:
    >>> ball_smoothing_lipschitz(1)
    1.0

  Args:
    dimension: d >= 1.

  Returns:
    kappa_d.
  """
  if isinstance(dimension, bool) or int(dimension) != dimension or dimension < 1:
    raise ValueError(f'dimension must be a positive integer, got {dimension!r}')
  d = float(dimension)
  return 2.0 * math.exp(math.lgamma(d / 2 + 1) - math.lgamma((d + 1) / 2)
                        ) / math.sqrt(math.pi)


def concentration_radius(summand_bound: float, num_directions: int,
                         failure_probability: float) -> float:
  """The deviation of a mean of m bounded i.i.d. vectors from its expectation.

  With probability at least `1 - failure_probability`,
  `||(1/m) sum_j X_j - E X|| <= summand_bound sqrt(2 log(2 / g) / m)` for
  independent `X_j` with `||X_j - E X|| <= summand_bound` (Pinelis 1994,
  Theorem 3.5, in a Hilbert space).

  Example:
    >>> concentration_radius(11.0, 100, 1e-9)   # (d + 1) L for d = 10, L = 1

  Args:
    summand_bound: b, the bound on each centred summand.
    num_directions: m.
    failure_probability: g in (0, 1).

  Returns:
    The radius.
  """
  if not 0.0 < failure_probability < 1.0:
    raise ValueError('failure_probability must be in (0, 1), got '
                     f'{failure_probability!r}')
  _validate_estimator(1.0, num_directions)
  return float(summand_bound) * math.sqrt(
      2.0 * math.log(2.0 / failure_probability) / num_directions)


class SmoothingClips(NamedTuple):
  """Clip norms of the smoothed statistics.

  Attributes:
    anchor: C_1, on each per-example estimate (anchor steps).
    difference: C_2, on each per-example difference (other steps).
  """

  anchor: float
  difference: float



def worst_case_clips(*, order: str, lipschitz: float,
                     dimension: int) -> SmoothingClips:
  """The worst-case norms: `(L d, 2 L d)` zero order, `(L, 2 L)` first order.

  Every estimate of an L-Lipschitz loss is within them with probability 1
  (each summand is), so these clips never bind for such a loss; the noise
  they imply is the earlier work's (Zhang et al. 2024: sensitivity L d / B).

  Example:
    >>> worst_case_clips(order='zero', lipschitz=1.0, dimension=100)
    SmoothingClips(anchor=100.0, difference=200.0)

  Args:
    order: 'zero' or 'first'.
    lipschitz: L.
    dimension: d.

  Returns:
    `SmoothingClips`.
  """
  lipschitz = checks.positive_finite(lipschitz, 'lipschitz')
  worst = lipschitz * (dimension if _validate_order(order) == 'zero' else 1)
  return SmoothingClips(anchor=worst, difference=2.0 * worst)


def effective_clips(
    *,
    order: str,
    lipschitz: float,
    dimension: int,
    smoothing_radius: float,
    movement_radius: float,
    num_directions: int,
    anchor_directions: Optional[int] = None,
    failure_probability: float,
    num_estimates: int,
) -> SmoothingClips:
  """Clips at the concentration radius ("effective sensitivity").

  For an L-Lipschitz loss, every one of the run's `num_estimates`
  per-example estimates lies within its clip with probability at least
  `1 - failure_probability` in all (a union bound, each estimate getting
  `failure_probability / num_estimates`):

      dev_k = b sqrt(2 log(2 num_estimates / g) / k)
      C_1 = min(worst, L + dev_{anchor_directions})
      C_2 = min(2 worst, kappa_d L (2 D) / alpha + 2 dev_m)

  with `b = (d + 1) L` and `worst = L d` (zero order), `b = 2 L` and
  `worst = L` (first order); `2 D` bounds the move of O2NC's query point in
  one step and `kappa_d` is `ball_smoothing_lipschitz(d)`. Privacy never
  depends on this event (every value is clipped); it only decides whether
  the clipped run equals the paper's unclipped algorithm, which the plans
  account for by spending part of delta (`docs/nonsmooth.md`).

  Example:
    >>> effective_clips(order='zero', lipschitz=1.0, dimension=100,
    ...                 smoothing_radius=0.1, movement_radius=1e-3,
    ...                 num_directions=10_000, failure_probability=1e-7,
    ...                 num_estimates=10_000)

  Args:
    order: 'zero' or 'first'.
    lipschitz: L, the Lipschitz constant of every per-example loss.
    dimension: d, the number of parameters.
    smoothing_radius: alpha.
    movement_radius: D, O2NC's bound on each step's movement.
    num_directions: m, directions per estimate on difference steps.
    anchor_directions: directions per anchor estimate (default m; Algorithm
      5 takes 1).
    failure_probability: g, the probability that any clip binds.
    num_estimates: how many per-example estimates the run makes (anchor
      examples plus two per difference example).

  Returns:
    `SmoothingClips`.
  """
  lipschitz = checks.positive_finite(lipschitz, 'lipschitz')
  alpha = checks.positive_finite(smoothing_radius, 'smoothing_radius')
  movement = checks.positive_finite(movement_radius, 'movement_radius')
  worst = worst_case_clips(order=order, lipschitz=lipschitz,
                           dimension=dimension)
  num_estimates = int(num_estimates)
  if num_estimates < 1:
    raise ValueError(f'num_estimates must be positive, got {num_estimates}')
  anchor_directions = anchor_directions or num_directions
  each = failure_probability / num_estimates
  bound = lipschitz * ((dimension + 1) if order == 'zero' else 2.0)
  anchor_dev = concentration_radius(bound, anchor_directions, each)
  dev = concentration_radius(bound, num_directions, each)
  kappa = ball_smoothing_lipschitz(dimension)
  return SmoothingClips(
      anchor=min(worst.anchor, lipschitz + anchor_dev),
      difference=min(worst.difference,
                     kappa * lipschitz * 2.0 * movement / alpha + 2.0 * dev))
