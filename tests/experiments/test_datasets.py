"""Tests of `experiments.datasets`."""

import numpy as np
import pytest

from experiments import datasets


def test_digits_shapes_and_dtypes():
  train, test = datasets.load_digits()
  assert train['x'].shape == (1437, 64) and test['x'].shape == (360, 64)
  assert train['y'].shape == (1437,) and test['y'].shape == (360,)
  for split in (train, test):
    assert split['x'].dtype == np.float32
    assert split['y'].dtype == np.int32


def test_digits_pixels_scaled_to_unit_interval():
  train, test = datasets.load_digits()
  pixels = np.concatenate([train['x'], test['x']])
  assert pixels.min() == 0.0 and pixels.max() == 1.0
  # Scaled by the maximum intensity 16, not per image: 1/16 steps remain.
  np.testing.assert_array_equal(pixels * 16, np.round(pixels * 16))


def test_digits_split_is_stratified():
  train, test = datasets.load_digits()
  train_counts = np.bincount(train['y'], minlength=10)
  test_counts = np.bincount(test['y'], minlength=10)
  np.testing.assert_allclose(test_counts / (train_counts + test_counts), 0.2,
                             atol=0.02)


def test_digits_split_is_deterministic_and_seeded():
  first_train, first_test = datasets.load_digits(seed=0)
  again_train, again_test = datasets.load_digits(seed=0)
  np.testing.assert_array_equal(first_train['x'], again_train['x'])
  np.testing.assert_array_equal(first_test['y'], again_test['y'])
  other_train, _ = datasets.load_digits(seed=1)
  assert not np.array_equal(first_train['x'], other_train['x'])


def _rows(split):
  """Each example (pixels and label) as bytes, to compare splits as sets."""
  return {x.tobytes() + y.tobytes() for x, y in zip(split['x'], split['y'])}


def test_digits_split_is_disjoint_and_complete():
  # The 1,797 digits are pairwise distinct, so set sizes count examples.
  train, test = datasets.load_digits(test_fraction=0.25)
  train_rows, test_rows = _rows(train), _rows(test)
  assert len(train_rows) == len(train['y']) and len(test_rows) == len(test['y'])
  assert not train_rows & test_rows
  assert len(train_rows | test_rows) == 1797


@pytest.mark.parametrize('test_fraction', [0.0, 1.0, -0.1])
def test_digits_rejects_bad_fraction(test_fraction):
  with pytest.raises(ValueError, match='test_fraction'):
    datasets.load_digits(test_fraction=test_fraction)
