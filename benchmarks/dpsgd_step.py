"""Per-step wall time of DP-SGD implementations against a non-private step.

Times, on the same model and the same synthetic batch, one jitted training step
of:

* ``non-private``: ``jax.grad`` of the mean batch loss followed by
  ``optax.sgd``;
* ``dpsco_jax``: ``dpsco_jax.dpsgd`` chained with ``optax.sgd``;
* ``optax``: ``optax.contrib.dpsgd`` fed ``jax.vmap``-ed per-example gradients;
* ``jax_privacy``: ``jax_privacy.clipped_grad`` and
  ``jax_privacy.noise_addition.gaussian_privatizer``, then a division by the
  batch size and ``optax.sgd`` (only when ``jax_privacy`` is importable).

Variants are interleaved in rounds (with a rotating order) so that drift in
machine load affects all of them equally; the reported time is the median over
rounds of the mean per-step time within a round.

Usage::

    python benchmarks/dpsgd_step.py [--iters N] [--warmup N] [--rounds N]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
Batch = dict[str, jax.Array]
StepFn = Callable[[PyTree, PyTree, Batch], tuple[PyTree, PyTree]]
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]

BATCH_SIZE = 500
INPUT_DIM = 784
HIDDEN_DIM = 256
NUM_CLASSES = 10
L2_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 0.1
DATA_SEED = 0

NON_PRIVATE = 'non-private'
OURS = 'dpsco_jax'
OPTAX = 'optax'
JAX_PRIVACY = 'jax_privacy'
VARIANTS = (NON_PRIVATE, OURS, OPTAX, JAX_PRIVACY)
RATIOS = (
    (OURS, NON_PRIVATE),
    (OPTAX, NON_PRIVATE),
    (JAX_PRIVACY, NON_PRIVATE),
    (OURS, OPTAX),
    (OURS, JAX_PRIVACY),
)


class Model(NamedTuple):
  """A classifier: its name, initial parameters and forward function."""

  name: str
  params: PyTree
  apply: ApplyFn


class Variant(NamedTuple):
  """A jitted training step together with its initial optimizer state."""

  step: StepFn
  state: PyTree


def optional_import(name: str) -> tuple[ModuleType | None, str]:
  """Imports module ``name``; returns (module or None, reason if missing)."""
  try:
    return importlib.import_module(name), ''
  except ImportError as err:
    return None, f'not installed ({err})'


def load_dpsco_jax() -> tuple[ModuleType | None, str]:
  """Returns ``dpsco_jax`` if it provides ``dpsgd``, else None and a reason."""
  module, reason = optional_import('dpsco_jax')
  if module is not None and not hasattr(module, 'dpsgd'):
    return None, 'importable but has no `dpsgd`'
  return module, reason


def dense_init(rng: np.random.Generator, fan_in: int, fan_out: int) -> PyTree:
  """Returns {"w", "b"} for a dense layer with scaled-normal weights."""
  w = rng.normal(size=(fan_in, fan_out)) / np.sqrt(fan_in)
  return {
      'w': jnp.asarray(w, jnp.float32),
      'b': jnp.zeros((fan_out,), jnp.float32),
  }


def dense(layer: PyTree, x: jax.Array) -> jax.Array:
  """Applies a dense layer to ``x`` (one example or a batch)."""
  return x @ layer['w'] + layer['b']


def logreg_apply(params: PyTree, x: jax.Array) -> jax.Array:
  """Logits of logistic regression."""
  return dense(params, x)


def mlp_apply(params: PyTree, x: jax.Array) -> jax.Array:
  """Logits of a one-hidden-layer ReLU MLP."""
  return dense(params['out'], jax.nn.relu(dense(params['hidden'], x)))


def make_models(rng: np.random.Generator) -> list[Model]:
  """Builds the benchmarked models with deterministic initial parameters."""
  logreg = dense_init(rng, INPUT_DIM, NUM_CLASSES)
  mlp = {
      'hidden': dense_init(rng, INPUT_DIM, HIDDEN_DIM),
      'out': dense_init(rng, HIDDEN_DIM, NUM_CLASSES),
  }
  return [
      Model(f'logistic regression {INPUT_DIM}->{NUM_CLASSES}', logreg,
            logreg_apply),
      Model(f'MLP {INPUT_DIM}-{HIDDEN_DIM}-{NUM_CLASSES} (relu)', mlp,
            mlp_apply),
  ]


def make_batch(rng: np.random.Generator) -> Batch:
  """Returns a synthetic batch {"x": [B, 784] float32, "y": [B] int32}."""
  return {
      'x': jnp.asarray(rng.normal(size=(BATCH_SIZE, INPUT_DIM)), jnp.float32),
      'y': jnp.asarray(rng.integers(0, NUM_CLASSES, size=BATCH_SIZE),
                       jnp.int32),
  }


def example_loss_fn(apply: ApplyFn) -> Callable[[PyTree, Batch], jax.Array]:
  """Softmax cross-entropy of ``apply`` on one example (no batch axis)."""

  def loss(params: PyTree, example: Batch) -> jax.Array:
    logits = apply(params, example['x'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])

  return loss


def non_private_variant(model: Model) -> Variant:
  """``jax.grad`` of the mean batch loss + ``optax.sgd``."""
  loss = example_loss_fn(model.apply)
  tx = optax.sgd(LEARNING_RATE)

  def mean_loss(params: PyTree, batch: Batch) -> jax.Array:
    # The per-example loss broadcasts over a leading batch axis.
    return jnp.mean(loss(params, batch))

  @jax.jit
  def step(params: PyTree, state: PyTree,
           batch: Batch) -> tuple[PyTree, PyTree]:
    grads = jax.grad(mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return Variant(step, tx.init(model.params))


def ours_variant(model: Model, dpsco_jax: ModuleType) -> Variant:
  """``dpsco_jax.dpsgd`` chained with ``optax.sgd``."""
  tx = optax.chain(
      dpsco_jax.dpsgd(
          example_loss_fn(model.apply),
          l2_clip=L2_CLIP,
          noise_multiplier=NOISE_MULTIPLIER,
          # Capacity well past the steps timed (the refusal is on every step).
          num_steps=2**30,
          key=jax.random.key(0),
      ),
      optax.sgd(LEARNING_RATE),
  )

  @jax.jit
  def step(params: PyTree, state: PyTree,
           batch: Batch) -> tuple[PyTree, PyTree]:
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  return Variant(step, tx.init(model.params))


def optax_variant(model: Model) -> Variant:
  """``optax.contrib.dpsgd`` on ``jax.vmap``-ed per-example gradients."""
  per_example_grads = jax.vmap(
      jax.grad(example_loss_fn(model.apply)), in_axes=(None, 0))
  tx = optax.contrib.dpsgd(
      learning_rate=LEARNING_RATE,
      l2_norm_clip=L2_CLIP,
      noise_multiplier=NOISE_MULTIPLIER,
      seed=0,
  )

  @jax.jit
  def step(params: PyTree, state: PyTree,
           batch: Batch) -> tuple[PyTree, PyTree]:
    updates, state = tx.update(per_example_grads(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  return Variant(step, tx.init(model.params))


def jax_privacy_variant(model: Model, jax_privacy: ModuleType,
                        batch_size: int = BATCH_SIZE) -> Variant:
  """``jax_privacy`` clipped-gradient sum + Gaussian privatizer + sgd."""
  clipped_grad_sum = jax_privacy.clipped_grad(
      example_loss_fn(model.apply),
      l2_clip_norm=L2_CLIP,
      batch_argnums=1,
      keep_batch_dim=False,
  )
  tx = optax.chain(
      jax_privacy.noise_addition.gaussian_privatizer(
          stddev=L2_CLIP * NOISE_MULTIPLIER, prng_key=jax.random.key(0)),
      optax.scale(1.0 / batch_size),
      optax.sgd(LEARNING_RATE),
  )

  @jax.jit
  def step(params: PyTree, state: PyTree,
           batch: Batch) -> tuple[PyTree, PyTree]:
    updates, state = tx.update(clipped_grad_sum(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  return Variant(step, tx.init(model.params))


def make_variants(
    model: Model,
    dpsco_jax: ModuleType | None,
    jax_privacy: ModuleType | None,
) -> dict[str, Variant]:
  """Builds every available variant for ``model``, keyed by variant name."""
  variants = {
      NON_PRIVATE: non_private_variant(model),
      OPTAX: optax_variant(model),
  }
  if dpsco_jax is not None:
    variants[OURS] = ours_variant(model, dpsco_jax)
  if jax_privacy is not None:
    variants[JAX_PRIVACY] = jax_privacy_variant(model, jax_privacy)
  return {name: variants[name] for name in VARIANTS if name in variants}


def run_steps(step: StepFn, params: PyTree, state: PyTree, batch: Batch,
              num_steps: int) -> tuple[PyTree, PyTree]:
  """Runs ``num_steps`` steps and blocks until the results are ready."""
  for _ in range(num_steps):
    params, state = step(params, state, batch)
  return jax.block_until_ready((params, state))


def benchmark(model: Model, variants: dict[str, Variant], batch: Batch,
              iters: int, warmup: int, rounds: int) -> dict[str, list[float]]:
  """Returns, per variant, the mean per-step seconds of each timed round."""
  carries = {}
  for name, variant in variants.items():
    carries[name] = run_steps(variant.step, model.params, variant.state, batch,
                              1 + warmup)
  names = list(variants)
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      carries[name] = run_steps(variants[name].step, *carries[name], batch,
                                iters)
      times[name].append((time.perf_counter() - start) / iters)
  return times


def describe(name: str, module: ModuleType | None, reason: str) -> str:
  """One header line: the version of ``name``, or why its column is skipped."""
  if module is None:
    return f'{name}: {reason}; its column is skipped'
  return f'{name} {getattr(module, "__version__", "(no __version__)")}'


def print_header(dpsco_jax: ModuleType | None, dpsco_reason: str,
                 jax_privacy: ModuleType | None, jax_privacy_reason: str,
                 args: argparse.Namespace) -> None:
  """Prints versions, devices and benchmark settings."""
  print(f'python {platform.python_version()} on {platform.platform()}, '
        f'{os.cpu_count()} CPU cores')
  print(f'jax {jax.__version__}, jaxlib {jax.lib.__version__}, '
        f'optax {optax.__version__}')
  print(describe('jax_privacy', jax_privacy, jax_privacy_reason))
  print(describe('dpsco_jax', dpsco_jax, dpsco_reason))
  print(f'backend {jax.default_backend()}, devices {jax.devices()}')
  print(f'batch {BATCH_SIZE}, clip {L2_CLIP}, noise multiplier '
        f'{NOISE_MULTIPLIER}, lr {LEARNING_RATE}; {args.rounds} rounds x '
        f'{args.iters} iters, {args.warmup} warmup steps after compile')


def print_results(model: Model, times: dict[str, list[float]],
                  ratios: tuple[tuple[str, str], ...] = RATIOS) -> None:
  """Prints median step times and the ratios `ratios` between variants."""
  medians = {name: statistics.median(ts) for name, ts in times.items()}
  width = max(12, *(len(name) for name in times))
  print(f'\n== {model.name} ==')
  print(f'  {"variant":<{width}} {"median ms":>10} {"min ms":>8} '
        f'{"max ms":>8}')
  for name, ts in times.items():
    print(f'  {name:<{width}} {1e3 * medians[name]:>10.3f} '
          f'{1e3 * min(ts):>8.3f} {1e3 * max(ts):>8.3f}')
  for num, den in ratios:
    ratio = (f'{medians[num] / medians[den]:.2f}x'
             if num in medians and den in medians else 'n/a')
    print(f'  {f"{num} / {den}":<28} {ratio:>8}')


def parse_args(argv: list[str]) -> argparse.Namespace:
  """Parses command-line flags."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--iters', type=int, default=5,
                      help='timed steps per variant per round')
  parser.add_argument('--warmup', type=int, default=1,
                      help='untimed steps per variant after compilation')
  parser.add_argument('--rounds', type=int, default=5,
                      help='interleaved timing rounds')
  args = parser.parse_args(argv)
  if min(args.iters, args.rounds) < 1 or args.warmup < 0:
    parser.error('--iters and --rounds must be >= 1, --warmup >= 0')
  return args


def main(argv: list[str]) -> None:
  """Benchmarks every available variant on each model."""
  args = parse_args(argv)
  dpsco_jax, dpsco_reason = load_dpsco_jax()
  jax_privacy, jax_privacy_reason = optional_import('jax_privacy')
  print_header(dpsco_jax, dpsco_reason, jax_privacy, jax_privacy_reason, args)
  rng = np.random.default_rng(DATA_SEED)
  models = make_models(rng)
  batch = make_batch(rng)
  for model in models:
    variants = make_variants(model, dpsco_jax, jax_privacy)
    times = benchmark(model, variants, batch, args.iters, args.warmup,
                      args.rounds)
    print_results(model, times)


if __name__ == '__main__':
  main(sys.argv[1:])
