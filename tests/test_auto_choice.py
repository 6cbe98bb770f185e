"""What `clipping_method='auto'` takes: by cost, and within a memory budget.

At the GPT-style decoder of `benchmarks/decoder_step.py` (35.8M parameters,
32 sequences of 256 tokens) the compiled ghost step moves fewer bytes and
needs less temporary memory than the vmap step (`benchmarks/compiled_cost.py`:
bytes 1.51x against 1.62x the non-private step, temporary memory 1.15x
against 1.37x): 'auto' must take ghost there, by its estimates alone, and
by the memory budget (4.6 GB of per-example gradients). The choice is read
from shapes only (`jax.eval_shape`), nothing is compiled or run.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping
from dpsco_jax import ghost

sys.path.insert(0, os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
import auto_choice  # pylint: disable=g-import-not-at-top,wrong-import-position
import decoder_step  # pylint: disable=g-import-not-at-top,wrong-import-position

DECODER = decoder_step.VARIANTS['default']


def _choice(loss_fn, params, batch, **kwargs):
  """`clipping_choice` of a default ('auto') statistic, from shapes."""
  statistic = clipping.clipped_grad_sum(loss_fn, 1.0, **kwargs)
  chosen = []

  def choose(batch, params):
    chosen.append(statistic.clipping_choice(batch, params))
    return 0

  jax.eval_shape(choose, batch, params)
  return chosen[0]


def _decoder():
  params = jax.eval_shape(lambda k: decoder_step.decoder_init(k, DECODER),
                          jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((DECODER.batch_size, DECODER.seq_len),
                                jnp.int32)
  return decoder_step.sequence_loss_fn(DECODER), params, {'x': tokens,
                                                          'y': tokens}


@pytest.fixture(scope='module')
def decoder():
  return _decoder()


def test_auto_takes_ghost_at_the_decoder_by_cost_alone(decoder):
  choice = _choice(*decoder, memory_budget=None)
  assert (choice.path, choice.reason) == ('ghost', 'cost'), (
      choice.ghost, choice.vmap)
  # The embedding's Gram form is what the ghost path saves; every other
  # layer forms its per-example gradient as the vmap path does, at the
  # vmap path's cost.
  forms = {tap.rule: set() for tap in choice.taps}
  for tap in choice.taps:
    forms[tap.rule].add(tap.form)
    if tap.form == 'materialized':
      assert tap.ghost == tap.materialized == tap.vmap, tap
  assert forms['gather'] == {'gram'}


def test_auto_takes_ghost_at_the_decoder_by_the_memory_budget(decoder):
  choice = _choice(*decoder)     # the default budget, 1 GiB
  params_bytes = 4 * decoder_step.count_params(DECODER)
  assert choice.per_example_bytes == DECODER.batch_size * params_bytes
  assert choice.memory_budget == ghost.DEFAULT_MEMORY_BUDGET == 2**30
  assert (choice.path, choice.reason) == ('ghost', 'memory budget')
  # A microbatch of one holds one gradient (143 MB): the estimates decide.
  small = _choice(*decoder, microbatch_size=1)
  assert small.per_example_bytes == params_bytes
  assert (small.path, small.reason) == ('ghost', 'cost')


def _long_narrow():
  """A loss whose one layer forms its per-example gradient on either path:
  the estimates tie and 'auto' takes vmap (tests/test_ghost_clipping.py)."""
  rng = np.random.default_rng(0)
  params = {'w': jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32)}
  batch = {'x': jnp.asarray(rng.normal(size=(4, 512, 16)), jnp.float32)}
  loss_fn = lambda p, e: jnp.sum(jnp.tanh(e['x'] @ p['w']))
  return loss_fn, params, batch


def test_the_budget_overrides_the_estimates_only_above_it():
  loss_fn, params, batch = _long_narrow()
  held = 4 * 16 * 16 * 4          # 4 examples' gradients of 256 floats
  within = _choice(loss_fn, params, batch, memory_budget=held)
  assert (within.path, within.reason, within.per_example_bytes) == (
      'vmap', 'cost', held)
  over = _choice(loss_fn, params, batch, memory_budget=held - 1)
  assert (over.path, over.reason) == ('ghost', 'memory budget')
  # Microbatches of 2 hold half as much: within the same budget again.
  halves = _choice(loss_fn, params, batch, memory_budget=held - 1,
                   microbatch_size=2)
  assert (halves.path, halves.per_example_bytes) == ('vmap', held // 2)


def test_the_step_takes_the_path_the_budget_chose():
  loss_fn, params, batch = _long_narrow()
  over = clipping.clipped_grad_sum(loss_fn, 1.0, memory_budget=1)
  ghost_sum = clipping.clipped_grad_sum(loss_fn, 1.0, clipping_method='ghost')
  # The same arithmetic as the ghost path, bit for bit.
  np.testing.assert_array_equal(jax.jit(over)(batch, params).sum['w'],
                                jax.jit(ghost_sum)(batch, params).sum['w'])


@pytest.mark.parametrize('budget', [0, -1, 1.5, True, '1GiB'])
def test_a_bad_budget_is_a_clear_error(budget):
  loss_fn, _, _ = _long_narrow()
  with pytest.raises(ValueError, match='memory_budget'):
    clipping.clipped_grad_sum(loss_fn, 1.0, memory_budget=budget)


# The four shapes of `benchmarks/auto_choice.py`, where the ghost step
# measured faster than the vmap step on the CPU (benchmarks/README.md,
# "auto_choice.py"): 'auto' must take ghost there by its estimates alone.
@pytest.mark.parametrize('name', ['mlp', 'cnn', 'transformer', 'embedding'])
def test_auto_takes_the_faster_path_measured_on_the_cpu(name):
  problem = auto_choice.PROBLEMS[name]
  rng = np.random.default_rng(0)
  params = jax.eval_shape(lambda: problem.params(rng))
  batch = jax.eval_shape(lambda: problem.batch(rng, problem.batch_size))
  loss_fn = auto_choice.models.example_loss_fn(problem.apply)
  choice = _choice(loss_fn, params, batch, memory_budget=None)
  assert (choice.path, choice.reason) == ('ghost', 'cost'), (
      choice.ghost, choice.vmap)
