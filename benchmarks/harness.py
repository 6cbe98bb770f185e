"""The one harness every benchmark runs on: timing, compiled cost, reports.

* Timing (`Row`, `step_row`, `time_rows`, `summarize`): each row is built
  and run once before timing (compilation excluded), warmed up, then timed
  in interleaved rounds with a rotating order, so that drift in machine load
  hits every row alike; each round ends with `jax.block_until_ready`. A
  row's time is the median over rounds of its mean per-step time, with the
  min and max as its spread, and every ratio comes from the same run. A row
  that fails to build or run is left out with its reason; the others go on.
* Compiled cost (`compiled_peak_bytes`): read with
  `dpsco_jax.compiled_cost` from XLA's own analyses, never run.
* Reports (`header_lines`, `markdown_table`, `render_markdown`,
  `write_report`): one markdown table, written with the same records as
  JSON (and CSV) beside it.
* Flags (`timing_parser`, `parse_timing`): `--iters`, `--warmup`,
  `--rounds` with each benchmark's defaults, checked alike.

Example::

    rows = {'plain': step_row('plain', step, params, state, batch)}
    times = time_rows(rows, iters=10, warmup=2, rounds=7, skipped={})
    print(markdown_table(summarize(times, baseline='plain')))
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Optional

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Run from a checkout (`python benchmarks/<name>.py`), the checkout's
# dpsco_jax is the one benchmarked, as with `PYTHONPATH=.`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpsco_jax  # pylint: disable=g-import-not-at-top,wrong-import-position

PyTree = Any
Step = Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]


def optional_import(name: str) -> tuple[Optional[ModuleType], str]:
  """`(module, '')`, or `(None, reason)` when `name` does not import.

  Example:
    >>> torch, reason = optional_import('torch')
  """
  try:
    return importlib.import_module(name), ''
  except ImportError as err:
    return None, f'not installed ({err})'


def version_line(name: str) -> str:
  """`'<name> <version>'`, or why `name` is missing (its rows are skipped)."""
  module, reason = optional_import(name)
  if module is None:
    return f'{name} {reason}; its rows are skipped'
  return f'{name} {getattr(module, "__version__", "?")}'


def reason(err: BaseException) -> str:
  """A one-line reason from an exception: `'Type: first line'`."""
  text = str(err).strip().splitlines()
  return f'{type(err).__name__}: {text[0][:200] if text else ""}'


# ------------------------------------------------------------------ timing


@dataclasses.dataclass
class Row:
  """One timed training step.

  Attributes:
    name: the row's name in the table.
    run: `run(n)` runs n steps and waits for the device.
    peak_bytes: `peak_bytes()`: the step's peak memory, None if unknown.
    note: what the table should say about the row (e.g. the path taken).
  """

  name: str
  run: Callable[[int], None]
  peak_bytes: Callable[[], Optional[int]] = lambda: None
  note: str = ''


def is_abstract(tree: PyTree) -> bool:
  """Whether `tree` holds shapes (`jax.ShapeDtypeStruct`), not arrays."""
  return any(isinstance(leaf, jax.ShapeDtypeStruct)
             for leaf in jax.tree_util.tree_leaves(tree))


def init_state(init_fn: Callable[[PyTree], PyTree], params: PyTree) -> PyTree:
  """`init_fn(params)`, or its shapes when `params` are shapes."""
  return (jax.eval_shape(init_fn, params) if is_abstract(params)
          else init_fn(params))


def _nbytes(tree: PyTree) -> int:
  return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize
             for leaf in jax.tree_util.tree_leaves(tree))


def compiled_peak_bytes(fn: Callable[..., Any], *args: Any,
                        donated: PyTree = ()) -> int:
  """Peak memory of `fn(*args)` as XLA plans it (compiled, never run).

  Arguments + temporaries + the outputs that do not overwrite `donated`
  (in a training loop the new params and state take the old ones'
  buffers), from `dpsco_jax.compiled_cost`: per program, independent of the
  order rows run in, as the process-wide `peak_bytes_in_use` is not.

  Example:
    >>> compiled_peak_bytes(step, params, state, batch,
    ...                     donated=(params, state))

  Args:
    fn: the program.
    *args: its arguments (arrays or shapes).
    donated: the arguments whose buffers the outputs reuse.

  Returns:
    Bytes.
  """
  cost = dpsco_jax.compiled_cost(fn, *args)
  return _planned_peak(cost.argument_bytes, cost.temp_bytes,
                       cost.output_bytes, donated)


def _planned_peak(argument_bytes: int, temp_bytes: int, output_bytes: int,
                  donated: PyTree) -> int:
  """Arguments + temporaries + the outputs not written over `donated`."""
  return int(argument_bytes + temp_bytes +
             max(0, output_bytes - _nbytes(donated)))


def step_row(name: str, step: Step, params: PyTree, state: PyTree,
             batch: PyTree, note: str = '') -> Row:
  """A `Row` of `step(params, state, batch) -> (params, state)`, jitted.

  Params and state are donated, as in a training loop (the row works on
  its own copies). With shapes (`jax.ShapeDtypeStruct`) in place of arrays
  the row is for its memory only: running it raises.

  Example:
    >>> row = step_row('plain', step, params, adam.init(params), batch)
    >>> row.run(3)

  Args:
    name: the row's name.
    step: the training step (not yet jitted, or jitted: it is jitted again
      with donation).
    params: initial params (arrays or shapes).
    state: initial optimizer state (arrays or shapes).
    batch: the batch every step sees (arrays or shapes).
    note: for the table.

  Returns:
    The row; its `peak_bytes` reads the compiled step's memory analysis.
  """
  abstract = is_abstract((params, state, batch))
  jitted = jax.jit(step, donate_argnums=(0, 1))
  # One program, with the donation of a training loop, serves the steps and
  # the memory analysis, whether the row runs or is compiled from shapes
  # only (then lazily): both kinds of row report the same program's peak,
  # and a large step is not compiled twice (as costly as once on a GPU).
  compiled: list[Any] = []

  def program() -> Any:
    if not compiled:
      compiled.append(jitted.lower(params, state, batch).compile())
    return compiled[0]

  if not abstract:
    program()

  def advance(carry: PyTree) -> PyTree:
    if abstract:
      raise RuntimeError(f'{name} was compiled from shapes only')
    return program()(*carry, batch)

  def peak_bytes() -> int:
    memory = program().memory_analysis()
    return _planned_peak(
        memory.argument_size_in_bytes, memory.temp_size_in_bytes,
        memory.output_size_in_bytes, (params, state))

  carry = ((params, state) if abstract else
           jax.tree_util.tree_map(jnp.copy, (params, state)))
  return loop_row(name, advance, carry, peak_bytes, note)


def loop_row(name: str, advance: Callable[[PyTree], PyTree], carry: PyTree,
             peak_bytes: Callable[[], Optional[int]] = lambda: None,
             note: str = '') -> Row:
  """A `Row` whose step is `carry = advance(carry)` (e.g. a jitted update).

  Example:
    >>> row = loop_row('noise', lambda c: draw(c[1]), (None, state))

  Args:
    name: the row's name.
    advance: one step, from the carry to the next carry.
    carry: the first carry.
    peak_bytes: for the row.
    note: for the table.

  Returns:
    The row; `run(n)` runs n steps and waits for the last carry.
  """

  def run(n: int) -> None:
    nonlocal carry
    for _ in range(n):
      carry = advance(carry)
    jax.block_until_ready(carry)

  return Row(name, run, peak_bytes, note)


def build_rows(builders: dict[str, Callable[[], Row]], run_once: bool = True
               ) -> tuple[dict[str, Row], dict[str, str]]:
  """Builds each row (and runs it once, compiling it) or records why not.

  Args:
    builders: row name -> a function building the row.
    run_once: run each built row one step, so that compilation stays out
      of the timing.

  Returns:
    `(rows, skipped)`: the rows built, in order, and each failure's reason.
  """
  rows, skipped = {}, {}
  for name, build in builders.items():
    try:
      row = build()
      if run_once:
        row.run(1)
      rows[name] = row
    except Exception as err:  # pylint: disable=broad-except
      skipped[name] = reason(err)
  return rows, skipped


def time_rows(rows: dict[str, Row], iters: int, warmup: int, rounds: int,
              skipped: dict[str, str]) -> dict[str, list[float]]:
  """Interleaved rounds, rotating order: per row, seconds per step a round.

  Example:
    >>> times = time_rows(rows, iters=10, warmup=2, rounds=7, skipped={})

  Args:
    rows: the rows (already compiled: see `build_rows`).
    iters: steps per row per round.
    warmup: untimed steps per row first.
    rounds: timed rounds.
    skipped: where the reason of a row that raises goes (it is dropped).

  Returns:
    Row name -> the mean seconds per step of each round.
  """
  for name, row in rows.items():
    try:
      row.run(warmup)
    except Exception as err:  # pylint: disable=broad-except
      skipped[name] = reason(err)
  names = [n for n in rows if n not in skipped]
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      if name in skipped:
        continue
      start = time.perf_counter()
      try:
        rows[name].run(iters)
      except Exception as err:  # pylint: disable=broad-except
        skipped[name] = reason(err)
        continue
      times[name].append((time.perf_counter() - start) / iters)
  return {n: ts for n, ts in times.items() if n not in skipped}


def ratio(times: dict[str, list[float]], num: str, den: str) -> str:
  """`'1.23x'`: the ratio of two rows' median times, or 'n/a'."""
  if not times.get(num) or not times.get(den):
    return 'n/a'
  return f'{statistics.median(times[num]) / statistics.median(times[den]):.2f}x'


def fastest(times: dict[str, list[float]],
            names: Sequence[str]) -> Optional[str]:
  """The row of `names` with the smallest median time (None: none timed)."""
  timed = [n for n in names if times.get(n)]
  return min(timed, key=lambda n: statistics.median(times[n]), default=None)


def summarize(times: dict[str, list[float]],
              baseline: Callable[[str], str] | str,
              peaks: Optional[dict[str, Optional[int]]] = None,
              notes: Optional[dict[str, str]] = None,
              ratio_name: str = 'time / non-private',
              memory_name: str = 'memory / non-private'
              ) -> list[dict[str, str]]:
  """One record per row: median and spread, ratio to its baseline, memory.

  A row with no times (compiled only) gets 'n/a' for them.

  Args:
    times: from `time_rows` (an empty list: not timed).
    baseline: the denominator row, or a function of the row giving it.
    peaks: row -> peak bytes (None: unknown); no memory columns if None.
    notes: row -> note; no note column if None.
    ratio_name: the time-ratio column's name.
    memory_name: the memory-ratio column's name.

  Returns:
    The records, in the order of `times`.
  """
  base_of = baseline if callable(baseline) else (lambda _: baseline)
  ms = lambda seconds: f'{1e3 * seconds:.3f}'
  records = []
  for name, ts in times.items():
    record = {'row': name,
              'median ms': ms(statistics.median(ts)) if ts else 'n/a',
              'min ms': ms(min(ts)) if ts else 'n/a',
              'max ms': ms(max(ts)) if ts else 'n/a',
              ratio_name: ratio(times, name, base_of(name))}
    if peaks is not None:
      peak, base_peak = peaks.get(name), peaks.get(base_of(name))
      record['peak MiB'] = f'{peak / 2**20:.1f}' if peak is not None else 'n/a'
      record[memory_name] = (f'{peak / base_peak:.2f}x'
                             if peak is not None and base_peak else 'n/a')
    if notes is not None:
      record['note'] = notes.get(name, '')
    records.append(record)
  return records


# ------------------------------------------------------------------ reports


def device_name() -> str:
  """The first JAX device's kind, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu'."""
  return jax.devices()[0].device_kind


def device_slug(name: Optional[str] = None) -> str:
  """A file-name form of a device name ('NVIDIA H100 80GB HBM3' -> ...)."""
  name = device_name() if name is None else name
  return re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_') or 'device'


def results_path(stem: str) -> str:
  """`benchmarks/results/<stem>_<device>.md`."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results',
                      f'{stem}_{device_slug()}.md')


def header_lines(script: str, argv: Sequence[str],
                 optional: Sequence[str] = ('jax_privacy',)) -> list[str]:
  """Device, load, versions and the command line, for every report."""
  versions = [f'jax {jax.__version__}', f'optax {optax.__version__}',
              f'dpsco_jax {getattr(dpsco_jax, "__version__", "?")}']
  versions += [version_line(name) for name in optional]
  load = ', '.join(f'{x:.1f}' for x in os.getloadavg())
  return [
      f'device: {device_name()} (JAX backend {jax.default_backend()}, '
      f'{jax.device_count()} device(s)); {os.cpu_count()} CPU cores, load '
      f'average {load} at the start; python {platform.python_version()}',
      'versions: ' + ', '.join(versions) + '; JAX default matmul precision '
      f'{jax.config.jax_default_matmul_precision or "default"}',
      f'command: python benchmarks/{script} ' + ' '.join(argv),
  ]


def markdown_table(records: list[dict[str, str]]) -> str:
  """A markdown table with one column per key of the first record."""
  if not records:
    return ''
  keys = list(records[0])
  lines = ['| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
  lines += ['| ' + ' | '.join(str(r.get(k, '')) for k in keys) + ' |'
            for r in records]
  return '\n'.join(lines) + '\n'


def render_markdown(title: str, header: list[str],
                    records: list[dict[str, str]], skipped: dict[str, str],
                    extra: Sequence[str] = ()) -> str:
  """The markdown report: title, header, table, extra lines, skipped rows."""
  lines = [f'# {title}', ''] + [f'- {line}' for line in header] + ['']
  table = markdown_table(records)
  if table:
    lines += [table]
  lines += [f'- {line}' for line in extra]
  lines += [f'- skipped {name}: {why}' for name, why in skipped.items()]
  return '\n'.join(lines) + '\n'


def write_report(path: str, markdown: str, records: list[dict[str, str]],
                 header: Sequence[str] = ()) -> str:
  """Writes `path` (markdown), and the records as CSV and JSON beside it.

  Returns:
    The CSV path.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(markdown)
  stem = os.path.splitext(path)[0]
  with open(stem + '.json', 'w', encoding='utf-8') as f:
    json.dump({'header': list(header), 'rows': records}, f, indent=1)
  with open(stem + '.csv', 'w', newline='', encoding='utf-8') as f:
    if records:
      writer = csv.DictWriter(f, fieldnames=list(records[0]))
      writer.writeheader()
      writer.writerows(records)
  return stem + '.csv'


# -------------------------------------------------------------------- flags


def timing_parser(doc: str, iters: int, warmup: int, rounds: int
                  ) -> argparse.ArgumentParser:
  """A parser with `--iters`, `--warmup` and `--rounds` (these defaults)."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument('--iters', type=int, default=iters,
                      help='timed steps per row per round')
  parser.add_argument('--warmup', type=int, default=warmup,
                      help='untimed steps per row after compilation')
  parser.add_argument('--rounds', type=int, default=rounds,
                      help='interleaved timing rounds')
  return parser


def parse_timing(parser: argparse.ArgumentParser,
                 argv: Sequence[str]) -> argparse.Namespace:
  """Parses `argv`; refuses `--iters`/`--rounds` below 1, `--warmup` below 0."""
  args = parser.parse_args(argv)
  if min(args.iters, args.rounds) < 1 or args.warmup < 0:
    parser.error('--iters and --rounds must be >= 1, --warmup >= 0')
  return args


def split_choices(parser: argparse.ArgumentParser, value: str,
                  choices: Sequence[str], flag: str) -> tuple[str, ...]:
  """`'a,b'` -> `('a', 'b')`, each one of `choices` (else a parser error)."""
  picked = tuple(v for v in value.split(',') if v)
  unknown = sorted(set(picked) - set(choices))
  if unknown or not picked:
    parser.error(f'{flag}: unknown {unknown}; choose from {tuple(choices)}')
  return picked


def print_results(title: str, times: dict[str, list[float]],
                  ratios: Sequence[tuple[str, str]], baseline: str,
                  skipped: Optional[dict[str, str]] = None) -> None:
  """Prints `== title ==`, the table of `summarize` and the named ratios.

  Example:
    >>> print_results('MLP', times, [('dpsco_jax', 'non-private')],
    ...               baseline='non-private')
  """
  print(f'\n== {title} ==')
  print(markdown_table(summarize(times, baseline,
                                 ratio_name=f'time / {baseline}')), end='')
  for num, den in ratios:
    print(f'  {f"{num} / {den}":<28} {ratio(times, num, den):>8}')
  for name, why in (skipped or {}).items():
    print(f'  skipped {name}: {why}')
