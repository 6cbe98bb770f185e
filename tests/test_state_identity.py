"""A state is only ever continued by the transformation (and mechanism) that
made it: refused at update, at save and at restore, eagerly and under jit.

The attack these tests replay: a DP-SGD state continued by DP-FTRL while the
DP-SGD ledger is kept. At FixedOrder(2, 8) with noise multiplier 2.82 the
ledger claims epsilon 2.00, while the tree noise at that multiplier spends
5.57.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import checkpoint
from dpsco_jax import noise
from dpsco_jax import strategies

PARTICIPATION = accounting.FixedOrder(2, 8)
NUM_STEPS = PARTICIPATION.num_steps
SIGMA, DELTA, KEY = 2.82, 1e-5, 11


def _loss(params, example):
  return 0.5 * jnp.sum((params['w'] * example['x'] - example['y']) ** 2)


PARAMS = {'w': jnp.zeros(3)}
BATCH = {'x': jnp.ones((4, 3)), 'y': jnp.ones((4, 3))}


def _dpsgd():
  return dpsco_jax.dpsgd(_loss, l2_clip=1.0, noise_multiplier=SIGMA,
                         num_steps=NUM_STEPS, key=KEY)


def _dpftrl():
  return dpsco_jax.dpftrl(_loss, l2_clip=1.0, noise_multiplier=SIGMA,
                          num_steps=NUM_STEPS, key=KEY)


def test_the_attack_is_worth_refusing():
  """The gap the refusal closes: the DP-SGD ledger under-reports DP-FTRL."""
  claimed = accounting.epsilon_spent(dpsco_jax.dpsgd_mechanism(NUM_STEPS),
                                     SIGMA, PARTICIPATION, DELTA)
  actual = accounting.epsilon_spent(dpsco_jax.dpftrl_mechanism(NUM_STEPS),
                                    SIGMA, PARTICIPATION, DELTA)
  assert claimed == pytest.approx(2.00, abs=0.01)
  assert actual == pytest.approx(5.57, abs=0.01)


def _mechanisms():
  strategy = strategies.optimize_strategy(strategies.workload(8), 1)
  return {
      'gaussian(8)': noise.gaussian(8),
      'gaussian(9)': noise.gaussian(9),
      'gaussian(None)': noise.gaussian(),
      'gaussian, other sampler': noise.gaussian(
          8, sampler=lambda k, s, d: jnp.ones(s, d)),
      'tree per_step': noise.tree(8),
      'tree prefix': noise.tree(8, release='prefix'),
      'tree restarts': noise.tree(8, restart_every=4),
      'tree honaker': noise.tree(8, honaker=True),
      'tree(16)': noise.tree(16),
      'mf optimized': noise.matrix_factorization(strategy),
      'mf identity': noise.matrix_factorization(np.eye(8)),
      'mf prefix': noise.matrix_factorization(strategy, release='prefix'),
      'mf regenerate': noise.matrix_factorization(strategy,
                                                  storage='regenerate'),
  }


def test_identities_tell_every_mechanism_apart_and_are_reproducible():
  first, second = _mechanisms(), _mechanisms()
  identities = {name: m.identity for name, m in first.items()}
  assert len(set(identities.values())) == len(identities)
  for name, mechanism in second.items():
    assert mechanism.identity == identities[name], name
    state = mechanism.init(PARAMS, jax.random.key(0))
    np.testing.assert_array_equal(
        state.mechanism_id, noise.identity_words(mechanism.identity))


@pytest.mark.parametrize('maker,other', [
    (noise.gaussian(8), noise.tree(8)),
    (noise.tree(8), noise.gaussian(8)),
    (noise.tree(8), noise.tree(8, restart_every=4)),
    (noise.gaussian(8), noise.matrix_factorization(np.eye(8))),
    (noise.matrix_factorization(np.eye(8)),
     noise.matrix_factorization(2 * np.eye(8))),
])
def test_next_refuses_a_state_of_another_mechanism(maker, other):
  state = maker.init(PARAMS, jax.random.key(0))
  with pytest.raises(ValueError, match='another noise mechanism'):
    other.next(state, PARAMS)
  # The maker itself accepts it.
  maker.next(state, PARAMS)


def test_next_refuses_states_it_cannot_have_made():
  mechanism = noise.gaussian(8)
  with pytest.raises(ValueError, match='no mechanism identity'):
    mechanism.next(noise.NoiseState(key=jax.random.key(0),
                                    step=jnp.zeros((), jnp.int32)), PARAMS)
  with pytest.raises(ValueError, match='expected the NoiseState'):
    mechanism.next(optax.EmptyState(), PARAMS)


@pytest.mark.parametrize('make_from,make_into', [(_dpsgd, _dpftrl),
                                                 (_dpftrl, _dpsgd)])
def test_update_refuses_the_other_algorithms_state_eagerly(make_from,
                                                            make_into):
  state = make_from().init(PARAMS)
  with pytest.raises(ValueError, match='another noise mechanism'):
    make_into().update(None, state, PARAMS, batch=BATCH)


def test_update_refuses_the_other_algorithms_state_under_jit():
  state = _dpsgd().init(PARAMS)
  dpftrl = _dpftrl()
  step = jax.jit(lambda s: dpftrl.update(None, s, PARAMS, batch=BATCH))
  out, refused = step(state)
  assert np.all(np.isnan(np.asarray(out['w'])))
  with pytest.raises(dpsco_jax.PrivacyGuardError,
                     match='another noise mechanism'):
    dpsco_jax.raise_if_refused(refused)
  # Its own state passes under the same compiled step.
  out, passed = step(dpftrl.init(PARAMS))
  assert np.all(np.isfinite(np.asarray(out['w'])))
  dpsco_jax.raise_if_refused(passed)


def test_under_vmap_one_foreign_run_is_refused():
  dpsgd, dpftrl = _dpsgd(), _dpftrl()
  states = jax.vmap(lambda _: dpftrl.init(PARAMS))(jnp.arange(4))
  ids = states.noise.mechanism_id.at[2].set(
      jnp.asarray(dpsgd.init(PARAMS).noise.mechanism_id))
  states = states._replace(noise=states.noise._replace(mechanism_id=ids))
  run = jax.jit(jax.vmap(lambda s: dpftrl.update(None, s, PARAMS,
                                                 batch=BATCH)))
  out, states = run(states)
  refused = np.isnan(np.asarray(out['w'])).all(axis=-1)
  np.testing.assert_array_equal(refused, [False, False, True, False])
  with pytest.raises(dpsco_jax.PrivacyGuardError,
                     match='another noise mechanism.*entry 2 of the 4'):
    dpsco_jax.raise_if_refused(states)


def _transformations():
  strategy = strategies.optimize_strategy(strategies.workload(8), 1)
  common = dict(l2_clip=1.0, noise_multiplier=1.0, key=0)
  return {
      'dpsgd': dpsco_jax.dpsgd(_loss, num_steps=8, **common),
      'srg_gradient': dpsco_jax.srg_gradient(_loss, num_steps=8, **common),
      'accelerated_dp_srgd': dpsco_jax.accelerated_dp_srgd(
          _loss, num_steps=8, beta=1.0, radius=10.0, **common),
      'dp_srg_memf': dpsco_jax.dp_srg_memf(_loss, strategy=strategy,
                                           steps_per_epoch=8, decay=0.1,
                                           num_examples=32, **common),
      'diff2_gd': dpsco_jax.diff2_gd(
          _loss, grad_clip=1.0, diff_clip_factor=1.0, restart_interval=2,
          num_rounds=8, learning_rate=0.1,
          noise_multipliers=dpsco_jax.Diff2NoiseMultipliers(1.0, 1.0), key=0,
          neighboring_relation='replace_one'),
  }


def test_a_state_of_another_transformation_is_a_clear_error():
  """Was: AttributeError "'builtin_function_or_method' object has no
  attribute 'astype'" (a NamedTuple's `count` method read as a field)."""
  transformations = _transformations()
  states = {name: tx.init(PARAMS) for name, tx in transformations.items()}
  for into, tx in transformations.items():
    for source, state in states.items():
      if source == into or (into, source) == ('dp_srg_memf', 'srg_gradient'):
        continue
      # (optax.chain itself refuses a state with another number of parts.)
      with pytest.raises(ValueError, match='another transformation|another '
                         'noise mechanism|expected the NoiseState|number of '
                         'updates and states'):
        tx.update(None, state, PARAMS, batch=BATCH,
                  example_ids=jnp.arange(4))


def _ledger(mechanism):
  return checkpoint.PrivacyLedger.create(mechanism, SIGMA, PARTICIPATION,
                                         DELTA, key=KEY)


def test_ledger_fingerprint_is_the_state_identity():
  mechanism = dpsco_jax.dpsgd_mechanism(NUM_STEPS)
  assert _ledger(mechanism).mechanism_fingerprint == mechanism.identity


def test_save_refuses_a_state_of_another_mechanism_than_the_ledgers(tmp_path):
  ledger = _ledger(dpsco_jax.dpsgd_mechanism(NUM_STEPS))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match="not made by the ledger's mechanism"):
    checkpoint.save(str(tmp_path / 'ckpt'), params=PARAMS,
                    opt_state=_dpftrl().init(PARAMS), step=0, ledger=ledger)


def test_restore_refuses_to_continue_dpsgd_as_dpftrl(tmp_path):
  path = str(tmp_path / 'ckpt')
  dpsgd, dpftrl = _dpsgd(), _dpftrl()
  ledger = _ledger(dpsco_jax.dpsgd_mechanism(NUM_STEPS))
  state = dpsgd.init(PARAMS)
  for _ in range(3):
    _, state = dpsgd.update(None, state, PARAMS, batch=BATCH)
  checkpoint.save(path, params=PARAMS, opt_state=state, step=3, ledger=ledger)
  # The same tree structure: only the identity tells the states apart.
  assert (jax.tree_util.tree_structure(state) ==
          jax.tree_util.tree_structure(dpftrl.init(PARAMS)))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match='another noise mechanism'):
    checkpoint.restore(path, params_like=PARAMS,
                       opt_state_like=dpftrl.init(PARAMS), ledger=ledger)
  # A shape-only template cannot be compared at restore; the identity comes
  # back from the file and the first DP-FTRL step refuses it.
  ckpt = checkpoint.restore(path, params_like=PARAMS,
                            opt_state_like=jax.eval_shape(dpftrl.init, PARAMS),
                            ledger=ledger)
  with pytest.raises(ValueError, match='another noise mechanism'):
    dpftrl.update(None, ckpt.opt_state, PARAMS, batch=BATCH)
  # And DP-SGD resumes as before.
  ckpt = checkpoint.restore(path, params_like=PARAMS,
                            opt_state_like=dpsgd.init(PARAMS), ledger=ledger)
  dpsgd.update(None, ckpt.opt_state, PARAMS, batch=BATCH)


def test_restore_refuses_a_ledger_of_another_mechanism(tmp_path):
  path = str(tmp_path / 'ckpt')
  ledger = _ledger(dpsco_jax.dpsgd_mechanism(NUM_STEPS))
  checkpoint.save(path, params=PARAMS, opt_state=_dpsgd().init(PARAMS),
                  step=0, ledger=ledger)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match='mechanism_fingerprint'):
    checkpoint.restore(path, params_like=PARAMS,
                       opt_state_like=_dpftrl().init(PARAMS),
                       ledger=_ledger(dpsco_jax.dpftrl_mechanism(NUM_STEPS)))


def test_a_private_estimator_after_another_transformation_is_refused():
  """Was silent: optax.sgd before dpsgd had its output discarded and the run
  trained uphill."""
  wrong = optax.chain(optax.sgd(0.1), _dpsgd())
  state = wrong.init(PARAMS)
  with pytest.raises(ValueError, match='FIRST in optax.chain'):
    wrong.update(PARAMS, state, PARAMS, batch=BATCH)
  for name, tx in _transformations().items():
    with pytest.raises(ValueError, match='FIRST in optax.chain'):
      tx.update(PARAMS, tx.init(PARAMS), PARAMS, batch=BATCH,
                example_ids=jnp.arange(4))
