"""What experiments write: progress logs, CSVs, TensorBoard scalars, plots, run records.

Every experiment ends the same way: log progress while it runs, write its
metrics as CSV, optionally TensorBoard scalars, plot learning curves (with
confidence bands when there are several seeds) and the privacy-utility
trade-off, and write a run record (JSON) that says what was run and what
privacy it spent:

    record = outputs.run_record(
        config, privacy=[outputs.privacy_entry('dpmemf', mechanism, z,
                                               participation, delta)],
        wall_seconds=time.perf_counter() - start)
    outputs.write_json(os.path.join(output_dir, 'run_record.json'), record)

TensorBoard needs `tensorboardX`, or `flax.metrics.tensorboard` /
`tf.summary` (TensorFlow); when none is importable `scalar_writer` returns a
writer that does nothing, so no experiment depends on them.
"""

import csv
import dataclasses
import datetime
import importlib
import json
import math
import os
import platform
import shlex
import sys
import time
from typing import (Any, Dict, Iterable, List, Mapping, NamedTuple, Optional,
                    Sequence)

from absl import logging
import dp_accounting
import matplotlib
matplotlib.use('Agg')  # Files only: no display is needed (or available).
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
from matplotlib import ticker  # pylint: disable=g-import-not-at-top
import ml_collections
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import noise

Row = Dict[str, Any]

# Packages whose versions go into a run record (those that are installed).
RECORDED_PACKAGES = ('dpsco_jax', 'jax', 'jaxlib', 'optax', 'numpy', 'scipy',
                     'dp_accounting', 'ml_collections', 'flax', 'absl-py',
                     'matplotlib', 'scikit-learn')


# ---------------------------------------------------------------- progress


class Progress:
  """Logs `done / total` with elapsed time and an ETA, at most every few seconds.

  Long runs (sweeps of many chunks, thousands of steps) should say where
  they are without flooding the log; the first and last updates are always
  logged.

  Example:
    >>> progress = Progress('sweep', total=10)
    >>> for i in range(10):
    ...   progress.update(i + 1, accuracy=0.9)

  Attributes:
    name: prefix of every log line.
    total: the number of units of work.
    min_interval_seconds: minimum time between two log lines.
  """

  def __init__(self, name: str, total: int,
               min_interval_seconds: float = 10.0):
    self.name = name
    self.total = int(total)
    self.min_interval_seconds = float(min_interval_seconds)
    self._start = time.perf_counter()
    self._last_logged = -math.inf

  def update(self, done: int, **metrics: float) -> bool:
    """Records that `done` units are finished; logs when due.

    Args:
      done: units finished so far.
      **metrics: scalars appended to the log line.

    Returns:
      Whether a line was logged.
    """
    now = time.perf_counter()
    due = (done <= 1 or done >= self.total or
           now - self._last_logged >= self.min_interval_seconds)
    if not due:
      return False
    self._last_logged = now
    elapsed = now - self._start
    # No estimate before the first unit is done (not 'eta nan s').
    eta = (f'eta {elapsed / done * (self.total - done):.1f} s' if done > 0
           else 'eta not yet known')
    extra = ''.join(f'  {k} {v:.4g}' for k, v in metrics.items())
    logging.info('%s: %d/%d  elapsed %.1f s  %s%s', self.name, done,
                 self.total, elapsed, eta, extra)
    return True


# --------------------------------------------------------------------- CSV


def columns_of(rows: Iterable[Row]) -> List[str]:
  """Every key of `rows`, in the order it first appears.

  Example:
    >>> columns_of([{'a': 1}, {'a': 2, 'b': 3}])   # ['a', 'b']

  Args:
    rows: dicts.

  Returns:
    The union of their keys, ordered by first appearance.
  """
  return list(dict.fromkeys(key for row in rows for key in row))


def write_csv(path: str, rows: Sequence[Row],
              columns: Optional[Sequence[str]] = None) -> None:
  """Writes `rows` (dicts) as CSV; missing values and None are left empty.

  Example:
    >>> write_csv('/tmp/metrics.csv', [{'step': 0, 'loss': 2.3}])

  Args:
    path: the file; its folder is created if missing.
    rows: one dict per line.
    columns: the header; default `columns_of(rows)`. Keys not in it are an
      error (a silently dropped column is a lost result).

  Raises:
    ValueError: if a row has a key that is not a column.
  """
  columns = list(columns) if columns is not None else columns_of(rows)
  _makedirs_for(path)
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=columns, restval='')
    writer.writeheader()
    writer.writerows(rows)


def read_csv(path: str) -> List[Dict[str, str]]:
  """Reads a CSV written by `write_csv` (values stay strings).

  Example:
    >>> rows = read_csv('/tmp/metrics.csv')
    >>> float(rows[0]['loss'])

  Args:
    path: the file.

  Returns:
    One dict per line.
  """
  with open(path, newline='') as f:
    return list(csv.DictReader(f))


def _makedirs_for(path: str) -> None:
  folder = os.path.dirname(path)
  if folder:
    os.makedirs(folder, exist_ok=True)


# ------------------------------------------------------------- TensorBoard


class ScalarWriter:
  """Writes scalars to TensorBoard through whichever backend is importable.

  Backends, in order: `tensorboardX`, `flax.metrics.tensorboard` (needs
  TensorFlow), `tf.summary`. With none, `backend` is None and every call
  does nothing, so callers never need to check.

  Example:
    >>> with scalar_writer('/tmp/tb') as writer:
    ...   writer.scalar('test_accuracy', 0.91, step=100)

  Attributes:
    backend: the backend's name, or None.
  """

  def __init__(self, logdir: Optional[str]):
    self.backend = None
    self._write = None
    self._flush = None
    self._close = None
    if logdir is None:
      return
    for name, opener in (('tensorboardX', self._tensorboardx),
                         ('flax', self._flax), ('tensorflow', self._tf)):
      try:
        opener(logdir)
      except ImportError:
        continue
      except Exception as e:  # pylint: disable=broad-except
        # A broken optional install must not stop the experiment.
        logging.warning('TensorBoard backend %s unusable: %s', name, e)
        continue
      self.backend = name
      logging.info('TensorBoard scalars (%s) in %s', name, logdir)
      return

  def _tensorboardx(self, logdir: str) -> None:
    tensorboardx = importlib.import_module('tensorboardX')
    writer = tensorboardx.SummaryWriter(logdir)
    self._write = writer.add_scalar
    self._flush, self._close = writer.flush, writer.close

  def _flax(self, logdir: str) -> None:
    tensorboard = importlib.import_module('flax.metrics.tensorboard')
    writer = tensorboard.SummaryWriter(logdir)
    self._write = writer.scalar
    self._flush, self._close = writer.flush, writer.close

  def _tf(self, logdir: str) -> None:
    tf = importlib.import_module('tensorflow')
    writer = tf.summary.create_file_writer(logdir)

    def write(tag, value, step):
      with writer.as_default():
        tf.summary.scalar(tag, value, step=step)

    self._write = write
    self._flush, self._close = writer.flush, writer.close

  def scalar(self, tag: str, value: float, step: int) -> None:
    """Writes one scalar (no-op without a backend).

    Args:
      tag: the series name, e.g. 'dpmemf/test_accuracy'.
      value: the value.
      step: the x coordinate.
    """
    if self._write is not None:
      self._write(tag, float(value), int(step))

  def close(self) -> None:
    """Flushes and closes the backend (no-op without one)."""
    if self._close is not None:
      self._flush()
      self._close()
      self._write = self._flush = self._close = None

  def __enter__(self) -> 'ScalarWriter':
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def scalar_writer(logdir: Optional[str]) -> ScalarWriter:
  """A TensorBoard writer for `logdir`, or a no-op one (see `ScalarWriter`).

  Example:
    >>> writer = scalar_writer(os.path.join(output_dir, 'tensorboard'))
    >>> writer.scalar('loss', 0.3, step=1); writer.close()

  Args:
    logdir: the event folder; None for a no-op writer.

  Returns:
    A `ScalarWriter`.
  """
  return ScalarWriter(logdir)


# ------------------------------------------------------------------- plots


class Curve(NamedTuple):
  """One line of a plot, with an optional band (e.g. a 95% interval).

  Attributes:
    label: the legend entry.
    x: x coordinates.
    y: y coordinates (e.g. the mean over seeds).
    lower: lower edge of the band, or None.
    upper: upper edge of the band, or None.
  """

  label: str
  x: Sequence[float]
  y: Sequence[float]
  lower: Optional[Sequence[float]] = None
  upper: Optional[Sequence[float]] = None


def plot_curves(path: str, curves: Sequence[Curve], *, xlabel: str,
                ylabel: str, title: str = '', xscale: str = 'linear',
                yscale: str = 'linear', markers: bool = False,
                xticks: Optional[Sequence[float]] = None) -> None:
  """Plots lines with shaded bands to a PNG.

  Example:
    >>> plot_curves('/tmp/curves.png',
    ...             [Curve('dpmemf', steps, mean, low, high)],
    ...             xlabel='step', ylabel='test accuracy')

  Args:
    path: the PNG file; its folder is created if missing.
    curves: the lines.
    xlabel: x axis label.
    ylabel: y axis label.
    title: plot title.
    xscale: 'linear' or 'log'.
    yscale: 'linear' or 'log'.
    markers: draw a marker at every point (for few points).
    xticks: label exactly these x values (plain numbers, also on a log
      axis), or None for matplotlib's choice.
  """
  figure, axes = plt.subplots(figsize=(6, 4))
  for curve in curves:
    (line,) = axes.plot(curve.x, curve.y, label=curve.label,
                        marker='o' if markers else None)
    if curve.lower is not None and curve.upper is not None:
      axes.fill_between(curve.x, curve.lower, curve.upper, alpha=0.2,
                        color=line.get_color(), linewidth=0)
  axes.set_xscale(xscale)
  axes.set_yscale(yscale)
  if xticks is not None:
    axes.xaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_xticks(list(xticks), [f'{x:g}' for x in xticks])
  axes.set_xlabel(xlabel)
  axes.set_ylabel(ylabel)
  if title:
    axes.set_title(title, fontsize=10)
  axes.legend(fontsize=8)
  axes.grid(alpha=0.3)
  figure.tight_layout()
  _makedirs_for(path)
  figure.savefig(path, dpi=100)
  plt.close(figure)


def plot_privacy_utility(path: str, curves: Sequence[Curve], *,
                         ylabel: str = 'test accuracy', title: str = '',
                         reference: Optional[float] = None) -> None:
  """Utility against epsilon (log scale), with bands and a non-private line.

  Example:
    >>> plot_privacy_utility('/tmp/pu.png', [Curve('dpmemf', [1, 2, 4],
    ...                      [0.8, 0.88, 0.91])], reference=0.95)

  Args:
    path: the PNG file.
    curves: one per method; `x` holds the epsilons.
    ylabel: the utility's name.
    title: plot title.
    reference: a horizontal line (e.g. the non-private accuracy), or None.
  """
  xs = sorted({float(x) for curve in curves for x in curve.x})
  if reference is not None:
    curves = list(curves) + [Curve('non-private', [min(xs), max(xs)],
                                   [reference, reference])]
  plot_curves(path, curves, xlabel='epsilon', ylabel=ylabel, title=title,
              xscale='log', markers=True, xticks=xs)


# -------------------------------------------------------------- run record


def config_to_dict(config: Any) -> Dict[str, Any]:
  """A config as plain JSON-able data (`ConfigDict.to_dict()`, tuples -> lists).

  Example:
    >>> config_to_dict(ml_collections.ConfigDict({'lr': 0.1}))   # {'lr': 0.1}

  Args:
    config: an `ml_collections.ConfigDict`, a mapping or None.

  Returns:
    A dict.
  """
  if config is None:
    return {}
  if isinstance(config, (ml_collections.ConfigDict,
                         ml_collections.FrozenConfigDict)):
    config = config.to_dict()
  return _jsonable(dict(config))


def event_to_dict(event: dp_accounting.DpEvent) -> Dict[str, Any]:
  """A `dp_accounting` event as nested dicts `{'class_name': ..., fields}`.

  Built from the event's `to_named_tuple()`, so every event type works and
  the record can be read without `dp_accounting`.

  Example:
    >>> event_to_dict(dp_accounting.GaussianDpEvent(1.5))
    {'class_name': 'GaussianDpEvent', 'noise_multiplier': 1.5}

  Args:
    event: a `dp_accounting.DpEvent`.

  Returns:
    A JSON-able dict.
  """

  def convert(value: Any) -> Any:
    if hasattr(value, '_asdict'):  # The event's named-tuple wrapper.
      fields = value._asdict()
      fields.pop('module_name', None)
      return {k: convert(v) for k, v in fields.items()}
    if isinstance(value, (list, tuple)):
      return [convert(v) for v in value]
    return _jsonable(value)

  return convert(event.to_named_tuple())


def privacy_entry(name: str, mechanism: noise.NoiseMechanism,
                  noise_multiplier: float,
                  participation: accounting.Participation, delta: float, *,
                  target_epsilon: Optional[float] = None,
                  method: str = 'pld') -> Dict[str, Any]:
  """What one private run spent, re-derived from its mechanism and batches.

  Example:
    >>> privacy_entry('dpsgd', dpsco_jax.dpsgd_mechanism(100), 1.1,
    ...               accounting.PoissonSampling(0.01, 100), 1e-5)

  Args:
    name: the run's name (e.g. the algorithm).
    mechanism: the noise mechanism the run used.
    noise_multiplier: the calibrated noise multiplier.
    participation: how its batches were formed.
    delta: the delta.
    target_epsilon: the epsilon it was calibrated for, if any.
    method: the accounting method (`accounting.METHODS`).

  Returns:
    A dict with the name, the `dp_accounting` event (`event_to_dict`) and
    its repr, the participation pattern, noise multiplier, delta, target
    epsilon and the epsilon spent.
  """
  event = accounting.dp_event(mechanism, noise_multiplier, participation)
  spent = accounting.epsilon_spent(mechanism, noise_multiplier, participation,
                                   delta, method=method)
  return {
      'name': name,
      'mechanism': mechanism.name,
      'participation': {'class_name': type(participation).__name__,
                        **dataclasses.asdict(participation)},
      'noise_multiplier': float(noise_multiplier),
      'delta': float(delta),
      'target_epsilon': (None if target_epsilon is None else
                         float(target_epsilon)),
      'epsilon_spent': float(spent),
      'accounting_method': method,
      'dp_event': event_to_dict(event),
      'dp_event_repr': repr(event),
  }


def package_versions(
    names: Sequence[str] = RECORDED_PACKAGES) -> Dict[str, str]:
  """The installed versions of `names` (missing packages are left out).

  Example:
    >>> package_versions(['jax'])   # {'jax': '0.10.2'}

  Args:
    names: distribution names.

  Returns:
    name -> version.
  """
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  versions = {}
  for name in names:
    try:
      versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      continue
  return versions


def command_line() -> str:
  """This process's command line, as a user would type it to run it again.

  A program started with `python -m experiments.NAME ...` is given back in
  that form (not as the path of the module's file), its arguments quoted
  for a POSIX shell.

  Example:
    >>> command_line()   # under `python -m experiments.quickstart --x=1`
    'python -m experiments.quickstart --x=1'

  Returns:
    The command line.
  """
  main = sys.modules.get('__main__')
  module = getattr(getattr(main, '__spec__', None), 'name', None)
  if module and module != '__main__':
    return shlex.join(['python', '-m', module.removesuffix('.__main__')]
                      + sys.argv[1:])
  return shlex.join(sys.argv)


def run_record(config: Any, *, privacy: Sequence[Mapping[str, Any]] = (),
               wall_seconds: Optional[float] = None,
               extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
  """Everything needed to know what a run did and what privacy it spent.

  Example:
    >>> record = run_record(config, privacy=[privacy_entry(...)],
    ...                     wall_seconds=12.3, extra={'command': '...'})
    >>> write_json('results/run_record.json', record)

  Args:
    config: the run's config (`ConfigDict` or mapping).
    privacy: one `privacy_entry` per private run.
    wall_seconds: total wall time.
    extra: anything else worth keeping (JSON-able after `_jsonable`).

  Returns:
    A JSON-able dict with keys 'created' (UTC, ISO 8601), 'command'
    (`command_line()` unless `extra` gives one), 'config', 'privacy',
    'wall_seconds', 'packages', 'platform', 'devices' and those of `extra`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  record = {
      'created': datetime.datetime.now(datetime.timezone.utc).isoformat(),
      'command': command_line(),
      'config': config_to_dict(config),
      'privacy': [_jsonable(dict(entry)) for entry in privacy],
      'wall_seconds': wall_seconds,
      'packages': package_versions(),
      'platform': {'python': platform.python_version(),
                   'machine': platform.machine(),
                   'system': platform.system()},
      'devices': [str(d) for d in jax.devices()],
  }
  record.update(_jsonable(dict(extra or {})))
  return record


def write_json(path: str, data: Any) -> None:
  """Writes `data` as indented JSON (NumPy values converted; inf -> "inf").

  Example:
    >>> write_json('/tmp/run_record.json', {'epsilon_spent': 2.0})

  Args:
    path: the file; its folder is created if missing.
    data: JSON-able after `_jsonable`.
  """
  _makedirs_for(path)
  with open(path, 'w') as f:
    json.dump(_jsonable(data), f, indent=2, sort_keys=False)
    f.write('\n')


def _jsonable(value: Any) -> Any:
  """Converts NumPy/JAX scalars and arrays, tuples and non-finite floats."""
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray) or hasattr(value, '__array__') and not (
      isinstance(value, (str, bytes))):
    array = np.asarray(value)
    return _jsonable(array.tolist() if array.ndim else array.item())
  if isinstance(value, float) and not math.isfinite(value):
    # Strict JSON has no inf/nan; keep them readable and unambiguous.
    return str(value)
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return repr(value)
