"""Tabular regression data of the DIFF2 experiments (paper 003, §6, App. A).

Loaders take any path, so users point them at their own copies:

* `load_california_housing(path)`: the StatLib `housing.csv` (20,640 block
  groups), turned into scikit-learn's 8 attributes (MedInc, HouseAge,
  AveRooms, AveBedrms, Population, AveOccup, Latitude, Longitude), target
  median_house_value / 100000;
* `load_gas_turbine(path)`: the UCI Gas Turbine CO and NOx Emission data
  (`gt_2011.csv` ... `gt_2015.csv`, 36,733 rows), 9 attributes, target CO
  (NOX is dropped, as in the paper);
* `synthetic_regression(...)`: a planted low-dimensional nonlinear
  regression with N >> d, the regime where DIFF2's bound beats DP-GD's.

`load_csv(path, target)` reads a numeric CSV with every other column as a
feature (the experiments' files; for your own data use the installed
`dpsco_jax.data.load_table`, which takes explicit features and refuses
identifiers and the target among them). Files are read by
`dpsco_jax.data.read_csv`. `prepare(x, y,
seed)` splits 80/20 at random, then standardizes every attribute and
divides the target by its largest absolute value with statistics of the
TRAINING rows only (not privatized, as in the paper: a release outside the
run's epsilon), or scales by public bounds (`bounds=`, nothing computed from
the data); for a private mean and variance whose epsilon the run's plan
spends, see `dpsco_jax.preprocessing.dp_standardization`. `split_clients` deals the
training rows into P IID clients of (nearly) equal size, padded to a common
size with a mask.
"""

import glob
import os
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from dpsco_jax import data

Split = Dict[str, np.ndarray]

_CALIFORNIA_HELP = (
    'California Housing: expected the StatLib CSV `housing.csv` (columns '
    'longitude, latitude, housing_median_age, total_rooms, total_bedrooms, '
    'population, households, median_income, median_house_value, '
    'ocean_proximity). Get it from https://github.com/ageron/handson-ml2 '
    '(datasets/housing/housing.tgz) or any StatLib mirror, and pass its path '
    '(or its folder).')
_GAS_HELP = (
    'Gas Turbine CO and NOx Emission: expected the UCI files gt_2011.csv ... '
    'gt_2015.csv (columns AT, AP, AH, AFDP, GTEP, TIT, TAT, TEY, CDP, CO, '
    'NOX) in one folder. Download them from '
    'https://archive.ics.uci.edu/dataset/551 and pass the folder.')


class ClientData(NamedTuple):
  """Training rows dealt to P clients, padded to a common size.

  Attributes:
    x: float32 `[P, n_max, d]`.
    y: float32 `[P, n_max]`.
    mask: bool `[P, n_max]`, True for real rows.
    sizes: int `[P]`, real rows per client.
  """

  x: np.ndarray
  y: np.ndarray
  mask: np.ndarray
  sizes: np.ndarray


def load_california_housing(path: str) -> Tuple[np.ndarray, np.ndarray]:
  """scikit-learn's 8 California Housing attributes from the StatLib CSV.

  The 207 missing `total_bedrooms` are imputed as `total_rooms` times the
  median bedrooms-per-room ratio of the other rows (scikit-learn's copy,
  derived from the original census file, has no missing values).

  Example:
    >>> x, y = load_california_housing('../shared/data/california_housing')
    >>> x.shape                                   # (20640, 8)

  Args:
    path: `housing.csv` or the folder holding it.

  Returns:
    `(x float64 [20640, 8], y float64 [20640])`, y in units of $100,000.

  Raises:
    FileNotFoundError: with instructions, if the file is missing.
    ValueError: if the columns are not the expected ones.
  """
  if os.path.isdir(path):
    path = os.path.join(path, 'housing.csv')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path} not found. {_CALIFORNIA_HELP}')
  header, cells = data.read_csv(path)
  needed = ('longitude', 'latitude', 'housing_median_age', 'total_rooms',
            'total_bedrooms', 'population', 'households', 'median_income',
            'median_house_value')
  missing = [c for c in needed if c not in header]
  if missing:
    raise ValueError(f'{path} lacks columns {missing}. {_CALIFORNIA_HELP}')
  column = {c: np.array([float(v) if v != '' else np.nan
                         for v in cells[:, header.index(c)]]) for c in needed}
  rooms, bedrooms = column['total_rooms'], column['total_bedrooms']
  ratio = np.nanmedian(bedrooms / rooms)
  bedrooms = np.where(np.isnan(bedrooms), rooms * ratio, bedrooms)
  households = column['households']
  x = np.stack([column['median_income'], column['housing_median_age'],
                rooms / households, bedrooms / households,
                column['population'], column['population'] / households,
                column['latitude'], column['longitude']], axis=1)
  return x, column['median_house_value'] / 1e5


def load_gas_turbine(path: str) -> Tuple[np.ndarray, np.ndarray]:
  """Gas Turbine CO emission: 9 attributes, target CO (NOX dropped).

  Example:
    >>> x, y = load_gas_turbine('../shared/data/gas_turbine')
    >>> x.shape                                   # (36733, 9)

  Args:
    path: the folder holding `gt_*.csv` (or one such file).

  Returns:
    `(x float64 [n, 9], y float64 [n])`.

  Raises:
    FileNotFoundError: with instructions, if no file is found.
    ValueError: if the columns are not the expected ones.
  """
  files = (sorted(glob.glob(os.path.join(path, 'gt_*.csv')))
           if os.path.isdir(path) else [path] if os.path.isfile(path) else [])
  if not files:
    raise FileNotFoundError(f'no gt_*.csv under {path}. {_GAS_HELP}')
  features = ('AT', 'AP', 'AH', 'AFDP', 'GTEP', 'TIT', 'TAT', 'TEY', 'CDP')
  xs, ys = [], []
  for name in files:
    header, cells = data.read_csv(name)
    if any(c not in header for c in features + ('CO',)):
      raise ValueError(f'{name} lacks the expected columns. {_GAS_HELP}')
    xs.append(np.stack([cells[:, header.index(c)].astype(float)
                        for c in features], axis=1))
    ys.append(cells[:, header.index('CO')].astype(float))
  return np.concatenate(xs), np.concatenate(ys)


def synthetic_regression(num_examples: int = 20000, dim: int = 4,
                         noise: float = 0.1,
                         seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
  """A planted nonlinear regression in low dimension (N >> d).

  `y = tanh(x . w) + 0.5 sin(x . u) + noise * N(0, 1)` with Gaussian x.

  Example:
    >>> x, y = synthetic_regression(20000, 4)

  Args:
    num_examples: N.
    dim: d.
    noise: label noise std.
    seed: the data seed (fixed across runs: one data set).

  Returns:
    `(x [N, d], y [N])`.
  """
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_examples, dim))
  w, u = rng.normal(size=dim), rng.normal(size=dim)
  y = np.tanh(x @ w) + 0.5 * np.sin(x @ u) + noise * rng.normal(
      size=num_examples)
  return x, y


def prepare(x: np.ndarray, y: np.ndarray, seed: int,
            test_fraction: float = 0.2, *,
            bounds: Optional[Tuple[np.ndarray, np.ndarray]] = None,
            target_bound: Optional[float] = None) -> Tuple[Split, Split]:
  """The paper's preprocessing and a seeded random train/test split.

  The split comes first, so nothing of the test rows reaches the training
  data. Scaling, either:

  * default (the paper's protocol): standardize every attribute with the
    mean and standard deviation of the TRAINING rows, divide the target by
    the training rows' largest absolute value. These statistics are not
    privatized (as in the paper): the run's epsilon does not cover them;
  * `bounds=(low, high)` and `target_bound`: public bounds, known before
    seeing the data (e.g. a sensor's range): attributes are mapped to
    [-1, 1] and the target divided by `target_bound`, values outside the
    bounds clipped. Nothing is computed from the data: the run's epsilon
    covers everything.

  Example:
    >>> train, test = prepare(*load_gas_turbine(path), seed=0)
    >>> train, test = prepare(x, y, seed=0, bounds=(low, high),
    ...                       target_bound=100.0)   # private end to end

  Args:
    x: attributes `[n, d]`.
    y: targets `[n]`.
    seed: the split seed.
    test_fraction: held-out fraction (the paper's 0.2).
    bounds: public per-attribute `(low, high)`, each `[d]`, or None.
    target_bound: public bound of `|y|` (required with `bounds`).

  Returns:
    `(train, test)`, dicts with float32 `'x' [n, d]` and `'y' [n]`.

  Raises:
    ValueError: for a bad fraction, a constant training attribute, or bad
      bounds.
  """
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f'test_fraction must be in (0, 1), got {test_fraction}')
  order = np.random.default_rng(seed).permutation(len(y))
  num_test = int(round(test_fraction * len(y)))
  test, train = order[:num_test], order[num_test:]
  if bounds is None:
    std = x[train].std(axis=0)
    if np.any(std == 0):
      raise ValueError('an attribute is constant on the training rows: it '
                       'cannot be standardized')
    x = (x - x[train].mean(axis=0)) / std
    y = y / np.max(np.abs(y[train]))
  else:
    low, high = (np.broadcast_to(np.asarray(b, np.float64), x.shape[1:])
                 for b in bounds)
    if not np.all(high > low) or target_bound is None or not (
        target_bound > 0):
      raise ValueError('bounds need high > low for every attribute and a '
                       'positive target_bound')
    x = 2.0 * (np.clip(x, low, high) - low) / (high - low) - 1.0
    y = np.clip(y, -target_bound, target_bound) / target_bound
  as_split = lambda rows: {'x': x[rows].astype(np.float32),
                           'y': y[rows].astype(np.float32)}
  return as_split(train), as_split(test)


def load_csv(path: str, target: str,
             features: Optional[Sequence[str]] = None
             ) -> Tuple[np.ndarray, np.ndarray]:
  """Numeric attributes and a target from a CSV file with a header row.

  For the experiments' numeric files; a user's own table goes through
  `dpsco_jax.data.load_table` (explicit features, class labels kept,
  private scaling). Ready for `prepare` and a plan:

      x, y = load_csv('my_data.csv', target='price')
      train, test = prepare(x, y, seed=0)
      plan = dpsco_jax.plans.dpsgd(loss_fn, num_examples=len(train['y']),
                                   ...)

  Example:
    >>> x, y = load_csv('housing.csv', target='median_house_value',
    ...                 features=['median_income', 'housing_median_age'])

  Args:
    path: the CSV file.
    target: the target column's name.
    features: the attribute columns (default: every other column).

  Returns:
    `(x float64 [n, d], y float64 [n])`.

  Raises:
    ValueError: for a missing column, or a cell that is not a number (with
      its row and column).
  """
  header, cells = data.read_csv(path)
  features = [c for c in header if c != target] if features is None else list(
      features)
  missing = [c for c in [target, *features] if c not in header]
  if missing:
    raise ValueError(f'{path} has no column(s) {missing}; its columns are '
                     f'{header}')

  def column(name):
    values = cells[:, header.index(name)]
    try:
      return values.astype(np.float64)
    except ValueError:
      for row, value in enumerate(values):
        try:
          float(value)
        except ValueError:
          raise ValueError(
              f'{path}, row {row + 2}, column {name!r}: {value!r} is not a '
              'number (encode categorical columns first, or leave them out '
              'of features)') from None
      raise

  x = np.stack([column(c) for c in features], axis=1)
  return x, column(target)


def split_clients(train: Split, num_clients: int, seed: int) -> ClientData:
  """Deals the training rows at random into P IID clients (sizes differ <= 1).

  Example:
    >>> clients = split_clients(train, 10, seed=0)
    >>> clients.x.shape, clients.sizes            # [10, n_max, d], sizes

  Args:
    train: the training split.
    num_clients: P.
    seed: the dealing seed.

  Returns:
    A `ClientData` (padding rows are zeros, masked out).

  Raises:
    ValueError: if there are fewer rows than clients.
  """
  n = len(train['y'])
  if not 1 <= num_clients <= n:
    raise ValueError(f'need 1 <= num_clients <= {n}, got {num_clients}')
  parts = np.array_split(np.random.default_rng(seed).permutation(n),
                         num_clients)
  width = max(len(p) for p in parts)
  x = np.zeros((num_clients, width) + train['x'].shape[1:], np.float32)
  y = np.zeros((num_clients, width), np.float32)
  mask = np.zeros((num_clients, width), bool)
  for p, rows in enumerate(parts):
    x[p, :len(rows)], y[p, :len(rows)] = train['x'][rows], train['y'][rows]
    mask[p, :len(rows)] = True
  return ClientData(x, y, mask, np.array([len(p) for p in parts]))
