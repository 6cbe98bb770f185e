"""Refusals: an eager error at once; under jit, NaN-poisoned output and a
record in the state that the host reads without waiting on the device
(`record`, `raise_if_refused`, `RefusalMonitor`). The legacy host-callback
`refuse` is tested last."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpsco_jax
from dpsco_jax import guards


def test_concrete_flag_raises_at_once():
  with pytest.raises(ValueError, match='refused here'):
    guards.refuse(True, {'a': jnp.ones(3)}, 'refused here')


def test_concrete_false_returns_the_tree_unchanged():
  tree = {'a': jnp.arange(3.0)}
  assert guards.refuse(False, tree, 'never') is tree


def test_traced_false_passes_values_through():
  out = jax.jit(lambda x: guards.refuse(x.sum() < 0, {'a': x}, 'never'))(
      jnp.arange(4.0))
  np.testing.assert_array_equal(out['a'], jnp.arange(4.0))


def test_traced_true_poisons_and_raises():
  poisoned = None
  with pytest.raises(Exception, match='refused under jit'):
    poisoned = jax.jit(
        lambda x: guards.refuse(x.sum() > 0, {'a': x, 'b': 2 * x},
                                'refused under jit'))(jnp.ones(4))
    # The callback is asynchronous: the values may arrive before the error.
    assert all(bool(jnp.all(jnp.isnan(leaf)))
               for leaf in jax.tree_util.tree_leaves(poisoned))
    jax.effects_barrier()


def test_under_vmap_one_host_call_per_step_for_all_runs(monkeypatch):
  """A sweep of 64 vmapped runs must not make 64 host round trips a step."""
  calls = []
  original = guards._raise_if  # pylint: disable=protected-access

  def counting(flag, anchor, message):
    calls.append(np.shape(flag))
    return original(flag, anchor, message)

  monkeypatch.setattr(guards, '_raise_if', counting)

  def run(limit):
    return guards.refuse(limit > 100, jnp.ones(3) * limit, 'over the limit')

  out = jax.jit(jax.vmap(run))(jnp.arange(64.0))
  assert np.all(np.isfinite(np.asarray(out)))
  assert len(calls) == 1 and calls[0] == (64,)
  # One lane over its limit: still refused.
  with pytest.raises(Exception, match='over the limit'):
    jax.block_until_ready(jax.jit(jax.vmap(run))(jnp.arange(64.0) * 2))


def test_refuse_any_raises_the_first_concrete_condition_that_holds():
  with pytest.raises(ValueError, match='second'):
    guards.refuse_any([(False, 'first'), (True, 'second'), (True, 'third')],
                      {'a': jnp.ones(2)})


def test_refuse_any_names_the_traced_condition_that_holds_in_one_call(
    monkeypatch):
  calls = []
  original = guards._raise_if  # pylint: disable=protected-access

  def counting(flag, anchor, message):
    calls.append((np.shape(flag), message))
    return original(flag, anchor, message)

  monkeypatch.setattr(guards, '_raise_if', counting)

  def run(x):
    return guards.refuse_any([(x > 100, 'too large'), (x < 0, 'negative')],
                             jnp.ones(3) * x)

  out = jax.jit(jax.vmap(run))(jnp.arange(8.0))
  assert np.all(np.isfinite(np.asarray(out)))
  assert len(calls) == 1 and calls[0] == ((8, 2), ('too large', 'negative'))
  with pytest.raises(Exception, match='negative'):
    jax.block_until_ready(jax.jit(jax.vmap(run))(jnp.arange(8.0) - 1))
  with pytest.raises(Exception, match='too large'):
    jax.block_until_ready(jax.jit(run)(jnp.asarray(101.0)))


def test_a_refusal_under_jit_surfaces_as_one_short_exception(caplog):
  tx = dpsco_jax.dpsgd(lambda w, x: jnp.sum(w * x), l2_clip=1.0,
                       noise_multiplier=1.0, num_steps=1, key=0)
  state = tx.init(jnp.zeros(3))
  step = guards.library_errors(jax.jit(
      lambda s: tx.update(None, s, jnp.zeros(3), batch=jnp.ones((2, 3)))))
  _, state = step(state)
  with pytest.raises(guards.PrivacyGuardError) as caught:
    step(state)
  first_line = str(caught.value).splitlines()[0]
  assert first_line.startswith('gaussian: a step past the capacity of 1')
  assert 'refused at step 1' in first_line
  assert 'Traceback' not in str(caught.value)
  assert caught.value.__cause__ is None
  assert not [r for r in caplog.records if 'callback' in r.getMessage()]
  # Eagerly, the same refusal is the same exception (a ValueError).
  with pytest.raises(guards.PrivacyGuardError, match='past the capacity'):
    tx.update(None, state, jnp.zeros(3), batch=jnp.ones((2, 3)))
  assert issubclass(guards.PrivacyGuardError, ValueError)


def test_library_errors_passes_other_errors_through():
  def broken(x):
    raise TypeError('not ours')
  with pytest.raises(TypeError, match='not ours'):
    guards.library_errors(broken)(1)


# ------------------------------------------------ records kept in the state


def _record_step(limit, record, step):
  return guards.record([(limit > 100, 'over the limit'),
                        (limit < 0, 'negative')], jnp.ones(3) * limit,
                       record, step)


def test_record_poisons_and_keeps_the_first_failed_check():
  step = jax.jit(_record_step)
  clear = guards.no_refusal()
  out, record = step(jnp.asarray(5.0), clear, 0)
  np.testing.assert_array_equal(out, 5.0 * np.ones(3))
  assert int(record.check) == 0 and int(record.step) == -1
  out, record = step(jnp.asarray(-1.0), record, 7)
  assert np.all(np.isnan(out))
  with pytest.raises(guards.PrivacyGuardError) as raised:
    guards.raise_if_refused({'state': record})
  assert str(raised.value).startswith('negative (refused at step 7')
  assert raised.value.step == 7 and raised.value.check == 'negative'
  # Sticky: a passing check after a refusal is still poisoned, and the
  # first refusal is the one kept.
  out, later = step(jnp.asarray(5.0), record, 8)
  assert np.all(np.isnan(out))
  out, later = step(jnp.asarray(500.0), later, 9)
  assert int(later.step) == 7 and int(later.check) == int(record.check)


def test_a_mechanism_state_that_refused_draws_nan_ever_after():
  mechanism = dpsco_jax.noise.gaussian(num_steps=1)
  draw = jax.jit(mechanism.next)
  template = jnp.zeros(4)
  state = mechanism.init(template, jax.random.key(0))
  noise, state = draw(state, template)
  assert np.all(np.isfinite(noise))
  noise, refused = draw(state, template)          # past the capacity
  assert np.all(np.isnan(noise)) and int(refused.refusal.step) == 1
  # Put the counter back below the capacity: the record still poisons.
  rewound = refused._replace(step=jnp.zeros((), jnp.int32))
  noise, _ = draw(rewound, template)
  assert np.all(np.isnan(noise))
  with pytest.raises(guards.PrivacyGuardError, match='refused at step 1'):
    guards.raise_if_refused(rewound)


def test_record_in_a_compiled_step_has_no_callback_and_no_conditional():
  text = jax.jit(_record_step).lower(
      jnp.asarray(1.0), guards.no_refusal(), 0).compile().as_text()
  assert 'conditional' not in text and 'callback' not in text.lower()
  # The legacy callback guard does hold both (what the check would catch).
  legacy = jax.jit(lambda x: guards.refuse(x > 1, x, 'no')).lower(
      jnp.asarray(1.0)).compile().as_text()
  assert 'conditional' in legacy and 'callback' in legacy.lower()


def test_record_under_vmap_names_the_run_that_refused():
  runs = jnp.arange(8.0) * 20.0             # runs 6 and 7 exceed 100
  records = jax.vmap(guards.no_refusal, axis_size=8)()
  out, records = jax.jit(jax.vmap(_record_step, in_axes=(0, 0, None)))(
      runs, records, 3)
  assert np.all(np.isfinite(out[:6])) and np.all(np.isnan(out[6:]))
  with pytest.raises(guards.PrivacyGuardError) as raised:
    guards.raise_if_refused(records)
  assert 'over the limit (refused at step 3, in entry 6 of the 8' in str(
      raised.value)


def test_record_raises_at_once_when_eager():
  with pytest.raises(guards.PrivacyGuardError, match='negative'):
    _record_step(jnp.asarray(-1.0), guards.no_refusal(), 0)
  out, record = _record_step(jnp.asarray(1.0), guards.no_refusal(), 0)
  np.testing.assert_array_equal(out, np.ones(3))
  _, refused = jax.jit(_record_step)(jnp.asarray(-1.0), record, 2)
  with pytest.raises(guards.PrivacyGuardError, match='refused at step 2'):
    _record_step(jnp.asarray(1.0), refused, 3)


def test_monitor_raises_at_most_max_lag_steps_late():
  step = jax.jit(_record_step)
  monitor = guards.RefusalMonitor(max_lag=2)
  record = guards.no_refusal()
  raised_at = None
  for t in range(10):
    _, record = step(jnp.asarray(-1.0 if t == 4 else 1.0), record, t)
    try:
      monitor.watch(record)
    except guards.PrivacyGuardError as error:
      raised_at = t
      assert error.step == 4
      break
  assert raised_at is not None and 4 <= raised_at <= 6
  # flush waits for everything still pending.
  monitor = guards.RefusalMonitor(max_lag=5)
  _, record = step(jnp.asarray(-1.0), guards.no_refusal(), 0)
  try:
    monitor.watch(record)
  except guards.PrivacyGuardError:
    pass                                    # already ready: raised at once
  else:
    with pytest.raises(guards.PrivacyGuardError):
      monitor.flush()
  with pytest.raises(ValueError, match='max_lag'):
    guards.RefusalMonitor(max_lag=-1)


def test_an_unknown_code_still_raises():
  record = guards.Refusal(check=np.asarray(12345, np.uint32),
                          step=np.asarray(3, np.int32))
  with pytest.raises(guards.PrivacyGuardError, match='code 0x00003039'):
    guards.raise_if_refused(record)
