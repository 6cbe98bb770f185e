"""`runs.whole_run` / `Plan.run`: a whole run of a plan as one program.

The whole run is the plan's own step loop (`plan.batches_of` then
`plan.step`) in one `lax.scan`, with the guards of the plan's
transformation on: the same params to float tolerance for the same seeds and
keys, run i of `num_runs` replayable alone, and a refused step raised.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import batching
from dpsco_jax import guards
from dpsco_jax import runs

N, DIM, CLASSES, BATCH = 32, 4, 3, 8


class Linear(nn.Module):
  """A one-layer classifier, as a user writes it."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(x)


MODEL = Linear()


def loss_fn(params, example):
  logits = MODEL.apply(params, example['x'])
  return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])


def accuracy(params, data):
  logits = MODEL.apply(params, data['x'])
  return jnp.mean(jnp.argmax(logits, -1) == data['y'])


@functools.lru_cache(maxsize=None)
def _problem():
  rng = np.random.default_rng(0)
  data = {'x': rng.normal(size=(N, DIM)).astype(np.float32),
          'y': rng.integers(0, CLASSES, N).astype(np.int32)}
  params = MODEL.init(jax.random.key(0), jnp.zeros(DIM))
  return data, params


@functools.lru_cache(maxsize=None)
def _plan(kind):
  if kind == 'poisson':
    return dpsco_jax.plans.dpsgd(
        loss_fn, optimizer=optax.sgd(0.5), num_examples=N, batch_size=BATCH,
        epochs=2, l2_clip=1.0, noise_multiplier=1.0, delta=1e-5,
        sampling='poisson', seed=3, key=4, clipping_method='vmap')
  return dpsco_jax.plans.dpmemf(
      loss_fn, optimizer=optax.sgd(0.5, momentum=0.9), num_examples=N,
      batch_size=BATCH, epochs=2, l2_clip=1.0, noise_multiplier=1.0,
      delta=1e-5, seed=3, key=4, clipping_method='vmap')


def _step_loop(plan, params, data):
  opt_state = plan.init(params)
  curve = []
  for inputs in plan.batches_of(data):
    params, opt_state = plan.step(params, opt_state, inputs)
    curve.append(accuracy(params, data))
  plan.finish(opt_state)
  return params, opt_state, np.array(curve)


def _assert_close(a, b):
  as_data = lambda leaf: (jax.random.key_data(leaf)
                          if dpsco_jax.keys.is_typed_key(leaf) else leaf)
  a, b = (jax.tree_util.tree_map(as_data, tree) for tree in (a, b))
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize('kind', ['poisson', 'fixed'])
def test_whole_run_equals_the_plans_step_loop(kind):
  data, params = _problem()
  plan = _plan(kind)
  want_params, want_state, want_curve = _step_loop(plan, params, data)
  result = plan.run(params, data,
                    metric_fn=lambda p, s: accuracy(p, _problem()[0]))
  _assert_close(result.params, want_params)
  _assert_close(result.opt_state, want_state)
  np.testing.assert_allclose(result.metrics, want_curve, atol=1e-6)
  # The noise was drawn: the private run is not the noiseless one.
  assert not np.allclose(jax.tree_util.tree_leaves(result.params)[0],
                         jax.tree_util.tree_leaves(params)[0])


def test_a_full_batch_plan_runs_all_its_rounds_on_all_the_data():
  data, params = _problem()
  plan = dpsco_jax.plans.dp_gd(
      loss_fn, learning_rate=0.5, num_rounds=3, grad_clip=1.0,
      num_examples=N, noise_multiplier=1.0, delta=1e-5, key=4,
      clipping_method='vmap')
  want, opt_state = params, plan.init(params)
  for _ in range(plan.num_steps):
    want, opt_state = plan.step(want, opt_state, {'batch': data})
  plan.finish(opt_state)
  _assert_close(plan.run(params, data).params, want)


def test_run_i_of_many_is_the_run_with_its_seed_and_key_alone():
  data, params = _problem()
  plan = _plan('poisson')
  many = runs.whole_run(plan, params, data, key=7, num_runs=3)
  seeds, keys = runs.sampler_seeds(7, 3), runs.run_keys(7, 3)
  for i in (0, 2):
    alone = runs.whole_run(plan, params, data, seed=seeds[i], key=keys[i])
    _assert_close(jax.tree_util.tree_map(lambda leaf: leaf[i], many.params),
                  alone.params)
  # Runs draw their own batches and noise.
  kernels = jax.tree_util.tree_leaves(many.params)[0]
  assert not np.allclose(kernels[0], kernels[1])
  with pytest.raises(ValueError, match='need key='):
    runs.whole_run(plan, params, data, num_runs=2)
  with pytest.raises(ValueError, match='num_examples = 32'):
    runs.whole_run(plan, params, {'x': np.zeros((3, DIM))})


def test_poisson_runs_are_padded_to_one_width_with_the_padding_masked():
  plan = _plan('poisson')
  indices, masks = runs.run_batches(plan.batches, runs.sampler_seeds(0, 20))
  assert indices.shape[:2] == (20, plan.num_steps)
  assert indices.shape[2] % plan.batches.pad_to_multiple == 0
  for run, seed in enumerate(runs.sampler_seeds(0, 20)[:3]):
    drawn = batching.reseeded(plan.batches, seed).iterate()
    for step, (ids, keep) in enumerate(drawn):
      np.testing.assert_array_equal(indices[run, step][masks[run, step]],
                                    ids[keep])


def test_a_refused_step_inside_a_whole_run_raises():
  # The fixed-order plan fed batches reshuffled every epoch: its order
  # check refuses the first step of epoch 2, inside the compiled run.
  data, params = _problem()
  plan = _plan('fixed')
  reshuffled = dataclasses.replace(plan, batches=batching.ShuffledBatches(
      N, batch_size=BATCH, num_epochs=2, seed=3))
  with pytest.raises(guards.PrivacyGuardError) as error:
    reshuffled.run(params, data)
  assert error.value.step == N // BATCH
  assert 'plan.batches_of(data)' in str(error.value)
