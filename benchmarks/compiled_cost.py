"""What each training step costs in its compiled program: no GPU needed.

Every row is one full training step (gradient, privacy, Adam), compiled for
the CPU from abstract arguments (`jax.ShapeDtypeStruct`s) and never run:
`dpsco_jax.compiled_cost` reads XLA's `cost_analysis()` (flops, bytes
accessed), `memory_analysis()` (temporary memory) and the optimized HLO
(host callbacks, conditionals run every step, top-level ops of ENTRY). Each
row's work is also given as a ratio to the non-private step of the same
(expected) batch size, compiled the same way.

Models:

* ``decoder``: the GPT-style decoder of `benchmarks/decoder_step.py`
  (`models.py`, variant ``default``: vocabulary 16384, width 512, 6 blocks of 8
  heads, T = 256, batch 32 sequences; 35.8M parameters);
* ``small``: an MLP 64-256-10 on digits-size inputs (8x8 images, 10
  classes; 19,210 parameters), batch 32 and 1,024.

Rows, per model and batch size B:

* ``non-private``: `jax.grad` of the batch-mean loss, `optax.adam`;
* ``dpsgd auto`` / ``dpsgd ghost`` / ``dpsgd vmap``:
  `optax.chain(dpsco_jax.dpsgd(..., clipping_method=...), optax.adam)`;
* ``plans.dpsgd poisson``: the plan's compiled step (`Plan._compiled_update`)
  with Poisson sampling at expected batch B over 50,000 examples, on the
  padded batch its sampler yields (`PoissonBatches`: the expected size plus
  four standard deviations, rounded up to 32);
* ``jax_privacy``: `jax_privacy.clipped_grad` sum, the Gaussian privatizer, a
  division by B and `optax.adam` (when `jax_privacy` imports).

Clip 1, noise multiplier 1, Adam learning rate 1e-4. A row that cannot be
built or compiled prints its reason and is left out. The figures are XLA's
CPU estimates, the same for every run on the same versions: compare rows
within one table.

Usage (from the repository root, with `dpsco_jax` installed or
`PYTHONPATH=.`)::

    python benchmarks/compiled_cost.py [--small_only] [--output PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import harness
import models
import steps

import dpsco_jax
from dpsco_jax import plans
# pylint: enable=g-import-not-at-top,wrong-import-position

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

LEARNING_RATE = 1e-4
# The data set a Poisson plan samples from (its size sets the padding).
POISSON_EXAMPLES = 50_000

NON_PRIVATE = 'non-private'
METHODS = ('auto', 'ghost', 'vmap')
PLAN = 'plans.dpsgd poisson'
JAX_PRIVACY = 'jax_privacy'
ROWS = (NON_PRIVATE,) + tuple(f'dpsgd {m}' for m in METHODS) + (
    PLAN, JAX_PRIVACY)


@dataclasses.dataclass(frozen=True)
class Model:
  """A model to cost.

  Attributes:
    name: its name in the table.
    loss_fn: `loss(params, example) -> scalar`, for one example.
    params: the params' shapes (`jax.ShapeDtypeStruct`s).
    example: one example's shapes.
    batch_sizes: the (expected) batch sizes to cost it at.
  """

  name: str
  loss_fn: LossFn
  params: PyTree
  example: PyTree
  batch_sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Record:
  """One row of the table."""

  model: str
  batch_size: int
  row: str
  cost: dpsco_jax.CompiledCost
  note: str = ''


def _shapes(tree: PyTree) -> PyTree:
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _batched(example: PyTree, rows: int) -> PyTree:
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct((rows,) + x.shape, x.dtype), example)


def decoder_model() -> Model:
  """The decoder of `decoder_step.py` (variant 'default'), as shapes."""
  config = models.VARIANTS['default']
  params = jax.eval_shape(lambda k: models.decoder_init(k, config),
                          jax.random.key(0))
  batch = models.decoder_batch(np.random.default_rng(0), config)
  example = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), batch)
  return Model('decoder', models.sequence_loss_fn(config), params,
               example, (config.batch_size,))


def small_model() -> Model:
  """An MLP 64-256-10 on digits-size inputs (`models.mlp_init`)."""
  params = models.mlp_init(np.random.default_rng(0), [64, 256, 10])
  loss_fn = models.example_loss_fn(models.mlp_apply)
  example = {'x': jax.ShapeDtypeStruct((64,), jnp.float32),
             'y': jax.ShapeDtypeStruct((), jnp.int32)}
  return Model('small', loss_fn, _shapes(params), example, (32, 1024))


def non_private(model: Model, batch_size: int):
  """`jax.grad` of the batch-mean loss, then Adam."""
  built = steps.non_private(model.loss_fn, optax.adam(LEARNING_RATE))
  return built.step, (model.params, jax.eval_shape(built.init, model.params),
                      _batched(model.example, batch_size)), ''


def dpsgd(model: Model, batch_size: int, method: str):
  """`dpsco_jax.dpsgd(clipping_method=method)`, then Adam."""
  built = steps.dpsgd(model.loss_fn, optax.adam(LEARNING_RATE), method)
  batch = _batched(model.example, batch_size)
  note = (f'takes {steps.auto_path(model.loss_fn, model.params, batch)}'
          if method == 'auto' else '')
  return built.step, (model.params, jax.eval_shape(built.init, model.params),
                      batch), note


def poisson_plan(model: Model, batch_size: int):
  """`plans.dpsgd` with Poisson sampling at expected `batch_size`."""
  plan = plans.dpsgd(
      model.loss_fn, optimizer=optax.adam(LEARNING_RATE),
      num_examples=POISSON_EXAMPLES, batch_size=batch_size, epochs=1,
      l2_clip=steps.L2_CLIP, delta=1e-6,
      noise_multiplier=steps.NOISE_MULTIPLIER,
      sampling='poisson', method='rdp', key=0, seed=0)
  indices, mask = next(iter(plan.batches))
  inputs = {'batch': _batched(model.example, len(indices)),
            'batch_mask': _shapes(mask), 'example_ids': _shapes(indices)}
  state = jax.eval_shape(plan.transformation.init, model.params)
  # pylint: disable-next=protected-access
  return plan._compiled_update, (model.params, state, inputs), (
      f'padded to {len(indices)}')


def jax_privacy_step(model: Model, batch_size: int, jax_privacy):
  """`jax_privacy.clipped_grad` sum + Gaussian privatizer, / B, Adam."""
  built = steps.jax_privacy(model.loss_fn, optax.adam(LEARNING_RATE),
                            batch_size, jax_privacy)
  return built.step, (model.params, jax.eval_shape(built.init, model.params),
                      _batched(model.example, batch_size)), ''


def cost_rows(model: Model, rows: tuple[str, ...] = ROWS,
              log: Callable[[str], None] = print
              ) -> tuple[list[Record], dict[str, str]]:
  """Compiles and costs each row of `rows` at each of the model's batches.

  Example:
    >>> records, skipped = cost_rows(small_model(), ('non-private',))
    >>> records[0].cost.host_callbacks
    0

  Args:
    model: the model.
    rows: a subset of `ROWS`.
    log: where progress lines go.

  Returns:
    `(records, skipped)`: the rows costed, and `{'model B row': reason}` for
    each that could not be.
  """
  jax_privacy, missing = harness.optional_import('jax_privacy')
  builders = {NON_PRIVATE: non_private, PLAN: poisson_plan,
              JAX_PRIVACY: lambda m, b: jax_privacy_step(m, b, jax_privacy)}
  for method in METHODS:
    builders[f'dpsgd {method}'] = (
        lambda m, b, method=method: dpsgd(m, b, method))
  records, skipped = [], {}
  for batch_size in model.batch_sizes:
    for row in rows:
      label = f'{model.name} B={batch_size} {row}'
      if row == JAX_PRIVACY and jax_privacy is None:
        skipped[label] = f'jax_privacy {missing}'
        continue
      start = time.perf_counter()
      try:
        with warnings.catch_warnings():
          warnings.simplefilter('ignore', dpsco_jax.keys.KeyReuseWarning)
          step, args, note = builders[row](model, batch_size)
          cost = dpsco_jax.compiled_cost(step, *args)
      except Exception as err:  # pylint: disable=broad-except
        skipped[label] = harness.reason(err)
        log(f'skipped {label}: {skipped[label]}')
        continue
      records.append(Record(model.name, batch_size, row, cost, note))
      log(f'compiled {label} in {time.perf_counter() - start:.1f} s')
  return records, skipped


def _si(value: float) -> str:
  for unit, scale in (('T', 1e12), ('G', 1e9), ('M', 1e6), ('k', 1e3)):
    if abs(value) >= scale:
      return f'{value / scale:.3g}{unit}'
  return f'{value:.3g}'


def _bytes(value: float) -> str:
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if abs(value) >= scale:
      return f'{value / scale:.3g} {unit}'
  return f'{value:.0f} B'


def markdown_table(records: list[Record]) -> str:
  """The table: each cost, and its ratio to the non-private step alike."""
  baselines = {(r.model, r.batch_size): r.cost for r in records
               if r.row == NON_PRIVATE}
  lines = ['| model | B | step | flops | bytes accessed | temp memory | '
           'host callbacks (in a conditional) | conditionals run every step '
           '| top-level ops | note |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for r in records:
    base = baselines.get((r.model, r.batch_size))
    ratio = r.cost.ratio_to(base) if base is not None else {}
    x = lambda name: f' ({ratio[name]:.2f}x)' if name in ratio else ''
    lines.append(
        f'| {r.model} | {r.batch_size} | {r.row} | {_si(r.cost.flops)}'
        f'{x("flops")} | {_bytes(r.cost.bytes_accessed)}'
        f'{x("bytes_accessed")} | {_bytes(r.cost.temp_bytes)}'
        f'{x("temp_bytes")} | {r.cost.host_callbacks} '
        f'({r.cost.host_callbacks_in_conditionals}) | '
        f'{r.cost.conditionals_every_step} | {r.cost.entry_ops}'
        f'{x("entry_ops")} | {r.note} |')
  return '\n'.join(lines) + '\n'


def parse_args(argv: list[str]):
  """Parses command-line flags (`--rows` must keep the non-private row)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--small_only', action='store_true',
                      help='cost the small model only (seconds, not minutes)')
  parser.add_argument('--rows', default=','.join(ROWS),
                      help=f'comma-separated subset of {ROWS}')
  parser.add_argument('--output', default='',
                      help='also write the markdown report to this path')
  args = parser.parse_args(argv)
  args.rows = harness.split_choices(parser, args.rows, ROWS, '--rows')
  if NON_PRIVATE not in args.rows:
    parser.error(f'no {NON_PRIVATE!r} row (the denominator) in --rows')
  return args


def main(argv: list[str]) -> Optional[str]:
  """Costs the rows of every model and prints (and writes) the table."""
  args = parse_args(argv)
  header = harness.header_lines('compiled_cost.py', argv)
  print('\n'.join(header), flush=True)
  models = [small_model()] + ([] if args.small_only else [decoder_model()])
  records, skipped = [], {}
  for model in models:
    got, missed = cost_rows(model, args.rows,
                            log=lambda line: print(line, flush=True))
    records += got
    skipped.update(missed)
  report = '\n'.join(
      [f'- {line}' for line in header] + ['- compiled for the device '
                                           'above, never run', '',
                                           markdown_table(records)] +
      [f'- skipped {label}: {reason}' for label, reason in skipped.items()])
  print(report)
  if args.output:
    with open(args.output, 'w', encoding='utf-8') as f:
      f.write(report + '\n')
  return report


if __name__ == '__main__':
  main(sys.argv[1:])
