"""Refusals: an eager ValueError, or NaN-poisoned output plus a raised error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_several_conditions_share_one_check(monkeypatch):
  messages = ('first broken', 'second broken')
  with pytest.raises(ValueError, match='second broken'):
    guards.refuse((False, True), jnp.ones(3), messages)
  assert guards.refuse((False, False), 1.0, messages) == 1.0
  calls = []
  original = guards._raise_if  # pylint: disable=protected-access

  def counting(flag, anchor, message):
    calls.append(np.shape(flag))
    return original(flag, anchor, message)

  monkeypatch.setattr(guards, '_raise_if', counting)

  def run(limit):
    return guards.refuse((limit > 100, limit > 200), jnp.ones(3) * limit,
                         ('over 100', 'over 200'))

  out = jax.jit(jax.vmap(run))(jnp.arange(64.0))
  assert np.all(np.isfinite(np.asarray(out)))
  assert len(calls) == 1 and calls[0] == (64, 2)
  with pytest.raises(Exception, match='over 100'):
    jax.block_until_ready(jax.jit(jax.vmap(run))(jnp.arange(64.0) * 2))
    jax.effects_barrier()
  with pytest.raises(ValueError, match='flags for'):
    guards.refuse((True,), 1.0, ('one', 'two'))
