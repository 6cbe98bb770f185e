"""The strategy comparison report on small settings."""

import json

import pytest

from experiments import strategy_report


@pytest.mark.parametrize('num_epochs,steps_per_epoch', [(1, 24), (3, 8)])
def test_optimized_strategy_wins_on_its_own_workload(num_epochs,
                                                     steps_per_epoch):
  rows = strategy_report.compare(num_epochs, steps_per_epoch, bands=[2, 4],
                                 momentum=0.9)
  for kind in strategy_report.WORKLOADS:
    errors = {row['mechanism']: row for row in rows if row['workload'] == kind}
    ours = errors[f'optimized dense for {kind}']
    assert ours['sensitivity'] == pytest.approx(1.0)
    for name, row in errors.items():
      if name != f'optimized dense for {kind}':
        assert ours['frobenius_error'] < row['frobenius_error'], name
    # The tree pays sqrt(levels) (and more when epochs share its nodes).
    assert errors['binary tree']['sensitivity'] > 1
    assert errors['identity (DP-SGD)']['vs_identity'] == 1.0
  table = strategy_report.markdown(rows)
  assert table.count('\n') == len(rows) + 1


def test_run_writes_the_report_and_its_record(tmp_path):
  rows = strategy_report.run(['1x12'], [2], 0.9, str(tmp_path))
  assert rows and (tmp_path / 'strategy_report.md').exists()
  header = (tmp_path / 'strategy_report.csv').read_text().split('\n')[0]
  assert header.split(',') == list(strategy_report.HEADER)
  record = json.loads((tmp_path / 'run_record.json').read_text())
  assert record['config']['settings'] == ['1x12']
  assert record['privacy'] == [] and record['packages']['jax']
