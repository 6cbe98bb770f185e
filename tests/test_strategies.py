"""Tests for `dpsco_jax.strategies`: workloads, optimized strategies, errors."""

import itertools
import math
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import accounting
from dpsco_jax import noise
from dpsco_jax import strategies

MOMENTUM = 0.9
DECAY = math.exp(-2.5)


def column_sum_sensitivity(strategy, num_epochs):
  """Paper 001 Alg 2's constraint: max_j ||sum_i C[:, i b + j]||_2."""
  steps_per_epoch = strategy.shape[0] // num_epochs
  sums = strategy.reshape(strategy.shape[0], num_epochs,
                          steps_per_epoch).sum(axis=1)
  return np.linalg.norm(sums, axis=0).max()


def brute_force_sensitivity(strategy, num_epochs):
  """max over batches j and signs s of ||sum_i s_i C[:, i b + j]||_2."""
  steps_per_epoch = strategy.shape[0] // num_epochs
  best = 0.0
  for j in range(steps_per_epoch):
    columns = strategy[:, j::steps_per_epoch]
    for signs in itertools.product((-1.0, 1.0), repeat=num_epochs):
      best = max(best, np.linalg.norm(columns @ np.array(signs)))
  return best


def test_true_workload_is_what_sgd_with_momentum_does():
  """x_{t+1} - x_0 = -lr (W g)_t for W = M A (optax.sgd with momentum)."""
  steps, lr = 12, 0.3
  gradients = np.random.default_rng(0).normal(size=(steps, 3))
  optimizer = optax.sgd(lr, momentum=MOMENTUM)
  params = jnp.zeros(3)
  state = optimizer.init(params)
  iterates = []
  for g in gradients:
    updates, state = optimizer.update(jnp.asarray(g), state, params)
    params = optax.apply_updates(params, updates)
    iterates.append(np.asarray(params))
  w = strategies.workload(steps, 'true', momentum=MOMENTUM)
  np.testing.assert_allclose(np.stack(iterates), -lr * w @ gradients,
                             rtol=1e-5, atol=1e-6)


def test_true_workload_with_decay_is_the_srg_recursion():
  """Grad_t = c Grad_{t-1} + Delta_t (c_0 = 0) fed to momentum SGD: M A L."""
  steps = 10
  deltas = np.random.default_rng(1).normal(size=(steps, 2))
  recursion, previous = [], np.zeros(2)
  for delta in deltas:
    previous = DECAY * previous + delta
    recursion.append(previous)
  w = strategies.workload(steps, 'true', momentum=MOMENTUM, decay=DECAY)
  expected = strategies.workload(steps, 'true', momentum=MOMENTUM) @ np.stack(
      recursion)
  np.testing.assert_allclose(w @ deltas, expected, rtol=1e-12)


def test_momentum_prefix_closed_form():
  """(A M)[t, s] = (1 - 0.9^(t - s + 1)) / 0.1 (notes §2.4)."""
  w = strategies.workload(8, 'true', momentum=MOMENTUM)
  lags = np.subtract.outer(np.arange(8), np.arange(8))
  expected = np.where(lags >= 0, (1 - MOMENTUM ** (lags + 1)) / 0.1, 0.0)
  np.testing.assert_allclose(w, expected, rtol=1e-12)


def test_strategy_from_gram_is_a_lower_triangular_factor():
  rng = np.random.default_rng(2)
  root = rng.normal(size=(7, 7))
  gram = root @ root.T + np.eye(7)
  strategy = strategies.strategy_from_gram(gram)
  assert np.all(np.triu(strategy, 1) == 0)
  np.testing.assert_allclose(strategy.T @ strategy, gram, rtol=1e-10)


CASES = [  # (num_steps, num_epochs, kind, momentum, decay, bands)
    (16, 1, 'ones', 0.0, 0.0, None),
    (24, 3, 'ones', 0.0, 0.0, None),
    (24, 3, 'true', MOMENTUM, 0.0, None),
    (24, 3, 'true', MOMENTUM, DECAY, None),
    (24, 3, 'ones', 0.0, 0.0, 4),
    (30, 1, 'true', MOMENTUM, 0.0, 5),
]


@pytest.mark.parametrize('num_steps,num_epochs,kind,momentum,decay,bands',
                         CASES)
def test_optimized_strategy_is_feasible_and_beats_identity_and_tree(
    num_steps, num_epochs, kind, momentum, decay, bands):
  w = strategies.workload(num_steps, kind, momentum=momentum, decay=decay)
  strategy = strategies.optimize_strategy(w, num_epochs, bands=bands,
                                          cache_dir=None)
  participation = accounting.FixedOrder(num_epochs, num_steps // num_epochs)
  assert np.all(np.triu(strategy, 1) == 0)
  assert np.all(np.diag(strategy) > 0)
  if bands is not None:
    lags = np.subtract.outer(np.arange(num_steps), np.arange(num_steps))
    assert np.all(strategy[lags >= bands] == 0)
  # Algorithm 2's constraint, the exact sensitivity and a brute force agree.
  assert column_sum_sensitivity(strategy, num_epochs) <= 1 + 1e-9
  assert accounting.participation_sensitivity(
      strategy, participation) == pytest.approx(1.0, abs=1e-9)
  assert brute_force_sensitivity(strategy, num_epochs) == pytest.approx(
      1.0, abs=1e-9)
  # The orthogonality that makes the sensitivity exact whatever the signs.
  gram = strategy.T @ strategy
  masked = ~strategies.orthogonality_mask(num_steps, num_epochs)
  assert np.abs(gram[masked]).max(initial=0.0) < 1e-9
  ours = strategies.workload_errors(
      w, noise.matrix_factorization(strategy), participation)
  for baseline in (noise.gaussian(num_steps), noise.tree(num_steps)):
    theirs = strategies.workload_errors(w, baseline, participation)
    assert ours[0] < theirs[0], baseline.name


def test_optimized_strategy_is_close_to_the_known_optimum():
  """Single epoch, prefix sums: the optimum is Toeplitz-like and the
  optimizer must not stop far from it; more iterations cannot do much
  better."""
  w = strategies.workload(32)
  quick = strategies.optimize_strategy(w, cache_dir=None)
  thorough = strategies.optimize_strategy(w, tolerance=1e-12, cache_dir=None)
  error = lambda c: np.linalg.norm(w @ np.linalg.inv(c))
  assert error(quick) <= error(thorough) * 1.001
  # Better than the banded square root it starts from (the sqrt of A).
  root = strategies.optimize_strategy(w, max_iterations=1, cache_dir=None)
  assert error(thorough) < error(root)


def test_cache_returns_the_stored_strategy_without_optimizing(tmp_path,
                                                              monkeypatch):
  w = strategies.workload(12, 'true', momentum=MOMENTUM)
  first = strategies.optimize_strategy(w, 2, cache_dir=str(tmp_path))
  assert len(os.listdir(tmp_path)) == 1

  def fail(*args, **kwargs):
    raise AssertionError('the cache was not used')

  monkeypatch.setattr(strategies, '_lbfgs', fail)
  np.testing.assert_array_equal(
      strategies.optimize_strategy(w, 2, cache_dir=str(tmp_path)), first)
  # Other inputs are other entries.
  with pytest.raises(AssertionError, match='cache'):
    strategies.optimize_strategy(w, 3, cache_dir=str(tmp_path))
  with pytest.raises(AssertionError, match='cache'):
    strategies.optimize_strategy(strategies.workload(12), 2,
                                 cache_dir=str(tmp_path))


def test_infeasible_cache_entry_is_recomputed(tmp_path):
  w = strategies.workload(12)
  first = strategies.optimize_strategy(w, 2, cache_dir=str(tmp_path))
  (entry,) = os.listdir(tmp_path)
  np.save(tmp_path / entry, 2.0 * first)  # sensitivity 2: weaker privacy
  again = strategies.optimize_strategy(w, 2, cache_dir=str(tmp_path))
  np.testing.assert_allclose(again, first)
  (tmp_path / entry).write_bytes(b'not a strategy')
  again = strategies.optimize_strategy(w, 2, cache_dir=str(tmp_path))
  np.testing.assert_allclose(again, first)


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv(strategies.CACHE_ENV_VAR, str(tmp_path))
  assert strategies.default_cache_dir() == str(tmp_path / 'strategies')


def test_workload_errors_of_identity_and_tree():
  steps = 16
  w = strategies.workload(steps)
  single = accounting.single_epoch(steps)
  total, worst = strategies.workload_errors(w, noise.gaussian(steps), single)
  assert total == pytest.approx(math.sqrt(steps * (steps + 1) / 2))
  assert worst == pytest.approx(math.sqrt(steps))
  # Tree: prefix t sums popcount(t+1) unit nodes; sensitivity sqrt(5).
  total, worst = strategies.workload_errors(w, noise.tree(steps), single)
  counts = [bin(t + 1).count('1') for t in range(steps)]
  assert total == pytest.approx(math.sqrt(5 * sum(counts)))
  assert worst == pytest.approx(math.sqrt(5 * max(counts)))
  # Two epochs of a tree over both: the example's two leaves share nodes.
  twice = accounting.FixedOrder(2, steps // 2)
  sensitivity = accounting.mechanism_sensitivity(noise.tree(steps), twice)
  total_twice, _ = strategies.workload_errors(w, noise.tree(steps), twice)
  assert total_twice == pytest.approx(total / math.sqrt(5) * sensitivity)


@pytest.mark.parametrize('call,match', [
    (lambda: strategies.workload(10, 'ones', momentum=0.9), 'no momentum'),
    (lambda: strategies.workload(10, 'other'), 'kind'),
    (lambda: strategies.momentum_matrix(10, 1.0), 'momentum'),
    (lambda: strategies.decay_matrix(10, -0.1), 'decay'),
    (lambda: strategies.optimize_strategy(np.ones((3, 4))), 'square'),
    (lambda: strategies.optimize_strategy(np.tri(10), 3), 'equal epochs'),
    (lambda: strategies.optimize_strategy(np.tri(4) * np.nan), 'non-finite'),
    (lambda: strategies.optimize_strategy(np.tri(4), bands=0), 'bands'),
    (lambda: strategies.workload_errors(
        np.tri(4), noise.tree(4, release='prefix'),
        accounting.single_epoch(4)), 'per-step'),
])
def test_bad_inputs_raise(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_long_optimizations_report_progress():
  calls = []
  strategies.optimize_strategy(strategies.workload(12, 'true', momentum=0.9),
                               2, cache_dir=False,
                               progress=lambda i, loss: calls.append((i, loss)))
  iterations = [i for i, _ in calls]
  assert iterations == list(range(1, len(calls) + 1)) and len(calls) > 3
  losses = [loss for _, loss in calls]
  assert all(b <= a * (1 + 1e-12) for a, b in zip(losses, losses[1:]))
  # The default, a line on stderr: tests/test_progress.py.
