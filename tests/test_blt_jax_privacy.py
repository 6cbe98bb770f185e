"""Our BLT numbers equal jax_privacy's (the anchor) for the same parameters.

jax_privacy 2.0's `matrix_factorization` defines, for a BLT C and its
inverse: the single-participation sensitivity (closed form and from the
Toeplitz coefficients), the min-separation sensitivity (the worst pattern
0, b, 2b, ...), the per-step errors of `B = A C^-1`, the max-loss and the
mean-loss (error times sensitivity squared), and the streaming product
`C^-1 z`. Each is compared with ours, in float64, for a few parameter sets,
numbers of steps T and participations (k, b). Skipped where jax_privacy is
not installed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import blt
from dpsco_jax import noise

jax_privacy = pytest.importorskip('jax_privacy')
# pylint: disable=g-import-not-at-top,wrong-import-position
from jax_privacy.matrix_factorization import buffered_toeplitz
from jax_privacy.matrix_factorization import sensitivity as jp_sensitivity
from jax_privacy.matrix_factorization import streaming_matrix
from jax_privacy.matrix_factorization import toeplitz
# pylint: enable=g-import-not-at-top,wrong-import-position

PARAMETER_SETS = (
    ([0.95, 0.6, 0.2], [0.25, 0.3, 0.15]),
    ([0.999, 0.3], [0.05, 0.9]),
    ([0.99, 0.9, 0.5, 0.1], [0.02, 0.1, 0.2, 0.3]),
)
# (parameter set, T, k, b): single participation, k below and above
# ceil(T / b).
CASES = ((0, 64, 1, None), (1, 100, 3, 20), (2, 1000, 10, 100),
         (0, 50, 10, 20))
RTOL = 1e-9


def _theirs(decays, scales):
  return buffered_toeplitz.BufferedToeplitz.build(decays, scales,
                                                  dtype=jnp.float64)


@pytest.fixture(autouse=True)
def float64():
  with jax.enable_x64(True):
    yield


@pytest.mark.parametrize('index,steps,k,b', CASES)
def test_sensitivity_error_and_loss_equal_jax_privacy(index, steps, k, b):
  decays, scales = PARAMETER_SETS[index]
  ours, theirs = blt.parameters(decays, scales), _theirs(decays, scales)
  coefs = theirs.toeplitz_coefs(steps)
  np.testing.assert_allclose(blt.coefficients(ours, steps), coefs, rtol=RTOL)
  # Sensitivity: single participation (their closed form and their
  # coefficient sum), min-separation (their O(T) worst pattern).
  single = blt.sensitivity(ours, steps) ** 2
  assert single == pytest.approx(
      float(buffered_toeplitz.sensitivity_squared(theirs, steps)), rel=RTOL)
  assert single == pytest.approx(float(toeplitz.sensitivity_squared(coefs)),
                                 rel=RTOL)
  if k == 1:
    squared = single
  else:
    squared = blt.sensitivity(ours, steps, k, b) ** 2
    assert squared == pytest.approx(float(toeplitz.minsep_sensitivity_squared(
        coefs, min_sep=b, max_participations=k)), rel=RTOL)
  # Per-step errors of B = A C^-1 from their inverse BLT; max and mean.
  column = blt.toeplitz_workload_column(steps)
  per_step = toeplitz.per_query_error(
      noising_coef=theirs.inverse().toeplitz_coefs(steps))
  np.testing.assert_allclose(blt.per_step_errors(ours, column), per_step,
                             rtol=RTOL)
  assert blt.per_step_errors(ours, column)[-1] == pytest.approx(
      float(buffered_toeplitz.max_error(theirs.inverse(), steps)), rel=RTOL)
  # The losses: theirs is error x sensitivity^2 (LossFn under min-sep).
  for error in ('max', 'mean'):
    loss_fn = buffered_toeplitz.LossFn.build_min_sep(
        steps, error=error, min_sep=b or 1, max_participations=k)
    assert blt.loss(ours, column, k, b, error=error) == pytest.approx(
        float(loss_fn.loss(theirs, skip_checks=True)), rel=RTOL)
  if k == 1:
    assert blt.loss(ours, column) == pytest.approx(
        float(buffered_toeplitz.max_loss(theirs, steps)), rel=RTOL)
  assert jp_sensitivity.minsep_true_max_participations(
      steps, b or 1, k) == min(k, -(-steps // (b or 1)))


def test_momentum_workload_errors_equal_jax_privacy():
  steps = 200
  decays, scales = PARAMETER_SETS[0]
  column = blt.toeplitz_workload_column(steps, momentum=0.9)
  theirs = toeplitz.per_query_error(
      noising_coef=_theirs(decays, scales).inverse().toeplitz_coefs(steps),
      workload_coef=jnp.asarray(column))
  np.testing.assert_allclose(
      blt.per_step_errors(blt.parameters(decays, scales), column), theirs,
      rtol=RTOL)


@pytest.mark.parametrize('decays,scales', PARAMETER_SETS)
def test_streamed_noise_equals_their_streaming_inverse(decays, scales):
  steps = 30
  template = {'w': np.zeros((3, 2), np.float32)}
  mechanism = blt.mechanism(blt.parameters(decays, scales), steps)
  state = mechanism.init(template, jax.random.key(0))
  gaussian = noise.gaussian(steps)
  z_state = gaussian.init(template, jax.random.key(0))
  # Each stream compiled once (not every op eagerly at every step).
  next_ours, next_z = jax.jit(mechanism.next), jax.jit(gaussian.next)
  ours, draws = [], []
  for _ in range(steps):
    out, state = next_ours(state, template)
    z, z_state = next_z(z_state, template)
    ours.append(np.ravel(out['w']))
    draws.append(np.ravel(z['w']))
  inverse = _theirs(decays, scales).inverse_as_streaming_matrix()
  theirs = streaming_matrix.multiply_array(
      inverse, jnp.asarray(np.stack(draws), jnp.float64))
  np.testing.assert_allclose(np.stack(ours), np.asarray(theirs), rtol=1e-5,
                             atol=1e-5)
