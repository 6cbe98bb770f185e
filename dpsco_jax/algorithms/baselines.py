"""Baselines: DP-SGD (i.i.d. Gaussian noise) and DP-FTRL (binary-tree noise).

Both are `dpsco_jax.estimators.noisy_gradient` with a different noise
mechanism; chain them with any optax optimizer (paper 001 §2.3-2.4):

    tx = optax.chain(dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=1.1,
                           num_steps=T, key=0),
                     optax.sgd(0.1, momentum=0.9))

Accounting (see `dpsco_jax.accounting`): DP-SGD can be accounted with Poisson
sampling (amplified: `accounting.PoissonSampling`, with
`batching.PoissonBatches`) or without amplification for any fixed or shuffled
order (`FixedOrder`, `Shuffled`). DP-FTRL gets no amplification: its batches
come in a public order (`single_epoch`, `FixedOrder`), or are reshuffled each
epoch (`Shuffled`: exact when a tree restarts every epoch, an upper bound
otherwise). Use `dpsgd_mechanism` / `dpftrl_mechanism` to
account for exactly the noise the transformation adds.
"""

from typing import Any, Callable, Optional

import jax
import optax

from dpsco_jax import checks
from dpsco_jax import estimators
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise

PyTree = Any


def dpsgd_mechanism(num_steps: Optional[int] = None) -> noise.NoiseMechanism:
  """The noise mechanism `dpsgd` builds: i.i.d. Gaussian noise.

  Account for a run with this very mechanism, e.g.
  `accounting.epsilon_spent(dpsgd_mechanism(T), z, participation, delta)`.

  Args:
    num_steps: the capacity, as passed to `dpsgd`.

  Returns:
    `noise.gaussian(num_steps)`.
  """
  return noise.gaussian(num_steps)


def dpftrl_mechanism(num_steps: int, restart_every: Optional[int] = None,
                     honaker: bool = False) -> noise.NoiseMechanism:
  """The noise mechanism `dpftrl` builds: the tree's per-step residual noise.

  Account for a run with this very mechanism, e.g.
  `accounting.calibrate_noise_multiplier(dpftrl_mechanism(T, R), ...)`.

  Args:
    num_steps: total steps, as passed to `dpftrl`.
    restart_every: steps per tree, as passed to `dpftrl`.
    honaker: as passed to `dpftrl`.

  Returns:
    `noise.tree(num_steps, release='per_step', ...)`.
  """
  return noise.tree(num_steps, release='per_step', restart_every=restart_every,
                    honaker=honaker)


@keywords.checked
def dpsgd(
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
    adaptive_clipping: Optional[Any] = None,
    automatic_clipping: Optional[float] = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-SGD's private gradient: clipped per-example sum plus i.i.d. noise.

  Outputs `(sum_i clip(grad f(x, d_i)) + N(0, (z * Delta)^2 I)) / B` with
  `Delta = l2_clip` (twice that under replace-one). Chain an optax optimizer
  after it (e.g. `optax.sgd(lr, momentum=0.9)`).

  Example:
    >>> tx = optax.chain(
    ...     dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=1.1, num_steps=1000,
    ...           key=0),
    ...     optax.sgd(0.1))
    >>> updates, state = tx.update(None, tx.init(params), params, batch=batch)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: per-example clip norm.
    noise_multiplier: noise std over the sensitivity (calibrate it with
      `dpsco_jax.accounting.calibrate_noise_multiplier`).
    key: PRNG key or int seed for the noise (replicated across devices).
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    num_steps: the number of steps the noise was calibrated for (required:
      steps past it are refused, so a loop that runs longer than its
      accounting stops instead of silently spending more privacy).
    neighboring_relation: the relation the noise is calibrated for.
    normalize_by: public batch size (required with a padding mask, e.g. the
      expected batch size under Poisson sampling).
    microbatch_size: optional cap on per-example gradients held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name on several devices.
    adaptive_clipping: None, or an `adaptive_clipping.AdaptiveClipping`
      (`l2_clip` is the initial clip; Andrew et al. 2021; needs
      `normalize_by`). `noise_multiplier` stays the accounted total.
    automatic_clipping: None, or the stability constant r of automatic
      clipping (Bu et al. 2023).

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=batch, batch_mask=None)`.
  """
  if num_steps is None:
    raise ValueError(
        'dpsgd needs num_steps, the number of steps its noise was calibrated '
        'for: steps past it are refused (without it a loop could run past '
        'its accounting and silently spend more privacy)')
  return estimators.noisy_gradient(
      loss_fn, l2_clip=l2_clip, noise_multiplier=noise_multiplier,
      mechanism=dpsgd_mechanism(checks.positive_int(num_steps, 'num_steps')),
      key=key,
      neighboring_relation=neighboring_relation, normalize_by=normalize_by,
      microbatch_size=microbatch_size,
      clipping_method=clipping_method, axis_name=axis_name,
      adaptive_clipping=adaptive_clipping,
      automatic_clipping=automatic_clipping)


@keywords.checked
def dpftrl(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    *,
    l2_clip: float,
    noise_multiplier: float,
    num_steps: int,
    key: estimators.KeyLike = None,
    restart_every: Optional[int] = None,
    honaker: bool = False,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    normalize_by: Optional[float] = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-FTRL's private gradient: clipped per-example sum plus tree residual noise.

  Outputs the clipped mean gradient plus the binary tree's per-step residual
  noise (paper 001 §2.4, Lemma 4.3), so the running sum of the outputs is the
  tree's noisy prefix sum of gradients: followed by `optax.sgd(lr)` this is
  DP-FTRL `x_t = x_0 - lr * (noisy prefix sum)`; with momentum it is the
  momentum variant of Kairouz et al. With `restart_every=R` a fresh tree
  starts every R steps, the noise already added staying in the iterate (the
  restart of Kairouz et al.).

  Example:
    >>> tx = optax.chain(
    ...     dpftrl(loss_fn, l2_clip=1.0, noise_multiplier=5.0, num_steps=600,
    ...            restart_every=100, key=0),
    ...     optax.sgd(0.1, momentum=0.9))

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: per-example clip norm.
    noise_multiplier: tree-node noise std over the sensitivity of one step's
      clipped sum (calibrate with `dpsco_jax.accounting`).
    num_steps: total steps; the tree refuses to go past it.
    key: PRNG key or int seed for the noise (replicated across devices).
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    restart_every: steps per tree (e.g. one epoch); None for one tree.
    honaker: use Honaker's variance-reduced tree estimates.
    neighboring_relation: the relation the noise is calibrated for.
    normalize_by: public batch size (required with a padding mask).
    microbatch_size: optional cap on per-example gradients held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name on several devices.

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=batch, batch_mask=None)`.
  """
  return estimators.noisy_gradient(
      loss_fn, l2_clip=l2_clip, noise_multiplier=noise_multiplier,
      mechanism=dpftrl_mechanism(num_steps, restart_every, honaker), key=key,
      neighboring_relation=neighboring_relation,
      normalize_by=normalize_by, microbatch_size=microbatch_size,
                                 clipping_method=clipping_method,
      axis_name=axis_name)
