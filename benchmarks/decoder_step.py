"""Training-step time and memory of a GPT-style decoder, private and not.

The model (`models.py`, issue 31): a decoder-only transformer with a
learned token embedding, learned positions, pre-LN blocks (causal multi-head
self-attention, then a GELU MLP), a final layer norm and an untied LM head
with bias. The privacy unit is one sequence: its loss is the mean
next-token cross-entropy over its positions (`optax`), with a causal mask
closed over as a constant. Adam follows every gradient.

Variants (`--variant`, `models.VARIANTS`): ``default`` (vocabulary 16384,
width 512, 6 blocks of 8 heads, T = 256, batch 32: 35.8M parameters),
``wide`` (four times wider: 369.8M parameters; rows holding per-example
gradients may not fit one 80 GB GPU, and then print why) and ``tiny``
(7,904 parameters: a smoke run on a CPU, not a speed claim).

Rows, each one full training step (`steps.py`): ``jax non-private``,
``dpsgd ghost`` / ``dpsgd vmap`` / ``dpsgd auto`` (`dpsco_jax.dpsgd`
chained with Adam), ``jax_privacy`` (when it imports), and the same
architecture in PyTorch: ``torch non-private``, ``opacus ghost``,
``opacus hooks`` (when `torch` and `opacus` import). Clip 1, noise
multiplier 1, learning rate 1e-4.

Timing, peak memory and the report come from `harness.py`: interleaved
rounds with a rotating order, medians and spread, every ratio from the
same run; a row that fails is left out with its reason. JAX rows' peak
memory is XLA's plan of the compiled step (params and state donated);
PyTorch rows' is `torch.cuda.max_memory_allocated()` over one step (not on
a CPU). `--compile_only` compiles the JAX rows from shapes alone: memory
only, no device memory, no timing, no PyTorch rows.

Usage (from the repository root)::

    python benchmarks/decoder_step.py [--variant default|wide|tiny]
        [--rounds 7] [--iters 10] [--warmup 2] [--rows ROW,ROW]
        [--compile_only]
        [--output benchmarks/results/decoder_step_<device>.md]
"""


from __future__ import annotations

import os

# Several frameworks share the device: JAX must not take 75% of it upfront.
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

# pylint: disable=g-import-not-at-top,wrong-import-position,unused-import
import sys
import time
import warnings
from typing import Any, Optional

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness
import steps
from harness import Row, time_rows
from models import (DecoderConfig, VARIANTS, count_params, decoder_apply,
                    decoder_init, sequence_loss_fn, torch_decoder)
from models import decoder_batch as make_batch

import dpsco_jax
# pylint: enable=g-import-not-at-top,wrong-import-position,unused-import

LEARNING_RATE = 1e-4
DATA_SEED = 0
ROWS = ('jax non-private', 'dpsgd ghost', 'dpsgd vmap', 'dpsgd auto',
        'jax_privacy', 'torch non-private', 'opacus ghost', 'opacus hooks')
# Each row's framework baseline (the denominator of its ratio).
BASELINE = {'jax': 'jax non-private', 'torch': 'torch non-private'}


def framework_of(row: str) -> str:
  """'torch' for the PyTorch rows, 'jax' for the others."""
  return 'torch' if row.startswith(('torch', 'opacus')) else 'jax'


def jax_rows(config: DecoderConfig, params: Any, batch: Any,
             names: tuple[str, ...]) -> dict[str, Any]:
  """Builders of the JAX rows in `names` (see `harness.build_rows`)."""
  loss, adam = sequence_loss_fn(config), optax.adam(LEARNING_RATE)
  jax_privacy, missing = harness.optional_import('jax_privacy')

  def build(name: str) -> Row:
    if name == 'jax non-private':
      built = steps.non_private(loss, adam)
    elif name == 'jax_privacy':
      if jax_privacy is None:
        raise ImportError(f'jax_privacy {missing}')
      built = steps.jax_privacy(loss, adam, config.batch_size, jax_privacy)
    else:
      built = steps.dpsgd(loss, adam, name.split()[1])
    note = (f'took the {steps.auto_path(loss, params, batch)} path'
            if name == 'dpsgd auto' else '')
    return harness.step_row(name, built.step, params,
                            harness.init_state(built.init, params), batch,
                            note)

  return {name: (lambda name=name: build(name)) for name in names}


def build_rows(config: DecoderConfig, names: tuple[str, ...],
               compile_only: bool = False
               ) -> tuple[dict[str, Row], dict[str, str]]:
  """Builds (compiles, runs once) each row in `names`, or says why not.

  One run before timing also builds Adam's state (and Opacus' buffers).

  Args:
    config: the shapes.
    names: rows to build, a subset of `ROWS`.
    compile_only: the JAX rows from shapes alone (nothing allocated or run:
      their memory analysis only); the PyTorch rows are then skipped.

  Returns:
    `(rows, skipped)`: the rows built, and each one not built's reason.
  """
  batch = make_batch(np.random.default_rng(DATA_SEED), config)
  jax_names = tuple(n for n in names if framework_of(n) == 'jax')
  torch_names = tuple(n for n in names if framework_of(n) == 'torch')
  make_params = lambda key: decoder_init(key, config)
  key = jax.random.key(DATA_SEED)
  if compile_only:
    params = jax.eval_shape(make_params, key)
    jax_batch = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
  else:
    params = make_params(key)
    jax_batch = jax.tree_util.tree_map(jax.numpy.asarray, batch)
  builders = jax_rows(config, params, jax_batch, jax_names)
  skipped = {}
  if compile_only:
    skipped = {n: 'not built with --compile_only (JAX rows only)'
               for n in torch_names}
  elif torch_names:
    torch_module, missing = harness.optional_import('torch')
    opacus, opacus_missing = harness.optional_import('opacus')
    if torch_module is None:
      skipped = {n: f'torch {missing}' for n in torch_names}
    else:
      if opacus is None:
        skipped = {n: f'opacus {opacus_missing}' for n in torch_names
                   if n != 'torch non-private'}
      builders.update(steps.torch_lm_rows(
          lambda: torch_decoder(config), batch, config.vocab, tuple(
              n for n in torch_names if n not in skipped), opacus,
          LEARNING_RATE, DATA_SEED))
  rows, failed = harness.build_rows(builders, run_once=not compile_only)
  skipped.update(failed)
  return {n: rows[n] for n in names if n in rows}, skipped


def table_records(times: dict[str, list[float]],
                  peaks: dict[str, Optional[int]],
                  notes: dict[str, str]) -> list[dict[str, str]]:
  """One record per row: times, ratios to its framework's baseline, memory."""
  return harness.summarize(times, lambda row: BASELINE[framework_of(row)],
                           peaks, notes)


def versus_jax_privacy(times: dict[str, list[float]],
                       peaks: dict[str, Optional[int]]) -> list[str]:
  """Lines `dpsgd <m> / jax_privacy: time ..x, memory ..x`."""
  if 'jax_privacy' not in times:
    return []
  ref = peaks.get('jax_privacy')
  return [f'{name} / jax_privacy: time '
          f'{harness.ratio(times, name, "jax_privacy")}, memory '
          + (f'{peaks[name] / ref:.2f}x' if peaks.get(name) and ref else 'n/a')
          for name in ('dpsgd ghost', 'dpsgd vmap', 'dpsgd auto')
          if name in times]


def header_lines(args, config: DecoderConfig, argv: list[str]) -> list[str]:
  """The harness's header, the torch device, the variant and settings."""
  lines = harness.header_lines('decoder_step.py', argv,
                               ('jax_privacy', 'torch', 'opacus'))
  torch_module, _ = harness.optional_import('torch')
  if torch_module is not None:
    # Float32 matmul precision differs by default between the frameworks on
    # GPUs (TF32 or not): the header says which each used.
    lines.append('torch device ' + (
        torch_module.cuda.get_device_name(0)
        if torch_module.cuda.is_available() else 'cpu') + ' (float32 matmul '
                 f'precision {torch_module.get_float32_matmul_precision()})')
  return lines + [
      f'variant: {args.variant} ({config}); '
      f'{count_params(config):,} parameters',
      f'clip {steps.L2_CLIP}, noise multiplier {steps.NOISE_MULTIPLIER}, '
      f'adam lr {LEARNING_RATE}; {args.rounds} rounds x {args.iters} steps '
      f'per row, {args.warmup} warmup steps after compilation; rotating order',
      'peak memory: JAX rows XLA compiled memory analysis (arguments + '
      'temporaries + outputs not written over the donated params and '
      'state); PyTorch rows torch.cuda.max_memory_allocated over one step '
      '(n/a on CPU)']


def parse_args(argv: list[str]):
  """Parses command-line flags."""
  parser = harness.timing_parser(__doc__, iters=10, warmup=2, rounds=7)
  parser.add_argument('--variant', choices=sorted(VARIANTS),
                      default='default')
  parser.add_argument('--rows', default=','.join(ROWS),
                      help=f'comma-separated subset of {ROWS}')
  parser.add_argument('--compile_only', action='store_true',
                      help='compile the JAX rows from shapes and report '
                      'their memory analysis only (no device memory, no '
                      'timing, no PyTorch rows)')
  parser.add_argument('--output', default='',
                      help='markdown path (CSV and JSON beside it); default '
                      'benchmarks/results/decoder_step[_<variant>]_'
                      '<device>.md')
  args = harness.parse_timing(parser, argv)
  args.rows = harness.split_choices(parser, args.rows, ROWS, '--rows')
  return args


def main(argv: list[str]) -> None:
  """Builds, times and reports the rows of `--variant`."""
  args = parse_args(argv)
  # Every dpsgd row reuses one fixed noise key on purpose: the run only
  # times steps and releases nothing.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  # Opacus' notices (its fast, not cryptographically secure, noise; backward
  # hooks on modules whose inputs need no gradient) say nothing on timing.
  warnings.filterwarnings('ignore', message='Secure RNG turned off')
  warnings.filterwarnings('ignore', message='Full backward hook is firing')
  config = VARIANTS[args.variant]
  header = header_lines(args, config, argv)
  print('\n'.join(header), flush=True)
  start = time.perf_counter()
  rows, skipped = build_rows(config, args.rows, args.compile_only)
  print(f'built {len(rows)} rows in {time.perf_counter() - start:.1f} s',
        flush=True)
  times = ({name: [] for name in rows} if args.compile_only else
           time_rows(rows, args.iters, args.warmup, args.rounds, skipped))
  peaks = {}
  for name in times:
    try:
      peaks[name] = rows[name].peak_bytes()
    except Exception as err:  # pylint: disable=broad-except
      peaks[name] = None
      print(f'peak memory of {name} not measured: {harness.reason(err)}')
  records = table_records(times, peaks, {n: r.note for n, r in rows.items()})
  markdown = harness.render_markdown('decoder_step', header, records, skipped,
                                     versus_jax_privacy(times, peaks))
  print(markdown)
  stem = ('decoder_step' + ('' if args.variant == 'default' else
                            f'_{args.variant}') +
          ('_compiled' if args.compile_only else ''))
  path = args.output or harness.results_path(stem)
  csv_path = harness.write_report(path, markdown, records, header)
  print(f'wrote {path} and {csv_path}')


if __name__ == '__main__':
  main(sys.argv[1:])
