"""Matrix-factorization noise: streamed C^-1 z equals the explicit product."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from scipy import stats

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import guards
from dpsco_jax import noise
from tests.noise_streams import flat, gaussian_draws, stream

TEMPLATE = {'w': np.zeros((4, 3), np.float32), 'b': np.zeros((5,), np.float32)}


def random_strategy(steps, bands=None, seed=0):
  """A well-conditioned lower-triangular C, optionally banded."""
  rng = np.random.default_rng(seed)
  strategy = np.tril(rng.uniform(0.0, 0.3, size=(steps, steps)))
  strategy[np.diag_indices(steps)] = rng.uniform(1.0, 2.0, size=steps)
  if bands is not None:
    strategy = np.tril(np.triu(strategy, -(bands - 1)))
  return strategy


STORAGES = ['buffer', 'regenerate']


@functools.cache
def template_draws(steps):
  """`gaussian_draws(TEMPLATE, steps)`, streamed (and compiled) once per
  length for every test and parametrization that compares with it."""
  draws = gaussian_draws(TEMPLATE, steps)
  draws.flags.writeable = False
  return draws


@pytest.mark.parametrize('storage', STORAGES)
def test_identity_strategy_is_the_gaussian_mechanism(storage):
  got, _ = stream(noise.matrix_factorization(np.eye(6), storage=storage),
                  TEMPLATE, 6)
  np.testing.assert_array_equal(got, template_draws(6))


@pytest.mark.parametrize('steps,bands', [(12, None), (15, 3), (9, 1), (9, 2)])
@pytest.mark.parametrize('release', ['per_step', 'prefix'])
@pytest.mark.parametrize('storage', STORAGES)
def test_streaming_equals_explicit_inverse_times_z(steps, bands, release,
                                                   storage):
  strategy = random_strategy(steps, bands)
  mechanism = noise.matrix_factorization(strategy, release=release,
                                         storage=storage)
  got, _ = stream(mechanism, TEMPLATE, steps)
  z = template_draws(steps)
  explicit = scipy.linalg.solve_triangular(strategy, z, lower=True)
  if release == 'prefix':
    explicit = np.cumsum(explicit, axis=0)
  np.testing.assert_allclose(got, explicit, rtol=1e-4, atol=1e-5)
  # The decoder the error report uses is the same linear map.
  np.testing.assert_allclose(mechanism.decoder_matrix() @ z, explicit,
                             rtol=1e-10, atol=1e-10)


def test_dense_strategy_streams_exactly_over_600_steps():
  # Long dense streams accumulate float32 round-off in the substitution. The
  # square root of the prefix-sum matrix (c_t = binom(2t, t) / 4^t), a
  # strategy with slowly decaying columns, must still match C^-1 z.
  steps = 600
  coefficients = np.cumprod([1.0] + [(2 * t - 1) / (2 * t)
                                     for t in range(1, steps)])
  strategy = scipy.linalg.toeplitz(coefficients, np.zeros(steps))
  np.testing.assert_allclose(strategy @ strategy, np.tri(steps), atol=1e-9)
  template = {'w': np.zeros((7,), np.float32)}
  mechanism = noise.matrix_factorization(strategy)

  def run(key):
    def step(state, _):
      out, state = mechanism.next(state, template)
      return state, out['w']
    return jax.lax.scan(step, mechanism.init(template, key), None,
                        length=steps)[1]

  got = np.asarray(jax.jit(run)(jax.random.key(0)), np.float64)
  explicit = scipy.linalg.solve_triangular(
      strategy, gaussian_draws(template, steps), lower=True)
  np.testing.assert_allclose(got, explicit, rtol=1e-3, atol=1e-3)


def test_banded_state_keeps_only_bands_minus_one_vectors():
  mechanism = noise.matrix_factorization(random_strategy(20, bands=4))
  state = mechanism.init(TEMPLATE, jax.random.key(0))
  assert state.buffers['past']['w'].shape == (3, 4, 3)
  dense = noise.matrix_factorization(random_strategy(20))
  assert dense.init(TEMPLATE, jax.random.key(0)).buffers['past']['w'].shape == (
      19, 4, 3)


def test_noise_scale_matches_inverse_gram():
  """w_t ~ N(0, (C^-1 C^-T)_tt): KS accepts it and rejects 2/3 and 3/2."""
  steps = 6
  strategy = random_strategy(steps, seed=3)
  template = {'w': np.zeros((4000,), np.float32)}
  got, _ = stream(noise.matrix_factorization(strategy), template, steps)
  inverse = np.linalg.inv(strategy)
  std = np.sqrt(np.diag(inverse @ inverse.T))
  normalized = (got / std[:, None]).ravel()
  assert stats.kstest(normalized, 'norm').pvalue > 0.01
  assert stats.kstest(normalized * 1.5, 'norm').pvalue < 0.01
  assert stats.kstest(normalized / 1.5, 'norm').pvalue < 0.01


@pytest.mark.parametrize('storage', STORAGES)
def test_refuses_past_its_size(storage):
  mechanism = noise.matrix_factorization(random_strategy(3), storage=storage)
  state = mechanism.init(TEMPLATE, jax.random.key(0))
  for _ in range(3):
    _, state = mechanism.next(state, TEMPLATE)
  with pytest.raises(ValueError, match='capacity'):
    mechanism.next(state, TEMPLATE)


@pytest.mark.parametrize('storage', STORAGES)
def test_jitted_step_past_its_size_is_poisoned_and_raises(storage):
  mechanism = noise.matrix_factorization(random_strategy(3), storage=storage)
  state = mechanism.init(TEMPLATE, jax.random.key(0))
  next_noise = jax.jit(mechanism.next)
  for _ in range(3):
    _, state = next_noise(state, TEMPLATE)
  # Inside jit: NaN noise, and the refusal recorded in the state.
  noise_out, state = next_noise(state, TEMPLATE)
  assert all(np.all(np.isnan(np.asarray(leaf)))
             for leaf in jax.tree_util.tree_leaves(noise_out))
  with pytest.raises(guards.PrivacyGuardError) as info:
    guards.raise_if_refused(state)
  assert 'capacity' in str(info.value) and info.value.step == 3


@pytest.mark.parametrize('strategy,match', [
    (np.triu(np.ones((3, 3))), 'lower-triangular'),
    (np.zeros((3, 3)), 'diagonal'),
    (np.ones((2, 3)), 'square'),
    (np.diag([1.0, np.nan]), 'non-finite'),
])
def test_bad_strategies(strategy, match):
  with pytest.raises(ValueError, match=match):
    noise.matrix_factorization(strategy)


def test_state_params_mismatch_is_refused():
  mechanism = noise.matrix_factorization(random_strategy(5))
  state = mechanism.init({'w': np.zeros((2,), np.float32)}, jax.random.key(0))
  with pytest.raises(ValueError, match='does not match'):
    mechanism.next(state, TEMPLATE)


def test_unknown_storage_is_refused():
  with pytest.raises(ValueError, match='storage'):
    noise.matrix_factorization(np.eye(3), storage='disk')


def test_accounting_uses_the_strategy():
  """Sensitivity comes from C: a column-normalized C has sensitivity 1."""
  strategy = random_strategy(10, seed=4)
  strategy /= np.linalg.norm(strategy, axis=0).max()
  mechanism = noise.matrix_factorization(strategy)
  assert accounting.mechanism_sensitivity(
      mechanism, accounting.single_epoch(10)) == pytest.approx(1.0)
  eps_mf = accounting.epsilon_spent(mechanism, 3.0,
                                    accounting.single_epoch(10), 1e-6)
  eps_one_gaussian = accounting.epsilon_spent(
      noise.gaussian(1), 3.0, accounting.single_epoch(1), 1e-6)
  assert eps_mf == pytest.approx(eps_one_gaussian, rel=1e-6)


def test_plugs_into_the_noisy_gradient_estimator():
  """The estimator adds noise_multiplier * clip / B times the streamed noise."""
  strategy = random_strategy(4, bands=2, seed=5)
  params = {'w': jnp.zeros((3, 2)), 'b': jnp.zeros((2,))}
  batch = {'x': jnp.ones((5, 3))}
  zero_loss = lambda p, ex: 0.0 * jnp.sum(p['w']) * jnp.sum(ex['x'])
  tx = dpsco_jax.noisy_gradient(
      zero_loss, l2_clip=0.5, noise_multiplier=2.0,
      mechanism=noise.matrix_factorization(strategy), key=9)
  state = tx.init(params)
  update = jax.jit(lambda s: tx.update(None, s, params, batch=batch))
  outputs = []
  for _ in range(4):
    out, state = update(state)
    outputs.append(flat(out))
  expected, _ = stream(noise.matrix_factorization(strategy), params, 4, seed=9)
  np.testing.assert_allclose(np.stack(outputs), expected * 2.0 * 0.5 / 5,
                             rtol=1e-5, atol=1e-7)
