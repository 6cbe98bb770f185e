"""Physical batches: a logical batch run in fixed-size pieces, noised once.

`Plan.step` of a plan built with `physical_batch_size=` must be the plan's
one-call step (its transformation's update compiled whole, same key, same
batch) up to float summation order, evaluate at most one microbatch of
padding, compile a bounded set of shapes, and keep every batch check of the
accounting on the whole logical batch.
"""

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import batching
from dpsco_jax import clipping
from dpsco_jax import guards
from dpsco_jax import physical
from dpsco_jax import plans

pytest.importorskip('flax.linen')
# pylint: disable=g-import-not-at-top,wrong-import-position
from tests.physical_model import DATA, DIM, EXPECTED, N, PARAMS
from tests.physical_model import loss as _loss
# pylint: enable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2   # logical steps compared per plan
# The accounting method never enters a step: RDP accounts a given noise
# multiplier in milliseconds where the PLD takes a second.
ACCOUNTING = 'rdp'


def _plan(physical_batch_size=8, **kwargs):
  return plans.dpsgd(
      _loss, optimizer=optax.adam(0.05), num_examples=N,
      batch_size=EXPECTED, epochs=1, l2_clip=0.5, noise_multiplier=1.0,
      delta=1e-5, method=ACCOUNTING, key=0, seed=1,
      physical_batch_size=physical_batch_size, **kwargs)


# One plan per clipping path, shared by the tests (compiled once each):
# ghost norms with a granularity of one example (physical sizes 8, 4, 2,
# 1), per-example gradients in microbatches of 4 (sizes 8, 4).
PLANS = {'ghost': _plan(clipping_method='ghost'),
         'vmap': _plan(clipping_method='vmap', microbatch_size=4)}


def _close(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      np.testing.assert_array_equal(jax.random.key_data(x),
                                    jax.random.key_data(y))
      continue
    np.testing.assert_allclose(np.asarray(x, np.float64),
                               np.asarray(y, np.float64), rtol=2e-5,
                               atol=1e-6)


def _first_inputs(plan):
  return next(iter(plan.batches_of(DATA)))


# ---------------------------------------------------------------- the sizes


@pytest.mark.parametrize('size,granularity', [(8, 1), (16, 2), (24, 4),
                                              (12, 12)])
def test_sizes_cover_every_batch_with_under_one_microbatch_of_padding(
    size, granularity):
  allowed = {size} | {granularity << j for j in range(8)
                      if granularity << j < size}
  bound = 1 + int(np.ceil(np.log2(size / granularity)))
  for num_real in range(0, 5 * size):
    sizes = physical.physical_sizes(num_real, size, granularity)
    assert set(sizes) <= allowed
    assert num_real <= sum(sizes) < num_real + granularity
    # Full batches first, then the remainder's pieces, largest first.
    assert list(sizes) == sorted(sizes, reverse=True)
  assert len(allowed) <= bound


def test_sizes_refuse_a_granularity_that_splits_a_microbatch():
  with pytest.raises(ValueError, match='not a multiple of the granularity'):
    physical.physical_sizes(10, 8, 3)


def test_default_granularity_is_the_microbatch_or_a_sixteenth():
  assert physical.default_granularity(256, None) == 16
  assert physical.default_granularity(256, 32) == 32
  assert physical.default_granularity(24, None) == 1
  assert PLANS['vmap'].physical_form.granularity == 4


def test_split_pads_only_the_last_pieces_and_keeps_every_real_example():
  inputs = _first_inputs(PLANS['vmap'])
  real = np.flatnonzero(inputs['batch_mask'])
  assert len(real) > 8   # the logical batch is larger than a physical one
  logical = physical.split_logical_batch(inputs, 8, 4)
  ids = np.concatenate([p.example_ids[p.batch_mask]
                        for p in logical.physical])
  np.testing.assert_array_equal(ids, inputs['example_ids'][real])
  xs = np.concatenate([p.batch['x'][p.batch_mask] for p in logical.physical])
  np.testing.assert_array_equal(xs, inputs['batch']['x'][real])
  masks = [p.batch_mask for p in logical.physical]
  assert all(m.all() for m in masks[:-1])       # only the last is padded
  assert (~masks[-1]).sum() < 4                 # by less than g = 4
  assert {len(m) for m in masks} <= {8, 4}
  # The checks get the logical batch as the sampler yielded it.
  assert logical.inputs['example_ids'] is inputs['example_ids']
  assert 'batch' not in logical.inputs


def _one_call(plan):
  """The plan's one-call step: its whole update as one compiled program."""
  return guards.library_errors(plan._compiled_update)  # pylint: disable=protected-access


def _logical(plan):
  """The plan's step over physical batches, raising its refusal at once."""
  return functools.partial(plan.step, block=True)


# ------------------------------------------------ the same step, cheaper


@pytest.mark.parametrize('path', sorted(PLANS))
def test_logical_step_equals_the_one_call_step(path):
  plan = PLANS[path]
  one, by_pieces = PARAMS, PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for step, inputs in zip(range(STEPS), plan.batches_of(DATA)):
    one, one_state = _one_call(plan)(one, one_state, inputs)
    by_pieces, pieces_state = _logical(plan)(by_pieces, pieces_state,
                                                    inputs)
    _close(by_pieces, one)
    _close(pieces_state, one_state)
  assert step == STEPS - 1
  form = plan.physical_form
  bound = 1 + int(np.ceil(np.log2(form.physical_batch_size /
                                  form.granularity)))
  assert 0 < plan._logical_step.compiled_shapes() <= bound  # pylint: disable=protected-access


def test_an_empty_logical_batch_releases_the_noise_alone():
  plan = PLANS['vmap']
  inputs = dict(_first_inputs(plan))
  inputs['batch_mask'] = np.zeros_like(inputs['batch_mask'])
  assert physical.split_logical_batch(inputs, 8).physical == ()
  state = plan.init(PARAMS)
  expected, expected_state = _one_call(plan)(PARAMS, state, inputs)
  got, got_state = _logical(plan)(PARAMS, state, inputs)
  _close(got, expected)
  _close(got_state, expected_state)


def test_a_batch_larger_than_memory_by_hand_equals_one_call():
  # A transformation chained by hand (no plan): a fixed logical batch of 40
  # run 16 at a time, Adam after the private gradient.
  grad = dpsco_jax.dpsgd(_loss, l2_clip=0.5, noise_multiplier=1.0,
                         num_steps=4, key=2, normalize_by=40.0,
                         clipping_method='vmap')
  tx = optax.chain(grad, optax.adam(0.05))
  step = physical.LogicalStep(tx, physical.statistic_form(
      clipping.clipped_grad_sum(_loss, 0.5, clipping_method='vmap'), 16))
  batch = jax.tree_util.tree_map(lambda x: x[:40], DATA)
  state = tx.init(PARAMS)
  updates, expected_state = jax.jit(
      lambda state: tx.update(None, state, PARAMS, batch=batch))(state)
  got, got_state = step(PARAMS, state, {'batch': batch})
  _close(got, optax.apply_updates(PARAMS, updates))
  _close(got_state, expected_state)
  # Without a public divisor the accumulated sum cannot be normalized.
  bare = dpsco_jax.dpsgd(_loss, l2_clip=0.5, noise_multiplier=1.0,
                         num_steps=4, key=3)
  accumulated = step.start(state, PARAMS, batch).clipped
  with pytest.raises(ValueError, match='no normalize_by'):
    bare.update(None, bare.init(PARAMS), PARAMS, clipped_sum=accumulated)


def test_dpftrl_fixed_order_batches_equal_the_one_call_step():
  # Tree noise, fixed-size batches without a mask, a batch of 24 run 8 at a
  # time.
  plan = plans.dpftrl(_loss, optimizer=optax.sgd(0.1), num_examples=N,
                      batch_size=24, epochs=1, l2_clip=0.5,
                      noise_multiplier=1.0, delta=1e-5,
                      method=ACCOUNTING, key=0, seed=1,
                      clipping_method='vmap', physical_batch_size=8)
  one = by_pieces = PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for inputs in plan.batches_of(DATA):
    one, one_state = _one_call(plan)(one, one_state, inputs)
    by_pieces, pieces_state = _logical(plan)(by_pieces, pieces_state,
                                                    inputs)
  _close(by_pieces, one)
  _close(pieces_state, one_state)


def test_user_level_batches_equal_the_one_call_step():
  # Users as the privacy unit: Poisson batches of about 10 of 40 users, up
  # to 3 items each, run 4 users at a time.
  user_ids = np.arange(N) % 40
  users = batching.group_by_user(DATA, user_ids, max_items=3)
  plan = plans.user_level_dpsgd(
      _loss, optimizer=optax.sgd(0.1), num_users=40, users_per_batch=10,
      epochs=1, l2_clip=0.5, noise_multiplier=1.0, delta=1e-5, key=0,
      seed=1, method='rdp', clipping_method='vmap', physical_batch_size=4)
  one = by_pieces = PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for _, inputs in zip(range(STEPS), plan.batches_of(users)):
    one, one_state = _one_call(plan)(one, one_state, inputs)
    by_pieces, pieces_state = _logical(plan)(by_pieces, pieces_state,
                                                    inputs)
  _close(by_pieces, one)
  _close(pieces_state, one_state)


def test_srg_memf_differences_at_two_points_equal_the_one_call_step():
  # DP-SRG-MEMF: each example's clipped difference grad f(x_t) - c grad
  # f(x_{t-1}) at the state's two points, a batch of 24 run 8 at a time;
  # a clip no difference reaches, so a wrong coefficient shows.
  plan = plans.dp_srg_memf(
      _loss, optimizer=optax.sgd(0.1), num_examples=N, batch_size=24,
      epochs=1, l2_clip=50.0, noise_multiplier=1.0, delta=1e-5,
      method=ACCOUNTING, decay=0.5,
      strategy='banded_sqrt', bands=2, key=0, seed=1,
      clipping_method='ghost', physical_batch_size=8)
  one = by_pieces = PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for inputs in plan.batches_of(DATA):   # 4 steps: c_0 = 0, then c = 0.5
    one, one_state = _one_call(plan)(one, one_state, inputs)
    by_pieces, pieces_state = _logical(plan)(by_pieces, pieces_state,
                                                    inputs)
  _close(by_pieces, one)
  _close(pieces_state, one_state)


def test_unaccelerated_srg_differences_equal_the_one_call_step():
  # Weighted differences (t + 1) grad f(x_t) - t grad f(x_{t-1}) over one
  # pass, a batch of 24 run 8 at a time; a clip no difference reaches.
  plan = plans.unaccelerated_dp_srg(
      _loss, num_examples=N, batch_size=24, beta=20.0, radius=None,
      l2_clip=50.0, noise_multiplier=1.0, delta=1e-5,
      method=ACCOUNTING, key=0, seed=1,
      clipping_method='vmap', physical_batch_size=8)
  one = by_pieces = PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for inputs in plan.batches_of(DATA):
    one, one_state = _one_call(plan)(one, one_state, inputs)
    by_pieces, pieces_state = _logical(plan)(by_pieces, pieces_state,
                                                    inputs)
  _close(by_pieces, one)
  _close(pieces_state, one_state)


@pytest.mark.parametrize('gradient', ['srg', 'independent'])
def test_accelerated_srgd_at_its_query_points_equals_the_one_call_step(
    gradient):
  # Algorithm 1: differences (t + 1) grad f(x_t) - t grad f(x_{t-1}) at the
  # query point x_t (the params the coupling moved) and the state's x_{t-1};
  # a batch of 24 run 8 at a time, a clip no difference reaches, a ball the
  # run stays inside.
  plan = plans.accelerated_dp_srgd(
      _loss, num_examples=N, batch_size=24, beta=20.0, radius=None,
      l2_clip=50.0, noise_multiplier=1.0, delta=1e-5,
      method=ACCOUNTING, key=0, seed=1,
      gradient=gradient, clipping_method='vmap', physical_batch_size=8)
  one = by_pieces = PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for inputs in plan.batches_of(DATA):
    one, one_state = _one_call(plan)(one, one_state, inputs)
    by_pieces, pieces_state = _logical(plan)(by_pieces, pieces_state,
                                             inputs)
    _close(by_pieces, one)
    _close(pieces_state, one_state)
  # The run moved the params: the comparison is not between two no-ops.
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(PARAMS))
             ) > 1e-3


def _diff2_plan(restart_interval, **kwargs):
  # DIFF2-GD (T > 1: restarts and differences at two points) or DP-GD
  # (T = 1): each round is the whole local data set, run 16 at a time.
  kwargs.setdefault('physical_batch_size', 16)
  if restart_interval == 1:
    return plans.dp_gd(_loss, learning_rate=0.5, num_rounds=4,
                       grad_clip=0.5, num_examples=N, noise_multiplier=1.0,
                       delta=1e-5, method=ACCOUNTING, key=0,
                       clipping_method='vmap', **kwargs)
  return plans.diff2_gd(
      _loss, learning_rate=0.5, num_rounds=4, restart_interval=2,
      grad_clip=0.5, diff_clip_factor=50.0, num_examples=N,
      noise_multipliers=(1.0, 1.0), delta=1e-5, method=ACCOUNTING, key=0,
      clipping_method='vmap', **kwargs)


DIFF2_PLANS = {'dp_gd': _diff2_plan(1), 'diff2_gd': _diff2_plan(2)}
# Local data padded to N with 11 padding rows: the last physical batch
# (85 real rows = 5 * 16 + 5) is padded, the padding never counted.
DIFF2_INPUTS = {'batch': DATA, 'batch_mask': np.arange(N) < N - 11}


@pytest.mark.parametrize('name', sorted(DIFF2_PLANS))
def test_diff2_rounds_over_physical_batches_equal_the_one_call_step(name):
  plan = DIFF2_PLANS[name]
  one = by_pieces = PARAMS
  one_state = pieces_state = plan.init(PARAMS)
  for _ in range(4):   # DIFF2: restart, difference, restart, difference
    one, one_state = _one_call(plan)(one, one_state, DIFF2_INPUTS)
    by_pieces, pieces_state = _logical(plan)(by_pieces, pieces_state,
                                             DIFF2_INPUTS)
    _close(by_pieces, one)
    _close(pieces_state, one_state)
  # The same accounting as the plan without physical batches.
  whole = _diff2_plan(1 if name == 'dp_gd' else 2, physical_batch_size=None)
  described, whole_described = plan.describe(), whole.describe()
  for record in (described, whole_described):
    del record['clipping_path']      # 'not traced yet' in the untraced plan
    assert record['hyperparameters'].pop('physical_batch_size', None) in (16, None)
  assert described == whole_described
  assert plan.epsilon == whole.epsilon
  assert str(plan.event) == str(whole.event)
  # The run moved the params: the comparison is not between two no-ops.
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(PARAMS))
             ) > 1e-3


def test_diff2_physical_batches_counted_twice_are_refused():
  # A physical batch run twice changes the client's size n_p: refused (the
  # release poisoned, the refusal recorded) like a batch of other examples.
  plan = DIFF2_PLANS['diff2_gd']
  step = plan._logical_step  # pylint: disable=protected-access
  run = guards.library_errors(_pieces_then_finish)
  state = plan.init(PARAMS)
  message = _refused(run, step, PARAMS, state, DIFF2_INPUTS,
                     lambda pieces: pieces + pieces[:1])
  assert 'another number of examples' in message
  assert 'step 0' in message


def test_diff2_physical_batches_refuse_a_client_axis():
  with pytest.raises(ValueError, match='each client.s data is its own'):
    _diff2_plan(2, axis_name='clients')


_NONSMOOTH = dict(order='first', num_examples=N, dimension=DIM,
                  lipschitz=1.0, smoothing_radius=0.1, movement_radius=0.01,
                  learning_rate=0.05, block_length=2, period=2,
                  num_directions=2, delta=1e-6, key=0)


@pytest.mark.parametrize('builder,kwargs', [
    (plans.nonsmooth_single_pass, dict(anchor_batch_size=8, batch_size=4,
                                       noise_multiplier=1.0, num_steps=4)),
    (plans.nonsmooth_multi_pass, dict(num_steps=4,
                                      noise_multipliers=(1.0, 1.0)))])
def test_nonsmooth_plans_refuse_physical_batches_naming_why(builder, kwargs):
  with pytest.raises(ValueError, match='smoothing directions are drawn from '
                     'its row'):
    builder(_loss, physical_batch_size=8, **_NONSMOOTH, **kwargs)


def test_a_device_axis_is_kept_for_the_sharded_programs():
  # The sharded step itself: tests/test_physical_sharded.py.
  form = physical.statistic_form(clipping.clipped_grad_sum(_loss, 0.5), 8,
                                 axis_name='devices')
  assert form.axis_name == 'devices'
  assert PLANS['vmap'].physical_form.axis_name is None


# ------------------------------------------------------ the checks hold


def _refused(run, *args):
  with pytest.raises(guards.PrivacyGuardError) as raised:
    run(*args)
  return str(raised.value)


def test_an_id_repeated_across_two_physical_batches_is_refused():
  plan = PLANS['vmap']
  inputs = dict(_first_inputs(plan))
  real = np.flatnonzero(inputs['batch_mask'])
  # The first example again in the second physical batch (data and id).
  ids = inputs['example_ids'].copy()
  ids[real[8]] = ids[real[0]]
  inputs['example_ids'] = ids
  inputs['batch'] = jax.tree_util.tree_map(lambda x: x[ids], DATA)
  pieces = physical.split_logical_batch(inputs, 8).physical
  assert ids[real[0]] in pieces[0].example_ids
  assert ids[real[0]] in pieces[1].example_ids[pieces[1].batch_mask]
  state = plan.init(PARAMS)
  message = _refused(_logical(plan), PARAMS, state, inputs)
  assert 'the same example id twice' in message
  # The same refusal as the one-call step's (the plan adds its advice).
  assert _refused(_one_call(plan), PARAMS, state, inputs) in message


def test_a_batch_too_large_for_poisson_sampling_is_refused():
  plan = PLANS['vmap']
  pad = plan.batches.pad_to_multiple
  ids = np.arange(pad)
  assert pad > batching.poisson_size_bound(N, EXPECTED / N)
  inputs = {'batch': jax.tree_util.tree_map(lambda x: x[ids], DATA),
            'batch_mask': np.ones(pad, bool), 'example_ids': ids}
  message = _refused(_logical(plan), PARAMS, plan.init(PARAMS),
                     inputs)
  assert 'which a Poisson batch' in message


def _pieces_then_finish(step, params, state, inputs, tamper):
  logical = step.split(inputs)
  pieces = tamper(list(logical.physical))
  accumulation = step.start(state, params, logical.template)
  for piece in pieces:
    accumulation = step.accumulate(accumulation, state, params, piece)
  return step.finish(params, state, accumulation, logical.inputs)


def test_physical_batches_that_are_not_the_logical_batch_are_refused():
  plan = PLANS['vmap']
  step = plan._logical_step  # pylint: disable=protected-access
  inputs = _first_inputs(plan)
  state = plan.init(PARAMS)
  run = guards.library_errors(_pieces_then_finish)

  def drop_last(pieces):
    return pieces[:-1]

  def other_example(pieces):
    first = pieces[0]
    ids = first.example_ids.copy()
    ids[0] = (set(range(N)) - set(inputs['example_ids'].tolist())).pop()
    return [first._replace(example_ids=ids)] + pieces[1:]

  assert 'another number of examples' in _refused(
      run, step, PARAMS, state, inputs, drop_last)
  assert 'other examples than the logical batch' in _refused(
      run, step, PARAMS, state, inputs, other_example)
  # Untampered, the same pieces pass.
  _close(run(step, PARAMS, state, inputs, lambda pieces: pieces),
         _logical(plan)(PARAMS, state, inputs))


# ------------------------------------------------------------- the docs


def test_the_docs_example_runs():
  path = os.path.join(ROOT, 'docs', 'physical_batches.md')
  with open(path) as handle:
    blocks = re.findall(r'^```python\n(.*?)^```', handle.read(), re.S | re.M)
  assert blocks
  namespace = {}
  for block in blocks:
    exec(compile(block, path, 'exec'), namespace)  # pylint: disable=exec-used
  assert namespace['step_inputs'] is not None


def test_the_benchmark_reads_compiled_costs_of_each_way(capsys):
  sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
  import physical_batches  # pylint: disable=g-import-not-at-top
  results = physical_batches.main(
      ['--expected', '8', '--num_examples', '16', '--input', '4',
       '--hidden', '4', '--physical_fractions', '1'])
  fixed, one_call, by_pieces = results[8]
  assert fixed['step'] == 'fixed B=8' and fixed['flops_ratio'] == 1.0
  assert one_call['step'] == 'one call (padded to 32)'
  assert by_pieces['step'] == 'physical P=8 (g=1)'
  # Padded to 32, one call does about four times the fixed batch's work;
  # the physical batches do about the realized batch's.
  assert one_call['flops_ratio'] > 2.0
  assert 0.5 < by_pieces['flops_ratio'] < 1.5
  assert '| 8 | physical P=8 (g=1) |' in capsys.readouterr().out
