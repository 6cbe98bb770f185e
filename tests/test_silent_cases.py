"""The silent cases of issue 16: what a mismatched run would spend, and the refusal now.

Each case computes what the run really spends against what was claimed (the
"before": nothing complained), then checks that the library refuses the
mismatch (the "after"). The numbers are the ones quoted in the docs.
"""

import warnings

import jax.numpy as jnp
import optax
import pytest

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import ledger as ledger_lib
from dpsco_jax import plans


def _loss(params, example):
  return jnp.sum((params - example) ** 2)


def _state(tx):
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    return tx.init(jnp.zeros(3))


@pytest.mark.parametrize('calibrated, built, participation, run, spent', [
    # Calibrated with restarts every 17 steps, built without them.
    (dict(num_steps=100, restart_every=17), dict(num_steps=100),
     accounting.FixedOrder(1, 100), accounting.FixedOrder(1, 100), 2.41),
    # Calibrated for 50 steps, built for (and run) 100: two epochs.
    (dict(num_steps=50), dict(num_steps=100), accounting.FixedOrder(1, 50),
     accounting.FixedOrder(2, 50), 3.48),
])
def test_a_transformation_built_unlike_its_calibration_is_refused(
    calibrated, built, participation, run, spent):
  mechanism = dpsco_jax.dpftrl_mechanism(**calibrated)
  z = dpsco_jax.calibrate_noise_multiplier(mechanism, participation, 2.0,
                                           1e-5)
  really = dpsco_jax.epsilon_spent(dpsco_jax.dpftrl_mechanism(**built), z,
                                   run, 1e-5)
  assert really == pytest.approx(spent, abs=0.01)    # claimed: 2.00
  ledger = ledger_lib.PrivacyLedger.create(mechanism, z, participation, 1e-5)
  tx = dpsco_jax.dpftrl(_loss, l2_clip=1.0, noise_multiplier=z, **built)
  with pytest.raises(ledger_lib.LedgerMismatchError, match='another mechanism'):
    ledger.check_state(_state(tx))


def test_one_dpftrl_run_described_three_ways():
  participation = accounting.FixedOrder(5, 20)
  mechanism = dpsco_jax.dpftrl_mechanism(100, restart_every=20)
  z = dpsco_jax.calibrate_noise_multiplier(mechanism, participation, 1.0,
                                           1e-5)
  without_restarts = dpsco_jax.epsilon_spent(
      dpsco_jax.dpftrl_mechanism(100), z, participation, 1e-5)
  as_one_epoch = dpsco_jax.epsilon_spent(
      mechanism, z, accounting.single_epoch(100), 1e-5)
  assert without_restarts == pytest.approx(1.47, abs=0.01)
  assert as_one_epoch == pytest.approx(0.42, abs=0.01)
  # The plan is one description: its mechanism and participation are the
  # run's, and so is its epsilon.
  plan = plans.dpftrl(_loss, optimizer=optax.sgd(0.1), num_examples=2000,
                      batch_size=100, epochs=5, l2_clip=1.0, epsilon=1.0,
                      delta=1e-5)
  assert plan.mechanism.identity == mechanism.identity
  assert plan.participation == participation
  assert plan.noise_multiplier == pytest.approx(z, rel=1e-9)
  assert plan.epsilon == pytest.approx(1.0, abs=1e-6)
