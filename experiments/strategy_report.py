r"""Compares noise mechanisms on the workloads of paper 001 §5, at equal privacy.

For each setting (k epochs of b steps, fixed order) and each workload W
("ones": prefix sums A; "true": M A, SGD with momentum 0.9), prints
`||W N||_F` and `max_t ||(W N)_t||_2` (`dpsco_jax.strategies.workload_errors`)
times the mechanism's sensitivity under `FixedOrder(k, b)`, i.e. the noise
error for a unit noise multiplier at equal privacy, for:

* identity (DP-SGD's i.i.d. noise, sensitivity sqrt(k));
* the binary tree over all steps, and restarted every epoch (DP-FTRL);
* Honaker's tree;
* the optimized dense strategy for W, and the one optimized for the other
  workload (how much the choice of workload matters);
* optimized banded strategies (a few band counts).

Usage:
  python -m experiments.strategy_report                    # k=1, T=120 and
                                                           # k=6, b=100
  python -m experiments.strategy_report --settings=1x120   # one setting

Writes `strategy_report.csv`, `strategy_report.md` and `run_record.json` to
`--output_dir`.
Strategies are cached on disk (`dpsco_jax.strategies.default_cache_dir`).
"""

import os
import time
from typing import Sequence

from absl import app
from absl import flags
from absl import logging

from dpsco_jax import accounting
from dpsco_jax import noise
from dpsco_jax import strategies
from experiments import outputs

FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program, so that importing this module (tests)
  # does not clash with other experiments' flags.
  flags.DEFINE_list('settings', ['1x120', '6x100'],
                    'Settings as EPOCHSxSTEPS_PER_EPOCH.')
  flags.DEFINE_list('bands', ['2', '8', '32'],
                    'Band counts of banded strategies.')
  flags.DEFINE_float('momentum', 0.9, "Momentum of the 'true' workload.")
  flags.DEFINE_string('output_dir', 'results/strategy_report',
                      'Where the CSV and markdown tables go.')


WORKLOADS = ('ones', 'true')
HEADER = ('setting', 'workload', 'mechanism', 'sensitivity', 'frobenius_error',
          'max_error', 'vs_identity')


def _parse_setting(text: str) -> tuple[int, int]:
  try:
    epochs, steps = (int(part) for part in text.lower().split('x'))
  except ValueError as error:
    raise app.UsageError(f'bad setting {text!r}: use EPOCHSxSTEPS, e.g. '
                         '6x100') from error
  return epochs, steps


def _workload(num_steps: int, kind: str, momentum: float):
  if kind == 'ones':
    return strategies.workload(num_steps, 'ones')
  return strategies.workload(num_steps, 'true', momentum=momentum)


def compare(num_epochs: int, steps_per_epoch: int, bands: Sequence[int],
            momentum: float) -> list[dict]:
  """All rows of one setting.

  Args:
    num_epochs: k.
    steps_per_epoch: b.
    bands: band counts of the banded strategies.
    momentum: momentum of the 'true' workload.

  Returns:
    One dict per (workload, mechanism), keys as `HEADER`.
  """
  num_steps = num_epochs * steps_per_epoch
  participation = accounting.FixedOrder(num_epochs, steps_per_epoch)
  workloads = {kind: _workload(num_steps, kind, momentum)
               for kind in WORKLOADS}
  optimized = {}
  for kind, matrix in workloads.items():
    start = time.perf_counter()
    optimized[kind] = strategies.optimize_strategy(matrix, num_epochs)
    logging.info('%s: dense strategy for %s in %.1f s (cached after the '
                 'first run)', participation, kind,
                 time.perf_counter() - start)
  mechanisms = {
      'identity (DP-SGD)': noise.gaussian(num_steps),
      'binary tree': noise.tree(num_steps),
      'Honaker tree': noise.tree(num_steps, honaker=True),
  }
  if num_epochs > 1:
    mechanisms['binary tree, restarted each epoch'] = noise.tree(
        num_steps, restart_every=steps_per_epoch)
  rows = []
  for kind, matrix in workloads.items():
    candidates = dict(mechanisms)
    candidates[f'optimized dense for {kind}'] = noise.matrix_factorization(
        optimized[kind])
    for other in WORKLOADS:
      if other != kind:
        candidates[f'optimized dense for {other}'] = (
            noise.matrix_factorization(optimized[other]))
    for band_count in bands:
      if band_count >= num_steps:
        continue
      strategy = strategies.optimize_strategy(matrix, num_epochs,
                                              bands=band_count)
      candidates[f'optimized {band_count}-banded for {kind}'] = (
          noise.matrix_factorization(strategy))
    identity_error, _ = strategies.workload_errors(
        matrix, mechanisms['identity (DP-SGD)'], participation)
    for name, mechanism in candidates.items():
      total, worst = strategies.workload_errors(matrix, mechanism,
                                                participation)
      rows.append({
          'setting': f'k={num_epochs}, b={steps_per_epoch} (T={num_steps})',
          'workload': kind,
          'mechanism': name,
          'sensitivity': accounting.mechanism_sensitivity(mechanism,
                                                          participation),
          'frobenius_error': total,
          'max_error': worst,
          'vs_identity': total / identity_error,
      })
  return rows


def markdown(rows: list[dict]) -> str:
  lines = ['| setting | workload | mechanism | sensitivity | ||W N||_F | '
           'max_t ||(W N)_t|| | vs identity |',
           '|---|---|---|---|---|---|---|']
  for row in rows:
    lines.append(
        f"| {row['setting']} | {row['workload']} | {row['mechanism']} | "
        f"{row['sensitivity']:.3f} | {row['frobenius_error']:.1f} | "
        f"{row['max_error']:.2f} | {row['vs_identity']:.3f} |")
  return '\n'.join(lines)


def run(settings: Sequence[str], bands: Sequence[int], momentum: float,
        output_dir: str) -> list:
  """Compares the strategies of every setting; writes the report files.

  Example:
    >>> rows = run(['1x120'], [2, 8], 0.9, 'results/strategy_report')

  Args:
    settings: 'EPOCHSxSTEPS' strings, e.g. '6x100'.
    bands: band widths of the banded strategies.
    momentum: momentum of the 'true' workload.
    output_dir: where `strategy_report.csv`, `strategy_report.md` and
      `run_record.json` go.

  Returns:
    The rows of the report.
  """
  start = time.perf_counter()
  rows = []
  for setting in settings:
    rows.extend(compare(*_parse_setting(setting), list(bands), momentum))
  outputs.write_csv(os.path.join(output_dir, 'strategy_report.csv'), rows,
                    columns=HEADER)
  with open(os.path.join(output_dir, 'strategy_report.md'), 'w') as f:
    f.write(markdown(rows) + '\n')
  # No data and no privacy spent: the record keeps the settings and versions.
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(
          {'settings': list(settings), 'bands': list(bands),
           'momentum': momentum},
          wall_seconds=time.perf_counter() - start,
          extra={'experiment': 'experiments.strategy_report'}))
  return rows


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  rows = run(FLAGS.settings, [int(b) for b in FLAGS.bands], FLAGS.momentum,
             FLAGS.output_dir)
  print(markdown(rows))


if __name__ == '__main__':
  _define_flags()
  app.run(main)
