r"""Noise error against T for dense, banded, BLT, tree and i.i.d. noise.

For each number of steps T (single participation, prefix-sum workload A,
the noise of DP-FTRL / DP-MF), reports the root-mean-square error
`||A N||_F / sqrt(T)` and the worst step's error `max_t ||(A N)_t||_2`,
both times the mechanism's sensitivity: the noise error for a unit noise
multiplier at equal privacy (every mechanism here is one Gaussian
mechanism, so equal sensitivity-scaled noise is equal epsilon), for:

* identity (DP-SGD's i.i.d. noise);
* the binary tree and Honaker's tree;
* the optimized dense strategy (`strategies.optimize_strategy`, which
  minimizes the Frobenius error);
* optimized banded strategies (`bands=`);
* the closed-form banded square root (`strategies.banded_square_root`,
  C with b bands) and banded inverse square root
  (`strategies.banded_inverse_square_root`, C^-1 with b bands, C dense),
  for the same band counts: no optimization, `b - 1` noise buffers;
* BLT strategies with 2 to 5 buffers (`blt.optimize(error='mean')`, the
  same objective), their noise state `d` params-sized buffers where the
  dense strategy keeps `T - 1`;
* with `--max_loss` (default): BLT strategies optimized for the max-loss
  (`blt.optimize(error='max')`: the worst step's squared error times the
  squared sensitivity, jax_privacy's BLT objective), and the optimal
  Toeplitz strategy for the max error, the Toeplitz square root of A
  (`c_0 = 1, c_k = c_(k-1) (1 - 1/(2k))`; Fichtenberger, Henzinger &
  Upadhyay 2023, optimal among Toeplitz strategies by Dvijotham et al.
  2024), in closed form at every T: the reference of the published
  BLT-vs-Toeplitz ratios.

Dense and banded strategies (optimized or closed-form) are materialized
only up to `--max_dense_steps` (the optimization and the `[T, T]` matrices
are the expensive part); BLT and the identity's closed form continue
beyond.

Usage:
  python -m experiments.blt_report --steps=64,128,256,512,2048,10000

Writes `blt_report.csv`, `blt_report.md`, `blt_report.png` and
`run_record.json` to `--output_dir`.
"""

import math
import os
import time
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import blt
from dpsco_jax import checks
from dpsco_jax import noise
from dpsco_jax import strategies
from experiments import outputs

FLAGS = flags.FLAGS

HEADER = ('num_steps', 'mechanism', 'noise_buffers', 'sensitivity',
          'rmse', 'max_error', 'rmse_vs_dense')


def _define_flags() -> None:
  flags.DEFINE_list('steps', ['64', '128', '256', '512', '2048', '10000'],
                    'Numbers of steps T.')
  flags.DEFINE_list('bands', ['8', '32'], 'Band counts of banded strategies.')
  flags.DEFINE_list('buffers', ['2', '3', '4', '5'], 'BLT buffer counts.')
  flags.DEFINE_integer('max_dense_steps', 512,
                       'Largest T for the materialized (dense, banded, tree) '
                       'rows.')
  flags.DEFINE_bool('max_loss', True,
                    'Add the max-loss BLT rows and the optimal Toeplitz '
                    'strategy for the max error.')
  flags.DEFINE_string('output_dir', 'results/blt_report',
                      'Where the tables and the plot go.')


def optimal_toeplitz_column(num_steps: int) -> np.ndarray:
  """First column of the Toeplitz square root of A (prefix sums).

  `c_0 = 1, c_k = c_(k-1) (1 - 1/(2k))`: `C C = A`, the strategy of least
  max error among lower-triangular Toeplitz ones under single
  participation (Fichtenberger, Henzinger & Upadhyay 2023; Dvijotham et
  al. 2024). Its decoder is `A C^-1 = C`.

  Example:
    >>> optimal_toeplitz_column(3)
    array([1.   , 0.5  , 0.375])

  Args:
    num_steps: T.

  Returns:
    float64 `[T]`.

  Raises:
    ValueError: unless `num_steps` is a positive integer.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  ratios = 1.0 - 0.5 / np.arange(1, num_steps)
  return np.concatenate([[1.0], np.cumprod(ratios)])


def compare(num_steps: int, bands: Sequence[int], buffers: Sequence[int],
            max_dense_steps: int, max_loss: bool = True) -> list[dict]:
  """The rows of one T.

  Args:
    num_steps: T.
    bands: band counts of the banded strategies.
    buffers: BLT buffer counts.
    max_dense_steps: materialized mechanisms only up to this T.
    max_loss: also the max-loss BLT rows and the optimal Toeplitz strategy
      for the max error.

  Returns:
    One dict per mechanism, keys as `HEADER`.
  """
  participation = accounting.single_epoch(num_steps)
  rows = []

  def add(name, buffers_kept, sensitivity, frobenius, worst):
    rows.append({'num_steps': num_steps, 'mechanism': name,
                 'noise_buffers': buffers_kept, 'sensitivity': sensitivity,
                 'rmse': frobenius / math.sqrt(num_steps),
                 'max_error': worst, 'rmse_vs_dense': math.nan})

  # i.i.d. noise in closed form: row t of A has t + 1 ones.
  add('identity (DP-SGD)', 0, 1.0,
      math.sqrt(num_steps * (num_steps + 1) / 2), math.sqrt(num_steps))
  if num_steps <= max_dense_steps:
    workload = strategies.workload(num_steps)
    mechanisms = {
        'binary tree': noise.tree(num_steps),
        'Honaker tree': noise.tree(num_steps, honaker=True),
        'optimized dense': noise.matrix_factorization(
            strategies.optimize_strategy(workload, 1)),
    }
    for band_count in bands:
      if band_count < num_steps:
        mechanisms[f'optimized {band_count}-banded'] = (
            noise.matrix_factorization(strategies.optimize_strategy(
                workload, 1, bands=band_count)))
    for band_count in bands:
      if band_count < num_steps:
        mechanisms[f'banded_sqrt {band_count}'] = noise.matrix_factorization(
            strategies.banded_square_root(num_steps, band_count))
        c, c_inverse = strategies.banded_inverse_square_root(
            num_steps, band_count, with_inverse=True)
        mechanisms[f'banded_inverse_sqrt {band_count}'] = (
            noise.matrix_factorization(c, inverse=c_inverse))
    for name, mechanism in mechanisms.items():
      frobenius, worst = strategies.workload_errors(workload, mechanism,
                                                    participation)
      add(name, noise.noise_buffer_count(mechanism),
          accounting.mechanism_sensitivity(mechanism, participation),
          frobenius, worst)
  column = blt.toeplitz_workload_column(num_steps)
  for count in buffers:
    start = time.perf_counter()
    params = blt.optimize(num_steps, count, error='mean')
    logging.info('T=%d: BLT with %d buffers optimized in %.1f s', num_steps,
                 count, time.perf_counter() - start)
    frobenius, worst = blt.errors(params, column)
    add(f'BLT, {count} buffers', count, blt.sensitivity(params, num_steps),
        frobenius, worst)
  if max_loss:
    # C C = A, so the decoder A C^-1 is C: row t's squared error is the
    # sum of c_m^2 up to t, the sensitivity ||c||.
    root = optimal_toeplitz_column(num_steps)
    squared = np.cumsum(root ** 2)
    scale = math.sqrt(squared[-1])
    add('optimal Toeplitz (max error)', num_steps - 1, scale,
        scale * math.sqrt(np.sum(squared)), scale * math.sqrt(squared[-1]))
    for count in buffers:
      params = blt.optimize(num_steps, count, error='max')
      frobenius, worst = blt.errors(params, column)
      add(f'BLT max-loss, {count} buffers', count,
          blt.sensitivity(params, num_steps), frobenius, worst)
  dense = [row['rmse'] for row in rows if row['mechanism'] == 'optimized dense']
  for row in rows:
    if dense:
      row['rmse_vs_dense'] = row['rmse'] / dense[0]
  return rows


def markdown(rows: list[dict]) -> str:
  lines = ['| T | mechanism | noise buffers | sensitivity | RMSE | '
           'max error | RMSE / dense |', '|---|---|---|---|---|---|---|']
  for row in rows:
    ratio = ('' if math.isnan(row['rmse_vs_dense'])
             else f"{row['rmse_vs_dense']:.4f}")
    lines.append(
        f"| {row['num_steps']} | {row['mechanism']} | "
        f"{row['noise_buffers']} | {row['sensitivity']:.3f} | "
        f"{row['rmse']:.3f} | {row['max_error']:.3f} | {ratio} |")
  return '\n'.join(lines)


def run(steps: Sequence[int], bands: Sequence[int], buffers: Sequence[int],
        max_dense_steps: int, output_dir: str,
        max_loss: bool = True) -> list[dict]:
  """Compares the mechanisms at every T; writes the report files.

  Example:
    >>> rows = run([64, 256], [8], [2, 4], 256, 'results/blt_report')

  Args:
    steps: the numbers of steps.
    bands: band counts of the banded strategies.
    buffers: BLT buffer counts.
    max_dense_steps: materialized mechanisms only up to this T.
    output_dir: where the files go.
    max_loss: also the max-loss BLT rows and the optimal Toeplitz strategy
      for the max error.

  Returns:
    The rows.
  """
  start = time.perf_counter()
  rows = []
  for num_steps in steps:
    rows.extend(compare(num_steps, bands, buffers, max_dense_steps,
                        max_loss))
  outputs.write_csv(os.path.join(output_dir, 'blt_report.csv'), rows,
                    columns=HEADER)
  with open(os.path.join(output_dir, 'blt_report.md'), 'w') as f:
    f.write(markdown(rows) + '\n')
  names = list(dict.fromkeys(row['mechanism'] for row in rows))
  curves = []
  for name in names:
    points = [(row['num_steps'], row['rmse']) for row in rows
              if row['mechanism'] == name]
    curves.append(outputs.Curve(name, [p[0] for p in points],
                                [p[1] for p in points]))
  outputs.plot_curves(os.path.join(output_dir, 'blt_report.png'), curves,
                      xlabel='steps T', ylabel='RMSE of the prefix sums',
                      title='noise error at equal privacy (unit multiplier)',
                      xscale='log', yscale='log', markers=True)
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(
          {'steps': list(steps), 'bands': list(bands),
           'buffers': list(buffers), 'max_dense_steps': max_dense_steps,
           'max_loss': max_loss},
          wall_seconds=time.perf_counter() - start,
          extra={'experiment': 'experiments.blt_report'}))
  return rows


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  rows = run([int(t) for t in FLAGS.steps], [int(b) for b in FLAGS.bands],
             [int(d) for d in FLAGS.buffers], FLAGS.max_dense_steps,
             FLAGS.output_dir, FLAGS.max_loss)
  print(markdown(rows))


if __name__ == '__main__':
  _define_flags()
  app.run(main)
