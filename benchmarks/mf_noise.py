"""Matrix-factorization costs: strategy optimization time and noise per step.

Part 1 times `dpsco_jax.strategies.optimize_strategy` (cache disabled) for
the 120x120 (k = 1) and 600x600 (k = 6, b = 100) strategies of paper 001 §5,
on the "ones" and "true" (momentum 0.9) workloads, and prints the L-BFGS
iterations and the error reached.

Part 2 times one jitted noise step `mechanism.next` for params of
d = 7,850 and d = 30,730 floats (logistic regression on MNIST and CIFAR-10)
and T = 600 steps, for i.i.d. Gaussian noise (the reference), dense MF noise
with a ring buffer, dense MF noise regenerated from keys (timed at step
T/2, its average cost over a run), and 32-banded MF noise with a buffer. The
state is donated, as in a training loop that updates it in place. Variants
are interleaved in rounds; the median per-step time over rounds is reported
with the ratio to the Gaussian step.

Usage:
  python benchmarks/mf_noise.py [--rounds 5] [--iters 20] [--skip_optimize]
"""

import os
import sys
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import harness

from dpsco_jax import noise
from dpsco_jax import strategies
# pylint: enable=g-import-not-at-top,wrong-import-position

NUM_STEPS = 600
DIMS = (7_850, 30_730)


def time_optimization() -> None:
  print('== strategy optimization (float64, cache disabled) ==')
  print(f"{'size':>9} {'k':>2} {'workload':>8} {'seconds':>8} "
        f"{'||W C^-1||_F':>13}")
  for num_steps, num_epochs in ((120, 1), (600, 6)):
    for kind in ('ones', 'true'):
      momentum = 0.9 if kind == 'true' else 0.0
      w = strategies.workload(num_steps, kind, momentum=momentum)
      start = time.perf_counter()
      c = strategies.optimize_strategy(w, num_epochs, cache_dir=None)
      seconds = time.perf_counter() - start
      error = np.linalg.norm(w @ np.linalg.inv(c))
      print(f'{num_steps:>4}x{num_steps:<4} {num_epochs:>2} {kind:>8} '
            f'{seconds:>8.1f} {error:>13.2f}', flush=True)


def _noise_step(mechanism, dim, start_step):
  template = {'w': jnp.zeros((dim,), jnp.float32)}
  state = mechanism.init(template, jax.random.key(0))
  state = state._replace(step=jnp.asarray(start_step, jnp.int32))
  # Buffers are filled with noise-like values so no variant gets zeros.
  state = state._replace(buffers=jax.tree_util.tree_map(
      lambda b: jnp.ones_like(b) * 0.1, state.buffers))

  def step(state):
    out, new_state = mechanism.next(state, template)
    # Hold the step fixed: the regenerated variant is timed at T/2.
    return out, new_state._replace(step=state.step)

  step = jax.jit(step, donate_argnums=0)
  return step, state


def time_noise(rounds: int, iters: int, warmup: int) -> None:
  """Part 2: noise per step, side by side on `harness.time_rows`."""
  print('\n== noise per step, T = 600 (median over rounds) ==')
  c = strategies.optimize_strategy(strategies.workload(NUM_STEPS), 6)
  banded = strategies.optimize_strategy(strategies.workload(NUM_STEPS), 6,
                                        bands=32)
  variants = {
      'gaussian': (noise.gaussian(NUM_STEPS), 0),
      'mf dense, buffer': (noise.matrix_factorization(c), NUM_STEPS // 2),
      'mf dense, regenerate': (
          noise.matrix_factorization(c, storage='regenerate'), NUM_STEPS // 2),
      'mf 32-banded, buffer': (noise.matrix_factorization(banded),
                               NUM_STEPS // 2),
  }
  for dim in DIMS:
    rows = {}
    for name, (mechanism, start) in variants.items():
      step, state = _noise_step(mechanism, dim, start)
      rows[name] = harness.loop_row(name, lambda c, s=step: s(c[1]),
                                    (None, state))
    rows, skipped = harness.build_rows({n: (lambda r=r: r)
                                        for n, r in rows.items()})
    times = harness.time_rows(rows, iters, warmup, rounds, skipped)
    print(f'd = {dim}')
    for record in harness.summarize(times, 'gaussian', ratio_name='ratio'):
      print(f'  {record["row"]:<22} {record["median ms"]:>8} ms  '
            f'{record["ratio"]:>7} of gaussian', flush=True)


def main() -> None:
  parser = harness.timing_parser(__doc__, iters=20, warmup=0, rounds=5)
  parser.add_argument('--skip_optimize', action='store_true')
  args = harness.parse_timing(parser, sys.argv[1:])
  logging.set_verbosity(logging.WARNING)
  print('\n'.join(harness.header_lines('mf_noise.py', sys.argv[1:], ())))
  if not args.skip_optimize:
    time_optimization()
  time_noise(args.rounds, args.iters, args.warmup)


if __name__ == '__main__':
  main()
