"""Stochastic recursive gradients (papers 000 and 001).

The SRG estimator of paper 000/001 Algorithm 1 evaluates two gradients of
every FRESH example of batch B_t, at the current query point x_t and at the
previous one x_{t-1}, and clips their weighted DIFFERENCE

    Delta_t(d) = eta_t grad f(x_t, d) - eta_{t-1} grad f(x_{t-1}, d),

with eta_t = t + 1 (erratum: the papers' introductions write eta_t = t,
which divides by zero at t = 0). The running sum G_t = sum_{i<=t} Delta_i
telescopes to eta_t times a gradient estimate, and one example changes one
Delta_t by at most `l2_clip / B`, so the normalized estimate
`Grad_t = G_t / eta_t` has sensitivity `l2_clip / (B eta_t)`, the "1/t" of
the papers. Privacy comes from continual-counting noise on the prefix sums
G_t (the binary tree of 001 Lemma 4.3 = 000 Lemma 5.6, or matrix
factorization with prefix release).

Transformations (all optax `GradientTransformationExtraArgs`, called as
`update(None, state, params, batch=batch)`):

* `srg_gradient`: the noisy SRG estimate `(G_t + xi_t) / (B eta_t)`, where
  `xi_t` is the mechanism's prefix noise. The state keeps the CLEAN
  normalized `Grad_t` (notes, pitfall 4: the noise is never fed back into
  the recursion, since it is already noise on prefix sums).
* `accelerated_dp_srgd`: Algorithm 1: the estimate feeds the Nesterov-type
  coupling `z`, `y`, `x` with projection onto an l2 ball; returns
  `x_{t+1} - x_t` as the update, so the params the user holds are the query
  points x_t. The algorithm's output is y_T: `final_params(state)`.
  `gradient='independent'` is the ablation of 000 Theorem 5.13 (a fresh
  clipped minibatch gradient with i.i.d. noise in the same coupling).
* `unaccelerated_dp_srg`: the ablation of 000/001 §4.3: `srg_gradient`
  followed by projected SGD with step 1/beta.
* `dp_srg_memf`: paper 001 Algorithm 3 (DP-SRG-MEMF, corrected): the
  decayed recursion `Grad_t = c Grad_{t-1} + Deltatilde_t` with per-step
  matrix-factorization noise, chained into any optax optimizer.

Parameter presets for the theorems (`srgd_preset`) give the batch size,
number of steps, beta, clip norm and radius; the noise multiplier always
comes from the accountant (`accounting.calibrate_noise_multiplier`), the
papers' GDP formula being `method='gdp_paper'`.

Accounting: Algorithm 1 is a single pass, each example in exactly one batch
(`accounting.single_epoch(T)`), no amplification. Algorithm 3 repeats the
same batches in the same order every epoch (`accounting.FixedOrder(k, b)`),
checked in every step by `batching.fixed_order_guard`.

Non-private state (DESIGN.md convention 4): `SrgGradientState.grad` is the
CLEAN recursive gradient and the noise state holds the key. Never log,
release or share a checkpoint of them. The params (x_t) and
`AcceleratedSrgdState.y`/`.z` are post-noise and may be released.
"""

import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import keys
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax import parallel
from dpsco_jax import physical
from dpsco_jax.algorithms import mf

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


class SrgGradientState(NamedTuple):
  """State of `srg_gradient`.

  Attributes:
    count: int32, the step t (number of updates done).
    prev_params: x_{t-1}, where the fresh batch's second gradients are
      taken (post-noise params: releasable).
    grad: the CLEAN normalized recursive gradient Grad_{t-1} = G_{t-1} /
      eta_{t-1}, summed over devices. NOT private: never log or release it.
    noise: the prefix-noise mechanism's state (secret, see `noise`).
  """

  count: jax.Array
  prev_params: PyTree
  grad: PyTree
  noise: noise.NoiseState


def _float_zeros_like(params: PyTree) -> PyTree:
  return jax.tree_util.tree_map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(p.dtype,
                                                          jnp.float32)),
      params)


# Beyond this the unnormalized differences `eta_t grad f` leave float32's
# range (about 3e38) for gradients of norm up to about 1e8.
_LARGEST_WEIGHT = 1e30


class ScheduleOutsideTheoryWarning(UserWarning):
  """A weight schedule that Algorithm 1's analysis does not cover."""


def srg_weights(num_steps: int, schedule: str = 'linear', *,
                rate: Optional[float] = None) -> np.ndarray:
  """Weights {eta_t} of Algorithm 1: `t + 1` (the theory's) or `e^(rate t)`.

  The analysis (000 §5.2, 001 Claim 4.2) takes eta_t = t + 1 (the papers'
  "eta_t = t" is an erratum: eta_0 = 0 divides by zero). Paper 001's
  introduction motivates DP-SRG-MEMF by eta_t = e^(lambda t) with lambda
  large; that schedule breaks the analysis' condition
  `eta_t^2 <= 4 eta_{0:t}` (see `validate_weights`), and its weights leave
  float32's range after about 69 / lambda steps (`dp_srg_memf` runs the
  same recursion in normalized form for any length).

  Example:
    >>> srg_weights(4)
    array([1., 2., 3., 4.])
    >>> srg_weights(3, 'exponential', rate=0.5)   # e^0, e^0.5, e^1

  Args:
    num_steps: T.
    schedule: 'linear' (`t + 1`) or 'exponential' (`e^(rate t)`).
    rate: lambda, for 'exponential' (positive).

  Returns:
    float64 `[T]` weights eta_0..eta_{T-1}.

  Raises:
    ValueError: for an unknown schedule or a bad rate.
  """
  steps = np.arange(checks.positive_int(num_steps, 'num_steps'),
                    dtype=np.float64)
  if schedule == 'linear':
    if rate is not None:
      raise ValueError("rate is for schedule='exponential'")
    return steps + 1.0
  if schedule == 'exponential':
    return np.exp(checks.positive_finite(rate, 'rate') * steps)
  raise ValueError(f"schedule must be 'linear' or 'exponential', got "
                   f'{schedule!r}')


def validate_weights(weights: Any, num_steps: int, *,
                     outside_theory: str = 'refuse') -> np.ndarray:
  """Checks a weight schedule {eta_t} for Algorithm 1.

  Always required: T finite, positive, non-decreasing weights, at most
  1e30 (the unnormalized differences `eta_t grad f` are formed in float32).
  The privacy never depends on the weights: each example's clipped
  difference enters one prefix sum with the same clip whatever eta_t is.
  The analysis (000 Lemma 5.9 / 001 Claim 4.2 and the potential argument)
  also needs `eta_t^2 <= 4 eta_{0:t}` (`eta_{0:t}` the sum up to t) for
  every t: `outside_theory` says what to do when it fails.

  Example:
    >>> validate_weights(srg_weights(100), 100)             # t + 1: fine
    >>> validate_weights(srg_weights(100, 'exponential', rate=0.5), 100,
    ...                  outside_theory='warn')              # warns

  Args:
    weights: `[T]` eta_0..eta_{T-1}.
    num_steps: T.
    outside_theory: 'refuse' (ValueError), 'warn'
      (`ScheduleOutsideTheoryWarning`) or 'allow'.

  Returns:
    The weights as float64 `[T]`.

  Raises:
    ValueError: on a wrong length, non-finite, non-positive, decreasing or
      too large weights, or (with 'refuse') a violated theory condition,
      naming the first step where it fails.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  if outside_theory not in ('refuse', 'warn', 'allow'):
    raise ValueError("outside_theory must be 'refuse', 'warn' or 'allow', "
                     f'got {outside_theory!r}')
  eta = np.asarray(weights, np.float64)
  if eta.shape != (num_steps,):
    raise ValueError(f'weights must hold T = {num_steps} values eta_0.. '
                     f'eta_(T-1), got shape {eta.shape}')
  if not np.all(np.isfinite(eta)) or not np.all(eta > 0):
    raise ValueError('weights must be finite and positive')
  if np.any(np.diff(eta) < 0):
    t = int(np.argmax(np.diff(eta) < 0)) + 1
    raise ValueError(f'weights must be non-decreasing (eta_{t} < '
                     f'eta_{t - 1})')
  if eta[-1] > _LARGEST_WEIGHT:
    t = int(np.argmax(eta > _LARGEST_WEIGHT))
    raise ValueError(
        f'eta_{t} = {eta[t]:.3g} exceeds {_LARGEST_WEIGHT:g}: the '
        'differences eta_t grad f would overflow float32; run fewer steps, '
        'a slower schedule, or dp_srg_memf (the normalized recursion)')
  failing = np.nonzero(eta**2 > 4.0 * np.cumsum(eta) * (1 + 1e-12))[0]
  if failing.size and outside_theory != 'allow':
    t = int(failing[0])
    message = (f'eta_t^2 <= 4 eta_(0:t) fails at t = {t} ({eta[t]:.4g}^2 > '
               f'4 x {np.sum(eta[:t + 1]):.4g}): Algorithm 1\'s analysis '
               'does not cover this schedule (privacy does not depend on it)')
    if outside_theory == 'refuse':
      raise ValueError(message + "; pass outside_theory='warn' to run it")
    warnings.warn(message, ScheduleOutsideTheoryWarning, stacklevel=2)
  return eta


class _Weights(NamedTuple):
  """A validated schedule as float32 constants, indexed by the step."""

  eta: jax.Array        # eta_t
  previous: jax.Array   # eta_{t-1} (0 at t = 0)
  tau_next: jax.Array   # tau_{t+1} = eta_{t+1} / eta_{0:t+1}; 0 at T - 1

  def at(self, count: jax.Array):
    index = jnp.minimum(count, self.eta.shape[0] - 1)
    return self.eta[index], self.previous[index], self.tau_next[index]


def _weights_constants(weights: Any, num_steps: int,
                       outside_theory: str) -> Optional[_Weights]:
  if weights is None:
    return None
  eta = validate_weights(weights, num_steps, outside_theory=outside_theory)
  cumulative = np.cumsum(eta)
  # x_T is never queried (the output is y_T): tau_T = 0 makes it y_T.
  tau_next = np.append(eta[1:] / cumulative[1:], 0.0)
  as32 = lambda v: jnp.asarray(v, jnp.float32)
  return _Weights(as32(eta), as32(np.append(0.0, eta[:-1])), as32(tau_next))


@keywords.checked
def srg_gradient(
    loss_fn: LossFn,
    *,
    l2_clip: float,
    noise_multiplier: float,
    num_steps: Optional[int] = None,
    key: estimators.KeyLike = None,
    mechanism: Optional[noise.NoiseMechanism] = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ZERO_OUT),
    normalize_by: Optional[float] = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    weights: Any = None,
    outside_theory: str = 'refuse',
) -> optax.GradientTransformationExtraArgs:
  """Noisy stochastic recursive gradient (papers 000/001 Algorithm 1, lines 3-4).

  At step t (eta_t = t + 1), for each example d of the fresh batch:
  `Delta_t(d) = eta_t grad f(x_t, d) - t grad f(x_{t-1}, d)`, clipped to
  `l2_clip` as a whole (notes, pitfall 5); the clipped sum (over devices)
  updates the clean normalized recursion

      Grad_t = (t / eta_t) Grad_{t-1} + sum_d clip(Delta_t(d)) / (B eta_t)

  (numerically the same as G_t / eta_t with G_t the running sum, without
  ever forming the growing G_t), and the output is

      Gradtilde_t = Grad_t + noise_multiplier * Delta * xi_t / (B eta_t),

  with `xi_t` the mechanism's noise on the t-th prefix sum and `Delta` the
  sensitivity of one clipped sum (`l2_clip`, twice that under replace-one).
  At t = 0 it is the plain clipped mean gradient plus noise.

  Example:
    >>> tx = optax.chain(
    ...     srg_gradient(loss_fn, l2_clip=1.0, noise_multiplier=5.0,
    ...                  num_steps=100, key=0),
    ...     optax.sgd(0.1))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(None, state, params, batch=batch)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm of each per-example difference Delta_t(d).
    noise_multiplier: noise std over the sensitivity of one step's clipped
      sum, for the mechanism's node (or strategy) noise; calibrate it with
      `accounting.calibrate_noise_multiplier(mechanism, single_epoch(T),
      ...)`.
    num_steps: T; builds the default mechanism `noise.tree(T,
      release='prefix')` (the theory's binary tree). Not needed when
      `mechanism` is given.
    key: PRNG key or int seed of the noise (replicated across devices).
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    mechanism: a prefix-release noise mechanism instead of the tree, e.g.
      `noise.matrix_factorization(C, release='prefix')`.
    neighboring_relation: the relation the noise is calibrated for; default
      ZERO_OUT, the papers' (000/001): a fixed batch order's accounting
      assumes it, since adding or removing an example would move every
      later example to another batch (same sensitivity as add/remove).
    normalize_by: public batch size B (required with a padding mask).
    microbatch_size: optional cap on per-example differences held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name on several devices.
    weights: None (eta_t = t + 1) or `[T]` weights eta_0..eta_{T-1}
      (`srg_weights`; checked by `validate_weights`): Delta_t uses eta_t and
      eta_{t-1}, and Grad_t = G_t / eta_t.
    outside_theory: what `validate_weights` does with a schedule that
      breaks `eta_t^2 <= 4 eta_{0:t}`: 'refuse', 'warn' or 'allow'.

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=batch, batch_mask=None)`.

  Raises:
    ValueError: on a mechanism that does not release prefix-sum noise,
      neither `num_steps` nor `mechanism`, or a bad weight schedule.
  """
  mechanism = _prefix_mechanism(mechanism, num_steps)
  schedule = _weights_constants(weights, mechanism.num_steps, outside_theory)
  coefficients = _srg_coefficients(schedule)

  def recursion(step, grad, total, divisor, noise_state, stddev):
    eta, previous = coefficients(step)
    # Clean normalized prefix sum G_t / eta_t; the noise is on G_t, i.e.
    # stddev * xi_t / (B eta_t) on the normalized value, never fed back.
    grad = jax.tree_util.tree_map(
        lambda g, s: (previous / eta) * g + s / (divisor * eta), grad, total)
    noisy, noise_state = estimators.add_noise(
        grad, noise_state, mechanism, stddev / (divisor * eta),
        axis_name=axis_name)
    return noisy, grad, noise_state

  return _recursive_gradient(
      SrgGradientState, coefficients, recursion, loss_fn, mechanism=mechanism,
      l2_clip=l2_clip, noise_multiplier=noise_multiplier, key=key,
      neighboring_relation=neighboring_relation, normalize_by=normalize_by,
      microbatch_size=microbatch_size,
      clipping_method=clipping_method, axis_name=axis_name)


def _srg_coefficients(schedule: Optional[_Weights]
                      ) -> Callable[[jax.Array], tuple[Any, Any]]:
  """`step -> (eta_t, eta_{t-1})` of `srg_gradient`'s differences."""

  def coefficients(step):
    # (eta_t, eta_{t-1}) of eta_t grad f(x_t, d) - eta_{t-1} grad
    # f(x_{t-1}, d); eta_t = t + 1 unless a schedule is given.
    if schedule is None:
      return step + 1.0, step
    eta, previous, _ = schedule.at(step.astype(jnp.int32))
    return eta, previous

  return coefficients


@keywords.checked
def srg_physical_form(loss_fn: LossFn, *, l2_clip: float, num_steps: int,
                      physical_batch_size: int,
                      microbatch_size: Optional[int] = None,
                      clipping_method: str = 'auto', weights: Any = None,
                      outside_theory: str = 'refuse',
                      state_of: Callable[[Any], Any] = lambda s: s,
                      ) -> physical.PhysicalForm:
  """The physical form of `srg_gradient` built with these arguments.

  Each physical batch adds its clipped differences `eta_t grad f(x_t, d) -
  eta_{t-1} grad f(x_{t-1}, d)` at the points and weights of the
  estimator's state; the estimator then takes the sum as `update(...,
  clipped_sum=...)`.

  Example:
    >>> form = srg_physical_form(loss_fn, l2_clip=1.0, num_steps=100,
    ...                          physical_batch_size=64,
    ...                          state_of=lambda opt_state: opt_state[0][0])

  Args:
    loss_fn, l2_clip, num_steps, microbatch_size, clipping_method, weights,
      outside_theory: as given to `srg_gradient`.
    physical_batch_size: P.
    state_of: the `SrgGradientState` within the whole chain's state.

  Returns:
    A `physical.PhysicalForm`.
  """
  return _difference_form(
      _srg_coefficients(_weights_constants(weights, num_steps,
                                           outside_theory)),
      loss_fn, l2_clip, physical_batch_size, microbatch_size,
      clipping_method, state_of)


def _difference_form(coefficients, loss_fn, l2_clip, physical_batch_size,
                     microbatch_size, clipping_method, state_of
                     ) -> physical.PhysicalForm:
  """A recursive gradient's physical form: the clipped differences at
  `(params, prev_params, *coefficients(count))` of its state."""

  def arguments(opt_state, params):
    state = state_of(opt_state)
    a, b = coefficients(state.count.astype(jnp.float32))
    return params, state.prev_params, a, b

  return physical.PhysicalForm(
      statistic=clipping.clipped_grad_difference_sum(
          loss_fn, l2_clip, microbatch_size=microbatch_size,
          clipping_method=clipping_method),
      arguments=arguments, physical_batch_size=physical_batch_size)


def _recursive_gradient(
    state_class, coefficients, recursion, loss_fn: LossFn, *,
    mechanism: noise.NoiseMechanism, l2_clip: float, noise_multiplier: float,
    key: estimators.KeyLike = None,
    neighboring_relation: neighboring.NeighboringRelation,
    normalize_by: Optional[float], microbatch_size: Optional[int],
    axis_name: Optional[str], clipping_method: str = 'auto'
) -> optax.GradientTransformationExtraArgs:
  """The estimator shared by Algorithms 1 and 3: clipped differences, then a
  recursion that says where the noise goes.

  Args:
    state_class: `SrgGradientState` or `SrgMemfState` (same fields).
    coefficients: `step -> (a_t, b_t)`: each example contributes
      `clip(a_t grad f(x_t, d) - b_t grad f(x_{t-1}, d))`.
    recursion: `(step, grad, total, divisor, noise_state, stddev) ->
      (output, new grad, noise_state)`, with `total` the clipped sum over
      every device and `stddev` the noise std on one step's sum.
    loss_fn, mechanism, l2_clip, noise_multiplier, key, neighboring_relation,
      normalize_by, microbatch_size, axis_name, clipping_method: as in
      `srg_gradient`.

  Returns:
    The transformation.
  """
  statistic = clipping.clipped_grad_difference_sum(
      loss_fn, l2_clip, microbatch_size=microbatch_size,
                        clipping_method=clipping_method)
  noise_multiplier = estimators.validate_noise_multiplier(
      noise_multiplier, f'recursive gradient ({mechanism.name})')
  stddev = noise_multiplier * statistic.sensitivity(neighboring_relation)
  key = keys.noise_key(key, f'recursive gradient ({mechanism.name})')
  estimators.validate_normalize_by(normalize_by)

  def init_fn(params):
    estimators.check_params(params)
    return state_class(
        count=jnp.zeros([], jnp.int32), prev_params=params,
        grad=_float_zeros_like(params), noise=mechanism.init(params, key))

  def update_fn(updates, state, params=None, *, batch=None, batch_mask=None,
                clipped_sum=None, **extra_args):
    del extra_args
    estimators.check_first_in_chain(updates, 'srg_gradient')
    checks.state_type(state, state_class, 'srg_gradient')
    estimators.check_params(params)
    step = state.count.astype(jnp.float32)
    if clipped_sum is not None:
      # Accumulated over physical batches (`dpsco_jax.physical`), at this
      # state's points and coefficients (`srg_physical_form`,
      # `memf_physical_form`).
      divisor = estimators.accumulated_batch_size(normalize_by,
                                                  'srg_gradient')
      clipped = clipped_sum
    else:
      divisor = estimators.public_batch_size(batch, batch_mask, normalize_by,
                                             axis_name)
      a, b = coefficients(step)
      clipped = statistic(batch, parallel.per_device(params, axis_name),
                          parallel.per_device(state.prev_params, axis_name),
                          a, b, mask=batch_mask, axis_name=axis_name)
    total = parallel.psum(clipped.sum, axis_name)
    output, grad, noise_state = recursion(step, state.grad, total, divisor,
                                          state.noise, stddev)
    new_state = state_class(count=state.count + 1, prev_params=params,
                            grad=grad, noise=noise_state)
    return estimators.cast_like(output, params), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _prefix_mechanism(mechanism: Optional[noise.NoiseMechanism],
                      num_steps: Optional[int]) -> noise.NoiseMechanism:
  if mechanism is None:
    if num_steps is None:
      raise ValueError('give num_steps (for the default binary tree) or a '
                       'prefix-release mechanism')
    return srg_mechanism(num_steps)
  if mechanism.release != 'prefix':
    raise ValueError(
        'the recursive gradient needs noise on PREFIX sums (release='
        f"'prefix'), got {mechanism.name}: per-step noise on G_t would not "
        'be the continual-counting mechanism the accounting assumes')
  if num_steps is not None and num_steps != mechanism.num_steps:
    raise ValueError(f'num_steps={num_steps} disagrees with the mechanism '
                     f'({mechanism.num_steps} steps)')
  return mechanism


def srg_mechanism(num_steps: int, *, honaker: bool = False
                  ) -> noise.NoiseMechanism:
  """The default noise of `srg_gradient`: a binary tree on prefix sums.

  Account with it: `accounting.calibrate_noise_multiplier(srg_mechanism(T),
  accounting.single_epoch(T), epsilon, delta)`. The plain tree keeps its
  last prefix noise in a buffer and adds the residual (`prefix_storage=
  'running'`: two node draws per step on average instead of about
  `log2(T) / 2`, for one params-sized buffer); Honaker's keeps its level
  buffers.

  Args:
    num_steps: T, the number of steps (one tree, no restarts).
    honaker: use Honaker's variance-reduced node estimates (same privacy).

  Returns:
    `noise.tree(num_steps, release='prefix', honaker=honaker, ...)`.
  """
  return noise.tree(num_steps, release='prefix', honaker=honaker,
                    prefix_storage='regenerate' if honaker else 'running')


class AcceleratedSrgdState(NamedTuple):
  """State of `accelerated_dp_srgd` (Algorithm 1).

  Attributes:
    count: int32, the step t.
    z: z_t, the mirror-descent sequence (post-noise: releasable).
    y: y_t, the gradient-step sequence; the algorithm's output is y_T
      (post-noise: releasable). Read it with `final_params`.
    estimator: the gradient estimator's state (`SrgGradientState`, or
      `estimators.NoisyGradientState` for `gradient='independent'`). Holds
      non-private values: never log or release it.
  """

  count: jax.Array
  z: PyTree
  y: PyTree
  estimator: Any



def _validate_radius(radius: Optional[float]) -> Optional[float]:
  if radius is None:
    return None
  return checks.positive_finite(radius, 'radius')


def project_l2_ball(tree: PyTree, radius: Optional[float]) -> PyTree:
  """Euclidean projection onto {x : ||x||_2 <= radius}, global over leaves.

  The norm is taken over the whole pytree (notes, pitfall 8): projecting
  each leaf on its own would not be the projection onto the set.

  Example:
    >>> project_l2_ball({'w': jnp.array([3.0, 4.0])}, 1.0)   # {'w': [.6, .8]}

  Args:
    tree: the point to project.
    radius: the ball's radius; None for no constraint (identity).

  Returns:
    The projected pytree.
  """
  if radius is None:
    return tree
  return optax.projections.projection_l2_ball(tree, radius)


def _check_inside(params: PyTree, radius: Optional[float]) -> None:
  if radius is None:
    return
  norm = optax.tree.norm(params)
  if isinstance(norm, jax.core.Tracer):
    return
  if float(norm) > radius * (1 + 1e-6):
    raise ValueError(
        f'the initial params have norm {float(norm):.6g} > radius {radius}: '
        'Algorithm 1 starts inside the constraint set (x_0 = z_0, the '
        'theory takes 0); project them first (project_l2_ball)')


def nesterov_coupling(
    estimator: optax.GradientTransformationExtraArgs,
    *,
    beta: float,
    radius: Optional[float],
    weights: Any = None,
    outside_theory: str = 'refuse',
) -> optax.GradientTransformationExtraArgs:
  """The accelerated outer loop of Algorithm 1 around any gradient estimator.

  With eta_t = t + 1 and tau_{t+1} = 2 / (t + 3) (tau_t = eta_t / eta_{0:t};
  the papers' eta_t = t is an erratum), given the estimator's noisy
  `Gradtilde_t` at the query point x_t (the params):

      z_{t+1} = Proj(z_t - (eta_t / beta) Gradtilde_t)
      y_{t+1} = Proj(x_t - Gradtilde_t / beta)
      x_{t+1} = (1 - tau_{t+1}) y_{t+1} + tau_{t+1} z_{t+1}

  Both projections see the SAME noisy estimate (one noise draw per step:
  `b_t` in z and `b_t / eta_t` in y, notes pitfall 3) and come after the
  noise (pitfall 8). The update returned is `x_{t+1} - x_t`.

  Args:
    estimator: a transformation whose output is the noisy gradient estimate
      at `params` (`srg_gradient`, or `estimators.noisy_gradient`).
    beta: the scaling beta (theory: beta >= M; >= 2 M T when constrained).
    radius: radius R of the l2-ball constraint set, or None for R^p.
    weights: None (eta_t = t + 1, tau_{t+1} = 2 / (t + 3)) or `[T]`
      weights, the same as the estimator's: eta_t scales the z step and
      tau_{t+1} = eta_{t+1} / eta_{0:t+1} (x_T, never queried, is y_T).
    outside_theory: as in `validate_weights`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `AcceleratedSrgdState`;
    extra args are forwarded to the estimator.
  """
  beta = checks.positive_finite(beta, 'beta')
  radius = _validate_radius(radius)
  schedule = (None if weights is None else _weights_constants(
      weights, len(np.asarray(weights)), outside_theory))

  def init_fn(params):
    estimators.check_params(params)
    _check_inside(params, radius)
    start = jax.tree_util.tree_map(jnp.asarray, params)
    return AcceleratedSrgdState(count=jnp.zeros([], jnp.int32), z=start,
                                y=start, estimator=estimator.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    checks.state_type(state, AcceleratedSrgdState, 'nesterov_coupling')
    estimators.check_params(params)
    gradient, inner = estimator.update(updates, state.estimator, params,
                                       **extra_args)
    if schedule is None:
      step = state.count.astype(jnp.float32)
      eta, tau_next = step + 1.0, 2.0 / (step + 3.0)
    else:
      eta, _, tau_next = schedule.at(state.count)
    z = project_l2_ball(
        jax.tree_util.tree_map(lambda z, g: z - (eta / beta) * g, state.z,
                               gradient), radius)
    y = project_l2_ball(
        jax.tree_util.tree_map(lambda x, g: x - g / beta, params, gradient),
        radius)
    new_updates = jax.tree_util.tree_map(
        lambda y, z, x: ((1.0 - tau_next) * y + tau_next * z - x).astype(
            x.dtype), y, z, params)
    return new_updates, AcceleratedSrgdState(
        count=state.count + 1, z=z, y=y, estimator=inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@keywords.checked
def accelerated_dp_srgd(
    loss_fn: LossFn,
    *,
    l2_clip: float,
    noise_multiplier: float,
    num_steps: int,
    beta: float,
    radius: Optional[float],
    key: estimators.KeyLike = None,
    gradient: str = 'srg',
    mechanism: Optional[noise.NoiseMechanism] = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ZERO_OUT),
    normalize_by: Optional[float] = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    weights: Any = None,
    outside_theory: str = 'refuse',
) -> optax.GradientTransformationExtraArgs:
  """Accelerated-DP-SRGD, papers 000 and 001 Algorithm 1 (corrected).

  One pass over the data in T batches of size B: step t takes the fresh
  batch B_t, forms the noisy recursive gradient (`srg_gradient`, binary-tree
  prefix noise by default, matrix factorization via `mechanism`) and takes
  the coupled steps of `nesterov_coupling`. Use it as the whole optimizer
  (do not chain another one after it): `optax.apply_updates(params,
  updates)` moves the params to the next query point x_{t+1}; the output of
  the algorithm is y_T, read with `final_params(state)`.

  Errata applied (notes §1.1, §7): eta_t = t + 1 (not t), tau_{t+1} =
  2 / (t + 3), one noise draw per step shared by z and y, the per-example
  DIFFERENCE clipped with a global norm, projections after the noise.

  `gradient='independent'` is the ablation of 000 Theorem 5.13 (001
  Theorem 4.11): the same coupling on the clipped minibatch gradient at
  x_t with i.i.d. Gaussian noise (`mechanism` defaults to
  `noise.gaussian(T)`), i.e. no recursion.

  Example:
    >>> T = 100
    >>> z = accounting.calibrate_noise_multiplier(
    ...     srg_mechanism(T), accounting.single_epoch(T), 1.0, 1e-6)
    >>> tx = accelerated_dp_srgd(loss_fn, l2_clip=1.0, noise_multiplier=z,
    ...                          num_steps=T, beta=10.0, radius=1.0, key=0)
    >>> state = tx.init(params)
    >>> for t in range(T):
    ...   updates, state = tx.update(None, state, params, batch=batches[t])
    ...   params = optax.apply_updates(params, updates)
    >>> output = final_params(state)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm of each per-example difference (or gradient, for
      `gradient='independent'`).
    noise_multiplier: noise std over one step's sensitivity, from the
      accountant for the same mechanism and `single_epoch(T)`.
    num_steps: T = n / B.
    beta: the scaling beta (see `srgd_preset` for the theorems' values).
    radius: radius R of the l2-ball constraint set (global norm over the
      params pytree), or None for no constraint.
    key: PRNG key or int seed of the noise (replicated across devices).
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    gradient: 'srg' (Algorithm 1) or 'independent' (Theorem 5.13 ablation).
    mechanism: the noise mechanism; prefix release for 'srg' (default
      `srg_mechanism(T)`), per-step for 'independent' (default
      `noise.gaussian(T)`).
    neighboring_relation: the relation the noise is calibrated for; default
      ZERO_OUT, the papers' (000/001): a fixed batch order's accounting
      assumes it, since adding or removing an example would move every
      later example to another batch (same sensitivity as add/remove).
    normalize_by: public batch size B (required with a padding mask).
    microbatch_size: optional cap on per-example values held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name on several devices.
    weights: None (eta_t = t + 1, the analysis') or a `[T]` schedule
      eta_0..eta_{T-1} (`srg_weights`, e.g. paper 001's `e^(lambda t)`),
      used by the recursion and the coupling alike ('srg' only).
    outside_theory: what to do with a schedule breaking
      `eta_t^2 <= 4 eta_{0:t}` (`validate_weights`): 'refuse' (default),
      'warn' or 'allow'.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `AcceleratedSrgdState`;
    call `update(None, state, params, batch=batch, batch_mask=None)`.

  Raises:
    ValueError: on invalid beta, radius, gradient, mechanism or weights,
      or initial params outside the ball.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  if weights is not None:
    if gradient != 'srg':
      raise ValueError("weights are for gradient='srg' (the independent "
                       'variant has no recursion to weight)')
    weights = validate_weights(weights, num_steps,
                               outside_theory=outside_theory)
  if gradient == 'srg':
    estimator = srg_gradient(
        loss_fn, l2_clip=l2_clip, noise_multiplier=noise_multiplier,
        num_steps=None if mechanism is not None else num_steps, key=key,
        mechanism=mechanism, neighboring_relation=neighboring_relation,
        normalize_by=normalize_by, microbatch_size=microbatch_size,
        clipping_method=clipping_method, axis_name=axis_name,
        weights=weights, outside_theory='allow')
    if mechanism is not None and mechanism.num_steps != num_steps:
      raise ValueError(f'num_steps={num_steps} disagrees with the mechanism '
                       f'({mechanism.num_steps} steps)')
  elif gradient == 'independent':
    if mechanism is None:
      mechanism = noise.gaussian(num_steps)
    elif mechanism.release != 'per_step':
      raise ValueError('the independent-gradient variant adds fresh noise to '
                       f'each minibatch gradient: use a per-step mechanism, '
                       f'got {mechanism.name}')
    estimator = estimators.noisy_gradient(
        loss_fn, l2_clip=l2_clip, noise_multiplier=noise_multiplier,
        mechanism=mechanism, key=key,
        neighboring_relation=neighboring_relation, normalize_by=normalize_by,
        microbatch_size=microbatch_size,
        clipping_method=clipping_method, axis_name=axis_name)
  else:
    raise ValueError(
        f"gradient must be 'srg' or 'independent', got {gradient!r}")
  return nesterov_coupling(estimator, beta=beta, radius=radius,
                           weights=weights, outside_theory='allow')


def final_params(state: Any) -> PyTree:
  """The output y_T of Algorithm 1 (000/001: every theorem bounds F(y_T)).

  Example:
    >>> output = final_params(state)   # after the last update

  Args:
    state: the state of `accelerated_dp_srgd` (or of a chain containing it).

  Returns:
    y_t of the last update (x_0 before any update).

  Raises:
    ValueError: if no `AcceleratedSrgdState` is found in `state`.
  """
  return checks.find_state(state, AcceleratedSrgdState,
                           'accelerated_dp_srgd').y


def projection(radius: Optional[float]) -> optax.GradientTransformation:
  """Makes the update land in the l2 ball: `Proj(params + u) - params`.

  Chain it last, after the optimizer (it needs the params).

  Example:
    >>> tx = optax.chain(optax.sgd(0.1), projection(1.0))

  Args:
    radius: the ball's radius (None: identity).

  Returns:
    An `optax.GradientTransformation` (stateless).
  """
  radius = _validate_radius(radius)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError('projection needs the params: update(u, state, params)')
    target = project_l2_ball(optax.apply_updates(params, updates), radius)
    return jax.tree_util.tree_map(lambda a, p: (a - p).astype(p.dtype),
                                  target, params), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update_fn)


@keywords.checked
def unaccelerated_dp_srg(
    loss_fn: LossFn,
    *,
    l2_clip: float,
    noise_multiplier: float,
    num_steps: int,
    beta: float,
    radius: Optional[float],
    key: estimators.KeyLike = None,
    mechanism: Optional[noise.NoiseMechanism] = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ZERO_OUT),
    normalize_by: Optional[float] = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Unaccelerated SRG, the ablation of papers 000/001 §4.3.

  `x_{t+1} = Proj(x_t - Gradtilde_t / beta)` with the same noisy recursive
  gradient as Algorithm 1. The papers show its variance is Omega(1) at
  large batches (it needs B = O(1) for one epoch), which is why Algorithm 1
  adds acceleration; it is here to measure that.

  Example:
    >>> tx = unaccelerated_dp_srg(loss_fn, l2_clip=1.0, noise_multiplier=z,
    ...                           num_steps=T, beta=10.0, radius=1.0, key=0)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm of each per-example difference.
    noise_multiplier: as in `srg_gradient` (same mechanism, same accounting).
    num_steps: T.
    beta: inverse step size.
    radius: l2-ball radius, or None.
    key: PRNG key or int seed of the noise.
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    mechanism: prefix-release mechanism (default `srg_mechanism(T)`).
    neighboring_relation: the relation the noise is calibrated for; default
      ZERO_OUT, the papers' (000/001): a fixed batch order's accounting
      assumes it, since adding or removing an example would move every
      later example to another batch (same sensitivity as add/remove).
    normalize_by: public batch size B (required with a padding mask).
    microbatch_size: optional cap on per-example differences held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name on several devices.

  Returns:
    `optax.chain(srg_gradient(...), optax.sgd(1 / beta), projection(R))`.
  """
  beta = checks.positive_finite(beta, 'beta')
  return optax.chain(
      srg_gradient(
          loss_fn, l2_clip=l2_clip, noise_multiplier=noise_multiplier,
          num_steps=None if mechanism is not None else num_steps,
          mechanism=mechanism, key=key,
          neighboring_relation=neighboring_relation,
          normalize_by=normalize_by, microbatch_size=microbatch_size,
                                     clipping_method=clipping_method,
          axis_name=axis_name),
      optax.sgd(1.0 / beta),
      projection(radius))


class SrgMemfState(NamedTuple):
  """State of `dp_srg_memf` (paper 001 Algorithm 3).

  Attributes:
    count: int32, the step t.
    prev_params: x_{t-1} (post-noise params: releasable).
    grad: the NOISY decayed gradient Grad_{t-1} (post-noise; it is what was
      released to the optimizer).
    noise: the matrix-factorization noise state (secret key and buffer).
  """

  count: jax.Array
  prev_params: PyTree
  grad: PyTree
  noise: noise.NoiseState


def validate_decay(decay: float) -> float:
  """Returns the decay c as a float, or raises if it is not in [0, 1].

  Args:
    decay: c = eta_{t-1} / eta_t (001's experiments: e^{-5/2}).

  Returns:
    `float(decay)`.

  Raises:
    ValueError: if outside [0, 1] or not finite.
  """
  value = float(decay)
  if not 0.0 <= value <= 1.0:
    raise ValueError(f'decay must be in [0, 1] (c = eta_(t-1)/eta_t for '
                     f'non-decreasing weights), got {decay!r}')
  return value


@keywords.checked
def dp_srg_memf(
    loss_fn: LossFn,
    *,
    l2_clip: float,
    noise_multiplier: float,
    strategy: Optional[np.ndarray] = None,
    steps_per_epoch: int,
    decay: float,
    mechanism: Optional[noise.NoiseMechanism] = None,
    key: estimators.KeyLike = None,
    num_examples: Optional[int] = None,
    check_order: bool = True,
    storage: str = 'buffer',
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ZERO_OUT),
    normalize_by: Optional[float] = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-SRG-MEMF, paper 001 Algorithm 3 (corrected), as an optax estimator.

  At step t = i b + j (epoch i, batch j), with c_0 = 0 and c_t = `decay`:

      Delta_t      = sum_d clip(grad l(x_t; d) - c_t grad l(x_{t-1}; d))
      Deltatilde_t = (Delta_t + noise_multiplier * Delta * (C^-1 xi)_t) / B
      Grad_t       = c_t Grad_{t-1} + Deltatilde_t          (the output)

  It is the normalized form of the recursion with eta_t = c^{-t}: the
  exponential weights themselves overflow even float64 (e^{1500} at
  c = e^{-2.5}, T = 600; notes pitfall 11), the normalized values never do.

  Corrections (notes §1.6, pitfall 13): the noise is added ONCE (the
  printed line 7 adds `C^-1 Z` a second time); the noise carries the
  `Ccl / B` scale; c_0 = 0, so the first output is DP-MEMF's; the step
  index is `i b + j`. With `decay=0` it equals `dpmemf` exactly. The
  matching workload for the strategy is `strategies.workload(k b, 'true',
  momentum=0.9, decay=c)` (= M A L).

  Example:
    >>> c = math.exp(-2.5)
    >>> C = strategies.optimize_strategy(
    ...     strategies.workload(120, 'true', momentum=0.9, decay=c), 1)
    >>> tx = optax.chain(
    ...     dp_srg_memf(loss_fn, l2_clip=1.0, noise_multiplier=52.7,
    ...                 strategy=C, steps_per_epoch=120, decay=c,
    ...                 num_examples=60_000, key=0),
    ...     optax.sgd(0.5, momentum=0.9))

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: clip norm Ccl of each per-example difference.
    noise_multiplier: noise std over one step's sensitivity; calibrate it
      with `accounting.calibrate_noise_multiplier(mf.dpmemf_mechanism(C),
      FixedOrder(k, b), ...)` (the same mechanism as DP-MEMF).
    strategy: the lower-triangular strategy C, `[k b, k b]`; or give
      `mechanism`.
    steps_per_epoch: b.
    decay: c in [0, 1].
    mechanism: instead of `strategy`, a per-step noise mechanism of `k b`
      steps, e.g. a BLT (`blt.mechanism`).
    key: PRNG key or int seed of the noise (replicated across devices).
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    num_examples: the training set size the `example_ids` index; required
      with `check_order`.
    check_order: verify the fixed batch order from `example_ids`
      (`batching.fixed_order_guard`).
    storage: how the MF noise is streamed (`noise.matrix_factorization`).
    neighboring_relation: the relation the noise is calibrated for; default
      ZERO_OUT, the papers' (000/001): a fixed batch order's accounting
      assumes it, since adding or removing an example would move every
      later example to another batch (same sensitivity as add/remove).
    normalize_by: public batch size (required with a padding mask).
    microbatch_size: optional cap on per-example differences held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name on several devices.

  Returns:
    An `optax.GradientTransformationExtraArgs`; call `update(None, state,
    params, batch=batch, example_ids=ids, batch_mask=None)`.

  Raises:
    ValueError: for bad arguments, `num_examples` missing with
      `check_order`.
  """
  decay = validate_decay(decay)
  mechanism = mf.epoch_mechanism(strategy, storage, steps_per_epoch,
                                 mechanism)
  coefficients = memf_coefficients(decay)

  def recursion(step, grad, total, divisor, noise_state, stddev):
    # The noise is added ONCE, to this step's fresh sum, then decays with
    # the recursion (001 Alg 3 line 7 as printed would add it again).
    fresh, noise_state = estimators.add_noise(
        total, noise_state, mechanism, stddev, normalize_by=divisor,
        axis_name=axis_name)
    c_t = jnp.where(step == 0, 0.0, decay)
    grad = jax.tree_util.tree_map(lambda g, f: c_t * g + f, grad, fresh)
    return grad, grad, noise_state

  estimator = _recursive_gradient(
      SrgMemfState, coefficients, recursion, loss_fn, mechanism=mechanism,
      l2_clip=l2_clip, noise_multiplier=noise_multiplier, key=key,
      neighboring_relation=neighboring_relation, normalize_by=normalize_by,
      microbatch_size=microbatch_size,
      clipping_method=clipping_method, axis_name=axis_name)
  return mf.with_order_check(estimator, steps_per_epoch, check_order,
                             axis_name, num_examples)


def memf_coefficients(decay: float
                      ) -> Callable[[jax.Array], tuple[Any, jax.Array]]:
  """`step -> (a_t, b_t)`: DP-SRG-MEMF's difference `grad f(x_t, d) - c_t
  grad f(x_{t-1}, d)` (paper 001 Algorithm 3, c_0 = 0).

  Example:
    >>> memf_coefficients(0.5)(jnp.float32(0))    # (1.0, 0.0): a gradient

  Args:
    decay: c.

  Returns:
    The function of the (float) step.
  """

  def coefficients(step):
    # c_0 = 0: the first step is a plain clipped gradient (DP-MEMF's).
    return 1.0, jnp.where(step == 0, 0.0, decay)

  return coefficients


@keywords.checked
def memf_physical_form(loss_fn: LossFn, *, l2_clip: float, decay: float,
                       physical_batch_size: int,
                       microbatch_size: Optional[int] = None,
                       clipping_method: str = 'auto',
                       state_of: Callable[[Any], Any] = lambda s: s,
                       ) -> physical.PhysicalForm:
  """The physical form of `dp_srg_memf` built with these arguments.

  Each physical batch adds its clipped differences at `(params,
  prev_params, 1, c_t)`, read from the estimator's state; the estimator
  then takes the sum as `update(..., clipped_sum=...)`.

  Example:
    >>> form = memf_physical_form(loss_fn, l2_clip=1.0, decay=0.5,
    ...                           physical_batch_size=64,
    ...                           state_of=lambda opt_state: opt_state[0])

  Args:
    loss_fn, l2_clip, decay, microbatch_size, clipping_method: as given to
      `dp_srg_memf`.
    physical_batch_size: P.
    state_of: the `SrgMemfState` within the whole chain's state.

  Returns:
    A `physical.PhysicalForm`.
  """
  return _difference_form(
      memf_coefficients(validate_decay(decay)), loss_fn, l2_clip,
      physical_batch_size, microbatch_size, clipping_method, state_of)


class SrgdParameters(NamedTuple):
  """Hyperparameters of Algorithm 1 for one of the papers' theorems.

  Attributes:
    regime: which theorem they come from.
    batch_size: B.
    num_steps: T (B T <= n; the remaining examples are unused).
    beta: the scaling beta.
    l2_clip: clip norm of each per-example difference.
    radius: R, the radius of the l2-ball constraint set.
    noise_multiplier: from the accountant for `srg_mechanism(T)` and
      `accounting.single_epoch(T)` at (epsilon, delta).
  """

  regime: str
  batch_size: int
  num_steps: int
  beta: float
  l2_clip: float
  radius: float
  noise_multiplier: float


@keywords.checked
def srgd_preset(
    regime: str,
    *,
    num_examples: int,
    epsilon: float,
    delta: float,
    lipschitz: float,
    smoothness: float,
    radius: float,
    dimension: int,
    batch_size: Optional[int] = None,
    method: str = 'pld',
) -> SrgdParameters:
  """Algorithm 1's parameters as set by the papers' theorems.

  Regimes (logs are natural logs; notes §3):

  * 'interior', paper 000 Theorem 5.8 (population minimizer inside the
    set, M <= c_M L / R): `c_DP = 4 sqrt(2) log^{3/2}(n) sqrt(ln(2n/delta))
    ln(2.5/delta)`, `T = ceil(c_DP n^{1/4})`, `B = floor(n / T)`,
    `beta = c_DP^2 L max(1, sqrt(p) / (epsilon sqrt(n))) / R`,
    `clip = c_DP L`. The constants are vacuous at practical n (B < 1 until
    n is astronomically large): such an n is refused with the numbers.
  * 'constrained', paper 000 Theorem 5.12: `B <= sqrt(n)` (default
    `floor(sqrt(n))`), `T = floor(n / B)`, `c_M = M R / L`,
    `beta = (16 c_M + 8) L n^{3/2} / (R B^2)`, `clip = (8 c_M + 4) L`.
  * '001', paper 001 Theorem 4.10: the same B and T,
    `beta = M + (8 L + 16 M R) n^{3/2} / (R B^2)`, `clip = 4 L + 8 M R`.

  The noise multiplier is not the theorems' symbolic sigma (000 Cor 5.7
  omits a 2 sqrt(2) factor, notes §2.3): it is calibrated by the
  accountant for the tree actually used, `method='gdp_paper'` being the
  papers' GDP route (mu = epsilon / sqrt(2 ln(2.5/delta))).

  For tuned runs ("practical mode") pass beta, clip, B and T to
  `accelerated_dp_srgd` directly.

  Example:
    >>> p = srgd_preset('constrained', num_examples=10**5, epsilon=1.0,
    ...                 delta=1e-6, lipschitz=1.0, smoothness=1.0,
    ...                 radius=1.0, dimension=20)
    >>> tx = accelerated_dp_srgd(loss_fn, l2_clip=p.l2_clip,
    ...                          noise_multiplier=p.noise_multiplier,
    ...                          num_steps=p.num_steps, beta=p.beta,
    ...                          radius=p.radius, key=0)

  Args:
    regime: 'interior', 'constrained' or '001'.
    num_examples: n.
    epsilon: target epsilon.
    delta: target delta.
    lipschitz: L, the per-example Lipschitz constant.
    smoothness: M, the per-example smoothness constant.
    radius: R.
    dimension: p (the number of parameters).
    batch_size: B for 'constrained' and '001' (must be <= sqrt(n)).
    method: accounting method for the noise multiplier.

  Returns:
    `SrgdParameters`.

  Raises:
    ValueError: on invalid inputs, B > sqrt(n), or a regime whose constants
      leave less than one example per batch.
  """
  n = checks.positive_int(num_examples, 'num_examples')
  accounting.validate_epsilon_delta(epsilon, delta)
  checks.warn_large_delta(delta, n)
  lipschitz = checks.positive_finite(lipschitz, 'lipschitz')
  smoothness = checks.positive_finite(smoothness, 'smoothness')
  radius = checks.positive_finite(radius, 'radius')
  dimension = checks.positive_int(dimension, 'dimension')
  if regime == 'interior':
    if batch_size is not None:
      raise ValueError("the 'interior' regime sets B = n / T itself")
    c_dp = (4 * math.sqrt(2) * math.log(n) ** 1.5 *
            math.sqrt(math.log(2 * n / delta)) * math.log(2.5 / delta))
    num_steps = math.ceil(c_dp * n ** 0.25)
    batch = n // num_steps
    if batch < 1:
      raise ValueError(
          f"paper 000 Theorem 5.8 at n={n}: c_DP={c_dp:.4g} gives "
          f'T={num_steps} steps > n, i.e. less than one example per batch. '
          "Its constants are vacuous at this n: use 'constrained' or tune "
          'beta, clip, B and T (practical mode)')
    beta = (c_dp ** 2 * lipschitz *
            max(1.0, math.sqrt(dimension) / (epsilon * math.sqrt(n))) / radius)
    clip = c_dp * lipschitz
  elif regime in ('constrained', '001'):
    largest = math.isqrt(n)
    batch = largest if batch_size is None else checks.positive_int(
        batch_size, 'batch_size')
    if batch > largest:
      raise ValueError(f'the {regime!r} regime needs B <= sqrt(n) = '
                       f'{math.sqrt(n):.4g}, got {batch}')
    num_steps = n // batch
    if regime == 'constrained':
      c_m = smoothness * radius / lipschitz
      beta = (16 * c_m + 8) * lipschitz * n ** 1.5 / (radius * batch ** 2)
      clip = (8 * c_m + 4) * lipschitz
    else:
      beta = smoothness + ((8 * lipschitz + 16 * smoothness * radius) *
                           n ** 1.5 / (radius * batch ** 2))
      clip = 4 * lipschitz + 8 * smoothness * radius
  else:
    raise ValueError(
        f"regime must be 'interior', 'constrained' or '001', got {regime!r}")
  noise_multiplier = accounting.calibrate_noise_multiplier(
      srg_mechanism(num_steps), accounting.single_epoch(num_steps), epsilon,
      delta, method=method)
  return SrgdParameters(regime=regime, batch_size=batch, num_steps=num_steps,
                        beta=float(beta), l2_clip=float(clip),
                        radius=radius, noise_multiplier=noise_multiplier)
