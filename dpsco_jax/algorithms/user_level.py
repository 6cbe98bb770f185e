"""User-level DP-SGD (paper 002's practical baseline): the user is the privacy unit.

Each sampled user contributes the gradient of its MEAN loss over its items
(at most m of them, `batching.group_by_user`), clipped to `l2_clip`
(`clipping.clipped_user_grad_sum`); the clipped sum over users gets ONE
noise draw calibrated to that clip, and is divided by the expected number of
users. Replacing (or adding, removing) one user's whole data moves the sum
by at most the clip, so the accounting is DP-SGD's with users in place of
examples: Poisson sampling of users with probability
`users_per_batch / num_users`, `accounting.PoissonSampling(q_users, T)`,
the user count, never the example count, in every accountant call.

    users = batching.group_by_user(data, user_ids, max_items=16)
    plan = plans.user_level_dpsgd(loss_fn, optimizer=optax.sgd(0.1),
                                  num_users=len(users.item_mask),
                                  users_per_batch=64, epochs=5,
                                  l2_clip=1.0, epsilon=2.0, delta=1e-6)
    for inputs in plan.batches_of(users): ...

With one item per user it is `dpsgd` exactly (the mean of one gradient is
that gradient).

`phased_sgd` is paper 002's Algorithm 1, whose noise shrinks like
1/sqrt(m) with m items per user: each phase trains C groups of fresh users
with one-pass projected SGD, then releases the outlier-removal private mean
of the C average iterates (`dpsco_jax.outlier_removal`). `phased_sgd_preset`
computes its parameters from Theorem 2.1 (B.1) and says which of the
theorem's conditions fail.

References:
  Paper 002 (user-level DP-SCO), §1 and §5 (user-level DP-SGD baseline);
  the user-level neighbouring relation of its §2; Algorithm 1 and
  Theorem 2.1 (formal: Theorem B.1).
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
from dpsco_jax import neighboring
from dpsco_jax import keys as keys_lib
from dpsco_jax import noise
from dpsco_jax import outlier_removal
from dpsco_jax import parallel
from dpsco_jax import smoothing
from dpsco_jax.algorithms import srg

PyTree = Any


def user_level_dpsgd_mechanism(num_steps: int) -> noise.NoiseMechanism:
  """The noise mechanism `user_level_dpsgd` builds: i.i.d. Gaussian.

  Account for a run with it and the USER participation, e.g.
  `accounting.epsilon_spent(user_level_dpsgd_mechanism(T), z,
  PoissonSampling(users_per_batch / num_users, T), delta)`.

  Example:
    >>> mechanism = user_level_dpsgd_mechanism(1000)

  Args:
    num_steps: the capacity, as passed to `user_level_dpsgd`.

  Returns:
    `noise.gaussian(num_steps)`.
  """
  return noise.gaussian(checks.positive_int(num_steps, 'num_steps'))


@keywords.checked
def user_level_dpsgd(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    *,
    l2_clip: float,
    noise_multiplier: float,
    num_steps: int,
    key: estimators.KeyLike = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    normalize_by: Optional[float] = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """User-level DP-SGD's private gradient: clipped user means plus noise.

  Outputs `(sum_u clip(grad mean_j f(x, d_uj)) + N(0, (z C)^2 I)) / U` with
  C = `l2_clip` (twice that under replace-one) and U the public number of
  users per batch. Chain an optax optimizer after it.

  Example:
    >>> tx = optax.chain(
    ...     user_level_dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=1.1,
    ...                      num_steps=1000, normalize_by=64.0),
    ...     optax.sgd(0.1))
    >>> updates, state = tx.update(None, state, params, batch=users,
    ...                            batch_mask=user_mask)

  Args:
    loss_fn: `loss_fn(params, item) -> scalar` for ONE item of one user.
    l2_clip: the clip norm of each user's mean gradient.
    noise_multiplier: noise std over the user-level sensitivity.
    num_steps: the steps the noise was calibrated for (required).
    key: the noise key (None: fresh from OS entropy; see `dpsco_jax.dpsgd`).
    neighboring_relation: add/remove or replace ONE USER.
    normalize_by: the public (expected) number of users per batch; required
      with a user mask.
    microbatch_size: optional cap on users processed at once.
    clipping_method: 'auto', 'ghost' or 'vmap' (`dpsco_jax.clipping`).
    axis_name: the device axis (users sharded across devices).

  Returns:
    An `optax.GradientTransformationExtraArgs`; call `update(None, state,
    params, batch=clipping.UserBatch(items, item_mask), batch_mask=None)`
    (items `[users, m, ...]`).

  Raises:
    ValueError: for bad arguments.

  References:
    Paper 002, §5: the user-level DP-SGD baseline.
  """
  if num_steps is None:
    raise ValueError('user_level_dpsgd needs num_steps, the number of steps '
                     'its noise was calibrated for')
  statistic = clipping.clipped_user_grad_sum(
      loss_fn, l2_clip, microbatch_size=microbatch_size,
      clipping_method=clipping_method)
  return estimators.noisy_statistic(
      statistic, noise_multiplier=noise_multiplier,
      mechanism=user_level_dpsgd_mechanism(num_steps), key=key,
      neighboring_relation=neighboring_relation, normalize_by=normalize_by,
      axis_name=axis_name, name='user_level_dpsgd')


def phase_sizes(num_users: int, phase_decay: float,
                num_phases: Optional[int] = None) -> list[int]:
  """`n_i = floor((1 - 2^-q) n / 2^(q i))` for i = 1..l (Algorithms 1 and 3).

  The phases use disjoint users, `sum_i n_i <= n 2^-q`.

  Example:
    >>> phase_sizes(20000, 0.5, 4)     # [4142, 2928, 2071, 1464]

  Args:
    num_users: n.
    phase_decay: q > 0.
    num_phases: l (default the paper's floor(log2 n)).

  Returns:
    The list of n_i.
  """
  n = checks.positive_int(num_users, 'num_users')
  phase_decay = checks.positive_finite(phase_decay, 'phase_decay')
  phases = (max(1, int(math.floor(math.log2(n)))) if num_phases is None
            else checks.positive_int(num_phases, 'num_phases'))
  return [int(math.floor((1 - 2 ** -phase_decay) * n /
                         2 ** (phase_decay * i))) for i in range(1, phases + 1)]


class PhaseSchedule(NamedTuple):
  """The per-phase sizes of `phased_sgd` (paper 002, Algorithm 1 lines 3-8).

  Attributes:
    users: n_i, the fresh users of phase i (disjoint across phases).
    users_per_group: N_i = floor(n_i / C); the n_i - C N_i left over are
      never used.
    steps: T_i = N_i m, one SGD step per item of a group.
    learning_rates: eta_i = eta / 2^(p i).
    taus: tau_i = tau_scale eta_i L sqrt(T_i), the concentration radius of
      the groups' average iterates (Lemma 2.3).
  """

  users: tuple[int, ...]
  users_per_group: tuple[int, ...]
  steps: tuple[int, ...]
  learning_rates: tuple[float, ...]
  taus: tuple[float, ...]


def phased_sgd_schedule(num_users: int, items_per_user: int, num_groups: int,
                        *, learning_rate: float, lipschitz: float,
                        tau_scale: float, phase_decay: float = 0.5,
                        step_decay: float = 1.5,
                        num_phases: Optional[int] = None) -> PhaseSchedule:
  """Algorithm 1's geometric phase schedule.

  `n_i = floor((1 - 2^-q) n / 2^(q i))` users in phase i = 1..l (so
  sum_i n_i <= n 2^-q), `N_i = floor(n_i / C)` users per group,
  `T_i = N_i m` steps, `eta_i = eta / 2^(p i)`,
  `tau_i = tau_scale eta_i L sqrt(T_i)` (the paper's tau_scale is
  1000 log(n d m)).

  Example:
    >>> schedule = phased_sgd_schedule(20000, 16, 150, learning_rate=0.05,
    ...                                lipschitz=1.0, tau_scale=4.0,
    ...                                num_phases=6)

  Args:
    num_users: n.
    items_per_user: m.
    num_groups: C, the groups per phase (the aggregator's K).
    learning_rate: eta.
    lipschitz: L, the loss's Lipschitz constant.
    tau_scale: the constant of tau_i (privacy holds for any value; utility
      needs the groups' iterates within tau_i of each other).
    phase_decay: q > 0.
    step_decay: p >= 0.
    num_phases: l (default the paper's floor(log2 n)).

  Returns:
    A `PhaseSchedule`.

  Raises:
    ValueError: for bad arguments or a phase whose groups would be empty
      (the message gives the most phases that fit).
  """
  n = checks.positive_int(num_users, 'num_users')
  m = checks.positive_int(items_per_user, 'items_per_user')
  c = checks.positive_int(num_groups, 'num_groups')
  for value, name in ((learning_rate, 'learning_rate'),
                      (lipschitz, 'lipschitz'), (tau_scale, 'tau_scale'),
                      (phase_decay, 'phase_decay')):
    checks.positive_finite(value, name)
  if not 0 <= float(step_decay) < math.inf:
    raise ValueError(f'step_decay must be >= 0, got {step_decay!r}')
  users = phase_sizes(n, phase_decay, num_phases)
  phases = len(users)
  per_group = [u // c for u in users]
  if per_group[-1] < 1:
    first = per_group.index(0)
    raise ValueError(
        f'phase {first + 1} of {phases} has {users[first]} users for {c} '
        f'groups: every group needs a user. With n = {n} and C = {c} at '
        f'most {first} phases fit: pass num_phases <= {first}, fewer '
        'groups, or another phase_decay')
  steps = [g * m for g in per_group]
  rates = [float(learning_rate) / 2 ** (float(step_decay) * i)
           for i in range(1, phases + 1)]
  taus = [float(tau_scale) * r * float(lipschitz) * math.sqrt(t)
          for r, t in zip(rates, steps)]
  return PhaseSchedule(tuple(users), tuple(per_group), tuple(steps),
                       tuple(rates), tuple(taus))


class PhaseRecord(NamedTuple):
  """What one phase of `phased_sgd` did (every field is public or private).

  Attributes:
    phase: i, from 1.
    users: n_i.
    users_per_group: N_i.
    steps: T_i.
    learning_rate: eta_i.
    tau: tau_i.
    noise_std: sigma of the output perturbation.
    laplace_scale: the score noise's scale.
    passed: the noisy score test's outcome (private: it is released).
    noisy_score: the noisy score (private).
  """

  phase: int
  users: int
  users_per_group: int
  steps: int
  learning_rate: float
  tau: float
  noise_std: float
  laplace_scale: float
  passed: bool
  noisy_score: float


class PhasedResult(NamedTuple):
  """The output of `phased_sgd` and of `accelerated_phased_erm`.

  Attributes:
    params: the last released point. `phased_sgd`: x_l (x_{i-1} when phase
      i halted). `accelerated_phased_erm`: the last phase's AC-SA output
      (at a halt, the x_ag reached: post-processing of released gradients).
    phases: a `PhaseRecord` (`phased_sgd`) or `ErmPhaseRecord` per phase
      run.
    halted: whether a test failed (the run stopped there).
    gradient_evaluations: the per-item gradients computed (`phased_sgd`:
      sum_i C T_i <= n m; `accelerated_phased_erm`: K_i m per step run).
    epsilon: the run's epsilon (each phase's: the phases' users are
      disjoint, so they compose in parallel).
    delta: the run's delta.
  """

  params: Any
  phases: list
  halted: bool
  gradient_evaluations: int
  epsilon: float
  delta: float


def phase_groups(num_users: int, schedule: PhaseSchedule, num_groups: int,
                 key: jax.Array) -> list[np.ndarray]:
  """The users of each phase's groups: `[C, N_i]` indices per phase.

  A random permutation of all users (data-independent, from `key`) is cut
  into consecutive blocks of n_i users, one per phase, so phases never
  share a user; the first C N_i of a block form its groups and the rest of
  the block is never used.

  Example:
    >>> groups = phase_groups(20000, schedule, 150, jax.random.key(0))
    >>> groups[0].shape       # (150, N_1)

  Args:
    num_users: n.
    schedule: from `phased_sgd_schedule` (with the same n and C).
    num_groups: C.
    key: the permutation's key.

  Returns:
    One int array `[C, N_i]` per phase.
  """
  blocks = disjoint_user_blocks(num_users, schedule.users, key)
  return [block[:num_groups * per_group].reshape(num_groups, per_group)
          for block, per_group in zip(blocks, schedule.users_per_group)]


def disjoint_user_blocks(num_users: int, sizes: Any,
                         key: jax.Array) -> list[np.ndarray]:
  """Disjoint random blocks of users, one per phase (Algorithms 1 and 3).

  A random permutation of all users (data-independent, from `key`) cut into
  consecutive blocks of the given sizes: phases never share a user, so
  they compose in parallel.

  Example:
    >>> blocks = disjoint_user_blocks(20000, phase_sizes(20000, 0.5, 4),
    ...                               jax.random.key(0))

  Args:
    num_users: n.
    sizes: n_i per phase (sum at most n).
    key: the permutation's key.

  Returns:
    One int array `[n_i]` per phase.

  Raises:
    ValueError: if the sizes need more users than there are.
  """
  sizes = [int(v) for v in sizes]
  if sum(sizes) > num_users:
    raise ValueError(f'the schedule needs {sum(sizes)} users, there are '
                     f'{num_users}')
  order = np.asarray(jax.random.permutation(key, num_users))
  starts = np.cumsum([0] + sizes)
  return [order[a:b] for a, b in zip(starts[:-1], starts[1:])]


def _group_average_iterates(loss_fn, start, items, item_mask, learning_rate,
                            radius):
  """One-pass projected SGD, batch 1, for each group; their average iterates.

  items: leaves `[C, T, ...]`; item_mask `[C, T]` (a masked item is a step
  that leaves the point where it is). Average over the T iterates
  x_1..x_T (paper 002, §2.1.1: the average iterate of Lemma B.3).
  """
  grad_fn = jax.grad(loss_fn)

  def one_group(group_items, group_mask):
    def step(carry, inputs):
      point, total = carry
      item, keep = inputs
      moved = srg.project_l2_ball(
          jax.tree_util.tree_map(lambda x, g: x - learning_rate * g, point,
                                 grad_fn(point, item)), radius)
      point = jax.tree_util.tree_map(
          lambda new, old: jnp.where(keep, new, old), moved, point)
      return (point, jax.tree_util.tree_map(jnp.add, total, point)), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, start)
    (_, total), _ = jax.lax.scan(step, (start, zeros),
                                 (group_items, group_mask))
    steps = group_mask.shape[0]
    return jax.tree_util.tree_map(lambda t: t / steps, total)

  return jax.vmap(one_group)(items, item_mask)


def _user_arrays(users: Any) -> tuple[int, int, np.ndarray]:
  """(n, m, item mask) of a `UserBatch` of all users, checked."""
  if not isinstance(users, clipping.UserBatch):
    raise TypeError('users must be a clipping.UserBatch (see '
                    'batching.group_by_user)')
  leaves = jax.tree_util.tree_leaves(users.items)
  if not leaves or any(np.ndim(leaf) < 2 for leaf in leaves):
    raise ValueError('users.items needs leaves shaped [users, items, ...]')
  n, m = np.shape(leaves[0])[:2]
  if m < 1:
    raise ValueError('every user needs at least one item slot (m >= 1)')
  mask = (np.ones((n, m), bool) if users.item_mask is None
          else np.asarray(users.item_mask, bool))
  if mask.shape != (n, m):
    raise ValueError(f'item_mask must be [{n}, {m}], got {mask.shape}')
  return n, m, mask


@keywords.checked
def phased_sgd(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    init_params: PyTree,
    users: clipping.UserBatch,
    *,
    epsilon: float,
    delta: float,
    num_groups: int,
    learning_rate: float,
    lipschitz: float,
    tau_scale: float,
    radius: Optional[float] = None,
    phase_decay: float = 0.5,
    step_decay: float = 1.5,
    num_phases: Optional[int] = None,
    inclusion: str = 'weighted',
    key: estimators.KeyLike = None,
    verbose: bool = False,
) -> PhasedResult:
  """Paper 002's Algorithm 1: phased SGD with outlier-iterate removal.

  Phase i = 1..l (`phased_sgd_schedule`): n_i fresh users (a random,
  data-independent permutation of all users, never reused) are split into
  C groups of N_i; each group runs one pass of projected SGD with batch
  size 1 over its N_i m items in random order, from x_{i-1}, step eta_i;
  the C average iterates go through the outlier-removal private mean
  (`outlier_removal.private_robust_mean`, score radius tau_i, inclusion
  radius 2 tau_i, calibrated to (epsilon, delta) by
  `outlier_removal.calibrate`; distances from coordinate differences,
  exact at any offset), and the release is projected onto the ball of
  `radius` (post-processing:
  Algorithm 1 does not project; the notes' pitfall 9). A failed test
  halts the run, which returns the last released point x_{i-1}.

  Privacy: a user is in one group of one phase, so replacing a user moves
  one of that phase's C points; each phase's release is (epsilon,
  delta)-user-level DP for ANY training inside the groups, and the phases'
  users are disjoint, so the run is (epsilon, delta) by parallel
  composition. Items past m per user are dropped and padded items masked
  by `batching.group_by_user`; a user is all of its items.

  Example:
    >>> users = batching.group_by_user(data, user_ids, max_items=16)
    >>> out = phased_sgd(loss_fn, params, users, epsilon=2.0, delta=1e-6,
    ...                  num_groups=150, learning_rate=0.05, lipschitz=1.0,
    ...                  tau_scale=4.0, radius=1.0, num_phases=6, key=0)
    >>> out.params, out.phases[-1].passed

  Args:
    loss_fn: `loss_fn(params, item) -> scalar`, convex and L-Lipschitz for
      the theory (privacy needs neither).
    init_params: x_0 (public).
    users: a `clipping.UserBatch` with leaves `[n, m, ...]`.
    epsilon: the run's epsilon.
    delta: the run's delta.
    num_groups: C (the calibration says if too few for epsilon).
    learning_rate: eta.
    lipschitz: L (enters tau_i only).
    tau_scale: the constant of tau_i (the paper: 1000 log(n d m);
      `phased_sgd_preset` computes both).
    radius: the constraint set, an l2 ball of this radius around 0
      (diameter R = 2 radius); None: unconstrained.
    phase_decay: q.
    step_decay: p.
    num_phases: l (default floor(log2 n)).
    inclusion: the aggregator's 'weighted' (default) or 'sampled'.
    key: the run's key (None: fresh OS entropy), used for the user
      permutation, the item orders and each phase's release (each its own
      fold).
    verbose: print one line per phase.

  Returns:
    A `PhasedResult`.

  Raises:
    ValueError: for bad arguments, too few users for the schedule, or too
      few groups for the score test at this epsilon.

  References:
    Paper 002, Algorithm 1, Lemmas 2.3, B.2-B.4, Theorem 2.1 (B.1).
  """
  n, m, mask = _user_arrays(users)
  schedule = phased_sgd_schedule(
      n, m, num_groups, learning_rate=learning_rate, lipschitz=lipschitz,
      tau_scale=tau_scale, phase_decay=phase_decay, step_decay=step_decay,
      num_phases=num_phases)
  calibrations = [outlier_removal.calibrate(
      num_groups, tau, epsilon, delta, inclusion=inclusion)
                  for tau in schedule.taus]
  key = keys_lib.noise_key(key, 'phased_sgd')
  groups = phase_groups(n, schedule, num_groups, jax.random.fold_in(key, 0))
  train = jax.jit(_group_average_iterates, static_argnums=(0,))
  release = jax.jit(outlier_removal.private_robust_mean, static_argnums=(1,))
  point = srg.project_l2_ball(init_params, radius)
  records, halted, evaluations = [], False, 0
  for index, (calibration, chosen, users_i, per_group, steps, rate) in (
      enumerate(zip(calibrations, groups, schedule.users,
                    schedule.users_per_group, schedule.steps,
                    schedule.learning_rates), start=1)):
    phase_key = jax.random.fold_in(key, index)
    shuffle = np.asarray(jax.vmap(
        lambda k: jax.random.permutation(k, steps))(
            jax.random.split(jax.random.fold_in(phase_key, 0), num_groups)))
    items = jax.tree_util.tree_map(
        lambda leaf: np.take_along_axis(
            np.asarray(leaf)[chosen].reshape(
                (num_groups, steps) + np.shape(leaf)[2:]),
            shuffle.reshape(shuffle.shape + (1,) * (np.ndim(leaf) - 2)),
            axis=1), users.items)
    item_mask = np.take_along_axis(mask[chosen].reshape(num_groups, steps),
                                   shuffle, axis=1)
    averages = train(loss_fn, point, items, item_mask, rate, radius)
    out = release(averages, calibration, jax.random.fold_in(phase_key, 1),
                  halt_value=point)
    evaluations += num_groups * steps
    passed = bool(out.passed)
    records.append(PhaseRecord(
        phase=index, users=users_i, users_per_group=per_group, steps=steps,
        learning_rate=rate, tau=calibration.tau,
        noise_std=calibration.noise_std,
        laplace_scale=calibration.laplace_scale, passed=passed,
        noisy_score=float(out.noisy_score)))
    if verbose:
      print(f'phase {index}/{len(calibrations)}: {num_groups} groups x '
            f'{per_group} users, {steps} steps, tau {calibration.tau:.3g}, '
            f'sigma {calibration.noise_std:.3g}, noisy score '
            f'{float(out.noisy_score):.1f} / {calibration.threshold:.1f}'
            f'{"" if passed else " -> halt"}', flush=True)
    if not passed:
      halted = True
      break
    point = srg.project_l2_ball(out.value, radius)
  return PhasedResult(params=point, phases=records, halted=halted,
                         gradient_evaluations=evaluations,
                         epsilon=float(epsilon), delta=float(delta))


class PresetCondition(NamedTuple):
  """One condition of a theorem, and whether the inputs meet it."""

  name: str
  holds: bool
  detail: str


@keywords.checked
def phased_sgd_preset(num_users: int, items_per_user: int, dim: int,
                      epsilon: float, delta: float, *, lipschitz: float,
                      diameter: float, smoothness: Optional[float] = None,
                      mode: str = 'paper', tau_scale: Optional[float] = None,
                      phase_decay: Optional[float] = None,
                      inclusion: str = 'weighted') -> tuple[dict, list]:
  """`phased_sgd`'s arguments from Theorem 2.1 (B.1), and its conditions.

  `mode='paper'`: the theorem's C = 100 log(20 n m e^eps / delta) / eps,
  eta = R / (L sqrt(d m n eps)), p = J + 3/2 with m = n^J, q maximizing
  n^(1-q) (1 - 2^-q), tau_scale = 1000 log(n d m), l = floor(log2 n).
  `mode='practical'`: the smallest C whose score test costs at most half of
  epsilon under this library's calibration, the theorem's eta, p and q,
  tau_scale 4 (Lemma 2.3's concentration with a modest constant: tune it),
  and as many phases (up to log2 n) as have a user per group. Privacy is
  exact in both modes (`outlier_removal.calibrate`); only utility rests on
  the theorem's conditions, which are returned, each with whether it holds.

  Example:
    >>> kwargs, conditions = phased_sgd_preset(
    ...     20000, 16, 10, 2.0, 1e-6, lipschitz=1.0, diameter=2.0,
    ...     mode='practical')
    >>> [c for c in conditions if not c.holds]
    >>> out = phased_sgd(loss_fn, params, users, key=0, **kwargs)

  Args:
    num_users: n.
    items_per_user: m.
    dim: d.
    epsilon: target epsilon.
    delta: target delta.
    lipschitz: L.
    diameter: R, the constraint set's diameter (the ball's radius is R/2).
    smoothness: beta, when known (checked against eta <= 1/beta).
    mode: 'paper' or 'practical'.
    tau_scale: overrides the mode's tau_scale.
    phase_decay: overrides the theorem's q (a larger q puts more users in
      the first phases).
    inclusion: the aggregator's inclusion ('weighted' or 'sampled').

  Returns:
    `(kwargs for phased_sgd, [PresetCondition, ...])`.

  Raises:
    ValueError: for bad arguments, or when no phase fits (practical mode).
  """
  n = checks.positive_int(num_users, 'num_users')
  m = checks.positive_int(items_per_user, 'items_per_user')
  d = checks.positive_int(dim, 'dim')
  if mode not in ('paper', 'practical'):
    raise ValueError(f"mode must be 'paper' or 'practical', got {mode!r}")
  if n < 2:
    raise ValueError('phased_sgd needs at least 2 users')
  eta = float(diameter) / (float(lipschitz) * math.sqrt(d * m * n * epsilon))
  big_j = max(math.log(m) / math.log(n), 0.0)
  step_decay = big_j + 1.5
  if phase_decay is None:
    ratio = math.log2(n)
    phase_decay = math.log2((1 + ratio) / ratio)
  log_phases = max(1, int(math.floor(math.log2(n))))
  conditions = []
  if mode == 'paper':
    groups = int(math.ceil(100 * math.log(20 * n * m * math.exp(epsilon) /
                                          delta) / epsilon))
    scale = 1000 * math.log(n * d * m) if tau_scale is None else tau_scale
    phases = log_phases
  else:
    groups = outlier_removal.fewest_points(epsilon, delta, score_share=0.5)
    scale = 4.0 if tau_scale is None else tau_scale
    phases = 0
    for i in range(1, log_phases + 1):
      if math.floor((1 - 2 ** -phase_decay) * n / 2 ** (phase_decay * i)
                   ) // groups < 1:
        break
      phases = i
    if phases == 0:
      raise ValueError(
          f'n = {n} users are too few for one phase of {groups} groups '
          f'(the fewest whose score test fits epsilon = {epsilon})')
  last = (1 - 2 ** -phase_decay) * n / 2 ** (phase_decay * phases)
  conditions.append(PresetCondition(
      'N_l >= 1 (n^(1-q) >= 100 log(n/delta) / (eps (1 - 2^-q)))',
      last / groups >= 1,
      f'last phase: {last:.0f} users for {groups} groups'))
  conditions.append(PresetCondition(
      'epsilon <= 10', epsilon <= 10, f'epsilon = {epsilon}'))
  if smoothness is not None:
    conditions.append(PresetCondition(
        'beta <= (L/R) sqrt(d m n eps) (eta <= 1/beta)',
        float(smoothness) * eta <= 1.0,
        f'beta eta = {float(smoothness) * eta:.3g}'))
  try:
    outlier_removal.calibrate(groups, 1.0, epsilon, delta,
                              inclusion=inclusion)
    feasible, detail = True, f'C = {groups}'
  except ValueError as error:
    feasible, detail = False, str(error)
  conditions.append(PresetCondition(
      'C groups pass this library\'s score-test calibration', feasible,
      detail))
  kwargs = dict(epsilon=float(epsilon), delta=float(delta),
                num_groups=groups, learning_rate=eta,
                lipschitz=float(lipschitz), tau_scale=scale,
                radius=float(diameter) / 2, phase_decay=phase_decay,
                step_decay=step_decay, num_phases=phases,
                inclusion=inclusion)
  return kwargs, conditions



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


@keywords.checked
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


@keywords.checked
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
  sizes = phase_sizes(n, phase_decay, num_phases)
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
    tx = optax.chain(
        outlier_removal_gradient(
            loss_fn, calibration, key=jax.random.fold_in(run_key, 1 + index),
            smoothing_radius=smoothing_radius),
        add_proximal_gradient(lam, point),
        ac_sa(float(smoothness) + lam, lam, radius=radius,
              stage_lengths=(ac_sa_stage_lengths(float(smoothness) + lam, lam,
                                                 t) if multi_stage else None)))
    step = jax.jit(_erm_step(tx))
    params, state = point, tx.init(point)
    released = 0
    for _ in range(t):
      chosen = block[sampler.choice(len(block), k, replace=False)]
      batch = clipping.UserBatch(
          jax.tree_util.tree_map(lambda leaf: np.asarray(leaf)[chosen],
                                 users.items), mask[chosen])
      params, state = step(params, state, batch)
      evaluations += k * m
      if bool(state[0].halted):
        halted = True
        break
      released += 1
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


def _erm_step(tx: optax.GradientTransformationExtraArgs):
  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state
  return step


@keywords.checked
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
  kwargs = dict(epsilon=float(epsilon), delta=float(delta),
                regularization=lam, smoothness=float(smoothness), tau=scale,
                users_per_step=per_step, steps=step_counts, phase_decay=q,
                regularization_growth=p, num_phases=phases,
                radius=big_r / 2, inclusion=inclusion)
  return kwargs, conditions
