"""The single-epoch synthetic experiment: library code path, privacy, a tiny run."""

import csv
import os

import jax
import numpy as np
import pytest

from configs import single_epoch_synthetic as experiment_config
from experiments import single_epoch_synthetic as experiment

NUM_EXAMPLES, BATCH = 60, 6
STEPS = NUM_EXAMPLES // BATCH
EPSILON, DELTA = 1.0, 1e-5
# A learning rate for the SGD-type methods, beta for the SRG-type ones.
HYPER = {'srgd': 20.0, 'srgd_preset': 20.0, 'srgd_independent': 20.0,
         'unaccelerated_srg': 5.0, 'unaccelerated_srg_4_3': 5.0,
         'dpsgd': 0.1, 'dpftrl': 0.1}


def tiny_data():
  config = experiment_config.get_config()
  config.dim = 5
  return experiment.make_data(NUM_EXAMPLES, (0,), config)


@pytest.mark.parametrize('method', sorted(experiment.LABELS))
def test_scan_runner_equals_python_loop_of_library_updates(method):
  """The compiled sweep (scan, vmap, beta reparametrization)
  gives what the library's transformation gives stepped by hand."""
  data = tiny_data()
  loss = data.problems[0][0].loss
  multiplier = 2.0
  runner = experiment.make_runner(method, BATCH, STEPS, multiplier, 1.0,
                                  loss)
  # Inside (projection idle), outside (active), anisotropic features.
  for case in (0, 1, 2):
    runs = [{'slot': 0, 'case': case, 'hyper': HYPER[method], 'clip': 1.5,
             'seed': 7}]
    scanned = experiment.run_list(runner, data, runs, 1, key_base=100)[0]
    looped = experiment.train_python_loop(
        method, loss, data.x[0, data.kinds[case]], data.y[0, case],
        batch_size=BATCH,
        num_steps=STEPS, multiplier=multiplier, hyper=HYPER[method],
        clip=1.5, radius=1.0, key=jax.random.key(107))
    assert np.linalg.norm(looped) > 1e-3  # the run moved
    np.testing.assert_allclose(scanned, np.asarray(looped), rtol=2e-4,
                               atol=2e-6)


def test_runs_in_one_call_match_runs_alone():
  """Vmapping runs together (padding included) changes no run."""
  data = tiny_data()
  runner = experiment.make_runner('srgd', BATCH, STEPS, 2.0, 1.0,
                                  data.problems[0][0].loss)
  runs = [{'slot': 0, 'case': c, 'hyper': h, 'clip': 1.0, 'seed': s}
          for c, h, s in ((0, 10.0, 1), (1, 40.0, 2), (0, 40.0, 3))]
  together = experiment.run_list(runner, data, runs, 2, key_base=0)
  alone = np.concatenate([experiment.run_list(runner, data, [r], 1, 0)
                          for r in runs])
  np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('method', sorted(experiment.LABELS))
def test_each_method_meets_the_privacy_target(method):
  multiplier = experiment.noise_multiplier(method, STEPS, EPSILON, DELTA)
  assert multiplier > 0
  spent = experiment.epsilon_spent(method, STEPS, multiplier, DELTA)
  assert spent <= EPSILON
  # The calibration is tight: 10% less noise breaks the target.
  assert experiment.epsilon_spent(method, STEPS, 0.9 * multiplier,
                                  DELTA) > EPSILON


def test_tree_methods_use_the_tree_and_sgd_the_gaussian():
  assert experiment.mechanism('srgd', 8).release == 'prefix'
  assert experiment.mechanism('unaccelerated_srg', 8).release == 'prefix'
  assert experiment.mechanism('dpftrl', 8).release == 'per_step'
  assert (experiment.mechanism('dpsgd', 8).name ==
          experiment.mechanism('srgd_independent', 8).name)


def test_excess_risk_is_zero_at_the_constrained_optimum():
  data = tiny_data()
  for problem in data.problems[0]:
    optimum = problem.constrained_optimum(1.0)
    assert experiment.excess_risk(problem, optimum, 1.0) == pytest.approx(
        0.0, abs=1e-12)
    assert experiment.excess_risk(problem, np.zeros(5), 1.0) > 0
    assert experiment.excess_risk(problem, np.full(5, np.nan), 1.0) == (
        np.inf)


def test_tiny_end_to_end_run_writes_the_table(tmp_path):
  config = experiment_config.get_config()
  config.dim = 5
  config.num_examples = (196,)
  config.batch_rules = ((1.0, 0.5),)
  config.headline_rule = 0
  config.small_rule = 0
  config.methods = ('srgd', 'srgd_preset', 'unaccelerated_srg_4_3', 'dpsgd')
  config.learning_rates = (1e-6, 1e-5)   # far too small: the pick is extended
  config.accelerated_relative_betas = (0.3,)
  config.clips = (1.0,)
  config.grid_extensions = 2
  config.tune_seeds = (0,)
  config.eval_seeds = (100, 101)
  rows = experiment.run(config, str(tmp_path))
  assert len(rows) == 4 * 3  # methods x cases
  for name in ('results.csv', 'results.md', 'tuning.csv',
               'excess_vs_batch.png', 'excess_vs_n.png', 'run_record.json'):
    assert os.path.exists(tmp_path / name), name
  with open(tmp_path / 'results.csv') as f:
    table = list(csv.DictReader(f))
  assert {r['method'] for r in table} == set(config.methods)
  for r in table:
    assert int(r['batch_size']) == 14 and int(r['num_steps']) == 14
    assert float(r['epsilon_spent']) <= 1.0
    assert np.isfinite(float(r['excess_mean']))
    assert float(r['excess_mean']) >= 0
  problems = experiment.make_data(196, (100,), config).problems[0]
  for r in rows:
    k = config.cases.index(r['case'])
    if r['method'] == 'dpsgd':
      # 1e-5 was the upper edge: extended twice, the pick still on it.
      assert r['hyper'] == pytest.approx(1e-3)
      assert r['grid_edge'] == 'lr upper' and r['chosen_on_grid_edge']
    if r['method'] == 'unaccelerated_srg_4_3':
      assert r['hyper'] == pytest.approx(
          np.max(problems[k].spectrum) * np.sqrt(196) / 14)
      assert r['grid_edge'] == ''   # one beta, one clip: nothing searched
    if r['method'] == 'srgd_preset':
      expected = experiment.preset(196, problems[k], config)
      assert (r['hyper'], r['clip'], r['noise_multiplier']) == (
          expected.beta, expected.l2_clip, expected.noise_multiplier)
  assert rows[-1]['case'] == 'anisotropic'
  text = (tmp_path / 'results.md').read_text()
  assert 'NOT a private selection' in text
  assert 'Accelerated-DP-SRGD' in text
  # The figures and table redrawn from results.csv are the run's.
  (tmp_path / 'results.md').unlink()
  (tmp_path / 'excess_vs_n.png').unlink()
  experiment.replot(str(tmp_path), config)
  assert (tmp_path / 'results.md').read_text() == text
  assert (tmp_path / 'excess_vs_n.png').exists()


def test_preset_constants_bound_every_gradient_on_the_ball():
  config = experiment_config.get_config()
  config.dim = 5
  data = experiment.make_data(20000, (0,), config)
  for k, problem in enumerate(data.problems[0]):
    lipschitz, smoothness = experiment.preset_constants(problem, config)
    x = data.x[0, data.kinds[k]].astype(np.float64)
    y = data.y[0, k].astype(np.float64)
    assert np.max(np.sum(x ** 2, 1)) <= smoothness * (1 + 1e-6)
    w = problem.constrained_optimum(config.radius)
    norms = np.abs(x @ w - y) * np.linalg.norm(x, axis=1)
    # Below L except for the label-noise tail beyond 3 sigma.
    assert np.mean(norms > lipschitz) < 0.003
