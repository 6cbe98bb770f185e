"""`Plan.step`: the plan's compiled step, and the error a user sees from it.

The compiled step makes no host round trip: a step the plan refuses is
poisoned on the device and recorded in the state, and reaches the user as
the library's own `PrivacyGuardError` (its message on the FIRST line of
what Python prints, naming the check, the step and the plan keyword that
fixes it) from `Plan.step` at most `REFUSAL_LAG` calls late, from
`Plan.finish`, from a checkpoint save, or from `raise_if_refused` in a
hand-written loop. The step is the same update as the plan's
transformation, compiled once.
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


def _poisoned(tree):
  return all(bool(jnp.all(jnp.isnan(leaf)))
             for leaf in jax.tree_util.tree_leaves(tree)
             if jnp.issubdtype(jnp.result_type(leaf), jnp.floating))


def _is_capacity_refusal(error, step=4):
  return ('a step past the capacity of 4 steps' in str(error)
          and error.kind == 'capacity' and error.step == step)


def test_step_past_the_plan_is_raised_late_by_step_and_at_once_by_block(
    capfd):
  plan = _plan()
  params, opt_state, last_inputs = _run(plan)
  plan.finish(opt_state)                 # the planned run: nothing refused
  # One step too many, without waiting: the device poisons and records it;
  # the host raises it within REFUSAL_LAG more calls (or at finish).
  raised, state = None, opt_state
  calls = 0
  try:
    for calls in range(1, plan.REFUSAL_LAG + 2):
      params, state = plan.step(params, state, last_inputs)
  except guards.PrivacyGuardError as error:
    raised = error
  assert raised is not None and calls <= plan.REFUSAL_LAG + 1
  assert _is_capacity_refusal(raised)
  # Addressed to a plan's user: the keyword that fixes it.
  assert 'build the plan with more epochs=' in str(raised)
  shown = traceback.format_exception_only(type(raised), raised)
  first = ''.join(shown).splitlines()[0]
  assert first.startswith('dpsco_jax.guards.PrivacyGuardError: ')
  assert 'a step past the capacity of 4 steps' in first
  assert raised.__cause__ is None and raised.__suppress_context__
  assert 'CpuCallback' not in capfd.readouterr().err
  # block=True raises this step's refusal from this call.
  fresh = _plan()
  params, opt_state, last_inputs = _run(fresh)
  with pytest.raises(guards.PrivacyGuardError) as at_once:
    fresh.step(params, opt_state, last_inputs, block=True)
  assert _is_capacity_refusal(at_once.value)


def test_refused_state_stays_poisoned_and_names_check_and_step():
  plan = _plan()
  params, opt_state, last_inputs = _run(plan)
  compiled = plan._compiled_update  # pylint: disable=protected-access
  # A hand-written loop: the compiled step itself never raises.
  refused_params, refused_state = compiled(params, opt_state, last_inputs)
  assert _poisoned(refused_params)
  # The next step is poisoned too (stickiness itself: tests/test_guards.py).
  later_params, later_state = compiled(refused_params, refused_state,
                                       last_inputs)
  assert _poisoned(later_params)
  # The one documented call of a hand-written loop.
  with pytest.raises(guards.PrivacyGuardError) as raised:
    dpsco_jax.raise_if_refused(later_state)
  assert _is_capacity_refusal(raised.value)
  assert 'refused at step 4' in str(raised.value)
  # The plan's own check says the same, with its advice.
  with pytest.raises(guards.PrivacyGuardError, match='more epochs='):
    plan.check_refusals(later_state)
  # A passing state raises nothing.
  dpsco_jax.raise_if_refused(opt_state)


def test_a_refused_state_cannot_be_checkpointed(tmp_path):
  plan = _plan()
  params, opt_state, last_inputs = _run(plan)
  compiled = plan._compiled_update  # pylint: disable=protected-access
  _, refused = compiled(params, opt_state, last_inputs)
  with pytest.raises(guards.PrivacyGuardError) as raised:
    dpsco_jax.checkpoint.save(str(tmp_path / 'run'), params=params,
                              opt_state=refused, step=plan.num_steps + 1,
                              ledger=plan.ledger, sampler_state=plan.batches)
  assert _is_capacity_refusal(raised.value)
  assert not (tmp_path / 'run').exists() or not any(
      (tmp_path / 'run').iterdir())
  # The ledger's reads of a state check it too.
  with pytest.raises(guards.PrivacyGuardError, match='refused at step 4'):
    plan.ledger.check_state(refused)


def test_a_batch_the_plan_did_not_form_is_refused_with_the_plan_advice():
  plan = _plan()
  params = {'w': jnp.zeros(DIM)}
  opt_state = plan.init(params)
  inputs = next(iter(plan.batches_of(_data())))
  twice = dict(inputs, example_ids=np.zeros_like(inputs['example_ids']))
  with pytest.raises(guards.PrivacyGuardError) as raised:
    plan.step(params, opt_state, twice, block=True)
  assert raised.value.kind == 'batch' and raised.value.step == 0
  assert 'the same example id twice' in str(raised.value)
  assert 'plan.batches_of(data)' in str(raised.value)


def test_the_compiled_plan_step_makes_no_host_round_trip():
  plan = _plan()
  params = {'w': jnp.zeros(DIM)}
  opt_state = plan.init(params)
  inputs = next(iter(plan.batches_of(_data())))
  text = plan._compiled_update.lower(  # pylint: disable=protected-access
      params, opt_state, inputs).compile().as_text()
  assert 'conditional' not in text
  assert 'callback' not in text.lower()


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
