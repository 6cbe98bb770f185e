"""Compiled work of a Poisson DP-SGD plan step: one padded call vs physical batches.

For a small MLP and a Poisson plan (`plans.dpsgd`, expected batch B), reads
XLA's cost analysis of the compiled programs (`jax.jit(f).lower(
*ShapeDtypeStructs).compile().cost_analysis()`: flops and bytes accessed;
nothing is executed, no accelerator needed) and averages it over the
sampler's batch-size distribution (Binomial(n, q), every size of
probability above 1e-12):

* ``fixed B``: the private step (the plan's private transformation and
  optimizer) on a fixed batch of exactly B examples, the reference;
* ``one call (padded)``: `Plan.step`, which evaluates the sampler's padded
  batch (B plus four standard deviations, rounded up to 32);
* ``physical P=...``: `Plan.step`, the realized batch cut into
  physical batches (`physical.physical_sizes`), plus the zero accumulation
  and the finishing program (noise, batch checks, optimizer).

The target (issue 35): the physical step at most 1.1x the flops of the
fixed batch of size B, at B = 32 and B = 1024.

Usage::

    python benchmarks/physical_batches.py [--expected 32 1024]
        [--hidden 256] [--input 784] [--num_examples 60000]
        [--physical_fractions 1 4]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,wrong-import-position
import dpsco_jax
from dpsco_jax import physical
from dpsco_jax import plans

PyTree = Any
TAIL = 1e-12   # batch sizes less likely than this are left out of the mean
NUM_CLASSES = 10


class Cost(NamedTuple):
  """XLA's estimate for one compiled program."""

  flops: float
  bytes_accessed: float


def program_cost(fn: Callable[..., Any], *args: Any) -> Cost:
  """The compiled cost of `fn` at the shapes of `args` (not executed)."""
  cost = dpsco_jax.compiled_cost(fn, *args)
  return Cost(cost.flops, cost.bytes_accessed)


def mlp(input_dim: int, hidden: int):
  """`(params, loss_fn)`: a one-hidden-layer MLP and its per-example loss."""
  keys = jax.random.split(jax.random.key(0), 2)
  params = {
      'w1': jax.random.normal(keys[0], (input_dim, hidden)) / input_dim**0.5,
      'b1': jnp.zeros(hidden),
      'w2': jax.random.normal(keys[1], (hidden, NUM_CLASSES)) / hidden**0.5,
      'b2': jnp.zeros(NUM_CLASSES)}

  def loss_fn(params, example):
    h = jax.nn.relu(example['x'] @ params['w1'] + params['b1'])
    logits = h @ params['w2'] + params['b2']
    return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                           example['y'])

  return params, loss_fn


def batch_of(size: int, input_dim: int) -> dict[str, jax.ShapeDtypeStruct]:
  return {'x': jax.ShapeDtypeStruct((size, input_dim), jnp.float32),
          'y': jax.ShapeDtypeStruct((size,), jnp.int32)}


def size_distribution(num_examples: int, q: float) -> dict[int, float]:
  """Realized batch size -> probability, sizes of probability > TAIL."""
  low = int(stats.binom.ppf(TAIL, num_examples, q))
  high = int(stats.binom.isf(TAIL, num_examples, q))
  sizes = np.arange(low, high + 1)
  weights = stats.binom.pmf(sizes, num_examples, q)
  return dict(zip(sizes.tolist(), (weights / weights.sum()).tolist()))


def _padded(num_real: int, multiple: int) -> int:
  return max(1, -(-num_real // multiple)) * multiple


def compare(expected: int, *, num_examples: int = 60_000,
            input_dim: int = 784, hidden: int = 256,
            physical_fractions: tuple[int, ...] = (1, 4)
            ) -> list[dict[str, Any]]:
  """The table's rows for one expected batch size (see the module doc).

  Args:
    expected: B, the expected Poisson batch size.
    num_examples: n (q = B / n).
    input_dim: the MLP's input width.
    hidden: the MLP's hidden width.
    physical_fractions: physical batch sizes as B / fraction.

  Returns:
    Dicts with `step`, `flops`, `bytes`, their ratios to the fixed batch,
    and `shapes` (programs compiled for the batch).
  """
  params, loss_fn = mlp(input_dim, hidden)
  optimizer = optax.sgd(0.1)
  distribution = size_distribution(num_examples, expected / num_examples)

  def plan_with(physical_batch_size):
    return plans.dpsgd(loss_fn, optimizer=optimizer,
                       num_examples=num_examples, batch_size=expected,
                       epochs=1, l2_clip=1.0, noise_multiplier=1.0,
                       delta=1e-6, seed=0, method='rdp',
                       physical_batch_size=physical_batch_size)

  plan = plan_with(expected)
  opt_state = jax.eval_shape(plan.transformation.init, params)
  multiple = plan.batches.pad_to_multiple

  # The reference: the private step on a fixed batch of B.
  fixed_tx = optax.chain(plan.private_transformation, optimizer)

  def fixed_step(params, state, batch):
    updates, state = fixed_tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  fixed = program_cost(fixed_step, params,
                       jax.eval_shape(fixed_tx.init, params),
                       batch_of(expected, input_dim))

  def logical_inputs(size):
    return {'example_ids': jax.ShapeDtypeStruct((size,), jnp.int32),
            'batch_mask': jax.ShapeDtypeStruct((size,), jnp.bool_)}

  def one_call(params, state, inputs):
    updates, state = plan.transformation.update(None, state, params,
                                                **inputs)
    return optax.apply_updates(params, updates), state

  padded_sizes = {_padded(k, multiple) for k in distribution}
  padded_cost = {
      size: program_cost(one_call, params, opt_state,
                         {'batch': batch_of(size, input_dim),
                          **logical_inputs(size)})
      for size in padded_sizes}
  rows = [{'step': f'fixed B={expected}', 'flops': fixed.flops,
           'bytes': fixed.bytes_accessed, 'shapes': 1}]
  rows.append({
      'step': f'one call (padded to {multiple})',
      'flops': sum(p * padded_cost[_padded(k, multiple)].flops
                   for k, p in distribution.items()),
      'bytes': sum(p * padded_cost[_padded(k, multiple)].bytes_accessed
                   for k, p in distribution.items()),
      'shapes': len(padded_sizes)})

  for fraction in physical_fractions:
    size = max(1, expected // fraction)
    split_plan = plan if size == expected else plan_with(size)
    step = physical.LogicalStep(split_plan.transformation,
                                split_plan.physical_form)
    granularity = split_plan.physical_form.granularity
    accumulation = jax.eval_shape(step.start, opt_state, params,
                                  batch_of(1, input_dim))
    start = program_cost(step.start, opt_state, params,
                         batch_of(1, input_dim))
    finish = {s: program_cost(step.finish, params, opt_state, accumulation,
                              logical_inputs(s)) for s in padded_sizes}
    pieces = {}
    for k in distribution:
      for piece in physical.physical_sizes(k, size, granularity):
        if piece not in pieces:
          pieces[piece] = program_cost(
              step.accumulate, accumulation, opt_state, params,
              physical.PhysicalBatch(
                  batch_of(piece, input_dim),
                  jax.ShapeDtypeStruct((piece,), jnp.bool_),
                  jax.ShapeDtypeStruct((piece,), jnp.int32)))

    def mean(field):
      return math.fsum(
          p * (getattr(start, field) +
               getattr(finish[_padded(k, multiple)], field) +
               sum(getattr(pieces[s], field)
                   for s in physical.physical_sizes(k, size, granularity)))
          for k, p in distribution.items())

    rows.append({'step': f'physical P={size} (g={granularity})',
                 'flops': mean('flops'), 'bytes': mean('bytes_accessed'),
                 'shapes': len(pieces)})
  for row in rows:
    row['flops_ratio'] = row['flops'] / fixed.flops
    row['bytes_ratio'] = row['bytes'] / fixed.bytes_accessed
  return rows


def format_table(results: dict[int, list[dict[str, Any]]]) -> str:
  """A markdown table of `compare`'s rows per expected batch size."""
  lines = ['| expected B | step | flops (mean) | x fixed B | bytes (mean) '
           '| x fixed B | physical shapes |',
           '|---|---|---|---|---|---|---|']
  for expected, rows in results.items():
    for row in rows:
      lines.append(
          f"| {expected} | {row['step']} | {row['flops']:.3e} | "
          f"{row['flops_ratio']:.3f} | {row['bytes']:.3e} | "
          f"{row['bytes_ratio']:.3f} | {row['shapes']} |")
  return '\n'.join(lines)


def main(argv=None) -> dict[int, list[dict[str, Any]]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--expected', type=int, nargs='+', default=[32, 1024])
  parser.add_argument('--num_examples', type=int, default=60_000)
  parser.add_argument('--input', type=int, default=784)
  parser.add_argument('--hidden', type=int, default=256)
  parser.add_argument('--physical_fractions', type=int, nargs='+',
                      default=[1, 4],
                      help='physical batch sizes, as B / fraction')
  args = parser.parse_args(argv)
  results = {b: compare(b, num_examples=args.num_examples,
                        input_dim=args.input, hidden=args.hidden,
                        physical_fractions=tuple(args.physical_fractions))
             for b in args.expected}
  print(f'MLP {args.input}-{args.hidden}-{NUM_CLASSES}, n = '
        f'{args.num_examples}, Poisson q = B / n; XLA cost analysis on '
        f'{jax.devices()[0].platform}, averaged over Binomial(n, q) batch '
        'sizes')
  print(format_table(results))
  return results


if __name__ == '__main__':
  main()
