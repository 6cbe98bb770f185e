"""The plan configs: checked once, and reaching every family's estimator."""

import functools
import warnings

import optax
import pytest

from dpsco_jax import plan_config
from dpsco_jax import plans

N, FEATURES, DELTA = 60, 3, 1e-5
BATCHED = dict(num_examples=N, batch_size=10, l2_clip=1.0, delta=DELTA,
               noise_multiplier=2.0, seed=0, key=0)
NONSMOOTH = dict(num_examples=N, dimension=FEATURES + 1, lipschitz=1.0,
                 smoothing_radius=0.1, movement_radius=0.01,
                 learning_rate=0.05, block_length=2, period=2,
                 num_directions=2, num_steps=4, delta=1e-6, key=0)


def linear_loss(params, example):
  """The squared error of a linear model on ONE example."""
  prediction = example['x'] @ params['w'] + params['b']
  return optax.squared_error(prediction, example['y'])


sgd = optax.sgd(0.1)
# Every plan function, built with a given noise (no calibration); each
# takes the clipping keywords of `plan_config.Clipping` it offers.
PLANS = {
    'dpsgd': functools.partial(plans.dpsgd, linear_loss, optimizer=sgd,
                               epochs=2, **BATCHED),
    'dpftrl': functools.partial(plans.dpftrl, linear_loss, optimizer=sgd,
                                epochs=2, **BATCHED),
    'dpmemf': functools.partial(plans.dpmemf, linear_loss, optimizer=sgd,
                                epochs=2, strategy='banded_sqrt', bands=2,
                                **BATCHED),
    'accelerated_dp_srgd': functools.partial(
        plans.accelerated_dp_srgd, linear_loss, beta=10.0, radius=None,
        **BATCHED),
    'unaccelerated_dp_srg': functools.partial(
        plans.unaccelerated_dp_srg, linear_loss, beta=10.0, radius=None,
        **BATCHED),
    'dp_srg_memf': functools.partial(
        plans.dp_srg_memf, linear_loss, optimizer=sgd, epochs=2, decay=0.5,
        strategy='banded_sqrt', bands=2, **BATCHED),
    'diff2_gd': functools.partial(
        plans.diff2_gd, linear_loss, learning_rate=0.1, num_rounds=4,
        restart_interval=2, grad_clip=1.0, diff_clip_factor=1.5,
        num_examples=N, noise_multipliers=(2.0, 3.0), delta=DELTA, key=0),
    'dp_gd': functools.partial(
        plans.dp_gd, linear_loss, learning_rate=0.1, num_rounds=4,
        grad_clip=1.0, num_examples=N, noise_multiplier=2.0, delta=DELTA,
        key=0),
    'user_level_dpsgd': functools.partial(
        plans.user_level_dpsgd, linear_loss, optimizer=sgd, num_users=N,
        users_per_batch=10, epochs=2, l2_clip=1.0, noise_multiplier=2.0,
        delta=DELTA, seed=0, key=0),
    'nonsmooth_single_pass': functools.partial(
        plans.nonsmooth_single_pass, linear_loss, order='first',
        anchor_batch_size=8, batch_size=4, noise_multiplier=1.0, seed=0,
        **NONSMOOTH),
    'nonsmooth_multi_pass': functools.partial(
        plans.nonsmooth_multi_pass, linear_loss, order='zero',
        noise_multipliers=(1.0, 1.0), **NONSMOOTH),
}
# The nonsmooth estimators have no clipping path to choose.
WITH_CLIPPING_METHOD = set(PLANS) - {'nonsmooth_single_pass',
                                     'nonsmooth_multi_pass'}


@pytest.mark.parametrize('name', sorted(PLANS))
def test_the_clipping_config_reaches_every_family_statistic(name):
  keywords = {'microbatch_size': 3}
  if name in WITH_CLIPPING_METHOD:
    keywords['clipping_method'] = 'vmap'
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    plan = PLANS[name](**keywords)
  statistics = plan._statistics  # pylint: disable=protected-access
  assert statistics, f'{name} computes no clipped statistic of the library'
  for statistic in statistics:
    assert statistic.microbatch_size == 3, (name, statistic)
    if name in WITH_CLIPPING_METHOD:
      assert statistic.clipping_method == 'vmap', (name, statistic)


@pytest.mark.parametrize('given', [
    dict(epsilon=1.0, noise_multiplier=1.0), {}])
def test_a_privacy_target_takes_exactly_one_of_epsilon_and_the_noise(given):
  with pytest.raises(ValueError, match='exactly one of epsilon'):
    plan_config.PrivacyTarget(delta=DELTA, **given)


@pytest.mark.parametrize('bad', [dict(epsilon=0.0), dict(delta=1.0),
                                 dict(delta=0.0)])
def test_a_privacy_target_out_of_range_is_refused(bad):
  with pytest.raises(ValueError):
    plan_config.PrivacyTarget(**{'delta': DELTA, 'epsilon': 1.0, **bad})


def test_sampling_refuses_a_batch_larger_than_the_data():
  with pytest.raises(ValueError, match='exceeds num_examples'):
    plan_config.Sampling(num_examples=10, batch_size=11)
  with pytest.raises(ValueError, match='sampling must be one of'):
    plan_config.Sampling(num_examples=10, batch_size=5,
                         sampling='random').sampler()


def test_a_plan_function_gathers_its_keywords_into_the_configs():
  keywords = dict(epsilon=2.0, delta=DELTA, l2_clip=1.5, microbatch_size=4,
                  axis_name='batch', key=7, unrelated=1)
  target, clip, devices, noise_key = plan_config.from_keywords(
      keywords, plan_config.PrivacyTarget, plan_config.Clipping,
      plan_config.Devices, plan_config.NoiseKey)
  assert (target.epsilon, target.delta, target.method) == (2.0, DELTA, 'pld')
  assert (clip.l2_clip, clip.microbatch_size, clip.clipping_method,
          clip.physical_batch_size) == (1.5, 4, 'auto', None)
  assert devices.axis_name == 'batch' and noise_key.key == 7
