"""A sweep as one vmapped program against a Python loop of jitted runs.

Both sides do the same work: every (learning rate, clip) grid point times
every seed of `experiments.sweep_digits` (DP-MEMF logistic regression on
digits, each run a whole `lax.scan` of training), producing the same
metrics:

* `vmapped`: `experiments.sweeps.run_sweep` (one compiled program,
  `jax.vmap` over runs, `--max_parallel` runs per call);
* `loop`: `jax.jit(train_fn)` compiled once for one run, then called for
  each run in a Python loop (what a for-loop over seeds and hyperparameters
  does when the hyperparameters are traced arguments).

Compilation is timed separately from running. Each side runs `--repeats`
times, in rounds that alternate which side goes first (the median is
reported), and the script checks that both sides computed the same
accuracies.

    python benchmarks/sweep_vs_loop.py [--seeds 20] [--epochs 10] \
        [--max_parallel 90] [--repeats 3]
"""

import argparse
import os
import statistics
import sys
import time

# `experiments` is a top-level folder of the repository, not installed; the
# repository's `dpsco_jax` must win over any installed copy.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

import dpsco_jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from configs import sweep_digits as sweep_config  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import datasets  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import sweep_digits  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import sweeps  # pylint: disable=g-import-not-at-top,wrong-import-position


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', type=int, default=20)
  parser.add_argument('--epochs', type=int, default=10)
  parser.add_argument('--max_parallel', type=int, default=90)
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args()

  config = sweep_config.get_config()
  config.num_epochs = args.epochs
  train_data, test_data = datasets.load_digits()
  schedule = sweep_digits.Schedule(len(train_data['y']), config.batch_size,
                                   config.num_epochs)
  built = sweep_digits.mechanism_for(config, schedule)
  z = dpsco_jax.calibrate_noise_multiplier(
      built['mechanism'], schedule.participation, config.epsilon,
      config.delta)
  train_fn = sweep_digits.make_train_fn(
      config, train_data, test_data, schedule, noise_multiplier=z,
      strategy=built['strategy'])
  grid = {'learning_rate': config.learning_rates, 'clip': config.clips}
  seeds = list(range(args.seeds))
  points = sweeps.grid_points(sweeps.validate_grid(grid))
  num_runs = len(points) * len(seeds)
  print(f'jax {jax.__version__}, devices {jax.devices()}, '
        f'{os.cpu_count()} CPUs')
  print(f'{config.algorithm}: {len(points)} grid points x {len(seeds)} seeds '
        f'= {num_runs} runs of {schedule.num_steps} steps (batch '
        f'{schedule.batch_size}), max_parallel {args.max_parallel}')

  # Loop: one jitted single run, compiled once, called per (point, seed).
  start = time.perf_counter()
  example = ({'learning_rate': np.float32(points[0, 0]),
              'clip': np.float32(points[0, 1])}, np.int32(seeds[0]))
  single = jax.jit(train_fn).lower(*example).compile()
  loop_compile = time.perf_counter() - start

  def loop_once():
    start = time.perf_counter()
    acc = np.zeros((len(points), len(seeds)))
    for g, (lr, clip) in enumerate(points):
      for s, seed in enumerate(seeds):
        out = single({'learning_rate': np.float32(lr),
                      'clip': np.float32(clip)}, np.int32(seed))
        acc[g, s] = float(out['test_accuracy'])  # Waits for the run.
    return time.perf_counter() - start, acc

  def vmapped_once():
    # run_sweep compiles on every call; its run_seconds excludes that.
    result = sweeps.run_sweep(train_fn, grid, seeds,
                              max_parallel=args.max_parallel)
    return (result.run_seconds, result.metrics['test_accuracy'],
            result.compile_seconds)

  # Rounds alternate which side goes first, so that a change in machine load
  # hits both alike.
  vmapped_runs, loop_runs, vmapped_compiles = [], [], []
  for r in range(args.repeats):
    for side in (('vmapped', 'loop') if r % 2 == 0 else ('loop', 'vmapped')):
      if side == 'vmapped':
        seconds, vmapped_acc, compile_seconds = vmapped_once()
        vmapped_runs.append(seconds)
        vmapped_compiles.append(compile_seconds)
      else:
        seconds, loop_acc = loop_once()
        loop_runs.append(seconds)
  vmapped_compile = statistics.median(vmapped_compiles)

  vmapped = statistics.median(vmapped_runs)
  loop = statistics.median(loop_runs)
  print(f'{"":10s} {"compile (s)":>12s} {"run (s, median)":>16s} '
        f'{"min":>8s} {"max":>8s} {"per run (ms)":>13s}')
  for name, comp, runs in (('vmapped', vmapped_compile, vmapped_runs),
                           ('loop', loop_compile, loop_runs)):
    med = statistics.median(runs)
    print(f'{name:10s} {comp:12.2f} {med:16.3f} {min(runs):8.3f} '
          f'{max(runs):8.3f} {1e3 * med / num_runs:13.2f}')
  print(f'loop / vmapped run time: {loop / vmapped:.2f}x')
  differ = np.abs(vmapped_acc - loop_acc)
  print(f'max |accuracy difference| between the two: {differ.max():.4f} '
        f'({int((differ > 0).sum())} of {num_runs} runs differ)')


if __name__ == '__main__':
  main()
