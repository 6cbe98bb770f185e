"""Rounding in the ghost norms never lets a contribution past the clip norm.

The Gram form `sum_{p,q} (a_p . a_q)(g_p . g_q)` (and the cross terms of a
gradient difference) add products of both signs. When they cancel, float32
rounding can put the computed squared norm anywhere within about
`n u sum|terms|` of the truth, below it too, so an example built to cancel
could have its true norm under-measured and escape clipping. The ghost
path adds a rounding margin to every layer's squared norm; these tests feed
such examples and check the clipped sum's norm against the clip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping

POSITIONS, FEATURES, OUT = 6, 8, 3


def _loss(params, example):
  # The output gradient is the same vector r at every position, so the
  # weight's gradient is (sum_p x_p) r^T: large positions that cancel.
  return jnp.sum((example['x'] @ params['w']) * example['r'])


@pytest.mark.parametrize('seed', range(6))
def test_cancelling_positions_are_still_clipped(seed):
  rng = np.random.default_rng(seed)
  scale = 10.0 ** rng.uniform(6, 9)
  base = rng.normal(size=(POSITIONS // 2, FEATURES))
  # Pairs of positions that nearly cancel: what remains is about 1 to 100
  # clip norms, the positions themselves 1e6 to 1e9.
  remainder = rng.normal(size=base.shape) * 10.0 ** rng.uniform(0, 2) / scale
  x = np.concatenate([base, -base + remainder]) * scale
  batch = {'x': jnp.asarray(x[None], jnp.float32),
           'r': jnp.asarray(rng.normal(size=(1, OUT)) / np.sqrt(OUT),
                            jnp.float32)}
  params = {'w': jnp.zeros((FEATURES, OUT), jnp.float32)}
  clip = 1.0
  stat = clipping.clipped_grad_sum(_loss, clip, method='ghost')
  out = stat(batch, params)
  norm = float(jnp.linalg.norm(out.sum['w']))
  assert norm <= clip * (1 + 1e-5), norm


def _two_layer_loss(params, example):
  hidden = jnp.tanh(example['x'] @ params['w1'])
  return jnp.sum((hidden @ params['w2']) * example['r'])


@pytest.mark.parametrize('seed', range(6))
def test_cancelling_differences_are_still_clipped(seed):
  # a grad f(x, d) - b grad f(x', d) with x' a hair from x and a, b large
  # and nearly equal: the two gradients are about 1e5 times the difference.
  # Each example's clipped contribution must stay within the clip. (Before
  # the weighted sum used the sum/difference basis of the norms, it left the
  # clip by up to 0.9%: its rounding, about u a |grad|, was not the one the
  # norm measured.)
  rng = np.random.default_rng(seed)
  a = float(10.0 ** rng.uniform(4, 6))
  b = a * (1.0 - 10.0 ** rng.uniform(-6, -4))
  w1 = rng.normal(size=(FEATURES, OUT)) / np.sqrt(FEATURES)
  params = {'w1': jnp.asarray(w1, jnp.float32),
            'w2': jnp.asarray(rng.normal(size=(OUT, OUT)), jnp.float32)}
  prev = jax.tree.map(
      lambda p: p + jnp.asarray(1e-6 * rng.normal(size=p.shape), p.dtype),
      params)
  batch = {'x': jnp.asarray(rng.normal(size=(4, POSITIONS, FEATURES)),
                            jnp.float32),
           'r': jnp.asarray(rng.normal(size=(4, OUT)), jnp.float32)}
  clip = 1.0
  stat = clipping.clipped_grad_difference_sum(_two_layer_loss, clip,
                                              method='ghost')
  for example in range(4):
    one = jax.tree.map(lambda v, e=example: v[e:e + 1], batch)
    total = stat(one, params, prev, a, b).sum
    norm = float(jnp.sqrt(sum(jnp.sum(v ** 2)
                              for v in jax.tree.leaves(total))))
    assert norm <= clip * (1 + 1e-5), (example, norm)


@pytest.mark.parametrize('seed', range(6))
def test_cancelling_items_of_a_user_are_still_clipped(seed):
  # A user's items nearly cancel in pairs: the Gram form over the items adds
  # huge products of both signs, and the user's mean is about a clip norm.
  rng = np.random.default_rng(seed)
  scale = 10.0 ** rng.uniform(6, 9)
  base = rng.normal(size=(POSITIONS // 2, 1, FEATURES))
  remainder = rng.normal(size=base.shape) * 10.0 ** rng.uniform(0, 2) / scale
  x = np.concatenate([base, -base + remainder]) * scale   # [items, 1, F]
  r = np.repeat(rng.normal(size=(1, OUT)) / np.sqrt(OUT), POSITIONS, 0)
  items = {'x': jnp.asarray(x[None], jnp.float32),
           'r': jnp.asarray(r[None], jnp.float32)}
  params = {'w': jnp.zeros((FEATURES, OUT), jnp.float32)}
  clip = 1.0
  stat = clipping.clipped_user_grad_sum(_loss, clip, method='ghost')
  out = stat(clipping.UserBatch(items), params)
  norm = float(jnp.linalg.norm(out.sum['w']))
  assert norm <= clip * (1 + 1e-5), norm


def _bias_over_positions(params, example):
  return jnp.sum((example['x'] + params['b']) * example['r'])


@pytest.mark.parametrize('seed', range(8))
def test_a_bias_whose_positions_cancel_is_still_clipped(seed):
  # A bias added at every position: its gradient is the sum of the output
  # gradients over positions, here built to cancel in pairs. Before the
  # materialized norms carried a margin, such an example left its clip by
  # up to 13%.
  rng = np.random.default_rng(seed)
  scale = 10.0 ** rng.uniform(3, 7)
  base = rng.normal(size=(POSITIONS // 2, OUT))
  remainder = rng.normal(size=base.shape) * 10.0 ** rng.uniform(-1, 1) / scale
  r = np.concatenate([base, -base + remainder]) * scale
  batch = {'x': jnp.zeros((3, POSITIONS, OUT), jnp.float32),
           'r': jnp.asarray(np.stack([r, 0.5 * r, 2.0 * r]), jnp.float32)}
  params = {'b': jnp.zeros(OUT, jnp.float32)}
  stat = clipping.clipped_grad_sum(_bias_over_positions, 1.0, method='ghost')
  for example in range(3):
    one = jax.tree.map(lambda v, e=example: v[e:e + 1], batch)
    norm = float(jnp.linalg.norm(stat(one, params).sum['b']))
    assert norm <= 1.0 + 1e-5, (example, norm)
