"""Flax models trained by plans on digits, end to end (tiny runs)."""

import json
import os
import warnings

from flax import nnx
import jax
import numpy as np
import pytest

from configs import flax_digits as flax_digits_config
from dpsco_jax import clipping
from experiments import flax_digits
from experiments import models


@pytest.mark.parametrize('model, algorithm', [('mlp', 'dpftrl'),
                                              ('cnn', 'dp_srg_memf'),
                                              ('mlp', 'dpmemf')])
def test_a_flax_model_trains_privately(tmp_path, model, algorithm):
  config = flax_digits_config.get_config()
  config.model, config.algorithm = model, algorithm
  config.num_epochs, config.eval_every = 3, 6
  # A smaller target than the default 2 calibrates to larger noise, whose
  # privacy loss distribution is quicker to compute.
  config.epsilon = 1.0
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    result = flax_digits.run(config, str(tmp_path))
  first, last = result.rows[0], result.rows[-1]
  assert first['epsilon'] == 0.0
  assert 0.99 < last['epsilon'] <= 1.0 + 1e-9
  assert last['epoch'] == pytest.approx(3.0, rel=0.02)
  # Ten classes: chance is 0.1; even three private epochs do far better.
  assert last['test_accuracy'] > 0.3, last
  with open(os.path.join(tmp_path, 'run_record.json')) as f:
    record = json.load(f)
  assert record['privacy'][0]['epsilon_spent'] == pytest.approx(
      last['epsilon'])
  assert os.path.getsize(os.path.join(tmp_path, 'learning_curve.png')) > 0


def _jitted_sum(statistic):
  """`statistic(batch, params).sum`, compiled as one program."""
  return jax.jit(lambda batch, params: statistic(batch, params).sum)


def test_example_loss_is_one_example_and_dense_layers_go_ghost():
  graphdef, params = models.split(models.MLP([4, 8, 3], rngs=nnx.Rngs(0)))
  loss_fn = models.example_loss(graphdef)
  # Host arrays: the jitted programs take them as they are (no eager op).
  example = {'x': np.ones(4, np.float32), 'y': np.asarray(1, np.int32)}
  # Its shape from an abstract trace: nothing compiled.
  assert jax.eval_shape(loss_fn, params, example).shape == ()
  batch = {'x': np.ones((5, 4), np.float32), 'y': np.zeros(5, np.int32)}
  statistic = clipping.clipped_grad_sum(loss_fn, l2_clip=1.0)
  assert statistic.ghost_plan(batch, params) is not None
  # The ghost sum equals the per-example one (jitted: one compile each
  # instead of one per operation).
  vmapped = clipping.clipped_grad_sum(
      loss_fn, l2_clip=1.0, clipping_method='vmap')
  for a, b in zip(jax.tree.leaves(_jitted_sum(statistic)(batch, params)),
                  jax.tree.leaves(_jitted_sum(vmapped)(batch, params))):
    assert np.allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_the_cnn_takes_the_ghost_path_with_no_fallback():
  graphdef, params = models.split(
      models.CNN(10, image_size=8, rngs=nnx.Rngs(0)))
  loss_fn = models.example_loss(graphdef)
  batch = {'x': np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 8, 8),
           'y': np.arange(4, dtype=np.int32)}
  statistic = clipping.clipped_grad_sum(loss_fn, l2_clip=0.1)
  with warnings.catch_warnings():
    warnings.simplefilter('error', clipping.GhostClippingFallbackWarning)
    choice = statistic.clipping_choice(batch, params)
    # Traced here, inside the filter: a fallback while tracing raises.
    ghost_sum = _jitted_sum(statistic)(batch, params)
  assert choice is not None and choice.path == 'ghost', choice
  vmapped = clipping.clipped_grad_sum(
      loss_fn, l2_clip=0.1, clipping_method='vmap')
  for a, b in zip(jax.tree.leaves(ghost_sum),
                  jax.tree.leaves(_jitted_sum(vmapped)(batch, params))):
    assert np.allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_split_refuses_state_that_mixes_examples():

  class WithBatchNorm(nnx.Module):

    def __init__(self):
      self.norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.norm(x)

  with pytest.raises(ValueError, match='BatchNorm'):
    models.split(WithBatchNorm())
  with pytest.raises(ValueError, match='even'):
    models.CNN(10, image_size=7, rngs=nnx.Rngs(0))
