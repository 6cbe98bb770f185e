"""`Plan.step`: the plan's compiled step, and the error a user sees from it.

A step the plan refuses must reach the user as the library's own
`PrivacyGuardError`, its message on the FIRST line of what Python prints,
without the user wrapping anything; and the step must be the same update
as the plan's transformation, compiled once.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import guards

N, DIM, BATCH = 32, 3, 8


def _loss(params, example):
  return (example['x'] @ params['w'] - example['y']) ** 2


def _data():
  rng = np.random.default_rng(0)
  return {'x': rng.normal(size=(N, DIM)).astype(np.float32),
          'y': rng.normal(size=N).astype(np.float32)}


def _plan(**kwargs):
  return dpsco_jax.plans.dpftrl(
      _loss, optimizer=optax.sgd(0.1), epsilon=2.0, delta=1e-5,
      num_examples=N, batch_size=BATCH, epochs=1, l2_clip=1.0, key=0,
      seed=1, **kwargs)


def _run(plan):
  params = {'w': jnp.zeros(DIM)}
  opt_state = plan.init(params)
  for inputs in plan.batches_of(_data()):
    params, opt_state = plan.step(params, opt_state, inputs)
  return params, opt_state, inputs


def test_step_past_the_plan_shows_the_library_error_first(capfd):
  plan = _plan()
  params, opt_state, last_inputs = _run(plan)
  with pytest.raises(guards.PrivacyGuardError) as raised:
    plan.step(params, opt_state, last_inputs)        # one step too many
  shown = traceback.format_exception_only(raised.type, raised.value)
  first = ''.join(shown).splitlines()[0]
  assert first.startswith('dpsco_jax.guards.PrivacyGuardError: ')
  assert 'a step past the capacity of 4 steps' in first
  assert str(raised.value).splitlines()[0] in first
  # Nothing of XLA's runtime error reaches the user, raised or logged.
  assert 'CpuCallback' not in ''.join(shown)
  assert raised.value.__cause__ is None and raised.value.__suppress_context__
  assert 'CpuCallback' not in capfd.readouterr().err


def test_step_is_the_plan_update_compiled_once():
  plan = _plan()
  params, opt_state, _ = _run(plan)
  # The same run, by hand: update then apply_updates.
  same = _plan()

  @jax.jit
  def by_hand(params, state, inputs):
    updates, state = same.transformation.update(None, state, params,
                                                **inputs)
    return optax.apply_updates(params, updates), state

  expected = {'w': jnp.zeros(DIM)}
  state = same.init(expected)
  for inputs in same.batches_of(_data()):
    expected, state = by_hand(expected, state, inputs)
  np.testing.assert_allclose(params['w'], expected['w'], rtol=1e-5,
                             atol=1e-6)
  compiled = plan._compiled_update  # pylint: disable=protected-access
  assert compiled._cache_size() == 1  # pylint: disable=protected-access


def test_step_refuses_inputs_that_are_not_a_mapping():
  plan = _plan()
  params = {'w': jnp.zeros(DIM)}
  with pytest.raises(TypeError, match='an item of plan.batches_of'):
    plan.step(params, plan.init(params), [1, 2])
