"""Amplified banded MF: cyclic Poisson sampling, its accounting and guard."""

import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import noise
from dpsco_jax import plans
from dpsco_jax import strategies

N, DIM, BATCH, EPOCHS, BANDS, DELTA = 60, 3, 5, 2, 3, 1e-5


def _loss(params, example):
  return (example['x'] @ params - example['y']) ** 2


def _data():
  rng = np.random.default_rng(0)
  return {'x': rng.normal(size=(N, DIM)).astype(np.float32),
          'y': rng.normal(size=N).astype(np.float32)}


def _plan(**kwargs):
  return plans.dpmemf(
      _loss, optimizer=optax.sgd(0.1), num_examples=N, batch_size=BATCH,
      epochs=EPOCHS, l2_clip=1.0, delta=DELTA, strategy='banded', bands=BANDS,
      sampling='cyclic_poisson', momentum=0.9, seed=0, key=0, method='rdp',
      **kwargs)


def _independent_epsilon(noise_multiplier, sampling_probability, sensitivity,
                         participations):
  """Each participation a Poisson-subsampled Gaussian, composed one by one."""
  one = dp_accounting.PoissonSampledDpEvent(
      sampling_probability,
      dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity))
  accountant = dp_accounting.rdp.RdpAccountant(
      neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
  for _ in range(participations):
    accountant.compose(one)
  with accounting.quiet_excluded_orders():
    return accountant.get_epsilon(DELTA)


def test_amplified_banded_epsilon_equals_an_independent_composition():
  plan = _plan(noise_multiplier=2.0)
  # From the description alone: q = B b / n, T = k n / B, ceil(T / b)
  # participations of an example of partition 0.
  steps = EPOCHS * N // BATCH
  assert plan.num_steps == steps
  strategy = plan.mechanism.encoder_matrix()
  assert np.all(np.triu(strategy, 1) == 0)
  assert np.all(np.tril(strategy, -BANDS) == 0)
  sensitivity = np.linalg.norm(strategy, axis=0).max()
  assert sensitivity == pytest.approx(1.0)
  expected = _independent_epsilon(2.0, BATCH * BANDS / N, sensitivity,
                                  math.ceil(steps / BANDS))
  assert plan.epsilon == pytest.approx(expected, rel=1e-9)
  # The first s steps release the rows < s of C x + z: ceil(s / b)
  # participations, each of sensitivity at most the largest column norm of
  # C[:s, :s].
  for s in (1, 4, 11):
    prefix = np.linalg.norm(strategy[:s, :s], axis=0).max()
    assert plan.epsilon_at(s) == pytest.approx(_independent_epsilon(
        2.0, BATCH * BANDS / N, prefix, math.ceil(s / BANDS)), rel=1e-9)
  # Amplification: far below the same noise without it (FixedOrder).
  fixed = accounting.epsilon_spent(
      noise.matrix_factorization(strategy), 2.0,
      accounting.FixedOrder(EPOCHS, steps // EPOCHS), DELTA, method='rdp')
  assert plan.epsilon < fixed


def test_the_run_forms_the_accounted_batches():
  plan = _plan(noise_multiplier=2.0)
  params = jnp.zeros(DIM)
  state = plan.init(params)
  step = jax.jit(lambda s, p, inputs: plan.transformation.update(
      None, s, p, **inputs))
  steps = 0
  for t, inputs in enumerate(plan.batches_of(_data())):
    ids = np.asarray(inputs['example_ids'])[np.asarray(inputs['batch_mask'])]
    assert np.all(ids % BANDS == t % BANDS)
    assert len(set(ids.tolist())) == len(ids)
    updates, state = step(state, params, inputs)
    params = optax.apply_updates(params, updates)
    steps += 1
  assert steps == plan.num_steps
  assert np.all(np.isfinite(params))
  assert plan.describe()['noise_buffers'] == BANDS - 1


def test_the_guard_refuses_an_example_of_another_partition():
  guard = batching.poisson_batch_guard(
      num_examples=N, sampling_probability=0.25, pad_to_multiple=4,
      num_partitions=BANDS)
  state = guard.init(None)
  updates = jnp.zeros(2)
  mask = jnp.array([True, True, False, False])
  _, state = guard.update(updates, state, example_ids=jnp.array([0, 3, 0, 0]),
                          batch_mask=mask)
  _, state = guard.update(updates, state, example_ids=jnp.array([1, 4, 0, 0]),
                          batch_mask=mask)
  with pytest.raises(ValueError, match='another partition'):
    guard.update(updates, state, example_ids=jnp.array([2, 3, 0, 0]),
                 batch_mask=mask)


def test_sampler_resumes_with_the_same_batches():
  sampler = batching.CyclicPoissonBatches(50, 0.4, 12, 4, seed=3)
  batches = [tuple(indices[mask]) for indices, mask in sampler]
  resumed = [tuple(indices[mask]) for indices, mask in sampler.iterate(5)]
  assert resumed == batches[5:]
  assert sampler.participation == accounting.CyclicPoissonSampling(0.4, 12, 4)


def test_a_strategy_wider_than_the_partitions_is_refused():
  dense = strategies.optimize_strategy(strategies.workload(12), 1,
                                       cache_dir=False)
  with pytest.raises(ValueError, match='share a row'):
    accounting.epsilon_spent(noise.matrix_factorization(dense), 2.0,
                             accounting.CyclicPoissonSampling(0.2, 12, 3),
                             DELTA)
  banded = strategies.optimize_strategy(strategies.workload(12), 1, bands=4,
                                        cache_dir=False)
  with pytest.raises(ValueError, match='share a row'):
    accounting.epsilon_spent(noise.matrix_factorization(banded), 2.0,
                             accounting.CyclicPoissonSampling(0.2, 12, 3),
                             DELTA)


def test_plan_refusals():
  with pytest.raises(ValueError, match='needs bands'):
    plans.dpmemf(_loss, optimizer=optax.sgd(0.1), num_examples=N,
                 batch_size=BATCH, epochs=EPOCHS, l2_clip=1.0, delta=DELTA,
                 noise_multiplier=1.0, strategy='banded',
                 sampling='cyclic_poisson')
  with pytest.raises(ValueError, match='banded strategy'):
    plans.dpmemf(_loss, optimizer=optax.sgd(0.1), num_examples=N,
                 batch_size=BATCH, epochs=EPOCHS, l2_clip=1.0, delta=DELTA,
                 noise_multiplier=1.0, strategy='blt', bands=BANDS,
                 sampling='cyclic_poisson')
  with pytest.raises(ValueError, match='exceeds num_examples'):
    plans.dpmemf(_loss, optimizer=optax.sgd(0.1), num_examples=N,
                 batch_size=30, epochs=EPOCHS, l2_clip=1.0, delta=DELTA,
                 noise_multiplier=1.0, strategy='banded', bands=BANDS,
                 sampling='cyclic_poisson')
