"""Tests of `dpsco_jax.audit`: the statistics, and audits of every family.

Every family is audited with a white-box gradient canary on a tiny model
(d = 4, batch 8, 8 steps) at a claimed epsilon of 2 (delta 1e-5), from the
library's own accountant for the mechanism and participation the run uses.
Three things are asserted per family:

* the correct build's lower bound stays below the claim;
* a null audit (no canary in either arm) gives about 0;
* planted bugs (noise on the mean instead of the sum, i.e. the noise
  multiplier divided by the batch size, and sigma / 10) push the bound
  ABOVE the claim, so the auditor would catch them.

The correct build's bound is far from the claim (0.15-0.8 against 2 over
60 seeds, 2000 runs per arm) and a bug's far above it (4.3-4.7 over 8 seeds
with 1000 runs per arm, the ceiling being about 4.7): the assertions are
not on a knife edge, and each can fail (the bound of a correct build fails
the bug assertion, a build with a bug fails the correct-build one, and the
null audit, run on the leakiest build, fails once the canary is put back).
"""

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import audit
from dpsco_jax import batching
from dpsco_jax import runs
from dpsco_jax.algorithms import diff2_accounting
from dpsco_jax.neighboring import NeighboringRelation

DELTA = 1e-5
TARGET_EPSILON = 2.0
NUM_STEPS = 8
STEPS_PER_EPOCH = 4            # two epochs in a fixed order
BATCH_SIZE = 8
NUM_RUNS = 1000                # per arm, for bugs and null audits
# Per arm for correct builds: at claimed epsilon 2 a canary is about
# 0.5-GDP, and 1500 evaluated runs per arm reliably see it (bounds
# 0.15-0.8 over 60 seeds), where 750 runs sometimes bound it by < 0.1.
CORRECT_RUNS = 2000


# ---------------------------------------------------------------------------
# Statistics.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize('k,n,alpha', [(0, 50, 0.05), (3, 50, 0.05),
                                       (25, 50, 0.01), (49, 50, 0.1),
                                       (50, 50, 0.05), (7, 1000, 0.001)])
def test_clopper_pearson_matches_beta_quantiles(k, n, alpha):
  upper = audit.clopper_pearson_upper(k, n, alpha)
  lower = audit.clopper_pearson_lower(k, n, alpha)
  expected_upper = 1.0 if k == n else stats.beta.ppf(1 - alpha, k + 1, n - k)
  expected_lower = 0.0 if k == 0 else stats.beta.ppf(alpha, k, n - k + 1)
  np.testing.assert_allclose(upper, expected_upper, rtol=1e-10)
  np.testing.assert_allclose(lower, expected_lower, rtol=1e-10)
  assert lower <= k / n <= upper


def test_clopper_pearson_covers_at_its_level():
  # One-sided: the upper bound falls below the truth in about alpha of the
  # experiments, never much more.
  rng = np.random.default_rng(0)
  p, n, alpha = 0.1, 200, 0.1
  counts = rng.binomial(n, p, size=4000)
  misses = np.mean(audit.clopper_pearson_upper(counts, n, alpha) < p)
  assert misses <= alpha
  misses = np.mean(audit.clopper_pearson_lower(counts, n, alpha) > p)
  assert misses <= alpha


def test_clopper_pearson_rejects_bad_counts():
  with pytest.raises(ValueError):
    audit.clopper_pearson_upper(5, 4, 0.05)
  with pytest.raises(ValueError):
    audit.clopper_pearson_lower(1, 4, 1.5)


def test_epsilon_from_rates():
  np.testing.assert_allclose(audit.epsilon_from_rates(0.5, 0.05, 0.0),
                             math.log(10))
  # The second inequality: 1 - FPR <= e^eps (1 - TPR) + delta.
  np.testing.assert_allclose(audit.epsilon_from_rates(0.99, 0.5, 0.0),
                             math.log(50))
  assert audit.epsilon_from_rates(0.3, 0.5, 0.0) == 0.0
  assert audit.epsilon_from_rates(1e-6, 0.0, 1e-5) == 0.0


def _gdp_scores(mu, n, seed):
  rng = np.random.default_rng(seed)
  return rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)


@pytest.mark.parametrize('mu', [1.0, 2.0, 3.0])
def test_epsilon_lower_bound_below_gaussian_truth(mu):
  # Scores of a mu-GDP mechanism: N(mu, 1) with the canary, N(0, 1) without.
  scores_in, scores_out = _gdp_scores(mu, 20000, seed=int(mu))
  truth = accounting.epsilon_for_gdp(mu, DELTA)
  bound = audit.epsilon_lower_bound(scores_in, scores_out, DELTA,
                                    thresholds=np.linspace(-1, 5, 13))
  assert 0.0 < bound.epsilon < truth
  # Not vacuous: within a factor of the truth with 20k samples per arm.
  assert bound.epsilon > 0.3 * truth
  assert bound.thresholds.shape == bound.tpr.shape == bound.epsilons.shape
  assert np.all(bound.tpr_lower <= bound.tpr)
  assert np.all(bound.fpr_upper >= bound.fpr)
  assert bound.roc_fpr[0] == 0 and bound.roc_tpr[-1] == 1


def test_epsilon_lower_bound_is_zero_without_signal():
  scores_in, scores_out = _gdp_scores(0.0, 5000, seed=7)
  bound = audit.epsilon_lower_bound(scores_in, scores_out, DELTA,
                                    thresholds=np.linspace(-3, 3, 25))
  assert bound.epsilon < 0.1


def test_epsilon_lower_bound_pays_for_every_threshold():
  # Bonferroni: the same threshold tried 20 times gives a lower bound.
  scores_in, scores_out = _gdp_scores(2.0, 2000, seed=3)
  once = audit.epsilon_lower_bound(scores_in, scores_out, DELTA,
                                   thresholds=[2.0])
  twenty = audit.epsilon_lower_bound(scores_in, scores_out, DELTA,
                                     thresholds=[2.0] * 20)
  assert twenty.epsilon < once.epsilon


def test_epsilon_lower_bound_rejects_non_finite_scores():
  with pytest.raises(ValueError, match='non-finite'):
    audit.epsilon_lower_bound([1.0, np.nan], [0.0, 1.0], DELTA,
                              thresholds=[0.5])


def test_one_run_p_value_is_the_binomial_tail_without_delta():
  q = 1 / (1 + math.exp(-1.0))
  np.testing.assert_allclose(
      audit.one_run_p_value(1000, 100, 70, 1.0, 0.0),
      stats.binom.sf(69, 100, q), rtol=1e-12)
  # The delta term only adds.
  assert audit.one_run_p_value(1000, 100, 70, 1.0, 1e-3) > (
      audit.one_run_p_value(1000, 100, 70, 1.0, 0.0))


def test_one_run_p_value_delta_term_matches_its_definition():
  # Theorem 3.1's delta term, written out independently: the largest, over
  # i = 1..v, of P[v - i <= B < v] / i, summed pmf by pmf.
  m, r, v, eps, delta = 1000, 60, 45, 1.5, 1e-4
  q = math.exp(eps) / (1 + math.exp(eps))
  pmf = [stats.binom.pmf(j, r, q) for j in range(r + 1)]
  worst = max(sum(pmf[v - i:v]) / i for i in range(1, v + 1))
  expected = stats.binom.sf(v - 1, r, q) + 2 * m * delta * worst
  np.testing.assert_allclose(audit.one_run_p_value(m, r, v, eps, delta),
                             expected, rtol=1e-9)
  # The delta term makes the bound smaller, never larger.
  rng = np.random.default_rng(13)
  included = rng.random(2000) < 0.5
  scores = rng.normal(2.0 * included, 1.0)
  pure = audit.one_run_epsilon_lower_bound(scores, included, delta=0.0)
  approx = audit.one_run_epsilon_lower_bound(scores, included, delta=1e-4)
  assert 0.0 < approx.epsilon < pure.epsilon


def test_one_run_bound_below_gaussian_truth():
  # m canaries, each a mu-GDP Gaussian mechanism on its own coordinate.
  mu, m = 3.0, 5000
  rng = np.random.default_rng(11)
  included = rng.random(m) < 0.5
  scores = rng.normal(mu * included, 1.0)
  bound = audit.one_run_epsilon_lower_bound(
      scores, included, delta=DELTA, num_positive_guesses=250,
      num_negative_guesses=250)
  truth = accounting.epsilon_for_gdp(mu, DELTA)
  assert 1.0 < bound.epsilon < truth
  assert bound.num_guesses == 500 and bound.num_correct <= 500
  assert bound.p_value < 0.05


def test_one_run_bound_is_zero_for_random_guesses():
  rng = np.random.default_rng(12)
  included = rng.random(5000) < 0.5
  bound = audit.one_run_epsilon_lower_bound(
      rng.normal(size=5000), included, delta=DELTA)
  assert bound.epsilon < 0.3


# ---------------------------------------------------------------------------
# Every family, white-box gradient canary.
# ---------------------------------------------------------------------------


def _strategy():
  return dpsco_jax.optimize_strategy(dpsco_jax.workload(NUM_STEPS),
                                     num_epochs=NUM_STEPS // STEPS_PER_EPOCH)


def _library_family(name):
  """(claimed epsilon fn, noise multiplier, builder, runner kwargs)."""
  fixed_order = accounting.FixedOrder(NUM_STEPS // STEPS_PER_EPOCH,
                                      STEPS_PER_EPOCH)
  epochs = dict(steps_per_epoch=STEPS_PER_EPOCH)
  if name == 'dpsgd':
    mechanism, participation = dpsco_jax.dpsgd_mechanism(NUM_STEPS), (
        fixed_order)

    def build(z):
      return lambda loss_fn, key: dpsco_jax.dpsgd(
          loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=NUM_STEPS,
          key=key)
    kwargs = epochs
  elif name == 'dpftrl':
    mechanism, participation = dpsco_jax.dpftrl_mechanism(NUM_STEPS), (
        fixed_order)

    def build(z):
      return lambda loss_fn, key: optax.chain(
          dpsco_jax.dpftrl(loss_fn, l2_clip=1.0, noise_multiplier=z,
                           num_steps=NUM_STEPS, key=key),
          optax.sgd(0.1, momentum=0.9))
    kwargs = epochs
  elif name == 'dpmemf':
    strategy = _strategy()
    mechanism, participation = dpsco_jax.dpmemf_mechanism(strategy), (
        fixed_order)

    def build(z):
      return lambda loss_fn, key: dpsco_jax.dpmemf(
          loss_fn, l2_clip=1.0, noise_multiplier=z, strategy=strategy,
          steps_per_epoch=STEPS_PER_EPOCH,
          num_examples=STEPS_PER_EPOCH * BATCH_SIZE, key=key)
    kwargs = epochs
  elif name == 'dp_srg_memf':
    strategy = _strategy()
    mechanism, participation = dpsco_jax.dpmemf_mechanism(strategy), (
        fixed_order)

    def build(z):
      return lambda loss_fn, key: optax.chain(
          dpsco_jax.dp_srg_memf(loss_fn, l2_clip=1.0, noise_multiplier=z,
                                strategy=strategy,
                                steps_per_epoch=STEPS_PER_EPOCH, decay=0.5,
                                num_examples=STEPS_PER_EPOCH * BATCH_SIZE,
                                key=key),
          optax.sgd(0.1))
    kwargs = epochs
  elif name == 'accelerated_dp_srgd':
    # Single pass (the algorithm's own accounting), canary in batch 2.
    mechanism = dpsco_jax.srg_mechanism(NUM_STEPS)
    participation = accounting.single_epoch(NUM_STEPS)

    def build(z):
      return lambda loss_fn, key: dpsco_jax.accelerated_dp_srgd(
          loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=NUM_STEPS,
          beta=10.0, radius=None, key=key)
    kwargs = dict(steps_per_epoch=NUM_STEPS, canary_batch=2)
  else:
    raise ValueError(name)
  z = accounting.calibrate_noise_multiplier(mechanism, participation,
                                            TARGET_EPSILON, DELTA)
  claimed = accounting.epsilon_spent(mechanism, z, participation, DELTA)
  return claimed, z, build, kwargs


def _dp_gd_family():
  # DIFF2 with a restart every round (DP-GD), one client holding the whole
  # batch: the canary takes part in every round; replace-one neighbours.
  z = diff2_accounting.calibrate(num_rounds=NUM_STEPS, restart_interval=1,
                                 epsilon=TARGET_EPSILON,
                                 delta=DELTA).restart
  claimed = diff2_accounting.epsilon_spent(
      NUM_STEPS, 1, dpsco_jax.Diff2NoiseMultipliers(z, 0.0), DELTA)

  def build(z):
    return lambda loss_fn, key: dpsco_jax.dp_gd(
        loss_fn, learning_rate=0.1, grad_clip=1.0, noise_multiplier=z,
        num_rounds=NUM_STEPS, key=key)
  return claimed, z, build, dict(
      steps_per_epoch=1, neighboring_relation=NeighboringRelation.REPLACE_ONE)


@functools.lru_cache(maxsize=None)
def _family(name):
  # Calibrated once per family: the accountant's search is the slow part.
  return _dp_gd_family() if name == 'dp_gd' else _library_family(name)


def _audit(build, kwargs, claimed, *, canary_norm=1e3, seed=0,
           num_runs=NUM_RUNS):
  return audit.run_gradient_canary_audit(
      build, num_steps=NUM_STEPS, batch_size=BATCH_SIZE, num_runs=num_runs,
      claimed_epsilon=claimed, delta=DELTA, key=seed,
      canary_norm=canary_norm, **kwargs)


FAMILIES = ('dpsgd', 'dpftrl', 'dpmemf', 'dp_srg_memf',
            'accelerated_dp_srgd', 'dp_gd')


@pytest.mark.parametrize('name', FAMILIES)
def test_correct_build_stays_below_claim_and_null_is_zero(name):
  claimed, z, build, kwargs = _family(name)
  assert claimed == pytest.approx(TARGET_EPSILON, rel=1e-3)
  report = _audit(build(z), kwargs, claimed, num_runs=CORRECT_RUNS)
  assert report.epsilon_lower_bound < claimed, report.to_markdown()
  assert not report.exceeds_claim
  # The canary is seen (the audit is not blind) ...
  assert report.epsilon_lower_bound > 0.1, report.to_markdown()
  # ... and without it in either arm there is nothing to see, even in the
  # leakiest build (sigma / 10, where the canary gives a bound above 5):
  # the bound measures the canary, not the noise level.
  null = _audit(build(z / 10), kwargs, claimed, canary_norm=0.0, seed=1)
  assert null.epsilon_lower_bound < 0.1, null.to_markdown()


# Noise on the mean instead of the sum: the std is divided by the batch
# size, i.e. the multiplier is z / B while the run claims z's epsilon.
BUGS = {'noise on the mean': BATCH_SIZE, 'sigma / 10': 10.0}


@pytest.mark.parametrize('name', FAMILIES)
@pytest.mark.parametrize('bug', sorted(BUGS))
def test_planted_bug_is_caught(name, bug):
  claimed, z, build, kwargs = _family(name)
  report = _audit(build(z / BUGS[bug]), kwargs, claimed, seed=2)
  assert report.epsilon_lower_bound > claimed, report.to_markdown()
  assert report.exceeds_claim
  assert 'VIOLATION' in report.to_markdown()


def test_diff2_with_difference_rounds_stays_below_claim():
  # DIFF2-GD proper (restart every 4 rounds): the linear canary has no
  # gradient differences, so only restarts reveal it; still a lower bound.
  z = diff2_accounting.calibrate(num_rounds=NUM_STEPS, restart_interval=4,
                                 epsilon=TARGET_EPSILON, delta=DELTA)
  claimed = diff2_accounting.epsilon_spent(NUM_STEPS, 4, z, DELTA)

  def build(loss_fn, key):
    return dpsco_jax.diff2_gd(
        loss_fn, learning_rate=0.1, grad_clip=1.0, diff_clip_factor=1.0,
        restart_interval=4, num_rounds=NUM_STEPS, noise_multipliers=z,
        key=key)
  report = _audit(build, dict(
      steps_per_epoch=1,
      neighboring_relation=NeighboringRelation.REPLACE_ONE), claimed,
                  num_runs=CORRECT_RUNS)
  assert 0.1 < report.epsilon_lower_bound < claimed


# ---------------------------------------------------------------------------
# Black-box, one-run and hand-written loops.
# ---------------------------------------------------------------------------


def _logistic_problem():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH_SIZE, 4)).astype(np.float32)
  x[:, 0] = 0.0       # the canary's feature is unused by the data
  data = {'x': x, 'y': rng.integers(0, 2, BATCH_SIZE).astype(np.int32)}
  canary = {'x': np.array([10.0, 0, 0, 0], np.float32),
            'y': np.array(1, np.int32)}

  def loss_fn(params, example):
    logit = jnp.vdot(params['w'], example['x']) + params['b']
    return jax.nn.softplus(-(2 * example['y'] - 1) * logit)
  params = {'w': jnp.zeros(4), 'b': jnp.zeros(())}
  return loss_fn, params, data, canary


@pytest.mark.parametrize('divisor', [1.0, 10.0])
def test_black_box_input_canary(divisor):
  # Full-batch DP-SGD, 4 steps; the canary is masked out in the out arm
  # (add/remove), so the transformation has a public normalizer.
  loss_fn, params, data, canary = _logistic_problem()
  steps = 4
  mechanism = dpsco_jax.dpsgd_mechanism(steps)
  participation = accounting.FixedOrder(steps, 1)
  z = accounting.calibrate_noise_multiplier(mechanism, participation,
                                            TARGET_EPSILON, DELTA)
  report = audit.run_input_canary_audit(
      lambda loss_fn, key: optax.chain(
          dpsco_jax.dpsgd(loss_fn, l2_clip=1.0,
                          noise_multiplier=z / divisor, num_steps=steps,
                          normalize_by=BATCH_SIZE, key=key),
          optax.sgd(0.01)),
      loss_fn=loss_fn, params=params, data=data, canary=canary,
      score_fn=lambda p, c: -loss_fn(p, c), num_steps=steps,
      batch_size=BATCH_SIZE, steps_per_epoch=1, num_runs=NUM_RUNS,
      claimed_epsilon=TARGET_EPSILON, delta=DELTA, key=5)
  if divisor == 1.0:
    assert 0.0 < report.epsilon_lower_bound < TARGET_EPSILON
  else:
    assert report.epsilon_lower_bound > TARGET_EPSILON


@pytest.mark.parametrize('divisor', [1.0, 10.0])
def test_one_run_gradient_canaries(divisor):
  steps = 4
  mechanism = dpsco_jax.dpsgd_mechanism(steps)
  z = accounting.calibrate_noise_multiplier(
      mechanism, accounting.single_epoch(steps), TARGET_EPSILON, DELTA)
  report = audit.run_one_run_gradient_audit(
      lambda loss_fn, key: dpsco_jax.dpsgd(
          loss_fn, l2_clip=1.0, noise_multiplier=z / divisor,
          num_steps=steps, key=key),
      num_canaries=1000, num_steps=steps, batch_size=250,
      claimed_epsilon=TARGET_EPSILON, delta=DELTA, key=6)
  assert report.method == 'one-run'
  if divisor == 1.0:
    assert report.epsilon_lower_bound < TARGET_EPSILON
  else:
    assert report.epsilon_lower_bound > TARGET_EPSILON
  assert 'guesses' in report.to_markdown()


def _hand_written_dpsgd(z, *, reuse_key):
  """A user's own DP-SGD loop; `reuse_key` plants a key-reuse bug."""
  clip, steps = 1.0, 4
  canary = jnp.array([1e3, 0.0, 0.0, 0.0])

  def train_fn(key, include):
    def step(params, t):
      grads = jnp.where(include & (t == 1), canary, jnp.zeros(4))[None]
      norms = jnp.linalg.norm(grads, axis=-1, keepdims=True)
      clipped = grads * jnp.minimum(1.0, clip / jnp.maximum(norms, 1e-12))
      noise_key = key if reuse_key else jax.random.fold_in(key, t)
      noisy = clipped.sum(0) + z * clip * jax.random.normal(noise_key, (4,))
      return params - 0.1 * noisy, noisy[0]
    _, released = jax.lax.scan(step, jnp.zeros(4), jnp.arange(steps))
    return released
  return train_fn


@pytest.mark.parametrize('reuse_key', [False, True])
def test_hand_written_loop(reuse_key):
  steps = 4
  z = accounting.calibrate_noise_multiplier(
      dpsco_jax.dpsgd_mechanism(steps), accounting.single_epoch(steps),
      TARGET_EPSILON, DELTA)
  report = audit.run_canary_audit(
      _hand_written_dpsgd(z, reuse_key=reuse_key), num_runs=CORRECT_RUNS,
      claimed_epsilon=TARGET_EPSILON, delta=DELTA, key=8)
  if reuse_key:
    # The same noise every step: a difference of two releases cancels it.
    assert report.epsilon_lower_bound > TARGET_EPSILON
  else:
    assert 0.1 < report.epsilon_lower_bound < TARGET_EPSILON


def test_run_keys_are_folded_from_the_run_index():
  keys = audit.run_keys(3, 5)
  for i in range(5):
    np.testing.assert_array_equal(
        jax.random.key_data(keys[i]),
        jax.random.key_data(jax.random.fold_in(jax.random.key(3), i)))
  # A smaller audit's runs are the first runs of a larger one.
  np.testing.assert_array_equal(jax.random.key_data(audit.run_keys(3, 2)),
                                jax.random.key_data(keys[:2]))
  assert len(np.unique(jax.random.key_data(keys), axis=0)) == 5
  with pytest.raises(ValueError, match='key'):
    audit.run_keys(None, 5)


def test_report_markdown_and_roc_plot(tmp_path):
  pytest.importorskip('matplotlib')
  scores_in, scores_out = _gdp_scores(1.0, 400, seed=4)
  report = audit.audit_observations(scores_in, scores_out,
                                    claimed_epsilon=2.0, delta=DELTA,
                                    name='synthetic')
  text = report.to_markdown()
  assert '| claimed epsilon | 2.000' in text
  assert '| threshold | TPR | FPR |' in text
  assert report.confidence == pytest.approx(0.95)
  path = tmp_path / 'roc.png'
  audit.plot_roc([report, report], str(path), title='two panels')
  assert path.stat().st_size > 10_000
  linear = tmp_path / 'roc_linear.png'
  audit.plot_roc(report, str(linear), log_scale=False)
  assert linear.stat().st_size > 10_000


def test_docs_examples_run(tmp_path, monkeypatch):
  # docs/audit.md's code blocks, as written: every family's recipe, a
  # hand-written loop and a loop with a library transformation inside.
  pytest.importorskip('matplotlib')
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  docs = pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'audit.md'
  blocks = re.findall(r'```python\n(.*?)```', docs.read_text(), re.S)
  assert len(blocks) == 4
  monkeypatch.chdir(tmp_path)     # the first block writes roc.png
  for block in blocks[:3]:
    namespace = {'print': lambda *args: None}
    exec(compile(block, str(docs), 'exec'), namespace)  # pylint: disable=exec-used
    report = namespace['report']
    assert 0.0 < report.epsilon_lower_bound < report.claimed_epsilon
  assert (tmp_path / 'roc.png').exists()
  # "How to audit a plan": as written but with 150 runs per arm instead of
  # 1000 (the full audits are test_audit_plan_poisson_dpsgd_below_...).
  plan_block = blocks[3].replace('num_runs=1000', 'num_runs=150')
  assert plan_block.count('num_runs=150') == 2
  namespace = {'print': lambda *args: None}
  exec(compile(plan_block, str(docs), 'exec'), namespace)  # pylint: disable=exec-used
  assert namespace['report'].claimed_epsilon == namespace['plan'].epsilon


def test_refused_step_is_not_scored():
  # A run past its noise's capacity is refused inside the program (NaN
  # output and a host error); the auditor never scores it.
  with pytest.raises(Exception, match='capacity|num_steps|past|non-finite'):
    audit.run_gradient_canary_audit(
        lambda loss_fn, key: dpsco_jax.dpsgd(
            loss_fn, l2_clip=1.0, noise_multiplier=1.0,
            num_steps=NUM_STEPS - 1, key=key),
        num_steps=NUM_STEPS, batch_size=BATCH_SIZE, num_runs=8,
        claimed_epsilon=1.0, delta=DELTA, key=0)


# ------------------------------------------------------------ auditing a plan


def _plan_problem():
  """A logistic regression whose canary uses a feature no row uses."""
  n, d = 64, 4
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, d)).astype(np.float32)
  x[:, 0] = 0.0
  data = {'x': x, 'y': rng.integers(0, 2, n).astype(np.int32)}
  canary = {'x': np.array([10.0, 0.0, 0.0, 0.0], np.float32),
            'y': np.int32(1)}

  def loss_fn(params, example):
    logit = jnp.vdot(params['w'], example['x']) + params['b']
    return optax.sigmoid_binary_cross_entropy(logit, example['y'])

  params = {'w': jnp.zeros(d), 'b': jnp.zeros(())}
  return data, canary, loss_fn, params


def _poisson_plan(loss_fn, **kw):
  # q = 48 / 64 = 0.75, T = round(2 * 64 / 48) = 3 Poisson steps.
  return dpsco_jax.plans.dpsgd(
      loss_fn, optimizer=optax.sgd(1.0), num_examples=64, batch_size=48,
      epochs=2, l2_clip=1.0, delta=DELTA, clipping_method='vmap', **kw)


def test_audit_plan_poisson_dpsgd_below_its_epsilon_and_a_planted_bug():
  data, canary, loss_fn, params = _plan_problem()
  plan = _poisson_plan(loss_fn, epsilon=TARGET_EPSILON)
  assert plan.hyperparameters['sampling'] == 'PoissonBatches'
  report = audit.audit_plan(plan, params=params, data=data, canary=canary,
                            loss_fn=loss_fn, num_runs=500, key=0)
  assert report.claimed_epsilon == plan.epsilon
  assert report.delta == plan.delta
  assert not report.exceeds_claim, report.to_markdown()
  # Planted bug: the plan claims its epsilon but adds a tenth of its noise.
  # Only the weak plan's transformation is used: RDP accounts it in
  # milliseconds (PLD takes seconds at so little noise).
  weak = _poisson_plan(loss_fn, noise_multiplier=plan.noise_multiplier / 10,
                       method='rdp')
  assert weak.noise_multiplier == plan.noise_multiplier / 10
  buggy = dataclasses.replace(plan, transformation=weak.transformation)
  report = audit.audit_plan(buggy, params=params, data=data, canary=canary,
                            loss_fn=loss_fn, num_runs=500, key=1)
  assert report.exceeds_claim, report.to_markdown()
  # Add/remove: the runs without the canary lack its row altogether (masked
  # out), so a data set that holds the canary itself at that row is still
  # told apart from its neighbour.
  own = {name: leaf.copy() for name, leaf in data.items()}
  own['x'][0], own['y'][0] = canary['x'], canary['y']
  report = audit.audit_plan(buggy, params=params, data=own, canary=canary,
                            loss_fn=loss_fn, num_runs=500, key=2)
  assert report.exceeds_claim, report.to_markdown()


def test_audit_plan_draws_each_runs_own_poisson_batches_and_noise():
  data, _, loss_fn, params = _plan_problem()
  plan = _poisson_plan(loss_fn, noise_multiplier=1.0)
  indices, masks = runs.run_batches(plan.batches,
                                      runs.sampler_seeds(0, 400))
  assert indices.shape[:2] == masks.shape[:2] == (400, plan.num_steps)
  assert indices.shape[2] % plan.batches.pad_to_multiple == 0
  indices, mask = indices[:, 0], masks[:, 0]
  # Row 0 (the canary's) is drawn with probability q = 0.75 in each run.
  drawn = np.array([np.any((i == 0) & m) for i, m in zip(indices, mask)])
  assert abs(drawn.mean() - 0.75) < 0.08
  # Runs draw different batches.
  assert len({tuple(i[m]) for i, m in zip(indices, mask)}) > 390
  # Every noise key of the plan's state is replaced by one of the run's.
  state = plan.transformation.init(params)
  fresh = runs.fresh_run_keys(state, jax.random.key(3))
  old = jax.tree_util.tree_leaves(state, is_leaf=dpsco_jax.keys.is_typed_key)
  new = jax.tree_util.tree_leaves(fresh, is_leaf=dpsco_jax.keys.is_typed_key)
  changed = [not np.array_equal(jax.random.key_data(a),
                                jax.random.key_data(b))
             for a, b in zip(old, new) if dpsco_jax.keys.is_typed_key(a)]
  assert changed and all(changed)
  with pytest.raises(ValueError, match='loss_fn= .* or score_fn='):
    audit.audit_plan(plan, params=params, data=data, canary=data, num_runs=4,
                     key=0)
  shuffled = dpsco_jax.plans.dpsgd(
      loss_fn, optimizer=optax.sgd(1.0), num_examples=64, batch_size=16,
      epochs=1, l2_clip=1.0, noise_multiplier=1.0, delta=DELTA,
      sampling='shuffled', clipping_method='vmap')
  with pytest.raises(ValueError, match='shuffled plan .* replacement='):
    audit.audit_plan(shuffled, params=params, data=data, canary=data,
                     loss_fn=loss_fn, num_runs=4, key=0)
  with pytest.raises(ValueError, match='num_examples = 64'):
    audit.audit_plan(plan, params=params, data={'x': np.zeros((3, 4))},
                     canary={'x': np.zeros(4)}, loss_fn=loss_fn,
                     num_runs=4, key=0)


def test_audit_plan_runs_fixed_order_and_full_batch_plans():
  # The noise multipliers are (rounded up) those that `epsilon=2.0`
  # calibrates to (4.884 and 3.453): claims just below the target without a
  # calibration each (the Poisson plan above is the calibrated case).
  data, canary, loss_fn, params = _plan_problem()
  ftrl = dpsco_jax.plans.dpftrl(
      loss_fn, optimizer=optax.sgd(1.0), num_examples=64, batch_size=16,
      epochs=2, l2_clip=1.0, noise_multiplier=4.9, delta=DELTA,
      clipping_method='vmap')
  assert 1.9 < ftrl.epsilon < TARGET_EPSILON
  report = audit.audit_plan(ftrl, params=params, data=data, canary=canary,
                            loss_fn=loss_fn, num_runs=100, key=0)
  assert report.claimed_epsilon == ftrl.epsilon
  assert report.epsilon_lower_bound <= report.claimed_epsilon
  gd = dpsco_jax.plans.dp_gd(loss_fn, learning_rate=1.0, num_rounds=3,
                             grad_clip=1.0, num_examples=64,
                             noise_multiplier=3.46, delta=DELTA,
                             clipping_method='vmap')
  assert 1.9 < gd.epsilon < TARGET_EPSILON
  report = audit.audit_plan(gd, params=params, data=data, canary=canary,
                            loss_fn=loss_fn, num_runs=100, key=0)
  assert report.claimed_epsilon == gd.epsilon
  assert report.epsilon_lower_bound <= report.claimed_epsilon


def test_audit_plan_raises_a_step_its_plan_refuses():
  # A fixed-order plan whose runs are fed batches reshuffled every epoch:
  # its order check refuses epoch 2 inside the audit's compiled runs, and
  # the audit raises the plan's refusal (not a bound on poisoned scores).
  data, canary, loss_fn, params = _plan_problem()
  ftrl = dpsco_jax.plans.dpftrl(
      loss_fn, optimizer=optax.sgd(1.0), num_examples=64, batch_size=16,
      epochs=2, l2_clip=1.0, noise_multiplier=1.0, delta=DELTA,
      clipping_method='vmap')
  reshuffled = dataclasses.replace(ftrl, batches=batching.ShuffledBatches(
      64, batch_size=16, num_epochs=2, seed=0))
  zero_out = {'x': np.zeros(4, np.float32), 'y': np.int32(0)}
  with pytest.raises(dpsco_jax.guards.PrivacyGuardError) as error:
    audit.audit_plan(reshuffled, params=params, data=data, canary=canary,
                     loss_fn=loss_fn, num_runs=2, key=0,
                     replacement=zero_out, progress=False)
  assert error.value.step == 4


# --------------------------------------------- auditing a plan at scale


LONG_ROWS, LONG_BATCH, LONG_EPOCHS = 100, 10, 30   # q = 0.1, 300 steps
LONG_RUNS = 200                                     # per arm


def _long_plan(**privacy):
  # The white-box linear model: an example's gradient is its `x`; rows use
  # coordinate 1 only, the canary coordinate 0 (clipped to norm 1).
  return dpsco_jax.plans.dpsgd(
      audit.linear_loss, optimizer=optax.sgd(1.0), num_examples=LONG_ROWS,
      batch_size=LONG_BATCH, epochs=LONG_EPOCHS, l2_clip=1.0, delta=DELTA,
      **privacy)


@functools.lru_cache(maxsize=None)
def _long_problem():
  rng = np.random.default_rng(0)
  x = np.zeros((LONG_ROWS, 2), np.float32)
  x[:, 1] = rng.normal(size=LONG_ROWS)
  canary = {'x': np.array([1e3, 0.0], np.float32)}
  plan = _long_plan(epsilon=TARGET_EPSILON)
  return plan, {'x': x}, canary


@pytest.mark.parametrize('divisor', [1.0, 10.0])
def test_audit_plan_of_300_poisson_steps_catches_a_tenth_of_the_noise(
    divisor):
  # 300 Poisson steps (q = 0.1): the canary joins about 30 of them. The
  # correct plan's bound stays below its epsilon; with a tenth of the noise
  # (still claiming it) the bound passes the claim, near the ceiling of 150
  # evaluated runs per arm (about 3).
  plan, data, canary = _long_problem()
  assert plan.num_steps == 300
  assert plan.hyperparameters['sampling'] == 'PoissonBatches'
  if divisor != 1.0:
    # Only its transformation is used: RDP accounts it fastest.
    weak = _long_plan(noise_multiplier=plan.noise_multiplier / divisor,
                      method='rdp')
    assert weak.noise_multiplier == plan.noise_multiplier / divisor
    plan = dataclasses.replace(plan, transformation=weak.transformation)
  report = audit.audit_plan(plan, params=jnp.zeros(2), data=data,
                            canary=canary, loss_fn=audit.linear_loss,
                            num_runs=LONG_RUNS, key=0)
  assert report.claimed_epsilon == pytest.approx(TARGET_EPSILON, rel=1e-5)
  print(report.to_markdown())
  if divisor == 1.0:
    assert not report.exceeds_claim, report.to_markdown()
  else:
    assert report.exceeds_claim, report.to_markdown()


def test_audit_plan_scores_do_not_depend_on_chunks_or_padding(monkeypatch):
  # A run's score depends on its key and its batches only: the same with
  # every run in one chunk, in uneven chunks, and when some runs are
  # re-padded wider (as a run with a batch past the common size is).
  data, canary, loss_fn, params = _plan_problem()
  plan = _poisson_plan(loss_fn, noise_multiplier=1.0)
  data = jax.tree_util.tree_map(jnp.asarray, data)

  def scores(**kw):
    return audit._plan_scores(
        plan, params=params, data=data, canary=canary,
        replacement={name: leaf[0] for name, leaf in data.items()},
        canary_index=0, masked=True,
        score_fn=lambda output, example: -loss_fn(output, example),
        output_fn=lambda p, s: p, num_runs=5, key=3, progress=False,
        **{'max_parallel': None, 'max_memory_bytes': 2**30, **kw})

  # A memory bound below one run: one run per chunk, with a warning.
  with pytest.warns(UserWarning, match='one at a time'):
    alone = scores(max_memory_bytes=1)
  # Uneven chunks of 4, and even runs "needing" twice the sampler's padded
  # size: those wait, and run in chunks of their own, padded wider, once
  # there are 4 of them (after the second chunk) and at the end.
  even_seeds = runs.sampler_seeds(3, 10)[0::2]
  even_first = [next(batching.reseeded(plan.batches, seed).iterate())[0]
                for seed in even_seeds]
  needed = runs.needed_width
  monkeypatch.setattr(runs, 'needed_width', lambda batches, multiple: (
      2 if any(np.array_equal(batches[0][0], first) for first in even_first)
      else 1) * needed(batches, multiple))
  widths = []
  padded_runs = runs.padded_runs
  monkeypatch.setattr(runs, 'padded_runs', lambda runs, width: (
      widths.append(width), padded_runs(runs, width))[1])
  np.testing.assert_allclose(scores(max_parallel=4), alone, rtol=1e-5)
  pad = plan.batches.pad_to_multiple
  assert widths == [pad, pad, 2 * pad, pad, 2 * pad], widths


def test_audit_plan_reports_runs_done_and_time_left(monkeypatch):
  data, canary, loss_fn, params = _plan_problem()
  plan = _poisson_plan(loss_fn, noise_multiplier=1.0)
  details = []

  @contextlib.contextmanager
  def task(what, progress=None):
    details.append(what)
    yield details.append

  monkeypatch.setattr(audit.progress_lib, 'task', task)
  audit.audit_plan(plan, params=params, data=data, canary=canary,
                   loss_fn=loss_fn, num_runs=12, key=0, max_parallel=8)
  assert details[0] == 'dpsco_jax: auditing the dpsgd plan (24 runs of 3 steps)'
  assert details[1] == 'compiling'
  assert details[2].startswith('8/24 runs (8 runs per chunk of about ')
  assert details[3].startswith('16/24 runs') and ', eta ' in details[3]
  assert details[4].startswith('24/24 runs') and details[4].endswith('eta 0 s')
