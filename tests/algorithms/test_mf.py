"""DP-MEMF (paper 001 Algorithm 2): reductions, noise, accounting, order."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import noise
from dpsco_jax import strategies
from tests.algorithms.test_baselines import loss_fn
from tests.algorithms.test_baselines import make_problem
from tests.algorithms.test_baselines import run_sgd_reference
from tests.algorithms.test_baselines import zero_loss

NUM_EPOCHS, STEPS_PER_EPOCH, BATCH = 2, 3, 8
NUM_EXAMPLES = STEPS_PER_EPOCH * BATCH
NUM_STEPS = NUM_EPOCHS * STEPS_PER_EPOCH


@functools.cache
def strategy():
  return strategies.optimize_strategy(
      strategies.workload(NUM_STEPS, 'true', momentum=0.9), NUM_EPOCHS,
      cache_dir=None)


def dataset(seed=0):
  """The examples as NumPy arrays: a batch is gathered on the host (an
  eager gather would compile a program per batch shape)."""
  _, data = make_problem(batch_size=NUM_EXAMPLES, seed=seed)
  return jax.tree_util.tree_map(np.asarray, data)


def fixed_order():
  return list(batching.FixedOrderBatches(NUM_EXAMPLES, BATCH, NUM_EPOCHS,
                                         seed=3))


def make_step(tx):
  @jax.jit
  def step(params, state, batch, ids):
    updates, state = tx.update(None, state, params, batch=batch,
                               example_ids=ids)
    return optax.apply_updates(params, updates), state
  return step


def train(tx, params, data, order):
  state = tx.init(params)
  step = make_step(tx)
  for indices in order:
    batch = jax.tree_util.tree_map(lambda x, i=indices: x[i], data)
    params, state = step(params, state, batch, jnp.asarray(indices))
  return params, state


def test_zero_noise_huge_clip_is_non_private_momentum_sgd():
  params, _ = make_problem()
  data, order = dataset(), fixed_order()
  tx = optax.chain(
      dpsco_jax.dpmemf(loss_fn, l2_clip=1e6, noise_multiplier=0.0,
                       strategy=strategy(), steps_per_epoch=STEPS_PER_EPOCH,
                       num_examples=NUM_EXAMPLES, key=0),
      optax.sgd(0.1, momentum=0.9))
  got, _ = train(tx, params, data, order)
  batches = [jax.tree_util.tree_map(lambda x, i=i: x[i], data) for i in order]
  want = run_sgd_reference(params, batches)
  for a, b in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(np.asarray(got['w']) - np.asarray(params['w']))) > 1e-3


def test_noise_is_clip_over_batch_times_inverse_strategy_times_z():
  """Algorithm 2 corrected: (Ccl / B) z (C^-1 xi)_t, xi the i.i.d. draws."""
  params, _ = make_problem()
  data, order = dataset(), fixed_order()
  clip, multiplier = 0.5, 3.0
  tx = dpsco_jax.dpmemf(zero_loss, l2_clip=clip, noise_multiplier=multiplier,
                        strategy=strategy(), steps_per_epoch=STEPS_PER_EPOCH,
                        num_examples=NUM_EXAMPLES, key=11)
  state = tx.init(params)
  # Compiled, as users run it: one program, not every op eagerly per step.
  update = jax.jit(lambda state, batch, ids: tx.update(
      None, state, params, batch=batch, example_ids=ids))
  outputs = []
  for indices in order:
    batch = jax.tree_util.tree_map(lambda x, i=indices: x[i], data)
    updates, state = update(state, batch, jnp.asarray(indices))
    outputs.append(np.concatenate(
        [np.ravel(u) for u in jax.tree_util.tree_leaves(updates)]))
  gaussian = noise.gaussian(NUM_STEPS)
  noise_state = gaussian.init(params, jax.random.key(11))
  next_noise = jax.jit(gaussian.next)
  draws = []
  for _ in range(NUM_STEPS):
    z, noise_state = next_noise(noise_state, params)
    draws.append(np.concatenate(
        [np.ravel(leaf) for leaf in jax.tree_util.tree_leaves(z)]))
  explicit = scipy.linalg.solve_triangular(strategy(), np.stack(draws),
                                           lower=True)
  np.testing.assert_allclose(np.stack(outputs),
                             clip * multiplier / BATCH * explicit,
                             rtol=1e-4, atol=1e-6)


def test_zcdp_calibration_of_an_optimized_strategy_matches_the_paper():
  """Sensitivity 1, so z = 1 / sqrt(2 rho): 2.720 at (2, 1e-6) (notes §2.4);
  the PLD accountant needs less noise for the same guarantee."""
  mechanism = dpsco_jax.dpmemf_mechanism(strategy())
  participation = accounting.FixedOrder(NUM_EPOCHS, STEPS_PER_EPOCH)
  zcdp = accounting.calibrate_noise_multiplier(
      mechanism, participation, 2.0, 1e-6, method='zcdp')
  assert zcdp == pytest.approx(1 / np.sqrt(2 * 0.0675739), rel=1e-5)
  assert zcdp == pytest.approx(2.720, abs=1e-3)
  pld = accounting.calibrate_noise_multiplier(mechanism, participation, 2.0,
                                              1e-6)
  assert pld < zcdp
  assert accounting.epsilon_spent(mechanism, pld, participation,
                                  1e-6) <= 2.0


def test_reshuffled_epoch_is_refused_eagerly():
  params, _ = make_problem()
  data = dataset()
  reshuffled = list(batching.ShuffledBatches(NUM_EXAMPLES, BATCH, NUM_EPOCHS,
                                             seed=1))
  tx = dpsco_jax.dpmemf(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                        strategy=strategy(), steps_per_epoch=STEPS_PER_EPOCH,
                        num_examples=NUM_EXAMPLES, key=0)
  state = tx.init(params)
  with pytest.raises(ValueError, match='reshuffles'):
    for indices in reshuffled:
      batch = jax.tree_util.tree_map(lambda x, i=indices: x[i], data)
      _, state = tx.update(None, state, params, batch=batch,
                           example_ids=indices)
  # It got through the first epoch and stopped at the first changed batch.
  assert int(state[1].step) == STEPS_PER_EPOCH


def test_reshuffled_epoch_is_refused_under_jit():
  params, _ = make_problem()
  data, order = dataset(), fixed_order()
  # Same batches, but two positions of the second epoch swapped.
  order[STEPS_PER_EPOCH], order[STEPS_PER_EPOCH + 1] = (
      order[STEPS_PER_EPOCH + 1], order[STEPS_PER_EPOCH])
  tx = optax.chain(
      dpsco_jax.dpmemf(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                       strategy=strategy(), steps_per_epoch=STEPS_PER_EPOCH,
                       num_examples=NUM_EXAMPLES, key=0),
      optax.sgd(0.1))
  with pytest.raises(dpsco_jax.PrivacyGuardError) as info:
    dpsco_jax.raise_if_refused(train(tx, params, data, order))
  assert 'reshuffles' in str(info.value)


def test_order_within_a_batch_does_not_matter():
  params, _ = make_problem()
  data, order = dataset(), fixed_order()
  order = [idx if t < STEPS_PER_EPOCH else idx[::-1]
           for t, idx in enumerate(order)]
  tx = optax.chain(
      dpsco_jax.dpmemf(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                       strategy=strategy(), steps_per_epoch=STEPS_PER_EPOCH,
                       num_examples=NUM_EXAMPLES, key=0),
      optax.sgd(0.1))
  got, _ = train(tx, params, data, order)
  jax.effects_barrier()
  assert all(np.all(np.isfinite(leaf))
             for leaf in jax.tree_util.tree_leaves(got))


def test_example_ids_are_required_unless_the_check_is_off():
  params, batch = make_problem(batch_size=BATCH)
  kwargs = dict(l2_clip=1.0, noise_multiplier=1.0, strategy=strategy(),
                steps_per_epoch=STEPS_PER_EPOCH, num_examples=NUM_EXAMPLES,
                key=0)
  tx = dpsco_jax.dpmemf(loss_fn, **kwargs)
  with pytest.raises(ValueError, match='example_ids'):
    tx.update(None, tx.init(params), params, batch=batch)
  unchecked = dpsco_jax.dpmemf(loss_fn, check_order=False, **kwargs)
  unchecked.update(None, unchecked.init(params), params, batch=batch)


def test_refuses_to_run_past_the_strategy():
  params, _ = make_problem()
  data, order = dataset(), fixed_order()
  tx = dpsco_jax.dpmemf(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                        strategy=strategy(), steps_per_epoch=STEPS_PER_EPOCH,
                        num_examples=NUM_EXAMPLES, key=0)
  state = tx.init(params)
  for indices in order + order[:1]:
    batch = jax.tree_util.tree_map(lambda x, i=indices: x[i], data)
    if indices is order[0] and int(state[0].noise.step) == NUM_STEPS:
      with pytest.raises(ValueError, match='capacity'):
        tx.update(None, state, params, batch=batch, example_ids=indices)
      return
    _, state = tx.update(None, state, params, batch=batch,
                         example_ids=indices)
  pytest.fail('the step past the strategy was not refused')


_DEVICES_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
import dpsco_jax
from dpsco_jax import batching
devices = 4
guard = batching.fixed_order_guard(2, num_examples=100, axis_name='d')
ids = np.arange(32).reshape(2, devices, 4)  # [position, device, ids]
step = lambda state, ids: guard.update(jnp.ones(3), state, example_ids=ids)
pmapped = jax.pmap(step, axis_name='d', in_axes=(None, 0))
first = lambda tree: jax.tree_util.tree_map(lambda x: x[0], tree)
state = guard.init(None)
for position in range(2):
  out, states = pmapped(state, ids[position])
  state = first(states)
# Second epoch: the same set, scattered differently over the devices.
out, states = pmapped(state, ids[0].ravel()[::-1].reshape(devices, 4))
dpsco_jax.raise_if_refused(states)
print('MOVED_ACCEPTED', bool(np.all(np.asarray(out) == 1.0)))
changed = ids[1].copy()
changed[2, 0] = 99  # one example of one device replaced
try:
  out, states = pmapped(first(states), changed)
  print('ALL_NAN', bool(np.all(np.isnan(np.asarray(out)))))
  dpsco_jax.raise_if_refused(states)
  print('RAISED False')
except dpsco_jax.PrivacyGuardError as error:
  print('RAISED', 'reshuffles' in str(error))
"""


def test_guard_across_devices_uses_the_global_batch():
  """Under pmap each device holds a shard of the ids; the fingerprint is of
  the whole batch, so moving examples between devices is not a change, and
  one replaced example on one device is refused on all of them.

  Runs in a subprocess: the refusal raises from a host callback on every
  device, and those errors must not leak into the other tests' runtime.
  """
  env = dict(os.environ)
  # This process's XLA flags (tests/conftest.py: 8 virtual devices, the
  # quicker-to-compile loop emitters) and optimization level, so the
  # subprocess compiles its programs as the suite does.
  flags = env.get('XLA_FLAGS', '')
  if 'xla_force_host_platform_device_count' not in flags:
    flags += ' --xla_force_host_platform_device_count=8'
  env['XLA_FLAGS'] = flags.strip()
  env['JAX_DISABLE_MOST_OPTIMIZATIONS'] = str(
      int(jax.config.read('jax_disable_most_optimizations')))
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  result = subprocess.run([sys.executable, '-c', _DEVICES_SCRIPT], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
  output = result.stdout + result.stderr
  assert 'MOVED_ACCEPTED True' in result.stdout, output
  assert 'RAISED True' in result.stdout, output
  assert 'ALL_NAN False' not in result.stdout, output


@pytest.mark.parametrize('kwargs,match', [
    (dict(steps_per_epoch=4), 'whole number of epochs'),
    (dict(steps_per_epoch=0), 'steps_per_epoch'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier'),
    (dict(l2_clip=0.0), 'clip'),
    (dict(strategy=np.triu(np.ones((6, 6)))), 'lower-triangular'),
    (dict(num_examples=None), 'num_examples'),
    (dict(num_examples=0), 'num_examples'),
])
def test_bad_arguments_raise(kwargs, match):
  arguments = dict(l2_clip=1.0, noise_multiplier=1.0, strategy=strategy(),
                   steps_per_epoch=STEPS_PER_EPOCH,
                   num_examples=NUM_EXAMPLES, key=0)
  arguments.update(kwargs)
  with pytest.raises(ValueError, match=match):
    dpsco_jax.dpmemf(loss_fn, **arguments)


def test_guard_needs_an_estimator_before_it():
  guard = batching.fixed_order_guard(3, num_examples=10)
  with pytest.raises(ValueError, match='after the estimator'):
    guard.update(None, guard.init(None), example_ids=np.arange(4))
