"""Paper 004's synthetic study: the problem's structure, the counts, a tiny run."""

import csv
import json
import math
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from configs import nonsmooth_synthetic as nonsmooth_config
from experiments import nonsmooth_synthetic


def tiny_config(**overrides):
  config = nonsmooth_config.get_config()
  config.dimensions = (4,)
  config.num_examples = 1_000
  config.anchor_batch_size, config.batch_size = 40, 20
  config.directions_per_dimension = 2
  config.tuning_seeds, config.seeds = 1, 2
  config.learning_rate_multipliers = (1.0,)
  config.proxy_samples = 4_096
  for name, value in overrides.items():
    setattr(config, name, value)
  return config


def test_the_loss_is_one_lipschitz_and_the_proxy_sees_the_structure():
  config = tiny_config()
  d = 8
  problem = nonsmooth_synthetic.make_problem(config, d)
  assert float(jnp.linalg.norm(problem.start)) == pytest.approx(
      config.start_distance, rel=1e-5)
  loss = nonsmooth_synthetic.example_loss(config.sphere_radius)
  xis = nonsmooth_synthetic.sample(config, problem, jax.random.key(0), 256)
  assert jnp.allclose(jnp.linalg.norm(xis, axis=1), config.spread, rtol=1e-5)
  points = jax.random.normal(jax.random.key(1), (256, d)) * 2.0
  # Compiled as one program each (not one per eager operation).
  norms = jax.jit(lambda p, xi: jnp.linalg.norm(
      jax.vmap(jax.grad(loss))(p, xi), axis=1))(points, xis)
  assert float(jnp.max(norms)) <= 1.0 + 1e-6  # L = 1, the clips' premise
  fresh = nonsmooth_synthetic.sample(config, problem, jax.random.key(2),
                                     16_384)
  compiled_proxy = jax.jit(lambda x: nonsmooth_synthetic.goldstein_proxy(
      loss, x, fresh, jax.random.key(3), config.smoothing_radius, 16_384))
  proxy = lambda x: float(compiled_proxy(x))
  # 0 is stationary (by symmetry); the start is not; the minimizing sphere
  # (radius sqrt(r^2 - spread^2) for large d, 0.87 here) nearly is.
  assert proxy(jnp.zeros(d)) < 0.03
  assert proxy(problem.start) > 0.9
  on_sphere = problem.start * (0.87 / config.start_distance)
  assert proxy(on_sphere) < 0.3


def test_loss_evaluations_count_every_oracle_call():
  config = tiny_config()
  plan = nonsmooth_synthetic.o2nc_plan(
      config, 'zero_effective', 4, 0.01, 0, num_examples=2_000,
      directions=8, noise_multiplier=1.0)   # counts need no calibration
  steps = plan.num_steps
  anchors = math.ceil(steps / config.period)
  # Zero order: 2 m values per estimate; a difference step makes two.
  expected = 2 * (anchors * 40 * 8 + (steps - anchors) * 20 * 2 * 8)
  assert nonsmooth_synthetic.loss_evaluations(plan, 2_000) == expected


def test_the_step_is_proposition_2_6_times_the_tuned_scale():
  config = tiny_config()
  plan = nonsmooth_synthetic.o2nc_plan(
      config, 'first_order', 4, 2.0, 0, num_examples=1_000, directions=4,
      noise_multiplier=1.0)   # the step's formula needs no calibration
  hyper = plan.hyperparameters
  assert hyper['learning_rate'] == pytest.approx(
      2.0 * config.movement_radius / (
          (1.0 + hyper['released_noise_norm']) *
          math.sqrt(config.block_length)))


def test_a_tiny_dimension_study_writes_its_outputs(tmp_path):
  config = tiny_config(methods=('zero_effective',))
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    summary = nonsmooth_synthetic.run(config, str(tmp_path))
  assert [r['method'] for r in summary] == ['zero_effective']
  for row in summary:
    assert row['seeds'] == 2
    assert row['epsilon'] <= config.epsilon * (1 + 1e-6)
    assert row['grid_edge'] == ''  # a one-value grid has no edge to flag
    assert 0.0 <= row['proxy'] <= 1.0
  # Effective clips at d = 4, m = 8 are the worst case (L d, 2 L d): the
  # concentration radius only helps for larger d / sqrt(m).
  assert summary[0]['anchor_clip'] == pytest.approx(4.0)
  assert summary[0]['difference_clip'] == pytest.approx(8.0)
  with open(os.path.join(tmp_path, 'runs.csv')) as f:
    runs = list(csv.DictReader(f))
  assert len(runs) == 1 + 2
  assert {r['phase'] for r in runs} == {'tuning', 'reported'}
  # Tuning seeds are disjoint from the reported ones.
  assert not ({r['seed'] for r in runs if r['phase'] == 'tuning'} &
              {r['seed'] for r in runs if r['phase'] == 'reported'})
  with open(os.path.join(tmp_path, 'run_record.json')) as f:
    assert json.load(f)['experiment'] == 'experiments.nonsmooth_synthetic'
  assert os.path.getsize(os.path.join(tmp_path,
                                      'proxy_vs_dimension.png')) > 0
  assert 'zero_effective | 4 |' in open(
      os.path.join(tmp_path, 'summary.md')).read()


def test_unknown_studies_and_methods_are_refused(tmp_path):
  with pytest.raises(ValueError, match='study must be one of'):
    nonsmooth_synthetic.run(tiny_config(study='both'), str(tmp_path))
  with pytest.raises(ValueError, match='unknown methods'):
    nonsmooth_synthetic.run(tiny_config(methods=('adam',)), str(tmp_path))


def test_a_pick_on_the_grid_edge_extends_the_grid(monkeypatch):
  # The proxy falls with the step up to 8, then rises: the pick on the upper
  # edge of (0.5, 1, 2) extends the grid by doubling until 8 is interior.
  def fake_run_one(config, method, dimension, value, seed, multi_pass=False):
    del config, method, dimension, multi_pass
    proxy = abs(math.log2(value) - 3.0) + (seed % 2) * 1e-3
    row = {k: 1.0 for k in ('proxy', 'empirical_proxy', 'loss', 'norm',
                            'learning_rate', 'num_steps', 'epsilon',
                            'noise_multiplier', 'anchor_clip',
                            'difference_clip', 'noise_norm',
                            'loss_evaluations')}
    return dict(row, proxy_last_block=proxy, value=value, seed=seed), None

  monkeypatch.setattr(nonsmooth_synthetic, 'run_one', fake_run_one)
  monkeypatch.setattr(nonsmooth_synthetic, 'stationary_floor',
                      lambda config, dimension: 0.0)
  config = tiny_config(learning_rate_multipliers=(0.5, 1.0, 2.0),
                       grid_extensions=3)
  runs, summary = nonsmooth_synthetic.tune_and_report(config, 'first_order', 4)
  assert summary['picked'] == 8.0
  assert summary['grid_edge'] == ''
  assert summary['grid'] == '0.5 1 2 4 8 16'
  assert sum(r['phase'] == 'tuning' for r in runs) == 6
  # With no extension allowed the edge pick is kept, and flagged.
  config.grid_extensions = 0
  _, summary = nonsmooth_synthetic.tune_and_report(config, 'first_order', 4)
  assert (summary['picked'], summary['grid_edge']) == (2.0, 'upper')
