"""Peak memory and step time of paper 004's zero- and first-order statistics.

Compiles, on two ReLU models of about 1e5 parameters (synthetic inputs,
softmax cross-entropy), the clipped sum that every difference step of the
single-pass oracle computes (`smoothing.clipped_smoothed_difference_sum`:
two smoothed-gradient estimates per example, at z_t and z_{t-1}, clipped as
one difference), for:

* ``zero``: the zero-order estimator (function values at x +- alpha u_j,
  directions regenerated from a key: never stored);
* ``first``: the first-order estimator (gradients at points of the ball);
* ``non-private``: ``jax.grad`` of the mean batch loss at one point (the
  reference a non-private step pays);

each with all examples at once and in microbatches of 8 and 1. The models:

* ``mlp``: 784-128-10 (101,770 parameters): the parameters dominate the
  memory of one example;
* ``tokens``: 128 tokens of 64 features, a per-token MLP 64-768-64, mean
  over tokens, then 64->10 (99,978 parameters): the activations (128 x 768
  per example) dominate, which a backward pass keeps and a forward pass
  does not.

Peak memory is
XLA's own account of the compiled program (``memory_analysis()``: the
temporaries, plus arguments and outputs), which does not depend on machine
load; step time is the median over interleaved rounds. Ratios come from the
same run.

Usage (from the repository root)::

    python benchmarks/nonsmooth_memory.py [--batch 32] [--directions 8]
"""

from __future__ import annotations

import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import harness

from dpsco_jax import smoothing
# pylint: enable=g-import-not-at-top,wrong-import-position

MODELS = {
    # name: (layer widths, tokens per example; 0 = a flat input)
    'mlp': ((784, 128, 10), 0),
    'tokens': ((64, 768, 64, 10), 128),
}


def init_params(widths, seed: int) -> dict:
  """Dense layers {'layer_k': {'w', 'b'}} of the given widths."""
  rng = np.random.default_rng(seed)
  return {f'layer_{k}': {
      'w': jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
      'b': jnp.zeros(b, jnp.float32)}
          for k, (a, b) in enumerate(zip(widths[:-1], widths[1:]))}


def make_loss(widths, tokens: int):
  """Cross-entropy of ONE example (flat: an MLP; tokens: per-token MLP, mean)."""
  last = len(widths) - 2

  def loss(params: dict, example: dict) -> jax.Array:
    h = example['x']
    for k in range(last + 1):
      if tokens and k == last:
        h = jnp.mean(h, axis=0)  # pool the tokens before the classifier
      layer = params[f'layer_{k}']
      h = h @ layer['w'] + layer['b']
      if k < last and not (tokens and k == last - 1):
        h = jax.nn.relu(h)
    return -jax.nn.log_softmax(h)[example['y']]

  return loss


def variants(model: str, batch: int, directions: int):
  """name -> (jitted function, its arguments)."""
  widths, tokens = MODELS[model]
  example_loss = make_loss(widths, tokens)
  params = init_params(widths, 0)
  prev = jax.tree_util.tree_map(lambda w: w + 1e-3, params)
  rng = np.random.default_rng(1)
  shape = (batch, tokens, widths[0]) if tokens else (batch, widths[0])
  data = {'x': jnp.asarray(rng.normal(size=shape), jnp.float32),
          'y': jnp.asarray(rng.integers(0, widths[-1], batch))}
  smoothing_batch = smoothing.SmoothingBatch(
      data, smoothing.example_keys(jax.random.key(2), batch))
  out = {}
  for order in ('zero', 'first'):
    for micro in (None, 8, 1):
      stat = smoothing.clipped_smoothed_difference_sum(
          example_loss, 1.0, order=order, radius=0.1,
          num_directions=directions, microbatch_size=micro)
      name = f'{order}' + ('' if micro is None else f', microbatch {micro}')
      out[name] = (jax.jit(lambda b, p, q, s=stat: s(b, p, q).sum),
                   (smoothing_batch, params, prev))
  mean_loss = lambda p, b: jnp.mean(jax.vmap(example_loss, (None, 0))(p, b))
  out['non-private'] = (jax.jit(jax.grad(mean_loss)), (params, data))
  return out


def run_model(model: str, args) -> None:
  """Prints one model's table."""
  widths, tokens = MODELS[model]
  params = init_params(widths, 0)
  num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  print(f'\n## {model}: widths {"-".join(map(str, widths))}'
        + (f' per token, {tokens} tokens' if tokens else '')
        + f' ({num_params:,} parameters), batch {args.batch}, '
        f'm = {args.directions} directions per point')
  fns = variants(model, args.batch, args.directions)
  memory = {name: harness.compiled_peak_bytes(fn, *a)
            for name, (fn, a) in fns.items()}
  rows, skipped = harness.build_rows({
      name: (lambda name=name, fn=fn, a=a: harness.loop_row(
          name, lambda _: fn(*a), None)) for name, (fn, a) in fns.items()})
  times = harness.time_rows(rows, args.iters, args.warmup, args.rounds,
                            skipped)
  median = {name: statistics.median(t) for name, t in times.items()}
  names = list(times)
  base = 'non-private'
  print('\n| statistic | peak memory (MiB) | x non-private | step (ms) | '
        'x non-private |')
  print('|---|---|---|---|---|')
  for name in names:
    print(f'| {name} | {memory[name] / 2**20:.2f} | '
          f'{memory[name] / memory[base]:.1f} | {1e3 * median[name]:.1f} | '
          f'{median[name] / median[base]:.0f} |')
  for suffix in ('', ', microbatch 8', ', microbatch 1'):
    zero, first = 'zero' + suffix, 'first' + suffix
    print(f'zero / first order{suffix or ", all at once"}: memory '
          f'{memory[zero] / memory[first]:.2f}x, time '
          f'{median[zero] / median[first]:.2f}x')


def main() -> None:
  parser = harness.timing_parser(__doc__, iters=2, warmup=0, rounds=3)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--directions', type=int, default=8)
  parser.add_argument('--models', default=','.join(MODELS))
  args = harness.parse_timing(parser, sys.argv[1:])
  args.models = harness.split_choices(parser, args.models, tuple(MODELS),
                                      '--models')
  print('\n'.join(harness.header_lines('nonsmooth_memory.py', sys.argv[1:],
                                       ())))
  for model in args.models:
    run_model(model, args)


if __name__ == '__main__':
  main()
