"""Tests for ghost-norm clipping (`dpsco_jax.ghost` behind `clipped_grad_sum`).

The ghost path must give the vmap path's `ClippedSum` (sum to float
tolerance, counters exactly) on every model it accepts, keep the module's
guarantees (masks, NaN/Inf, microbatches, sensitivity), and fall back, with an
announcement, on the models it does not accept. Equivalence tests force
`clipping_method='ghost'`, so a silent fallback cannot make them pass.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import clipping
from dpsco_jax import ghost
from dpsco_jax.neighboring import NeighboringRelation

CLIP = 1.0
NUM_EXAMPLES = 12


# Arrays are made in numpy, cast there: `jnp.asarray(x, dtype)` of another
# dtype, indexing a jax array and eager jnp operations each compile a program
# per shape.


def _normal(rng, *shape, scale=1.0):
  return jnp.asarray((rng.normal(size=shape) * scale).astype(np.float32))


def _classification_batch(rng, num_features, num_classes=3,
                          num_examples=NUM_EXAMPLES, positions=None):
  shape = (num_examples, num_features) if positions is None else (
      num_examples, positions, num_features)
  # Scales spread over [0.1, 3] so some examples are clipped and some not.
  scales = rng.uniform(0.1, 3.0, size=(num_examples,) + (1,) * (len(shape) - 1))
  return {'x': (rng.normal(size=shape) * scales).astype(np.float32),
          'y': rng.integers(0, num_classes, num_examples).astype(np.int32)}


def _cross_entropy(logits, label):
  return optax.softmax_cross_entropy_with_integer_labels(logits, label)


# ---------------------------------------------------------------------------
# Models: (loss_fn, params, batch).


def _logistic_regression(seed=0):
  rng = np.random.default_rng(seed)
  params = {'w': _normal(rng, 6, 3), 'b': _normal(rng, 3)}

  def loss_fn(params, example):
    return _cross_entropy(example['x'] @ params['w'] + params['b'],
                          example['y'])

  return loss_fn, params, _classification_batch(rng, 6)


def _mlp(seed=1):
  rng = np.random.default_rng(seed)
  params = {'hidden': {'w': _normal(rng, 6, 8, scale=0.5),
                       'b': _normal(rng, 8, scale=0.1)},
            'out': {'w': _normal(rng, 8, 3, scale=0.5),
                    'b': _normal(rng, 3, scale=0.1)}}

  def loss_fn(params, example):
    hidden = jax.nn.relu(example['x'] @ params['hidden']['w'] +
                         params['hidden']['b'])
    return _cross_entropy(hidden @ params['out']['w'] + params['out']['b'],
                          example['y'])

  return loss_fn, params, _classification_batch(rng, 6)


POSITIONS = 4
# At 8 positions the cost model (ghost.clipping_choice) takes the Gram form
# for the 16 -> 16 layer and forms the 16 -> 2 head's per-example gradient.
GRAM_AND_MATERIALIZED_POSITIONS = 8


def _sequence_model(seed=2):
  """Dense layers over a position axis, as einsums with various layouts."""
  rng = np.random.default_rng(seed)
  params = {'embed': _normal(rng, 5, 16, scale=0.4),
            'embed_bias': _normal(rng, 16, scale=0.1),
            # [out, in]: the parameter is the transposed operand.
            'mix': _normal(rng, 16, 16, scale=0.25),
            # A head axis shared by activation and weight (a batch dimension
            # of the dot_general).
            'heads': _normal(rng, 2, 8, 4, scale=0.3),
            'head': _normal(rng, 8, 3, scale=0.3)}

  def loss_fn(params, example):
    x = jnp.tanh(example['x'] @ params['embed'] + params['embed_bias'])
    x = jax.nn.gelu(jnp.einsum('pi,oi->po', x, params['mix']))
    heads = jnp.einsum('phd,hde->phe', x.reshape(POSITIONS, 2, 8),
                       params['heads'])
    pooled = jnp.mean(jnp.tanh(heads).reshape(POSITIONS, 8), axis=0)
    return _cross_entropy(pooled @ params['head'], example['y'])

  return loss_fn, params, _classification_batch(rng, 5, positions=POSITIONS)


def _gram_and_materialized_model(seed=3):
  rng = np.random.default_rng(seed)
  params = {'wide': _normal(rng, 16, 16, scale=0.25),
            'wide_bias': _normal(rng, 16, scale=0.1),
            'narrow': _normal(rng, 16, 2, scale=0.25)}

  def loss_fn(params, example):
    x = jnp.tanh(example['x'] @ params['wide'] + params['wide_bias'])
    return jnp.sum(jnp.sin(x @ params['narrow']))

  return loss_fn, params, _classification_batch(
      rng, 16, positions=GRAM_AND_MATERIALIZED_POSITIONS)


def _built(module_class, seed):
  """`module_class(nnx.Rngs(seed))`, its initializers run as ONE program.

  Built eagerly, every initializer of every layer shape would compile a
  program of its own.
  """
  nnx = pytest.importorskip('flax.nnx')
  return nnx.jit(lambda: module_class(nnx.Rngs(seed)))()


def _flax_linen_mlp(seed=4):
  nn = pytest.importorskip('flax.linen')

  class Mlp(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(8)(x))
      x = nn.LayerNorm()(x)
      return nn.Dense(3)(x)

  model = Mlp()
  rng = np.random.default_rng(seed)
  batch = _classification_batch(rng, 6)
  # One compiled init (an eager one compiles a program per operation).
  params = jax.jit(model.init)(jax.random.key(seed), batch['x'][0])['params']

  def loss_fn(params, example):
    logits = model.apply({'params': params}, example['x'])
    return _cross_entropy(logits, example['y'])

  return loss_fn, params, batch


def _flax_nnx_mlp(seed=5):
  nnx = pytest.importorskip('flax.nnx')

  class Mlp(nnx.Module):

    def __init__(self, rngs):
      self.hidden = nnx.Linear(6, 8, rngs=rngs)
      self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.hidden(x)))

  graphdef, params = nnx.split(_built(Mlp, seed), nnx.Param)

  def loss_fn(params, example):
    return _cross_entropy(nnx.merge(graphdef, params)(example['x']),
                          example['y'])

  return loss_fn, params, _classification_batch(np.random.default_rng(seed), 6)


def _embedding_model(seed=8):
  """An nnx.Embed lookup (repeated tokens), mean pooling, a dense head."""
  nnx = pytest.importorskip('flax.nnx')

  class Bag(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(VOCABULARY, 8, rngs=rngs)
      self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, tokens):
      return self.out(jnp.tanh(jnp.mean(self.embed(tokens), axis=0)))

  graphdef, params = nnx.split(_built(Bag, seed), nnx.Param)
  params = jax.tree_util.tree_map(lambda w: jnp.asarray(np.asarray(w) * 3.0),
                                  params)

  def loss_fn(params, example):
    return _cross_entropy(nnx.merge(graphdef, params)(example['x']),
                          example['y'])

  rng = np.random.default_rng(seed)
  # 6 tokens from a vocabulary of 5: most examples repeat a token, so the
  # rows of the table's gradient add up and the equality term matters.
  batch = {'x': rng.integers(0, VOCABULARY, (NUM_EXAMPLES, 6)).astype(np.int32),
           'y': rng.integers(0, 3, NUM_EXAMPLES).astype(np.int32)}
  return loss_fn, params, batch


def _conv(seed=7):
  """A plain `lax` convolution (NCHW/OIHW, VALID, two input channels)."""
  rng = np.random.default_rng(seed)
  params = {'kernel': _normal(rng, 3, 2, 3, 3, scale=0.5),
            'w': _normal(rng, 3 * 4 * 4, 3, scale=0.3)}

  def loss_fn(params, example):
    image = example['x'].reshape(1, 2, 6, 6)
    features = jax.lax.conv_general_dilated(image, params['kernel'], (1, 1),
                                            'VALID')
    logits = jax.nn.relu(features).reshape(-1) @ params['w']
    return _cross_entropy(logits, example['y'])

  return loss_fn, params, _classification_batch(rng, 72)


def _flax_nnx_cnn(seed=10):
  """nnx convolutions: SAME, strided VALID, and a dilated depthwise layer
  with uneven padding; then mean pooling and a dense head."""
  nnx = pytest.importorskip('flax.nnx')

  class Cnn(nnx.Module):

    def __init__(self, rngs):
      self.first = nnx.Conv(1, 4, (3, 3), padding='SAME', rngs=rngs)
      self.strided = nnx.Conv(4, 8, (3, 3), strides=2, padding='VALID',
                              rngs=rngs)
      self.depthwise = nnx.Conv(8, 8, (3, 3), feature_group_count=8,
                                padding=((1, 0), (0, 2)), kernel_dilation=2,
                                rngs=rngs)
      self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, image):
      x = jax.nn.relu(self.first(image[None, :, :, None]))
      x = jax.nn.relu(self.strided(x))
      x = jnp.tanh(self.depthwise(x))
      return self.out(jnp.mean(x, axis=(0, 1, 2)))

  graphdef, params = nnx.split(_built(Cnn, seed), nnx.Param)

  def loss_fn(params, example):
    return _cross_entropy(nnx.merge(graphdef, params)(example['x']),
                          example['y'])

  rng = np.random.default_rng(seed)
  batch = _classification_batch(rng, 10, positions=10)
  return loss_fn, params, batch


VOCABULARY = 5


MODELS = {
    'logistic_regression': _logistic_regression,
    'mlp': _mlp,
    'sequence': _sequence_model,
    'gram_and_materialized': _gram_and_materialized_model,
    'flax_linen_mlp_layernorm': _flax_linen_mlp,
    'flax_nnx_mlp': _flax_nnx_mlp,
    'embedding': _embedding_model,
    'conv': _conv,
    'flax_nnx_cnn': _flax_nnx_cnn,
    'tied_weights': lambda: _tied_weights(),  # defined below
}
# Clip norms inside each model's spread of per-example gradient norms (and
# not within 1% of any of them), so both clipped and unclipped examples occur.
CLIPS = {
    'logistic_regression': 3.0,
    'mlp': 2.0,
    'sequence': 1.0,
    'gram_and_materialized': 16.0,
    'flax_linen_mlp_layernorm': 4.0,
    'flax_nnx_mlp': 2.0,
    'embedding': 1.0,
    'conv': 5.0,
    'flax_nnx_cnn': 2.0,
    'tied_weights': 17.0,
}


# ---------------------------------------------------------------------------
# Helpers.


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(leaf, np.float64))
                         for leaf in jax.tree_util.tree_leaves(tree)])


@functools.cache
def _model(name):
  """One instance per model, so statistics of its loss can be cached."""
  return MODELS[name]()


@functools.cache
def _statistic(loss_fn, method, microbatch_size):
  """One jitted statistic per configuration, the clip a traced argument.

  `fn(clip, batch, params, mask)` clips to `clip` (the `l2_clip=` of a
  call): every clip of one model and configuration shares one compiled
  program.
  """
  stat = clipping.clipped_grad_sum(loss_fn, 1.0, clipping_method=method,
                                   microbatch_size=microbatch_size)
  return jax.jit(lambda clip, batch, params, mask: stat(
      batch, params, mask=mask, l2_clip=clip))


def _run(loss_fn, params, batch, method, mask=None, microbatch_size=None,
         clip=CLIP):
  if mask is None:
    mask = np.ones(clipping.batch_size_of(batch), bool)
  return _statistic(loss_fn, method, microbatch_size)(
      np.float32(clip), batch, params, mask)


def _assert_same(actual, expected, rtol=1e-5):
  scale = max(1.0, float(np.max(np.abs(_flat(expected.sum)))))
  np.testing.assert_allclose(_flat(actual.sum), _flat(expected.sum),
                             rtol=rtol, atol=rtol * scale)
  for field in ('count', 'num_nonfinite', 'num_clipped'):
    assert int(getattr(actual, field)) == int(getattr(expected, field)), field


def _ghost_and_vmap(loss_fn, params, batch, **kwargs):
  """The same statistic on the ghost path (forced) and on the vmap path."""
  return (_run(loss_fn, params, batch, 'ghost', **kwargs),
          _run(loss_fn, params, batch, 'vmap', **kwargs))


def _set(x, index, value):
  """numpy: a copy of `x` with `x[index] = value` (an eager jnp update
  would compile a program per shape)."""
  x = np.array(x)
  x[index] = value
  return x


def _rows(batch, rows):
  """numpy: the batch's `rows`."""
  return jax.tree_util.tree_map(lambda x: np.asarray(x)[rows], batch)


def _poisoned(batch, mask):
  """numpy: the rows `mask` drops set to NaN (integer leaves to 0)."""
  def poison(x):
    x = np.asarray(x)
    keep = mask.reshape((-1,) + (1,) * (x.ndim - 1))
    return np.where(keep, x, np.nan if x.dtype == np.float32 else 0).astype(
        x.dtype)
  return jax.tree_util.tree_map(poison, batch)


# ---------------------------------------------------------------------------
# Equivalence with the vmap path.


# The ghost norms are upper bounds including rounding (ghost.LayerNorms),
# so clip factors may be smaller than the vmap path's by up to ~1e-4
# relative (clipping a little earlier, never later;
# `test_conv_norms_match_per_example_norms` checks the norms themselves
# tightly).
RTOL = {'flax_nnx_cnn': 3e-4}


@pytest.mark.parametrize('model', list(MODELS))
def test_ghost_sum_equals_vmap_sum(model):
  loss_fn, params, batch = _model(model)
  ghost_out, vmap_out = _ghost_and_vmap(loss_fn, params, batch,
                                        clip=CLIPS[model])
  _assert_same(ghost_out, vmap_out, rtol=RTOL.get(model, 1e-5))
  assert int(ghost_out.count) == NUM_EXAMPLES
  # Clipping is active on some examples and not on others.
  assert 0 < int(vmap_out.num_clipped) < NUM_EXAMPLES
  for leaf in jax.tree_util.tree_leaves(ghost_out.sum):
    assert leaf.dtype == jnp.float32


def test_sequence_layers_exercise_gram_and_materialized_forms():
  loss_fn, params, batch = _gram_and_materialized_model()
  plan = ghost.analyze(loss_fn, params, batch)
  names = ['narrow', 'wide', 'wide_bias']   # params leaves, sorted keys
  choices = {names[tap.leaf]: ghost.dense_uses_gram(tap, plan)
             for tap in plan.taps}
  assert choices == {'wide': True, 'narrow': False, 'wide_bias': None}


@pytest.mark.parametrize('model', ['conv', 'flax_nnx_cnn'])
def test_conv_norms_match_per_example_norms(model):
  # The unfolded-input rule against the norms of materialized per-example
  # gradients: never below them, and above only by the rounding margin.
  loss_fn, params, batch = _model(model)
  plan = ghost.analyze(loss_fn, params, batch)
  assert 'conv_general_dilated' in {tap.rule for tap in plan.taps}

  @jax.jit   # one program each instead of one dispatch per operation
  def ghost_and_per_example(params, batch):
    values = ghost.gradient_terms(plan, params, batch)
    return (ghost.squared_norms(plan, params, values, 1.0, NUM_EXAMPLES),
            jax.vmap(jax.grad(loss_fn), (None, 0))(params, batch))

  ghost_squared, per_example = ghost_and_per_example(params, batch)
  true_squared = sum(
      np.sum(np.asarray(leaf, np.float64).reshape(NUM_EXAMPLES, -1)**2, 1)
      for leaf in jax.tree_util.tree_leaves(per_example))
  ratio = np.asarray(ghost_squared, np.float64) / true_squared
  assert np.all(ratio >= 1 - 1e-6), ratio
  assert np.all(ratio <= 1 + 5e-4), ratio


def test_every_leaf_of_the_models_is_handled_natively():
  for model in MODELS:
    loss_fn, params, batch = _model(model)
    plan = ghost.analyze(loss_fn, params, batch)
    # Every leaf is tapped (a leaf used twice, as tied weights are, twice).
    assert sorted(set(tap.leaf for tap in plan.taps)) == list(
        range(len(jax.tree_util.tree_leaves(params))))


def test_auto_takes_the_ghost_path_when_it_applies():
  loss_fn, params, batch = _model('mlp')
  stat = clipping.clipped_grad_sum(loss_fn, CLIP)
  assert stat.clipping_method == 'auto'
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert stat.ghost_plan(batch, params) is not None
    _assert_same(jax.jit(stat)(batch, params),
                 _run(loss_fn, params, batch, 'vmap'))


@pytest.mark.parametrize('microbatch_size', [1, 5, 16])
def test_microbatches_match_one_block_and_vmap(microbatch_size):
  loss_fn, params, batch = _model('mlp')
  mask = np.arange(NUM_EXAMPLES) % 4 != 1
  poisoned = _poisoned(batch, mask)
  whole = _run(loss_fn, params, poisoned, 'ghost', mask=mask)
  ghost_out, vmap_out = _ghost_and_vmap(loss_fn, params, poisoned, mask=mask,
                                        microbatch_size=microbatch_size)
  _assert_same(ghost_out, whole)
  _assert_same(ghost_out, vmap_out)


@pytest.mark.parametrize('model', ['mlp', 'sequence'])
def test_masked_rows_holding_nan_contribute_exactly_zero(model):
  loss_fn, params, batch = _model(model)
  mask = np.arange(NUM_EXAMPLES) % 3 != 0
  rows = np.flatnonzero(mask)
  poisoned = _poisoned(batch, mask)
  out = _run(loss_fn, params, poisoned, 'ghost', mask=mask)
  unpadded = _run(loss_fn, params, _rows(batch, rows), 'ghost')
  _assert_same(out, unpadded)
  assert int(out.count) == len(rows)
  assert int(out.num_nonfinite) == 0


@pytest.mark.parametrize('value', [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize('model', ['logistic_regression', 'mlp', 'sequence'])
def test_nonfinite_examples_are_dropped_and_counted(model, value):
  loss_fn, params, batch = _model(model)
  x = _set(batch['x'], 2, value)
  x[7] *= np.where(np.arange(x.shape[-1]) == 0, value, 1.0).astype(x.dtype)
  poisoned = dict(batch, x=x)
  ghost_out, vmap_out = _ghost_and_vmap(loss_fn, params, poisoned)
  assert np.all(np.isfinite(_flat(ghost_out.sum)))
  assert int(ghost_out.num_nonfinite) == 2
  _assert_same(ghost_out, vmap_out)
  # Dropped means zero: the same as leaving the two rows out.
  kept = np.setdiff1d(np.arange(NUM_EXAMPLES), [2, 7])
  without = _run(loss_fn, params, _rows(batch, kept), 'ghost')
  np.testing.assert_allclose(_flat(ghost_out.sum), _flat(without.sum),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('model', ['logistic_regression', 'mlp'])
def test_huge_examples_are_clipped_like_vmap(model):
  loss_fn, params, batch = _model(model)
  x = np.array(batch['x'])
  x[:3] *= 1e6
  huge = dict(batch, x=x)
  ghost_out, vmap_out = _ghost_and_vmap(loss_fn, params, huge)
  _assert_same(ghost_out, vmap_out)
  assert int(ghost_out.num_nonfinite) == 0
  assert int(ghost_out.num_clipped) >= 3


@pytest.mark.parametrize('value', [np.nan, np.inf, 1e30, 1e15, -7.0])
def test_changing_one_example_moves_the_sum_by_at_most_sensitivity(value):
  loss_fn, params, batch = _model('mlp')
  # `_run`: the ghost path's program of this model, shared with the other
  # tests and every parametrization (a mask is always passed).
  stat = clipping.clipped_grad_sum(loss_fn, CLIP, clipping_method='ghost')
  original = _flat(_run(loss_fn, params, batch, 'ghost').sum)
  # Replace-one: any new value of example 4 (one coordinate set to `value`,
  # or the whole row) moves the sum by at most 2C.
  for changed in (_set(batch['x'], (4, 0), value),
                  _set(batch['x'], 4, value)):
    moved = _flat(_run(loss_fn, params, dict(batch, x=changed), 'ghost').sum)
    assert np.all(np.isfinite(moved))
    assert np.linalg.norm(moved - original) <= stat.sensitivity(
        NeighboringRelation.REPLACE_ONE) * (1 + 1e-5)
  # Add/remove: masking example 4 out moves it by at most C.
  mask = np.arange(NUM_EXAMPLES) != 4
  removed = _flat(_run(loss_fn, params, batch, 'ghost', mask=mask).sum)
  assert np.linalg.norm(removed - original) <= stat.sensitivity() * (1 + 1e-5)


def test_sensitivity_is_the_same_on_both_paths():
  loss_fn, _, _ = _model('mlp')
  for relation in NeighboringRelation:
    assert (clipping.clipped_grad_sum(loss_fn, 0.7, clipping_method='ghost')
            .sensitivity(relation) ==
            clipping.clipped_grad_sum(loss_fn, 0.7, clipping_method='vmap')
            .sensitivity(relation))


def test_equivalence_check_catches_a_wrong_norm_identity(monkeypatch):
  # The Gram form without its cross terms p != q (a plausible slip) must be
  # caught by the comparison the other tests make. Each run builds a fresh
  # loss, so no compilation made before the patch is reused after it.
  def diagonal_only(tap, program, leaf, others, g):
    del tap, program, leaf
    (a,) = others   # [units, terms (1 here), ...]
    if a.ndim < 4:   # no positions: the identity is exact
      return jnp.sum(a**2, axis=(1, 2)) * jnp.sum(g**2, axis=(1, 2))
    return jnp.sum(jnp.sum(a**2, -1) * jnp.sum(g**2, -1), axis=(1, 2))

  def ghost_against_vmap():
    loss_fn, params, batch = _gram_and_materialized_model()
    _assert_same(_run(loss_fn, params, batch, 'ghost', clip=10.0),
                 _run(loss_fn, params, batch, 'vmap', clip=10.0))

  ghost_against_vmap()
  monkeypatch.setitem(ghost.LAYER_RULES, 'dot_general',
                      ghost.LayerRule(ghost.LAYER_RULES['dot_general'].check,
                                      diagonal_only))
  with pytest.raises(AssertionError):
    ghost_against_vmap()


def test_pmap_statistic_is_per_device_and_sums_to_the_whole_batch():
  num_devices = 4
  loss_fn, params, batch = _model('mlp')
  stat = clipping.clipped_grad_sum(loss_fn, CLIP, clipping_method='ghost')
  split = jax.tree_util.tree_map(
      lambda x: x.reshape((num_devices, -1) + x.shape[1:]), batch)
  per_device = jax.pmap(lambda rows, p: stat(rows, p), in_axes=(0, None),
                        devices=jax.devices()[:num_devices])(split, params)
  whole = _run(loss_fn, params, batch, 'vmap')
  summed = jax.tree_util.tree_map(lambda x: np.sum(np.asarray(x), axis=0),
                                  per_device)
  _assert_same(summed, whole)


# ---------------------------------------------------------------------------
# Fallback.


def _tied_weights(seed=6):
  rng = np.random.default_rng(seed)
  params = {'w': _normal(rng, 6, 4, scale=0.5), 'b': _normal(rng, 4)}

  def loss_fn(params, example):
    code = jnp.tanh(example['x'] @ params['w'] + params['b'])
    return jnp.sum((code @ params['w'].T - example['x'])**2)

  return loss_fn, params, _classification_batch(rng, 6)


def _cumulative(seed=7):
  """A parameter through `cumsum`: an operation with no layer rule."""
  rng = np.random.default_rng(seed)
  params = {'w': _normal(rng, 6, 3, scale=0.5)}

  def loss_fn(params, example):
    return _cross_entropy(example['x'] @ jnp.cumsum(params['w'], axis=0),
                          example['y'])

  return loss_fn, params, _classification_batch(rng, 6)


def _column_gather(seed=9):
  """A gather of table COLUMNS: not an embedding lookup."""
  rng = np.random.default_rng(seed)
  params = {'table': _normal(rng, 6, VOCABULARY)}

  def loss_fn(params, example):
    picked = jnp.take(params['table'], example['tokens'], axis=1)
    return jnp.sum(jnp.tanh(example['x'] @ picked))

  batch = dict(_classification_batch(rng, 6),
               tokens=rng.integers(0, VOCABULARY,
                                   (NUM_EXAMPLES, 2)).astype(np.int32))
  return loss_fn, params, batch


FALLBACKS = {
    'cumulative': (_cumulative, r"\['w'\] is used by `cumsum`"),
    'column_gather': (_column_gather, r"\['table'\] used by `gather`: not a "
                      'lookup of whole rows'),
}


@pytest.mark.parametrize('model', list(FALLBACKS))
def test_auto_falls_back_to_vmap_once_with_the_reason(model):
  make, reason = FALLBACKS[model]
  loss_fn, params, batch = make()
  stat = clipping.clipped_grad_sum(loss_fn, CLIP)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    # Two compiled functions: the statistic is traced twice (as two eager
    # calls would), and announces its fallback once.
    first = jax.jit(stat)(batch, params)
    second = jax.jit(lambda batch, params: stat(batch, params))(batch, params)
  fallbacks = [w for w in caught
               if issubclass(w.category, clipping.GhostClippingFallbackWarning)]
  assert len(fallbacks) == 1
  assert re.search(reason, str(fallbacks[0].message))
  vmap_out = _run(loss_fn, params, batch, 'vmap')
  _assert_same(first, vmap_out)
  _assert_same(second, vmap_out)


@pytest.mark.parametrize('model', list(FALLBACKS))
def test_ghost_method_refuses_with_the_reason(model):
  make, reason = FALLBACKS[model]
  loss_fn, params, batch = make()
  stat = clipping.clipped_grad_sum(loss_fn, CLIP, clipping_method='ghost')
  with pytest.raises(ghost.GhostClippingUnsupported, match=reason):
    stat(batch, params)


def test_invalid_method_is_refused():
  loss_fn, _, _ = _model('mlp')
  with pytest.raises(ValueError, match='method must be one of'):
    clipping.clipped_grad_sum(loss_fn, CLIP, clipping_method='fast')
  with pytest.raises(ValueError, match='needs loss_fn'):
    clipping.ClippedStatistic(lambda unit: unit, CLIP, clipping_method='auto')


def test_a_loss_the_ghost_passes_cannot_trace_falls_back(monkeypatch):
  # A loss the analysis accepts but the ghost passes fail on (an operation
  # the interpreter mishandles) must not break 'auto': it falls back.
  def broken(*args, **kwargs):
    raise NotImplementedError('no interpreter rule for this operation')

  loss_fn, params, batch = _mlp()
  monkeypatch.setattr(ghost, 'layer_values', broken)
  stat = clipping.clipped_grad_sum(loss_fn, CLIP)
  with pytest.warns(clipping.GhostClippingFallbackWarning,
                    match='failed to trace.*no interpreter rule'):
    out = jax.jit(stat)(batch, params)
  _assert_same(out, _run(loss_fn, params, batch, 'vmap'))
  with pytest.raises(ghost.GhostClippingUnsupported, match='failed to trace'):
    clipping.clipped_grad_sum(loss_fn, CLIP, clipping_method='ghost')(
        batch, params)


def test_embedding_ids_outside_the_table_never_shrink_the_norm():
  # With mode='clip' the ids V + 2 and V - 1 read and update the SAME row:
  # the true gradient of that row is the SUM of both positions' gradients.
  # Norms that took the raw ids as distinct rows would give sqrt(P) times
  # too little here, and the clipped contribution would exceed the clip.
  direction = np.asarray([1.0, -2.0, 0.5], np.float32)
  params = {'table': jnp.asarray(np.zeros((VOCABULARY, 3), np.float32))}

  def loss_fn(params, example):
    rows = jnp.take(params['table'], example['tokens'], axis=0, mode='clip')
    return jnp.sum(rows @ direction)

  tokens = np.full((NUM_EXAMPLES, 6), VOCABULARY - 1)
  tokens[:, ::2] = VOCABULARY + 2          # outside: clamped to V - 1
  batch = {'tokens': tokens.astype(np.int32)}
  true_norm = 6 * float(np.linalg.norm(np.asarray(direction)))
  clip = 0.5 * true_norm
  single = _rows(batch, slice(0, 1))
  out = _run(loss_fn, params, single, 'ghost', clip=clip)
  assert float(np.linalg.norm(np.asarray(out.sum['table']))) <= clip * (
      1 + 1e-6)
  # With every id inside the table the norms are exact again.
  inside = {'tokens': np.full((NUM_EXAMPLES, 6), 1, np.int32)}
  ghost_out, vmap_out = _ghost_and_vmap(loss_fn, params, inside, clip=clip)
  _assert_same(ghost_out, vmap_out)
  assert int(vmap_out.num_clipped) == NUM_EXAMPLES


# ---------------------------------------------------------------------------
# The cost model (ghost.clipping_choice).


def _tanh_layer_loss(params, example):
  return jnp.sum(jnp.tanh(example['x'] @ params['w']))


# (positions, width): the plain dense layer and the short wide sequence take
# the Gram form on the ghost path; the long narrow sequence forms its
# per-example gradient, which the vmap path does as cheaply, so 'auto' takes
# the vmap path.
CHOICE_SHAPES = {(None, 64): ('gram', 'ghost'), (16, 256): ('gram', 'ghost'),
                 (512, 16): ('materialized', 'vmap')}


@pytest.mark.parametrize('shape', list(CHOICE_SHAPES))
def test_clipping_choice_on_three_shapes(shape):
  positions, width = shape
  rng = np.random.default_rng(0)
  params = {'w': _normal(rng, width, width, scale=width**-0.5)}
  x_shape = (4, width) if positions is None else (4, positions, width)
  batch = {'x': _normal(rng, *x_shape)}
  stat = clipping.clipped_grad_sum(_tanh_layer_loss, 0.1)
  choice = stat.clipping_choice(batch, params)
  (tap,) = choice.taps
  assert (tap.form, choice.path) == CHOICE_SHAPES[shape]
  assert choice.ghost == tap.ghost and choice.vmap == tap.vmap
  if tap.form == 'gram':
    assert tap.gram < tap.materialized
  with warnings.catch_warnings():
    warnings.simplefilter('error')   # a choice by cost is not a fallback
    auto = jax.jit(stat)(batch, params)
  # The path taken: the same arithmetic as the path chosen, bit for bit.
  chosen = jax.jit(clipping.clipped_grad_sum(
      _tanh_layer_loss, 0.1, clipping_method=choice.path))(batch, params)
  np.testing.assert_array_equal(_flat(auto.sum), _flat(chosen.sum))


def test_clipping_choice_is_none_for_vmap_and_refuses_bad_terms():
  loss_fn, params, batch = _model('mlp')
  assert clipping.clipped_grad_sum(
      loss_fn, CLIP, clipping_method='vmap').clipping_choice(batch, params) is None
  plan = ghost.analyze(loss_fn, params, batch)
  with pytest.raises(ValueError, match='terms'):
    ghost.clipping_choice(plan, NUM_EXAMPLES, terms=(1,))
  with pytest.raises(ValueError, match='positive'):
    ghost.clipping_choice(plan, 0)
