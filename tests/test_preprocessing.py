"""Private preprocessing: its sensitivity, its noise, and its epsilon in the run's.

The release must be accounted where the run is: the plan calibrates the
steps to what it leaves, the ledger spends it from step 0, a checkpoint
refuses a resume without it, and a release made for another neighbouring
relation is refused.
"""

import dataclasses
import itertools
import json
import math
import warnings

import jax
import numpy as np
import optax
import pytest

from dpsco_jax import accounting
from dpsco_jax import keys
from dpsco_jax import ledger as ledger_lib
from dpsco_jax import noise
from dpsco_jax import plans
from dpsco_jax import preprocessing

DELTA = 1e-5


def _statistic_change(u, v=None):
  """How far one row moves sum (u, u^2): v=None adds/removes u."""
  if v is None:
    return np.concatenate([u, u ** 2])
  return np.concatenate([u - v, u ** 2 - v ** 2])


@pytest.mark.parametrize('relation', ['add_or_remove', 'zero_out',
                                      'replace_one'])
def test_sensitivity_bounds_every_row_change_and_is_attained(relation):
  dim = 2
  bound = preprocessing.statistics_sensitivity(dim, relation)
  grid = np.linspace(-1.0, 1.0, 9)
  rows = [np.array(p) for p in itertools.product(grid, repeat=dim)]
  rng = np.random.default_rng(0)
  rows += list(rng.uniform(-1, 1, size=(200, dim)))
  if relation == 'replace_one':
    pairs = itertools.chain(itertools.product(rows[:81], repeat=2),
                            zip(rows[81:], rows[:81:-1]))
    norms = [np.linalg.norm(_statistic_change(u, v)) for u, v in pairs]
  else:
    norms = [np.linalg.norm(_statistic_change(u)) for u in rows]
  assert max(norms) <= bound * (1 + 1e-12)
  assert max(norms) == pytest.approx(bound)   # tight: not a loose constant


def test_sensitivity_grows_with_the_dimension():
  assert preprocessing.statistics_sensitivity(8) == pytest.approx(4.0)
  assert preprocessing.statistics_sensitivity(
      9, 'replace_one') == pytest.approx(6.0)
  with pytest.raises(ValueError):
    preprocessing.statistics_sensitivity(0)


def _rows(n=1000, seed=0):
  rng = np.random.default_rng(seed)
  return np.stack([rng.normal(3.0, 2.0, n), rng.uniform(-5, 15, n)], axis=1)


LOWER, UPPER = np.array([-5.0, -10.0]), np.array([11.0, 20.0])


def test_noise_std_is_the_multiplier_times_the_sensitivity():
  x = _rows()
  n, dim = x.shape
  half, mid = (UPPER - LOWER) / 2, (UPPER + LOWER) / 2
  # The noisy first-moment sum, read back from the mean (never clamped here).
  sums = []
  for seed in range(400):
    std = preprocessing.dp_standardization(
        x, LOWER, UPPER, noise_multiplier=0.7, key=jax.random.key(seed))
    sums.append(n * (std.mean - mid) / half)
  keys.forget_keys()
  sums = np.asarray(sums)
  u = (np.clip(x, LOWER, UPPER) - mid) / half
  np.testing.assert_allclose(sums.mean(axis=0), u.sum(axis=0), atol=0.5)
  expected = 0.7 * preprocessing.statistics_sensitivity(dim)
  ratio = sums.std(axis=0, ddof=1) / expected
  assert np.all((ratio > 0.88) & (ratio < 1.12)), ratio


def test_small_noise_recovers_the_clipped_mean_and_std():
  x = _rows(n=20000)
  std = preprocessing.dp_standardization(x, LOWER, UPPER, noise_multiplier=0.5,
                                         key=jax.random.key(3))
  clipped = np.clip(x, LOWER, UPPER)
  np.testing.assert_allclose(std.mean, clipped.mean(axis=0), rtol=2e-3)
  np.testing.assert_allclose(std.scale, clipped.std(axis=0), rtol=5e-3)
  z = std.apply(x)
  assert z.dtype == np.float32
  np.testing.assert_allclose(z.mean(axis=0), 0.0, atol=0.01)
  np.testing.assert_allclose(z.std(axis=0), 1.0, atol=0.01)


def test_noisy_variance_is_clamped_and_rows_are_clipped():
  x = np.zeros((3, 2))   # variance 0: the noisy one is often negative
  std = preprocessing.dp_standardization(x, LOWER, UPPER, noise_multiplier=50.0,
                                         key=jax.random.key(5), min_scale=0.1)
  assert np.all(std.scale >= 0.1 * (UPPER - LOWER) / 2 - 1e-12)
  assert np.all(std.scale <= (UPPER - LOWER) / 2 + 1e-12)
  far = std.apply(np.array([[1e9, -1e9]]))
  np.testing.assert_allclose(
      far, (np.array([[UPPER[0], LOWER[1]]]) - std.mean) / std.scale,
      rtol=1e-6)


def test_public_standardization_spends_nothing():
  std = preprocessing.public_standardization(LOWER, UPPER)
  assert std.release is None
  np.testing.assert_allclose(std.apply(np.stack([LOWER, UPPER])),
                             [[-1, -1], [1, 1]])


@pytest.mark.parametrize('kwargs, match', [
    (dict(noise_multiplier=1.0, epsilon=1.0, delta=DELTA), 'exactly one'),
    (dict(), 'exactly one'),
    (dict(epsilon=1.0), 'delta'),
    (dict(noise_multiplier=0.0), 'no noise'),
    (dict(noise_multiplier=float('nan')), 'noise_multiplier'),
    (dict(noise_multiplier=1.0, min_scale=0.0), 'min_scale'),
])
def test_bad_arguments_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    preprocessing.dp_standardization(_rows(10), LOWER, UPPER,
                                     key=jax.random.key(0), **kwargs)


def test_bad_rows_and_bounds_are_refused():
  x = _rows(10)
  with pytest.raises(ValueError, match='upper > lower'):
    preprocessing.dp_standardization(x, UPPER, LOWER, noise_multiplier=1.0)
  with pytest.raises(ValueError, match='one bound per feature'):
    preprocessing.dp_standardization(x[:, :1], LOWER, UPPER,
                                     noise_multiplier=1.0)
  x[0, 0] = np.nan
  with pytest.raises(ValueError, match='NaN'):
    preprocessing.dp_standardization(x, LOWER, UPPER, noise_multiplier=1.0)
  with pytest.raises(ValueError, match='rows'):
    preprocessing.public_standardization(LOWER, UPPER).apply(x[:, :1])


def test_a_key_given_twice_warns():
  key = jax.random.key(123)
  preprocessing.dp_standardization(_rows(10), LOWER, UPPER,
                                   noise_multiplier=1.0, key=key)
  with pytest.warns(keys.KeyReuseWarning):
    preprocessing.dp_standardization(_rows(10), LOWER, UPPER,
                                     noise_multiplier=1.0, key=key)
  keys.forget_keys()


def test_epsilon_calibrates_the_release_alone():
  std = preprocessing.dp_standardization(_rows(10), LOWER, UPPER, epsilon=0.5,
                                         delta=DELTA, key=jax.random.key(1))
  spent = accounting.releases_epsilon([std.release], DELTA)
  assert 0.499 < spent <= 0.5 + 1e-9


# ------------------------------------------------ the release in the run


def _loss(params, example):
  return (example['x'] @ params - example['y']) ** 2


def _dpsgd(**kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    return plans.dpsgd(_loss, optimizer=optax.sgd(0.1), num_examples=100,
                       batch_size=10, epochs=2, l2_clip=1.0, delta=DELTA,
                       seed=0, **kwargs)


RELEASE = accounting.GaussianRelease('feature mean and variance', 4.0)


@pytest.mark.parametrize('sampling', ['poisson', 'fixed'])
def test_plan_spends_the_release_with_the_steps(sampling):
  # A fixed order is accounted for zero-out neighbours: so is its release.
  release = (RELEASE if sampling == 'poisson' else
             dataclasses.replace(RELEASE, neighboring_relation='zero_out'))
  alone = accounting.releases_epsilon([release], DELTA)
  plan = _dpsgd(epsilon=2.0, sampling=sampling, releases=[release])
  assert 1.99 < plan.epsilon <= 2.0 + 1e-9
  assert plan.ledger.releases == (release,)
  # Before the first step the release is already spent; after the last,
  # the whole target; the steps alone spend less than it.
  assert plan.epsilon_at(0) == pytest.approx(alone)
  assert 0 < alone < plan.epsilon_at(1) < plan.epsilon_at(plan.num_steps)
  # So the release raised the multiplier: the same steps calibrated without
  # it would spend 1.99 or more (epsilon falls as the multiplier grows).
  steps_alone = accounting.epsilon_spent(plan.mechanism, plan.noise_multiplier,
                                         plan.participation, DELTA)
  assert steps_alone < plan.epsilon - 0.05
  assert plan.describe()['releases'] == [dataclasses.asdict(release)]
  json.dumps(plan.describe())
  # The plan's event is the composition, as an accountant reads it.
  composed = accounting.dp_event(plan.mechanism, plan.noise_multiplier,
                                 plan.participation, [release])
  assert plan.event == composed


@pytest.mark.parametrize('method', ['pld', 'rdp', 'zcdp', 'gdp_paper'])
def test_gaussians_compose_exactly_without_amplification(method):
  # One pass in a fixed order is one Gaussian of multiplier z (sensitivity
  # 1): with a release of multiplier r the steps need 1/z^2 = 1/z0^2 - 1/r^2.
  mech, part = noise.gaussian(50), accounting.single_epoch(50)
  z0 = accounting.calibrate_noise_multiplier(mech, part, 2.0, DELTA,
                                             method=method)
  z = accounting.calibrate_noise_multiplier(mech, part, 2.0, DELTA,
                                            method=method, releases=[RELEASE])
  assert z ** -2 + RELEASE.noise_multiplier ** -2 == pytest.approx(
      z0 ** -2, rel=2e-3 if method in ('pld', 'rdp') else 1e-9)
  spent = accounting.epsilon_spent(mech, z, part, DELTA, method=method,
                                   releases=[RELEASE])
  assert 1.99 < spent <= 2.0 + 1e-9   # the releases are counted, fully
  assert accounting.epsilon_spent(mech, z, part, DELTA,
                                  method=method) < spent - 0.02


def test_releases_that_spend_the_target_are_refused():
  loud = accounting.GaussianRelease('stats', 0.5)
  with pytest.raises(ValueError, match='alone spend'):
    _dpsgd(epsilon=2.0, releases=[loud])


def test_a_release_for_another_relation_is_refused():
  replace = accounting.GaussianRelease('stats', 4.0, 'replace_one')
  with pytest.raises(ValueError, match='calibrated for replace_one'):
    _dpsgd(epsilon=2.0, releases=[replace])
  with pytest.raises(ValueError, match='calibrated for replace_one'):
    _dpsgd(noise_multiplier=1.0, releases=[replace])
  # The single-pass plans default to zero-out: an add/remove release is
  # another relation there.
  with pytest.raises(ValueError, match='calibrated for add_or_remove'):
    plans.accelerated_dp_srgd(_loss, num_examples=100, batch_size=10,
                              beta=10.0, radius=1.0, l2_clip=1.0, delta=DELTA,
                              epsilon=2.0, seed=0, releases=[RELEASE])


def test_given_noise_reports_the_release_too():
  plan = _dpsgd(noise_multiplier=1.2, releases=[RELEASE])
  bare = _dpsgd(noise_multiplier=1.2)
  assert plan.epsilon > bare.epsilon
  assert plan.epsilon_at(0) > 0 == bare.epsilon_at(0)


def test_ledger_keeps_the_release_through_json_and_refuses_a_resume_without():
  plan = _dpsgd(epsilon=2.0, releases=[RELEASE])
  value = json.loads(json.dumps(plan.ledger.to_json()))
  back = ledger_lib.PrivacyLedger.from_json(value)
  assert back == plan.ledger and back.releases == (RELEASE,)
  without = dataclasses.replace(plan.ledger, releases=())
  with pytest.raises(ledger_lib.LedgerMismatchError, match='releases'):
    without.check_same_run(plan.ledger)
  # A ledger written before releases existed reads back with none.
  del value['releases']
  assert ledger_lib.PrivacyLedger.from_json(value).releases == ()


def test_release_type_is_checked():
  with pytest.raises(TypeError, match='GaussianRelease'):
    accounting.epsilon_spent(noise.gaussian(5), 1.0,
                             accounting.single_epoch(5), DELTA,
                             releases=[('stats', 4.0)])
  assert math.isclose(accounting.releases_mu(
      [accounting.GaussianRelease('a', 3.0),
       accounting.GaussianRelease('b', 4.0)]), 5 / 12)


def test_releases_keep_the_poisson_relation_checks():
  # The steps' event, not the composition, decides the accountant's
  # relation: Poisson sampling under replace-one stays refused.
  replace = accounting.GaussianRelease('stats', 4.0, 'replace_one')
  with pytest.raises(ValueError, match='Poisson sampling is accounted'):
    _dpsgd(noise_multiplier=1.0, neighboring_relation='replace_one',
           releases=[replace])
  zero_out = accounting.GaussianRelease('stats', 4.0, 'zero_out')
  plan = _dpsgd(noise_multiplier=1.0, neighboring_relation='zero_out',
                releases=[zero_out])
  bare = _dpsgd(noise_multiplier=1.0, neighboring_relation='zero_out')
  assert plan.epsilon > bare.epsilon
