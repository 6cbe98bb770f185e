"""Cost of the in-step refusals (mechanism identity and capacity) per step.

Every private step checks, inside the compiled program, that its noise state
was made by its own mechanism and that the step is within the capacity the
noise was calibrated for (`dpsco_jax.guards.record`: the output poisoned
with a select and the refusal recorded in the state, no host round trip). This script times the jitted DP-SGD step
with the checks and, side by side in the same process, with the checks
replaced by a pass-through, interleaving the two so that machine load hits
both alike, and prints the median ratio.

    python benchmarks/refusal_overhead.py --batch_size=500 --rounds=7
"""

import argparse
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpsco_jax
from dpsco_jax import noise


def _loss(params, example):
  logits = example['x'] @ params['w'] + params['b']
  return -jax.nn.log_softmax(logits)[example['y']]


def _step():
  tx = optax.chain(
      dpsco_jax.dpsgd(_loss, l2_clip=1.0, noise_multiplier=1.0,
                      num_steps=2**30, key=jax.random.key(0)),
      optax.sgd(0.1))

  @jax.jit
  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  return tx, step


def _time(step, params, state, batch, repeats: int) -> float:
  params, state = step(params, state, batch)
  jax.block_until_ready(params)
  start = time.perf_counter()
  for _ in range(repeats):
    params, state = step(params, state, batch)
  jax.block_until_ready(params)
  return (time.perf_counter() - start) / repeats


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch_size', type=int, default=500)
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--repeats', type=int, default=200)
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  batch = {'x': jnp.asarray(rng.normal(size=(args.batch_size, 784)),
                            jnp.float32),
           'y': jnp.asarray(rng.integers(0, 10, args.batch_size))}
  params = {'w': jnp.zeros((784, 10)), 'b': jnp.zeros(10)}

  tx_checked, checked = _step()
  original = noise._refuse_invalid  # pylint: disable=protected-access
  # The same step without the in-step refusals (eager checks still run).
  noise._refuse_invalid = lambda state, tree, *unused: (tree, state.refusal)  # pylint: disable=protected-access
  try:
    with warnings.catch_warnings():
      # The same key on purpose: both steps do the same work.
      warnings.simplefilter('ignore', dpsco_jax.keys.KeyReuseWarning)
      tx_unchecked, unchecked = _step()
    state_unchecked = tx_unchecked.init(params)
    jax.block_until_ready(unchecked(params, state_unchecked, batch))
  finally:
    noise._refuse_invalid = original  # pylint: disable=protected-access
  state_checked = tx_checked.init(params)
  ratios, times = [], []
  for _ in range(args.rounds):
    with_checks = _time(checked, params, state_checked, batch, args.repeats)
    without = _time(unchecked, params, state_unchecked, batch, args.repeats)
    ratios.append(with_checks / without)
    times.append((with_checks, without))
  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'logistic regression 784->10, batch {args.batch_size}, '
        f'{args.rounds} interleaved rounds of {args.repeats} steps')
  for with_checks, without in times:
    print(f'  with refusals {1e3 * with_checks:.3f} ms/step, without '
          f'{1e3 * without:.3f} ms/step')
  print(f'median ratio (with / without): {statistics.median(ratios):.3f}')


if __name__ == '__main__':
  main(sys.argv[1:])
