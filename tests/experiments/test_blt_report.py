"""The BLT error report on small settings."""

import json
import math

import numpy as np
import pytest
import scipy.linalg

from dpsco_jax import accounting
from dpsco_jax import noise
from dpsco_jax import strategies
from experiments import blt_report


STEPS = 48


@pytest.fixture(scope='module')
def rows_48():
  """Every row of the report at 48 steps (computed once: the BLT and
  max-loss BLT optimizations are most of the report's time)."""
  return {row['mechanism']: row
          for row in blt_report.compare(STEPS, bands=[4], buffers=[2, 3],
                                        max_dense_steps=64)}


def test_blt_is_near_the_dense_strategy_and_below_the_others(rows_48):
  rows = rows_48
  dense = rows['optimized dense']
  assert dense['rmse_vs_dense'] == 1.0
  for name, row in rows.items():
    assert row['rmse'] >= dense['rmse'] * (1 - 1e-6), name
  assert rows['BLT, 3 buffers']['rmse_vs_dense'] < 1.05
  for other in ('identity (DP-SGD)', 'binary tree', 'Honaker tree',
                'optimized 4-banded'):
    assert rows['BLT, 3 buffers']['rmse'] < rows[other]['rmse'], other
  assert rows['BLT, 3 buffers']['noise_buffers'] == 3
  assert rows['optimized dense']['noise_buffers'] == 47
  # The closed-form banded (inverse) square roots: b - 1 buffers, between
  # the optimized dense strategy and i.i.d. noise.
  for name in ('banded_sqrt 4', 'banded_inverse_sqrt 4'):
    assert rows[name]['noise_buffers'] == 3, name
    assert rows[name]['rmse'] < rows['identity (DP-SGD)']['rmse'], name
  # The closed-form i.i.d. row equals the materialized one.
  assert math.isclose(rows['identity (DP-SGD)']['rmse'],
                      math.sqrt(49 / 2), rel_tol=1e-12)


def test_run_writes_the_report_and_its_record(tmp_path):
  rows = blt_report.run([16, 100], [4], [2], 16, str(tmp_path))
  assert {row['num_steps'] for row in rows} == {16, 100}
  # Beyond max_dense_steps only the closed-form and BLT rows.
  assert {row['mechanism'] for row in rows if row['num_steps'] == 100} == {
      'identity (DP-SGD)', 'BLT, 2 buffers', 'optimal Toeplitz (max error)',
      'BLT max-loss, 2 buffers'}
  for name in ('blt_report.md', 'blt_report.csv', 'blt_report.png'):
    assert (tmp_path / name).exists()
  record = json.loads((tmp_path / 'run_record.json').read_text())
  assert record['config']['steps'] == [16, 100]


def test_max_loss_rows_sit_between_the_optimal_toeplitz_and_the_mean_rows(
    rows_48):
  steps = STEPS
  rows = rows_48
  toeplitz = rows['optimal Toeplitz (max error)']
  # The closed form equals the materialized square root of A.
  root = scipy.linalg.toeplitz(blt_report.optimal_toeplitz_column(steps),
                               np.zeros(steps))
  workload = strategies.workload(steps)
  np.testing.assert_allclose(root @ root, workload, atol=1e-12)
  rmse, worst = strategies.workload_errors(
      workload, noise.matrix_factorization(root),
      accounting.single_epoch(steps))
  # The mechanism is accounted with the float32 coefficients the device
  # applies (2^-24 relative each), the closed form in float64.
  assert math.isclose(toeplitz['rmse'], rmse / math.sqrt(steps),
                      rel_tol=1e-6)
  assert math.isclose(toeplitz['max_error'], worst, rel_tol=1e-6)
  # A BLT is Toeplitz: no better than the optimum on the max error; the
  # max-loss BLT is near it and below the mean-loss BLT there.
  by_max, by_mean = rows['BLT max-loss, 3 buffers'], rows['BLT, 3 buffers']
  assert toeplitz['max_error'] <= by_max['max_error'] * (1 + 1e-9)
  assert by_max['max_error'] < 1.02 * toeplitz['max_error']
  assert by_max['max_error'] < by_mean['max_error']
  assert by_mean['rmse'] < by_max['rmse']
  assert 'optimal Toeplitz (max error)' not in {
      row['mechanism'] for row in blt_report.compare(
          steps, bands=[], buffers=[2], max_dense_steps=0, max_loss=False)}
