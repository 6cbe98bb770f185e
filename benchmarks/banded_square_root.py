"""Closed-form banded strategies against optimized banded ones.

Part 1 prints `||W C^-1||_F` at equal sensitivity
(`strategies.workload_errors`) of the banded square root (BSR) and the
banded inverse square root (BISR) with b bands, divided by that of
`strategies.optimize_strategy(W, k, bands=b)`, on the "true" workload
`M A L` (several momentum / decay values) under `FixedOrder(k, T / k)`.

Part 2 measures what starting `optimize_strategy(bands=)` from the closed
form would change: its start (`_toeplitz_square_root_start`, the banded
square root of W computed by a generic Toeplitz recursion) is compared
with the start built from `strategies.banded_square_root`, and the
optimizer is run from both and from the identity (L-BFGS iterations,
seconds, final error).

Usage:
  OPENBLAS_NUM_THREADS=1 python benchmarks/banded_square_root.py
"""

import math
import time

import numpy as np

from dpsco_jax import accounting
from dpsco_jax import noise
from dpsco_jax import strategies

WORKLOADS = ((0.0, 0.0), (0.9, 0.0), (0.9, math.exp(-2.5)))


def _error(w, mechanism, participation) -> float:
  return strategies.workload_errors(w, mechanism, participation)[0]


def error_ratios() -> None:
  print('== ||W C^-1||_F / that of the optimized banded strategy ==')
  print(f"{'T':>4} {'k':>2} {'momentum':>8} {'decay':>6} {'b':>3} "
        f"{'optimized':>10} {'BSR':>6} {'BISR':>6}")
  for steps, epochs in ((24, 1), (24, 2), (64, 1), (64, 4)):
    participation = accounting.FixedOrder(epochs, steps // epochs)
    for momentum, decay in WORKLOADS:
      w = strategies.workload(steps, 'true', momentum=momentum, decay=decay)
      for bands in (2, 4, 8):
        optimized = _error(w, noise.matrix_factorization(
            strategies.optimize_strategy(w, epochs, bands=bands,
                                         cache_dir=False, progress=False)),
                           participation)
        bsr = _error(w, noise.matrix_factorization(
            strategies.banded_square_root(steps, bands, momentum=momentum,
                                          decay=decay)), participation)
        c, inverse = strategies.banded_inverse_square_root(
            steps, bands, momentum=momentum, decay=decay, with_inverse=True)
        bisr = _error(w, noise.matrix_factorization(c, inverse=inverse),
                      participation)
        print(f'{steps:>4} {epochs:>2} {momentum:>8.2f} {decay:>6.3f} '
              f'{bands:>3} {optimized:>10.2f} {bsr / optimized:>6.3f} '
              f'{bisr / optimized:>6.3f}')


def _closed_form_start(steps, epochs, bands, momentum, decay):
  """The starting Gram matrix of `optimize_strategy`, from the closed form."""
  c = strategies.banded_square_root(steps, bands, momentum=momentum,
                                    decay=decay)
  gram = c.T @ c
  scale = 1.0 / np.sqrt(epochs * np.diag(gram))
  return gram * np.outer(scale, scale)


def starts() -> None:
  print('\n== optimize_strategy from its start, the closed form, identity ==')
  current = strategies._toeplitz_square_root_start  # pylint: disable=protected-access
  for steps, epochs, bands, momentum, decay in (
      (60, 1, None, 0.9, 0.0), (60, 3, None, 0.9, 0.0), (60, 1, 8, 0.9, 0.0),
      (60, 3, 8, 0.9, math.exp(-2.5)), (120, 2, 16, 0.9, 0.0)):
    w = strategies.workload(steps, 'true', momentum=momentum, decay=decay)
    start_bands = min(bands or steps, steps // epochs)
    difference = np.abs(
        current(w, epochs, start_bands) -
        _closed_form_start(steps, epochs, start_bands, momentum, decay)).max()
    print(f'T={steps} k={epochs} bands={bands} momentum={momentum} '
          f'decay={decay:.3f}: max |start - closed-form start| = '
          f'{difference:.1e}')
    variants = {
        'current': current,
        'closed form': lambda w_, k, b, m=momentum, d=decay: (
            _closed_form_start(w_.shape[0], k, b, m, d)),
        'identity': lambda *args: None,
    }
    try:
      for name, start in variants.items():
        strategies._toeplitz_square_root_start = start  # pylint: disable=protected-access
        iterations = []
        begin = time.perf_counter()
        c = strategies.optimize_strategy(
            w, epochs, bands=bands, cache_dir=False,
            progress=lambda i, loss, log=iterations: log.append(i))
        seconds = time.perf_counter() - begin
        error = _error(w, noise.matrix_factorization(c),
                       accounting.FixedOrder(epochs, steps // epochs))
        print(f'  {name:>12}: {len(iterations):4d} iterations, '
              f'{seconds:6.2f} s, error {error:.4f}')
    finally:
      strategies._toeplitz_square_root_start = current  # pylint: disable=protected-access


if __name__ == '__main__':
  error_ratios()
  starts()
