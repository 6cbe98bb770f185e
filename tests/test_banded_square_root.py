"""Closed-form banded square-root (BSR) and banded inverse square-root (BISR)
strategies: their algebra, their noise streams and their plans."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import linalg

from dpsco_jax import accounting
from dpsco_jax import noise
from dpsco_jax import plans
from dpsco_jax import strategies
from tests.noise_streams import flat

MOMENTUM = 0.9
DECAY = math.exp(-2.5)
WORKLOADS = [(0.0, 0.0), (MOMENTUM, 0.0), (MOMENTUM, DECAY)]


def _nonzero_diagonals(matrix):
  """The lags t - s of the diagonals holding a non-zero entry."""
  rows, cols = np.nonzero(matrix)
  return sorted(set((rows - cols).tolist()))


@pytest.mark.parametrize('momentum,decay', WORKLOADS)
def test_full_band_is_the_square_root_of_the_workload(momentum, decay):
  steps = 20
  w = strategies.workload(steps, 'true', momentum=momentum, decay=decay)
  root = linalg.sqrtm(w).real
  bsr = strategies.banded_square_root(steps, steps, momentum=momentum,
                                      decay=decay)
  np.testing.assert_allclose(bsr @ bsr, w, rtol=0, atol=1e-10)
  np.testing.assert_allclose(bsr, root, rtol=0, atol=1e-10)
  bisr, bisr_inverse = strategies.banded_inverse_square_root(
      steps, steps, momentum=momentum, decay=decay, with_inverse=True)
  np.testing.assert_allclose(bisr_inverse @ bisr_inverse, np.linalg.inv(w),
                             rtol=0, atol=1e-10)
  np.testing.assert_allclose(bisr_inverse, np.linalg.inv(root), rtol=0,
                             atol=1e-10)
  np.testing.assert_allclose(bisr, root, rtol=0, atol=1e-10)


@pytest.mark.parametrize('momentum', [0.0, MOMENTUM])
def test_full_band_with_weight_decay_is_the_square_root(momentum):
  # SGD with weight decay: x_(t+1) = alpha x_t - lr m_t, alpha = 1 - lr wd.
  steps, alpha = 20, 0.95
  w = strategies.workload(steps, 'true', momentum=momentum,
                          iterate_decay=alpha)
  assert w[1, 0] == pytest.approx(alpha + momentum)
  bsr = strategies.banded_square_root(steps, steps, momentum=momentum,
                                      iterate_decay=alpha)
  np.testing.assert_allclose(bsr @ bsr, w, rtol=0, atol=1e-10)
  _, bisr_inverse = strategies.banded_inverse_square_root(
      steps, steps, momentum=momentum, iterate_decay=alpha,
      with_inverse=True)
  np.testing.assert_allclose(bisr_inverse @ bisr_inverse, np.linalg.inv(w),
                             rtol=0, atol=1e-9)
  # Banded: the first diagonals are the root's, the rest zero.
  banded = strategies.banded_square_root(steps, 4, momentum=momentum,
                                         iterate_decay=alpha)
  np.testing.assert_allclose(banded[:, 0], np.where(np.arange(steps) < 4,
                                                    bsr[:, 0], 0.0))


@pytest.mark.parametrize('bands', [1, 3, 12])
@pytest.mark.parametrize('momentum,decay', WORKLOADS)
def test_toeplitz_lower_triangular_with_exactly_bands_diagonals(
    bands, momentum, decay):
  steps = 12
  bsr = strategies.banded_square_root(steps, bands, momentum=momentum,
                                      decay=decay)
  bisr, bisr_inverse = strategies.banded_inverse_square_root(
      steps, bands, momentum=momentum, decay=decay, with_inverse=True)
  for matrix in (bsr, bisr, bisr_inverse):
    assert np.all(np.triu(matrix, 1) == 0)
    np.testing.assert_array_equal(
        matrix, linalg.toeplitz(matrix[:, 0], np.zeros(steps)))
  # The band: of C for BSR, of C^-1 for BISR (whose C is dense).
  assert _nonzero_diagonals(bsr) == list(range(bands))
  assert _nonzero_diagonals(bisr_inverse) == list(range(bands))
  assert _nonzero_diagonals(bisr) == list(range(steps if bands > 1 else 1))
  np.testing.assert_allclose(bisr @ bisr_inverse, np.eye(steps), rtol=0,
                             atol=1e-12)
  # Both are truncations of the full (inverse) square root.
  root = strategies.banded_square_root(steps, steps, momentum=momentum,
                                       decay=decay)
  lags = np.subtract.outer(np.arange(steps), np.arange(steps))
  np.testing.assert_allclose(bsr, np.where(lags < bands, root, 0.0),
                             rtol=1e-13)
  np.testing.assert_allclose(
      bisr_inverse, np.where(lags < bands, np.linalg.inv(root), 0.0),
      rtol=1e-10, atol=1e-13)


def test_prefix_sums_give_the_central_binomial_coefficients():
  steps = 30
  k = np.arange(steps)
  central = np.array([math.comb(2 * i, i) / 4 ** i for i in range(steps)])
  np.testing.assert_allclose(
      strategies.banded_square_root(steps, steps)[:, 0], central,
      rtol=1e-13)
  # (1 - x)^(1/2) = 1 - sum_k binom(2k, k) / (4^k (2k - 1)) x^k.
  _, inverse = strategies.banded_inverse_square_root(steps, steps,
                                                     with_inverse=True)
  np.testing.assert_allclose(inverse[:, 0], -central / (2 * k - 1),
                             rtol=1e-13)


@pytest.mark.parametrize('function', [strategies.banded_square_root,
                                      strategies.banded_inverse_square_root])
@pytest.mark.parametrize('args,kwargs,match', [
    ((10, 0), {}, 'bands'),
    ((10, 11), {}, 'exceeds num_steps'),
    ((0, 1), {}, 'num_steps'),
    ((10, 2.5), {}, 'bands'),
    ((10, 3), {'momentum': 1.0}, 'momentum'),
    ((10, 3), {'momentum': -0.1}, 'momentum'),
    ((10, 3), {'decay': 1.0}, 'decay'),
    ((10, 3), {'decay': float('nan')}, 'decay'),
    ((10, 3), {'iterate_decay': 0.0}, 'iterate_decay'),
    ((10, 3), {'iterate_decay': 1.01}, 'iterate_decay'),
    ((10, 3), {'iterate_decay': float('nan')}, 'iterate_decay'),
])
def test_bad_inputs_raise(function, args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    function(*args, **kwargs)


@pytest.mark.parametrize('num_epochs', [1, 2])
def test_errors_are_close_to_the_optimized_banded_strategy(num_epochs):
  """Measured at T = 24, momentum 0.9, 4 bands (ratios of ||W C^-1||_F at
  equal sensitivity): BSR / optimized 1.005 (k = 1), 1.097 (k = 2); BISR /
  optimized 0.747 and 0.932 (its C is dense, so it is not in the banded
  class)."""
  steps, bands = 24, 4
  w = strategies.workload(steps, 'true', momentum=MOMENTUM)
  participation = accounting.FixedOrder(num_epochs, steps // num_epochs)
  optimized = strategies.optimize_strategy(w, num_epochs, bands=bands,
                                           cache_dir=False)
  reference = strategies.workload_errors(
      w, noise.matrix_factorization(optimized), participation)[0]
  bsr = strategies.banded_square_root(steps, bands, momentum=MOMENTUM)
  bisr, inverse = strategies.banded_inverse_square_root(
      steps, bands, momentum=MOMENTUM, with_inverse=True)
  bsr_error = strategies.workload_errors(
      w, noise.matrix_factorization(bsr), participation)[0]
  bisr_error = strategies.workload_errors(
      w, noise.matrix_factorization(bisr, inverse=inverse), participation)[0]
  assert reference <= bsr_error <= 1.15 * reference
  assert bisr_error <= 1.0 * reference
  identity = strategies.workload_errors(w, noise.gaussian(steps),
                                        participation)[0]
  assert max(bsr_error, bisr_error) < 0.6 * identity


@pytest.mark.parametrize('release', ['per_step', 'prefix'])
def test_banded_inverse_streams_from_the_last_draws(release):
  steps, bands = 11, 3
  c, inverse = strategies.banded_inverse_square_root(
      steps, bands, momentum=MOMENTUM, decay=DECAY, with_inverse=True)
  mechanism = noise.matrix_factorization(c, inverse=inverse, release=release)
  extra = 1 if release == 'prefix' else 0  # The running sum.
  assert noise.noise_buffer_count(mechanism) == bands - 1 + extra
  # Without the inverse the dense C keeps T - 1 noise vectors.
  assert noise.noise_buffer_count(
      noise.matrix_factorization(c, release=release)) == steps - 1 + extra
  template = {'a': jnp.zeros(2), 'b': jnp.zeros((1, 3))}
  key = jax.random.key(3)
  iid = noise.gaussian(steps)
  state, iid_state = mechanism.init(template, key), iid.init(template, key)
  released, draws = [], []
  for _ in range(steps):
    value, state = mechanism.next(state, template)
    z, iid_state = iid.next(iid_state, template)
    released.append(flat(value))
    draws.append(flat(z))
  decoder = np.cumsum(inverse, axis=0) if release == 'prefix' else inverse
  np.testing.assert_allclose(np.stack(released), decoder @ np.stack(draws),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(mechanism.decoder_matrix(), decoder, rtol=1e-12)
  # The device's float32 coefficients (docs/sharp_edges.md).
  np.testing.assert_allclose(mechanism.encoder_matrix(), c, rtol=1e-6,
                             atol=1e-7)


def test_banded_square_root_streams_with_bands_minus_one_buffers():
  mechanism = noise.matrix_factorization(
      strategies.banded_square_root(16, 5, momentum=MOMENTUM))
  assert noise.noise_buffer_count(mechanism) == 4


def test_a_diagonal_inverse_keeps_no_buffer():
  """C equal to the identity up to round-off: the draws themselves."""
  steps = 5
  c = np.eye(steps) + 1e-12 * np.eye(steps, k=-1)
  mechanism = noise.matrix_factorization(c, inverse=np.eye(steps))
  assert noise.noise_buffer_count(mechanism) == 0
  template = jnp.zeros(3)
  iid = noise.gaussian(steps)
  state = mechanism.init(template, jax.random.key(1))
  iid_state = iid.init(template, jax.random.key(1))
  for _ in range(steps):
    value, state = mechanism.next(state, template)
    z, iid_state = iid.next(iid_state, template)
    np.testing.assert_array_equal(value, z)


def test_an_inverse_that_does_not_match_is_refused():
  c, inverse = strategies.banded_inverse_square_root(10, 3, with_inverse=True)
  with pytest.raises(ValueError, match='not the inverse'):
    noise.matrix_factorization(c, inverse=inverse * (1 + 1e-6))
  with pytest.raises(ValueError, match='lower-triangular'):
    noise.matrix_factorization(c, inverse=inverse.T)
  with pytest.raises(ValueError, match='shape'):
    noise.matrix_factorization(c, inverse=inverse[:5, :5])
  # The inverse is part of the identity: states do not cross.
  assert (noise.matrix_factorization(c, inverse=inverse).identity !=
          noise.matrix_factorization(c).identity)


# ------------------------------------------------------------------ plans

N, DIM, BATCH, EPOCHS, BANDS, DELTA = 40, 3, 5, 2, 3, 1e-5


def _loss(params, example):
  return (example['x'] @ params - example['y']) ** 2


def _plan(factory, strategy, sampling='fixed', **kwargs):
  extra = {'decay': DECAY} if factory is plans.dp_srg_memf else {}
  return factory(
      _loss, optimizer=optax.sgd(0.1), num_examples=N, batch_size=BATCH,
      epochs=EPOCHS, l2_clip=1.0, delta=DELTA, noise_multiplier=2.0,
      strategy=strategy, bands=BANDS, sampling=sampling, momentum=MOMENTUM,
      seed=0, key=0, method='rdp', **extra, **kwargs)


def _one_step(plan):
  rng = np.random.default_rng(0)
  data = {'x': rng.normal(size=(N, DIM)).astype(np.float32),
          'y': rng.normal(size=N).astype(np.float32)}
  params = jnp.zeros(DIM)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    state = plan.init(params)
    params, state = plan.step(params, state, next(plan.batches_of(data)))
  return params


@pytest.mark.parametrize('factory', [plans.dpmemf, plans.dp_srg_memf])
@pytest.mark.parametrize('strategy', ['banded_sqrt', 'banded_inverse_sqrt'])
def test_fixed_order_plans_use_the_closed_form(factory, strategy):
  plan = _plan(factory, strategy)
  steps = EPOCHS * N // BATCH
  decay = DECAY if factory is plans.dp_srg_memf else 0.0
  if strategy == 'banded_sqrt':
    c = strategies.banded_square_root(steps, BANDS, momentum=MOMENTUM,
                                      decay=decay)
    mechanism = noise.matrix_factorization(c)
  else:
    c, inverse = strategies.banded_inverse_square_root(
        steps, BANDS, momentum=MOMENTUM, decay=decay, with_inverse=True)
    mechanism = noise.matrix_factorization(c, inverse=inverse)
  # The device's float32 coefficients (docs/sharp_edges.md).
  np.testing.assert_allclose(plan.mechanism.encoder_matrix(), c, rtol=1e-6,
                             atol=1e-7)
  assert plan.mechanism.identity == mechanism.identity
  assert plan.describe()['noise_buffers'] == BANDS - 1
  assert plan.describe()['hyperparameters']['strategy'] == strategy
  # Accounted from this C under the fixed order (min-separation b).
  participation = accounting.FixedOrder(EPOCHS, steps // EPOCHS)
  assert plan.participation == participation
  sensitivity = accounting.participation_sensitivity(c, participation)
  assert accounting.mechanism_sensitivity(
      plan.mechanism, participation) == pytest.approx(sensitivity, rel=1e-6)
  assert plan.epsilon == pytest.approx(accounting.epsilon_spent(
      mechanism, 2.0, participation, DELTA, method='rdp'), rel=1e-9)
  assert np.all(np.isfinite(_one_step(plan)))


@pytest.mark.parametrize('factory', [plans.dpmemf, plans.dp_srg_memf])
def test_cyclic_poisson_takes_the_square_root_and_refuses_its_inverse(
    factory):
  plan = _plan(factory, 'banded_sqrt', sampling='cyclic_poisson')
  steps = plan.num_steps
  decay = DECAY if factory is plans.dp_srg_memf else 0.0
  c = strategies.banded_square_root(steps, BANDS, momentum=MOMENTUM,
                                    decay=decay)
  # The device's float32 coefficients (docs/sharp_edges.md).
  np.testing.assert_allclose(plan.mechanism.encoder_matrix(), c, rtol=1e-6,
                             atol=1e-7)
  assert plan.describe()['noise_buffers'] == BANDS - 1
  participation = accounting.CyclicPoissonSampling(BATCH * BANDS / N, steps,
                                                   BANDS)
  assert plan.participation == participation
  assert plan.epsilon == pytest.approx(accounting.epsilon_spent(
      noise.matrix_factorization(c), 2.0, participation, DELTA,
      method='rdp'), rel=1e-9)
  assert np.all(np.isfinite(_one_step(plan)))
  with pytest.raises(ValueError, match='C itself is dense'):
    _plan(factory, 'banded_inverse_sqrt', sampling='cyclic_poisson')


def test_plan_refusals():
  with pytest.raises(ValueError, match='needs bands'):
    plans.dpmemf(_loss, optimizer=optax.sgd(0.1), num_examples=N,
                 batch_size=BATCH, epochs=EPOCHS, l2_clip=1.0, delta=DELTA,
                 noise_multiplier=1.0, strategy='banded_sqrt')
  with pytest.raises(ValueError, match='exceeds num_steps'):
    plans.dpmemf(_loss, optimizer=optax.sgd(0.1), num_examples=N,
                 batch_size=BATCH, epochs=EPOCHS, l2_clip=1.0, delta=DELTA,
                 noise_multiplier=1.0, strategy='banded_inverse_sqrt',
                 bands=17)  # 16 steps.
  with pytest.raises(ValueError, match='strategy must be'):
    plans.dpmemf(_loss, optimizer=optax.sgd(0.1), num_examples=N,
                 batch_size=BATCH, epochs=EPOCHS, l2_clip=1.0, delta=DELTA,
                 noise_multiplier=1.0, strategy='sqrt', bands=3)
