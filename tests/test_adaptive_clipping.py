"""Adaptive clipping (Andrew et al. 2021) and automatic clipping (Bu et al. 2023).

Written the way a user writes a model: a flax module and an optax loss.
"""

import itertools

import dp_accounting
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import adaptive_clipping
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax import physical

Relation = neighboring.NeighboringRelation
BATCH = 64
FEATURES = 6


class Classifier(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


MODEL = Classifier()


def loss_fn(params, example):
  logits = MODEL.apply(params, example['x'])
  return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         example['y'])


@pytest.fixture(scope='module')
def data():
  rng = np.random.default_rng(0)
  # Rows of very different scales: per-example gradient norms spread over
  # two orders of magnitude.
  scales = np.geomspace(0.05, 20.0, BATCH)[:, None]
  x = (rng.normal(size=(BATCH, FEATURES)) * scales).astype(np.float32)
  y = rng.integers(0, 3, size=BATCH).astype(np.int32)
  # One compiled init instead of an eager program per layer op.
  params = jax.jit(MODEL.init)(jax.random.key(0), x[0])
  return params, {'x': jnp.asarray(x), 'y': jnp.asarray(y)}


@jax.jit
def gradient_norms(params, batch):
  grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, batch)
  squares = sum(jnp.sum(g.reshape(BATCH, -1) ** 2, axis=1)
                for g in jax.tree_util.tree_leaves(grads))
  return jnp.sqrt(squares)


def adaptive_tx(noise_multiplier=1.0, clipping_method='vmap', key=1,
                **config):
  return estimators.noisy_gradient(
      loss_fn, l2_clip=0.01, noise_multiplier=noise_multiplier,
      mechanism=noise.gaussian(400), key=key, normalize_by=BATCH,
      clipping_method=clipping_method,
      adaptive_clipping=adaptive_clipping.AdaptiveClipping(**config))


def run(tx, params, batch, steps):
  """The states of `steps` steps on one batch (one compiled scan)."""

  def step(state, _):
    updates, state = tx.update(None, state, params, batch=batch)
    return state, (state.adaptive.clip, updates)

  return jax.jit(lambda s: jax.lax.scan(step, s, None, length=steps))(
      tx.init(params))


# ------------------------------------------------------------ the budget


def test_sum_and_count_form_one_gaussian_of_the_total_multiplier():
  """z_sum and z_b compose to z exactly: 1/z^2 = 1/z_sum^2 + 1/z_b^2."""
  for z, stddev in [(0.8, 3.2), (1.1, 12.8), (4.0, 51.2)]:
    for relation in (Relation.ADD_OR_REMOVE, Relation.REPLACE_ONE):
      z_b = adaptive_clipping.count_noise_multiplier(stddev, relation)
      z_sum = adaptive_clipping.sum_noise_multiplier(z, z_b)
      assert z_sum > z
      np.testing.assert_allclose(z_sum ** -2 + z_b ** -2, z ** -2,
                                 rtol=1e-12)
  # The count's sensitivity: 1/2 under add/remove, 1 under replace-one.
  assert adaptive_clipping.count_noise_multiplier(
      12.8, Relation.ADD_OR_REMOVE) == 25.6
  assert adaptive_clipping.count_noise_multiplier(
      12.8, Relation.REPLACE_ONE) == 12.8


def test_the_two_releases_composed_independently_spend_what_z_spends():
  """An independent composition (dp_accounting's PLD of the two Gaussian
  releases of every step, T steps, no amplification) gives the epsilon of
  one Gaussian of multiplier z over T steps: the ledger's one event."""
  # A count noise large enough to matter (z_b = 4, z_sum = 2.31).
  z, steps, delta = 2.0, 10, 1e-5
  z_b = adaptive_clipping.count_noise_multiplier(
      adaptive_clipping.count_stddev(
          adaptive_clipping.AdaptiveClipping(count_stddev=2.0), 256),
      Relation.ADD_OR_REMOVE)
  z_sum = adaptive_clipping.sum_noise_multiplier(z, z_b)

  def epsilon(event):
    accountant = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=1e-3)
    accountant.compose(event)
    return accountant.get_epsilon(delta)

  separate = dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(z_sum),
       dp_accounting.GaussianDpEvent(z_b)]), steps)
  joint = dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(z), steps)
  np.testing.assert_allclose(epsilon(separate), epsilon(joint), rtol=2e-3)
  # Without the split (the sum noised at z, the count on top), more is spent.
  unsplit = dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(z),
       dp_accounting.GaussianDpEvent(z_b)]), steps)
  assert epsilon(unsplit) > 1.05 * epsilon(joint)


def test_a_count_noise_that_would_spend_the_whole_budget_is_refused():
  with pytest.raises(ValueError, match='larger count_stddev'):
    adaptive_tx(noise_multiplier=5.0, count_stddev=2.0)
  with pytest.raises(ValueError, match='count must be noised'):
    adaptive_tx(count_stddev=0.0)
  with pytest.raises(ValueError, match='target_quantile'):
    adaptive_tx(target_quantile=1.0)
  with pytest.raises(ValueError, match='normalize_by'):
    estimators.noisy_gradient(
        loss_fn, l2_clip=1.0, noise_multiplier=1.0,
        mechanism=noise.gaussian(10), key=2,
        adaptive_clipping=adaptive_clipping.AdaptiveClipping())


def test_correlated_noise_is_refused():
  with pytest.raises(ValueError, match='independently each step'):
    estimators.noisy_gradient(
        loss_fn, l2_clip=1.0, noise_multiplier=1.0,
        mechanism=noise.tree(16), key=3, normalize_by=BATCH,
        adaptive_clipping=adaptive_clipping.AdaptiveClipping())


# -------------------------------------------------------- the algorithm


@pytest.fixture(scope='module')
def trajectory(data):
  params, batch = data
  _, (clips, updates) = run(adaptive_tx(), params, batch, 300)
  return np.asarray(clips), updates


def test_the_clip_moves_to_the_target_quantile_of_the_norms(data, trajectory):
  params, batch = data
  norms = np.asarray(gradient_norms(params, batch))
  clips, _ = trajectory
  assert clips[0] != 0.01 and np.all(np.isfinite(clips))
  # From 0.01 the geometric update climbs by about e^0.1 per step, then
  # hovers around the median (the noisy fraction has std 0.05).
  final = np.mean(clips[-100:])
  assert np.quantile(norms, 0.4) < final < np.quantile(norms, 0.6), (
      final, np.quantile(norms, [0.4, 0.5, 0.6]))
  fraction = np.mean(norms <= final)
  assert abs(fraction - 0.5) < 0.1


def test_a_higher_quantile_gives_a_higher_clip(data, trajectory):
  params, batch = data
  _, (clips, _) = run(adaptive_tx(target_quantile=0.9), params, batch, 300)
  norms = np.asarray(gradient_norms(params, batch))
  final = np.mean(np.asarray(clips)[-100:])
  assert final > np.quantile(norms, 0.8)
  assert final > 2 * np.mean(trajectory[0][-100:])


def test_the_count_is_released_with_its_noise(data):
  """The fraction a step releases varies with std sigma_b / m around the
  true one; released without noise it would not vary at all."""
  params, batch = data
  config = adaptive_clipping.AdaptiveClipping()
  clipped = jax.jit(clipping.clipped_grad_sum(
      loss_fn, 0.5, clipping_method='vmap'))(batch, params)

  @jax.jit
  def fractions(keys):
    def one(key):
      fraction, _ = adaptive_clipping.unclipped_fraction(
          clipped, adaptive_clipping.init(0.5, key),
          stddev=adaptive_clipping.count_stddev(config, BATCH),
          batch_size=BATCH)
      return fraction
    return jax.vmap(one)(keys)

  released = np.asarray(fractions(jax.random.split(jax.random.key(5), 2000)))
  true = (int(clipped.count) - int(clipped.num_clipped)) / BATCH
  np.testing.assert_allclose(np.mean(released), true, atol=0.005)
  np.testing.assert_allclose(np.std(released), 0.05, rtol=0.06)


def test_the_sum_is_noised_at_z_sum_times_the_current_clip(data):
  """On parameters whose gradients are zero the released value is the noise
  alone: its std is z_sum * C_t / m at every step, at the clip the step
  used (noise at the initial clip, or at z instead of z_sum, would be a
  privacy bug)."""
  params, _ = data
  zero_params = jax.tree_util.tree_map(jnp.zeros_like, params)
  batch = {'x': jnp.zeros((BATCH, FEATURES)), 'y': jnp.zeros(BATCH, jnp.int32)}
  z, count_stddev = 2.0, 1.2
  tx = adaptive_tx(noise_multiplier=z, key=7, count_stddev=count_stddev)

  def step(state, _):
    clip = state.adaptive.clip
    updates, state = tx.update(None, state, zero_params, batch=batch)
    # Zero inputs and weights: every gradient but the output bias's is zero
    # (flax names the output layer, built first, Dense_0).
    output, hidden = updates['params']['Dense_0'], updates['params']['Dense_1']
    pure = jnp.concatenate([output['kernel'].ravel(),
                            hidden['kernel'].ravel(), hidden['bias']])
    return state, (clip, pure / clip)

  _, (clips, scaled) = jax.jit(lambda s: jax.lax.scan(
      step, s, None, length=30))(tx.init(zero_params))
  clips = np.asarray(clips)
  # The output bias's gradients are all clipped: the clip climbs, so the
  # steps use clips far from the initial one.
  assert clips[-1] > 3 * clips[0]
  z_b = adaptive_clipping.count_noise_multiplier(count_stddev,
                                                 Relation.ADD_OR_REMOVE)
  z_sum = adaptive_clipping.sum_noise_multiplier(z, z_b)
  assert z_sum > 1.5 * z   # a z-for-z_sum mistake would show
  np.testing.assert_allclose(np.std(np.asarray(scaled)), z_sum / BATCH,
                             rtol=0.06)


# -------------------------------------------------------- every path


def test_ghost_and_vmap_paths_adapt_alike(data):
  params, batch = data
  _, (vmap_clips, vmap_updates) = run(adaptive_tx(key=11), params, batch, 20)
  _, (ghost_clips, ghost_updates) = run(
      adaptive_tx(key=11, clipping_method='ghost'), params, batch, 20)
  np.testing.assert_allclose(ghost_clips, vmap_clips, rtol=1e-4)
  for g, v in zip(jax.tree_util.tree_leaves(ghost_updates),
                  jax.tree_util.tree_leaves(vmap_updates)):
    np.testing.assert_allclose(g, v, rtol=1e-3, atol=1e-5)


def test_devices_adapt_like_one_device(data):
  """Under shard_map over 4 devices, the counts are summed over the devices
  before the noise: the same clips and updates as one device."""
  params, batch = data
  devices = jax.devices()[:4]
  if len(devices) < 4:
    pytest.skip('needs 4 devices')
  mesh = jax.sharding.Mesh(np.array(devices), ('d',))
  tx_one = adaptive_tx(key=13)
  tx_sharded = estimators.noisy_gradient(
      loss_fn, l2_clip=0.01, noise_multiplier=1.0,
      mechanism=noise.gaussian(400), key=13, normalize_by=BATCH,
      clipping_method='vmap', axis_name='d',
      adaptive_clipping=adaptive_clipping.AdaptiveClipping())
  spec = jax.sharding.PartitionSpec
  sharded_update = jax.jit(jax.shard_map(
      lambda s, b: tx_sharded.update(None, s, params, batch=b),
      mesh=mesh, in_specs=(spec(), spec('d')), out_specs=spec()))
  one_update = jax.jit(lambda s, b: tx_one.update(None, s, params, batch=b))
  state_one, state_sharded = tx_one.init(params), tx_sharded.init(params)
  for _ in range(5):
    out_one, state_one = one_update(state_one, batch)
    out_sharded, state_sharded = sharded_update(state_sharded, batch)
  np.testing.assert_allclose(state_sharded.adaptive.clip,
                             state_one.adaptive.clip, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(out_sharded),
                  jax.tree_util.tree_leaves(out_one)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_physical_batches_clip_at_the_state_clip(data):
  """A logical step run as physical batches equals the one-call step: each
  physical batch is clipped at the clip in the state, not the initial one."""
  params, batch = data
  tx = adaptive_tx(key=17)
  statistic = clipping.clipped_grad_sum(loss_fn, 0.01, clipping_method='vmap')
  logical = physical.LogicalStep(
      tx, physical.statistic_form(statistic, physical_batch_size=16))
  one_call = jax.jit(lambda s: tx.update(None, s, params, batch=batch))
  params_out = params
  state_one, state_physical = tx.init(params), tx.init(params)
  inputs = {'batch': jax.tree_util.tree_map(np.asarray, batch)}
  for _ in range(4):
    updates, state_one = one_call(state_one)
    params_out, state_physical = logical(params, state_physical, inputs)
  np.testing.assert_allclose(state_physical.adaptive.clip,
                             state_one.adaptive.clip, rtol=1e-5)
  expected = optax.apply_updates(params, updates)
  for a, b in zip(jax.tree_util.tree_leaves(params_out),
                  jax.tree_util.tree_leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_refused_step_releases_no_clip(data):
  """Past the mechanism's capacity the step is refused: the clip is NaN
  (nothing derived from the unaccounted count is released), and stays so."""
  params, batch = data
  tx = estimators.noisy_gradient(
      loss_fn, l2_clip=0.5, noise_multiplier=1.0,
      mechanism=noise.gaussian(2), key=19, normalize_by=BATCH,
      clipping_method='vmap',
      adaptive_clipping=adaptive_clipping.AdaptiveClipping())
  update = jax.jit(lambda s: tx.update(None, s, params, batch=batch))
  state = tx.init(params)
  for _ in range(2):
    _, state = update(state)
  assert np.isfinite(float(state.adaptive.clip))
  _, state = update(state)
  assert np.isnan(float(state.adaptive.clip))
  _, state = update(state)
  assert np.isnan(float(state.adaptive.clip))


# ------------------------------------------------------ automatic clipping


@pytest.mark.parametrize('clipping_method', ['vmap', 'ghost'])
def test_automatic_clipping_scales_each_gradient_by_c_over_norm_plus_r(
    data, clipping_method):
  params, batch = data
  r, clip = 0.01, 2.0
  out = jax.jit(clipping.clipped_grad_sum(
      loss_fn, clip, clipping_method=clipping_method,
      automatic_clipping=r))(batch, params)
  grads = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))(params,
                                                                  batch)
  norms = gradient_norms(params, batch)
  expected = jax.tree_util.tree_map(
      lambda g: jnp.einsum('b,b...->...', clip / (norms + r), g), grads)
  for a, b in zip(jax.tree_util.tree_leaves(out.sum),
                  jax.tree_util.tree_leaves(expected)):
    # The clip is held 2.1e-4 below C (the batch sum's rounding bound).
    np.testing.assert_allclose(a, b, rtol=5e-4, atol=1e-6)


def test_automatic_clipping_never_exceeds_the_clip():
  """Whatever a contribution (huge, tiny, zero, NaN), its scaled norm is
  below C, so the sensitivity is the clipping's; r = 0 (normalization) is
  finite on a zero gradient."""
  values = jnp.asarray([[1e30, 0.0], [3.0, 4.0], [1e-36, 0.0], [0.0, 0.0],
                        [jnp.nan, 1.0], [1e-12, 1e-12]], jnp.float32)
  for r in (0.0, 1e-6, 0.5):
    for clip in (1e-3, 1.0, 1e3):
      for row in range(values.shape[0]):
        out = clipping.clipped_sum(
            lambda unit: {'g': unit}, values[row:row + 1], l2_clip=clip,
            automatic_clipping=r)
        norm = float(jnp.linalg.norm(out.sum['g']))
        assert np.isfinite(norm)
        assert norm <= clip, (r, clip, row, norm)
  # r = 0 normalizes: a gradient well above the floor comes out at norm C.
  out = clipping.clipped_sum(lambda unit: {'g': unit}, values[1:2],
                             l2_clip=1.0, automatic_clipping=0.0)
  np.testing.assert_allclose(jnp.linalg.norm(out.sum['g']), 1.0, rtol=1e-3)


def test_automatic_clipping_rejects_a_bad_stability_constant():
  for bad in (-1.0, float('nan'), float('inf'), 'big'):
    with pytest.raises(ValueError, match='automatic_clipping'):
      clipping.clipped_grad_sum(loss_fn, 1.0, automatic_clipping=bad)


def test_automatic_clipping_trains_through_dpsgd(data):
  params, batch = data
  tx = optax.chain(
      estimators.noisy_gradient(
          loss_fn, l2_clip=1.0, noise_multiplier=0.5,
          mechanism=noise.gaussian(50), key=23, normalize_by=BATCH,
          automatic_clipping=0.01),
      optax.sgd(0.5))
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  mean_loss = lambda p: jnp.mean(jax.vmap(loss_fn, (None, 0))(p, batch))
  before = float(mean_loss(params))
  for _ in range(40):
    params, state = step(params, state)
  assert float(mean_loss(params)) < before


# ------------------------------------------------------------- the audit


def _released_fractions(num_runs, with_canary, seed):
  """One adaptive step per run; the score is the released fraction read
  back from the clip it publishes (b~ = gamma - log(C_1 / C_0) / eta)."""
  loss = lambda params, example: jnp.vdot(params['w'], example['x'])
  rows = jnp.full((16, 4), 10.0)            # gradients x: all clipped at 1
  if with_canary:                           # a zero gradient: unclipped
    rows = jnp.concatenate([rows, jnp.zeros((1, 4))])
  config = adaptive_clipping.AdaptiveClipping(count_stddev=2.0)
  params = {'w': jnp.zeros(4)}

  def one_run(key):
    tx = estimators.noisy_gradient(
        loss, l2_clip=1.0, noise_multiplier=2.0, mechanism=noise.gaussian(1),
        key=key, normalize_by=16, clipping_method='vmap',
        adaptive_clipping=config)
    _, state = tx.update(None, tx.init(params), params, batch={'x': rows})
    return (config.target_quantile -
            jnp.log(state.adaptive.clip) / config.learning_rate)

  return np.asarray(jax.jit(jax.vmap(one_run))(
      jax.random.split(jax.random.key(seed), num_runs)))


def _audited_epsilon(num_runs=3000):
  from dpsco_jax import audit  # pylint: disable=g-import-not-at-top
  return audit.epsilon_lower_bound(
      _released_fractions(num_runs, True, 1),
      _released_fractions(num_runs, False, 2), delta=1e-5,
      thresholds=np.linspace(-0.2, 0.6, 33)).epsilon


def test_the_auditor_bounds_the_released_clip_and_catches_a_noiseless_count(
    monkeypatch):
  """The step is accounted as one Gaussian of multiplier 2 (epsilon 2.3 at
  delta 1e-5); the clip it publishes must not reveal more. With the count
  released without its noise (a planted bug) the clip tells whether the
  canary was there."""
  accountant = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=1e-3)
  accountant.compose(dp_accounting.GaussianDpEvent(2.0))
  claimed = accountant.get_epsilon(1e-5)
  assert _audited_epsilon() <= claimed
  noiseless = adaptive_clipping.unclipped_fraction
  monkeypatch.setattr(
      adaptive_clipping, 'unclipped_fraction',
      lambda clipped, state, *, stddev, **kw: noiseless(
          clipped, state, stddev=0.0, **kw))
  assert _audited_epsilon() > claimed


# ----------------------------------------------------------------- plans


def _plan(**kw):
  from dpsco_jax import plans  # pylint: disable=g-import-not-at-top
  return plans.dpsgd(loss_fn, optimizer=optax.sgd(0.1), num_examples=BATCH,
                     batch_size=16, epochs=2, l2_clip=0.05, delta=1e-5,
                     noise_multiplier=1.0, seed=3, key=29,
                     clipping_method='vmap', **kw)


def test_a_plan_with_adaptive_clipping_spends_what_the_fixed_clip_plan_does(
    data):
  params, batch = data
  config = adaptive_clipping.AdaptiveClipping(target_quantile=0.7)
  with pytest.warns(Warning):   # the key given twice in this process
    fixed, adaptive = _plan(), _plan(adaptive_clipping=config)
  assert adaptive.epsilon == fixed.epsilon
  assert adaptive.event == fixed.event
  record = adaptive.describe()['hyperparameters']
  assert record['adaptive_clipping']['target_quantile'] == 0.7
  assert 'adaptive_clipping' not in fixed.describe()['hyperparameters']
  state = adaptive.init(params)
  for inputs in itertools.islice(adaptive.batches_of(batch), 3):
    params_out, state = adaptive.step(params, state, inputs)
  adaptive.finish(state)
  clip = float(adaptive_clipping.current_clip(state))
  assert np.isfinite(clip) and clip != pytest.approx(0.05)


def test_a_plan_of_physical_batches_adapts_like_the_one_call_plan(data):
  params, batch = data
  config = adaptive_clipping.AdaptiveClipping()
  with pytest.warns(Warning):
    one_call = _plan(adaptive_clipping=config)
    split = _plan(adaptive_clipping=config, physical_batch_size=8)
  states = [plan.init(params) for plan in (one_call, split)]
  for inputs in itertools.islice(one_call.batches_of(batch), 3):
    out_one, states[0] = one_call.step(params, states[0], inputs)
    out_split, states[1] = split.step(params, states[1], inputs)
  np.testing.assert_allclose(adaptive_clipping.current_clip(states[1]),
                             adaptive_clipping.current_clip(states[0]),
                             rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(out_split),
                  jax.tree_util.tree_leaves(out_one)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_plans_offer_each_choice_where_its_accounting_holds():
  from dpsco_jax import plans  # pylint: disable=g-import-not-at-top
  common = dict(optimizer=optax.sgd(0.1), num_examples=BATCH, batch_size=16,
                epochs=1, l2_clip=1.0, delta=1e-5, noise_multiplier=1.0)
  # Correlated noise: no adaptive clipping (not the accounted mechanism).
  with pytest.raises(TypeError, match='adaptive_clipping'):
    plans.dpftrl(loss_fn, adaptive_clipping=adaptive_clipping.
                 AdaptiveClipping(), **common)
  plan = plans.dpftrl(loss_fn, automatic_clipping=0.01, **common)
  assert plan.describe()['hyperparameters']['automatic_clipping'] == 0.01
  with pytest.raises(ValueError, match='automatic_clipping'):
    plans.dpsgd(loss_fn, automatic_clipping=-1.0, **common)


def test_user_level_statistics_adapt_too(data):
  params, batch = data
  users = clipping.UserBatch(
      jax.tree_util.tree_map(lambda x: x.reshape((16, 4) + x.shape[1:]),
                             batch), None)
  tx = estimators.noisy_statistic(
      clipping.clipped_user_grad_sum(loss_fn, 0.01, clipping_method='vmap'),
      noise_multiplier=1.0, mechanism=noise.gaussian(50), key=31,
      normalize_by=16,
      adaptive_clipping=adaptive_clipping.AdaptiveClipping())
  update = jax.jit(lambda s: tx.update(None, s, params, batch=users))
  state = tx.init(params)
  for _ in range(20):
    _, state = update(state)
  # Users' mean gradients are far above 0.01: the clip grows.
  assert float(state.adaptive.clip) > 0.05
