"""The experiment spine: a plan's run with epsilon so far, killed and resumed."""

import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import plans
from experiments import models
from experiments import spine

N = 40


def _setup():
  rng = np.random.default_rng(0)
  data = {'x': rng.normal(size=(N, 6)).astype(np.float32),
          'y': rng.integers(0, 3, size=N).astype(np.int32)}
  graphdef, params = models.split(models.MLP([6, 8, 3], rngs=nnx.Rngs(0)))
  plan = plans.dpftrl(
      models.example_loss(graphdef), optimizer=optax.sgd(0.1, momentum=0.9),
      num_examples=N, batch_size=8, epochs=2, l2_clip=1.0,
      noise_multiplier=2.0, delta=1e-5, seed=3, key=jax.random.key(5))
  # One compiled program per evaluation, not one per eager operation.
  evaluate = jax.jit(lambda p: {'loss': models.mean_loss(graphdef)(p, data)})
  return plan, params, data, evaluate


class _Killed(Exception):
  pass


def test_rows_carry_the_epsilon_so_far():
  plan, params, data, evaluate = _setup()
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    result = spine.run_plan('dpftrl', plan, params, data, evaluate=evaluate,
                            eval_every=3)
  steps = [row['step'] for row in result.rows]
  assert steps == [0, 3, 6, 9, 10]
  assert [row['epsilon'] for row in result.rows] == [
      plan.epsilon_at(t) for t in steps]
  assert result.rows[-1]['epsilon'] == pytest.approx(plan.epsilon)
  assert result.rows[-1]['epoch'] == pytest.approx(2.0)


def test_a_killed_run_resumes_bit_identical(tmp_path):
  plan, params, data, evaluate = _setup()
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    through = spine.run_plan('dpftrl', plan, params, data, evaluate=evaluate,
                             eval_every=100)
    calls = []

    def dies_at_step_7(p):
      calls.append(1)
      if len(calls) == 2:       # the evaluation at step 7
        raise _Killed
      return evaluate(p)

    directory = str(tmp_path / 'checkpoint')
    with pytest.raises(_Killed):
      spine.run_plan('dpftrl', plan, params, data, evaluate=dies_at_step_7,
                     eval_every=7, checkpoint_dir=directory,
                     checkpoint_every=4)
    # The plan is rebuilt as a new process would (same seed and key).
    plan, params, data, evaluate = _setup()
    resumed = spine.run_plan('dpftrl', plan, params, data, evaluate=evaluate,
                             eval_every=100, checkpoint_dir=directory,
                             checkpoint_every=4)
  assert resumed.rows[0]['step'] == 4
  for a, b in zip(jax.tree_util.tree_leaves(through.params),
                  jax.tree_util.tree_leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jnp.isfinite(resumed.rows[-1]['loss'])


def test_a_full_batch_plan_reads_all_the_data_every_step():
  rng = np.random.default_rng(1)
  data = rng.normal(size=(16, 3)).astype(np.float32)
  loss = lambda x, xi: jnp.sum(jnp.abs(x - xi))
  plan = plans.nonsmooth_multi_pass(
      loss, order='first', num_examples=16, num_steps=4, dimension=3,
      lipschitz=2.0, smoothing_radius=0.1, movement_radius=0.01,
      learning_rate=0.05, block_length=2, period=2, num_directions=2,
      # Given noise, not calibrated: this test is about the data each step
      # reads and the rows' epsilon, not about calibration.
      noise_multipliers=(1.0, 2.0), delta=1e-6, key=jax.random.key(0))
  assert plan.batches is None
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    result = spine.run_plan('multi_pass', plan, jnp.ones(3), data,
                            evaluate=jax.jit(
                                lambda p: {'norm': jnp.linalg.norm(p)}),
                            eval_every=2)
  assert [r['step'] for r in result.rows] == [0, 2, 4]
  assert result.rows[-1]['epsilon'] == pytest.approx(plan.epsilon)
  with pytest.raises(ValueError, match='no privacy ledger'):
    spine.run_plan('multi_pass', plan, jnp.ones(3), data,
                   evaluate=lambda p: {}, eval_every=2, checkpoint_dir='/tmp')
  # A fifth step would pass the accounted T: the plan's noise refuses it
  # (the run's compiled step, not an op-by-op eager update: no new
  # compilations).
  with pytest.raises(ValueError, match='past|capacity|steps'):
    plan.step(result.params, result.opt_state, {'batch': data}, block=True)


def test_stop_after_and_on_step_and_the_ledger_of_the_steps_run(tmp_path):
  plan, params, data, evaluate = _setup()
  seen = []
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    stopped = spine.run_plan('dpftrl', plan, params, data, evaluate=evaluate,
                             eval_every=3, on_step=seen.append, stop_after=4)
  assert seen == [1, 2, 3, 4]
  assert (stopped.first_step, stopped.last_step) == (0, 4)
  assert stopped.ledger.steps_consumed == 4
  assert [row['step'] for row in stopped.rows] == [0, 3]
  # With checkpoints, the ledger is the one the last save wrote.
  directory = str(tmp_path / 'ckpt')
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    first = spine.run_plan('dpftrl', plan, params, data, evaluate=evaluate,
                           eval_every=3, checkpoint_dir=directory,
                           checkpoint_every=3, stop_after=5)
    assert first.ledger.steps_consumed == 3
    rest = spine.run_plan('dpftrl', plan, params, data, evaluate=evaluate,
                          eval_every=3, checkpoint_dir=directory,
                          checkpoint_every=3, on_step=seen.append)
  assert (rest.first_step, rest.last_step) == (3, plan.num_steps)
  assert rest.ledger.steps_consumed == plan.num_steps
  assert seen[4:] == list(range(4, plan.num_steps + 1))
