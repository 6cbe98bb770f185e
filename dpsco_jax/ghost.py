"""Ghost-norm clipping: per-example gradient norms without per-example gradients.

A clipped gradient sum `sum_i min(1, C / ||g_i||) g_i` needs each example's
gradient NORM, not the gradient itself. For the layers that hold most
parameters the norm follows from two quantities an ordinary backward pass
already has: the layer's input `a_i` and the gradient of the loss at the
layer's output `g_i` (notes/fast-clipping.md):

* dense layer, no sequence axis: `||a_i g_i^T||_F^2 = ||a_i||^2 ||g_i||^2`;
* dense layer over positions p: `sum_{p,q} (a_ip . a_iq)(g_ip . g_iq)` (the
  Gram form) when that is cheaper than materializing the `d_in x d_out`
  per-example gradient, else the per-example gradient of that layer alone
  (the cost model `clipping_choice` decides per layer, and whether the
  vmap path is cheaper for the whole loss, unless its per-example
  gradients would exceed a memory budget);
* bias add and elementwise scale: the per-example gradient of that
  parameter (small) is materialized;
* embedding lookup (a `gather` of whole rows of a 2-D table): the
  token-equality Gram form `sum_{p,q} [i_p = i_q] (g_p . g_q)`, or the
  per-example table gradient for a small vocabulary;
* convolution (`conv_general_dilated`, any layout, strides, padding,
  dilations, groups): the input unfolded into patches (im2col) makes it a
  dense layer over the output positions, so the dense identities apply.

The layers are found by tracing `loss_fn(params, example)` to a jaxpr, so a
plain JAX function and a flax model (whose `apply` traces to operations on the
params pytree) are handled alike. Each use of a params leaf, after
structural operations (reshape, transpose, dtype conversion, broadcast), must
be an operation that has a layer rule below; anything else (a gather that is
not a row lookup; a custom_vjp or scan that takes a parameter; a parameter
meeting another in one operation) makes `analyze` raise
`GhostClippingUnsupported` with the reason, and the caller falls back to
per-example gradients. A leaf used several times (tied input and output
embeddings) gets one tap per use; its norm is that of the sum of the uses'
gradients, formed for that leaf alone (`_layer_norms`).

How a batch is processed (`clipping.ClippedStatistic` composes the steps):

1. One forward pass over all examples with a zero perturbation added to the
   output of every recognized layer, recording the layer's other inputs
   (`a_i`); one backward pass of the summed losses with respect to the
   perturbations gives every `g_i` at once (no parameter gradient).
2. The per-example squared norms from the identities, summed over layers
   (global clipping), give the clip factors `w_i`.
3. The clipped sum is assembled from the same `a_i` and `g_i`: each layer's
   parameter gradient is the layer's vector-Jacobian product at the
   cotangents `w_i g_i`, summed over examples (one matrix product per dense
   layer, as in a non-private backward pass); a layer whose per-example
   gradients step 2 formed sums those very arrays times `w_i`. This equals
   the backward pass of `sum_i w_i loss_i` with the weights held constant,
   without a second forward pass. Rows dropped by the mask or for a non-finite norm are
   removed with `where` from both `a_i` and `g_i` (a zero weight would not
   do: `0 * NaN` is NaN).

The same passes serve sums of per-example gradient TERMS per privacy unit
(`gradient_terms`, `difference_terms`, `mean_terms`): a gradient difference
`a grad f(x, d) - b grad f(x', d)` is one example at two points (the first
pass runs at both), a user's mean gradient is its items' gradients times
`1/m`. A dense layer's unit norm is then the Gram form over the unit's terms
and positions together (for a difference the cross-term identity
`a^2 |u1|^2 |v1|^2 + b^2 |u2|^2 |v2|^2 - 2ab (u1.u2)(v1.v2)`, evaluated in a
sum/difference basis), and the clipped sum the same vector-Jacobian products
over every term.

Adding a layer type is one rule: a `LayerRule` registered in `LAYER_RULES`
under the primitive's name (as `gather` for embeddings and
`conv_general_dilated` for convolutions).
A rule only computes per-example squared norms (upper bounds, rounding
included: see the rounding notes before `LayerNorms`), and may return the
per-example gradients it formed; the clipped sum is the generic
vector-Jacobian product, or the sum of those, and needs nothing new.

Example:
  >>> stat = dpsco_jax.clipped_grad_sum(loss_fn, l2_clip=1.0)  # 'auto'
  >>> out = stat(batch, params)           # ghost path when the loss qualifies
  >>> plan = analyze(loss_fn, params, batch)   # what was recognized
  >>> [tap.rule for tap in plan.taps]
  ['dot_general', 'add', 'dot_general', 'add']
"""

import dataclasses
import itertools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from dpsco_jax import rounding

PyTree = Any

# Call primitives whose body is inlined, so that a parameter passed into a
# nested `jax.jit` (jnp functions are often jitted) is followed inside it.
_INLINED_CALLS = ('jit', 'pjit', 'closed_call', 'core_call')
# Single-operand operations that move, reshape or recast a parameter without
# mixing it with anything else; a chain of them links a leaf to its use.
_STRUCTURAL = ('reshape', 'transpose', 'convert_element_type', 'copy',
               'copy_p', 'squeeze', 'broadcast_in_dim', 'expand_dims')
# Loops and branches whose bodies the analysis does not enter, with what
# users write to get them. A parameter passed into one has no single layer use
# to tap (a stacked layer's weights are sliced once per iteration: one
# parameter used as many times as there are layers), so the loss falls back.
_OPAQUE_CONTROL_FLOW = {
    'scan': 'layers stacked with `lax.scan` or `nnx.scan`',
    'while': 'a `lax.while_loop` or `lax.fori_loop`',
    'cond': 'a `lax.cond` or `lax.switch`',
}


class GhostClippingUnsupported(ValueError):
  """Raised when a loss has a parameter use that ghost norms cannot handle."""


class _Const:
  """A constant operand of a flattened program (a literal or a captured const).

  Its value is data: an array of any type (`jax.Array`, numpy, a literal's
  typed array), dtype or rank, or a Python scalar. It is compared and hashed
  by identity (`object`'s defaults), never by value: an array has no hash,
  and `==` on arrays is elementwise. The analysis keys values by variable
  number (`_is_var`) and never looks a constant up.

  Attributes:
    value: the constant's value.
  """

  __slots__ = ('value',)

  def __init__(self, value: Any):
    self.value = value

  def __repr__(self) -> str:
    return (f'_Const({type(self.value).__name__} '
            f'{getattr(self.value, "shape", ())})')


_Atom = Union[int, _Const]


def _is_var(atom: _Atom) -> bool:
  """Whether `atom` is a numbered variable (not a constant)."""
  return not isinstance(atom, _Const)


class _Node(NamedTuple):
  """One primitive application of a flattened program."""

  eqn: Any  # the jaxpr equation: primitive, params, context
  invars: tuple[_Atom, ...]
  outvars: tuple[int, ...]


class _Program(NamedTuple):
  """A jaxpr with every nested `jit` inlined and variables numbered."""

  invars: tuple[int, ...]
  nodes: tuple[_Node, ...]
  outvar: _Atom


@dataclasses.dataclass(frozen=True)
class Tap:
  """One parameter use that a layer rule handles.

  Attributes:
    leaf: index of the params leaf (in `jax.tree_util.tree_leaves` order).
    chain: the structural operations from the leaf to the operand.
    node: index of the consuming operation in the program.
    position: which operand of that operation is the parameter.
    rule: the layer rule's name (the primitive's name).
    param_free: whether the operation's other operands depend on no
      parameter (the data entering a first layer): they are then the same
      at any two points, which a gradient difference uses.
    shared: whether the leaf has other taps (a leaf used several times, as
      tied input and output embeddings are): its norm is then that of the
      sum of its uses' gradients, formed (`_layer_norms`), not the rule's.
  """

  leaf: int
  chain: tuple[_Node, ...]
  node: int
  position: int
  rule: str
  param_free: bool = False
  shared: bool = False


class LayerRule(NamedTuple):
  """How ghost norms treat one primitive that consumes a parameter.

  Attributes:
    check: `check(tap, program) -> None or reason`; a reason makes the whole
      loss unsupported.
    squared_norms: `squared_norms(tap, program, leaf, others, g) ->
      LayerNorms` (or a bare `[U]` array of bounds): upper bounds on the
      per-unit squared norms of the leaf's gradient as the clipped sum
      releases it, rounding included, in float32 or wider, and the formed
      per-unit gradients when the rule forms them (see `LayerNorms`).
      A unit (an example, a difference, a user) is a sum of T terms, each
      one example's gradient at some params: `others` are the operation's
      other operands and `g` the gradient at its output, with leading axes
      `[U, T]` (`g` already multiplied by the term's coefficient and
      divided by the clip norm; dropped terms are zero in both). The unit's
      gradient of the leaf is the sum over its terms of the operation's
      vector-Jacobian product at `g`. T may differ between taps.
  """

  check: Callable[[Tap, _Program], Optional[str]]
  squared_norms: Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class GhostPlan:
  """The recognized layers of one loss at one params/example signature.

  Attributes:
    program: the flattened per-example loss.
    taps: one entry per used params leaf, in program order.
    num_leaves: number of params leaves.
    treedef: the params tree structure.
    params_bytes: the bytes of all params leaves (of one gradient).
  """

  program: _Program
  taps: tuple[Tap, ...]
  num_leaves: int
  treedef: Any
  params_bytes: int = 0


def _bind(eqn, invals: Sequence[Any]) -> list[Any]:
  """Applies a jaxpr equation's primitive to `invals`."""
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns = ()
  if isinstance(params, tuple):  # older jax: (subfuns, params)
    subfuns, params = params
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _inner_closed_jaxpr(eqn) -> Optional[Any]:
  if eqn.primitive.name not in _INLINED_CALLS:
    return None
  for name in ('jaxpr', 'call_jaxpr'):
    inner = eqn.params.get(name)
    if isinstance(inner, jex.ClosedJaxpr):
      return inner
  return None


def _flatten(closed: Any) -> _Program:
  """Numbers the variables of `closed` and inlines nested `jit` calls."""
  nodes: list[_Node] = []
  counter = itertools.count()

  def inline(jaxpr, consts: Sequence[_Atom], args: Sequence[_Atom]):
    env: dict[Any, _Atom] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v) -> _Atom:
      return _Const(v.val) if isinstance(v, jex.Literal) else env[v]

    for eqn in jaxpr.eqns:
      ins = tuple(read(v) for v in eqn.invars)
      inner = _inner_closed_jaxpr(eqn)
      if inner is not None:
        outs = inline(inner.jaxpr, [_Const(c) for c in inner.consts], ins)
      else:
        outs = tuple(next(counter) for _ in eqn.outvars)
        nodes.append(_Node(eqn, ins, outs))
      for v, atom in zip(eqn.outvars, outs):
        if not isinstance(v, jex.DropVar):
          env[v] = atom
    return tuple(read(v) for v in jaxpr.outvars)

  invars = tuple(next(counter) for _ in closed.jaxpr.invars)
  (outvar,) = inline(closed.jaxpr, [_Const(c) for c in closed.consts], invars)
  return _Program(invars, tuple(nodes), outvar)


def _size(shape: Sequence[int]) -> int:
  return math.prod(shape)


def _aval(node: _Node, index: int = 0):
  return node.eqn.outvars[index].aval


def _norm_preserving(chain: Sequence[_Node]) -> bool:
  """Whether the chain only permutes entries (so gradient norms carry over)."""
  for node in chain:
    in_aval = node.eqn.invars[0].aval
    if _size(in_aval.shape) != _size(_aval(node).shape):
      return False
  return True


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


def _dense_layout(tap: Tap, program: _Program):
  """Axes of a `dot_general` seen from its (non-parameter) activation.

  Returns:
    `(a_perm, g_perm, num_batch, num_free_a)`: the permutations that bring
    the activation to `[batch, free_a, contract]` and the output to
    `[batch, free_a, free_param]` (per example, no leading axis), and the
    numbers of batch and activation-free axes.
  """
  eqn = program.nodes[tap.node].eqn
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = (
      eqn.params['dimension_numbers'])
  activation = 1 - tap.position
  contract, batch = ((lhs_contract, lhs_batch) if activation == 0 else
                     (rhs_contract, rhs_batch))
  a_ndim = eqn.invars[activation].aval.ndim
  free = [d for d in range(a_ndim) if d not in contract and d not in batch]
  a_perm = (*batch, *free, *contract)
  out_ndim = _aval(program.nodes[tap.node]).ndim
  num_batch, num_free_a = len(batch), len(free)
  num_free_p = out_ndim - num_batch - num_free_a
  # The output is [batch, lhs free, rhs free].
  if activation == 0:
    g_perm = tuple(range(out_ndim))
  else:
    g_perm = (*range(num_batch), *range(num_batch + num_free_p, out_ndim),
              *range(num_batch, num_batch + num_free_p))
  return a_perm, g_perm, num_batch, num_free_a


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


def _dense_dims(tap: Tap, program: _Program):
  """`(batch, positions, contract, features)` of a dense tap, per example."""
  eqn = program.nodes[tap.node].eqn
  a_perm, g_perm, num_batch, num_free_a = _dense_layout(tap, program)
  a_shape = [eqn.invars[1 - tap.position].aval.shape[d] for d in a_perm]
  g_shape = [_aval(program.nodes[tap.node]).shape[d] for d in g_perm]
  return (_size(a_shape[:num_batch]),
          _size(a_shape[num_batch:num_batch + num_free_a]),
          _size(a_shape[num_batch + num_free_a:]),
          _size(g_shape[num_batch + num_free_a:]))


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


def _conv_geometry_supported(tap: Tap, program: _Program) -> bool:
  params = program.nodes[tap.node].eqn.params
  return (tap.position == 1 and params['batch_group_count'] == 1 and
          _norm_preserving(tap.chain))


def _conv_dims(tap: Tap, program: _Program):
  """`(groups, positions, patch, features)` of a convolution kernel's tap."""
  eqn = program.nodes[tap.node].eqn
  _, rhs_spec, _ = eqn.params['dimension_numbers']
  kernel = eqn.invars[1].aval.shape
  groups = eqn.params['feature_group_count']
  out_features = kernel[rhs_spec[0]]
  patch = kernel[rhs_spec[1]] * _size([kernel[d] for d in rhs_spec[2:]])
  positions = _size(_aval(program.nodes[tap.node]).shape) // out_features
  return groups, positions, patch, out_features // groups


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


def dense_uses_gram(tap: Tap, plan: GhostPlan,
                    terms: int = 1) -> Optional[bool]:
  """Whether a dense tap's norms use the Gram form (None: not dense/identity).

  Example:
    >>> plan = analyze(loss_fn, params, batch)
    >>> [dense_uses_gram(tap, plan) for tap in plan.taps]
    [None, None, True, False]

  Args:
    tap: a tap of `plan`.
    plan: the plan.
    terms: the terms per unit (1: examples, 2: differences, items per user).

  Returns:
    True for the Gram form, False for the formed per-example
    `d_in x d_out` gradient, None when the tap is not a norm-preserving
    dense use with positions (a plain dense layer, a bias, a scale).
  """
  if tap.rule != 'dot_general' or not _norm_preserving(tap.chain):
    return None
  _, positions, _, _ = _dense_dims(tap, plan.program)
  if terms * positions == 1:
    return None
  return _tap_estimate(tap, plan.program, terms).form == 'gram'


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


# ----------------------------------------------------------------------------
# Analysis.


def _varying_axes(aval: Any) -> tuple[str, ...]:
  """The `shard_map` axes along which a value varies (empty outside one)."""
  axis_type = getattr(aval, 'manual_axis_type', None)
  axes = getattr(axis_type, 'varying', None)
  if axes is None:
    axes = getattr(aval, 'vma', ())
  return tuple(sorted(axes))


def _leaf_names(params: PyTree) -> list[str]:
  paths, _ = jax.tree_util.tree_flatten_with_path(params)
  return [jax.tree_util.keystr(path) or '<root>' for path, _ in paths]


def describe_error(error: BaseException, limit: int = 300) -> str:
  """`'TypeName: first line of the message'`, at most `limit` characters.

  A short, stable reason for a fallback warning (JAX errors often carry
  long multi-line messages).

  Example:
    >>> describe_error(TypeError("unhashable type: 'ArrayImpl'"))
    "TypeError: unhashable type: 'ArrayImpl'"

  Args:
    error: the exception.
    limit: the most characters returned (at least 20).

  Returns:
    The description.

  Raises:
    ValueError: if `limit` is below 20.
  """
  if limit < 20:
    raise ValueError(f'limit must be at least 20, got {limit}')
  lines = str(error).strip().splitlines()
  text = f'{type(error).__name__}: {lines[0] if lines else ""}'.rstrip(': ')
  return text if len(text) <= limit else text[:limit - 3] + '...'


def analyze(loss_fn: Callable[[PyTree, PyTree], jax.Array], params: PyTree,
            rows: PyTree) -> GhostPlan:
  """Finds the layers of `loss_fn` at the signature of `params` and `rows`.

  Example:
    >>> plan = analyze(loss_fn, params, batch)   # batch: leading example axis
    >>> [tap.rule for tap in plan.taps]
    ['dot_general', 'add']

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    params: the params (arrays or tracers; only shapes and dtypes are used).
    rows: a batch with a leading example axis (only shapes and dtypes).

  Returns:
    A `GhostPlan`.

  Raises:
    GhostClippingUnsupported: and no other exception type. With the reason,
      naming the operation and the params leaf, when some parameter use has
      no layer rule, a parameter is used more than once, or the loss is not
      a real scalar; any other error raised while tracing or analyzing the
      loss is re-raised as one naming it (chained to it), so that `'auto'`
      can always fall back to per-example gradients.
  """
  try:
    return _analyze(loss_fn, params, rows)
  except GhostClippingUnsupported:
    raise
  except Exception as error:  # pylint: disable=broad-exception-caught
    raise GhostClippingUnsupported(
        f'the analysis failed ({describe_error(error)})') from error


def _analyze(loss_fn: Callable[[PyTree, PyTree], jax.Array], params: PyTree,
             rows: PyTree) -> GhostPlan:
  """`analyze` without the conversion of unexpected errors."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  names = _leaf_names(params)
  for name, leaf in zip(names, leaves):
    if not jnp.issubdtype(jax.typeof(leaf).dtype, jnp.floating):
      raise GhostClippingUnsupported(
          f'params leaf {name} has dtype {jax.typeof(leaf).dtype}, not a '
          'floating type')
  # Trace with the values themselves (only their types are used): under
  # `shard_map` the types say which values vary across devices, and the
  # jaxpr then holds the casts that mixing them needs.
  closed = jax.make_jaxpr(loss_fn)(
      params, jax.tree_util.tree_map(lambda x: x[0], rows))
  out_avals = closed.out_avals
  if (len(out_avals) != 1 or out_avals[0].shape != () or
      not jnp.issubdtype(out_avals[0].dtype, jnp.floating)):
    raise GhostClippingUnsupported(
        'loss_fn must return one real scalar per example, got '
        f'{[str(a) for a in out_avals]}')
  program = _flatten(closed)
  taps = _find_taps(program, names)
  # Values computed from the example alone (no parameter upstream).
  dependent = set(program.invars[:len(leaves)])
  for node in program.nodes:
    if any(_is_var(atom) and atom in dependent
           for atom in node.invars):
      dependent.update(node.outvars)
  taps = tuple(dataclasses.replace(tap, param_free=all(
      not _is_var(atom) or atom not in dependent
      for i, atom in enumerate(program.nodes[tap.node].invars)
      if i != tap.position)) for tap in taps)
  params_bytes = sum(
      _size(jax.typeof(leaf).shape) * jnp.dtype(jax.typeof(leaf).dtype).itemsize
      for leaf in leaves)
  return GhostPlan(program, taps, len(leaves), treedef, params_bytes)


def _checked_tap(program: _Program, names: Sequence[str],
                 origin: dict[int, int], leaf: int, chain: tuple[_Node, ...],
                 index: int, position: int) -> Tap:
  """The tap of one use of a params leaf, or why the use is unsupported.

  Raises:
    GhostClippingUnsupported: when the consuming operation has no layer
      rule, several outputs, a second parameter operand, or fails the
      rule's check.
  """
  name = names[leaf]
  node = program.nodes[index]
  prim = node.eqn.primitive.name
  rule = LAYER_RULES.get(prim)
  if rule is None and prim in _OPAQUE_CONTROL_FLOW:
    raise GhostClippingUnsupported(
        f'params leaf {name} is used by `{prim}` '
        f'({_OPAQUE_CONTROL_FLOW[prim]}): ghost norms do not follow a '
        'parameter into a loop or branch body; apply the layers in a '
        'Python loop to take the ghost path')
  if rule is None:
    raise GhostClippingUnsupported(
        f'params leaf {name} is used by `{prim}`, which has no ghost-norm '
        'layer rule')
  if len(node.outvars) != 1:
    raise GhostClippingUnsupported(
        f'params leaf {name} is used by `{prim}` with several outputs')
  for other, atom in enumerate(node.invars):
    if other != position and _is_var(atom) and atom in origin:
      raise GhostClippingUnsupported(
          f'params leaf {name} meets params leaf {names[origin[atom]]} in '
          f'one `{prim}`: ghost norms need a parameter and an activation')
  tap = Tap(leaf, chain, index, position, prim)
  reason = rule.check(tap, program)
  if reason is not None:
    raise GhostClippingUnsupported(
        f'params leaf {name} used by `{prim}`: {reason}')
  return tap


def _find_taps(program: _Program, names: Sequence[str]) -> tuple[Tap, ...]:
  """Follows each params leaf to its uses and checks each has a rule.

  A leaf used several times (tied weights) gets one tap per use, all marked
  `shared`.
  """
  consumers: dict[int, list[tuple[int, int]]] = {}
  for index, node in enumerate(program.nodes):
    for position, atom in enumerate(node.invars):
      if _is_var(atom):
        consumers.setdefault(atom, []).append((index, position))
  # var id -> leaf index, for every value that is a leaf or a structural
  # image of one (so a use mixing two parameters is recognized).
  origin = {var: leaf for leaf, var in enumerate(program.invars[:len(names)])}
  for node in program.nodes:
    if (node.eqn.primitive.name in _STRUCTURAL and len(node.invars) == 1 and
        _is_var(node.invars[0]) and node.invars[0] in origin):
      origin[node.outvars[0]] = origin[node.invars[0]]

  taps = []
  for leaf, name in enumerate(names):
    # Every use of the leaf, through every branch of structural operations
    # (tied weights: a lookup of the table and its transpose in the head).
    pending, leaf_taps = [(program.invars[leaf], ())], []
    while pending:
      var, chain = pending.pop()
      if _is_var(program.outvar) and var == program.outvar:
        raise GhostClippingUnsupported(
            f'params leaf {name} is part of the loss value itself')
      for index, position in consumers.get(var, []):
        node = program.nodes[index]
        prim = node.eqn.primitive.name
        if prim in _STRUCTURAL and len(node.invars) == 1:
          pending.append((node.outvars[0], chain + (node,)))
          continue
        leaf_taps.append(_checked_tap(program, names, origin, leaf, chain,
                                      index, position))
    if len(leaf_taps) > 1:
      leaf_taps = [dataclasses.replace(tap, shared=True) for tap in leaf_taps]
    taps.extend(leaf_taps)
  return tuple(sorted(taps, key=lambda t: t.node))


# ----------------------------------------------------------------------------
# Evaluation.


class LayerValues(NamedTuple):
  """What the first pass records for every tap.

  `layer_values` returns them with a leading example axis; the term builders
  (`gradient_terms`, `difference_terms`, `mean_terms`) regroup them with
  leading axes `[units, terms]` for `squared_norms` and `weighted_grad_sum`.

  Attributes:
    others: per tap, the tapped operation's other operands.
    grads: per tap, the gradient of the example's loss at the operation's
      output.
  """

  others: tuple[tuple[jax.Array, ...], ...]
  grads: tuple[jax.Array, ...]


def _run(program: _Program, taps: Sequence[Tap], leaves: Sequence[Any],
         example: Sequence[Any], perturbations: Sequence[Any]):
  """Evaluates the loss on one example, perturbing and recording the taps."""
  env: dict[int, Any] = dict(zip(program.invars, (*leaves, *example)))
  by_node = {tap.node: k for k, tap in enumerate(taps)}
  recorded: list[Any] = [None] * len(taps)

  def read(atom: _Atom) -> Any:
    return env[atom] if _is_var(atom) else atom.value

  for index, node in enumerate(program.nodes):
    invals = [read(atom) for atom in node.invars]
    outvals = _bind(node.eqn, invals)
    k = by_node.get(index)
    if k is not None:
      position = taps[k].position
      recorded[k] = tuple(v for i, v in enumerate(invals) if i != position)
      outvals = [outvals[0] + perturbations[k]]
    env.update(zip(node.outvars, outvals))
  return read(program.outvar), tuple(recorded)


def _zeros_like_output(node: _Node, size: int) -> jax.Array:
  """Zero perturbations, one per example, typed like the node's output."""
  aval = _aval(node)
  zeros = jnp.zeros((size, *aval.shape), aval.dtype)
  axes = _varying_axes(aval)
  # Under `shard_map` a gradient with respect to a device-invariant value is
  # summed over devices: the perturbations must vary like the output, so
  # that each device keeps its own examples' output gradients.
  return jax.lax.pcast(zeros, axes, to='varying') if axes else zeros


def layer_values(plan: GhostPlan, params: PyTree,
                 rows: PyTree) -> LayerValues:
  """The first pass: every tap's operands and output gradients, all examples.

  Args:
    plan: from `analyze` on the same signature.
    params: the params.
    rows: the examples, with a leading axis.

  Returns:
    `LayerValues` (rows with NaN inputs hold NaN values; the caller drops
    them).
  """
  leaves = jax.tree_util.tree_leaves(params)
  example_leaves = jax.tree_util.tree_leaves(rows)
  size = example_leaves[0].shape[0]
  zeros = [_zeros_like_output(plan.program.nodes[t.node], size)
           for t in plan.taps]

  def total_loss(perturbations):
    losses, recorded = jax.vmap(
        lambda ex, z: _run(plan.program, plan.taps, leaves, ex, z))(
            example_leaves, perturbations)
    # d(sum)/d(loss_i) = 1 whatever the other losses are, NaN included.
    return jnp.sum(losses), recorded

  grads, recorded = jax.grad(total_loss, has_aux=True)(zeros)
  return LayerValues(tuple(recorded), tuple(grads))


def _weighted_terms(values: LayerValues, coefficients: jax.Array,
                    keep: Optional[jax.Array]) -> LayerValues:
  """Multiplies each term's output gradients by its coefficient.

  Args:
    values: with leading axes `[U, T]`.
    coefficients: `[U, T]`.
    keep: optional bool `[U, T]`; the other terms are set to zero with
      `where` in both operands and gradients (a zero coefficient would not
      do: `0 * NaN` is NaN, and a dropped item may hold NaN).

  Returns:
    The weighted `LayerValues`.
  """

  def expand(x, like):
    return x.reshape(x.shape + (1,) * (like.ndim - 2))

  def drop(x):
    return x if keep is None else jnp.where(expand(keep, x), x,
                                            jnp.zeros((), x.dtype))

  # In float32 or wider: a coefficient such as SRG's t + 1 would lose digits
  # in a bfloat16 gradient (the vmap path multiplies in float32 too).
  grads = tuple(
      drop(g).astype(jnp.promote_types(g.dtype, jnp.float32)) *
      expand(coefficients, g) for g in values.grads)
  others = tuple(tuple(drop(o) for o in tap_others)
                 for tap_others in values.others)
  return LayerValues(others, grads)


def gradient_terms(plan: GhostPlan, params: PyTree,
                   rows: PyTree) -> LayerValues:
  """Units for per-example gradients: each example, one term.

  Args:
    plan: from `analyze` on the same signature.
    params: the params.
    rows: the examples, with a leading axis.

  Returns:
    `LayerValues` with leading axes `[B, 1]`.
  """
  values = layer_values(plan, params, rows)
  return jax.tree_util.tree_map(lambda x: x[:, None], values)


def difference_terms(plan: GhostPlan, params: PyTree, prev_params: PyTree,
                     rows: PyTree, a: Any, b: Any) -> LayerValues:
  """Units for `a grad f(params, d) - b grad f(prev_params, d)`, d one example.

  The first pass runs at both points; each example is a unit of two terms
  with coefficients `a` and `-b` (one term `u (a v1 - b v2)^T` at a layer
  whose input does not depend on the parameters). The operations the layer
  rules handle are linear in the parameter, so the terms' vector-Jacobian
  products do not depend on the point they were recorded at.

  Args:
    plan: from `analyze` at `params` (`prev_params` has the same signature).
    params: the current point.
    prev_params: the previous point.
    rows: the examples, with a leading axis.
    a: scalar coefficient of the current gradient (may be traced).
    b: scalar coefficient of the previous gradient (may be traced).

  Returns:
    Weighted `LayerValues` with leading axes `[B, 2]` (`[B, 1]` for a tap
    whose `param_free` is set).
  """
  current = layer_values(plan, params, rows)
  previous = layer_values(plan, prev_params, rows)
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  others, grads = [], []
  for tap, now, before, g, h in zip(plan.taps, current.others,
                                    previous.others, current.grads,
                                    previous.grads):
    acc = jnp.promote_types(g.dtype, jnp.float32)
    h1, h2 = a * g.astype(acc), -b * h.astype(acc)
    if tap.param_free or tap.rule in _LINEAR_IN_COTANGENT:
      # One term `u (a v1 - b v2)^T`: the same operands at both points
      # (computed alike from the example, so bitwise equal), or a use whose
      # gradient does not involve them (a bias). Exact, cheaper, and
      # without cross terms to cancel.
      others.append(tuple(o[:, None] for o in now))
      grads.append((h1 + h2)[:, None])
    else:
      # The two terms in the sum/difference basis: `((u1 + u2) / 2)
      # (h1 + h2)^T + ((u1 - u2) / 2) (h1 - h2)^T` is the same bilinear
      # gradient, but when the points are close (x' near x, a near b) the
      # plain terms are large and cancel, while these are of the size of
      # the difference. The norms AND the weighted sum use these same
      # computed terms: a sum formed from the plain terms would carry their
      # rounding (about u a |v1| |u1|, far above the difference), which the
      # norm measured here does not see, and a contribution could leave its
      # clip by that much.
      others.append(tuple(jnp.stack([(o + p) * 0.5, (o - p) * 0.5], axis=1)
                          for o, p in zip(now, before)))
      grads.append(jnp.stack([h1 + h2, h1 - h2], axis=1))
  return LayerValues(tuple(others), tuple(grads))


def mean_terms(plan: GhostPlan, params: PyTree, items: PyTree,
               item_mask: Optional[jax.Array]) -> LayerValues:
  """Units for users: the mean of a user's item gradients.

  The first pass runs over all items of all users at once; user u is a unit
  whose terms are its items, with coefficient `1/m_u` (`m_u` the number of
  unmasked items, at least 1) and masked items dropped, so a user with no
  items contributes zero.

  Args:
    plan: from `analyze` on one user's items.
    params: the params.
    items: leaves shaped `[users, items, ...]`.
    item_mask: optional bool `[users, items]`; None keeps every item.

  Returns:
    Weighted `LayerValues` with leading axes `[users, items]`.
  """
  leaves = jax.tree_util.tree_leaves(items)
  users, per_user = leaves[0].shape[:2]
  flat = jax.tree_util.tree_map(
      lambda x: x.reshape((users * per_user,) + x.shape[2:]), items)
  values = jax.tree_util.tree_map(
      lambda x: x.reshape((users, per_user) + x.shape[1:]),
      layer_values(plan, params, flat))
  if item_mask is None:
    coefficients = jnp.full((users, per_user), 1.0 / per_user, jnp.float32)
    return _weighted_terms(values, coefficients, None)
  item_mask = jnp.asarray(item_mask, bool)
  count = jnp.maximum(jnp.sum(item_mask, axis=1, keepdims=True), 1)
  coefficients = item_mask / count.astype(jnp.float32)
  return _weighted_terms(values, coefficients, item_mask)


def _layer_norms(plan: GhostPlan, params: PyTree, values: LayerValues,
                 scale: Any) -> tuple[LayerNorms, ...]:
  """Every tap's `LayerNorms`, gradients multiplied by `scale` first."""
  leaves = jax.tree_util.tree_leaves(params)
  norms = []
  shared: dict[int, int] = {}   # a shared leaf -> the index of its first tap
  for tap, others, g in zip(plan.taps, values.others, values.grads):
    g = g.astype(jnp.promote_types(g.dtype, jnp.float32)) * scale
    if tap.shared:
      # A leaf used several times (tied weights): its per-unit gradient is
      # the sum of its uses' vector-Jacobian products, with cross terms no
      # single rule sees. It is formed here, summed over the uses, and
      # released as formed (`weighted_grad_sum`), so only its sum of
      # squares is rounded, as for any formed gradient.
      formed = _formed_grads(tap, plan.program, leaves[tap.leaf], others, g)
      if tap.leaf in shared:
        first = shared[tap.leaf]
        norms[first] = LayerNorms(norms[first].bound,
                                  norms[first].formed + formed)
        norms.append(LayerNorms(jnp.zeros(g.shape[:1], formed.dtype)))
      else:
        shared[tap.leaf] = len(norms)
        norms.append(LayerNorms(None, formed))
      continue
    rule = LAYER_RULES[tap.rule]
    layer = rule.squared_norms(tap, plan.program, leaves[tap.leaf], others, g)
    if not isinstance(layer, LayerNorms):   # a rule returning bounds only
      layer = LayerNorms(layer)
    norms.append(layer)
  for index in shared.values():
    norms[index] = LayerNorms(_formed_squared_norms(norms[index].formed),
                              norms[index].formed)
  return tuple(norms)


def squared_norms_and_formed(
    plan: GhostPlan, params: PyTree, values: LayerValues, scale: Any,
    size: int) -> tuple[jax.Array, tuple[Optional[jax.Array], ...]]:
  """Per-unit squared global norms (bounds) and the formed gradients.

  Example:
    >>> values = gradient_terms(plan, params, batch)
    >>> squared, formed = squared_norms_and_formed(plan, params, values,
    ...                                            1.0 / clip, batch_size)
    >>> out = weighted_grad_sum(plan, params, values, weights, keep,
    ...                         formed=formed, formed_scale=clip)

  Args:
    plan: the plan.
    params: the params.
    values: from `gradient_terms`, `difference_terms` or `mean_terms`
      (leading axes `[units, terms]`).
    scale: multiplies every gradient first (`1 / l2_clip`: norms in clip
      units stay far from float overflow).
    size: the number of units.

  Returns:
    `(squared, formed)`: `[size]` float32 (or wider) upper bounds on the
    squared norms of what `weighted_grad_sum` releases per unit (divided by
    the unit's weight; see the rounding notes before `LayerNorms`), summed
    over layers, NaN or Inf for a unit whose gradient is not finite; and per
    tap the formed per-unit gradients (times `scale`) or None.

  Raises:
    ValueError: if `size` differs from the units of `values`.
  """
  norms = _layer_norms(plan, params, values, scale)
  total = jnp.zeros((size,), jnp.float32)
  for layer in norms:
    if layer.bound.shape != (size,):
      raise ValueError(f'size {size} does not match the units of values '
                       f'({layer.bound.shape})')
    # `maximum` keeps NaN (dropped rows) and never lets a negative rounding
    # of a bound reach rsqrt.
    total = total + jnp.maximum(layer.bound, 0.0)
  # F1 for the non-negative sum over layers, and F2 for what follows: the
  # clip factor min(1, rsqrt(total)) (2 ulp), and for a formed gradient
  # the products (clip factor * l2_clip) * formed (2 roundings).
  total = total * (1.0 + 2.0 * rounding.gamma(len(norms) + 16, total.dtype))
  return total, tuple(layer.formed for layer in norms)


def squared_norms(plan: GhostPlan, params: PyTree, values: LayerValues,
                  scale: Any, size: int) -> jax.Array:
  """Per-unit squared global gradient norms, times `scale**2`.

  Upper bounds, rounding included, on the squared norms of what
  `weighted_grad_sum` releases per unit (`squared_norms_and_formed`, whose
  formed gradients the clipped sum must then release).

  Example:
    >>> squared = squared_norms(plan, params, values, 1.0 / clip, batch_size)

  Args:
    plan: the plan.
    params: the params.
    values: from `gradient_terms`, `difference_terms` or `mean_terms`
      (leading axes `[units, terms]`).
    scale: multiplies every gradient first (`1 / l2_clip`: norms in clip
      units stay far from float overflow).
    size: the number of units.

  Returns:
    `[size]` float32 (or wider) squared norms, summed over layers; NaN or
    Inf for a unit whose gradient is not finite.
  """
  return squared_norms_and_formed(plan, params, values, scale, size)[0]


def weighted_grad_sum(plan: GhostPlan, params: PyTree, values: LayerValues,
                      weights: jax.Array, keep: jax.Array, *,
                      formed: Optional[Sequence[Optional[jax.Array]]] = None,
                      formed_scale: Any = 1.0) -> PyTree:
  """`sum_u weights_u grad_u` over the units where `keep` is True.

  `grad_u` is unit u's gradient, the sum of its terms' gradients. A leaf
  whose per-unit gradients were formed by its rule (`formed`, from
  `squared_norms_and_formed`) sums exactly those, times
  `weights_u * formed_scale`, so that what is released is what was
  measured. Every other leaf's sum is the vector-Jacobian product of its
  one use at the cotangents `weights_u g_ut`, over every term of every unit
  at once (one matrix product per dense layer, as in a non-private backward
  pass). The other operands of the dropped units and their gradients (or
  formed gradients) are set to zero by `where` (so NaN rows contribute
  exactly zero).

  Example:
    >>> squared, formed = squared_norms_and_formed(plan, params, values,
    ...                                            1.0 / clip, batch_size)
    >>> total = weighted_grad_sum(plan, params, values, weights, keep,
    ...                           formed=formed, formed_scale=clip)

  Args:
    plan: the plan.
    params: the params.
    values: leading axes `[units, terms]`, as for `squared_norms`.
    weights: `[units]` per-unit weights (clip factors).
    keep: `[units]` bool, the units that contribute.
    formed: optional, per tap, the formed per-unit gradients or None.
    formed_scale: multiplies the formed gradients (`l2_clip`, undoing the
      `scale` they were formed with).

  Returns:
    A pytree like `params`, each leaf in its accumulation dtype (float32 or
    wider); zeros for unused leaves.
  """
  leaves = jax.tree_util.tree_leaves(params)
  sums = [jnp.zeros(jnp.shape(leaf), jnp.promote_types(leaf.dtype,
                                                        jnp.float32))
          for leaf in leaves]

  def rows(x):
    return x.reshape((-1,) + x.shape[2:])

  if formed is None:
    formed = (None,) * len(plan.taps)
  # A leaf whose per-unit gradient was formed (a shared leaf: from all its
  # uses at once) is released from that array alone.
  formed_leaves = {tap.leaf for tap, grads in zip(plan.taps, formed)
                   if grads is not None}
  for tap, others, g, grads in zip(plan.taps, values.others, values.grads,
                                   formed):
    if grads is None and tap.leaf in formed_leaves:
      continue
    if grads is not None:
      kept = jnp.where(keep.reshape((-1,) + (1,) * (grads.ndim - 1)), grads,
                       jnp.zeros((), grads.dtype))
      coefficients = jnp.where(keep, weights * formed_scale, 0.0)
      # Summed as the vmap path sums (products, a compensated pairwise sum,
      # no matrix product): its rounding is the one `clipping` charges.
      sums[tap.leaf] = rounding.weighted_row_sum(
          coefficients, kept.astype(sums[tap.leaf].dtype))[0]
      continue
    # Every term is one row of the vector-Jacobian product, weighted like
    # its unit (the number of terms may differ between taps).
    terms = g.shape[1]
    row_weights = jnp.repeat(weights, terms)
    row_keep = jnp.repeat(keep, terms)

    def rowwise(x, row_keep=row_keep):
      return row_keep.reshape((-1,) + (1,) * (x.ndim - 1))

    g = rows(g)
    cotangent = (jnp.where(rowwise(g), g, 0) * row_weights.reshape(
        (-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)).astype(
            _aval(plan.program.nodes[tap.node]).dtype)
    others = tuple(jnp.where(rowwise(o), o, jnp.zeros((), o.dtype))
                   for o in map(rows, others))
    leaf = leaves[tap.leaf]
    # `cotangent` rides along unused so that vmap always has a batched input
    # (a rule for a one-operand operation has no other operands).
    # At full float32 precision (not TF32, the default of float32 matmuls
    # on NVIDIA GPUs, nor bfloat16 passes): TF32 would round the clip
    # factors and the rows to 10 bits AFTER the norms were measured, and a
    # contribution could leave the clip by about 2^-11
    # (`tests/test_precision.py`).
    with jax.default_matmul_precision('highest'):
      _, vjp = jax.vjp(
          lambda p, tap=tap, others=others, c=cotangent: jax.vmap(
              lambda o, _: _apply_tap(plan.program, tap, p, o))(others, c),
          leaf)
      (grad,) = vjp(cotangent)
    # A shared leaf (tied weights) sums its uses' gradients.
    sums[tap.leaf] = sums[tap.leaf] + grad.astype(sums[tap.leaf].dtype)
  return jax.tree_util.tree_unflatten(plan.treedef, sums)


# ----------------------------------------------------------------------------
# Cost model: the form of each layer, and ghost or vmap for the whole loss.

# Flops that moving one float to or from memory costs, about (a per-unit
# gradient, formed on either path, is written once and read twice: for its
# norm and for the clipped sum).
_MEMORY_WEIGHT = 8.0
# The Gram form's released product is bounded by about K^1.5 u relative
# (`_gram_squared_norms`, step 4): beyond this many columns per unit the
# per-unit gradient is formed instead, whatever the flops.
_GRAM_MAX_COLUMNS = 256
# The memory `clipping_method='auto'` lets per-example gradients take (bytes): above
# it the ghost path is taken whatever the estimates say (1 GiB).
DEFAULT_MEMORY_BUDGET = 2**30


class TapEstimate(NamedTuple):
  """The cost model's view of one tap, per unit (flop-equivalents).

  Attributes:
    leaf: the params leaf index.
    rule: the layer rule's name.
    form: 'gram' (Gram form, no per-unit gradient) or 'materialized' (the
      per-unit gradient of the leaf is formed).
    gram: cost of the Gram form (its norms and its share of the clipped
      sum), or None where the rule has none.
    materialized: cost of forming the per-unit gradient (flops, plus
      `_MEMORY_WEIGHT` per float written or read).
    ghost: cost on the ghost path: the chosen form, plus for the Gram form
      reading the tap's operands and output gradients again in the
      re-weighted pass.
    vmap: cost of the leaf's per-example gradients on the vmap path.
  """

  leaf: int
  rule: str
  form: str
  gram: Optional[float]
  materialized: float
  ghost: float
  vmap: float


class ClippingChoice(NamedTuple):
  """What `clipping_method='auto'` does with a loss, and why.

  Attributes:
    path: 'ghost' or 'vmap' (the cheaper by the estimates, or 'ghost' when
      the vmap path's per-example gradients would exceed the memory budget).
    ghost: estimated cost of the ghost path (sum over taps, all units).
    vmap: estimated cost of the vmap path (alike).
    taps: one `TapEstimate` per tap, costs for all units.
    per_example_bytes: the memory the vmap path's per-example gradients of
      every params leaf take (parameter bytes x rows held at once).
    memory_budget: the budget they were held to (bytes; None: none).
    reason: 'cost' (the estimates decided) or 'memory budget'.
  """

  path: str
  ghost: float
  vmap: float
  taps: tuple[TapEstimate, ...]
  per_example_bytes: int = 0
  memory_budget: Optional[int] = None
  reason: str = 'cost'


def validate_memory_budget(memory_budget: Optional[int]) -> Optional[int]:
  """`memory_budget` as an int of bytes (or None), or a clear error.

  Example:
    >>> validate_memory_budget(4 * 2**30)
    4294967296

  Raises:
    ValueError: unless None or a positive number of bytes.
  """
  if memory_budget is None:
    return None
  if (isinstance(memory_budget, bool) or
      not isinstance(memory_budget, (int, np.integer)) or memory_budget < 1):
    raise ValueError('memory_budget must be a positive number of bytes or '
                     f'None, got {memory_budget!r}')
  return int(memory_budget)


def per_example_gradient_bytes(plan: GhostPlan, rows: int) -> int:
  """Bytes of `rows` per-example gradients of every params leaf.

  What the vmap path holds at once: one params-sized gradient per example
  (per unit) of a block of `rows`, in the params' dtypes.

  Example:
    >>> per_example_gradient_bytes(analyze(loss_fn, params, batch), 32)

  Args:
    plan: from `analyze`.
    rows: the examples (units) whose gradients are held at once.

  Returns:
    The byte count.
  """
  return int(rows) * int(plan.params_bytes)


def _tap_estimate(tap: Tap, program: _Program, terms: int) -> TapEstimate:
  """Per-unit costs of the forms of one tap (see `clipping_choice`)."""
  kappa = _MEMORY_WEIGHT
  node = program.nodes[tap.node]
  eqn = node.eqn
  out = _size(_aval(node).shape)
  leaf = _size(tap.chain[0].eqn.invars[0].aval.shape if tap.chain else
               eqn.invars[tap.position].aval.shape)
  others = sum(_size(v.aval.shape) for i, v in enumerate(eqn.invars)
               if i != tap.position)
  # The ghost path's second (re-weighted) pass reads a Gram-form tap's
  # operands and output gradients again. A formed tap reads them once, to
  # form its per-unit gradient, as the vmap path's per-example backward
  # pass does: the two paths then cost the same, and nothing is charged.
  record = kappa * terms * (others + out)
  gram = None
  if tap.rule == 'gather':
    vocabulary, features = eqn.invars[0].aval.shape
    columns = terms * (out // features)
    gram = columns * columns * (features + 8) + columns * features
    flops = columns * features
    materialized = flops + 3 * kappa * vocabulary * features
    vmap = flops + 3 * kappa * terms * vocabulary * features
  else:
    if tap.rule == 'dot_general':
      batch, positions, contract, features = _dense_dims(tap, program)
    elif tap.rule == 'conv_general_dilated':
      batch, positions, contract, features = _conv_dims(tap, program)
    else:   # a bias or a scale: one product per output entry
      batch, positions, contract, features = 1, max(1, out // leaf), 1, leaf
    columns = terms * positions
    flops = batch * columns * contract * features
    materialized = flops + 3 * kappa * batch * contract * features
    vmap = flops + 3 * kappa * terms * batch * contract * features
    bilinear = (tap.rule == 'dot_general' and _norm_preserving(tap.chain)) or (
        tap.rule == 'conv_general_dilated' and
        _conv_geometry_supported(tap, program))
    if bilinear and columns <= _GRAM_MAX_COLUMNS:
      gram = (batch * columns * columns * (contract + features + 8) + flops)
      if tap.rule == 'conv_general_dilated':   # the unfolded patches
        gram += kappa * batch * columns * contract
  form = 'gram' if gram is not None and gram <= materialized else (
      'materialized')
  ghost = gram + record if form == 'gram' else materialized
  return TapEstimate(tap.leaf, tap.rule, form, gram, materialized, ghost,
                     vmap)


def clipping_choice(plan: GhostPlan, units: int,
                    terms: Union[int, Sequence[int]] = 1, *,
                    rows: Optional[int] = None,
                    memory_budget: Optional[int] = DEFAULT_MEMORY_BUDGET
                    ) -> ClippingChoice:
  """The form of each layer, and whether the ghost path pays, by cost.

  A flop-and-memory estimate in the spirit of mixed ghost clipping (Li et
  al. 2021, "Large language models can be strong differentially private
  learners"; Bu et al. 2023, "Differentially private optimization on large
  model at small cost", book-keeping), per unit, summed over units:

  * a dense layer over K columns (a unit's positions and terms), C inputs
    and F outputs (per shared batch index; a convolution: C the patch
    length, K the output positions): the Gram form costs
    `K^2 (C + F + 8)` (its Gram matrices and bound) plus `K C F` (its
    share of the clipped sum, a matrix product as in a non-private step,
    plus `_MEMORY_WEIGHT K C` for a convolution's unfolded patches); the
    formed per-unit gradient costs `K C F` plus `3 _MEMORY_WEIGHT C F`
    (written once, read for its norm and for the clipped sum). The Gram
    form is taken when cheaper and K is at most `_GRAM_MAX_COLUMNS` (its
    rounding bound);
  * an embedding of V rows of F over K looked-up positions: token-equality
    Gram form `K^2 (F + 8) + K F`, formed table gradient
    `K F + 3 _MEMORY_WEIGHT V F`;
  * biases and scales: formed (`out + 3 _MEMORY_WEIGHT leaf`);
  * the ghost path also reads a Gram-form tap's operands and output
    gradients again in its re-weighted pass (`_MEMORY_WEIGHT` per float); a
    formed tap reads them once, as the vmap path does;
  * the vmap path forms every term's per-example gradient of every leaf:
    the same flops as the formed form, and `3 _MEMORY_WEIGHT` per entry per
    term. A loss whose every layer is formed on the ghost path costs the
    same on both paths.

  The forward pass and the backward pass through the activations are
  common to both paths and left out. `clipping_method='auto'` takes the
  vmap path when its estimate is not above the ghost path's; then no
  warning is issued (it is a choice, not a failure).

  A memory budget comes first: when the vmap path's per-example gradients
  (the parameter bytes times the `rows` held at once,
  `per_example_gradient_bytes`) exceed `memory_budget`, the ghost path is
  taken whatever the estimates say (`reason='memory budget'`). The default,
  `DEFAULT_MEMORY_BUDGET`, is 1 GiB: a GPT-style decoder of 35.8M float32
  parameters at 32 sequences would hold 4.6 GB of per-example gradients.

  Example:
    >>> plan = analyze(loss_fn, params, batch)
    >>> choice = clipping_choice(plan, units=batch_size)
    >>> choice.path, [(t.rule, t.form) for t in choice.taps]
    ('ghost', [('gather', 'gram'), ('dot_general', 'materialized'), ...])

  Args:
    plan: from `analyze`.
    units: the number of units (examples, differences, users) per call.
    terms: the terms per unit, one for all taps or one per tap (2 for a
      difference where the tap's operands depend on the params, the items
      per user).
    rows: the units whose per-example gradients the vmap path holds at once
      (the microbatch size); default `units`.
    memory_budget: bytes the vmap path's per-example gradients may take
      (None: no budget, the estimates alone decide).

  Returns:
    A `ClippingChoice`.

  Raises:
    ValueError: for a non-positive `units`, `terms` or `rows`, a `terms`
      sequence whose length is not the number of taps, or a bad
      `memory_budget`.
  """
  if isinstance(terms, int):
    terms = (terms,) * len(plan.taps)
  terms = tuple(terms)
  if len(terms) != len(plan.taps):
    raise ValueError(f'terms has {len(terms)} entries for {len(plan.taps)} '
                     'taps')
  if int(units) < 1 or any(int(t) < 1 for t in terms):
    raise ValueError(f'units and terms must be positive, got {units} and '
                     f'{terms}')
  taps = []
  for tap, count in zip(plan.taps, terms):
    estimate = _tap_estimate(tap, plan.program, int(count))
    scaled = {name: None if value is None else float(units) * value
              for name, value in estimate._asdict().items()
              if name in ('gram', 'materialized', 'ghost', 'vmap')}
    taps.append(estimate._replace(**scaled))
  ghost_cost = sum(t.ghost for t in taps)
  vmap_cost = sum(t.vmap for t in taps)
  memory_budget = validate_memory_budget(memory_budget)
  rows = int(units) if rows is None else int(rows)
  if rows < 1:
    raise ValueError(f'rows must be positive, got {rows}')
  held = per_example_gradient_bytes(plan, min(rows, int(units)))
  if memory_budget is not None and held > memory_budget:
    path, reason = 'ghost', 'memory budget'
  else:
    path, reason = ('ghost' if ghost_cost < vmap_cost else 'vmap'), 'cost'
  return ClippingChoice(path, ghost_cost, vmap_cost, tuple(taps), held,
                        memory_budget, reason)
