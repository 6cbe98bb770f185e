"""Private nonsmooth nonconvex optimization (paper 004): O2NC, the smoothed
estimators, the variance-reduced oracles, their privacy and their plans."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpsco_jax import batching
from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import plans
from dpsco_jax import smoothing
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms import nonsmooth


def robust_loss(params, example):
  """Absolute error of a linear model: 1-Lipschitz in w for ||x|| <= 1."""
  return jnp.abs(example['x'] @ params['w'] + params['b'] - example['y'])


def make_data(n=64, d=4, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d))
  x /= np.maximum(1.0, np.linalg.norm(x, axis=1, keepdims=True))
  return {'x': jnp.asarray(x, jnp.float32),
          'y': jnp.asarray(rng.normal(size=n), jnp.float32)}


def zero_params(d=4):
  return {'w': jnp.zeros((d,), jnp.float32), 'b': jnp.zeros((), jnp.float32)}


def slice_rows(data, start, size):
  return jax.tree_util.tree_map(lambda x: x[start:start + size], data)


def exact_gradient(objective):
  """A non-private oracle: the exact gradient of `objective` at the params."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.grad(objective)(params), state))


# ----------------------------------------------------------------- O2NC


def test_o2nc_with_the_exact_gradient_meets_proposition_2_6():
  # A smooth quadratic and its exact gradient (G_0 = 0): the mean over
  # blocks of ||grad f(block average)|| (the expectation over the uniform
  # output) is within Phi / (D T) + 3 G_1 / (2 sqrt(M)) at
  # eta = D / (G_1 sqrt(M)), and the blocks approach the stationary point.
  a = jnp.array([[3.0, 0.5], [0.5, 1.0]])
  objective = lambda p: 0.5 * p['x'] @ a @ p['x'] - jnp.sum(p['x'])
  gradient_norm = lambda p: jnp.linalg.norm(jax.grad(objective)(p)['x'])
  radius, block, steps = 0.005, 40, 3000
  g1 = math.sqrt(2.0)  # ||grad f|| at the start, the largest on the path
  tx = optax.chain(exact_gradient(objective), nonsmooth.o2nc(
      learning_rate=radius / (g1 * math.sqrt(block)), movement_radius=radius,
      block_length=block, key=0))

  def step(carry, _):
    # One O2NC step and what the assertions read of it (the whole run is
    # one compiled scan, not 3,000 dispatches and eager norms).
    params, state = carry
    updates, state = tx.update(None, state, params)
    seen = (gradient_norm(params), optax.tree.norm(updates),
            optax.tree.norm(state[1].delta), gradient_norm(state[1].last_block))
    return (optax.apply_updates(params, updates), state), seen

  @jax.jit
  def run(params):
    return jax.lax.scan(step, (params, tx.init(params)), length=steps)

  (_, state), seen = run({'x': jnp.zeros(2)})
  query_norms, update_norms, delta_norms, last_block_norms = map(np.asarray,
                                                                  seen)
  # ||z_{t+1} - z_t|| <= 2D and ||Delta|| <= D at every step.
  assert np.all(update_norms <= 2 * radius * (1 + 1e-5))
  assert np.all(delta_norms <= radius * (1 + 1e-5))
  block_norms = last_block_norms[block - 1::block]  # read as blocks complete
  assert query_norms.max() == pytest.approx(g1, rel=1e-5)
  gap = -float(objective({'x': jnp.linalg.solve(a, jnp.ones(2))}))
  bound = gap / (radius * steps) + 1.5 * g1 / math.sqrt(block)
  assert np.mean(block_norms) <= bound
  assert block_norms[-1] < 0.2 * g1
  assert len(block_norms) == steps // block == int(state[1].num_blocks)
  np.testing.assert_allclose(
      float(gradient_norm(nonsmooth.o2nc_output(state, 'last'))),
      block_norms[-1], rtol=1e-6)


def test_o2nc_first_query_point_is_the_start_and_output_needs_a_block():
  tx = nonsmooth.o2nc(learning_rate=0.1, movement_radius=1.0, block_length=3,
                      key=0)
  params = {'x': jnp.ones(2)}
  state = tx.init(params)
  updates, state = tx.update({'x': jnp.ones(2)}, state, params)
  # Delta_1 = 0: x_1 = x_0, and the next point lies on [x_1, x_1 + Delta_2].
  np.testing.assert_allclose(state.x_prev['x'], params['x'])
  with pytest.raises(ValueError, match='no block'):
    nonsmooth.o2nc_output(state)
  with pytest.raises(ValueError, match='consumes a gradient'):
    tx.update(None, state, params)


def test_o2nc_output_is_a_uniform_block_average():
  # Constant gradient: z moves along one line; count how often each of the
  # 4 block averages is the output over many keys. The key lives in the
  # state (o2nc(key=seed) stores jax.random.key(seed) there), so the 400
  # runs are one compiled program vmapped over the keys.
  tx = nonsmooth.o2nc(learning_rate=1.0, movement_radius=1.0, block_length=2,
                      key=0)

  @jax.jit
  @jax.vmap
  def run(key):
    params = {'x': jnp.zeros(1)}
    state = tx.init(params)._replace(key=key)
    points = []
    for _ in range(8):
      points.append(params['x'][0])
      updates, state = tx.update({'x': -jnp.ones(1)}, state, params)
      params = optax.apply_updates(params, updates)
    return jnp.stack(points), nonsmooth.o2nc_output(state)['x'][0]

  points, outputs = map(np.asarray, run(jax.vmap(jax.random.key)(
      jnp.arange(400))))
  averages = points.reshape(400, 4, 2).mean(axis=2)
  distances = np.abs(averages - outputs[:, None])
  assert np.all(distances.min(axis=1) < 1e-5)
  counts = np.bincount(np.argmin(distances, axis=1), minlength=4)
  # 100 expected each; 5 standard deviations is about 43.
  assert np.all(np.abs(counts - 100) < 43), counts


# ------------------------------------------------------------ estimators


def test_zero_order_estimate_is_exact_for_abs_in_one_dimension():
  # d = 1: the sphere is {-1, +1}, and (|x + a| - |x - a|) / (2a) = x / a is
  # the smoothed derivative of |x| for |x| < a, sign(x) beyond.
  loss = lambda p, e: jnp.abs(p['x'][0] - e)
  for x, expected in ((0.03, 0.3), (-0.05, -0.5), (0.4, 1.0)):
    g = smoothing.zero_order_estimate(loss, {'x': jnp.array([x])}, 0.0,
                                      jax.random.key(0), radius=0.1,
                                      num_directions=5)
    np.testing.assert_allclose(g['x'][0], expected, rtol=1e-5)


def test_zero_order_estimate_is_unbiased_on_a_quadratic():
  # For a quadratic f, f(x + a y) - f(x - a y) = 2 a grad f(x).y, and
  # E[d (g.y) y] = g on the sphere: the smoothed gradient is grad f.
  d = 6
  a = np.diag(np.arange(1.0, d + 1))
  loss = lambda p, e: 0.5 * p['x'] @ (a @ p['x']) + e @ p['x']
  x = jnp.linspace(-1, 1, d)
  e = jnp.ones(d)
  expected = a @ np.asarray(x) + 1.0
  g = smoothing.zero_order_estimate(loss, {'x': x}, e, jax.random.key(3),
                                    radius=0.2, num_directions=40_000)['x']
  # Each summand has covariance at most d |g|^2 / m per coordinate.
  tolerance = 5 * math.sqrt(d / 40_000) * np.linalg.norm(expected)
  assert np.linalg.norm(np.asarray(g) - expected) < tolerance


def test_first_order_estimate_matches_the_ball_smoothed_derivative():
  loss = lambda p, e: jnp.abs(p['x'][0])
  g = smoothing.first_order_estimate(loss, {'x': jnp.array([0.05])}, 0.0,
                                     jax.random.key(1), radius=0.1,
                                     num_directions=20_000)
  # f_a'(x) = x / a inside the interval: 0.5; binomial error 1/sqrt(m).
  assert abs(float(g['x'][0]) - 0.5) < 5 / math.sqrt(20_000)


def test_sphere_and_ball_samplers():
  like = {'a': jnp.zeros((3, 4)), 'b': jnp.zeros(5)}
  key = jax.random.key(0)
  y = smoothing.sphere_direction(key, like)
  assert abs(float(optax.tree.norm(y)) - 1.0) < 1e-6
  # One compiled program for the 20,000 draws (an unjitted vmap runs, and
  # compiles, op by op).
  points = jax.jit(jax.vmap(lambda k: jnp.concatenate([
      v.ravel() for v in jax.tree_util.tree_leaves(
          smoothing.ball_point(k, like, 2.0))])))(jax.random.split(key, 20_000))
  norms = np.linalg.norm(np.asarray(points), axis=1)
  assert norms.max() <= 2.0 + 1e-5
  # E[u u^T] = a^2 / (d + 2) I for the ball of radius a in d = 17.
  second = np.asarray(points).T @ np.asarray(points) / len(points)
  np.testing.assert_allclose(np.diag(second), 4.0 / 19, rtol=0.1)
  # P(||u|| <= a / 2) = 2^-d: almost never for d = 17.
  assert np.mean(norms < 1.0) < 1e-3


def test_clip_radii():
  assert smoothing.ball_smoothing_lipschitz(1) == pytest.approx(1.0)
  assert smoothing.ball_smoothing_lipschitz(2) == pytest.approx(4 / math.pi)
  for d in (3, 10, 1000):
    kappa = smoothing.ball_smoothing_lipschitz(d)
    assert math.sqrt(2 * d / math.pi) * 0.9 < kappa <= math.sqrt(d)
  worst = smoothing.worst_case_clips(order='zero', lipschitz=2.0,
                                     dimension=50)
  assert worst == (100.0, 200.0)
  clips = smoothing.effective_clips(
      order='zero', lipschitz=2.0, dimension=50, smoothing_radius=0.1,
      movement_radius=1e-4, num_directions=100_000, failure_probability=1e-6,
      num_estimates=1000)
  dev = 51 * 2.0 * math.sqrt(2 * math.log(2 * 1000 / 1e-6) / 100_000)
  assert clips.anchor == pytest.approx(2.0 + dev)
  assert clips.difference == pytest.approx(
      smoothing.ball_smoothing_lipschitz(50) * 2.0 * 2e-4 / 0.1 + 2 * dev)
  # Few directions: never more than the worst case.
  few = smoothing.effective_clips(
      order='zero', lipschitz=2.0, dimension=50, smoothing_radius=0.1,
      movement_radius=1e-4, num_directions=1, failure_probability=1e-6,
      num_estimates=1000)
  assert few == worst


def test_the_concentration_radius_holds_empirically():
  # Zero order, d = 8, L = 1 (|w.x| with ||x|| = 1): the deviation of the
  # estimate from the smoothed gradient stays within the radius at g = 0.01.
  d, m = 8, 64
  x = jnp.ones(d) / math.sqrt(d)
  loss = lambda p, e: jnp.abs(p['w'] @ x)
  w = {'w': jnp.full((d,), 3.0)}  # far from the kink: grad f_a = x exactly
  estimates = jax.jit(jax.vmap(lambda k: smoothing.zero_order_estimate(
      loss, w, 0.0, k, radius=0.1, num_directions=m)['w']))(
          jax.random.split(jax.random.key(0), 2000))
  deviations = np.linalg.norm(np.asarray(estimates) - np.asarray(x), axis=1)
  radius = smoothing.concentration_radius((d + 1) * 1.0, m, 0.01)
  assert np.mean(deviations > radius) <= 0.01


# --------------------------------------------------------------- oracles


def make_oracle(order='first', noise_multiplier=0.0, clips=(1.0, 0.5),
                period=3, num_steps=7, key=11, relation=None, **kwargs):
  extra = {} if relation is None else {'neighboring_relation': relation}
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', checks.NoPrivacyWarning)
    return nonsmooth.nonsmooth_vr_gradient(
        robust_loss, order=order, smoothing_radius=0.05, num_directions=4,
        clips=clips, period=period, anchor_batch_size=8, batch_size=4,
        noise_multiplier=noise_multiplier, num_steps=num_steps, key=key,
        **extra, **kwargs)


def batches_for(data, period, num_steps, anchor=8, small=4):
  out, start = [], 0
  for step in range(num_steps):
    size = anchor if step % period == 0 else small
    out.append(slice_rows(data, start, size))
    start += size
  return out


def query_points(num_steps, d=4, seed=5):
  rng = np.random.default_rng(seed)
  return [{'w': jnp.asarray(rng.normal(size=d) * 0.3, jnp.float32),
           'b': jnp.asarray(rng.normal() * 0.3, jnp.float32)}
          for _ in range(num_steps)]


@functools.lru_cache(maxsize=None)
def cached_oracle(order):
  """One noiseless oracle per order and its compiled step, shared by the
  tests below (the same key: runs on neighbouring data see the same
  directions, as the coupling in the sensitivity argument assumes)."""
  tx = make_oracle(order, period=3, num_steps=7)
  return tx, jax.jit(lambda p, s, b: tx.update(None, s, p, batch=b))


def run_oracle(tx, batches, points, step=None):
  state = tx.init(points[0])
  if step is None:
    step = jax.jit(lambda p, s, b: tx.update(None, s, p, batch=b))
  outputs, states = [], []
  for params, batch in zip(points, batches):
    out, state = step(params, state, batch)
    outputs.append(out)
    states.append(state)
  return outputs, states


def flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


@pytest.mark.parametrize('order', ['zero', 'first'])
def test_running_estimate_is_the_prefix_sum_and_resets_at_anchors(order):
  data = make_data()
  period, steps = 3, 7
  tx, step = cached_oracle(order)
  batches = batches_for(data, period, steps)
  points = query_points(steps)
  outputs, states = run_oracle(tx, batches, points, step)
  anchor_stat = smoothing.clipped_smoothed_grad_sum(
      robust_loss, 1.0, order=order, radius=0.05,
      num_directions=1 if order == 'first' else 4)
  diff_stat = smoothing.clipped_smoothed_difference_sum(
      robust_loss, 0.5, order=order, radius=0.05, num_directions=4)
  anchor_sum = jax.jit(lambda rows, p: anchor_stat(rows, p).sum)
  diff_sum = jax.jit(lambda rows, p, q: diff_stat(rows, p, q).sum)
  directions_key = states[0].directions_key
  running = None
  for t in range(steps):
    rows = smoothing.SmoothingBatch(batches[t], smoothing.example_keys(
        jax.random.fold_in(directions_key, t), len(batches[t]['y'])))
    if t % period == 0:
      running = flat(anchor_sum(rows, points[t])) / 8
    else:
      running = running + flat(diff_sum(rows, points[t], points[t - 1])) / 4
    np.testing.assert_allclose(flat(states[t].estimate), running, rtol=1e-5,
                               atol=1e-6)
    # Without noise the output is the clean estimate.
    np.testing.assert_allclose(flat(outputs[t]), running, rtol=1e-5,
                               atol=1e-6)


def test_tree_noise_is_fresh_in_every_period_and_covers_the_last_step():
  # A constant loss: every increment is 0, the output is the noise alone.
  constant = lambda p, e: 0.0 * jnp.sum(p['w'])
  period, steps = 4, 12
  tx = nonsmooth.nonsmooth_vr_gradient(
      constant, order='first', smoothing_radius=0.05, num_directions=1,
      clips=(1.0, 1.0), period=period, anchor_batch_size=8, batch_size=4,
      noise_multiplier=1.0, num_steps=steps, key=3)
  data = make_data()
  outputs, _ = run_oracle(tx, batches_for(data, period, steps),
                          query_points(steps))
  noise = np.stack([flat(o) for o in outputs])
  # Every position of every period has noise, the last included (the
  # paper's TREE(t mod Sigma) adds none there).
  assert np.all(np.linalg.norm(noise, axis=1) > 0)
  # No period repeats another period's noise at any position.
  for p in range(period):
    rows = noise[p::period]
    for i in range(len(rows)):
      for j in range(i + 1, len(rows)):
        assert not np.allclose(rows[i], rows[j])
  # The noise is the period's own tree (fresh key per period) scaled by
  # s = replace-one max(C1/B1, C2/B2).
  s = 2 * max(1.0 / 8, 1.0 / 4)
  tree = nonsmooth.nonsmooth_mechanism(steps, period)
  state = tree.init(zero_params(), jax.random.fold_in(jax.random.key(3), 0))
  draws = []
  for _ in range(steps):
    n, state = tree.next(state, zero_params())
    draws.append(flat(n))
  np.testing.assert_allclose(noise, s * np.stack(draws), rtol=1e-5, atol=1e-6)
  # That mechanism is one tree per period: a release mixes only its own
  # period's nodes, the anchor's is one node and position p has popcount(p).
  decoder = np.asarray(tree.decoder_matrix())
  for t in range(steps):
    support = set(np.flatnonzero(decoder[t]))
    assert len(support) == bin(t % period + 1).count('1')
    for u in range(steps):
      if u // period != t // period:
        assert not support & set(np.flatnonzero(decoder[u]))


@pytest.mark.parametrize('order', ['zero', 'first'])
def test_one_changed_example_moves_each_increment_by_at_most_s(order):
  # Replace-one: the changed example is far away, NaN, Inf or huge, in an
  # anchor batch (step 0) or a difference batch (step 1); every released
  # increment moves by at most 2 C_1 / B_1 or 2 C_2 / B_2 at that step, and
  # not at all at the others (the queries are held fixed: the lemma's
  # "conditioned on g_{t-1} = g'_{t-1}").
  data = make_data()
  period, steps = 3, 6
  batches = batches_for(data, period, steps)
  points = query_points(steps)
  tx, step = cached_oracle(order)
  clean, _ = run_oracle(tx, batches, points, step)
  for replacement in (1e3, np.nan, np.inf, 3e38):
    for changed_step in (0, 1):
      changed = list(batches)
      changed[changed_step] = {
          'x': batches[changed_step]['x'].at[0].set(replacement),
          'y': batches[changed_step]['y'].at[0].set(-replacement)}
      other, _ = run_oracle(tx, changed, points, step)
      sensitivity = 2 * (1.0 / 8 if changed_step == 0 else 0.5 / 4)
      for t in range(steps):
        increment = flat(other[t]) - flat(clean[t]) - (
            0 if t % period == 0 else flat(other[t - 1]) - flat(clean[t - 1]))
        bound = sensitivity if t == changed_step else 0.0
        assert np.linalg.norm(increment) <= bound * (1 + 1e-5) + 1e-6, (
            replacement, t, np.linalg.norm(increment))
      if changed_step == 0:
        # The change is visible: the test compares runs that differ. (A
        # difference of this piecewise-linear loss between two close points
        # is often exactly 0, before and after the change.)
        assert np.linalg.norm(flat(other[0]) - flat(clean[0])) > 1e-4


def test_the_noise_is_scaled_to_the_larger_increment_sensitivity():
  for clips, expected in (((1.0, 0.5), 2 * 0.5 / 4), ((4.0, 0.1), 2 * 4.0 / 8)):
    shape = nonsmooth._oracle_shape(  # pylint: disable=protected-access
        robust_loss, order='first', smoothing_radius=0.1, num_directions=2,
        anchor_directions=None, clips=clips, period=3, anchor_batch_size=8,
        batch_size=4, microbatch_size=None)
    assert max(nonsmooth.increment_sensitivities(
        shape, nonsmooth.Relation.REPLACE_ONE)) == pytest.approx(expected)


@functools.lru_cache(maxsize=None)
def noisy_oracle():
  """A noisy oracle (3 steps accounted, an anchor every 2nd) and its
  compiled step raising its refusals, shared by the refusal tests below."""
  tx = make_oracle(noise_multiplier=1.0, period=2, num_steps=3)
  return tx, guards.library_errors(jax.jit(
      lambda p, s, b: tx.update(None, s, p, batch=b)))


def test_steps_past_the_calibrated_number_are_refused():
  data = make_data()
  tx, step = noisy_oracle()
  batches = batches_for(data, 2, 4)
  points = query_points(4)
  state = tx.init(points[0])
  for t in range(3):
    _, state = step(points[t], state, batches[t])
  with pytest.raises(ValueError, match='past|capacity|steps'):
    step(points[3], state, batches[3])


def test_a_batch_of_the_wrong_size_is_refused():
  # A difference-sized batch (4) at the anchor step (accounted for 8).
  data = make_data()
  tx, step = noisy_oracle()
  params = zero_params()
  state = tx.init(params)
  with pytest.raises(guards.PrivacyGuardError, match='accounted for 8'):
    step(params, state, slice_rows(data, 0, 4))


def test_bad_input_is_a_clear_error():
  with pytest.raises(ValueError, match="order must be 'zero' or 'first'"):
    make_oracle('second')
  with pytest.raises(ValueError, match='smoothing radius'):
    smoothing.clipped_smoothed_grad_sum(robust_loss, 1.0, order='zero',
                                        radius=-1.0, num_directions=3)
  with pytest.raises(ValueError, match='num_directions'):
    smoothing.clipped_smoothed_grad_sum(robust_loss, 1.0, order='zero',
                                        radius=0.1, num_directions=0)
  with pytest.raises(ValueError, match='l2_clip'):
    make_oracle(clips=(0.0, 1.0))
  with pytest.raises(ValueError, match='SmoothingBatch'):
    smoothing.clipped_smoothed_grad_sum(
        robust_loss, 1.0, order='zero', radius=0.1, num_directions=1)(
            make_data(), zero_params())
  with pytest.raises(ValueError, match='dimension d = 9'):
    make_oracle(dimension=9).init(zero_params())
  with pytest.raises(ValueError, match='ONE example'):
    tx = nonsmooth.nonsmooth_vr_gradient(
        lambda p, e: robust_loss(p, e)[None] * jnp.ones(2),
        order='first', smoothing_radius=0.05, num_directions=1,
        clips=(1.0, 1.0), period=2, anchor_batch_size=8, batch_size=4,
        noise_multiplier=1.0, num_steps=4)
    tx.update(None, tx.init(zero_params()), zero_params(),
              batch=slice_rows(make_data(), 0, 8))
  with pytest.raises(ValueError, match='alpha <= Phi / L'):
    nonsmooth.nonsmooth_preset('3.1', num_examples=100, dimension=3,
                               epsilon=1.0, delta=1e-6, lipschitz=1.0,
                               initial_gap=0.1, smoothing_radius=1.0)
  with pytest.raises(ValueError, match='target_norm'):
    nonsmooth.nonsmooth_preset('4.1', num_examples=100, dimension=3,
                               epsilon=1.0, delta=1e-6, lipschitz=1.0,
                               initial_gap=1.0, smoothing_radius=0.1)


# ------------------------------------------------------------------ plans


def single_pass_plan(**overrides):
  args = dict(order='first', num_examples=400, dimension=5, lipschitz=1.0,
              smoothing_radius=0.1, movement_radius=0.01, learning_rate=0.05,
              block_length=4, period=4, anchor_batch_size=20, batch_size=5,
              num_directions=3, epsilon=2.0, delta=1e-6, seed=0)
  args.update(overrides)
  return plans.nonsmooth_single_pass(robust_loss, **args)


@functools.lru_cache(maxsize=None)
def default_single_pass():
  """`single_pass_plan()` and its compiled step, shared by the tests below
  (one calibration, one compile per batch shape)."""
  plan = single_pass_plan()
  return plan, jax.jit(
      lambda p, s, i: plan.transformation.update(None, s, p, **i))


def test_single_pass_plan_runs_once_over_the_data_and_meets_its_target():
  plan, step = default_single_pass()
  sampler = plan.batches
  assert plan.num_steps == sampler.num_steps
  assert sampler.examples_used(plan.num_steps) <= 400
  seen = np.concatenate(list(sampler))
  assert len(seen) == len(np.unique(seen))  # a single pass
  assert plan.epsilon <= 2.0 * (1 + 1e-9)
  hyper = plan.hyperparameters
  assert hyper['mechanism_delta'] == pytest.approx(5e-7)
  # The clip-event budget: (1 + e^eps) g = delta / 2.
  assert (1 + math.exp(plan.epsilon)) * hyper['failure_probability'] == (
      pytest.approx(5e-7))
  data = make_data(400, 4)
  params = zero_params()
  state = plan.init(params)
  for inputs in plan.batches_of(data):
    updates, state = step(params, state, inputs)
    params = optax.apply_updates(params, updates)
  out = nonsmooth.o2nc_output(state)
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(out))


def test_single_pass_plan_refuses_a_reused_example():
  plan, compiled = default_single_pass()
  data = make_data(400, 4)
  params = zero_params()
  state = plan.init(params)
  inputs = list(plan.batches_of(data))
  step = guards.library_errors(compiled)
  _, state = step(params, state, inputs[0])
  reused = dict(inputs[1])
  reused['example_ids'] = np.concatenate([inputs[0]['example_ids'][:1],
                                          inputs[1]['example_ids'][1:]])
  with pytest.raises(ValueError, match='earlier batch'):
    step(params, state, reused)


def test_worst_case_clips_spend_all_of_delta_and_need_more_noise_per_unit():
  effective = single_pass_plan(order='zero', num_directions=20_000)
  worst = single_pass_plan(order='zero', num_directions=20_000,
                           sensitivity='worst_case')
  assert worst.hyperparameters['mechanism_delta'] == 1e-6
  assert worst.hyperparameters['clips'] == {'anchor': 5.0, 'difference': 10.0}
  e_clips = effective.hyperparameters['clips']
  assert e_clips['anchor'] < 5.0 and e_clips['difference'] < 10.0
  with pytest.raises(ValueError, match='sensitivity must be'):
    single_pass_plan(sensitivity='none')


def test_single_pass_sampler_refuses_more_steps_than_the_data_allow():
  with pytest.raises(ValueError, match='never reuses'):
    batching.AnchoredSinglePass(100, 20, 5, 4, seed=0, num_steps=40)
  sampler = batching.AnchoredSinglePass(100, 20, 5, 4, seed=0)
  assert sampler.num_steps == 11  # 3 anchors (60) + 8 differences (40)
  resumed = list(sampler.iterate(start_step=5))
  np.testing.assert_array_equal(resumed[0], sampler.batch_at(5))


def test_multi_pass_plan_composes_anchor_and_difference_gaussians():
  plan = plans.nonsmooth_multi_pass(
      robust_loss, order='zero', num_examples=32, num_steps=12, dimension=5,
      lipschitz=1.0, smoothing_radius=0.1, movement_radius=0.01,
      learning_rate=0.05, block_length=3, period=4, num_directions=5,
      epsilon=3.0, delta=1e-6)
  z = plan.noise_multiplier
  assert plan.epsilon <= 3.0 * (1 + 1e-6)
  assert z.restart < z.difference  # 3 anchors, 9 differences
  assert plan.epsilon_at(4) < plan.epsilon
  data = make_data(32, 4)
  params = zero_params()
  state = plan.init(params)
  # One compiled step, raising its refusals: the 13th step is refused by
  # the same program that ran the 12 accounted ones.
  step = guards.library_errors(jax.jit(
      lambda p, s: plan.transformation.update(None, s, p, batch=data)))
  for _ in range(12):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
  with pytest.raises(ValueError, match='past|capacity|steps'):
    step(params, state)


def test_multi_pass_recursion_is_on_the_noisy_output():
  data = make_data(16, 4)
  tx = nonsmooth.nonsmooth_multipass_gradient(
      robust_loss, order='first', smoothing_radius=0.05, num_directions=2,
      clips=(1.0, 0.5), period=3, num_examples=16,
      noise_multipliers=diff2.Diff2NoiseMultipliers(2.0, 3.0), num_steps=3,
      key=2)
  points = query_points(3)
  state = tx.init(points[0])
  step = jax.jit(lambda p, s: tx.update(None, s, p, batch=data))
  out0, state = step(points[0], state)
  out1, state1 = step(points[1], state)
  # The state keeps the released (noisy) estimate, and the next release is
  # it plus a fresh increment and fresh noise.
  np.testing.assert_allclose(flat(state.estimate), flat(out0), rtol=1e-6)
  np.testing.assert_allclose(flat(state1.estimate), flat(out1), rtol=1e-6)
  assert np.linalg.norm(flat(out1) - flat(out0)) > 0


def test_presets_follow_the_theorems():
  p = nonsmooth.nonsmooth_preset(
      '6.1', num_examples=10_000, dimension=20, epsilon=1.0, delta=1e-6,
      lipschitz=1.0, initial_gap=1.0, smoothing_radius=0.1)
  assert p.num_steps == 5000 and p.anchor_batch_size == p.period
  assert p.batch_size == 1
  assert p.block_length == max(1, math.floor(0.1 / (4 * p.movement_radius)))
  zero = nonsmooth.nonsmooth_preset(
      '3.1', num_examples=10_000, dimension=20, epsilon=1.0, delta=1e-6,
      lipschitz=1.0, initial_gap=1.0, smoothing_radius=0.1)
  # Remark 6.2: the first-order oracle needs far fewer directions.
  assert zero.num_directions > 20 ** 2 * p.num_directions
  erm = nonsmooth.nonsmooth_preset(
      '4.1', num_examples=10_000, dimension=20, epsilon=1.0, delta=1e-6,
      lipschitz=1.0, initial_gap=1.0, smoothing_radius=0.1, target_norm=0.5)
  # Dimension-consistent reading: D = alpha beta^2 / L^2, T = Phi L^2 /
  # (alpha beta^3), so D T = Phi / beta.
  assert erm.movement_radius * erm.num_steps == pytest.approx(2.0, rel=0.05)


def test_difference_uses_independent_directions_at_the_two_points():
  # Algorithms 3-5 draw the directions j <= m at z_t and j > m at z_{t-1}:
  # at z_t = z_{t-1} the difference is then not zero (shared directions
  # would cancel exactly).
  stat = smoothing.clipped_smoothed_difference_sum(
      robust_loss, 100.0, order='zero', radius=0.1, num_directions=3)
  data = make_data(4)
  rows = smoothing.SmoothingBatch(
      data, smoothing.example_keys(jax.random.key(0), 4))
  params = query_points(1)[0]
  difference = jax.jit(lambda r, p: stat(r, p, p).sum)(rows, params)
  assert np.linalg.norm(flat(difference)) > 1e-3


def test_proposition_2_6_step_comes_from_the_calibrated_noise():
  plan = single_pass_plan(learning_rate='proposition_2_6',
                          learning_rate_scale=3.0)
  hyper = plan.hyperparameters
  # G_0 by hand: the tree's prefix noise, 1 + ceil(log2 4) = 3 nodes of std
  # z * 2 C / B (replace-one) for the larger of the two increments.
  clips = hyper['clips']
  stddev = plan.noise_multiplier * 2 * max(clips['anchor'] / 20,
                                           clips['difference'] / 5)
  noise = stddev * math.sqrt(5 * 3)
  assert hyper['released_noise_norm'] == pytest.approx(noise)
  assert hyper['learning_rate'] == pytest.approx(
      3.0 * 0.01 / ((1.0 + noise) * math.sqrt(4)))
  # A given number is used as given.
  given, _ = default_single_pass()  # learning_rate=0.05
  assert given.hyperparameters['learning_rate'] == 0.05
  # Given noise multipliers (the calibrated ones are
  # test_multi_pass_plan_composes_anchor_and_difference_gaussians'): G_0
  # comes from whichever z the plan runs with.
  multi = plans.nonsmooth_multi_pass(
      robust_loss, order='first', num_examples=32, num_steps=8, dimension=5,
      lipschitz=1.0, smoothing_radius=0.1, movement_radius=0.01,
      learning_rate='proposition_2_6', block_length=2, period=4,
      num_directions=2, noise_multipliers=(2.0, 3.0), delta=1e-6)
  z, mclips = multi.noise_multiplier, multi.hyperparameters['clips']
  multi_noise = 2 * max(z.restart * mclips['anchor'],
                        z.difference * mclips['difference']) / 32 * math.sqrt(5)
  assert multi.hyperparameters['released_noise_norm'] == pytest.approx(
      multi_noise)


@pytest.mark.parametrize('overrides, match', [
    (dict(learning_rate='auto'), 'a number or'),
    (dict(learning_rate=0.05, learning_rate_scale=2.0), 'scales learning_rate'),
    (dict(learning_rate='proposition_2_6', learning_rate_scale=0.0),
     'scale'),
])
def test_bad_learning_rates_are_refused(overrides, match):
  with pytest.raises(ValueError, match=match):
    single_pass_plan(**overrides)
