"""Shared argument checks."""

import warnings

import jax.numpy as jnp
import optax
import pytest

import dpsco_jax
from dpsco_jax import checks
from dpsco_jax.algorithms import diff2


@pytest.mark.parametrize('value', [1, 7, 3.0])
def test_positive_int_accepts(value):
  assert checks.positive_int(value, 'n') == int(value)


@pytest.mark.parametrize('value', [0, -2, 2.5, True, None, 'three', float('nan')])
def test_positive_int_refuses(value):
  with pytest.raises(ValueError, match='n must be a positive integer'):
    checks.positive_int(value, 'n')


@pytest.mark.parametrize('value', [0, 0.0, 1.5, 1e6])
def test_noise_multiplier_accepts(value):
  assert checks.noise_multiplier(value) == float(value)


@pytest.mark.parametrize('value', [-1.0, -1e-12, float('nan'), float('inf'),
                                   float('-inf'), None, 'one'])
def test_noise_multiplier_refuses(value):
  with pytest.raises(ValueError, match='z must be a non-negative finite'):
    checks.noise_multiplier(value, 'z')


def test_no_noise_is_announced_not_silent():
  loss = lambda w, x: jnp.sum(w * x)
  with pytest.warns(checks.NoPrivacyWarning, match='epsilon is infinite'):
    dpsco_jax.dpsgd(loss, l2_clip=1.0, noise_multiplier=0.0, num_steps=3)
  with pytest.warns(checks.NoPrivacyWarning, match='z_1 = 0'):
    dpsco_jax.diff2_gd(loss, learning_rate=0.1, grad_clip=1.0,
                       diff_clip_factor=1.0, restart_interval=2,
                       num_rounds=4, noise_multipliers=(0.0, 1.0))
  with warnings.catch_warnings():
    warnings.simplefilter('error', checks.NoPrivacyWarning)
    # DP-GD's unused difference multiplier is 0 by construction: no warning.
    dpsco_jax.dp_gd(loss, learning_rate=0.1, grad_clip=1.0,
                    noise_multiplier=1.0, num_rounds=4)
    dpsco_jax.dpftrl(loss, l2_clip=1.0, noise_multiplier=0.5, num_steps=3)


@pytest.mark.parametrize('bad', [0.0, -1.0, float('nan'), float('inf'),
                                 'x', None])
def test_positive_finite_refuses_what_no_radius_or_step_can_be(bad):
  with pytest.raises(ValueError, match='radius must be positive and finite'):
    checks.positive_finite(bad, 'radius')


def test_positive_finite_returns_a_float():
  assert checks.positive_finite(jnp.float32(0.5), "radius") == 0.5


def test_find_state_finds_the_one_state_in_a_chain_or_wrapper():
  tx = diff2.random_output_iterate(3, key=0)
  inner = tx.init({'w': 1.0})
  chain = optax.chain(optax.sgd(0.1), optax.inject_hyperparams(
      optax.sgd)(learning_rate=0.1)).init({'w': 1.0})
  nested = (chain, (optax.EmptyState(), inner))
  assert checks.find_state(nested, diff2.RandomIterateState, 'x') is inner
  with pytest.raises(ValueError, match='expected one RandomIterateState'
                     r'.*found 0'):
    checks.find_state(chain, diff2.RandomIterateState, 'x')
  with pytest.raises(ValueError, match='found 2'):
    checks.find_state((inner, inner), diff2.RandomIterateState, 'x')
