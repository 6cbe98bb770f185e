"""Tests of `experiments.sweeps`: one vmapped program equals the runs alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from experiments import outputs
from experiments import sweeps

NUM_STEPS = 12


def _toy_train_fn(hparams, seed):
  """Noisy clipped gradient descent on a 3-d quadratic, as a scan."""
  key = jax.random.key(seed)
  target = jnp.array([1.0, -2.0, 3.0])

  def step(x, t):
    grad = x - target
    norm = jnp.linalg.norm(grad)
    grad = grad * jnp.minimum(1.0, hparams['clip'] / norm)
    noise = jax.random.normal(jax.random.fold_in(key, t), (3,))
    x = x - hparams['learning_rate'] * (grad + 0.1 * hparams['clip'] * noise)
    return x, jnp.sum((x - target) ** 2)

  x, curve = jax.lax.scan(step, jnp.zeros(3), jnp.arange(NUM_STEPS))
  return {'loss': curve[-1], 'curve': curve, 'x': x}


GRID = {'learning_rate': [0.1, 0.5], 'clip': [0.3, 1.0, 3.0]}
SEEDS = [0, 7, 11]


@pytest.fixture(scope='module')
def toy_result():
  return sweeps.run_sweep(_toy_train_fn, GRID, SEEDS)


def test_shapes_and_grid_order(toy_result):
  assert toy_result.names == ('learning_rate', 'clip')
  assert toy_result.metrics['loss'].shape == (6, 3)
  assert toy_result.metrics['curve'].shape == (6, 3, NUM_STEPS)
  assert toy_result.metrics['x'].shape == (6, 3, 3)
  # Cartesian product, last name fastest.
  np.testing.assert_allclose(
      toy_result.points,
      [[0.1, 0.3], [0.1, 1.0], [0.1, 3.0], [0.5, 0.3], [0.5, 1.0],
       [0.5, 3.0]], rtol=1e-12)
  np.testing.assert_array_equal(toy_result.seeds, SEEDS)
  assert toy_result.point(4) == {'learning_rate': 0.5, 'clip': 1.0}


def test_sweep_equals_each_run_alone(toy_result):
  single = jax.jit(_toy_train_fn)
  for g in range(toy_result.num_points):
    hparams = {k: jnp.float32(v) for k, v in toy_result.point(g).items()}
    for s, seed in enumerate(SEEDS):
      alone = single(hparams, jnp.int32(seed))
      for name, value in alone.items():
        np.testing.assert_allclose(toy_result.metrics[name][g, s], value,
                                   rtol=1e-5, atol=1e-6)


def test_shared_data_is_an_argument_not_a_constant(toy_result):
  """`data=` gives the same runs as closing over the same arrays."""
  target = jnp.array([1.0, -2.0, 3.0])

  def using_data(hparams, seed, data):
    key = jax.random.key(seed)

    def step(x, t):
      grad = x - data['target']
      grad = grad * jnp.minimum(1.0, hparams['clip'] / jnp.linalg.norm(grad))
      noise = jax.random.normal(jax.random.fold_in(key, t), (3,))
      x = x - hparams['learning_rate'] * (grad + 0.1 * hparams['clip'] *
                                          noise)
      return x, jnp.sum((x - data['target']) ** 2)

    _, curve = jax.lax.scan(step, jnp.zeros(3), jnp.arange(NUM_STEPS))
    return {'loss': curve[-1]}

  shared = sweeps.run_sweep(using_data, GRID, SEEDS,
                            data={'target': target}, max_parallel=5)
  np.testing.assert_allclose(shared.metrics['loss'],
                             toy_result.metrics['loss'], rtol=1e-5, atol=1e-6)


def test_seeds_and_points_give_different_runs(toy_result):
  loss = toy_result.metrics['loss']
  assert len(np.unique(np.round(loss, 6))) == loss.size


@pytest.mark.parametrize('max_parallel', [1, 4, 5, 18, 100])
def test_chunking_and_padding_do_not_change_results(toy_result,
                                                    max_parallel):
  # 18 runs: chunks of 4 and 5 need padding; 100 is capped at 18.
  chunked = sweeps.run_sweep(_toy_train_fn, GRID, SEEDS,
                             max_parallel=max_parallel)
  assert chunked.chunk_size == min(max_parallel, 18)
  for name, value in toy_result.metrics.items():
    np.testing.assert_allclose(chunked.metrics[name], value, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize('grid, match', [
    ({}, 'empty'),
    ({'clip': [0.0, 1.0]}, 'clip.*> 0'),
    ({'l2_clip': [-1.0]}, 'l2_clip.*> 0'),
    ({'learning_rate': [0.1, -0.1]}, 'learning_rate.*> 0'),
    ({'lr': [0.0]}, 'lr.*> 0'),
    ({'momentum': [0.9, float('nan')]}, 'finite'),
    ({'clip': [1.0, float('inf')]}, 'finite'),
    ({'clip': []}, 'non-empty'),
    ({'clip': 1.0}, 'sequence'),
    ({'clip': 'abc'}, 'sequence'),
    ({'clip': ['a']}, 'numbers'),
    ({'clip': [1.0, 1.0]}, 'repeats'),
])
def test_bad_grids_are_refused_on_the_host(grid, match):
  with pytest.raises(ValueError, match=match):
    sweeps.run_sweep(_toy_train_fn, grid, SEEDS)


def test_non_positive_values_are_fine_for_other_names():
  checked = sweeps.validate_grid({'momentum': [0.0, 0.9], 'shift': [-1.0]})
  np.testing.assert_array_equal(checked['momentum'], [0.0, 0.9])


@pytest.mark.parametrize('seeds, match', [
    ([], 'at least one'), ([0, 0], 'repeat'), ([-1], 'in \\['),
    ([2**31], 'in \\['), ([0.5], 'integers'), ([True], 'integers')])
def test_bad_seeds_are_refused(seeds, match):
  with pytest.raises(ValueError, match=match):
    sweeps.run_sweep(_toy_train_fn, GRID, seeds)


@pytest.mark.parametrize('max_parallel', [0, -2, 1.5, True])
def test_bad_max_parallel_is_refused(max_parallel):
  with pytest.raises(ValueError, match='max_parallel'):
    sweeps.run_sweep(_toy_train_fn, GRID, SEEDS, max_parallel=max_parallel)


def test_interval_matches_scipy():
  values = np.array([0.91, 0.88, 0.93, 0.90, 0.95, 0.89, 0.92])
  mean, std, n, half = sweeps.mean_and_interval(values)
  low, high = stats.t.interval(0.95, len(values) - 1, loc=values.mean(),
                               scale=stats.sem(values))
  assert n == 7
  assert mean == pytest.approx(values.mean())
  assert std == pytest.approx(values.std(ddof=1))
  assert mean - half == pytest.approx(low)
  assert mean + half == pytest.approx(high)
  # The formula of the docs, by hand: t_{0.975, 6} = 2.446912.
  assert half == pytest.approx(2.446912 * std / math.sqrt(7), rel=1e-6)
  _, _, _, half90 = sweeps.mean_and_interval(values, confidence=0.9)
  assert half90 == pytest.approx(
      stats.t.ppf(0.95, 6) * std / math.sqrt(7))


def test_interval_of_one_sample_is_nan():
  mean, std, n, half = sweeps.mean_and_interval([0.5])
  assert mean == 0.5 and n == 1 and np.isnan(std) and np.isnan(half)
  with pytest.raises(ValueError, match='confidence'):
    sweeps.mean_and_interval([1.0, 2.0], confidence=1.0)


def test_summarize_best_and_table(toy_result, tmp_path):
  rows = sweeps.summarize(toy_result, 'loss', labels={'algorithm': 'toy'})
  assert len(rows) == 6
  loss = toy_result.metrics['loss']
  for g, row in enumerate(rows):
    assert row['algorithm'] == 'toy' and row['n'] == 3
    assert row['learning_rate'] == toy_result.point(g)['learning_rate']
    assert row['mean'] == pytest.approx(loss[g].mean(), rel=1e-6)
    low, high = stats.t.interval(0.95, 2, loc=loss[g].mean(),
                                 scale=stats.sem(loss[g]))
    assert (row['ci_low'], row['ci_high']) == pytest.approx((low, high),
                                                            rel=1e-6)
  lowest = sweeps.best(rows, maximize=False)
  assert lowest['mean'] == min(r['mean'] for r in rows)
  assert sweeps.best(rows)['mean'] == max(r['mean'] for r in rows)
  table = sweeps.format_table(rows)
  lines = table.strip().split('\n')
  assert lines[0] == ('| algorithm | learning_rate | clip | mean | 95% CI | '
                      'std | n |')
  assert len(lines) == 2 + 6
  path = str(tmp_path / 'summary.csv')
  outputs.write_csv(path, rows)
  back = outputs.read_csv(path)
  assert [float(r['mean']) for r in back] == pytest.approx(
      [r['mean'] for r in rows])
  runs = sweeps.per_run_rows(toy_result, ['loss'])
  assert len(runs) == 18 and runs[4]['seed'] == 7


def test_summarize_refuses_curves_and_unknown_metrics(toy_result):
  with pytest.raises(ValueError, match='one scalar per run'):
    sweeps.summarize(toy_result, 'curve')
  with pytest.raises(KeyError, match='accuracy'):
    sweeps.summarize(toy_result, 'accuracy')


def test_best_skips_nan_rows():
  rows = [{'mean': float('nan')}, {'mean': 0.5}, {'mean': 0.2}]
  assert sweeps.best(rows)['mean'] == 0.5
  with pytest.raises(ValueError, match='finite'):
    sweeps.best([{'mean': float('nan')}])


def test_runs_spread_over_the_devices_give_the_same_results(toy_result):
  # 8 test devices (tests/conftest.py): a chunk of 8 runs is split over them.
  assert sweeps.run_sharding(8) is not None
  assert sweeps.run_sharding(6) is None
  spread = sweeps.run_sweep(_toy_train_fn, GRID, SEEDS + [3, 5], max_parallel=8)
  assert spread.chunk_size == 8
  np.testing.assert_allclose(spread.metrics['loss'][:, :3],
                             toy_result.metrics['loss'], rtol=1e-5, atol=1e-6)


def test_grid_edge_flags_picks_on_either_edge():
  grid = [0.3, 0.01, 0.1]  # any order
  assert sweeps.grid_edge(grid, 0.01) == 'lower'
  assert sweeps.grid_edge(grid, 0.3) == 'upper'
  assert sweeps.grid_edge(grid, 0.1) == ''
  assert sweeps.grid_edge([1.0], 1.0) == ''
  with pytest.raises(ValueError, match='not a value of the grid'):
    sweeps.grid_edge(grid, 0.2)


# ---------------------------------------------------------------------------
# Paper 003's descending learning-rate search with patience.


def test_descending_search_takes_the_largest_rate_that_completes():
  nan = float('nan')
  rates = [0.125, 0.5, 0.25]          # tried as 0.5, 0.25, 0.125
  losses = [[1.0, 0.9, 0.8, 0.7],     # 0.125: would complete
            [1.0, 0.5, nan, 0.1],     # 0.5: loss becomes NaN at check 2
            [1.0, 0.8, 0.6, 0.5]]     # 0.25: completes
  result = sweeps.descending_step_size_selection(rates, losses)
  assert result.selected == 2
  assert result.verdicts == ('not tried', 'nan', 'selected')
  assert result.stopped_at == (-1, 2, -1)


def test_patience_counts_checks_above_the_tolerance_and_resets_on_progress():
  # Four checks above 1.05 x best, then progress resets the counter, then
  # four more: the run never reaches a count of 5, so it completes.
  up = [1.0, 1.1, 1.1, 1.1, 1.1, 0.9, 1.0, 1.0, 1.0, 1.0]
  assert sweeps.descending_step_size_selection([0.5], [up]).selected == 0
  # A fifth check above the tolerance without progress rejects it.
  result = sweeps.descending_step_size_selection(
      [0.5, 0.1], [up[:5] + [1.2], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
  assert result.verdicts == ('patience', 'selected')
  assert result.stopped_at == (5, -1)
  # Losses within the tolerance of the best never count.
  flat = [1.0, 1.04, 1.04, 1.04, 1.04, 1.04, 1.04]
  assert sweeps.descending_step_size_selection([0.5], [flat]).selected == 0
  # The paper's parameters are the defaults; a stricter patience rejects.
  assert sweeps.descending_step_size_selection(
      [0.5], [up], patience=4).selected is None


def test_descending_search_reports_when_every_rate_fails_and_refuses_bad_input():
  inf = float('inf')
  result = sweeps.descending_step_size_selection([0.5, 0.25],
                                                 [[1.0, inf], [inf, 1.0]])
  assert result.selected is None
  assert result.verdicts == ('nan', 'nan')
  with pytest.raises(ValueError, match='one row per learning rate'):
    sweeps.descending_step_size_selection([0.5], [[1.0], [1.0]])
  with pytest.raises(ValueError, match='patience must be'):
    sweeps.descending_step_size_selection([0.5], [[1.0]], patience=0)


def test_edge_report_names_each_axis_on_an_edge():
  grid = {'learning_rate': [0.1, 0.3, 1.0], 'clip': [0.5, 1.0, 2.0],
          'decay': [0.1]}
  assert sweeps.edge_report({'learning_rate': 0.3, 'clip': 1.0,
                             'decay': 0.1}, grid) == ''
  assert sweeps.edge_report({'learning_rate': 1.0, 'clip': 0.5,
                             'decay': 0.1}, grid) == (
                                 'learning_rate upper, clip lower')
  with pytest.raises(ValueError, match="no value for axis 'clip'"):
    sweeps.edge_report({'learning_rate': 0.3, 'decay': 0.1}, grid)
  with pytest.raises(ValueError, match='not a value of the grid'):
    sweeps.edge_report({'learning_rate': 0.2, 'clip': 1.0, 'decay': 0.1},
                       grid)


def _one_run(inputs, offset):
  key = jax.random.key(inputs['seed'])
  return {'value': inputs['scale'] * jax.random.normal(key, (3,)) + offset}


def test_run_in_chunks_matches_each_run_alone_for_any_chunk():
  per_run = {'scale': np.array([0.5, 1.0, 2.0, 3.0, 4.0], np.float32),
             'seed': np.array([4, 1, 3, 3, 0], np.int32)}
  alone = np.stack([np.asarray(jax.jit(_one_run)(
      {k: v[r] for k, v in per_run.items()}, 1.5)['value'])
                    for r in range(5)])
  for max_parallel in (None, 1, 2, 3, 7):
    done = sweeps.run_in_chunks(_one_run, per_run, max_parallel=max_parallel,
                                shared=(1.5,))
    assert done.outputs['value'].shape == (5, 3)
    assert done.chunk_size == (5 if max_parallel is None
                               else min(max_parallel, 5))
    np.testing.assert_allclose(done.outputs['value'], alone, rtol=1e-6)


def test_run_in_chunks_refuses_ragged_or_empty_run_lists():
  with pytest.raises(ValueError, match='one entry per run'):
    sweeps.run_in_chunks(_one_run, {'scale': np.ones(3), 'seed': np.ones(2)},
                         shared=(0.0,))
  with pytest.raises(ValueError, match='one entry per run'):
    sweeps.run_in_chunks(_one_run, {'scale': np.ones(0), 'seed': np.ones(0)},
                         shared=(0.0,))
  with pytest.raises(ValueError, match='max_parallel'):
    sweeps.run_in_chunks(_one_run, {'scale': np.ones(2),
                                    'seed': np.ones(2, np.int32)},
                         max_parallel=0, shared=(0.0,))


def test_a_bounded_extension_stops_at_its_bound_and_the_pick_stays_flagged():
  # The best integer value is past the bound 8: the search extends 4 -> 8,
  # then the bounded `extend` can add nothing, so it stops there with the
  # pick still on the upper edge (the caller flags it).
  def extend(axis, values, edge):
    if axis != 'bands':
      return sweeps.extend_axis(values, edge)
    nxt = min(8.0, 2 * max(values)) if edge == 'upper' else max(
        1.0, min(values) // 2)
    return values if nxt in values else sorted(values + [nxt])

  asked = []

  def score(bands, lr):
    asked.append((bands, lr))
    return -bands + (math.log10(lr) + 1) ** 2

  picked, grid, scores = sweeps.search_with_extension(
      {'bands': [2.0, 4.0], 'lr': [0.1, 1.0]}, score, extensions=5,
      extend=extend)
  assert picked == {'bands': 8.0, 'lr': 0.1}
  assert grid['bands'] == [2.0, 4.0, 8.0]
  assert sweeps.grid_edge(grid['bands'], picked['bands']) == 'upper'
  # lr 0.1 was on the lower edge once: extended geometrically once, then
  # interior.
  assert grid['lr'] == [0.01, 0.1, 1.0]
  assert len(asked) == len(set(asked)) == len(scores)
  # Batched: two rounds, and no empty round once nothing can be extended.
  rounds = []

  def score_points(points):
    rounds.append(len(points))
    return [score(**point) for point in points]

  batched = sweeps.search_with_extension(
      {'bands': [2.0, 4.0], 'lr': [0.1, 1.0]}, extensions=5, extend=extend,
      score_points=score_points)
  assert batched[:2] == (picked, grid)
  assert rounds == [4, 5]
