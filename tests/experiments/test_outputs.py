"""Tests of `experiments.outputs`: CSVs, run records, plots, logging."""

import json
import math
import shlex
import sys

import dp_accounting
import ml_collections
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import accounting
from experiments import outputs

PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def test_csv_round_trip(tmp_path):
  rows = [{'algorithm': 'dpsgd', 'step': 0, 'loss': 2.302585},
          {'algorithm': 'dpsgd', 'step': 10, 'loss': 0.5, 'extra': None},
          {'algorithm': 'nonprivate', 'step': 10, 'loss': math.inf}]
  path = str(tmp_path / 'sub' / 'metrics.csv')
  outputs.write_csv(path, rows)
  back = outputs.read_csv(path)
  assert list(back[0]) == ['algorithm', 'step', 'loss', 'extra']
  assert [r['algorithm'] for r in back] == ['dpsgd', 'dpsgd', 'nonprivate']
  assert float(back[0]['loss']) == pytest.approx(2.302585)
  assert back[0]['extra'] == '' and back[1]['extra'] == ''
  assert float(back[2]['loss']) == math.inf


def test_csv_with_explicit_columns_refuses_unknown_keys(tmp_path):
  path = str(tmp_path / 'm.csv')
  outputs.write_csv(path, [{'a': 1}], columns=['a', 'b'])
  assert outputs.read_csv(path) == [{'a': '1', 'b': ''}]
  with pytest.raises(ValueError):
    outputs.write_csv(path, [{'a': 1, 'c': 2}], columns=['a'])


def test_event_to_dict_nests_and_drops_module_names():
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          0.1, dp_accounting.GaussianDpEvent(1.5)), 100)
  assert outputs.event_to_dict(event) == {
      'class_name': 'SelfComposedDpEvent', 'count': 100,
      'event': {'class_name': 'PoissonSampledDpEvent',
                'sampling_probability': 0.1,
                'event': {'class_name': 'GaussianDpEvent',
                          'noise_multiplier': 1.5}}}


@pytest.fixture(scope='module')
def dpsgd_privacy():
  mechanism = dpsco_jax.dpsgd_mechanism(100)
  participation = accounting.PoissonSampling(0.05, 100)
  z = dpsco_jax.calibrate_noise_multiplier(mechanism, participation, 1.0,
                                           1e-5, method='rdp')
  return mechanism, participation, z


def test_run_record_round_trip(tmp_path, dpsgd_privacy):
  mechanism, participation, z = dpsgd_privacy
  config = ml_collections.ConfigDict({'epsilon': 1.0, 'delta': 1e-5,
                                      'algorithms': ('dpsgd',),
                                      'model': {'width': 8}})
  entry = outputs.privacy_entry('dpsgd', mechanism, z, participation, 1e-5,
                                target_epsilon=1.0, method='rdp')
  record = outputs.run_record(config, privacy=[entry], wall_seconds=1.5,
                              extra={'accuracy': np.float32(0.9),
                                     'curve': np.arange(3)})
  path = str(tmp_path / 'run_record.json')
  outputs.write_json(path, record)
  with open(path) as f:
    back = json.load(f)
  assert back['config'] == {'epsilon': 1.0, 'delta': 1e-5,
                            'algorithms': ['dpsgd'], 'model': {'width': 8}}
  (privacy,) = back['privacy']
  assert privacy['name'] == 'dpsgd'
  assert 0.99 < privacy['epsilon_spent'] <= 1.0 + 1e-9
  assert privacy['target_epsilon'] == 1.0 and privacy['delta'] == 1e-5
  assert privacy['noise_multiplier'] == pytest.approx(z)
  assert privacy['participation'] == {'class_name': 'PoissonSampling',
                                      'sampling_probability': 0.05,
                                      'num_steps': 100}
  assert privacy['dp_event']['class_name'] == 'SelfComposedDpEvent'
  assert privacy['dp_event']['count'] == 100
  assert privacy['dp_event_repr'].startswith('SelfComposedDpEvent(')
  assert back['wall_seconds'] == 1.5
  assert back['accuracy'] == pytest.approx(0.9)
  assert back['curve'] == [0, 1, 2]
  assert 'jax' in back['packages'] and 'dp_accounting' in back['packages']
  assert back['devices']


def test_command_line_gives_back_a_module_run_as_typed(monkeypatch):
  class Spec:
    name = 'experiments.diff2_tabular'

  class Main:
    __spec__ = Spec

  monkeypatch.setitem(sys.modules, '__main__', Main)
  monkeypatch.setattr(sys, 'argv', [
      '/repo/experiments/diff2_tabular.py', "--config.datasets=('gas',)"])
  command = outputs.command_line()
  assert command == ("python -m experiments.diff2_tabular "
                     "'--config.datasets=('\"'\"'gas'\"'\"',)'")
  assert shlex.split(command)[3] == "--config.datasets=('gas',)"
  assert outputs.run_record({})['command'] == command
  assert outputs.run_record({}, extra={'command': 'x'})['command'] == 'x'

  class Script:
    __spec__ = None

  monkeypatch.setitem(sys.modules, '__main__', Script)
  monkeypatch.setattr(sys, 'argv', ['run.py', '--a=1'])
  assert outputs.command_line() == 'run.py --a=1'


def test_fixed_order_entry_has_a_gaussian_event():
  mechanism = dpsco_jax.dpftrl_mechanism(12, restart_every=6)
  participation = accounting.FixedOrder(2, 6)
  entry = outputs.privacy_entry('dpftrl', mechanism, 5.0, participation,
                                1e-5)
  assert entry['dp_event']['class_name'] == 'GaussianDpEvent'
  assert entry['epsilon_spent'] == pytest.approx(accounting.epsilon_spent(
      mechanism, 5.0, participation, 1e-5))
  assert entry['target_epsilon'] is None


def test_non_finite_values_stay_readable(tmp_path):
  path = str(tmp_path / 'r.json')
  outputs.write_json(path, {'epsilon_spent': math.inf, 'x': float('nan')})
  with open(path) as f:
    assert json.load(f) == {'epsilon_spent': 'inf', 'x': 'nan'}


def test_plots_write_pngs(tmp_path):
  steps = np.arange(1, 11)
  mean = 0.5 + 0.04 * steps
  curves = [outputs.Curve('a', steps, mean, mean - 0.02, mean + 0.02),
            outputs.Curve('b', steps, mean - 0.1)]
  path = str(tmp_path / 'plots' / 'curves.png')
  outputs.plot_curves(path, curves, xlabel='step', ylabel='accuracy',
                      title='t')
  pu = str(tmp_path / 'pu.png')
  outputs.plot_privacy_utility(
      pu, [outputs.Curve('dpmemf', [0.5, 1, 2], [0.7, 0.8, 0.9],
                         [0.65, 0.78, 0.89], [0.75, 0.82, 0.91])],
      reference=0.95)
  for p in (path, pu):
    with open(p, 'rb') as f:
      assert f.read(8) == PNG_MAGIC


def test_scalar_writer_without_backend_is_a_no_op(tmp_path):
  with outputs.scalar_writer(None) as writer:
    writer.scalar('a', 1.0, 0)
    assert writer.backend is None
  # Whatever is installed, writing never fails.
  with outputs.scalar_writer(str(tmp_path / 'tb')) as writer:
    writer.scalar('a', 1.0, 0)


def test_progress_logs_first_and_last(monkeypatch):
  lines = []
  monkeypatch.setattr(outputs.logging, 'info',
                      lambda fmt, *args: lines.append(fmt % args))
  progress = outputs.Progress('job', total=5, min_interval_seconds=3600)
  logged = [progress.update(i, loss=0.5) for i in range(1, 6)]
  assert logged == [True, False, False, False, True]
  assert lines[0].startswith('job: 1/5') and 'loss 0.5' in lines[0]
  assert lines[-1].startswith('job: 5/5')


def test_progress_at_step_0_says_no_eta_yet(monkeypatch):
  lines = []
  monkeypatch.setattr(outputs.logging, 'info',
                      lambda fmt, *args: lines.append(fmt % args))
  progress = outputs.Progress('train', total=100)
  progress.update(0)     # the spine logs step 0 before the first step
  progress.update(1)
  assert 'nan' not in lines[0] and 'eta not yet known' in lines[0]
  assert lines[1].startswith('train: 1/100') and ' s' in lines[1].split(
      'eta ')[1]


def test_columns_of_keeps_first_seen_order():
  assert outputs.columns_of([{'b': 1, 'a': 2}, {'c': 3, 'a': 4}]) == [
      'b', 'a', 'c']
