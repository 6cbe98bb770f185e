"""Noise mechanisms: streams of (correlated) Gaussian noise shaped like params.

Every mechanism is a linear Gaussian mechanism in the matrix-factorization
view: an encoder matrix `C` (rows: independent unit-variance Gaussian
coordinates, e.g. tree nodes; columns: steps) is applied to the stream of
per-step statistics and noised, `C x + z`, and the algorithm releases a
decoding of it. What the algorithm adds at step t is the decoded noise
`(D z)_t` with `D C = W` for the workload `W`:

* `release='per_step'`: `W = I`, noise for each step's statistic, for
  SGD-style updates (DP-SGD's i.i.d. noise, the tree's residual noise,
  matrix-factorization noise `C^-1 z`);
* `release='prefix'`: `W = A` (all-ones lower triangle), noise for the prefix
  sum `x_0 + ... + x_t` (DP-FTRL's noisy prefix sums, Accelerated-DP-SRGD).

One interface serves all of them:

* `mechanism.init(template, key) -> NoiseState`;
* `mechanism.next(state, template) -> (noise, state)`: the noise for the next
  step, a pytree shaped like `template` in float32 (or wider), with unit
  noise multiplier: the caller scales it by `noise_multiplier * sensitivity`;
* `mechanism.encoder_matrix()`: the explicit `C` for `num_steps` steps, from
  which `dpsco_jax.accounting` derives the sensitivity under any
  participation pattern (so accounting is derived, not hand-copied);
* `mechanism.num_steps`: the capacity. Drawing past it is refused with a
  clear error (and, inside `jit`, the noise is also poisoned with NaN so a
  run that ignores the error cannot continue with weaker privacy).

Keys: the mechanism key is one purpose key, identical on every device. Each
draw folds in the step (or tree node) and the leaf index, so no key is ever
reused and a tree node is regenerated identically whenever it is needed.
"""

import hashlib
import json
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from scipy import linalg

from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import rounding

PyTree = Any
Sampler = Callable[[jax.Array, tuple, Any], jax.Array]


class NoiseState(NamedTuple):
  """State of a noise mechanism.

  Attributes:
    key: the mechanism's PRNG key (replicated across devices).
    step: int32, how many noise vectors have been drawn.
    buffers: mechanism-specific arrays (empty for the stateless mechanisms;
      the Honaker tree keeps one node estimate per level, matrix
      factorization its last noise vectors). They hold noise, never data.
    mechanism_id: uint32[4], the identity of the mechanism that made the
      state (`NoiseMechanism.identity`: its kind and every parameter that
      determines the noise). `next` refuses a state made by another
      mechanism, and `dpsco_jax.checkpoint` checks it against the ledger, so
      a run cannot continue one mechanism's state under another while its
      accounting describes the first. Not secret.
    refusal: the `guards.Refusal` record of the checks made with this state
      (the capacity, the identity, and the checks of the estimator that
      adds this noise): once set, every later draw is NaN, and
      `guards.raise_if_refused` reports it. Not secret.

  The key and buffers determine the noise, so the state is secret: it can be
  checkpointed privately but must never be logged or released.
  """

  key: jax.Array
  step: jax.Array
  buffers: PyTree = ()
  mechanism_id: Optional[jax.Array] = None
  refusal: Optional[guards.Refusal] = None


class NoiseMechanism(NamedTuple):
  """A stream of correlated Gaussian noise (see the module docstring).

  Attributes:
    init: `(template, key) -> NoiseState`.
    next: `(state, template) -> (noise, state)`.
    encoder_matrix: `() -> np.ndarray`, the strategy matrix `C` (float64,
      shape `[num_coordinates, num_steps]`) for the whole run, as the
      device applies it (its float32 coefficients).
    num_steps: capacity: how many steps the noise was built for (None: no
      limit, only for i.i.d. Gaussian noise).
    release: 'per_step' or 'prefix'.
    name: a human-readable description.
    decoder_matrix: `() -> np.ndarray`, the linear map `N` (float64,
      `[num_steps, num_coordinates]`) from the unit-variance draws (one per
      row of the encoder) to the released noise: step t releases
      `sum_j N[t, j] xi_j`. It gives the mechanism's error on any workload
      (`dpsco_jax.strategies.workload_errors`).
    single_participation_sensitivity: optional `() -> float`, the largest
      column norm of the encoder, `max_t ||C e_t||`: the sensitivity of a
      run in which each example takes part in one step, computed without
      building `C` (a million-step tree or i.i.d. run has a `C` too large
      to form). None: the accountant computes it from `encoder_matrix`.
    identity: 32 hex digits naming the mechanism's kind and every parameter
      that determines its noise (`mechanism_identity`); the states it makes
      carry it (`NoiseState.mechanism_id`) and `next` refuses any other.
      Empty only for mechanisms built by hand for accounting.
    fixed_order_sensitivity: optional `(k, b) -> float or None`, the exact
      sensitivity under `FixedOrder(k, b)` without building C (a BLT's
      closed form; O(T) instead of the O(T^3) Gram matrix). None, or a
      None result: the accountant computes it from `encoder_matrix`.
    truncated: optional `(steps) -> NoiseMechanism`, the mechanism that
      accounts for the first `steps` steps of a run (`ledger.epsilon_at`):
      its encoder is the rows of C those steps' releases use, cut to the
      first `steps` columns (the later columns zero), with `num_steps` the
      whole run's, and its own sensitivity routes (a BLT's are O(T d)).
      None: the ledger cuts `encoder_matrix()` itself (T x T).
  """

  init: Callable[[PyTree, jax.Array], NoiseState]
  next: Callable[[NoiseState, PyTree], tuple[PyTree, NoiseState]]
  encoder_matrix: Callable[[], np.ndarray]
  num_steps: Optional[int]
  release: str
  name: str
  decoder_matrix: Optional[Callable[[], np.ndarray]] = None
  single_participation_sensitivity: Optional[Callable[[], float]] = None
  identity: str = ''
  fixed_order_sensitivity: Optional[Callable[[int, int],
                                             Optional[float]]] = None
  truncated: Optional[Callable[[int], 'NoiseMechanism']] = None


def mechanism_identity(kind: str, **parameters: Any) -> str:
  """The identity of a noise mechanism: a hash of its kind and parameters.

  Two mechanisms have the same identity exactly when they draw the same
  noise from the same key (the parameters must include everything that
  determines the noise: capacity, release, restarts, the strategy matrix,
  a non-default sampler).

  Example:
    >>> mechanism_identity('tree', num_steps=16, release='prefix',
    ...                    tree_size=16, honaker=False, sampler=None)
    '...'   # 32 hex digits

  Args:
    kind: the mechanism family, e.g. 'gaussian'.
    **parameters: JSON-serializable values that determine the noise.

  Returns:
    32 hex digits (128 bits of SHA-256).
  """
  text = json.dumps({'kind': kind, **parameters}, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def identity_words(identity: str) -> np.ndarray:
  """The identity as the uint32[4] a `NoiseState` carries.

  Example:
    >>> identity_words(mechanism.identity).shape
    (4,)

  Args:
    identity: 32 hex digits (`NoiseMechanism.identity`).

  Returns:
    uint32 array of shape [4].
  """
  return np.frombuffer(bytes.fromhex(identity), dtype='>u4').astype(np.uint32)


def _sampler_name(sampler: Sampler) -> Optional[str]:
  """None for the default sampler, else a name that sets the noise apart."""
  if sampler is jax.random.normal:
    return None
  return (f'{getattr(sampler, "__module__", "")}.'
          f'{getattr(sampler, "__qualname__", type(sampler).__name__)}')


def check_state(state: Any, identity: str, name: str) -> Any:
  """Raises unless `state` is a noise state this mechanism could have made.

  Structure is checked at once; the identity is compared at once when it is
  concrete, and returned as a traced flag under `jit`/`vmap`/`pmap` (for
  `guards.refuse_any`).

  Example:
    >>> flag = check_state(state, mechanism.identity, mechanism.name)

  Args:
    state: the state handed to `next`.
    identity: the mechanism's identity.
    name: the mechanism's name, for the messages.

  Returns:
    A bool flag (Python False, or traced) that is True when the state was
    made by another mechanism.

  Raises:
    ValueError: if `state` is not a `NoiseState` with an identity of the
      right shape, or (when concrete) was made by another mechanism.
  """
  if not isinstance(state, NoiseState):
    raise ValueError(
        f'{name}: expected the NoiseState made by this mechanism\'s init, got '
        f'{type(state).__name__}: the optimizer state does not belong to this '
        'transformation')
  words = state.mechanism_id
  if words is None:
    raise ValueError(
        f'{name}: the noise state carries no mechanism identity (it was not '
        'made by a mechanism\'s init); build it with mechanism.init')
  if jnp.shape(words)[-1:] != (4,) or jnp.result_type(words) != jnp.uint32:
    raise ValueError(
        f'{name}: the noise state\'s mechanism identity has shape '
        f'{jnp.shape(words)} and dtype {jnp.result_type(words)}, not uint32[4]')
  expected = identity_words(identity)
  if isinstance(words, jax.core.Tracer):
    return jnp.any(words != jnp.asarray(expected))
  if np.any(np.asarray(words) != expected):
    raise ValueError(_other_mechanism_message(name, identity))
  return False


def _other_mechanism_message(name: str, identity: str) -> str:
  return (f'{name}: the noise state was made by another noise mechanism '
          f'(this one is {identity}): continuing one mechanism\'s state under '
          'another would release noise its accounting never described. Start '
          'from this mechanism\'s init, or restore the checkpoint of the run '
          'this state belongs to with that run\'s transformation.')


def _validate_steps(value: Optional[int], name: str,
                    required: bool) -> Optional[int]:
  if value is None:
    if required:
      raise ValueError(f'{name} is required')
    return None
  return checks.positive_int(value, name)


def _noise_dtype(leaf) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def _draw(key: jax.Array, template: PyTree, sampler: Sampler) -> PyTree:
  """One unit-variance draw per leaf of `template`, a distinct key per leaf."""
  leaves, treedef = jax.tree_util.tree_flatten(template)
  # Drawing flat then reshaping gives the same values as drawing in the leaf's
  # shape, but compiles much faster for multi-dimensional leaves.
  noise = [
      sampler(jax.random.fold_in(key, index), (math.prod(jnp.shape(leaf)),),
              _noise_dtype(leaf)).reshape(jnp.shape(leaf))
      for index, leaf in enumerate(leaves)
  ]
  return jax.tree_util.tree_unflatten(treedef, noise)


def _zeros(template: PyTree) -> PyTree:
  return jax.tree_util.tree_map(
      lambda leaf: jnp.zeros(jnp.shape(leaf), _noise_dtype(leaf)), template)


def _refuse_invalid(state: NoiseState, noise: PyTree,
                    num_steps: Optional[int], name: str,
                    identity: str) -> tuple[PyTree, guards.Refusal]:
  """Refuses a state of another mechanism, and a draw past the capacity.

  Both refusals go through one `dpsco_jax.guards.record`: a
  `PrivacyGuardError` at once when the values are concrete; under tracing
  NaN-poisoned noise and the refusal recorded in the state (no host round
  trip). A state whose record is already set draws NaN.

  Returns:
    `(noise, refusal)`: the (possibly poisoned) noise and the state's new
    record.
  """
  conditions = [(check_state(state, identity, name),
                 _other_mechanism_message(name, identity), 'mechanism')]
  step = state.step
  if num_steps is not None:
    if not isinstance(step, jax.core.Tracer):
      step = int(np.max(np.asarray(step)))
    conditions.append((
        step >= num_steps,
        f'{name}: a step past the capacity of {num_steps} steps its noise was '
        'calibrated for; running further would silently weaken privacy. Build '
        'a mechanism (and accounting) for more steps.', 'capacity'))
  refusal = state.refusal if state.refusal is not None else (
      guards.no_refusal())
  return guards.record(conditions, noise, refusal, state.step)


def _identified_init(init: Callable[[PyTree, jax.Array], NoiseState],
                     identity: str) -> Callable[[PyTree, jax.Array],
                                                NoiseState]:
  """`init` whose states carry the mechanism's identity."""
  words = identity_words(identity)

  def identified(template, key):
    return init(template, key)._replace(mechanism_id=jnp.asarray(words),
                                        refusal=guards.no_refusal())

  return identified


def gaussian(num_steps: Optional[int] = None, *,
             sampler: Sampler = jax.random.normal) -> NoiseMechanism:
  """I.i.d. Gaussian noise, a fresh draw each step (DP-SGD).

  Example:
    >>> mech = gaussian(num_steps=100)
    >>> state = mech.init(params, jax.random.key(0))
    >>> noise, state = mech.next(state, params)   # N(0, 1) per coordinate

  Args:
    num_steps: optional capacity; if set, drawing more steps is refused.
    sampler: `(key, shape, dtype) -> array` unit-variance sampler (tests
      replace it; keep the default in real use).

  Returns:
    A `NoiseMechanism` with identity encoder and per-step release.
  """
  num_steps = _validate_steps(num_steps, 'num_steps', required=False)
  name = 'gaussian'
  identity = mechanism_identity('gaussian', num_steps=num_steps,
                                sampler=_sampler_name(sampler))

  def init(template, key):
    del template
    return NoiseState(key=key, step=jnp.zeros((), jnp.int32))

  def next_noise(state, template):
    check_state(state, identity, name)
    noise = _draw(jax.random.fold_in(state.key, state.step), template, sampler)
    noise, refusal = _refuse_invalid(state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, refusal=refusal)

  def encoder_matrix():
    if num_steps is None:
      raise ValueError('gaussian(num_steps=None) has no finite encoder matrix; '
                       'give num_steps to account for it')
    return np.eye(num_steps)

  return NoiseMechanism(init=_identified_init(init, identity), next=next_noise,
                        encoder_matrix=encoder_matrix, num_steps=num_steps,
                        release='per_step', name=name,
                        decoder_matrix=encoder_matrix,
                        single_participation_sensitivity=lambda: 1.0,
                        identity=identity)


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
  num_levels = tree_num_levels(tree_size)
  name = (f"{'honaker_' if honaker else ''}tree(release={release}, "
          f'num_steps={num_steps}, restart_every={restart_every}'
          f"{', running prefix' if running else ''})")
  identity = mechanism_identity(
      'tree', num_steps=num_steps, release=release, tree_size=tree_size,
      honaker=honaker, sampler=_sampler_name(sampler),
      **({'prefix_storage': 'running'} if running else {}))

  def local_position(step):
    tree_index = step // tree_size
    return tree_index, step % tree_size + 1

  def node(key, tree_index, level, index, template):
    node_key = jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(key, tree_index), level), index)
    return _draw(node_key, template, sampler)

  def add(a, b, scale=1.0):
    return jax.tree_util.tree_map(lambda x, y: x + scale * y, a, b)

  def standard_next(state, template):
    tree_index, i = local_position(state.step)
    zeros = _zeros(template)
    if running:
      residual, _ = residual_next(state, template, tree_index, i)
      # A new tree (i == 1) starts its prefix from zero.
      prefix = jax.tree_util.tree_map(
          lambda b, r: jnp.where(i == 1, r, b.astype(r.dtype) + r),
          state.buffers, residual)
      buffers = jax.tree_util.tree_map(lambda b, p: p.astype(b.dtype),
                                       state.buffers, prefix)
      return prefix, buffers
    if release == 'prefix':
      # The set bits of i, lowest first: one loop trip per drawn node. (A
      # loop whose trip count is the number of nodes, rather than one
      # conditional per level, matters on GPUs, where every conditional
      # reads its predicate back to the host: 31 levels cost ~0.8 ms.)
      def prefix_node(carry):
        total, remaining = carry
        level = _trailing_zeros(remaining)
        total = add(total, node(state.key, tree_index, level, i >> level,
                                template))
        return total, remaining & (remaining - 1)

      total, _ = jax.lax.while_loop(lambda carry: carry[1] != 0, prefix_node,
                                    (zeros, i))
      return total, ()
    return residual_next(state, template, tree_index, i)

  def residual_next(state, template, tree_index, i):
    # Residual: the new node at level ctz(i) enters, the nodes of i-1 below it
    # (its trailing ones) leave; one loop trip per drawn node, levels in
    # increasing order (see `prefix_node` for why not one cond per level).
    ctz = _trailing_zeros(i)

    def residual_node(level, total):
      entering = level == ctz
      index = jnp.where(entering, i, i - 1) >> level
      return add(total, node(state.key, tree_index, level, index, template),
                 jnp.where(entering, 1.0, -1.0))

    total = jax.lax.fori_loop(0, ctz + 1, residual_node, _zeros(template))
    return total, ()

  weights = [2.0 - 2.0 ** (-level) for level in range(num_levels)]

  def honaker_prefix(buffers, i):
    total = jax.tree_util.tree_map(lambda b: jnp.zeros(b.shape[1:], b.dtype),
                                   buffers)
    for level in range(num_levels):
      bit = ((i >> level) & 1).astype(jnp.float32)
      total = jax.tree_util.tree_map(
          lambda t, b, lv=level: t + (bit / weights[lv]) * b[lv].astype(t.dtype),
          total, buffers)
    return total

  def honaker_next(state, template):
    tree_index, i = local_position(state.step)
    ctz = _trailing_zeros(i)
    old = state.buffers
    # Levels 0..ctz(i) complete at step i, lowest first, one loop trip each
    # (see `prefix_node` for why not one conditional per level). A node's
    # left child is the level below's previous value (still in `old`); its
    # right child is the node completed in the trip before.
    def complete(level, carry):
      right, buffers = carry
      fresh = node(state.key, tree_index, level, i >> level, template)
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
    after = honaker_prefix(buffers, i)
    if release == 'prefix':
      return after, buffers
    before = honaker_prefix(old, i - 1)
    return jax.tree_util.tree_map(jnp.subtract, after, before), buffers

  def init(template, key):
    buffers = ()
    if honaker:
      buffers = jax.tree_util.tree_map(
          lambda leaf: jnp.zeros((num_levels,) + jnp.shape(leaf),
                                 _noise_dtype(leaf)), template)
    if running:
      buffers = jax.tree_util.tree_map(
          lambda leaf: jnp.zeros(jnp.shape(leaf), _noise_dtype(leaf)),
          template)
    return NoiseState(key=key, step=jnp.zeros((), jnp.int32), buffers=buffers)

  def draw_next(state, template):
    if honaker:
      noise, buffers = honaker_next(state, template)
    else:
      noise, buffers = standard_next(state, template)
    noise, refusal = _refuse_invalid(state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, buffers=buffers,
                                 refusal=refusal)

  compiled_next = jax.jit(draw_next)

  def next_noise(state, template):
    check_state(state, identity, name)
    if honaker:
      _check_buffers(state.buffers, template, (num_levels,))
    if running:
      _check_buffers(state.buffers, template, ())
    if isinstance(state.step, jax.core.Tracer):
      return draw_next(state, template)
    # Called eagerly: refuse at once, and compile the per-level conds once
    # instead of dispatching each of them op by op.
    _refuse_invalid(state, (), num_steps, name, identity)
    return compiled_next(state, template)

  return NoiseMechanism(
      init=_identified_init(init, identity), next=next_noise,
      identity=identity,
      encoder_matrix=lambda: tree_encoder_matrix(num_steps, tree_size),
      num_steps=num_steps, release=release, name=name,
      decoder_matrix=lambda: tree_decoder_matrix(
          num_steps, release=release, restart_every=tree_size,
          honaker=honaker),
      # The first leaf of a tree is in one node per level.
      single_participation_sensitivity=lambda: math.sqrt(num_levels))


def _check_buffers(buffers: PyTree, template: PyTree,
                   leading: tuple[int, ...]) -> None:
  """Raises a clear error if the noise buffers do not match `template`.

  Args:
    buffers: a pytree like `template` whose leaves have extra leading axes.
    template: the params-like pytree the noise is drawn for.
    leading: the extra leading axes of every buffer leaf.
  """
  expected = jax.tree_util.tree_structure(template)
  actual = jax.tree_util.tree_structure(buffers)
  if expected != actual:
    raise ValueError('noise state does not match the params pytree: state has '
                     f'{actual}, params have {expected}')
  for leaf, buffer in zip(jax.tree_util.tree_leaves(template),
                          jax.tree_util.tree_leaves(buffers)):
    if tuple(buffer.shape) != tuple(leading) + tuple(jnp.shape(leaf)):
      raise ValueError(
          'noise state does not match the params: a buffer of shape '
          f'{buffer.shape} for a leaf of shape {jnp.shape(leaf)}')


def _bandwidth(strategy: np.ndarray) -> int:
  """Number of non-zero diagonals of a lower-triangular matrix."""
  rows, cols = np.nonzero(strategy)
  return int(np.max(rows - cols)) + 1


def validate_strategy(strategy: np.ndarray) -> np.ndarray:
  """Returns `strategy` as float64, or raises if it is not a usable `C`.

  Args:
    strategy: the matrix-factorization strategy `C`, `[T, T]`.

  Returns:
    The matrix as a float64 array.

  Raises:
    ValueError: unless `C` is square, finite, lower-triangular (the noise at
      step t may only depend on draws up to t) with a non-zero diagonal.
  """
  strategy = np.asarray(strategy, dtype=np.float64)
  if strategy.ndim != 2 or strategy.shape[0] != strategy.shape[1]:
    raise ValueError(f'the strategy must be a square matrix, got shape '
                     f'{strategy.shape}')
  if not np.all(np.isfinite(strategy)):
    raise ValueError('the strategy has non-finite entries')
  if np.any(np.triu(strategy, 1) != 0):
    raise ValueError('the strategy must be lower-triangular: streaming noise '
                     'at step t may only use the draws of steps <= t')
  if np.any(np.diag(strategy) == 0):
    raise ValueError('the strategy must have a non-zero diagonal (invertible)')
  return strategy


def matrix_factorization(
    strategy: np.ndarray,
    *,
    inverse: Optional[np.ndarray] = None,
    release: str = 'per_step',
    storage: str = 'buffer',
    sampler: Sampler = jax.random.normal,
) -> NoiseMechanism:
  """Matrix-factorization noise `C^-1 z`, streamed one step at a time.

  For a lower-triangular strategy `C` (`[T, T]`) the per-step noise is
  `w = C^-1 z` with `z_t` drawn from `fold_in(key, t)` (the same draws as
  `gaussian`, so `C = I` reproduces it exactly). Strategies for DP-MF /
  DP-MEMF (paper 001 Alg 2; `dpsco_jax.strategies.optimize_strategy`) plug
  in here; the accountant derives the sensitivity from `C` and the
  participation pattern. Two ways to stream it, same values up to float32
  round-off:

  * `storage='buffer'` (default): forward substitution
    `w_t = (z_t - sum_{0 < j < b} C[t, t-j] w_{t-j}) / C[t, t]`, keeping the
    last `b - 1` noise vectors in a ring buffer, b the number of non-zero
    diagonals of `C`: O(bands x params) memory for banded strategies,
    O(T x params) for dense ones, one draw per step.
  * `storage='regenerate'`: `w_t = sum_{s <= t} (C^-1)[t, s] z_s`, redrawing
    every `z_s` from its key: no buffer at all, but t + 1 draws at step t.
    For memory-bound runs (see `benchmarks/mf_noise.py` for the cost).

  A dense C can have a banded inverse (the banded inverse square root,
  `strategies.banded_inverse_square_root`): then give that inverse as
  `inverse=`, and `storage='buffer'` computes `w_t = sum_{0 <= j < b'}
  (C^-1)[t, t-j] z_(t-j)` directly, keeping the last `b' - 1` draws z (b'
  the number of non-zero diagonals of `C^-1`) when that is fewer than the
  `b - 1` noise vectors of the forward substitution. The noise is then
  exactly `inverse @ z`; C (checked to be its inverse to 1e-8) remains the
  mechanism's identity.

  The accountant reads the strategy the device applies
  (`encoder_matrix()`): the float32 values of C for the forward
  substitution, `inv(float32(C^-1))` when the noise is drawn with the
  (given or regenerated) decoder, as `blt` does with its coefficients
  (`rounding.float32_values`): a decoder coefficient rounded up can make
  the device's strategy more sensitive than the float64 C (3e-5 at T =
  1024, `tests/test_precision.py`).

  With `release='prefix'` the prefix noise `A C^-1 z` is released instead
  (the running sum of `w`).

  Example:
    >>> c = strategies.optimize_strategy(strategies.workload(120), 1)
    >>> mech = matrix_factorization(c)
    >>> state = mech.init(params, jax.random.key(0))
    >>> noise, state = mech.next(state, params)

  Args:
    strategy: `C`, lower-triangular `[T, T]` with a non-zero diagonal; T is
      the capacity.
    inverse: optional `C^-1`, exactly (e.g. the banded inverse of
      `strategies.banded_inverse_square_root(..., with_inverse=True)`); it
      defines the noise when given.
    release: 'per_step' (`C^-1 z`) or 'prefix' (`A C^-1 z`).
    storage: 'buffer' or 'regenerate' (see above).
    sampler: `(key, shape, dtype) -> array` unit-variance sampler (tests
      replace it; keep the default in real use).

  Returns:
    A `NoiseMechanism`.

  Raises:
    ValueError: for an invalid strategy (`validate_strategy`), release or
      storage, or an `inverse` that is not lower-triangular, of another
      shape, or not the inverse of `strategy`.
  """
  strategy = validate_strategy(strategy)
  if inverse is not None:
    inverse = _validate_inverse(strategy, inverse)
  if release not in ('per_step', 'prefix'):
    raise ValueError(f"release must be 'per_step' or 'prefix', got {release!r}")
  if storage not in ('buffer', 'regenerate'):
    raise ValueError(
        f"storage must be 'buffer' or 'regenerate', got {storage!r}")
  num_steps = strategy.shape[0]
  bands = _bandwidth(strategy)
  extra = {}
  inverse_bands = None
  if inverse is not None:
    inverse_bands = _bandwidth(inverse)
    # Only the inverse's own hash and bands are new: a mechanism built
    # without it keeps its identity (and its checkpoints stay valid).
    extra['inverse_sha256'] = _sha256(inverse)
  name = (f'matrix_factorization(T={num_steps}, bands={bands}, '
          + (f'inverse_bands={inverse_bands}, ' if inverse is not None
             else '') + f'release={release}, storage={storage})')
  identity = mechanism_identity(
      'matrix_factorization', release=release, storage=storage,
      sampler=_sampler_name(sampler), shape=list(strategy.shape),
      strategy_sha256=_sha256(strategy), **extra)

  def decoder_matrix():
    if inverse is not None:
      decoder = inverse.copy()
    else:
      decoder = linalg.solve_triangular(strategy, np.eye(num_steps),
                                        lower=True)
    return np.cumsum(decoder, axis=0) if release == 'prefix' else decoder

  if storage == 'regenerate':
    next_noise, init = _regenerated_noise(decoder_matrix(), num_steps, name,
                                          identity, sampler)
    applied = 'decoder'
  elif inverse is not None and inverse_bands < bands:
    next_noise, init = _banded_decoder_noise(inverse, inverse_bands, release,
                                             num_steps, name, identity,
                                             sampler)
    applied = 'inverse'
  else:
    next_noise, init = _buffered_noise(strategy, bands, release, num_steps,
                                       name, identity, sampler)
    applied = 'strategy'

  def encoder_matrix():
    # The strategy the device applies: its float32 coefficients.
    if applied == 'strategy':
      return rounding.float32_values(strategy)
    decoder = rounding.float32_values(
        decoder_matrix() if applied == 'decoder' else inverse)
    if applied == 'decoder' and release == 'prefix':
      decoder = np.diff(decoder, axis=0, prepend=0.0)   # A^-1 (A C^-1)
    return linalg.solve_triangular(decoder, np.eye(num_steps), lower=True)

  return NoiseMechanism(
      init=_identified_init(init, identity), next=next_noise,
      identity=identity, encoder_matrix=encoder_matrix,
      num_steps=num_steps, release=release, name=name,
      decoder_matrix=decoder_matrix)


def _sha256(matrix: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(
      matrix, dtype='<f8').tobytes()).hexdigest()


def _validate_inverse(strategy: np.ndarray, inverse: np.ndarray
                      ) -> np.ndarray:
  """Returns `inverse` as float64, or raises unless it is `C^-1` of C.

  `C C^-1` is formed from the diagonals of `C^-1` (O(T^2 b') for b'
  diagonals), and must be the identity to 1e-8 relative to the sizes of
  the factors: the accountant reads C while the noise is drawn with the
  inverse, so they must describe one mechanism.
  """
  inverse = validate_strategy(inverse)
  if inverse.shape != strategy.shape:
    raise ValueError(f'the inverse has shape {inverse.shape}, the strategy '
                     f'{strategy.shape}')
  num_steps = strategy.shape[0]
  product = np.zeros_like(strategy)
  for lag in range(_bandwidth(inverse)):
    diagonal = np.diagonal(inverse, -lag)
    if np.any(diagonal):
      # (C C^-1)[:, j] gets C[:, j + lag] C^-1[j + lag, j].
      product[:, :num_steps - lag] += strategy[:, lag:] * diagonal
  scale = np.abs(strategy).max() * np.abs(inverse).sum(axis=0).max()
  error = np.abs(product - np.eye(num_steps)).max()
  if not error <= 1e-8 * max(scale, 1.0):
    raise ValueError(f'inverse is not the inverse of the strategy: '
                     f'max |C inverse - I| = {error:.3g}')
  return inverse


def _banded_decoder_noise(inverse: np.ndarray, bands: int, release: str,
                          num_steps: int, name: str, identity: str,
                          sampler: Sampler):
  """`next`/`init` of `w_t = sum_(j < b') C^-1[t, t-j] z_(t-j)`.

  For a banded `C^-1` (b' diagonals): a ring buffer of the last b' - 1
  draws z, one draw per step.
  """

  def combine(row0, z_leaf, correction):
    current = row0.astype(z_leaf.dtype) * z_leaf
    return current if correction is None else current + correction

  return _ring_buffer_noise(inverse, bands, release, num_steps, name,
                            identity, sampler, buffer_name='past_draws',
                            combine=combine, keep_draws=True)


def _buffered_noise(strategy: np.ndarray, bands: int, release: str,
                    num_steps: int, name: str, identity: str,
                    sampler: Sampler):
  """`next`/`init` of the forward substitution with a ring buffer."""

  def substitute(row0, z_leaf, correction):
    if correction is None:
      return z_leaf / row0.astype(z_leaf.dtype)
    return (z_leaf - correction) / row0.astype(z_leaf.dtype)

  return _ring_buffer_noise(strategy, bands, release, num_steps, name,
                            identity, sampler, buffer_name='past',
                            combine=substitute, keep_draws=False)


def _ring_buffer_noise(matrix: np.ndarray, bands: int, release: str,
                       num_steps: int, name: str, identity: str,
                       sampler: Sampler, *, buffer_name: str,
                       combine: Callable[..., jax.Array], keep_draws: bool):
  """`next`/`init` of a banded recursion over the last `bands - 1` vectors.

  Step t forms `combine(M[t, t], z_t, sum_(1 <= j < bands) M[t, t-j]
  v_(t-j))` (the correction None when `bands` is 1), with v the kept
  vectors: the draws z (`keep_draws`: `M = C^-1`, a banded decoder) or the
  outputs w (the forward substitution of `M = C`).
  """
  # band[t, j] = M[t, t - j] (zero above the first row), in float32 for the
  # device; row t drives step t.
  band = np.zeros((num_steps, bands))
  for j in range(bands):
    band[j:, j] = np.diagonal(matrix, -j)
  band = jnp.asarray(band, jnp.float32)
  slots = max(bands - 1, 1)

  def init(template, key):
    past = jax.tree_util.tree_map(
        lambda leaf: jnp.zeros((bands - 1,) + jnp.shape(leaf),
                               _noise_dtype(leaf)), template)
    buffers = {buffer_name: past}
    if release == 'prefix':
      buffers['prefix'] = _zeros(template)
    return NoiseState(key=key, step=jnp.zeros((), jnp.int32), buffers=buffers)

  def next_noise(state, template):
    check_state(state, identity, name)
    _check_buffers(state.buffers[buffer_name], template, (bands - 1,))
    if release == 'prefix':
      _check_buffers(state.buffers['prefix'], template, ())
    step = jnp.asarray(state.step)
    row = band[jnp.minimum(step, num_steps - 1)]
    # Slot m holds v_s for the latest s < t with s = m (mod slots): lag
    # t - s = ((t - 1 - m) mod slots) + 1. Writing one slot per step (instead
    # of shifting the whole buffer) keeps the update in place under jit.
    lags = (step - 1 - jnp.arange(slots)) % slots + 1
    coefficients = row[lags] if bands > 1 else None
    z = _draw(jax.random.fold_in(state.key, state.step), template, sampler)

    def one_leaf(z_leaf, past_leaf):
      correction = None if coefficients is None else jnp.tensordot(
          coefficients.astype(z_leaf.dtype), past_leaf, axes=1,
          precision=jax.lax.Precision.HIGHEST)  # not TF32: C as accounted
      return combine(row[0], z_leaf, correction)

    noise = jax.tree_util.tree_map(one_leaf, z, state.buffers[buffer_name])
    if bands > 1:
      kept = z if keep_draws else noise
      past = jax.tree_util.tree_map(
          lambda past_leaf, v: jax.lax.dynamic_update_index_in_dim(
              past_leaf, v.astype(past_leaf.dtype), step % slots, 0),
          state.buffers[buffer_name], kept)
    else:
      past = state.buffers[buffer_name]
    buffers = {buffer_name: past}
    if release == 'prefix':
      buffers['prefix'] = jax.tree_util.tree_map(
          jnp.add, state.buffers['prefix'], noise)
      noise = buffers['prefix']
    noise, refusal = _refuse_invalid(state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, buffers=buffers,
                                 refusal=refusal)

  return next_noise, init


def _regenerated_noise(decoder: np.ndarray, num_steps: int, name: str,
                       identity: str, sampler: Sampler):
  """`next`/`init` of `sum_{s <= t} decoder[t, s] z_s`, redrawing every z_s."""
  decoder = jnp.asarray(decoder, jnp.float32)

  def init(template, key):
    del template
    return NoiseState(key=key, step=jnp.zeros((), jnp.int32))

  def next_noise(state, template):
    check_state(state, identity, name)
    step = jnp.asarray(state.step)
    row = decoder[jnp.minimum(step, num_steps - 1)]

    def accumulate(s, total):
      z = _draw(jax.random.fold_in(state.key, s), template, sampler)
      return jax.tree_util.tree_map(
          lambda t, z_leaf: t + row[s].astype(t.dtype) * z_leaf, total, z)

    noise = jax.lax.fori_loop(0, jnp.minimum(step, num_steps - 1) + 1,
                              accumulate, _zeros(template))
    noise, refusal = _refuse_invalid(state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, refusal=refusal)

  return next_noise, init


def noise_buffer_count(mechanism: NoiseMechanism) -> int:
  """How many params-sized buffers the mechanism's state keeps.

  Found by tracing `init` on a scalar template with `jax.eval_shape` (so
  nothing is allocated): every buffer leaf then has one entry per
  params-sized buffer. The noise state takes about this many times the
  memory of the params (in float32 or wider).

  Example:
    >>> noise_buffer_count(matrix_factorization(np.eye(5)))   # dense: T - 1
    4

  Args:
    mechanism: a noise mechanism.

  Returns:
    The number of params-sized buffers (0 for i.i.d. noise, `bands - 1`
    for a banded strategy or a strategy given with its banded inverse, the
    number of buffers of a BLT).
  """
  state = jax.eval_shape(mechanism.init, jax.ShapeDtypeStruct((), jnp.float32),
                         jax.random.key(0))
  return int(sum(math.prod(leaf.shape)
                 for leaf in jax.tree_util.tree_leaves(state.buffers)))
