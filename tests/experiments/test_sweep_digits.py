"""End-to-end test of `experiments.sweep_digits` on a tiny sweep."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import sweep_digits as sweep_config
from dpsco_jax import runs as dpsco_runs
from dpsco_jax import guards
from experiments import datasets
from experiments import outputs
from experiments import sweep_digits
from experiments import sweeps


def _tiny_config():
  config = sweep_config.get_config()
  config.num_seeds = 2
  config.num_epochs = 1          # 6 steps of 239.
  config.learning_rates = (0.5, 1.0)
  config.clips = (1.0,)
  config.epsilon = 2.0
  config.epsilons = (2.0,)
  config.max_parallel = 3        # 4 private runs: two chunks, one padded.
  return config


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  output_dir = str(tmp_path_factory.mktemp('sweep_digits'))
  return output_dir, sweep_digits.run(_tiny_config(), output_dir)


def test_writes_tables_plots_and_record(finished):
  output_dir, out = finished
  for name in ('learning_curves.png', 'privacy_utility.png'):
    with open(os.path.join(output_dir, name), 'rb') as f:
      assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  summary = outputs.read_csv(os.path.join(output_dir, 'summary.csv'))
  # 2 private grid points + 2 non-private learning rates.
  assert [r['algorithm'] for r in summary] == ['dpmemf'] * 2 + [
      'nonprivate'] * 2
  assert all(r['n'] == '2' for r in summary)
  runs = outputs.read_csv(os.path.join(output_dir, 'runs.csv'))
  assert len(runs) == 8
  with open(os.path.join(output_dir, 'summary.md')) as f:
    text = f.read()
  assert '| dpmemf | 2 | 0.5 | 1 |' in text and '95% CI' in text
  with open(os.path.join(output_dir, 'run_record.json')) as f:
    record = json.load(f)
  (privacy,) = record['privacy']
  assert 0.99 * 2.0 < privacy['epsilon_spent'] <= 2.0 + 1e-6
  assert privacy['dp_event']['class_name'] == 'GaussianDpEvent'
  assert privacy['participation'] == {'class_name': 'FixedOrder',
                                      'num_epochs': 1, 'steps_per_epoch': 6}
  assert record['config']['num_seeds'] == 2
  assert out['rows'][0]['epsilon_spent'] == privacy['epsilon_spent']
  # Two learning rates: the best of the grid is on an edge, and flagged.
  utility = outputs.read_csv(os.path.join(output_dir, 'privacy_utility.csv'))
  best = [r for r in utility if r['selection'].startswith('best')]
  assert best and all(r['grid_edge'].startswith('learning_rate ')
                      for r in best)


def test_accuracies_are_meaningful(finished):
  _, out = finished
  for row in out['rows']:
    # One epoch from zero init; chance is 0.1.
    assert row['mean'] > 0.5, row


def test_private_sweep_equals_single_runs():
  config = _tiny_config()
  train, test = datasets.load_digits()
  schedule = sweep_digits.Schedule(len(train['y']), config.batch_size,
                                   config.num_epochs)
  built = sweep_digits.mechanism_for(config, schedule)
  train_fn = sweep_digits.make_train_fn(
      config, train, test, schedule, noise_multiplier=2.0,
      strategy=built['strategy'])
  grid = {'learning_rate': [0.5, 1.0], 'clip': [0.5, 2.0]}
  result = sweeps.run_sweep(train_fn, grid, [3, 4], max_parallel=3)
  single = jax.jit(train_fn)
  for g in range(result.num_points):
    hparams = {k: jnp.float32(v) for k, v in result.point(g).items()}
    for s, seed in enumerate(result.seeds):
      alone = single(hparams, jnp.int32(seed))
      np.testing.assert_allclose(result.metrics['train_loss'][g, s],
                                 alone['train_loss'], rtol=1e-4)
      # Accuracy counts argmaxes: a near-tie may flip under reassociation.
      np.testing.assert_allclose(result.metrics['test_accuracy_curve'][g, s],
                                 alone['test_accuracy_curve'], atol=2 / 360)


def test_bad_configs_are_refused(tmp_path):
  config = _tiny_config()
  config.clips = (0.0, 1.0)
  with pytest.raises(ValueError, match='clip'):
    sweep_digits.run(config, str(tmp_path))
  config = _tiny_config()
  config.algorithm = 'adam'
  with pytest.raises(ValueError, match='adam'):
    sweep_digits.run(config, str(tmp_path))
  config = _tiny_config()
  config.epsilon = 3.0
  with pytest.raises(ValueError, match='epsilons'):
    sweep_digits.run(config, str(tmp_path))


def test_the_order_check_runs_inside_the_compiled_run(monkeypatch):
  # Epoch 2 fed in another order than epoch 1: DP-MEMF's order check
  # refuses it inside the compiled run, and the run's outputs are poisoned.
  config = _tiny_config()
  config.num_epochs = 2
  train, test = datasets.load_digits()
  schedule = sweep_digits.Schedule(len(train['y']), config.batch_size, 2)
  strategy = sweep_digits.mechanism_for(config, schedule)['strategy']
  hparams = {'learning_rate': jnp.float32(0.5), 'clip': jnp.float32(1.0)}

  def final_metrics():
    train_fn = sweep_digits.make_train_fn(
        config, train, test, schedule, noise_multiplier=1.0,
        strategy=strategy)
    return jax.jit(train_fn)(hparams, 0)

  accepted = final_metrics()
  assert np.isfinite(accepted['train_loss'])
  dpsco_runs.raise_refusal_metrics(accepted)
  scan_steps, b = dpsco_runs.scan_steps, schedule.steps_per_epoch

  def reordered(tx, params, state, batches, **kwargs):
    ids, mask = batches
    ids = ids.at[b:].set(jnp.roll(ids[b:], 1, axis=0))
    return scan_steps(tx, params, state, (ids, mask), **kwargs)

  monkeypatch.setattr(dpsco_runs, 'scan_steps', reordered)
  refused = final_metrics()
  assert np.isnan(refused['train_loss'])
  with pytest.raises(guards.PrivacyGuardError, match='refused at step 6'):
    dpsco_runs.raise_refusal_metrics(refused)
