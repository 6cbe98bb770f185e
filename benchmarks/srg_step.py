"""Per-step wall time of the recursive-gradient algorithms against DP-SGD.

Times one jitted training step, on the same model and the same synthetic
batch as `dpsgd_step.py` (500 examples, 784 inputs, 10 classes), for:

* `non-private`: `jax.grad` of the mean loss, then `optax.sgd`;
* `dpsgd`: `dpsco_jax.dpsgd` + `optax.sgd` (one gradient per example);
* `srg`: `dpsco_jax.srg_gradient` (binary-tree prefix noise, kept as a
  running prefix: `1 + ctz(t)` node draws per step) + `optax.sgd`: two
  gradients per example (at x_t and x_{t-1}), so about 2x DP-SGD is the
  floor;
* `srg regenerated prefix`: the same with the tree drawing every node of
  each prefix (`popcount(t)` draws; small in the first steps timed here,
  about log2(t) / 2 later in a run);
* `accelerated_srgd`: `dpsco_jax.accelerated_dp_srgd` (Algorithm 1: the
  same estimator plus the z/y/x coupling and two projections);
* `dpmemf` and `dp_srg_memf`: DP-MEMF and DP-SRG-MEMF (paper 001 Alg 2 and
  3) with the same dense 64-step strategy, + `optax.sgd(momentum=0.9)`;
* `dpsgd clip only` and `srg clip only`: the clipped statistic alone (per
  example gradients; differences at x_t and x_{t-1} with SRG's
  coefficients) over B, then `optax.sgd`: NOT private, they separate the
  cost of clipping from the mechanisms' draws (the binary tree's prefix
  noise draws `popcount(t)` nodes per step, DP-SGD's one).

`dpsgd`, `srg` and `accelerated_srgd` take the ghost path of their clipped
statistics by default (`clipping_method='auto'`: ghost norms, no per-example
gradient; `srg` runs the first pass at both points). Before timing, the
script prints, per model, which path each statistic takes and how closely
the ghost and vmap clipped difference sums agree on the batch.

Variants are interleaved in rounds with a rotating order (machine-load drift
hits all alike); the reported time is the median over rounds of the mean
per-step time. The ratios are printed side by side from the same run.

`--only` times a subset (e.g. `--only non-private,dpsgd,srg`). Without the
MEMF variants (whose dense strategy holds 64 steps) each round times
`--iters` x a per-model scale (x20 logistic regression, x4 the MLP), so
that the cheap steps are timed over enough steps to beat timer jitter.

Usage (from the repository root)::

    python benchmarks/srg_step.py [--iters 5] [--warmup 1] [--rounds 5]
        [--only non-private,dpsgd,srg]
"""

from __future__ import annotations

import os
import sys
import warnings

import jax
import jax.numpy as jnp
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

# Capacity of the MEMF strategies (dense, so kept small): more than
# compile + warm-up + timed steps.
NUM_STEPS = 64
# Capacity of the tree and i.i.d. mechanisms (their state grows as log T).
TREE_STEPS = 4096
MEMF_VARIANTS = ('dpmemf', 'dp_srg_memf')
# Steps per round relative to --iters, when no MEMF variant is timed.
ITERS_SCALE = (20, 4)   # logistic regression, MLP
RATIOS = (
    ('dpsgd', 'non-private'),
    ('srg', 'dpsgd'),
    ('srg', 'srg regenerated prefix'),
    ('srg clip only', 'dpsgd clip only'),
    ('accelerated_srgd', 'dpsgd'),
    ('dp_srg_memf', 'dpmemf'),
    ('dpmemf', 'dpsgd'),
)


VARIANTS = ('non-private', 'dpsgd', 'srg', 'srg regenerated prefix',
            'accelerated_srgd', 'dpmemf', 'dp_srg_memf', 'dpsgd clip only',
            'srg clip only')


def clip_only_variant(apply, difference: bool) -> steps.Step:
  """The clipped sum (default path) over B, then sgd: no noise.

  NOT private: it isolates the cost of the clipped statistic (per-example
  gradients for `dpsgd`, differences at x_t and x_{t-1} with SRG's
  coefficients for `srg`) from the noise mechanisms' per-step draws.
  """
  loss = models.example_loss_fn(apply)
  sgd = optax.sgd(dpsgd_step.LEARNING_RATE)
  if difference:
    statistic = dpsco_jax.clipped_grad_difference_sum(loss, steps.L2_CLIP)
  else:
    statistic = dpsco_jax.clipped_grad_sum(loss, steps.L2_CLIP)

  def step(params, state, batch):
    prev, count, sgd_state = state
    args = (params, prev, count + 1.0, count) if difference else (params,)
    total = statistic(batch, *args).sum
    grads = jax.tree_util.tree_map(lambda s: s / dpsgd_step.BATCH_SIZE, total)
    updates, sgd_state = sgd.update(grads, sgd_state, params)
    return (optax.apply_updates(params, updates),
            (params, count + 1.0, sgd_state))

  return steps.Step(step, lambda params: (params, jnp.float32(0.0),
                                          sgd.init(params)))


def make_variants(apply, only: tuple[str, ...] = VARIANTS
                  ) -> dict[str, steps.Step]:
  """The variants of the module docstring named in `only`, for `apply`."""
  loss = models.example_loss_fn(apply)
  common = dict(l2_clip=steps.L2_CLIP,
                noise_multiplier=steps.NOISE_MULTIPLIER, key=0)
  sgd = optax.sgd(dpsgd_step.LEARNING_RATE)
  strategy = np.tril(np.ones((NUM_STEPS, NUM_STEPS))) / np.sqrt(NUM_STEPS)
  memf = dict(strategy=strategy, steps_per_epoch=NUM_STEPS,
              check_order=False, **common)
  momentum = optax.sgd(dpsgd_step.LEARNING_RATE, momentum=0.9)
  # Built lazily: only the selected variants are compiled.
  builds = {
      'dpsgd': lambda: optax.chain(dpsco_jax.dpsgd(
          loss, num_steps=TREE_STEPS, **common), sgd),
      'srg': lambda: optax.chain(dpsco_jax.srg_gradient(
          loss, num_steps=TREE_STEPS, **common), sgd),
      # The tree drawing every node of each prefix (popcount(t) draws) instead
      # of the default running prefix (1 + ctz(t) draws).
      'srg regenerated prefix': lambda: optax.chain(dpsco_jax.srg_gradient(
          loss, mechanism=dpsco_jax.noise.tree(TREE_STEPS, release='prefix'),
          **common), sgd),
      'accelerated_srgd': lambda: dpsco_jax.accelerated_dp_srgd(
          loss, num_steps=TREE_STEPS, beta=1.0 / dpsgd_step.LEARNING_RATE,
          radius=100.0, **common),
      'dpmemf': lambda: optax.chain(dpsco_jax.dpmemf(loss, **memf), momentum),
      'dp_srg_memf': lambda: optax.chain(
          dpsco_jax.dp_srg_memf(loss, decay=float(np.exp(-2.5)), **memf),
          momentum),
  }
  variants = {}
  if 'non-private' in only:
    variants['non-private'] = steps.non_private(loss, sgd)
  for name, build in builds.items():
    if name in only:
      variants[name] = steps.transformation(build())
  for name, difference in (('dpsgd clip only', False),
                           ('srg clip only', True)):
    if name in only:
      variants[name] = clip_only_variant(apply, difference)
  return variants


def describe_paths(params, apply, batch) -> str:
  """Which path the clipped statistics take, and ghost-vs-vmap agreement."""
  loss = models.example_loss_fn(apply)
  # The previous point of a mid-run step: a small step away.
  prev = jax.tree_util.tree_map(lambda p: p * 0.99 + 1e-3, params)
  args = (params, prev, 5.0, 4.0)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', dpsco_jax.GhostClippingFallbackWarning)
    paths = {
        'dpsgd': dpsco_jax.clipped_grad_sum(loss, steps.L2_CLIP)
                 .ghost_plan(batch, params),
        'srg': dpsco_jax.clipped_grad_difference_sum(loss, steps.L2_CLIP)
               .ghost_plan(batch, *args)}
  sums = [jax.jit(dpsco_jax.clipped_grad_difference_sum(
      loss, steps.L2_CLIP, clipping_method=method))(batch, *args)
          for method in ('ghost', 'vmap')]
  difference = steps.max_relative_difference(sums[0].sum, sums[1].sum)
  taken = ', '.join(f'{name} {"ghost" if plan is not None else "vmap"}'
                    for name, plan in paths.items())
  return (f'  paths: {taken}; ghost vs vmap clipped difference sum '
          f'(a=5, b=4): max |diff| / max |sum| = {difference:.1e}, clipped '
          f'{int(sums[0].num_clipped)} vs {int(sums[1].num_clipped)}')


def parse_args(argv: list[str]):
  """The harness's timing flags, and `--only`."""
  parser = harness.timing_parser(__doc__, iters=5, warmup=1, rounds=5)
  parser.add_argument('--only', default=','.join(VARIANTS),
                      help=f'comma-separated subset of {VARIANTS}')
  args = harness.parse_timing(parser, argv)
  args.only = harness.split_choices(parser, args.only, VARIANTS, '--only')
  return args


def main(argv: list[str]) -> None:
  """Benchmarks the selected variants on each model and prints the ratios."""
  args = parse_args(argv)
  with_memf = any(name in MEMF_VARIANTS for name in args.only)
  scales = (1, 1) if with_memf else ITERS_SCALE
  capacity = NUM_STEPS if with_memf else TREE_STEPS
  if 1 + args.warmup + args.rounds * args.iters * max(scales) > capacity:
    raise SystemExit(f'at most {capacity} steps per variant: lower '
                     '--iters, --rounds or --warmup')
  # The variants reuse a fixed noise key on purpose: these runs only time
  # steps, they release nothing.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  print('\n'.join(harness.header_lines('srg_step.py', argv, optional=())))
  print(f'variants {", ".join(args.only)}; steps per round: --iters x '
        f'{scales[0]} (logistic regression), x {scales[1]} (MLP); load '
        f'average {", ".join(f"{x:.2f}" for x in os.getloadavg())}')
  rng = np.random.default_rng(dpsgd_step.DATA_SEED)
  problems = dpsgd_step.make_models(rng)
  batch = models.make_batch(rng, dpsgd_step.BATCH_SIZE)
  for (name, (params, apply)), scale in zip(problems.items(), scales):
    rows, skipped = dpsgd_step.step_rows(make_variants(apply, args.only),
                                         params, batch)
    times = harness.time_rows(rows, args.iters * scale, args.warmup,
                              args.rounds, skipped)
    harness.print_results(name, times, RATIOS, 'non-private', skipped)
    print(describe_paths(params, apply, batch))
  print(f'load average at the end '
        f'{", ".join(f"{x:.2f}" for x in os.getloadavg())}')


if __name__ == '__main__':
  main(sys.argv[1:])
