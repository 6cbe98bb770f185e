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
run of consecutive values, or one distinct string per row) and features
that predict the target almost perfectly on the training rows, alone or a
few indicator columns together (`predictive_columns`, with its thresholds;
`allow_predictive=` confirms a column known before the target is). That
detection is a heuristic: it cannot catch every leak (a leak spread over
many columns, or holding on part of the rows, passes), so leave out the
columns recorded from the label yourself. Every refused column is named in
one error, so one run finds them all.

Which class is 1. String labels are encoded in sorted order ('fail'/'ok'
gives y = 1 for 'ok') unless `positive_class=` names the class of y = 1;
the encoding is printed on stderr (`DPSCO_JAX_PROGRESS=0` silences it) and
kept in `table.classes` and `table.positive_class`.

Why the scaling spends privacy (or not). Standardizing features with the
training rows' own mean and variance releases those rows outside the
accounting. `scaling='public'` maps public bounds (known before seeing the
data, e.g. a sensor's range) to [-1, 1] and spends nothing
(`preprocessing.public_standardization`); `scaling='dp'` releases a noisy
mean and variance of the training rows (`preprocessing.dp_standardization`)
whose release `table.releases` goes to the plan's `releases=`, so the
ledger spends it with the steps. `scaling='none'` leaves the features as
they are (already in a small public range). Values outside public bounds
are clipped to them, with a `ClippedValuesWarning` counting them per
column.

pandas is optional: a DataFrame is accepted when one is passed, and this
module never imports pandas.
"""

import math
import os
import sys
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from dpsco_jax import accounting
from dpsco_jax import estimators
from dpsco_jax import checks
from dpsco_jax import neighboring
from dpsco_jax import preprocessing
from dpsco_jax import progress

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

# Features that predict the target almost perfectly on the training rows
# (`predictive_columns`; a heuristic: module docstring). Classification: a
# mapping of the column's values to classes matches the target on at least
# PREDICTIVE_AGREEMENT of the rows AND on PREDICTIVE_BALANCED of each
# class's rows on average (so a rare class cannot hide behind the majority
# class). Regression: the column's values explain at least
# PREDICTIVE_EXPLAINED of the target's variance (|correlation| >= 0.99).
PREDICTIVE_AGREEMENT = 0.99
PREDICTIVE_BALANCED = 0.95
PREDICTIVE_EXPLAINED = 0.98
# A column with many values is read as runs of about this many training
# rows in sorted order (ties kept together), so that a mapping cannot
# memorize single rows; a column with at most n / _GROUP_ROWS values is
# read value by value.
_GROUP_ROWS = 20
# Combinations: of two-valued (indicator) columns only, at most this many,
# their joint values in at most n / _GROUP_ROWS cells.
MAX_COMBINED = 5
# Fewer training rows than this say nothing either way: not checked.
_MIN_ROWS = 20


class ClippedValuesWarning(UserWarning):
  """Public bounds clipped some values of a table (counts per column)."""


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
    classes: for classification with non-integer labels (or with
      `positive_class=`), the original label of each class index
      (`classes[y]`; two classes: `classes[1]` is y = 1); None when the
      labels were integers (kept as they are) and for regression.
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
    """The number of training rows n, the plan's `num_examples`."""
    return int(self.train['y'].shape[0])

  @property
  def releases(self) -> tuple[accounting.GaussianRelease, ...]:
    """What to pass as the plan's `releases=`: the DP scaling's release
    (`scaling='dp'`), or nothing."""
    if self.standardization is None or self.standardization.release is None:
      return ()
    return (self.standardization.release,)

  @property
  def positive_class(self) -> Any:
    """The label that y = 1 stands for in a two-class table (`classes[1]`;
    1 for integer labels), None otherwise."""
    if self.num_classes != 2:
      return None
    return 1 if self.classes is None else self.classes[1]

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


class Predictive(NamedTuple):
  """Features that predict the target almost perfectly (`predictive_columns`).

  Attributes:
    columns: the feature(s): one column alone, or the indicator columns
      that predict it together.
    evidence: what was measured on the training rows, in words.
  """

  columns: tuple[str, ...]
  evidence: str


def _value_groups(values: np.ndarray) -> tuple[np.ndarray, int]:
  """Group codes of a column: its values, or runs of about `_GROUP_ROWS`
  rows in sorted order when it has more than n / `_GROUP_ROWS` values."""
  distinct, inverse, counts = np.unique(values, return_inverse=True,
                                        return_counts=True)
  if distinct.size <= max(2, values.shape[0] // _GROUP_ROWS):
    return inverse.reshape(-1), int(distinct.size)
  # Ties stay in one run: a value's run is where its first row falls.
  run = (np.cumsum(counts) - counts) // _GROUP_ROWS
  return run[inverse.reshape(-1)], int(run[-1]) + 1


def _class_fit(codes: np.ndarray, num_codes: int, y: np.ndarray,
               num_classes: int) -> tuple[float, float, np.ndarray]:
  """`(agreement, balanced agreement, class of each code)` of the best
  mapping from codes to classes (each code to its most frequent class)."""
  table = np.bincount(codes * num_classes + y,
                      minlength=num_codes * num_classes).reshape(
                          num_codes, num_classes)
  predicted = table.argmax(axis=1)
  hits = table[np.arange(num_codes), predicted]
  sizes = table.sum(axis=0)
  recalled = np.bincount(predicted, weights=hits, minlength=num_classes)
  present = sizes > 0
  return (float(hits.sum()) / y.shape[0],
          float(np.mean(recalled[present] / sizes[present])), predicted)


def _explained(codes: np.ndarray, num_codes: int, y: np.ndarray) -> float:
  """The share of the target's variance its mean per code explains (the
  correlation ratio eta^2)."""
  total = float(np.sum((y - y.mean()) ** 2))
  if total == 0.0:
    return 0.0
  counts = np.bincount(codes, minlength=num_codes)
  sums = np.bincount(codes, weights=y, minlength=num_codes)
  used = counts > 0
  between = float(np.sum(sums[used] ** 2 / counts[used])
                  - y.sum() ** 2 / y.shape[0])
  return between / total


class _Target(NamedTuple):
  """The target as the detection reads it."""
  values: np.ndarray        # class indices (int) or numbers (float64)
  classes: Optional[tuple]  # class names, None for regression

  @property
  def classification(self) -> bool:
    return self.classes is not None

  def fit(self, codes: np.ndarray, num_codes: int) -> tuple[float, ...]:
    """The score to maximize: (balanced agreement, agreement) or
    (explained variance,)."""
    if self.classification:
      agreement, balanced, _ = _class_fit(codes, num_codes, self.values,
                                          len(self.classes))
      return (balanced, agreement)
    return (_explained(codes, num_codes, self.values),)

  def flagged(self, score: tuple[float, ...]) -> bool:
    if self.classification:
      return (score[0] >= PREDICTIVE_BALANCED and
              score[1] >= PREDICTIVE_AGREEMENT)
    return score[0] >= PREDICTIVE_EXPLAINED


def _rows(count: int, n: int) -> str:
  return f'{count:,} of {n:,} training rows ({100.0 * count / n:.1f}%)'


def _alone(values: np.ndarray, target: _Target) -> Optional[str]:
  """Why `values` predicts the target alone, or None."""
  n = values.shape[0]
  y = target.values
  codes, num_codes = _value_groups(values)
  score = target.fit(codes, num_codes)
  if target.classification:
    if not target.flagged(score):
      return None
    agreement, balanced, predicted = _class_fit(codes, num_codes, y,
                                                len(target.classes))
    distinct = np.unique(values)
    if num_codes == distinct.size <= 4:
      mapping = ', '.join(
          f'{value:g} -> {target.classes[predicted[k]]!r}'
          for k, value in enumerate(distinct))
      how = f'mapping its values to classes ({mapping})'
    elif num_codes == distinct.size:
      how = f'mapping its {num_codes} values to classes'
    else:
      how = (f'mapping ranges of its values (about {_GROUP_ROWS} sorted rows '
             'each) to classes')
    return (f'{how} matches the target on '
            f'{_rows(int(round(agreement * n)), n)}, and on {balanced:.1%} '
            "of each class's rows on average")
  correlation = 0.0
  if np.std(values) > 0 and np.std(y) > 0:
    correlation = float(np.corrcoef(values, y)[0, 1])
  if correlation ** 2 >= PREDICTIVE_EXPLAINED:
    return (f'its correlation with the target is {correlation:.4f} on the '
            f'{n:,} training rows')
  if target.flagged(score):
    return (f'ranges of its values explain {score[0]:.1%} of the target\'s '
            f'variance on the {n:,} training rows')
  return None


def _together(indicators: np.ndarray, target: _Target
              ) -> Optional[tuple[list[int], str]]:
  """`(columns, evidence)` of a few indicator columns that predict the
  target together (greedy forward selection over their joint values, then
  pruned to the columns needed), or None."""
  n, count = indicators.shape
  limit = max(4, n // _GROUP_ROWS)
  codes, cells, chosen = np.zeros(n, np.int64), 1, []
  score = target.fit(codes, cells)
  while len(chosen) < MAX_COMBINED and cells * 2 <= limit:
    scores = {j: target.fit(codes * 2 + indicators[:, j], cells * 2)
              for j in range(count) if j not in chosen}
    if not scores:
      break
    best = max(scores, key=scores.get)
    if scores[best] <= score:
      break
    chosen.append(best)
    codes, cells, score = codes * 2 + indicators[:, best], cells * 2, (
        scores[best])
    if target.flagged(score):
      break
  if len(chosen) < 2 or not target.flagged(score):
    return None

  def fit_of(columns):
    joint = np.zeros(n, np.int64)
    for j in columns:
      joint = joint * 2 + indicators[:, j]
    return target.fit(joint, 2 ** len(columns))

  for j in list(chosen):   # keep only the columns the prediction needs
    rest = [c for c in chosen if c != j]
    if len(rest) >= 2 and target.flagged(fit_of(rest)):
      chosen = rest
  chosen = sorted(chosen)   # in the features' order
  part = indicators[:, chosen]
  y = target.values
  if target.classification and len(target.classes) == 2:
    largest = part.max(axis=1)
    for positive in (1, 0):
      equal = int(np.sum(largest == (y == positive)))
      if equal >= PREDICTIVE_AGREEMENT * n:
        return chosen, (
            f'their max is 1 exactly where the target is '
            f'{target.classes[positive]!r} on {_rows(equal, n)}')
  for name, combined in (('max', part.max(axis=1)), ('sum', part.sum(
      axis=1))):
    equal = int(np.sum(combined == y))
    if equal >= PREDICTIVE_AGREEMENT * n:
      what = 'class index' if target.classification else 'target'
      return chosen, f'their {name} equals the {what} on {_rows(equal, n)}'
  score = fit_of(chosen)
  if target.classification:
    return chosen, (f'a mapping of their joint values to classes matches '
                    f'the target on {_rows(int(round(score[1] * n)), n)}, '
                    f"and on {score[0]:.1%} of each class's rows on average")
  return chosen, (f'their joint values explain {score[0]:.1%} of the '
                  f"target's variance on the {n:,} training rows")


def predictive_columns(x: np.ndarray, y: np.ndarray, names: Sequence[str],
                       task: str, *, classes: Optional[Sequence[Any]] = None
                       ) -> list[Predictive]:
  """Features that predict the target almost perfectly (a leak's sign).

  A column recorded from the label (a failure type next to a "failure"
  target, a price band next to a price) makes a model look excellent and
  fail on new rows, and under DP it spends the whole budget learning the
  copy. This heuristic flags, on the rows given (the training rows):

  * a column alone: classification, the best mapping of its values (or,
    for a column with many values, of runs of about 20 rows in sorted
    order: a threshold or a few ranges) to classes matches the target on
    at least `PREDICTIVE_AGREEMENT` (99%) of the rows and on at least
    `PREDICTIVE_BALANCED` (95%) of each class's rows on average;
    regression, `|correlation| >= 0.99` or the runs' means explain at
    least `PREDICTIVE_EXPLAINED` (98%) of the target's variance;
  * a combination of up to `MAX_COMBINED` two-valued (indicator) columns
    whose joint values (a max, a sum or any other function of them)
    predict the target the same way: found by greedy forward selection,
    then pruned to the columns needed.

  It cannot catch every leak: a leak spread over many columns, through a
  column with many values combined with others, or one that holds only on
  part of the rows passes. A flagged column may also be legitimate (known
  before the target is); `load_table(allow_predictive=...)` confirms it.
  Cost: a sort per column and `O(MAX_COMBINED x indicators)` counts over
  the rows (vectorized numpy).

  Example:
    >>> modes = rng.random((1000, 5)) < 0.01            # 5 indicators
    >>> failed = modes.any(axis=1)
    >>> found = predictive_columns(np.c_[modes, rng.normal(size=1000)],
    ...                            failed.astype(int),
    ...                            ['a', 'b', 'c', 'd', 'e', 'noise'],
    ...                            'classification')
    >>> found[0].columns, found[0].evidence             # ('a', ..., 'e')

  Args:
    x: the features, `[n, d]` numbers.
    y: the target, `[n]`: class indices (int) or numbers.
    names: the `d` column names.
    task: 'classification' or 'regression'.
    classes: the class names (`classes[y]`), for the messages; default the
      indices.

  Returns:
    The flagged columns with their evidence, each column alone first, then
    at most one combination (of columns not flagged alone). Empty for fewer
    than 20 rows or a constant target.

  Raises:
    ValueError: for an unknown task or shapes that disagree.
  """
  if task not in TASKS:
    raise ValueError(f'task must be one of {TASKS}, got {task!r}')
  x = np.asarray(x, np.float64)
  names = [str(name) for name in names]
  if x.ndim != 2 or x.shape[1] != len(names) or np.shape(y) != x.shape[:1]:
    raise ValueError(f'x [n, d], y [n] and d names, got {x.shape}, '
                     f'{np.shape(y)} and {len(names)} names')
  if x.shape[0] < _MIN_ROWS:
    return []
  if np.unique(np.asarray(y)).size < 2:
    return []     # a constant target: every column "predicts" it
  if task == 'classification':
    labels, indices = np.unique(np.asarray(y), return_inverse=True)
    classes = (tuple(classes[int(k)] for k in labels) if classes is not None
               else tuple(labels.tolist()))
    target = _Target(indices.reshape(-1), classes)
  else:
    target = _Target(np.asarray(y, np.float64), None)
  found, left = [], []
  for j, name in enumerate(names):
    evidence = _alone(x[:, j], target)
    if evidence:
      found.append(Predictive((name,), evidence))
    else:
      left.append(j)
  indicators = [j for j in left if np.unique(x[:, j]).size == 2]
  if len(indicators) >= 2:
    ones = np.stack([x[:, j] == x[:, j].max() for j in indicators],
                    axis=1).astype(np.int64)
    together = _together(ones, target)
    if together is not None:
      columns, evidence = together
      found.append(Predictive(tuple(names[indicators[c]] for c in columns),
                              evidence))
  return found


def _numbers(values: np.ndarray, name: str, where: Callable[[int], str],
             role: str = 'feature') -> tuple[Optional[np.ndarray],
                                              Optional[str]]:
  """`(the column as float64, None)`, or `(None, what is wrong)` naming its
  first bad cell and how many there are."""
  try:
    numbers = np.asarray(values).astype(np.float64)
  except (TypeError, ValueError):
    numbers = None
  if numbers is not None and np.all(np.isfinite(numbers)):
    return numbers, None
  text, missing = [], []
  for row, value in enumerate(values):
    if isinstance(value, str) and not value.strip():
      number = math.nan
    else:
      try:
        number = float(value)
      except (TypeError, ValueError):
        text.append(row)
        continue
    if not math.isfinite(number):
      missing.append(row)
  more = lambda rows: (f' ({len(rows):,} such cells)' if len(rows) > 1
                       else '')
  if text:
    row = text[0]
    if role == 'target':
      return None, (
          f'the target {name!r} is not numeric ({where(row)} holds '
          f"{values[row]!r}{more(text)}): task='regression' needs a number "
          "on every row; for class labels use task='classification'")
    return None, (f'{where(row)}, column {name!r}: {values[row]!r} is not a '
                  f'number{more(text)} (encode categorical columns first, or '
                  'leave them out of features)')
  row = missing[0]
  return None, (f"{where(row)}, {'column' if role == 'feature' else role} "
                f'{name!r}: {values[row]!r} is missing '
                f'or not finite{more(missing)} (clean, impute or drop those '
                'rows first)')


def _names(values: Union[str, Sequence[str]], what: str,
           allow_empty: bool = False) -> list[str]:
  if isinstance(values, str):
    values = [values]
  values = [str(v) for v in values]
  if not values and not allow_empty:
    raise ValueError(f'{what} is empty: name the feature columns')
  duplicated = sorted({v for v in values if values.count(v) > 1})
  if duplicated:
    raise ValueError(f'{what} names {duplicated} more than once')
  return values


def _labels(values: np.ndarray, name: str, where: Callable[[int], str],
            positive_class: Any = None
            ) -> tuple[Optional[np.ndarray], Optional[tuple[Any, ...]],
                       Optional[str]]:
  """`(class indices int32, label of each index or None, None)`, or
  `(None, None, what is wrong)`. Integer labels are kept as they are
  (classes None) unless `positive_class` re-encodes two of them."""
  values = np.asarray(values)
  try:
    numbers = values.astype(np.float64)
  except (TypeError, ValueError):
    numbers = None
  if numbers is not None:
    bad = np.flatnonzero(~np.isfinite(numbers) | (numbers != np.round(
        numbers)) | (numbers < 0))
    if bad.size:
      return None, None, (
          f"{where(int(bad[0]))}, column {name!r}: {values[bad[0]]!r} is not "
          "a class label (classification takes integer labels >= 0 or "
          "strings; use task='regression' for a numeric target)")
    labels = numbers.astype(np.int64)
    if positive_class is None:
      return labels.astype(np.int32), None, None
    classes = tuple(int(v) for v in np.unique(labels))
    try:
      positive = int(positive_class)
    except (TypeError, ValueError):
      positive = positive_class
  else:
    labels = np.array([str(v).strip() for v in values], dtype=object)
    empty = np.flatnonzero(labels == '')
    if empty.size:
      return None, None, (f'{where(int(empty[0]))}, column {name!r}: the '
                          'label is missing')
    classes = tuple(sorted(set(labels.tolist())))
    positive = None if positive_class is None else str(positive_class).strip()
  if positive is not None:
    if len(classes) != 2:
      return None, None, (
          f'positive_class= picks which of TWO classes is y = 1; the target '
          f'{name!r} has {len(classes)}: {list(classes)}')
    if positive not in classes:
      return None, None, (f'positive_class={positive_class!r} is not a class '
                          f'of the target {name!r}: its classes are '
                          f'{list(classes)}')
    classes = tuple(c for c in classes if c != positive) + (positive,)
  index = {label: k for k, label in enumerate(classes)}
  return (np.array([index[t] for t in labels.tolist()], dtype=np.int32),
          classes, None)


def _clipped_counts(x: np.ndarray, lower: np.ndarray, upper: np.ndarray,
                    names: Sequence[str]) -> list[str]:
  """Per column with values outside `[lower, upper]`: how many, in words."""
  below, above = np.sum(x < lower, axis=0), np.sum(x > upper, axis=0)
  n = x.shape[0]
  lines = []
  for name, low, high, down, up in zip(names, lower, upper, below, above):
    if down or up:
      parts = [f'{int(down):,} below {low:g}'] if down else []
      parts += [f'{int(up):,} above {high:g}'] if up else []
      lines.append(f'{name!r}: {int(down + up):,} of {n:,} rows '
                   f'({", ".join(parts)})')
  return lines


def _say(line: str) -> None:
  """A line on stderr (silenced like progress: `DPSCO_JAX_PROGRESS=0`)."""
  if progress.enabled():
    print(f'dpsco_jax.data: {line}', file=sys.stderr)


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


def _refuse(problems: Sequence[str]) -> None:
  """One error listing every problem (so one run finds them all)."""
  if not problems:
    return
  items = '\n'.join(f'  - {problem}' for problem in problems)
  raise ValueError(f'load_table found {len(problems)} problem(s) with the '
                   f'columns; fix them all, then load again:\n{items}')


def _table_arguments(features, target, task: str, *, allow_predictive,
                     positive_class, target_bound, test_fraction
                     ) -> tuple[list, list]:
  """`load_table`'s arguments checked: `(features, allowed predictive)`."""
  if task not in TASKS:
    raise ValueError(f'task must be one of {TASKS}, got {task!r}')
  if not isinstance(target, str) or not target:
    raise ValueError(f'target must be a column name, got {target!r}')
  features = _names(features, 'features')
  if target in features:
    raise ValueError(
        f'the target {target!r} is among the features: a model would read the '
        'answer from its input; take it out of features')
  allowed = _names(allow_predictive, 'allow_predictive', allow_empty=True)
  strangers = [c for c in allowed if c not in features]
  if strangers:
    raise ValueError(f'allow_predictive names {strangers}, which are not '
                     f'among the features {features}')
  if task == 'classification' and target_bound is not None:
    raise ValueError('target_bound scales a regression target; task is '
                     "'classification'")
  if task == 'regression' and positive_class is not None:
    raise ValueError("positive_class= picks a class; task is 'regression'")
  if target_bound is not None and not float(target_bound) > 0.0:
    raise ValueError(f'target_bound must be > 0, got {target_bound!r}')
  if not 0.0 <= float(test_fraction) < 1.0:
    raise ValueError(f'test_fraction must be in [0, 1), got {test_fraction!r}')
  return features, allowed


def _feature_numbers(features, column, where) -> tuple[list, dict]:
  """Each feature's numbers, or the problem with it (an identifier-like
  column, a cell that is not a number): `(problems, parsed)`."""
  problems, parsed = [], {}
  for name in features:
    reason = identifier_reason(name, column(name))
    if reason:
      problems.append(
          f'feature {name!r} looks like a row identifier ({reason}): a model '
          'can memorize identifiers and they say nothing about new rows; '
          'leave it out of features')
      continue
    numbers, problem = _numbers(column(name), name, where)
    if problem:
      problems.append(problem)
    else:
      parsed[name] = numbers
  return problems, parsed


def _leaks(parsed: dict, allowed, y: np.ndarray, train_rows: np.ndarray,
           target: str, task: str, classes) -> list[str]:
  """The features that predict the target on the training rows, unless
  `allow_predictive` confirms them: one problem per leak."""
  problems = []
  checked = [c for c in parsed if c not in allowed]
  if checked:
    found = predictive_columns(
        np.stack([parsed[c][train_rows] for c in checked], axis=1),
        y[train_rows], checked, task, classes=classes)
    for leak in found:
      alone = len(leak.columns) == 1
      listed = ', '.join(map(repr, leak.columns))
      problems.append(
          f"feature{'' if alone else 's'} {listed} predict"
          f"{'s' if alone else ''} the target {target!r} "
          f"{'alone' if alone else 'together'}: {leak.evidence}. A column "
          'recorded from the target (or at the same time) leaks it: leave '
          f"{'it' if alone else 'them'} out of features, or, if known "
          'before the target is, confirm with allow_predictive='
          f'{tuple(leak.columns)!r}')
  return problems


def _warn_clipped(clipped: list[str]) -> None:
  """Warns of the values the public bounds clipped, with counts per column."""
  if clipped:
    warnings.warn(
        'the public bounds clipped values (each is trained on at the bound): '
        + '; '.join(clipped) + '. If the bounds are wrong, set public ones '
        'that cover the range (not read off the data: that would release '
        'it outside the accounting).', ClippedValuesWarning,
        stacklevel=3)


def load_table(
    source: Any,
    *,
    features: Sequence[str],
    target: str,
    task: str,
    positive_class: Any = None,
    allow_predictive: Sequence[str] = (),
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

  Every refused column is listed in ONE error: identifiers, cells that are
  not numbers, missing values, and features that predict the target almost
  perfectly on the training rows (`predictive_columns`: alone, or a few
  indicator columns together, such as failure-type flags whose max is the
  "failure" target). That detection is a heuristic with stated thresholds
  (99% of the training rows and 95% of each class's rows; 98% of a
  regression target's variance): it cannot catch every leak, and a
  flagged column known before the target is can be confirmed with
  `allow_predictive=`.

  Example:
    >>> table = load_table(
    ...     'tests/data/machines.csv', task='classification',
    ...     target='failure', positive_class='yes',
    ...     features=['torque_nm', 'tool_wear_min'],
    ...     scaling='dp', lower=[0, 0], upper=[80, 250], epsilon=0.2,
    ...     delta=1e-6, key=jax.random.key(7))
    >>> table.classes, table.positive_class       # ('no', 'yes') 'yes'
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
    positive_class: classification with two classes: the label that
      becomes y = 1 (the other y = 0). Default: string labels in sorted
      order (with 'fail'/'ok', y = 1 is 'ok'), integer labels as they are.
      The encoding is printed on stderr and kept in `table.classes`.
    allow_predictive: feature columns you confirm although they predict
      the target almost perfectly (known before the target is, not
      recorded from it); they are not checked.
    scaling: 'public' (default: `lower`/`upper` mapped to [-1, 1], nothing
      spent), 'dp' (a noisy mean and variance of the training rows, clipped
      to `lower`/`upper`; its release is `table.releases`) or 'none'.
    lower: `[d]` public lower bounds of the features ('public', 'dp').
    upper: `[d]` public upper bounds. Values outside the bounds are
      clipped to them, with a `ClippedValuesWarning` counting them per
      column.
    epsilon: the DP scaling's own epsilon ('dp'; or `noise_multiplier`).
    delta: the DP scaling's delta (with `epsilon`).
    noise_multiplier: the DP scaling's noise (instead of `epsilon`).
    key: the DP scaling's noise key (None: fresh from OS entropy; not the
      run's key).
    method: accounting method of the DP scaling's calibration.
    neighboring_relation: the run's relation ('dp': the plan refuses a
      release made for another; e.g. 'zero_out' for fixed-order plans).
    target_bound: regression only: a public bound B of `|y|`; the target is
      clipped to [-B, B] (counted in the warning) and divided by B. None
      keeps it as it is.
    test_fraction: the share of rows held out, in [0, 1) (0: no test rows).
    seed: the split's seed.

  Returns:
    A `Table`.

  Raises:
    TypeError: if `source` is neither a path nor a DataFrame.
    FileNotFoundError: if the CSV file does not exist.
    ValueError: for a missing column or the target among the features; one
      error listing every identifier-like feature, cell that is not a
      number or not a class label (with its row and column), predictive
      feature (with the evidence) and bad `positive_class`; bad bounds or
      scaling arguments, an unknown task, or a bad `test_fraction` or
      `target_bound`.

  Warns:
    ClippedValuesWarning: when public bounds (or `target_bound`) clip
      values, with the count per column.
  """
  features, allowed = _table_arguments(
      features, target, task, allow_predictive=allow_predictive,
      positive_class=positive_class, target_bound=target_bound,
      test_fraction=test_fraction)
  names, column, where, label = _columns(source)
  missing = [c for c in [*features, target] if c not in names]
  if missing:
    raise ValueError(f'{label} has no column(s) {missing}; its columns are '
                     f'{names}')
  problems, parsed = _feature_numbers(features, column, where)
  if task == 'classification':
    y, classes, problem = _labels(column(target), target, where,
                                  positive_class)
  else:
    (y, problem), classes = _numbers(column(target), target, where,
                                     role='target'), None
  rows = len(column(target))
  order = np.random.default_rng(seed).permutation(rows)
  num_test = int(round(float(test_fraction) * rows))
  test_rows, train_rows = order[:num_test], order[num_test:]
  if train_rows.size == 0:
    raise ValueError(f'{label} has no training rows left')
  if problem:
    problems.append(problem)
  else:
    problems += _leaks(parsed, allowed, y, train_rows, target, task, classes)
  _refuse(problems)
  x = np.stack([parsed[c] for c in features], axis=1)
  if classes is not None:
    _say(f'target {target!r}: ' + ', '.join(
        f'y = {k} is {c!r}' for k, c in enumerate(classes)) + (
            '' if positive_class is not None or len(classes) != 2 else
            ' (sorted order; positive_class= picks the class of y = 1)'))
  clipped = []
  if task == 'regression':
    if target_bound is not None:
      bound = float(target_bound)
      clipped += _clipped_counts(y[:, None], np.array([-bound]),
                                 np.array([bound]), [f'target {target}'])
      y = np.clip(y, -bound, bound) / bound
    y = y.astype(np.float32)
  standardization = _scaling(
      scaling, x[train_rows], lower, upper, epsilon=epsilon, delta=delta,
      noise_multiplier=noise_multiplier, key=key, method=method,
      neighboring_relation=neighboring_relation)
  if standardization is not None:
    clipped = _clipped_counts(x, standardization.lower, standardization.upper,
                              features) + clipped
  _warn_clipped(clipped)
  scaled = (x.astype(np.float32) if standardization is None else
            standardization.apply(x))
  split = lambda rows: {'x': scaled[rows], 'y': y[rows]}
  return Table(train=split(train_rows),
               test=split(test_rows) if num_test else None,
               features=tuple(features), target=target, task=task,
               classes=classes, standardization=standardization,
               target_bound=None if target_bound is None else float(
                   target_bound))


__all__ = ('MAX_COMBINED', 'PREDICTIVE_AGREEMENT', 'PREDICTIVE_BALANCED',
           'PREDICTIVE_EXPLAINED', 'SCALINGS', 'TASKS', 'ClippedValuesWarning',
           'Predictive', 'Table', 'identifier_reason', 'load_table',
           'predictive_columns', 'read_csv')
