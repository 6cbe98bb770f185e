"""End-to-end test of `experiments.clipping_choices` on a tiny config."""

import json
import os

import numpy as np
import pytest

from configs import clipping_choices as clip_config
from experiments import clipping_choices
from experiments import outputs


def _tiny_config():
  config = clip_config.get_config()
  config.num_seeds = 2
  config.epsilons = (2.0,)
  config.num_epochs = 2             # 10 steps of 230.
  config.learning_rates = (0.5, 1.0)
  config.clips = (0.5, 1.0)
  config.search_mean_trials = 2.0
  return config


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  output_dir = str(tmp_path_factory.mktemp('clipping_choices'))
  return output_dir, clipping_choices.run(_tiny_config(), output_dir)


def test_one_row_per_method_with_its_accounted_epsilon(finished):
  _, out = finished
  rows = {row['method']: row for row in out['rows']}
  assert list(rows) == list(clipping_choices.METHODS)
  for method in clipping_choices.METHODS:
    row = rows[method]
    assert row['n'] == 2 and 0.0 < row['mean'] <= 1.0
    assert row['ci_low'] <= row['mean'] <= row['ci_high']
    # Every row spends at most the target, and close to it (calibrated).
    assert 0.9 * 2.0 < row['epsilon_accounted'] <= 2.0 + 1e-6, row
  search = rows[clipping_choices.SEARCH]
  assert search['covers'] == 'the whole search'
  # The search's trials get more noise than a single run at the same total.
  assert search['noise_multiplier'] > rows[clipping_choices.FIXED][
      'noise_multiplier']
  # The adaptive clip moved from its initial 0.1.
  final_clip = rows[clipping_choices.ADAPTIVE]['final_clip']
  assert np.isfinite(final_clip) and abs(final_clip - 0.1) > 0.05


def test_writes_the_table_the_plot_and_the_record(finished):
  output_dir, out = finished
  with open(os.path.join(output_dir, 'privacy_utility.png'), 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n'
  with open(os.path.join(output_dir, 'summary.md')) as f:
    text = f.read()
  assert 'NOT privately' in text and 'private random search' in text
  runs = outputs.read_csv(os.path.join(output_dir, 'runs.csv'))
  searched = [r for r in runs if r['method'] == clipping_choices.SEARCH]
  assert len(searched) == 2 and all(int(r['trials']) >= 1 for r in searched)
  with open(os.path.join(output_dir, 'run_record.json')) as f:
    record = json.load(f)
  assert record['experiment'] == 'experiments.clipping_choices'
  assert len(record['privacy']) == 1
  assert out['table'].count('\n') >= 5


def test_an_unknown_method_is_refused():
  with pytest.raises(ValueError, match='unknown method'):
    clipping_choices.private_gradient(_tiny_config(), 'median', {}, 1.0,
                                      None, None)
