"""Every compiled private step makes no host round trip.

On a GPU, a host callback stops the device for the host, and every
`conditional` the program runs reads its predicate back to the host and
waits on the stream: either one, once per step, drains the queue of kernels
that asynchronous dispatch builds. This file compiles (never runs) the
`update` of every private transformation family and the step of every plan
(`Plan._compiled_update`, Poisson sampling where the plan offers it) on a
tiny flax MLP, from abstract arguments, and reads the optimized HLO with
`dpsco_jax.compiled_cost`: no host callback, no conditional run every step.

The user-level drivers that run whole phases themselves
(`user_level.phased_sgd`, `user_level.accelerated_phased_erm`) have no
`update` of their own: their private step is `outlier_removal_gradient`,
covered here.

The last tests plant a `jax.pure_callback` and a `lax.cond` in a clean step
and check that the same assertion catches each.
"""

import functools
import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import adaptive_clipping
from dpsco_jax import batching
from dpsco_jax import blt
from dpsco_jax import nonsmooth
from dpsco_jax import outlier_removal
from dpsco_jax import plans
from dpsco_jax import strategies
from dpsco_jax import user_level
from tests import phase_calibration

N, FEATURES, CLASSES, BATCH, STEPS, USERS = 32, 8, 3, 8, 8, 16


class Mlp(nn.Module):
  """A tiny classifier: 8 -> 16 -> 3."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(16)(x)))


MODEL = Mlp()


def loss_fn(params, example):
  logits = MODEL.apply({'params': params}, example['x'])
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         example['y'])


@functools.cache
def _params():
  # One compiled init, not one eager program per layer op.
  return jax.jit(MODEL.init)(jax.random.key(0),
                             np.zeros(FEATURES, np.float32))['params']


def _dimension():
  return sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(_params()))


def _data(n=N):
  rng = np.random.default_rng(0)
  return {'x': rng.normal(size=(n, FEATURES)).astype(np.float32),
          'y': rng.integers(0, CLASSES, n).astype(np.int32)}


def _abstract(tree):
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _step_of(transformation):
  """A user's step: `update` with the inputs as keywords, then apply."""

  def step(params, opt_state, inputs):
    updates, opt_state = transformation.update(None, opt_state, params,
                                               **inputs)
    return optax.apply_updates(params, updates), opt_state

  return step


def _transformation_case(transformation, inputs):
  """(step, abstract args) of a transformation on the tiny MLP."""
  params = _params()
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    opt_state = transformation.init(params)
  return _step_of(transformation), _abstract((params, opt_state, inputs))


def _plan_case(plan, inputs=None):
  """(the plan's compiled step, abstract args) on the tiny MLP."""
  params = _params()
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    opt_state = plan.init(params)
  if inputs is None:
    inputs = next(iter(plan.batches_of(_data(plan.num_examples))))
  # pylint: disable-next=protected-access
  return plan._compiled_update, _abstract((params, opt_state, dict(inputs)))


def _guard_case(guard):
  """A batch guard checks the updates of the estimator before it."""
  params = _params()
  opt_state = guard.init(params)

  def step(params, opt_state, example_ids):
    updates = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, opt_state = guard.update(updates, opt_state, params,
                                      example_ids=example_ids)
    return optax.apply_updates(params, updates), opt_state

  return step, _abstract((params, opt_state, np.arange(BATCH)))


def _batch(n=BATCH):
  return {'batch': _data(n)}


def _ordered_batch():
  return {'batch': _data(BATCH), 'example_ids': np.arange(BATCH)}


def _users():
  data = _data(N)
  # 16 users of 2 items: outlier removal needs at least 9 users a batch.
  return batching.group_by_user(data, np.arange(N) % USERS, max_items=2)


COMMON = dict(l2_clip=1.0, noise_multiplier=1.0, key=0)

# A phase's calibration, written out (tests/phase_calibration.py): the
# compiled step depends on the structure its fields select, not on their
# values.
_PHASE = phase_calibration.PHASE


# ------------------------------------------------ transformations' update

TRANSFORMATIONS: dict[str, Callable[[], tuple[Any, Any]]] = {
    'dpsgd_vmap': lambda: _transformation_case(dpsco_jax.dpsgd(
        loss_fn, num_steps=STEPS, clipping_method='vmap', **COMMON),
                                               _batch()),
    'dpsgd_ghost': lambda: _transformation_case(dpsco_jax.dpsgd(
        loss_fn, num_steps=STEPS, clipping_method='ghost', **COMMON),
                                                _batch()),
    'dpftrl': lambda: _transformation_case(dpsco_jax.dpftrl(
        loss_fn, num_steps=STEPS, restart_every=4, **COMMON), _batch()),
    'dpmemf_dense': lambda: _transformation_case(dpsco_jax.dpmemf(
        loss_fn, strategy=strategies.banded_square_root(STEPS, STEPS),
        steps_per_epoch=STEPS, num_examples=N, **COMMON), _ordered_batch()),
    'dpmemf_banded': lambda: _transformation_case(dpsco_jax.dpmemf(
        loss_fn, strategy=strategies.banded_square_root(STEPS, 3),
        steps_per_epoch=STEPS, num_examples=N, **COMMON), _ordered_batch()),
    'dpmemf_blt': lambda: _transformation_case(dpsco_jax.dpmemf(
        loss_fn, mechanism=blt.mechanism(
            blt.parameters([0.9, 0.5], [0.3, 0.2]), STEPS),
        steps_per_epoch=STEPS, num_examples=N, **COMMON), _ordered_batch()),
    'accelerated_dp_srgd': lambda: _transformation_case(
        dpsco_jax.accelerated_dp_srgd(loss_fn, num_steps=STEPS, beta=10.0,
                                      radius=None, **COMMON), _batch()),
    'unaccelerated_dp_srg': lambda: _transformation_case(
        dpsco_jax.unaccelerated_dp_srg(loss_fn, num_steps=STEPS, beta=10.0,
                                       radius=None, **COMMON), _batch()),
    'srg_gradient': lambda: _transformation_case(dpsco_jax.srg_gradient(
        loss_fn, num_steps=STEPS, **COMMON), _batch()),
    'fixed_order_guard': lambda: _guard_case(dpsco_jax.fixed_order_guard(
        STEPS, num_examples=N)),
    'dp_srg_memf': lambda: _transformation_case(dpsco_jax.dp_srg_memf(
        loss_fn, strategy=strategies.banded_square_root(STEPS, 3),
        steps_per_epoch=STEPS, decay=0.5, num_examples=N, **COMMON),
                                                _ordered_batch()),
    'diff2_gd': lambda: _transformation_case(dpsco_jax.diff2_gd(
        loss_fn, learning_rate=0.1, grad_clip=1.0, diff_clip_factor=1.5,
        restart_interval=2, num_rounds=STEPS,
        noise_multipliers=dpsco_jax.Diff2NoiseMultipliers(1.0, 1.0), key=0),
                                             _batch(N)),
    'diff2_estimator': lambda: _transformation_case(dpsco_jax.diff2_estimator(
        loss_fn, grad_clip=1.0, diff_clip_factor=1.5, restart_interval=2,
        num_rounds=STEPS,
        noise_multipliers=dpsco_jax.Diff2NoiseMultipliers(1.0, 1.0), key=0),
                                                    _batch(N)),
    'dp_gd': lambda: _transformation_case(dpsco_jax.dp_gd(
        loss_fn, learning_rate=0.1, grad_clip=1.0, noise_multiplier=1.0,
        num_rounds=STEPS, key=0), _batch(N)),
    'diff2_bvr_local_sgd': lambda: _transformation_case(
        dpsco_jax.diff2_bvr_local_sgd(
            loss_fn, learning_rate=0.1, grad_clip=1.0, diff_clip_factor=1.5,
            restart_interval=2, num_rounds=STEPS,
            noise_multipliers=dpsco_jax.Diff2NoiseMultipliers(1.0, 1.0),
            local_steps=2, local_batch_size=4, key=0), _batch(N)),
    'user_level_dpsgd': lambda: _transformation_case(
        dpsco_jax.user_level_dpsgd(loss_fn, num_steps=STEPS, **COMMON),
        {'batch': _users()}),
    # The outlier-removal mean needs hundreds of users a step.
    'outlier_removal_gradient': lambda: _transformation_case(
        user_level.outlier_removal_gradient(loss_fn, _PHASE, key=0),
        {'batch': batching.group_by_user(_data(1024), np.arange(1024) % 512,
                                         max_items=2)}),
    'nonsmooth_vr_gradient': lambda: _transformation_case(
        nonsmooth.nonsmooth_vr_gradient(
            loss_fn, order='first', smoothing_radius=0.1, num_directions=2,
            clips=(1.0, 1.0), period=2, anchor_batch_size=BATCH,
            batch_size=4, noise_multiplier=1.0, num_steps=STEPS, key=0),
        _batch()),
    'nonsmooth_multipass_gradient': lambda: _transformation_case(
        nonsmooth.nonsmooth_multipass_gradient(
            loss_fn, order='zero', smoothing_radius=0.1, num_directions=2,
            clips=(1.0, 1.0), period=2, num_examples=N,
            noise_multipliers=dpsco_jax.Diff2NoiseMultipliers(1.0, 1.0),
            num_steps=STEPS, key=0), _batch(N)),
}

# ------------------------------------------------------ plans' steps

# The accounting method never enters the compiled step; RDP accounts a
# given noise multiplier in milliseconds where the PLD takes a second.
ACCOUNTING = dict(method='rdp')
PLAN_COMMON = dict(num_examples=N, batch_size=BATCH, l2_clip=1.0, delta=1e-5,
                   noise_multiplier=1.0, key=0, seed=0, **ACCOUNTING)
SGD = optax.sgd(0.1)

PLANS: dict[str, Callable[[], tuple[Any, Any]]] = {
    'dpsgd_poisson': lambda: _plan_case(plans.dpsgd(
        loss_fn, optimizer=SGD, epochs=1, sampling='poisson',
        **PLAN_COMMON)),
    # The clip held in the state and its noisy count: no host round trip.
    'dpsgd_poisson_adaptive': lambda: _plan_case(plans.dpsgd(
        loss_fn, optimizer=SGD, epochs=1, sampling='poisson',
        adaptive_clipping=adaptive_clipping.AdaptiveClipping(count_stddev=2.0),
        **PLAN_COMMON)),
    'dpsgd_poisson_automatic': lambda: _plan_case(plans.dpsgd(
        loss_fn, optimizer=SGD, epochs=1, sampling='poisson',
        automatic_clipping=0.01, **PLAN_COMMON)),
    'dpftrl': lambda: _plan_case(plans.dpftrl(
        loss_fn, optimizer=SGD, epochs=1, **PLAN_COMMON)),
    'dpmemf_banded_cyclic_poisson': lambda: _plan_case(plans.dpmemf(
        loss_fn, optimizer=SGD, epochs=2, strategy='banded_sqrt', bands=2,
        sampling='cyclic_poisson', **PLAN_COMMON)),
    'dpmemf_blt': lambda: _plan_case(plans.dpmemf(
        loss_fn, optimizer=SGD, epochs=2, strategy='blt', n_buffers=2,
        **PLAN_COMMON)),
    'accelerated_dp_srgd': lambda: _plan_case(plans.accelerated_dp_srgd(
        loss_fn, beta=10.0, radius=None, **PLAN_COMMON)),
    'unaccelerated_dp_srg': lambda: _plan_case(plans.unaccelerated_dp_srg(
        loss_fn, beta=10.0, radius=None, **PLAN_COMMON)),
    'dp_srg_memf_banded_inverse_sqrt': lambda: _plan_case(plans.dp_srg_memf(
        loss_fn, optimizer=SGD, epochs=2, decay=0.5,
        strategy='banded_inverse_sqrt', bands=2, **PLAN_COMMON)),
    'diff2_gd': lambda: _plan_case(plans.diff2_gd(
        loss_fn, learning_rate=0.1, num_rounds=4, restart_interval=2,
        grad_clip=1.0, diff_clip_factor=1.5, num_examples=N, delta=1e-5,
        noise_multipliers=(1.0, 1.0), key=0, **ACCOUNTING), _batch(N)),
    # C_2 held in the state, counted on difference rounds only: selects.
    'diff2_gd_adaptive': lambda: _plan_case(plans.diff2_gd(
        loss_fn, learning_rate=0.1, num_rounds=4, restart_interval=2,
        grad_clip=1.0, diff_clip_factor=1.5, num_examples=N, delta=1e-5,
        noise_multipliers=(1.0, 1.0), key=0, **ACCOUNTING,
        adaptive_clipping=adaptive_clipping.AdaptiveClipping(count_stddev=2.0)),
                                            _batch(N)),
    'dp_gd': lambda: _plan_case(plans.dp_gd(
        loss_fn, learning_rate=0.1, num_rounds=4, grad_clip=1.0,
        num_examples=N, delta=1e-5, noise_multiplier=1.0, key=0, **ACCOUNTING),
      _batch(N)),
    'user_level_dpsgd_poisson': lambda: _user_plan_case(),
    'nonsmooth_single_pass': lambda: _plan_case(plans.nonsmooth_single_pass(
        loss_fn, order='first', num_examples=N, dimension=_dimension(),
        lipschitz=1.0, smoothing_radius=0.1, movement_radius=0.01,
        learning_rate=0.05, block_length=2, period=2, anchor_batch_size=8,
        batch_size=4, num_directions=2, noise_multiplier=1.0, num_steps=4,
        delta=1e-6, key=0, seed=0, **ACCOUNTING)),
    'nonsmooth_multi_pass': lambda: _plan_case(plans.nonsmooth_multi_pass(
        loss_fn, order='zero', num_examples=N, num_steps=4,
        dimension=_dimension(), lipschitz=1.0, smoothing_radius=0.1,
        movement_radius=0.01, learning_rate=0.05, block_length=2, period=2,
        num_directions=2, noise_multipliers=(1.0, 1.0), delta=1e-6, key=0,
        **ACCOUNTING), _batch(N)),
}


def _user_plan_case():
  plan = plans.user_level_dpsgd(
      loss_fn, optimizer=SGD, num_users=USERS, users_per_batch=4, epochs=1,
      l2_clip=1.0, delta=1e-5, noise_multiplier=1.0, key=0, seed=0,
      **ACCOUNTING)
  return _plan_case(plan, next(iter(plan.batches_of(_users()))))


@functools.cache
def _cost(kind: str, name: str) -> dpsco_jax.CompiledCost:
  builders = TRANSFORMATIONS if kind == 'update' else PLANS
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    step, args = builders[name]()
    return dpsco_jax.compiled_cost(step, *args)


def assert_no_host_round_trip(cost: dpsco_jax.CompiledCost, what: str):
  """Fails, naming what the program holds, on a host callback or a
  conditional run every step."""
  found = (f'{what}: {cost.host_callbacks} host callback(s) '
           f'({cost.host_callbacks_in_conditionals} inside a conditional), '
           f'{cost.conditionals} conditional(s), '
           f'{cost.conditionals_every_step} run every step')
  print(found)
  assert cost.host_callbacks == 0 and cost.conditionals_every_step == 0, (
      found)


@pytest.mark.parametrize('name', list(TRANSFORMATIONS))
def test_update_makes_no_host_round_trip(name):
  assert_no_host_round_trip(_cost('update', name), f'{name} update')


@pytest.mark.parametrize('name', list(PLANS))
def test_plan_step_makes_no_host_round_trip(name):
  assert_no_host_round_trip(_cost('plan', name), f'plans.{name} step')


def test_every_plan_builder_is_covered():
  # A new plan function must come with a case above.
  # `plans.build` is the one constructor every plan function calls (its
  # steps are the plan functions' steps), not a plan of its own.
  builders = {name for name in dir(plans) if not name.startswith('_') and
              callable(getattr(plans, name)) and
              getattr(getattr(plans, name), '__annotations__', {}).get(
                  'return') in (plans.Plan, 'Plan')} - {'build'}
  covered = {name.split('_poisson')[0].split('_banded')[0].split('_blt')[0]
             for name in PLANS}
  assert builders <= covered, sorted(builders - covered)


# --------------------------------------------- the inspector catches them


def _clean_step():
  tx = optax.adam(1e-3)

  def step(params, opt_state, batch):
    grads = jax.grad(lambda p: jnp.mean(jax.vmap(
        loss_fn, in_axes=(None, 0))(p, batch)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  args = _abstract((_params(), tx.init(_params()), _data(BATCH)))
  return step, args


def test_a_clean_step_passes():
  step, args = _clean_step()
  assert_no_host_round_trip(dpsco_jax.compiled_cost(step, *args), 'adam')


def test_a_planted_callback_is_caught():
  step, args = _clean_step()

  def planted(params, opt_state, batch):
    params, opt_state = step(params, opt_state, batch)
    # A host check every step, as a guard might make it.
    ok = jax.pure_callback(lambda p: np.bool_(True),
                           jax.ShapeDtypeStruct((), jnp.bool_),
                           params['Dense_0']['bias'])
    return jax.tree_util.tree_map(lambda x: jnp.where(ok, x, jnp.nan),
                                  params), opt_state

  cost = dpsco_jax.compiled_cost(planted, *args)
  assert cost.host_callbacks == 1 and cost.conditionals == 0, cost
  with pytest.raises(AssertionError, match='1 host callback'):
    assert_no_host_round_trip(cost, 'planted callback')


def test_a_planted_cond_is_caught_even_inside_a_loop():
  step, args = _clean_step()

  def planted(params, opt_state, batch):
    params, opt_state = step(params, opt_state, batch)
    bias = params['Dense_0']['bias']
    bias = jax.lax.cond(jnp.all(jnp.isfinite(bias)), lambda b: b,
                        lambda b: jnp.full_like(b, jnp.nan), bias)

    def body(i, b):   # one more conditional, in a loop body
      return jax.lax.cond(i % 2 == 0, jnp.sin, jnp.cos, b)

    bias = jax.lax.fori_loop(0, 3, body, bias)
    params = {**params, 'Dense_0': {**params['Dense_0'], 'bias': bias}}
    return params, opt_state

  cost = dpsco_jax.compiled_cost(planted, *args)
  assert cost.host_callbacks == 0, cost
  assert cost.conditionals == cost.conditionals_every_step >= 2, cost
  with pytest.raises(AssertionError, match='run every step'):
    assert_no_host_round_trip(cost, 'planted cond')


def test_a_conditional_inside_a_branch_is_not_run_every_step():
  def fn(x):
    def rare(y):   # a callback and a nested cond, only when x is not finite
      y = jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(y.shape,
                                                             y.dtype), y)
      return jax.lax.cond(y[0] > 0, jnp.sin, jnp.cos, y)
    return jax.lax.cond(jnp.all(jnp.isfinite(x)), lambda y: y * 2, rare, x)

  cost = dpsco_jax.compiled_cost(fn, jax.ShapeDtypeStruct((4,), jnp.float32))
  assert (cost.host_callbacks, cost.host_callbacks_in_conditionals) == (1, 1)
  assert (cost.conditionals, cost.conditionals_every_step) == (2, 1)
