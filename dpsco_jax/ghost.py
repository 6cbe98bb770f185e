"""Ghost-norm clipping: per-example gradient norms without per-example gradients.

A clipped gradient sum `sum_i min(1, C / ||g_i||) g_i` needs each example's
gradient NORM, not the gradient itself. For the layers that hold most
parameters the norm follows from two quantities an ordinary backward pass
already has: the layer's input `a_i` and the gradient of the loss at the
layer's output `g_i` (notes/fast-clipping.md):

* dense layer, no sequence axis: `||a_i g_i^T||_F^2 = ||a_i||^2 ||g_i||^2`;
* dense layer over positions p: `sum_{p,q} (a_ip . a_iq)(g_ip . g_iq)` (the
  Gram form) when that is cheaper than materializing the `d_in x d_out`
  per-example gradient, else the per-example gradient of that layer alone;
* bias add and elementwise scale: the per-example gradient of that
  parameter (small) is materialized;
* embedding lookup (a `gather` of whole rows of a 2-D table): the
  token-equality Gram form `sum_{p,q} [i_p = i_q] (g_p . g_q)`;
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
gradients, formed for that leaf alone (`_shared_squared_norms`).

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
   layer, as in a non-private backward pass). This equals the backward pass
   of `sum_i w_i loss_i` with the weights held constant, without a second
   forward pass. Rows dropped by the mask or for a non-finite norm are
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
A rule only computes per-example squared norms; the clipped sum is the
generic vector-Jacobian product and needs nothing new.

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
      sum of its uses' gradients (`_shared_squared_norms`), not the rule's.
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
    squared_norms: `squared_norms(tap, program, leaf, others, g) -> [U]`, the
      per-unit squared norms of the leaf's gradient, in float32 or wider.
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
  """

  program: _Program
  taps: tuple[Tap, ...]
  num_leaves: int
  treedef: Any


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


def _apply_tap(program: _Program, tap: Tap, leaf: jax.Array,
               others: Sequence[Any]) -> jax.Array:
  """The tapped operation as a function of the leaf, other operands fixed."""
  value = leaf
  for node in tap.chain:
    (value,) = _bind(node.eqn, [value])
  operands = list(others)
  operands.insert(tap.position, value)
  return _bind(program.nodes[tap.node].eqn, operands)[0]


def _sum_squares(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)))


def _materialized_squared_norms(tap: Tap, program: _Program, leaf: jax.Array,
                                others: Sequence[jax.Array],
                                g: jax.Array) -> jax.Array:
  """Squared norms of per-unit gradients of ONE leaf, materialized.

  The gradient of the leaf through its single use is the vector-Jacobian
  product of that use at the output gradient; taken over a unit's terms at
  once (the product of a vmapped use sums over them) and vmapped over units,
  it is the per-unit gradient of this leaf only (cheap for biases and
  scales).
  """
  dtype = _aval(program.nodes[tap.node]).dtype

  def one(others_u, g_u):
    # `g_u` rides along so that the inner vmap always has a batched input.
    _, vjp = jax.vjp(lambda p: jax.vmap(
        lambda o, _: _apply_tap(program, tap, p, o))(others_u, g_u), leaf)
    return vjp(g_u.astype(dtype))[0]

  others = tuple(others)
  squared = _sum_squares(jax.vmap(one)(others, g))
  # The gradient is a sum of products of the operands and the output
  # gradients (a bias: of the output gradients over positions and terms).
  # When they cancel (an example built so), its rounding, and that of the
  # weighted sum formed later in another order, can be far above the
  # gradient itself: the same products with absolute values bound every
  # entry's terms, and the margin of `_with_rounding_margin` covers both.
  magnitude = jnp.abs(jax.vmap(one)(
      tuple(jnp.abs(o) if jnp.issubdtype(o.dtype, jnp.inexact) else o
            for o in others), jnp.abs(g)))
  per_unit, entries = _size(g.shape[1:]), max(1, _size(jnp.shape(leaf)))
  if tap.rule in ('add', 'sub', 'mul'):
    # Each parameter entry sums the output-gradient entries broadcast onto it.
    terms = max(1, per_unit // entries)
  else:
    terms = per_unit + sum(_size(o.shape[1:]) for o in others)
  # Each entry of the computed gradient (and of its share of the weighted
  # sum) is within gamma_terms of the truth, relative to its absolute-value
  # counterpart S; the squared norm adds gamma_entries. As for dense layers
  # (`_with_rounding_margin`), adding 2 (terms + entries + 8) u |S|^2 bounds
  # (|M| + gamma_terms |S|)^2 from above.
  roundoff = float(jnp.finfo(jnp.promote_types(dtype, jnp.float32)).eps) / 2
  return squared + 2.0 * (terms + entries + 8) * roundoff * _sum_squares(
      magnitude)


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


# Up to this many positions (a unit's terms included) the Gram matrices are
# formed by broadcasting rather than by matrix products.
_FEW_POSITIONS = 4


def _norm(x: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.sum(jnp.square(x), axis=-1))


def _with_rounding_margin(squared: jax.Array, magnitude: jax.Array, *,
                          contract: int, features: int, columns: int,
                          dtype: Any, gram: bool = True) -> jax.Array:
  """A squared norm raised by a bound on its rounding error: never below
  the truth, so rounding never lets a contribution past the clip.

  The dense layer's per-unit gradient is `M = sum_k a_k g_k^T` over its
  columns k (positions, the terms of a difference in the sum/difference
  basis), for each shared batch index. Its squared norm is computed as a
  sum of products of both signs (the Gram form, the cross terms), or as the
  squared entries of `A^T G`. With `S = sum_k |a_k| |g_k|` (summed in
  squares over the batch indices), standard bounds on floating-point dot
  products (`|fl(x . y) - x . y| <= gamma_n |x| |y|`, `gamma_n ~ n u`, u the
  unit roundoff, whatever the summation order) put the computed value
  within `(gamma_C + gamma_F + gamma_{K^2} + ...) S^2` of `|M|^2`, and the
  clipped contribution, itself a product over the K columns, within
  `gamma_K S` of `M`. Adding `2 (C + F + K^2 + 2 K + 8) u S^2` therefore
  bounds `(|M| + gamma_K S)^2` from above: the contribution scaled by the
  clip factor computed from it has norm at most the clip. When the terms
  do not cancel, S^2 is about |M|^2 and the margin is a relative
  `~1e-4` (clipping that much earlier); when they cancel (positions or
  points built to cancel), the margin dominates and such units are clipped
  hard rather than under-measured (`tests/test_ghost_rounding.py`).

  When `M` itself is formed (`gram=False`: the squared entries of `A^T G`),
  only its entries are signed sums, each within `gamma_K` of its
  absolute-value counterpart, so `|M| <= |fl(M)| + gamma_K S` and
  `2 (2 K + 8) u S^2` suffices; the K^2 pair sum is not formed. (The final
  sum of squares adds non-negative terms: its rounding is relative to the
  norm itself, as in every path's norm, the vmap path's included, and
  cancellation cannot hide a norm there.) With hundreds of positions (a
  convolution's output positions) the Gram bound's `K^2 u` would be a
  relative few percent; this one stays near `1e-4`.

  Args:
    squared: `[units]` computed squared norms.
    magnitude: `[units, batch]` `S` per shared batch index.
    contract, features: C and F, the dense layer's dot-product lengths.
    columns: K, the columns summed per unit.
    dtype: the accumulation dtype (its unit roundoff is used).
    gram: whether the squared norm was a sum over pairs of columns (Gram
      form, cross terms) rather than the squared entries of the formed `M`.

  Returns:
    `[units]` squared norms plus the margin.
  """
  roundoff = float(jnp.finfo(dtype).eps) / 2
  if gram:
    terms = contract + features + columns * columns + 2 * columns + 8
  else:
    terms = 2 * columns + 8
  factor = 2.0 * terms * roundoff
  return squared + factor * jnp.sum(jnp.square(magnitude), axis=-1)


def _dense_squared_norms(tap: Tap, program: _Program, leaf: jax.Array,
                         others: Sequence[jax.Array],
                         g: jax.Array) -> jax.Array:
  """Per-unit squared norms of a dense (`dot_general`) weight's gradient.

  With the activation as `A: [batch, P, C]` (P positions: the activation's
  free axes) and the output gradient as `G: [batch, P, F]` for each of a
  unit's T terms, the weight's per-unit gradient is `sum_batch A^T G` with
  the terms' positions taken together (P' = T P positions); its squared norm
  is `sum_{p,q} (a_p . a_q)(g_p . g_q)` over those P' (Gram form,
  O(P'^2 (C + F))) or the squared entries of `A^T G` (O(P' C F)), whichever
  the shapes make cheaper.

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
  if not _norm_preserving(tap.chain):
    return _materialized_squared_norms(tap, program, leaf, others, g)
  (a,) = others
  a_perm, g_perm, num_batch, num_free_a = _dense_layout(tap, program)
  acc = jnp.promote_types(jnp.promote_types(a.dtype, g.dtype), jnp.float32)
  a = jnp.transpose(a.astype(acc), (0, 1, *(2 + d for d in a_perm)))
  g = jnp.transpose(g.astype(acc), (0, 1, *(2 + d for d in g_perm)))
  units, terms = a.shape[:2]
  batch = _size(a.shape[2:2 + num_batch])
  positions = _size(a.shape[2 + num_batch:2 + num_batch + num_free_a])
  contract = _size(a.shape[2 + num_batch + num_free_a:])
  features = _size(g.shape[2 + num_batch + num_free_a:])
  a = a.reshape(units, terms, batch, positions, contract)
  g = g.reshape(units, terms, batch, positions, features)
  return _bilinear_squared_norms(a, g)


def _bilinear_squared_norms(a: jax.Array, g: jax.Array) -> jax.Array:
  """Per-unit `||sum_{t,p} a_tp g_tp^T||_F^2`, summed over shared indices.

  The one computation behind every layer whose gradient is a sum of outer
  products of an input column and an output-gradient column: a dense layer
  (columns: its positions) and a convolution (columns: the unfolded input
  patches at each output position).

  Args:
    a: `[units, terms, batch, positions, contract]` inputs, in the
      accumulation dtype.
    g: `[units, terms, batch, positions, features]` output gradients, alike.

  Returns:
    `[units]` squared norms plus the rounding margin
    (`_with_rounding_margin`), so never below the truth.
  """
  acc = a.dtype
  units, terms, batch, positions, contract = a.shape
  features = g.shape[-1]
  gram = (terms * positions) * (contract + features) <= contract * features
  if terms * positions == 1 or (gram and
                                terms * positions <= _FEW_POSITIONS):
    # A few positions (a plain dense layer; a difference without sequence
    # axis): one fused product-and-sum per pair of columns, each a pass
    # over slices of `a` and `g`. Stacking the columns first, or an einsum
    # (many tiny matrix products), measured several times slower on CPU.
    cols_a = [a[:, t, :, p] for t in range(terms) for p in range(positions)]
    cols_g = [g[:, t, :, p] for t in range(terms) for p in range(positions)]
    total = 0.0
    for p, (ap, gp) in enumerate(zip(cols_a, cols_g)):
      for aq, gq in zip(cols_a[p:], cols_g[p:]):
        both = 1.0 if aq is ap else 2.0   # (p, q) and (q, p)
        total = total + both * (jnp.sum(ap * aq, axis=-1) *
                                jnp.sum(gp * gq, axis=-1))
    magnitude = sum(_norm(ap) * _norm(gp) for ap, gp in zip(cols_a, cols_g))
    return _with_rounding_margin(
        jnp.sum(total, axis=1), magnitude, contract=contract,
        features=features, columns=len(cols_a), dtype=acc)
  # A unit's terms are more positions of the same layer.
  positions *= terms
  a = jnp.swapaxes(a, 1, 2).reshape(units, batch, positions, contract)
  g = jnp.swapaxes(g, 1, 2).reshape(units, batch, positions, features)
  # Full float32 products even where the default matmul precision is lower
  # (TPU): the rounding margin below assumes them.
  highest = jax.lax.Precision.HIGHEST
  if gram:
    gram_a = jnp.einsum('nbpc,nbqc->nbpq', a, a, precision=highest)
    gram_g = jnp.einsum('nbpf,nbqf->nbpq', g, g, precision=highest)
    squared = jnp.sum(gram_a * gram_g, axis=(1, 2, 3))
  else:
    per_unit = jnp.einsum('nbpc,nbpf->nbcf', a, g, precision=highest)
    squared = jnp.sum(jnp.square(per_unit), axis=(1, 2, 3))
  magnitude = jnp.sum(_norm(a) * _norm(g), axis=2)
  return _with_rounding_margin(squared, magnitude, contract=contract,
                               features=features, columns=positions,
                               dtype=acc, gram=gram)


def _conv_squared_norms(tap: Tap, program: _Program, leaf: jax.Array,
                        others: Sequence[jax.Array],
                        g: jax.Array) -> jax.Array:
  """Per-unit squared norms of a convolution kernel's gradient.

  Unfolding the input into the patches each output position sees (im2col)
  makes the convolution a dense layer over the output positions: the
  kernel's per-unit gradient is `sum_p patch_p g_p^T` (for grouped and
  depthwise convolutions, one such block per group, as a shared batch
  index), with the patch length `C_in/G * prod(window)` as the contracting
  size. `_bilinear_squared_norms` then takes the Gram form over positions
  or the per-unit `patch x C_out` gradient, whichever the shapes make
  cheaper (usually the latter: many positions, small patches). The order of
  a patch's entries need not match the kernel's layout: a norm does not
  depend on it, and the clipped sum is the convolution's own
  vector-Jacobian product (`weighted_grad_sum`).

  A kernel that is resized before use, a convolution with
  `batch_group_count > 1` or one whose parameter is the convolved input
  takes the per-unit gradient of that leaf alone (still exact, slower).
  """
  eqn = program.nodes[tap.node].eqn
  params = eqn.params
  if (tap.position != 1 or params['batch_group_count'] != 1 or
      not _norm_preserving(tap.chain)):
    return _materialized_squared_norms(tap, program, leaf, others, g)
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

  return _bilinear_squared_norms(columns(patches),
                                 columns(g.reshape(flat.shape[:1] +
                                                   g.shape[2:]).astype(acc)))


def dense_uses_gram(tap: Tap, plan: GhostPlan,
                    terms: int = 1) -> Optional[bool]:
  """Whether a dense tap's norms use the Gram form (None: not dense/identity).

  Args:
    tap: a tap of `plan`.
    plan: the plan.
    terms: the terms per unit (1: examples, 2: differences, items per user).

  Returns:
    True for the Gram form, False for the per-example `d_in x d_out`
    materialization, None when the tap is not a norm-preserving dense use
    with positions (a plain dense layer, a bias, a scale).
  """
  if tap.rule != 'dot_general' or not _norm_preserving(tap.chain):
    return None
  eqn = plan.program.nodes[tap.node].eqn
  a_perm, g_perm, num_batch, num_free_a = _dense_layout(tap, plan.program)
  a_shape = [eqn.invars[1 - tap.position].aval.shape[d] for d in a_perm]
  g_shape = [_aval(plan.program.nodes[tap.node]).shape[d] for d in g_perm]
  positions = terms * _size(a_shape[num_batch:num_batch + num_free_a])
  if positions == 1:
    return None
  contract = _size(a_shape[num_batch + num_free_a:])
  features = _size(g_shape[num_batch + num_free_a:])
  return positions * (contract + features) <= contract * features


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
                             g: jax.Array) -> jax.Array:
  """Per-unit squared norms of an embedding table's gradient.

  The table's per-unit gradient is `M = sum_p e_{i_p} g_p^T` over the unit's
  positions p (its terms' positions together), i_p the row looked up: rows
  looked up twice add. Its squared norm is the token-equality Gram form
  `sum_{p,q} [i_p = i_q] (g_p . g_q)`, O(P^2 F) per unit instead of the
  `V x F` table per unit.

  An id outside the table (`0 <= i < V` fails) is clamped, filled or
  dropped depending on the lookup's mode and the backend; whatever happens
  to it, its row of `M` changes by at most `||g_p||` in norm, so the norm
  used is the in-table part plus `sum ||g_p||` over such positions (the
  triangle inequality): never below the truth.
  """
  del leaf
  (ids,) = others
  vocabulary = program.nodes[tap.node].eqn.invars[0].aval.shape[0]
  acc = jnp.promote_types(g.dtype, jnp.float32)
  units, features = g.shape[0], g.shape[-1]
  ids = ids.reshape(units, -1)
  g = g.astype(acc).reshape(units, ids.shape[1], features)
  inside = (ids >= 0) & (ids < vocabulary)
  g_inside = jnp.where(inside[..., None], g, 0.0)
  gram = jnp.einsum('upf,uqf->upq', g_inside, g_inside,
                    precision=jax.lax.Precision.HIGHEST)
  same = ids[:, :, None] == ids[:, None, :]
  squared = jnp.sum(jnp.where(same, gram, 0.0), axis=(1, 2))
  norms = _norm(g)
  # Each position is a column `e_{i_p} g_p^T` with |e_{i_p}| = 1: the dense
  # layer's rounding bound with C = 1 and K = P columns.
  squared = _with_rounding_margin(
      squared, jnp.sum(jnp.where(inside, norms, 0.0), axis=1, keepdims=True),
      contract=1, features=features, columns=ids.shape[1], dtype=acc)
  outside = jnp.sum(jnp.where(inside, 0.0, norms), axis=1)
  return jnp.square(jnp.sqrt(squared) + outside)


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
  return GhostPlan(program, taps, len(leaves), treedef)


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


def _shared_squared_norms(program: _Program, leaf: jax.Array,
                          uses: Sequence[tuple[Tap, Any, Any]]) -> jax.Array:
  """Per-unit squared norms of a leaf used several times (tied weights).

  The leaf's gradient is the sum over its uses of each use's
  vector-Jacobian product at the gradient at that use's output, the other
  operands held fixed (the chain rule, all uses at once; `weighted_grad_sum`
  forms the clipped sum the same way). Its squared norm has cross terms
  between the uses that no single layer rule sees, so the per-unit gradient
  of this leaf alone is formed, summed over the uses and squared: exact, at
  the cost of one leaf-sized gradient per unit (the per-example gradient of
  the vmap path, for this leaf only).

  Rounding: each entry of a use's gradient is a sum of products within
  `gamma_n S_k` of the truth (`_materialized_squared_norms`: the same
  products with absolute values give S_k), adding the K uses' gradients
  adds `gamma_K`, and the clipped sum forms the same sums in another order.
  With `S = sum_k S_k` and n the uses' terms added up, adding
  `2 (n + K + entries + 8) u |S|^2` bounds `(|M| + gamma_{n+K} |S|)^2`
  from above, as for one use.

  Args:
    program: the flattened loss.
    leaf: the params leaf.
    uses: `(tap, others, g)` per use, with leading axes `[U, T]` (T may
      differ between uses) and `g` already scaled.

  Returns:
    `[U]` squared norms plus the rounding margin, never below the truth.
  """
  gradient, magnitude, terms = 0.0, 0.0, len(uses)
  entries = max(1, _size(jnp.shape(leaf)))
  for tap, others, g in uses:
    dtype = _aval(program.nodes[tap.node]).dtype

    def one(others_u, g_u, tap=tap, dtype=dtype):
      # `g_u` rides along so that the inner vmap always has a batched input.
      _, vjp = jax.vjp(lambda p: jax.vmap(
          lambda o, _: _apply_tap(program, tap, p, o))(others_u, g_u), leaf)
      (grad,) = vjp(g_u.astype(dtype))
      return grad.astype(jnp.promote_types(grad.dtype, jnp.float32))

    others = tuple(others)
    gradient = gradient + jax.vmap(one)(others, g)
    magnitude = magnitude + jnp.abs(jax.vmap(one)(
        tuple(jnp.abs(o) if jnp.issubdtype(o.dtype, jnp.inexact) else o
              for o in others), jnp.abs(g)))
    per_unit = _size(g.shape[1:])
    terms += (max(1, per_unit // entries) if tap.rule in ('add', 'sub', 'mul')
              else per_unit + sum(_size(o.shape[1:]) for o in others))
  roundoff = float(jnp.finfo(gradient.dtype).eps) / 2
  return _sum_squares(gradient) + 2.0 * (terms + entries + 8) * roundoff * (
      _sum_squares(magnitude))


def squared_norms(plan: GhostPlan, params: PyTree, values: LayerValues,
                  scale: Any, size: int) -> jax.Array:
  """Per-unit squared global gradient norms, times `scale**2`.

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
  leaves = jax.tree_util.tree_leaves(params)
  total = jnp.zeros((size,), jnp.float32)
  shared: dict[int, list[tuple[Tap, Any, Any]]] = {}
  for tap, others, g in zip(plan.taps, values.others, values.grads):
    g = g.astype(jnp.promote_types(g.dtype, jnp.float32)) * scale
    if tap.shared:   # the norm of the sum of its uses, below
      shared.setdefault(tap.leaf, []).append((tap, others, g))
      continue
    rule = LAYER_RULES[tap.rule]
    layer = rule.squared_norms(tap, plan.program, leaves[tap.leaf], others, g)
    # A Gram form sums products of both signs: rounding can take an exact 0
    # (a difference at x' = x, a = b) slightly below it, and rsqrt of a
    # negative number would be NaN. `maximum` keeps NaN (dropped rows).
    total = total + jnp.maximum(layer, 0.0)
  for leaf, uses in shared.items():
    total = total + _shared_squared_norms(plan.program, leaves[leaf], uses)
  return total


def weighted_grad_sum(plan: GhostPlan, params: PyTree, values: LayerValues,
                      weights: jax.Array, keep: jax.Array) -> PyTree:
  """`sum_u weights_u grad_u` over the units where `keep` is True.

  `grad_u` is unit u's gradient, the sum of its terms' gradients. Each
  leaf's sum is the vector-Jacobian product of its one use at the
  cotangents `weights_u g_ut`, over every term of every unit at once (one
  matrix product per dense layer, as in a non-private backward pass), with
  the other operands of the dropped units and their gradients set to zero
  by `where` (so NaN rows contribute exactly zero).

  Args:
    plan: the plan.
    params: the params.
    values: leading axes `[units, terms]`, as for `squared_norms`.
    weights: `[units]` per-unit weights (clip factors).
    keep: `[units]` bool, the units that contribute.

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

  for tap, others, g in zip(plan.taps, values.others, values.grads):
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
    _, vjp = jax.vjp(
        lambda p, tap=tap, others=others, c=cotangent: jax.vmap(
            lambda o, _: _apply_tap(plan.program, tap, p, o))(others, c),
        leaf)
    (grad,) = vjp(cotangent)
    # A shared leaf (tied weights) sums its uses' gradients.
    sums[tap.leaf] = sums[tap.leaf] + grad.astype(sums[tap.leaf].dtype)
  return jax.tree_util.tree_unflatten(plan.treedef, sums)
