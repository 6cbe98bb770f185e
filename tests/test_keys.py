"""Noise keys: fresh secret keys by default, the warning on a key given to two
runs, and a DP-SGD that refuses to be built without its step budget."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import checkpoint
from dpsco_jax import keys
from dpsco_jax import noise


def _loss(params, example):
  return 0.5 * jnp.sum((params['w'] - example['x']) ** 2)


PARAMS = {'w': jnp.zeros(4)}
BATCH = {'x': jnp.ones((2, 4))}


@pytest.fixture(autouse=True)
def _fresh_registry():
  keys.forget_keys()
  yield
  keys.forget_keys()


def _dpsgd(**kwargs):
  return dpsco_jax.dpsgd(_loss, l2_clip=1.0, noise_multiplier=1.0,
                         num_steps=4, **kwargs)


def test_dpsgd_requires_its_step_budget():
  """Was accepted: `num_steps=None` never refused a step past the budget."""
  with pytest.raises(TypeError, match='num_steps'):
    dpsco_jax.dpsgd(_loss, l2_clip=1.0, noise_multiplier=1.0, key=1)
  with pytest.raises(ValueError, match='needs num_steps'):
    dpsco_jax.dpsgd(_loss, l2_clip=1.0, noise_multiplier=1.0, key=1,
                    num_steps=None)
  with pytest.raises(ValueError, match='no capacity'):
    dpsco_jax.estimators.noisy_gradient(
        _loss, l2_clip=1.0, noise_multiplier=1.0, mechanism=noise.gaussian(),
        key=1)


def test_dpsgd_refuses_the_step_past_its_budget():
  tx = _dpsgd(key=3)
  state = tx.init(PARAMS)
  for _ in range(4):
    _, state = tx.update(None, state, PARAMS, batch=BATCH)
  with pytest.raises(ValueError, match='past the capacity of 4 steps'):
    tx.update(None, state, PARAMS, batch=BATCH)


def test_default_keys_are_fresh_and_secret():
  """Two runs built without a key never share noise (the README used to
  show key=0 everywhere: two runs on neighbouring data cancelled it)."""
  with warnings.catch_warnings():
    warnings.simplefilter('error', keys.KeyReuseWarning)
    first, second = _dpsgd(), _dpsgd()
  out_first, _ = first.update(None, first.init(PARAMS), PARAMS, batch=BATCH)
  out_second, _ = second.update(None, second.init(PARAMS), PARAMS,
                                batch=BATCH)
  assert not np.allclose(out_first['w'], out_second['w'])
  data = [np.asarray(jax.random.key_data(keys.fresh_key()))
          for _ in range(8)]
  assert len({row.tobytes() for row in data}) == 8


def test_a_key_given_to_two_runs_warns_once_per_reuse():
  with warnings.catch_warnings():
    warnings.simplefilter('error', keys.KeyReuseWarning)
    _dpsgd(key=5)                      # first use: silent
    _dpsgd(key=6)
  with pytest.warns(keys.KeyReuseWarning, match='already given'):
    dpsco_jax.dpftrl(_loss, l2_clip=1.0, noise_multiplier=1.0, num_steps=4,
                     key=5)
  # The same key as a typed key, or as a raw PRNGKey, is the same key.
  with pytest.warns(keys.KeyReuseWarning):
    _dpsgd(key=jax.random.PRNGKey(6))
  with pytest.warns(keys.KeyReuseWarning):
    dpsco_jax.accelerated_dp_srgd(_loss, l2_clip=1.0, noise_multiplier=1.0,
                                  num_steps=4, beta=1.0, radius=10.0,
                                  key=jax.random.key(6))


def test_composed_transformations_do_not_warn_about_their_own_parts():
  with warnings.catch_warnings():
    warnings.simplefilter('error', keys.KeyReuseWarning)
    dpsco_jax.accelerated_dp_srgd(_loss, l2_clip=1.0, noise_multiplier=1.0,
                                  num_steps=4, beta=1.0, radius=10.0, key=9)
    dpsco_jax.diff2_bvr_local_sgd(
        _loss, learning_rate=0.1, grad_clip=1.0, diff_clip_factor=1.0,
        restart_interval=2, num_rounds=4,
        noise_multipliers=dpsco_jax.Diff2NoiseMultipliers(1.0, 1.0, 1.0),
        key=10, local_steps=2, local_batch_size=1)


def test_traced_keys_are_not_checked():
  def build(seed):
    tx = _dpsgd(key=jax.random.key(seed))
    return tx.update(None, tx.init(PARAMS), PARAMS, batch=BATCH)[0]['w']

  with warnings.catch_warnings():
    warnings.simplefilter('error', keys.KeyReuseWarning)
    out = jax.vmap(build)(jnp.array([0, 0, 1]))
  np.testing.assert_array_equal(out[0], out[1])


def test_the_fresh_key_reaches_the_ledger_and_the_checkpoint(tmp_path):
  tx = _dpsgd()
  mechanism = dpsco_jax.dpsgd_mechanism(4)
  state = tx.init(PARAMS)
  key = checkpoint.noise_key_of(state, mechanism)
  assert checkpoint.noise_key_of(state) is key
  ledger = checkpoint.PrivacyLedger.create(
      mechanism, 1.0, accounting.single_epoch(4), 1e-5, key=key)
  path = str(tmp_path / 'ckpt')
  checkpoint.save(path, params=PARAMS, opt_state=state, step=0,
                  ledger=ledger)
  ckpt = checkpoint.restore(path, params_like=PARAMS, opt_state_like=state,
                            ledger=ledger)
  np.testing.assert_array_equal(
      jax.random.key_data(ckpt.opt_state.noise.key), jax.random.key_data(key))
  with pytest.raises(ValueError, match='no noise state made by'):
    checkpoint.noise_key_of(state, dpsco_jax.dpftrl_mechanism(4))


def test_a_run_with_a_fresh_key_resumes_with_the_checkpoints_key(tmp_path):
  """The resumed process draws another fresh key at construction; the run
  continues with the saved one, and the outputs equal an uninterrupted run."""
  path = str(tmp_path / 'ckpt')
  mechanism = dpsco_jax.dpsgd_mechanism(4)

  def ledger():
    return checkpoint.PrivacyLedger.create(
        mechanism, 1.0, accounting.single_epoch(4), 1e-5)

  tx = _dpsgd()
  ckpt = checkpoint.restore_or_init(path, params=PARAMS,
                                    opt_state=tx.init(PARAMS), ledger=ledger())
  state, run_ledger = ckpt.opt_state, ckpt.ledger
  assert run_ledger.key_fingerprint == checkpoint.key_fingerprint(
      checkpoint.noise_key_of(state))
  outputs = []
  for step in range(1, 5):
    out, state = tx.update(None, state, PARAMS, batch=BATCH)
    outputs.append(out['w'])
    if step == 2:
      run_ledger = checkpoint.save(path, params=PARAMS, opt_state=state,
                                   step=2, ledger=run_ledger)
  resumed_tx = _dpsgd()                     # another fresh key
  ckpt = checkpoint.restore_or_init(path, params=PARAMS,
                                    opt_state=resumed_tx.init(PARAMS),
                                    ledger=ledger())
  assert ckpt.step == 2
  state = ckpt.opt_state
  for step in range(3, 5):
    out, state = resumed_tx.update(None, state, PARAMS, batch=BATCH)
    np.testing.assert_array_equal(out['w'], outputs[step - 1])
