"""Refusals: an eager ValueError, or NaN-poisoned output plus a raised error."""

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
  assert 'Traceback' not in str(caught.value)
  assert caught.value.__cause__ is None and caught.value.__suppress_context__
  # JAX's own log of the callback failure is not printed for a refusal.
  assert not [r for r in caplog.records if 'pure_callback failed' in
              r.getMessage()]
  # Eagerly, the same refusal is the same exception (a ValueError).
  with pytest.raises(guards.PrivacyGuardError, match='past the capacity'):
    tx.update(None, state, jnp.zeros(3), batch=jnp.ones((2, 3)))
  assert issubclass(guards.PrivacyGuardError, ValueError)


def test_library_errors_passes_other_errors_through():
  def broken(x):
    raise TypeError('not ours')
  with pytest.raises(TypeError, match='not ours'):
    guards.library_errors(broken)(1)
