"""Paper 002's Algorithm 1 (phased SGD with outlier-iterate removal), end to end.

Privacy rests on the outlier-removal mean (tests/test_outlier_removal.py);
here: the phases' users are disjoint, one user moves one group's point, so a
replaced user (huge, NaN, Inf) moves the released point by at most the
calibrated sensitivity under the same key; a run without noise equals a
plain reimplementation; a failed test halts with the last released point;
bad input is refused.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping
from dpsco_jax import outlier_removal
from dpsco_jax.algorithms import phased_sgd as phased
from dpsco_jax.algorithms import srg
from dpsco_jax.algorithms import user_level as ul

GROUPS = 60     # enough for the score test at epsilon 8, delta 1e-5
EPSILON, DELTA = 8.0, 1e-5
N, M, D = 1000, 4, 3


def _loss(w, item):
  return jnp.logaddexp(0.0, -item['y'] * (item['x'] @ w))


def _users(seed=0, n=N):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, M, D)).astype(np.float32)
  y = np.where(rng.random((n, M)) < 1 / (1 + np.exp(-x @ np.ones(D))),
               1.0, -1.0).astype(np.float32)
  return clipping.UserBatch({'x': x, 'y': y})


KWARGS = dict(epsilon=EPSILON, delta=DELTA, num_groups=GROUPS,
              learning_rate=0.2, lipschitz=math.sqrt(D) * 4, tau_scale=2.0,
              radius=2.0, phase_decay=0.5, step_decay=0.5, num_phases=2)


def test_phases_use_disjoint_users_and_no_more_than_n():
  schedule = ul.phased_sgd_schedule(1000, 4, 30, learning_rate=0.1,
                                    lipschitz=1.0, tau_scale=1.0,
                                    num_phases=5)
  assert sum(schedule.users) <= 1000 * 2 ** -0.5
  groups = ul.phase_groups(1000, schedule, 30, jax.random.key(0))
  seen = np.concatenate([g.ravel() for g in groups])
  assert len(np.unique(seen)) == len(seen)
  for g, per_group in zip(groups, schedule.users_per_group):
    assert g.shape == (30, per_group)
  assert schedule.steps == tuple(4 * g for g in schedule.users_per_group)
  np.testing.assert_allclose(schedule.learning_rates,
                             [0.1 / 2 ** (1.5 * i) for i in range(1, 6)])


def test_group_sgd_is_one_pass_projected_sgd_with_average_iterate():
  rng = np.random.default_rng(1)
  items = {'x': rng.normal(size=(2, 5, D)).astype(np.float32),
           'y': np.sign(rng.normal(size=(2, 5))).astype(np.float32)}
  mask = np.ones((2, 5), bool)
  mask[1, 2] = False
  start = jnp.array([0.5, -0.5, 0.2])
  got = phased._group_average_iterates(_loss, start, items, mask, 0.7, 0.6)
  for group in range(2):
    point, total = np.array(start), np.zeros(D)
    for t in range(5):
      if mask[group, t]:
        x, y = items['x'][group, t], items['y'][group, t]
        grad = -y * x / (1 + np.exp(y * x @ point))
        point = point - 0.7 * grad
        point *= min(1.0, 0.6 / np.linalg.norm(point))
      total += point
    np.testing.assert_allclose(got[group], total / 5, rtol=1e-5, atol=1e-6)


def _without_noise(calibration):
  return calibration._replace(noise_std=0.0, laplace_scale=1e-9)


def test_without_noise_and_a_huge_tau_it_is_the_plain_phased_average(
    monkeypatch):
  real = outlier_removal.calibrate
  monkeypatch.setattr(outlier_removal, 'calibrate',
                      lambda *a, **k: _without_noise(real(*a, **k)))
  users = _users()
  kwargs = dict(KWARGS, tau_scale=1e6)
  out = ul.phased_sgd(_loss, jnp.zeros(D), users, key=3, **kwargs)
  assert not out.halted and len(out.phases) == 2
  # Reference: the same groups and item orders, plain mean of the C
  # average iterates, projected.
  schedule = ul.phased_sgd_schedule(
      N, M, GROUPS, learning_rate=0.2, lipschitz=kwargs['lipschitz'],
      tau_scale=1e6, phase_decay=0.5, step_decay=0.5, num_phases=2)
  key = jax.random.key(3)
  groups = ul.phase_groups(N, schedule, GROUPS, jax.random.fold_in(key, 0))
  point = jnp.zeros(D)
  for index, (chosen, steps, rate) in enumerate(zip(
      groups, schedule.steps, schedule.learning_rates), start=1):
    shuffle = np.asarray(jax.vmap(lambda k: jax.random.permutation(k, steps))(
        jax.random.split(jax.random.fold_in(jax.random.fold_in(key, index),
                                            0), GROUPS)))
    items = {name: np.take_along_axis(
        users.items[name][chosen].reshape((GROUPS, steps) +
                                          users.items[name].shape[2:]),
        shuffle.reshape(shuffle.shape + (1,) * (users.items[name].ndim - 2)),
        axis=1) for name in ('x', 'y')}
    averages = phased._group_average_iterates(
        _loss, point, items, np.ones((GROUPS, steps), bool), rate, 2.0)
    point = srg.project_l2_ball(jnp.mean(averages, axis=0), 2.0)
  np.testing.assert_allclose(out.params, point, rtol=1e-4, atol=1e-6)
  assert out.gradient_evaluations == GROUPS * sum(schedule.steps) <= N * M


@pytest.mark.parametrize('replacement', ['huge', 'nan', 'inf', 'flipped'])
def test_replacing_one_user_moves_the_release_by_at_most_the_sensitivity(
    replacement):
  kwargs = dict(KWARGS, num_phases=1)
  users = _users()
  schedule = ul.phased_sgd_schedule(
      N, M, GROUPS, learning_rate=0.2, lipschitz=kwargs['lipschitz'],
      tau_scale=2.0, phase_decay=0.5, step_decay=0.5, num_phases=1)
  victim = int(ul.phase_groups(N, schedule, GROUPS,
                               jax.random.fold_in(jax.random.key(5), 0))[0][
                                   0, 0])
  items = jax.tree.map(np.array, users.items)
  if replacement == 'huge':
    items['x'][victim] = 1e6
  elif replacement == 'nan':
    items['x'][victim] = np.nan
  elif replacement == 'inf':
    items['x'][victim, 0, 0] = np.inf
  else:
    items['y'][victim] = -items['y'][victim]
  out = ul.phased_sgd(_loss, jnp.zeros(D), users, key=5, **kwargs)
  out_after = ul.phased_sgd(_loss, jnp.zeros(D),
                            clipping.UserBatch(items), key=5, **kwargs)
  assert out.phases[0].passed and out_after.phases[0].passed
  sensitivity = outlier_removal.mean_sensitivity(GROUPS, out.phases[0].tau)
  moved = float(jnp.linalg.norm(out.params - out_after.params))
  assert np.all(np.isfinite(out_after.params))
  assert moved <= sensitivity
  assert moved > 0 or replacement != 'flipped'


def test_a_failed_test_halts_with_the_last_released_point():
  # Groups that disagree far beyond tau: the score test fails in phase 1.
  kwargs = dict(KWARGS, tau_scale=1e-6)
  start = jnp.array([0.3, 0.0, -0.3])
  out = ul.phased_sgd(_loss, start, _users(), key=0, **kwargs)
  assert out.halted and len(out.phases) == 1 and not out.phases[0].passed
  np.testing.assert_array_equal(out.params, start)


@pytest.mark.parametrize('change, match', [
    (dict(tau_scale=0.0), 'tau_scale'),
    (dict(tau_scale=-1.0), 'tau_scale'),
    (dict(num_phases=9), "at most"),
    (dict(num_groups=20), 'too few'),
    (dict(learning_rate=float('nan')), 'learning_rate'),
    (dict(epsilon=-1.0), 'epsilon'),
])
def test_bad_arguments_are_refused(change, match):
  with pytest.raises(ValueError, match=match):
    ul.phased_sgd(_loss, jnp.zeros(D), _users(), key=0,
                  **dict(KWARGS, **change))


def test_users_without_items_are_refused():
  empty = clipping.UserBatch({'x': np.zeros((N, 0, D), np.float32),
                              'y': np.zeros((N, 0), np.float32)})
  with pytest.raises(ValueError, match='m >= 1'):
    ul.phased_sgd(_loss, jnp.zeros(D), empty, key=0, **KWARGS)
  with pytest.raises(TypeError, match='UserBatch'):
    ul.phased_sgd(_loss, jnp.zeros(D), {'x': 1}, key=0, **KWARGS)


def test_presets_compute_the_theorem_and_flag_failed_conditions():
  kwargs, conditions = ul.phased_sgd_preset(
      20000, 16, 10, 2.0, 1e-6, lipschitz=1.0, diameter=4.0, mode='paper')
  assert kwargs['num_groups'] == math.ceil(
      100 * math.log(20 * 20000 * 16 * math.exp(2.0) / 1e-6) / 2.0)
  assert math.isclose(kwargs['learning_rate'],
                      4.0 / math.sqrt(10 * 16 * 20000 * 2.0))
  assert math.isclose(kwargs['tau_scale'], 1000 * math.log(20000 * 10 * 16))
  failed = [c.name for c in conditions if not c.holds]
  assert any('N_l >= 1' in name for name in failed)
  practical, conditions = ul.phased_sgd_preset(
      20000, 16, 10, 2.0, 1e-6, lipschitz=1.0, diameter=4.0,
      smoothness=1.0, mode='practical')
  assert all(c.holds for c in conditions)
  assert practical['num_groups'] == outlier_removal.fewest_points(
      2.0, 1e-6, score_share=0.5)
  # The practical parameters run (the schedule fits, the test calibrates).
  ul.phased_sgd_schedule(20000, 16, practical['num_groups'],
                         learning_rate=practical['learning_rate'],
                         lipschitz=1.0, tau_scale=practical['tau_scale'],
                         phase_decay=practical['phase_decay'],
                         step_decay=practical['step_decay'],
                         num_phases=practical['num_phases'])
