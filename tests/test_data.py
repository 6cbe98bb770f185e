"""dpsco_jax.data: a user's table, with explicit columns, as a plan's data."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import checks
from dpsco_jax import data
from dpsco_jax import plans
from dpsco_jax import preprocessing

MACHINES = os.path.join(os.path.dirname(__file__), 'data', 'machines.csv')
FEATURES = ['air_temp_k', 'process_temp_k', 'rotation_rpm', 'torque_nm',
            'tool_wear_min']
LOWER, UPPER = [290, 300, 1000, 0, 0], [310, 320, 2000, 80, 250]


def test_classification_keeps_integer_labels_and_encodes_strings():
  table = data.load_table(MACHINES, task='classification', target='failure',
                          features=FEATURES, lower=LOWER, upper=UPPER)
  header, cells = data.read_csv(MACHINES)
  raw = cells[:, header.index('failure')]
  assert table.classes == ('no', 'yes')
  assert table.num_classes == 2
  assert table.train['y'].dtype == np.int32
  assert table.train['x'].dtype == np.float32
  assert table.num_examples == 240 and table.test['y'].shape == (60,)
  # Every row is in exactly one split, with its own label.
  assert sorted(np.concatenate([table.train['y'], table.test['y']])) == sorted(
      (raw == 'yes').astype(int))
  # Public scaling: the bounds map to [-1, 1], nothing is spent.
  assert table.releases == ()
  assert np.all(np.abs(table.train['x']) <= 1.0)
  wear = cells[:, header.index('tool_wear_min')].astype(float)
  np.testing.assert_allclose(
      np.sort(np.concatenate([table.train['x'][:, 4], table.test['x'][:, 4]])),
      np.sort(wear / 125.0 - 1.0), atol=1e-6)
  # Integer labels stay as they are (no encoding).
  codes = data.load_table(MACHINES, task='classification',
                          target='failure_code', features=['torque_nm'],
                          scaling='none', test_fraction=0.0)
  assert codes.classes is None and codes.test is None
  assert codes.train['y'].dtype == np.int32
  assert set(codes.train['y'].tolist()) == {0, 1, 2, 3}
  assert codes.num_classes == 4


def test_regression_target_is_float32_and_bounded():
  table = data.load_table(MACHINES, task='regression', target='torque_nm',
                          features=['rotation_rpm', 'air_temp_k'],
                          lower=[1000, 290], upper=[2000, 310],
                          target_bound=80.0, test_fraction=0.0)
  header, cells = data.read_csv(MACHINES)
  torque = cells[:, header.index('torque_nm')].astype(float)
  assert table.train['y'].dtype == np.float32 and table.classes is None
  np.testing.assert_allclose(np.sort(table.train['y']),
                             np.sort(torque / 80.0), rtol=1e-6)
  with pytest.raises(ValueError, match='not a class label'):
    data.load_table(MACHINES, task='classification', target='torque_nm',
                    features=['rotation_rpm'], scaling='none')


def test_the_batches_a_plan_takes_and_a_trained_classifier():
  table = data.load_table(MACHINES, task='classification', target='failure',
                          features=FEATURES, lower=LOWER, upper=UPPER)

  def loss_fn(params, example):
    logit = example['x'] @ params['w'] + params['b']
    return optax.sigmoid_binary_cross_entropy(logit, example['y'])

  plan = plans.dpsgd(loss_fn, optimizer=optax.adam(0.1),
                     num_examples=table.num_examples, batch_size=60,
                     epochs=10, l2_clip=1.0, noise_multiplier=0.5,
                     delta=1e-6, seed=0, key=jax.random.key(0),
                     clipping_method='vmap')
  params = {'w': jnp.zeros(5), 'b': jnp.zeros(())}
  state = plan.init(params)
  step = jax.jit(lambda p, s, inputs: plan.transformation.update(
      None, s, p, **inputs))
  for inputs in plan.batches_of(table.train):
    assert inputs['batch']['y'].dtype == np.int32
    updates, state = step(params, state, inputs)
    params = optax.apply_updates(params, updates)
  logits = table.test['x'] @ params['w'] + params['b']
  accuracy = float(np.mean((logits > 0) == (table.test['y'] == 1)))
  majority = max(np.mean(table.test['y']), 1 - np.mean(table.test['y']))
  assert accuracy > majority


def test_columns_are_explicit_and_bad_ones_refused(tmp_path):
  load = lambda **kw: data.load_table(
      MACHINES, **{'task': 'classification', 'target': 'failure',
                   'scaling': 'none', **kw})
  with pytest.raises(TypeError, match='features'):
    data.load_table(MACHINES, task='classification', target='failure')
  with pytest.raises(ValueError, match="no column.*'torque'"):
    load(features=['torque'])
  with pytest.raises(ValueError, match="target 'failure' is among"):
    load(features=['torque_nm', 'failure'])
  with pytest.raises(ValueError, match="'udi' looks like a row identifier"):
    load(features=['udi', 'torque_nm'])
  with pytest.raises(ValueError, match='more than once'):
    load(features=['torque_nm', 'torque_nm'])
  with pytest.raises(ValueError, match='task must be one of'):
    load(features=['torque_nm'], task='ranking')
  # By value: a row number under an innocent name, a distinct string a row.
  rows = '\n'.join(f'{i},{i % 7},ab{i},{i % 2},{i % 2}'
                   for i in range(5, 35))
  path = tmp_path / 'mine.csv'
  path.write_text('m,level,code,label,copy\n' + rows + '\n')
  kw = dict(task='classification', target='label', scaling='none')
  with pytest.raises(ValueError, match="'m' looks like a row identifier.*"
                     'consecutive'):
    data.load_table(str(path), features=['m'], **kw)
  with pytest.raises(ValueError, match="'code' looks like a row identifier"):
    data.load_table(str(path), features=['code'], **kw)
  assert data.load_table(str(path), features=['level'],
                         **kw).train['x'].shape == (24, 1)
  # By name alone (values neither distinct strings nor a run of integers).
  path.write_text('customer_id,label\n' + '\n'.join(
      f'{7 * (i % 5)},{i % 2}' for i in range(30)) + '\n')
  with pytest.raises(ValueError, match="'customer_id' looks like a row "
                     'identifier.*name'):
    data.load_table(str(path), features=['customer_id'], **kw)
  path.write_text('m,level,code,label,copy\n' + rows + '\n')
  # A copy of the label.
  with pytest.raises(ValueError, match="'copy' predicts the target 'label'"):
    data.load_table(str(path), features=['level', 'copy'], **kw)
  # A cell that is not a number, with its line and column.
  path.write_text('a,label\n1,0\nred,1\n')
  with pytest.raises(ValueError, match="line 3, column 'a': 'red'"):
    data.load_table(str(path), features=['a'], **kw)
  path.write_text('a,label\n1,0\n,1\n')
  with pytest.raises(ValueError, match="line 3, column 'a'.*missing"):
    data.load_table(str(path), features=['a'], **kw)
  path.write_text('a,label\n1,0\n2,1,3\n')
  with pytest.raises(ValueError, match='line 3: 3 cells, the header has 2'):
    data.load_table(str(path), features=['a'], **kw)
  with pytest.raises(FileNotFoundError, match='no such file'):
    data.load_table(str(tmp_path / 'absent.csv'), features=['a'], **kw)
  # Scaling needs public bounds, and DP arguments only with 'dp'.
  with pytest.raises(ValueError, match='public bounds'):
    load(features=['torque_nm'], scaling='public')
  with pytest.raises(ValueError, match="configure scaling='dp'"):
    load(features=['torque_nm'], scaling='public', lower=[0], upper=[80],
         epsilon=0.1, delta=1e-6)
  with pytest.raises(TypeError, match='CSV path or a pandas DataFrame'):
    data.load_table(np.zeros((3, 2)), features=['a'], **kw)


def test_the_dp_release_reaches_the_plan_and_its_ledger():
  table = data.load_table(MACHINES, task='classification', target='failure',
                          features=FEATURES, lower=LOWER, upper=UPPER,
                          scaling='dp', epsilon=0.3, delta=1e-6,
                          key=jax.random.key(5))
  (release,) = table.releases
  assert release.name == preprocessing.RELEASE_NAME
  assert isinstance(table.standardization, preprocessing.Standardization)
  plan = plans.dpsgd(lambda p, e: jnp.sum(p * e['x']),
                     optimizer=optax.sgd(0.1),
                     num_examples=table.num_examples, batch_size=60,
                     epochs=2, l2_clip=1.0, epsilon=2.0, delta=1e-6,
                     releases=table.releases, seed=0, key=jax.random.key(1))
  assert plan.ledger.releases == (release,)
  assert plan.describe()['releases'][0]['name'] == preprocessing.RELEASE_NAME
  # Before any step, the ledger has spent the scaling's epsilon.
  assert 0.25 < plan.epsilon_at(0) <= 0.3 + 1e-6
  assert plan.epsilon <= 2.0 + 1e-6
  # The scaling is fitted on the training rows only: the test rows do not
  # change it (same key, same training rows, other test rows).
  again = data.load_table(MACHINES, task='classification', target='failure',
                          features=FEATURES, lower=LOWER, upper=UPPER,
                          scaling='dp', epsilon=0.3, delta=1e-6,
                          key=jax.random.key(5), test_fraction=0.0)
  assert not np.allclose(again.standardization.mean,
                         table.standardization.mean)


class _FrameColumn:

  def __init__(self, values):
    self._values = values

  def to_numpy(self):
    return np.asarray(self._values)


class _Frame:
  """The part of a pandas DataFrame the loader uses (pandas is optional)."""

  def __init__(self, columns):
    self._columns = columns
    self.columns = list(columns)

  def __getitem__(self, name):
    return _FrameColumn(self._columns[name])

  def to_numpy(self):
    return np.stack([np.asarray(v, object) for v in self._columns.values()],
                    axis=1)


def test_a_dataframe_is_read_like_the_csv():
  header, cells = data.read_csv(MACHINES)
  frame = _Frame({name: (cells[:, i] if name == 'failure' else
                         cells[:, i].astype(float))
                  for i, name in enumerate(header)})
  from_csv = data.load_table(MACHINES, task='classification',
                             target='failure', features=FEATURES,
                             lower=LOWER, upper=UPPER)
  from_frame = data.load_table(frame, task='classification',
                               target='failure', features=FEATURES,
                               lower=LOWER, upper=UPPER)
  for split in ('train', 'test'):
    for name in ('x', 'y'):
      np.testing.assert_array_equal(getattr(from_csv, split)[name],
                                    getattr(from_frame, split)[name])
  assert from_frame.classes == ('no', 'yes')
  with pytest.raises(ValueError, match="'udi' looks like a row identifier"):
    data.load_table(frame, task='classification', target='failure',
                    features=['udi'], scaling='none')


# ------------------------------------------- data that cannot leak or flip


def _machines_frame(num_rows=10_000, seed=7):
  """A predictive-maintenance table shaped like the public one: a failure
  target, and five failure-mode flags recorded with it (tool wear, heat
  dissipation, power, overstrain, random), whose max equals the target on
  9,973 of the 10,000 rows (9 failures without a mode, 18 random-failure
  flags without a failure)."""
  rng = np.random.default_rng(seed)
  modes = np.zeros((num_rows, 5), np.int64)
  rows = rng.permutation(num_rows)
  for j, (start, stop) in enumerate([(0, 45), (45, 155), (155, 245),
                                     (245, 329), (329, 348)]):
    modes[rows[start:stop], j] = 1
  failed = modes[:, :4].max(axis=1)
  failed[rows[329]] = 1                      # one random failure
  failed[rows[348:357]] = 1                  # nine without a mode
  assert np.sum(modes.max(axis=1) == failed) == 9973
  assert np.sum(failed) == 339
  columns = {
      'udi': np.arange(1, num_rows + 1),
      'air_temp_k': rng.normal(300.0, 2.0, num_rows).round(1),
      'rotation_rpm': rng.normal(1540.0, 180.0, num_rows).round(),
      'torque_nm': rng.normal(40.0, 10.0, num_rows).round(1),
      'tool_wear_min': rng.integers(0, 250, num_rows),
      **{name: modes[:, j] for j, name in enumerate(
          ['twf', 'hdf', 'pwf', 'osf', 'rnf'])},
      'machine_failure': np.where(failed == 1, 'fail', 'ok').astype(object)}
  return _Frame(columns)


SENSORS = ['air_temp_k', 'rotation_rpm', 'torque_nm', 'tool_wear_min']
MODES = ['twf', 'hdf', 'pwf', 'osf', 'rnf']


@pytest.fixture(scope='module')
def machines():
  return _machines_frame()


def test_failure_mode_flags_whose_max_is_the_target_are_refused(machines):
  load = lambda features, **kw: data.load_table(
      machines, task='classification', target='machine_failure',
      positive_class='fail', features=features, scaling='none', **kw)
  with pytest.raises(ValueError) as refused:
    load(SENSORS + MODES)
  message = str(refused.value)
  assert ("features 'twf', 'hdf', 'pwf', 'osf' predict the target "
          "'machine_failure' together") in message
  assert "their max is 1 exactly where the target is 'fail'" in message
  assert "allow_predictive=('twf', 'hdf', 'pwf', 'osf')" in message
  # The sensors alone are not flagged, nor is the random-failure flag.
  table = load(SENSORS + ['rnf'])
  assert table.num_examples == 8000
  # Confirmed by the user: loaded as asked.
  assert load(SENSORS + MODES, allow_predictive=MODES[:4]).train[
      'x'].shape == (8000, 9)
  with pytest.raises(ValueError, match=r"allow_predictive names \['TWF'\]"):
    load(SENSORS, allow_predictive=['TWF'])


def test_every_refused_column_is_named_in_one_error(machines):
  with pytest.raises(ValueError) as refused:
    data.load_table(machines, task='classification',
                    target='machine_failure',
                    features=['udi', *SENSORS, *MODES], scaling='none')
  message = str(refused.value)
  assert message.startswith('load_table found 2 problem(s)')
  assert "'udi' looks like a row identifier" in message
  assert "'twf', 'hdf', 'pwf', 'osf' predict the target" in message
  # A cell that is not a number, a missing one and an identifier at once.
  frame = _Frame({'row_id': np.arange(40),
                  'level': np.arange(40) % 5,
                  'color': np.array(['red' if i == 7 else str(i % 3)
                                     for i in range(40)], object),
                  'depth': np.array(['' if i == 9 else str(i % 4)
                                     for i in range(40)], object),
                  'label': np.arange(40) % 2})
  with pytest.raises(ValueError) as refused:
    data.load_table(frame, task='classification', target='label',
                    features=['row_id', 'level', 'color', 'depth'],
                    scaling='none')
  message = str(refused.value)
  assert message.startswith('load_table found 3 problem(s)')
  assert "'row_id' looks like a row identifier" in message
  assert "row 7 of the DataFrame, column 'color': 'red' is not a number" in (
      message)
  assert "row 9 of the DataFrame, column 'depth': '' is missing" in message


def test_a_near_copy_of_the_target_is_refused_alone():
  rng = np.random.default_rng(3)
  n = 2000
  failed = rng.random(n) < 0.3
  flipped = failed ^ (rng.random(n) < 0.004)          # 99.6% agreement
  torque = rng.normal(40.0, 10.0, n)
  frame = _Frame({'torque_nm': torque,
                  'inspection': np.where(flipped, 7.0, 2.0),
                  'failure': np.where(failed, 'yes', 'no').astype(object)})
  with pytest.raises(ValueError, match=r"feature 'inspection' predicts the "
                     r"target 'failure' alone: mapping its values to classes "
                     r"\(2 -> 'no', 7 -> 'yes'\) matches the target on "):
    data.load_table(frame, task='classification', target='failure',
                    features=['torque_nm', 'inspection'], scaling='none')
  # A continuous near-copy: the best threshold separates the classes.
  score = np.where(failed, 1.0, 0.0) + rng.normal(0.0, 0.05, n)
  frame = _Frame({'torque_nm': torque, 'score': score,
                  'failure': np.where(failed, 'yes', 'no').astype(object)})
  with pytest.raises(ValueError, match="'score' predicts the target"):
    data.load_table(frame, task='classification', target='failure',
                    features=['torque_nm', 'score'], scaling='none')
  # Regression: a price band recorded from the price.
  price = rng.lognormal(12.0, 0.5, n)
  frame = _Frame({'rooms': rng.integers(1, 8, n).astype(float),
                  'band': price * (1.0 + rng.normal(0.0, 0.02, n)),
                  'price': price})
  with pytest.raises(ValueError, match=r"'band' predicts the target 'price' "
                     r'alone: its correlation with the target is 0\.99'):
    data.load_table(frame, task='regression', target='price',
                    features=['rooms', 'band'], scaling='none')
  table = data.load_table(frame, task='regression', target='price',
                          features=['rooms', 'band'], scaling='none',
                          allow_predictive=['band'])
  assert table.train['x'].shape == (1600, 2)


def test_positive_class_chooses_y_equal_one(machines, capsys):
  load = lambda **kw: data.load_table(
      machines, task='classification', target='machine_failure',
      features=SENSORS, scaling='none', test_fraction=0.0, **kw)
  raw = machines['machine_failure'].to_numpy()
  # Sorted order: with 'fail'/'ok', y = 1 is 'ok', and the loader says so.
  table = load()
  assert table.classes == ('fail', 'ok') and table.positive_class == 'ok'
  assert "y = 1 is 'ok' (sorted order; positive_class= picks" in (
      capsys.readouterr().err)
  # positive_class='fail': y = 1 marks the failures.
  table = load(positive_class='fail')
  assert table.classes == ('ok', 'fail') and table.positive_class == 'fail'
  assert "y = 0 is 'ok', y = 1 is 'fail'" in capsys.readouterr().err
  order = np.random.default_rng(0).permutation(len(raw))
  np.testing.assert_array_equal(table.train['y'], raw[order] == 'fail')
  assert int(table.train['y'].sum()) == int(np.sum(raw == 'fail')) == 339
  with pytest.raises(ValueError, match=r"positive_class='failed' is not a "
                     r"class .* its classes are \['fail', 'ok'\]"):
    load(positive_class='failed')
  # Integer labels: positive_class re-encodes them.
  frame = _Frame({'x': np.arange(40) % 3 * 1.0,
                  'label': np.arange(40) % 2})
  flipped = data.load_table(frame, task='classification', target='label',
                            features=['x'], scaling='none', test_fraction=0.0,
                            positive_class=0)
  assert flipped.classes == (1, 0) and flipped.positive_class == 0
  np.testing.assert_array_equal(
      flipped.train['y'], np.arange(40)[np.random.default_rng(0).permutation(
          40)] % 2 == 0)
  with pytest.raises(ValueError, match='picks which of TWO classes.*has 4'):
    data.load_table(MACHINES, task='classification', target='failure_code',
                    features=['torque_nm'], scaling='none', positive_class=1)


def test_regression_on_a_string_target_names_the_target():
  with pytest.raises(ValueError, match=r"the target 'failure' is not numeric "
                     r"\(.*machines\.csv, line 2 holds 'no' \(300 such cells\)\): "
                     r"task='regression' needs a number"):
    data.load_table(MACHINES, task='regression', target='failure',
                    features=['torque_nm'], scaling='none')


def test_public_bounds_report_the_values_they_clip():
  header, cells = data.read_csv(MACHINES)
  rpm = cells[:, header.index('rotation_rpm')].astype(float)
  above = int(np.sum(rpm > 1600))
  assert 0 < above < 300
  with pytest.warns(data.ClippedValuesWarning) as caught:
    data.load_table(MACHINES, task='classification', target='failure',
                    features=FEATURES, lower=LOWER,
                    upper=[310, 320, 1600, 80, 250])
  (warning,) = caught
  assert f"'rotation_rpm': {above} of 300 rows ({above} above 1600)" in str(
      warning.message)
  assert 'torque_nm' not in str(warning.message)
  # The regression target's public bound too.
  torque = cells[:, header.index('torque_nm')].astype(float)
  with pytest.warns(data.ClippedValuesWarning,
                    match=(f"'target torque_nm': {np.sum(torque > 60)} of 300 "
                           'rows')):
    data.load_table(MACHINES, task='regression', target='torque_nm',
                    features=['rotation_rpm'], lower=[1000], upper=[2000],
                    target_bound=60.0)
  # Bounds that hold every value: no warning.
  with warnings.catch_warnings():
    warnings.simplefilter('error', data.ClippedValuesWarning)
    data.load_table(MACHINES, task='classification', target='failure',
                    features=FEATURES, lower=LOWER, upper=UPPER)


def _logistic_loss(params, example):
  logit = example['x'] @ params['w'] + params['b']
  return optax.sigmoid_binary_cross_entropy(logit, example['y'])


def test_a_plan_warns_about_nan_rows_once_per_data_object():
  table = data.load_table(MACHINES, task='classification', target='failure',
                          features=FEATURES, lower=LOWER, upper=UPPER)
  plan = plans.dpsgd(_logistic_loss, optimizer=optax.sgd(0.1),
                     num_examples=table.num_examples, batch_size=60,
                     epochs=1, l2_clip=1.0, noise_multiplier=1.0,
                     delta=1e-6, seed=0, key=jax.random.key(0))
  x = table.train['x'].copy()
  x[[3, 17, 200], 1] = np.nan
  x[50, 0] = np.inf
  broken = {'x': x, 'y': table.train['y']}
  with pytest.warns(checks.NonFiniteDataWarning,
                    match=r'plan\.batches_of: 4 of 240 rows of the data hold '
                    'NaN or infinite values'):
    next(plan.batches_of(broken))
  # The same data again (another epoch, a resumed run): no second warning.
  with warnings.catch_warnings():
    warnings.simplefilter('error', checks.NonFiniteDataWarning)
    list(plan.batches_of(broken, start_step=1))
    list(plan.batches_of(table.train))          # clean data: silent
  # Device arrays are checked too.
  with pytest.warns(checks.NonFiniteDataWarning, match='4 of 240 rows'):
    next(plan.batches_of(jax.tree_util.tree_map(jnp.asarray, broken)))


def test_delta_at_least_one_over_n_warns_with_the_usual_choice():
  build = lambda delta, **kw: plans.dpsgd(
      _logistic_loss, optimizer=optax.sgd(0.1), num_examples=8000,
      batch_size=256, epochs=1, l2_clip=1.0, noise_multiplier=1.0,
      delta=delta, seed=0, key=jax.random.key(0), **kw)
  with pytest.warns(checks.LargeDeltaWarning,
                    match=r'delta = 0\.01 is at least 1/n = 1/8,000.*'
                    r'well below 1/n, e\.g\. 1/n\^1\.1 = 5\.1e-05'):
    build(0.01)
  with warnings.catch_warnings():
    warnings.simplefilter('error', checks.LargeDeltaWarning)
    build(1e-5)
  # User-level privacy counts users.
  with pytest.warns(checks.LargeDeltaWarning, match='the number of users'):
    plans.user_level_dpsgd(_logistic_loss, optimizer=optax.sgd(0.1),
                           num_users=50, users_per_batch=10, epochs=1,
                           l2_clip=1.0, noise_multiplier=1.0, delta=0.05,
                           seed=0, key=jax.random.key(1))
