"""Seeds x hyperparameter grids as ONE vmapped, jit-compiled program.

A sweep trains the same model many times: for every point of a grid of
scalar hyperparameters (learning rate, clip norm, ...) and every seed. When
one training run is a pure function of its hyperparameters and its seed,

    def train_fn(hparams: Dict[str, jax.Array], seed: jax.Array
                 ) -> Dict[str, jax.Array]:
      ...   # a whole run, e.g. `lax.scan` over the steps
      return {'test_accuracy': accuracy, 'curve': per_step_accuracy}

all runs share their shapes, and `run_sweep` compiles `jax.vmap(train_fn)`
once and runs them together (in chunks of `max_parallel` runs to cap
memory; a chunk's runs are spread over all local devices when their number
divides it, see `run_sharding`), which on a CPU is much faster than a Python loop of runs (see
`benchmarks/sweep_vs_loop.py`):

    result = run_sweep(train_fn, {'learning_rate': [0.1, 0.3, 1.0],
                                  'clip': [0.3, 1.0, 3.0]}, seeds=range(20))
    rows = summarize(result, 'test_accuracy')   # mean, std, 95% interval
    print(format_table(rows))

Inside `train_fn` the hyperparameters are tracers: the private optimizers
accept a traced clip norm (`clipping.validate_clip`) and `optax.sgd` a traced
learning rate, and keys are made inside from the traced seed
(`jax.random.key(seed)`). Traced values cannot be checked while tracing, so
`run_sweep` checks the grid on the host first (`validate_grid`). Anything
that changes shapes or the accounting (batch size, number of steps, the
noise multiplier, which is a host float calibrated once per privacy target)
is fixed per sweep: sweep those with a Python loop over `run_sweep` calls.

Which run gets which seed is explicit, so any single run can be reproduced
alone: `jax.jit(train_fn)(point_hparams, seed)` gives the same result as its
entry of the sweep, up to float reassociation.
"""

import dataclasses
import functools
import itertools
import math
import time
from typing import (Any, Callable, Dict, List, Mapping, NamedTuple,
                    Optional, Sequence, Tuple)

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from experiments import outputs

Row = Dict[str, Any]
TrainFn = Callable[[Dict[str, jax.Array], jax.Array], Dict[str, jax.Array]]

# Hyperparameters that must be positive whatever the experiment (a clip norm
# or learning rate <= 0 is always a mistake); others need only be finite.
POSITIVE_HPARAMS = ('learning_rate', 'lr', 'clip', 'l2_clip')
# Seeds become `jax.random.key(seed)` from an int32 inside the program.
_MAX_SEED = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class SweepResult:
  """The metrics of every run of a sweep.

  Attributes:
    names: the hyperparameter names, in grid order.
    points: `[num_points, len(names)]` float64: row g holds the values of
      grid point g (the cartesian product, last name varying fastest).
    seeds: `[num_seeds]` int64.
    metrics: name -> `[num_points, num_seeds, ...]` NumPy array (whatever
      shape `train_fn` returned for one run after the two leading axes).
    compile_seconds: time to trace and compile the vmapped program.
    run_seconds: time to run every chunk (excluding compilation).
    chunk_size: runs per compiled call.
  """

  names: Tuple[str, ...]
  points: np.ndarray
  seeds: np.ndarray
  metrics: Dict[str, np.ndarray]
  compile_seconds: float
  run_seconds: float
  chunk_size: int

  @property
  def num_points(self) -> int:
    return self.points.shape[0]

  @property
  def num_seeds(self) -> int:
    return self.seeds.shape[0]

  def point(self, index: int) -> Dict[str, float]:
    """The hyperparameters of grid point `index` as a dict of floats."""
    return {name: float(v) for name, v in zip(self.names, self.points[index])}


def validate_grid(grid: Mapping[str, Sequence[float]],
                  positive: Sequence[str] = POSITIVE_HPARAMS
                  ) -> Dict[str, np.ndarray]:
  """Checks a grid on the host and returns it as float64 arrays.

  Example:
    >>> validate_grid({'learning_rate': [0.1, 1.0], 'clip': [1.0]})
    >>> validate_grid({'clip': [0.0]})   # ValueError: clip must be > 0

  Args:
    grid: name -> the values to try (a non-empty sequence of numbers).
    positive: names whose values must be > 0.

  Returns:
    name -> 1-D float64 array, in the grid's order.

  Raises:
    ValueError: on an empty grid, an empty or non-numeric value list, a
      non-finite value, a non-positive value of a `positive` name, or a
      repeated value.
  """
  if not grid:
    raise ValueError('the grid is empty: give at least one hyperparameter')
  checked = {}
  for name, values in grid.items():
    if isinstance(values, (str, bytes)) or not hasattr(values, '__len__'):
      raise ValueError(f'grid[{name!r}] must be a sequence of numbers, got '
                       f'{values!r}')
    try:
      array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
      raise ValueError(f'grid[{name!r}] must hold numbers, got {values!r}'
                       ) from e
    if array.ndim != 1 or array.size == 0:
      raise ValueError(f'grid[{name!r}] must be a non-empty 1-D sequence, '
                       f'got {values!r}')
    if not np.all(np.isfinite(array)):
      raise ValueError(f'grid[{name!r}] must be finite, got {values!r}')
    if name in positive and not np.all(array > 0):
      raise ValueError(f'grid[{name!r}] values must be > 0, got {values!r}')
    if len(np.unique(array)) != array.size:
      raise ValueError(f'grid[{name!r}] repeats a value: {values!r}')
    checked[str(name)] = array
  return checked


def validate_seeds(seeds: Sequence[int]) -> np.ndarray:
  """Checks the seeds: distinct integers in [0, 2^31 - 1].

  Example:
    >>> validate_seeds(range(20))

  Args:
    seeds: the seeds.

  Returns:
    `[num_seeds]` int64.

  Raises:
    ValueError: if empty, not integers, out of range or repeated.
  """
  seeds = list(seeds)
  if not seeds:
    raise ValueError('give at least one seed')
  if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
             for s in seeds):
    raise ValueError(f'seeds must be integers, got {seeds!r}')
  array = np.asarray(seeds, dtype=np.int64)
  if np.any(array < 0) or np.any(array > _MAX_SEED):
    raise ValueError(f'seeds must be in [0, {_MAX_SEED}], got {seeds!r}')
  if len(np.unique(array)) != array.size:
    raise ValueError(f'seeds repeat: {seeds!r}')
  return array


def grid_points(grid: Mapping[str, np.ndarray]) -> np.ndarray:
  """The cartesian product of the grid, last name varying fastest.

  Example:
    >>> grid_points({'a': np.array([1., 2.]), 'b': np.array([3., 4.])})
    array([[1., 3.], [1., 4.], [2., 3.], [2., 4.]])

  Args:
    grid: name -> 1-D values.

  Returns:
    `[prod(len(values)), len(grid)]` float64.
  """
  return np.array(list(itertools.product(*grid.values())),
                  dtype=np.float64).reshape(-1, len(grid))


def run_sharding(num_runs: int) -> Optional[jax.sharding.NamedSharding]:
  """Spreads the runs of a chunk over every local device, when they divide.

  The same program then uses one CPU, or all the GPUs / TPU cores of the
  machine, without code changes: runs are independent, so splitting the
  run axis needs no communication.

  Args:
    num_runs: runs in one compiled call.

  Returns:
    A sharding of the leading (run) axis over a 1-D mesh of the local
    devices, or None with one device or when they do not divide the runs.
  """
  devices = jax.local_devices()
  if len(devices) < 2 or num_runs % len(devices):
    return None
  mesh = jax.sharding.Mesh(np.asarray(devices), ('runs',))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('runs'))


def run_sweep(train_fn: TrainFn, grid: Mapping[str, Sequence[float]],
              seeds: Sequence[int], *, max_parallel: Optional[int] = None,
              positive: Sequence[str] = POSITIVE_HPARAMS,
              dtype: Any = jnp.float32, name: str = 'sweep',
              data: Any = None) -> SweepResult:
  """Runs `train_fn` on every (grid point, seed) as one vmapped program.

  The `num_points * num_seeds` runs are laid out point-major, cut into chunks
  of `max_parallel` runs (the last one padded by repeating the first run;
  the padding is computed and dropped), and each chunk is one call of
  `jax.jit(jax.vmap(train_fn))`, compiled once for the chunk shape.

  Example:
    >>> def train_fn(hparams, seed):
    ...   noise = jax.random.normal(jax.random.key(seed))
    ...   return {'loss': (hparams['learning_rate'] - 0.3) ** 2 + 0.01 * noise}
    >>> result = run_sweep(train_fn, {'learning_rate': [0.1, 0.3]}, range(5))
    >>> result.metrics['loss'].shape   # (2, 5)

  Args:
    train_fn: `train_fn(hparams, seed) -> metrics`, a pure function of ONE
      run: `hparams` maps each grid name to a scalar of `dtype`, `seed` is an
      int32 scalar; metrics are arrays of fixed shapes.
    grid: name -> values; checked by `validate_grid`.
    seeds: distinct non-negative integers; every grid point runs every seed.
    max_parallel: most runs per compiled call (None: all at once). Memory
      grows linearly with it.
    positive: grid names whose values must be > 0.
    dtype: dtype of the hyperparameter scalars.
    name: prefix of the progress log lines.
    data: optional pytree of arrays shared by every run (e.g. the data
      set). It is passed to the compiled program as an argument, called as
      `train_fn(hparams, seed, data)`: a large data set closed over by
      `train_fn` would be baked into the program as a constant instead.

  Returns:
    A `SweepResult` with metrics shaped `[num_points, num_seeds, ...]`.

  Raises:
    ValueError: on a bad grid, bad seeds, or `max_parallel < 1`.
  """
  checked = validate_grid(grid, positive)
  seed_array = validate_seeds(seeds)
  points = grid_points(checked)
  names = tuple(checked)
  num_points, num_seeds = points.shape[0], seed_array.shape[0]
  # Run r is (point r // num_seeds, seed r % num_seeds).
  run_points = np.repeat(np.arange(num_points), num_seeds)
  per_run = ({n: points[run_points, i].astype(dtype)
              for i, n in enumerate(names)},
             np.tile(seed_array, num_points).astype(np.int32))
  done = run_in_chunks(_call_with_seed(train_fn), per_run,
                       max_parallel=max_parallel,
                       shared=() if data is None else (data,),
                       name=f'{name}: {num_points} grid points x {num_seeds} '
                       'seeds')
  metrics = {key: values.reshape((num_points, num_seeds) + values.shape[1:])
             for key, values in done.outputs.items()}
  return SweepResult(names=names, points=points, seeds=seed_array,
                     metrics=metrics, compile_seconds=done.compile_seconds,
                     run_seconds=done.run_seconds, chunk_size=done.chunk_size)


@functools.lru_cache(maxsize=16)
def _call_with_seed(train_fn: TrainFn) -> Callable[..., Any]:
  """`train_fn(hparams, seed, *shared)` as a function of one input tuple
  (cached, so the same `train_fn` is the same program: no recompilation)."""
  return lambda inputs, *shared: train_fn(*inputs, *shared)


class ChunkedRuns(NamedTuple):
  """The outputs of `run_in_chunks`.

  Attributes:
    outputs: the runs' outputs, each leaf with a leading run axis.
    compile_seconds: time to compile the chunk program (0 when cached).
    run_seconds: time to run every chunk.
    chunk_size: runs per compiled call.
  """

  outputs: Any
  compile_seconds: float
  run_seconds: float
  chunk_size: int


@functools.lru_cache(maxsize=16)
def _vmapped(one_run: Callable[..., Any], num_shared: int):
  # Cached per function: the same run function is one jitted program, so a
  # second call with the same shapes reuses its compilation.
  return jax.jit(jax.vmap(one_run, in_axes=(0,) + (None,) * num_shared))


def run_in_chunks(one_run: Callable[..., Any], per_run: Any, *,
                  max_parallel: Optional[int] = None,
                  shared: Sequence[Any] = (), name: str = 'runs'
                  ) -> ChunkedRuns:
  """Runs `one_run` on every run of a list as chunks of ONE vmapped program.

  The engine of every vmapped sweep: the runs are cut into chunks of
  `max_parallel` (the last one padded by repeating the first run; the
  padding is computed and dropped), and every chunk is one call of
  `jax.jit(jax.vmap(one_run))`, compiled once for the chunk shape (and
  reused by later calls with the same `one_run` and shapes). A chunk's runs
  are spread over the local devices when their number divides it
  (`run_sharding`); only host copies of the outputs are kept, so device
  memory stays one chunk's worth.

  Example:
    >>> def one_run(inputs, data):
    ...   lr, seed = inputs
    ...   noise = jax.random.normal(jax.random.key(seed))
    ...   return {'loss': (lr - data) ** 2 + 0.01 * noise}
    >>> done = run_in_chunks(one_run, (np.array([0.1, 0.3, 1.0]),
    ...                                np.array([0, 1, 2], np.int32)),
    ...                      max_parallel=2, shared=(0.3,))
    >>> done.outputs['loss'].shape   # (3,)

  Args:
    one_run: `one_run(inputs, *shared) -> outputs`, a pure function of ONE
      run, where `inputs` is one run's slice of `per_run`; outputs are
      arrays of fixed shapes.
    per_run: a pytree of arrays with a leading axis of one entry per run.
    max_parallel: most runs per compiled call (None: all at once).
    shared: arguments every run shares (e.g. the data set), passed to the
      compiled program rather than baked into it as constants.
    name: prefix of the progress log lines.

  Returns:
    `ChunkedRuns`, its outputs with a leading axis of `num_runs` (NumPy).

  Raises:
    ValueError: for `max_parallel < 1`, no runs, or leaves of `per_run`
      with different leading sizes.
  """
  sizes = {np.shape(leaf)[0] for leaf in jax.tree_util.tree_leaves(per_run)}
  if len(sizes) != 1 or 0 in sizes:
    raise ValueError('per_run must hold one entry per run in every leaf (and '
                     f'at least one run); leading sizes are {sorted(sizes)}')
  num_runs = sizes.pop()
  if max_parallel is not None and (isinstance(max_parallel, bool) or
                                   int(max_parallel) != max_parallel or
                                   max_parallel < 1):
    raise ValueError(f'max_parallel must be a positive integer or None, got '
                     f'{max_parallel!r}')
  chunk = num_runs if max_parallel is None else min(int(max_parallel),
                                                    num_runs)
  num_chunks = math.ceil(num_runs / chunk)
  # Padding repeats run 0, so that it sees valid inputs.
  order = np.concatenate([np.arange(num_runs),
                          np.zeros(num_chunks * chunk - num_runs, np.int64)])
  padded = jax.tree_util.tree_map(lambda leaf: np.asarray(leaf)[order],
                                  per_run)
  sharding = run_sharding(chunk)

  def chunk_inputs(c: int):
    window = jax.tree_util.tree_map(
        lambda leaf: leaf[c * chunk:(c + 1) * chunk], padded)
    return window if sharding is None else jax.device_put(window, sharding)

  start = time.perf_counter()
  compiled = _vmapped(one_run, len(shared)).lower(
      chunk_inputs(0), *shared).compile()
  compile_seconds = time.perf_counter() - start
  logging.info('%s = %d runs in %d chunk(s) of %d; compiled in %.1f s', name,
               num_runs, num_chunks, chunk, compile_seconds)
  progress = outputs.Progress(name, num_chunks)
  start = time.perf_counter()
  pieces = []
  for c in range(num_chunks):
    out = jax.block_until_ready(compiled(chunk_inputs(c), *shared))
    pieces.append(jax.tree_util.tree_map(np.asarray, out))
    progress.update(c + 1)
  run_seconds = time.perf_counter() - start
  joined = jax.tree_util.tree_map(
      lambda *leaves: np.concatenate(leaves)[:num_runs], *pieces)
  return ChunkedRuns(outputs=joined, compile_seconds=compile_seconds,
                     run_seconds=run_seconds, chunk_size=chunk)


def mean_and_interval(values: Any, axis: int = 0, confidence: float = 0.95
                      ) -> Tuple[np.ndarray, np.ndarray, np.ndarray,
                                 np.ndarray]:
  """Mean, sample std, count and Student-t half-width of the mean's interval.

  The half-width is `t.ppf((1 + confidence) / 2, n - 1) * std / sqrt(n)`
  with the sample standard deviation (ddof = 1): an exact interval when the
  values are i.i.d. normal, approximate otherwise. Non-finite values
  propagate (a diverged run makes its row NaN rather than vanish).

  Example:
    >>> mean, std, n, half = mean_and_interval([0.90, 0.92, 0.91])
    >>> (mean - half, mean + half)

  Args:
    values: array-like; the samples run along `axis`.
    axis: the sample axis.
    confidence: in (0, 1).

  Returns:
    `(mean, std, n, half_width)`, arrays over the remaining axes (NaN std
    and half-width when n = 1).

  Raises:
    ValueError: if `confidence` is not in (0, 1).
  """
  if not 0.0 < confidence < 1.0:
    raise ValueError(f'confidence must be in (0, 1), got {confidence!r}')
  values = np.asarray(values, dtype=np.float64)
  n = values.shape[axis]
  mean = np.mean(values, axis=axis)
  if n < 2:
    nan = np.full_like(mean, np.nan)
    return mean, nan, np.full(mean.shape, n), nan
  std = np.std(values, axis=axis, ddof=1)
  half = stats.t.ppf(0.5 + confidence / 2.0, n - 1) * std / math.sqrt(n)
  return mean, std, np.full(mean.shape, n), half


def summarize(result: SweepResult, metric: str, *, confidence: float = 0.95,
              labels: Optional[Mapping[str, Any]] = None) -> List[Row]:
  """One row per grid point: its values, and the metric's mean over seeds.

  Example:
    >>> rows = summarize(result, 'test_accuracy', labels={'algorithm': 'dpmemf'})
    >>> rows[0]   # {'algorithm': 'dpmemf', 'learning_rate': 0.1, 'clip': 0.3,
    ...           #  'mean': ..., 'std': ..., 'n': 20, 'ci_low': ..., ...}

  Args:
    result: a sweep's result.
    metric: a scalar metric (shape `[num_points, num_seeds]`).
    confidence: of the interval for the mean (Student t, see
      `mean_and_interval`).
    labels: constant columns put first in every row (e.g. the algorithm).

  Returns:
    Rows with the labels, the grid names, 'metric', 'mean', 'std', 'n',
    'ci_low', 'ci_high', 'ci_half_width' and 'confidence'.

  Raises:
    KeyError: for an unknown metric.
    ValueError: if the metric is not one scalar per run.
  """
  if metric not in result.metrics:
    raise KeyError(f'no metric {metric!r}; have {sorted(result.metrics)}')
  values = result.metrics[metric]
  if values.ndim != 2:
    raise ValueError(f'metric {metric!r} has shape {values.shape}, not one '
                     'scalar per run [num_points, num_seeds]')
  mean, std, n, half = mean_and_interval(values, axis=1,
                                         confidence=confidence)
  rows = []
  for g in range(result.num_points):
    rows.append({**dict(labels or {}), **result.point(g), 'metric': metric,
                 'mean': float(mean[g]), 'std': float(std[g]),
                 'n': int(n[g]), 'ci_low': float(mean[g] - half[g]),
                 'ci_high': float(mean[g] + half[g]),
                 'ci_half_width': float(half[g]), 'confidence': confidence})
  return rows


def best(rows: Sequence[Row], *, by: str = 'mean',
         maximize: bool = True) -> Row:
  """The row with the best `by` value (NaN rows never win).

  Choosing the best grid point on the metric that is then reported makes
  that number optimistic; pick on a validation metric when one exists.

  Example:
    >>> best(summarize(result, 'test_accuracy'))['learning_rate']
    >>> best(summarize(result, 'train_loss'), maximize=False)

  Args:
    rows: e.g. from `summarize`.
    by: the column to compare.
    maximize: True for accuracy-like, False for loss-like columns.

  Returns:
    The best row.

  Raises:
    ValueError: if there is no row with a finite `by`.
  """
  finite = [r for r in rows if math.isfinite(float(r[by]))]
  if not finite:
    raise ValueError(f'no row has a finite {by!r}')
  return (max if maximize else min)(finite, key=lambda r: float(r[by]))


def grid_edge(grid: Sequence[float], picked: float) -> str:
  """Which edge of a one-dimensional grid a picked value sits on, if any.

  An optimum on the edge of the grid searched may lie outside it: a table
  that reports it must say so (and a wider grid should be tried).

  Example:
    >>> grid_edge([0.01, 0.1, 1.0], 1.0)
    'upper'

  Args:
    grid: the values searched (any order; at least one).
    picked: the value chosen (one of `grid`).

  Returns:
    'lower' or 'upper' when `picked` is the grid's smallest or largest value
    (of a grid of two or more values), '' when it is interior or the grid has
    one value.

  Raises:
    ValueError: if `picked` is not in `grid`.
  """
  values = sorted(float(v) for v in grid)
  if not any(math.isclose(float(picked), v, rel_tol=1e-12) for v in values):
    raise ValueError(f'{picked!r} is not a value of the grid {values}')
  if len(values) < 2:
    return ''
  if math.isclose(float(picked), values[0], rel_tol=1e-12):
    return 'lower'
  if math.isclose(float(picked), values[-1], rel_tol=1e-12):
    return 'upper'
  return ''


def edge_report(point: Mapping[str, float],
                grid: Mapping[str, Sequence[float]]) -> str:
  """Which axes of a multi-axis grid a picked point sits on the edge of.

  Every reported optimum carries this, so no table hides a pick that may
  lie outside the grid searched (`grid_edge` per axis; axes with one value
  are not searched and never flagged).

  Example:
    >>> edge_report({'learning_rate': 1.0, 'clip': 0.5},
    ...             {'learning_rate': [0.1, 1.0], 'clip': [0.5, 1, 2]})
    'learning_rate upper'

  Args:
    point: the picked value of each axis.
    grid: the values searched on each axis (the keys of `point`).

  Returns:
    '' when no axis is on an edge, else '<axis> lower|upper' entries joined
    by ', '.

  Raises:
    ValueError: if an axis of `grid` is missing from `point`, or a picked
      value is not on its axis.
  """
  flags = []
  for axis, values in grid.items():
    if axis not in point:
      raise ValueError(f'the picked point has no value for axis {axis!r}')
    edge = grid_edge(values, point[axis])
    if edge:
      flags.append(f'{axis} {edge}')
  return ', '.join(flags)


class PatienceResult(NamedTuple):
  """The outcome of `descending_step_size_selection`.

  Attributes:
    selected: index (into the learning rates as given) of the first rate,
      largest first, whose run completed; None when every run was rejected.
    verdicts: per learning rate as given: 'selected', 'nan' (the loss
      became non-finite), 'patience' (the counter reached its limit) or
      'not tried' (smaller than the selected rate).
    stopped_at: per learning rate, the index of the check at which the run
      was abandoned (-1 for runs that completed or were not tried).
  """

  selected: Optional[int]
  verdicts: tuple[str, ...]
  stopped_at: tuple[int, ...]


def descending_step_size_selection(
    learning_rates: Sequence[float], train_losses: Any, *, patience: int = 5,
    tolerance: float = 1.05) -> PatienceResult:
  """Paper 003's learning-rate search: largest first, with early rejection.

  Rates are tried from the largest down. A run's train loss is checked at
  fixed intervals (the paper: every 20 rounds); it is abandoned when the
  loss is not finite or when a patience counter reaches `patience`. The
  counter goes up by one when the loss exceeds `tolerance` times the best
  loss seen so far and resets to zero when the loss improves on it. The
  first rate whose run completes is selected and smaller rates are not
  tried. Runs are independent, so applying the rule to the curves of runs
  made together (a vmapped sweep) selects what the sequential search would.

  Example:
    >>> descending_step_size_selection(
    ...     [0.5, 0.25], [[1.0, float('nan')], [1.0, 0.9]]).selected
    1

  Args:
    learning_rates: the rates, any order (they are tried largest first).
    train_losses: `[num_rates, num_checks]` train losses at the checks,
      row k for `learning_rates[k]`.
    patience: the counter's limit (the paper: 5).
    tolerance: the factor over the best loss that counts as no progress
      (the paper: 1.05).

  Returns:
    A `PatienceResult`.

  Raises:
    ValueError: on shapes that disagree, an empty grid, patience < 1 or
      tolerance < 1.

  References:
    Murata & Suzuki (2023), Appendix A (hyperparameter search).
  """
  rates = [float(r) for r in learning_rates]
  losses = np.asarray(train_losses, np.float64)
  if not rates or losses.ndim != 2 or losses.shape[0] != len(rates):
    raise ValueError('train_losses must be [num_rates, num_checks] with one '
                     f'row per learning rate; got {losses.shape} for '
                     f'{len(rates)} rates')
  if int(patience) < 1 or not float(tolerance) >= 1.0:
    raise ValueError(f'patience must be >= 1 and tolerance >= 1, got '
                     f'{patience!r} and {tolerance!r}')
  verdicts = ['not tried'] * len(rates)
  stopped = [-1] * len(rates)
  selected = None
  for k in sorted(range(len(rates)), key=lambda k: -rates[k]):
    best, counter, verdict = math.inf, 0, 'completed'
    for check, loss in enumerate(losses[k]):
      if not math.isfinite(loss):
        verdict = 'nan'
      elif loss > tolerance * best:
        counter += 1
        verdict = 'patience' if counter >= patience else verdict
      elif loss < best:
        counter = 0
      if verdict != 'completed':
        stopped[k] = check
        break
      best = min(best, loss)
    verdicts[k] = verdict
    if verdict == 'completed':
      verdicts[k], selected = 'selected', k
      break
  return PatienceResult(selected, tuple(verdicts), tuple(stopped))


def format_table(rows: Sequence[Row], columns: Optional[Sequence[str]] = None,
                 *, digits: int = 4) -> str:
  """Rows as a markdown table; 'mean' is shown with its interval.

  Example:
    >>> print(format_table(summarize(result, 'test_accuracy')))
    | learning_rate | clip | mean | 95% CI | std | n |
    |---|---|---|---|---|---|
    | 0.1 | 0.3 | 0.8812 | [0.8790, 0.8834] | 0.0047 | 20 |

  Args:
    rows: e.g. from `summarize` (the interval columns are optional).
    columns: the columns to show; default every column except 'metric',
      'confidence', 'ci_low', 'ci_high' and 'ci_half_width', with an
      interval column after
      'mean' when the rows have one.
    digits: decimals of floats.

  Returns:
    The markdown text (ends with a newline).
  """
  if columns is None:
    hidden = {'metric', 'confidence', 'ci_low', 'ci_high', 'ci_half_width'}
    columns = [c for c in outputs.columns_of(rows) if c not in hidden]
    if rows and 'ci_low' in rows[0] and 'mean' in columns:
      columns.insert(columns.index('mean') + 1, 'ci')
  confidence = rows[0].get('confidence', 0.95) if rows else 0.95

  def cell(row: Row, column: str) -> str:
    if column == 'ci':
      low, high = row.get('ci_low'), row.get('ci_high')
      if low is None or not math.isfinite(low):
        return '-'
      return f'[{low:.{digits}f}, {high:.{digits}f}]'
    value = row.get(column)
    if value is None or value == '':
      return '-'
    if isinstance(value, float):
      if column in ('mean', 'std'):
        return f'{value:.{digits}f}' if math.isfinite(value) else '-'
      return f'{value:g}'
    return str(value)

  header = [f'{100 * confidence:g}% CI' if c == 'ci' else c for c in columns]
  lines = ['| ' + ' | '.join(header) + ' |',
           '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(cell(r, c) for c in columns) + ' |'
            for r in rows]
  return '\n'.join(lines) + '\n'


def per_run_rows(result: SweepResult, metrics: Sequence[str],
                 labels: Optional[Mapping[str, Any]] = None) -> List[Row]:
  """One row per (grid point, seed) with the given scalar metrics.

  Example:
    >>> write_csv('runs.csv', per_run_rows(result, ['test_accuracy']))

  Args:
    result: a sweep's result.
    metrics: scalar metrics to include.
    labels: constant columns put first.

  Returns:
    `num_points * num_seeds` rows: labels, grid values, 'seed', metrics.
  """
  rows = []
  for g in range(result.num_points):
    for s, seed in enumerate(result.seeds):
      rows.append({**dict(labels or {}), **result.point(g), 'seed': int(seed),
                   **{m: float(result.metrics[m][g, s]) for m in metrics}})
  return rows


def extend_axis(axis: Sequence[float], edge: str) -> list[float]:
  """`axis` with one more value past its `edge`, at its ratio (or x2).

  Example:
    >>> extend_axis([0.1, 0.3, 1.0], 'upper')
    [0.1, 0.3, 1.0, 3.0...]

  Args:
    axis: the values of one grid axis (positive, geometric).
    edge: 'lower' or 'upper'.

  Returns:
    The sorted extended values.
  """
  values = sorted(float(v) for v in axis)
  ratio = values[1] / values[0] if len(values) > 1 else 2.0
  return sorted(values + ([values[0] / ratio] if edge == 'lower'
                          else [values[-1] * ratio]))


def search_with_extension(
    grid: Mapping[str, Sequence[float]],
    score: Optional[Callable[..., float]] = None, *, extensions: int,
    score_points: Optional[Callable[[list], Sequence[float]]] = None,
    extend: Optional[Callable[[str, list, str], list]] = None,
) -> Tuple[dict, dict, dict]:
  """Minimizes `score(**point)` over a grid, extending axes past edge picks.

  Every point of the grid is scored; while the best point sits on the edge
  of some axis (and its score is finite), that axis gets one more value
  past the edge and the new points are scored, up to `extensions` times
  (or until no edge axis can be extended any more: a bounded `extend`
  returns an axis unchanged at its bound). The caller flags a pick still
  on an edge (`grid_edge`).

  Example:
    >>> picked, grid, scores = search_with_extension(
    ...     {'learning_rate': [0.1, 1.0]}, lambda learning_rate: ...,
    ...     extensions=2)
    >>> search_with_extension(grid, extensions=2,      # one vmapped call
    ...                       score_points=lambda points: run_all(points))

  Args:
    grid: axis name -> values (positive: extensions are geometric).
    score: `score(**point) -> float` (lower is better; inf for a point
      that cannot run).
    extensions: the most times the grid is extended.
    score_points: instead of `score`, `score_points([point, ...]) ->
      scores` for all the new points of a round at once (runs vmapped
      together).
    extend: `extend(axis, values, edge) -> values` adds a value past
      `edge` ('lower' or 'upper') of the named axis, or returns the values
      unchanged where the axis is at a bound (e.g. an integer axis with a
      largest valid value); default `extend_axis` (geometric, unbounded).

  Returns:
    `(picked point, final grid, {values tuple: score})`.

  Raises:
    ValueError: unless exactly one of `score` and `score_points` is given.
  """
  if (score is None) == (score_points is None):
    raise ValueError('give exactly one of score and score_points')
  if score_points is None:
    score_points = lambda points: [score(**point) for point in points]
  if extend is None:
    extend = lambda axis, values, edge: extend_axis(values, edge)
  grid = {axis: sorted(float(v) for v in values)
          for axis, values in grid.items()}
  scores: dict = {}
  for extension in range(extensions + 1):
    new = [values for values in itertools.product(*grid.values())
           if values not in scores]
    results = list(score_points([dict(zip(grid, v)) for v in new]))
    if len(results) != len(new):
      raise ValueError(f'score_points returned {len(results)} scores for '
                       f'{len(new)} points')
    for values, value in zip(new, results):
      scores[values] = float(value)
    best = min(scores, key=scores.get)
    edges = {axis: grid_edge(grid[axis], value)
             for axis, value in zip(grid, best)}
    # The grid returned is the grid scored: the pick's edge flag must be
    # read against the values actually tried.
    if (not any(edges.values()) or not math.isfinite(scores[best]) or
        extension == extensions):
      break
    extended = {axis: (sorted(float(v) for v in extend(
        axis, list(grid[axis]), edges[axis])) if edges[axis] else grid[axis])
                for axis in grid}
    if extended == grid:
      break   # Every edge axis is at its bound: nothing left to try.
    grid = extended
  best = min(scores, key=scores.get)
  return dict(zip(grid, best)), grid, scores
