"""Private statistics: clipped sums of per-example (or per-user) contributions.

Every algorithm in the library privatizes a SUM of contributions, one per
privacy unit (an example, or a user), each clipped to a global l2 norm. This
module computes such sums for any `loss_fn(params, example) -> scalar`:

* `clipped_grad_sum`: per-example gradients (DP-SGD, DP-FTRL, DP-MF);
* `clipped_grad_difference_sum`: per-example differences
  `a * grad f(x, d) - b * grad f(x_prev, d)` evaluated on the SAME example (the
  stochastic recursive gradients of papers 000/001, DIFF2's gradient
  differences, the O2NC variance-reduced oracle);
* `clipped_user_grad_sum`: a batch shaped `[users, items, ...]`; each user's
  contribution is the gradient of its mean loss over its items, clipped per
  user (user-level DP, paper 002).

Each returns a `ClippedStatistic`: call it to get a `ClippedSum`, ask it for
`sensitivity(relation)` to get the l2 sensitivity the clipping guarantees. The
accountant takes the sensitivity from here, never from a hand-copied constant.

Two paths compute each statistic: `'vmap'` forms every per-unit
contribution (any loss); `'ghost'` (`dpsco_jax.ghost`) gets the per-unit
norms from layer inputs and output gradients (at both points for a
difference, over a user's items for a user) and never forms a per-example
gradient, at about the cost of a non-private step per point. The default
`'auto'`
takes the ghost path when every use of a parameter is a dense layer, a
convolution, an embedding lookup, a bias add or an elementwise scale (a
parameter used several times, as tied weights are, included), and otherwise
falls back to
`'vmap'` with one `GhostClippingFallbackWarning` naming the reason. The two
paths agree to float rounding, counters included, and have the same
sensitivity; the guarantees below hold on both.

Guarantees, whatever the data:

* A contribution whose norm is not finite (a NaN or Inf anywhere, or a norm
  too large to represent: beyond about 1e19 clip norms in float32, e.g. a
  gradient entry of 1e30 with clip 1) is replaced by zero and counted in
  `num_nonfinite`. Zero is a valid clipped value, so the sensitivity bound
  holds for every input. (On the ghost path a row is also dropped when a
  layer input's squared norm alone overflows, beyond about 1e19 in float32,
  even if its gradient would be representable.)
* Masked-out rows (`mask=False`, padding) contribute exactly zero, even if
  they hold NaNs.
* Microbatching (`microbatch_size`) evaluates at most that many per-unit
  contributions (on the ghost path: examples) at once, bounding memory;
  results equal the unbatched ones up to float summation order.
* The float rounding of the batch SUM stays inside the sensitivity (vmap
  path): rows are summed in a fixed compensated order without a matrix
  product (`rounding.weighted_row_sum`; microbatches by
  `rounding.compensated_add`), so neither the backend's accumulation order
  nor its matmul precision (TF32 on GPUs) enters, and every contribution is
  clipped to `effective_clip(l2_clip, n)`, slightly below `l2_clip`, so that
  two neighbouring batches' computed sums differ by at most
  `sensitivity(relation)` (Casacuberta et al. 2022; `docs/sharp_edges.md`).
"""

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from dpsco_jax import checks
from dpsco_jax import ghost
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import parallel
from dpsco_jax import rounding

PyTree = Any


class ClippedSum(NamedTuple):
  """The output of a clipped statistic on one batch.

  Only `sum` is meant to be privatized. The counters depend on the data and
  are NOT private: use them for debugging, never log or release them in a
  private run.

  Attributes:
    sum: pytree like the contributions, the sum of the clipped contributions
      of the unmasked units, in float32 (or wider if the inputs are wider).
    count: int32 scalar, number of unmasked units.
    num_nonfinite: int32 scalar, unmasked units whose contribution had a NaN or
      Inf (or an unrepresentably large norm) and was replaced by zero.
    num_clipped: int32 scalar, unmasked units whose contribution norm exceeded
      the clip norm.
  """

  sum: PyTree
  count: jax.Array
  num_nonfinite: jax.Array
  num_clipped: jax.Array


def validate_clip(l2_clip: float, name: str = 'l2_clip') -> float:
  """Returns `l2_clip` as a float, or raises if it is not positive and finite.

  Args:
    l2_clip: the clip norm.
    name: the argument name used in the error message.

  A traced clip norm (a hyperparameter swept with `jax.vmap` over one
  compiled program) is returned unchanged: its value is unknown while
  tracing, so the caller checks the grid on the host (the sweeps do). The
  noise multiplier never depends on it: the noise scales with the clip.

  Returns:
    `float(l2_clip)`, or the tracer itself.

  Raises:
    ValueError: if the clip norm is not a positive finite number.
  """
  if isinstance(l2_clip, jax.core.Tracer):
    return l2_clip
  try:
    value = float(l2_clip)
  except (TypeError, ValueError) as e:
    raise ValueError(f'{name} must be a positive number, got {l2_clip!r}') from e
  if not (value > 0.0 and value < float('inf')):
    raise ValueError(f'{name} must be positive and finite, got {l2_clip!r}')
  return value


def batch_size_of(batch: PyTree, min_ndim: int = 1) -> int:
  """The size of the leading (example) axis shared by every leaf of `batch`.

  Args:
    batch: a pytree of arrays with a leading example axis.
    min_ndim: the fewest dimensions a leaf may have (2 for `[users, items]`).

  Returns:
    The leading axis size.

  Raises:
    ValueError: if the batch is empty, a leaf lacks the leading axis, or the
      leaves disagree on its size.
  """
  leaves = jax.tree_util.tree_leaves(batch)
  if not leaves:
    raise ValueError('batch is empty: it must be a pytree of arrays with a '
                     'leading example axis')
  sizes = set()
  for leaf in leaves:
    shape = jnp.shape(leaf)
    if len(shape) < min_ndim:
      axes = 'a leading example axis' if min_ndim == 1 else (
          f'at least {min_ndim} axes ([users, items, ...])')
      raise ValueError(
          f'every batch leaf needs {axes}; got a leaf of shape {shape}. '
          'Pass a batch of examples, not a single example.')
    sizes.add(shape[0])
  if len(sizes) != 1:
    raise ValueError(f'batch leaves disagree on the leading axis: {sorted(sizes)}')
  (size,) = sizes
  if size == 0:
    raise ValueError('batch has zero examples')
  return size


def _accumulation_dtype(dtype) -> jnp.dtype:
  return jnp.promote_types(dtype, jnp.float32)


def _row_shape(values: jax.Array, ndim: int) -> jax.Array:
  return values.reshape((-1,) + (1,) * (ndim - 1))


def _squared_norms_in_clip_units(contributions: PyTree,
                                 l2_clip: float) -> jax.Array:
  """Per-row UPPER BOUNDS on the squared global l2 norms of `contributions / l2_clip`.

  Measuring in units of the clip norm (the scaling fuses into the same pass)
  keeps the values that decide clipping, norms near the clip, far from
  float overflow and underflow whatever the clip's magnitude. Each leaf is
  summed in sqrt-sized blocks and the result raised by its rounding bound
  (`rounding.upper_bound`: the scaling, the square, the blocks, the
  leaves), so a row is never measured below its norm and the clip factor
  computed from it never lets a contribution past the clip. The margin is
  about `4 sqrt(n) u` relative (n: the largest leaf's size), 2.4e-4 for a
  leaf of a million parameters.
  """
  total, sizes, dtype = 0.0, [], jnp.float32
  for leaf in jax.tree_util.tree_leaves(contributions):
    dtype = rounding.accumulation_dtype(dtype, leaf.dtype)
    leaf = leaf.astype(_accumulation_dtype(leaf.dtype)) * (1.0 / l2_clip)
    rows = leaf.reshape(leaf.shape[0], -1)
    sizes.append(rows.shape[1])
    total = total + rounding.blocked_sum_of_squares(rows)
  # Two roundings before the square: 1 / l2_clip and the product; a traced
  # clip (selected on the device) met a third, its own rounding to float32.
  extra = 2 if isinstance(l2_clip, (int, float)) else 3
  return rounding.upper_bound(
      total, rounding.squared_norm_roundings(sizes, extra=extra), sum(sizes),
      dtype)


def _clip_factors(squared: jax.Array, mask: jax.Array,
                  sum_shrink: float = 1.0,
                  stability: Optional[Any] = None):
  """Clip factors and counters from per-row squared norms in clip units.

  Args:
    squared: per-row upper bounds on the squared norms, in clip units.
    mask: the rows that count.
    sum_shrink: the factor the clip is shrunk by so that the rounding of
      the batch sum stays within the sensitivity (`_sum_layout`).
    stability: None for clipping; for automatic clipping (Bu et al. 2023)
      the stability constant in clip units, `r / C`: every row is scaled
      by `C / (||g|| + r)`.

  Returns:
    `(used, factors, counters)`: the rows that contribute (unmasked, finite
    norm), their factors `min(1, C / ||g||)`, or `C / (||g|| + r)` with
    `stability` (0 elsewhere), and a partial `ClippedSum` holding the
    counters.
  """
  # NaN/Inf anywhere in a row makes its squared norm non-finite, and so does a
  # norm beyond ~1e19 clip norms in float32: such rows are dropped (zero),
  # which never exceeds the sensitivity.
  finite = jnp.isfinite(squared)
  used = mask & finite
  # `squared` is an upper bound (`_squared_norms_in_clip_units`, ghost
  # margins); 1 - 8u more covers the rounding of rsqrt (a few ulp on any
  # backend) and of the scaled row itself.
  shrink = (1.0 - 8.0 * rounding.unit_roundoff(squared.dtype)) * sum_shrink
  if stability is None:
    scale = jnp.minimum(1.0, shrink * jax.lax.rsqrt(squared))
  else:
    # ||g|| / C <= sqrt(squared), so the row's norm after scaling is at
    # most sqrt(squared) / (sqrt(squared) + r / C) < 1 clip norm: the same
    # sensitivity as clipping, whatever r >= 0 (the margin of `shrink`
    # covers the rounding of the sqrt, the sum and the quotient).
    # With r = 0 (normalization) a zero row still divides by a positive
    # number: `squared` carries the underflow floor of
    # `rounding.upper_bound` (4 n tiny), so its factor is finite and the
    # row stays zero.
    scale = shrink / (jnp.sqrt(squared) + stability)
  factors = jnp.where(used, scale, 0.0)
  counters = ClippedSum(
      sum=None,
      count=jnp.sum(mask, dtype=jnp.int32),
      num_nonfinite=jnp.sum(mask & ~finite, dtype=jnp.int32),
      num_clipped=jnp.sum(used & (squared > 1.0), dtype=jnp.int32))
  return used, factors, counters


# Roundings of the clipped sum after this module, before the noise: the
# estimators' one scaling of it (DIFF2's n_min / n_p weights, the nonsmooth
# oracles' 1 / B).
_SCALING_ROUNDINGS = 1


# Batches of up to this many units share one clip (the bound for this many,
# 2.1e-4 below `l2_clip`): a batch of up to 256 split across devices, or
# padded, then clips exactly as the whole one does.
_SMALLEST_BOUNDED_BATCH = 256


class _SumLayout(NamedTuple):
  """How a batch's clipped sum is formed: blocks of rows, and its margin.

  Attributes:
    block_rows: rows per block (the microbatch, or the whole batch).
    num_blocks: blocks accumulated by `rounding.compensated_add`.
    sum_shrink: `rounding.sum_clip_shrink` for this layout: every
      contribution is clipped to `sum_shrink * C`, so that the computed sums
      of two neighbouring batches differ by at most the sensitivity `f C`
      whatever the rounding (vmap path; see `_clip_and_sum_rows`).
  """

  block_rows: int
  num_blocks: int
  sum_shrink: float


def _sum_layout(size: int, microbatch_size: Optional[int],
                num_devices: int = 1) -> _SumLayout:
  """The `_SumLayout` of `size` rows in microbatches of `microbatch_size`.

  Each term of the sum meets one rounding as a product, at most
  `compensated_sum_roundings(block_rows)` inside its block, the compensated
  accumulation of the blocks (`accumulation_roundings`) and the estimators'
  scaling: N in all (gamma_a + gamma_b + gamma_a gamma_b <= gamma_(a+b)),
  7 for every layout up to 4,000 microbatches. On `num_devices` P > 1
  (`size` rows on each), the sums are then added across the devices
  (`psum`, P - 1 roundings in the backend's order): charged by
  `rounding.sum_clip_shrink(..., num_devices=P)` where that bound exceeds
  the one of `_SMALLEST_BOUNDED_BATCH` rows, which every layout pays (so a
  small batch clips the same on one device or several).

  Raises:
    ValueError: for a bad microbatch size.
  """
  if microbatch_size is None or microbatch_size >= size:
    block_rows, num_blocks = size, 1
  else:
    if int(microbatch_size) != microbatch_size or microbatch_size < 1:
      raise ValueError('microbatch_size must be a positive integer, got '
                       f'{microbatch_size!r}')
    block_rows, num_blocks = int(microbatch_size), -(-size // microbatch_size)
  # The microbatched layout's N for every layout (a product, the blocks'
  # compensated sums, their compensated accumulation, the scaling), so that
  # microbatching never changes the clip; padding rows are zeros and do
  # not count in n.
  roundings = (1 + max(2, rounding.compensated_sum_roundings(block_rows)) +
               max(3, rounding.accumulation_roundings(num_blocks)) +
               _SCALING_ROUNDINGS)
  shrink = rounding.sum_clip_shrink(max(size, _SMALLEST_BOUNDED_BATCH),
                                    roundings, jnp.float32)
  if num_devices > 1:
    shrink = min(shrink, rounding.sum_clip_shrink(
        size, roundings, jnp.float32, num_devices=num_devices))
  return _SumLayout(block_rows, num_blocks, shrink)


@keywords.checked
def effective_clip(l2_clip: float, batch_size: int,
                   microbatch_size: Optional[int] = None,
                   num_devices: int = 1) -> float:
  """The norm each contribution is clipped to in a batch of `batch_size` units.

  Slightly below `l2_clip`: `l2_clip / (1 + 2 gamma_N n)` (`_sum_layout`,
  `rounding.sum_clip_shrink`), so that the float rounding of the batch sum
  cannot move two neighbouring batches' sums apart by more than the
  sensitivity `f * l2_clip` the accountant uses. 0.021% below up to 256
  units, 0.085% at 1,024, 1.3% at 16,384. Summed over devices, the
  cross-device sum's roundings are charged too (`rounding.sum_clip_shrink`).

  Example:
    >>> effective_clip(1.0, 1024)
    0.99914...
    >>> effective_clip(1.0, 128, num_devices=8)   # 1,024 over 8 devices
    0.99904...

  Args:
    l2_clip: the clip norm.
    batch_size: n, the units of the batch (padding included).
    microbatch_size: the statistic's microbatch size (it changes the clip
      only past 4,000 microbatches).
    num_devices: the devices the statistic is summed over (`batch_size`
      units on each).

  Returns:
    The clip norm contributions are held to, before the 8u rounding margin
    of the clip factors.
  """
  num_devices = checks.positive_int(num_devices, 'num_devices')
  return l2_clip * _sum_layout(batch_size, microbatch_size,
                               num_devices).sum_shrink


def _clip_and_sum_rows(contributions: PyTree, mask: jax.Array,
                       l2_clip: float, sum_shrink: float = 1.0,
                       stability: Optional[Any] = None) -> ClippedSum:
  """Clips each row of `contributions` (leading axis) and sums the rows.

  The rows are summed by `rounding.weighted_row_sum`: elementwise products
  and a compensated pairwise sum, no matrix product, so the released sum
  does not depend on the backend's matmul precision (TF32 on GPUs) or
  accumulation order, and its rounding is the bound `sum_shrink` pays for.
  """
  squared = _squared_norms_in_clip_units(contributions, l2_clip)
  used, factors, counters = _clip_factors(squared, mask, sum_shrink,
                                          stability)

  def weighted_sum(leaf):
    leaf = leaf.astype(_accumulation_dtype(leaf.dtype))
    # Zero the dropped rows with `where` (a zero factor is not enough:
    # 0 * NaN is NaN).
    kept = jnp.where(_row_shape(used, leaf.ndim), leaf, 0.0)
    return rounding.weighted_row_sum(factors, kept)[0]

  return counters._replace(
      sum=jax.tree_util.tree_map(weighted_sum, contributions))


class GhostForm(NamedTuple):
  """How a statistic's units are sums of per-example gradient terms.

  The ghost path (`dpsco_jax.ghost`) computes a unit's norm and the clipped
  sum from the layer inputs and output gradients of the unit's terms: one
  term per example for `clipped_grad_sum`, two (the same example at both
  points) for `clipped_grad_difference_sum`, one per item for
  `clipped_user_grad_sum`.

  Attributes:
    signature: `(batch, *args) -> (params, examples)`: the params and a
      batch of single examples (leading axis) to analyze `loss_fn` at.
      Raises `ghost.GhostClippingUnsupported` for arguments the form does
      not take.
    terms: `(plan, batch, *args) -> ghost.LayerValues` with leading axes
      `[units, terms]` (`ghost.gradient_terms` and its siblings).
  """

  signature: Callable[..., tuple[PyTree, PyTree]]
  terms: Callable[..., ghost.LayerValues]


def _one_params_argument(args: tuple[Any, ...]) -> PyTree:
  if len(args) != 1:
    raise ghost.GhostClippingUnsupported(
        f'the statistic takes (batch, params), got {len(args)} arguments '
        'after the batch')
  return args[0]


GRADIENT_FORM = GhostForm(
    signature=lambda batch, *args: (_one_params_argument(args), batch),
    terms=lambda plan, batch, *args: ghost.gradient_terms(
        plan, _one_params_argument(args), batch))


def _difference_arguments(args: tuple[Any, ...]):
  """`(params, prev_params, a, b)` from a difference statistic's arguments."""
  if not 2 <= len(args) <= 4:
    raise ghost.GhostClippingUnsupported(
        'the statistic takes (batch, params, prev_params, a=1.0, b=1.0), got '
        f'{len(args)} arguments after the batch')
  params, prev_params, a, b = (*args, 1.0, 1.0)[:4]
  types = [jax.tree_util.tree_map(lambda x: (jnp.shape(x), jax.typeof(x).dtype),
                                  tree) for tree in (params, prev_params)]
  if (jax.tree_util.tree_structure(params) !=
      jax.tree_util.tree_structure(prev_params) or types[0] != types[1]):
    raise ghost.GhostClippingUnsupported(
        'params and prev_params differ in structure, shapes or dtypes')
  return params, prev_params, a, b


def _difference_terms(plan, batch, *args):
  params, prev_params, a, b = _difference_arguments(args)
  return ghost.difference_terms(plan, params, prev_params, batch, a, b)


DIFFERENCE_FORM = GhostForm(
    signature=lambda batch, *args: (_difference_arguments(args)[0], batch),
    terms=_difference_terms)


def _user_items(unit: PyTree) -> tuple[PyTree, Optional[jax.Array]]:
  """`(items, item_mask)` of a `UserBatch` or a bare pytree of items."""
  if isinstance(unit, UserBatch):
    return unit.items, unit.item_mask
  return unit, None


def _user_signature(batch, *args):
  items, _ = _user_items(batch)
  # One user's items: a batch of single items.
  return _one_params_argument(args), jax.tree_util.tree_map(
      lambda x: x[0], items)


USER_FORM = GhostForm(
    signature=_user_signature,
    terms=lambda plan, batch, *args: ghost.mean_terms(
        plan, _one_params_argument(args), *_user_items(batch)))


def _ghost_clip_and_sum_rows(plan: ghost.GhostPlan, form: GhostForm,
                             rows: PyTree, args: tuple[Any, ...],
                             mask: jax.Array, l2_clip: float,
                             sum_shrink: float = 1.0,
                             stability: Optional[Any] = None) -> ClippedSum:
  """`_clip_and_sum_rows` of the units' gradients, from ghost norms.

  No per-unit gradient is formed: norms come from layer inputs and output
  gradients (`dpsco_jax.ghost`), and the clipped sum from the same values
  re-weighted by the clip factors.
  """
  params, _ = form.signature(rows, *args)
  values = form.terms(plan, rows, *args)
  squared, formed = ghost.squared_norms_and_formed(
      plan, params, values, 1.0 / l2_clip, mask.shape[0])
  used, factors, counters = _clip_factors(squared, mask, sum_shrink,
                                          stability)
  # Where a rule formed the per-unit gradients, the sum releases those very
  # arrays (measured in clip units: `formed_scale` restores the units).
  return counters._replace(
      sum=ghost.weighted_grad_sum(plan, params, values, factors, used,
                                  formed=formed, formed_scale=l2_clip))


def _validated_mask(mask: Optional[jax.Array], size: int) -> jax.Array:
  if mask is None:
    return jnp.ones((size,), dtype=bool)
  mask = jnp.asarray(mask)
  if mask.shape != (size,):
    raise ValueError(
        f'mask must have shape ({size},) to match the batch, got {mask.shape}')
  return mask.astype(bool)


def _sum_in_blocks(
    block: Callable[[PyTree, jax.Array, float], ClippedSum],
    batch: PyTree,
    mask: jax.Array,
    microbatch_size: Optional[int],
    num_devices: int = 1,
) -> ClippedSum:
  """`block(batch, mask, sum_shrink)`, or its sum over blocks of rows.

  Blocks of `microbatch_size` rows are accumulated with
  `rounding.compensated_add` (a running sum would cost a term up to one
  rounding per block: adversarial rows then move one neighbour's sum by
  more than the clip, `tests/test_precision.py`). `sum_shrink` is the
  layout's (`_sum_layout`).
  """
  size = mask.shape[0]
  layout = _sum_layout(size, microbatch_size, num_devices)
  if layout.num_blocks == 1:
    return block(batch, mask, layout.sum_shrink)
  num_blocks, block_rows = layout.num_blocks, layout.block_rows
  padding = num_blocks * block_rows - size

  def to_blocks(x):
    x = jnp.pad(x, [(0, padding)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((num_blocks, block_rows) + x.shape[1:])

  blocked_batch = jax.tree_util.tree_map(to_blocks, batch)
  blocked_mask = to_blocks(mask)
  first = jax.eval_shape(
      lambda rows, rows_mask: block(rows, rows_mask, layout.sum_shrink),
      jax.tree_util.tree_map(lambda x: x[0], blocked_batch), blocked_mask[0])
  zero = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), first)

  def accumulate(carry, xs):
    total, compensation = carry
    rows, rows_mask = xs
    partial = block(rows, rows_mask, layout.sum_shrink)
    sums = jax.tree_util.tree_map(rounding.compensated_add, total.sum,
                                  compensation, partial.sum)
    outer = jax.tree_util.tree_structure(total.sum)
    inner = jax.tree_util.tree_structure((0, 0))
    new_sum, new_compensation = jax.tree_util.tree_transpose(outer, inner,
                                                             sums)
    counters = jax.tree_util.tree_map(
        jnp.add, total._replace(sum=None), partial._replace(sum=None))
    return (counters._replace(sum=new_sum), new_compensation), None

  (total, compensation), _ = jax.lax.scan(
      accumulate, (zero, zero.sum), (blocked_batch, blocked_mask))
  return total._replace(sum=jax.tree_util.tree_map(jnp.add, total.sum,
                                                   compensation))


def validate_stability(automatic_clipping: Optional[float]
                       ) -> Optional[float]:
  """The stability constant r of automatic clipping, checked (None: clip).

  Example:
    >>> validate_stability(0.01)
    0.01

  Args:
    automatic_clipping: None, or r >= 0 (finite).

  Returns:
    `float(r)`, or None.

  Raises:
    ValueError: for a negative, NaN or infinite r.
  """
  if automatic_clipping is None:
    return None
  try:
    value = float(automatic_clipping)
  except (TypeError, ValueError) as e:
    raise ValueError('automatic_clipping must be None or the stability '
                     f'constant r >= 0, got {automatic_clipping!r}') from e
  if not 0.0 <= value < float('inf'):
    raise ValueError('automatic_clipping must be None or a finite stability '
                     f'constant r >= 0, got {automatic_clipping!r}')
  return value


def _stability_in_clip_units(automatic_clipping: Optional[float],
                             l2_clip: Any) -> Optional[Any]:
  """r / C, the stability constant in the units norms are measured in."""
  r = validate_stability(automatic_clipping)
  return None if r is None else r / l2_clip


@keywords.checked
def clipped_sum(
    contribution_fn: Callable[..., PyTree],
    batch: PyTree,
    *args: Any,
    l2_clip: float,
    mask: Optional[jax.Array] = None,
    microbatch_size: Optional[int] = None,
    min_ndim: int = 1,
    automatic_clipping: Optional[float] = None,
    num_devices: int = 1,
) -> ClippedSum:
  """Sums `contribution_fn(unit, *args)` over the units of `batch`, clipped.

  This is the shared core of every statistic in this module.

  Args:
    contribution_fn: maps ONE unit (a slice of `batch` without its leading
      axis) and `args` to a pytree, the unit's contribution.
    batch: pytree with a leading unit axis.
    *args: passed unchanged to `contribution_fn` (e.g. params).
    l2_clip: the global l2 norm each contribution is clipped to.
    mask: optional bool vector over units; False rows (padding) contribute
      nothing and are not counted.
    microbatch_size: if set, at most this many contributions are evaluated at
      once (the batch is padded with masked rows to a multiple of it).
    min_ndim: fewest dimensions each batch leaf must have.
    automatic_clipping: None (clip each contribution to `l2_clip`), or the
      stability constant r >= 0 of automatic clipping (Bu et al. 2023):
      each contribution g is scaled to `l2_clip * g / (||g|| + r)`
      (`ClippedStatistic.automatic_clipping`).
    num_devices: the devices whose sums the caller adds up (`psum`): their
      roundings are charged to the clip (`effective_clip`).

  Returns:
    A `ClippedSum`.

  Raises:
    ValueError: for a bad clip norm, batch, mask, microbatch size or
      stability constant.
  """
  l2_clip = validate_clip(l2_clip)
  stability = _stability_in_clip_units(automatic_clipping, l2_clip)
  size = batch_size_of(batch, min_ndim)
  mask = _validated_mask(mask, size)

  def block(rows, rows_mask, sum_shrink):
    contributions = jax.vmap(lambda unit: contribution_fn(unit, *args))(rows)
    return _clip_and_sum_rows(contributions, rows_mask, l2_clip, sum_shrink,
                              stability)

  return _sum_in_blocks(block, batch, mask, microbatch_size, num_devices)


METHODS = ('auto', 'vmap', 'ghost')

# The open `recording_statistics` blocks, innermost last.
_RECORDERS: list[list] = []


@contextlib.contextmanager
def recording_statistics():
  """Collects the `ClippedStatistic`s built inside the block.

  A plan builds its transformation inside one, so that `Plan.describe()`
  can report the clipping path its step took (`ClippedStatistic.
  clipping_path`), known once the step has run or been traced.

  Example:
    >>> with recording_statistics() as built:
    ...   tx = dpsco_jax.dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
    ...                        num_steps=10)
    >>> [stat.clipping_method for stat in built]
    ['auto']

  Yields:
    The list the statistics are appended to, in the order they were built.
  """
  built = []
  _RECORDERS.append(built)
  try:
    yield built
  finally:
    _RECORDERS.remove(built)
# The keyword `clipping_method=` was `method=` until 0.2 (`keywords.checked`);
# `method=` is the accounting method everywhere else.
_RENAMED = {'method': 'clipping_method'}


class GhostClippingFallbackWarning(UserWarning):
  """Ghost clipping does not apply to a loss; per-example gradients are used.

  The result is the same, only slower and with more memory. Filter this
  category to silence it.
  """


@dataclasses.dataclass(frozen=True)
class ClippedStatistic:
  """A clipped-sum statistic together with the sensitivity it guarantees.

  Call it as `statistic(batch, *args, mask=None, axis_name=None)`; `args`
  are forwarded to the contribution function (params, previous params,
  coefficients, ...). Give `axis_name` when the result is summed over that
  device axis (`parallel.psum`): the roundings of that sum are charged to
  the clip (`effective_clip`).

  Two ways compute the same statistic: `'vmap'` evaluates
  `contribution_fn` on every unit (any contribution); `'ghost'` applies when
  the contribution is `grad(loss_fn)(params, example)` and computes the
  clipped sum from ghost norms (`dpsco_jax.ghost`) without per-example
  gradients. `'auto'` takes the ghost path when the loss qualifies and falls
  back to `'vmap'` otherwise, with one `GhostClippingFallbackWarning` naming
  the reason. Both paths give the same `ClippedSum` up to float rounding
  (the counters included) and the same sensitivity.

  Attributes:
    contribution_fn: `(unit, *args) -> pytree`, one unit's contribution.
    l2_clip: the clip norm on each unit's contribution.
    microbatch_size: optional cap on contributions evaluated at once (on the
      ghost path: on examples per pass).
    unit: 'example' or 'user', the privacy unit (for messages and docs).
    min_ndim: fewest axes a batch leaf must have.
    loss_fn: `loss_fn(params, example) -> scalar` when the contribution is
      its gradient (`args == (params,)`); required unless
      `clipping_method='vmap'`.
    clipping_method: 'vmap', 'ghost' or 'auto' (`method` until 0.3.0,
      deprecated).
    ghost_form: how a unit's gradient is made of per-example gradient terms
      (`GRADIENT_FORM`, `DIFFERENCE_FORM` or `USER_FORM`).
    memory_budget: for `clipping_method='auto'`, the bytes per-example gradients may
      take (parameter bytes x units held at once: the batch, or
      `microbatch_size`); above it the ghost path is taken whatever the
      cost estimates say. Default `ghost.DEFAULT_MEMORY_BUDGET` (1 GiB);
      None: the estimates alone decide.
    automatic_clipping: None (default: each contribution g is clipped,
      `g min(1, C / ||g||)`), or the stability constant r >= 0 of automatic
      clipping (Bu et al., NeurIPS 2023, AUTO-S; r = 0 is their AUTO-V):
      each contribution is scaled to `C g / (||g|| + r)`, C = `l2_clip`.
      Its norm is below C whatever g, so the sensitivity is the clipping's,
      `C * factor(relation)`; with C the learning rate's scale (Bu et al.
      Thm 1: `C` only rescales the step), no clip norm needs tuning. Every
      path takes it (vmap, ghost, microbatches, devices).

  Calling it with `l2_clip=` (a traced scalar allowed) clips to that norm
  instead of `l2_clip` for this call: the adaptive clip of
  `dpsco_jax.adaptive_clipping`, held in the estimator's state. The noise
  must then be scaled by `sensitivity(relation, l2_clip=...)`.
  """

  contribution_fn: Callable[..., PyTree]
  l2_clip: float
  microbatch_size: Optional[int] = None
  unit: str = 'example'
  min_ndim: int = 1
  loss_fn: Optional[Callable[[PyTree, PyTree], jax.Array]] = None
  clipping_method: str = 'vmap'
  ghost_form: GhostForm = GRADIENT_FORM
  memory_budget: Optional[int] = ghost.DEFAULT_MEMORY_BUDGET
  automatic_clipping: Optional[float] = None
  # Fallback reasons already announced by this statistic (once each).
  _announced: set = dataclasses.field(
      default_factory=set, init=False, repr=False, compare=False, hash=False)
  # The paths its calls (or traces) took: 'ghost', 'vmap'.
  _paths: set = dataclasses.field(
      default_factory=set, init=False, repr=False, compare=False, hash=False)

  @property
  def method(self) -> str:
    """Deprecated name of `clipping_method` (removed in dpsco_jax 0.3.0)."""
    warnings.warn(
        f'ClippedStatistic.method is now ClippedStatistic.clipping_method; '
        f'method is deprecated and stops working in dpsco_jax '
        f'{keywords.REMOVED_IN}', DeprecationWarning, stacklevel=2)
    return self.clipping_method

  @property
  def clipping_path(self) -> Optional[str]:
    """The path this statistic's calls took, or None before the first.

    Recorded when a call runs or is traced (under `jax.jit`, at the first
    step): 'ghost' (ghost norms) or 'vmap' (per-example gradients), or
    'ghost and vmap' when batches of different shapes took different paths
    (`'auto'` decides per shape: the cost model, a padded last batch). It is
    what ran, where `ghost_plan(...) is not None` only says that the ghost
    path applies (`'auto'` may still choose per-example gradients).

    Example:
      >>> stat = clipped_grad_sum(loss_fn, 1.0)
      >>> out = stat(batch, params)
      >>> stat.clipping_path
      'ghost'
    """
    return ' and '.join(sorted(self.paths_taken)) or None

  @property
  def paths_taken(self) -> frozenset:
    """The paths taken so far ('ghost', 'vmap'), as a set (see
    `clipping_path`).

    Example:
      >>> clipped_grad_sum(loss_fn, 1.0).paths_taken
      frozenset()
    """
    return frozenset(self._paths)

  def __post_init__(self):
    object.__setattr__(self, 'l2_clip', validate_clip(self.l2_clip))
    if self.microbatch_size is not None:
      object.__setattr__(self, 'microbatch_size', checks.positive_int(
          self.microbatch_size, 'microbatch_size'))
    object.__setattr__(self, 'memory_budget',
                       ghost.validate_memory_budget(self.memory_budget))
    object.__setattr__(self, 'automatic_clipping',
                       validate_stability(self.automatic_clipping))
    for built in _RECORDERS:
      built.append(self)
    if self.clipping_method not in METHODS:
      raise ValueError(
          f'clipping_method must be one of {METHODS}, got '
          f'{self.clipping_method!r}')
    if self.clipping_method != 'vmap' and self.loss_fn is None:
      raise ValueError(
          f'clipping_method={self.clipping_method!r} needs loss_fn (the '
          'contribution must be the gradient of a per-example loss)')

  def ghost_plan(self, batch: PyTree, *args: Any) -> Optional[ghost.GhostPlan]:
    """The ghost-norm plan for this call signature, or None for `vmap`.

    Example:
      >>> stat = clipped_grad_sum(loss_fn, 1.0)
      >>> stat.ghost_plan(batch, params) is not None   # ghost path taken

    Args:
      batch: the batch (leading example axis).
      *args: the call's arguments (`(params,)`).

    Returns:
      The plan when the ghost path applies, else None (for
      `clipping_method='auto'` after announcing the reason once; always None for `'vmap'`).

    Raises:
      ghost.GhostClippingUnsupported: for `clipping_method='ghost'` when the
        loss does not qualify, with the reason (chained to the original error). No
        other exception type leaves this method: under `'auto'` any failure
        of the analysis, or of tracing the ghost passes from its plan,
        falls back to `'vmap'`.
    """
    return self._ghost_plan(batch, args, trace=True)

  def _ghost_plan(self, batch: PyTree, args: tuple[Any, ...], *,
                  trace: bool) -> Optional[ghost.GhostPlan]:
    """`ghost_plan`; `trace=False` skips tracing the ghost passes first.

    The statistic's own call traces the ghost passes for real right after
    (`_ghost_sum`, which falls back the same way when they fail): tracing
    them once more on one unit beforehand would double the ghost path's
    trace time.
    """
    if self.clipping_method == 'vmap':
      return None
    try:
      params, examples = self.ghost_form.signature(batch, *args)
      plan = ghost.analyze(self.loss_fn, params, examples)
      if trace:
        self._trace_ghost_passes(plan, batch, args)
      return plan
    except Exception as e:  # pylint: disable=broad-exception-caught
      self._fall_back(e)
      return None

  def _fall_back(self, error: Exception) -> None:
    """Announces the fallback to `vmap` (once per reason), or raises.

    Whatever failed, the vmap path computes the same sum: a failure of the
    analysis, or of the ghost passes, must cost speed, never the step.

    Raises:
      ghost.GhostClippingUnsupported: for `clipping_method='ghost'`.
    """
    reason = (str(error) if isinstance(error, ghost.GhostClippingUnsupported)
              else f'the analysis failed ({ghost.describe_error(error)})')
    if self.clipping_method == 'ghost':
      raise ghost.GhostClippingUnsupported(
          f"clipping_method='ghost' cannot apply: {reason}") from error
    if reason not in self._announced:
      self._announced.add(reason)
      warnings.warn(
          f'ghost clipping does not apply ({reason}); the clipped sum uses '
          'per-example gradients (vmap) instead: same result, slower',
          GhostClippingFallbackWarning, stacklevel=4)

  def _trace_ghost_passes(self, plan: ghost.GhostPlan, batch: PyTree,
                          args: tuple[Any, ...]) -> None:
    """Traces the ghost passes on one unit without running them.

    A loss the analysis accepts but the ghost passes cannot evaluate (an
    operation the interpreter does not handle) then falls back like any
    other unsupported loss instead of failing inside the step.

    Raises:
      ghost.GhostClippingUnsupported: naming the error.
    """
    try:
      jax.eval_shape(lambda: _ghost_clip_and_sum_rows(
          plan, self.ghost_form,
          jax.tree_util.tree_map(lambda x: x[:1], batch), args,
          jnp.ones((1,), bool), self.l2_clip))
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise ghost.GhostClippingUnsupported(
          f'the ghost passes failed to trace ({ghost.describe_error(e)})'
      ) from e

  def check_loss(self, batch: PyTree, *args: Any) -> None:
    """Raises a clear error unless `loss_fn` maps ONE example to a scalar.

    Traced once (`jax.eval_shape`, no computation) on the batch's first
    example: a loss written for a batch fails deep inside the per-example
    machinery otherwise, or returns a vector.

    Example:
      >>> clipped_grad_sum(loss_fn, 1.0).check_loss(batch, params)

    Args:
      batch: the batch (leading example axis).
      *args: the call's arguments.

    Raises:
      ValueError: if `loss_fn(params, example)` fails on one example or
        does not return a scalar; the library's explanation comes first.
    """
    if self.loss_fn is None:
      return
    batch_size_of(batch, self.min_ndim)  # Its shape errors come first.
    try:
      params, examples = self.ghost_form.signature(batch, *args)
    except Exception:  # pylint: disable=broad-exception-caught
      return  # Unusual arguments: the path that runs reports them.
    example = jax.tree_util.tree_map(lambda x: x[0], examples)
    shapes = jax.tree_util.tree_map(jnp.shape, example)
    contract = (
        'loss_fn(params, example) computes the loss of ONE example, without '
        'a batch axis: the private transformations clip each example\'s '
        'gradient and vmap the loss over the batch themselves. ')
    try:
      out = jax.eval_shape(self.loss_fn, params, example)
    except Exception as error:  # pylint: disable=broad-exception-caught
      raise ValueError(
          f'{contract}Called on one example (shapes {shapes}) it failed with '
          f'{type(error).__name__}: {str(error).rstrip(".")}. A loss written '
          'for a batch fails this way: write it for one example (for a model '
          'that expects a batch axis, `model(x[None])[0]`).') from error
    if jnp.shape(out) != ():
      raise ValueError(
          f'{contract}Called on one example (shapes {shapes}) it returned '
          f'shape {jnp.shape(out)}, not a scalar: return the example\'s loss '
          '(e.g. sum or index the per-class values), not a vector or a batch '
          'of losses.')

  def __call__(self, batch: PyTree, *args: Any,
               mask: Optional[jax.Array] = None,
               l2_clip: Optional[Any] = None,
               axis_name: Optional[str] = None) -> ClippedSum:
    # Summed over `axis_name` by the caller: the cross-device sum's
    # roundings are charged to the clip (`effective_clip`).
    devices = parallel.axis_size(axis_name)
    self.check_loss(batch, *args)
    clip = self.l2_clip if l2_clip is None else validate_clip(l2_clip)
    if self.clipping_method == 'vmap':
      self._paths.add('vmap')
      return clipped_sum(
          self.contribution_fn, batch, *args, l2_clip=clip, mask=mask,
          microbatch_size=self.microbatch_size, min_ndim=self.min_ndim,
          automatic_clipping=self.automatic_clipping, num_devices=devices)
    size = batch_size_of(batch, self.min_ndim)
    mask = _validated_mask(mask, size)
    plan = self._ghost_plan(batch, args, trace=False)
    summed = None if plan is None else self._ghost_sum(
        plan, batch, args, mask, clip, devices)
    if summed is None:
      self._paths.add('vmap')
      return clipped_sum(
          self.contribution_fn, batch, *args, l2_clip=clip, mask=mask,
          microbatch_size=self.microbatch_size, min_ndim=self.min_ndim,
          automatic_clipping=self.automatic_clipping, num_devices=devices)
    self._paths.add('ghost')
    return summed

  def _ghost_sum(self, plan: ghost.GhostPlan, batch: PyTree,
                 args: tuple[Any, ...], mask: jax.Array, clip: Any,
                 devices: int) -> Optional[ClippedSum]:
    """The ghost path's clipped sum, or None where `vmap` takes over.

    None when the cost model chooses `vmap` under 'auto' (no warning, not a
    failure) and when the ghost passes fail to trace (announced, or raised
    under 'ghost', as by `ghost_plan`). A failed trace leaves only unused
    operations behind, which compilation removes.
    """
    try:
      if (self.clipping_method == 'auto' and
          self._choice(plan, batch, args).path == 'vmap'):
        return None
      stability = _stability_in_clip_units(self.automatic_clipping, clip)
      # The same clip as the vmap path (the paths agree); but the ghost sum
      # of a Gram-form layer is a matrix product (at full float32 precision)
      # whose accumulation order is the backend's, which `sum_shrink` does
      # not bound (docs/sharp_edges.md).
      return _sum_in_blocks(
          lambda rows, rows_mask, sum_shrink: _ghost_clip_and_sum_rows(
              plan, self.ghost_form, rows, args, rows_mask, clip,
              sum_shrink, stability),
          batch, mask, self.microbatch_size, devices)
    except Exception as e:  # pylint: disable=broad-exception-caught
      unsupported = ghost.GhostClippingUnsupported(
          f'the ghost passes failed to trace ({ghost.describe_error(e)})')
      unsupported.__cause__ = e
      self._fall_back(unsupported)
      return None

  def _choice(self, plan: ghost.GhostPlan, batch: PyTree,
              args: tuple[Any, ...]) -> ghost.ClippingChoice:
    """`ghost.clipping_choice` for this call's units and terms per tap."""
    size = batch_size_of(batch, self.min_ndim)
    # The terms per unit of each tap, from the shapes of one unit's values.
    values = jax.eval_shape(lambda: self.ghost_form.terms(
        plan, jax.tree_util.tree_map(lambda x: x[:1], batch), *args))
    return ghost.clipping_choice(
        plan, size, tuple(g.shape[1] for g in values.grads),
        rows=self.microbatch_size, memory_budget=self.memory_budget)

  def clipping_choice(self, batch: PyTree,
                      *args: Any) -> Optional[ghost.ClippingChoice]:
    """What `clipping_method='auto'` does on this call signature, and why.

    Example:
      >>> stat = clipped_grad_sum(loss_fn, 1.0)
      >>> choice = stat.clipping_choice(batch, params)
      >>> choice.path, [(tap.rule, tap.form) for tap in choice.taps]
      ('ghost', [('dot_general', 'gram'), ('add', 'materialized')])

    Args:
      batch: the batch (leading unit axis).
      *args: the call's arguments (`(params,)`, ...).

    Returns:
      The `ghost.ClippingChoice` (per tap the form and the cost estimates,
      and the whole-loss path, 'ghost' or 'vmap'), or None when the ghost
      path does not apply to the loss (for `'auto'`, announced as by
      `ghost_plan`) or `clipping_method='vmap'`. With
      `clipping_method='ghost'` the path taken is the ghost path whatever the choice says.

    Raises:
      ghost.GhostClippingUnsupported: for `clipping_method='ghost'` when the loss
        does not qualify.
    """
    plan = self.ghost_plan(batch, *args)
    return None if plan is None else self._choice(plan, batch, args)

  def sensitivity(
      self,
      relation: neighboring.NeighboringRelation = (
          neighboring.NeighboringRelation.ADD_OR_REMOVE),
      l2_clip: Optional[Any] = None,
  ) -> Any:
    """The l2 sensitivity of the clipped sum when one unit changes.

    It is the same on every path: each unit's contribution is clipped to
    `l2_clip` (or dropped) whichever way its norm was computed; automatic
    clipping scales each below it.

    Example:
      >>> clipped_grad_sum(loss_fn, 2.0).sensitivity()
      2.0

    Args:
      relation: the neighbouring relation (replace-one doubles it).
      l2_clip: the clip of a call made with `l2_clip=` (default: the
        statistic's).

    Returns:
      `l2_clip * factor(relation)` (traced when `l2_clip` is).
    """
    clip = self.l2_clip if l2_clip is None else l2_clip
    return clip * neighboring.sensitivity_factor(relation)


# `ClippedStatistic(method=...)` keeps working until 0.3.0, warned.
ClippedStatistic.__init__ = keywords.checked(ClippedStatistic.__init__,
                                             renamed=_RENAMED)


@keywords.checked(renamed=_RENAMED)
def clipped_grad_sum(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    l2_clip: float,
    *,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    memory_budget: Optional[int] = ghost.DEFAULT_MEMORY_BUDGET,
    automatic_clipping: Optional[float] = None,
) -> ClippedStatistic:
  """Sum of per-example gradients, each clipped to global l2 norm `l2_clip`.

  By default (`clipping_method='auto'`) the sum is computed with ghost norms
  when every use of a parameter of `loss_fn` is a dense layer (`dot_general`,
  with or without positions), a convolution, a bias add, an elementwise
  scale or an embedding lookup (tied weights included): about the cost of
  one non-private step instead of one gradient per example
  (`dpsco_jax.ghost`). Other losses (scans, custom derivatives, ...) use
  per-example gradients
  (`jax.vmap`), announced
  once by a `GhostClippingFallbackWarning`. Both give the same sum up to
  float rounding; DP-SGD, DP-FTRL and DP-MF use this default.

  Example:
    >>> stat = clipped_grad_sum(loss_fn, l2_clip=1.0)
    >>> out = stat(batch, params)            # out.sum: clipped gradient SUM
    >>> stat.sensitivity()                   # 1.0 under add/remove

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm per example.
    microbatch_size: optional cap on examples processed at once.
    clipping_method: 'auto' (default), 'ghost' (raise if the loss does not
      qualify) or 'vmap' (always per-example gradients). Its old spelling
      `method=` is accepted with a `DeprecationWarning` until dpsco_jax
      0.3.0.
    memory_budget: bytes the per-example gradients of the vmap path may
      take before `'auto'` takes the ghost path whatever its estimates
      (`ClippedStatistic.memory_budget`; default 1 GiB, None: no budget).
    automatic_clipping: None (default: clip), or the stability constant r
      of automatic clipping: each contribution scaled to
      `l2_clip * g / (||g|| + r)` (`ClippedStatistic.automatic_clipping`).

  Returns:
    A `ClippedStatistic` called as `stat(batch, params, mask=None)`.

  Raises:
    ValueError: for a bad clip norm or clipping method.
    ghost.GhostClippingUnsupported: when called, for
      `clipping_method='ghost'` and a loss that does not qualify (the
      message says why).
  """
  grad_fn = jax.grad(loss_fn)
  return ClippedStatistic(
      contribution_fn=lambda example, params: grad_fn(params, example),
      l2_clip=l2_clip, microbatch_size=microbatch_size, loss_fn=loss_fn,
      clipping_method=clipping_method,
      memory_budget=memory_budget, automatic_clipping=automatic_clipping)


@keywords.checked(renamed=_RENAMED)
def clipped_grad_difference_sum(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    l2_clip: float,
    *,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    memory_budget: Optional[int] = ghost.DEFAULT_MEMORY_BUDGET,
    automatic_clipping: Optional[float] = None,
) -> ClippedStatistic:
  """Sum of per-example gradient differences, each difference clipped.

  For each example d the contribution is
  `a * grad f(params, d) - b * grad f(prev_params, d)`, both gradients taken
  on the SAME example, and the DIFFERENCE is clipped (clipping each gradient
  separately would give a sensitivity growing with `a + b`; papers 000/001
  Alg. 1, 001 Alg. 3, paper 003 Alg. 1, paper 004 Alg. 3/5).

  By default (`clipping_method='auto'`) the sum is computed with ghost norms
  when the loss qualifies (as for `clipped_grad_sum`): the first pass runs at
  both points, each dense layer's difference norm comes from the cross-term
  identity `||a u1 v1^T - b u2 v2^T||^2 = a^2 |u1|^2 |v1|^2 + b^2 |u2|^2
  |v2|^2 - 2ab (u1.u2)(v1.v2)` (Gram forms with positions), evaluated in a
  sum/difference basis that stays accurate when the points are close, and
  the clipped sum from the stored values at both points with cotangents
  `w_i a g_i` and `-w_i b g'_i`: about two non-private steps, no
  per-example gradient. Other losses fall back to `'vmap'`, announced once.

  Example:
    >>> stat = clipped_grad_difference_sum(loss_fn, l2_clip=1.0)
    >>> out = stat(batch, params, prev_params, 2.0, 1.0)   # a=2, b=1

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm per example difference.
    microbatch_size: optional cap on per-example differences held at once.
    clipping_method: 'auto' (default), 'ghost' (raise if the loss does not
      qualify) or 'vmap' (always per-example gradients; `method=` until
      0.3.0, deprecated).
    memory_budget: bytes the per-example gradients of the vmap path may
      take before `'auto'` takes the ghost path whatever its estimates
      (`ClippedStatistic.memory_budget`; default 1 GiB, None: no budget).
    automatic_clipping: None (default: clip), or the stability constant r
      of automatic clipping: each contribution scaled to
      `l2_clip * g / (||g|| + r)` (`ClippedStatistic.automatic_clipping`).

  Returns:
    A `ClippedStatistic` called as
    `stat(batch, params, prev_params, a=1.0, b=1.0, mask=None)`; `a` and `b`
    may be traced scalars.

  Raises:
    ValueError: for a bad clip norm or clipping method.
    ghost.GhostClippingUnsupported: when called, for
      `clipping_method='ghost'` and a loss that does not qualify (the
      message says why).
  """
  grad_fn = jax.grad(loss_fn)

  def difference(example, params, prev_params, a=1.0, b=1.0):
    current = grad_fn(params, example)
    previous = grad_fn(prev_params, example)
    return jax.tree_util.tree_map(lambda g, h: a * g - b * h, current, previous)

  return ClippedStatistic(
      contribution_fn=difference, l2_clip=l2_clip,
      microbatch_size=microbatch_size, loss_fn=loss_fn,
      clipping_method=clipping_method, ghost_form=DIFFERENCE_FORM,
      memory_budget=memory_budget, automatic_clipping=automatic_clipping)


class UserBatch(NamedTuple):
  """A user-level batch: items grouped by user, with an optional item mask.

  Attributes:
    items: pytree whose leaves are shaped `[users, items, ...]`.
    item_mask: optional bool `[users, items]`; False drops an item from its
      user's mean (a user with no items left contributes zero).
  """

  items: PyTree
  item_mask: Optional[jax.Array] = None


def user_mean_gradient(
    loss_fn: Callable[[PyTree, PyTree], jax.Array]
) -> Callable[[PyTree, PyTree], PyTree]:
  """`user_gradient(unit, params)`: the gradient of ONE user's mean loss.

  `unit` is one user's items (`[items, ...]` leaves), or a `UserBatch`
  of one user with its item mask; masked items are left out of the mean
  (a user with no items left has gradient 0).

  Example:
    >>> grads = jax.vmap(user_mean_gradient(loss_fn), in_axes=(0, None))(
    ...     UserBatch(items, item_mask), params)      # one row per user

  Args:
    loss_fn: `loss_fn(params, item) -> scalar` for ONE item.

  Returns:
    The function `(unit, params) -> gradient pytree like params`.
  """
  grad_fn = jax.grad(loss_fn)

  def user_gradient(unit, params):
    items, item_mask = _user_items(unit)
    per_item = jax.vmap(grad_fn, in_axes=(None, 0))(params, items)
    if item_mask is None:
      return jax.tree_util.tree_map(lambda g: jnp.mean(g, axis=0), per_item)
    # Select per-item gradients rather than masking the loss: the gradient of
    # a masked-out NaN loss is NaN even behind `where` (0 * NaN), and it would
    # spoil the whole user's contribution.
    count = jnp.maximum(jnp.sum(item_mask), 1)
    return jax.tree_util.tree_map(
        lambda g: jnp.sum(jnp.where(_row_shape(item_mask, g.ndim), g, 0.0),
                          axis=0) / count.astype(g.dtype), per_item)

  return user_gradient


@keywords.checked(renamed=_RENAMED)
def clipped_user_grad_sum(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    l2_clip: float,
    *,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    memory_budget: Optional[int] = ghost.DEFAULT_MEMORY_BUDGET,
    automatic_clipping: Optional[float] = None,
) -> ClippedStatistic:
  """Sum over users of the clipped gradient of each user's mean loss.

  User u contributes `grad (1/m_u) sum_j f(params, item_{u,j})` (the mean of
  its per-item gradients), clipped to `l2_clip`. Changing ALL of one user's
  items moves the sum by at most the sensitivity (user-level DP, paper 002).

  By default (`clipping_method='auto'`) the sum is computed with ghost norms
  when the loss qualifies (as for `clipped_grad_sum`): one first pass over every
  item, then per dense layer the Gram form over a user's items (and
  positions together), `(1/m^2) sum_{j,k} (a_j . a_k)(g_j . g_k)` over the
  m unmasked items, and the clipped sum from the same values: no per-item
  or per-user gradient. Other losses fall back to `'vmap'`, announced once.

  Example:
    >>> stat = clipped_user_grad_sum(loss_fn, l2_clip=1.0)
    >>> out = stat(UserBatch(items, item_mask), params)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE item.
    l2_clip: clip norm per user.
    microbatch_size: optional cap on users processed at once.
    clipping_method: 'auto' (default), 'ghost' (raise if the loss does not
      qualify) or 'vmap' (always per-item gradients; `method=` until 0.3.0,
      deprecated).
    memory_budget: bytes the per-example gradients of the vmap path may
      take before `'auto'` takes the ghost path whatever its estimates
      (`ClippedStatistic.memory_budget`; default 1 GiB, None: no budget).
    automatic_clipping: None (default: clip), or the stability constant r
      of automatic clipping: each contribution scaled to
      `l2_clip * g / (||g|| + r)` (`ClippedStatistic.automatic_clipping`).

  Returns:
    A `ClippedStatistic` called as `stat(batch, params, mask=None)`, where
    `batch` is a `UserBatch` (or a bare pytree of `[users, items, ...]`
    leaves when every item counts) and `mask[u]` False drops user u.

  Raises:
    ValueError: for a bad clip norm or clipping method.
    ghost.GhostClippingUnsupported: when called, for
      `clipping_method='ghost'` and a loss that does not qualify (the
      message says why).
  """
  return ClippedStatistic(
      contribution_fn=user_mean_gradient(loss_fn), l2_clip=l2_clip,
      microbatch_size=microbatch_size, unit='user', min_ndim=2,
      loss_fn=loss_fn, clipping_method=clipping_method, ghost_form=USER_FORM,
      memory_budget=memory_budget, automatic_clipping=automatic_clipping)
