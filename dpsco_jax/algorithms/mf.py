"""DP-MEMF: multi-epoch matrix-factorization DP (paper 001 Algorithm 2).

Each step adds the clipped per-example gradient sum and the matrix-
factorization noise `(C^-1 Z)_t`, then divides by the batch size, and feeds
the result to any optax optimizer (the paper: SGD with momentum 0.9):

    c = strategies.optimize_strategy(
        strategies.workload(k * b, 'true', momentum=0.9), num_epochs=k)
    z = accounting.calibrate_noise_multiplier(
        dpmemf_mechanism(c), accounting.FixedOrder(k, b), epsilon, delta,
        method='zcdp')                       # or the tighter default 'pld'
    tx = optax.chain(
        dpmemf(loss_fn, l2_clip=1.0, noise_multiplier=z, strategy=c,
               steps_per_epoch=b, num_examples=n, key=0),
        optax.sgd(lr, momentum=0.9))

Corrections to the printed Algorithm 2 (notes §1.5, pitfall 13): the step
index is `t = i b + j` for epoch i and batch j (not `i k + j`), and the noise
is scaled by the sensitivity: the update is
`(1/B) (sum_d clip(grad l(x_t; d), Ccl) + Ccl z (C^-1 xi)_t)` with
`xi ~ N(0, I)`; the paper's `Z ~ N(0, 1/(2 rho))` is `z = 1/sqrt(2 rho)`
for a strategy of sensitivity 1, which `calibrate_noise_multiplier(...,
method='zcdp')` returns.

Accounting assumes `FixedOrder(k, b)`: the same batches in the same public
order every epoch, no amplification. `dpmemf` checks it (see
`batching.fixed_order_guard`) from the example ids passed to each update:
ids in `[0, num_examples)`, each example in one batch of the first epoch at
most once, the same batches in every later epoch.
"""

from typing import Any, Callable, Optional

import jax
import numpy as np
import optax

from dpsco_jax import batching
from dpsco_jax import checks
from dpsco_jax import estimators
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise

PyTree = Any


def dpmemf_mechanism(strategy: np.ndarray,
                     storage: str = 'buffer') -> noise.NoiseMechanism:
  """The noise mechanism `dpmemf` builds: per-step `C^-1 z`.

  Account for a run with this very mechanism, e.g.
  `accounting.epsilon_spent(dpmemf_mechanism(c), z, FixedOrder(k, b),
  delta, method='zcdp')`.

  Args:
    strategy: the lower-triangular strategy C, `[k b, k b]`.
    storage: 'buffer' or 'regenerate' (`noise.matrix_factorization`).

  Returns:
    `noise.matrix_factorization(strategy, release='per_step', ...)`.
  """
  return noise.matrix_factorization(strategy, release='per_step',
                                    storage=storage)


@keywords.checked
def dpmemf(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    *,
    l2_clip: float,
    noise_multiplier: float,
    strategy: Optional[np.ndarray] = None,
    steps_per_epoch: int,
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
    automatic_clipping: Optional[float] = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-MEMF's private gradient (paper 001 Algorithm 2, corrected).

  Outputs `(sum_d clip(grad l(x_t; d)) + z Delta (C^-1 xi)_t) / B` at step
  `t = i b + j` with `Delta = l2_clip` (twice that under replace-one); chain
  an optax optimizer after it. The run refuses to go past the `k b` steps of
  the strategy, and, with `check_order=True`, refuses a batch that breaks
  the fixed order: an example twice in the first epoch (or twice in a
  batch), an id outside `[0, num_examples)`, or examples that differ from
  those at the same position of the first epoch.

  Example:
    >>> c = strategies.optimize_strategy(strategies.workload(600), 6)
    >>> tx = optax.chain(
    ...     dpmemf(loss_fn, l2_clip=1.0, noise_multiplier=2.72, strategy=c,
    ...            steps_per_epoch=100, num_examples=50_000, key=0),
    ...     optax.sgd(0.5, momentum=0.9))
    >>> state = tx.init(params)
    >>> for indices in batching.FixedOrderBatches(50_000, 500, num_epochs=6):
    ...   updates, state = tx.update(None, state, params,
    ...                              batch=data[indices], example_ids=indices)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    l2_clip: per-example clip norm (Ccl).
    noise_multiplier: noise std over one step's sensitivity (calibrate it
      with `accounting.calibrate_noise_multiplier(dpmemf_mechanism(C),
      FixedOrder(k, b), ...)`).
    strategy: the lower-triangular C, `[k b, k b]` (e.g. from
      `strategies.optimize_strategy`); or give `mechanism`.
    steps_per_epoch: b; the strategy's size must be a multiple of it.
    mechanism: instead of `strategy`, a per-step noise mechanism of `k b`
      steps, e.g. a BLT (`blt.mechanism`), whose noise state keeps a few
      params-sized buffers where a dense `strategy` keeps `k b - 1`.
    key: PRNG key or int seed for the noise (replicated across devices).
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    num_examples: the training set size the `example_ids` index; required
      with `check_order` (`batching.fixed_order_guard`).
    check_order: verify the fixed batch order from `example_ids`. Only turn
      it off when the pipeline is known to repeat its batches.
    storage: how the MF noise is streamed (`noise.matrix_factorization`).
    neighboring_relation: the relation the noise is calibrated for; default
      ZERO_OUT, the papers' (000/001): a fixed batch order's accounting
      assumes it, since adding or removing an example would move every
      later example to another batch (same sensitivity as add/remove).
    normalize_by: public batch size (required with a padding mask).
    microbatch_size: optional cap on per-example gradients held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the `pmap`/`shard_map` axis name on several devices.
    automatic_clipping: None, or the stability constant r of automatic
      clipping (Bu et al. 2023): each gradient scaled to
      `l2_clip * g / (||g|| + r)`, the same sensitivity.

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=batch, example_ids=ids,
    batch_mask=None)` (`example_ids` only needed with `check_order`).

  Raises:
    ValueError: for bad arguments, `num_examples` missing with
      `check_order`.
  """
  mechanism = epoch_mechanism(strategy, storage, steps_per_epoch, mechanism)
  estimator = estimators.noisy_gradient(
      loss_fn, l2_clip=l2_clip, noise_multiplier=noise_multiplier,
      mechanism=mechanism, key=key, neighboring_relation=neighboring_relation,
      normalize_by=normalize_by, microbatch_size=microbatch_size,
      clipping_method=clipping_method, axis_name=axis_name,
      automatic_clipping=automatic_clipping)
  return with_order_check(estimator, steps_per_epoch, check_order, axis_name,
                          num_examples)


def epoch_mechanism(strategy: Optional[np.ndarray], storage: str,
                    steps_per_epoch: int,
                    mechanism: Optional[noise.NoiseMechanism] = None
                    ) -> noise.NoiseMechanism:
  """`dpmemf_mechanism(strategy)` (or `mechanism`), checked to cover epochs.

  Example:
    >>> mech = epoch_mechanism(None, 'buffer', 100,
    ...                        blt.mechanism(blt.optimize(600, 4), 600))

  Args:
    strategy: the lower-triangular C, `[k b, k b]`, or None with
      `mechanism`.
    storage: 'buffer' or 'regenerate' (for `strategy`).
    steps_per_epoch: b.
    mechanism: a per-step mechanism instead of `strategy`.

  Returns:
    The mechanism.

  Raises:
    ValueError: unless exactly one of `strategy` and `mechanism` is given,
      if the mechanism does not release per-step noise, or if b is not a
      positive integer dividing the number of steps.
  """
  if (strategy is None) == (mechanism is None):
    raise ValueError('give exactly one of strategy= (a matrix) and '
                     'mechanism= (e.g. blt.mechanism(...))')
  if mechanism is None:
    mechanism = dpmemf_mechanism(strategy, storage)
  elif mechanism.release != 'per_step' or mechanism.num_steps is None:
    raise ValueError(f'matrix-factorization noise is added to each step\'s '
                     f'gradient: use a per-step mechanism with a capacity, '
                     f'got {mechanism.name}')
  steps_per_epoch = checks.positive_int(steps_per_epoch, 'steps_per_epoch')
  if mechanism.num_steps % steps_per_epoch:
    raise ValueError(
        f'the strategy covers {mechanism.num_steps} steps, not a whole number '
        f'of epochs of {steps_per_epoch} steps')
  return mechanism


def with_order_check(estimator: optax.GradientTransformationExtraArgs,
                     steps_per_epoch: int, check_order: bool,
                     axis_name: Optional[str], num_examples: Optional[int]
                     ) -> optax.GradientTransformationExtraArgs:
  """Chains `batching.fixed_order_guard` after a fixed-order estimator.

  Example:
    >>> tx = with_order_check(estimator, 100, True, None, 50_000)

  Args:
    estimator: the private estimator (DP-MEMF's, DP-SRG-MEMF's).
    steps_per_epoch: b.
    check_order: False returns the estimator alone.
    axis_name: the device axis, or None.
    num_examples: the training set size (required when `check_order`).

  Returns:
    The estimator, followed by the order check when `check_order`.

  Raises:
    ValueError: if `check_order` and `num_examples` is None.
  """
  if not check_order:
    return estimator
  if num_examples is None:
    raise ValueError(
        'the fixed-order check needs num_examples, the size of the training '
        'set the example ids index (to catch an example repeated within '
        'the first epoch); pass num_examples=..., or check_order=False when '
        'the pipeline is known to repeat its batches')
  return optax.chain(
      estimator,
      batching.fixed_order_guard(steps_per_epoch, num_examples=num_examples,
                                 axis_name=axis_name))
