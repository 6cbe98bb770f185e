"""Phased SGD (paper 002, Algorithm 1): user-level DP-SCO whose noise shrinks
like 1/sqrt(m) with m items per user.

Each phase trains C groups of fresh users with one-pass projected SGD, then
releases the outlier-removal private mean of the C average iterates
(`dpsco_jax.outlier_removal`). `phased_sgd_schedule` and `phase_groups` lay
the phases out, `phased_sgd` runs them, and `phased_sgd_preset` computes the
parameters from Theorem 2.1 (B.1) and says which of the theorem's conditions
fail. `dpsco_jax.algorithms.user_level` re-exports every public name.

References:
  Paper 002 (user-level DP-SCO), Algorithm 1 and Theorem 2.1 (formal:
  Theorem B.1).
"""

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import keywords
from dpsco_jax import keys as keys_lib
from dpsco_jax import outlier_removal
from dpsco_jax.algorithms import srg

PyTree = Any


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


def _phase_items(items: PyTree, mask: np.ndarray, chosen: np.ndarray,
                 steps: int, key: jax.Array) -> tuple[PyTree, np.ndarray]:
  """The phase's groups' items `[C, steps, ...]`, each group's in a random
  order (one permutation per group), and their mask `[C, steps]`.

  `chosen` is `[C, users per group]`: the users of each group.
  """
  num_groups = chosen.shape[0]
  shuffle = np.asarray(jax.vmap(
      lambda k: jax.random.permutation(k, steps))(
          jax.random.split(key, num_groups)))
  grouped = jax.tree_util.tree_map(
      lambda leaf: np.take_along_axis(
          np.asarray(leaf)[chosen].reshape(
              (num_groups, steps) + np.shape(leaf)[2:]),
          shuffle.reshape(shuffle.shape + (1,) * (np.ndim(leaf) - 2)),
          axis=1), items)
  item_mask = np.take_along_axis(mask[chosen].reshape(num_groups, steps),
                                 shuffle, axis=1)
  return grouped, item_mask


@keywords.checked(home='user_level')
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
    items, item_mask = _phase_items(users.items, mask, chosen, steps,
                                    jax.random.fold_in(phase_key, 0))
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


@keywords.checked(home='user_level')
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
