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

Timing is `harness.py`'s: interleaved rounds with a rotating order
(machine-load drift hits all alike), the median over rounds of the mean
per-step time, every ratio from the same run. Peak memory is XLA's plan of
each compiled step (`harness.compiled_peak_bytes`: arguments, temporaries
and the outputs not written over the donated params and state), on
whatever backend runs the script.

Usage (from the repository root)::

    python benchmarks/ghost_step.py [--iters 3] [--warmup 1] [--rounds 5] \
        [--only cnn]
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import dpsgd_step
import harness
import models
import steps

import dpsco_jax
# pylint: enable=g-import-not-at-top,wrong-import-position

RATIOS = (
    ('vmap', 'non-private'), ('ghost', 'non-private'),
    ('dpsgd', 'non-private'), ('optax', 'non-private'),
    ('jax_privacy', 'non-private'), ('ghost clip only', 'non-private'),
    ('vmap', 'ghost'), ('auto', 'ghost'), ('auto', 'vmap'),
)


class Problem(NamedTuple):
  """A model, the batch size it is timed with, and its steps per round.

  Attributes:
    name: the model's name.
    params: its initial params.
    apply: `apply(params, x)`: logits.
    batch_size: B.
    iters_scale: multiplies --iters: cheap steps are timed over more steps
      per round, so that timer and dispatch jitter stay small against them.
    batch_fn: `batch_fn(rng, B)`: a synthetic batch.
  """

  name: str
  params: Any
  apply: Callable[..., Any]
  batch_size: int
  iters_scale: int
  batch_fn: Callable[..., Any] = models.make_batch


def make_problems(rng: np.random.Generator) -> list[Problem]:
  """The benchmarked models and batch sizes."""
  d, c = models.INPUT_DIM, models.NUM_CLASSES
  problems = [Problem(f'logistic regression {d}->{c}, B=500',
                      models.dense_init(rng, d, c), models.logreg_apply,
                      500, 20)]
  for widths, batch_size, iters_scale in (([d, 256, c], 500, 4),
                                          ([d, 1024, 1024, c], 256, 1)):
    problems.append(Problem(
        f'MLP {"-".join(map(str, widths))} (relu), B={batch_size}',
        models.mlp_init(rng, widths), models.mlp_apply, batch_size,
        iters_scale))
  problems.append(Problem(
      'CNN 28x28 conv3x3-16-pool-conv3x3-32-pool-dense, B=256',
      models.cnn_init(rng), models.cnn_apply, 256, 1))
  problems.append(Problem(
      'transformer encoder (embedding 1000x64, 32 tokens, 4 heads, layer '
      'norms), B=64', models.transformer_init(rng), models.transformer_apply,
      64, 1, models.make_token_batch))
  return problems


def make_variants(problem: Problem) -> dict[str, steps.Step]:
  """Every variant of the module docstring, for `problem`."""
  loss = models.example_loss_fn(problem.apply)
  sgd = optax.sgd(dpsgd_step.LEARNING_RATE)
  built = {'non-private': steps.non_private(loss, sgd)}
  for method in ('vmap', 'ghost', 'auto'):
    built[method] = steps.clipped_sum(loss, sgd, method, problem.batch_size)
  built['dpsgd'] = steps.dpsgd(loss, sgd)
  built['optax'] = steps.optax_contrib(loss, dpsgd_step.LEARNING_RATE)
  built['ghost clip only'] = steps.clipped_sum(
      loss, sgd, 'ghost', problem.batch_size, noise=False)
  jax_privacy, _ = harness.optional_import('jax_privacy')
  if jax_privacy is not None:
    built['jax_privacy'] = steps.jax_privacy(loss, sgd, problem.batch_size,
                                             jax_privacy)
  return built


def memory_line(rows: dict[str, harness.Row]) -> str:
  """XLA's peak estimate per variant and its ratio to the non-private step."""
  peaks = {name: row.peak_bytes() for name, row in rows.items()}
  base = peaks.get('non-private')
  if not base:
    return '  peak memory: not reported by this backend'
  return '  peak memory (XLA): ' + ', '.join(
      f'{name} {peak / 2**20:.1f} MiB ({peak / base:.2f}x)'
      for name, peak in peaks.items() if peak)


def check_agreement(problem: Problem, batch: Any) -> str:
  """The largest relative difference between ghost and vmap clipped sums."""
  loss = models.example_loss_fn(problem.apply)
  sums = [jax.jit(dpsco_jax.clipped_grad_sum(
      loss, steps.L2_CLIP, clipping_method=method))(batch, problem.params)
          for method in ('ghost', 'vmap')]
  counters = [(int(s.num_clipped), int(s.num_nonfinite)) for s in sums]
  difference = steps.max_relative_difference(sums[0].sum, sums[1].sum)
  return (f'  ghost vs vmap clipped sum: max |diff| / max |sum| = '
          f'{difference:.1e}; (clipped, nonfinite) {counters[0]} vs '
          f'{counters[1]}')


def describe_choice(problem: Problem, batch: Any) -> str:
  """The cost model's choice for `clipping_method='auto'` on the batch."""
  choice = steps.auto_choice(models.example_loss_fn(problem.apply),
                             problem.params, batch)
  if choice is None:
    return '  auto: the ghost path does not apply (vmap)'
  forms = ', '.join(f'{tap.rule}:{tap.form}' for tap in choice.taps)
  return (f'  auto picks {choice.path} (estimates: ghost {choice.ghost:.3g}, '
          f'vmap {choice.vmap:.3g}); forms {forms}')


def parse_args(argv: list[str]):
  """Parses command-line flags."""
  parser = harness.timing_parser(__doc__, iters=3, warmup=1, rounds=5)
  parser.add_argument('--only', default='',
                      help='time only the models whose name contains this')
  parser.add_argument('--variants', default='',
                      help='comma-separated variants to time (default: all)')
  return harness.parse_timing(parser, argv)


def main(argv: list[str]) -> None:
  """Times every variant on each model."""
  args = parse_args(argv)
  # One fixed noise key per row on purpose: the run releases nothing.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  print('\n'.join(harness.header_lines('ghost_step.py', argv)))
  print(f'clip {steps.L2_CLIP}, noise multiplier {steps.NOISE_MULTIPLIER}, '
        f'lr {dpsgd_step.LEARNING_RATE}; {args.rounds} rounds x (--iters '
        f'{args.iters} x per-model scale) steps, {args.warmup} warmup steps '
        'after compile')
  rng = np.random.default_rng(dpsgd_step.DATA_SEED)
  for problem in make_problems(rng):
    if args.only not in problem.name:
      continue
    batch = problem.batch_fn(rng, problem.batch_size)
    built = make_variants(problem)
    if args.variants:
      keep = args.variants.split(',')
      built = {name: s for name, s in built.items() if name in keep}
    rows, skipped = dpsgd_step.step_rows(built, problem.params, batch)
    times = harness.time_rows(rows, args.iters * problem.iters_scale,
                              args.warmup, args.rounds, skipped)
    harness.print_results(problem.name, times, RATIOS, 'non-private',
                          skipped)
    best = harness.fastest(times, ('ghost', 'vmap'))
    if best and 'auto' in times:
      print(f'  {"auto / min(ghost, vmap)":<28} '
            f'{harness.ratio(times, "auto", best):>8}')
    print(describe_choice(problem, batch))
    if 'non-private' in rows:
      print(memory_line(rows))
    print(check_agreement(problem, batch))


if __name__ == '__main__':
  main(sys.argv[1:])
