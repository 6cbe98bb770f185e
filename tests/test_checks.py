"""Shared argument checks."""

import pytest

from dpsco_jax import checks


@pytest.mark.parametrize('value', [1, 7, 3.0])
def test_positive_int_accepts(value):
  assert checks.positive_int(value, 'n') == int(value)


@pytest.mark.parametrize('value', [0, -2, 2.5, True, None, 'three', float('nan')])
def test_positive_int_refuses(value):
  with pytest.raises(ValueError, match='n must be a positive integer'):
    checks.positive_int(value, 'n')


@pytest.mark.parametrize('value', [0, 0.0, 1.5, 1e6])
def test_noise_multiplier_accepts(value):
  assert checks.noise_multiplier(value) == float(value)


@pytest.mark.parametrize('value', [-1.0, -1e-12, float('nan'), float('inf'),
                                   float('-inf'), None, 'one'])
def test_noise_multiplier_refuses(value):
  with pytest.raises(ValueError, match='z must be a non-negative finite'):
    checks.noise_multiplier(value, 'z')
