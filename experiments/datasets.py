"""Data sets for the experiments, as dicts of host-side NumPy arrays.

Every loader returns `(train, test)`, each a dict `{'x': float32 [n, d],
'y': int32 [n]}`, so a batch is `{'x': x[indices], 'y': y[indices]}` and the
per-example loss sees one `{'x': [d], 'y': []}` example.
"""

from typing import Dict, Tuple

import numpy as np
from sklearn import datasets as sk_datasets
from sklearn import model_selection

Split = Dict[str, np.ndarray]

# Digits pixels are integer intensities in 0..16 (sklearn's 8x8 downsampling).
_DIGITS_MAX_PIXEL = 16.0


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float,
           seed: int) -> Tuple[Split, Split]:
  """A stratified, seeded train/test split, so every class is in both."""
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f'test_fraction must be in (0, 1), got {test_fraction!r}')
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, y, test_size=test_fraction, stratify=y, random_state=seed)
  return {'x': x_train, 'y': y_train}, {'x': x_test, 'y': y_test}


def load_digits(test_fraction: float = 0.2,
                seed: int = 0) -> Tuple[Split, Split]:
  """scikit-learn's bundled 8x8 digits (1,797 images, 10 classes), no network.

  Example:
    >>> train, test = load_digits()
    >>> train['x'].shape, test['x'].shape   # ((1437, 64), (360, 64))

  Args:
    test_fraction: fraction of the examples held out for testing.
    seed: seed of the (stratified) split; the same seed gives the same split.

  Returns:
    `(train, test)`: dicts with `'x'` float32 `[n, 64]` scaled to [0, 1] and
    `'y'` int32 `[n]` labels in 0..9.
  """
  digits = sk_datasets.load_digits()
  x = (digits.data / _DIGITS_MAX_PIXEL).astype(np.float32)
  y = digits.target.astype(np.int32)
  return _split(x, y, test_fraction, seed)
