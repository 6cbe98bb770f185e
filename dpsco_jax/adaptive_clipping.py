"""Adaptive clipping: the clip norm follows a private quantile of the norms.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping" (NeurIPS 2021), Algorithm 1 with the geometric update.
At step t, with clip C_t, each unit i (an example, a difference at two
points, a user) also answers one bit, `b_i = 1[||contribution_i|| <= C_t]`.
The step releases, besides the noisy clipped sum,

    noisy count  = sum_i (b_i - 1/2) + N(0, sigma_b^2)
    b~_t         = noisy count / m + 1/2     (m: the public batch size)
    C_{t+1}      = C_t * exp(-eta_C (b~_t - gamma))

so C moves toward the gamma-quantile of the norms: up when more than a
fraction 1 - gamma of the units are clipped, down otherwise. Centering the
bits (`b_i - 1/2`, the paper's Section 3.1) halves the count's sensitivity:
one unit added or removed moves it by 1/2 (by 1 under replace-one, as the
clipped sum's sensitivity doubles too, and by 1 under zero-out, where the
zero unit's bit is 1: `count_sensitivity`).

Privacy, with ONE noise multiplier z (the one the accountant calibrates).
The clipped sum and the count are evaluated on the same batch, so they
form one Gaussian mechanism on the vector (sum / (z_sum C_t f), count /
(z_b s_b)), f the relation's factor and s_b the count's sensitivity: its l2
sensitivity is `sqrt(1 / z_sum^2 + 1 / z_b^2)`. Choosing the sum's
multiplier

    z_sum = (z^-2 - z_b^-2)^(-1/2),     z_b = sigma_b / s_b

(the paper's Section 3.2 effective noise multiplier, `sigma_Delta =
(z^-2 - (2 sigma_b)^-2)^(-1/2)` under add/remove) makes that sensitivity
exactly 1 / z, so the step IS the Gaussian mechanism of multiplier z that
the plan accounts for, under every sampling the accountant handles (the
same batch enters both queries, so Poisson amplification applies to the
pair): one event, no extra epsilon. The price is noise: z_sum > z. The
clip itself is a function of earlier releases only (post-processing):
it may be logged.

This holds for noise drawn independently each step (`noise.gaussian`):
DP-SGD and user-level DP-SGD. Correlated noise (trees, matrix
factorization) is refused: there the count's independent noise is not part
of the mechanism the accountant describes.

    tx = estimators.noisy_statistic(
        clipping.clipped_grad_sum(loss_fn, 0.1),    # 0.1: the initial clip
        noise_multiplier=1.1, mechanism=noise.gaussian(1000),
        normalize_by=256, adaptive_clipping=AdaptiveClipping())
"""

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from dpsco_jax import clipping
from dpsco_jax import guards
from dpsco_jax import neighboring
from dpsco_jax import parallel

PyTree = Any

# The paper's defaults (Section 4; tensorflow_federated's
# `gaussian_adaptive` uses the same): the median, eta_C = 0.2, and a count
# noise of one twentieth of the expected batch.
DEFAULT_TARGET_QUANTILE = 0.5
DEFAULT_LEARNING_RATE = 0.2
DEFAULT_COUNT_STDDEV_FRACTION = 0.05


class AdaptiveClipping(NamedTuple):
  """How the clip adapts (Andrew et al. 2021, Algorithm 1, geometric update).

  Example:
    >>> AdaptiveClipping(target_quantile=0.5, learning_rate=0.2)

  Attributes:
    target_quantile: gamma in (0, 1), the fraction of units the clip should
      leave unclipped (0.5: the median norm).
    learning_rate: eta_C > 0 of the geometric update
      `C <- C exp(-eta_C (b~ - gamma))`.
    count_stddev: sigma_b, the standard deviation of the noise on the
      centered count of unclipped units (in units; not a multiplier). None:
      `0.05 * m`, m the public batch size (the paper's m / 20).
  """

  target_quantile: float = DEFAULT_TARGET_QUANTILE
  learning_rate: float = DEFAULT_LEARNING_RATE
  count_stddev: Optional[float] = None


class AdaptiveClipState(NamedTuple):
  """The adaptive clip between steps.

  Attributes:
    clip: float32 scalar, the clip norm C_t of the next step (a function of
      earlier private releases: it may be logged).
    key: the count noise's key, apart from the clipped sum's (secret, like
      every noise key).
    step: int32, counts drawn so far (the count noise of step t uses
      `fold_in(key, t)`).
  """

  clip: jax.Array
  key: jax.Array
  step: jax.Array


def validate(config: AdaptiveClipping) -> AdaptiveClipping:
  """`config` with its values checked.

  Example:
    >>> validate(AdaptiveClipping(target_quantile=0.9))

  Args:
    config: an `AdaptiveClipping`.

  Returns:
    The config with float values.

  Raises:
    TypeError: if `config` is not an `AdaptiveClipping`.
    ValueError: for a quantile outside (0, 1), a learning rate that is not
      positive and finite, or a count noise that is not positive.
  """
  if not isinstance(config, AdaptiveClipping):
    raise TypeError('adaptive_clipping must be an AdaptiveClipping(...), got '
                    f'{type(config).__name__}')
  quantile = float(config.target_quantile)
  if not 0.0 < quantile < 1.0:
    raise ValueError(f'target_quantile must be in (0, 1), got {quantile}')
  rate = float(config.learning_rate)
  if not 0.0 < rate < math.inf:
    raise ValueError(f'learning_rate must be positive and finite, got {rate}')
  stddev = config.count_stddev
  if stddev is not None:
    stddev = float(stddev)
    if not 0.0 < stddev < math.inf:
      raise ValueError('count_stddev must be positive and finite (the count '
                       f'must be noised), got {stddev}')
  return AdaptiveClipping(quantile, rate, stddev)


def count_stddev(config: AdaptiveClipping, batch_size: float) -> float:
  """sigma_b: the configured count noise, or 0.05 times the batch size.

  Example:
    >>> count_stddev(AdaptiveClipping(), 256)
    12.8

  Args:
    config: the adaptive clipping.
    batch_size: m, the public (expected) batch size.

  Returns:
    The count noise's standard deviation.
  """
  if config.count_stddev is not None:
    return float(config.count_stddev)
  return DEFAULT_COUNT_STDDEV_FRACTION * float(batch_size)


def count_sensitivity(relation: neighboring.NeighboringRelation) -> float:
  """The centered count's sensitivity: 1/2 under add/remove, else 1.

  Adding or removing a unit adds or removes one `b_i - 1/2`: 1/2. Replacing
  it flips its bit: 1. Zeroing it out (a "zero" unit, contribution 0, which
  is never clipped: bit 1) also flips a 0 to a 1: 1, although the clipped
  sum's factor is 1 there (the zero unit's contribution is 0, not -C).

  Example:
    >>> count_sensitivity(neighboring.NeighboringRelation.ZERO_OUT)
    1.0

  Args:
    relation: the neighbouring relation.

  Returns:
    1/2 or 1.
  """
  if neighboring.NeighboringRelation(relation) is (
      neighboring.NeighboringRelation.ADD_OR_REMOVE):
    return 0.5
  return 1.0


def count_noise_multiplier(stddev: float,
                           relation: neighboring.NeighboringRelation) -> float:
  """z_b: the count noise over the centered count's sensitivity.

  Example:
    >>> count_noise_multiplier(12.8, neighboring.NeighboringRelation.ADD_OR_REMOVE)
    25.6

  Args:
    stddev: sigma_b.
    relation: the neighbouring relation (`count_sensitivity`: 1/2 under
      add/remove, 1 under replace-one and zero-out).

  Returns:
    `sigma_b / count_sensitivity(relation)`: `2 sigma_b` under add/remove.
  """
  return float(stddev) / count_sensitivity(relation)


def sum_noise_multiplier(noise_multiplier: float,
                         count_multiplier: float) -> float:
  """z_sum = (z^-2 - z_b^-2)^(-1/2): the clipped sum's share of z.

  Andrew et al. 2021, Section 3.2 (there with z_b = 2 sigma_b). With it the
  sum and the count together are one Gaussian mechanism of multiplier z.

  Example:
    >>> sum_noise_multiplier(1.0, 25.6)
    1.00076...

  Args:
    noise_multiplier: z, the step's total (accounted) multiplier; 0 for a
      non-private reference run (then 0).
    count_multiplier: z_b.

  Returns:
    z_sum >= z.

  Raises:
    ValueError: when z_b <= z (the count alone would spend the whole
      budget): give a larger count_stddev.
  """
  if noise_multiplier == 0.0:
    return 0.0
  if count_multiplier <= noise_multiplier:
    raise ValueError(
        f'the count noise multiplier {count_multiplier:g} (count_stddev '
        f'over the count\'s sensitivity) must exceed the noise multiplier '
        f'{noise_multiplier:g}: the count would spend the whole privacy '
        'budget. Give AdaptiveClipping a larger count_stddev (the default '
        'is 0.05 x the batch size, so a larger batch also works).')
  return (noise_multiplier ** -2 - count_multiplier ** -2) ** -0.5


def init(l2_clip: float, key: jax.Array) -> AdaptiveClipState:
  """The state of step 0: the initial clip and the count's key.

  Example:
    >>> state = init(0.1, jax.random.key(1))

  Args:
    l2_clip: C_0, the initial clip norm.
    key: the count noise's key (never the sum's).

  Returns:
    An `AdaptiveClipState`.
  """
  return AdaptiveClipState(
      clip=jnp.asarray(clipping.validate_clip(l2_clip), jnp.float32),
      key=key, step=jnp.zeros((), jnp.int32))


def unclipped_fraction(
    clipped: clipping.ClippedSum,
    state: AdaptiveClipState,
    *,
    stddev: float,
    batch_size: Any,
    axis_name: Optional[str] = None,
) -> tuple[jax.Array, AdaptiveClipState]:
  """b~: the privately released fraction of units the clip left unclipped.

  Example:
    >>> fraction, state = unclipped_fraction(clipped, state, stddev=12.8,
    ...                                      batch_size=256)

  Args:
    clipped: this device's `ClippedSum` (its counters; summed over devices).
    state: the adaptive state (its key and step draw the noise).
    stddev: sigma_b.
    batch_size: m, the public batch size the count is divided by.
    axis_name: the device axis, or None.

  Returns:
    `(b~, state with the step advanced)`; b~ is a float32 scalar.
  """
  # Nonfinite contributions were dropped (zero): not "at most the clip".
  unclipped = clipped.count - clipped.num_clipped - clipped.num_nonfinite
  unclipped = parallel.psum(unclipped, axis_name)
  count = parallel.psum(clipped.count, axis_name)
  centered = unclipped.astype(jnp.float32) - 0.5 * count.astype(jnp.float32)
  noise = jax.random.normal(jax.random.fold_in(state.key, state.step), (),
                            jnp.float32)
  fraction = (centered + stddev * noise) / batch_size + 0.5
  return fraction, state._replace(step=state.step + 1)


def next_clip(clip: jax.Array, fraction: jax.Array,
              config: AdaptiveClipping) -> jax.Array:
  """The geometric update `C exp(-eta_C (b~ - gamma))` (Algorithm 1).

  Example:
    >>> next_clip(jnp.float32(1.0), jnp.float32(0.9), AdaptiveClipping())

  Args:
    clip: C_t.
    fraction: b~_t.
    config: the adaptive clipping.

  Returns:
    The next step's clip C_{t+1}, positive whatever the noise (an
    exponential), in float32.
  """
  step = -config.learning_rate * (fraction - config.target_quantile)
  return (clip * jnp.exp(step)).astype(jnp.float32)


def current_clip(opt_state: PyTree) -> Optional[jax.Array]:
  """The adaptive clip held in an optimizer state, or None without one.

  What the physical batches of a logical step are clipped at
  (`dpsco_jax.physical`): the clip the step's one-call form would use.

  Example:
    >>> current_clip(opt_state)     # a float32 scalar, or None

  Args:
    opt_state: a chain's state holding at most one `AdaptiveClipState`.

  Returns:
    Its clip, or None.

  Raises:
    ValueError: if the state holds several adaptive clips.
  """
  found = [node for node in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, AdaptiveClipState))
           if isinstance(node, AdaptiveClipState)]
  if len(found) > 1:
    raise ValueError('the optimizer state holds several adaptive clips: '
                     'which one a physical batch is clipped at is ambiguous')
  return found[0].clip if found else None


def check_mechanism(mechanism: Any) -> None:
  """Refuses adaptive clipping with noise correlated across steps.

  Example:
    >>> check_mechanism(noise.gaussian(100))    # passes
    >>> check_mechanism(noise.tree(100))        # ValueError

  Args:
    mechanism: the estimator's noise mechanism.

  Raises:
    ValueError: for a mechanism other than `noise.gaussian` (the count's
      independent noise would not be part of the mechanism accounted for).
  """
  if mechanism.name != 'gaussian':
    raise ValueError(
        f'adaptive clipping needs noise drawn independently each step '
        f'(noise.gaussian), not {mechanism.name}: the clipped sum and the '
        'count form one Gaussian mechanism only then. Use DP-SGD (or '
        'user-level DP-SGD) for adaptive clipping, or a fixed clip (or '
        'automatic clipping, which needs no clip) with correlated noise.')


def poisoned(clip: jax.Array, refusal: Optional[guards.Refusal]) -> jax.Array:
  """The clip, NaN once a refusal is recorded (nothing released after it).

  Example:
    >>> poisoned(new_clip, noise_state.refusal)

  Args:
    clip: the next step's clip.
    refusal: the noise state's `guards.Refusal` record, or None.

  Returns:
    `clip`, or NaN when the record holds a failed check.
  """
  if refusal is None:
    return clip
  return jnp.where(refusal.check != 0, jnp.nan, clip)


def checked_config(config: Optional[AdaptiveClipping], *,
                   noise_multiplier: float, mechanism: Any,
                   batch_size: Optional[float],
                   relation: neighboring.NeighboringRelation
                   ) -> Optional[tuple[AdaptiveClipping, float, float]]:
  """`(config, sigma_b, z_sum)` for an estimator, or None without one.

  Example:
    >>> checked_config(AdaptiveClipping(), noise_multiplier=1.0,
    ...                mechanism=noise.gaussian(100), batch_size=256,
    ...                relation=neighboring.NeighboringRelation.ADD_OR_REMOVE)

  Args:
    config: the adaptive clipping, or None.
    noise_multiplier: z, the accounted (total) multiplier.
    mechanism: the estimator's noise mechanism.
    batch_size: the public batch size m, or None.
    relation: the neighbouring relation.

  Returns:
    The checked config, the count's noise std and the sum's multiplier.

  Raises:
    ValueError: see `validate`, `check_mechanism`, `sum_noise_multiplier`;
      and without a public batch size (the count is divided by it).
  """
  if config is None:
    return None
  config = validate(config)
  check_mechanism(mechanism)
  if batch_size is None:
    raise ValueError('adaptive clipping divides the noisy count by the '
                     'public batch size: give normalize_by')
  stddev = count_stddev(config, batch_size)
  z_sum = sum_noise_multiplier(
      noise_multiplier, count_noise_multiplier(stddev, relation))
  return config, stddev, z_sum

