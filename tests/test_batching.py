"""Batch samplers: the batches they form are the ones their accounting assumes."""

import numpy as np
import pytest

from dpsco_jax import accounting
from dpsco_jax import batching


def test_fixed_order_repeats_the_same_batches_every_epoch():
  sampler = batching.FixedOrderBatches(103, batch_size=10, num_epochs=3,
                                       order_seed=4)
  batches = list(sampler)
  assert len(batches) == sampler.num_steps == 30
  assert sampler.participation == accounting.FixedOrder(3, 10)
  for epoch in (1, 2):
    for j in range(10):
      np.testing.assert_array_equal(batches[epoch * 10 + j], batches[j])
  first_epoch = np.concatenate(batches[:10])
  assert len(np.unique(first_epoch)) == 100  # disjoint batches
  assert not np.array_equal(first_epoch, np.arange(100))  # the seeded order


def test_shuffled_uses_each_example_at_most_once_per_epoch():
  sampler = batching.ShuffledBatches(50, batch_size=8, num_epochs=4, seed=1)
  batches = list(sampler)
  assert sampler.participation == accounting.Shuffled(4, 6)
  epochs = [np.concatenate(batches[e * 6:(e + 1) * 6]) for e in range(4)]
  for epoch in epochs:
    assert len(np.unique(epoch)) == len(epoch) == 48
  assert not np.array_equal(epochs[0], epochs[1])  # reshuffled


def test_poisson_batches_are_independent_bernoulli_with_padding():
  n, q, steps = 400, 0.05, 600
  sampler = batching.PoissonBatches(n, q, steps, seed=3, pad_to_multiple=16)
  assert sampler.participation == accounting.PoissonSampling(q, steps)
  assert sampler.expected_batch_size == pytest.approx(20.0)
  sizes, hits = [], np.zeros(n)
  for indices, mask in sampler:
    assert len(indices) % 16 == 0 and len(indices) == len(mask)
    chosen = indices[mask]
    assert len(np.unique(chosen)) == len(chosen)
    assert not mask[len(chosen):].any()  # padding only at the end
    sizes.append(len(chosen))
    hits[chosen] += 1
  # Batch size ~ Binomial(n, q): mean nq = 20, variance nq(1-q) = 19.
  assert np.mean(sizes) == pytest.approx(20, abs=0.6)
  assert np.var(sizes) == pytest.approx(19, rel=0.2)
  # Every example is sampled about q * steps = 30 times.
  assert np.mean(hits) == pytest.approx(30, abs=1)


@pytest.mark.parametrize('make', [
    lambda: batching.FixedOrderBatches(10, batch_size=11),
    lambda: batching.FixedOrderBatches(10, batch_size=0),
    lambda: batching.ShuffledBatches(10, batch_size=2, num_epochs=0, seed=0),
    lambda: batching.PoissonBatches(10, 0.0, 5, seed=0),
    lambda: batching.PoissonBatches(10, 0.5, 0, seed=0),
])
def test_bad_sampler_arguments(make):
  with pytest.raises(ValueError):
    make()


def test_samplers_resume_where_they_stopped():
  samplers = [
      batching.FixedOrderBatches(50, 8, num_epochs=3, order_seed=2),
      batching.ShuffledBatches(50, 8, num_epochs=3, seed=2),
  ]
  for sampler in samplers:
    full = list(sampler)
    for start in (0, 1, 6, 7, 17, 18):
      rest = list(sampler.iterate(start_step=start))
      assert len(rest) == len(full) - start
      for a, b in zip(rest, full[start:]):
        np.testing.assert_array_equal(a, b)
    for step in (0, 5, 6, 17):
      np.testing.assert_array_equal(sampler.batch_at(step), full[step])
    with pytest.raises(ValueError):
      sampler.batch_at(18)
  poisson = batching.PoissonBatches(40, 0.2, 9, seed=5)
  full = list(poisson)
  for start in (0, 4, 9):
    rest = list(poisson.iterate(start))
    assert len(rest) == 9 - start
    for (a, m), (b, n) in zip(rest, full[start:]):
      np.testing.assert_array_equal(a, b)
      np.testing.assert_array_equal(m, n)
  for bad in (-1, 10, 1.5):
    with pytest.raises(ValueError):
      list(poisson.iterate(bad))


def test_iteration_draws_the_same_stream_as_one_generator_per_run():
  # The resumable iterators must keep the data order a run always had: one
  # generator per run, one permutation per epoch / n uniforms per step.
  rng = np.random.default_rng(3)
  expected = [rng.permutation(50)[:48].reshape(6, 8) for _ in range(3)]
  got = list(batching.ShuffledBatches(50, 8, num_epochs=3, seed=3))
  np.testing.assert_array_equal(np.stack(got), np.concatenate(expected))
  order = np.random.default_rng(4).permutation(50)[:48].reshape(6, 8)
  got = list(batching.FixedOrderBatches(50, 8, num_epochs=2, order_seed=4))
  np.testing.assert_array_equal(np.stack(got), np.concatenate([order, order]))
  rng = np.random.default_rng(5)
  for indices, mask in batching.PoissonBatches(40, 0.2, 9, seed=5):
    np.testing.assert_array_equal(indices[mask],
                                  np.flatnonzero(rng.random(40) < 0.2))
