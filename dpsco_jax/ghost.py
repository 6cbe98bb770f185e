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

The pieces: `dpsco_jax.ghost_program` (the flattened program, `Tap`,
`GhostPlan`), `dpsco_jax.ghost_rules` (the layer rules and their rounding
bounds), `dpsco_jax.ghost_cost` (the cost model, `clipping_choice`) and this
module (the analysis and the passes), which re-exports the public names.

Example:
  >>> stat = dpsco_jax.clipped_grad_sum(loss_fn, l2_clip=1.0)  # 'auto'
  >>> out = stat(batch, params)           # ghost path when the loss qualifies
  >>> plan = analyze(loss_fn, params, batch)   # what was recognized
  >>> [tap.rule for tap in plan.taps]
  ['dot_general', 'add', 'dot_general', 'add']
"""

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from dpsco_jax import rounding
from dpsco_jax.ghost_program import _Atom
from dpsco_jax.ghost_program import _aval
from dpsco_jax.ghost_program import _bind
from dpsco_jax.ghost_program import _flatten
from dpsco_jax.ghost_program import GhostClippingUnsupported
from dpsco_jax.ghost_program import GhostPlan
from dpsco_jax.ghost_program import _is_var
from dpsco_jax.ghost_program import _Node
from dpsco_jax.ghost_program import _OPAQUE_CONTROL_FLOW
from dpsco_jax.ghost_program import _Program
from dpsco_jax.ghost_program import PyTree
from dpsco_jax.ghost_program import _size
from dpsco_jax.ghost_program import _STRUCTURAL
from dpsco_jax.ghost_program import Tap
from dpsco_jax.ghost_rules import _apply_tap
from dpsco_jax.ghost_rules import _formed_grads
from dpsco_jax.ghost_rules import _formed_squared_norms
from dpsco_jax.ghost_rules import LAYER_RULES
from dpsco_jax.ghost_rules import LayerNorms
from dpsco_jax.ghost_rules import _LINEAR_IN_COTANGENT
# pylint: disable=unused-import
# Re-exported: `ghost.X` is the name users and the library write.
from dpsco_jax.ghost_cost import clipping_choice
from dpsco_jax.ghost_cost import ClippingChoice
from dpsco_jax.ghost_cost import DEFAULT_MEMORY_BUDGET
from dpsco_jax.ghost_cost import dense_uses_gram
from dpsco_jax.ghost_cost import per_example_gradient_bytes
from dpsco_jax.ghost_cost import TapEstimate
from dpsco_jax.ghost_cost import validate_memory_budget
from dpsco_jax.ghost_program import LayerRule
# pylint: enable=unused-import

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


__all__ = ('analyze', 'clipping_choice', 'ClippingChoice', 'dense_uses_gram',
           'describe_error', 'difference_terms', 'GhostClippingUnsupported',
           'GhostPlan', 'gradient_terms', 'layer_values', 'LayerNorms',
           'LayerRule', 'LayerValues', 'mean_terms',
           'per_example_gradient_bytes', 'squared_norms',
           'squared_norms_and_formed', 'Tap', 'TapEstimate',
           'validate_memory_budget', 'weighted_grad_sum')
