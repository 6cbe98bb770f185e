"""Private gradient estimators as optax transformations.

An estimator turns a batch into a privatized gradient estimate: it evaluates a
clipped statistic (`dpsco_jax.clipping`) at the current params, sums it across
devices (`dpsco_jax.parallel`), adds ONE draw of a noise mechanism
(`dpsco_jax.noise`) scaled to the statistic's sensitivity, and only then
divides by the public batch size. Chain it before any optax optimizer: what
comes after is post-processing.

    tx = optax.chain(noisy_gradient(loss_fn, ...), optax.sgd(lr, momentum=0.9))
    updates, state = tx.update(None, state, params, batch=batch)

The `updates` argument is ignored (pass None): the estimator computes the
gradients itself from `loss_fn`, bound at construction, so it controls the
per-example clipping the privacy guarantee rests on.
"""

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from dpsco_jax import adaptive_clipping as adaptive_lib
from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import guards
from dpsco_jax import keys
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise as noise_lib
from dpsco_jax import parallel

PyTree = Any
KeyLike = keys.KeyLike


class NoisyGradientState(NamedTuple):
  """State of `noisy_gradient`.

  Attributes:
    noise: the noise mechanism's state (key, step counter, noise buffers).
      It holds no data, but the key and buffers determine the noise: keep it
      secret (checkpoint it privately, never log or release it), or anyone
      could subtract the noise from the released outputs.
    adaptive: with adaptive clipping, the clip of the next step and the
      count noise's key (`adaptive_clipping.AdaptiveClipState`); None
      otherwise.
  """

  noise: noise_lib.NoiseState
  adaptive: Optional[Any] = None


as_key = keys.as_key


def validate_noise_multiplier(noise_multiplier: float,
                              what: Optional[str] = None) -> float:
  """Returns the noise multiplier as a float, or raises if it is invalid.

  The same check as the accountants' (`dpsco_jax.checks.noise_multiplier`),
  so a multiplier the noise accepts is one the accounting accepts. Zero is
  allowed (a non-private reference run) and, with `what`, announced by a
  `checks.NoPrivacyWarning`.

  Example:
    >>> validate_noise_multiplier(0.0)   # no noise: allowed, epsilon = inf
    0.0

  Args:
    noise_multiplier: noise standard deviation over sensitivity.
    what: the transformation's name, to warn when the multiplier is 0.

  Returns:
    `float(noise_multiplier)`.

  Raises:
    ValueError: if negative, NaN or infinite.
  """
  value = checks.noise_multiplier(noise_multiplier)
  if value == 0.0 and what is not None:
    checks.warn_no_noise(what)
  return value


def add_noise(
    total: PyTree,
    noise_state: noise_lib.NoiseState,
    mechanism: noise_lib.NoiseMechanism,
    stddev: Union[float, jax.Array],
    *,
    normalize_by: Union[float, jax.Array] = 1.0,
    axis_name: Optional[str] = None,
) -> tuple[PyTree, noise_lib.NoiseState]:
  """Adds the mechanism's next noise ONCE to an already summed statistic.

  `total` must be the same on every device (a `psum` result, or a running
  sum of such results, as the recursive-gradient estimators keep): the noise
  is drawn from the replicated key, so every device adds the same draw.

  Args:
    total: the global clipped statistic (replicated across devices).
    noise_state: the mechanism state; its key must be replicated.
    mechanism: the noise mechanism.
    stddev: noise standard deviation on `total` (noise multiplier times the
      statistic's sensitivity, times any public scale applied to `total`).
    normalize_by: public divisor applied after the noise.
    axis_name: the device axis, or None.

  Returns:
    `((total + stddev * noise) / normalize_by, new noise state)`, in
    float32 (or wider).
  """
  not_replicated = parallel.check_replicated(noise_state.key, axis_name)
  noise, noise_state = mechanism.next(noise_state, total)
  private = jax.tree_util.tree_map(
      lambda s, n: (s + stddev * n.astype(s.dtype)) / normalize_by, total,
      noise)
  if not_replicated is not None:
    # Recorded in the noise state (no host round trip): its later draws
    # are NaN too, and `guards.raise_if_refused` reports it.
    private, refusal = guards.record(
        [(not_replicated, parallel.NOT_REPLICATED_MESSAGE, 'replication')],
        private, noise_state.refusal or guards.no_refusal(),
        noise_state.step - 1)
    noise_state = noise_state._replace(refusal=refusal)
  return private, noise_state


def privatize_sum(
    clipped: clipping.ClippedSum,
    noise_state: noise_lib.NoiseState,
    mechanism: noise_lib.NoiseMechanism,
    stddev: float,
    *,
    normalize_by: float,
    axis_name: Optional[str] = None,
) -> tuple[PyTree, noise_lib.NoiseState]:
  """Sums a clipped statistic across devices, adds noise once, normalizes.

  This is the one place where noise meets a fresh batch sum: every
  estimator calls it (or `add_noise` on a running sum of its results).

  Args:
    clipped: the local (per-device) clipped sum.
    noise_state: the mechanism state; its key must be replicated.
    mechanism: the noise mechanism.
    stddev: noise standard deviation on the SUM (noise multiplier times the
      statistic's sensitivity).
    normalize_by: the public batch size the noisy sum is divided by.
    axis_name: the device axis, or None.

  Returns:
    `((global clipped sum + stddev * noise) / normalize_by, new noise state)`,
    in float32 (or wider).
  """
  total = parallel.psum(clipped.sum, axis_name)
  return add_noise(total, noise_state, mechanism, stddev,
                   normalize_by=normalize_by, axis_name=axis_name)


def check_first_in_chain(updates: PyTree, transformation: str) -> None:
  """Raises unless a private estimator was given `updates=None`.

  A private estimator computes its gradients itself, from `loss_fn`, so that
  it controls the clipping its guarantee rests on; whatever it is handed as
  `updates` it would discard. Something other than None means another
  transformation runs before it in an `optax.chain` (its output lost, e.g.
  `optax.sgd` first trains uphill), or the caller passed gradients it
  expects to be used.

  Example:
    >>> check_first_in_chain(updates, 'noisy_gradient')

  Args:
    updates: the `updates` argument of `update`.
    transformation: the estimator's name, for the message.

  Raises:
    ValueError: if `updates` is not None.
  """
  if updates is not None:
    raise ValueError(
        f'{transformation}.update got updates that it would discard: a '
        'private estimator computes its own clipped gradients from loss_fn. '
        'Put it FIRST in optax.chain (private part, then the optimizer) and '
        'call tx.update(None, state, params, batch=batch)')


def check_params(params: PyTree) -> None:
  """Raises if an estimator's `update` was called without params.

  Args:
    params: the `params` argument of `update`.

  Raises:
    ValueError: if `params` is None.
  """
  if params is None:
    raise ValueError('params are required: call update(None, state, params, '
                     'batch=batch)')


def cast_like(tree: PyTree, like: PyTree) -> PyTree:
  """Casts an estimate to the params' dtypes, checking the structure.

  Args:
    tree: the estimate (a gradient-shaped pytree).
    like: the params.

  Returns:
    `tree` with each leaf cast to the dtype of the matching params leaf.

  Raises:
    ValueError: if the pytree structures differ.
  """
  if jax.tree_util.tree_structure(tree) != jax.tree_util.tree_structure(like):
    raise ValueError('the gradient pytree does not match the params pytree')
  return jax.tree_util.tree_map(
      lambda x, p: x.astype(jnp.result_type(p)), tree, like)


def validate_normalize_by(normalize_by: Optional[float]) -> Optional[float]:
  """Returns `normalize_by` as given, or raises if it is not positive.

  Args:
    normalize_by: the public batch size, or None.

  Returns:
    `normalize_by`.

  Raises:
    ValueError: if it is given and not positive.
  """
  if normalize_by is not None and not float(normalize_by) > 0:
    raise ValueError(f'normalize_by must be positive, got {normalize_by!r}')
  return normalize_by


def public_batch_size(batch: PyTree, batch_mask: Optional[jax.Array],
                      normalize_by: Optional[float],
                      axis_name: Optional[str]) -> float:
  """The public divisor of a noisy sum: never the realized (private) count.

  Args:
    batch: the local batch (leading example axis).
    batch_mask: the padding mask, or None.
    normalize_by: the public batch size given at construction, or None.
    axis_name: the device axis, or None.

  Returns:
    `normalize_by` if given, else the batch's leading size times the number
    of devices.

  Raises:
    ValueError: if the batch is missing, or a mask comes without
      `normalize_by` (dividing by the realized count would release it).
  """
  if batch is None:
    raise ValueError('the batch is required: update(None, state, params, '
                     'batch=batch)')
  if batch_mask is not None and normalize_by is None:
    raise ValueError(
        'a padding mask was given without normalize_by: pass the public '
        'batch size (e.g. the expected batch size under Poisson sampling); '
        'dividing by the realized count would release a private value')
  if normalize_by is not None:
    return normalize_by
  return clipping.batch_size_of(batch) * parallel.axis_size(axis_name)


def accumulated_batch_size(normalize_by: Optional[float],
                           transformation: str) -> float:
  """The public divisor of a statistic summed over physical batches.

  Example:
    >>> accumulated_batch_size(256.0, 'noisy_gradient')
    256.0

  Args:
    normalize_by: the public batch size given at construction, or None.
    transformation: the estimator's name, for the message.

  Returns:
    `normalize_by`.

  Raises:
    ValueError: if it is None: the batch's size is not known from an
      accumulated sum, and its count is private.
  """
  if normalize_by is None:
    raise ValueError(
        f'{transformation} was given a clipped_sum accumulated over physical '
        'batches, but no normalize_by: build it with normalize_by= (the '
        'public logical batch size; plans do); the accumulated count is '
        'private and cannot be the divisor')
  return normalize_by


@keywords.checked
def noisy_gradient(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    *,
    l2_clip: float,
    noise_multiplier: float,
    mechanism: noise_lib.NoiseMechanism,
    key: KeyLike = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    normalize_by: Optional[float] = None,
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    adaptive_clipping: Optional[Any] = None,
    automatic_clipping: Optional[float] = None,
) -> optax.GradientTransformationExtraArgs:
  """Noisy clipped mean gradient: the estimator behind DP-SGD and DP-FTRL.

  Each step: per-example gradients of `loss_fn` at `params` on `batch`, each
  clipped to `l2_clip`; their SUM (summed over devices when `axis_name` is
  set); plus `noise_multiplier * sensitivity` times the mechanism's next
  noise vector; divided by the public batch size. With the i.i.d. Gaussian
  mechanism this is DP-SGD's gradient (paper 001 §2.3); with the tree's
  per-step residual noise it is DP-FTRL's (prefix sums of the outputs are the
  tree's noisy prefix sums).

  Example:
    >>> tx = optax.chain(
    ...     noisy_gradient(loss_fn, l2_clip=1.0, noise_multiplier=1.1,
    ...                    mechanism=noise.gaussian(1000), key=0),
    ...     optax.sgd(0.1, momentum=0.9))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(None, state, params, batch=batch)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: per-example clip norm.
    noise_multiplier: noise standard deviation over the sensitivity of the
      clipped sum (under `neighboring_relation`).
    mechanism: the noise mechanism (its `num_steps` caps the run).
    key: PRNG key or int seed used only for this noise; under several devices
      it must be the same on all of them.
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    neighboring_relation: the relation the noise is calibrated for (replace-
      one doubles the sensitivity, hence the noise).
    normalize_by: the public batch size to divide by. Default: the batch's
      leading size times the number of devices. Required with a padding mask
      (e.g. the expected batch size under Poisson sampling): dividing by the
      realized count would use a private quantity.
    microbatch_size: optional cap on per-example gradients held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name when run on several devices.
    adaptive_clipping: None, or an `adaptive_clipping.AdaptiveClipping`:
      `l2_clip` is then the initial clip, and the clip follows a private
      quantile of the gradient norms (see `noisy_statistic`).
    automatic_clipping: None, or the stability constant r of automatic
      clipping: each gradient scaled to `l2_clip * g / (||g|| + r)` (Bu et
      al. 2023; `clipping.ClippedStatistic.automatic_clipping`).

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=batch, batch_mask=None)`. The output
    has the params' structure and dtypes.
  """
  statistic = clipping.clipped_grad_sum(
      loss_fn, l2_clip, microbatch_size=microbatch_size,
      clipping_method=clipping_method,
      automatic_clipping=automatic_clipping)
  return noisy_statistic(
      statistic, noise_multiplier=noise_multiplier, mechanism=mechanism,
      key=key, neighboring_relation=neighboring_relation,
      normalize_by=normalize_by, axis_name=axis_name,
      adaptive_clipping=adaptive_clipping)


@keywords.checked
def noisy_statistic(
    statistic: clipping.ClippedStatistic,
    *,
    noise_multiplier: float,
    mechanism: noise_lib.NoiseMechanism,
    key: KeyLike = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    normalize_by: Optional[float] = None,
    axis_name: Optional[str] = None,
    name: str = 'noisy_gradient',
    adaptive_clipping: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Any clipped statistic of the params, summed, noised once, normalized.

  The estimator behind `noisy_gradient` (per-example gradients) and the
  user-level estimators (`clipping.clipped_user_grad_sum`): each step calls
  `statistic(batch, params, mask=batch_mask)`, sums over devices, adds
  `noise_multiplier * statistic.sensitivity(relation)` times the
  mechanism's next noise, and divides by the public batch size (examples,
  or users).

  Example:
    >>> tx = noisy_statistic(clipping.clipped_user_grad_sum(loss_fn, 1.0),
    ...                      noise_multiplier=1.1,
    ...                      mechanism=noise.gaussian(1000))

  Args:
    statistic: a `ClippedStatistic` called as `statistic(batch, params)`.
    noise_multiplier: noise std over the statistic's sensitivity.
    mechanism: the noise mechanism (its `num_steps` caps the run).
    key: the noise key (None: fresh from OS entropy; see `noisy_gradient`).
    neighboring_relation: the relation the noise is calibrated for.
    normalize_by: the public number of units (examples, users) to divide
      by; required with a padding mask.
    axis_name: the device axis name.
    name: the transformation's name in messages and key bookkeeping.
    adaptive_clipping: None (the statistic's fixed clip), or an
      `adaptive_clipping.AdaptiveClipping`: the statistic's `l2_clip` is
      the initial clip, the clip of each step is in the state and follows
      a private quantile of the norms (Andrew et al. 2021, Algorithm 1),
      and `noise_multiplier` is the TOTAL multiplier of the sum and the
      count (the sum gets `adaptive_clipping.sum_noise_multiplier` of it),
      so the accounting of `noise_multiplier` is unchanged. Needs
      `normalize_by` and `noise.gaussian` noise.

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=batch, batch_mask=None)`, or
    `update(None, state, params, clipped_sum=clipped)` with the statistic
    already summed over a logical batch's physical batches
    (`dpsco_jax.physical`; needs `normalize_by`; with adaptive clipping,
    each physical batch clipped at the state's clip,
    `adaptive_clipping.current_clip(state)`).
  """
  noise_multiplier = validate_noise_multiplier(
      noise_multiplier, f'{name}({mechanism.name})')
  stddev = noise_multiplier * statistic.sensitivity(neighboring_relation)
  if mechanism.num_steps is None:
    raise ValueError(
        f'{mechanism.name} has no capacity (num_steps=None): a private '
        'estimator must refuse the steps past the ones its noise was '
        'calibrated for; build the mechanism with num_steps')
  adaptive = adaptive_lib.checked_config(
      adaptive_clipping, noise_multiplier=noise_multiplier,
      mechanism=mechanism, batch_size=normalize_by,
      relation=neighboring_relation)
  key = keys.noise_key(key, f'{name}({mechanism.name})')
  count_key = None
  if adaptive is not None:
    # Two streams from one key: the sum's noise never shares a draw with
    # the count's.
    key, count_key = jax.random.split(as_key(key))
  validate_normalize_by(normalize_by)

  def init_fn(params):
    check_params(params)
    return NoisyGradientState(
        noise=mechanism.init(params, key),
        adaptive=(None if adaptive is None else
                  adaptive_lib.init(statistic.l2_clip, count_key)))

  def update_fn(updates, state, params=None, *, batch=None, batch_mask=None,
                clipped_sum=None, **extra_args):
    del extra_args
    check_first_in_chain(updates, name)
    checks.state_type(state, NoisyGradientState, name)
    check_params(params)
    clip = None if adaptive is None else state.adaptive.clip
    if clipped_sum is not None:
      # Accumulated over physical batches (`dpsco_jax.physical`).
      divisor = accumulated_batch_size(normalize_by, name)
      clipped = clipped_sum
    else:
      divisor = public_batch_size(batch, batch_mask, normalize_by, axis_name)
      clipped = statistic(batch, parallel.per_device(params, axis_name),
                          mask=batch_mask, l2_clip=clip, axis_name=axis_name)
    if adaptive is None:
      private, noise_state = privatize_sum(
          clipped, state.noise, mechanism, stddev, normalize_by=divisor,
          axis_name=axis_name)
      return cast_like(private, params), NoisyGradientState(noise=noise_state)
    config, count_stddev, sum_multiplier = adaptive
    private, noise_state = privatize_sum(
        clipped, state.noise, mechanism,
        sum_multiplier * statistic.sensitivity(neighboring_relation, clip),
        normalize_by=divisor, axis_name=axis_name)
    fraction, adaptive_state = adaptive_lib.unclipped_fraction(
        clipped, state.adaptive, stddev=count_stddev, batch_size=divisor,
        axis_name=axis_name)
    new_clip = adaptive_lib.poisoned(
        adaptive_lib.next_clip(clip, fraction, config), noise_state.refusal)
    return cast_like(private, params), NoisyGradientState(
        noise=noise_state, adaptive=adaptive_state._replace(clip=new_clip))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
