"""DP-SGD and DP-FTRL as optax transformations: reductions, noise scale, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import dpsco_jax
from dpsco_jax import NeighboringRelation


def loss_fn(params, example):
  logits = example['x'] @ params['w'] + params['b']
  return -jax.nn.log_softmax(logits)[example['y']]


def zero_loss(params, example):
  """A loss whose gradients are all zero: the output is pure noise."""
  return 0.0 * (jnp.sum(params['w']) + jnp.sum(params['b'])) * jnp.sum(
      example['x'])


def make_problem(batch_size=32, dim=6, classes=3, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  batch = {'x': jnp.asarray(rng.normal(size=(batch_size, dim)), dtype),
           'y': jnp.asarray(rng.integers(0, classes, batch_size), jnp.int32)}
  params = {'w': jnp.asarray(rng.normal(size=(dim, classes)) * 0.1, dtype),
            'b': jnp.zeros((classes,), dtype)}
  return params, batch


def run(tx, params, batches, **extra):
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch, **extra)
    return optax.apply_updates(params, updates), state

  for batch in batches:
    params, state = step(params, state, batch)
  return params, state


def _mean_loss(params, batch):
  return jnp.mean(jax.vmap(loss_fn, (None, 0))(params, batch))


_REFERENCE_SGD = optax.sgd(0.1, momentum=0.9)


@jax.jit
def _reference_step(params, state, batch):
  """One non-private momentum-SGD step on the mean loss (one program)."""
  grads = jax.grad(_mean_loss)(params, batch)
  updates, state = _REFERENCE_SGD.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def run_sgd_reference(params, batches):
  """Non-private SGD with momentum 0.9, learning rate 0.1."""
  state = _REFERENCE_SGD.init(params)
  for batch in batches:
    params, state = _reference_step(params, state, batch)
  return params


@pytest.mark.parametrize('algorithm', ['dpsgd', 'dpftrl', 'dpftrl_honaker'])
def test_zero_noise_huge_clip_is_non_private_sgd(algorithm):
  params, _ = make_problem()
  batches = [make_problem(seed=s)[1] for s in range(6)]
  kwargs = dict(l2_clip=1e6, noise_multiplier=0.0, key=0, num_steps=6)
  if algorithm == 'dpsgd':
    private = dpsco_jax.dpsgd(loss_fn, **kwargs)
  else:
    private = dpsco_jax.dpftrl(loss_fn, honaker=algorithm.endswith('honaker'),
                               restart_every=4, **kwargs)
  tx = optax.chain(private, optax.sgd(0.1, momentum=0.9))
  got, _ = run(tx, params, batches)
  want = run_sgd_reference(params, batches)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert float(jnp.max(jnp.abs(got['w'] - params['w']))) > 1e-3


def noise_outputs(tx, params, batch, steps):
  state = tx.init(params)
  update = jax.jit(lambda s: tx.update(None, s, params, batch=batch))
  outputs = []
  for _ in range(steps):
    out, state = update(state)
    outputs.append(np.concatenate([np.ravel(x) for x in
                                   jax.tree_util.tree_leaves(out)]))
  return np.stack(outputs)


@pytest.mark.parametrize('relation,factor', [
    (NeighboringRelation.ADD_OR_REMOVE, 1.0),
    (NeighboringRelation.ZERO_OUT, 1.0),
    (NeighboringRelation.REPLACE_ONE, 2.0),
])
def test_dpsgd_noise_is_on_the_sum_then_divided_by_batch(relation, factor):
  """Output std must be z * sensitivity / B: calibrated to the SUM."""
  batch_size, clip, z = 16, 0.7, 1.3
  params = {'w': jnp.zeros((64, 32)), 'b': jnp.zeros((32,))}
  batch = {'x': jnp.ones((batch_size, 3)), 'y': jnp.zeros((batch_size,), int)}
  tx = dpsco_jax.dpsgd(zero_loss, l2_clip=clip, noise_multiplier=z, key=1,
                       num_steps=2, neighboring_relation=relation)
  out = noise_outputs(tx, params, batch, steps=2).ravel()
  std = z * clip * factor / batch_size
  assert stats.kstest(out / std, 'norm').pvalue > 0.01
  assert stats.kstest(out / (std * 2 / 3), 'norm').pvalue < 0.01
  assert stats.kstest(out / (std * 3 / 2), 'norm').pvalue < 0.01


def test_dpftrl_prefix_of_outputs_is_tree_noise():
  """With zero gradients the running sum of outputs is the tree's prefix noise."""
  batch_size, clip, z, steps = 8, 2.0, 0.5, 8
  params = {'w': jnp.zeros((100, 100)), 'b': jnp.zeros((1,))}
  batch = {'x': jnp.ones((batch_size, 2)), 'y': jnp.zeros((batch_size,), int)}
  tx = dpsco_jax.dpftrl(zero_loss, l2_clip=clip, noise_multiplier=z,
                        num_steps=steps, key=3)
  prefix = np.cumsum(noise_outputs(tx, params, batch, steps), axis=0)
  unit = z * clip / batch_size
  for t in range(steps):
    expected = unit * np.sqrt(bin(t + 1).count('1'))
    assert stats.kstest(prefix[t] / expected, 'norm').pvalue > 0.001, t
    assert np.std(prefix[t]) == pytest.approx(expected, rel=0.05)


def test_masked_padding_equals_unpadded_batch():
  params, batch = make_problem(batch_size=20)
  padded = jax.tree_util.tree_map(
      lambda x: jnp.concatenate([x, jnp.full((12,) + x.shape[1:], 7, x.dtype)]),
      batch)
  padded['x'] = padded['x'].at[20].set(jnp.nan)
  mask = jnp.arange(32) < 20
  kwargs = dict(l2_clip=0.5, noise_multiplier=0.9, key=5, normalize_by=20,
                num_steps=1)
  plain = dpsco_jax.dpsgd(loss_fn, **kwargs)
  masked = dpsco_jax.dpsgd(loss_fn, **kwargs)
  # Compiled, as users run it (one program each, not hundreds of eager ops).
  out_plain, _ = jax.jit(lambda p, b: plain.update(
      None, plain.init(p), p, batch=b))(params, batch)
  out_masked, _ = jax.jit(lambda p, b, m: masked.update(
      None, masked.init(p), p, batch=b, batch_mask=m))(params, padded, mask)
  for a, b in zip(jax.tree_util.tree_leaves(out_plain),
                  jax.tree_util.tree_leaves(out_masked)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_microbatching_does_not_change_the_result():
  params, batch = make_problem(batch_size=30)
  kwargs = dict(l2_clip=0.5, noise_multiplier=0.9, key=5, num_steps=1)
  whole = dpsco_jax.dpsgd(loss_fn, **kwargs)
  pieces = dpsco_jax.dpsgd(loss_fn, microbatch_size=7, **kwargs)
  # Compiled, as users run it (one program each, not hundreds of eager ops).
  a, _ = jax.jit(lambda p, b: whole.update(None, whole.init(p), p, batch=b))(
      params, batch)
  b, _ = jax.jit(lambda p, b: pieces.update(None, pieces.init(p), p,
                                            batch=b))(params, batch)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('algorithm', ['dpsgd', 'dpftrl'])
def test_params_keep_their_dtype_under_jit(dtype, algorithm):
  params, batch = make_problem(dtype=dtype)
  make = dpsco_jax.dpsgd if algorithm == 'dpsgd' else dpsco_jax.dpftrl
  tx = optax.chain(make(loss_fn, l2_clip=1.0, noise_multiplier=1.0, key=0,
                        num_steps=3), optax.sgd(0.1, momentum=0.9))
  new_params, _ = run(tx, params, [batch] * 3)
  for leaf in jax.tree_util.tree_leaves(new_params):
    assert leaf.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32))))


@pytest.mark.parametrize('algorithm', ['dpsgd', 'dpftrl'])
def test_purity_same_state_same_output(algorithm):
  params, batch = make_problem()
  make = dpsco_jax.dpsgd if algorithm == 'dpsgd' else dpsco_jax.dpftrl
  tx = make(loss_fn, l2_clip=1.0, noise_multiplier=1.0, key=0, num_steps=4)
  state = tx.init(params)
  update = jax.jit(lambda s: tx.update(None, s, params, batch=batch))
  first, state_a = update(state)
  second, state_b = update(state)
  third, _ = update(state_a)
  for a, b, c in zip(jax.tree_util.tree_leaves(first),
                     jax.tree_util.tree_leaves(second),
                     jax.tree_util.tree_leaves(third)):
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)  # the next step draws fresh noise
  assert int(state_a.noise.step) == int(state_b.noise.step) == 1


def test_steps_beyond_capacity_are_refused():
  """The step past num_steps, compiled as users run it: NaN noise and the
  refusal recorded in the state (the program of the purity test above).
  Run eagerly the same check raises at once (tests/algorithms/test_mf.py
  and tests/test_noise_matrix_factorization.py)."""
  params, batch = make_problem()
  tx = dpsco_jax.dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=1.0, key=0,
                       num_steps=4)
  state = tx.init(params)
  update = jax.jit(lambda s: tx.update(None, s, params, batch=batch))
  for _ in range(4):
    out, state = update(state)
  dpsco_jax.raise_if_refused(state)   # every step within the capacity
  out, state = update(state)
  assert all(np.all(np.isnan(np.asarray(leaf)))
             for leaf in jax.tree_util.tree_leaves(out))
  with pytest.raises(dpsco_jax.PrivacyGuardError, match='capacity'):
    dpsco_jax.raise_if_refused(state)


@pytest.mark.parametrize('kwargs,match', [
    (dict(l2_clip=0.0), 'l2_clip'),
    (dict(l2_clip=-1.0), 'l2_clip'),
    (dict(l2_clip=float('inf')), 'l2_clip'),
    (dict(noise_multiplier=-0.5), 'noise_multiplier'),
    (dict(noise_multiplier=float('nan')), 'noise_multiplier'),
    (dict(key='zero'), 'key'),
    (dict(num_steps=None), 'num_steps'),
    (dict(num_steps=0), 'num_steps'),
    (dict(normalize_by=0), 'normalize_by'),
])
def test_bad_construction_arguments(kwargs, match):
  args = dict(l2_clip=1.0, noise_multiplier=1.0, key=0, num_steps=10)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    dpsco_jax.dpsgd(loss_fn, **args)


def test_bad_update_arguments():
  params, batch = make_problem()
  tx = dpsco_jax.dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=1.0, key=0,
                       num_steps=4)
  state = tx.init(params)
  with pytest.raises(ValueError, match='batch is required'):
    tx.update(None, state, params)
  with pytest.raises(ValueError, match='params are required'):
    tx.update(None, state, None, batch=batch)
  single_example = jax.tree_util.tree_map(lambda x: x[0], batch)
  with pytest.raises(ValueError, match='leading example axis'):
    tx.update(None, state, params, batch=single_example)
  ragged = dict(batch, y=batch['y'][:5])
  with pytest.raises(ValueError, match='disagree'):
    tx.update(None, state, params, batch=ragged)
  with pytest.raises(ValueError, match='normalize_by'):
    tx.update(None, state, params, batch=batch,
              batch_mask=jnp.ones(32, bool))


def test_state_params_mismatch_is_refused():
  params, batch = make_problem()
  tx = dpsco_jax.dpftrl(loss_fn, l2_clip=1.0, noise_multiplier=1.0, key=0,
                        num_steps=4, honaker=True)
  other_params = {'w': jnp.zeros((7, 3)), 'b': jnp.zeros((3,))}
  state = tx.init(other_params)
  # A check of shapes: refused while the step is traced, before anything
  # runs (eagerly it would first run every op of the step).
  with pytest.raises(ValueError, match='does not match'):
    jax.jit(lambda s: tx.update(None, s, params, batch=batch))(state)


@pytest.mark.parametrize('algorithm', ['dpsgd', 'dpftrl', 'dpftrl_honaker'])
def test_accounted_mechanism_is_the_one_that_adds_the_noise(algorithm):
  """`*_mechanism` (what the accountant sees) draws exactly the added noise."""
  batch_size, clip, z, steps = 4, 0.5, 2.0, 6
  params = {'w': jnp.zeros((5, 3)), 'b': jnp.zeros((3,))}
  batch = {'x': jnp.ones((batch_size, 2)), 'y': jnp.zeros((batch_size,), int)}
  kwargs = dict(l2_clip=clip, noise_multiplier=z, key=11, num_steps=steps)
  if algorithm == 'dpsgd':
    tx = dpsco_jax.dpsgd(zero_loss, **kwargs)
    mechanism = dpsco_jax.dpsgd_mechanism(steps)
  else:
    honaker = algorithm.endswith('honaker')
    tx = dpsco_jax.dpftrl(zero_loss, restart_every=4, honaker=honaker,
                          **kwargs)
    mechanism = dpsco_jax.dpftrl_mechanism(steps, 4, honaker)
  outputs = noise_outputs(tx, params, batch, steps)
  noise_state = mechanism.init(params, jax.random.key(11))
  next_noise = jax.jit(mechanism.next)
  for t in range(steps):
    drawn, noise_state = next_noise(noise_state, params)
    expected = np.concatenate([np.ravel(x) for x in
                               jax.tree_util.tree_leaves(drawn)])
    np.testing.assert_allclose(outputs[t], expected * z * clip / batch_size,
                               rtol=1e-5, atol=1e-7)
