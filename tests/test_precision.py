"""The released clipped sum under float rounding and reduced matmul precision.

Two roundings the clipping's certificate did not cover:

* the batch sum itself (Casacuberta et al. 2022): a running float32 sum of
  adversarial rows moves one neighbour's sum by more than the clip;
* a reduced matmul precision on the accelerator (TF32 on NVIDIA GPUs, the
  default for float32 matmuls): a sum formed as a matrix product rounds the
  clip factors and the rows to 10 mantissa bits AFTER the norms were
  measured, so a contribution can leave the clip by about 2^-10.

The CPU backend ignores `jax.default_matmul_precision` ('tensorfloat32' and
'bfloat16' give full float32 products there), so the accelerator is
emulated: `_emulate_tf32` evaluates a function's jaxpr and rounds the
operands of every matrix product not asked for at `Precision.HIGHEST` to
TF32's 10-bit mantissa, as the GPU does.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import linalg

from dpsco_jax import accounting
from dpsco_jax import blt
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import noise
from dpsco_jax import rounding
from dpsco_jax import strategies

# Rounding and precision of the code users' devices run: every XLA
# optimization, not the suite's level 0 (tests/conftest.py).
pytestmark = pytest.mark.xla_optimized

F32 = np.float32


def linear_loss(params, example):
  """A linear score: its per-example gradient is the example itself."""
  return jnp.dot(params['w'], example['x'])


def _adversarial_rows(num_rows: int, level: float = 4096.0):
  """Rows in [-0.99, 0.99] whose running float32 sums drift apart.

  The first row is +0.9 in one batch and -0.9 in its neighbour (replace-one:
  sensitivity 2 at clip 1). The others lift both running sums to `level`,
  then keep the first batch's sum just above that power of two (coarse
  grid: an addition there rounds by up to half its ulp) and the
  neighbour's just below (a grid twice finer), choosing each row so that
  the first rounds up while the second stays exact.
  """
  rows, upper, lower = [F32(0.9)], F32(0.9), F32(-0.9)
  level, fine = F32(level), np.spacing(F32(level)) / 2
  while upper < level:
    row = F32(min(0.99, float(level - upper) + 0.45))
    rows.append(row)
    upper, lower = F32(upper + row), F32(lower + row)
  while len(rows) < num_rows:
    centre = float(level) + 0.9 - float(upper)
    candidates = (centre + np.arange(-64, 64) * fine / 8).astype(F32)
    candidates = candidates[np.abs(candidates) <= 0.99]
    new_upper, new_lower = upper + candidates, lower + candidates
    gain = ((new_upper - (np.float64(upper) + candidates)) -
            (new_lower - (np.float64(lower) + candidates)))
    gain = np.where((new_upper >= level) & (new_lower < level), gain, -np.inf)
    row = candidates[np.argmax(gain)]
    rows.append(row)
    upper, lower = F32(upper + row), F32(lower + row)
  return np.asarray(rows, F32)[:, None]


ROWS = _adversarial_rows(6000)
NEIGHBOUR = np.concatenate([-ROWS[:1], ROWS[1:]])
PARAMS = {'w': jnp.zeros((1,), jnp.float32)}


def _running_sum(rows):
  total = F32(0)
  for row in rows[:, 0]:
    total = F32(total + row)
  return total


def test_the_adversarial_rows_defeat_a_running_float32_sum():
  # The premise: summed in order in float32, the two batches differ by more
  # than the replace-one sensitivity 2 (exactly they differ by 1.8).
  assert _running_sum(ROWS) - _running_sum(NEIGHBOUR) > 2.0
  assert np.all(np.abs(ROWS) <= 0.99)


def _sum_fn(microbatch_size):
  stat = clipping.clipped_grad_sum(linear_loss, 1.0,
                                   microbatch_size=microbatch_size,
                                   method='vmap')
  return jax.jit(lambda x: stat({'x': x}, PARAMS).sum['w'][0])


def test_one_neighbour_moves_the_clipped_sum_at_most_the_sensitivity():
  # One example per microbatch: the blocks are accumulated one after the
  # other, the order a running sum would take. Both layouts stay within the
  # sensitivity 2 C (replace-one) whatever the rounding.
  for microbatch_size in (1, None):
    total = _sum_fn(microbatch_size)
    gap = float(total(ROWS)) - float(total(NEIGHBOUR))
    assert abs(gap) <= 2.0, (microbatch_size, gap)
    assert abs(gap - 1.8) < 1e-3, (microbatch_size, gap)


def test_the_sum_shrink_pays_for_the_bound_on_the_rounding():
  # The clip is shrunk by 1 / (1 + 2 gamma_N n): with it, f C' plus twice
  # the rounding bound is at most f C for every relation factor f >= 1.
  for size, roundings in ((8, 4), (1024, 4), (6000, 7)):
    shrink = rounding.sum_clip_shrink(size, roundings, jnp.float32)
    bound = rounding.gamma(roundings, jnp.float32) * size * shrink
    assert shrink + 2 * bound <= 1.0 + 1e-12
    assert 1 - shrink < 2.5 * roundings * size * 2.0 ** -24
  contributions = jnp.asarray(np.full((4, 3), 10.0, F32))
  stat = clipping.clipped_grad_sum(linear_loss, 1.0, method='vmap')
  out = stat({'x': contributions}, {'w': jnp.zeros((3,), jnp.float32)})
  norm = np.linalg.norm(np.asarray(out.sum['w'], np.float64)) / 4
  assert clipping.effective_clip(1.0, 4) <= rounding.sum_clip_shrink(
      4, 7, jnp.float32)
  assert norm <= clipping.effective_clip(1.0, 4)
  assert norm > clipping.effective_clip(1.0, 4) - 1e-6


def test_compensated_sums_are_accurate_whatever_the_order():
  x = jnp.asarray([2.0 ** 24, 1.0, 1.0, 1.0, -(2.0 ** 24), 1.0], jnp.float32)
  assert float(rounding.compensated_pairwise_sum(x)) == 4.0
  total, compensation = jnp.float32(0), jnp.float32(0)
  for value in x:
    total, compensation = rounding.compensated_add(total, compensation, value)
  assert float(total + compensation) == 4.0


def test_the_cross_device_sum_is_charged_to_the_clip():
  # Summed over P devices (psum, each device's sum through P - 1 more
  # roundings in the backend's order), two neighbouring totals differ by at
  # most f C' + 2 gamma_N n C' + 2 gamma_(P-1) (1 + gamma_N) n P C': the
  # clip the statistic applies keeps that within f C.
  gamma = lambda k: rounding.gamma(k, jnp.float32)
  for size, devices, roundings in ((128, 8, 7), (512, 8, 7), (64, 256, 4)):
    shrink = rounding.sum_clip_shrink(size, roundings, jnp.float32,
                                      num_devices=devices)
    bound = (gamma(roundings) * size + gamma(devices - 1) *
             (1 + gamma(roundings)) * size * devices) * shrink
    assert shrink + 2 * bound <= 1.0 + 1e-12
  if jax.device_count() < 8:
    return
  # DP-SGD's estimator on 8 devices, 512 examples each, all far above the
  # clip: each contribution is released at the clip that pays for the
  # cross-device sum, below the one of 512 examples on one device.
  mesh = jax.make_mesh((8,), ('devices',))
  estimator = estimators.noisy_gradient(
      linear_loss, l2_clip=1.0, noise_multiplier=1e-30,
      mechanism=noise.gaussian(1), key=0, normalize_by=8 * 512.0,
      clipping_method='vmap', axis_name='devices')
  params = {'w': jnp.zeros((1,), jnp.float32)}
  state = estimator.init(params)
  rows = jax.device_put(np.full((8 * 512, 1), 50.0, F32),
                        jax.NamedSharding(mesh, jax.P('devices')))

  def step(x):
    return estimator.update(None, state, params, batch={'x': x})[0]['w']

  mean = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=jax.P('devices'),
                               out_specs=jax.P()))(rows)
  charged = clipping.effective_clip(1.0, 512, num_devices=8)
  assert charged < clipping.effective_clip(1.0, 512) - 1e-3
  np.testing.assert_allclose(float(mean[0]), charged, rtol=1e-6)


# ------------------------------------------------- reduced matmul precision


def _tf32(x):
  """Rounds float32 to TF32 (10 explicit mantissa bits), to nearest even."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(
      0xFFFFE000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _emulate_tf32(fn):
  """`fn` with every matrix product below HIGHEST precision run as TF32."""
  def run(jaxpr, consts, *args):
    env = {}
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for var, value in zip(jaxpr.constvars, consts):
      env[var] = value
    for var, value in zip(jaxpr.invars, args):
      env[var] = value
    for eqn in jaxpr.eqns:
      inputs = [read(v) for v in eqn.invars]
      sub = eqn.params.get('jaxpr', eqn.params.get('call_jaxpr'))
      if eqn.primitive.name == 'dot_general':
        precision = eqn.params['precision']
        highest = precision is not None and all(
            p == jax.lax.Precision.HIGHEST for p in precision)
        if not highest:
          inputs = [_tf32(x) if x.dtype == jnp.float32 else x for x in inputs]
        outputs = eqn.primitive.bind(*inputs, **eqn.params)
      elif eqn.primitive.name in ('pjit', 'custom_jvp_call', 'closed_call'):
        outputs = run(sub.jaxpr, sub.consts, *inputs)
      else:
        outputs = eqn.primitive.bind(*inputs, **eqn.params)
      if not eqn.primitive.multiple_results:
        outputs = [outputs]
      for var, value in zip(eqn.outvars, outputs):
        env[var] = value
    return [read(v) for v in jaxpr.outvars]

  def emulated(*args):
    closed = jax.make_jaxpr(fn)(*args)
    flat = jax.tree_util.tree_leaves(args)
    out = run(closed.jaxpr, closed.consts, *flat)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(jax.eval_shape(fn, *args)), out)
  return emulated


def test_the_cpu_ignores_the_default_matmul_precision():
  # Why the TF32 tests emulate: on the CPU 'tensorfloat32' changes nothing.
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.normal(size=(32, 32)), jnp.float32)
          for _ in range(2))
  full = jax.jit(jnp.matmul)(a, b)
  with jax.default_matmul_precision('tensorfloat32'):
    reduced = jax.jit(lambda a, b: a @ b)(a, b)
  np.testing.assert_array_equal(np.asarray(full), np.asarray(reduced))
  emulated = _emulate_tf32(jnp.matmul)(a, b)
  assert np.max(np.abs(np.asarray(emulated) - np.asarray(full))) > 1e-4


def test_clipped_contributions_hold_under_tf32_matmuls():
  # Rows far above the clip, with entries that TF32 rounds up: the released
  # sum of ONE row is the row times its clip factor, at most the clip.
  rng = np.random.default_rng(3)
  rows = np.abs(rng.normal(size=(16, 64))).astype(F32) * 50 + F32(1.0009765)
  stat = clipping.clipped_grad_sum(linear_loss, 1.0, method='vmap')
  params = {'w': jnp.zeros((64,), jnp.float32)}
  # Compiled: one program for the 16 rows (run eagerly, the emulation
  # would trace the statistic and dispatch its operations once per row).
  one_row = jax.jit(_emulate_tf32(lambda x: stat({'x': x}, params).sum['w']))
  norms = [np.linalg.norm(np.asarray(one_row(jnp.asarray(rows[i:i + 1])),
                                     np.float64)) for i in range(16)]
  # Held to the clip the certificate gives (`effective_clip`), not past it.
  clip = clipping.effective_clip(1.0, 1)
  assert max(norms) <= clip, max(norms)
  assert min(norms) > clip - 1e-5   # the norms' own rounding margins


def sequence_loss(params, example):
  """A dense layer over a sequence: `example['x']` is `[T, d_in]`."""
  return jnp.sum(example['x'] @ params['w'])


def test_the_ghost_clipped_sum_holds_under_tf32_matmuls():
  # The ghost path's clipped sum: a re-weighted backward pass in the Gram
  # form (d_in 64, T = 1 and T = 4), and the per-example gradients it
  # formed (T = 64 on a 2 x 1 layer) summed with their clip factors. Rows
  # far above the clip, entries TF32 rounds up: each released contribution
  # is held to the clip.
  rng = np.random.default_rng(3)
  cases = [(linear_loss, (16, 64), (64,), 'gram'),
           (sequence_loss, (16, 4, 64), (64, 3), 'gram'),
           (sequence_loss, (16, 64, 2), (2, 1), 'materialized')]
  clip = clipping.effective_clip(1.0, 1)
  for loss, shape, w_shape, form in cases:
    rows = np.abs(rng.normal(size=shape)).astype(F32) * 50 + F32(1.0009765)
    stat = clipping.clipped_grad_sum(loss, 1.0, clipping_method='ghost')
    params = {'w': jnp.zeros(w_shape, jnp.float32)}
    choice = stat.clipping_choice({'x': jnp.asarray(rows[:1])}, params)
    assert [tap.form for tap in choice.taps] == [form]
    one_row = jax.jit(_emulate_tf32(
        lambda x, s=stat, p=params: s({'x': x}, p).sum['w']))
    norms = [np.linalg.norm(np.asarray(one_row(jnp.asarray(rows[i:i + 1])),
                                       np.float64)) for i in range(16)]
    assert max(norms) <= clip, (shape, max(norms))
    assert min(norms) > clip - 2e-5, (shape, min(norms))


# ------------------------------------------------ correlated-noise coefficients


def test_the_blt_is_accounted_with_the_coefficients_the_device_applies():
  # A decay just below 1 that float32 rounds UP, over a long run: the BLT
  # the device runs has a 1.2% larger sensitivity than the float64 one.
  params = blt.parameters(np.array([1 - 1.4 * 2.0 ** -24, 0.9]),
                          np.array([0.3, 0.2]))
  steps = 10 ** 6
  device = blt.parameters(*(np.asarray(np.asarray(v, F32), np.float64)
                            for v in params))
  assert blt.sensitivity(device, steps) > 1.01 * blt.sensitivity(params, steps)
  stated = blt.mechanism(params, steps).single_participation_sensitivity()
  assert stated == blt.sensitivity(device, steps)


def _long_memory_factorization(steps):
  """`C` with the banded inverse `C^-1 = I - a S` (S the shift), `a` just
  above 1 (`1 + 0.51 * 2^-23`, which float32 rounds UP to `1 + 2^-23`):
  `C[i, j] = a^(i - j)`, whose column norms grow with a over the run."""
  a = 1 + 0.51 * 2.0 ** -23
  inverse = np.eye(steps) - a * np.eye(steps, k=-1)
  return linalg.solve_triangular(inverse, np.eye(steps), lower=True), inverse


def _sensitivity(encoder, steps):
  return accounting.participation_sensitivity(
      encoder, accounting.FixedOrder(1, steps))


def test_mf_noise_from_the_inverse_is_accounted_as_the_device_applies_it():
  # The banded decoder and the regenerated one apply float32(C^-1): the
  # strategy the device runs is inv(float32(C^-1)), 3e-5 more sensitive
  # than the float64 C at T = 1024.
  steps = 1024
  c, inverse = _long_memory_factorization(steps)
  device = linalg.solve_triangular(np.asarray(inverse, F32).astype(np.float64),
                                   np.eye(steps), lower=True)
  assert _sensitivity(device, steps) > (1 + 2e-5) * _sensitivity(c, steps)
  for storage in ('buffer', 'regenerate'):
    mechanism = noise.matrix_factorization(c, inverse=inverse,
                                           storage=storage)
    stated = accounting.mechanism_sensitivity(
        mechanism, accounting.FixedOrder(1, steps))
    assert stated == pytest.approx(_sensitivity(device, steps), rel=1e-12), (
        storage)


def test_mf_noise_by_substitution_is_accounted_with_float32_coefficients():
  # The forward substitution applies float32(C): the accountant reads those
  # values (different from the float64 ones in the last bits).
  steps = 64
  c = strategies.banded_square_root(steps, 4, momentum=0.9)
  device = np.asarray(c, F32).astype(np.float64)
  assert not np.array_equal(device, c)
  mechanism = noise.matrix_factorization(c)
  np.testing.assert_array_equal(mechanism.encoder_matrix(), device)
  assert accounting.mechanism_sensitivity(
      mechanism, accounting.FixedOrder(2, steps // 2)) == (
          accounting.participation_sensitivity(
              device, accounting.FixedOrder(2, steps // 2)))


def _noise_after(mechanism, steps=5):
  template = {'w': jnp.zeros((7,), jnp.float32)}
  state = mechanism.init(template, jax.random.key(0))
  # One compiled step (eagerly, each of its operations compiles its own).
  step = jax.jit(lambda state: mechanism.next(state, template)[1])
  for _ in range(steps):
    state = step(state)
  return state, template


def test_correlated_noise_applies_its_coefficients_in_full_float32():
  # Under TF32 matmuls a coefficient rounded to 10 bits is another strategy
  # than the accounted one; the noise must not change under the emulation.
  mechanisms = [
      blt.mechanism(blt.parameters(np.array([0.9, 0.5]),
                                   np.array([0.3, 0.2])), 20),
      noise.matrix_factorization(
          strategies.banded_inverse_square_root(20, 4))]
  for mechanism in mechanisms:
    state, template = _noise_after(mechanism)
    next_noise = lambda s, m=mechanism: m.next(s, template)[0]['w']
    # Both compiled, as users run them: the same program but for the TF32
    # rounding the emulation adds before a product below HIGHEST precision.
    np.testing.assert_array_equal(
        np.asarray(jax.jit(_emulate_tf32(next_noise))(state)),
        np.asarray(jax.jit(next_noise)(state)), err_msg=mechanism.name)
