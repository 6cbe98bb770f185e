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

`dpsco_jax.algorithms.phased_sgd` holds Algorithm 1 and
`dpsco_jax.algorithms.phased_erm` Algorithm 2 (accelerated phased ERM, its
outlier-removal gradient and AC-SA); this module re-exports their public
names.

References:
  Paper 002 (user-level DP-SCO), §1 and §5 (user-level DP-SGD baseline);
  the user-level neighbouring relation of its §2; Algorithm 1 and
  Theorem 2.1 (formal: Theorem B.1).
"""

from typing import Any, Callable, Optional

import jax
import optax

from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise
# pylint: disable=unused-import
from dpsco_jax.algorithms.phased_erm import ac_sa
from dpsco_jax.algorithms.phased_erm import ac_sa_output
from dpsco_jax.algorithms.phased_erm import ac_sa_stage_lengths
from dpsco_jax.algorithms.phased_erm import accelerated_phased_erm
from dpsco_jax.algorithms.phased_erm import accelerated_phased_erm_preset
from dpsco_jax.algorithms.phased_erm import AcSaState
from dpsco_jax.algorithms.phased_erm import add_proximal_gradient
from dpsco_jax.algorithms.phased_erm import ErmPhaseRecord
from dpsco_jax.algorithms.phased_erm import outlier_removal_gradient
from dpsco_jax.algorithms.phased_erm import OutlierRemovalGradientState
from dpsco_jax.algorithms.phased_erm import smoothed_item_loss
from dpsco_jax.algorithms.phased_sgd import disjoint_user_blocks
from dpsco_jax.algorithms.phased_sgd import phase_groups
from dpsco_jax.algorithms.phased_sgd import phase_sizes
from dpsco_jax.algorithms.phased_sgd import phased_sgd
from dpsco_jax.algorithms.phased_sgd import phased_sgd_preset
from dpsco_jax.algorithms.phased_sgd import phased_sgd_schedule
from dpsco_jax.algorithms.phased_sgd import PhasedResult
from dpsco_jax.algorithms.phased_sgd import PhaseRecord
from dpsco_jax.algorithms.phased_sgd import PhaseSchedule
from dpsco_jax.algorithms.phased_sgd import PresetCondition
# pylint: enable=unused-import

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


__all__ = ('ac_sa', 'ac_sa_output', 'ac_sa_stage_lengths',
           'accelerated_phased_erm', 'accelerated_phased_erm_preset',
           'AcSaState', 'add_proximal_gradient', 'disjoint_user_blocks',
           'ErmPhaseRecord', 'outlier_removal_gradient',
           'OutlierRemovalGradientState', 'phase_groups', 'phase_sizes',
           'phased_sgd', 'phased_sgd_preset', 'phased_sgd_schedule',
           'PhasedResult', 'PhaseRecord', 'PhaseSchedule', 'PresetCondition',
           'smoothed_item_loss', 'user_level_dpsgd',
           'user_level_dpsgd_mechanism')
