"""Private hyperparameter tuning: the search's bounds, calibration, refusals.

The bounds are checked three ways: against dp_accounting's own
implementation of the same theorems (`RepeatAndSelectDpEvent`), against the
exact Renyi divergence of the best of K runs of a binary mechanism (the
bound must hold at every order, and repetition must cost something), and in
the pure-DP limit against Liu & Talwar's 3 epsilon for a geometric K.
"""

import math
import os
import re
import textwrap
import warnings

import dp_accounting
import numpy as np
import optax
import pytest
from scipy import special
from scipy import stats

from dpsco_jax import accounting
from dpsco_jax import guards
from dpsco_jax import keys
from dpsco_jax import plans
from dpsco_jax import tuning

DELTA = 1e-5
GAUSSIAN = dp_accounting.GaussianDpEvent(3.0)
DPSGD = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(
        1.0)), 1000)
RANDOM = [tuning.geometric(10.0),
          tuning.TruncatedNegativeBinomial(eta=0.0, gamma=0.05),
          tuning.TruncatedNegativeBinomial(eta=2.0, gamma=0.2),
          tuning.TruncatedNegativeBinomial(eta=0.5, gamma=0.02),
          tuning.Poisson(mean=10.0)]
IDS = ['geometric', 'logarithmic', 'tnb_eta2', 'tnb_eta0.5', 'poisson']


def one_trial_epsilon(event, delta=DELTA):
  return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


# ------------------------------------------ the bound, computed independently


@pytest.mark.parametrize('event', [GAUSSIAN, DPSGD], ids=['gauss', 'dpsgd'])
@pytest.mark.parametrize('distribution', RANDOM, ids=IDS)
def test_bound_matches_dp_accounting_repeat_and_select(distribution, event):
  """Theorems 2 and 6 as dp_accounting implements them, on the same orders."""
  ours = tuning.search_epsilon(distribution, event, DELTA)
  event_of_search = tuning.search_event(distribution, event)
  theirs = one_trial_epsilon(event_of_search)
  # dp_accounting recovers gamma from the mean by bisection (rtol 1e-9).
  assert ours == pytest.approx(theirs, rel=1e-7)


def _renyi(p, q, order):
  keep = p > 0
  return special.logsumexp(order * np.log(p[keep]) +
                           (1 - order) * np.log(q[keep])) / (order - 1)


def _rdp_of_pair(p, q):
  return np.array([max(_renyi(p, q, a), _renyi(q, p, a))
                   for a in tuning.ORDERS])


def _pmf_of_k(distribution, largest=5000):
  """P[K = k], k = 0..largest, from scipy (not the module's pmf)."""
  k = np.arange(largest + 1)
  if isinstance(distribution, tuning.Poisson):
    return stats.poisson.pmf(k, distribution.mean)
  if distribution.eta == 0:
    weights = stats.logser.pmf(k, 1 - distribution.gamma)
  else:  # eta > 0: a negative binomial conditioned on K >= 1.
    weights = stats.nbinom.pmf(k, distribution.eta, distribution.gamma)
    weights[0] = 0.0
  return weights / weights.sum()


def _best_of_k(distribution, p):
  """Output distribution of the best of K runs (score = output, K = 0: none).

  P[best <= y] = E[F(y)^K], the probability generating function of K at the
  CDF of one run.
  """
  weights = _pmf_of_k(distribution)
  k = np.arange(weights.size)
  cdf = np.concatenate([[0.0], np.cumsum(p)])
  pgf = [np.sum(weights * c ** k) for c in cdf]
  return np.concatenate([[weights[0]], np.diff(pgf)])


@pytest.mark.parametrize('distribution', RANDOM[:3] + RANDOM[4:],
                         ids=IDS[:3] + IDS[4:])
@pytest.mark.parametrize('epsilon,p_top', [(1.0, 0.05), (2.0, 0.05),
                                           (1.0, 0.001)])
def test_bound_holds_for_the_exact_best_of_k_of_a_binary_mechanism(
    distribution, epsilon, p_top):
  """Randomized response (top outcome e^epsilon more likely on one side).

  The exact RDP of the released best exceeds one run's (repetition costs
  privacy) and never exceeds the bound, at any order.
  """
  p = np.array([1 - p_top, p_top])
  q = np.array([1 - p_top * math.exp(-epsilon), p_top * math.exp(-epsilon)])
  one_run = _rdp_of_pair(p, q)
  exact = _rdp_of_pair(_best_of_k(distribution, p),
                       _best_of_k(distribution, q))
  bound = tuning.search_rdp(distribution, one_run)
  assert np.all(exact <= bound * (1 + 1e-9))
  assert np.max(exact - one_run) > 0.05


@pytest.mark.parametrize('eta', [0.0, 1.0, 2.0])
def test_pure_dp_limit_is_liu_talwar(eta):
  """An epsilon-DP trial (RDP epsilon at every order): Theorem 2 tends to
  ((2 + eta) epsilon)-DP as lambda and lambda_hat grow; 3 epsilon for a
  geometric K, Liu & Talwar's (2019) bound for pure DP."""
  epsilon = 0.7
  orders = np.geomspace(2.0, 1e7, 60)
  bound = tuning.search_rdp(
      tuning.TruncatedNegativeBinomial(eta=eta, gamma=0.1),
      np.full(orders.shape, epsilon), orders=orders)
  assert bound[-1] == pytest.approx((2 + eta) * epsilon, abs=1e-4)


# ------------------------------------------------------------------ sanity


@pytest.mark.parametrize('distribution', RANDOM, ids=IDS)
def test_search_costs_more_than_one_trial_and_less_with_more_noise(
    distribution):
  events = [dp_accounting.GaussianDpEvent(z) for z in (2.0, 4.0, 8.0)]
  searches = [tuning.search_epsilon(distribution, e, DELTA) for e in events]
  for search, event in zip(searches, events):
    assert search > one_trial_epsilon(event)
  assert searches[0] > searches[1] > searches[2]


@pytest.mark.parametrize('event', [GAUSSIAN, DPSGD], ids=['gauss', 'dpsgd'])
def test_one_fixed_trial_is_one_trial(event):
  assert tuning.search_epsilon(tuning.FixedTrials(1), event, DELTA) == (
      pytest.approx(one_trial_epsilon(event), rel=1e-12))


def test_fixed_trials_are_composed_not_accounted_as_random():
  """k fixed trials: the composition of k trials, not the random-K bound at
  mean k (which needs K random). Here the composition costs more."""
  fixed = tuning.search_epsilon(tuning.FixedTrials(10), GAUSSIAN, DELTA)
  composed = one_trial_epsilon(dp_accounting.SelfComposedDpEvent(GAUSSIAN, 10))
  assert fixed == pytest.approx(composed, rel=1e-12)
  for random_k in (tuning.geometric(10.0), tuning.Poisson(10.0)):
    assert fixed != pytest.approx(
        tuning.search_epsilon(random_k, GAUSSIAN, DELTA), rel=1e-3)


@pytest.mark.parametrize('distribution', [
    tuning.geometric(4.0), tuning.TruncatedNegativeBinomial(0.0, 0.1),
    tuning.TruncatedNegativeBinomial(-0.5, 0.05),
    tuning.TruncatedNegativeBinomial(2.0, 0.3), tuning.Poisson(3.0)],
                         ids=['geometric', 'logarithmic', 'tnb_neg', 'tnb_2',
                              'poisson'])
def test_k_is_drawn_from_the_declared_distribution(distribution):
  draws = np.array([distribution.sample(keys.as_key(seed))
                    for seed in range(600)])
  support = np.arange(draws.max() + 1)
  pmf = np.array([distribution.pmf(int(k)) for k in support])
  assert sum(distribution.pmf(k) for k in range(2000)) == pytest.approx(
      1.0, abs=1e-9)
  assert np.sum(support * pmf) == pytest.approx(distribution.mean, rel=0.05)
  # Kolmogorov-Smirnov distance of the discrete CDFs.
  empirical = np.array([np.mean(draws <= k) for k in support])
  assert np.max(np.abs(empirical - np.cumsum(pmf))) < 1.36 / math.sqrt(600)


@pytest.mark.parametrize('eta', [-0.5, 0.0, 1.0, 3.0])
def test_distribution_from_its_mean(eta):
  distribution = tuning.truncated_negative_binomial(eta=eta, mean=8.0)
  assert distribution.mean == pytest.approx(8.0, rel=1e-8)
  assert sum(k * distribution.pmf(k) for k in range(1, 5000)) == (
      pytest.approx(8.0, rel=1e-6))


def test_calibration_spends_at_most_the_target():
  distribution = tuning.geometric(5.0)
  z = tuning.calibrate_trial_noise(2.0, DELTA, distribution,
                                   dp_accounting.GaussianDpEvent)
  spent = tuning.search_epsilon(distribution,
                                dp_accounting.GaussianDpEvent(z), DELTA)
  assert 2.0 * (1 - 1e-3) < spent <= 2.0
  with pytest.raises(ValueError, match='epsilon'):
    tuning.calibrate_trial_noise(0.0, DELTA, distribution,
                                 dp_accounting.GaussianDpEvent)


def test_bad_distributions_are_refused():
  with pytest.raises(ValueError, match='eta'):
    tuning.TruncatedNegativeBinomial(eta=-1.0, gamma=0.1)
  with pytest.raises(ValueError, match='gamma'):
    tuning.TruncatedNegativeBinomial(eta=1.0, gamma=1.0)
  with pytest.raises(ValueError, match='mean'):
    tuning.Poisson(mean=0.0)
  with pytest.raises(ValueError, match='count'):
    tuning.FixedTrials(0)


# ------------------------------------------------------------------ search


class TrialRun:
  """What a trial returns besides its score: the event it ran with."""

  def __init__(self, event, config):
    self.event = event
    self.config = config


def public_trial(config, noise_multiplier):
  # A score from public data only: here a known function of the config.
  return -(config['lr'] - 0.1) ** 2, TrialRun(
      dp_accounting.GaussianDpEvent(noise_multiplier), config)


SPACE = {'lr': [0.01, 0.03, 0.1, 0.3], 'clip': lambda key: 1.0}


def test_random_search_returns_the_best_trial_and_its_record():
  result = tuning.random_search(
      SPACE, public_trial, distribution=tuning.geometric(6.0), epsilon=2.0,
      delta=DELTA, make_event=dp_accounting.GaussianDpEvent,
      score_source='public', key=123)
  assert result.num_trials == len(result.trials) >= 1
  assert result.best.score == max(t.score for t in result.trials)
  assert result.epsilon <= 2.0
  record = result.record.to_json()
  assert record['distribution']['name'] == 'truncated_negative_binomial'
  assert record['epsilon'] == result.epsilon and record['delta'] == DELTA
  assert 'Theorem 2' in record['method']
  # K and the other trials are not covered by the guarantee: not published.
  assert 'num_trials' not in record and 'trials' not in record


def test_a_poisson_search_with_no_trial_releases_nothing():
  result = tuning.random_search(
      {'lr': np.array([0.1, 0.3])}, public_trial,
      distribution=tuning.Poisson(mean=1e-3), noise_multiplier=5.0,
      delta=DELTA, make_event=dp_accounting.GaussianDpEvent,
      score_source='public', key=7)
  assert result.num_trials == 0 and result.best is None
  assert math.isfinite(result.epsilon)


def test_random_search_refuses_a_forced_number_of_trials():
  """A distribution that draws K its own way (here always 3) while
  declaring the parameters that are accounted is refused."""

  class AlwaysThree(tuning.Poisson):

    def sample(self, key):
      return 3

  with pytest.raises(TypeError, match='declared distribution'):
    tuning.random_search(
        SPACE, public_trial, distribution=AlwaysThree(mean=10.0),
        noise_multiplier=5.0, delta=DELTA,
        make_event=dp_accounting.GaussianDpEvent, score_source='public',
        key=1)


def test_random_search_refuses_a_bare_score_declared_private():
  with pytest.raises(guards.PrivacyGuardError, match='bare score'):
    tuning.random_search(
        SPACE, public_trial, distribution=tuning.geometric(3.0),
        noise_multiplier=5.0, delta=DELTA,
        make_event=dp_accounting.GaussianDpEvent,
        score_source='private_release', key=2)


def _private_trial(compose_score):
  validation = np.linspace(0.0, 1.0, 200)

  def run_trial(config, noise_multiplier):
    score = tuning.private_score(validation * config['lr'],
                                 noise_multiplier=20.0)
    event = dp_accounting.GaussianDpEvent(noise_multiplier)
    if compose_score:
      event = dp_accounting.ComposedDpEvent([event, score.event])
    return score, TrialRun(event, config)

  return run_trial


def _make_private_event(z):
  return dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(z), dp_accounting.GaussianDpEvent(20.0)])


def test_random_search_takes_a_private_score_it_accounted():
  result = tuning.random_search(
      SPACE, _private_trial(compose_score=True),
      distribution=tuning.Poisson(4.0), noise_multiplier=5.0, delta=DELTA,
      make_event=_make_private_event, score_source='private_release', key=3)
  assert result.record.score_source == 'private_release'
  assert result.epsilon == tuning.search_epsilon(
      tuning.Poisson(4.0), _make_private_event(5.0), DELTA)


def test_random_search_refuses_a_private_score_left_out_of_the_accounting():
  with pytest.raises(guards.PrivacyGuardError, match='does not contain'):
    tuning.random_search(
        SPACE, _private_trial(compose_score=False),
        distribution=tuning.geometric(3.0), noise_multiplier=5.0,
        delta=DELTA, make_event=dp_accounting.GaussianDpEvent,
        score_source='private_release', key=4)


def test_random_search_refuses_a_trial_that_ran_another_event():
  def costlier_trial(config, noise_multiplier):
    # A config that would double the epochs: twice the accounted event.
    return 0.0, TrialRun(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(noise_multiplier), 2), config)

  with pytest.raises(guards.PrivacyGuardError, match='not the accounted'):
    tuning.random_search(
        SPACE, costlier_trial, distribution=tuning.geometric(3.0),
        noise_multiplier=5.0, delta=DELTA,
        make_event=dp_accounting.GaussianDpEvent, score_source='public',
        key=5)


def _linear_loss(params, example):
  return optax.sigmoid_binary_cross_entropy(
      example['x'] @ params['w'] + params['b'], example['y'])


def _dpsgd_plan(learning_rate, noise_multiplier, epochs=1):
  return plans.dpsgd(_linear_loss, optimizer=optax.sgd(learning_rate),
                     num_examples=64, batch_size=16, epochs=epochs,
                     l2_clip=1.0, delta=DELTA,
                     noise_multiplier=noise_multiplier, method='rdp')


TEMPLATE = None


def _plan_event(noise_multiplier):
  # The event of the plan each trial builds, without building one per
  # calibration step.
  global TEMPLATE
  if TEMPLATE is None:
    TEMPLATE = _dpsgd_plan(0.1, 1.0)
  return accounting.dp_event(TEMPLATE.mechanism, noise_multiplier,
                             TEMPLATE.participation)


def test_trials_run_as_plans_and_a_plan_that_spends_more_is_refused():
  def run_trial(config, noise_multiplier):
    plan = _dpsgd_plan(config['lr'], noise_multiplier, config['epochs'])
    return -abs(config['lr'] - 0.1), plan   # declared public score

  common = dict(distribution=tuning.geometric(2.0), noise_multiplier=3.0,
                delta=DELTA, make_event=_plan_event, score_source='public')
  result = tuning.random_search({'lr': [0.1, 0.3], 'epochs': [1]},
                                run_trial, key=8, **common)
  assert all(trial.result.event == _plan_event(3.0)
             for trial in result.trials)
  with pytest.raises(guards.PrivacyGuardError, match='not the accounted'):
    tuning.random_search({'lr': [0.1], 'epochs': [2]}, run_trial, key=9,
                         **common)


def test_random_search_input_errors():
  common = dict(distribution=tuning.geometric(3.0), delta=DELTA,
                make_event=dp_accounting.GaussianDpEvent, key=6)
  with pytest.raises(ValueError, match='score_source'):
    tuning.random_search(SPACE, public_trial, noise_multiplier=5.0,
                         score_source='validation', **common)
  with pytest.raises(ValueError, match='exactly one'):
    tuning.random_search(SPACE, public_trial, score_source='public',
                         **common)
  with pytest.raises(TypeError, match='space'):
    tuning.random_search(['lr'], public_trial, noise_multiplier=5.0,
                         score_source='public', **common)


def test_private_score_noise_has_the_stated_scale():
  """KS test: accepts the stated std, rejects 2/3 and 3/2 of it."""
  scores = np.ones(50)
  z = 4.0
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', keys.KeyReuseWarning)
    noise = np.array([
        tuning.private_score(scores, noise_multiplier=z, key=seed).value * 50
        - 50 for seed in range(400)])
  assert stats.kstest(noise / z, 'norm').pvalue > 1e-3
  for wrong in (2 / 3, 3 / 2):
    assert stats.kstest(noise / (wrong * z), 'norm').pvalue < 1e-3


# ------------------------------------------------------------------- docs


def test_the_docs_page_runs():
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'docs',
                      'tuning.md')
  with open(path) as f:
    blocks = re.findall(r'^```python\n(.*?)^```', f.read(), re.S | re.M)
  assert blocks
  namespace = {'__name__': '__docs__'}
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    for code in blocks:
      exec(compile(textwrap.dedent(code), 'docs/tuning.md', 'exec'),  # pylint: disable=exec-used
           namespace)
  assert namespace['result'].epsilon <= 2.0
