"""Rounding in the ghost norms never lets a contribution past the clip norm.

The Gram form `sum_{p,q} (a_p . a_q)(g_p . g_q)` (and the cross terms of a
gradient difference) add products of both signs. When they cancel, float32
rounding can put the computed squared norm anywhere within about
`n u sum|terms|` of the truth, below it too, so an example built to cancel
could have its true norm under-measured and escape clipping. The ghost
path adds a rounding margin to every layer's squared norm; these tests feed
such examples and check the clipped sum's norm against the clip.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping

# Rounding and precision of the code users' devices run: every XLA
# optimization, not the suite's level 0 (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized

POSITIONS, FEATURES, OUT = 6, 8, 3


@functools.cache
def _compiled(make, loss_fn, clip=1.0):
  """`jax.jit(make(loss_fn, clip, clipping_method='ghost'))`, shared by a
  test's seeds: compiled as users run it, one program for every seed (run
  eagerly, each of its operations would compile a program of its own)."""
  return jax.jit(make(loss_fn, clip, clipping_method='ghost'))


def _norm(tree):
  """numpy float64: the global l2 norm of `tree`."""
  return float(np.sqrt(sum(np.sum(np.asarray(v, np.float64)**2)
                           for v in jax.tree_util.tree_leaves(tree))))


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
  # numpy float32 (a cast by jnp would compile a program per shape).
  batch = {'x': np.asarray(x[None], np.float32),
           'r': np.asarray(rng.normal(size=(1, OUT)) / np.sqrt(OUT),
                           np.float32)}
  params = {'w': jnp.zeros((FEATURES, OUT), jnp.float32)}
  clip = 1.0
  stat = _compiled(clipping.clipped_grad_sum, _loss, clip)
  norm = _norm(stat(batch, params).sum['w'])
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
  params = {'w1': np.asarray(w1, np.float32),
            'w2': np.asarray(rng.normal(size=(OUT, OUT)), np.float32)}
  # numpy (float32 as before): eager jnp would compile per operation.
  prev = jax.tree.map(
      lambda p: np.asarray(p) + (1e-6 * rng.normal(size=p.shape)).astype(
          p.dtype), params)
  batch = {'x': np.asarray(rng.normal(size=(4, POSITIONS, FEATURES)),
                           np.float32),
           'r': np.asarray(rng.normal(size=(4, OUT)), np.float32)}
  clip = 1.0
  stat = _compiled(clipping.clipped_grad_difference_sum, _two_layer_loss,
                   clip)
  for example in range(4):
    one = jax.tree.map(lambda v, e=example: v[e:e + 1], batch)
    norm = _norm(stat(one, params, prev, a, b).sum)
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
  items = {'x': np.asarray(x[None], np.float32),
           'r': np.asarray(r[None], np.float32)}
  params = {'w': jnp.zeros((FEATURES, OUT), jnp.float32)}
  clip = 1.0
  stat = _compiled(clipping.clipped_user_grad_sum, _loss, clip)
  norm = _norm(stat(clipping.UserBatch(items), params).sum['w'])
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
  batch = {'x': np.zeros((3, POSITIONS, OUT), np.float32),
           'r': np.stack([r, 0.5 * r, 2.0 * r]).astype(np.float32)}
  params = {'b': jnp.zeros(OUT, jnp.float32)}
  stat = _compiled(clipping.clipped_grad_sum, _bias_over_positions)
  for example in range(3):
    one = jax.tree.map(lambda v, e=example: v[e:e + 1], batch)
    norm = _norm(stat(one, params).sum['b'])
    assert norm <= 1.0 + 1e-5, (example, norm)


# ---------------------------------------------------------------------------
# Sequence lengths: cancellation still clipped, and no over-clipping.


def _sequence_loss(params, example):
  return jnp.sum((example['x'] @ params['w']) * example['r'])


def _cancelling_sequence(rng, positions, width):
  """Positions that cancel in pairs, 1e6 to 1e9 times what remains."""
  scale = 10.0 ** rng.uniform(6, 9)
  base = rng.normal(size=(positions // 2, width))
  remainder = rng.normal(size=base.shape) * 10.0 ** rng.uniform(0, 2) / scale
  x = np.concatenate([base, -base + remainder]) * scale
  r = rng.normal(size=(width,)) / np.sqrt(width)
  return ({'x': np.asarray(x[None], np.float32),
           'r': np.asarray(r[None], np.float32)},
          {'w': jnp.zeros((width, width), jnp.float32)})


# (positions, width, the form the cost model takes for the weight).
SEQUENCE_CASES = [(32, 128, 'gram'), (256, 16, 'materialized'),
                  (2048, 16, 'materialized')]


@pytest.mark.parametrize('positions,width,form', SEQUENCE_CASES)
@pytest.mark.parametrize('seed', range(2))
def test_cancelling_long_sequences_are_still_clipped(positions, width, form,
                                                     seed):
  rng = np.random.default_rng(seed)
  batch, params = _cancelling_sequence(rng, positions, width)
  stat = clipping.clipped_grad_sum(_sequence_loss, 1.0, clipping_method='ghost')
  choice = stat.clipping_choice(batch, params)
  assert [tap.form for tap in choice.taps] == [form]
  norm = _norm(_compiled(clipping.clipped_grad_sum, _sequence_loss)(
      batch, params).sum['w'])
  assert norm <= 1.0 + 1e-5, norm


def _decoder_loss(params, example):
  """A small next-token model over T positions (batch axis of one)."""
  h = jnp.take(params['embed'], example['tokens'][None], axis=0)
  h = jnp.tanh(h @ params['mix'] + params['mix_bias']) * params['scale']
  logits = h @ params['head']
  log_probs = jax.nn.log_softmax(logits)
  picked = jnp.sum(log_probs * jax.nn.one_hot(example['targets'][None],
                                              logits.shape[-1]), axis=-1)
  return -jnp.mean(picked)


def _decoder_case(positions, width, vocabulary=32, examples=3, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: np.asarray(rng.normal(size=shape) / np.sqrt(
      shape[0]), np.float32)
  # numpy float32 throughout (eager jnp casts and products compile per
  # shape).
  params = {'embed': normal(vocabulary, width) * np.float32(
                np.sqrt(vocabulary)),
            'mix': normal(width, width),
            'mix_bias': np.zeros(width, np.float32),
            'scale': np.ones(width, np.float32),
            'head': normal(width, vocabulary)}
  tokens = rng.integers(0, vocabulary, (examples, positions + 1))
  batch = {'tokens': np.asarray(tokens[:, :-1], np.int32),
           'targets': np.asarray(tokens[:, 1:], np.int32)}
  return params, batch


def _contribution_ratios(loss_fn, params, batch):
  """||clipped contribution|| / clip per example, with a binding clip."""
  size = len(jax.tree_util.tree_leaves(batch)[0])
  # Compiled: eagerly, each operation would compile a program of its own.
  grads = jax.jit(jax.vmap(jax.grad(loss_fn), (None, 0)))(params, batch)
  norms = np.sqrt(sum(np.sum(np.asarray(g, np.float64).reshape(size, -1)**2,
                             axis=1) for g in jax.tree_util.tree_leaves(grads)))
  clip = float(0.01 * norms.min())
  stat = jax.jit(clipping.clipped_grad_sum(loss_fn, clip,
                                           clipping_method='ghost'))
  ratios = []
  for i in range(size):
    total = stat(batch, params, mask=np.arange(size) == i).sum
    ratios.append(np.sqrt(sum(np.sum(np.asarray(v, np.float64)**2)
                              for v in jax.tree_util.tree_leaves(total)))
                  / clip)
  return np.array(ratios)


@pytest.mark.parametrize('positions', [256, 2048])
def test_binding_clip_gives_contributions_at_the_clip(positions):
  # With a clip far below every example's norm, each example's contribution
  # has norm equal to the clip up to rounding: the vmap path gives 1.000.
  # A margin that grows with the positions clips harder than asked.
  params, batch = _decoder_case(positions, width=16)
  ratios = _contribution_ratios(_decoder_loss, params, batch)
  assert np.all(ratios >= 0.999) and np.all(ratios <= 1.0 + 1e-6), ratios


@pytest.mark.parametrize('positions,width', [(32, 128), (64, 1024)])
def test_binding_clip_gives_contributions_at_the_clip_in_the_gram_form(
    positions, width):
  # The output gradient is the same at every position (correlated
  # columns): the bound on the input Gram matrix's rounding then weighs
  # K times the norm, and at width 1024 a one-level bound (gamma_C) would
  # clip at 0.998.
  rng = np.random.default_rng(1)
  params = {'w': np.asarray(rng.normal(size=(width, width)) / np.sqrt(width),
                            np.float32)}
  batch = {'x': np.asarray(rng.normal(size=(2, positions, width)),
                           np.float32),
           'r': np.asarray(rng.normal(size=(2, width)), np.float32)}
  choice = clipping.clipped_grad_sum(_sequence_loss, 1.0).clipping_choice(
      batch, params)
  assert [tap.form for tap in choice.taps] == ['gram']
  ratios = _contribution_ratios(_sequence_loss, params, batch)
  assert np.all(ratios >= 0.999) and np.all(ratios <= 1.0 + 1e-6), ratios
