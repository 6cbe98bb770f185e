"""The paper 001 §5 experiment: end to end, and its scan is the library's path."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from configs import srg_memf_digits
from experiments import srg_memf


def tiny_config():
  config = srg_memf_digits.get_config()
  config.num_seeds = 3
  config.tuning_seeds = 1
  config.learning_rates = (0.5,)
  config.clips = (1.0,)
  config.decays = (0.1,)
  config.algorithms = ('srg_true', 'nonprivate')
  return config


def test_end_to_end_writes_the_table(tmp_path):
  config = tiny_config()
  results = srg_memf.run(config, str(tmp_path))
  for name in ('results.csv', 'tuning.csv', 'runs.csv', 'results.md',
               'accuracy.png', 'run_record.json'):
    assert os.path.getsize(tmp_path / name) > 0
  by_name = {r['algorithm']: r for r in results}
  assert set(by_name) == set(config.algorithms)
  for name in ('srg_true',):
    # Every private run spent exactly its (zCDP-converted) target.
    assert by_name[name]['epsilon_spent'] <= config.epsilon * (1 + 1e-9)
    assert 0.1 < by_name[name]['mean_test_accuracy'] < 1.0
  assert by_name['nonprivate']['mean_test_accuracy'] > 0.8
  record = json.loads((tmp_path / 'run_record.json').read_text())
  (entry,) = record['privacy']
  assert entry['name'] == 'srg_true'
  assert entry['epsilon_spent'] <= config.epsilon * (1 + 1e-9)
  assert entry['accounting_method'] == 'zcdp'
  text = (tmp_path / 'results.md').read_text()
  assert 'srg_true' in text and '+-' in text
  # One value per axis searched: no pick can be on an edge, and the table
  # says so.
  assert by_name['srg_true']['grid_edge'] == ''
  assert 'pick on a grid edge' in text


def test_an_edge_pick_is_extended_or_flagged_and_final_runs_use_all_data(
    tmp_path):
  config = tiny_config()
  config.learning_rates = (0.25, 0.5)
  config.algorithms = ('dpmemf_true',)
  config.num_seeds = 2
  config.grid_extensions = 1
  (result,) = srg_memf.run(config, str(tmp_path))
  tried = sorted({row['learning_rate'] for row in result['tuning']})
  # One extension past whichever edge the first pick was on.
  assert tried in ([0.125, 0.25, 0.5], [0.25, 0.5, 1.0])
  assert result['grid_searched'].startswith('learning_rate ')
  assert len(result['grid_searched'].split()) == 4   # axis name + 3 values
  train, _ = srg_memf.datasets.load(config.dataset,
                                    **dict(config.data_kwargs))
  assert result['num_train_final'] == len(train['y'])
  # Without an extension, two values make any pick an edge: the result and
  # the table flag it.
  config.final_on_full_train = False
  config.grid_extensions = 0
  (result,) = srg_memf.run(config, str(tmp_path / 'part'))
  assert result['num_train_final'] == len(train['y']) - config.validation_size
  assert result['grid_edge'] in ('learning_rate lower',
                                 'learning_rate upper')
  assert result['grid_edge'] in (tmp_path / 'part' / 'results.md').read_text()


def test_scanned_run_equals_the_library_steps_one_by_one():
  config = tiny_config()
  data = srg_memf.load_data(config)
  num_train = int(data.train_y.shape[0])
  decay = 0.1
  setup = srg_memf.make_setup('srg_true', config, num_train, decay)
  run = jax.jit(srg_memf.make_run(setup, decay, config.momentum, 10))
  seed, lr, clip = 3, 0.5, 1.0
  val, test, refusal = run(jnp.float32(lr), jnp.float32(clip),
                           jnp.int32(seed), data)
  assert int(refusal['refusal_check']) == 0

  # The same run written as a host loop of `tx.update` calls.
  order_key, noise_key = jax.random.split(jax.random.key(seed))
  b = setup.steps_per_epoch
  order = np.asarray(jax.random.permutation(order_key, num_train))[
      :b * setup.batch_size].reshape(b, setup.batch_size)
  tx = optax.chain(
      dpsco_jax.dp_srg_memf(
          srg_memf.example_loss, l2_clip=clip,
          noise_multiplier=setup.noise_multiplier, strategy=setup.strategy,
          steps_per_epoch=b, decay=decay, num_examples=num_train,
          key=noise_key),
      optax.sgd(lr, momentum=config.momentum))
  params = {'w': jnp.zeros((64, 10)), 'b': jnp.zeros((10,))}
  state = tx.init(params)
  step = jax.jit(lambda p, s, batch, ids: tx.update(None, s, p, batch=batch,
                                                    example_ids=ids))
  for t in range(setup.num_epochs * b):
    ids = order[t % b]
    batch = {'x': data.train_x[ids], 'y': data.train_y[ids]}
    updates, state = step(params, state, batch, jnp.asarray(ids))
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(
      float(test), float(srg_memf.accuracy(params, data.test_x, data.test_y)),
      atol=1.5 / len(data.test_y))
  assert float(val) > 0.1


def test_one_seed_is_refused_before_any_work(tmp_path):
  config = tiny_config()
  config.num_seeds = 1
  with pytest.raises(ValueError, match='num_seeds must be at least 2'):
    srg_memf.run(config, str(tmp_path))


def test_validation_split_is_refused_when_it_eats_the_data():
  train = {'x': np.zeros((10, 2)), 'y': np.zeros(10, np.int32)}
  with pytest.raises(ValueError, match='validation_size'):
    srg_memf.split_validation(train, 10, 0)


@pytest.mark.parametrize('name', ['srg_memf_mnist', 'srg_memf_cifar10'])
def test_paper_data_configs_ask_for_the_files(name):
  module = __import__(f'configs.{name}', fromlist=['get_config'])
  config = module.get_config()
  assert config.batch_size == 500 and config.delta == 1e-6
  assert (config.num_epochs, config.epsilon) in ((1, 0.1), (6, 2.0))
  with pytest.raises(ValueError, match='data_path'):
    srg_memf.load_data(config)


def test_paired_differences_are_per_seed():
  lines = srg_memf.paired_differences(
      {'srg_true': [0.80, 0.82, 0.81], 'dpmemf_true': [0.79, 0.80, 0.80]})
  assert len(lines) == 3  # header, rule, the one pair present
  assert lines[2].startswith('| srg_true - dpmemf_true | +1.333 +- ')


def test_the_decay_axis_stays_below_one():
  # c = eta_{t-1} / eta_t < 1 (the decay workload needs it): extending past
  # the upper edge goes halfway to 1.
  assert srg_memf._extend('decay', [0.2, 0.6], 'upper') == pytest.approx(
      [0.2, 0.6, 0.8])
  assert srg_memf._extend('decay', [0.5, 0.99], 'upper')[-1] < 1.0
  assert srg_memf._extend('decay', [0.1, 0.3], 'lower') == pytest.approx(
      [0.1 / 3, 0.1, 0.3])
  assert srg_memf._extend('clip', [1.0, 3.0], '') == [1.0, 3.0]
