"""Physical batches: a logical batch run as fixed-size pieces, noised once.

A logical batch (a Poisson batch of random size, or a batch larger than
device memory) need not be evaluated in one call. Its real examples are cut
into physical batches whose sizes come from a short fixed list, so each
size is compiled once; the clipped statistic of each (`clipping.ClippedSum`:
the clipped SUM and its counters) is added up on the device; then ONE
finishing program adds the noise, runs the batch checks the accounting
relies on and the optimizer, exactly as the one-call step does.

    plan = plans.dpsgd(loss_fn, optimizer=optax.sgd(0.1), ...,
                       physical_batch_size=256)
    for inputs in plan.batches_of(data):
      params, opt_state = plan.step(params, opt_state, inputs)

Why it is the same release. The clipped sum is a sum over examples, so the
sum of the physical batches' clipped sums is the logical batch's clipped
sum (up to float summation order); the sensitivity does not depend on how
the sum is split; the noise is drawn once, from the same state, by the same
transformation, and divided by the same public batch size. The accounting
is that of the logical batch, unchanged.

Why it costs the realized batch. The host knows how many real examples a
logical batch holds (the sampler's mask), so no shape is padded beyond
need: `physical_sizes` gives the full physical batches of size P, then the
remainder rounded up to the granularity g (the statistic's
`microbatch_size` when set) and cut into power-of-two multiples of g,
largest first. At most `g - 1` padded examples are evaluated per logical
step (at most one microbatch), with at most `1 + ceil(log2(P / g))`
compiled shapes and as many remainder calls. There is no device-side loop
or conditional: each physical call is one straight program, so on a GPU
the host never waits for the device between them. (jax_privacy's
`split_and_pad_global_batch` pads the last minibatch to the full size and
skips its padding microbatches with a device-side loop; Opacus'
`BatchMemoryManager` runs a last batch of any size, each size a new
shape.)

Why the checks hold. The batch checks of the plan (`batching.
participation_guard`: ids in range, no repeats, the Poisson size bound)
run in the finishing program on the WHOLE logical batch's `example_ids`
and `batch_mask`, as the sampler yielded them, exactly as in the one-call
step. The physical batches are bound to those ids: each physical call adds
the order-invariant fingerprint (`batching.batch_fingerprint`) of its
real ids and counts its real examples, and the finishing program refuses
(`guards.record_in`: the released sum poisoned, the refusal recorded in
the state) when the fingerprint or the
count differs from the logical batch's. So an example repeated across two
physical batches, or physical batches that are not the logical batch, are
refused like a repeated example in one call.

On several devices. A form with `axis_name` (a plan built with
`axis_name=` and `physical_batch_size=`) runs its programs under
`jax.shard_map` over a mesh with that axis: each device evaluates its
shard of every physical batch and keeps its own running sum (no
cross-device sum per physical batch); the finishing program sums the
devices' statistics once and draws the noise once from the replicated
key, as the one-call sharded step does. The logical batch's ids and mask
are split over the axis like its examples, so the batch checks gather
them, and the fingerprint and count are summed over the devices before
the comparison.
"""

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax import adaptive_clipping
from dpsco_jax import batching
from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import guards
from dpsco_jax import noise as noise_lib
from dpsco_jax import parallel

PyTree = Any

# Without a microbatch size, the remainder is rounded up to P / 16: at most
# 1/16 of a physical batch is wasted per logical step, with at most five
# compiled shapes (P, P/2, P/4, P/8, P/16).
DEFAULT_GRANULARITY_FRACTION = 16


def physical_sizes(num_real: int, physical_batch_size: int,
                   granularity: int = 1) -> tuple[int, ...]:
  """The sizes of the physical batches that hold `num_real` examples.

  Full batches of `physical_batch_size` (P) first; the remainder `r < P`
  is rounded up to a multiple of the granularity g and cut into
  power-of-two multiples of g, largest first; when the rounded remainder
  reaches P it is one more batch of P. Every size is P or `g * 2^j < P`,
  so a run compiles at most `1 + ceil(log2(P / g))` shapes, and the
  padding is at most `g - 1` examples.

  Example:
    >>> physical_sizes(45, 16, 2)      # 16 + 16 + 13 real, padded to 14
    (16, 16, 8, 4, 2)
    >>> physical_sizes(0, 16, 2)       # an empty logical batch
    ()

  Args:
    num_real: the logical batch's real (unmasked) examples, >= 0.
    physical_batch_size: P, the largest batch evaluated at once.
    granularity: g, dividing P (the statistic's `microbatch_size`, so no
      microbatch is split).

  Returns:
    The sizes, a tuple of ints summing to at least `num_real`.

  Raises:
    ValueError: for a negative `num_real`, a non-positive size, or a
      granularity that does not divide P.
  """
  physical_batch_size, granularity = _checked_sizes(physical_batch_size,
                                                    granularity)
  if isinstance(num_real, bool) or int(num_real) != num_real or num_real < 0:
    raise ValueError(f'num_real must be a non-negative integer, got '
                     f'{num_real!r}')
  full, remainder = divmod(int(num_real), physical_batch_size)
  units = -(-remainder // granularity)
  if units * granularity >= physical_batch_size:
    return (physical_batch_size,) * (full + 1)
  pieces = [granularity << bit for bit in reversed(range(units.bit_length()))
            if units >> bit & 1]
  return (physical_batch_size,) * full + tuple(pieces)


def _checked_sizes(physical_batch_size: int, granularity: int
                   ) -> tuple[int, int]:
  physical_batch_size = checks.positive_int(physical_batch_size,
                                            'physical_batch_size')
  granularity = checks.positive_int(granularity, 'granularity')
  if physical_batch_size % granularity:
    raise ValueError(
        f'physical_batch_size {physical_batch_size} is not a multiple of '
        f'the granularity {granularity} (the microbatch size): a physical '
        'batch would end inside a microbatch; pick a multiple')
  return physical_batch_size, granularity


def default_granularity(physical_batch_size: int,
                        microbatch_size: Optional[int]) -> int:
  """The remainder's granularity: the microbatch size, else P / 16.

  Example:
    >>> default_granularity(256, None), default_granularity(256, 32)
    (16, 32)

  Args:
    physical_batch_size: P.
    microbatch_size: the statistic's microbatch size, or None.

  Returns:
    `microbatch_size` when set (at most one microbatch of padding is
    evaluated), else the largest divisor of P at most
    `P / DEFAULT_GRANULARITY_FRACTION` (at least 1).
  """
  physical_batch_size = checks.positive_int(physical_batch_size,
                                            'physical_batch_size')
  if microbatch_size is not None:
    return checks.positive_int(microbatch_size, 'microbatch_size')
  target = max(1, physical_batch_size // DEFAULT_GRANULARITY_FRACTION)
  return max(g for g in range(1, target + 1) if physical_batch_size % g == 0)


class PhysicalBatch(NamedTuple):
  """One physical batch: a fixed-size slice of a logical batch's examples.

  Attributes:
    batch: the examples (leading axis: one of `physical_sizes`).
    batch_mask: bool, False on the padding at the end of the last pieces.
    example_ids: the examples' ids (padding repeats an id, masked out), or
      None when the logical batch came without ids.
  """

  batch: PyTree
  batch_mask: np.ndarray
  example_ids: Optional[np.ndarray]


class LogicalBatch(NamedTuple):
  """A logical batch cut into physical batches.

  Attributes:
    physical: the physical batches, in order.
    inputs: the logical step's other inputs, unchanged (`example_ids` and
      `batch_mask` as the sampler yielded them, for the batch checks).
    template: one example of the batch (leading axis 1), for the shapes of
      an empty logical batch's zero statistic.
  """

  physical: tuple[PhysicalBatch, ...]
  inputs: dict[str, Any]
  template: PyTree


def split_logical_batch(batch_inputs: Mapping[str, Any],
                        physical_batch_size: int,
                        granularity: int = 1) -> LogicalBatch:
  """Cuts one logical step's inputs into physical batches (on the host).

  The real examples (where `batch_mask` is True; all of them without a
  mask) are taken in order and cut by `physical_sizes`; the padding of
  the last pieces repeats the logical batch's first example, masked out.

  Example:
    >>> inputs = next(plan.batches_of(data))
    >>> logical = split_logical_batch(inputs, physical_batch_size=64,
    ...                               granularity=8)
    >>> [len(p.batch_mask) for p in logical.physical]   # e.g. [64, 8]

  Args:
    batch_inputs: one item of `Plan.batches_of` (`batch`, and
      `batch_mask`, `example_ids` when the sampler gives them).
    physical_batch_size: P.
    granularity: g (see `physical_sizes`).

  Returns:
    A `LogicalBatch`.

  Raises:
    ValueError: if `batch` is missing, or the mask does not match it.
  """
  if 'batch' not in batch_inputs:
    raise ValueError('the logical step needs its batch: an item of '
                     'plan.batches_of(data)')
  batch = batch_inputs['batch']
  size = clipping.batch_size_of(batch)
  mask = batch_inputs.get('batch_mask')
  if mask is None:
    rows = np.arange(size)
  else:
    mask = np.asarray(mask, bool)
    if mask.shape != (size,):
      raise ValueError(f'batch_mask has shape {mask.shape}; the batch has '
                       f'{size} examples')
    rows = np.flatnonzero(mask)
  ids = batch_inputs.get('example_ids')
  ids = None if ids is None else np.asarray(ids)
  pieces, start = [], 0
  for piece in physical_sizes(len(rows), physical_batch_size, granularity):
    real = rows[start:start + piece]
    start += len(real)
    # Padding repeats row 0 (finite data the sampler chose), masked out.
    take = np.concatenate([real, np.zeros(piece - len(real), real.dtype)])
    pieces.append(PhysicalBatch(
        batch=jax.tree_util.tree_map(lambda x, take=take: x[take], batch),
        batch_mask=np.arange(piece) < len(real),
        example_ids=None if ids is None else ids[take]))
  inputs = {k: v for k, v in batch_inputs.items() if k != 'batch'}
  template = jax.tree_util.tree_map(lambda x: x[:1], batch)
  return LogicalBatch(physical=tuple(pieces), inputs=inputs,
                      template=template)


class Accumulation(NamedTuple):
  """The clipped statistic of the physical batches run so far.

  Not private: it is the clipped sum BEFORE noise and the fingerprint of
  which examples took part. Keep it on the device; only the finishing
  program's noisy output may be released.

  Attributes:
    clipped: the running `clipping.ClippedSum` (sum and counters).
    fingerprint: `[2]` uint32, the running `batching.batch_fingerprint` of
      the real example ids (zero when the batches came without ids).
  """

  clipped: clipping.ClippedSum
  fingerprint: jax.Array


@dataclasses.dataclass(frozen=True)
class PhysicalForm:
  """How a private transformation's statistic is evaluated batch by batch.

  The transformation (first in the chain) must accept the accumulated sum
  in place of a batch: `update(None, state, params, clipped_sum=...,
  **inputs)` (`estimators.noisy_statistic` does).

  Attributes:
    statistic: the clipped statistic the transformation privatizes.
    arguments: `(opt_state, params) -> args`, the statistic's arguments
      after the batch, as the transformation's `update` would pass them
      (`opt_state` is the whole chain's state).
    physical_batch_size: P, the examples of one physical batch over all
      devices (with `axis_name`, each device holds P / n of them).
    granularity: g (default: `default_granularity(P, microbatch_size)`;
      with `axis_name`, `LogicalStep` rounds it up to whole microbatches on
      every device: `sharded_granularity`).
    axis_name: the transformation's device axis, or None. With it,
      `LogicalStep` runs its programs under `jax.shard_map` over a mesh
      with this axis: each device evaluates its shard of every physical
      batch and the transformation's update sums the devices' statistics
      once, in the finishing program.
  """

  statistic: clipping.ClippedStatistic
  arguments: Callable[[PyTree, PyTree], tuple[Any, ...]]
  physical_batch_size: int
  granularity: Optional[int] = None
  axis_name: Optional[str] = None

  def __post_init__(self):
    granularity = self.granularity
    if granularity is None:
      granularity = default_granularity(self.physical_batch_size,
                                        self.statistic.microbatch_size)
    object.__setattr__(self, 'granularity', granularity)
    _checked_sizes(self.physical_batch_size, granularity)


def statistic_form(statistic: clipping.ClippedStatistic,
                   physical_batch_size: int, *,
                   granularity: Optional[int] = None,
                   axis_name: Optional[str] = None) -> PhysicalForm:
  """The physical form of `estimators.noisy_statistic`.

  That is the estimator of DP-SGD, DP-FTRL and DP-MF (`noisy_gradient`,
  per-example gradients) and of user-level DP-SGD
  (`clipping.clipped_user_grad_sum`). Its statistic takes `(batch,
  params)`; nothing comes from the state.

  Example:
    >>> stat = clipping.clipped_grad_sum(loss_fn, 1.0)
    >>> form = statistic_form(stat, physical_batch_size=256)

  Args:
    statistic: the statistic the transformation was built with (e.g.
      `clipping.clipped_grad_sum(loss_fn, l2_clip, microbatch_size=...,
      method=...)` for `noisy_gradient`).
    physical_batch_size: P.
    granularity: g (default: see `default_granularity`).
    axis_name: the transformation's device axis, or None (see
      `PhysicalForm`).

  Returns:
    A `PhysicalForm`.
  """
  return PhysicalForm(
      statistic=statistic,
      arguments=lambda opt_state, params: (params,),
      physical_batch_size=physical_batch_size, granularity=granularity,
      axis_name=axis_name)


def client_form(form: PhysicalForm, axis_name: Optional[str]
                ) -> PhysicalForm:
  """A full-batch form of one client (DIFF2, DP-GD), refused on a client axis.

  A client's round is a sum over ITS examples, weighted by its size n_p
  (`algorithms.diff2`); on a client axis each client's data is its own
  logical batch. `LogicalStep` splits ONE logical batch over the devices,
  which would move examples between clients and change their sizes, so
  the form is refused there.

  Example:
    >>> form = client_form(diff2.diff2_physical_form(loss_fn, ...), None)

  Args:
    form: the estimator's physical form.
    axis_name: the client axis the estimator was built with, or None.

  Returns:
    `form`.

  Raises:
    ValueError: with an `axis_name`.
  """
  if axis_name is not None:
    raise ValueError(
        f'physical_batch_size= runs one client\'s data; with the client axis '
        f'{axis_name!r} each client\'s data is its own logical batch, '
        'weighted by its own size, and the physical step would split one '
        'logical batch over the devices, moving examples between clients: '
        'run the clients in one call (physical_batch_size=None, '
        'microbatch_size= to cap memory), or one client without axis_name')
  return form


def refuse_unsplittable(physical_batch_size: Optional[int], algorithm: str,
                        why: str) -> None:
  """Refuses `physical_batch_size=` for a statistic that cannot be split.

  Example:
    >>> refuse_unsplittable(None, 'nonsmooth_multi_pass', '...')  # passes

  Args:
    physical_batch_size: what the user asked for (None: nothing to refuse).
    algorithm: the plan's name, for the message.
    why: why its statistic is not a sum that physical batches can add up.

  Raises:
    ValueError: if `physical_batch_size` is not None.
  """
  if physical_batch_size is not None:
    raise ValueError(
        f'{algorithm} cannot run physical batches (physical_batch_size='
        f'{physical_batch_size!r}): {why}. Run each step in one call '
        '(physical_batch_size=None) and cap memory with microbatch_size=')


def sharded_granularity(form: PhysicalForm, num_devices: int) -> int:
  """The granularity of a form's physical batches split over devices.

  Every physical batch is cut into `num_devices` equal shards, each a whole
  number of microbatches: g' = lcm(g, n * m), with g the form's
  granularity, n the devices and m the microbatch size (1 without one).
  At most g' - 1 padded examples, i.e. under one microbatch per device,
  are evaluated per logical step.

  Example:
    >>> form = statistic_form(clipping.clipped_grad_sum(
    ...     loss_fn, 1.0, microbatch_size=2), 32, axis_name='devices')
    >>> sharded_granularity(form, 8)
    16

  Args:
    form: the physical form.
    num_devices: n, the devices along `form.axis_name`.

  Returns:
    g', dividing `form.physical_batch_size`.

  Raises:
    ValueError: if P is not a multiple of g' (name the fix: a multiple of
      n times the microbatch size).
  """
  num_devices = checks.positive_int(num_devices, 'num_devices')
  per_device = num_devices * (form.statistic.microbatch_size or 1)
  granularity = int(np.lcm(form.granularity, per_device))
  if form.physical_batch_size % granularity:
    raise ValueError(
        f'physical_batch_size {form.physical_batch_size} cannot be split '
        f'into {num_devices} devices\' shards of whole microbatches (size '
        f'{form.statistic.microbatch_size or 1}) at granularity '
        f'{form.granularity}: pick a multiple of {granularity}')
  return granularity


def _step_of(opt_state: PyTree) -> jax.Array:
  """The step counter of the state's noise mechanism (steps taken so far)."""
  for leaf in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, noise_lib.NoiseState)):
    if isinstance(leaf, noise_lib.NoiseState):
      return leaf.step
  return jnp.zeros((), jnp.int32)


def _plus(total: PyTree, part: PyTree) -> PyTree:
  return jax.tree_util.tree_map(jnp.add, total, part)


# The logical step's inputs split over a device axis like the batch (the
# batch checks gather them); any other input is replicated.
_SPLIT_INPUTS = ('example_ids', 'batch_mask')


class _Placed:
  """A compiled program whose arguments are first put on a mesh."""

  def __init__(self, program, place):
    self.program, self.place = program, place

  def __call__(self, *args):
    return self.program(*self.place(*args))

  def lower(self, *args):
    return self.program.lower(*self.place(*args))


class LogicalStep:
  """A transformation's step run over physical batches, noised once.

  Three compiled programs: `start` (the zero accumulation), `accumulate`
  (one per physical size, adds a physical batch's clipped statistic;
  the accumulation's buffers are donated and reused) and `finish` (checks
  the physical batches against the logical batch's ids, then runs the
  transformation's update with the accumulated sum and applies it). The
  host dispatches them without waiting for the device.

  Sharded (a form with `axis_name`): the three programs run under
  `jax.shard_map` over `mesh`. Each physical batch and the logical batch's
  `example_ids` / `batch_mask` are split over the axis; each device adds
  its shard's clipped statistic to its own accumulation (no cross-device
  sum per physical batch); `finish` sums the devices' fingerprints and
  counts for the check, and the transformation's update sums the clipped
  statistic over the devices ONCE and draws the noise once from the
  replicated key, as the one-call sharded step does. The batch checks
  gather the ids over the axis, so they see the whole logical batch.
  `params` and `opt_state` are replicated.

  Example:
    >>> tx = optax.chain(dpsco_jax.dpsgd(loss_fn, l2_clip=1.0,
    ...                                  noise_multiplier=1.1, num_steps=T,
    ...                                  normalize_by=256.0),
    ...                  optax.sgd(0.1))
    >>> step = LogicalStep(tx, statistic_form(
    ...     clipping.clipped_grad_sum(loss_fn, 1.0), physical_batch_size=64))
    >>> params, opt_state = step(params, opt_state, {'batch': big_batch})

    Sharded over eight devices (`plan` built with `axis_name='devices'`
    and `physical_batch_size=`; `Plan.step` does this with a mesh of all
    devices):

    >>> mesh = jax.make_mesh((8,), ('devices',))
    >>> step = LogicalStep(plan.transformation, plan.physical_form,
    ...                    mesh=mesh)

  Args:
    transformation: the whole update (private estimator first, then any
      checks and the optimizer), e.g. `Plan.transformation`.
    form: the `PhysicalForm` of its private estimator.
    mesh: with a form's `axis_name`, the mesh to map over (it must have
      that axis; default: all devices on one axis of that name). Ignored
      without one.

  Raises:
    ValueError: if the mesh lacks the form's axis, or the physical batch
      size does not split into whole microbatches per device.
  """

  def __init__(self, transformation: optax.GradientTransformationExtraArgs,
               form: PhysicalForm, *,
               mesh: Optional[jax.sharding.Mesh] = None):
    self.transformation = transformation
    self.form = form
    self.mesh = None
    self.granularity = form.granularity
    self._traced_sizes = set()   # per device, when sharded
    start, accumulate, finish = self._start, self._accumulate, self._finish
    axis = form.axis_name
    if axis is not None:
      if mesh is None:
        mesh = jax.make_mesh((jax.device_count(),), (axis,))
      if axis not in mesh.axis_names:
        raise ValueError(f'the mesh has axes {mesh.axis_names}, not the '
                         f'transformation\'s device axis {axis!r}')
      self.mesh = mesh
      self.granularity = sharded_granularity(form, mesh.shape[axis])
      start, accumulate, finish = self._sharded_programs(mesh, axis)
    self.start = jax.jit(start)
    self.accumulate = jax.jit(accumulate, donate_argnums=0)
    self.finish = jax.jit(finish)
    if self.mesh is not None:
      self.start, self.accumulate, self.finish = self._placed(mesh, axis)

  def _placed(self, mesh, axis) -> tuple['_Placed', '_Placed', '_Placed']:
    """The sharded programs, their arguments put where their specs say
    (host arrays, or arrays committed to one device, are split or
    replicated over the mesh first)."""
    shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def put(tree, sharding):
      return jax.device_put(tree, sharding)

    def inputs_placed(inputs):
      return {k: put(v, shard if k in _SPLIT_INPUTS else whole)
              for k, v in inputs.items()}

    return (
        _Placed(self.start, lambda o, p, t: (put(o, whole), put(p, whole),
                                             put(t, whole))),
        _Placed(self.accumulate, lambda a, o, p, b: (
            put(a, shard), put(o, whole), put(p, whole), put(b, shard))),
        _Placed(self.finish, lambda p, o, a, i: (
            put(p, whole), put(o, whole), put(a, shard), inputs_placed(i))))

  def _sharded_programs(self, mesh, axis):
    """`start`, `accumulate`, `finish` mapped over `axis` of `mesh`.

    The accumulation is per device: a leading axis of one per device,
    split over `axis` (so `[n, ...]` in all), never summed across devices
    before `finish`.
    """
    shard, whole = jax.sharding.PartitionSpec(axis), (
        jax.sharding.PartitionSpec())

    def own(tree):    # this device's accumulation, out of its [1, ...] block
      return jax.tree_util.tree_map(lambda x: x[0], tree)

    def block(tree):  # this device's accumulation as its [1, ...] block
      return jax.tree_util.tree_map(lambda x: x[None], tree)

    def inputs_specs(inputs):
      # The logical batch's ids and mask are split like the batch (the
      # batch checks gather them); anything else is replicated.
      return {k: shard if k in _SPLIT_INPUTS else whole for k in inputs}

    def start(opt_state, params, template):
      return jax.shard_map(
          lambda o, p, t: block(self._start(o, p, t)), mesh=mesh,
          in_specs=(whole, whole, whole), out_specs=shard)(
              opt_state, params, template)

    def accumulate(accumulation, opt_state, params, physical):
      return jax.shard_map(
          lambda a, o, p, b: block(self._accumulate(own(a), o, p, b)),
          mesh=mesh, in_specs=(shard, whole, whole, shard),
          out_specs=shard)(accumulation, opt_state, params, physical)

    def finish(params, opt_state, accumulation, inputs):
      return jax.shard_map(
          lambda p, o, a, i: self._finish(p, o, own(a), i), mesh=mesh,
          in_specs=(whole, whole, shard, inputs_specs(inputs)),
          out_specs=(whole, whole))(params, opt_state, accumulation, inputs)

    return start, accumulate, finish

  def split(self, batch_inputs: Mapping[str, Any]) -> LogicalBatch:
    """`split_logical_batch` with this step's sizes."""
    return split_logical_batch(batch_inputs, self.form.physical_batch_size,
                               self.granularity)

  def _arguments(self, opt_state, params) -> tuple[Any, ...]:
    # Under the axis, the (replicated) arguments are typed as varying, as
    # the transformation's own statistic call does: a gradient with
    # respect to them is then this device's, not summed over the axis.
    return parallel.per_device(self.form.arguments(opt_state, params),
                               self.form.axis_name)

  def _start(self, opt_state, params, template) -> Accumulation:
    args = self._arguments(opt_state, params)
    clip = adaptive_clipping.current_clip(opt_state)
    shapes = jax.eval_shape(
        lambda: self.form.statistic(template, *args, l2_clip=clip))
    return Accumulation(
        clipped=jax.tree_util.tree_map(
            lambda s: jnp.zeros(s.shape, s.dtype), shapes),
        fingerprint=jnp.zeros((2,), jnp.uint32))

  def _accumulate(self, accumulation: Accumulation, opt_state, params,
                  physical: PhysicalBatch) -> Accumulation:
    args = self._arguments(opt_state, params)
    self._traced_sizes.add(np.shape(physical.batch_mask)[0])
    # With adaptive clipping, at the clip the one-call step would use.
    clipped = self.form.statistic(
        physical.batch, *args, mask=physical.batch_mask,
        l2_clip=adaptive_clipping.current_clip(opt_state),
        axis_name=self.form.axis_name)
    fingerprint = accumulation.fingerprint
    if physical.example_ids is not None:
      fingerprint = fingerprint + batching.batch_fingerprint(
          physical.example_ids, physical.batch_mask)
    return Accumulation(clipped=_plus(accumulation.clipped, clipped),
                        fingerprint=fingerprint)

  def _finish(self, params, opt_state, accumulation: Accumulation,
              inputs: dict[str, Any]):
    axis = self.form.axis_name
    clipped = accumulation.clipped
    ids, mask = inputs.get('example_ids'), inputs.get('batch_mask')
    real = (jnp.asarray(mask, bool) if mask is not None else None)
    count = (jnp.sum(real, dtype=jnp.int32) if real is not None else
             None)
    refusals = []
    if count is None and ids is not None:
      count = jnp.asarray(jnp.size(ids), jnp.int32)
    if count is not None:
      # Over all devices: a device's physical shards need not hold its
      # shard of the logical batch, only all of them together all of it.
      refusals.append((
          parallel.psum(clipped.count, axis) != parallel.psum(count, axis),
          'the physical batches hold another number of examples than the '
          'logical batch: they were not cut from it (use '
          'physical.split_logical_batch or Plan.step).'))
    if ids is not None:
      refusals.append((
          jnp.any(parallel.psum(accumulation.fingerprint, axis) !=
                  batching.batch_fingerprint(ids, mask, axis)),
          'the physical batches hold other examples than the logical '
          'batch\'s example_ids (or one of them twice): the batch checks '
          'and the accounting describe the logical batch.'))
    if refusals:
      # Poisoned on the device and recorded in the state (no host round
      # trip): the release of this step is NaN, and so is every later one.
      refused = functools.reduce(jnp.logical_or, [f for f, _ in refusals])
      clipped = clipped._replace(sum=jax.tree_util.tree_map(
          lambda s: jnp.where(refused, jnp.nan, s), clipped.sum))
    step = _step_of(opt_state)
    updates, opt_state = self.transformation.update(
        None, opt_state, params, clipped_sum=clipped, **inputs)
    if refusals:
      opt_state = guards.record_in(refusals, opt_state, step, kind='batch')
    return optax.apply_updates(params, updates), opt_state

  def __call__(self, params: PyTree, opt_state: PyTree,
               batch_inputs: Mapping[str, Any]) -> tuple[PyTree, PyTree]:
    """One logical step: `(params, opt_state)` after `batch_inputs`.

    Args:
      params: the current params.
      opt_state: the transformation's state.
      batch_inputs: the logical step's inputs (`batch`, and `batch_mask`,
        `example_ids` when the sampler gives them), host arrays.

    Returns:
      `(params, opt_state)` after the step; nothing is waited for.
    """
    logical = self.split(batch_inputs)
    if self.mesh is not None:
      self._check_divisible(logical.inputs)
    accumulation = self.start(opt_state, params, logical.template)
    for physical in logical.physical:
      accumulation = self.accumulate(accumulation, opt_state, params,
                                     physical)
    return self.finish(params, opt_state, accumulation, logical.inputs)

  def _check_divisible(self, inputs: Mapping[str, Any]) -> None:
    """Refuses a logical batch whose ids / mask do not split evenly."""
    devices = self.mesh.shape[self.form.axis_name]
    for name in ('example_ids', 'batch_mask'):
      if inputs.get(name) is not None and np.shape(inputs[name])[0] % devices:
        raise ValueError(
            f'the logical batch\'s {name} has {np.shape(inputs[name])[0]} '
            f'entries, not a multiple of the {devices} devices on axis '
            f'{self.form.axis_name!r} that split it: pad the batch to a '
            f'multiple of {devices} (the sampler\'s pad_to_multiple)')

  def compiled_shapes(self) -> int:
    """How many physical sizes `accumulate` has compiled so far.

    Example:
      >>> step.compiled_shapes()    # at most 1 + ceil(log2(P / g))

    Returns:
      The number of physical sizes `accumulate` was traced for (sharded,
      jit may keep more than one entry per size: one per layout of the
      arguments it was handed, the same program).
    """
    if self.mesh is None:
      return self.accumulate._cache_size()  # pylint: disable=protected-access
    return len(self._traced_sizes)

