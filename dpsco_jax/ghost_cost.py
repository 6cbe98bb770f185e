"""The ghost path's cost model: the form of each layer, ghost or vmap.

`clipping_choice` estimates, per tap, the flops and memory traffic of the
Gram form and of the formed per-unit gradient, and for the whole loss those
of the ghost and the vmap paths, under a memory budget for the vmap path's
per-example gradients; `dense_uses_gram` reads the form of one dense tap.
`dpsco_jax.ghost` re-exports the public names.
"""

from typing import NamedTuple, Optional, Sequence, Union

import numpy as np

from dpsco_jax.ghost_program import _aval
from dpsco_jax.ghost_program import _conv_dims
from dpsco_jax.ghost_program import _conv_geometry_supported
from dpsco_jax.ghost_program import _dense_dims
from dpsco_jax.ghost_program import GhostPlan
from dpsco_jax.ghost_program import _norm_preserving
from dpsco_jax.ghost_program import _Program
from dpsco_jax.ghost_program import _size
from dpsco_jax.ghost_program import Tap

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
