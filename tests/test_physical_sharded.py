"""Physical batches on a device mesh: each device its shard, noised once.

A plan built with `axis_name=` and `physical_batch_size=` runs each logical
batch as physical batches split over the axis (`jax.shard_map`, eight
virtual CPU devices from tests/conftest.py). It must equal the one-call
sharded step (the plan's transformation under `jax.shard_map`, the logical
batch split over the same devices, the same key) to float tolerance; sum
the clipped statistic across devices once per logical step, not once per
physical batch; and keep the batch checks on the whole logical batch.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpsco_jax import batching
from dpsco_jax import clipping
from dpsco_jax import guards
from dpsco_jax import physical
from dpsco_jax import plans
from dpsco_jax import profiling

pytest.importorskip('flax.linen')
# pylint: disable=g-import-not-at-top,wrong-import-position
from tests.physical_model import DATA, EXPECTED, N, PARAMS
from tests.physical_model import loss as _loss
# pylint: enable=g-import-not-at-top,wrong-import-position

AXIS = 'devices'


def _mesh():
  if jax.device_count() < 8:
    pytest.skip('needs 8 devices')
  return jax.make_mesh((8,), (AXIS,))


@functools.lru_cache(maxsize=None)
def _plan(algorithm):
  common = dict(num_examples=N, batch_size=EXPECTED, epochs=1,
                noise_multiplier=1.0, delta=1e-5, key=0, seed=1,
                axis_name=AXIS, physical_batch_size=16)
  if algorithm == 'dpsgd':
    # Poisson batches of about 24, padded to 32: physical sizes 16 and 8
    # (2 and 1 examples per device).
    return plans.dpsgd(_loss, optimizer=optax.adam(0.05), l2_clip=0.5,
                       clipping_method='ghost', **common)
  if algorithm == 'user_level_dpsgd':
    # Users as the privacy unit: Poisson batches of about 10 of 40 users,
    # up to 3 items each, padded to a multiple of 32.
    return plans.user_level_dpsgd(
        _loss, optimizer=optax.sgd(0.1), num_users=40, users_per_batch=10,
        epochs=1, l2_clip=0.5, noise_multiplier=1.0, delta=1e-5, key=0,
        seed=1, method='rdp', clipping_method='vmap', axis_name=AXIS,
        physical_batch_size=16)
  if algorithm == 'accelerated_dp_srgd':
    # Differences at the query point x_t and the state's x_{t-1}, fixed
    # batches of 24: 16 + 8. A clip no difference reaches.
    return plans.accelerated_dp_srgd(
        _loss, beta=20.0, radius=None, l2_clip=50.0,
        clipping_method='vmap', **{k: v for k, v in common.items()
                                   if k != 'epochs'})
  # Differences at two points of the state (x_t and x_{t-1}), fixed batches
  # of 24: 16 + 8. A clip no difference reaches, so a wrong point shows.
  return plans.dp_srg_memf(
      _loss, optimizer=optax.sgd(0.1), l2_clip=50.0, decay=0.5,
      strategy='banded_sqrt', bands=2, clipping_method='vmap', **common)


@functools.lru_cache(maxsize=None)
def _one_call(algorithm):
  """The plan's one-call sharded step: its whole update under shard_map,
  the logical batch (data, ids, mask) split over the devices."""
  tx = _plan(algorithm).transformation

  def step(params, state, inputs):
    updates, state = tx.update(None, state, params, **inputs)
    return optax.apply_updates(params, updates), state

  mesh = _mesh()
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS)),
                              out_specs=(P(), P())))

  def one_call(params, state, inputs):
    whole = NamedSharding(mesh, P())
    return run(jax.device_put(params, whole), jax.device_put(state, whole),
               jax.device_put(inputs, NamedSharding(mesh, P(AXIS))))

  return guards.library_errors(one_call)


def _logical(algorithm):
  """`Plan.step` over physical batches, raising its refusal at once."""
  return functools.partial(_plan(algorithm).step, block=True)


def _close(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      np.testing.assert_array_equal(jax.random.key_data(x),
                                    jax.random.key_data(y))
      continue
    np.testing.assert_allclose(np.asarray(x, np.float64),
                               np.asarray(y, np.float64), rtol=2e-5,
                               atol=1e-6)


def _data_of(algorithm):
  if algorithm == 'user_level_dpsgd':
    return batching.group_by_user(DATA, np.arange(N) % 40, max_items=3)
  return DATA


def _first_inputs(algorithm):
  return next(iter(_plan(algorithm).batches_of(DATA)))


@pytest.mark.parametrize('algorithm', ['dpsgd', 'dp_srg_memf',
                                       'accelerated_dp_srgd',
                                       'user_level_dpsgd'])
def test_sharded_physical_batches_equal_the_one_call_sharded_step(algorithm):
  _mesh()
  plan = _plan(algorithm)
  one = by_pieces = PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for _, inputs in zip(range(3), plan.batches_of(_data_of(algorithm))):
    one, one_state = _one_call(algorithm)(one, one_state, inputs)
    by_pieces, pieces_state = _logical(algorithm)(by_pieces, pieces_state,
                                                  inputs)
    _close(by_pieces, one)
    _close(pieces_state, one_state)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(PARAMS))
             ) > 1e-3
  step = plan._logical_step  # pylint: disable=protected-access
  assert step.mesh.shape[AXIS] == 8
  # Sizes 16 and 8 (a whole example per device at granularity 8).
  assert step.granularity == 8
  assert 0 < step.compiled_shapes() <= 2   # 2 and 1 examples per device


def test_the_accumulate_program_sums_nothing_across_devices():
  """Each device keeps its own running sum; the one cross-device sum of the
  statistic is in the finishing program."""
  step = _plan('dpsgd')._logical_step  # pylint: disable=protected-access
  state = _plan('dpsgd').init(PARAMS)
  logical = step.split(_first_inputs('dpsgd'))
  accumulation = step.start(state, PARAMS, logical.template)
  assert accumulation.fingerprint.shape == (8, 2)   # one per device
  text = step.accumulate.lower(accumulation, state, PARAMS,
                               logical.physical[0]).compile().as_text()
  assert 'all-reduce' not in text and 'all-gather' not in text
  finish = step.finish.lower(PARAMS, state, accumulation,
                             logical.inputs).compile().as_text()
  assert 'all-reduce' in finish
  # No host round trip in either program (the refusals are recorded in
  # the state on the device).
  for program in (text, finish):
    counts = profiling.hlo_counts(program)
    assert counts.host_callbacks == 0, counts
    assert counts.conditionals_every_step == 0, counts


def _refused(run, *args):
  with pytest.raises(guards.PrivacyGuardError) as raised:
    run(*args)
  return str(raised.value)


def test_an_id_repeated_on_two_devices_is_refused():
  """The repeat sits in two devices' shards of the logical batch and in two
  physical batches: only a check that gathers the ids over the axis sees
  it."""
  inputs = dict(_first_inputs('dpsgd'))
  real = np.flatnonzero(inputs['batch_mask'])
  shard = len(inputs['batch_mask']) // 8
  later = real[real >= 2 * shard][0]    # on another device than real[0]
  ids = inputs['example_ids'].copy()
  ids[later] = ids[real[0]]
  inputs['example_ids'] = ids
  inputs['batch'] = jax.tree_util.tree_map(lambda x: x[ids], DATA)
  state = _plan('dpsgd').init(PARAMS)
  message = _refused(_logical('dpsgd'), PARAMS, state, inputs)
  assert 'the same example id twice' in message
  assert _refused(_one_call('dpsgd'), PARAMS, state, inputs) in message


def _pieces_then_finish(step, params, state, inputs, tamper):
  logical = step.split(inputs)
  accumulation = step.start(state, params, logical.template)
  for piece in tamper(list(logical.physical)):
    accumulation = step.accumulate(accumulation, state, params, piece)
  return step.finish(params, state, accumulation, logical.inputs)


def test_physical_batches_that_are_not_the_logical_batch_are_refused():
  plan = _plan('dpsgd')
  step = plan._logical_step  # pylint: disable=protected-access
  inputs = _first_inputs('dpsgd')
  state = plan.init(PARAMS)
  run = guards.library_errors(_pieces_then_finish)

  def drop_last(pieces):
    return pieces[:-1]

  def other_example(pieces):
    # The last device's shard of the first physical batch holds an example
    # the logical batch does not.
    first = pieces[0]
    ids = first.example_ids.copy()
    ids[-1] = (set(range(N)) - set(inputs['example_ids'].tolist())).pop()
    return [first._replace(example_ids=ids)] + pieces[1:]

  assert 'another number of examples' in _refused(
      run, step, PARAMS, state, inputs, drop_last)
  assert 'other examples than the logical batch' in _refused(
      run, step, PARAMS, state, inputs, other_example)
  _close(run(step, PARAMS, state, inputs, lambda pieces: pieces),
         _logical('dpsgd')(PARAMS, state, inputs))


def test_sizes_that_do_not_split_over_the_devices_are_refused():
  _mesh()
  form = physical.statistic_form(
      clipping.clipped_grad_sum(_loss, 0.5, microbatch_size=4), 16,
      axis_name=AXIS)
  with pytest.raises(ValueError, match='pick a multiple of 32'):
    physical.LogicalStep(optax.identity(), form)
  with pytest.raises(ValueError, match="not the transformation's device"):
    physical.LogicalStep(optax.identity(), form,
                         mesh=jax.make_mesh((8,), ('other',)))
