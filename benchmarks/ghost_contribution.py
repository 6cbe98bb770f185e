"""Each example's clipped contribution, ghost and vmap paths, on a decoder LM.

With a clip that binds on every example, each example's contribution to the
clipped sum should have norm equal to the clip. This script builds a small
GPT-style decoder language model in plain JAX (token embedding, learned
positions, pre-norm blocks of causal self-attention and a GELU MLP with
biases, a final norm and an untied head; next-token cross-entropy averaged
over the positions), a batch of 8 random token sequences, a clip of 1% of the
smallest per-example gradient norm, and prints, per configuration and path
(`clipping_method='ghost'` and `clipping_method='vmap'` of
`dpsco_jax.clipped_grad_sum`):

* the worst (smallest) and largest `||contribution|| / clip` over the 8
  examples, a contribution being the clipped sum with only that example
  unmasked;
* the relative l2 difference `|ghost sum - vmap sum| / |vmap sum|` of the
  clipped sums over the whole batch.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/ghost_contribution.py [--configs 256,32,2,16]

`--configs` takes `V,d,L,T` tuples separated by `;` (vocabulary, width,
layers, positions); the default is the two CPU rows of the table in the
ghost-clipping issue, `256,32,2,16;1024,32,1,256`.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dpsco_jax

BATCH = 8


def init(rng: np.random.Generator, vocabulary: int, width: int, layers: int,
         positions: int) -> dict:
  """Parameters of the decoder (all float32)."""
  normal = lambda *shape, scale: jnp.asarray(
      rng.normal(size=shape) * scale, jnp.float32)
  dense = lambda a, b: normal(a, b, scale=1 / np.sqrt(a))
  params = {'embed': normal(vocabulary, width, scale=1.0),
            'position': normal(positions, width, scale=0.1),
            'final_scale': jnp.ones(width),
            'head': dense(width, vocabulary)}
  for k in range(layers):
    params[f'block_{k}'] = {
        'attention_scale': jnp.ones(width), 'mlp_scale': jnp.ones(width),
        'query': dense(width, width), 'key': dense(width, width),
        'value': dense(width, width), 'out': dense(width, width),
        'mlp_in': dense(width, 4 * width),
        'mlp_in_bias': jnp.zeros(4 * width),
        'mlp_out': dense(4 * width, width), 'mlp_out_bias': jnp.zeros(width)}
  return params


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) +
                           1e-6) * scale


def loss_fn(params: dict, example: dict) -> jax.Array:
  """Mean next-token cross-entropy of ONE sequence `example['tokens']`."""
  tokens = example['tokens']
  positions = tokens.shape[0] - 1
  inputs, targets = tokens[:-1], tokens[1:]
  h = jnp.take(params['embed'], inputs, axis=0) + params['position']
  causal = jnp.arange(positions)[:, None] >= jnp.arange(positions)[None, :]
  layers = len([key for key in params if key.startswith('block_')])
  for k in range(layers):
    block = params[f'block_{k}']
    x = _rms_norm(h, block['attention_scale'])
    q, key, v = (x @ block[name] for name in ('query', 'key', 'value'))
    scores = (q @ key.T) / np.sqrt(q.shape[-1])
    scores = jnp.where(causal, scores, -1e9)
    h = h + (jax.nn.softmax(scores) @ v) @ block['out']
    x = _rms_norm(h, block['mlp_scale'])
    h = h + (jax.nn.gelu(x @ block['mlp_in'] + block['mlp_in_bias'])
             @ block['mlp_out'] + block['mlp_out_bias'])
  logits = _rms_norm(h, params['final_scale']) @ params['head']
  log_probs = jax.nn.log_softmax(logits)
  picked = jnp.sum(log_probs * jax.nn.one_hot(targets, logits.shape[-1]),
                   axis=-1)
  return -jnp.mean(picked)


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(leaf, np.float64))
                         for leaf in jax.tree_util.tree_leaves(tree)])


def measure(vocabulary: int, width: int, layers: int, positions: int,
            seed: int = 0) -> dict:
  """The contribution ratios and the sums' difference for one decoder."""
  rng = np.random.default_rng(seed)
  params = init(rng, vocabulary, width, layers, positions)
  batch = {'tokens': jnp.asarray(
      rng.integers(0, vocabulary, (BATCH, positions + 1)), jnp.int32)}
  per_example = jax.jit(jax.vmap(jax.grad(loss_fn), (None, 0)))(params,
                                                                 batch)
  norms = np.sqrt(sum(np.sum(np.asarray(leaf, np.float64).reshape(BATCH, -1)
                             ** 2, axis=1)
                      for leaf in jax.tree_util.tree_leaves(per_example)))
  clip = float(0.01 * norms.min())   # binds on every example
  out = {}
  for method in ('ghost', 'vmap'):
    stat = jax.jit(dpsco_jax.clipped_grad_sum(loss_fn, clip,
                                              clipping_method=method))
    ratios = [np.linalg.norm(_flat(stat(batch, params,
                                        mask=np.arange(BATCH) == i).sum))
              / clip for i in range(BATCH)]
    out[method] = (min(ratios), max(ratios), _flat(stat(batch, params).sum))
  difference = (np.linalg.norm(out['ghost'][2] - out['vmap'][2]) /
                np.linalg.norm(out['vmap'][2]))
  return {'ghost': out['ghost'][:2], 'vmap': out['vmap'][:2],
          'difference': difference}


def parse_args(argv: list[str]) -> argparse.Namespace:
  """Parses command-line flags."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--configs', default='256,32,2,16;1024,32,1,256',
                      help='V,d,L,T tuples separated by ";"')
  args = parser.parse_args(argv)
  try:
    args.configs = [tuple(int(v) for v in part.split(','))
                    for part in args.configs.split(';')]
  except ValueError:
    parser.error('--configs must be V,d,L,T tuples of integers')
  if any(len(c) != 4 or min(c) < 1 for c in args.configs):
    parser.error('--configs must be V,d,L,T tuples of positive integers')
  return args


def main(argv: list[str]) -> None:
  """Prints one table row per configuration."""
  args = parse_args(argv)
  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'batch {BATCH}, clip = 1% of the smallest per-example norm')
  print('| decoder | ghost worst | ghost max | vmap worst | vmap max | '
        'rel. l2 diff of sums | seconds |')
  print('|---|---|---|---|---|---|---|')
  for vocabulary, width, layers, positions in args.configs:
    start = time.perf_counter()
    row = measure(vocabulary, width, layers, positions)
    print(f'| V {vocabulary}, d {width}, L {layers}, T {positions} | '
          f'{row["ghost"][0]:.5f} | {row["ghost"][1]:.5f} | '
          f'{row["vmap"][0]:.5f} | {row["vmap"][1]:.5f} | '
          f'{row["difference"]:.2e} | {time.perf_counter() - start:.0f} |',
          flush=True)


if __name__ == '__main__':
  main(sys.argv[1:])
