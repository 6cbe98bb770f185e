"""The DIFF2 tabular experiment: loaders, preprocessing, clients, one tiny run."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import diff2_tabular as diff2_config
from experiments import diff2_tabular
from experiments import outputs
from experiments import tabular_data

SHARED = os.path.join(os.path.dirname(__file__), '..', '..', '..', 'shared',
                      'data')


def write_housing(path, wrapped):
  header = ('longitude,latitude,housing_median_age,total_rooms,'
            'total_bedrooms,population,households,median_income,'
            'median_house_value,ocean_proximity')
  rows = ['-122.2,37.9,41.0,880.0,129.0,322.0,126.0,8.3,452600.0,NEAR BAY',
          '-122.3,37.8,21.0,7099.0,,2401.0,1138.0,8.3,358500.0,NEAR BAY',
          '-121.0,36.0,30.0,1000.0,200.0,500.0,250.0,3.0,100000.0,INLAND']
  text = '\n'.join([header] + rows) + '\n'
  with open(path, 'w') as f:
    f.write(f"b'{text}'\n" if wrapped else text)


@pytest.mark.parametrize('wrapped', [False, True])
def test_california_loader(tmp_path, wrapped):
  write_housing(tmp_path / 'housing.csv', wrapped)
  x, y = tabular_data.load_california_housing(str(tmp_path))
  assert x.shape == (3, 8) and np.all(np.isfinite(x))
  np.testing.assert_allclose(y, [4.526, 3.585, 1.0])
  # Missing bedrooms imputed from the median bedrooms-per-room ratio.
  ratio = np.median([129 / 880, 200 / 1000])
  assert x[1, 3] == pytest.approx(7099 * ratio / 1138)


def test_missing_files_say_how_to_get_them(tmp_path):
  with pytest.raises(FileNotFoundError, match='StatLib'):
    tabular_data.load_california_housing(str(tmp_path))
  with pytest.raises(FileNotFoundError, match='archive.ics.uci.edu'):
    tabular_data.load_gas_turbine(str(tmp_path))


def test_gas_turbine_loader_concatenates_years_and_drops_nox(tmp_path):
  header = 'AT,AP,AH,AFDP,GTEP,TIT,TAT,TEY,CDP,CO,NOX\n'
  for year, co in ((2011, 1.5), (2012, 2.5)):
    with open(tmp_path / f'gt_{year}.csv', 'w') as f:
      f.write(header + ','.join(['1'] * 9 + [str(co), '80']) + '\n')
  x, y = tabular_data.load_gas_turbine(str(tmp_path))
  assert x.shape == (2, 9)
  np.testing.assert_array_equal(y, [1.5, 2.5])


@pytest.mark.skipif(not os.path.isdir(SHARED), reason='no shared data')
def test_shared_copies_have_the_paper_sizes():
  x, _ = tabular_data.load_california_housing(
      os.path.join(SHARED, 'california_housing'))
  assert x.shape == (20640, 8) and np.all(np.isfinite(x))
  x, _ = tabular_data.load_gas_turbine(os.path.join(SHARED, 'gas_turbine'))
  assert x.shape == (36733, 9)


def test_preprocessing_and_iid_clients():
  x, y = tabular_data.synthetic_regression(1003, 3)
  train, test = tabular_data.prepare(x * 5 + 2, y * 7, seed=1)
  assert len(test['y']) == 201 and len(train['y']) == 802
  # Statistics of the TRAINING rows only: the test rows leave no trace.
  np.testing.assert_allclose(train['x'].mean(0), 0, atol=1e-5)
  np.testing.assert_allclose(train['x'].std(0), 1, atol=1e-5)
  assert np.max(np.abs(train['y'])) == pytest.approx(1.0)
  assert np.abs(test['x'].mean(0)).max() > 1e-3
  changed = x * 5 + 2
  test_rows = np.random.default_rng(1).permutation(1003)[:201]
  changed[test_rows] *= 1000.0        # a test set from another world
  again, _ = tabular_data.prepare(changed, y * 7, seed=1)
  np.testing.assert_array_equal(again['x'], train['x'])
  np.testing.assert_array_equal(again['y'], train['y'])
  clients = tabular_data.split_clients(train, 10, seed=0)
  assert clients.x.shape == (10, 81, 3)
  assert set(clients.sizes.tolist()) == {80, 81} and clients.sizes.sum() == 802
  np.testing.assert_array_equal(clients.mask.sum(1), clients.sizes)
  dealt = np.sort(clients.y[clients.mask])
  np.testing.assert_array_equal(dealt, np.sort(train['y']))


def tiny_config(**overrides):
  config = diff2_config.get_config()
  config.num_rounds, config.eval_every, config.chunk_checks = 24, 4, 2
  config.synthetic_examples, config.num_clients = 400, 3
  config.tuning_seeds, config.eval_seeds = (0,), (1, 2)
  config.grad_clips, config.diff_clip_factors = (1.0, 10.0), (1.0,)
  config.restart_fractions = (0.25,)
  config.learning_rates = (64.0, 0.25)
  config.epsilons = (3.0,)
  config.update(overrides)
  return config


def test_search_batches_resume_exactly_where_runs_stop():
  """A lane's curve from the chunked, compacted search equals one straight
  run with the same key: leaving the batch (the other lanes blow up at
  rate 64) does not disturb the runs that stay."""
  config = tiny_config(patience=1000)   # only a blow-up stops a run
  data = diff2_tabular.seeded_data('synthetic', config, (0, 3))
  points = diff2_tabular.grid_points('diff2_gd', config)
  rates = (64.0, 0.25)
  interval = diff2_tabular.interval_of('diff2_gd', points[0], config)
  z = diff2_tabular.noise_multipliers('diff2_gd', interval, 3.0, config)
  engine = diff2_tabular._engine('diff2_gd', interval, z, config, data)
  lanes = [diff2_tabular.Lane(s, i, r) for s in (0, 1) for i in (0, 1)
           for r in (0, 1)]
  outcome = diff2_tabular._wave(engine, lanes, 'diff2_gd', points, rates,
                                data, config)
  verdicts = [v for v, _, _ in outcome]
  assert verdicts.count('completed') == 4
  assert all(v == 'nan' for v, _, _ in outcome[0::2])
  for lane, (verdict, stop, curve) in zip(lanes, outcome):
    if verdict != 'completed':
      assert stop >= 0 and len(curve) == stop + 2
      continue
    key = jax.random.fold_in(jax.random.fold_in(data.keys[lane.seed],
                                                lane.point), lane.rate)
    c1, c2 = diff2_tabular._clips('diff2_gd', points[lane.point])
    take = lambda tree: jax.tree_util.tree_map(
        lambda a: a[lane.seed:lane.seed + 1], tree)
    straight, _ = engine.full_run(
        jnp.asarray([rates[lane.rate]]), jnp.asarray([c1]),
        jnp.asarray([c2]), take(data.params), take(data.clients),
        take(data.test), key[None], key[None])
    np.testing.assert_allclose(curve, np.asarray(straight)[0], rtol=1e-5)


def test_search_retries_smaller_rates_and_the_guard_skips_unstable_ones():
  config = tiny_config(learning_rates=(64.0, 0.25, 0.0625), patience=1000)
  data = diff2_tabular.seeded_data('synthetic', config, (0,))
  results = diff2_tabular.search('diff2_gd', 3.0, data, config)
  assert len(results) == 2
  for result in results:
    first = result.trail[0]
    assert first[0] == 64.0 and first[1] == "nan"
    assert result.learning_rate == 0.25 and result.trail[-1] == (
        0.25, 'completed', -1)
    assert result.curve.shape == (24 // 4 + 1, 3)
  # With the guard, rates above Theorem 4.3's bound are never run.
  config.step_size_guard = 'skip'
  z = diff2_tabular.noise_multipliers('diff2_gd', 6, 3.0, config)
  point = results[0].point
  bound = diff2_tabular.stability('diff2_gd', point, 1.0, z, data,
                                  config).step_size_bound
  config.learning_rates = (2 * bound, bound / 2)
  guarded = diff2_tabular.search('diff2_gd', 3.0, data, config)
  for result in guarded:
    assert result.trail[0] == (2 * bound, 'skipped', -1)
    assert result.trail[1][0] == bound / 2


def test_pick_takes_each_criterion_minimum_and_skips_failed_points():
  curve = lambda train, grad: np.array([[train, grad, 0.0]])
  results = [
      diff2_tabular.SearchResult(0, {'grad_clip': 1.0}, 0.5, (),
                                 curve(0.2, 0.01)),
      diff2_tabular.SearchResult(0, {'grad_clip': 3.0}, 0.25, (),
                                 curve(0.1, 0.05)),
      diff2_tabular.SearchResult(0, {'grad_clip': 10.0}, None, (), None)]
  assert diff2_tabular.pick(results, 'train_loss').point == {'grad_clip': 3.0}
  assert diff2_tabular.pick(results, 'test_loss').learning_rate == 0.25
  chosen = diff2_tabular.pick(results, 'grad_norm_sq')
  assert chosen.point == {'grad_clip': 1.0} and chosen.tuning_minimum == 0.01


def test_tiny_run_writes_flagged_picks_and_paired_tests(tmp_path):
  config = tiny_config()
  rows = diff2_tabular.run(config, str(tmp_path))
  assert {r['algorithm'] for r in rows} == {'gd', 'dp_gd', 'diff2_gd'}
  private = [r for r in rows if r['algorithm'] != 'gd']
  for row in private:
    # Both rates are edges of a two-rate grid: every pick is flagged.
    edge = {64.0: 'learning_rate upper', 0.25: 'learning_rate lower'}
    assert edge[row['learning_rate']] in row['grid_edge']
    assert 0.0 <= row['p_min'] <= 1.0
    assert np.isfinite(row['random_iterate_mean'])
  searched = outputs.read_csv(str(tmp_path / 'search.csv'))
  assert len(searched) == 1 + 2 + 2     # one seed: GD, 2 DP-GD, 2 DIFF2
  assert all(r['trail'].startswith('64:') for r in searched)
  for name in ('summary.md', 'curves.csv', 'synthetic_eps3.png',
               'runs_synthetic_eps3.npz', 'run_record.json'):
    assert (tmp_path / name).exists(), name
  record = json.loads((tmp_path / 'run_record.json').read_text())
  assert record['cells_done'] == ['synthetic eps 3']
  figure = tmp_path / 'synthetic_eps3.png'
  figure.unlink()
  assert diff2_tabular.replot(str(tmp_path), config) == [str(figure)]
  assert figure.stat().st_size > 10_000


def test_the_config_is_checked_before_any_work():
  with pytest.raises(ValueError, match='both tuning and evaluation'):
    diff2_tabular.validate(tiny_config(eval_seeds=(0, 1)))
  with pytest.raises(ValueError, match='multiple of eval_every'):
    diff2_tabular.validate(tiny_config(num_rounds=25))
  with pytest.raises(ValueError, match='step_size_guard'):
    diff2_tabular.validate(tiny_config(step_size_guard='warn'))
  with pytest.raises(ValueError, match='at least 2'):
    diff2_tabular.validate(tiny_config(eval_seeds=(1,)))


def test_public_bounds_compute_nothing_from_the_data():
  x = np.array([[0.0, 10.0], [5.0, 20.0], [20.0, 0.0], [2.0, 15.0]])
  y = np.array([1.0, -3.0, 8.0, 2.0])
  train, test = tabular_data.prepare(x, y, seed=0, test_fraction=0.25,
                                     bounds=([0.0, 0.0], [10.0, 20.0]),
                                     target_bound=4.0)
  rows = np.concatenate([train['x'], test['x']])
  assert rows.min() >= -1.0 and rows.max() <= 1.0
  # 20 is above its bound 10: clipped to 1; 5 of [0, 10] maps to 0.
  assert sorted(rows[:, 0].tolist()) == [-1.0, -0.6000000238418579, 0.0, 1.0]
  assert sorted(np.concatenate([train['y'], test['y']]).tolist()) == [
      -0.75, 0.25, 0.5, 1.0]
  with pytest.raises(ValueError, match='target_bound'):
    tabular_data.prepare(x, y, seed=0, bounds=([0, 0], [1, 1]))


def test_load_csv_reads_a_users_file(tmp_path):
  path = tmp_path / 'mine.csv'
  path.write_text('a,b,price\n1,2,3.5\n4,5,6\n')
  x, y = tabular_data.load_csv(str(path), target='price')
  np.testing.assert_array_equal(x, [[1, 2], [4, 5]])
  np.testing.assert_array_equal(y, [3.5, 6])
  x, _ = tabular_data.load_csv(str(path), target='price', features=['b'])
  assert x.shape == (2, 1)
  with pytest.raises(ValueError, match="no column.*'c'"):
    tabular_data.load_csv(str(path), target='c')
  path.write_text('a,price\n1,2\nred,3\n')
  with pytest.raises(ValueError, match="row 3, column 'a': 'red'"):
    tabular_data.load_csv(str(path), target='price')


def test_the_run_record_lists_what_every_grid_point_spends():
  config = diff2_config.get_config()
  config.num_rounds, config.epsilons = 40, (3.0,)
  config.restart_fractions = (0.1, 0.25)
  config.grad_clips, config.diff_clip_factors = (1.0, 3.0), (1.0, 3.0)
  entries = diff2_tabular.privacy_entries(config)
  names = [e['name'] for e in entries]
  assert names == ['dp_gd, epsilon 3, T = 1', 'diff2_gd, epsilon 3, T = 4',
                   'diff2_gd, epsilon 3, T = 10']
  for entry in entries:
    assert 0 < entry['epsilon_spent'] <= 3.0 * (1 + 1e-6)
    assert entry['dp_event']['class_name']
