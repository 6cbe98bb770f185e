"""Plans: one description, and the epsilon of what the run really did.

The central test runs every batched plan to the end on tiny data, records
the batches it really formed and the steps its noise state really took,
infers the participation pattern from those batches alone, rebuilds the
mechanism from the description (not from the plan), and checks that
`accounting.epsilon_spent` on that equals the plan's epsilon.
"""

import json
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import blt
from dpsco_jax import noise
from dpsco_jax import plans
from dpsco_jax import strategies
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms import diff2_accounting

N, DIM, BATCH, EPOCHS, DELTA = 60, 3, 10, 2, 1e-5


def _loss(params, example):
  return (example['x'] @ params - example['y']) ** 2


def _data():
  rng = np.random.default_rng(0)
  return {'x': rng.normal(size=(N, DIM)).astype(np.float32),
          'y': rng.normal(size=N).astype(np.float32)}


def _strategy(decay=0.0):
  steps = EPOCHS * (N // BATCH)
  return strategies.optimize_strategy(
      strategies.workload(steps, 'true', momentum=0.9, decay=decay), EPOCHS,
      cache_dir=False)


def _run(plan):
  """Runs the plan to the end; returns the batches and the final state."""
  params = jnp.zeros(DIM)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    state = plan.init(params)
  step = jax.jit(lambda s, p, inputs: plan.transformation.update(
      None, s, p, **inputs))
  batches = []
  for inputs in plan.batches_of(_data()):
    ids = np.asarray(inputs['example_ids'])
    if 'batch_mask' in inputs:
      ids = ids[np.asarray(inputs['batch_mask'])]
    batches.append(ids)
    updates, state = step(state, params, inputs)
    params = optax.apply_updates(params, updates)
  assert np.all(np.isfinite(params))
  return batches, state


def _noise_state(state):
  found = [leaf for leaf in jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, noise.NoiseState))
           if isinstance(leaf, noise.NoiseState)]
  assert len(found) == 1, found
  return found[0]


def _inferred_participation(batches, kind):
  """The pattern the recorded batches follow, checked from the ids alone."""
  steps = len(batches)
  if kind == 'poisson':
    for ids in batches:
      assert len(set(ids.tolist())) == len(ids)
    # The probability comes from the description (B / n), not the plan.
    return accounting.PoissonSampling(BATCH / N, steps)
  positions = {}
  for t, ids in enumerate(batches):
    assert len(set(ids.tolist())) == len(ids)
    for i in ids.tolist():
      positions.setdefault(i, []).append(t)
  epochs = max(len(p) for p in positions.values())
  per_epoch = steps // epochs
  fixed = True
  for p in positions.values():
    # At most once per epoch in every case.
    assert len({t // per_epoch for t in p}) == len(p)
    fixed &= all(t % per_epoch == p[0] % per_epoch for t in p)
  if kind == 'fixed':
    assert fixed
    return accounting.FixedOrder(epochs, per_epoch)
  return accounting.Shuffled(epochs, per_epoch)


STEPS = EPOCHS * (N // BATCH)
COMMON = dict(num_examples=N, batch_size=BATCH, l2_clip=1.0, delta=DELTA)


def _cases():
  sgd = optax.sgd(0.1, momentum=0.9)
  mf_strategy, srg_strategy = _strategy(), _strategy(0.5)
  return [
      ('dpsgd_poisson', lambda: plans.dpsgd(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0, **COMMON),
       'poisson', lambda: dpsco_jax.dpsgd_mechanism(STEPS)),
      ('dpsgd_shuffled', lambda: plans.dpsgd(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0,
          sampling='shuffled', **COMMON),
       'shuffled', lambda: dpsco_jax.dpsgd_mechanism(STEPS)),
      ('dpsgd_fixed', lambda: plans.dpsgd(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0, sampling='fixed',
          **COMMON),
       'fixed', lambda: dpsco_jax.dpsgd_mechanism(STEPS)),
      ('dpftrl_epoch_restarts', lambda: plans.dpftrl(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0, **COMMON),
       'fixed', lambda: dpsco_jax.dpftrl_mechanism(STEPS, N // BATCH)),
      ('dpftrl_one_tree_shuffled', lambda: plans.dpftrl(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0, restart=None,
          sampling='shuffled', **COMMON),
       'shuffled', lambda: dpsco_jax.dpftrl_mechanism(STEPS)),
      ('dpftrl_given_noise', lambda: plans.dpftrl(
          _loss, optimizer=sgd, epochs=EPOCHS, noise_multiplier=3.0,
          restart=4, **COMMON),
       'fixed', lambda: dpsco_jax.dpftrl_mechanism(STEPS, 4)),
      ('dpmemf', lambda: plans.dpmemf(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0,
          strategy=mf_strategy, **COMMON),
       'fixed', lambda: dpsco_jax.dpmemf_mechanism(mf_strategy)),
      ('accelerated_dp_srgd', lambda: plans.accelerated_dp_srgd(
          _loss, beta=10.0, radius=None, epsilon=2.0, **COMMON),
       'fixed', lambda: dpsco_jax.srg_mechanism(N // BATCH)),
      ('accelerated_independent', lambda: plans.accelerated_dp_srgd(
          _loss, beta=10.0, radius=None, epsilon=2.0, gradient='independent',
          **COMMON),
       'fixed', lambda: noise.gaussian(N // BATCH)),
      ('unaccelerated_dp_srg', lambda: plans.unaccelerated_dp_srg(
          _loss, beta=10.0, radius=None, epsilon=2.0, **COMMON),
       'fixed', lambda: dpsco_jax.srg_mechanism(N // BATCH)),
      ('dp_srg_memf', lambda: plans.dp_srg_memf(
          _loss, optimizer=sgd, epochs=EPOCHS, decay=0.5, epsilon=2.0,
          strategy=srg_strategy, **COMMON),
       'fixed', lambda: dpsco_jax.dpmemf_mechanism(srg_strategy)),
      ('dpmemf_blt', lambda: plans.dpmemf(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0, strategy='blt',
          n_buffers=3, momentum=0.9, **COMMON),
       'fixed', lambda: _blt_mechanism(momentum=0.9)),
      ('dp_srg_memf_blt', lambda: plans.dp_srg_memf(
          _loss, optimizer=sgd, epochs=EPOCHS, decay=0.5, epsilon=2.0,
          strategy='blt', n_buffers=2, **COMMON),
       'fixed', lambda: _blt_mechanism(n_buffers=2, decay=0.5)),
      ('dpmemf_banded_sqrt', lambda: plans.dpmemf(
          _loss, optimizer=sgd, epochs=EPOCHS, epsilon=2.0,
          strategy='banded_sqrt', bands=3, momentum=0.9, **COMMON),
       'fixed', lambda: dpsco_jax.dpmemf_mechanism(
           strategies.banded_square_root(STEPS, 3, momentum=0.9))),
      ('dp_srg_memf_banded_inverse_sqrt', lambda: plans.dp_srg_memf(
          _loss, optimizer=sgd, epochs=EPOCHS, decay=0.5, epsilon=2.0,
          strategy='banded_inverse_sqrt', bands=3, **COMMON),
       'fixed', lambda: _bisr_mechanism(3, decay=0.5)),
  ]


def _bisr_mechanism(bands, momentum=0.0, decay=0.0):
  """The banded inverse square root a plan's description calls for."""
  c, inverse = strategies.banded_inverse_square_root(
      STEPS, bands, momentum=momentum, decay=decay, with_inverse=True)
  return noise.matrix_factorization(c, inverse=inverse)


def _blt_mechanism(n_buffers=3, momentum=0.0, decay=0.0):
  """The BLT a plan's description calls for, built independently."""
  steps_per_epoch = N // BATCH
  params = blt.optimize(
      STEPS, n_buffers, max_participations=EPOCHS,
      min_separation=steps_per_epoch,
      workload_column=blt.toeplitz_workload_column(STEPS, momentum=momentum,
                                                   decay=decay))
  return blt.mechanism(params, STEPS)


class FixedOrderPlansAreZeroOutTest(absltest.TestCase):

  def test_add_or_remove_is_refused_for_a_fixed_or_shuffled_order(self):
    # Adding or removing an example moves every later one to another batch:
    # the fixed-order accounting does not describe that relation. The
    # refusal comes before any accounting, and the recorded relation does
    # not depend on it: the plans give their noise (no replace-one
    # calibration each), ample enough for the accounting of it to be quick.
    sgd = optax.sgd(0.1)
    makers = [
        lambda r: plans.dpsgd(_loss, optimizer=sgd, epochs=EPOCHS,
                              noise_multiplier=10.0, sampling='fixed',
                              neighboring_relation=r, **COMMON),
        lambda r: plans.dpsgd(_loss, optimizer=sgd, epochs=EPOCHS,
                              noise_multiplier=10.0, sampling='shuffled',
                              neighboring_relation=r, **COMMON),
        lambda r: plans.dpftrl(_loss, optimizer=sgd, epochs=EPOCHS,
                               noise_multiplier=10.0, neighboring_relation=r,
                               **COMMON),
        lambda r: plans.dpmemf(_loss, optimizer=sgd, epochs=EPOCHS,
                               noise_multiplier=10.0, neighboring_relation=r,
                               **COMMON),
        lambda r: plans.accelerated_dp_srgd(
            _loss, beta=10.0, radius=None, noise_multiplier=10.0,
            neighboring_relation=r, **COMMON),
    ]
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      for make in makers:
        with self.assertRaisesRegex(ValueError, 'not add/remove'):
          make('add_or_remove')
        self.assertEqual(make('replace_one').ledger.neighboring_relation,
                         'replace_one')
      poisson = plans.dpsgd(_loss, optimizer=sgd, epochs=EPOCHS,
                            noise_multiplier=10.0,
                            neighboring_relation='add_or_remove', **COMMON)
    self.assertEqual(poisson.ledger.neighboring_relation, 'add_or_remove')


class PlanAccountsWhatTheRunDidTest(parameterized.TestCase):

  @parameterized.named_parameters(*_cases())
  def test_epsilon_of_the_batches_formed_and_steps_taken(
      self, make_plan, kind, independent_mechanism):
    plan = make_plan()
    # A fixed or shuffled batch order is accounted under zero-out neighbours
    # (papers 000/001); the sensitivity (and so epsilon, checked below
    # against add/remove) is the same, but the record says which relation
    # was assumed. Only Poisson sampling is add/remove.
    self.assertEqual(plan.ledger.neighboring_relation,
                     'add_or_remove' if kind == 'poisson' else 'zero_out')
    batches, state = _run(plan)
    mechanism = independent_mechanism()
    noise_state = _noise_state(state)
    # The noise really came from the mechanism of the description...
    np.testing.assert_array_equal(
        np.asarray(noise_state.mechanism_id),
        noise.identity_words(mechanism.identity))
    # ... for as many steps as batches were formed.
    self.assertEqual(int(noise_state.step), len(batches))
    participation = _inferred_participation(batches, kind)
    self.assertEqual(participation.num_steps, plan.num_steps)
    independent = accounting.epsilon_spent(
        mechanism, plan.noise_multiplier, participation, DELTA)
    self.assertAlmostEqual(plan.epsilon, independent, places=9)
    if plan.target_epsilon is not None:
      self.assertLessEqual(plan.epsilon, plan.target_epsilon * (1 + 1e-9))
      self.assertGreater(plan.epsilon, plan.target_epsilon * 0.99)
    self.assertAlmostEqual(plan.epsilon_at(plan.num_steps), plan.epsilon,
                           places=9)
    json.dumps(plan.describe())
    # The run recorded the clipping path its steps took.
    self.assertIn(plan.describe()['clipping_path'],
                  ('ghost', 'vmap', 'ghost and vmap'))


class PlanRefusalTest(parameterized.TestCase):

  def _plan(self, **kwargs):
    # The refusals come before any accounting: a given noise, accounted by
    # RDP in milliseconds (a calibration takes seconds).
    return plans.dpsgd(_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS,
                       noise_multiplier=1.0, method='rdp',
                       **{**COMMON, **kwargs})

  def _state(self, plan):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      return plan.init(jnp.zeros(DIM))

  def test_exactly_one_of_epsilon_and_noise(self):
    with self.assertRaisesRegex(ValueError, 'exactly one of epsilon'):
      plans.dpsgd(_loss, optimizer=optax.sgd(0.1), epochs=1,
                  epsilon=1.0, noise_multiplier=1.0, **COMMON)
    with self.assertRaisesRegex(ValueError, 'exactly one of epsilon'):
      plans.dpftrl(_loss, optimizer=optax.sgd(0.1), epochs=1, **COMMON)

  def test_poisson_plan_refuses_a_fixed_size_batch(self):
    # The case at scale: Poisson accounting at q = 1/6 here, fed
    # every example at once.
    plan = self._plan()
    state = self._state(plan)
    data, ids = _data(), np.arange(N)
    with self.assertRaisesRegex(ValueError, 'needs batch_mask'):
      plan.transformation.update(None, state, jnp.zeros(DIM), batch=data,
                                 example_ids=ids)
    pad = plan.batches.pad_to_multiple
    # Masked but not padded: the same shape as above (the eager update's
    # operations compile once for it).
    assert N % pad
    with self.assertRaisesRegex(ValueError, f'not a multiple of {pad}'):
      plan.transformation.update(None, state, jnp.zeros(DIM), batch=data,
                                 example_ids=ids, batch_mask=np.ones(N, bool))
    # A padded batch holding every example: the count is implausible.
    size = pad * -(-N // pad)
    take = np.concatenate([ids, np.zeros(size - N, int)])
    mask = np.arange(size) < N
    with self.assertRaisesRegex(ValueError, 'practically never'):
      plan.transformation.update(
          None, state, jnp.zeros(DIM), batch=jax.tree.map(
              lambda x: x[take], data), example_ids=take, batch_mask=mask)

  def test_poisson_plan_refuses_a_big_batch_under_jit(self):
    plan = self._plan()
    state = self._state(plan)
    pad = plan.batches.pad_to_multiple
    size = pad * -(-N // pad)
    take = np.concatenate([np.arange(N), np.zeros(size - N, int)])
    step = jax.jit(lambda s, inputs: plan.transformation.update(
        None, s, jnp.zeros(DIM), **inputs))
    inputs = {'batch': jax.tree.map(lambda x: x[take], _data()),
              'example_ids': take, 'batch_mask': np.arange(size) < N}
    with self.assertRaisesRegex(dpsco_jax.PrivacyGuardError,
                                'practically never'):
      dpsco_jax.raise_if_refused(step(state, inputs))

  def test_fixed_order_plan_refuses_a_reshuffled_epoch(self):
    plan = self._plan(sampling='fixed')
    state = self._state(plan)
    data = _data()
    params = jnp.zeros(DIM)
    b = N // BATCH
    for inputs in plan.batches_of(data):
      if int(state[1].step) == b:  # first step of the second epoch
        other = plan.batches.batch_at(1)
        inputs = {'batch': jax.tree.map(lambda x: x[other], data),
                  'example_ids': other}
        with self.assertRaisesRegex(ValueError, 'same position of the first'):
          plan.transformation.update(None, state, params, **inputs)
        return
      _, state = plan.transformation.update(None, state, params, **inputs)
    self.fail('the second epoch was never reached')

  def test_shuffled_plan_refuses_a_repeat_within_an_epoch_and_a_bad_size(
      self):
    plan = self._plan(sampling='shuffled')
    state = self._state(plan)
    data, params = _data(), jnp.zeros(DIM)
    first = plan.batches.batch_at(0)
    take = lambda ids: {'batch': jax.tree.map(lambda x: x[ids], data),
                        'example_ids': ids}
    _, state = plan.transformation.update(None, state, params, **take(first))
    with self.assertRaisesRegex(ValueError, 'same epoch held'):
      plan.transformation.update(None, state, params, **take(first))
    with self.assertRaisesRegex(ValueError, 'other than the 10'):
      plan.transformation.update(None, state, params,
                                 **take(plan.batches.batch_at(1)[:5]))

  def test_batches_of_refuses_data_of_another_size(self):
    plan = self._plan()
    with self.assertRaisesRegex(ValueError, 'num_examples = 60'):
      next(plan.batches_of({'x': np.zeros((61, DIM)), 'y': np.zeros(61)}))

  def test_private_part_comes_first(self):
    plan = plans.dpftrl(_loss, optimizer=optax.sgd(0.1), epochs=1,
                        epsilon=2.0, **COMMON)
    state = self._state(plan)
    self.assertIsInstance(state[0], dpsco_jax.estimators.NoisyGradientState)
    inputs = next(plan.batches_of(_data()))
    updates, _ = plan.transformation.update(None, state, jnp.zeros(DIM),
                                            **inputs)
    self.assertEqual(updates.shape, (DIM,))

  def test_epsilon_at_is_non_decreasing(self):
    plan = plans.dpftrl(_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS,
                        epsilon=2.0, restart=None, **COMMON)
    values = [plan.epsilon_at(t) for t in range(plan.num_steps + 1)]
    self.assertEqual(values[0], 0.0)
    self.assertTrue(all(a <= b + 1e-12 for a, b in zip(values, values[1:])))
    self.assertAlmostEqual(values[-1], plan.epsilon, places=9)
    with self.assertRaisesRegex(ValueError, 'past the'):
      plan.epsilon_at(plan.num_steps + 1)


class Diff2PlanTest(absltest.TestCase):

  def test_epsilon_is_diff2_accounting_of_the_rounds(self):
    plan = plans.diff2_gd(_loss, learning_rate=0.1, num_rounds=20,
                          restart_interval=5, grad_clip=1.0,
                          diff_clip_factor=1.5, num_examples=N, epsilon=3.0,
                          delta=DELTA)
    z = plan.noise_multiplier
    self.assertAlmostEqual(
        plan.epsilon,
        diff2_accounting.epsilon_spent(20, 5, z, DELTA, method='pld'),
        places=9)
    self.assertLessEqual(plan.epsilon, 3.0 * (1 + 1e-6))
    self.assertAlmostEqual(
        plan.epsilon_at(7),
        diff2_accounting.epsilon_spent(7, 5, z, DELTA, method='pld'),
        places=9)
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      state = plan.init(jnp.zeros(DIM))
    params = jnp.zeros(DIM)
    for _ in range(3):
      updates, state = plan.transformation.update(None, state, params,
                                                  batch=_data())
      params = optax.apply_updates(params, updates)
    self.assertTrue(np.all(np.isfinite(params)))

  def test_random_output_iterate_is_kept_by_the_plan(self):
    plan = plans.diff2_gd(_loss, learning_rate=0.1, num_rounds=4,
                          restart_interval=2, grad_clip=1.0,
                          diff_clip_factor=1.5, num_examples=N,
                          noise_multipliers=(2.0, 3.0), delta=DELTA,
                          output='random_iterate', output_key=2)
    self.assertEqual(plan.hyperparameters['output'], 'random_iterate')
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      state = plan.init(jnp.zeros(DIM))
    params, points = jnp.zeros(DIM), []
    for _ in range(4):
      points.append(params)
      updates, state = plan.transformation.update(None, state, params,
                                                  batch=_data())
      params = optax.apply_updates(params, updates)
    selected = int(state[0].selected)
    np.testing.assert_array_equal(diff2.selected_iterate(state),
                                  points[selected])
    with self.assertRaisesRegex(ValueError, 'output must be'):
      plans.diff2_gd(_loss, learning_rate=0.1, num_rounds=4,
                     restart_interval=2, grad_clip=1.0, diff_clip_factor=1.5,
                     num_examples=N, noise_multipliers=(2.0, 3.0),
                     delta=DELTA, output='best')

  def test_dp_gd_is_one_restart_per_round(self):
    plan = plans.dp_gd(_loss, learning_rate=0.1, num_rounds=10,
                       grad_clip=1.0, num_examples=N, noise_multiplier=5.0,
                       delta=DELTA)
    self.assertEqual(plan.algorithm, 'dp_gd')
    self.assertAlmostEqual(
        plan.epsilon, accounting.epsilon_spent(
            noise.gaussian(10), 5.0, accounting.FixedOrder(10, 1), DELTA),
        places=6)


def _tied_loss(params, example):
  # The weights are used twice, once by `integer_pow`: no ghost-norm rule.
  return (example['x'] @ params - example['y']) ** 2 + jnp.sum(params ** 2)


class ClippingMethodTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('dpsgd', lambda **kw: plans.dpsgd(
          optimizer=optax.sgd(0.1), epochs=1, sampling='fixed', **kw)),
      ('dpftrl', lambda **kw: plans.dpftrl(optimizer=optax.sgd(0.1),
                                           epochs=1, **kw)),
      ('dp_srg_memf', lambda **kw: plans.dp_srg_memf(
          optimizer=optax.sgd(0.1), epochs=1, decay=0.5, **kw)),
      ('accelerated', lambda **kw: plans.accelerated_dp_srgd(
          beta=10.0, radius=None, **kw)),
  )
  def test_the_method_reaches_the_clipped_statistic(self, make):
    outputs = {}
    for method in ('ghost', 'vmap'):
      plan = make(loss_fn=_loss, noise_multiplier=1.0, key=3, seed=1,
                  clipping_method=method, **COMMON)
      with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        state = plan.init(jnp.ones(DIM))
      inputs = next(plan.batches_of(_data()))
      outputs[method], _ = plan.transformation.update(None, state,
                                                      jnp.ones(DIM), **inputs)
    np.testing.assert_allclose(outputs['ghost'], outputs['vmap'], rtol=2e-5,
                               atol=1e-6)
    plan = make(loss_fn=_tied_loss, noise_multiplier=1.0, key=4, seed=1,
                clipping_method='ghost', **COMMON)
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      state = plan.init(jnp.ones(DIM))
    with self.assertRaises(dpsco_jax.ghost.GhostClippingUnsupported):
      plan.transformation.update(None, state, jnp.ones(DIM),
                                 **next(plan.batches_of(_data())))

  def test_diff2_takes_the_method_too(self):
    plan = plans.diff2_gd(_tied_loss, learning_rate=0.1, num_rounds=4,
                          restart_interval=2, grad_clip=1.0,
                          diff_clip_factor=1.0, num_examples=N,
                          noise_multipliers=(1.0, 1.0), delta=DELTA,
                          clipping_method='ghost')
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      state = plan.init(jnp.ones(DIM))
    with self.assertRaises(dpsco_jax.ghost.GhostClippingUnsupported):
      plan.transformation.update(None, state, jnp.ones(DIM), batch=_data())


if __name__ == '__main__':
  absltest.main()
