"""The privacy ledger: epsilon at any step, and refusal of a state it does not account."""

import warnings

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import optax

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import ledger as ledger_lib


def _loss(params, example):
  return jnp.sum((params - example) ** 2)


def _init(tx):
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    return tx.init(jnp.zeros(3))


class EpsilonAtTest(parameterized.TestCase):

  def test_matches_epsilon_spent_of_a_ledger_advanced_to_the_step(self):
    mechanism = dpsco_jax.dpftrl_mechanism(40, restart_every=10)
    participation = accounting.FixedOrder(4, 10)
    ledger = ledger_lib.PrivacyLedger.create(mechanism, 3.0, participation,
                                             1e-5, key=0)
    values = [ledger.epsilon_at(t, mechanism) for t in range(0, 41, 5)]
    self.assertEqual(values[0], 0.0)
    self.assertAlmostEqual(values[-1], ledger.planned_epsilon, places=9)
    for t, value in zip(range(0, 41, 5), values):
      self.assertAlmostEqual(
          value, ledger.advance_to(t).epsilon_spent(mechanism), places=9)
    # Epsilon never decreases with the steps, and a partial run is cheaper.
    self.assertTrue(all(a <= b + 1e-12 for a, b in zip(values, values[1:])))
    self.assertLess(values[3], values[-1])
    self.assertEqual(ledger.steps_consumed, 0)  # asking does not advance it

  def test_poisson_prefix_is_the_composition_of_fewer_steps(self):
    mechanism = dpsco_jax.dpsgd_mechanism(100)
    participation = accounting.PoissonSampling(0.05, 100)
    ledger = ledger_lib.PrivacyLedger.create(mechanism, 1.2, participation,
                                             1e-5, key=0)
    expected = accounting.epsilon_spent(
        dpsco_jax.dpsgd_mechanism(30), 1.2,
        accounting.PoissonSampling(0.05, 30), 1e-5)
    self.assertAlmostEqual(ledger.epsilon_at(30, mechanism), expected,
                           places=9)

  def test_refuses_steps_past_the_run(self):
    mechanism = dpsco_jax.dpsgd_mechanism(10)
    ledger = ledger_lib.PrivacyLedger.create(
        mechanism, 1.0, accounting.single_epoch(10), 1e-5, key=0)
    with self.assertRaisesRegex(ValueError, 'past the 10 steps'):
      ledger.epsilon_at(11, mechanism)
    with self.assertRaisesRegex(ledger_lib.LedgerMismatchError,
                                'not the mechanism'):
      ledger.epsilon_at(5, dpsco_jax.dpsgd_mechanism(11))


class CheckStateTest(parameterized.TestCase):

  def _ledger(self, mechanism, steps):
    return ledger_lib.PrivacyLedger.create(
        mechanism, 5.0, accounting.single_epoch(steps), 1e-5)

  def test_accepts_the_transformation_it_was_made_for(self):
    ledger = self._ledger(dpsco_jax.dpftrl_mechanism(100, restart_every=17),
                          100)
    tx = dpsco_jax.dpftrl(_loss, l2_clip=1.0, noise_multiplier=5.0,
                          num_steps=100, restart_every=17)
    ledger.check_state(_init(tx))

  @parameterized.named_parameters(
      # Calibrated with restarts, built without: 3.94 spent for 2 claimed.
      ('restart_left_out', dict(num_steps=100), 100, dict(restart_every=17)),
      # Calibrated for 50 steps, built for 100.
      ('more_steps', dict(num_steps=100, restart_every=17), 50,
       dict(restart_every=17)),
  )
  def test_refuses_a_transformation_built_differently(self, built, steps,
                                                       calibrated):
    ledger = self._ledger(dpsco_jax.dpftrl_mechanism(steps, **calibrated),
                          steps)
    tx = dpsco_jax.dpftrl(_loss, l2_clip=1.0, noise_multiplier=5.0, **built)
    with self.assertRaisesRegex(ledger_lib.LedgerMismatchError,
                                'made by another mechanism'):
      ledger.check_state(_init(tx))

  def test_refuses_a_state_without_noise(self):
    ledger = self._ledger(dpsco_jax.dpsgd_mechanism(10), 10)
    with self.assertRaisesRegex(ledger_lib.LedgerMismatchError,
                                'no dpsco_jax noise state'):
      ledger.check_state(optax.sgd(0.1).init(jnp.zeros(3)))


if __name__ == '__main__':
  absltest.main()
