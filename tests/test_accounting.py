"""Accounting: published values, dp_accounting cross-checks, sensitivity, errors."""

import itertools
import logging
import math

from absl import logging as absl_logging
import dp_accounting
import numpy as np
import pytest

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import noise
from dpsco_jax.accounting import FixedOrder, PoissonSampling, Shuffled


def rdp_epsilon(event, delta, relation):
  accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
  return accountant.compose(event).get_epsilon(delta)


@pytest.mark.parametrize('noise_multiplier,bound', [(1.13, 19.74),
                                                    (8.83, 2.04)])
@pytest.mark.parametrize('method', ['rdp', 'pld'])
def test_tree_matches_dp_accounting_published_values(noise_multiplier, bound,
                                                     method):
  """dp_accounting's StackOverflow DP-FTRL figures: T = 1600, delta = 1e-6."""
  mechanism = noise.tree(1600)
  epsilon = accounting.epsilon_spent(mechanism, noise_multiplier,
                                     accounting.single_epoch(1600), 1e-6,
                                     method=method)
  assert epsilon < bound
  assert epsilon > 0.8 * bound  # the figures are upper bounds, not loose ones


@pytest.mark.parametrize('num_steps,restart_every', [(1600, None), (1000, 100),
                                                     (250, 64)])
def test_tree_event_agrees_with_dp_accounting_tree_event(num_steps,
                                                         restart_every):
  z = 3.0
  mechanism = noise.tree(num_steps, restart_every=restart_every)
  ours = accounting.epsilon_spent(mechanism, z,
                                  accounting.single_epoch(num_steps), 1e-6,
                                  method='rdp')
  theirs = rdp_epsilon(
      accounting.tree_aggregation_event(z, num_steps, restart_every), 1e-6,
      dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
  assert ours == pytest.approx(theirs, rel=1e-9)


def test_zcdp_values_of_paper_001():
  """Paper 001 §2.4: (0.1, 1e-6) -> rho = 1.80304e-4, (2, 1e-6) -> 0.0675739."""
  assert accounting.zcdp_rho(0.1, 1e-6) == pytest.approx(1.80304e-4, rel=1e-5)
  assert accounting.zcdp_rho(2.0, 1e-6) == pytest.approx(0.0675739, rel=1e-6)
  for eps in (0.1, 2.0, 7.0):
    rho = accounting.zcdp_rho(eps, 1e-6)
    assert accounting.zcdp_epsilon(rho, 1e-6) == pytest.approx(eps, rel=1e-12)


def test_zcdp_method_round_trip():
  mechanism = noise.gaussian(120)
  participation = accounting.single_epoch(120)
  z = accounting.calibrate_noise_multiplier(mechanism, participation, 0.1,
                                            1e-6, method='zcdp')
  # One Gaussian of sensitivity 1: std = sqrt(1 / (2 rho)) = 52.66 (notes).
  assert z == pytest.approx(52.66, rel=1e-3)
  assert accounting.epsilon_spent(mechanism, z, participation, 1e-6,
                                  method='zcdp') == pytest.approx(0.1)


def test_paper_gdp_closed_form():
  """mu = eps / sqrt(2 ln(2.5/delta)); the tree node noise is sens / mu."""
  mu = accounting.paper_gdp_mu(1.0, 1e-6)
  assert mu == pytest.approx(1 / math.sqrt(2 * math.log(2.5e6)))
  assert mu == pytest.approx(0.184, abs=1e-3)
  # T = 245: 8 levels are released (floor(log2 245) + 1), so the multiplier
  # is sqrt(8) / mu (paper 001 bounds the levels by 1 + ceil(log2 T) = 9).
  z = accounting.calibrate_noise_multiplier(noise.tree(245),
                                            accounting.single_epoch(245), 1.0,
                                            1e-6, method='gdp_paper')
  assert z == pytest.approx(math.sqrt(8) / mu)
  # The exact GDP delta at eps = 1 is far below the delta/2 the proof uses.
  assert accounting.gdp_delta(mu, 1.0) < 1e-8
  assert accounting.epsilon_for_gdp(mu, 1e-6) < 1.0


def test_gdp_round_trip():
  for mu in (0.3, 1.0, 2.5):
    eps = accounting.epsilon_for_gdp(mu, 1e-5)
    assert accounting.gdp_delta(mu, eps) == pytest.approx(1e-5, rel=1e-6)


def test_poisson_dpsgd_matches_jax_privacy_documented_value():
  """PLD epsilon 3.77 for sigma = 3, T = 512, q = 0.1, delta = 1e-6."""
  epsilon = accounting.epsilon_spent(noise.gaussian(512), 3.0,
                                     PoissonSampling(0.1, 512), 1e-6)
  assert epsilon == pytest.approx(3.77, abs=0.02)


def test_single_gaussian_calibration_known_value():
  """One Gaussian release at (1, 1e-5) needs sigma = 3.73 (analytic value)."""
  z = accounting.calibrate_noise_multiplier(noise.gaussian(1),
                                            accounting.single_epoch(1), 1.0,
                                            1e-5)
  assert z == pytest.approx(3.73, abs=0.01)


@pytest.mark.parametrize('mechanism,participation', [
    (noise.gaussian(50), PoissonSampling(0.05, 50)),
    (noise.tree(64, restart_every=16), FixedOrder(4, 16)),
    (noise.tree(60, honaker=True), accounting.single_epoch(60)),
])
@pytest.mark.parametrize('method', ['pld', 'rdp'])
def test_calibration_is_tight_and_never_weaker(mechanism, participation, method):
  z = accounting.calibrate_noise_multiplier(mechanism, participation, 2.0,
                                            1e-5, method=method)
  eps = accounting.epsilon_spent(mechanism, z, participation, 1e-5,
                                 method=method)
  assert eps <= 2.0
  assert eps > 1.99
  assert accounting.epsilon_spent(mechanism, 0.98 * z, participation, 1e-5,
                                  method=method) > 2.0


def test_fixed_order_gaussian_equals_composition():
  """k epochs of i.i.d. noise = k-fold composition of one Gaussian."""
  z, k, b = 4.0, 5, 7
  ours = accounting.epsilon_spent(noise.gaussian(k * b), z, FixedOrder(k, b),
                                  1e-6)
  accountant = dp_accounting.pld.PLDAccountant()
  theirs = accountant.compose(dp_accounting.GaussianDpEvent(z),
                              k).get_epsilon(1e-6)
  assert ours == pytest.approx(theirs, rel=1e-3)


def brute_force_sensitivity(encoder, steps_sets, dim=3, trials=2000, seed=0):
  """Largest ||sum_s C[:, s] g_s^T||_F over random unit g_s and given step sets."""
  rng = np.random.default_rng(seed)
  best = 0.0
  for steps in steps_sets:
    columns = encoder[:, list(steps)]
    aligned = np.linalg.norm(columns.sum(axis=1))
    best = max(best, aligned)
    vectors = rng.normal(size=(trials, len(steps), dim))
    vectors /= np.linalg.norm(vectors, axis=2, keepdims=True)
    values = np.linalg.norm(np.einsum('rs,tsd->trd', columns, vectors),
                            axis=(1, 2))
    assert values.max() <= aligned + 1e-9
  return best


@pytest.mark.parametrize('k,b,restart', [(1, 13, None), (3, 5, None),
                                         (2, 8, 8), (4, 4, 6)])
def test_fixed_order_sensitivity_by_brute_force(k, b, restart):
  encoder = noise.tree_encoder_matrix(k * b, restart)
  sets = [[i * b + j for i in range(k)] for j in range(b)]
  computed = accounting.participation_sensitivity(encoder, FixedOrder(k, b))
  assert computed == pytest.approx(brute_force_sensitivity(encoder, sets))


def _sign_brute_force(encoder, sets):
  """Largest ||C x|| over x in {-1, 0, 1} on one example's steps."""
  best = 0.0
  for steps in sets:
    for signs in itertools.product((-1.0, 0.0, 1.0), repeat=len(steps)):
      best = max(best, np.linalg.norm(encoder[:, steps] @ np.array(signs)))
  return best


@pytest.mark.parametrize('k,b,seed', [(2, 4, 0), (2, 3, 1), (3, 3, 2),
                                      (4, 2, 3)])
def test_mixed_sign_strategy_sensitivity(k, b, seed):
  # A lower-triangular C with entries of both signs: exact for two
  # participations (align or oppose the two contributions), an upper bound
  # beyond, never below what any neighbouring pair of datasets achieves.
  rng = np.random.default_rng(seed)
  encoder = np.tril(rng.normal(size=(k * b, k * b)))
  sets = [[i * b + j for i in range(k)] for j in range(b)]
  computed = accounting.participation_sensitivity(encoder, FixedOrder(k, b))
  signs = _sign_brute_force(encoder, sets)
  assert computed >= signs - 1e-9
  vectors = rng.normal(size=(2000, k, 3))
  vectors /= np.linalg.norm(vectors, axis=2, keepdims=True)
  for steps in sets:
    moved = np.einsum('rs,tsd->trd', encoder[:, steps], vectors)
    assert np.linalg.norm(moved, axis=(1, 2)).max() <= computed + 1e-9
  if k == 2:
    assert computed == pytest.approx(signs)


@pytest.mark.parametrize('k,b,restart', [(3, 4, 4), (2, 5, None), (3, 3, 2)])
def test_shuffled_sensitivity_bounds_every_placement(k, b, restart):
  encoder = noise.tree_encoder_matrix(k * b, restart)
  sets = list(itertools.product(*[range(i * b, (i + 1) * b) for i in range(k)]))
  worst = brute_force_sensitivity(encoder, sets, trials=50)
  computed = accounting.participation_sensitivity(encoder, Shuffled(k, b))
  assert computed >= worst - 1e-9
  if restart == b:  # one tree per epoch: the bound is exact
    assert computed == pytest.approx(worst)


def test_sensitivity_of_known_mechanisms():
  # Identity: sqrt(epochs) in both patterns.
  assert accounting.mechanism_sensitivity(
      noise.gaussian(12), FixedOrder(3, 4)) == pytest.approx(math.sqrt(3))
  assert accounting.mechanism_sensitivity(
      noise.gaussian(12), Shuffled(3, 4)) == pytest.approx(math.sqrt(3))
  # One tree over T steps: floor(log2 T) + 1 levels.
  for steps in (1, 2, 7, 8, 100, 1024):
    assert accounting.mechanism_sensitivity(
        noise.tree(steps), accounting.single_epoch(steps)) == pytest.approx(
            math.sqrt(steps.bit_length()))


def test_more_participation_costs_more():
  z = 5.0
  single = accounting.epsilon_spent(noise.tree(60), z,
                                    accounting.single_epoch(60), 1e-6)
  repeated = accounting.epsilon_spent(noise.tree(60), z, FixedOrder(3, 20),
                                      1e-6)
  assert repeated > single


@pytest.mark.parametrize('epsilon,delta', [(0.0, 1e-5), (-1.0, 1e-5),
                                           (1.0, 0.0), (1.0, 1.0),
                                           (1.0, -1e-5), (float('nan'), 1e-5)])
def test_bad_epsilon_delta(epsilon, delta):
  with pytest.raises(ValueError, match='epsilon|delta'):
    accounting.calibrate_noise_multiplier(noise.gaussian(10),
                                          accounting.single_epoch(10), epsilon,
                                          delta)


def test_bad_accounting_requests():
  with pytest.raises(ValueError, match='100 steps'):
    accounting.epsilon_spent(noise.tree(100), 1.0, accounting.single_epoch(50),
                             1e-5)
  with pytest.raises(ValueError, match='Poisson'):
    accounting.epsilon_spent(noise.tree(100), 1.0, PoissonSampling(0.1, 100),
                             1e-5)
  with pytest.raises(ValueError, match='amplification'):
    accounting.epsilon_spent(noise.gaussian(100), 1.0,
                             PoissonSampling(0.1, 100), 1e-5, method='zcdp')
  with pytest.raises(ValueError, match='method'):
    accounting.epsilon_spent(noise.gaussian(10), 1.0,
                             accounting.single_epoch(10), 1e-5, method='moments')
  with pytest.raises(ValueError, match='sampling_probability'):
    accounting.epsilon_spent(noise.gaussian(10), 1.0, PoissonSampling(1.5, 10),
                             1e-5)
  with pytest.raises(ValueError, match='noise_multiplier'):
    accounting.epsilon_spent(noise.gaussian(10), -1.0,
                             accounting.single_epoch(10), 1e-5)
  with pytest.raises(ValueError, match='replace-one'):
    accounting.epsilon_spent(
        noise.gaussian(10), 1.0, PoissonSampling(0.1, 10), 1e-5,
        neighboring_relation=accounting.neighboring.NeighboringRelation
        .REPLACE_ONE)


def test_zero_noise_is_infinite_epsilon():
  assert math.isinf(accounting.epsilon_spent(
      noise.gaussian(10), 0.0, accounting.single_epoch(10), 1e-5))


@pytest.mark.parametrize('mechanism', [
    noise.gaussian(40),
    noise.tree(40),
    noise.tree(37, release='prefix'),
    noise.tree(40, restart_every=12),
    noise.tree(33, honaker=True),
    noise.matrix_factorization(np.tril(np.ones((6, 6))) / np.sqrt(6)),
], ids=lambda m: m.name)
def test_single_pass_sensitivity_is_the_largest_encoder_column(mechanism):
  participation = accounting.single_epoch(mechanism.num_steps)
  encoder = mechanism.encoder_matrix()
  expected = np.sqrt(np.max(np.sum(encoder ** 2, axis=0)))
  assert accounting.mechanism_sensitivity(
      mechanism, participation) == pytest.approx(expected, rel=1e-12)
  # The general (Gram) computation agrees.
  assert accounting.participation_sensitivity(
      encoder, participation) == pytest.approx(expected, rel=1e-12)


def test_million_step_single_pass_runs_are_accounted_without_their_matrix():
  """A 2^20-step tree or i.i.d. run has a C far too large to build."""
  steps = 2 ** 20
  tree = noise.tree(steps, release='prefix')
  assert accounting.mechanism_sensitivity(
      tree, accounting.single_epoch(steps)) == pytest.approx(np.sqrt(21))
  z = accounting.calibrate_noise_multiplier(
      tree, accounting.single_epoch(steps), 1.0, 1e-6, method='gdp_paper')
  assert z == pytest.approx(
      np.sqrt(21) / accounting.paper_gdp_mu(1.0, 1e-6))
  assert accounting.epsilon_spent(noise.gaussian(steps), 5.0,
                                  accounting.single_epoch(steps),
                                  1e-6) < 2.0
  with pytest.raises(ValueError, match='steps'):
    accounting.mechanism_sensitivity(tree, accounting.single_epoch(steps - 1))


@pytest.mark.parametrize('method', accounting.METHODS)
@pytest.mark.parametrize('noise_multiplier', [-1.0, -1e-9, float('nan'),
                                              float('inf'), float('-inf')])
def test_every_method_refuses_an_invalid_noise_multiplier(method,
                                                          noise_multiplier):
  # The closed forms used to read -1 as 1 (or as a negative epsilon) and NaN
  # as NaN, while the dp_accounting methods refused it.
  with pytest.raises(ValueError, match='noise_multiplier must be a '
                     'non-negative finite number'):
    accounting.epsilon_spent(noise.tree(16), noise_multiplier,
                             accounting.single_epoch(16), 1e-5, method=method)


@pytest.mark.parametrize('method', accounting.METHODS)
def test_every_method_gives_infinite_epsilon_without_noise(method):
  assert accounting.epsilon_spent(noise.tree(16), 0.0,
                                  accounting.single_epoch(16), 1e-5,
                                  method=method) == math.inf


@pytest.mark.parametrize('noise_multiplier', [-1.0, float('nan'),
                                              float('inf')])
def test_tree_event_refuses_an_invalid_noise_multiplier(noise_multiplier):
  # dp_accounting's RDP accountant reports epsilon 0 for a NaN multiplier.
  with pytest.raises(ValueError, match='noise_multiplier'):
    accounting.tree_aggregation_event(noise_multiplier, 16)


@pytest.mark.parametrize('method', accounting.METHODS)
def test_calibrated_multipliers_are_valid_and_meet_the_target(method):
  mechanism, participation = noise.tree(16), accounting.single_epoch(16)
  z = accounting.calibrate_noise_multiplier(mechanism, participation, 2.0,
                                            1e-5, method=method)
  assert 0 < z < math.inf
  assert accounting.epsilon_spent(mechanism, z, participation, 1e-5,
                                  method=method) <= 2.0


def test_excluded_rdp_orders_are_not_a_user_facing_warning(caplog):
  # At q = 0.1, sigma = 1 dp_accounting's RDP series does not converge for
  # the small orders and it logs one absl warning per order: by design.
  caplog.set_level(logging.WARNING)
  mechanism = noise.gaussian(20)
  # method='rdp': the calibration's RDP evaluations are where the warnings
  # come from (a 'pld' calibration brackets with the same ones first, at 8x
  # the cost).
  accounting.calibrate_noise_multiplier(
      mechanism, accounting.PoissonSampling(0.1, 20), 2.0, 1e-5, method='rdp')
  accounting.epsilon_spent(mechanism, 1.0, accounting.PoissonSampling(0.1, 20),
                           1e-5, method='rdp')
  assert not [r for r in caplog.records
              if 'failed to converge' in r.getMessage()]
  # Only those records, only inside the context: other warnings pass.
  with accounting.quiet_excluded_orders():
    absl_logging.warning('something else')
  absl_logging.warning('_compute_log_a_frac failed to converge (outside)')
  messages = [r.getMessage() for r in caplog.records]
  assert 'something else' in messages
  assert '_compute_log_a_frac failed to converge (outside)' in messages


@pytest.mark.parametrize('participation', [
    accounting.PoissonSampling(0.01, 100), accounting.single_epoch(100)])
def test_a_nominal_epsilon_is_calibrated_fast_and_announced(participation):
  # epsilon = 1e6 took minutes and gigabytes under PLD (its discretization
  # grows with the privacy loss); now the interval grows with it instead.
  mechanism = noise.gaussian(100)
  with pytest.warns(checks.NoPrivacyWarning, match='private in name only'):
    z = accounting.calibrate_noise_multiplier(mechanism, participation, 1e6,
                                              1e-5)
  spent = accounting.epsilon_spent(mechanism, z, participation, 1e-5)
  assert 0.99e6 < spent <= 1e6
  # Below epsilon 33 the PLD is the default one: values unchanged.
  assert accounting.epsilon_spent(mechanism, 2.0, participation, 1e-5) == (
      pytest.approx(float(dp_accounting.pld.PLDAccountant(
          neighboring_relation=dp_accounting.NeighboringRelation
          .ADD_OR_REMOVE_ONE).compose(accounting.dp_event(
              mechanism, 2.0, participation)).get_epsilon(1e-5)), rel=1e-12))


@pytest.mark.parametrize('call', [
    lambda: accounting.gdp_delta(-1.0, 1.0),
    lambda: accounting.gdp_delta(float('nan'), 1.0),
    lambda: accounting.epsilon_for_gdp(-0.5, 1e-5),
    lambda: accounting.epsilon_for_gdp(float('inf'), 1e-5),
    lambda: accounting.zcdp_epsilon(-0.1, 1e-5),
    lambda: accounting.zcdp_epsilon(float('nan'), 1e-5),
])
def test_gdp_and_zcdp_parameters_are_validated(call):
  with pytest.raises(ValueError, match='must be a non-negative finite'):
    call()
