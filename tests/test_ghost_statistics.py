"""Ghost norms for gradient differences and per-user means.

`clipped_grad_difference_sum` (one example at two points, `a g - b g'`) and
`clipped_user_grad_sum` (a user's mean item gradient) must give on the ghost
path the vmap path's `ClippedSum` (sum to float tolerance, counters exactly)
with masks, microbatches, NaN/Inf rows and traced coefficients, keep the
sensitivity bound for any data, and fall back with an announcement where
the ghost path does not apply. Equivalence tests force
`clipping_method='ghost'`, so a
silent fallback cannot make them pass.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping
from dpsco_jax import ghost
from dpsco_jax.neighboring import NeighboringRelation
from tests.test_ghost_clipping import _assert_same
from tests.test_ghost_clipping import _flat
from tests.test_ghost_clipping import _model
from tests.test_ghost_clipping import _tied_weights
from tests.test_ghost_clipping import RTOL

MODELS = ('logistic_regression', 'mlp', 'sequence', 'embedding',
          'flax_nnx_cnn')
NUM_EXAMPLES = 12
USERS, ITEMS = 6, 3


def _moved(params, scale, seed=10):
  """`params` plus a Gaussian step of relative size `scale`.

  Computed in numpy: eager jnp arithmetic would compile a program per
  operation and leaf shape.
  """
  rng = np.random.default_rng(seed)

  def move(p):
    p = np.asarray(p)
    step = (rng.normal(size=p.shape) * scale).astype(p.dtype) * np.std(p)
    return jnp.asarray(p + step, p.dtype)

  return jax.tree_util.tree_map(move, params)


_MAKE = {'difference': clipping.clipped_grad_difference_sum,
         'user': clipping.clipped_user_grad_sum}


@functools.cache
def _statistic(kind, loss_fn, method, microbatch_size=None):
  """One jitted statistic per configuration, the clip a traced argument.

  `fn(clip, batch, *args, mask=None)` clips to `clip` (the `l2_clip=` of
  a call): every clip of one model and configuration shares one compiled
  program.
  """
  stat = _MAKE[kind](loss_fn, 1.0, clipping_method=method,
                     microbatch_size=microbatch_size)
  return jax.jit(lambda clip, batch, *args, mask=None: stat(
      batch, *args, mask=mask, l2_clip=clip))


def _both(kind, loss_fn, batch, args, clip, mask=None, microbatch_size=None):
  """The statistic on the ghost path (forced) and on the vmap path.

  Without a mask every unit counts: an all-true mask, so that masked and
  unmasked calls share one compiled program.
  """
  if mask is None:
    mask = np.ones(clipping.batch_size_of(batch), bool)
  return tuple(_statistic(kind, loss_fn, method, microbatch_size)(
      np.float32(clip), batch, *args, mask=mask)
               for method in ('ghost', 'vmap'))


def _clip_between_norms(kind, loss_fn, batch, args):
  """A clip norm between the middle two unit norms (so both cases occur).

  Each unit's contribution is the vmap path's sum over that unit alone (a
  one-hot mask) at a clip far above it: calls of the program `_both`
  compiles for this model and configuration, no program of its own.
  """
  units = clipping.batch_size_of(batch)
  alone = [_statistic(kind, loss_fn, 'vmap')(
      np.float32(1e6), batch, *args, mask=np.arange(units) == unit)
           for unit in range(units)]
  norms = np.sort([np.linalg.norm(_flat(out.sum)) for out in alone
                   if int(out.num_nonfinite) == 0])
  assert not any(int(out.num_clipped) for out in alone)
  middle = len(norms) // 2
  return float(np.sqrt(norms[middle - 1] * norms[middle]))


def _nan_rows(x, mask):
  """numpy: `x` with the rows `mask` drops set to NaN."""
  x = np.asarray(x)
  return np.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, np.nan)


# ---------------------------------------------------------------------------
# Gradient differences.


def _difference_case(model, scale=0.3):
  loss_fn, params, batch = _model(model)
  return loss_fn, batch, (params, _moved(params, scale), 2.0, 1.5)


@pytest.mark.parametrize('model', MODELS)
def test_difference_ghost_equals_vmap(model):
  loss_fn, batch, args = _difference_case(model)
  clip = _clip_between_norms('difference', loss_fn, batch, args)
  ghost_out, vmap_out = _both('difference', loss_fn, batch, args, clip)
  _assert_same(ghost_out, vmap_out, rtol=RTOL.get(model, 1e-5))
  assert 0 < int(vmap_out.num_clipped) < NUM_EXAMPLES


@pytest.mark.parametrize('model', ['mlp', 'sequence'])
def test_difference_with_mask_nan_and_microbatches(model):
  loss_fn, batch, args = _difference_case(model)
  clip = _clip_between_norms('difference', loss_fn, batch, args)
  mask = np.arange(NUM_EXAMPLES) % 4 != 1
  # Masked rows hold NaN (must be exactly zero); rows 2 and 7 (unmasked)
  # hold NaN and Inf (dropped and counted).
  x = _nan_rows(batch['x'], mask)
  x[2], x[7] = np.nan, np.inf
  poisoned = dict(batch, x=x)
  for microbatch_size in (None, 5):
    ghost_out, vmap_out = _both('difference', loss_fn, poisoned, args, clip,
                                mask=mask, microbatch_size=microbatch_size)
    _assert_same(ghost_out, vmap_out)
    assert int(ghost_out.num_nonfinite) == 2
    assert int(ghost_out.count) == int(mask.sum())
    assert np.all(np.isfinite(_flat(ghost_out.sum)))


def test_difference_coefficients_may_be_traced():
  loss_fn, batch, (params, prev, _, _) = _difference_case('mlp')
  # The coefficients are traced arguments of one compiled program per path.
  for a, b in ((3.0, 2.0), (1.0, 0.0), (0.5, 1.25)):
    _assert_same(*_both('difference', loss_fn, batch, (params, prev, a, b),
                        0.5))


def test_difference_default_coefficients_and_auto():
  loss_fn, batch, (params, prev, _, _) = _difference_case('mlp')
  stat = clipping.clipped_grad_difference_sum(loss_fn, 0.5)
  assert stat.clipping_method == 'auto'
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert stat.ghost_plan(batch, params, prev) is not None
    # The constructor's clip against the traced clip of the vmap path.
    _assert_same(jax.jit(stat)(batch, params, prev),
                 _both('difference', loss_fn, batch,
                       (params, prev, 1.0, 1.0), 0.5)[1])


@pytest.mark.parametrize('model', MODELS)
def test_difference_of_close_points_with_large_coefficients(model):
  # The recursive-gradient regime: x' next to x, a and b large and nearly
  # equal (SRG's t + 1 and t; DIFF2's 1 / ||x - x'||), a clip far below the
  # gradients themselves. The plain cross-term sum would cancel
  # catastrophically here; the vmap path itself rounds at about
  # eps * a |g| / |a g - b g'|, hence the tolerance.
  loss_fn, params, batch = _model(model)
  args = (params, _moved(params, 1e-3), 1001.0, 1000.0)
  clip = _clip_between_norms('difference', loss_fn, batch, args)
  ghost_out, vmap_out = _both('difference', loss_fn, batch, args, clip)
  _assert_same(ghost_out, vmap_out, rtol=1e-3)
  assert 0 < int(vmap_out.num_clipped) < NUM_EXAMPLES


def test_difference_at_the_same_point_is_zero_not_nan():
  loss_fn, params, batch = _model('sequence')
  out, _ = _both('difference', loss_fn, batch, (params, params, 7.0, 7.0),
                 1e-3)
  assert int(out.num_nonfinite) == 0
  np.testing.assert_allclose(_flat(out.sum), 0.0, atol=1e-4)


@pytest.mark.parametrize('value', [np.nan, np.inf, 1e30, 1e6, -7.0])
def test_changing_one_example_moves_the_difference_sum_by_at_most_sensitivity(
    value):
  loss_fn, batch, args = _difference_case('mlp', scale=1e-2)
  args = (*args[:2], 101.0, 100.0)
  stat, jitted = _jitted_ghost_statistic('difference', loss_fn)
  original = _flat(jitted(batch, *args).sum)
  for changed in (_set(batch['x'], (4, 0), value), _set(batch['x'], 4, value)):
    moved = _flat(jitted(dict(batch, x=changed), *args).sum)
    assert np.all(np.isfinite(moved))
    assert np.linalg.norm(moved - original) <= stat.sensitivity(
        NeighboringRelation.REPLACE_ONE) * (1 + 1e-4)
  removed = _flat(jitted(batch, *args,
                         mask=np.arange(NUM_EXAMPLES) != 4).sum)
  assert np.linalg.norm(removed - original) <= stat.sensitivity() * (1 + 1e-4)


@functools.cache
def _jitted_ghost_statistic(kind, loss_fn):
  """`(statistic, jax.jit(statistic))`, clip 0.5, the ghost path forced.

  Shared by the parametrizations of a sensitivity test: one program.
  """
  stat = _MAKE[kind](loss_fn, 0.5, clipping_method='ghost')
  return stat, jax.jit(stat)


def _set(x, index, value):
  """numpy: a copy of `x` with `x[index] = value`."""
  x = np.array(x)
  x[index] = value
  return x


def test_difference_check_catches_a_missing_cross_term(monkeypatch):
  # Summing the two points' squared norms, without the cross term
  # -2ab (u1.u2)(v1.v2), is a plausible slip; the comparison the tests make
  # must catch it. A fresh statistic (not the cached one) is traced after
  # the patch.
  dense = ghost.LAYER_RULES['dot_general']

  def without_cross_term(tap, program, leaf, others, g):
    (a,) = others
    return sum(dense.squared_norms(tap, program, leaf, (a[:, t:t + 1],),
                                   g[:, t:t + 1]).bound
               for t in range(a.shape[1]))

  loss_fn, batch, args = _difference_case('mlp')
  ghost_out, vmap_out = _both('difference', loss_fn, batch, args, 0.5)
  _assert_same(ghost_out, vmap_out)
  monkeypatch.setitem(ghost.LAYER_RULES, 'dot_general',
                      ghost.LayerRule(dense.check, without_cross_term))
  patched = jax.jit(clipping.clipped_grad_difference_sum(
      loss_fn, 0.5, clipping_method='ghost'))(batch, *args)
  with pytest.raises(AssertionError):
    _assert_same(patched, vmap_out)


def test_difference_refuses_params_of_another_shape():
  loss_fn, params, batch = _model('mlp')
  other = jax.tree_util.tree_map(lambda p: np.zeros(p.shape + (1,)), params)
  stat = clipping.clipped_grad_difference_sum(loss_fn, 1.0,
                                              clipping_method='ghost')
  with pytest.raises(ghost.GhostClippingUnsupported, match='prev_params'):
    stat.ghost_plan(batch, params, other)


# ---------------------------------------------------------------------------
# Per-user means.


def _user_case(model, seed=11):
  """Users of ITEMS items each, with a mask that drops some items."""
  loss_fn, params, batch = _model(model)
  rng = np.random.default_rng(seed)
  rows = rng.integers(0, NUM_EXAMPLES, USERS * ITEMS)
  items = jax.tree_util.tree_map(
      lambda x: np.asarray(x)[rows].reshape((USERS, ITEMS) + x.shape[1:]),
      batch)
  item_mask = np.ones((USERS, ITEMS), bool)
  item_mask[1, 2] = item_mask[3, 0] = item_mask[3, 1] = False
  item_mask[4] = False   # a user with no items: contributes zero
  return loss_fn, params, items, item_mask


def _poison_masked_items(items, item_mask):
  def poison(x):
    keep = item_mask.reshape(item_mask.shape + (1,) * (x.ndim - 2))
    return np.where(keep, x, np.nan if x.dtype == np.float32 else 0).astype(
        x.dtype)
  return jax.tree_util.tree_map(poison, items)


# The ghost norms are upper bounds including rounding (ghost.LayerNorms):
# a Gram-form layer's bound grows with the columns per unit (a user of the
# sequence model has ITEMS x positions of them), so its clip factor may be
# smaller than the vmap path's by up to ~1e-4 relative (clipping a little
# earlier, never later).
USER_RTOL = {'logistic_regression': 1e-5, 'mlp': 1e-5, 'sequence': 2e-4,
             'embedding': 2e-4, 'flax_nnx_cnn': 2e-4}


@pytest.mark.parametrize('model', MODELS)
def test_user_ghost_equals_vmap(model):
  loss_fn, params, items, item_mask = _user_case(model)
  batch = clipping.UserBatch(_poison_masked_items(items, item_mask),
                             item_mask)
  clip = _clip_between_norms('user', loss_fn, batch, (params,))
  ghost_out, vmap_out = _both('user', loss_fn, batch, (params,), clip)
  _assert_same(ghost_out, vmap_out, rtol=USER_RTOL[model])
  assert int(ghost_out.count) == USERS
  assert 0 < int(vmap_out.num_clipped) < USERS
  # Without an item mask every item counts (a bare pytree of items).
  ghost_out, vmap_out = _both('user', loss_fn, items, (params,), clip)
  _assert_same(ghost_out, vmap_out, rtol=USER_RTOL[model])


@pytest.mark.parametrize('model', ['mlp', 'sequence'])
def test_user_mask_nan_and_microbatches(model):
  loss_fn, params, items, item_mask = _user_case(model)
  # User 2 has an unmasked NaN item: its mean is NaN, dropped and counted.
  items = dict(items, x=_set(items['x'], (2, 1), np.nan))
  batch = clipping.UserBatch(_poison_masked_items(items, item_mask),
                             item_mask)
  mask = np.arange(USERS) != 5
  for microbatch_size in (None, 4):
    ghost_out, vmap_out = _both('user', loss_fn, batch, (params,), 0.5,
                                mask=mask, microbatch_size=microbatch_size)
    _assert_same(ghost_out, vmap_out, rtol=USER_RTOL[model])
    assert int(ghost_out.num_nonfinite) == 1
    assert int(ghost_out.count) == USERS - 1
    assert np.all(np.isfinite(_flat(ghost_out.sum)))


def test_user_with_no_items_contributes_zero():
  loss_fn, params, items, item_mask = _user_case('mlp')
  batch = clipping.UserBatch(_poison_masked_items(items, item_mask),
                             item_mask)
  alone, _ = _both('user', loss_fn, batch, (params,), 0.5,
                   mask=np.arange(USERS) == 4)
  assert int(alone.count) == 1 and int(alone.num_nonfinite) == 0
  np.testing.assert_array_equal(_flat(alone.sum), 0.0)


def test_user_statistic_is_auto_by_default():
  loss_fn, params, items, item_mask = _user_case('mlp')
  batch = clipping.UserBatch(items, item_mask)
  stat = clipping.clipped_user_grad_sum(loss_fn, 0.5)
  assert stat.clipping_method == 'auto'
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert stat.ghost_plan(batch, params) is not None
    # The constructor's clip against the traced clip of the vmap path.
    _assert_same(jax.jit(stat)(batch, params),
                 _both('user', loss_fn, batch, (params,), 0.5)[1])


@pytest.mark.parametrize('value', [np.nan, np.inf, 1e30, -7.0])
def test_changing_one_user_moves_the_sum_by_at_most_sensitivity(value):
  loss_fn, params, items, item_mask = _user_case('mlp')
  stat, jitted = _jitted_ghost_statistic('user', loss_fn)
  batch = clipping.UserBatch(items, item_mask)
  original = _flat(jitted(batch, params).sum)
  # Replace-one: all of user 1's items change, or one entry of one item
  # together with the user's item mask.
  all_items = np.where(np.arange(USERS)[:, None] == 1, True, item_mask)
  for changed in (
      clipping.UserBatch(dict(items, x=_set(items['x'], 1, value)),
                         item_mask),
      clipping.UserBatch(dict(items, x=_set(items['x'], (1, 0, 0), value)),
                         all_items)):
    moved = _flat(jitted(changed, params).sum)
    assert np.all(np.isfinite(moved))
    assert np.linalg.norm(moved - original) <= stat.sensitivity(
        NeighboringRelation.REPLACE_ONE) * (1 + 1e-5)
  removed = _flat(jitted(batch, params, mask=np.arange(USERS) != 1).sum)
  assert np.linalg.norm(removed - original) <= stat.sensitivity() * (1 + 1e-5)


def test_dense_gram_choice_counts_the_terms():
  loss_fn, params, batch = _model('mlp')
  plan = ghost.analyze(loss_fn, params, batch)
  dense = [tap for tap in plan.taps if tap.rule == 'dot_general']
  assert [ghost.dense_uses_gram(tap, plan) for tap in dense] == [None, None]
  # Two terms (a difference) of a plain dense layer: the 2x2 Gram form.
  assert [ghost.dense_uses_gram(tap, plan, terms=2) for tap in dense] == [
      True, True]


# ---------------------------------------------------------------------------
# Fallback.


@pytest.mark.parametrize('kind', ['difference', 'user'])
def test_tied_weights_take_the_ghost_path(kind):
  # A parameter used twice (the decoder reads w.T): one tap per use, the
  # norm of the sum of their gradients.
  loss_fn, params, batch = _tied_weights()
  if kind == 'difference':
    make, args = clipping.clipped_grad_difference_sum, (
        params, _moved(params, 0.3), 2.0, 1.0)
  else:
    make, args = clipping.clipped_user_grad_sum, (params,)
    batch = jax.tree_util.tree_map(
        lambda x: np.asarray(x).reshape((4, 3) + x.shape[1:]), batch)
  plan = make(loss_fn, 1.0, clipping_method='ghost').ghost_plan(batch, *args)
  assert [(tap.rule, tap.shared) for tap in plan.taps if tap.leaf == 1] == [
      ('dot_general', True), ('dot_general', True)]
  with warnings.catch_warnings():
    warnings.simplefilter('error', clipping.GhostClippingFallbackWarning)
    out = jax.jit(make(loss_fn, 1.0))(batch, *args)
  _assert_same(out, jax.jit(make(loss_fn, 1.0, clipping_method='vmap'))(
      batch, *args))


def test_layers_fed_by_the_data_alone_are_marked_param_free():
  # Their inputs are the same at both points, so a difference is one term
  # there; a layer after a parameterized one keeps both terms.
  loss_fn, params, batch = _model('mlp')
  plan = ghost.analyze(loss_fn, params, batch)
  names = ['hidden.b', 'hidden.w', 'out.b', 'out.w']   # leaves, sorted keys
  assert {names[tap.leaf]: tap.param_free for tap in plan.taps} == {
      'hidden.w': True, 'hidden.b': False, 'out.w': False, 'out.b': False}
