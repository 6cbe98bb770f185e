"""The program ghost norms read: a loss traced to a flat jaxpr, and its taps.

`analyze` (in `dpsco_jax.ghost`) traces `loss_fn(params, example)` to a
jaxpr; this module holds what that analysis produces and reads:

* `_flatten`: the jaxpr with nested `jit` calls inlined and variables
  numbered (`_Program` of `_Node`s, constants as `_Const`);
* `Tap`: one parameter use a layer rule handles; `GhostPlan`: the taps of
  one loss; `LayerRule`: what a rule provides (`dpsco_jax.ghost_rules`);
* the shapes of a dense or convolution tap (`_dense_layout`, `_dense_dims`,
  `_conv_dims`), which the rules and the cost model share.

`dpsco_jax.ghost` re-exports the public names.
"""

import dataclasses
import itertools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.extend.core as jex


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
# The shapes of a tap.


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
