"""DIFF2 accounting: the paper's closed forms, dp_accounting, calibration."""

import math

import dp_accounting
import pytest

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax.algorithms import diff2_accounting as diff2_acc
from dpsco_jax.algorithms.diff2 import Diff2NoiseMultipliers

DELTA = 1e-5
ROUNDS = 2000


@pytest.mark.parametrize('epsilon,order,dp_gd', [(3.0, 9, 77.46),
                                                 (5.0, 6, 48.99)])
def test_paper_order_and_dp_gd_multiplier(epsilon, order, dp_gd):
  assert diff2_acc.paper_order(epsilon, DELTA) == order
  z = diff2_acc.calibrate(ROUNDS, 1, epsilon, DELTA, method='paper')
  assert z.restart == pytest.approx(dp_gd, abs=0.005)
  assert z.restart == pytest.approx(math.sqrt(order * ROUNDS / epsilon))


# z_1, z_2 of Proposition 4.1 with u = 1.25 (worked out from the closed form
# independently of the code: z_1^2 = u a ceil(R/T) / eps,
# z_2^2 = u/(u-1) a (R - ceil(R/T)) / eps).
@pytest.mark.parametrize('epsilon,interval,z1,z2', [
    (3.0, 6, 35.39, 158.08), (3.0, 20, 19.36, 168.82),
    (3.0, 60, 11.29, 171.73), (3.0, 200, 6.12, 172.77),
    (5.0, 6, 22.38, 99.98), (5.0, 20, 12.25, 106.77),
    (5.0, 60, 7.14, 108.61), (5.0, 200, 3.87, 109.27),
])
def test_proposition_4_1_values(epsilon, interval, z1, z2):
  z = diff2_acc.calibrate(ROUNDS, interval, epsilon, DELTA, method='paper',
                          budget_split=1.25)
  assert z.restart == pytest.approx(z1, abs=0.005)
  assert z.difference == pytest.approx(z2, abs=0.005)
  assert z.local == 0.0
  # The closed form meets the target (its fixed order is not the best one).
  spent = diff2_acc.epsilon_spent(ROUNDS, interval, z, DELTA, method='paper')
  assert epsilon * 0.9 < spent <= epsilon


def test_paper_sigma_on_california_housing():
  """n_min = 1651 rows per client, P = 10, epsilon = 3."""
  dp_gd = diff2_acc.calibrate(ROUNDS, 1, 3.0, DELTA, method='paper')
  assert diff2_acc.paper_sigma(dp_gd.restart, 1651, 10) == pytest.approx(
      0.00938, abs=5e-6)
  z = diff2_acc.calibrate(ROUNDS, 20, 3.0, DELTA, method='paper')
  assert diff2_acc.paper_sigma(z.restart, 1651, 10) == pytest.approx(
      0.00235, abs=5e-6)
  assert diff2_acc.paper_sigma(z.difference, 1651, 10) == pytest.approx(
      0.0205, abs=5e-5)


@pytest.mark.parametrize('method', ['pld', 'rdp'])
def test_dp_accounting_calibration_is_tight_and_below_the_closed_form(method):
  rounds, interval, epsilon = 500, 20, 3.0
  z = diff2_acc.calibrate(rounds, interval, epsilon, DELTA, method=method)
  paper = diff2_acc.calibrate(rounds, interval, epsilon, DELTA,
                              method='paper')
  spent = diff2_acc.epsilon_spent(rounds, interval, z, DELTA, method=method)
  assert epsilon * (1 - 1e-4) <= spent <= epsilon
  assert z.restart < paper.restart and z.difference < paper.difference
  # The paper's split is kept: only a common scale changes.
  assert z.difference / z.restart == pytest.approx(
      paper.difference / paper.restart)
  # 10% less noise is visibly more epsilon: the accounting is not vacuous.
  weaker = Diff2NoiseMultipliers(z.restart * 0.9, z.difference * 0.9)
  assert diff2_acc.epsilon_spent(rounds, interval, weaker, DELTA,
                                 method=method) > epsilon * 1.05


def test_dp_gd_agrees_with_the_library_accountant():
  """T = 1: R full-batch Gaussian rounds = FixedOrder(R epochs, 1 step)."""
  rounds, z = 300, 30.0
  ours = diff2_acc.epsilon_spent(rounds, 1, Diff2NoiseMultipliers(z, 0.0),
                                 DELTA)
  library = dpsco_jax.epsilon_spent(
      dpsco_jax.noise.gaussian(rounds), z, accounting.FixedOrder(rounds, 1),
      DELTA)
  assert ours == pytest.approx(library, rel=1e-3)


def test_event_composes_the_actual_mechanisms():
  z = Diff2NoiseMultipliers(10.0, 50.0, 4.0)
  local = diff2_acc.LocalSteps(local_steps=4, local_batch_size=16,
                               min_client_size=400, num_clients=10)
  event = diff2_acc.diff2_dp_event(95, 10, z, local)
  restarts, differences, local_part = event.events
  assert restarts.count == 10 and restarts.event.noise_multiplier == 10.0
  assert differences.count == 85
  # K - 1 = 3 local releases in each of ceil(95 / 10) = 10 active rounds.
  assert local_part.count == 30
  assert local_part.event.sample_size == 16
  assert local_part.event.source_dataset_size == 400


def test_paper_subsampling_bound_is_above_dp_accounting():
  """B.7 (WBK19 Thm 9) >= dp_accounting's strengthened Thm 27, same RDP."""
  for order in (2, 5, 9, 30):
    for gamma, z in ((0.01, 1.0), (0.1, 3.0), (0.5, 0.8)):
      event = dp_accounting.SampledWithoutReplacementDpEvent(
          1000, int(gamma * 1000), dp_accounting.GaussianDpEvent(z))
      tight = dp_accounting.rdp.RdpAccountant(
          orders=[order], neighboring_relation=(
              dp_accounting.NeighboringRelation.REPLACE_ONE)).compose(event)
      bound = diff2_acc.paper_subsampled_rdp(order, gamma, z)
      assert tight._rdp[0] <= bound * (1 + 1e-9), (order, gamma, z)
      # And below the unsampled Gaussian's alpha / (2 z^2) for small gamma.
      if gamma <= 0.1:
        assert bound < order / (2 * z ** 2)


@pytest.mark.parametrize('method', ['paper', 'rdp'])
def test_bvr_calibration_meets_the_target(method):
  local = diff2_acc.LocalSteps(5, 32, 800, 8)
  z = diff2_acc.calibrate(200, 10, 2.0, DELTA, method=method, local=local)
  assert z.local > 0
  spent = diff2_acc.epsilon_spent(200, 10, z, DELTA, method=method,
                                  local=local)
  assert spent <= 2.0
  if method == 'rdp':
    assert spent == pytest.approx(2.0, rel=1e-4)
  # The local steps cost privacy: without them the same noise spends less.
  assert diff2_acc.epsilon_spent(200, 10, z, DELTA, method=method) < spent


def test_zero_noise_is_infinite_epsilon():
  z = Diff2NoiseMultipliers(10.0, 0.0)
  assert diff2_acc.epsilon_spent(100, 10, z, DELTA, method='paper') == math.inf
  assert diff2_acc.epsilon_spent(100, 10, z, DELTA, method='rdp') == math.inf
  # With T = 1 the difference multiplier is never used.
  assert math.isfinite(diff2_acc.epsilon_spent(100, 1, z, DELTA))


@pytest.mark.parametrize('method', diff2_acc.METHODS)
@pytest.mark.parametrize('bad', [-1.0, float('nan'), float('inf')])
@pytest.mark.parametrize('position', [0, 1, 2])
def test_every_method_refuses_an_invalid_noise_multiplier(method, bad,
                                                          position):
  multipliers = [10.0, 50.0, 4.0]
  multipliers[position] = bad
  local = diff2_acc.LocalSteps(3, 8, 100, 4) if method != 'pld' else None
  with pytest.raises(ValueError, match='entry of the noise multipliers must '
                     'be a non-negative finite number'):
    diff2_acc.epsilon_spent(100, 10, Diff2NoiseMultipliers(*multipliers),
                            DELTA, method=method, local=local)


@pytest.mark.parametrize('method', diff2_acc.METHODS)
def test_every_method_gives_infinite_epsilon_without_noise(method):
  z = Diff2NoiseMultipliers(0.0, 50.0)
  assert diff2_acc.epsilon_spent(100, 10, z, DELTA, method=method) == math.inf


@pytest.mark.parametrize('call,match', [
    (lambda: diff2_acc.calibrate(100, 10, 0.0, DELTA), 'epsilon'),
    (lambda: diff2_acc.calibrate(100, 10, 1.0, 1.5), 'delta'),
    (lambda: diff2_acc.calibrate(100, 0, 1.0, DELTA), 'restart_interval'),
    (lambda: diff2_acc.calibrate(0, 10, 1.0, DELTA), 'num_rounds'),
    (lambda: diff2_acc.calibrate(100, 10, 1.0, DELTA, budget_split=1.0),
     'budget_split'),
    (lambda: diff2_acc.calibrate(100, 10, 1.0, DELTA, method='gdp'),
     'method'),
    (lambda: diff2_acc.calibrate(
        100, 10, 1.0, DELTA, budget_split=(2.0, 2.0),
        local=diff2_acc.LocalSteps(3, 8, 100, 4)), '1/u_1'),
    (lambda: diff2_acc.epsilon_spent(
        100, 10, (1.0, 1.0, 1.0), DELTA, method='pld',
        local=diff2_acc.LocalSteps(3, 8, 100, 4)), 'pld'),
    (lambda: diff2_acc.epsilon_spent(
        100, 10, (1.0, 1.0, 1.0), DELTA,
        local=diff2_acc.LocalSteps(3, 200, 100, 4)), 'local_batch_size'),
    (lambda: diff2_acc.epsilon_spent(100, 10, (1.0, -1.0), DELTA),
     'noise multipliers'),
])
def test_bad_inputs(call, match):
  with pytest.raises(ValueError, match=match):
    call()


# Two BVR runs whose calibration used to crash with OverflowError: the root
# bracket of z_3 started at 1e-3, where B.7's e^{eps(2)} overflows, and with
# a large sampling ratio the doubling search never ended (B.7's floor).
SMALL_RATIO = diff2_acc.LocalSteps(4, 16, 1000, 10)   # b / n_min = 0.016
LARGE_RATIO = diff2_acc.LocalSteps(3, 5, 20, 4)       # b / n_min = 0.25


@pytest.mark.parametrize('local', [SMALL_RATIO, LARGE_RATIO],
                         ids=['small_ratio', 'large_ratio'])
def test_rdp_calibration_with_local_steps_meets_the_target_tightly(local):
  z = diff2_acc.calibrate(60, 6, 4.0, DELTA, local=local)  # 'rdp' default
  assert all(0 < m < math.inf for m in z)
  spent = diff2_acc.epsilon_spent(60, 6, z, DELTA, local=local)
  assert 4.0 * (1 - 1e-6) <= spent <= 4.0


def test_paper_calibration_with_a_small_sampling_ratio_meets_the_target():
  z = diff2_acc.calibrate(60, 6, 4.0, DELTA, method='paper',
                          local=SMALL_RATIO)
  # The local steps get exactly their third of the RDP budget at alpha.
  order = diff2_acc.paper_order(4.0, DELTA)
  releases = (4 - 1) * math.ceil(60 / 10)
  assert releases * diff2_acc.paper_subsampled_rdp(
      order, 16 / 1000, z.local) == pytest.approx(4.0 / 2 / 3, rel=1e-8)
  spent = diff2_acc.epsilon_spent(60, 6, z, DELTA, method='paper',
                                  local=SMALL_RATIO)
  # alpha = 7 makes log(1/delta) / (alpha - 1) = 1.92 < epsilon / 2: the
  # closed form's fixed order leaves about 10% unspent (3.607).
  assert 0.9 * 4.0 <= spent <= 4.0


def test_paper_calibration_refuses_a_budget_below_the_b7_floor():
  order = diff2_acc.paper_order(4.0, DELTA)
  releases = (3 - 1) * math.ceil(60 / 4)
  floor = releases * diff2_acc.paper_subsampled_rdp(order, 5 / 20, math.inf)
  # 30 releases at ratio 0.25 cost at least 4.40 of RDP at alpha = 7 however
  # much noise: more than the local third (0.667), even more than the whole
  # RDP budget epsilon / 2 = 2, so no budget split can help.
  assert floor == pytest.approx(4.402, abs=1e-3)
  with pytest.raises(ValueError, match=r'B\.7\) cannot fit the local steps '
                     r'into their share of the budget at any noise'):
    diff2_acc.calibrate(60, 6, 4.0, DELTA, method='paper', local=LARGE_RATIO)


@pytest.mark.parametrize('method', diff2_acc.METHODS)
def test_calibration_spends_the_target_for_each_method(method):
  # epsilon = 2 log(1/delta) / 6 makes the paper's conversion term exactly
  # epsilon / 2 (alpha = 7), so even the closed form is tight.
  epsilon = 2 * math.log(1 / DELTA) / 6 * (1 + 1e-12)
  local = None if method == 'pld' else diff2_acc.LocalSteps(5, 32, 800, 8)
  z = diff2_acc.calibrate(60, 6, epsilon, DELTA, method=method, local=local)
  spent = diff2_acc.epsilon_spent(60, 6, z, DELTA, method=method,
                                  local=local)
  assert 0.99 * epsilon <= spent <= epsilon


def test_paper_subsampling_bound_has_a_floor_and_never_overflows():
  floor = diff2_acc.paper_subsampled_rdp(7, 0.25, math.inf)
  # 1/(a-1) log(1 + 2 sum_{j>=3} g^j C(a, j)), by hand.
  by_hand = math.log(1 + 2 * sum(0.25 ** j * math.comb(7, j)
                                 for j in range(3, 8))) / 6
  assert floor == pytest.approx(by_hand, rel=1e-12)
  assert diff2_acc.paper_subsampled_rdp(7, 0.25, 1e200) == pytest.approx(
      floor, rel=1e-12)
  assert floor < diff2_acc.paper_subsampled_rdp(7, 0.25, 100.0)
  assert diff2_acc.paper_subsampled_rdp(7, 0.25, 1e-3) > 1e5
  assert diff2_acc.paper_subsampled_rdp(7, 0.25, 1e-200) == math.inf


def test_calibration_search_is_bounded():
  with pytest.raises(ValueError, match='no z up to 2'):
    diff2_acc._smallest_meeting(lambda x: 1.0, 'z')
