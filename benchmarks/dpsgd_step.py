"""Per-step wall time of DP-SGD implementations against a non-private step.

Times, on the same model and the same synthetic batch (500 examples, 784
inputs, 10 classes; `models.py`), one jitted training step (`steps.py`) of:

* ``non-private``: `jax.grad` of the mean batch loss, then `optax.sgd`;
* ``dpsco_jax``: `optax.chain(dpsco_jax.dpsgd(...), optax.sgd(...))`;
* ``optax``: `optax.contrib.dpsgd` fed `jax.vmap`-ed per-example gradients;
* ``jax_privacy``: `jax_privacy.clipped_grad` and its Gaussian privatizer,
  a division by the batch size and `optax.sgd` (when it imports).

Models: logistic regression 784->10 and an MLP 784-256-10 (ReLU). Timing
is `harness.py`'s: interleaved rounds with a rotating order, the median
over rounds of the mean per-step time (with min and max), every ratio from
the same run.

Usage::

    python benchmarks/dpsgd_step.py [--iters N] [--warmup N] [--rounds N]
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import harness
import models
import steps

import dpsco_jax
# pylint: enable=g-import-not-at-top,wrong-import-position

BATCH_SIZE = 500
LEARNING_RATE = 0.1
DATA_SEED = 0
NON_PRIVATE, OURS, OPTAX, JAX_PRIVACY = ('non-private', 'dpsco_jax', 'optax',
                                         'jax_privacy')
RATIOS = ((OURS, NON_PRIVATE), (OPTAX, NON_PRIVATE), (JAX_PRIVACY, NON_PRIVATE),
          (OURS, OPTAX), (OURS, JAX_PRIVACY))


def make_models(rng: np.random.Generator) -> dict[str, tuple]:
  """Model name -> `(params, apply)`, deterministic in `rng`."""
  return {
      'logistic regression 784->10': (
          models.dense_init(rng, models.INPUT_DIM, models.NUM_CLASSES),
          models.logreg_apply),
      'MLP 784-256-10 (relu)': (
          models.mlp_init(rng, [models.INPUT_DIM, 256, models.NUM_CLASSES]),
          models.mlp_apply),
  }


def variants(apply, batch_size: int = BATCH_SIZE) -> dict[str, steps.Step]:
  """The steps of the module docstring (jax_privacy when it imports)."""
  loss = models.example_loss_fn(apply)
  sgd = optax.sgd(LEARNING_RATE)
  built = {NON_PRIVATE: steps.non_private(loss, sgd),
           OURS: steps.dpsgd(loss, sgd),
           OPTAX: steps.optax_contrib(loss, LEARNING_RATE)}
  jax_privacy, _ = harness.optional_import('jax_privacy')
  if jax_privacy is not None:
    built[JAX_PRIVACY] = steps.jax_privacy(loss, sgd, batch_size, jax_privacy)
  return built


def step_rows(built: dict[str, steps.Step], params, batch
              ) -> tuple[dict[str, harness.Row], dict[str, str]]:
  """Each step as a compiled `harness.Row` (or the reason it is not)."""
  return harness.build_rows({
      name: (lambda s=s, name=name: harness.step_row(
          name, s.step, params, s.init(params), batch))
      for name, s in built.items()})


def main(argv: list[str]) -> None:
  """Times every available variant on each model."""
  args = harness.parse_timing(
      harness.timing_parser(__doc__, iters=5, warmup=1, rounds=5), argv)
  # One fixed noise key per row on purpose: the run releases nothing.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  print('\n'.join(harness.header_lines('dpsgd_step.py', argv)))
  print(f'batch {BATCH_SIZE}, clip {steps.L2_CLIP}, noise multiplier '
        f'{steps.NOISE_MULTIPLIER}, lr {LEARNING_RATE}; {args.rounds} rounds '
        f'x {args.iters} iters, {args.warmup} warmup steps after compile')
  rng = np.random.default_rng(DATA_SEED)
  problems = make_models(rng)
  batch = models.make_batch(rng, BATCH_SIZE)
  for name, (params, apply) in problems.items():
    rows, skipped = step_rows(variants(apply), params, batch)
    times = harness.time_rows(rows, args.iters, args.warmup, args.rounds,
                              skipped)
    harness.print_results(name, times, RATIOS, NON_PRIVATE, skipped)


if __name__ == '__main__':
  main(sys.argv[1:])
