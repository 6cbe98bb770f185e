"""Your own tabular data in one call: a CSV file or a DataFrame to a plan's data.

This module is the installed door for a user's own data: the repository's
`experiments` folder (with its paper-specific loaders) is not installed by
`pip install dpsco_jax`, so everything a user needs to go from a table to
the arrays a plan trains on lives here, in the package.

    table = data.load_table(
        'machines.csv', task='classification', target='failure',
        features=['air_temp_k', 'torque_nm', 'tool_wear_min'],
        scaling='dp', lower=[290, 0, 0], upper=[310, 80, 250],
        epsilon=0.2, delta=1e-6)
    plan = plans.dpsgd(loss_fn, ..., num_examples=table.num_examples,
                       epsilon=2.0, delta=1e-6, releases=table.releases)
    for inputs in plan.batches_of(table.train): ...

Why the columns are explicit. A table often holds columns that must not be
features: row identifiers (a model can memorize them, and they say nothing
about new rows) and columns derived from the label (failure-type flags next
to a "failure" target, a price band next to a price), which make a model
look excellent and fail on new data. No column is taken by default:
`features=` and `target=` are required, the target is refused among the
features, and so are columns that look like identifiers (by name, such as
`id`, `udi`, `customer_id`, or by value: one distinct integer per row in a
run of consecutive values, or one distinct string per row).

Why the scaling spends privacy (or not). Standardizing features with the
training rows' own mean and variance releases those rows outside the
accounting. `scaling='public'` maps public bounds (known before seeing the
data, e.g. a sensor's range) to [-1, 1] and spends nothing
(`preprocessing.public_standardization`); `scaling='dp'` releases a noisy
mean and variance of the training rows (`preprocessing.dp_standardization`)
whose release `table.releases` goes to the plan's `releases=`, so the
ledger spends it with the steps. `scaling='none'` leaves the features as
they are (already in a small public range).

pandas is optional: a DataFrame is accepted when one is passed, and this
module never imports pandas.
"""

import math
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from dpsco_jax import accounting
from dpsco_jax import estimators
from dpsco_jax import neighboring
from dpsco_jax import preprocessing

Relation = neighboring.NeighboringRelation
Split = dict[str, np.ndarray]

TASKS = ('classification', 'regression')
SCALINGS = ('public', 'dp', 'none')

# Names that say "row identifier" (compared lowercased, with spaces,
# dashes and dots turned into underscores): whole names, and endings after
# an underscore (`customer_id`, `product_id`, `row_index`).
_IDENTIFIER_NAMES = frozenset({
    'id', 'uid', 'udi', 'uuid', 'guid', 'key', 'index', 'idx', 'row',
    'row_number', 'rownum', 'record', 'record_id', 'unnamed:_0', 'unnamed_0',
    'serial', 'serial_number'})
_IDENTIFIER_ENDINGS = ('_id', '_uid', '_uuid', '_guid', '_key', '_index',
                       '_idx')


class Table(NamedTuple):
  """A table loaded for a plan (`load_table`).

  Attributes:
    train: `{'x': float32 [n, d], 'y': [n]}`, the training rows, in the
      shape `plan.batches_of` takes (leading axis: the `n` examples); `y` is
      int32 for classification, float32 for regression.
    test: the held-out rows in the same form (scaled with the same map), or
      None when `test_fraction=0`.
    features: the feature columns, in the order of `x`'s columns.
    target: the target column.
    task: 'classification' or 'regression'.
    classes: for classification with non-integer labels, the original
      label of each class index (`classes[y]`); None when the labels were
      integers (kept as they are) and for regression.
    standardization: the `preprocessing.Standardization` applied to the
      features (None with `scaling='none'`); apply it to new rows.
    target_bound: the public bound the regression target was clipped to
      and divided by, or None.
  """

  train: Split
  test: Optional[Split]
  features: tuple[str, ...]
  target: str
  task: str
  classes: Optional[tuple[Any, ...]]
  standardization: Optional[preprocessing.Standardization]
  target_bound: Optional[float]

  @property
  def num_examples(self) -> int:
    """The training rows n: the plan's `num_examples`."""
    return int(self.train['y'].shape[0])

  @property
  def releases(self) -> tuple[accounting.GaussianRelease, ...]:
    """What to pass as the plan's `releases=`: the DP scaling's release
    (`scaling='dp'`), or nothing."""
    if self.standardization is None or self.standardization.release is None:
      return ()
    return (self.standardization.release,)

  @property
  def num_classes(self) -> Optional[int]:
    """Classes of a classification table (`max(label) + 1` for integer
    labels), None for regression."""
    if self.task != 'classification':
      return None
    if self.classes is not None:
      return len(self.classes)
    labels = [self.train['y']] + ([] if self.test is None else
                                  [self.test['y']])
    return int(max(int(np.max(y)) for y in labels)) + 1


def read_csv(path: str) -> tuple[list[str], np.ndarray]:
  """The header and the string cells of a small CSV file (no pandas).

  Tolerates what real copies of public data sets contain: a byte-order
  mark, a file saved as a Python bytes literal (`b'...'`), names padded
  with spaces. Cells are not parsed.

  Example:
    >>> header, cells = read_csv('tests/data/machines.csv')
    >>> header[:2], cells.shape                   # names, (rows, columns)

  Args:
    path: the CSV file (comma-separated, a header row, no quoted commas).

  Returns:
    `(header, cells)`: the column names, and an object array of strings
    `[rows, columns]`.

  Raises:
    FileNotFoundError: if there is no such file.
    ValueError: if a row has another number of cells than the header.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file')
  # utf-8-sig: some copies start with a byte-order mark.
  with open(path, encoding='utf-8-sig') as f:
    first = f.readline().strip()
    # Some copies were saved as a Python bytes literal: b'...\n'.
    wrapped = first.startswith("b'")
    # Some copies pad names with spaces (gt_2015.csv has 'AFDP ').
    header = [name.strip() for name in
              (first[2:] if wrapped else first).split(',')]
    rows = []
    for number, line in enumerate(f, 2):
      line = line.strip()
      if not line or (wrapped and line == "'"):
        continue
      row = line.split(',')
      if len(row) != len(header):
        raise ValueError(f'{path}, line {number}: {len(row)} cells, the '
                         f'header has {len(header)} (quoted commas are not '
                         'supported: load the file with pandas and pass the '
                         'DataFrame)')
      rows.append(row)
  return header, np.array(rows, dtype=object).reshape(-1, len(header))


def _columns(source: Any) -> tuple[list[str], Callable[[str], np.ndarray],
                                   Callable[[int], str], str]:
  """`(names, column(name) -> values, where(row) -> text, label)`."""
  if isinstance(source, (str, os.PathLike)):
    path = os.fspath(source)
    header, cells = read_csv(path)
    return (header, lambda name: cells[:, header.index(name)],
            lambda row: f'{path}, line {row + 2}', path)
  # A pandas DataFrame (duck-typed: pandas is never imported here).
  if hasattr(source, 'columns') and hasattr(source, 'to_numpy'):
    names = [str(c) for c in source.columns]
    by_name = dict(zip(names, source.columns))
    return (names, lambda name: np.asarray(source[by_name[name]].to_numpy()),
            lambda row: f'row {row} of the DataFrame', 'the DataFrame')
  raise TypeError('source must be a CSV path or a pandas DataFrame, got '
                  f'{type(source).__name__}')


def _normalized(name: str) -> str:
  text = name.strip().lower()
  for char in ' -.':
    text = text.replace(char, '_')
  return text


def identifier_reason(name: str, values: np.ndarray) -> Optional[str]:
  """Why a column looks like a row identifier, or None.

  By name (`id`, `udi`, `uuid`, `index`, `customer_id`, `row_number`, ...),
  or by value: one distinct string per row, or one distinct integer per row
  forming a run of consecutive values (a row number). Checked on at least
  20 rows for values (a few rows are distinct by chance).

  Example:
    >>> identifier_reason('UDI', np.arange(1, 301))
    "its name 'UDI' names an identifier"
    >>> identifier_reason('torque_nm', np.linspace(3, 70, 300)) is None
    True

  Args:
    name: the column's name.
    values: the column's cells (strings or numbers), `[n]`.

  Returns:
    A reason, or None.
  """
  normalized = _normalized(name)
  if normalized in _IDENTIFIER_NAMES or normalized.endswith(
      _IDENTIFIER_ENDINGS):
    return f'its name {name!r} names an identifier'
  values = np.asarray(values)
  if values.shape[0] < 20:
    return None
  try:
    numbers = values.astype(np.float64)
  except (TypeError, ValueError):
    if len(set(map(str, values))) == values.shape[0]:
      return 'it holds a different non-numeric value on every row'
    return None
  if not np.all(np.isfinite(numbers)) or np.any(numbers != np.round(numbers)):
    return None
  ordered = np.sort(numbers)
  if np.all(np.diff(ordered) == 1):
    return ('it holds a different integer on every row, consecutive '
            f'({int(ordered[0])} to {int(ordered[-1])}): a row number')
  return None


def _numbers(values: np.ndarray, name: str,
             where: Callable[[int], str]) -> np.ndarray:
  """The column as float64, or an error naming the first bad cell."""
  try:
    numbers = np.asarray(values).astype(np.float64)
  except (TypeError, ValueError):
    numbers = None
  if numbers is not None and np.all(np.isfinite(numbers)):
    return numbers
  for row, value in enumerate(values):
    if isinstance(value, str) and not value.strip():
      number = math.nan
    else:
      try:
        number = float(value)
      except (TypeError, ValueError):
        raise ValueError(
            f'{where(row)}, column {name!r}: {value!r} is not a number '
            '(encode categorical columns first, or leave them out of '
            'features)') from None
    if not math.isfinite(number):
      raise ValueError(f'{where(row)}, column {name!r}: {value!r} is missing '
                       'or not finite (clean or impute it first)')
  raise AssertionError('unreachable')


def _names(values: Union[str, Sequence[str]], what: str) -> list[str]:
  if isinstance(values, str):
    values = [values]
  values = [str(v) for v in values]
  if not values:
    raise ValueError(f'{what} is empty: name the feature columns')
  duplicated = sorted({v for v in values if values.count(v) > 1})
  if duplicated:
    raise ValueError(f'{what} names {duplicated} more than once')
  return values


def _labels(values: np.ndarray, name: str, where: Callable[[int], str]
            ) -> tuple[np.ndarray, Optional[tuple[Any, ...]]]:
  """Class indices (int32) and the label encoding (None for integers)."""
  values = np.asarray(values)
  try:
    numbers = values.astype(np.float64)
  except (TypeError, ValueError):
    numbers = None
  if numbers is not None:
    bad = np.flatnonzero(~np.isfinite(numbers) | (numbers != np.round(
        numbers)) | (numbers < 0))
    if bad.size:
      raise ValueError(
          f"{where(int(bad[0]))}, column {name!r}: {values[bad[0]]!r} is not "
          "a class label (classification takes integer labels >= 0 or "
          "strings; use task='regression' for a numeric target)")
    return numbers.astype(np.int32), None
  text = np.array([str(v).strip() for v in values], dtype=object)
  empty = np.flatnonzero(text == '')
  if empty.size:
    raise ValueError(f'{where(int(empty[0]))}, column {name!r}: the label is '
                     'missing')
  classes = tuple(sorted(set(text.tolist())))
  index = {label: k for k, label in enumerate(classes)}
  return np.array([index[t] for t in text], dtype=np.int32), classes


def _scaling(scaling: str, x_train: np.ndarray, lower, upper, *, epsilon,
             delta, noise_multiplier, key, method, neighboring_relation
             ) -> Optional[preprocessing.Standardization]:
  if scaling not in SCALINGS:
    raise ValueError(f'scaling must be one of {SCALINGS}, got {scaling!r}')
  privacy_args = dict(epsilon=epsilon, delta=delta,
                      noise_multiplier=noise_multiplier)
  if scaling != 'dp':
    given = sorted(k for k, v in privacy_args.items() if v is not None)
    if given:
      raise ValueError(f"{given} configure scaling='dp'; scaling is "
                       f'{scaling!r}')
  if scaling == 'none':
    if lower is not None or upper is not None:
      raise ValueError("lower= and upper= are the bounds of scaling='public' "
                       "or 'dp'; scaling is 'none'")
    return None
  if lower is None or upper is None:
    raise ValueError(
        f"scaling={scaling!r} needs public bounds lower= and upper=, one per "
        'feature, fixed before looking at the data (e.g. a sensor\'s range): '
        'bounds read off the data would release it outside the accounting')
  if scaling == 'public':
    return preprocessing.public_standardization(lower, upper)
  return preprocessing.dp_standardization(
      x_train, lower, upper, key=key, method=method,
      neighboring_relation=neighboring_relation, **privacy_args)


def load_table(
    source: Any,
    *,
    features: Sequence[str],
    target: str,
    task: str,
    scaling: str = 'public',
    lower: Optional[Sequence[float]] = None,
    upper: Optional[Sequence[float]] = None,
    epsilon: Optional[float] = None,
    delta: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    key: estimators.KeyLike = None,
    method: str = 'pld',
    neighboring_relation: Relation = Relation.ADD_OR_REMOVE,
    target_bound: Optional[float] = None,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Table:
  """A CSV file or a pandas DataFrame as the data a plan trains on.

  Reads the named columns, refuses columns that must not be features
  (module docstring), splits the rows at random into training and test
  rows (`seed`), scales the features with a map fitted on the training
  rows only (public bounds, or a DP release that the plan spends), and
  returns float32 features and int32 class labels (classification: string
  labels are encoded as `classes.index(label)`) or float32 targets
  (regression), as `{'x', 'y'}` dicts that `plan.batches_of` takes.

  Example:
    >>> table = load_table(
    ...     'tests/data/machines.csv', task='classification',
    ...     target='failure', features=['torque_nm', 'tool_wear_min'],
    ...     scaling='dp', lower=[0, 0], upper=[80, 250], epsilon=0.2,
    ...     delta=1e-6, key=jax.random.key(7))
    >>> table.classes                             # ('no', 'yes')
    >>> plan = plans.dpsgd(loss_fn, optimizer=optax.adam(0.05),
    ...                    num_examples=table.num_examples, batch_size=64,
    ...                    epochs=10, l2_clip=1.0, epsilon=2.0, delta=1e-6,
    ...                    releases=table.releases)
    >>> for inputs in plan.batches_of(table.train): ...

  Args:
    source: a CSV path (header row, comma-separated) or a pandas DataFrame.
    features: the feature columns (numeric), in order. Required: no column
      is taken by default.
    target: the target column.
    task: 'classification' (integer labels >= 0 kept as int32; string
      labels encoded, their names in `classes`) or 'regression' (float32).
    scaling: 'public' (default: `lower`/`upper` mapped to [-1, 1], nothing
      spent), 'dp' (a noisy mean and variance of the training rows, clipped
      to `lower`/`upper`; its release is `table.releases`) or 'none'.
    lower: `[d]` public lower bounds of the features ('public', 'dp').
    upper: `[d]` public upper bounds.
    epsilon: the DP scaling's own epsilon ('dp'; or `noise_multiplier`).
    delta: the DP scaling's delta (with `epsilon`).
    noise_multiplier: the DP scaling's noise (instead of `epsilon`).
    key: the DP scaling's noise key (None: fresh from OS entropy; not the
      run's key).
    method: accounting method of the DP scaling's calibration.
    neighboring_relation: the run's relation ('dp': the plan refuses a
      release made for another; e.g. 'zero_out' for fixed-order plans).
    target_bound: regression only: a public bound B of `|y|`; the target is
      clipped to [-B, B] and divided by B. None keeps it as it is.
    test_fraction: the share of rows held out, in [0, 1) (0: no test rows).
    seed: the split's seed.

  Returns:
    A `Table`.

  Raises:
    TypeError: if `source` is neither a path nor a DataFrame.
    FileNotFoundError: if the CSV file does not exist.
    ValueError: for a missing column, the target among the features, an
      identifier-like feature, a cell that is not a number or not a class
      label (with its row and column), bad bounds or scaling arguments, an
      unknown task, or a bad `test_fraction` or `target_bound`.
  """
  if task not in TASKS:
    raise ValueError(f'task must be one of {TASKS}, got {task!r}')
  if not isinstance(target, str) or not target:
    raise ValueError(f'target must be a column name, got {target!r}')
  features = _names(features, 'features')
  if target in features:
    raise ValueError(
        f'the target {target!r} is among the features: a model would read the '
        'answer from its input; take it out of features')
  names, column, where, label = _columns(source)
  missing = [c for c in [*features, target] if c not in names]
  if missing:
    raise ValueError(f'{label} has no column(s) {missing}; its columns are '
                     f'{names}')
  for name in features:
    reason = identifier_reason(name, column(name))
    if reason:
      raise ValueError(
          f'feature {name!r} looks like a row identifier ({reason}): a model '
          'can memorize identifiers and they say nothing about new rows; '
          'leave it out of features')
  x = np.stack([_numbers(column(c), c, where) for c in features], axis=1)
  if task == 'classification':
    if target_bound is not None:
      raise ValueError('target_bound scales a regression target; task is '
                       "'classification'")
    y, classes = _labels(column(target), target, where)
  else:
    y, classes = _numbers(column(target), target, where), None
    if target_bound is not None:
      if not float(target_bound) > 0.0:
        raise ValueError(f'target_bound must be > 0, got {target_bound!r}')
      y = np.clip(y, -target_bound, target_bound) / float(target_bound)
    y = y.astype(np.float32)
  leaks = [c for c, values in zip(features, x.T)
           if np.array_equal(values, np.asarray(y, np.float64))]
  if leaks and len(y) >= 20:
    raise ValueError(f'feature(s) {leaks} equal the target {target!r} on '
                     'every row: a copy of the label, not a feature')
  if not 0.0 <= float(test_fraction) < 1.0:
    raise ValueError(f'test_fraction must be in [0, 1), got {test_fraction!r}')
  order = np.random.default_rng(seed).permutation(len(y))
  num_test = int(round(float(test_fraction) * len(y)))
  test_rows, train_rows = order[:num_test], order[num_test:]
  if train_rows.size == 0:
    raise ValueError(f'{label} has no training rows left')
  standardization = _scaling(
      scaling, x[train_rows], lower, upper, epsilon=epsilon, delta=delta,
      noise_multiplier=noise_multiplier, key=key, method=method,
      neighboring_relation=neighboring_relation)
  scaled = (x.astype(np.float32) if standardization is None else
            standardization.apply(x))
  split = lambda rows: {'x': scaled[rows], 'y': y[rows]}
  return Table(train=split(train_rows),
               test=split(test_rows) if num_test else None,
               features=tuple(features), target=target, task=task,
               classes=classes, standardization=standardization,
               target_bound=None if target_bound is None else float(
                   target_bound))


__all__ = ('SCALINGS', 'TASKS', 'Table', 'identifier_reason', 'load_table',
           'read_csv')
