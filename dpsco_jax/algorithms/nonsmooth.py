"""Private nonsmooth nonconvex optimization (paper 004).

Kornowski, Liu and Talwar find (alpha, beta)-Goldstein stationary points of
Lipschitz losses that are neither smooth nor convex (ReLU networks, robust
losses): O2NC (Algorithm 2) run on the smoothed loss `f_alpha`, fed by a
variance-reduced private oracle of `grad f_alpha` (`dpsco_jax.smoothing`).

Transformations (optax, called as `update(None, state, params, batch=...)`):

* `o2nc`: Algorithm 2's outer loop. It consumes a gradient estimate at the
  query point z_t (the params the user holds), moves the "movement"
  `Delta_{t+1} = Proj_{B(0,D)}(Delta_t - eta g_t)` (projected online
  gradient descent), sets `x_t = x_{t-1} + Delta_t` and the next query point
  `z_{t+1} = x_t + s_{t+1} Delta_{t+1}`, `s ~ U[0, 1]`, and returns
  `z_{t+1} - z_t`. It keeps the block averages of the z's (blocks of M
  steps) and a uniformly drawn one (reservoir sampling), the algorithm's
  output: `o2nc_output(state)`.
* `nonsmooth_vr_gradient`: Algorithms 3 (zero order) and 5 (first order),
  single pass. Every `period` (Sigma) steps an anchor step restarts the
  running estimate with the clipped mean of per-example estimates over
  `anchor_batch_size` (B_1) fresh examples; every other step adds the
  clipped mean of per-example DIFFERENCES (estimate at z_t minus estimate at
  z_{t-1}, same example, independent directions) over `batch_size` (B_2)
  fresh examples. The CLEAN running estimate g_t (private state) is the
  prefix sum of the period's increments; the output is
  `g_t + stddev TREE(p)`, the tree noise of position `p = (t mod Sigma) + 1`
  of a FRESH tree per period (`noise.tree(T, release='prefix',
  restart_every=Sigma)`: a key folded with the period's index).
* `nonsmooth_multipass_gradient`: Algorithm 4 (multi-pass ERM): the whole
  data set every step, recursion on the NOISY previous output, a fresh
  Gaussian per release (`z_1` on anchors, `z_2` on differences), composed by
  the accountant (`algorithms.diff2_accounting`, the same composition of
  restart and difference Gaussians).

Errata implemented (notes 6.1): the tree position is `((t - 1) mod Sigma) +
1` in the paper's 1-based t, so the last step of a period gets noise (the
paper's `TREE(t mod Sigma)` adds none there), and the tree has
`floor(log2 Sigma) + 1` levels (the root included); anchors are the steps
with `(t - 1) mod Sigma = 0` (`count % Sigma == 0` here), which also works
for Sigma = 1; directions are on the sphere for the two-point estimator
(Algorithms 3 and 4 write the ball) and in the ball for the first-order
one (eq. (10) writes the sphere); Theorem 4.1's D and T are read
dimension-consistently (`nonsmooth_preset`).

Privacy (replace-one, the paper's relation; add/remove is accepted for the
single pass). Each per-example value is clipped (`C_1` anchors, `C_2`
differences), so one example moves an anchor increment by at most
`f C_1 / B_1` and a difference increment by at most `f C_2 / B_2` (f = 2
under replace-one), whatever the loss. One tree needs one bound for all
its increments (Proposition 2.5), `s = f max(C_1 / B_1, C_2 / B_2)`, and the
tree's node noise has std `noise_multiplier * s`. A single pass uses every
example once (`accounting.single_epoch(T)`, checked in every step by the
plans), so periods touch disjoint data and only one increment of one tree
sees a changed example. Steps past the calibrated T are refused by the
noise. The clip radii come from `smoothing.effective_clips` (the
concentration radius, "effective sensitivity") or
`smoothing.worst_case_clips`; the derivation, and the part of delta the
plans spend so that the run also covers the paper's unclipped algorithm,
are in `docs/nonsmooth.md`.

Secret state (never log or release): the oracles' `estimate` in the single
pass (the CLEAN running sum), every noise state, and the directions key.
The params (query points) and `o2nc`'s state are post-noise.

References:
  G. Kornowski, D. Liu, K. Talwar. Improved sample complexity for private
  nonsmooth nonconvex optimization. Algorithms 1-5, Proposition 2.5,
  Proposition 2.6, Theorems 3.1, 4.1, 6.1.
  A. Cutkosky, H. Mehta, F. Orabona. Optimal stochastic non-smooth
  non-convex optimization through online-to-non-convex conversion. ICML
  2023.
"""

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import guards
from dpsco_jax import keys
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax import parallel
from dpsco_jax import smoothing
from dpsco_jax.algorithms import diff2

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
Relation = neighboring.NeighboringRelation


# ------------------------------------------------------------------ O2NC


class O2ncState(NamedTuple):
  """State of `o2nc` (Algorithm 2). Every field is post-noise (releasable).

  Attributes:
    count: int32, steps done (t).
    x_prev: x_t, the end point of the last movement (x_{t-1} before the
      step).
    delta: Delta_{t+1}, the next movement (||delta|| <= D).
    block_sum: sum of the query points z of the current block.
    num_blocks: int32, completed blocks K.
    output: a block average drawn uniformly among the completed ones
      (x_out; zeros before the first block completes).
    last_block: the last completed block average.
    key: the key of the segment points s_t and of the output draw (public
      randomness of the optimizer, not noise).
  """

  count: jax.Array
  x_prev: PyTree
  delta: PyTree
  block_sum: PyTree
  num_blocks: jax.Array
  output: PyTree
  last_block: PyTree
  key: jax.Array



def _float_zeros(params: PyTree) -> PyTree:
  return jax.tree_util.tree_map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(
          jnp.result_type(p), jnp.float32)), params)


def _segment_point(key: jax.Array, step: jax.Array) -> jax.Array:
  return jax.random.uniform(jax.random.fold_in(key, step), (), jnp.float32)


@keywords.checked
def o2nc(
    *,
    learning_rate: float,
    movement_radius: float,
    block_length: int,
    key: estimators.KeyLike = None,
    reset_delta_each_block: bool = False,
) -> optax.GradientTransformation:
  """O2NC, the online-to-nonconvex conversion (paper 004 Algorithm 2).

  Given the gradient estimate g_t at the query point z_t (the params):

      Delta_{t+1} = min(1, D / ||Delta_t - eta g_t||) (Delta_t - eta g_t)
      x_t         = x_{t-1} + Delta_t
      z_{t+1}     = x_t + s_{t+1} Delta_{t+1},   s_{t+1} ~ U[0, 1]

  and returns `z_{t+1} - z_t`, so the params the user holds are always the
  query points (Delta_1 = 0: z_1 = x_0 = the initial params). The z's are
  averaged over blocks of M steps; `o2nc_output(state)` is a block average
  drawn uniformly among the completed ones (the algorithm's x_out,
  Proposition 2.6: `E ||grad_alpha h(x_out)|| <= (h(x_0) - inf h) / (D T) +
  3 G_1 / (2 sqrt(M)) + G_0` for `eta = D / (G_1 sqrt(M))` and `M D <=
  alpha`). Steps move z by at most 2D (`||z_{t+1} - z_t|| <= 2D`), which
  the difference clips rely on.

  Example:
    >>> tx = optax.chain(nonsmooth_vr_gradient(loss_fn, ...),
    ...                  o2nc(learning_rate=0.05, movement_radius=1e-3,
    ...                       block_length=50, key=1))
    >>> state = tx.init(params)

  Args:
    learning_rate: eta.
    movement_radius: D, the radius of the ball the movement stays in.
    block_length: M, steps per block average (theory: alpha / (4 D)).
    key: key or seed of the segment points and the output draw (None: fresh
      from OS entropy). Not noise: it may be public.
    reset_delta_each_block: start each block with Delta = 0 (the regret
      constant 3/2 assumes it; the paper's pseudocode does not reset).

  Returns:
    An `optax.GradientTransformation` with `O2ncState`.
  """
  learning_rate = checks.positive_finite(learning_rate, 'learning_rate')
  radius = checks.positive_finite(movement_radius, 'movement_radius')
  block_length = checks.positive_int(block_length, 'block_length')
  key = keys.fresh_key() if key is None else keys.as_key(key)

  def init_fn(params):
    estimators.check_params(params)
    start = jax.tree_util.tree_map(jnp.asarray, params)
    zeros = _float_zeros(params)
    return O2ncState(count=jnp.zeros([], jnp.int32), x_prev=start,
                     delta=zeros, block_sum=zeros,
                     num_blocks=jnp.zeros([], jnp.int32), output=zeros,
                     last_block=zeros, key=key)

  def update_fn(updates, state, params=None):
    checks.state_type(state, O2ncState, 'o2nc')
    estimators.check_params(params)
    if updates is None:
      raise ValueError('o2nc consumes a gradient estimate: chain it after a '
                       'private oracle (nonsmooth_vr_gradient)')
    gradient = estimators.cast_like(updates, state.delta)
    # x_t = x_{t-1} + Delta_t (Delta_t is the movement z_t was drawn on).
    x_now = jax.tree_util.tree_map(lambda x, d: x + d.astype(x.dtype),
                                   state.x_prev, state.delta)
    delta = optax.projections.projection_l2_ball(
        jax.tree_util.tree_map(lambda d, g: d - learning_rate * g,
                               state.delta, gradient), radius)
    block_sum = jax.tree_util.tree_map(lambda b, z: b + z.astype(b.dtype),
                                       state.block_sum, params)
    complete = (state.count + 1) % block_length == 0
    average = jax.tree_util.tree_map(lambda b: b / block_length, block_sum)
    num_blocks = state.num_blocks + complete.astype(jnp.int32)
    # Reservoir sampling: block k replaces the output with probability 1/k.
    draw = jax.random.uniform(
        jax.random.fold_in(jax.random.fold_in(state.key, 1), state.count))
    take = complete & (draw * num_blocks.astype(jnp.float32) < 1.0)
    select = lambda flag: lambda new, old: jnp.where(flag, new, old)
    output = jax.tree_util.tree_map(select(take), average, state.output)
    last_block = jax.tree_util.tree_map(select(complete), average,
                                        state.last_block)
    block_sum = jax.tree_util.tree_map(
        lambda b: jnp.where(complete, jnp.zeros_like(b), b), block_sum)
    if reset_delta_each_block:
      delta = jax.tree_util.tree_map(
          lambda d: jnp.where(complete, jnp.zeros_like(d), d), delta)
    s_next = _segment_point(state.key, state.count + 1)
    z_next = jax.tree_util.tree_map(
        lambda x, d: x + (s_next * d).astype(x.dtype), x_now, delta)
    step = jax.tree_util.tree_map(lambda z, p: (z - p).astype(jnp.result_type(p)),
                                  z_next, params)
    return step, O2ncState(
        count=state.count + 1, x_prev=x_now, delta=delta,
        block_sum=block_sum, num_blocks=num_blocks, output=output,
        last_block=last_block, key=state.key)

  return optax.GradientTransformation(init_fn, update_fn)


def o2nc_output(opt_state: Any, which: str = 'uniform') -> PyTree:
  """The output of O2NC: a block average of the query points.

  Example:
    >>> x_out = o2nc_output(opt_state)            # Algorithm 2's x_out
    >>> x_last = o2nc_output(opt_state, 'last')   # the last block average

  Args:
    opt_state: an `O2ncState`, or a chain's state holding one.
    which: 'uniform' (drawn uniformly among the completed blocks, what
      Proposition 2.6 bounds) or 'last' (the last completed block).

  Returns:
    A pytree like the params.

  Raises:
    ValueError: before the first block completes (fewer than M steps), or
      for another `which`.
  """
  state = checks.find_state(opt_state, O2ncState, 'o2nc')
  if which not in ('uniform', 'last'):
    raise ValueError(f"which must be 'uniform' or 'last', got {which!r}")
  if not isinstance(state.num_blocks, jax.core.Tracer) and int(
      state.num_blocks) == 0:
    raise ValueError('no block of O2NC is complete yet: run at least '
                     'block_length steps before reading the output')
  return state.output if which == 'uniform' else state.last_block


# --------------------------------------------------------------- oracles


class NonsmoothOracleState(NamedTuple):
  """State of the variance-reduced oracles (Algorithms 3, 4 and 5).

  Attributes:
    count: int32, steps done (t).
    prev_params: z_{t-1}, the previous query point (post-noise).
    estimate: the running estimate g_{t-1}: CLEAN in the single pass
      (`nonsmooth_vr_gradient`: private, never log or release it), the
      released noisy one in the multi-pass oracle.
    noise: the noise mechanism's state (secret).
    directions_key: the key of the per-example directions (secret: derived
      with the noise key).
  """

  count: jax.Array
  prev_params: PyTree
  estimate: PyTree
  noise: noise.NoiseState
  directions_key: jax.Array


@dataclasses.dataclass(frozen=True)
class _OracleShape:
  """What the two oracles share: the statistics, batch sizes and period.

  `step` is the statistic of both kinds of step
  (`smoothing.clipped_smoothed_step_sum`), for batch sizes B_1 = B_2 only:
  when they differ, the batch's static shape says which kind of step runs.
  """

  anchor: clipping.ClippedStatistic
  difference: clipping.ClippedStatistic
  period: int
  anchor_batch_size: int
  batch_size: int
  step: Optional[clipping.ClippedStatistic] = None


def _oracle_shape(loss_fn, *, order, smoothing_radius, num_directions,
                  anchor_directions, clips, period, anchor_batch_size,
                  batch_size, microbatch_size) -> _OracleShape:
  clips = smoothing.SmoothingClips(*clips)
  if anchor_directions is None:
    anchor_directions = 1 if order == 'first' else num_directions
  anchor_batch_size = checks.positive_int(anchor_batch_size,
                                          'anchor_batch_size')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  step = None
  if anchor_batch_size == batch_size:
    step = smoothing.clipped_smoothed_step_sum(
        loss_fn, clips.anchor, order=order, radius=smoothing_radius,
        num_directions=num_directions, anchor_directions=anchor_directions,
        microbatch_size=microbatch_size)
  return _OracleShape(
      anchor=smoothing.clipped_smoothed_grad_sum(
          loss_fn, clips.anchor, order=order, radius=smoothing_radius,
          num_directions=anchor_directions, microbatch_size=microbatch_size),
      difference=smoothing.clipped_smoothed_difference_sum(
          loss_fn, clips.difference, order=order, radius=smoothing_radius,
          num_directions=num_directions, microbatch_size=microbatch_size),
      period=checks.positive_int(period, 'period'),
      anchor_batch_size=anchor_batch_size, batch_size=batch_size, step=step)


def increment_sensitivities(shape: _OracleShape, relation: Relation
                            ) -> tuple[float, float]:
  """The l2 sensitivities of one anchor and one difference increment.

  Args:
    shape: the oracle's statistics and batch sizes.
    relation: the neighbouring relation.

  Returns:
    `(f C_1 / B_1, f C_2 / B_2)`.
  """
  return (shape.anchor.sensitivity(relation) / shape.anchor_batch_size,
          shape.difference.sensitivity(relation) / shape.batch_size)


def _increment(shape: _OracleShape, rows: smoothing.SmoothingBatch,
               here: PyTree, before: PyTree, anchor_step: jax.Array,
               size: int, batch_mask: Optional[jax.Array],
               axis_name: Optional[str] = None) -> PyTree:
  """This device's increment: an anchor's or a difference's clipped mean.

  No conditional runs on the device (a `lax.cond` would make it read
  `anchor_step` back to the host and synchronize its stream every step):

  * B_1 != B_2: the batch's static size (`size`, over all devices) says
    which kind of step this is, so the host traces only that statistic. A
    batch whose size does not match its step's kind (an anchor-sized batch
    on a difference step, or the reverse) is refused by the oracle's size
    check, so a statistic is never released under the other kind's noise.
  * B_1 = B_2: one statistic (`shape.step`) forms each example's anchor or
    difference value with a select, and clips it to `C_1` or `C_2`
    (`jnp.where`, a traced clip). Each example is clipped to its step's
    clip exactly as by the two statistics, so the increments' sensitivities
    (`increment_sensitivities`) are unchanged. Cost: anchor steps also
    evaluate the difference's estimate at the previous point, and with
    `anchor_directions != num_directions` every step also evaluates the
    anchor estimate.

  Returns:
    The local clipped sum divided by the step's batch size (B_1 or B_2).
  """
  if shape.step is None:
    if size == shape.anchor_batch_size:
      total = shape.anchor(rows, here, mask=batch_mask,
                           axis_name=axis_name).sum
    else:
      total = shape.difference(rows, here, before, mask=batch_mask,
                               axis_name=axis_name).sum
    return jax.tree_util.tree_map(lambda s: s / size, total)
  clip = jnp.where(anchor_step, jnp.float32(shape.anchor.l2_clip),
                   jnp.float32(shape.difference.l2_clip))
  step = dataclasses.replace(shape.step, l2_clip=clip)
  total = step(rows, here, before, anchor_step, mask=batch_mask,
               axis_name=axis_name).sum
  return jax.tree_util.tree_map(lambda s: s / shape.batch_size, total)


def _oracle(shape: _OracleShape, stddev_at, *, keep_noisy: bool, mechanism,
            key, name, axis_name,
            dimension) -> optax.GradientTransformationExtraArgs:
  """The oracle body: per-example keys, the anchor/difference increment
  (`_increment`, no branch on the device), the recursion restarted at
  anchors, the noise, the size check.

  `stddev_at(anchor_step)` is the noise std of the step. `keep_noisy`
  says which estimate the recursion continues from: the released one
  (Algorithm 4: the noise of each step is its own Gaussian) or the clean
  one (Algorithms 3 and 5: the tree's noise is on the prefix sum and is
  never fed back, notes erratum 5)."""
  key = keys.noise_key(key, name)
  noise_key = jax.random.fold_in(key, 0)
  directions_key = jax.random.fold_in(key, 1)
  if dimension is not None:
    dimension = checks.positive_int(dimension, 'dimension')

  def init_fn(params):
    estimators.check_params(params)
    if dimension is not None and smoothing.num_parameters(params) != dimension:
      raise ValueError(
          f'the params have {smoothing.num_parameters(params)} parameters, '
          f'but the clips were derived for dimension d = {dimension} (the '
          'zero-order weight d / (2 alpha) and the concentration radii '
          'depend on it)')
    return NonsmoothOracleState(
        count=jnp.zeros([], jnp.int32), prev_params=params,
        estimate=_float_zeros(params),
        noise=mechanism.init(params, noise_key),
        directions_key=directions_key)

  def update_fn(updates, state, params=None, *, batch=None, batch_mask=None,
                **extra_args):
    del extra_args
    estimators.check_first_in_chain(updates, name)
    checks.state_type(state, NonsmoothOracleState, name)
    estimators.check_params(params)
    if batch is None:
      raise ValueError(f'{name} needs the batch: update(None, state, params, '
                       'batch=batch)')
    local = clipping.batch_size_of(batch)
    offset = 0 if axis_name is None else jax.lax.axis_index(axis_name) * local
    rows = smoothing.SmoothingBatch(batch, smoothing.example_keys(
        jax.random.fold_in(state.directions_key, state.count), local, offset))
    anchor_step = state.count % shape.period == 0
    here = parallel.per_device(params, axis_name)
    before = parallel.per_device(state.prev_params, axis_name)

    size = local * parallel.axis_size(axis_name)
    increment = parallel.psum(
        _increment(shape, rows, here, before, anchor_step, size, batch_mask,
                   axis_name),
        axis_name)
    estimate = jax.tree_util.tree_map(
        lambda g, i: jnp.where(anchor_step, i, g + i), state.estimate,
        increment)
    output, noise_state = estimators.add_noise(
        estimate, state.noise, mechanism, stddev_at(anchor_step),
        axis_name=axis_name)
    if keep_noisy:
      estimate = output
    expected = jnp.where(anchor_step, shape.anchor_batch_size,
                         shape.batch_size)
    output, refusal = guards.record(
        [(size != expected,
          f'{name}: the batch has {size} examples, but the step is accounted '
          f'for {shape.anchor_batch_size} (anchor steps, every '
          f'{shape.period}-th from the first) or {shape.batch_size} (the '
          'others); pad with batch_mask if fewer are real', 'batch')],
        output, noise_state.refusal, state.count)
    noise_state = noise_state._replace(refusal=refusal)
    new_state = NonsmoothOracleState(
        count=state.count + 1, prev_params=params, estimate=estimate,
        noise=noise_state, directions_key=state.directions_key)
    return estimators.cast_like(output, params), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def nonsmooth_mechanism(num_steps: int, period: int) -> noise.NoiseMechanism:
  """The noise of the single-pass oracle: a fresh tree per period.

  Account with it: `accounting.calibrate_noise_multiplier(
  nonsmooth_mechanism(T, Sigma), accounting.single_epoch(T), epsilon,
  delta)`.

  Args:
    num_steps: T, the steps of the run (refused past it).
    period: Sigma, the steps of one tree (an anchor and Sigma - 1
      differences).

  Returns:
    `noise.tree(T, release='prefix', restart_every=Sigma, prefix_storage=
    'running')`.
  """
  return noise.tree(num_steps, release='prefix',
                    restart_every=min(period, num_steps),
                    prefix_storage='running')


@keywords.checked
def nonsmooth_vr_gradient(
    loss_fn: LossFn,
    *,
    order: str,
    smoothing_radius: float,
    num_directions: int,
    clips: smoothing.SmoothingClips,
    period: int,
    anchor_batch_size: int,
    batch_size: int,
    noise_multiplier: float,
    num_steps: int,
    anchor_directions: Optional[int] = None,
    key: estimators.KeyLike = None,
    neighboring_relation: Relation = Relation.REPLACE_ONE,
    microbatch_size: Optional[int] = None,
    axis_name: Optional[str] = None,
    dimension: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """The single-pass private oracle (paper 004 Algorithms 3 and 5).

  At step t (0-based count c, anchor when `c % period == 0`):

      anchor:     g_t = (1/B_1) sum_i clip_{C_1}(est(z_t; i))
      otherwise:  g_t = g_{t-1} + (1/B_2) sum_i clip_{C_2}(est(z_t; i)
                                                      - est(z_{t-1}; i))
      output:     g_t + noise_multiplier * s * TREE(c % period + 1)

  with `s = f max(C_1 / B_1, C_2 / B_2)` (f = 2 under replace-one) and TREE
  the prefix noise of the period's own tree (`nonsmooth_mechanism`). The
  estimates are `smoothing.zero_order_estimate` (Algorithm 3) or
  `smoothing.first_order_estimate` (Algorithm 5, one perturbation per
  anchor example by default). Each example must be FRESH (never used
  before): the plans check it.

  Example:
    >>> clips = smoothing.effective_clips(order='first', lipschitz=1.0, ...)
    >>> tx = optax.chain(
    ...     nonsmooth_vr_gradient(loss_fn, order='first',
    ...                           smoothing_radius=0.1, num_directions=4,
    ...                           clips=clips, period=10,
    ...                           anchor_batch_size=100, batch_size=10,
    ...                           noise_multiplier=z, num_steps=T),
    ...     o2nc(learning_rate=0.05, movement_radius=1e-3, block_length=25))

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    order: 'zero' or 'first'.
    smoothing_radius: alpha.
    num_directions: m, directions per estimate on difference steps.
    clips: `(C_1, C_2)` (`smoothing.effective_clips` or `worst_case_clips`).
    period: Sigma.
    anchor_batch_size: B_1.
    batch_size: B_2.
    noise_multiplier: tree node std over s, calibrated for
      `nonsmooth_mechanism(num_steps, period)` and `single_epoch(T)`.
    num_steps: T (the noise refuses step T + 1).
    anchor_directions: directions per anchor estimate (default: 1 first
      order, m zero order).
    key: the noise key (None: fresh from OS entropy); the directions are
      drawn from a key derived from it.
    neighboring_relation: the relation the noise is calibrated for.
    microbatch_size: optional cap on examples estimated at once.
    axis_name: the device axis; each device holds a shard of the batch.
    dimension: the d the clips were derived for; `init` refuses params
      with another parameter count (None: not checked).

  Returns:
    An `optax.GradientTransformationExtraArgs` with `NonsmoothOracleState`;
    call `update(None, state, params, batch=batch, batch_mask=None)`.
  """
  shape = _oracle_shape(
      loss_fn, order=order, smoothing_radius=smoothing_radius,
      num_directions=num_directions, anchor_directions=anchor_directions,
      clips=clips, period=period, anchor_batch_size=anchor_batch_size,
      batch_size=batch_size, microbatch_size=microbatch_size)
  mechanism = nonsmooth_mechanism(num_steps, period)
  multiplier = estimators.validate_noise_multiplier(
      noise_multiplier, 'nonsmooth_vr_gradient')
  stddev = multiplier * max(increment_sensitivities(shape,
                                                    neighboring_relation))
  return _oracle(shape, lambda anchor_step: stddev, keep_noisy=False,
                 mechanism=mechanism, key=key, name='nonsmooth_vr_gradient',
                 axis_name=axis_name, dimension=dimension)


@keywords.checked
def nonsmooth_multipass_gradient(
    loss_fn: LossFn,
    *,
    order: str,
    smoothing_radius: float,
    num_directions: int,
    clips: smoothing.SmoothingClips,
    period: int,
    num_examples: int,
    noise_multipliers: diff2.Diff2NoiseMultipliers,
    num_steps: int,
    anchor_directions: Optional[int] = None,
    key: estimators.KeyLike = None,
    microbatch_size: Optional[int] = None,
    axis_name: Optional[str] = None,
    dimension: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """The multi-pass ERM oracle (paper 004 Algorithm 4), zero or first order.

  Every step uses all n examples (full batch, replace-one neighbours):

      anchor:     gt_t = (1/n) sum_i clip_{C_1}(est(z_t; i)) + N(0, sigma_1^2)
      otherwise:  gt_t = gt_{t-1} + (1/n) sum_i clip_{C_2}(...diff...)
                         + N(0, sigma_2^2)

  with `sigma_k = z_k * 2 C_k / n`. The recursion is on the NOISY previous
  output (post-processing), so each release is one Gaussian mechanism on
  one increment; the run is `ceil(T / Sigma)` Gaussian(z_1) and the rest
  Gaussian(z_2), composed by the accountant
  (`algorithms.diff2_accounting.epsilon_spent(T, Sigma, (z_1, z_2), delta)`:
  the same composition). The paper states the first-order variant without
  analysis; it is the same with `smoothing.first_order_estimate`.

  Example:
    >>> tx = optax.chain(
    ...     nonsmooth_multipass_gradient(loss_fn, order='zero', ...,
    ...         noise_multipliers=Diff2NoiseMultipliers(3.0, 9.0)),
    ...     o2nc(learning_rate=0.05, movement_radius=1e-3, block_length=25))

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    order: 'zero' or 'first'.
    smoothing_radius: alpha.
    num_directions: m.
    clips: `(C_1, C_2)`.
    period: Sigma.
    num_examples: n, the whole data set passed as the batch every step.
    noise_multipliers: `(z_1, z_2)` as `Diff2NoiseMultipliers(restart=z_1,
      difference=z_2)` (the same composition as DIFF2's; `local` unused).
    num_steps: T (refused past it).
    anchor_directions: directions per anchor estimate (default m).
    key: the noise key (None: fresh from OS entropy).
    microbatch_size: optional cap on examples estimated at once.
    axis_name: the device axis; each device holds a shard of the data.
    dimension: the d the clips were derived for (None: not checked).

  Returns:
    An `optax.GradientTransformationExtraArgs` with `NonsmoothOracleState`.
  """
  num_examples = checks.positive_int(num_examples, 'num_examples')
  shape = _oracle_shape(
      loss_fn, order=order, smoothing_radius=smoothing_radius,
      num_directions=num_directions,
      anchor_directions=anchor_directions or num_directions, clips=clips,
      period=period, anchor_batch_size=num_examples, batch_size=num_examples,
      microbatch_size=microbatch_size)
  z = diff2.Diff2NoiseMultipliers(*(estimators.validate_noise_multiplier(
      v, 'nonsmooth_multipass_gradient') for v in noise_multipliers[:2]))
  anchor_sensitivity, difference_sensitivity = increment_sensitivities(
      shape, Relation.REPLACE_ONE)
  mechanism = noise.gaussian(checks.positive_int(num_steps, 'num_steps'))

  stddev_at = lambda anchor_step: jnp.where(
      anchor_step, z.restart * anchor_sensitivity,
      z.difference * difference_sensitivity)
  return _oracle(shape, stddev_at, keep_noisy=True, mechanism=mechanism,
                 key=key, name='nonsmooth_multipass_gradient',
                 axis_name=axis_name, dimension=dimension)


# --------------------------------------------------------------- presets


PROPOSITION_2_6 = 'proposition_2_6'


@keywords.checked
def released_noise_norm(*, noise_multiplier: float, sensitivity: float,
                        dimension: int, period: int = 1) -> float:
  """G_0's privacy part: the norm of the noise on one released estimate.

  A diagnostic and a step-size input, never a privacy quantity. The
  single-pass oracles (Algorithms 3 and 5) release the running estimate
  plus the prefix noise of the period's tree: at most `1 + ceil(log2
  Sigma)` nodes of std `z s` each (s the increment sensitivity), so its
  norm is about `z s sqrt(d (1 + ceil(log2 Sigma)))`. The multi-pass
  oracle (Algorithm 4) adds one Gaussian per release: `period=1` gives
  `z s sqrt(d)`.

  Example:
    >>> released_noise_norm(noise_multiplier=2.45, sensitivity=0.04,
    ...                     dimension=16, period=10)

  Args:
    noise_multiplier: z (of the step whose noise is largest).
    sensitivity: s, the l2 sensitivity of that step's increment.
    dimension: d.
    period: Sigma (1: no tree).

  Returns:
    The noise norm.
  """
  levels = 1 + math.ceil(math.log2(checks.positive_int(period, 'period')))
  return float(noise_multiplier * sensitivity * math.sqrt(
      checks.positive_int(dimension, 'dimension') * levels))


def proposition_2_6_learning_rate(*, movement_radius: float,
                                  block_length: int, lipschitz: float,
                                  noise_norm: float,
                                  scale: float = 1.0) -> float:
  """O2NC's step eta = scale D / (G_1 sqrt(M)), G_1 = L + G_0.

  Proposition 2.6 sets eta = D / (G_1 sqrt(M)) with G_1 a bound on the
  norm of the gradient estimates; here G_1 = L + the released noise norm
  (`released_noise_norm`), the practical reading used by the plans'
  `learning_rate='proposition_2_6'`. `scale` is what one tunes (the
  experiments tune it over a grid around 1).

  Example:
    >>> proposition_2_6_learning_rate(movement_radius=0.01, block_length=10,
    ...                               lipschitz=1.0, noise_norm=0.9)

  Args:
    movement_radius: D.
    block_length: M.
    lipschitz: L.
    noise_norm: G_0 (its privacy part).
    scale: a multiplier > 0.

  Returns:
    eta.
  """
  scale = checks.positive_finite(scale, 'scale')
  return float(scale * checks.positive_finite(movement_radius, 'movement_radius') / (
      (checks.positive_finite(lipschitz, 'lipschitz') + max(0.0, float(noise_norm))) *
      math.sqrt(checks.positive_int(block_length, 'block_length'))))


class NonsmoothParameters(NamedTuple):
  """Hyperparameters of a nonsmooth run (a preset's starting point).

  Attributes:
    num_steps: T.
    movement_radius: D.
    period: Sigma.
    anchor_batch_size: B_1 (n for the multi-pass oracle).
    batch_size: B_2 (n for the multi-pass oracle).
    block_length: M.
    num_directions: m.
    learning_rate: eta = D / (G_1 sqrt(M)).
    predicted_bound: the theorem's bound on E ||grad_{2 alpha} F(x_out)||
      with every constant and log set to 1 (an order of magnitude only).
  """

  num_steps: int
  movement_radius: float
  period: int
  anchor_batch_size: int
  batch_size: int
  block_length: int
  num_directions: int
  learning_rate: float
  predicted_bound: float


THEOREMS = ('3.1', '6.1', '4.1')


@keywords.checked
def nonsmooth_preset(
    theorem: str,
    *,
    num_examples: int,
    dimension: int,
    epsilon: float,
    delta: float,
    lipschitz: float,
    initial_gap: float,
    smoothing_radius: float,
    target_norm: Optional[float] = None,
) -> NonsmoothParameters:
  """The parameter settings of Theorems 3.1, 6.1 (single pass) and 4.1.

  Every O(.) constant and log factor is set to 1 (notes 6.4): the values
  are a starting point to tune from, and the noise never comes from here
  (the plans calibrate it with the accountant). Single pass (3.1 zero
  order, 6.1 first order): `T = n / 2`, `B_1 = Sigma`, `B_2 = 1`,

      D = min{(Phi alpha eps / (d L T))^(1/2),
              (Phi^3 alpha^2 eps / (d^(3/2) L^3 T^3))^(1/5),
              (Phi^2 alpha / (L^2 T^2 sqrt(d)))^(1/3)}
      Sigma = ceil((alpha / (eps D))^(2/3) + alpha / (D sqrt(d)))
      M = max(1, floor(alpha / (4 D)))
      m = log(d / delta) (d^2 B_1^2 + d alpha^2 / D^2)      (zero order)
        = max(1, log(d / delta) alpha^2 / (D^2 d))          (first order)

  (the theorem's fourth term of the min is implied by the others and
  dropped). Theorem 4.1 (multi-pass ERM, needs `target_norm` beta) in the
  dimension-consistent reading of its erratum: `D = alpha beta^2 / L^2`,
  `T = Phi L^2 / (alpha beta^3)`, `Sigma = alpha / (D sqrt(d))`, the paper's
  sigma_1, sigma_2 and the variance-driven `m = L^2 d Sigma / (n sigma_1^2)
  + L^2 d / (n sigma_2^2)`. In both, `G_0` is the theorem's variance bound
  (eq. (9); Lemma 4.4), `G_1 = L + G_0` and `eta = D / (G_1 sqrt(M))`
  (Proposition 2.6).

  Example:
    >>> p = nonsmooth_preset('6.1', num_examples=100_000, dimension=50,
    ...                      epsilon=1.0, delta=1e-6, lipschitz=1.0,
    ...                      initial_gap=1.0, smoothing_radius=0.1)

  Args:
    theorem: '3.1', '6.1' or '4.1'.
    num_examples: n.
    dimension: d.
    epsilon: the privacy target.
    delta: the privacy target.
    lipschitz: L.
    initial_gap: Phi >= F(x_0) - inf F.
    smoothing_radius: alpha (the theorems need alpha <= Phi / L).
    target_norm: beta, for Theorem 4.1.

  Returns:
    `NonsmoothParameters`.
  """
  if theorem not in THEOREMS:
    raise ValueError(f'theorem must be one of {THEOREMS}, got {theorem!r}')
  n = checks.positive_int(num_examples, 'num_examples')
  d = checks.positive_int(dimension, 'dimension')
  eps = checks.positive_finite(epsilon, 'epsilon')
  if not 0 < delta < 1:
    raise ValueError(f'delta must be in (0, 1), got {delta!r}')
  lip = checks.positive_finite(lipschitz, 'lipschitz')
  phi = checks.positive_finite(initial_gap, 'initial_gap')
  alpha = checks.positive_finite(smoothing_radius, 'smoothing_radius')
  if alpha > phi / lip:
    raise ValueError(f'the theorems assume alpha <= Phi / L = {phi / lip:g}, '
                     f'got alpha = {alpha:g}')
  log_delta = math.log(1 / delta)
  if theorem in ('3.1', '6.1'):
    steps = max(1, n // 2)
    movement = min(
        (phi * alpha * eps / (d * lip * steps)) ** 0.5,
        (phi ** 3 * alpha ** 2 * eps / (d ** 1.5 * lip ** 3 * steps ** 3)
         ) ** 0.2,
        (phi ** 2 * alpha / (lip ** 2 * steps ** 2 * math.sqrt(d))) ** (1 / 3))
    period = math.ceil((alpha / (eps * movement)) ** (2 / 3) +
                       alpha / (movement * math.sqrt(d)))
    anchor, batch = period, 1
    block = max(1, math.floor(alpha / (4 * movement)))
    if theorem == '3.1':
      directions = math.log(d * batch / delta) * (
          d ** 2 * anchor ** 2 + d * alpha ** 2 * batch ** 2 / movement ** 2)
    else:
      directions = math.log(d * batch / delta) * (
          batch ** 2 * alpha ** 2 / (movement ** 2 * d))
    sensitivity = max(2 * lip / anchor,
                      2 * 2 * lip * math.sqrt(d) * movement / (alpha * batch))
    log_period = max(1.0, math.log(period))
    sigma = 4 * sensitivity * math.sqrt(log_period * log_delta) / eps
    g0 = (lip / math.sqrt(period) +
          lip * movement * math.sqrt(d * period) / alpha +
          sigma * math.sqrt(d * log_period))
    g1 = lip + g0
    bound = 2 * phi / (movement * steps) + 1.5 * g1 / math.sqrt(block) + g0
  else:
    if target_norm is None:
      raise ValueError("theorem '4.1' needs target_norm (beta)")
    beta = checks.positive_finite(target_norm, 'target_norm')
    movement = alpha * beta ** 2 / lip ** 2
    steps = max(1, math.ceil(phi * lip ** 2 / (alpha * beta ** 3)))
    period = max(1, round(alpha / (movement * math.sqrt(d))))
    anchor = batch = n
    block = max(1, math.floor(alpha / (4 * movement)))
    sigma1 = lip * math.sqrt(steps * log_delta / period) / (n * eps)
    sigma2 = (lip * movement * math.sqrt(steps * d * log_delta) /
              (alpha * n * eps))
    directions = (lip ** 2 * d * period / (n * sigma1 ** 2) +
                  lip ** 2 * d / (n * sigma2 ** 2))
    g0 = math.sqrt(lip ** 2 * d ** 2 * period / (max(1.0, directions) * n) +
                   sigma1 ** 2 * d + sigma2 ** 2 * d * period)
    g1 = lip + g0
    bound = phi / (movement * steps) + lip * math.sqrt(
        movement / alpha) + g0
  return NonsmoothParameters(
      num_steps=int(steps), movement_radius=float(movement),
      period=int(period), anchor_batch_size=int(anchor),
      batch_size=int(batch), block_length=int(block),
      num_directions=max(1, math.ceil(directions)),
      learning_rate=float(movement / (g1 * math.sqrt(block))),
      predicted_bound=float(bound))
