"""Binary-tree (continual counting) noise, paper 001 Lemma 4.3.

`tree` streams the noise of a binary tree of Gaussian nodes (per-step
residuals or prefix sums, restarts, the Honaker variant); its encoder and
decoder matrices are `tree_encoder_matrix` and `tree_decoder_matrix`. One
step's noise is one small function per case (`_residual_noise`,
`_regenerated_prefix`, `_running_prefix`, `_honaker_next`), all reading the
static `_TreeSpec`. `dpsco_jax.noise` re-exports every public name here.
"""

import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax.noise_protocol import _check_buffers
from dpsco_jax.noise_protocol import check_state
from dpsco_jax.noise_protocol import _draw
from dpsco_jax.noise_protocol import _identified_init
from dpsco_jax.noise_protocol import mechanism_identity
from dpsco_jax.noise_protocol import _noise_dtype
from dpsco_jax.noise_protocol import NoiseMechanism
from dpsco_jax.noise_protocol import NoiseState
from dpsco_jax.noise_protocol import PyTree
from dpsco_jax.noise_protocol import _refuse_invalid
from dpsco_jax.noise_protocol import Sampler
from dpsco_jax.noise_protocol import _sampler_name
from dpsco_jax.noise_protocol import _validate_steps
from dpsco_jax.noise_protocol import _zeros

def tree_num_levels(tree_size: int) -> int:
  """Levels of a binary tree over `tree_size` leaves: `floor(log2 T) + 1`.

  This is also how many released nodes contain the first leaf, i.e. the
  squared l2 sensitivity of one step's contribution (paper 001 Lemma 4.3
  bounds it by `1 + ceil(log2 T)`; this count is exact).

  Args:
    tree_size: number of leaves (steps) of the tree.

  Returns:
    The number of levels.
  """
  return int(tree_size).bit_length()


def tree_encoder_matrix(num_steps: int, restart_every: Optional[int] = None
                        ) -> np.ndarray:
  """Node-membership matrix of (restarted) binary trees over `num_steps` steps.

  Row (k, j) of a tree is the node at level k covering leaves
  `(j-1) 2^k + 1 .. j 2^k` (1-indexed); only complete nodes are listed, since
  only those are ever released. Restarted trees are independent blocks.

  Args:
    num_steps: total number of steps.
    restart_every: steps per tree (default: one tree).

  Returns:
    A 0/1 float64 matrix `[num_nodes, num_steps]`.
  """
  num_steps = _validate_steps(num_steps, 'num_steps', required=True)
  tree_size = restart_every or num_steps
  rows = []
  for start in range(0, num_steps, tree_size):
    size = min(tree_size, num_steps - start)
    for level in range(tree_num_levels(size)):
      width = 1 << level
      for j in range(1, size // width + 1):
        row = np.zeros(num_steps)
        row[start + (j - 1) * width:start + j * width] = 1.0
        rows.append(row)
  return np.stack(rows)


def tree_decoder_matrix(num_steps: int, *, release: str = 'per_step',
                        restart_every: Optional[int] = None,
                        honaker: bool = False) -> np.ndarray:
  """The released tree noise as a linear map of the node draws.

  Columns follow the rows of `tree_encoder_matrix`. Prefix release at local
  step i sums the nodes of the binary decomposition of i (paper 001 Lemma
  4.3), or, with `honaker=True`, their Honaker estimates (node value
  `v_k = n_k + (v_left + v_right) / 2`, estimate `v_k / (2 - 2^-k)`); the
  prefix restarts with every tree. Per-step release is the difference of
  consecutive prefixes within a tree (a tree's first step releases its first
  prefix), so finished trees' noise stays in the running sum.

  Args:
    num_steps: total steps.
    release: 'per_step' or 'prefix'.
    restart_every: steps per tree (default: one tree).
    honaker: decode with Honaker's estimates.

  Returns:
    `[num_steps, num_nodes]` float64.
  """
  num_steps = _validate_steps(num_steps, 'num_steps', required=True)
  tree_size = min(restart_every or num_steps, num_steps)
  columns = {}
  for start in range(0, num_steps, tree_size):
    size = min(tree_size, num_steps - start)
    for level in range(tree_num_levels(size)):
      for index in range(1, (size >> level) + 1):
        columns[(start, level, index)] = len(columns)
  decoder = np.zeros((num_steps, len(columns)))
  for start in range(0, num_steps, tree_size):
    size = min(tree_size, num_steps - start)
    estimates = {}
    for (tree_start, level, index), column in columns.items():
      if tree_start != start:
        continue
      value = np.zeros(len(columns))
      value[column] = 1.0
      if honaker and level > 0:
        value += 0.5 * (estimates[(level - 1, 2 * index - 1)] +
                        estimates[(level - 1, 2 * index)])
      estimates[(level, index)] = value
    weights = [(2.0 - 2.0 ** -level) if honaker else 1.0
               for level in range(tree_num_levels(size))]
    previous = np.zeros(len(columns))
    for i in range(1, size + 1):
      prefix = sum(estimates[(level, i >> level)] / weights[level]
                   for level in range(i.bit_length()) if (i >> level) & 1)
      decoder[start + i - 1] = prefix if release == 'prefix' else (
          prefix - previous)
      previous = prefix
  return decoder


def _trailing_zeros(i: jax.Array) -> jax.Array:
  """Number of trailing zero bits of a positive int32."""
  return jax.lax.population_count((i & -i) - 1)


class _TreeSpec(NamedTuple):
  """What every step of one `tree` mechanism needs (static, never traced).

  Attributes:
    num_steps: the capacity, over all restarts.
    tree_size: steps per tree (`restart_every`, or `num_steps`).
    num_levels: levels of one tree (`tree_num_levels(tree_size)`).
    release: 'per_step' or 'prefix'.
    honaker: whether nodes are Honaker's variance-reduced estimates.
    running: whether the prefix noise is kept in a buffer (`'running'`).
    sampler: the unit-variance node sampler.
    name: the mechanism's name, for the messages.
    identity: the mechanism's identity.
  """

  num_steps: int
  tree_size: int
  num_levels: int
  release: str
  honaker: bool
  running: bool
  sampler: Sampler
  name: str
  identity: str


def _tree_spec(num_steps: int, release: str, restart_every: Optional[int],
               honaker: bool, prefix_storage: str,
               sampler: Sampler) -> _TreeSpec:
  """The checked arguments of `tree`, its name and identity."""
  num_steps = _validate_steps(num_steps, 'num_steps', required=True)
  restart_every = _validate_steps(restart_every, 'restart_every', required=False)
  if release not in ('per_step', 'prefix'):
    raise ValueError(f"release must be 'per_step' or 'prefix', got {release!r}")
  if prefix_storage not in ('regenerate', 'running'):
    raise ValueError("prefix_storage must be 'regenerate' or 'running', got "
                     f'{prefix_storage!r}')
  running = prefix_storage == 'running'
  if running and (release != 'prefix' or honaker):
    raise ValueError("prefix_storage='running' is for release='prefix' "
                     'without Honaker (the others draw few nodes already)')
  tree_size = min(restart_every or num_steps, num_steps)
  name = (f"{'honaker_' if honaker else ''}tree(release={release}, "
          f'num_steps={num_steps}, restart_every={restart_every}'
          f"{', running prefix' if running else ''})")
  identity = mechanism_identity(
      'tree', num_steps=num_steps, release=release, tree_size=tree_size,
      honaker=honaker, sampler=_sampler_name(sampler),
      **({'prefix_storage': 'running'} if running else {}))
  return _TreeSpec(num_steps, tree_size, tree_num_levels(tree_size), release,
                   honaker, running, sampler, name, identity)


def _local_position(spec: _TreeSpec, step: jax.Array):
  """`(tree index, 1-indexed step within that tree)` of a global step."""
  tree_index = step // spec.tree_size
  return tree_index, step % spec.tree_size + 1


def _tree_node(spec: _TreeSpec, key: jax.Array, tree_index, level, index,
               template: PyTree) -> PyTree:
  """The draw of node (level, index) of a tree: its key folds in all three."""
  node_key = jax.random.fold_in(
      jax.random.fold_in(jax.random.fold_in(key, tree_index), level), index)
  return _draw(node_key, template, spec.sampler)


def _add(a: PyTree, b: PyTree, scale=1.0) -> PyTree:
  return jax.tree_util.tree_map(lambda x, y: x + scale * y, a, b)


def _residual_noise(spec: _TreeSpec, state: NoiseState, template: PyTree,
                    tree_index, i) -> tuple[PyTree, tuple]:
  """Per-step noise: prefix noise of step i minus that of step i - 1.

  The new node at level ctz(i) enters, the nodes of i-1 below it (its
  trailing ones) leave; one loop trip per drawn node, levels in increasing
  order (see `_regenerated_prefix` for why not one cond per level).
  """
  ctz = _trailing_zeros(i)

  def residual_node(level, total):
    entering = level == ctz
    index = jnp.where(entering, i, i - 1) >> level
    return _add(total,
                _tree_node(spec, state.key, tree_index, level, index, template),
                jnp.where(entering, 1.0, -1.0))

  total = jax.lax.fori_loop(0, ctz + 1, residual_node, _zeros(template))
  return total, ()


def _regenerated_prefix(spec: _TreeSpec, state: NoiseState, template: PyTree,
                        tree_index, i) -> tuple[PyTree, tuple]:
  """Prefix noise of step i, every node of its binary decomposition drawn.

  The set bits of i, lowest first: one loop trip per drawn node. (A loop
  whose trip count is the number of nodes, rather than one conditional per
  level, matters on GPUs, where every conditional reads its predicate back
  to the host: 31 levels cost ~0.8 ms.)
  """

  def prefix_node(carry):
    total, remaining = carry
    level = _trailing_zeros(remaining)
    total = _add(total, _tree_node(spec, state.key, tree_index, level,
                                   i >> level, template))
    return total, remaining & (remaining - 1)

  total, _ = jax.lax.while_loop(lambda carry: carry[1] != 0, prefix_node,
                                (_zeros(template), i))
  return total, ()


def _running_prefix(spec: _TreeSpec, state: NoiseState, template: PyTree,
                    tree_index, i) -> tuple[PyTree, PyTree]:
  """Prefix noise of step i as the buffered prefix of i - 1 plus the residual."""
  residual, _ = _residual_noise(spec, state, template, tree_index, i)
  # A new tree (i == 1) starts its prefix from zero.
  prefix = jax.tree_util.tree_map(
      lambda b, r: jnp.where(i == 1, r, b.astype(r.dtype) + r),
      state.buffers, residual)
  buffers = jax.tree_util.tree_map(lambda b, p: p.astype(b.dtype),
                                   state.buffers, prefix)
  return prefix, buffers


def _standard_next(spec: _TreeSpec, state: NoiseState,
                   template: PyTree) -> tuple[PyTree, PyTree]:
  """`(noise, buffers)` of the next step of a tree without Honaker."""
  tree_index, i = _local_position(spec, state.step)
  if spec.running:
    return _running_prefix(spec, state, template, tree_index, i)
  if spec.release == 'prefix':
    return _regenerated_prefix(spec, state, template, tree_index, i)
  return _residual_noise(spec, state, template, tree_index, i)


def _honaker_prefix(spec: _TreeSpec, buffers: PyTree, i) -> PyTree:
  """Prefix noise of step i from the Honaker estimates of its nodes."""
  weights = [2.0 - 2.0 ** (-level) for level in range(spec.num_levels)]
  total = jax.tree_util.tree_map(lambda b: jnp.zeros(b.shape[1:], b.dtype),
                                 buffers)
  for level in range(spec.num_levels):
    bit = ((i >> level) & 1).astype(jnp.float32)
    total = jax.tree_util.tree_map(
        lambda t, b, lv=level: t + (bit / weights[lv]) * b[lv].astype(t.dtype),
        total, buffers)
  return total


def _honaker_next(spec: _TreeSpec, state: NoiseState,
                  template: PyTree) -> tuple[PyTree, PyTree]:
  """`(noise, buffers)` of the next step of a Honaker tree.

  Levels 0..ctz(i) complete at step i, lowest first, one loop trip each
  (see `_regenerated_prefix` for why not one conditional per level). A
  node's left child is the level below's previous value (still in `old`);
  its right child is the node completed in the trip before.
  """
  tree_index, i = _local_position(spec, state.step)
  ctz = _trailing_zeros(i)
  old = state.buffers

  def complete(level, carry):
    right, buffers = carry
    fresh = _tree_node(spec, state.key, tree_index, level, i >> level,
                       template)
    below = jnp.maximum(level - 1, 0)
    value = jax.tree_util.tree_map(
        lambda n, left, r: jnp.where(level == 0, n,
                                     n + 0.5 * (left[below] + r)),
        fresh, old, right)
    buffers = jax.tree_util.tree_map(lambda b, v: b.at[level].set(v),
                                     buffers, value)
    return value, buffers

  _, buffers = jax.lax.fori_loop(0, ctz + 1, complete,
                                 (_zeros(template), old))
  after = _honaker_prefix(spec, buffers, i)
  if spec.release == 'prefix':
    return after, buffers
  before = _honaker_prefix(spec, old, i - 1)
  return jax.tree_util.tree_map(jnp.subtract, after, before), buffers


def _tree_init(spec: _TreeSpec, template: PyTree,
               key: jax.Array) -> NoiseState:
  """A tree's first state: one buffer per level (Honaker), or per prefix."""
  buffers = ()
  if spec.honaker:
    buffers = jax.tree_util.tree_map(
        lambda leaf: jnp.zeros((spec.num_levels,) + jnp.shape(leaf),
                               _noise_dtype(leaf)), template)
  if spec.running:
    buffers = jax.tree_util.tree_map(
        lambda leaf: jnp.zeros(jnp.shape(leaf), _noise_dtype(leaf)),
        template)
  return NoiseState(key=key, step=jnp.zeros((), jnp.int32), buffers=buffers)


def _tree_draw_next(spec: _TreeSpec, state: NoiseState,
                    template: PyTree) -> tuple[PyTree, NoiseState]:
  """The next step's noise and state, refused past the capacity."""
  if spec.honaker:
    noise, buffers = _honaker_next(spec, state, template)
  else:
    noise, buffers = _standard_next(spec, state, template)
  noise, refusal = _refuse_invalid(state, noise, spec.num_steps, spec.name,
                                   spec.identity)
  return noise, state._replace(step=state.step + 1, buffers=buffers,
                               refusal=refusal)


def _tree_next(spec: _TreeSpec, compiled_next: Callable[..., Any],
               state: NoiseState,
               template: PyTree) -> tuple[PyTree, NoiseState]:
  """`NoiseMechanism.next` of a tree: checks, then one compiled draw."""
  check_state(state, spec.identity, spec.name)
  if spec.honaker:
    _check_buffers(state.buffers, template, (spec.num_levels,))
  if spec.running:
    _check_buffers(state.buffers, template, ())
  if isinstance(state.step, jax.core.Tracer):
    return _tree_draw_next(spec, state, template)
  # Called eagerly: refuse at once, and compile the per-level conds once
  # instead of dispatching each of them op by op.
  _refuse_invalid(state, (), spec.num_steps, spec.name, spec.identity)
  return compiled_next(state, template)


def tree(
    num_steps: int,
    *,
    release: str = 'per_step',
    restart_every: Optional[int] = None,
    honaker: bool = False,
    prefix_storage: str = 'regenerate',
    sampler: Sampler = jax.random.normal,
) -> NoiseMechanism:
  """Binary-tree (continual counting) noise, paper 001 Lemma 4.3.

  Each tree node (level k, index j) carries an independent unit-variance
  Gaussian draw keyed by `fold_in` of (tree, level, index), so a node is
  regenerated identically for every prefix that uses it. At local step i
  (1-indexed within the current tree) the prefix noise is the sum of the
  nodes of the binary decomposition of i (`popcount(i)` nodes; e.g.
  `g_7 = s_{1,2} + s_{3,1} + s_{7,0}`). The per-step residual noise is the
  difference of consecutive prefix noises, computed directly from the nodes
  that change (`1 + ctz(i)` draws, two on average).

  The Honaker variant (`honaker=True`) replaces each node by its
  minimum-variance estimate from itself and its subtree (node value
  `v_k = n_k + (v_left + v_right) / 2`, estimate `v_k / (2 - 2^-k)`), which
  needs one buffer per level; the standard tree keeps no buffers at all.
  Either way the released values are post-processing of the same node
  measurements, so the encoder (and privacy) is the same.

  Prefix release draws the `popcount(i)` nodes of the prefix at every step
  (`prefix_storage='regenerate'`, no buffer), or keeps the last prefix noise
  in a params-sized buffer and adds the residual (`'running'`: `1 + ctz(i)`
  draws, two on average instead of about `log2(T) / 2`). Both release the
  same node sums (up to float32 rounding of the running sum), so the
  encoder, and the privacy, are the same; the identity differs, since the
  states differ.

  Restarts: with `restart_every=R` a fresh tree starts every R steps. In
  'per_step' release the noise already added by earlier trees stays in
  (it is folded into the iterate, as DP-FTRL's restart does), and in
  'prefix' release the prefix restarts from zero.

  Example:
    >>> mech = tree(num_steps=1000, release='per_step', restart_every=100)
    >>> state = mech.init(params, jax.random.key(0))
    >>> noise, state = mech.next(state, params)

  Args:
    num_steps: capacity: total steps (over all restarts). Refused past it.
    release: 'per_step' (residual noise) or 'prefix' (noise on prefix sums).
    restart_every: steps per tree; None for a single tree.
    honaker: use the Honaker variance-reduced node estimates.
    prefix_storage: with `release='prefix'` and no Honaker: 'regenerate'
      (draw the prefix's nodes each step) or 'running' (one buffer, fewer
      draws).
    sampler: `(key, shape, dtype) -> array` unit-variance node sampler (tests
      replace it, e.g. with ones; keep the default in real use).

  Returns:
    A `NoiseMechanism`.
  """
  spec = _tree_spec(num_steps, release, restart_every, honaker,
                    prefix_storage, sampler)
  compiled_next = jax.jit(functools.partial(_tree_draw_next, spec))
  return NoiseMechanism(
      init=_identified_init(functools.partial(_tree_init, spec),
                            spec.identity),
      next=functools.partial(_tree_next, spec, compiled_next),
      identity=spec.identity,
      encoder_matrix=lambda: tree_encoder_matrix(spec.num_steps,
                                                 spec.tree_size),
      num_steps=spec.num_steps, release=release, name=spec.name,
      decoder_matrix=lambda: tree_decoder_matrix(
          spec.num_steps, release=release, restart_every=spec.tree_size,
          honaker=honaker),
      # The first leaf of a tree is in one node per level.
      single_participation_sensitivity=lambda: math.sqrt(spec.num_levels))
