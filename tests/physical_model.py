"""The small flax model and data the physical-batch tests share.

One place for the model of `tests/test_physical.py` and
`tests/test_physical_sharded.py`, so that their one-call and physical
steps (on one device and on several) train the same network on the same
examples.
"""

import flax.linen as nn
import jax
import numpy as np
import optax

N, DIM, CLASSES, EXPECTED = 96, 6, 3, 24


class Mlp(nn.Module):
  """A two-layer MLP written the way users write one."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(8)(x)))


MODEL = Mlp()


def loss(params, example):
  """Softmax cross-entropy of ONE example (an optax loss)."""
  logits = MODEL.apply({'params': params}, example['x'])
  return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, DIM)).astype(np.float32)
  return {'x': x, 'y': (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1)}


DATA = _data()
# One compiled init, not one eager program per initializer op.
PARAMS = jax.jit(MODEL.init)(jax.random.key(0), DATA['x'][0])['params']
