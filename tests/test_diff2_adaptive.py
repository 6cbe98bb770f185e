"""Adaptive clipping of DIFF2's difference clip C_2 (and of DP-GD's C_1).

Andrew et al. 2021 (Algorithm 1) applied to paper 003's Algorithm 1: the
difference rounds release a noisy count of unclipped differences besides
the noisy sum, the two one Gaussian of the accounted z_2; restart rounds
release no count and leave C_2 alone. Written the way a user writes a
model: a flax module and an optax loss, one client (clients are a vmap
axis where a test is about them).
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
from dpsco_jax import checks
from dpsco_jax import estimators
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax import physical
from dpsco_jax import plans
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms import srg

Relation = neighboring.NeighboringRelation
N = 48
FEATURES = 4
ROUNDS = 8

pytestmark = pytest.mark.filterwarnings(
    # Tests give fixed integer keys, some more than once.
    'ignore::dpsco_jax.keys.KeyReuseWarning')


class Regressor(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(x)[..., 0]


MODEL = Regressor()


def loss_fn(params, example):
  return optax.l2_loss(MODEL.apply(params, example['x']), example['y'])


@pytest.fixture(scope='module')
def data():
  rng = np.random.default_rng(0)
  # Rows of different scales: difference norms spread over a decade.
  scales = np.geomspace(0.3, 3.0, N)[:, None]
  x = (rng.normal(size=(N, FEATURES)) * scales).astype(np.float32)
  y = (x @ rng.normal(size=FEATURES)).astype(np.float32)
  # One compiled init instead of an eager program per layer op.
  params = jax.jit(MODEL.init)(jax.random.key(0), x[0])
  return params, {'x': jnp.asarray(x), 'y': jnp.asarray(y)}


def estimator(key=1, restart_interval=3, num_rounds=ROUNDS, z=(1.0, 1.0),
              diff_clip_factor=0.2, **config):
  return diff2.diff2_estimator(
      loss_fn, grad_clip=1.0, diff_clip_factor=diff_clip_factor,
      restart_interval=restart_interval, num_rounds=num_rounds,
      noise_multipliers=diff2.Diff2NoiseMultipliers(*z), key=key,
      clipping_method='vmap',
      adaptive_clipping=adaptive_clipping.AdaptiveClipping(
          **{'count_stddev': 2.0, **config}))


def gd(tx, learning_rate=0.1):
  return optax.chain(tx, optax.sgd(learning_rate))


def trajectory(tx, params, batch, rounds):
  """Each round's clip (before it) and params, the final state (one scan)."""

  def step(carry, _):
    params, state = carry
    clip = state[0].adaptive.clip
    updates, state = tx.update(None, state, params, batch=batch)
    return (optax.apply_updates(params, updates), state), (clip, params)

  return jax.jit(lambda p, s: jax.lax.scan(step, (p, s), None,
                                           length=rounds))(params,
                                                           tx.init(params))


@pytest.fixture(scope='module')
def run(data):
  """Eight rounds of DIFF2-GD, T = 3 (restarts at rounds 0, 3, 6)."""
  params, batch = data
  tx = gd(estimator(key=3))
  (_, state), (clips, _) = trajectory(tx, params, batch, ROUNDS)
  return np.asarray(clips), state


# ------------------------------------------------------------ the budget


def test_the_plan_spends_what_an_independent_composition_of_its_releases_does():
  """Each difference round is two Gaussian releases (the sum at z_sum, the
  count at z_b); composed independently with the restarts (dp_accounting
  PLD) they spend the plan's epsilon, the fixed-clip plan's, one event."""
  z, rounds, interval, n = (1.5, 2.0), 12, 4, 200
  config = adaptive_clipping.AdaptiveClipping(count_stddev=3.0)
  common = dict(learning_rate=0.1, num_rounds=rounds,
                restart_interval=interval, grad_clip=1.0,
                diff_clip_factor=0.5, num_examples=n, delta=1e-5,
                noise_multipliers=z, key=5, clipping_method='vmap')
  fixed = plans.diff2_gd(loss_fn, **common)
  adaptive = plans.diff2_gd(loss_fn, adaptive_clipping=config, **common)
  assert adaptive.epsilon == fixed.epsilon
  assert str(adaptive.event) == str(fixed.event)
  z_b = adaptive_clipping.count_noise_multiplier(3.0, Relation.REPLACE_ONE)
  z_sum = adaptive_clipping.sum_noise_multiplier(z[1], z_b)
  assert z_sum > 1.3 * z[1]   # the count's share is not negligible
  restarts = -(-rounds // interval)

  def epsilon(difference_round):
    accountant = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=1e-3)
    accountant.compose(dp_accounting.GaussianDpEvent(z[0]), restarts)
    accountant.compose(difference_round, rounds - restarts)
    return accountant.get_epsilon(1e-5)

  separate = epsilon(dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(z_sum),
       dp_accounting.GaussianDpEvent(z_b)]))
  np.testing.assert_allclose(separate, adaptive.epsilon, rtol=5e-3)
  # The sum left at z_2 with the count on top would spend more.
  unsplit = epsilon(dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(z[1]),
       dp_accounting.GaussianDpEvent(z_b)]))
  assert unsplit > 1.05 * adaptive.epsilon


def test_the_count_sensitivity_is_one_under_replace_one_and_zero_out():
  """A zeroed-out example has contribution 0, never clipped: its bit can
  flip from 0 to 1, a change of 1 (not 1/2) in the centered count."""
  assert adaptive_clipping.count_noise_multiplier(
      2.0, Relation.ZERO_OUT) == 2.0
  assert adaptive_clipping.count_noise_multiplier(
      2.0, Relation.REPLACE_ONE) == 2.0
  assert adaptive_clipping.count_noise_multiplier(
      2.0, Relation.ADD_OR_REMOVE) == 4.0


def test_a_count_noise_that_would_spend_the_budget_is_refused():
  with pytest.raises(ValueError, match='larger count_stddev'):
    estimator(z=(1.0, 3.0), count_stddev=2.0)
  with pytest.raises(ValueError, match='count_stddev='):
    estimator(count_stddev=None)
  with pytest.raises(ValueError, match='target_quantile'):
    estimator(target_quantile=0.0)
  # DP-GD adapts C_1: z_b must exceed z_1 there.
  with pytest.raises(ValueError, match='larger count_stddev'):
    diff2.dp_gd(loss_fn, learning_rate=0.1, grad_clip=1.0,
                noise_multiplier=3.0, num_rounds=4, key=1,
                adaptive_clipping=adaptive_clipping.AdaptiveClipping(
                    count_stddev=2.0))


# ------------------------------------------------------------- the noise

# The silent rounds' multipliers, count noise and clip learning rate, and
# the state's C_2, far from the initial 0.2.
SILENT_Z = (1.5, 2.0)
SILENT_COUNT_STDDEV = 2.4
SILENT_RATE = 0.2
SILENT_CLIP = 3.7


@pytest.fixture(scope='module')
def silent():
  """Rounds whose clipped statistic is exactly zero (inputs and the bias
  zero, so every per-example gradient and difference is zero, and the
  released value is the noise alone), run for 2000 noise and count keys by
  one compiled function: `release(round_index, previous)` gives the
  released values and the next clips. The iterate moved by `movement`."""
  x = jnp.zeros((N, FEATURES))
  batch = {'x': x, 'y': jnp.zeros((N,))}
  params = jax.tree_util.tree_map(jnp.zeros_like,
                                  MODEL.init(jax.random.key(1), x[0]))
  params['params']['Dense_0']['kernel'] = jnp.full((FEATURES, 1), 0.5)
  previous = jax.tree_util.tree_map(lambda p: p, params)
  previous['params']['Dense_0']['kernel'] = jnp.full((FEATURES, 1), 0.25)
  tx = estimator(key=7, z=SILENT_Z, count_stddev=SILENT_COUNT_STDDEV,
                 learning_rate=SILENT_RATE)
  keys = jax.random.split(jax.random.key(11), 2000)

  @jax.jit
  def released(round_index, previous):
    state = tx.init(params)
    state = state._replace(
        count=round_index, prev_params=previous,
        adaptive=state.adaptive._replace(clip=jnp.float32(SILENT_CLIP)))

    def one(key):
      noise_key, count_key = jax.random.split(key)
      v, new_state = tx.update(None, state._replace(
          noise=state.noise._replace(key=noise_key),
          adaptive=state.adaptive._replace(key=count_key)), params,
                               batch=batch)
      return v, new_state.adaptive.clip

    return jax.vmap(one)(keys)

  def release(round_index, previous_params):
    values, clips = released(jnp.int32(round_index), previous_params)
    return (np.concatenate([np.ravel(leaf) for leaf in
                            jax.tree_util.tree_leaves(values)]),
            np.asarray(clips))

  return release, params, previous, 0.25 * FEATURES ** 0.5


@pytest.fixture(scope='module')
def difference_round(silent):
  release, _, previous, _ = silent
  return release(1, previous)


def test_difference_rounds_noise_the_sum_at_z_sum_times_the_current_clip(
    silent, difference_round):
  """Std of the increment: movement * z_sum * 2 C_2,t / n (replace-one);
  z_2 for z_sum, or the initial clip for the current one, would show."""
  movement = silent[3]
  released, _ = difference_round
  z_sum = adaptive_clipping.sum_noise_multiplier(
      SILENT_Z[1], adaptive_clipping.count_noise_multiplier(
          SILENT_COUNT_STDDEV, Relation.REPLACE_ONE))
  assert z_sum > 1.5 * SILENT_Z[1]
  np.testing.assert_allclose(np.std(released),
                             movement * z_sum * 2 * SILENT_CLIP / N,
                             rtol=0.05)


def test_the_count_is_released_with_its_noise(difference_round):
  """All differences are zero (unclipped): the fraction read back from the
  clip's geometric step is 1 + noise of std sigma_b / n; released without
  its noise it would not vary."""
  _, clips = difference_round
  fraction = 0.5 - np.log(clips / SILENT_CLIP) / SILENT_RATE
  np.testing.assert_allclose(np.mean(fraction), 1.0, atol=0.005)
  np.testing.assert_allclose(np.std(fraction), SILENT_COUNT_STDDEV / N,
                             rtol=0.06)


def test_restart_rounds_are_the_plain_accounted_gaussian(silent):
  """A restart's release is the C_1-clipped mean plus z_1 * 2 C_1 / n
  noise whatever C_2 is now: no share of it spent on a count; C_2 stays."""
  release, params, _, _ = silent
  released, clips = release(3, params)
  np.testing.assert_allclose(np.std(released), SILENT_Z[0] * 2 * 1.0 / N,
                             rtol=0.05)
  np.testing.assert_array_equal(clips, np.float32(SILENT_CLIP))


# -------------------------------------------------------- the clip moves


def test_restart_rounds_leave_the_clip_and_difference_rounds_move_it(run):
  clips, state = run
  final = float(state[0].adaptive.clip)
  after = np.append(clips[1:], final)
  restarts = np.arange(ROUNDS) % 3 == 0
  np.testing.assert_array_equal(after[restarts], clips[restarts])
  assert np.all(after[~restarts] != clips[~restarts])
  # The initial C_2 clips most differences: the clip grows.
  assert final > 1.2 * clips[0]


def test_the_clip_converges_to_the_target_quantile_of_the_difference_norms():
  """On a quadratic with per-example curvature a_i, the difference of two
  gradients over the movement has norm a_i whatever the direction: the
  clip settles at the target quantile of the a_i (noise small: n large)."""
  n, rounds = 400, 60
  curvature = np.geomspace(0.25, 4.0, n).astype(np.float32)
  rng = np.random.default_rng(3)
  batch = {'a': jnp.asarray(rng.permutation(curvature)),
           'c': jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)}

  def quadratic(params, example):
    return 0.5 * example['a'] * jnp.sum((params['w'] - example['c']) ** 2)

  params = {'w': jnp.zeros(3)}
  results = {}
  for quantile in (0.5, 0.8):
    tx = gd(diff2.diff2_estimator(
        quadratic, grad_clip=10.0, diff_clip_factor=0.1,
        restart_interval=20, num_rounds=rounds,
        noise_multipliers=diff2.Diff2NoiseMultipliers(1.0, 1.0), key=17,
        clipping_method='vmap',
        adaptive_clipping=adaptive_clipping.AdaptiveClipping(
            target_quantile=quantile, learning_rate=0.5,
            count_stddev=0.01 * n)), learning_rate=0.05)
    (_, state), _ = trajectory(tx, params, batch, rounds)
    results[quantile] = float(state[0].adaptive.clip)
  for quantile, clip in results.items():
    np.testing.assert_allclose(clip, np.quantile(curvature, quantile),
                               rtol=0.15)


def test_dp_gd_adapts_c1_every_round(data):
  params, batch = data
  tx = diff2.dp_gd(loss_fn, learning_rate=0.1, grad_clip=0.01,
                   noise_multiplier=1.0, num_rounds=6, key=19,
                   clipping_method='vmap',
                   adaptive_clipping=adaptive_clipping.AdaptiveClipping(
                       count_stddev=2.0))
  (_, state), (clips, _) = trajectory(tx, params, batch, 6)
  clips = np.append(np.asarray(clips), float(state[0].adaptive.clip))
  # All gradients clipped at 0.01: the clip climbs every round.
  assert np.all(np.diff(clips) > 0)


def test_a_refused_round_releases_no_clip(data):
  """Past num_rounds the round is refused: the clip is NaN from then on."""
  params, batch = data
  tx = estimator(key=23, num_rounds=2)
  update = jax.jit(lambda s: tx.update(None, s, params, batch=batch))
  state = tx.init(params)
  for _ in range(2):
    _, state = update(state)
  assert np.isfinite(float(state.adaptive.clip))
  for _ in range(2):
    _, state = update(state)
    assert np.isnan(float(state.adaptive.clip))


# ------------------------------------------------------------ every path


def test_physical_batches_adapt_like_the_one_call_step(data):
  """Four rounds (restart, difference, restart, difference) run as
  physical batches of 16: each clipped at the state's C_2 (and the
  restart's a = C_2 / C_1 at it), the same as one call."""
  params, batch = data
  tx = gd(estimator(key=29, restart_interval=2, diff_clip_factor=0.05,
                    count_stddev=1.0, z=(0.5, 0.5), learning_rate=1.0))
  form = diff2.diff2_physical_form(
      loss_fn, grad_clip=1.0, diff_clip_factor=0.05, restart_interval=2,
      physical_batch_size=16, clipping_method='vmap',
      state_of=lambda opt_state: opt_state[0])
  logical = physical.LogicalStep(tx, form)

  @jax.jit
  def one_call(params, state):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  inputs = {'batch': jax.tree_util.tree_map(np.asarray, batch)}
  one = split = params
  one_state = split_state = tx.init(params)
  for _ in range(4):
    one, one_state = one_call(one, one_state)
    split, split_state = logical(split, split_state, inputs)
  assert float(one_state[0].adaptive.clip) > 1.5 * 0.05   # it moved
  np.testing.assert_allclose(split_state[0].adaptive.clip,
                             one_state[0].adaptive.clip, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(split),
                  jax.tree_util.tree_leaves(one)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_clients_count_together_like_one_client_with_their_data(data):
  """Two clients of n/2 examples (a vmap axis) release what one client of
  n does: the counts are summed over clients before their one noise draw
  and divided by all the clients' examples."""
  params, batch = data
  tx_one = gd(estimator(key=31))
  tx_clients = gd(diff2.diff2_estimator(
      loss_fn, grad_clip=1.0, diff_clip_factor=0.2, restart_interval=3,
      num_rounds=ROUNDS, noise_multipliers=diff2.Diff2NoiseMultipliers(
          1.0, 1.0), key=31, clipping_method='vmap', axis_name='clients',
      adaptive_clipping=adaptive_clipping.AdaptiveClipping(count_stddev=2.0)))
  halves = jax.tree_util.tree_map(
      lambda x: x.reshape((2, N // 2) + x.shape[1:]), batch)

  def client_step(params, state, local):
    updates, state = tx_clients.update(None, state, params, batch=local)
    return optax.apply_updates(params, updates), state

  step_clients = jax.jit(jax.vmap(client_step, in_axes=(None, None, 0),
                                  out_axes=None, axis_name='clients'))
  step_one = jax.jit(lambda p, s: (
      lambda u: (optax.apply_updates(p, u[0]), u[1]))(
          tx_one.update(None, s, p, batch=batch)))
  one = two = params
  one_state, two_state = tx_one.init(params), tx_clients.init(params)
  for _ in range(4):
    one, one_state = step_one(one, one_state)
    two, two_state = step_clients(two, two_state, halves)
  assert float(one_state[0].adaptive.clip) != pytest.approx(0.2)
  np.testing.assert_allclose(two_state[0].adaptive.clip,
                             one_state[0].adaptive.clip, rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(two),
                  jax.tree_util.tree_leaves(one)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------- plans


def _plan(**kw):
  return plans.diff2_gd(loss_fn, learning_rate=0.1, num_rounds=6,
                        restart_interval=3, grad_clip=1.0,
                        diff_clip_factor=0.2, num_examples=N, delta=1e-5,
                        noise_multipliers=(1.0, 1.0), key=37,
                        clipping_method='vmap', **kw)


def test_the_plan_records_and_runs_adaptive_clipping(data):
  params, batch = data
  config = adaptive_clipping.AdaptiveClipping(target_quantile=0.7)
  fixed, adaptive = _plan(), _plan(adaptive_clipping=config)
  record = adaptive.describe()['hyperparameters']['adaptive_clipping']
  assert record['target_quantile'] == 0.7
  # The count's default noise: 0.05 x all clients' examples.
  assert record['count_stddev'] == pytest.approx(0.05 * N)
  assert 'adaptive_clipping' not in fixed.describe()['hyperparameters']
  state = adaptive.init(params)
  for _ in range(3):
    params, state = adaptive.step(params, state, {'batch': batch})
  adaptive.finish(state)
  clip = float(adaptive_clipping.current_clip(state))
  assert np.isfinite(clip) and clip != pytest.approx(0.2)


def test_dp_gd_plan_offers_it_with_the_same_epsilon():
  common = dict(learning_rate=0.1, num_rounds=4, grad_clip=1.0,
                num_examples=N, delta=1e-5, noise_multiplier=1.0, key=41)
  fixed = plans.dp_gd(loss_fn, **common)
  adaptive = plans.dp_gd(loss_fn, adaptive_clipping=adaptive_clipping.
                         AdaptiveClipping(), **common)
  assert adaptive.epsilon == fixed.epsilon
  assert 'adaptive_clipping' in adaptive.describe()['hyperparameters']


def test_correlated_noise_families_refuse_adaptive_clipping():
  """SRG (tree noise) and the nonsmooth plans (tree-mechanism oracle) take
  no adaptive_clipping=, and their noise is refused by the check every
  adaptive estimator runs: the count's independent noise would not be part
  of the mechanism accounted for."""
  common = dict(num_examples=N, batch_size=8, l2_clip=1.0, delta=1e-5,
                noise_multiplier=1.0, key=0, seed=0, beta=10.0, radius=None)
  config = adaptive_clipping.AdaptiveClipping()
  with pytest.raises(TypeError, match='adaptive_clipping'):
    plans.accelerated_dp_srgd(loss_fn, adaptive_clipping=config, **common)
  with pytest.raises(ValueError, match='independently each step'):
    adaptive_clipping.check_mechanism(srg.srg_mechanism(8))
  nonsmooth = dict(order='first', num_examples=N, dimension=FEATURES + 1,
                   lipschitz=1.0, smoothing_radius=0.1, movement_radius=0.01,
                   learning_rate=0.05, block_length=2, period=2,
                   anchor_batch_size=8, batch_size=4, num_directions=2,
                   noise_multiplier=1.0, num_steps=4, delta=1e-6, key=0,
                   seed=0)
  with pytest.raises(TypeError, match='adaptive_clipping'):
    plans.nonsmooth_single_pass(loss_fn, adaptive_clipping=config,
                                **nonsmooth)
  plan = plans.nonsmooth_single_pass(loss_fn, **nonsmooth)
  with pytest.raises(ValueError, match='independently each step'):
    adaptive_clipping.check_mechanism(plan.mechanism)
  # Through the estimator that takes the option: the same refusal.
  with pytest.raises(ValueError, match='independently each step'):
    estimators.noisy_gradient(
        loss_fn, l2_clip=1.0, noise_multiplier=1.0,
        mechanism=srg.srg_mechanism(8), key=0, normalize_by=8,
        adaptive_clipping=config)


def test_bvr_local_sgd_adapts_the_server_clip_only(data):
  """DIFF2-BVR-L-SGD: the server's difference rounds move C_2, its
  restarts do not; the local steps keep their fixed C_3 and release no
  count. A client too small for its local minibatch is refused, the clip
  with it."""
  params, batch = data
  config = adaptive_clipping.AdaptiveClipping(count_stddev=2.0)
  common = dict(learning_rate=0.05, grad_clip=1.0, diff_clip_factor=0.2,
                restart_interval=2, num_rounds=4,
                noise_multipliers=diff2.Diff2NoiseMultipliers(1.0, 1.0, 1.0),
                local_steps=2, clipping_method='vmap',
                adaptive_clipping=config)
  tx = diff2.diff2_bvr_local_sgd(loss_fn, key=43, local_batch_size=8,
                                 **common)

  @jax.jit
  def step(params, state, mask):
    updates, state = tx.update(None, state, params, batch=batch,
                               batch_mask=mask)
    return optax.apply_updates(params, updates), state

  every_row = jnp.ones((N,), bool)
  state = tx.init(params)
  clips = [float(state.server.adaptive.clip)]
  for _ in range(4):
    params, state = step(params, state, every_row)
    clips.append(float(state.server.adaptive.clip))
  clips = np.asarray(clips)
  np.testing.assert_array_equal(clips[[1, 3]], clips[[0, 2]])  # restarts
  assert np.all(clips[[2, 4]] != clips[[1, 3]])                 # differences
  few_rows = jnp.arange(N) < 4    # 4 real rows, minibatches of 8
  _, state = step(params, tx.init(params), few_rows)
  assert np.isnan(float(state.server.adaptive.clip))
