"""Accelerated phased ERM (paper 002, Algorithm 2) and its pieces.

* `outlier_removal_gradient`: one phase's private gradient, the
  outlier-removal mean of the users' smoothed gradients
  (`smoothed_item_loss`);
* `add_proximal_gradient` and `ac_sa`: the phase's regularised objective
  minimised by Ghadimi and Lan's AC-SA (multi-stage), `ac_sa_output` and
  `ac_sa_stage_lengths`;
* `accelerated_phased_erm` runs the phases, `accelerated_phased_erm_preset`
  computes their parameters from the paper's theorem.

`dpsco_jax.algorithms.user_level` re-exports every public name.

References:
  Paper 002 (user-level DP-SCO), Algorithm 2.
"""

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import guards
from dpsco_jax import keywords
from dpsco_jax import keys as keys_lib
from dpsco_jax import outlier_removal
from dpsco_jax import parallel
from dpsco_jax import smoothing
from dpsco_jax.algorithms import srg
from dpsco_jax.algorithms.phased_sgd import _user_arrays
from dpsco_jax.algorithms.phased_sgd import disjoint_user_blocks
from dpsco_jax.algorithms.phased_sgd import phase_sizes
from dpsco_jax.algorithms.phased_sgd import PhasedResult
from dpsco_jax.algorithms.phased_sgd import PresetCondition

PyTree = Any


class OutlierRemovalGradientState(NamedTuple):
  """State of `outlier_removal_gradient` for one phase of Algorithm 2.

  Attributes:
    threshold_noise: AboveThreshold's threshold noise xi, drawn ONCE per
      phase at `init` (paper 002 writes it inside the loop; its proof,
      AboveThreshold, needs one draw).
    halted: True from the first failed test on; every later output is 0.
    step: releases made (refused past the calibrated `num_steps`).
    key: the phase's key (releases use folds of it).
    refusal: the `guards.Refusal` record of the step's checks (the
      calibrated number of steps, a key that differs across devices).
  """

  threshold_noise: jax.Array
  halted: jax.Array
  step: jax.Array
  key: jax.Array
  refusal: Optional[guards.Refusal] = None


def smoothed_item_loss(loss_fn: Callable[[PyTree, PyTree], jax.Array],
                       radius: float) -> Callable[[PyTree, PyTree],
                                                  jax.Array]:
  """`f(x + y, z)` with y uniform in the ball of `radius` (paper 002, §4).

  The returned loss takes items `{'item': z, 'key': k}`; y is drawn from
  k, so each (user, item) gets its own perturbation and the user's mean
  gradient is an unbiased estimate of the smoothed loss's (Lemma D.1).

  Example:
    >>> smoothed = smoothed_item_loss(hinge_loss, radius=0.01)

  Args:
    loss_fn: `loss_fn(params, item) -> scalar`.
    radius: r > 0.

  Returns:
    The perturbed loss.
  """
  radius = checks.positive_finite(radius, 'smoothing radius')

  def loss(params, keyed):
    shift = smoothing.ball_point(keyed['key'], params, radius)
    return loss_fn(jax.tree_util.tree_map(jnp.add, params, shift),
                   keyed['item'])

  return loss


@keywords.checked(home='user_level')
def outlier_removal_gradient(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    calibration: outlier_removal.OutlierRemovalCalibration,
    *,
    key: estimators.KeyLike = None,
    smoothing_radius: Optional[float] = None,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Algorithm 2's private gradient: the outlier-removal mean of user gradients.

  Each step takes K users (drawn without replacement from the phase's
  `calibration.population`, by the caller), their mean-loss gradients at
  `params` (the query point), tests the concentration score by
  AboveThreshold (one threshold noise per phase, fresh step noise) and
  releases the outlier-removal mean plus Gaussian noise; after the first
  failed test it outputs 0 for the rest of the phase (AboveThreshold
  halts; zero is data-independent). Chain the proximal term and the
  optimizer after it (`accelerated_phased_erm` does).

  Example:
    >>> cal = outlier_removal.calibrate(K, tau, eps, delta, num_steps=T,
    ...                                 population=n_i, score_radius=2 * tau)
    >>> tx = optax.chain(outlier_removal_gradient(loss_fn, cal, key=0),
    ...                  add_proximal_gradient(lam, anchor),
    ...                  ac_sa(beta + lam, lam))
    >>> updates, state = tx.update(None, state, params,
    ...                            batch=clipping.UserBatch(items, mask))

  Args:
    loss_fn: `loss_fn(params, item) -> scalar` for one item.
    calibration: from `outlier_removal.calibrate` for this phase.
    key: the phase's key (None: fresh OS entropy).
    smoothing_radius: if set, each item's loss is evaluated at a point
      perturbed uniformly in the ball of this radius (Section 4), the
      perturbation keyed per step, user slot and item (public randomness).
    axis_name: the device axis when the K users are sharded across devices:
      each device forms its users' gradients, the gradients are gathered
      and every device releases the same mean from the same replicated key.

  Returns:
    A transformation; call `update(None, state, params, batch=UserBatch)`
    with items `[K, m, ...]`.

  Raises:
    ValueError: for a batch of other than K users (when called).

  References:
    Paper 002, Algorithm 2 lines 3-14; Dwork & Roth (2014), AboveThreshold.
  """
  if not isinstance(calibration, outlier_removal.OutlierRemovalCalibration):
    raise TypeError('calibration must come from outlier_removal.calibrate')
  user_gradient = clipping.user_mean_gradient(
      loss_fn if smoothing_radius is None
      else smoothed_item_loss(loss_fn, smoothing_radius))
  name = 'outlier_removal_gradient'
  phase_key = keys_lib.noise_key(key, name)

  def init_fn(params):
    del params
    return OutlierRemovalGradientState(
        threshold_noise=outlier_removal.draw_threshold_noise(
            calibration, jax.random.fold_in(phase_key, 0)),
        halted=jnp.zeros((), bool), step=jnp.zeros((), jnp.int32),
        key=phase_key, refusal=guards.no_refusal())

  def update_fn(updates, state, params=None, *, batch=None, **extra):
    del updates, extra
    state = checks.state_type(state, OutlierRemovalGradientState, name)
    if params is None or batch is None:
      raise ValueError(f'{name} needs params and batch=UserBatch(...)')
    if not isinstance(batch, clipping.UserBatch):
      batch = clipping.UserBatch(batch)
    size = np.shape(jax.tree_util.tree_leaves(batch.items)[0])[0]
    if size * parallel.axis_size(axis_name) != calibration.num_points:
      raise ValueError(f'{name} is calibrated for K = '
                       f'{calibration.num_points} users per step, got '
                       f'{size * parallel.axis_size(axis_name)}')
    items = batch.items
    if smoothing_radius is not None:
      m = np.shape(jax.tree_util.tree_leaves(items)[0])[1]
      step_key = jax.random.fold_in(jax.random.fold_in(state.key, 2),
                                    state.step)
      # Slots numbered globally, so the perturbations do not depend on how
      # the users are sharded.
      first = size * (jax.lax.axis_index(axis_name) if axis_name else 0)
      item_keys = jax.vmap(lambda u: jax.vmap(
          lambda j: jax.random.fold_in(jax.random.fold_in(step_key, u), j))(
              jnp.arange(m)))(first + jnp.arange(size))
      items = {'item': items, 'key': item_keys}
    gradients = jax.vmap(user_gradient, in_axes=(0, None))(
        clipping.UserBatch(items, batch.item_mask), params)
    release = outlier_removal.private_robust_mean(
        gradients, calibration,
        jax.random.fold_in(jax.random.fold_in(state.key, 1), state.step),
        threshold_noise=state.threshold_noise, axis_name=axis_name)
    halted = state.halted | ~release.passed
    private = jax.tree_util.tree_map(
        lambda g: jnp.where(halted, jnp.zeros_like(g), g), release.value)
    conditions = [(
        state.step >= calibration.num_steps,
        f'{name} is calibrated for {calibration.num_steps} steps per phase; '
        'this step would release more than was accounted', 'capacity')]
    if release.not_replicated is not None:
      conditions.append((release.not_replicated,
                         parallel.NOT_REPLICATED_MESSAGE, 'replication'))
    private, refusal = guards.record(
        conditions, private, state.refusal or guards.no_refusal(),
        state.step)
    return private, state._replace(halted=halted, step=state.step + 1,
                                   refusal=refusal)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def add_proximal_gradient(strength: float,
                          anchor: PyTree) -> optax.GradientTransformation:
  """Adds `strength * (params - anchor)`: the gradient of the phase regulariser.

  Algorithm 3's phase objective adds `(lambda_i / 2) ||x - x_{i-1}||^2`;
  its gradient is data-independent and gets no noise.

  Example:
    >>> tx = optax.chain(private_gradient, add_proximal_gradient(0.1, x_prev),
    ...                  ac_sa(1.1, 0.1))

  Args:
    strength: lambda_i >= 0.
    anchor: x_{i-1} (public).

  Returns:
    A stateless transformation (needs params).
  """
  strength = float(strength)
  if not 0 <= strength < math.inf:
    raise ValueError(f'strength must be >= 0 and finite, got {strength!r}')

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError('add_proximal_gradient needs params')
    return jax.tree_util.tree_map(
        lambda g, x, a: g + strength * (x - a), updates, params,
        anchor), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update_fn)


class AcSaState(NamedTuple):
  """State of `ac_sa` (Ghadimi and Lan's AC-SA, multi-stage).

  The params the loss sees are the query points x_md; the answer is
  `aggregate` (read it with `ac_sa_output`).

  Attributes:
    prox: x_t, the prox sequence.
    aggregate: x_ag_t, the output sequence.
    step: t within the current stage, from 1.
    count: steps taken in all stages.
  """

  prox: PyTree
  aggregate: PyTree
  step: jax.Array
  count: jax.Array


def _ac_sa_weights(step, smoothness, strong_convexity):
  step = step.astype(jnp.float32)
  alpha = 2.0 / (step + 1.0)
  gamma = 4.0 * smoothness / (step * (step + 1.0))
  return alpha, gamma


def ac_sa(smoothness: float, strong_convexity: float, *,
          radius: Optional[float] = None,
          stage_lengths: Optional[tuple[int, ...]] = None
          ) -> optax.GradientTransformation:
  """AC-SA for a mu-strongly convex, L-smooth objective, Euclidean prox.

  With `alpha_t = 2/(t+1)`, `gamma_t = 4 L / (t (t+1))` and gradient G_t
  at the query point x_md_t:

      x_t    = Pi([alpha mu x_md + ((1 - alpha) mu + gamma) x_{t-1}
                   - alpha G_t] / (mu + gamma))
      x_ag_t = alpha x_t + (1 - alpha) x_ag_{t-1}
      x_md_{t+1} = [(1 - a')(mu + g') x_ag_t + a'((1 - a') mu + g') x_t]
                   / (g' + (1 - a'^2) mu)     (a', g' at t + 1)

  The params are x_md (the loss is evaluated there); `updates` move them to
  the next query point; `ac_sa_output(state)` is the answer x_ag. With
  `stage_lengths` (multi-stage AC-SA, paper 002 Remark C.5), each stage
  restarts from the previous stage's x_ag with t = 1. Everything here is
  post-processing of the gradients it is given.

  Example:
    >>> tx = ac_sa(smoothness=2.0, strong_convexity=0.1, radius=1.0)
    >>> state = tx.init(x0)                  # x0 is also the first query
    >>> updates, state = tx.update(grad_at(params), state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> answer = ac_sa_output(state)

  Args:
    smoothness: L of the objective (beta + lambda_i in Algorithm 2).
    strong_convexity: mu (lambda_i in Algorithm 2), > 0.
    radius: the l2 ball the iterates live in (None: unconstrained).
    stage_lengths: steps per stage; None: one stage.

  Returns:
    A `GradientTransformation` with state `AcSaState`.

  References:
    Ghadimi & Lan (2012), AC-SA for strongly convex problems; paper 002,
    Algorithm 2 line 15 and Remark C.5.
  """
  smoothness = checks.positive_finite(smoothness, 'smoothness')
  mu = checks.positive_finite(strong_convexity, 'strong_convexity')
  boundaries = None
  if stage_lengths is not None:
    lengths = [checks.positive_int(v, 'stage_lengths') for v in stage_lengths]
    boundaries = jnp.asarray(np.cumsum(lengths), jnp.int32)

  def query(prox, aggregate, step):
    alpha, gamma = _ac_sa_weights(step, smoothness, mu)
    denominator = gamma + (1.0 - alpha ** 2) * mu
    return jax.tree_util.tree_map(
        lambda ag, x: ((1 - alpha) * (mu + gamma) * ag +
                       alpha * ((1 - alpha) * mu + gamma) * x) / denominator,
        aggregate, prox)

  def init_fn(params):
    return AcSaState(prox=params, aggregate=params,
                     step=jnp.ones((), jnp.int32),
                     count=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError('ac_sa needs params (the query point)')
    state = checks.state_type(state, AcSaState, 'ac_sa')
    alpha, gamma = _ac_sa_weights(state.step, smoothness, mu)
    prox = srg.project_l2_ball(jax.tree_util.tree_map(
        lambda md, x, g: (alpha * mu * md + ((1 - alpha) * mu + gamma) * x -
                          alpha * g) / (mu + gamma),
        params, state.prox, updates), radius)
    aggregate = jax.tree_util.tree_map(
        lambda x, ag: alpha * x + (1 - alpha) * ag, prox, state.aggregate)
    count = state.count + 1
    step = state.step + 1
    if boundaries is not None:
      restart = jnp.any(count == boundaries)
      prox = jax.tree_util.tree_map(
          lambda ag, x: jnp.where(restart, ag, x), aggregate, prox)
      step = jnp.where(restart, 1, step)
    following = query(prox, aggregate, step)
    new_updates = jax.tree_util.tree_map(lambda a, b: a - b, following,
                                         params)
    return new_updates, AcSaState(prox, aggregate, step, count)

  return optax.GradientTransformation(init_fn, update_fn)


def ac_sa_output(state: Any) -> PyTree:
  """The answer of an `ac_sa` run (x_ag), from its state or a chain's.

  Example:
    >>> answer = ac_sa_output(opt_state)

  Args:
    state: an `AcSaState`, or a tuple (an optax chain's state) holding one.

  Returns:
    x_ag.

  Raises:
    ValueError: if no `AcSaState` is found.
  """
  return checks.find_state(state, AcSaState, 'ac_sa').aggregate


class ErmPhaseRecord(NamedTuple):
  """What one phase of `accelerated_phased_erm` did.

  Attributes:
    phase: i, from 1.
    users: n_i, the phase's fresh users.
    users_per_step: K_i, sampled without replacement from them each step.
    steps: T_i, the steps calibrated for.
    steps_released: the steps whose test passed (T_i unless halted).
    regularization: lambda_i.
    tau: the concentration radius.
    noise_std: the Gaussian sigma on each released mean gradient.
    score_epsilon: the part of epsilon the AboveThreshold tests cost.
    halted: whether a test failed in this phase.
  """

  phase: int
  users: int
  users_per_step: int
  steps: int
  steps_released: int
  regularization: float
  tau: float
  noise_std: float
  score_epsilon: float
  halted: bool


def _per_phase(value: Any, phases: int, name: str) -> list:
  if np.ndim(value) == 0:
    return [value] * phases
  values = list(value)
  if len(values) != phases:
    raise ValueError(f'{name} needs one value per phase ({phases}), got '
                     f'{len(values)}')
  return values


def ac_sa_stage_lengths(smoothness: float, strong_convexity: float,
                        num_steps: int) -> Optional[tuple[int, ...]]:
  """Multi-stage AC-SA stages of `ceil(4 sqrt(2 L / mu))` steps within T.

  The deterministic part of Ghadimi and Lan's multi-stage rule (each stage
  halves the optimality gap without noise); the noise part needs the
  unknown initial gap, so stages are equal and the last one takes the
  remainder. None when one stage covers T.

  Example:
    >>> ac_sa_stage_lengths(10.0, 0.1, 500)     # (57, 57, ..., 44)

  Args:
    smoothness: L.
    strong_convexity: mu.
    num_steps: T.

  Returns:
    The stage lengths (summing to T), or None.
  """
  length = int(math.ceil(4 * math.sqrt(2 * smoothness / strong_convexity)))
  if length >= num_steps:
    return None
  lengths = [length] * (num_steps // length)
  if num_steps % length:
    lengths.append(num_steps % length)
  return tuple(lengths)


@keywords.checked(home='user_level')
def accelerated_phased_erm(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    init_params: PyTree,
    users: clipping.UserBatch,
    *,
    epsilon: float,
    delta: float,
    regularization: float,
    smoothness: float,
    tau: float,
    users_per_step: Any,
    steps: Any,
    phase_decay: float = 0.5,
    regularization_growth: float = 2.5,
    num_phases: Optional[int] = None,
    radius: Optional[float] = None,
    multi_stage: bool = True,
    inclusion: str = 'weighted',
    smoothing_radius: Optional[float] = None,
    key: estimators.KeyLike = None,
    verbose: bool = False,
) -> PhasedResult:
  """Paper 002's Algorithm 3 (with Algorithm 2 per phase).

  Phase i = 1..l takes n_i fresh users (`phase_sizes`,
  `disjoint_user_blocks`) and solves the regularised ERM
  `F_i(x) = mean over its users of the user's mean loss +
  (lambda_i / 2) ||x - x_{i-1}||^2`, `lambda_i = lambda 2^(p i)`, with
  (multi-stage) AC-SA (`ac_sa`) fed by Algorithm 2's private gradient
  (`outlier_removal_gradient`: K_i users drawn without replacement from the
  phase's n_i each step, AboveThreshold on the concentration score at
  radius 2 tau, the outlier-removal mean plus Gaussian noise) plus the
  regulariser's gradient (no noise). x_i is AC-SA's output. A failed test
  halts the run with the x_ag reached.

  Privacy: each phase is (epsilon, delta)-user-level DP (its
  `outlier_removal.calibrate(K_i, tau, epsilon, delta, num_steps=T_i,
  population=n_i)`, docs/user_level.md §4), whatever the optimizer does
  with the released gradients; phases use disjoint users, so the run is
  (epsilon, delta).

  Example:
    >>> kwargs, conditions = accelerated_phased_erm_preset(
    ...     n, m, d, 4.0, 1e-6, lipschitz=1.0, diameter=2.0, smoothness=1.0,
    ...     mode='practical')
    >>> out = accelerated_phased_erm(loss_fn, x0, users, key=0, **kwargs)

  Args:
    loss_fn: `loss_fn(params, item) -> scalar` (convex, L-Lipschitz and
      beta-smooth for the theory; privacy needs none of it).
    init_params: x_0 (public).
    users: a `clipping.UserBatch` with leaves `[n, m, ...]`.
    epsilon: the run's epsilon.
    delta: the run's delta.
    regularization: lambda.
    smoothness: beta (enters AC-SA's step sizes).
    tau: the concentration radius (privacy holds for any tau).
    users_per_step: K_i, one int or one per phase.
    steps: T_i, one int or one per phase.
    phase_decay: q.
    regularization_growth: p (lambda_i = lambda 2^(p i)).
    num_phases: l (default floor(log2 n)).
    radius: the constraint ball's radius (None: unconstrained).
    multi_stage: restart AC-SA in stages (`ac_sa_stage_lengths`).
    inclusion: the aggregator's 'weighted' or 'sampled'.
    smoothing_radius: for non-smooth losses (Section 4), the radius of the
      uniform perturbation of each item's evaluation point.
    key: the run's key (None: fresh OS entropy).
    verbose: one line per phase.

  Returns:
    A `PhasedResult`.

  Raises:
    ValueError: for bad arguments, too few users for the schedule, or a
      phase whose K_i is too small for its tests.

  References:
    Paper 002, Algorithms 2-3, Lemma D.2, Theorems 3.2 (C.3) and 4.1.
  """
  n, m, mask = _user_arrays(users)
  for value, name in ((regularization, 'regularization'),
                      (smoothness, 'smoothness'), (tau, 'tau')):
    checks.positive_finite(value, name)
  if not 0 <= float(regularization_growth) < math.inf:
    raise ValueError('regularization_growth must be >= 0, got '
                     f'{regularization_growth!r}')
  sizes, per_step, step_counts = _erm_phases(n, users_per_step, steps,
                                              phase_decay, num_phases)
  phases = len(sizes)
  calibrations = [outlier_removal.calibrate(
      k, tau, epsilon, delta, num_steps=t, population=size,
      score_radius=2.0 * float(tau), inclusion=inclusion)
                  for k, t, size in zip(per_step, step_counts, sizes)]
  run_key = keys_lib.noise_key(key, 'accelerated_phased_erm')
  blocks = disjoint_user_blocks(n, sizes, jax.random.fold_in(run_key, 0))
  sampler = np.random.default_rng(np.asarray(
      jax.random.key_data(jax.random.fold_in(run_key, 1))).ravel().tolist())
  point = srg.project_l2_ball(init_params, radius)
  records, halted, evaluations = [], False, 0
  for index, (calibration, block, k, t) in enumerate(
      zip(calibrations, blocks, per_step, step_counts), start=1):
    lam = float(regularization) * 2 ** (float(regularization_growth) * index)
    tx = _erm_phase_optimizer(
        loss_fn, calibration, jax.random.fold_in(run_key, 1 + index),
        smoothing_radius=smoothing_radius, regularization=lam, anchor=point,
        smoothness=float(smoothness), radius=radius, steps=t,
        multi_stage=multi_stage)
    state, released, halted = _run_erm_phase(
        jax.jit(_erm_step(tx)), tx.init(point), point, users, mask, block,
        users_per_step=k, steps=t, sampler=sampler)
    # Every step drawn (the halting one included) evaluated K users' m items.
    evaluations += k * m * (released + int(halted))
    point = ac_sa_output(state)
    records.append(ErmPhaseRecord(
        phase=index, users=len(block), users_per_step=k, steps=t,
        steps_released=released, regularization=lam, tau=float(tau),
        noise_std=calibration.noise_std,
        score_epsilon=calibration.score_epsilon, halted=halted))
    if verbose:
      print(f'phase {index}/{phases}: {len(block)} users, K = {k}, '
            f'T = {t}, lambda {lam:.3g}, sigma {calibration.noise_std:.3g}, '
            f'{released}/{t} released{" -> halt" if halted else ""}',
            flush=True)
    if halted:
      break
  return PhasedResult(params=point, phases=records, halted=halted,
                      gradient_evaluations=evaluations,
                      epsilon=float(epsilon), delta=float(delta))


def _erm_phases(num_users: int, users_per_step, steps, phase_decay: float,
                num_phases: Optional[int]) -> tuple[list, list, list]:
  """Users, users per step and steps of each phase of Algorithm 3, checked.

  Raises:
    ValueError: for a phase with fewer users than it draws per step.
  """
  sizes = phase_sizes(num_users, phase_decay, num_phases)
  phases = len(sizes)
  per_step = [checks.positive_int(k, 'users_per_step')
              for k in _per_phase(users_per_step, phases, 'users_per_step')]
  step_counts = [checks.positive_int(t, 'steps')
                 for t in _per_phase(steps, phases, 'steps')]
  for i, (k, size) in enumerate(zip(per_step, sizes), start=1):
    if k > size:
      raise ValueError(f'phase {i} has {size} users, fewer than the '
                       f'{k} users per step it needs: fewer phases, fewer '
                       'users per step or more users')
  return sizes, per_step, step_counts


def _erm_phase_optimizer(loss_fn, calibration, key: jax.Array, *,
                         smoothing_radius, regularization: float,
                         anchor: PyTree, smoothness: float, radius,
                         steps: int, multi_stage: bool
                         ) -> optax.GradientTransformationExtraArgs:
  """Algorithm 2 for one phase: the private gradient, the phase's
  regulariser around `anchor`, and AC-SA on the regularised objective."""
  lam = regularization
  return optax.chain(
      outlier_removal_gradient(loss_fn, calibration, key=key,
                               smoothing_radius=smoothing_radius),
      add_proximal_gradient(lam, anchor),
      ac_sa(smoothness + lam, lam, radius=radius,
            stage_lengths=(ac_sa_stage_lengths(smoothness + lam, lam, steps)
                           if multi_stage else None)))


def _run_erm_phase(step, state, params: PyTree, users: clipping.UserBatch,
                   mask: np.ndarray, block: np.ndarray, *,
                   users_per_step: int, steps: int,
                   sampler: np.random.Generator) -> tuple[Any, int, bool]:
  """Runs one phase: each step draws K users of the phase's block.

  Returns:
    `(state, steps released, halted)`: a halting step is not released.
  """
  released = 0
  for _ in range(steps):
    chosen = block[sampler.choice(len(block), users_per_step, replace=False)]
    batch = clipping.UserBatch(
        jax.tree_util.tree_map(lambda leaf: np.asarray(leaf)[chosen],
                               users.items), mask[chosen])
    params, state = step(params, state, batch)
    if bool(state[0].halted):
      return state, released, True
    released += 1
  return state, released, False


def _erm_step(tx: optax.GradientTransformationExtraArgs):
  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state
  return step



def _erm_preset_conditions(n: int, m: int, epsilon: float, delta: float,
                           sizes: list, per_step: list, step_counts: list,
                           theory_steps: list) -> list[PresetCondition]:
  """The conditions of Theorem 3.2 (C.3) and Lemma D.2 for a preset, and
  whether this library's calibration accepts every phase."""
  conditions = [
      PresetCondition('epsilon <= 10', epsilon <= 10, f'epsilon = {epsilon}'),
      PresetCondition('delta < 1/(n m)', delta < 1 / (n * m),
                      f'delta = {delta}, 1/(nm) = {1 / (n * m):.3g}'),
      PresetCondition('K_i <= n_i', all(k <= s for k, s in zip(per_step,
                                                               sizes)),
                      f'K = {per_step}, n_i = {sizes}'),
      PresetCondition('T_i >= (1 + sqrt(beta/lambda_i)) ln(ndm) (Lemma D.2)',
                      step_counts == theory_steps,
                      f'T = {step_counts}, Lemma D.2: {theory_steps}'),
      PresetCondition('K_i T_i >= n_i', all(
          k * t >= s for k, t, s in zip(per_step, step_counts, sizes)),
                      f'T = {step_counts}'),
      PresetCondition('K_i >= n_i eps / sqrt(T_i) (Lemma D.2)', all(
          k >= s * epsilon / math.sqrt(t)
          for k, t, s in zip(per_step, step_counts, sizes)), ''),
  ]
  feasible, detail = True, 'every phase calibrates'
  for k, t, size in zip(per_step, step_counts, sizes):
    if k > size:
      feasible, detail = False, f'K = {k} > n_i = {size}'
      break
    if outlier_removal.score_test_epsilon(
        k, epsilon, delta, num_steps=t, one_release=False) >= epsilon:
      feasible, detail = False, f'K = {k} too few for {t} tests'
      break
  conditions.append(PresetCondition(
      "every phase passes this library's calibration", feasible, detail))
  return conditions


@keywords.checked(home='user_level')
def accelerated_phased_erm_preset(
    num_users: int, items_per_user: int, dim: int, epsilon: float,
    delta: float, *, lipschitz: float, diameter: float, smoothness: float,
    mode: str = 'paper', inclusion: str = 'weighted',
    tau: Optional[float] = None,
    phase_decay: Optional[float] = None,
    max_steps: Optional[int] = None) -> tuple[dict, list]:
  """`accelerated_phased_erm`'s arguments from Theorem 3.2 (C.3), Lemma D.2.

  Both modes: lambda = (L/R)(1/sqrt(nm) + sqrt(d)/(eps n sqrt(m))),
  p = 3q + 2.5 + ln m / (2 ln n), q maximizing n^(1-q)(1 - 2^-q),
  T_i = ceil((1 + sqrt(beta/lambda_i)) ln(ndm)).
  `mode='paper'`: K_i = 500 ln(n_i^2 m^2 e^eps/delta)(1/eps +
  n_i eps/sqrt(T_i ln(1/delta))), tau = L ln(ndm)/sqrt(m), l = log2 n.
  `mode='practical'`: K_i the fewest whose AboveThreshold tests cost at
  most half of epsilon (`outlier_removal.fewest_points`), at least
  n_i / T_i (Lemma D.2's K_i T_i >= n_i); tau from Pinelis' inequality,
  2 L sqrt(2 ln(2/gamma)/m) with gamma = 0.01/(n T) (every user within
  tau of the population gradient, so pairs within 2 tau), at most L (any
  two gradients are within 2L); as many phases
  as have K_i <= n_i. Privacy is exact in both modes; the theorem's
  conditions are returned, each with whether it holds.

  Example:
    >>> kwargs, conditions = accelerated_phased_erm_preset(
    ...     100000, 16, 10, 4.0, 1e-7, lipschitz=1.0, diameter=2.0,
    ...     smoothness=1.0, mode='practical')

  Args:
    num_users: n.
    items_per_user: m.
    dim: d.
    epsilon: target epsilon.
    delta: target delta.
    lipschitz: L.
    diameter: R (the ball's radius is R/2).
    smoothness: beta.
    mode: 'paper' or 'practical'.
    inclusion: the aggregator's inclusion.
    tau: overrides the mode's tau.
    phase_decay: overrides the theorem's q (p follows it).
    max_steps: caps T_i (the smoothed losses of Section 4 have
      beta = L sqrt(d)/r, and Lemma D.2's T_i then runs to tens of
      thousands of steps); the theorem's condition on T_i is then reported
      as failing where the cap bites. Privacy is calibrated to the steps
      actually taken.

  Returns:
    `(kwargs for accelerated_phased_erm, [PresetCondition, ...])`.

  Raises:
    ValueError: for bad arguments, or when not one phase fits.
  """
  n = checks.positive_int(num_users, 'num_users')
  m = checks.positive_int(items_per_user, 'items_per_user')
  d = checks.positive_int(dim, 'dim')
  if mode not in ('paper', 'practical'):
    raise ValueError(f"mode must be 'paper' or 'practical', got {mode!r}")
  if n < 2:
    raise ValueError('accelerated_phased_erm needs at least 2 users')
  big_l, big_r = float(lipschitz), float(diameter)
  lam = (big_l / big_r) * (1 / math.sqrt(n * m) +
                           math.sqrt(d) / (epsilon * n * math.sqrt(m)))
  if phase_decay is None:
    ratio = math.log2(n)
    q = math.log2((1 + ratio) / ratio)
  else:
    q = float(phase_decay)
  p = 3 * q + 2.5 + math.log(m) / (2 * math.log(n))
  log_ndm = math.log(n * d * m)
  sizes = phase_sizes(n, q)
  lambdas = [lam * 2 ** (p * i) for i in range(1, len(sizes) + 1)]
  theory_steps = [int(math.ceil((1 + math.sqrt(float(smoothness) / li)) *
                                log_ndm)) for li in lambdas]
  step_counts = (theory_steps if max_steps is None else
                 [min(t, checks.positive_int(max_steps, 'max_steps'))
                  for t in theory_steps])
  if mode == 'paper':
    per_step = [int(math.ceil(
        500 * math.log(size ** 2 * m ** 2 * math.exp(epsilon) / delta) *
        (1 / epsilon + size * epsilon / math.sqrt(t * math.log(1 / delta)))))
                for size, t in zip(sizes, step_counts)]
    scale = big_l * log_ndm / math.sqrt(m) if tau is None else tau
    phases = len(sizes)
  else:
    per_step = [max(outlier_removal.fewest_points(
        epsilon, delta, num_steps=t, one_release=False, score_share=0.5),
                    int(math.ceil(size / t)))
                for size, t in zip(sizes, step_counts)]
    gamma = 0.01 / (n * sum(step_counts))
    # Gradients have norm <= L, so every pair is within 2L: tau = L is
    # always enough.
    scale = (min(big_l, 2 * big_l * math.sqrt(2 * math.log(2 / gamma) / m))
             if tau is None else tau)
    phases = 0
    for size, k in zip(sizes, per_step):
      if k > size:
        break
      phases += 1
    if phases == 0:
      raise ValueError(
          f'n = {n} users are too few for one phase: it needs '
          f'{per_step[0]} users per step and has {sizes[0]}')
  sizes, per_step, step_counts, theory_steps = (
      sizes[:phases], per_step[:phases], step_counts[:phases],
      theory_steps[:phases])
  conditions = _erm_preset_conditions(n, m, epsilon, delta, sizes, per_step,
                                      step_counts, theory_steps)
  kwargs = dict(epsilon=float(epsilon), delta=float(delta),
                regularization=lam, smoothness=float(smoothness), tau=scale,
                users_per_step=per_step, steps=step_counts, phase_decay=q,
                regularization_growth=p, num_phases=phases,
                radius=big_r / 2, inclusion=inclusion)
  return kwargs, conditions
