"""Multi-device steps: pmap and shard_map over 8 CPU devices equal one device.

The 8 virtual devices come from tests/conftest.py. Each device holds 1/8 of
the global batch; clipped sums are psum'd and the noise is drawn once from
the replicated key, so the result must match the single-device run on the
full batch with the same key, step after step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpsco_jax
from dpsco_jax import parallel
from dpsco_jax.algorithms import nonsmooth

NUM_DEVICES = 8
GLOBAL_BATCH = 64
NUM_STEPS = 5


def loss_fn(params, example):
  logits = example['x'] @ params['w'] + params['b']
  return -jax.nn.log_softmax(logits)[example['y']]


def make_data(seed=0):
  # Host (numpy) arrays: the tests reshape and broadcast them on the host,
  # and the compiled steps take them as they are.
  rng = np.random.default_rng(seed)
  batches = [{
      'x': rng.normal(size=(GLOBAL_BATCH, 12)).astype(np.float32),
      'y': rng.integers(0, 4, GLOBAL_BATCH).astype(np.int32),
  } for _ in range(NUM_STEPS)]
  params = {'w': (rng.normal(size=(12, 4)) * 0.1).astype(np.float32),
            'b': np.zeros((4,), np.float32)}
  return params, batches


def make_tx(algorithm, axis_name):
  common = dict(l2_clip=0.3, noise_multiplier=0.8, key=7, num_steps=NUM_STEPS,
                axis_name=axis_name)
  if algorithm == 'accelerated_srgd':
    # A whole optimizer (Algorithm 1): nothing is chained after it.
    return dpsco_jax.accelerated_dp_srgd(loss_fn, beta=2.0, radius=1.0,
                                         **common)
  if algorithm == 'dp_srg_memf':
    del common['num_steps']
    private = dpsco_jax.dp_srg_memf(
        loss_fn, strategy=np.tril(np.ones((NUM_STEPS, NUM_STEPS))) / 2,
        steps_per_epoch=NUM_STEPS, decay=0.3, check_order=False, **common)
  elif algorithm == 'dpsgd':
    private = dpsco_jax.dpsgd(loss_fn, **common)
  elif algorithm == 'user_level':
    # Consecutive pairs of examples are users of two items each (the same
    # users on one device and on eight: 8 examples per device).
    inner = dpsco_jax.user_level_dpsgd(loss_fn, **common)

    def update(updates, state, params=None, *, batch=None, **extra):
      users = jax.tree_util.tree_map(
          lambda x: x.reshape((-1, 2) + x.shape[1:]), batch)
      return inner.update(updates, state, params, batch=users, **extra)

    private = optax.GradientTransformationExtraArgs(inner.init, update)
  elif algorithm.startswith('nonsmooth'):
    # Paper 004: anchors at steps 0, 2, 4, differences between; the
    # per-example directions follow the example, not the device.
    private = nonsmooth.nonsmooth_vr_gradient(
        loss_fn, order=algorithm.split('_')[1], smoothing_radius=0.05,
        num_directions=3, clips=(0.3, 0.2), period=2,
        anchor_batch_size=GLOBAL_BATCH, batch_size=GLOBAL_BATCH,
        noise_multiplier=0.8, num_steps=NUM_STEPS, key=7,
        axis_name=axis_name)
    return optax.chain(private, nonsmooth.o2nc(
        learning_rate=0.5, movement_radius=0.1, block_length=2, key=3))
  elif algorithm == 'dpftrl':
    private = dpsco_jax.dpftrl(loss_fn, restart_every=3, **common)
  else:
    private = dpsco_jax.dpftrl(loss_fn, honaker=True, **common)
  return optax.chain(private, optax.sgd(0.5, momentum=0.9))


def step_fn(tx):
  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state
  return step


def run_single(algorithm, params, batches):
  tx = make_tx(algorithm, None)
  state = tx.init(params)
  step = jax.jit(step_fn(tx))
  for batch in batches:
    params, state = step(params, state, batch)
  return params


_SINGLE_RUNS = {}


def single_device_run(algorithm):
  """`run_single` on `make_data()`, once per algorithm for both runners.

  The single-device reference is the same for pmap and shard_map (same data,
  same key); computing it once spares a compile and a run per algorithm.
  """
  if algorithm not in _SINGLE_RUNS:
    _SINGLE_RUNS[algorithm] = run_single(algorithm, *make_data())
  return _SINGLE_RUNS[algorithm]


def replicate(tree):
  # On the host: an eager jnp.broadcast_to would compile a program per
  # leaf shape.
  def one(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = np.asarray(jax.random.key_data(x))
      return jax.random.wrap_key_data(
          np.broadcast_to(data, (NUM_DEVICES,) + data.shape),
          impl=jax.random.key_impl(x))
    x = np.asarray(x)
    return np.broadcast_to(x, (NUM_DEVICES,) + x.shape)
  return jax.tree_util.tree_map(one, tree)


def shard_batch(batch):
  return jax.tree_util.tree_map(
      lambda x: np.reshape(x, (NUM_DEVICES, -1) + x.shape[1:]), batch)


def run_pmap(algorithm, params, batches):
  tx = make_tx(algorithm, 'devices')
  state = replicate(tx.init(params))
  params = replicate(params)
  step = jax.pmap(step_fn(tx), axis_name='devices')
  for batch in batches:
    params, state = step(params, state, shard_batch(batch))
  for leaf in jax.tree_util.tree_leaves(params):
    # Every replica holds the same params: the noise was drawn once.
    leaf = np.asarray(leaf)
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
  return jax.tree_util.tree_map(lambda leaf: leaf[0], params)


def run_shard_map(algorithm, params, batches):
  tx = make_tx(algorithm, 'devices')
  mesh = jax.make_mesh((NUM_DEVICES,), ('devices',))
  replicated = NamedSharding(mesh, P())
  step = jax.jit(jax.shard_map(
      step_fn(tx), mesh=mesh, in_specs=(P(), P(), P('devices')),
      out_specs=(P(), P())))
  state = jax.device_put(tx.init(params), replicated)
  params = jax.device_put(params, replicated)
  for batch in batches:
    batch = jax.device_put(batch, NamedSharding(mesh, P('devices')))
    params, state = step(params, state, batch)
  return params


def test_eight_devices_available():
  assert jax.device_count() == NUM_DEVICES


@pytest.mark.parametrize('runner', [run_pmap, run_shard_map],
                         ids=['pmap', 'shard_map'])
@pytest.mark.parametrize('algorithm', ['dpsgd', 'dpftrl', 'honaker',
                                       'accelerated_srgd', 'dp_srg_memf',
                                       'user_level', 'nonsmooth_zero',
                                       'nonsmooth_first'])
def test_eight_devices_equal_one_device(runner, algorithm):
  params, batches = make_data()
  single = single_device_run(algorithm)
  multi = runner(algorithm, params, batches)
  for leaf_single, leaf_multi in zip(jax.tree_util.tree_leaves(single),
                                     jax.tree_util.tree_leaves(multi)):
    np.testing.assert_allclose(leaf_multi, leaf_single, rtol=1e-5, atol=1e-6)
  # The run moved the params: the comparison is not between two no-ops.
  assert np.max(np.abs(np.asarray(single['w']) - params['w'])) > 1e-2


def test_shard_map_per_example_gradients_stay_on_their_device():
  """Gradients at replicated params must not be summed across devices."""
  params, batches = make_data()
  statistic = dpsco_jax.clipped_grad_sum(loss_fn, l2_clip=1e6)
  mesh = jax.make_mesh((NUM_DEVICES,), ('devices',))

  def local_then_psum(batch, p):
    local = statistic(batch, parallel.per_device(p, 'devices'), mask=None)
    return jax.lax.psum(local.sum, 'devices')

  batch = jax.device_put(batches[0], NamedSharding(mesh, P('devices')))
  total = jax.jit(jax.shard_map(
      local_then_psum, mesh=mesh, in_specs=(P('devices'), P()),
      out_specs=P()))(batch, params)
  expected = statistic(batches[0], params).sum
  for got, want in zip(jax.tree_util.tree_leaves(total),
                       jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pmap_refuses_per_device_noise_keys():
  """A key that differs across devices would add different noise per device.

  The refused step's output is NaN on every device, and the refusal
  recorded in the replicated state is raised by `raise_if_refused`.
  """
  params, batches = make_data()
  tx = make_tx('dpsgd', 'devices')
  state = replicate(tx.init(params))
  keys = jax.random.split(jax.random.key(0), NUM_DEVICES)
  state = (state[0]._replace(noise=state[0].noise._replace(key=keys)),) + (
      tuple(state[1:]))
  step = jax.pmap(step_fn(tx), axis_name='devices')
  out, state = step(replicate(params), state, shard_batch(batches[0]))
  for leaf in jax.tree_util.tree_leaves(out):
    assert np.isnan(np.asarray(leaf)).all()
  with pytest.raises(dpsco_jax.PrivacyGuardError,
                     match='differs across devices'):
    dpsco_jax.raise_if_refused(state)


def test_gather_concatenates_every_device_block_on_every_device():
  blocks = jnp.arange(12).reshape(4, 3)
  mask = jnp.array([[True], [False], [True], [True]])
  gathered = jax.vmap(lambda x, m: (parallel.gather(x, 'd'),
                                    parallel.gather(m, 'd')),
                      axis_name='d')(blocks, mask)
  for ids, keep in zip(*gathered):
    np.testing.assert_array_equal(ids, jnp.arange(12))
    np.testing.assert_array_equal(keep, mask.ravel())
    assert keep.dtype == jnp.bool_
  assert parallel.gather(blocks, None) is blocks
  # Under shard_map the result is replicated: out_specs P() type-checks.
  mesh = jax.make_mesh((NUM_DEVICES,), ('devices',))
  ids = jax.device_put(jnp.arange(2 * NUM_DEVICES),
                       NamedSharding(mesh, P('devices')))
  out = jax.jit(jax.shard_map(lambda x: parallel.gather(x, 'devices'),
                              mesh=mesh, in_specs=P('devices'),
                              out_specs=P()))(ids)
  np.testing.assert_array_equal(out, jnp.arange(2 * NUM_DEVICES))
