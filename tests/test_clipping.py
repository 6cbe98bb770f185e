"""Tests for `dpsco_jax.clipping`: clipped sums, their guarantees and errors.

References are plain per-example loops in float64 numpy, so they share no
code path (vmap, microbatching, rescaled norms) with the library.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping
from dpsco_jax.neighboring import NeighboringRelation

CLIP = 0.5
DIM = 4
NUM_EXAMPLES = 10


def _logistic_loss(params, example):
  logit = jnp.dot(example['x'], params['w']) + params['b']
  return jnp.logaddexp(0.0, logit) - example['y'] * logit


def _linear_loss(params, example):
  # The gradient is the example itself, so a test controls it exactly.
  return jnp.sum(params['w'] * example['x'])


# The references call it once per example: jit it once for all tests.
_logistic_grad = jax.jit(jax.grad(_logistic_loss))


@functools.cache
def _statistic(make, loss_fn=_logistic_loss, microbatch_size=None):
  """One statistic per configuration, so its jit compilations are shared."""
  return make(loss_fn, CLIP, microbatch_size=microbatch_size)


def _evaluate(stat, batch, *args, mask=None):
  """`stat(batch, *args, mask=mask)` under jit; all-True mask by default.

  Eager calls compile every `lax.cond` afresh, which dominates the runtime;
  jitting the cached statistic with one call signature compiles once per
  statistic and shape.

  Args:
    stat: a `ClippedStatistic`.
    batch: its batch.
    *args: its arguments (params, ...), traced.
    mask: optional unit mask.

  Returns:
    The `ClippedSum`.
  """
  if mask is None:
    mask = np.ones(clipping.batch_size_of(batch, stat.min_ndim), bool)
  return jax.jit(stat)(batch, *args, mask=mask)


def _logistic_problem(num_examples=NUM_EXAMPLES, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  params = {'w': jnp.asarray(rng.normal(size=DIM), dtype),
            'b': jnp.asarray(0.1, dtype)}
  # Scales spread over [0.05, 3] so some examples are clipped and some not.
  scales = rng.uniform(0.05, 3.0, size=(num_examples, 1))
  batch = {'x': jnp.asarray(rng.normal(size=(num_examples, DIM)) * scales,
                            dtype),
           'y': jnp.asarray(rng.integers(0, 2, size=num_examples), dtype)}
  return params, batch


def _linear_problem(num_examples=6, seed=1):
  rng = np.random.default_rng(seed)
  params = {'w': jnp.zeros(DIM)}
  batch = {'x': jnp.asarray(rng.normal(size=(num_examples, DIM)), jnp.float32)}
  return params, batch


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(leaf, np.float64))
                         for leaf in jax.tree_util.tree_leaves(tree)])


def _row(batch, index):
  return jax.tree_util.tree_map(lambda x: x[index], batch)


def _rows(batch, indices):
  return jax.tree_util.tree_map(lambda x: x[np.asarray(indices)], batch)


def _reference(contribution_fn, batch, indices, clip=CLIP):
  """Loop reference: sum of contributions scaled by min(1, C'/||g||).

  C' is `clipping.effective_clip` for the batch's size: the clip lowered by
  the bound on the batch sum's rounding.
  """
  total, num_clipped = 0.0, 0
  size = clipping.batch_size_of(batch)
  for index in indices:
    contribution = _flat(contribution_fn(_row(batch, index)))
    norm = np.linalg.norm(contribution)
    total = total + contribution * min(
        1.0, clipping.effective_clip(clip, size) / norm)
    num_clipped += int(norm > clip)
  return total, num_clipped


def _assert_same_sum(actual, expected):
  np.testing.assert_allclose(_flat(actual.sum), _flat(expected.sum),
                             rtol=1e-5, atol=1e-6)
  assert int(actual.count) == int(expected.count)
  assert int(actual.num_clipped) == int(expected.num_clipped)
  assert int(actual.num_nonfinite) == int(expected.num_nonfinite)


def test_clipped_grad_sum_matches_loop_reference():
  params, batch = _logistic_problem()
  # Called without a mask on purpose: `_evaluate` always passes one.
  out = jax.jit(_statistic(clipping.clipped_grad_sum))(batch, params)
  expected, num_clipped = _reference(lambda ex: _logistic_grad(params, ex),
                                     batch, range(NUM_EXAMPLES))
  np.testing.assert_allclose(_flat(out.sum), expected, rtol=1e-5, atol=1e-6)
  assert int(out.count) == NUM_EXAMPLES
  assert int(out.num_nonfinite) == 0
  # Both clipped and unclipped examples are present, so the factor matters.
  assert 0 < num_clipped < NUM_EXAMPLES
  assert int(out.num_clipped) == num_clipped


def _set_example(batch, index, values):
  return {'x': batch['x'].at[index].set(jnp.asarray(values, jnp.float32))}


# The module documents that a norm beyond ~1e19 clip norms is unrepresentable
# in float32 and dropped like NaN/Inf (1e30 here), while 1e15 (whose square,
# 1e30, overflows no float32) is clipped like any other gradient.
ADVERSARIAL = [(1e15, False), (1e30, True), (np.nan, True), (np.inf, True),
               (-np.inf, True)]


@pytest.mark.parametrize('value, dropped', ADVERSARIAL)
def test_adversarial_example_moves_sum_by_at_most_sensitivity(value, dropped):
  stat = _statistic(clipping.clipped_grad_sum, _linear_loss)
  params, batch = _linear_problem()
  adversarial = _set_example(batch, 0, [value, 1.0, -1.0, 2.0])
  with_adversary = _evaluate(stat, adversarial, params)
  without = _evaluate(stat, _rows(batch, range(1, 6)), params)
  difference = _flat(with_adversary.sum) - _flat(without.sum)
  assert np.all(np.isfinite(_flat(with_adversary.sum)))
  assert np.linalg.norm(difference) <= stat.sensitivity() * (1 + 1e-6)
  assert int(with_adversary.count) == 6
  if dropped:
    assert int(with_adversary.num_nonfinite) == 1
    np.testing.assert_allclose(difference, 0.0, atol=1e-6)
  else:
    # Clipped to norm C' (`effective_clip`) along its own direction (~e_0),
    # not dropped.
    assert int(with_adversary.num_nonfinite) == 0
    np.testing.assert_allclose(
        difference, [clipping.effective_clip(CLIP, 6), 0.0, 0.0, 0.0],
        atol=1e-6)
    assert int(with_adversary.num_clipped) == int(without.num_clipped) + 1


@pytest.mark.parametrize('value, dropped', ADVERSARIAL)
def test_replacing_one_example_moves_sum_by_at_most_twice_clip(value, dropped):
  stat = _statistic(clipping.clipped_grad_sum, _linear_loss)
  params, batch = _linear_problem()
  # Example 0 is 5 e_0 (clipped to C e_0); replacing it by -1e15 e_0 (clipped
  # to -C e_0) reaches the bound 2C exactly.
  batch = _set_example(batch, 0, [5.0, 0.0, 0.0, 0.0])
  replaced = _set_example(batch, 0, [-value, 0.0, 0.0, 0.0])
  distance = np.linalg.norm(_flat(_evaluate(stat, replaced, params).sum) -
                            _flat(_evaluate(stat, batch, params).sum))
  bound = stat.sensitivity(NeighboringRelation.REPLACE_ONE)
  assert bound == 2 * CLIP
  assert distance <= bound * (1 + 1e-6)
  # A dropped replacement contributes zero: only the removal remains. The
  # bound is reached up to the sum's rounding margin (`effective_clip`).
  clip = clipping.effective_clip(CLIP, clipping.batch_size_of(batch))
  expected = clip if dropped else 2 * clip
  np.testing.assert_allclose(distance, expected, rtol=1e-5)


def _poison_masked_rows(batch, mask):
  return jax.tree_util.tree_map(
      lambda x: jnp.where(
          mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.nan), batch)


def test_masked_rows_holding_nan_contribute_nothing():
  params, batch = _logistic_problem()
  mask = np.arange(NUM_EXAMPLES) % 3 != 1
  stat = _statistic(clipping.clipped_grad_sum)
  out = _evaluate(stat, _poison_masked_rows(batch, mask), params, mask=mask)
  unpadded = _evaluate(stat, _rows(batch, np.flatnonzero(mask)), params)
  _assert_same_sum(out, unpadded)
  assert int(out.count) == int(mask.sum())
  assert int(out.num_nonfinite) == 0


@pytest.mark.parametrize('microbatch_size', [1, 3, 7, 16])
@pytest.mark.parametrize('masked', [False, True])
def test_microbatching_matches_one_block(microbatch_size, masked):
  params, batch = _logistic_problem()
  mask = np.ones(NUM_EXAMPLES, bool)
  if masked:
    mask = np.arange(NUM_EXAMPLES) % 3 != 1
    batch = _poison_masked_rows(batch, mask)
  whole = _evaluate(_statistic(clipping.clipped_grad_sum), batch, params,
                    mask=mask)
  blocked = _evaluate(
      _statistic(clipping.clipped_grad_sum, microbatch_size=microbatch_size),
      batch, params, mask=mask)
  _assert_same_sum(blocked, whole)
  assert int(blocked.count) == int(mask.sum())


def _difference_problem():
  params, batch = _logistic_problem()
  prev = jax.tree_util.tree_map(lambda p: p - 0.7, params)
  return params, prev, batch


def _difference_reference(params, prev, batch, a, b):
  def difference(example):
    return jax.tree_util.tree_map(lambda g, h: a * g - b * h,
                                  _logistic_grad(params, example),
                                  _logistic_grad(prev, example))

  return _reference(difference, batch, range(NUM_EXAMPLES))


@pytest.mark.parametrize('a, b', [(2.0, 1.0), (0.5, 3.0)])
def test_clipped_grad_difference_sum_clips_the_whole_difference(a, b):
  # `_evaluate` traces a and b, and both pairs share one compilation, so
  # this also checks that traced coefficients are used, not baked in.
  params, prev, batch = _difference_problem()
  stat = _statistic(clipping.clipped_grad_difference_sum)
  out = _evaluate(stat, batch, params, prev, a, b)
  expected, num_clipped = _difference_reference(params, prev, batch, a, b)
  np.testing.assert_allclose(_flat(out.sum), expected, rtol=1e-5, atol=1e-6)
  # Clipping is active, so clipping each gradient separately would differ.
  assert int(out.num_clipped) == num_clipped > 0


@pytest.mark.parametrize('method', ['vmap', 'ghost'])
def test_clipped_grad_difference_sum_is_zero_at_equal_params(method):
  params, _, batch = _difference_problem()
  stat = clipping.clipped_grad_difference_sum(_logistic_loss, CLIP,
                                              clipping_method=method)
  out = _evaluate(stat, batch, params, params, 1.0, 1.0)
  if method == 'vmap':
    # Each example's two gradients are computed alike and cancel exactly.
    np.testing.assert_array_equal(_flat(out.sum), 0.0)
  else:
    # The ghost path sums both points' products in one matrix product:
    # they cancel up to float32 rounding of the gradients' size.
    np.testing.assert_allclose(_flat(out.sum), 0.0, atol=1e-6)
  assert int(out.count) == NUM_EXAMPLES
  assert int(out.num_nonfinite) == 0


def _user_problem(seed=2):
  """Four users with three items each; user 2 has every item masked."""
  rng = np.random.default_rng(seed)
  params, _ = _logistic_problem()
  scales = rng.uniform(0.1, 3.0, size=(4, 1, 1))
  items = {'x': jnp.asarray(rng.normal(size=(4, 3, DIM)) * scales, jnp.float32),
           'y': jnp.asarray(rng.integers(0, 2, size=(4, 3)), jnp.float32)}
  item_mask = np.array([[True, True, False],
                        [True, True, True],
                        [False, False, False],
                        [False, True, True]])
  return params, items, item_mask


def _user_reference(params, items, item_mask):
  """Sum over users of clip(mean of the user's unmasked per-item grads)."""
  total = 0.0
  for user in range(item_mask.shape[0]):
    kept = np.flatnonzero(item_mask[user])
    if not kept.size:
      continue
    user_items = _row(items, user)
    mean = np.mean(
        [_flat(_logistic_grad(params, _row(user_items, j))) for j in kept],
        axis=0)
    total = total + mean * min(1.0, clipping.effective_clip(
        CLIP, item_mask.shape[0]) / np.linalg.norm(mean))
  return total


def test_clipped_user_grad_sum_matches_reference():
  params, items, item_mask = _user_problem()
  stat = _statistic(clipping.clipped_user_grad_sum)
  out = _evaluate(stat, clipping.UserBatch(items, item_mask), params)
  np.testing.assert_allclose(_flat(out.sum),
                             _user_reference(params, items, item_mask),
                             rtol=1e-5, atol=1e-6)
  assert int(out.count) == 4
  assert int(out.num_nonfinite) == 0


def test_user_with_every_item_masked_contributes_zero():
  params, items, item_mask = _user_problem()
  stat = _statistic(clipping.clipped_user_grad_sum)
  batch = clipping.UserBatch(items, item_mask)
  out = _evaluate(stat, batch, params)
  without_user = _evaluate(stat, batch, params, mask=item_mask.any(axis=1))
  np.testing.assert_allclose(_flat(out.sum), _flat(without_user.sum),
                             rtol=1e-6, atol=1e-7)
  assert int(out.num_nonfinite) == 0
  assert int(out.count) == int(without_user.count) + 1


def test_bare_user_batch_uses_every_item():
  params, items, item_mask = _user_problem()
  stat = _statistic(clipping.clipped_user_grad_sum)
  np.testing.assert_allclose(
      _flat(_evaluate(stat, items, params).sum),
      _user_reference(params, items, np.ones_like(item_mask)),
      rtol=1e-5, atol=1e-6)


def test_masked_item_holding_nan_is_dropped_from_its_user():
  # A masked item's NaN gradient must not reach its user's mean: masking the
  # loss with `where` would still multiply that NaN by a zero cotangent.
  params, items, item_mask = _user_problem()
  poisoned = {'x': jnp.where(item_mask[..., None], items['x'], jnp.nan),
              'y': items['y']}
  stat = _statistic(clipping.clipped_user_grad_sum)
  out = _evaluate(stat, clipping.UserBatch(poisoned, item_mask), params)
  assert int(out.num_nonfinite) == 0
  np.testing.assert_allclose(_flat(out.sum),
                             _user_reference(params, items, item_mask),
                             rtol=1e-5, atol=1e-6)


def test_changing_all_items_of_one_user_is_bounded_by_sensitivity():
  params, items, item_mask = _user_problem()
  stat = _statistic(clipping.clipped_user_grad_sum, _linear_loss)
  # User 0's mean gradient is 3 e_0, clipped to C e_0; replacing all its items
  # by -1e15 e_0 flips it to -C e_0, which reaches the bound 2C exactly.
  direction = jnp.zeros((3, DIM)).at[:, 0].set(1.0)
  before = {'x': items['x'].at[0].set(3.0 * direction), 'y': items['y']}
  after = {'x': items['x'].at[0].set(-1e15 * direction), 'y': items['y']}

  def clipped(user_items, mask=None):
    batch = clipping.UserBatch(user_items, item_mask)
    return _flat(_evaluate(stat, batch, params, mask=mask).sum)

  original = clipped(before)
  replaced = np.linalg.norm(clipped(after) - original)
  removed = np.linalg.norm(clipped(before, np.arange(4) != 0) - original)
  replace_bound = stat.sensitivity(NeighboringRelation.REPLACE_ONE)
  assert replaced <= replace_bound * (1 + 1e-6)
  # Reached up to the sum's rounding margin (`effective_clip`).
  clip = clipping.effective_clip(CLIP, item_mask.shape[0])
  np.testing.assert_allclose(replaced, 2 * clip, rtol=1e-5)
  assert removed <= stat.sensitivity() * (1 + 1e-6)
  np.testing.assert_allclose(removed, clip, rtol=1e-5)


def _grad_sum_of(batch, mask=None, microbatch_size=None):
  params, _ = _logistic_problem()
  stat = clipping.clipped_grad_sum(_logistic_loss, CLIP,
                                   microbatch_size=microbatch_size)
  return stat(batch, params, mask=mask)


def _user_sum_of(batch):
  params, _ = _logistic_problem()
  return clipping.clipped_user_grad_sum(_logistic_loss, CLIP)(batch, params)


_FIVE = {'x': jnp.ones((5, DIM)), 'y': jnp.ones(5)}


@pytest.mark.parametrize('make, match', [
    (lambda: clipping.clipped_grad_sum(_logistic_loss, 0.0),
     'positive and finite'),
    (lambda: clipping.clipped_grad_difference_sum(_logistic_loss, -1.0),
     'positive and finite'),
    (lambda: clipping.clipped_grad_sum(_logistic_loss, float('inf')),
     'positive and finite'),
    (lambda: clipping.clipped_user_grad_sum(_logistic_loss, float('nan')),
     'positive and finite'),
    (lambda: _grad_sum_of({'x': jnp.ones((5, DIM)), 'y': jnp.float32(1)}),
     'needs a leading example axis'),
    (lambda: _grad_sum_of({'x': jnp.ones((5, DIM)), 'y': jnp.ones(4)}),
     r'disagree on the leading axis: \[4, 5\]'),
    (lambda: _grad_sum_of(_FIVE, mask=np.ones(4, bool)),
     r'mask must have shape \(5,\)'),
    (lambda: _user_sum_of(_FIVE),
     r'at least 2 axes \(\[users, items, ...\]\)'),
    (lambda: _grad_sum_of(_FIVE, microbatch_size=0),
     'microbatch_size must be a positive integer'),
])
def test_invalid_inputs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize('microbatch_size', [None, 3])
def test_bfloat16_inputs_accumulate_in_float32(microbatch_size):
  params, batch = _logistic_problem(dtype=jnp.bfloat16)
  stat = _statistic(clipping.clipped_grad_sum, microbatch_size=microbatch_size)
  out = _evaluate(stat, batch, params)
  for leaf in jax.tree_util.tree_leaves(out.sum):
    assert leaf.dtype == jnp.float32
  assert np.all(np.isfinite(_flat(out.sum)))
  # The bfloat16 gradients differ from the float32 ones only by rounding.
  reference_params, reference_batch = _logistic_problem()
  reference = _evaluate(stat, reference_batch, reference_params)
  np.testing.assert_allclose(_flat(out.sum), _flat(reference.sum),
                             rtol=0.05, atol=0.05)


def test_jitted_statistic_is_pure():
  params, batch = _logistic_problem()
  jitted = jax.jit(_statistic(clipping.clipped_grad_sum, microbatch_size=3))
  first, second = jitted(batch, params), jitted(batch, params)
  for a, b in zip(jax.tree_util.tree_leaves(first),
                  jax.tree_util.tree_leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_traced_clip_norm_vmaps_over_a_grid_of_clips():
  # A sweep vmaps one compiled program over clip norms: each lane must equal
  # the statistic built with that clip as a Python float.
  params, batch = _logistic_problem()
  clips = jnp.asarray([0.05, 0.5, 5.0])

  def clipped_at(clip):
    return clipping.clipped_grad_sum(_logistic_loss, clip)(batch, params).sum

  swept = jax.jit(jax.vmap(clipped_at))(clips)
  for i, clip in enumerate([0.05, 0.5, 5.0]):
    expected, _ = _reference(lambda ex: _logistic_grad(params, ex), batch,
                             range(NUM_EXAMPLES), clip=clip)
    np.testing.assert_allclose(
        _flat(jax.tree_util.tree_map(lambda leaf: leaf[i], swept)), expected,
        rtol=1e-5, atol=1e-6)


def _vector_loss(params, example):
  return example['x'] @ params          # one value per output: not a loss


def _batch_loss(params, example):
  return jnp.mean((example['x'] @ params)[:, 0])   # indexes a batch axis


@pytest.mark.parametrize('make, call', [
    (clipping.clipped_grad_sum, lambda stat, b, p: stat(b, p)),
    (clipping.clipped_grad_difference_sum,
     lambda stat, b, p: stat(b, p, p, 2.0, 1.0)),
    (clipping.clipped_user_grad_sum,
     lambda stat, b, p: stat(jax.tree.map(lambda x: x[:, None], b), p)),
])
@pytest.mark.parametrize('method', ['auto', 'vmap', 'ghost'])
def test_a_loss_for_a_batch_gets_the_one_example_contract(make, call, method):
  params = jnp.zeros((4, 3))
  batch = {'x': jnp.ones((5, 4))}
  for loss, says in ((_vector_loss, 'returned shape (3,), not a scalar'),
                     (_batch_loss, 'failed with')):
    stat = make(loss, 1.0, clipping_method=method)
    for run in (lambda: call(stat, batch, params),
                lambda: jax.jit(lambda b, p: call(stat, b, p).sum)(batch,
                                                                    params)):
      with pytest.raises(ValueError) as caught:
        run()
      text = str(caught.value)
      assert text.startswith('loss_fn(params, example) computes the loss of '
                             'ONE example'), text
      assert says in text and "shapes {'x': (4,)}" in text, text


def test_rounding_never_lets_a_contribution_past_the_clip():
  """Rows whose exact norm is the clip to within float32 rounding.

  A float32 sum of squares may come out below the exact norm; the clip
  factor computed from it would then leave the row slightly above the clip.
  The norms are raised by their rounding bound (`rounding.upper_bound`), so
  in exact arithmetic every clipped row is at most the clip, and not by
  more than the margin below it.
  """
  rng = np.random.default_rng(11)
  rows = rng.normal(size=(64, 50_000))
  rows /= np.linalg.norm(rows, axis=1, keepdims=True)
  rows *= 1.0 + rng.uniform(-3e-7, 3e-7, size=(64, 1))
  rows = rows.astype(np.float32)
  clip = 1.0
  out = clipping.clipped_sum(lambda row: {'g': row * 1.0}, rows,
                                 l2_clip=clip)
  assert int(out.count) == 64
  # Each row alone, so the released sum IS the clipped row.
  singles = jax.vmap(lambda row: clipping.clipped_sum(
      lambda r: {'g': r * 1.0}, row[None], l2_clip=clip).sum['g'])(rows)
  norms = np.linalg.norm(np.asarray(singles, np.float64), axis=1)
  assert np.all(norms <= clip)
  assert np.all(norms >= clip * (1 - 1e-3))
