"""Cost of the outlier-removal private mean against the plain clipped mean.

Times, on the same K points of dimension d (user gradients already formed,
float32, i.i.d. Gaussian around a common mean), one jitted release of:

* `clipped mean`: clip each point to norm 1, sum, add one Gaussian draw,
  divide by K (what user-level DP-SGD does after its per-user gradients);
* `outlier removal`: `outlier_removal.private_robust_mean` (pairwise
  distances from the K x K Gram matrix, score, Laplace test, weights, mean,
  one Gaussian draw): O(K^2 d) work and a K x K matrix.

Both are interleaved in rounds with a rotating order; the reported time is
the median over rounds. The ratio `outlier removal / clipped mean` is
printed for each (K, d) from the same run.

`--constants` instead prints the noise constants of docs/user_level.md §5:
the aggregator's sigma K / tau against the clipped mean's sigma K / L at
the same (epsilon, delta), for one release and for a phase of T releases
on K of 4K users.

Usage (from the repository root)::

    python benchmarks/outlier_removal_step.py [--rounds 5] [--iters 3]
        [--sizes 256,1024,4096] [--dims 100,10000,100000]
    python benchmarks/outlier_removal_step.py --constants
"""

from __future__ import annotations

import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import harness

from dpsco_jax import accounting
from dpsco_jax import outlier_removal
# pylint: enable=g-import-not-at-top,wrong-import-position

EPSILON, DELTA = 2.0, 1e-6
# Point arrays above this are skipped (2 GiB): the K x d points must fit.
MAX_BYTES = 2 ** 31


def _clipped_mean(points, key, stddev):
  norms = jnp.linalg.norm(points, axis=1, keepdims=True)
  clipped = points * jnp.minimum(1.0, 1.0 / jnp.maximum(norms, 1e-30))
  total = jnp.sum(clipped, axis=0)
  return (total + stddev * jax.random.normal(key, total.shape)) / len(points)


def time_one(size: int, dim: int, rounds: int, iters: int) -> tuple:
  """Median seconds per release: (clipped mean, outlier removal)."""
  rng = np.random.default_rng(0)
  points = jnp.asarray(rng.normal(size=(size, dim)).astype(np.float32) /
                       np.sqrt(dim) * 0.05 + 1.0 / np.sqrt(dim))
  calibration = outlier_removal.calibrate(size, 0.2, EPSILON, DELTA)
  clipped = jax.jit(lambda p, k: _clipped_mean(p, k, 4.0))
  robust = jax.jit(lambda p, k: outlier_removal.private_robust_mean(
      p, calibration, k).value)
  variants = {'clipped mean': clipped, 'outlier removal': robust}
  # The carry counts releases: each draws its noise from a fresh key.
  rows, skipped = harness.build_rows({
      name: (lambda name=name, fn=fn: harness.loop_row(
          name, lambda c: (c[0] + 1, fn(points, jax.random.fold_in(
              jax.random.key(0), c[0]))), (0, None)))
      for name, fn in variants.items()})
  times = harness.time_rows(rows, iters, 0, rounds, skipped)
  if skipped:
    raise RuntimeError(f'not timed: {skipped}')
  return tuple(float(np.median(times[name])) for name in variants)


def print_constants() -> None:
  """docs/user_level.md §5: noise per unit of tau against per unit of L."""
  def clipped_multiplier(steps, population, size):
    return outlier_removal._bisect_multiplier(  # pylint: disable=protected-access
        lambda z: accounting.subsampled_gaussian_epsilon(
            z, steps, population, size, DELTA) > EPSILON)

  print(f'epsilon {EPSILON}, delta {DELTA}; replace-one user')
  print('| setting | c_agg = sigma K / tau | c_clip = sigma K / L | ratio |')
  print('|---|---|---|---|')
  for size in (300, 3000):
    cal = outlier_removal.calibrate(size, 1.0, EPSILON, DELTA)
    clip = 2 * clipped_multiplier(1, size, size)
    print(f'| one release, K = {size} | {cal.noise_std * size:.0f} | '
          f'{clip:.2f} | {cal.noise_std * size / clip:.0f} |')
  for size in (3000, 10000):
    cal = outlier_removal.calibrate(size, 1.0, EPSILON, DELTA, num_steps=30,
                                    population=4 * size, score_radius=2.0)
    clip = 2 * clipped_multiplier(30, 4 * size, size)
    print(f'| T = 30, n_i = 4K, K = {size} | {cal.noise_std * size:.0f} | '
          f'{clip:.1f} | {cal.noise_std * size / clip:.0f} |')


def main() -> None:
  parser = harness.timing_parser(__doc__, iters=3, warmup=0, rounds=5)
  parser.add_argument('--sizes', default='256,1024,4096')
  parser.add_argument('--dims', default='100,10000,100000')
  parser.add_argument('--constants', action='store_true')
  args = harness.parse_timing(parser, sys.argv[1:])
  if args.constants:
    print_constants()
    return
  print('\n'.join(harness.header_lines('outlier_removal_step.py',
                                       sys.argv[1:], ())))
  print('| K | d | clipped mean (ms) | outlier removal (ms) | ratio |')
  print('|---|---|---|---|---|')
  sizes = [int(v) for v in args.sizes.split(',')]
  dims = [int(v) for v in args.dims.split(',')]
  for size, dim in itertools.product(sizes, dims):
    if size * dim * 4 > MAX_BYTES:
      print(f'| {size} | {dim} | skipped: {size * dim * 4 / 2**30:.1f} GiB '
            'of points | | |')
      continue
    clipped, robust = time_one(size, dim, args.rounds, args.iters)
    print(f'| {size} | {dim} | {clipped * 1e3:.2f} | {robust * 1e3:.2f} | '
          f'{robust / clipped:.1f}x |', flush=True)


if __name__ == '__main__':
  main()
