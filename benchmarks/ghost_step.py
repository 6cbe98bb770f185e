"""Per-step wall time of DP-SGD with ghost-norm clipping against the others.

Times one jitted training step, on synthetic data (784 float inputs, 10
classes, softmax cross-entropy), for:

* ``non-private``: ``jax.grad`` of the mean batch loss, then ``optax.sgd``;
* ``vmap``: ``dpsco_jax.clipped_grad_sum(..., clipping_method='vmap')`` (per-example
  gradients), the estimator's ``privatize_sum`` with DP-SGD's Gaussian
  mechanism, then ``optax.sgd``;
* ``ghost``: the same with ``clipping_method='ghost'`` (ghost norms, no per-example
  gradient);
* ``auto``: the same with ``clipping_method='auto'``, which takes the ghost or the
  vmap path by the cost model of ``dpsco_jax.ghost.clipping_choice`` (its
  choice and estimates are printed per model);
* ``dpsgd``: ``optax.chain(dpsco_jax.dpsgd(...), optax.sgd(...))`` as a user
  writes it (its default ``clipping_method='auto'`` takes the ghost path here);
* ``ghost clip only``: the ghost clipped sum divided by B, then
  ``optax.sgd``, without noise or the in-step refusals: NOT private, it
  isolates the cost of clipping from the fixed per-step cost of the noise
  and of the refusals' host callback (``benchmarks/refusal_overhead.py``);
* ``optax``: ``optax.contrib.dpsgd`` on ``jax.vmap``-ed per-example
  gradients.

* ``jax_privacy``: ``jax_privacy.clipped_grad`` (per-example gradients),
  its Gaussian privatizer and ``optax.sgd``, when ``jax_privacy`` is
  importable (``pip install jax-privacy``; else the column is skipped).

Models: logistic regression 784->10 (B=500), MLP 784-256-10 (B=500) and
MLP 784-1024-1024-10 (B=256), ReLU; a small CNN on 28x28 inputs (two 3x3
SAME convolutions with 16 and 32 channels, each followed by ReLU and 2x2
average pooling, a dense head; 20,490 parameters; B=256) whose
convolutions take the unfolded-input rule; and a one-block transformer
encoder (token embedding 1000x64, learned positions, 4-head self-attention,
two layer norms, a ReLU MLP 64-256-64, mean pooling; 116,426 parameters; 32
tokens, B=64) whose every parameter takes the ghost path (the embedding by
the token-equality Gram form). Before timing, the script checks that the
ghost and vmap clipped sums agree on the batch.

Variants are interleaved in rounds with a rotating order (machine-load drift
hits all alike); the reported time is the median over rounds of the mean
per-step time, and the ratios come from the same run. Peak memory is XLA's
own account of each compiled step (``memory_analysis()``: temporaries,
arguments and outputs), on whatever backend runs the script.

Usage (from the repository root)::

    python benchmarks/ghost_step.py [--iters 3] [--warmup 1] [--rounds 5] \
        [--only cnn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpsgd_step  # pylint: disable=g-import-not-at-top,wrong-import-position

import dpsco_jax  # pylint: disable=g-import-not-at-top,wrong-import-position
from dpsco_jax import estimators  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_CLASSES = dpsgd_step.NUM_CLASSES
INPUT_DIM = dpsgd_step.INPUT_DIM
RATIOS = (
    ('vmap', 'non-private'),
    ('ghost', 'non-private'),
    ('dpsgd', 'non-private'),
    ('optax', 'non-private'),
    ('jax_privacy', 'non-private'),
    ('ghost clip only', 'non-private'),
    ('vmap', 'ghost'),
    ('auto', 'ghost'),
    ('auto', 'vmap'),
)


class Problem(NamedTuple):
  """A model, the batch size it is timed with, and its steps per round."""

  model: dpsgd_step.Model
  batch_size: int
  # Multiplies --iters: cheap steps are timed over more steps per round, so
  # that timer and dispatch jitter stay small against them.
  iters_scale: int
  # `make_batch(rng, batch_size)`; None: 784 float inputs (`make_batch`).
  batch_fn: Optional[Callable[..., dpsgd_step.Batch]] = None


# The transformer encoder: vocabulary, sequence length, width, heads.
VOCABULARY, SEQUENCE, WIDTH, HEADS = 1000, 32, 64, 4


def transformer_init(rng: np.random.Generator) -> dict:
  """A one-block pre-norm transformer encoder (116,426 parameters)."""
  normal = lambda *shape, scale: jnp.asarray(
      rng.normal(size=shape) * scale, jnp.float32)
  dense = lambda a, b: normal(a, b, scale=1 / np.sqrt(a))
  return {
      'embed': normal(VOCABULARY, WIDTH, scale=1.0),
      'position': normal(SEQUENCE, WIDTH, scale=0.1),
      'norm1': {'scale': jnp.ones(WIDTH), 'bias': jnp.zeros(WIDTH)},
      'query': dense(WIDTH, WIDTH), 'key': dense(WIDTH, WIDTH),
      'value': dense(WIDTH, WIDTH), 'attention_out': dense(WIDTH, WIDTH),
      'norm2': {'scale': jnp.ones(WIDTH), 'bias': jnp.zeros(WIDTH)},
      'mlp_in': dense(WIDTH, 4 * WIDTH), 'mlp_in_bias': jnp.zeros(4 * WIDTH),
      'mlp_out': dense(4 * WIDTH, WIDTH), 'mlp_out_bias': jnp.zeros(WIDTH),
      'head': dense(WIDTH, NUM_CLASSES), 'head_bias': jnp.zeros(NUM_CLASSES),
  }


def _layer_norm(x: jax.Array, norm: dict) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centred = x - mean
  scale = jax.lax.rsqrt(jnp.mean(centred**2, axis=-1, keepdims=True) + 1e-5)
  return centred * scale * norm['scale'] + norm['bias']


def transformer_apply(params: dict, tokens: jax.Array) -> jax.Array:
  """Logits for token ids `[..., SEQUENCE]` (any leading axes)."""
  h = jnp.take(params['embed'], tokens, axis=0) + params['position']
  x = _layer_norm(h, params['norm1'])
  split = lambda y: y.reshape(y.shape[:-1] + (HEADS, WIDTH // HEADS))
  q, k, v = (split(x @ params[name]) for name in ('query', 'key', 'value'))
  scores = jnp.einsum('...qhd,...khd->...hqk', q, k) / np.sqrt(WIDTH // HEADS)
  mixed = jnp.einsum('...hqk,...khd->...qhd', jax.nn.softmax(scores), v)
  h = h + mixed.reshape(h.shape) @ params['attention_out']
  x = _layer_norm(h, params['norm2'])
  h = h + (jax.nn.relu(x @ params['mlp_in'] + params['mlp_in_bias'])
           @ params['mlp_out'] + params['mlp_out_bias'])
  return jnp.mean(h, axis=-2) @ params['head'] + params['head_bias']


def make_token_batch(rng: np.random.Generator,
                     batch_size: int) -> dpsgd_step.Batch:
  """A synthetic batch {"x": [B, SEQUENCE] int32 ids, "y": [B] int32}."""
  return {
      'x': jnp.asarray(rng.integers(0, VOCABULARY, (batch_size, SEQUENCE)),
                       jnp.int32),
      'y': jnp.asarray(rng.integers(0, NUM_CLASSES, size=batch_size),
                       jnp.int32),
  }


# The CNN: image side, channels of its two convolutions.
IMAGE_SIDE, CNN_CHANNELS = 28, (16, 32)


def cnn_init(rng: np.random.Generator) -> dict:
  """Two 3x3 convolutions (HWIO kernels) and a dense head (20,490 params)."""
  params, fan_in = {}, 1
  for k, channels in enumerate(CNN_CHANNELS):
    params[f'conv_{k}'] = {
        'kernel': jnp.asarray(rng.normal(size=(3, 3, fan_in, channels)) /
                              np.sqrt(9 * fan_in), jnp.float32),
        'bias': jnp.zeros(channels, jnp.float32)}
    fan_in = channels
  side = IMAGE_SIDE // 2**len(CNN_CHANNELS)
  params['head'] = dpsgd_step.dense_init(rng, side * side * fan_in,
                                         NUM_CLASSES)
  return params


def cnn_apply(params: dict, x: jax.Array) -> jax.Array:
  """Logits for flattened 28x28 images `[..., 784]` (any leading axes)."""
  lead = x.shape[:-1]
  h = x.reshape((-1, IMAGE_SIDE, IMAGE_SIDE, 1))
  for k in range(len(CNN_CHANNELS)):
    layer = params[f'conv_{k}']
    h = jax.lax.conv_general_dilated(
        h, layer['kernel'], (1, 1), 'SAME',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    h = jax.nn.relu(h + layer['bias'])
    n, height, width, channels = h.shape
    h = jnp.mean(h.reshape(n, height // 2, 2, width // 2, 2, channels),
                 axis=(2, 4))
  logits = dpsgd_step.dense(params['head'], h.reshape(h.shape[0], -1))
  return logits.reshape(lead + (NUM_CLASSES,))


def mlp_init(rng: np.random.Generator, widths: list[int]):
  """Params of an MLP with the given layer widths: {"layer_k": {"w", "b"}}."""
  return {f'layer_{k}': dpsgd_step.dense_init(rng, fan_in, fan_out)
          for k, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:]))}


def mlp_apply(params, x: jax.Array) -> jax.Array:
  """Logits of a ReLU MLP built by `mlp_init`."""
  for k in range(len(params)):
    x = dpsgd_step.dense(params[f'layer_{k}'], x)
    if k < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def make_problems(rng: np.random.Generator) -> list[Problem]:
  """The benchmarked models and batch sizes."""
  problems = [Problem(dpsgd_step.Model(
      f'logistic regression {INPUT_DIM}->{NUM_CLASSES}, B=500',
      dpsgd_step.dense_init(rng, INPUT_DIM, NUM_CLASSES),
      dpsgd_step.logreg_apply), 500, 20)]
  for widths, batch_size, iters_scale in (
      ([INPUT_DIM, 256, NUM_CLASSES], 500, 4),
      ([INPUT_DIM, 1024, 1024, NUM_CLASSES], 256, 1)):
    name = '-'.join(map(str, widths))
    problems.append(Problem(dpsgd_step.Model(
        f'MLP {name} (relu), B={batch_size}', mlp_init(rng, widths),
        mlp_apply), batch_size, iters_scale))
  problems.append(Problem(dpsgd_step.Model(
      f'CNN {IMAGE_SIDE}x{IMAGE_SIDE} conv3x3-{CNN_CHANNELS[0]}-pool-'
      f'conv3x3-{CNN_CHANNELS[1]}-pool-dense, B=256', cnn_init(rng),
      cnn_apply), 256, 1))
  problems.append(Problem(dpsgd_step.Model(
      f'transformer encoder (embedding {VOCABULARY}x{WIDTH}, {SEQUENCE} '
      f'tokens, {HEADS} heads, layer norms), B=64', transformer_init(rng),
      transformer_apply), 64, 1, make_token_batch))
  return problems


def make_batch(rng: np.random.Generator, batch_size: int) -> dpsgd_step.Batch:
  """A synthetic batch {"x": [B, 784] float32, "y": [B] int32}."""
  return {
      'x': jnp.asarray(rng.normal(size=(batch_size, INPUT_DIM)), jnp.float32),
      'y': jnp.asarray(rng.integers(0, NUM_CLASSES, size=batch_size),
                       jnp.int32),
  }


def clipped_sum_variant(model: dpsgd_step.Model, method: str,
                        batch_size: int) -> dpsgd_step.Variant:
  """DP-SGD from the library's parts, with the clipped sum's `method`."""
  statistic = dpsco_jax.clipped_grad_sum(
      dpsgd_step.example_loss_fn(model.apply), dpsgd_step.L2_CLIP,
      clipping_method=method)
  mechanism = dpsco_jax.dpsgd_mechanism(2**30)
  stddev = dpsgd_step.NOISE_MULTIPLIER * statistic.sensitivity()
  sgd = optax.sgd(dpsgd_step.LEARNING_RATE)

  @jax.jit
  def step(params, state, batch):
    noise_state, sgd_state = state
    clipped = statistic(batch, params)
    grads, noise_state = estimators.privatize_sum(
        clipped, noise_state, mechanism, stddev, normalize_by=batch_size)
    updates, sgd_state = sgd.update(grads, sgd_state, params)
    return optax.apply_updates(params, updates), (noise_state, sgd_state)

  state = (mechanism.init(model.params, jax.random.key(0)),
           sgd.init(model.params))
  return dpsgd_step.Variant(step, state)


def clip_only_variant(model: dpsgd_step.Model,
                      batch_size: int) -> dpsgd_step.Variant:
  """The ghost clipped sum over B, then sgd: no noise (cost attribution)."""
  statistic = dpsco_jax.clipped_grad_sum(
      dpsgd_step.example_loss_fn(model.apply), dpsgd_step.L2_CLIP,
      clipping_method='ghost')
  sgd = optax.sgd(dpsgd_step.LEARNING_RATE)

  @jax.jit
  def step(params, state, batch):
    grads = jax.tree_util.tree_map(lambda s: s / batch_size,
                                   statistic(batch, params).sum)
    updates, state = sgd.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return dpsgd_step.Variant(step, sgd.init(model.params))


def make_variants(problem: Problem,
                  jax_privacy=None) -> dict[str, dpsgd_step.Variant]:
  """Every variant of the module docstring, for `problem`."""
  model = problem.model
  variants = {
      'non-private': dpsgd_step.non_private_variant(model),
      'vmap': clipped_sum_variant(model, 'vmap', problem.batch_size),
      'ghost': clipped_sum_variant(model, 'ghost', problem.batch_size),
      'auto': clipped_sum_variant(model, 'auto', problem.batch_size),
      'dpsgd': dpsgd_step.ours_variant(model, dpsco_jax),
      'optax': dpsgd_step.optax_variant(model),
      'ghost clip only': clip_only_variant(model, problem.batch_size),
  }
  if jax_privacy is not None:
    variants['jax_privacy'] = dpsgd_step.jax_privacy_variant(
        model, jax_privacy, problem.batch_size)
  return variants


def peak_memory(model: dpsgd_step.Model,
                variants: dict[str, dpsgd_step.Variant],
                batch: dpsgd_step.Batch) -> dict[str, float]:
  """XLA's peak estimate (temporaries + arguments + outputs) per step, MiB."""
  peaks = {}
  for name, variant in variants.items():
    analysis = variant.step.lower(model.params, variant.state,
                                  batch).compile().memory_analysis()
    if analysis is None:   # a backend without the analysis
      continue
    peaks[name] = (analysis.temp_size_in_bytes +
                   analysis.argument_size_in_bytes +
                   analysis.output_size_in_bytes) / 2**20
  return peaks


def print_memory(peaks: dict[str, float]) -> None:
  """Peak MiB per variant and its ratio to the non-private step."""
  if 'non-private' not in peaks:
    print('  peak memory: not reported by this backend')
    return
  base = peaks['non-private']
  print('  peak memory (XLA): ' + ', '.join(
      f'{name} {mib:.1f} MiB ({mib / base:.2f}x)'
      for name, mib in peaks.items()))


def check_agreement(model: dpsgd_step.Model, batch: dpsgd_step.Batch) -> str:
  """The largest relative difference between ghost and vmap clipped sums."""
  loss = dpsgd_step.example_loss_fn(model.apply)
  sums = [jax.jit(dpsco_jax.clipped_grad_sum(
      loss, dpsgd_step.L2_CLIP, clipping_method=method))(batch, model.params)
          for method in ('ghost', 'vmap')]
  ghost, vmap = (np.concatenate([np.ravel(leaf) for leaf in
                                 jax.tree_util.tree_leaves(s.sum)])
                 for s in sums)
  counters = [(int(s.num_clipped), int(s.num_nonfinite)) for s in sums]
  difference = np.max(np.abs(ghost - vmap)) / np.max(np.abs(vmap))
  return (f'  ghost vs vmap clipped sum: max |diff| / max |sum| = '
          f'{difference:.1e}; (clipped, nonfinite) {counters[0]} vs '
          f'{counters[1]}')


def describe_choice(model: dpsgd_step.Model, batch: dpsgd_step.Batch) -> str:
  """The cost model's choice for `clipping_method='auto'` on the batch."""
  statistic = dpsco_jax.clipped_grad_sum(
      dpsgd_step.example_loss_fn(model.apply), dpsgd_step.L2_CLIP)
  if not hasattr(statistic, 'clipping_choice'):   # an older dpsco_jax
    return '  auto: no cost model in this dpsco_jax'
  choice = statistic.clipping_choice(batch, model.params)
  if choice is None:
    return "  auto: the ghost path does not apply (vmap)"
  forms = ', '.join(f'{tap.rule}:{tap.form}' for tap in choice.taps)
  return (f'  auto picks {choice.path} (estimates: ghost {choice.ghost:.3g}, '
          f'vmap {choice.vmap:.3g}); forms {forms}')


def print_auto_ratio(times: dict[str, list[float]]) -> None:
  """`auto / min(ghost, vmap)` from the median step times."""
  medians = {name: statistics.median(ts) for name, ts in times.items()}
  if not {'auto', 'ghost', 'vmap'} <= set(medians):
    return
  best = min(medians['ghost'], medians['vmap'])
  print(f'  {"auto / min(ghost, vmap)":<28} {medians["auto"] / best:>7.2f}x')


def parse_args(argv: list[str]) -> argparse.Namespace:
  """Parses command-line flags."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--iters', type=int, default=3,
                      help='timed steps per variant per round')
  parser.add_argument('--warmup', type=int, default=1,
                      help='untimed steps per variant after compilation')
  parser.add_argument('--rounds', type=int, default=5,
                      help='interleaved timing rounds')
  parser.add_argument('--only', default='',
                      help='time only the models whose name contains this')
  parser.add_argument('--variants', default='',
                      help='comma-separated variants to time (default: all)')
  args = parser.parse_args(argv)
  if min(args.iters, args.rounds) < 1 or args.warmup < 0:
    parser.error('--iters and --rounds must be >= 1, --warmup >= 0')
  return args


def print_header(args: argparse.Namespace) -> None:
  """Prints versions, devices and settings."""
  print(f'jax {jax.__version__}, optax {optax.__version__}, '
        f'dpsco_jax {dpsco_jax.__version__}, {os.cpu_count()} CPU cores, '
        f'backend {jax.default_backend()}')
  print(f'clip {dpsgd_step.L2_CLIP}, noise multiplier '
        f'{dpsgd_step.NOISE_MULTIPLIER}, lr {dpsgd_step.LEARNING_RATE}; '
        f'{args.rounds} rounds x (--iters {args.iters} x per-model scale) '
        f'steps, {args.warmup} warmup steps after compile')


def main(argv: list[str]) -> None:
  """Benchmarks every variant on each model."""
  args = parse_args(argv)
  # The `dpsgd` column reuses `dpsgd_step`'s fixed noise key for every model
  # on purpose: these runs only time steps, they release nothing.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  jax_privacy, reason = dpsgd_step.optional_import('jax_privacy')
  print_header(args)
  print(dpsgd_step.describe('jax_privacy', jax_privacy, reason))
  rng = np.random.default_rng(dpsgd_step.DATA_SEED)
  for problem in make_problems(rng):
    if args.only not in problem.model.name:
      continue
    batch = (problem.batch_fn or make_batch)(rng, problem.batch_size)
    variants = make_variants(problem, jax_privacy)
    if args.variants:
      keep = args.variants.split(',')
      variants = {name: v for name, v in variants.items() if name in keep}
    times = dpsgd_step.benchmark(problem.model, variants, batch,
                                 args.iters * problem.iters_scale,
                                 args.warmup, args.rounds)
    dpsgd_step.print_results(problem.model, times, RATIOS)
    print_auto_ratio(times)
    print(describe_choice(problem.model, batch))
    if 'non-private' in variants:
      print_memory(peak_memory(problem.model, variants, batch))
    print(check_agreement(problem.model, batch))


if __name__ == '__main__':
  main(sys.argv[1:])
