"""Private steps under `jax.jit` on a device mesh (`NamedSharding`).

Users who outgrow one device shard the batch (data parallel), the
parameters (FSDP-style) or both, and jit the step; no `axis_name` is
involved. The private step must then equal the one-device step: the
clipped sum is the same sum whoever holds which examples, and the noise is
ONE draw from one key (JAX's partitionable threefry makes a sharded draw
the same numbers as an unsharded one), so a shard never repeats another's
noise. Eight virtual CPU devices (tests/conftest.py).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dpsco_jax

D, H, C, B = 16, 32, 8, 16


def _problem():
  rng = np.random.default_rng(0)
  params = {'w1': jnp.asarray(rng.normal(size=(D, H)) * 0.3, jnp.float32),
            'w2': jnp.asarray(rng.normal(size=(H, C)) * 0.3, jnp.float32)}
  batch = {'x': jnp.asarray(rng.normal(size=(B, D)), jnp.float32),
           'y': jnp.asarray(rng.integers(0, C, B), jnp.int32)}
  return params, batch


def loss_fn(params, example):  # one example, an optax loss
  logits = jnp.tanh(example['x'] @ params['w1']) @ params['w2']
  return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])


def _mesh():
  if len(jax.devices()) < 8:
    pytest.skip('needs 8 devices')
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ('data', 'model'))


PARAM_SPECS = {
    'replicated': {'w1': P(), 'w2': P()},
    'fsdp': {'w1': P('model', None), 'w2': P(None, 'model')},
}
BATCH_SPECS = {'replicated': P(), 'data_parallel': P('data')}


def _private_step(method, clip=0.1, noise_multiplier=1.0):
  tx = optax.chain(
      dpsco_jax.dpsgd(loss_fn, l2_clip=clip, noise_multiplier=noise_multiplier,
                      num_steps=4, key=7, clipping_method=method),
      optax.sgd(0.5))
  return tx


@pytest.mark.parametrize('method', ['vmap', 'ghost'])
@pytest.mark.parametrize('params_layout, batch_layout', [
    ('replicated', 'data_parallel'), ('fsdp', 'replicated'),
    ('fsdp', 'data_parallel')])
def test_sharded_step_equals_the_one_device_step(method, params_layout,
                                                 batch_layout):
  mesh = _mesh()
  params, batch = _problem()
  tx = _private_step(method)

  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  expected, _ = jax.jit(step)(params, tx.init(params), batch)
  shardings = {name: NamedSharding(mesh, spec)
               for name, spec in PARAM_SPECS[params_layout].items()}
  sharded_params = jax.device_put(params, shardings)
  sharded_batch = jax.device_put(
      batch, NamedSharding(mesh, BATCH_SPECS[batch_layout]))
  sharded_step = jax.jit(step, out_shardings=(shardings, None))
  got, _ = sharded_step(sharded_params, tx.init(sharded_params),
                        sharded_batch)
  for name in params:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5,
                               atol=1e-6)
    assert got[name].sharding.is_equivalent_to(shardings[name], 2)


def test_fsdp_noise_is_one_draw_split_across_shards():
  """Noise alone (a vanishing clip): each device holds its own slice of the
  one-device draw, and no two shards hold the same numbers."""
  mesh = _mesh()
  params, batch = _problem()
  tx = dpsco_jax.dpsgd(loss_fn, l2_clip=1e-30, noise_multiplier=1e30,
                       num_steps=4, key=3, clipping_method='vmap')

  def noise_of(params, state, batch):
    return tx.update(None, state, params, batch=batch)[0]

  expected = jax.jit(noise_of)(params, tx.init(params), batch)
  shardings = {name: NamedSharding(mesh, spec)
               for name, spec in PARAM_SPECS['fsdp'].items()}
  sharded_params = jax.device_put(params, shardings)
  got = jax.jit(noise_of, out_shardings=shardings)(
      sharded_params, tx.init(sharded_params),
      jax.device_put(batch, NamedSharding(mesh, P('data'))))
  for name, leaf in got.items():
    np.testing.assert_allclose(leaf, expected[name], rtol=1e-6)
    blocks = {}
    for shard in leaf.addressable_shards:
      blocks.setdefault(str(shard.index), np.asarray(shard.data))
    values = list(blocks.values())
    assert len(values) == 2  # the 'model' axis splits each leaf in two
    assert not np.allclose(values[0], values[1])


def test_ghost_step_gathers_no_per_example_gradients():
  """Under FSDP + data parallel the ghost step's program all-gathers nothing
  of the size of a (local) batch of per-example gradients."""
  mesh = _mesh()
  params, batch = _problem()
  tx = _private_step('ghost')
  shardings = {name: NamedSharding(mesh, spec)
               for name, spec in PARAM_SPECS['fsdp'].items()}
  sharded_params = jax.device_put(params, shardings)

  def step(params, state, batch):
    return tx.update(None, state, params, batch=batch)[0]

  text = jax.jit(step, out_shardings=shardings).lower(
      sharded_params, tx.init(sharded_params),
      jax.device_put(batch, NamedSharding(mesh, P('data')))).compile().as_text()
  local_batch = B // 4
  smallest_leaf = min(leaf.size for leaf in params.values())
  for line in text.splitlines():
    match = re.search(r'= f32\[([\d,]*)\][^ ]* all-gather\(', line)
    if match:
      dims = [int(d) for d in match.group(1).split(',') if d]
      assert int(np.prod(dims)) < local_batch * smallest_leaf, line
