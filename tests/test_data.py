"""dpsco_jax.data: a user's table, with explicit columns, as a plan's data."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
  with pytest.raises(ValueError, match='equal the target'):
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
