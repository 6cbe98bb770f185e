"""Batch samplers: the batches they form are the ones their accounting assumes."""

import warnings
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import samplers


def test_fixed_order_repeats_the_same_batches_every_epoch():
  sampler = batching.FixedOrderBatches(103, batch_size=10, num_epochs=3,
                                       seed=4)
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
      batching.FixedOrderBatches(50, 8, num_epochs=3, seed=2),
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
  got = list(batching.FixedOrderBatches(50, 8, num_epochs=2, seed=4))
  np.testing.assert_array_equal(np.stack(got), np.concatenate([order, order]))
  rng = np.random.default_rng(5)
  for indices, mask in batching.PoissonBatches(40, 0.2, 9, seed=5):
    np.testing.assert_array_equal(indices[mask],
                                  np.flatnonzero(rng.random(40) < 0.2))


# ----------------------------------------------------- fixed_order_guard

UPDATES = jnp.ones(3)


def guard_steps(guard, batches, masks=None):
  """Eager updates of `guard` over `batches`; returns the last state."""
  state = guard.init(None)
  for t, ids in enumerate(batches):
    mask = None if masks is None else masks[t]
    out, state = guard.update(UPDATES, state, example_ids=np.asarray(ids),
                              batch_mask=mask)
    np.testing.assert_array_equal(out, UPDATES)
  return state


def test_guard_accepts_fixed_order_batches():
  sampler = batching.FixedOrderBatches(50, 8, num_epochs=3, seed=2)
  guard = batching.fixed_order_guard(sampler.steps_per_epoch,
                                     num_examples=50)
  state = guard_steps(guard, list(sampler))
  # One bit per example of the first epoch (48 of the 50), set exactly once.
  bits = np.unpackbits(np.asarray(state.seen).view(np.uint8))
  assert bits.sum() == 48 and int(state.step) == 18


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
def test_guard_refuses_an_example_twice_in_a_batch(jit):
  guard = batching.fixed_order_guard(2, num_examples=10)
  update = lambda state, ids: guard.update(UPDATES, state, example_ids=ids)
  if jit:
    update = jax.jit(update)
  state = guard.init(None)
  with pytest.raises(dpsco_jax.PrivacyGuardError) as info:
    dpsco_jax.raise_if_refused(update(state, jnp.array([0, 1, 2, 1])))
  assert 'the same example id twice' in str(info.value)


def test_guard_refuses_an_example_twice_in_the_first_epoch():
  guard = batching.fixed_order_guard(3, num_examples=10)
  state = guard_steps(guard, [[0, 1, 2], [3, 4, 5]])
  with pytest.raises(ValueError, match='earlier batch of the first epoch'):
    guard.update(UPDATES, state, example_ids=np.array([6, 7, 1]))
  # The same batches one epoch later are what FixedOrder expects.
  guard_steps(guard, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]])


@pytest.mark.parametrize('bad_id', [10, -1, 2 ** 31 - 1])
def test_guard_refuses_an_id_outside_the_training_set(bad_id):
  guard = batching.fixed_order_guard(2, num_examples=10)
  with pytest.raises(ValueError, match=r'outside \[0, 10\)'):
    guard.update(UPDATES, guard.init(None),
                 example_ids=np.array([0, bad_id], np.int32))


def test_guard_ignores_masked_padding_even_repeated_or_out_of_range():
  guard = batching.fixed_order_guard(2, num_examples=10)
  keep = np.array([True, True, True, False, False, False])
  batches = [[0, 1, 2, 0, 0, 0], [3, 4, 5, 0, -1, 99]]
  guard_steps(guard, batches * 3, [keep] * 6)
  # Padding sharing a kept id's value hides neither a repeat in the batch
  # (the kept copies become neighbours when sorted) nor a real change.
  with pytest.raises(ValueError, match='the same example id twice'):
    guard.update(UPDATES, guard.init(None),
                 example_ids=np.array([4, 4, 1, 4]),
                 batch_mask=np.array([True, False, True, True]))


def test_guard_refusal_under_jit_poisons_the_updates():
  """Under jit the refused step's updates are NaN, and so are the next's."""
  guard = batching.fixed_order_guard(2, num_examples=10)
  step = jax.jit(lambda state, ids: guard.update(UPDATES, state,
                                                 example_ids=ids))
  out, state = step(guard.init(None), jnp.array([0, 1]))
  assert np.all(np.asarray(out) == 1.0)
  out, state = step(state, jnp.array([2, 0]))  # 0 again in the first epoch
  assert np.all(np.isnan(np.asarray(out)))
  out, state = step(state, jnp.array([3, 4]))  # fine, but after a refusal
  assert np.all(np.isnan(np.asarray(out)))
  assert int(state.refusal.step) == 1


def test_guard_gathers_the_ids_of_all_devices():
  """Each (vmapped) device holds a shard: a repeat across devices counts."""
  guard = batching.fixed_order_guard(2, num_examples=16, axis_name='d')
  step = jax.vmap(lambda state, ids: guard.update(UPDATES, state,
                                                  example_ids=ids),
                  in_axes=(None, 0), out_axes=(0, None), axis_name='d')
  out, state = step(guard.init(None), jnp.arange(8).reshape(4, 2))
  assert np.all(np.asarray(out) == 1.0)
  # Example 3 on device 0 and on device 2 of the second batch.
  with pytest.raises(dpsco_jax.PrivacyGuardError) as info:
    dpsco_jax.raise_if_refused(
        step(state, jnp.array([[8, 3], [9, 10], [11, 3], [12, 13]])))
  assert 'the same example id twice' in str(info.value)


def test_guard_state_stays_replicated_under_shard_map():
  devices = jax.device_count()
  mesh = jax.make_mesh((devices,), ('d',))
  guard = batching.fixed_order_guard(2, num_examples=4 * devices,
                                     axis_name='d')
  step = jax.jit(jax.shard_map(
      lambda state, ids: guard.update(UPDATES, state, example_ids=ids),
      mesh=mesh, in_specs=(P(), P('d')), out_specs=(P(), P())))
  state = jax.device_put(guard.init(None), NamedSharding(mesh, P()))
  order = np.arange(4 * devices).reshape(2, 2 * devices)
  for ids in list(order) * 2:
    out, state = step(state, jax.device_put(ids, NamedSharding(mesh, P('d'))))
    assert np.all(np.asarray(out) == 1.0)
  bits = np.unpackbits(np.asarray(state.seen).view(np.uint8))
  assert bits.sum() == 4 * devices and int(state.step) == 4


def test_guard_needs_the_training_set_size():
  with pytest.raises(TypeError, match='num_examples'):
    batching.fixed_order_guard(3)  # pylint: disable=missing-kwoa
  with pytest.raises(ValueError, match='num_examples'):
    batching.fixed_order_guard(3, num_examples=0)


def test_a_dropped_remainder_is_announced(monkeypatch):
  # Once per process for each sampler kind and sizes (a set the samplers'
  # module keeps): start afresh.
  monkeypatch.setattr(samplers, '_REMAINDERS_ANNOUNCED', set())
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    exact = batching.FixedOrderBatches(1000, 100)
    assert not caught and exact.unused_per_epoch == 0
    for sampler in (batching.FixedOrderBatches(1000, 300),
                    batching.ShuffledBatches(1000, 300, seed=0)):
      assert sampler.unused_per_epoch == 100
  assert [w.category for w in caught] == [batching.RemainderWarning] * 2
  assert '100 example(s) per epoch are not used' in str(caught[0].message)


def test_every_sampler_names_its_seed_seed_and_reseeds_alike():
  samplers = [batching.FixedOrderBatches(50, 8, num_epochs=2, seed=1),
              batching.ShuffledBatches(50, 8, num_epochs=2, seed=1),
              batching.PoissonBatches(50, 0.2, num_steps=4, seed=1)]
  for sampler in samplers:
    other = batching.reseeded(sampler, 2)
    assert type(other) is type(sampler) and other.seed == 2
    assert other.participation == sampler.participation
    first = [np.asarray(b[0] if isinstance(b, tuple) else b) for b in sampler]
    second = [np.asarray(b[0] if isinstance(b, tuple) else b) for b in other]
    assert any(not np.array_equal(a, b) for a, b in zip(first, second))
  # The old spelling still works, with a warning, and means the same.
  with pytest.warns(DeprecationWarning, match='order_seed'):
    old = batching.FixedOrderBatches(50, 8, num_epochs=2, order_seed=1)
  assert old == samplers[0]
  with pytest.raises(TypeError, match='seed= alone'):
    batching.FixedOrderBatches(50, 8, seed=1, order_seed=1)
  with pytest.raises(ValueError, match='no seed'):
    batching.reseeded(object(), 1)
