"""Ghost-norm layer rules: per-unit squared norms of one parameter use.

One `LayerRule` per primitive that consumes a parameter (`LAYER_RULES`):
dense (`dot_general`, the Gram form or the formed per-unit gradient),
bias and scale (`add`, `sub`, `mul`: formed), embedding (`gather`: the
token-equality Gram form) and convolution (`conv_general_dilated`: unfolded
patches, then the dense computation). Every rule returns upper bounds,
rounding included (the notes before `LayerNorms`). `dpsco_jax.ghost` runs the
rules and re-exports the public names.
"""

import math
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from dpsco_jax import rounding
from dpsco_jax.ghost_cost import _tap_estimate
from dpsco_jax.ghost_program import _aval
from dpsco_jax.ghost_program import _bind
from dpsco_jax.ghost_program import _dense_dims
from dpsco_jax.ghost_program import _dense_layout
from dpsco_jax.ghost_program import LayerRule
from dpsco_jax.ghost_program import _norm_preserving
from dpsco_jax.ghost_program import _Program
from dpsco_jax.ghost_program import Tap


# ----------------------------------------------------------------------------
# Layer rules.


# Rounding bounds.
#
# A contribution must never leave its clip because of rounding, and must not
# be clipped harder than the clip asks. Every bound below rests on two facts
# of IEEE arithmetic with unit roundoff u (2^-24 in float32), which hold
# whatever order an XLA operation sums in, and whether or not it fuses
# multiplies into adds:
#
# (F1) A sum of n terms formed in ANY order (any tree of additions, each
#      rounded or exact) differs from the exact sum by at most
#      gamma_{n-1} sum_i |x_i|, with gamma_m = m u / (1 - m u): each term
#      passes through at most n - 1 rounded additions (Higham, Accuracy and
#      Stability of Numerical Algorithms, 2002, section 3.1). Adding an exact
#      zero is exact, so only the non-zero terms count. A dot product of
#      length n is such a sum of rounded products: it is within
#      gamma_n sum_i |x_i y_i| of the truth; a sum of non-negative terms is
#      within a RELATIVE gamma_{n-1} of the truth.
# (F2) One multiplication, square root or reciprocal square root is within a
#      relative few u of the truth (u for IEEE operations; XLA's rsqrt is
#      within 2 ulp on the backends it supports).
#
# A single reduction of n terms is only bounded by gamma_{n-1}; XLA merges
# consecutive reductions into one (it does on CPU), so the long reductions
# whose length a bound relies on are split in two levels with an
# optimization barrier between them (`rounding.sum_in_two_levels`): every term then
# passes through at most about 2 sqrt(n) additions.
#
# How the bounds are used (`LayerNorms`): a layer rule either FORMS each
# unit's gradient of its leaf (biases, scales, and dense, convolution and
# embedding layers whose per-unit gradient is cheaper than the Gram form),
# and the clipped sum then releases exactly that formed gradient times the
# clip factor, so only the non-negative sum of its squares is rounded; or it
# takes a Gram form, whose released sum is a separate product (the
# vector-Jacobian product in `weighted_grad_sum`), and its bound covers both
# the norm's rounding and the released product's, a posteriori from the
# values actually formed.


class LayerNorms(NamedTuple):
  """What a layer rule returns for one tap.

  Attributes:
    bound: `[U]` upper bounds, in the accumulation dtype, on the squared
      norm of what the clipped sum releases for each unit (in clip units),
      rounding included (see the rounding notes above).
    formed: the per-unit gradients of the leaf `[U, *leaf.shape]` when the
      rule formed them (the clipped sum then releases them, times the clip
      factors), else None (the clipped sum is the vector-Jacobian product of
      `weighted_grad_sum`).
  """

  bound: jax.Array
  formed: Optional[jax.Array] = None


def _formed_squared_norms(formed: jax.Array) -> jax.Array:
  """Upper bounds on the squared norms of formed gradients `[U, ...]`.

  The squares are non-negative: by F1 and F2 the computed sum is at least
  `(1 - gamma_{d+1})` times the exact one (d additions per term, one
  rounded square), so multiplying it by `1 + 2 gamma_{d+1}` bounds it from
  above (`gamma <= 1/2`).
  """
  flat = formed.reshape(formed.shape[0], -1)
  squared, depth = rounding.sum_in_two_levels(jnp.square(flat))
  return squared * (1.0 + 2.0 * rounding.gamma(depth + 1, flat.dtype))


def _apply_tap(program: _Program, tap: Tap, leaf: jax.Array,
               others: Sequence[Any]) -> jax.Array:
  """The tapped operation as a function of the leaf, other operands fixed."""
  value = leaf
  for node in tap.chain:
    (value,) = _bind(node.eqn, [value])
  operands = list(others)
  operands.insert(tap.position, value)
  return _bind(program.nodes[tap.node].eqn, operands)[0]


def _formed_grads(tap: Tap, program: _Program, leaf: jax.Array,
                  others: Sequence[jax.Array], g: jax.Array) -> jax.Array:
  """Per-unit gradients of ONE leaf, `[U, *leaf.shape]`, formed.

  The gradient of the leaf through its single use is the vector-Jacobian
  product of that use at the output gradient; taken over a unit's terms at
  once (the product of a vmapped use sums over them) and vmapped over units,
  it is the per-unit gradient of this leaf only.
  """
  dtype = _aval(program.nodes[tap.node]).dtype

  def one(others_u, g_u):
    # `g_u` rides along so that the inner vmap always has a batched input.
    _, vjp = jax.vjp(lambda p: jax.vmap(
        lambda o, _: _apply_tap(program, tap, p, o))(others_u, g_u), leaf)
    return vjp(g_u.astype(dtype))[0]

  formed = jax.vmap(one)(tuple(others), g)
  return formed.astype(jnp.promote_types(formed.dtype, jnp.float32))


def _materialized_squared_norms(tap: Tap, program: _Program, leaf: jax.Array,
                                others: Sequence[jax.Array],
                                g: jax.Array) -> LayerNorms:
  """The per-unit gradients of ONE leaf, formed, and their squared norms.

  Cheap for biases and scales (their gradients are small) and for dense,
  convolution and embedding layers where the cost model says so
  (`clipping_choice`). The clipped sum releases these very arrays times the
  clip factors (`weighted_grad_sum`), so their norms need no allowance for
  cancellation however the terms cancel: only the sum of squares is rounded
  (`_formed_squared_norms`).
  """
  formed = _formed_grads(tap, program, leaf, others, g)
  return LayerNorms(_formed_squared_norms(formed), formed)


def _no_check(tap: Tap, program: _Program) -> Optional[str]:
  del tap, program
  return None


# Up to this many columns per unit (positions, terms) the Gram matrices are
# formed by broadcasting rather than by matrix products.
_FEW_POSITIONS = 4


def _norm(x: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=-1))


def _gram_in_two_levels(x: jax.Array) -> tuple[jax.Array, int]:
  """Gram matrices `[n, b, K, K]` of `x: [n, b, K, C]`, summed in two levels.

  The contraction over C is split into blocks of about `sqrt(C)`: one
  batched matrix product per block, then a sum over the blocks behind an
  optimization barrier. Each entry is then within `gamma_d` of the sum of
  its products' absolute values, `d = (block) + (blocks - 1)` about
  `2 sqrt(C)` (F1: one rounded product and at most that many additions per
  term), rather than `gamma_C` for one product of length C: a layer 1024
  wide whose output gradients are alike at every position would otherwise
  have its Gram error bound, `gamma_C K` relative, clip it at 0.998.

  Returns:
    The Gram matrices and d.
  """
  length = x.shape[-1]
  # Full float32 products even where the default matmul precision is lower
  # (TPU, TF32 on GPU): the bound assumes them.
  highest = jax.lax.Precision.HIGHEST
  if length <= 16:
    return jnp.einsum('nbpc,nbqc->nbpq', x, x, precision=highest), length
  block = math.isqrt(length - 1) + 1   # ceil(sqrt(C))
  count = -(-length // block)
  x = jnp.pad(x, [(0, 0)] * 3 + [(0, count * block - length)])
  x = x.reshape(x.shape[:3] + (count, block))
  partial = jnp.einsum('nbpjc,nbqjc->nbjpq', x, x, precision=highest)
  partial = jax.lax.optimization_barrier(partial)
  return jnp.sum(partial, axis=2), block + count - 1


def _gram_bound(total: jax.Array, error: jax.Array, release: jax.Array,
                slack: float) -> jax.Array:
  """`(sqrt(total + error) + release)^2`, the bound of a Gram-form rule.

  `total` is the computed squared norm, `error` a bound on its rounding
  (so `||M||^2 <= total + error`), `release` a bound on how far the released
  product can be from the clip factor times M, per unit of clip factor;
  `slack` covers the rounding of the bound's own non-negative terms.
  """
  inner = jnp.sqrt(jnp.maximum(total + slack * error, 0.0))
  return jnp.square(inner + slack * release)


def _gram_squared_norms(a: jax.Array, g: jax.Array,
                        out_dtype: Any) -> LayerNorms:
  """Per-unit `||sum_{t,p} a_tp g_tp^T||_F^2` by the Gram form, bounded.

  The one computation behind every layer whose gradient is a sum of outer
  products of an input column and an output-gradient column: a dense layer
  (columns: its positions) and a convolution (columns: the unfolded input
  patches at each output position); a unit's terms are more columns.

  The bound, for one unit and one shared batch index (the total sums over
  them). Write `M = sum_k a_k g_k^T` over the K columns, `n_k = |a_k|`,
  `m_k = |g_k|`, `S = sum_k n_k m_k`, and `A_pq = a_p . a_q`,
  `G_pq = g_p . g_q` with computed values `A'`, `G'` (dot products of
  lengths C and F).

  1. By F1, `|A' - A| <= gamma_C n_p n_q` and `|G' - G| <= gamma_F m_p m_q`,
     so `sum |A'G' - AG| <= gamma_C sum n_p n_q |G'| + gamma_F sum |A'| m_p
     m_q + gamma_C gamma_F S^2`, all computed from the values formed. (The
     dot products are summed in two levels, `_gram_in_two_levels`, and
     `gamma_C` in the first two terms becomes `gamma_d`, d about
     `2 sqrt(C)`.)
  2. The products `A'G'` are rounded (u each) and summed in two levels
     (F1 with d additions per term): within `gamma_{d+1} sum |A'G'|`.
  3. So `||M||^2 = sum AG <= total + error` with `error` the sum of the
     terms of 1 and 2: an a posteriori bound, about `gamma_C K / sqrt(F)`
     relative for unrelated columns (not the `K^2 u S^2` of the worst case).
  4. The clipped sum releases `R = sum_k a_k (w g_k)^T` from a separate
     product over the K columns (`weighted_grad_sum`), with the cotangent
     `w g_k` rounded to the operation's dtype (`u_out`): by F1, `|R - w M|
     <= w (gamma_K + u_out (1 + gamma_K)) S`.
  5. The bound returned is `(sqrt(total + error) + (gamma_{K+1} + u_out)
     S)^2 >= (||M|| + |R/w - M|)^2 >= |R / w|^2`: the clip factor computed
     from it keeps `|R|` within the clip (`squared_norms` adds F2's
     allowance for the clip factor itself).

  For unrelated columns (e.g. random positions), `S` is about
  `sqrt(K) ||M||`, so step 4 costs about `K^1.5 u` relative: the cost model
  takes the Gram form only up to `_GRAM_MAX_COLUMNS` columns, where this
  stays near `2e-4`, and forms the per-unit gradient beyond.

  Args:
    a: `[units, terms, batch, positions, contract]` inputs, in the
      accumulation dtype.
    g: `[units, terms, batch, positions, features]` output gradients, alike.
    out_dtype: the dtype of the tapped operation's output (the released
      product's cotangent is rounded to it).

  Returns:
    `LayerNorms` with the bounds and no formed gradient.
  """
  acc = a.dtype
  units, terms, batch, positions, contract = a.shape
  features = g.shape[-1]
  columns = terms * positions
  u_out = (rounding.unit_roundoff(out_dtype)
           if jnp.finfo(out_dtype).eps > jnp.finfo(acc).eps else 0.0)
  if columns == 1:
    # One column (a plain dense layer): `|M|^2 = sum_b |a_b|^2 |g_b|^2`, a
    # sum of products of sums of squares, all non-negative: by F1 and F2
    # the computed value is within a relative `gamma` of the truth, and
    # each released entry is one product `a_c (w g_f)` (two roundings).
    squares_a = jnp.sum(jnp.square(a[:, 0, :, 0]), axis=-1)
    squares_g = jnp.sum(jnp.square(g[:, 0, :, 0]), axis=-1)
    total = jnp.sum(squares_a * squares_g, axis=1)
    factor = ((1.0 + 2.0 * rounding.gamma(contract, acc)) *
              (1.0 + 2.0 * rounding.gamma(features, acc)) *
              (1.0 + 2.0 * rounding.gamma(batch + 1, acc)))
    release = 1.0 + rounding.gamma(2, acc) + u_out
    return LayerNorms(total * factor * release * release)
  if columns <= _FEW_POSITIONS:
    # A few columns (a plain dense layer; a difference without sequence
    # axis): one fused product-and-sum per pair of columns, each a pass
    # over slices of `a` and `g`. Stacking the columns first, or an einsum
    # (many tiny matrix products), measured several times slower on CPU.
    cols_a = [a[:, t, :, p] for t in range(terms) for p in range(positions)]
    cols_g = [g[:, t, :, p] for t in range(terms) for p in range(positions)]
    norms_a = [_norm(x) for x in cols_a]
    norms_g = [_norm(x) for x in cols_g]
    total = absolute = cross = 0.0
    for p in range(columns):
      for q in range(p, columns):
        both = 1.0 if p == q else 2.0   # (p, q) and (q, p)
        # Dot products in two levels: within gamma_{d+1} (d about
        # 2 sqrt(C)) rather than gamma_C of their absolute values.
        gram_a, depth_a = rounding.sum_in_two_levels(cols_a[p] * cols_a[q])
        gram_g, depth_g = rounding.sum_in_two_levels(cols_g[p] * cols_g[q])
        product = both * (gram_a * gram_g)
        total = total + product
        absolute = absolute + jnp.abs(product)
        cross = cross + both * (
            rounding.gamma(depth_a + 1, acc) * norms_a[p] * norms_a[q] *
            jnp.abs(gram_g) + rounding.gamma(depth_g + 1, acc) * jnp.abs(gram_a) *
            norms_g[p] * norms_g[q])
    total, absolute, cross = (jnp.sum(x, axis=1)
                              for x in (total, absolute, cross))
    # Every term of `total` passes through at most all the other additions.
    depth = batch * columns * (columns + 1) // 2 - 1
    magnitude = sum(na * ng for na, ng in zip(norms_a, norms_g))
  else:
    # A unit's terms are more positions of the same layer.
    a = jnp.swapaxes(a, 1, 2).reshape(units, batch, columns, contract)
    g = jnp.swapaxes(g, 1, 2).reshape(units, batch, columns, features)
    highest = jax.lax.Precision.HIGHEST
    gram_a, depth_a = _gram_in_two_levels(a)
    gram_g, depth_g = _gram_in_two_levels(g)
    products = (gram_a * gram_g).reshape(units, -1)
    total, depth = rounding.sum_in_two_levels(products)
    absolute, _ = rounding.sum_in_two_levels(jnp.abs(products))
    norms_a, norms_g = _norm(a), _norm(g)    # [units, batch, columns]
    cross = (rounding.gamma(depth_a, acc) * jnp.einsum(
        'nbp,nbpq,nbq->n', norms_a, jnp.abs(gram_g), norms_a,
        precision=highest) + rounding.gamma(depth_g, acc) * jnp.einsum(
            'nbp,nbpq,nbq->n', norms_g, jnp.abs(gram_a), norms_g,
            precision=highest))
    magnitude = jnp.sum(norms_a * norms_g, axis=2)
  s_squared = jnp.sum(jnp.square(magnitude), axis=-1)   # sum_b S_b^2
  error = (cross + rounding.gamma(contract + 1, acc) * rounding.gamma(features + 1, acc) *
           s_squared
           + rounding.gamma(depth + 1, acc) * absolute)
  release = (rounding.gamma(columns + 1, acc) + u_out) * jnp.sqrt(s_squared)
  # The bound's own terms are non-negative sums of at most
  # batch * columns^2 products of norms (each within gamma_{C+F+2}).
  slack = 1.0 + 4.0 * rounding.gamma(batch * columns * columns + contract +
                             features + 8, acc)
  return LayerNorms(_gram_bound(total, error, release, slack))


def _dense_squared_norms(tap: Tap, program: _Program, leaf: jax.Array,
                         others: Sequence[jax.Array],
                         g: jax.Array) -> LayerNorms:
  """Per-unit squared norms of a dense (`dot_general`) weight's gradient.

  With the activation as `A: [batch, P, C]` (P positions: the activation's
  free axes) and the output gradient as `G: [batch, P, F]` for each of a
  unit's T terms, the weight's per-unit gradient is `sum_batch A^T G` with
  the terms' positions taken together (P' = T P columns); its squared norm
  is `sum_{p,q} (a_p . a_q)(g_p . g_q)` over those P' (Gram form,
  `_gram_squared_norms`) or that of the formed per-unit gradient
  (`_materialized_squared_norms`), as the cost model chooses
  (`clipping_choice`).

  A gradient difference `a u1 v1^T - b u2 v2^T` (the cross-term identity)
  arrives from `difference_terms` in the sum/difference basis
  `((u1 + u2)/2) (h1 + h2)^T + ((u1 - u2)/2) (h1 - h2)^T`, `h1 = a v1`,
  `h2 = -b v2`: the same matrix, but when the two points are close (x' near
  x, a near b, the recursive-gradient regime) the cross terms of the plain
  pair are large and cancel, and float32 rounding of their sum could
  understate the norm by far more than the clip, while the terms of the
  rewritten pair are of the size of the difference itself. The weighted
  sum (`weighted_grad_sum`) is formed from the same terms.
  """
  if _tap_estimate(tap, program, g.shape[1]).form != 'gram':
    return _materialized_squared_norms(tap, program, leaf, others, g)
  (a,) = others
  a_perm, g_perm, num_batch, num_free_a = _dense_layout(tap, program)
  acc = jnp.promote_types(jnp.promote_types(a.dtype, g.dtype), jnp.float32)
  a = jnp.transpose(a.astype(acc), (0, 1, *(2 + d for d in a_perm)))
  g = jnp.transpose(g.astype(acc), (0, 1, *(2 + d for d in g_perm)))
  units, terms = a.shape[:2]
  batch, positions, contract, features = _dense_dims(tap, program)
  a = a.reshape(units, terms, batch, positions, contract)
  g = g.reshape(units, terms, batch, positions, features)
  return _gram_squared_norms(a, g, _aval(program.nodes[tap.node]).dtype)


def _conv_squared_norms(tap: Tap, program: _Program, leaf: jax.Array,
                        others: Sequence[jax.Array],
                        g: jax.Array) -> LayerNorms:
  """Per-unit squared norms of a convolution kernel's gradient.

  Unfolding the input into the patches each output position sees (im2col)
  makes the convolution a dense layer over the output positions: the
  kernel's per-unit gradient is `sum_p patch_p g_p^T` (for grouped and
  depthwise convolutions, one such block per group, as a shared batch
  index), with the patch length `C_in/G * prod(window)` as the contracting
  size. Where the cost model (`clipping_choice`) prefers the Gram form over
  positions it takes `_gram_squared_norms` on the patches (whose order of
  entries need not match the kernel's layout: a norm does not depend on
  it); else, usually (many positions, small patches), it forms the
  per-unit kernel gradient (`_materialized_squared_norms`). The released
  product of the Gram form is the convolution's own vector-Jacobian product
  (`weighted_grad_sum`), assumed to sum products (direct or unfolded
  algorithms; not FFT or Winograd ones).

  A kernel that is resized before use, a convolution with
  `batch_group_count > 1` or one whose parameter is the convolved input
  always forms the per-unit gradient of that leaf.
  """
  if _tap_estimate(tap, program, g.shape[1]).form != 'gram':
    return _materialized_squared_norms(tap, program, leaf, others, g)
  eqn = program.nodes[tap.node].eqn
  params = eqn.params
  (x,) = others
  numbers = params['dimension_numbers']
  _, rhs_spec, out_spec = numbers
  kernel_shape = eqn.invars[1].aval.shape
  window = tuple(kernel_shape[d] for d in rhs_spec[2:])
  groups = params['feature_group_count']
  acc = jnp.promote_types(jnp.promote_types(x.dtype, g.dtype), jnp.float32)
  units, terms = x.shape[:2]

  def patches_of(lhs):
    # The unfolding is itself a convolution with a 0/1 kernel: at full
    # precision every patch entry is an input entry, exactly.
    return jax.lax.conv_general_dilated_patches(
        lhs, window, params['window_strides'], params['padding'],
        params['lhs_dilation'], params['rhs_dilation'], numbers,
        precision=jax.lax.Precision.HIGHEST)

  flat = x.reshape((units * terms,) + x.shape[2:]).astype(acc)
  patches = jax.vmap(patches_of)(flat)
  # Output layout to [rows, batch, spatial..., features], then to
  # [rows, groups, positions, features per group] (a patch's entries are
  # ordered input channel first, and the channels of a group are adjacent,
  # as are the output features of a group).
  order = (0, 1 + out_spec[0], *(1 + d for d in out_spec[2:]),
           1 + out_spec[1])

  def columns(y):
    y = jnp.transpose(y, order)
    y = y.reshape(units, terms, -1, groups, y.shape[-1] // groups)
    return jnp.swapaxes(y, 2, 3)

  return _gram_squared_norms(
      columns(patches),
      columns(g.reshape(flat.shape[:1] + g.shape[2:]).astype(acc)),
      _aval(program.nodes[tap.node]).dtype)


def _embedding_check(tap: Tap, program: _Program) -> Optional[str]:
  """An embedding lookup: rows of a 2-D table gathered by integer ids."""
  eqn = program.nodes[tap.node].eqn
  if tap.position != 0:
    return 'the parameter is not the gathered table'
  table, ids = eqn.invars[0].aval, eqn.invars[1].aval
  numbers = eqn.params['dimension_numbers']
  row_lookup = (
      table.ndim == 2 and ids.ndim >= 1 and ids.shape[-1] == 1 and
      tuple(numbers.collapsed_slice_dims) == (0,) and
      tuple(numbers.start_index_map) == (0,) and
      tuple(numbers.offset_dims) == (ids.ndim - 1,) and
      not tuple(numbers.operand_batching_dims) and
      tuple(eqn.params['slice_sizes']) == (1, table.shape[1]))
  if not row_lookup:
    return 'not a lookup of whole rows of a 2-D table (an embedding)'
  if not _norm_preserving(tap.chain):
    return 'the table is resized before the lookup'
  return None


def _embedding_squared_norms(tap: Tap, program: _Program, leaf: jax.Array,
                             others: Sequence[jax.Array],
                             g: jax.Array) -> LayerNorms:
  """Per-unit squared norms of an embedding table's gradient.

  The table's per-unit gradient is `M = sum_p e_{i_p} g_p^T` over the unit's
  positions p (its terms' positions together), i_p the row looked up: rows
  looked up twice add. Where the cost model (`clipping_choice`) prefers it,
  its squared norm is the token-equality Gram form
  `sum_{p,q} [i_p = i_q] (g_p . g_q)`, O(P^2 F) per unit instead of the
  `V x F` table per unit; else the per-unit table gradient is formed
  (`_materialized_squared_norms`, a small vocabulary).

  The Gram form's bound follows `_gram_squared_norms` with exact
  `a_p . a_q = [i_p = i_q]`: the norm is within
  `gamma_F Q + gamma_{d+1} sum |[i_p = i_q] G'_pq|` of the computed one,
  `Q = sum_{p,q} [i_p = i_q] m_p m_q`; the released table gradient adds, in
  each row, the c positions that look it up, so it is within
  `(gamma_{c+1} + u_out) sqrt(Q)` of the truth (F1, c the most positions
  of the unit sharing one id): for distinct ids `Q = ||M||^2`, and the bound
  is a relative few u whatever the number of positions.

  An id outside the table (`0 <= i < V` fails) is clamped, filled or
  dropped depending on the lookup's mode and the backend; whatever happens
  to it, its row of `M` changes by at most `||g_p||` in norm, so the norm
  used is the in-table part plus `sum ||g_p||` over such positions (the
  triangle inequality): never below the truth.
  """
  if _tap_estimate(tap, program, g.shape[1]).form != 'gram':
    return _materialized_squared_norms(tap, program, leaf, others, g)
  (ids,) = others
  vocabulary = program.nodes[tap.node].eqn.invars[0].aval.shape[0]
  acc = jnp.promote_types(g.dtype, jnp.float32)
  units, features = g.shape[0], g.shape[-1]
  ids = ids.reshape(units, -1)
  columns = ids.shape[1]
  g = g.astype(acc).reshape(units, columns, features)
  inside = (ids >= 0) & (ids < vocabulary)
  g_inside = jnp.where(inside[..., None], g, 0.0)
  highest = jax.lax.Precision.HIGHEST
  gram = jnp.einsum('upf,uqf->upq', g_inside, g_inside, precision=highest)
  same = ids[:, :, None] == ids[:, None, :]
  products = jnp.where(same, gram, 0.0).reshape(units, -1)
  total, depth = rounding.sum_in_two_levels(products)
  absolute, _ = rounding.sum_in_two_levels(jnp.abs(products))
  norms = _norm(g)
  inside_norms = jnp.where(inside, norms, 0.0)
  paired = jnp.einsum('up,upq,uq->u', inside_norms, same.astype(acc),
                      inside_norms, precision=highest)
  shared = (jnp.max(jnp.sum(same, axis=2), axis=1) +
            jnp.sum(~inside, axis=1))
  error = rounding.gamma(features, acc) * paired + rounding.gamma(depth + 1, acc) * absolute
  out_dtype = _aval(program.nodes[tap.node]).dtype
  u_out = (rounding.unit_roundoff(out_dtype)
           if jnp.finfo(out_dtype).eps > jnp.finfo(acc).eps else 0.0)
  release = (rounding.gamma(shared + 1, acc) + u_out) * jnp.sqrt(paired)
  slack = 1.0 + 4.0 * rounding.gamma(columns * columns + features + 8, acc)
  outside = jnp.sum(jnp.where(inside, 0.0, norms), axis=1)
  inner = jnp.sqrt(_gram_bound(total, error, release, slack))
  return LayerNorms(jnp.square(inner + slack * outside))


# One rule per primitive name. `dot_general` covers dense layers (with or
# without positions, any dimension numbers); `add`/`sub` cover biases and
# `mul` elementwise scales (e.g. a norm layer's scale), whose per-example
# gradients are small enough to materialize; `gather` covers embedding
# lookups (the token-equality Gram form); `conv_general_dilated` covers
# convolutions (unfolded input, then the dense computation).
# Rules whose parameter gradient is linear in the output gradient alone (a
# bias: the other operand does not enter it).
_LINEAR_IN_COTANGENT = ('add', 'sub')

LAYER_RULES: dict[str, LayerRule] = {
    'dot_general': LayerRule(_no_check, _dense_squared_norms),
    'add': LayerRule(_no_check, _materialized_squared_norms),
    'sub': LayerRule(_no_check, _materialized_squared_norms),
    'mul': LayerRule(_no_check, _materialized_squared_norms),
    'gather': LayerRule(_embedding_check, _embedding_squared_norms),
    'conv_general_dilated': LayerRule(_no_check, _conv_squared_norms),
}
