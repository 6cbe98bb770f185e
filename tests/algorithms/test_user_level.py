"""User-level DP-SGD: users as the privacy unit, end to end."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import clipping
from dpsco_jax import plans


def _loss(params, item):
  return 0.5 * (item['x'] @ params - item['y']) ** 2


def _examples(n, dim=3, seed=0):
  rng = np.random.default_rng(seed)
  return {'x': rng.normal(size=(n, dim)).astype(np.float32),
          'y': rng.normal(size=n).astype(np.float32)}


def test_group_by_user_truncates_pads_and_masks():
  data = {'x': np.arange(7.0)[:, None], 'y': np.arange(7.0)}
  users = batching.group_by_user(data, np.array([1, 0, 1, 1, 2, 1, 0]),
                                 max_items=3)
  np.testing.assert_array_equal(users.item_mask, [[1, 1, 0], [1, 1, 1],
                                                  [1, 0, 0]])
  # User 1 keeps its FIRST three examples in data order (0, 2, 3), not 5.
  np.testing.assert_array_equal(users.items['y'][1], [0.0, 2.0, 3.0])
  np.testing.assert_array_equal(users.items['y'][0][:2], [1.0, 6.0])
  with pytest.raises(ValueError, match='max_items'):
    batching.group_by_user(data, np.zeros(7, int), max_items=0)
  with pytest.raises(ValueError, match='own no example'):
    batching.group_by_user(data, np.array([0, 0, 2, 2, 2, 2, 2]),
                           max_items=2)
  with pytest.raises(ValueError, match=r'in \[0, 2\)'):
    batching.group_by_user(data, np.array([0, 1, 2, 0, 1, 0, 1]),
                           max_items=2, num_users=2)


def test_one_item_per_user_is_dpsgd():
  data = _examples(8)
  params = jnp.ones(3)
  users = batching.group_by_user(data, np.arange(8), max_items=1)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    user_tx = dpsco_jax.user_level_dpsgd(_loss, l2_clip=0.5,
                                         noise_multiplier=1.3, num_steps=2,
                                         key=9)
    example_tx = dpsco_jax.dpsgd(_loss, l2_clip=0.5, noise_multiplier=1.3,
                                 num_steps=2, key=9)
  user_out, _ = user_tx.update(None, user_tx.init(params), params,
                               batch=users)
  example_out, _ = example_tx.update(None, example_tx.init(params), params,
                                     batch=data)
  np.testing.assert_allclose(user_out, example_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('method', ['ghost', 'vmap'])
@pytest.mark.parametrize('replacement', ['huge', 'nan', 'inf', 'many'])
def test_replacing_one_users_whole_data_moves_the_sum_by_at_most_the_clip(
    method, replacement):
  data = _examples(20)
  users = batching.group_by_user(data, np.arange(20) % 5, max_items=4)
  params = jnp.ones(3)
  stat = clipping.clipped_user_grad_sum(_loss, 0.7,
                                       clipping_method=method)
  before = stat(users, params).sum
  items = jax.tree.map(np.array, users.items)
  mask = np.array(users.item_mask)
  if replacement == 'huge':
    items['x'][2] = 1e6
  elif replacement == 'nan':
    items['x'][2, 0] = np.nan     # a NaN user is dropped, not propagated
  elif replacement == 'inf':
    items['y'][2] = np.inf
  else:
    mask[2] = True                # all m items, of large values
    items['x'][2] = 50.0
  after = stat(clipping.UserBatch(items, mask), params).sum
  moved = float(jnp.linalg.norm(after - before))
  # Replace-one: the old contribution leaves, the new one enters (2 C).
  bound = stat.sensitivity(dpsco_jax.NeighboringRelation.REPLACE_ONE)
  assert bound == pytest.approx(1.4)
  assert np.isfinite(moved) and moved <= bound * (1 + 1e-5), moved
  # Add/remove: the user's whole data leaves the batch (C).
  removed = stat(clipping.UserBatch(items, mask), params,
                 mask=np.arange(5) != 2).sum
  assert float(jnp.linalg.norm(after - removed)) <= 0.7 * (1 + 1e-5)


def test_the_plan_accounts_users_not_examples():
  data = _examples(300)
  users = batching.group_by_user(data, np.arange(300) % 60, max_items=5)
  plan = plans.user_level_dpsgd(_loss, optimizer=optax.sgd(0.1),
                                num_users=60, users_per_batch=6, epochs=2,
                                l2_clip=1.0, epsilon=2.0, delta=1e-5,
                                seed=4)
  assert plan.participation == accounting.PoissonSampling(0.1, 20)
  assert plan.epsilon == pytest.approx(accounting.epsilon_spent(
      dpsco_jax.user_level_dpsgd_mechanism(20), plan.noise_multiplier,
      accounting.PoissonSampling(6 / 60, 20), 1e-5), rel=1e-9)
  params = jnp.zeros(3)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    state = plan.init(params)
  step = jax.jit(lambda s, p, inputs: plan.transformation.update(
      None, s, p, **inputs))
  taken = 0
  for inputs in plan.batches_of(users):
    ids = inputs['example_ids'][inputs['batch_mask']]
    # User ids, each at most once (a Poisson batch may also be empty).
    assert np.all(ids < 60) and len(set(ids.tolist())) == len(ids)
    updates, state = step(state, params, inputs)
    params = optax.apply_updates(params, updates)
    taken += 1
  assert taken == plan.num_steps == 20 and np.all(np.isfinite(params))
  # Feeding the examples instead of the users is refused by the guard.
  with pytest.raises(ValueError, match='num_examples = 60'):
    next(plan.batches_of(data))


def test_bad_input_is_a_clear_error():
  with pytest.raises(ValueError, match='num_steps'):
    dpsco_jax.user_level_dpsgd(_loss, l2_clip=1.0, noise_multiplier=1.0,
                               num_steps=None)
  with pytest.raises(ValueError, match='exceeds num_examples'):
    plans.user_level_dpsgd(_loss, optimizer=optax.sgd(0.1), num_users=5,
                           users_per_batch=6, epochs=1, l2_clip=1.0,
                           epsilon=1.0, delta=1e-5)
