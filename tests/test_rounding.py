"""The certified bounds of `dpsco_jax.rounding` hold against exact arithmetic."""

import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import rounding

# Rounding and precision of the code users' devices run: every XLA
# optimization, not the suite's level 0 (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized


@pytest.mark.parametrize('size', [1, 7, 100, 4099])
def test_blocked_sum_of_squares_raised_is_an_upper_bound(size):
  rng = np.random.default_rng(size)
  # Terms over many magnitudes: the rounding of their sum is not trivial.
  x = (rng.normal(size=(200, size)) *
       10.0 ** rng.uniform(-3, 3, size=(200, size))).astype(np.float32)
  exact = np.sum(x.astype(np.float64) ** 2, axis=1)
  computed = rounding.blocked_sum_of_squares(jnp.asarray(x))
  bound = np.asarray(rounding.upper_bound(
      computed, rounding.squared_norm_roundings([size]), size, jnp.float32),
                     np.float64)
  assert np.all(bound >= exact)
  # ... and not by much: the margin is 2 (N + 3) u, N about 2 sqrt(size).
  margin = 2 * (rounding.squared_norm_roundings([size]) + 3) * 2.0 ** -24
  assert np.all(bound <= exact * (1 + 2 * margin) + 1e-30)
  np.testing.assert_allclose(computed, exact, rtol=1e-5)


def test_roundings_grow_like_the_square_root():
  assert rounding.sum_roundings(1) == 0
  assert rounding.sum_roundings(100) == 18          # 10 + 10 - 2
  assert rounding.sum_roundings(10 ** 6) == 1998    # 1000 + 1000 - 2
  assert rounding.squared_norm_roundings([100, 100, 3], extra=2) == 1 + 18 + 2 + 2


def test_square_below_never_rounds_up():
  rng = np.random.default_rng(0)
  for radius in np.concatenate([rng.uniform(1e-6, 1e6, 2000), [0.1, 2.0]]):
    value = float(rounding.square_below(float(radius), jnp.float32))
    assert value <= float(radius) ** 2
    assert value >= float(radius) ** 2 * (1 - 2 ** -22)


def test_pairwise_sum_matches_and_refuses_meaningless_bounds():
  x = jnp.arange(1.0, 12.0)
  assert float(rounding.pairwise_sum(x)) == 66.0
  with pytest.raises(ValueError, match='no usable error bound'):
    rounding.upper_bound(jnp.float32(1.0), 2 ** 23, 1, jnp.float32)
