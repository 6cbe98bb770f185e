"""Per-step wall time of the recursive-gradient algorithms against DP-SGD.

Times one jitted training step, on the same model and the same synthetic
batch as `dpsgd_step.py` (500 examples, 784 inputs, 10 classes), for:

* `non-private`: `jax.grad` of the mean loss, then `optax.sgd`;
* `dpsgd`: `dpsco_jax.dpsgd` + `optax.sgd` (one gradient per example);
* `srg`: `dpsco_jax.srg_gradient` (binary-tree prefix noise) + `optax.sgd`:
  two gradients per example (at x_t and x_{t-1}), so about 2x DP-SGD is the
  floor;
* `accelerated_srgd`: `dpsco_jax.accelerated_dp_srgd` (Algorithm 1: the
  same estimator plus the z/y/x coupling and two projections);
* `dpmemf` and `dp_srg_memf`: DP-MEMF and DP-SRG-MEMF (paper 001 Alg 2 and
  3) with the same dense 64-step strategy, + `optax.sgd(momentum=0.9)`.

Variants are interleaved in rounds with a rotating order (machine-load drift
hits all alike); the reported time is the median over rounds of the mean
per-step time. The ratios are printed side by side from the same run.

Usage (from the repository root)::

    python benchmarks/srg_step.py [--iters 5] [--warmup 1] [--rounds 5]
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpsgd_step  # pylint: disable=g-import-not-at-top,wrong-import-position

import dpsco_jax  # pylint: disable=g-import-not-at-top,wrong-import-position

# Capacity of the noise mechanisms: more than compile + warm-up + timed steps.
NUM_STEPS = 64
RATIOS = (
    ('dpsgd', 'non-private'),
    ('srg', 'dpsgd'),
    ('accelerated_srgd', 'dpsgd'),
    ('dp_srg_memf', 'dpmemf'),
    ('dpmemf', 'dpsgd'),
)


def _jitted(tx: optax.GradientTransformationExtraArgs,
            params) -> dpsgd_step.Variant:
  @jax.jit
  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state
  return dpsgd_step.Variant(step, tx.init(params))


def make_variants(model: dpsgd_step.Model) -> dict[str, dpsgd_step.Variant]:
  """Every variant of the module docstring, for `model`."""
  loss = dpsgd_step.example_loss_fn(model.apply)
  common = dict(l2_clip=dpsgd_step.L2_CLIP,
                noise_multiplier=dpsgd_step.NOISE_MULTIPLIER, key=0)
  sgd = optax.sgd(dpsgd_step.LEARNING_RATE)
  strategy = np.tril(np.ones((NUM_STEPS, NUM_STEPS))) / np.sqrt(NUM_STEPS)
  memf = dict(strategy=strategy, steps_per_epoch=NUM_STEPS,
              check_order=False, **common)
  momentum = optax.sgd(dpsgd_step.LEARNING_RATE, momentum=0.9)
  builds = {
      'dpsgd': optax.chain(dpsco_jax.dpsgd(loss, num_steps=NUM_STEPS,
                                           **common), sgd),
      'srg': optax.chain(dpsco_jax.srg_gradient(loss, num_steps=NUM_STEPS,
                                                **common), sgd),
      'accelerated_srgd': dpsco_jax.accelerated_dp_srgd(
          loss, num_steps=NUM_STEPS, beta=1.0 / dpsgd_step.LEARNING_RATE,
          radius=100.0, **common),
      'dpmemf': optax.chain(dpsco_jax.dpmemf(loss, **memf), momentum),
      'dp_srg_memf': optax.chain(
          dpsco_jax.dp_srg_memf(loss, decay=float(np.exp(-2.5)), **memf),
          momentum),
  }
  variants = {'non-private': dpsgd_step.non_private_variant(model)}
  for name, tx in builds.items():
    variants[name] = _jitted(tx, model.params)
  return variants


def main(argv: list[str]) -> None:
  """Benchmarks every variant on each model and prints the ratios."""
  args = dpsgd_step.parse_args(argv)
  if 1 + args.warmup + args.rounds * args.iters > NUM_STEPS:
    raise SystemExit(f'at most {NUM_STEPS} steps per variant: lower '
                     '--iters, --rounds or --warmup')
  dpsgd_step.print_header(dpsco_jax, '', None, 'not measured here', args)
  rng = np.random.default_rng(dpsgd_step.DATA_SEED)
  models = dpsgd_step.make_models(rng)
  batch = dpsgd_step.make_batch(rng)
  for model in models:
    times = dpsgd_step.benchmark(model, make_variants(model), batch,
                                 args.iters, args.warmup, args.rounds)
    dpsgd_step.print_results(model, times, RATIOS)


if __name__ == '__main__':
  main(sys.argv[1:])
