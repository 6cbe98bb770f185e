"""The shared estimator: key handling and the one place noise meets data."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import noise


def test_as_key_accepts_seeds_and_keys_and_refuses_the_rest():
  typed = estimators.as_key(3)
  np.testing.assert_array_equal(jax.random.key_data(typed),
                                jax.random.key_data(jax.random.key(3)))
  raw = jax.random.PRNGKey(3)
  assert estimators.as_key(raw) is raw
  with pytest.raises(ValueError, match='key'):
    estimators.as_key(None)
  with pytest.raises(ValueError, match='key'):
    estimators.as_key(jnp.zeros((2,), jnp.float32))


def test_privatize_sum_adds_scaled_noise_to_the_sum_then_divides():
  template = {'a': jnp.zeros((3,)), 'b': jnp.zeros((2, 2))}
  clipped = clipping.ClippedSum(
      sum={'a': jnp.arange(3.0), 'b': jnp.ones((2, 2))},
      count=jnp.int32(5), num_nonfinite=jnp.int32(0),
      num_clipped=jnp.int32(0))
  ones = lambda key, shape, dtype: jnp.ones(shape, dtype)
  mechanism = noise.tree(4, release='prefix', sampler=ones)
  state = mechanism.init(template, jax.random.key(0))
  outputs = []
  for _ in range(3):
    private, state = estimators.privatize_sum(clipped, state, mechanism, 2.0,
                                              normalize_by=4.0)
    outputs.append(private['a'])
  # Prefix noise with unit nodes is popcount(t + 1): 1, 1, 2.
  for t, count in enumerate([1, 1, 2]):
    np.testing.assert_allclose(outputs[t], (jnp.arange(3.0) + 2.0 * count) / 4)


def test_validate_noise_multiplier():
  assert estimators.validate_noise_multiplier(0) == 0.0
  for bad in (-1e-9, float('inf'), float('nan')):
    with pytest.raises(ValueError, match='noise_multiplier'):
      estimators.validate_noise_multiplier(bad)
