"""In-step guards: the batches a step sees are the batches accounted for.

Each guard is an optax transformation that sits in the private chain and
refuses (NaN updates, a `guards.Refusal` recorded in its state) a step whose
batch does not follow the participation pattern the accounting claims:

* `fixed_order_guard` (`accounting.FixedOrder`): every example in one batch
  of the first epoch, at most once, and the same batches in the same order in
  every later epoch;
* `shuffled_order_guard` (`accounting.Shuffled`): every example at most once
  per epoch, batches of the accounted size;
* `poisson_batch_guard` (`accounting.PoissonSampling`,
  `accounting.CyclicPoissonSampling`): padded shapes, ids in range, batch
  sizes within `poisson_size_bound`, and the partition of each step;
* `participation_guard` picks the guard of a participation pattern.

The host samplers that produce such batches are in `dpsco_jax.samplers`;
`dpsco_jax.batching` re-exports both modules.
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from scipy import stats

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import parallel


class FixedOrderGuardState(NamedTuple):
  """State of `fixed_order_guard`.

  Attributes:
    step: steps seen so far.
    fingerprints: `[steps_per_epoch, 2]` uint32, an order-invariant hash of
      the example ids of each batch position in the first epoch.
    seen: `[ceil(num_examples / 32)]` uint32, one bit per example: set once
      the example has taken part in a first-epoch batch.
    refusal: the `guards.Refusal` record of the guard's checks: once set,
      every later update is NaN, and `guards.raise_if_refused` reports it.

  The fingerprints and the bitmap are functions of the ids of the training
  examples (which examples were used, and when): not noised, do not publish.
  """

  step: jax.Array
  fingerprints: jax.Array
  seen: jax.Array
  refusal: Optional[guards.Refusal] = None


def _mix(ids: jax.Array, seed: int) -> jax.Array:
  """A 32-bit avalanche hash of each id (the MurmurHash3 finalizer)."""
  x = ids.astype(jnp.uint32) ^ jnp.uint32(seed)
  x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
  x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _ids_and_mask(example_ids: jax.Array, mask: Optional[jax.Array]
                  ) -> tuple[jax.Array, jax.Array]:
  """Flat integer ids and a flat bool mask of the same size, or a ValueError."""
  example_ids = jnp.ravel(jnp.asarray(example_ids))
  if not jnp.issubdtype(example_ids.dtype, jnp.integer):
    raise ValueError(f'example_ids must be integers, got {example_ids.dtype}')
  keep = (jnp.ones(example_ids.shape, bool) if mask is None else
          jnp.ravel(jnp.asarray(mask, bool)))
  if keep.shape != example_ids.shape:
    raise ValueError(f'batch_mask has {keep.size} entries for '
                     f'{example_ids.size} example ids')
  return example_ids, keep


def batch_fingerprint(example_ids: jax.Array,
                      mask: Optional[jax.Array] = None,
                      axis_name: Optional[str] = None) -> jax.Array:
  """An order-invariant 64-bit fingerprint of a batch's set of example ids.

  Two independent 32-bit hashes of every id, summed (mod 2^32) over the ids
  the mask keeps and over devices: equal sets give equal fingerprints in any
  order or device layout, different sets almost never do.

  Args:
    example_ids: integer ids of the batch's examples (this device's shard).
    mask: optional bool mask, False on padding.
    axis_name: the device axis, or None.

  Returns:
    `[2]` uint32.
  """
  example_ids, keep = _ids_and_mask(example_ids, mask)
  hashes = jnp.stack([_mix(example_ids, 0x9E3779B9),
                      _mix(example_ids, 0x7F4A7C15)], axis=-1)
  local = jnp.sum(jnp.where(keep[:, None], hashes, jnp.uint32(0)), axis=0,
                  dtype=jnp.uint32)
  return parallel.psum(local, axis_name)


class _IdChecks(NamedTuple):
  """What `_check_ids` found in one (global) batch."""

  out_of_range: jax.Array  # a kept id outside [0, num_examples)
  repeated: jax.Array      # a kept id twice in the batch
  seen_before: jax.Array   # a kept id already set in the bitmap
  seen: jax.Array          # the bitmap with the batch's ids set


def _check_ids(ids: jax.Array, keep: jax.Array, seen: jax.Array,
               num_examples: int) -> _IdChecks:
  """Range, within-batch repeats and the seen-bitmap for one batch's ids."""
  # Sorted by id, then by the mask (padding first among equal ids): the kept
  # copies of an id are neighbours, whatever padding shares their value.
  ids, keep_sorted = jax.lax.sort((ids, keep.astype(jnp.int32)), num_keys=2)
  keep = keep_sorted.astype(bool)
  in_range = ids >= 0
  if num_examples <= jnp.iinfo(ids.dtype).max:
    in_range &= ids < num_examples
  same_as_previous = jnp.concatenate([
      jnp.zeros((1,), bool),
      (ids[1:] == ids[:-1]) & keep[1:] & keep[:-1]])
  # Each kept, in-range id once: setting its bit by an addition is then an
  # exact OR (no carries), also when the batch itself is refused.
  valid = keep & in_range & ~same_as_previous
  safe = jnp.where(valid, ids, 0)
  word = (safe >> 5).astype(jnp.int32)
  bit = jnp.left_shift(jnp.uint32(1), (safe & 31).astype(jnp.uint32))
  already = valid & ((seen[word] & bit) != 0)
  seen = seen.at[word].add(jnp.where(valid & ~already, bit, jnp.uint32(0)))
  return _IdChecks(out_of_range=jnp.any(keep & ~in_range),
                   repeated=jnp.any(same_as_previous),
                   seen_before=jnp.any(already), seen=seen)


def _fixed_order_messages(where: str, num_examples: int,
                          steps_per_epoch: int) -> tuple[str, ...]:
  """The refusals of `fixed_order_guard`: an id out of range, an id twice,
  an example seen earlier in the first epoch, a batch that changed."""
  return (
      f'the batch at {where} holds an example id outside [0, '
      f'{num_examples}): ids must index the training set of num_examples '
      f'= {num_examples} examples.',
      f'the batch at {where} holds the same example id twice: the example '
      'would count twice in one clipped sum, which FixedOrder accounting '
      'does not assume (mask padding out with batch_mask).',
      f'the batch at {where} holds an example that an earlier batch of '
      'the first epoch already held: FixedOrder accounting assumes every '
      'example in one batch per epoch, at the same position every epoch. '
      'Use batching.FixedOrderBatches.',
      f'the batch at {where} is not the batch at the same position of the '
      f'first epoch (position = step mod {steps_per_epoch}): FixedOrder '
      'accounting assumes the same batches in the same order every epoch, '
      'and a pipeline that reshuffles between epochs invalidates it. Use '
      'batching.FixedOrderBatches, or account for the run as Shuffled.')


def fixed_order_guard(
    steps_per_epoch: int,
    *,
    num_examples: int,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Refuses batches that break the `FixedOrder(k, b)` participation.

  `FixedOrder(k, b)` accounting (DP-MF, DP-MEMF: paper 001 Algorithms 2-3,
  notes pitfall 15) assumes that the example in batch j takes part exactly
  at steps `j, b + j, ..., (k-1) b + j`, and at no other step. The guard
  refuses (`dpsco_jax.guards.record`: ValueError when eager; under jit
  NaN-poisoned updates and the refusal recorded in the guard's state,
  raised by `guards.raise_if_refused`) a step whose batch

  * holds an id outside `[0, num_examples)`;
  * holds the same id twice (the example would count twice in one sum);
  * in the first epoch, holds an id that an earlier batch of the first
    epoch already held (kept in a bitmap of `num_examples` bits): the
    example would take part at two positions of every epoch;
  * in a later epoch, is not the set of ids at the same position of the
    first epoch (a pipeline that reshuffles between epochs: an example can
    then meet strategy columns whose cross terms the sensitivity never
    counted). Batches are compared by fingerprint; the order of examples
    within a batch does not matter.

  Ids where `batch_mask` is False (padding) are ignored by every check, so
  padding may repeat any id. With `axis_name`, the ids of all devices are
  gathered, so a repeat across two devices is caught too.

  Place it after the private estimator in the chain, so it guards the
  updates that estimator produced.

  Example:
    >>> tx = optax.chain(
    ...     noisy_gradient(loss_fn, ..., mechanism=noise.matrix_factorization(c)),
    ...     fixed_order_guard(steps_per_epoch=100, num_examples=50_000),
    ...     optax.sgd(0.1, momentum=0.9))
    >>> for indices in FixedOrderBatches(50_000, 500, num_epochs=6):
    ...   updates, state = tx.update(None, state, params,
    ...                              batch=data[indices],
    ...                              example_ids=indices)

  Args:
    steps_per_epoch: b, the batches per epoch.
    num_examples: the size of the training set the ids index (ids are in
      `[0, num_examples)`). Required: the first-epoch bitmap needs it, and
      without it a repeated example would go unnoticed. The state holds
      `ceil(num_examples / 32)` uint32 words.
    axis_name: the device axis when each device holds a shard of the batch
      (and of its ids).

  Returns:
    An `optax.GradientTransformationExtraArgs`: `update(updates, state,
    params=None, *, example_ids, batch_mask=None)`.

  Raises:
    ValueError: for a non-positive `steps_per_epoch` or `num_examples`; at
      update time, see above.
  """
  steps_per_epoch = checks.positive_int(steps_per_epoch, 'steps_per_epoch')
  num_examples = checks.positive_int(num_examples, 'num_examples')
  words = -(-num_examples // 32)

  def init_fn(params):
    del params
    return FixedOrderGuardState(
        step=jnp.zeros((), jnp.int32),
        fingerprints=jnp.zeros((steps_per_epoch, 2), jnp.uint32),
        seen=jnp.zeros((words,), jnp.uint32), refusal=guards.no_refusal())

  def update_fn(updates, state, params=None, *, example_ids=None,
                batch_mask=None, **extra_args):
    del params, extra_args
    checks.state_type(state, FixedOrderGuardState, 'fixed_order_guard')
    if updates is None:
      raise ValueError('fixed_order_guard guards the updates of a private '
                       'estimator: place it after the estimator in the chain')
    if example_ids is None:
      raise ValueError(
          'the fixed-order check needs the ids of the batch examples: '
          'update(..., example_ids=indices) (e.g. the indices yielded by '
          'batching.FixedOrderBatches); its accounting assumes the same '
          'batches in the same order every epoch')
    ids, keep = _ids_and_mask(example_ids, batch_mask)
    fingerprint = batch_fingerprint(ids, keep, axis_name)
    # The whole batch, on every device: repeats across devices count.
    found = _check_ids(parallel.gather(ids, axis_name),
                       parallel.gather(keep, axis_name), state.seen,
                       num_examples)
    position = state.step % steps_per_epoch
    first_epoch = state.step < steps_per_epoch
    stored = state.fingerprints[position]
    changed = jnp.logical_and(~first_epoch, jnp.any(fingerprint != stored))
    seen_before = jnp.logical_and(first_epoch, found.seen_before)
    fingerprints = jnp.where(
        first_epoch, state.fingerprints.at[position].set(fingerprint),
        state.fingerprints)
    seen = jnp.where(first_epoch, found.seen, state.seen)
    where = 'a step'
    if not isinstance(changed, jax.core.Tracer):
      where = f'step {int(state.step)}'
    messages = _fixed_order_messages(where, num_examples, steps_per_epoch)
    updates, refusal = guards.record(
        list(zip((found.out_of_range, found.repeated, seen_before, changed),
                 messages)), updates, _record_of(state), state.step,
        kind='batch')
    return updates, FixedOrderGuardState(
        step=state.step + 1, fingerprints=fingerprints, seen=seen,
        refusal=refusal)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class EpochGuardState(NamedTuple):
  """State of `shuffled_order_guard`.

  Attributes:
    step: steps seen so far.
    seen: `[ceil(num_examples / 32)]` uint32, one bit per example that has
      taken part in the current epoch (cleared at each epoch's first step).
    refusal: the `guards.Refusal` record of the guard's checks: once set,
      every later update is NaN, and `guards.raise_if_refused` reports it.

  The bitmap is a function of which training examples were used: not
  noised, do not publish.
  """

  step: jax.Array
  seen: jax.Array
  refusal: Optional[guards.Refusal] = None


class PoissonGuardState(NamedTuple):
  """State of `poisson_batch_guard`.

  Attributes:
    step: steps seen so far.
    refusal: the `guards.Refusal` record of the guard's checks: once set,
      every later update is NaN, and `guards.raise_if_refused` reports it.
  """

  step: jax.Array
  refusal: Optional[guards.Refusal] = None


def _record_of(state) -> guards.Refusal:
  """A guard state's record (a clear one for a state made without it)."""
  return state.refusal if state.refusal is not None else guards.no_refusal()


def _require_updates_and_ids(updates, example_ids, guard: str,
                             accounted: str) -> None:
  if updates is None:
    raise ValueError(f'{guard} guards the updates of a private estimator: '
                     'place it after the estimator in the chain')
  if example_ids is None:
    raise ValueError(
        f'{guard} needs the ids of the batch examples: update(..., '
        f'example_ids=indices) (the indices the run\'s sampler yielded); '
        f'the run is accounted as {accounted}')


def _gathered_ids(example_ids, batch_mask, axis_name):
  """The batch's ids and mask over every device (repeats across devices
  count)."""
  ids, keep = _ids_and_mask(example_ids, batch_mask)
  return parallel.gather(ids, axis_name), parallel.gather(keep, axis_name)


def _id_refusals(found: '_IdChecks', where: str, num_examples: int,
                 repeated_because: str) -> list[tuple[jax.Array, str]]:
  """The refusals every batch guard makes: ids out of range, ids repeated."""
  return [
      (found.out_of_range, f'the batch at {where} holds an example id '
       f'outside [0, {num_examples}).'),
      (found.repeated, f'the batch at {where} holds the same example id '
       f'twice{repeated_because}.'),
  ]


def _where(step: jax.Array) -> str:
  return ('a step' if isinstance(step, jax.core.Tracer) else
          f'step {int(step)}')


def shuffled_order_guard(
    steps_per_epoch: int,
    *,
    num_examples: int,
    batch_size: int,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Refuses batches that break the `Shuffled(k, b)` participation.

  `Shuffled(k, b)` accounting assumes every example in at most one batch of
  each epoch of b steps, at any position, and batches of the accounted
  size. The guard refuses (`dpsco_jax.guards`) a step whose batch holds an
  id outside `[0, num_examples)`, an id twice, an id an earlier batch of the
  same epoch held, or a number of examples other than `batch_size` (the
  padded ids `batch_mask` drops are not counted). With `axis_name` the ids
  of all devices are checked together.

  Example:
    >>> tx = optax.chain(
    ...     dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=T),
    ...     shuffled_order_guard(100, num_examples=50_000, batch_size=500),
    ...     optax.sgd(0.1))

  Args:
    steps_per_epoch: b.
    num_examples: the training set size the ids index.
    batch_size: examples per batch, as accounted.
    axis_name: the device axis when each device holds a shard of the batch.

  Returns:
    An `optax.GradientTransformationExtraArgs`: `update(updates, state,
    params=None, *, example_ids, batch_mask=None)`.
  """
  steps_per_epoch = checks.positive_int(steps_per_epoch, 'steps_per_epoch')
  num_examples = checks.positive_int(num_examples, 'num_examples')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  words = -(-num_examples // 32)

  def init_fn(params):
    del params
    return EpochGuardState(step=jnp.zeros((), jnp.int32),
                           seen=jnp.zeros((words,), jnp.uint32),
                           refusal=guards.no_refusal())

  def update_fn(updates, state, params=None, *, example_ids=None,
                batch_mask=None, **extra_args):
    del params, extra_args
    checks.state_type(state, EpochGuardState, 'shuffled_order_guard')
    _require_updates_and_ids(updates, example_ids, 'shuffled_order_guard',
                             'Shuffled (each example once per epoch)')
    ids, keep = _gathered_ids(example_ids, batch_mask, axis_name)
    epoch_start = state.step % steps_per_epoch == 0
    found = _check_ids(ids, keep, jnp.where(epoch_start, 0, state.seen),
                       num_examples)
    size = jnp.sum(keep)
    where = _where(state.step)
    updates, refusal = guards.record(_id_refusals(
        found, where, num_examples,
        ' (mask padding out with batch_mask)') + [
        (found.seen_before,
         f'the batch at {where} holds an example that an earlier batch of '
         'the same epoch held: Shuffled accounting assumes each example at '
         'most once per epoch. Use batching.ShuffledBatches.'),
        (size != batch_size,
         f'the batch at {where} has a number of examples other than the '
         f'{batch_size} the run is accounted for.'),
    ], updates, _record_of(state), state.step, kind='batch')
    return updates, EpochGuardState(step=state.step + 1, seen=found.seen,
                                    refusal=refusal)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def poisson_size_bound(num_examples: int, sampling_probability: float,
                       false_refusal: float = 1e-12) -> int:
  """The largest Poisson batch `poisson_batch_guard` accepts.

  The smallest m with `P(Binomial(n, q) > m) <= false_refusal`: a run
  that really samples with probability q is refused with probability at
  most `false_refusal` per step (and a refusal only stops the run; it never
  weakens privacy).

  Example:
    >>> poisson_size_bound(60_000, 0.01)   # about 600 + 7.1 * 24

  Args:
    num_examples: n.
    sampling_probability: q.
    false_refusal: the per-step probability of refusing a true Poisson batch.

  Returns:
    m, an int.
  """
  return int(stats.binom.isf(false_refusal, num_examples,
                             sampling_probability))


def poisson_batch_guard(
    *,
    num_examples: int,
    sampling_probability: float,
    pad_to_multiple: int,
    axis_name: Optional[str] = None,
    num_partitions: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """Refuses batches that a `PoissonBatches` sampler could not have made.

  Poisson accounting (`PoissonSampling(q, T)`) assumes each example in
  each batch independently with probability q, the noisy sum divided by the
  expected size `q n`. A fixed-size batch of 1,000 from 2,000 examples at
  q = 0.05 is not such a batch, and its epsilon is not the one accounted.
  The guard refuses a step

  * without `batch_mask` (Poisson batches are padded and masked), or whose
    padded size is not a multiple of `pad_to_multiple` (checked when the
    step is traced: the shape is static);
  * whose number of real examples exceeds `poisson_size_bound(n, q)` (a
    true Poisson batch does so with probability below 1e-12 per step);
  * holding an id outside `[0, num_examples)` or a real id twice;
  * with `num_partitions` (b, cyclic Poisson sampling,
    `CyclicPoissonBatches`): holding an example of another partition than
    `step mod b` (example i is in partition `i mod b`); the size bound is
    then that of one partition.

  It cannot tell a Poisson batch from another random batch of a plausible
  size: use `batching.PoissonBatches` (or a plan) to form them.

  Example:
    >>> batches = PoissonBatches(50_000, 0.01, num_steps=1000, seed=1)
    >>> guard = poisson_batch_guard(
    ...     num_examples=50_000, sampling_probability=0.01,
    ...     pad_to_multiple=batches.pad_to_multiple)

  Args:
    num_examples: n.
    sampling_probability: q.
    pad_to_multiple: the sampler's `pad_to_multiple`.
    axis_name: the device axis when each device holds a shard of the batch.
    num_partitions: b for cyclic Poisson sampling (None: plain Poisson).

  Returns:
    An `optax.GradientTransformationExtraArgs`: `update(updates, state,
    params=None, *, example_ids, batch_mask)`.
  """
  num_examples = checks.positive_int(num_examples, 'num_examples')
  pad_to_multiple = checks.positive_int(pad_to_multiple, 'pad_to_multiple')
  if not 0.0 < float(sampling_probability) <= 1.0:
    raise ValueError('sampling_probability must be in (0, 1], got '
                     f'{sampling_probability!r}')
  population = num_examples
  if num_partitions is not None:
    num_partitions = checks.positive_int(num_partitions, 'num_partitions')
    population = -(-num_examples // num_partitions)
  largest = poisson_size_bound(population, float(sampling_probability))

  def init_fn(params):
    del params
    return PoissonGuardState(step=jnp.zeros((), jnp.int32),
                             refusal=guards.no_refusal())

  def update_fn(updates, state, params=None, *, example_ids=None,
                batch_mask=None, **extra_args):
    del params, extra_args
    checks.state_type(state, PoissonGuardState, 'poisson_batch_guard')
    _require_updates_and_ids(updates, example_ids, 'poisson_batch_guard',
                             f'Poisson sampling at q = {sampling_probability}')
    if batch_mask is None:
      raise ValueError(
          'a Poisson-sampled run needs batch_mask: its batches are padded to '
          'a multiple of a fixed size and masked (batching.PoissonBatches '
          'yields (indices, mask)); a batch without a mask is not a Poisson '
          'batch')
    ids, keep = _gathered_ids(example_ids, batch_mask, axis_name)
    if ids.shape[0] % pad_to_multiple:
      raise ValueError(
          f'the batch is padded to {ids.shape[0]} entries, not a multiple of '
          f'{pad_to_multiple} (the sampler\'s pad_to_multiple): it was not '
          'formed by the Poisson sampler the run is accounted for')
    found = _check_ids(ids, keep, jnp.zeros((-(-num_examples // 32),),
                                            jnp.uint32), num_examples)
    where = _where(state.step)
    refusals = _id_refusals(
        found, where, num_examples,
        ': Poisson sampling includes an example at most once') + [
        (jnp.sum(keep) > largest,
         f'the batch at {where} holds more than {largest} examples, which a '
         f'Poisson batch at q = {sampling_probability} of {population} '
         'examples practically never does: it was not formed by Poisson '
         'sampling, and its epsilon is not the one accounted.'),
    ]
    if num_partitions is not None:
      partition = state.step % num_partitions
      refusals.append((
          jnp.any(keep & (ids % num_partitions != partition)),
          f'the batch at {where} holds an example of another partition than '
          f'step mod {num_partitions}: cyclic Poisson accounting assumes '
          'example i only in the steps t with t = i (mod b), at least b '
          'apart. Use batching.CyclicPoissonBatches.'))
    updates, refusal = guards.record(refusals, updates, _record_of(state),
                                     state.step, kind='batch')
    return updates, PoissonGuardState(step=state.step + 1, refusal=refusal)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def participation_guard(
    participation: accounting.Participation,
    *,
    num_examples: int,
    batch_size: Optional[int] = None,
    pad_to_multiple: Optional[int] = None,
    axis_name: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """The in-step check of the batches an accounting assumes.

  `FixedOrder` -> `fixed_order_guard`; `Shuffled` -> `shuffled_order_guard`
  (needs `batch_size`); `PoissonSampling` and `CyclicPoissonSampling` ->
  `poisson_batch_guard` (needs `pad_to_multiple`).

  Example:
    >>> guard = participation_guard(sampler.participation, num_examples=n,
    ...                             batch_size=sampler.batch_size)

  Args:
    participation: the accounted participation pattern.
    num_examples: the training set size.
    batch_size: examples per batch (fixed-size patterns).
    pad_to_multiple: the Poisson sampler's padding multiple.
    axis_name: the device axis, or None.

  Returns:
    The guard transformation; chain it right after the private estimator.

  Raises:
    ValueError: if a needed argument is missing or the pattern is unknown.
  """
  if isinstance(participation, accounting.FixedOrder):
    return fixed_order_guard(participation.steps_per_epoch,
                             num_examples=num_examples, axis_name=axis_name)
  if isinstance(participation, accounting.Shuffled):
    if batch_size is None:
      raise ValueError('the Shuffled guard needs batch_size')
    return shuffled_order_guard(participation.steps_per_epoch,
                                num_examples=num_examples,
                                batch_size=batch_size, axis_name=axis_name)
  if isinstance(participation, (accounting.PoissonSampling,
                                accounting.CyclicPoissonSampling)):
    if pad_to_multiple is None:
      raise ValueError('the Poisson guard needs pad_to_multiple')
    return poisson_batch_guard(
        num_examples=num_examples,
        sampling_probability=participation.sampling_probability,
        pad_to_multiple=pad_to_multiple, axis_name=axis_name,
        num_partitions=getattr(participation, 'num_partitions', None))
  raise ValueError(f'unknown participation pattern {participation!r}')
