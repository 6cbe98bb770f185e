"""The DIFF2 tabular experiment: loaders, preprocessing, clients, one tiny run."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from configs import diff2_tabular as diff2_config
from experiments import diff2_tabular
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


def test_rejection_rule():
  assert diff2_tabular.rejected(np.array([1.0, np.nan]))
  assert diff2_tabular.rejected(np.array([1.0, 0.5] + [0.6] * 5))
  assert not diff2_tabular.rejected(np.array([1.0, 0.5, 0.52, 0.4, 0.3]))


def test_tiny_run_of_every_algorithm():
  config = diff2_config.get_config()
  config.num_rounds, config.eval_every, config.seeds = 4, 2, (0, 1)
  config.synthetic_examples, config.num_clients = 300, 3
  data = diff2_tabular.seeded_data('synthetic', config)
  params, clients, tests, keys, sizes, dim = data
  assert dim == config.synthetic_dim and sizes.sum() == 240
  z = diff2_tabular.grid('diff2_gd', 3.0, config)[0]['noise_multipliers']
  for algorithm, hyper in (('gd', {}), ('diff2_gd', {
      'grad_clip': 1.0, 'diff_clip_factor': 3.0, 'restart_interval': 2,
      'noise_multipliers': z})):
    metrics = np.asarray(diff2_tabular.make_runner(algorithm, hyper, config)(
        jnp.asarray([0.1, 0.05]), params, clients, tests, keys))
    assert metrics.shape == (2, 2, 3, 3)
    assert np.all(np.isfinite(metrics))
    if algorithm == 'gd':  # noiseless descent lowers the train loss
      assert np.all(metrics[:, :, -1, 0] < metrics[:, :, 0, 0])


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
  entries = diff2_tabular.privacy_entries(config)
  names = [e['name'] for e in entries]
  assert names == ['dp_gd, epsilon 3, T = 1', 'diff2_gd, epsilon 3, T = 4',
                   'diff2_gd, epsilon 3, T = 10']
  for entry in entries:
    assert 0 < entry['epsilon_spent'] <= 3.0 * (1 + 1e-6)
    assert entry['dp_event']['class_name']
