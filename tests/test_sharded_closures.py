"""A step written with its params closed over, under `shard_map`.

Users often close over the params (or a frozen part of them) instead of
passing them to the mapped function. Differentiating with respect to a
closed-over value inside `shard_map` sums the gradient over the devices, so
per-example gradients would mix the examples of different devices before
clipping (a sensitivity of n_devices * C). `parallel.per_device` must type
them as per-device whatever way they entered.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import noise
from dpsco_jax import parallel

P = jax.sharding.PartitionSpec


class Model(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.tanh(nn.Dense(5)(x)))


def loss_fn(params, example):
  logits = Model().apply(params, example['x'])
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         example['y'])


@pytest.fixture(scope='module')
def setup():
  if len(jax.devices()) < 4:
    pytest.skip('needs 4 devices')
  rng = np.random.default_rng(1)
  batch = {'x': jnp.asarray(rng.normal(size=(16, 4)) * 3, jnp.float32),
           'y': jnp.asarray(rng.integers(0, 3, 16), jnp.int32)}
  params = jax.jit(Model().init)(jax.random.key(0), batch['x'][0])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ('d',))
  return params, batch, mesh


def test_a_clipped_sum_over_closed_over_params_is_per_example(setup):
  params, batch, mesh = setup
  statistic = clipping.clipped_grad_sum(loss_fn, 0.5, clipping_method='vmap')
  one_device = jax.jit(lambda b: statistic(b, params))(batch)

  def closed_over(b):   # params captured, not an argument
    return parallel.psum(statistic(b, parallel.per_device(params, 'd')), 'd')

  sharded = jax.jit(jax.shard_map(closed_over, mesh=mesh, in_specs=(P('d'),),
                                  out_specs=P()))(batch)
  assert int(sharded.num_clipped) == int(one_device.num_clipped)
  for a, b in zip(jax.tree_util.tree_leaves(sharded.sum),
                  jax.tree_util.tree_leaves(one_device.sum)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_dpsgd_step_over_closed_over_params_equals_one_device(setup):
  params, batch, mesh = setup
  build = lambda axis: estimators.noisy_gradient(
      loss_fn, l2_clip=0.5, noise_multiplier=0.0,
      mechanism=noise.gaussian(2), key=0, normalize_by=16,
      clipping_method='vmap', axis_name=axis)
  tx_one, tx_sharded = build(None), build('d')
  # The one-device reference compiled whole (eagerly, every op of the
  # update would compile a program of its own).
  expected, _ = jax.jit(lambda s: tx_one.update(None, s, params, batch=batch))(
      tx_one.init(params))
  step = jax.jit(jax.shard_map(
      lambda s, b: tx_sharded.update(None, s, params, batch=b)[0],
      mesh=mesh, in_specs=(P(), P('d')), out_specs=P()))
  got = step(tx_sharded.init(params), batch)
  for a, b in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
