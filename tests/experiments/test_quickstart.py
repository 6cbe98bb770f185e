"""End-to-end test of `experiments.quickstart` on a two-epoch config."""

import csv
import json
import math
import os

import pytest

from configs import quickstart as quickstart_config
from experiments import quickstart

PRIVATE = ('dpsgd', 'dpftrl', 'dpmemf')


def _read_csv(path):
  with open(path, newline='') as f:
    reader = csv.DictReader(f)
    return reader.fieldnames, list(reader)


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  """One short run of every algorithm, shared by the tests below."""
  config = quickstart_config.get_config()
  config.num_epochs = 2
  config.eval_every = 5
  # A smaller target than the default 2 keeps the PLD calibration fast
  # (seconds per run, the bulk of this test's time besides compilation).
  config.epsilon = 0.5
  output_dir = str(tmp_path_factory.mktemp('quickstart'))
  summary = quickstart.run(config, output_dir)
  return config, output_dir, {row['algorithm']: row for row in summary}


def test_writes_metrics_summary_and_plot(finished_run):
  config, output_dir, _ = finished_run
  columns, metrics = _read_csv(os.path.join(output_dir, 'metrics.csv'))
  assert tuple(columns) == quickstart.METRICS_COLUMNS
  assert {row['algorithm'] for row in metrics} == set(config.algorithms)
  columns, summary = _read_csv(os.path.join(output_dir, 'summary.csv'))
  assert tuple(columns) == quickstart.SUMMARY_COLUMNS
  assert [row['algorithm'] for row in summary] == list(config.algorithms)
  plot = os.path.join(output_dir, 'learning_curves.png')
  with open(plot, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_metrics_cover_every_run_from_start_to_end(finished_run):
  _, output_dir, by_name = finished_run
  _, metrics = _read_csv(os.path.join(output_dir, 'metrics.csv'))
  for name, row in by_name.items():
    steps = [int(r['step']) for r in metrics if r['algorithm'] == name]
    assert steps[0] == 0 and steps[-1] == row['num_steps']
    assert steps == sorted(steps)
    # The last logged accuracy is the one reported in the summary.
    last = [r for r in metrics if r['algorithm'] == name][-1]
    assert float(last['test_accuracy']) == pytest.approx(row['test_accuracy'])
    # Zero init predicts uniformly: loss ln(10) before the first step, and
    # nothing is spent yet.
    first = [r for r in metrics if r['algorithm'] == name][0]
    assert float(first['train_loss']) == pytest.approx(math.log(10), rel=1e-5)
    assert float(first['epsilon']) == 0.0
    # The epsilon so far grows to the run's.
    spent = [float(r['epsilon']) for r in metrics if r['algorithm'] == name]
    assert spent == sorted(spent)
    assert spent[-1] == pytest.approx(row['epsilon_spent'])


@pytest.mark.parametrize('name', PRIVATE)
def test_private_runs_spend_at_most_the_target(finished_run, name):
  config, _, by_name = finished_run
  row = by_name[name]
  assert 0 < row['epsilon_spent'] <= config.epsilon + 1e-6
  # Calibrated tightly, not with a wastefully large noise multiplier.
  assert row['epsilon_spent'] > 0.99 * config.epsilon
  assert row['noise_multiplier'] > 0
  assert row['delta'] == config.delta


def test_step_counts_follow_the_samplers(finished_run):
  config, _, by_name = finished_run
  # Fixed order: every full batch of the 1,437 training examples, each epoch.
  fixed_order_steps = config.num_epochs * (1437 // config.batch_size)
  assert by_name['dpftrl']['num_steps'] == fixed_order_steps
  assert by_name['dpmemf']['num_steps'] == fixed_order_steps
  assert by_name['nonprivate']['num_steps'] == fixed_order_steps
  # Poisson: as many expected epochs.
  assert by_name["dpsgd"]["num_steps"] == round(
      config.num_epochs * 1437 / config.expected_batch_size)


def test_accuracies_are_meaningful(finished_run):
  _, _, by_name = finished_run
  assert by_name['nonprivate']['test_accuracy'] > 0.8
  assert by_name['nonprivate']['epsilon_spent'] == math.inf
  for name in PRIVATE:
    # Ten balanced classes: chance is 0.1; ask for twice that.
    assert by_name[name]['test_accuracy'] > 0.2, name


def test_rejects_unknown_algorithm(tmp_path):
  config = quickstart_config.get_config()
  config.algorithms = ('dpsgd', 'adam')
  with pytest.raises(ValueError, match='adam'):
    quickstart.run(config, str(tmp_path))


def test_writes_run_record(finished_run):
  config, output_dir, by_name = finished_run
  with open(os.path.join(output_dir, 'run_record.json')) as f:
    record = json.load(f)
  assert record['config']['epsilon'] == config.epsilon
  entries = {entry['name']: entry for entry in record['privacy']}
  assert set(entries) == set(PRIVATE)
  for name in PRIVATE:
    assert entries[name]['epsilon_spent'] == pytest.approx(
        by_name[name]['epsilon_spent'])
    assert entries[name]['dp_event']['class_name']
  assert record['wall_seconds'] > 0
