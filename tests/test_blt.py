"""BLT strategies: streamed noise, sensitivity, optimization, identity."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg

from dpsco_jax import accounting
from dpsco_jax import blt
from dpsco_jax import ledger
from dpsco_jax import noise
from dpsco_jax import rounding
from tests.noise_streams import gaussian_draws, stream
from dpsco_jax import plans
from dpsco_jax import strategies

TEMPLATE = {'w': np.zeros((4, 3), np.float32), 'b': np.zeros((5,), np.float32)}
# Float32 values: the mechanism accounts the coefficients the device holds
# (`rounding.float32_values`), so these tests compare like with like.
PARAMS = blt.parameters(*map(rounding.float32_values,
                             ([0.95, 0.6, 0.2], [0.25, 0.3, 0.15])))


def test_materialized_c_has_the_blt_coefficients():
  steps = 9
  c = blt.materialize(PARAMS, steps)
  theta, w = PARAMS
  expected = [1.0] + [float(np.sum(w * theta ** (k - 1)))
                      for k in range(1, steps)]
  np.testing.assert_allclose(c[:, 0], expected, rtol=1e-12)
  np.testing.assert_array_equal(c, scipy.linalg.toeplitz(c[:, 0],
                                                         np.zeros(steps)))


def test_the_inverse_is_a_blt_with_the_inverse_matrix():
  steps = 30
  inverse = blt.inverse(PARAMS)
  assert inverse.num_buffers == PARAMS.num_buffers
  np.testing.assert_allclose(
      blt.materialize(inverse, steps) @ blt.materialize(PARAMS, steps),
      np.eye(steps), atol=1e-12)
  np.testing.assert_allclose(blt.inverse_coefficients(PARAMS, steps),
                             blt.materialize(inverse, steps)[:, 0],
                             atol=1e-12)


@pytest.mark.parametrize('release', ['per_step', 'prefix'])
def test_stream_equals_inverse_of_materialized_c_times_z(release):
  steps = 40
  mechanism = blt.mechanism(PARAMS, steps, release=release)
  got, state = stream(mechanism, TEMPLATE, steps)
  z = gaussian_draws(TEMPLATE, steps)
  explicit = scipy.linalg.solve_triangular(blt.materialize(PARAMS, steps), z,
                                           lower=True)
  if release == 'prefix':
    explicit = np.cumsum(explicit, axis=0)
  np.testing.assert_allclose(got, explicit, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mechanism.decoder_matrix() @ z, explicit,
                             atol=1e-10)
  # O(buffers x params): one buffer per decay (and the running prefix).
  assert state.buffers['decaying']['w'].shape == (3, 4, 3)
  assert noise.noise_buffer_count(mechanism) == 3 + (release == 'prefix')


def test_same_noise_as_the_dense_matrix_factorization():
  steps = 25
  ours, _ = stream(blt.mechanism(PARAMS, steps), TEMPLATE, steps)
  dense, _ = stream(noise.matrix_factorization(blt.materialize(PARAMS, steps)),
                    TEMPLATE, steps)
  np.testing.assert_allclose(ours, dense, rtol=1e-5, atol=1e-5)


def brute_force_sensitivity(c, k, b):
  """max over every pattern of <= k steps, pairwise >= b apart."""
  gram = c.T @ c
  steps = c.shape[0]
  best = 0.0
  for size in range(1, k + 1):
    for pattern in itertools.combinations(range(steps), size):
      if all(t - s >= b for s, t in zip(pattern, pattern[1:])):
        best = max(best, gram[np.ix_(pattern, pattern)].sum())
  return float(np.sqrt(best))


@pytest.mark.parametrize('k,b', [(1, 1), (2, 3), (3, 4), (4, 3), (6, 2)])
def test_min_separation_sensitivity_equals_brute_force(k, b):
  steps = 14
  for params in (PARAMS, blt.parameters([0.999, 0.3], [0.05, 0.9]),
                 blt.optimize(steps, 2, max_participations=k,
                              min_separation=b)):
    expected = brute_force_sensitivity(blt.materialize(params, steps), k, b)
    assert blt.sensitivity(params, steps, k, b) == pytest.approx(
        expected, rel=1e-12)


def test_fixed_order_accounting_uses_the_same_sensitivity():
  # Batch 0 of FixedOrder(k, b) is the worst min-separation pattern.
  steps, k = 24, 4
  mechanism = blt.mechanism(PARAMS, steps)
  participation = accounting.FixedOrder(k, steps // k)
  from_gram = accounting.participation_sensitivity(
      blt.materialize(PARAMS, steps), participation)
  assert from_gram == pytest.approx(
      blt.sensitivity(PARAMS, steps, k, steps // k), rel=1e-12)
  # The mechanism's O(T) closed form gives the accountant the same value.
  assert accounting.mechanism_sensitivity(
      mechanism, participation) == pytest.approx(from_gram, rel=1e-12)
  increasing = blt.mechanism(blt.parameters([0.5], [1.5]), steps)
  assert accounting.mechanism_sensitivity(
      increasing, participation) == pytest.approx(
          accounting.participation_sensitivity(
              increasing.encoder_matrix(), participation), rel=1e-12)
  assert accounting.mechanism_sensitivity(
      mechanism, accounting.single_epoch(steps)) == pytest.approx(
          np.linalg.norm(blt.materialize(PARAMS, steps), axis=0).max())


def _no_encoder():
  raise AssertionError('the O(T d) route built the T x T encoder')


@pytest.mark.parametrize('release', ['per_step', 'prefix'])
def test_epsilon_at_every_step_equals_the_dense_route(release):
  # The ledger accounts the first s steps from the mechanism's truncation
  # (O(T d)); removing it sends the ledger through the T x T encoder cut to
  # the rows and columns those steps use. Both agree at every step.
  steps = 24
  mechanism = blt.mechanism(PARAMS, steps, release=release)
  dense = mechanism._replace(truncated=None)
  # Without its matrices: the ledger must not need them.
  matrix_free = mechanism._replace(encoder_matrix=_no_encoder,
                                   decoder_matrix=_no_encoder)
  for participation in (accounting.single_epoch(steps),
                        accounting.FixedOrder(2, 12),
                        accounting.FixedOrder(4, 6),
                        accounting.FixedOrder(24, 1)):
    record = ledger.PrivacyLedger.create(mechanism, 3.0, participation, 1e-5,
                                         method='zcdp')
    for step in range(1, steps + 1):
      fast = mechanism.truncated(step)._replace(encoder_matrix=_no_encoder)
      assert accounting.mechanism_sensitivity(
          fast, participation) == pytest.approx(
              accounting.participation_sensitivity(
                  mechanism.truncated(step).encoder_matrix(), participation),
              rel=1e-12)
      assert record.epsilon_at(step, matrix_free) == pytest.approx(
          record.epsilon_at(step, dense), rel=1e-12)
  with pytest.raises(ValueError, match='past the 24 steps'):
    mechanism.truncated(25)


def test_min_separation_refuses_increasing_coefficients():
  with pytest.raises(ValueError, match='non-increasing'):
    blt.sensitivity(blt.parameters([0.5], [1.5]), 10, 2, 3)


def test_errors_match_the_materialized_workload_errors():
  steps, k = 24, 3
  workload = strategies.workload(steps, 'true', momentum=0.9)
  column = blt.toeplitz_workload_column(steps, momentum=0.9)
  np.testing.assert_allclose(column, workload[:, 0], rtol=1e-12)
  got = blt.errors(PARAMS, column, k, steps // k)
  expected = strategies.workload_errors(workload, blt.mechanism(PARAMS, steps),
                                        accounting.FixedOrder(k, steps // k))
  np.testing.assert_allclose(got, expected, rtol=1e-9)


@pytest.mark.parametrize('k,b', [(1, None), (3, 8)])
def test_max_and_mean_loss_match_their_definition(k, b):
  # max-loss = s^2 max_t ||(W C^-1)_t||^2, mean-loss = s^2 mean_t of it,
  # from the materialized matrices and the brute-force sensitivity.
  steps = 24
  workload = strategies.workload(steps, 'true', momentum=0.9)
  column = workload[:, 0]
  b_matrix = workload @ np.linalg.inv(blt.materialize(PARAMS, steps))
  rows = np.sum(b_matrix ** 2, axis=1)
  np.testing.assert_allclose(blt.per_step_errors(PARAMS, column), rows,
                             rtol=1e-10)
  squared = brute_force_sensitivity(blt.materialize(PARAMS, steps), k,
                                    b or 1) ** 2
  assert blt.loss(PARAMS, column, k, b) == pytest.approx(
      squared * rows.max(), rel=1e-10)
  assert blt.loss(PARAMS, column, k, b, error='mean') == pytest.approx(
      squared * rows.mean(), rel=1e-10)
  with pytest.raises(ValueError, match="'max' or 'mean'"):
    blt.loss(PARAMS, column, error='rms')


def test_optimize_minimizes_the_loss_it_is_asked_for():
  # Each objective's optimum beats the other's on its own loss.
  steps, k, b = 48, 3, 16
  column = blt.toeplitz_workload_column(steps)
  by_max, by_mean = (blt.optimize(steps, 2, max_participations=k,
                                  min_separation=b, error=error)
                     for error in ('max', 'mean'))
  assert (blt.loss(by_max, column, k, b, error='max') <
          blt.loss(by_mean, column, k, b, error='max') * (1 - 1e-4))
  assert (blt.loss(by_mean, column, k, b, error='mean') <
          blt.loss(by_max, column, k, b, error='mean') * (1 - 1e-4))


def test_a_buffer_more_never_ends_worse():
  # optimize(T, d) is no worse than optimize(T, d - 1) (before, 3 and 4
  # buffers ended above 2 here).
  steps, k, b = 48, 3, 12
  column = blt.toeplitz_workload_column(steps)
  losses = [blt.loss(blt.optimize(steps, d, max_participations=k,
                                  min_separation=b), column, k, b)
            for d in (2, 3, 4)]
  for fewer, more in zip(losses, losses[1:]):
    assert more <= fewer * (1 + 1e-9), losses


def test_optimized_blt_is_near_the_dense_optimum_and_scales():
  steps = 64
  workload = strategies.workload(steps)
  dense = strategies.optimize_strategy(workload, 1, cache_dir=False)
  dense_error = strategies.workload_errors(
      workload, noise.matrix_factorization(dense),
      accounting.single_epoch(steps))[0]
  params = blt.optimize(steps, 3, error='mean')
  blt_error = blt.errors(params, blt.toeplitz_workload_column(steps))[0]
  identity_error = strategies.workload_errors(
      workload, noise.gaussian(steps), accounting.single_epoch(steps))[0]
  assert dense_error <= blt_error * (1 + 1e-6)
  assert blt_error < 1.05 * dense_error < identity_error
  # A long multi-participation run optimizes to valid parameters (its time
  # is measured in benchmarks/, not asserted here).
  long_run = blt.optimize(10_000, 2, max_participations=10,
                          min_separation=1000)
  assert long_run.num_buffers == 2
  assert np.all((long_run.buffer_decays >= 0) &
                (long_run.buffer_decays < 1))
  assert np.all(np.isfinite(long_run.output_scales))


def test_identity_covers_every_parameter():
  steps = 10
  base = blt.mechanism(PARAMS, steps)
  theta, w = PARAMS
  others = [
      blt.mechanism(blt.parameters(theta * [1, 1, 0.999], w), steps),
      blt.mechanism(blt.parameters(theta, w * [1, 1.001, 1]), steps),
      blt.mechanism(PARAMS, steps + 1),
      blt.mechanism(PARAMS, steps, release='prefix'),
  ]
  assert len({base.identity} | {m.identity for m in others}) == 5
  assert blt.mechanism(PARAMS, steps).identity == base.identity
  state = others[0].init(TEMPLATE, jax.random.key(0))
  with pytest.raises(ValueError, match='another noise mechanism'):
    base.next(state, TEMPLATE)


def test_refuses_past_its_capacity():
  mechanism = blt.mechanism(PARAMS, 2)
  state = mechanism.init(TEMPLATE, jax.random.key(0))
  for _ in range(2):
    _, state = mechanism.next(state, TEMPLATE)
  with pytest.raises(ValueError, match='capacity'):
    mechanism.next(state, TEMPLATE)


@pytest.mark.parametrize('decays,scales,match', [
    ([1.0], [0.5], r'\[0, 1\)'),
    ([0.5, 0.2], [0.5], 'one length'),
    ([np.nan], [0.5], 'finite'),
    ([], [], 'non-empty'),
])
def test_bad_parameters(decays, scales, match):
  with pytest.raises(ValueError, match=match):
    blt.parameters(decays, scales)


def _loss(params, example):
  return jnp.sum(params['w'] * example['x']) ** 2


def _noise_state(opt_state):
  found = [leaf for leaf in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, noise.NoiseState))
           if isinstance(leaf, noise.NoiseState)]
  assert len(found) == 1
  return found[0]


def test_a_36m_parameter_plan_of_1000_steps_keeps_at_most_8_buffers():
  # A 35.8M-parameter model for T = 1,000 (2 epochs of 500 batches): the
  # dense strategy would keep 999 params-sized buffers (143 GB); the BLT
  # plan's noise state, traced with eval_shape (nothing allocated), keeps
  # n_buffers of them.
  params = {'embed': jax.ShapeDtypeStruct((32_000, 512), jnp.float32),
            'blocks': jax.ShapeDtypeStruct((12, 512, 3_148), jnp.float32),
            'head': jax.ShapeDtypeStruct((2_000,), jnp.float32)}
  num_params = sum(math.prod(leaf.shape)
                   for leaf in jax.tree_util.tree_leaves(params))
  assert 35_700_000 < num_params < 35_900_000
  common = dict(optimizer=optax.sgd(0.1, momentum=0.9),
                num_examples=100_000, batch_size=200, epochs=2, l2_clip=1.0,
                delta=1e-6, noise_multiplier=8.0, momentum=0.9, seed=0,
                key=0)
  # noise_multiplier=: the buffers do not depend on the noise's scale, and a
  # calibration to an epsilon would cost more than the rest of the test.
  plan = plans.dpmemf(_loss, strategy='blt', n_buffers=4, **common)
  assert plan.num_steps == 1000
  state = _noise_state(jax.eval_shape(plan.transformation.init, params))
  buffer_floats = sum(math.prod(leaf.shape)
                      for leaf in jax.tree_util.tree_leaves(state.buffers))
  assert buffer_floats == 4 * num_params
  assert buffer_floats <= 8 * num_params
  assert plan.describe()['noise_buffers'] == 4
  # The dense plan is refused before its strategy is optimized, with the
  # numbers and the fixes.
  with pytest.raises(ValueError, match=r'999 params-sized buffers.*'
                     r"max_noise_buffers=64.*strategy='blt'"):
    plans.dpmemf(_loss, **common)


def test_every_mf_plan_reports_its_noise_buffers_and_the_limit_can_be_raised():
  common = dict(optimizer=optax.sgd(0.1), num_examples=60, batch_size=10,
                epochs=2, l2_clip=1.0, delta=1e-5, noise_multiplier=2.0,
                seed=0, method='rdp')
  strategy = strategies.optimize_strategy(strategies.workload(12), 2,
                                          cache_dir=False)
  dense = plans.dpmemf(_loss, strategy=strategy, **common)
  assert dense.describe()['noise_buffers'] == 11
  banded = plans.dpmemf(_loss, bands=3, **common)
  assert banded.describe()['noise_buffers'] == 2
  srg_blt = plans.dp_srg_memf(_loss, decay=0.5, strategy='blt', n_buffers=2,
                              **common)
  assert srg_blt.describe()['noise_buffers'] == 2
  with pytest.raises(ValueError, match='11 params-sized buffers'):
    plans.dp_srg_memf(_loss, decay=0.5, strategy=strategy,
                      max_noise_buffers=10, **common)
  raised = plans.dp_srg_memf(_loss, decay=0.5, strategy=strategy,
                             max_noise_buffers=11, **common)
  assert raised.describe()['noise_buffers'] == 11


def test_the_ledger_refuses_the_state_of_another_blt():
  # A transformation built with other BLT parameters than the ones its
  # ledger accounts for is refused before a step is taken.
  common = dict(optimizer=optax.sgd(0.1), num_examples=60, batch_size=10,
                epochs=2, l2_clip=1.0, delta=1e-5, noise_multiplier=2.0,
                seed=0, method='rdp', strategy='blt')
  two, three = (plans.dpmemf(_loss, n_buffers=n, **common) for n in (2, 3))
  params = {'w': jnp.zeros(3)}
  two.ledger.check_state(two.transformation.init(params))
  with pytest.raises(ledger.LedgerMismatchError, match='another mechanism'):
    two.ledger.check_state(three.transformation.init(params))


def test_optimize_cache_returns_the_same_parameters_and_rejects_bad_entries(
    tmp_path, monkeypatch):
  first = blt.optimize(300, 2, cache_dir=str(tmp_path))
  [entry] = list(tmp_path.iterdir())
  calls = []
  original = blt._optimize  # pylint: disable=protected-access

  def counting(*args, **kwargs):
    calls.append(args)
    return original(*args, **kwargs)

  monkeypatch.setattr(blt, '_optimize', counting)
  again = blt.optimize(300, 2, cache_dir=str(tmp_path))
  assert not calls  # Read back, not optimized again.
  np.testing.assert_array_equal(again.buffer_decays, first.buffer_decays)
  np.testing.assert_array_equal(again.output_scales, first.output_scales)
  # Another argument is another entry.
  blt.optimize(300, 2, error='mean', cache_dir=str(tmp_path))
  assert len(calls) == 1
  # An entry outside the region where the sensitivity is exact (scales
  # summing past 1) is recomputed, not used.
  np.save(entry, np.array([[0.9, 0.5], [0.8, 0.7]]))
  recomputed = blt.optimize(300, 2, cache_dir=str(tmp_path))
  assert len(calls) == 2
  np.testing.assert_allclose(recomputed.output_scales, first.output_scales)
  np.save(entry, np.array([1.0]))  # Unreadable as parameters.
  blt.optimize(300, 2, cache_dir=str(tmp_path))
  assert len(calls) == 3
  # Plans use the library cache ($DPSCO_JAX_CACHE, a temporary folder here).
  monkeypatch.setenv('DPSCO_JAX_CACHE', str(tmp_path / 'library'))
  plan_kwargs = dict(optimizer=optax.sgd(0.1), num_examples=40,
                     batch_size=10, epochs=2, l2_clip=1.0,
                     noise_multiplier=1.0, delta=1e-5, strategy='blt',
                     n_buffers=2)
  loss = lambda params, example: jnp.sum(params * example)
  plans.dpmemf(loss, **plan_kwargs)
  assert len(calls) == 4
  assert list((tmp_path / 'library' / 'blt').iterdir())
  plans.dpmemf(loss, **plan_kwargs)
  assert len(calls) == 4


@pytest.mark.parametrize('steps, k, b, d', [(8, 2, 4, 2), (16, 2, 8, 2),
                                            (30, 3, 10, 3)])
def test_optimize_keeps_every_decay_below_one_even_in_float32(steps, k, b, d):
  # Under several participations the search pushes one decay towards 1; it
  # used to reach exactly 1.0 (which `parameters` refuses) at T = 8, k = 2.
  params = blt.optimize(steps, d, max_participations=k, min_separation=b)
  assert np.all(params.buffer_decays.astype(np.float32) < 1), params
  assert blt.sensitivity(params, steps, max_participations=k,
                         min_separation=b) > 0
