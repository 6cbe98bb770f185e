"""Paper 002's Algorithms 2-3: the private outlier-removal gradient, AC-SA, phases.

The aggregator's own proof is tested in tests/test_outlier_removal.py; here:
AboveThreshold draws its threshold noise once per phase and halts for good;
steps past the calibration are refused; one replaced user (huge, NaN, Inf,
or with a gradient of norm 1e3)
moves a released gradient by at most the sensitivity under the same key;
without noise the oracle is the plain mean of user gradients; AC-SA meets
its deterministic rate; the driver uses disjoint users and counts its work.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import clipping
from dpsco_jax import guards
from dpsco_jax import outlier_removal
from dpsco_jax.algorithms import user_level as ul
from tests import phase_calibration

K, T, POPULATION = 512, 3, 2048
EPSILON, DELTA = 8.0, 1e-5


# A phase's calibration, written out (tests/phase_calibration.py: K users of
# POPULATION, T AboveThreshold steps): these tests use its noise levels,
# not its search; the calibration itself is tested in
# tests/test_outlier_removal.py, and the driver below calibrates its own.
_PHASE = phase_calibration.PHASE
assert (_PHASE.num_points, _PHASE.num_steps, _PHASE.population,
        _PHASE.epsilon, _PHASE.delta) == (K, T, POPULATION, EPSILON, DELTA)


def test_the_written_out_phase_is_what_calibrate_returns():
  assert outlier_removal.calibrate(
      **phase_calibration.ARGUMENTS) == phase_calibration.PHASE


def _cal(tau=0.5):
  """The phase above at concentration radius `tau` (score radius 2 tau).

  Only the sensitivity and the Gaussian noise scale with tau: the score
  test's noise and the accounting do not depend on it.
  """
  scale = tau / _PHASE.tau
  return _PHASE._replace(tau=tau, score_radius=2 * tau,
                         sensitivity=_PHASE.sensitivity * scale,
                         noise_std=_PHASE.noise_std * scale)


def _loss(w, item):
  return jnp.logaddexp(0.0, -item['y'] * (item['x'] @ w))


def _users(n, m=4, d=3, seed=0, spread=1.0):
  rng = np.random.default_rng(seed)
  x = (rng.normal(size=(n, m, d)) * spread).astype(np.float32)
  y = np.where(rng.random((n, m)) < 0.7, 1.0, -1.0).astype(np.float32)
  return clipping.UserBatch({'x': x, 'y': y})


def _compiled_update(tx):
  """`tx.update(None, state, w, batch=users)` as one compiled program (not
  every op eagerly); the same outputs."""
  return jax.jit(lambda state, w, users: tx.update(None, state, w,
                                                   batch=users))


def _plain_mean_gradient(users, w):
  per_user = jax.vmap(clipping.user_mean_gradient(_loss),
                      in_axes=(0, None))(users, w)
  return jnp.mean(per_user, axis=0)


def test_ac_sa_meets_its_deterministic_rate():
  rng = np.random.default_rng(1)
  basis = np.linalg.qr(rng.normal(size=(6, 6)))[0]
  eigenvalues = np.array([0.05, 0.1, 0.5, 1.0, 3.0, 8.0])
  hessian = jnp.asarray(basis @ np.diag(eigenvalues) @ basis.T, jnp.float32)
  target = jnp.asarray(rng.normal(size=6), jnp.float32)
  objective = lambda x: 0.5 * (x - target) @ hessian @ (x - target)
  x0 = jnp.zeros(6)
  for stages in (None, (40, 40, 40)):
    tx = ul.ac_sa(8.0, 0.05, stage_lengths=stages)

    @jax.jit
    def step(params, state, tx=tx):
      updates, state = tx.update(jax.grad(objective)(params), state, params)
      return (optax.apply_updates(params, updates), state,
              objective(ul.ac_sa_output(state)))

    params, state = x0, tx.init(x0)
    for n in range(1, 121):
      params, state, output_objective = step(params, state)
      if stages is None:
        bound = 4 * 8.0 * 0.5 * float(jnp.sum((x0 - target) ** 2)) / (
            n * (n + 1))
        assert float(output_objective) <= bound * (1 + 1e-4)
    assert float(output_objective) < 1e-3
    if stages is not None:
      assert int(state.step) == 1  # restarted at the last boundary


def test_ac_sa_first_query_is_the_start_and_stays_in_the_ball():
  tx = ul.ac_sa(2.0, 0.5, radius=0.3)
  x0 = {'w': jnp.array([0.1, 0.2])}
  state = tx.init(x0)
  assert state.aggregate is x0
  updates, state = tx.update({'w': jnp.array([-50.0, 0.0])}, state, x0)
  assert float(jnp.linalg.norm(state.prox['w'])) <= 0.3 + 1e-6


def test_threshold_noise_is_drawn_once_per_phase():
  tx = ul.outlier_removal_gradient(_loss, _cal(), key=11)
  w = jnp.zeros(3)
  state = tx.init(w)
  expected = _cal().threshold_scale * jax.random.laplace(
      jax.random.fold_in(jax.random.key(11), 0), ())
  np.testing.assert_allclose(state.threshold_noise, expected, rtol=1e-6)
  users = _users(K, spread=0.01)
  update = _compiled_update(tx)
  for _ in range(T):
    _, state = update(state, w, users)
    np.testing.assert_allclose(state.threshold_noise, expected, rtol=1e-6)
  other = ul.outlier_removal_gradient(_loss, _cal(), key=12).init(w)
  assert float(other.threshold_noise) != float(expected)
  # Every test of the phase compares with THAT draw: a threshold raised
  # past K fails even concentrated users.
  raised = tx.init(w)._replace(threshold_noise=jnp.float32(K))
  _, raised = update(raised, w, users)
  assert bool(raised.halted)


def test_a_halted_phase_releases_zero_for_good():
  tight = _cal(tau=1e-4)
  tx = ul.outlier_removal_gradient(_loss, tight, key=0)
  w = jnp.array([0.2, -0.1, 0.3])
  state = tx.init(w)
  out, state = tx.update(None, state, w, batch=_users(K, spread=3.0))
  assert bool(state.halted)
  np.testing.assert_array_equal(out, 0.0)
  # Later batches that would pass release nothing either.
  same = clipping.UserBatch(jax.tree.map(lambda a: np.repeat(a[:1], K, 0),
                                         _users(K).items))
  out, state = tx.update(None, state, w, batch=same)
  np.testing.assert_array_equal(out, 0.0)


def test_steps_past_the_calibration_are_refused():
  tx = ul.outlier_removal_gradient(_loss, _cal(), key=1)
  w = jnp.zeros(3)
  state = tx.init(w)
  users = _users(K, spread=0.01)
  for _ in range(T):
    _, state = tx.update(None, state, w, batch=users)
  with pytest.raises(guards.PrivacyGuardError, match='calibrated for 3'):
    tx.update(None, state, w, batch=users)
  with pytest.raises(ValueError, match='K = 512'):
    tx.update(None, tx.init(w), w, batch=_users(100))


def test_without_noise_it_is_the_plain_mean_of_user_gradients():
  quiet = _cal()._replace(noise_std=0.0, laplace_scale=1e-9,
                          threshold_scale=0.0, tau=1e3, score_radius=2e3)
  tx = ul.outlier_removal_gradient(_loss, quiet, key=2)
  w = jnp.array([0.3, -0.2, 0.1])
  users = _users(K)
  out, _ = tx.update(None, tx.init(w), w, batch=users)
  np.testing.assert_allclose(out, _plain_mean_gradient(users, w), rtol=1e-5,
                             atol=1e-7)


@pytest.mark.parametrize('replacement',
                         ['huge', 'nan', 'inf', 'huge_gradient'])
def test_one_replaced_user_moves_the_release_by_at_most_the_sensitivity(
    replacement):
  w = jnp.array([0.3, -0.2, 0.1])
  users = _users(K, spread=0.2)
  items = jax.tree.map(np.array, users.items)
  if replacement == 'huge_gradient':
    # x = 1e6 saturates the logistic loss (a zero gradient); this user's
    # examples point against their labels instead, so its mean gradient
    # has norm ~1e3: without the outlier removal it alone would move the
    # mean by ~2, far past the sensitivity.
    direction = np.asarray(w) / np.linalg.norm(w)
    items['x'][5] = -1e3 * items['y'][5][:, None] * direction
  else:
    items['x'][5] = {'huge': 1e6, 'nan': np.nan, 'inf': np.inf}[replacement]
  releases = []
  for batch in (users, clipping.UserBatch(items)):
    tx = ul.outlier_removal_gradient(_loss, _cal(), key=jax.random.key(3))
    out, state = tx.update(None, tx.init(w), w, batch=batch)
    assert not bool(state.halted)
    releases.append(np.asarray(out))
  assert np.all(np.isfinite(releases[1]))
  assert np.linalg.norm(releases[0] - releases[1]) <= _cal().sensitivity


def test_eight_devices_equal_one():
  """Users sharded over 8 devices (a vmap with the axis name): same release."""
  w = jnp.array([0.3, -0.2, 0.1])
  users = _users(K, spread=0.2)
  single = ul.outlier_removal_gradient(_loss, _cal(), key=jax.random.key(6))
  expected, _ = _compiled_update(single)(single.init(w), w, users)
  sharded = ul.outlier_removal_gradient(_loss, _cal(), key=jax.random.key(6),
                                        axis_name='devices')

  def on_device(items):
    out, state = sharded.update(None, sharded.init(w), w,
                                batch=clipping.UserBatch(items))
    return out, state.halted

  items = jax.tree.map(lambda a: a.reshape((8, K // 8) + a.shape[1:]),
                       users.items)
  outs, halted = jax.jit(jax.vmap(on_device, axis_name='devices'))(items)
  assert not np.any(halted)
  for device in range(8):
    np.testing.assert_allclose(outs[device], expected, rtol=1e-5, atol=1e-6)


def test_smoothing_evaluates_each_item_at_a_perturbed_point():
  quiet = _cal()._replace(noise_std=0.0, laplace_scale=1e-9,
                          threshold_scale=0.0, tau=1e3, score_radius=2e3)
  absolute = lambda w, item: jnp.abs(w[0] - item['z'])
  users = clipping.UserBatch({'z': np.zeros((K, 4), np.float32)})
  w = jnp.array([0.005])
  plain_tx = ul.outlier_removal_gradient(absolute, quiet, key=4)
  plain, _ = _compiled_update(plain_tx)(plain_tx.init(w), w, users)
  tx = ul.outlier_removal_gradient(absolute, quiet, key=5,
                                   smoothing_radius=0.1)
  smoothed, _ = _compiled_update(tx)(tx.init(w), w, users)
  assert float(plain[0]) == 1.0
  # E sign(0.005 + y), y ~ U[-0.1, 0.1]: 0.05; 2,048 draws: std 0.022.
  assert abs(float(smoothed[0]) - 0.05) < 0.09


def test_phases_use_disjoint_users_and_the_work_is_counted():
  sizes = ul.phase_sizes(3000, 0.5, 4)
  blocks = ul.disjoint_user_blocks(3000, sizes, jax.random.key(0))
  everyone = np.concatenate(blocks)
  assert len(np.unique(everyone)) == len(everyone) == sum(sizes) <= 3000
  with pytest.raises(ValueError, match='needs'):
    ul.disjoint_user_blocks(10, [6, 6], jax.random.key(0))


def test_accelerated_phased_erm_runs_and_halts_on_a_failed_test():
  users = _users(5000, spread=0.3)
  kwargs = dict(epsilon=EPSILON, delta=DELTA, regularization=0.05,
                smoothness=0.25, users_per_step=K, steps=T, num_phases=1,
                radius=1.0, phase_decay=0.5)
  out = ul.accelerated_phased_erm(_loss, jnp.zeros(3), users, tau=0.5, key=0,
                                  **kwargs)
  assert not out.halted and out.phases[0].steps_released == T
  assert out.gradient_evaluations == K * T * 4
  assert float(jnp.linalg.norm(out.params)) <= 1.0 + 1e-6
  halted = ul.accelerated_phased_erm(_loss, jnp.full(3, 0.1), users,
                                     tau=1e-5, key=1, **kwargs)
  assert halted.halted and halted.phases[0].steps_released == 0
  # Halted at the first step: AC-SA's output after one zero-gradient step
  # moves only by the (data-independent) regulariser, which is 0 at x_0.
  np.testing.assert_allclose(halted.params, jnp.full(3, 0.1), atol=1e-6)


@pytest.mark.parametrize('change, match', [
    (dict(tau=0.0), 'tau'),
    (dict(users_per_step=4000), 'fewer than'),
    (dict(steps=[3, 3]), 'one value per phase'),
    (dict(users_per_step=50), 'too few'),
    (dict(regularization=-1.0), 'regularization'),
])
def test_bad_arguments_are_refused(change, match):
  kwargs = dict(epsilon=EPSILON, delta=DELTA, regularization=0.05,
                smoothness=0.25, users_per_step=K, steps=T, num_phases=1,
                radius=1.0, tau=0.5, phase_decay=0.5)
  kwargs.update(change)
  with pytest.raises(ValueError, match=match):
    ul.accelerated_phased_erm(_loss, jnp.zeros(3), _users(5000), key=0,
                              **kwargs)


def test_presets_follow_the_theorem_and_flag_what_fails():
  kwargs, conditions = ul.accelerated_phased_erm_preset(
      10000, 16, 10, 4.0, 1e-7, lipschitz=1.0, diameter=2.0, smoothness=1.0)
  n, m, d = 10000, 16, 10
  assert math.isclose(kwargs['regularization'],
                      0.5 * (1 / math.sqrt(n * m) +
                             math.sqrt(d) / (4.0 * n * math.sqrt(m))))
  assert not [c for c in conditions if c.name == 'K_i <= n_i'][0].holds
  practical, conditions = ul.accelerated_phased_erm_preset(
      100000, 16, 10, 4.0, 1e-7, lipschitz=1.0, diameter=2.0, smoothness=1.0,
      mode='practical')
  assert [c for c in conditions
          if c.name.startswith('every phase')][0].holds
  assert practical['tau'] <= 1.0  # never above L
  capped, conditions = ul.accelerated_phased_erm_preset(
      100000, 16, 10, 4.0, 1e-7, lipschitz=1.0, diameter=2.0,
      smoothness=1.0, mode='practical', max_steps=20)
  assert max(capped['steps']) == 20
  assert not [c for c in conditions if c.name.startswith('T_i >=')][0].holds
  with pytest.raises(ValueError, match='too few for one phase'):
    ul.accelerated_phased_erm_preset(
        1000, 16, 10, 4.0, 1e-7, lipschitz=1.0, diameter=2.0,
        smoothness=1.0, mode='practical')
