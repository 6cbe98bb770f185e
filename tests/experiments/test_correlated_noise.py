"""The correlated-noise accuracy experiment: end to end, batches, padding."""

import json
import os

import numpy as np
import pytest

from configs import correlated_noise_digits
from configs import correlated_noise_fashion_mnist
from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import plans
from experiments import correlated_noise
from experiments import srg_memf

# The target of the calibrated runs: a small epsilon calibrates to a large
# noise multiplier, whose privacy loss distribution is small (the PLD
# calibrations take a third of the time of epsilon = 2 on the same path).
EPSILON = 0.5


def tiny_config():
  config = correlated_noise_digits.get_config()
  config.num_epochs = 1
  config.epsilons = (EPSILON,)
  config.learning_rates = (0.3, 1.0)   # the 2 grid points
  config.clips = (1.0,)
  config.bands = (2,)
  config.tuning_seeds = 1
  config.num_seeds = 2
  config.grid_extensions = 0
  return config


@pytest.fixture(scope='module')
def data():
  return srg_memf.load_data(tiny_config())


def test_end_to_end_writes_every_output_and_spends_at_most_the_target(
    tmp_path):
  config = tiny_config()
  # One masked (padded) method and the reference: each method costs two
  # compilations; the others' plans are checked below.
  config.methods = ('banded_amplified', 'nonprivate')
  results = correlated_noise.run(config, str(tmp_path))
  for name in ('results.csv', 'tuning.csv', 'runs.csv', 'results.md',
               'accuracy.png', 'run_record.json'):
    assert os.path.getsize(tmp_path / name) > 0
  by_method = {r['method']: r for r in results}
  assert set(by_method) == set(config.methods)
  banded = by_method['banded_amplified']
  # The plan spends at most its target, and the record says the same.
  assert 0 < banded['epsilon_spent'] <= EPSILON * (1 + 1e-9)
  record = json.loads((tmp_path / 'run_record.json').read_text())
  (entry,) = record['privacy']
  assert entry['name'] == f'banded_amplified eps={EPSILON:g}'
  assert entry['epsilon_spent'] == pytest.approx(banded['epsilon_spent'])
  assert entry['participation']['kind'] == 'CyclicPoissonSampling'
  assert entry['noise_buffers'] == banded['noise_buffers'] == 1   # b - 1
  assert banded['sampling'] == 'CyclicPoissonBatches'
  assert banded['padding_checked']
  assert 0.1 < banded['mean_test_accuracy'] <= 1.0
  # 2 learning rates: the pick is on an edge, flagged in the table.
  assert banded['grid_edge'].startswith('learning_rate ')
  assert by_method['nonprivate']['mean_test_accuracy'] > 0.8
  assert record['seeds'] == {'tuning': [10_000, 10_000], 'final': [0, 1]}
  text = (tmp_path / 'results.md').read_text()
  assert correlated_noise.LABELS['banded_amplified'] in text
  assert '(edge)' in text and 'learning_rate' in text
  runs = (tmp_path / 'runs.csv').read_text().splitlines()
  assert len(runs) == 1 + 2 * config.num_seeds


@pytest.mark.parametrize('method', ['dpsgd_poisson', 'dpmemf_dense', 'blt'])
def test_every_private_plan_spends_at_most_its_target(method, data):
  config = tiny_config()
  n = int(data.train_y.shape[0])
  plan = correlated_noise.make_plan(method, config, n, epsilon=EPSILON)
  assert 0 < plan.epsilon <= EPSILON * (1 + 1e-9)
  assert plan.hyperparameters['epochs'] == config.num_epochs
  buffers = plan.describe()['noise_buffers']
  if method == 'dpmemf_dense':
    assert buffers == plan.num_steps - 1
    # The default 5 epochs keep k b - 1 = 114 buffers, over the plans'
    # default limit: max_noise_buffers is raised to what the run needs.
    five = correlated_noise.make_plan(
        method, correlated_noise_digits.get_config(), n, noise_multiplier=1.0)
    assert five.describe()['noise_buffers'] == 114 > plans.MAX_NOISE_BUFFERS
  elif method == 'blt':
    assert buffers == config.blt_buffers
  else:
    assert isinstance(plan.batches, batching.PoissonBatches)


def test_the_banded_method_samples_cyclic_poisson_partitions(data):
  config = tiny_config()
  n = int(data.train_y.shape[0])
  plan = correlated_noise.make_plan('banded_amplified', config, n,
                                    noise_multiplier=2.0, bands=4)
  assert isinstance(plan.batches, batching.CyclicPoissonBatches)
  assert plan.batches.num_partitions == 4
  assert isinstance(plan.participation, accounting.CyclicPoissonSampling)
  indices, masks = correlated_noise.padded_batches(plan.batches, [0, 1])
  steps = np.arange(indices.shape[1])[None, :, None]
  # Every real example of step t is in partition t mod 4.
  assert np.all((indices % 4 == steps % 4) | ~masks)
  for other in ('dpsgd_poisson', 'dpmemf_dense', 'blt'):
    with pytest.raises(ValueError, match='bands= is for banded'):
      correlated_noise.make_plan(other, config, n, noise_multiplier=2.0,
                                 bands=4)
  with pytest.raises(ValueError, match='no plan'):
    correlated_noise.make_plan('nonprivate', config, n, noise_multiplier=2.0)
  with pytest.raises(ValueError, match='method must be one of'):
    correlated_noise.make_plan('dpftrl', config, n, noise_multiplier=2.0)


def test_padded_batches_are_the_samplers_batches(data):
  config = tiny_config()
  n = int(data.train_y.shape[0])
  plan = correlated_noise.make_plan('dpsgd_poisson', config, n,
                                    noise_multiplier=1.0)
  indices, masks = correlated_noise.padded_batches(plan.batches, [3, 4])
  assert indices.shape[:2] == (2, plan.num_steps)
  assert indices.shape[2] % plan.batches.pad_to_multiple == 0
  for s, seed in enumerate([3, 4]):
    sampler = correlated_noise.sampler_for_seed(plan.batches, seed)
    assert type(sampler) is type(plan.batches)
    assert sampler.participation == plan.participation
    for t, (ids, mask) in enumerate(sampler.iterate()):
      np.testing.assert_array_equal(indices[s, t][masks[s, t]], ids[mask])
      assert masks[s, t].sum() == mask.sum()
  # Two seeds draw different batches.
  assert not np.array_equal(indices[0], indices[1])


def test_padded_rows_do_not_change_the_release(data, monkeypatch):
  config = tiny_config()
  n = int(data.train_y.shape[0])
  plan = correlated_noise.make_plan('dpsgd_poisson', config, n,
                                    noise_multiplier=1.0, key=0)
  indices, masks = correlated_noise.padded_batches(plan.batches, [0])
  t = int(np.argmin(masks[0].sum(-1)))
  assert not masks[0, t].all()
  inputs = correlated_noise.step_inputs(data.train_x, data.train_y,
                                        indices[0, t], masks[0, t])
  np.testing.assert_array_equal(inputs['batch_mask'], masks[0, t])
  assert correlated_noise.padding_is_masked(plan, data, indices[0, t],
                                            masks[0, t], num_classes=10)
  # The check can fail: inputs without the mask count the padded rows in
  # the clipped sum, and moving them changes the release.
  step_inputs = correlated_noise.step_inputs
  monkeypatch.setattr(
      correlated_noise, 'step_inputs',
      lambda x, y, ids, mask: step_inputs(x, y, ids, None))
  assert not correlated_noise.padding_is_masked(plan, data, indices[0, t],
                                                masks[0, t], num_classes=10)


def test_the_fashion_mnist_config_is_the_same_protocol_and_builds():
  digits = correlated_noise_digits.get_config()
  fashion = correlated_noise_fashion_mnist.get_config()
  assert set(fashion.keys()) == set(digits.keys())
  assert fashion.dataset == 'fashion_mnist'
  for name in ('epsilons', 'delta', 'momentum', 'num_epochs', 'methods'):
    assert fashion[name] == digits[name]
  n = 60_000 - fashion.validation_size
  assert n % fashion.batch_size == 0   # a fixed order uses every example
  plan = correlated_noise.make_plan('dpsgd_poisson', fashion, n,
                                    noise_multiplier=1.0)
  assert plan.num_steps == fashion.num_epochs * n // fashion.batch_size
  assert max(fashion.bands) <= correlated_noise.largest_bands(fashion, n)
