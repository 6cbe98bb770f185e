"""DIFF2 across clients: reductions, sensitivity, clients as devices or vmap.

Clients are simulated with `jax.vmap(..., axis_name='clients')` unless a test
is about devices (8 virtual CPU devices from tests/conftest.py). Client data
are padded to a common size with junk (NaN) rows and a mask, so every test
also checks that padding never leaks into the per-client means.
"""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy import stats

import dpsco_jax
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms.diff2 import Diff2NoiseMultipliers

AXIS = 'clients'
# A refusal inside a compiled step arrives from a host callback.
REFUSED = (ValueError, jax.errors.JaxRuntimeError)
SIZES = (5, 8, 6)


def loss_fn(params, example):
  """Squared loss of a 3-4-1 softplus network (smooth and nonconvex)."""
  hidden = jax.nn.softplus(example['x'] @ params['w1'] + params['b1'])
  return 0.5 * (hidden @ params['w2'] + params['b2'] - example['y']) ** 2


@jax.jit
def mean_gradient(params, x, y):
  """Mean over rows of the per-example gradients (a non-private reference)."""
  grads = jax.vmap(jax.grad(loss_fn), (None, 0))(params, {'x': x, 'y': y})
  return jax.tree_util.tree_map(lambda g: jnp.mean(g, 0), grads)


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  return {'w1': jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
          'b1': jnp.asarray(rng.normal(size=(4,)) * 0.1, jnp.float32),
          'w2': jnp.asarray(rng.normal(size=(4,)), jnp.float32),
          'b2': jnp.zeros((), jnp.float32)}


def make_clients(sizes=SIZES, pad_to=None, seed=1):
  """Per-client data (lists) and the stacked, NaN-padded batch with mask."""
  rng = np.random.default_rng(seed)
  clients = [{'x': rng.normal(size=(n, 3)).astype(np.float32) * 2,
              'y': rng.normal(size=(n,)).astype(np.float32) * 3}
             for n in sizes]
  width = pad_to or max(sizes)
  def pad(x):
    junk = np.full((width - len(x),) + x.shape[1:], np.nan, np.float32)
    return np.concatenate([x, junk])
  batch = {k: jnp.asarray(np.stack([pad(c[k]) for c in clients]))
           for k in ('x', 'y')}
  mask = jnp.asarray(np.arange(width)[None, :] < np.array(sizes)[:, None])
  return clients, batch, mask


def client_step(tx):
  def step(params, state, batch, mask):
    updates, state = tx.update(None, state, params, batch=batch,
                               batch_mask=mask)
    return optax.apply_updates(params, updates), state
  return step


@functools.cache
def vmapped(tx):
  """The jitted step of `tx` over clients (one per `tx`: reuse shares it)."""
  return jax.jit(jax.vmap(client_step(tx), in_axes=(None, None, 0, 0),
                          out_axes=None, axis_name=AXIS))


def run_vmapped(tx, params, batch, mask, rounds):
  state = tx.init(params)
  step = vmapped(tx)
  trajectory = []
  for _ in range(rounds):
    params, state = step(params, state, batch, mask)
    trajectory.append(params)
  return trajectory, state


@functools.cache
def default_gd():
  """`make_tx('gd')`, built once: the tests that run it on the default clients
  share one compiled step (`vmapped` is cached per transformation)."""
  return make_tx('gd')


def flat(tree):
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def kwargs(**overrides):
  args = dict(learning_rate=0.2, grad_clip=0.5, diff_clip_factor=0.7,
              restart_interval=3, num_rounds=7,
              noise_multipliers=Diff2NoiseMultipliers(0.8, 1.5, 2.0), key=3,
              axis_name=AXIS)
  args.update(overrides)
  return args


def reference_diff2(params, clients, rounds, *, learning_rate, grad_clip,
                    diff_clip_factor, restart_interval, noise_multipliers,
                    key, **unused):
  """Algorithm 1 + GD routine written out from the paper, in float64."""
  del unused
  x0, unravel = ravel_pytree(params)
  grad = jax.jit(jax.vmap(jax.grad(lambda v, e: loss_fn(unravel(v), e)),
                          in_axes=(None, 0)))
  mechanism = noise.gaussian(rounds)
  noise_state = mechanism.init(params, jax.random.key(key))
  next_noise = jax.jit(mechanism.next)   # one program, not every op eagerly
  n_min, num_clients = min(len(c['y']) for c in clients), len(clients)

  def clip(rows, c):
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows * np.minimum(1.0, c / np.maximum(norms, 1e-300))

  x = np.asarray(x0, np.float64)
  x_prev, v = x, np.zeros_like(x)
  trajectory = []
  for t in range(rounds):
    g = lambda point, c: np.asarray(grad(jnp.asarray(point, jnp.float32), c),
                                    np.float64)
    if t % restart_interval == 0:
      c, z, base = grad_clip, noise_multipliers.restart, 0.0
      means = [clip(g(x, cl), c).mean(0) for cl in clients]
    else:
      c = diff_clip_factor * np.linalg.norm(x - x_prev)
      z, base = noise_multipliers.difference, v
      means = [clip(g(x, cl) - g(x_prev, cl), c).mean(0) for cl in clients]
    drawn, noise_state = next_noise(noise_state, params)
    sigma = 2 * z / (n_min * num_clients)  # the paper's sigma (z = sigma nP/2)
    v = np.mean(means, 0) + base + sigma * c * flat(drawn)
    x_prev, x = x, x - learning_rate * v
    trajectory.append(x)
  return trajectory


def test_matches_algorithm_1_written_out():
  """Binding clips, noise, unequal padded clients: the paper's recursion."""
  params = make_params()
  clients, batch, mask = make_clients()
  args = kwargs()
  got, _ = run_vmapped(default_gd(), params, batch, mask, args['num_rounds'])
  want = reference_diff2(params, clients, args['num_rounds'], **args)
  for t, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_allclose(flat(a), b, rtol=2e-4, atol=2e-5, err_msg=t)
  assert np.linalg.norm(want[-1] - flat(params)) > 0.1


def test_restart_interval_one_equals_dpsgd_full_batch():
  """T = 1 is DP-GD: equal clients, same key = DP-SGD on all the data."""
  params = make_params()
  sizes = (6, 6, 6, 6)
  clients, batch, mask = make_clients(sizes)
  rounds, z, clip, lr = 4, 0.9, 0.5, 0.3
  got, _ = run_vmapped(
      diff2.diff2_gd(loss_fn, **kwargs(
          restart_interval=1, num_rounds=rounds, learning_rate=lr,
          grad_clip=clip, noise_multipliers=Diff2NoiseMultipliers(z, 123.0))),
      params, batch, mask, rounds)
  via_dp_gd, _ = run_vmapped(
      diff2.dp_gd(loss_fn, learning_rate=lr, grad_clip=clip,
                  noise_multiplier=z, num_rounds=rounds, key=3,
                  axis_name=AXIS), params, batch, mask, rounds)
  everything = {k: jnp.concatenate([jnp.asarray(c[k]) for c in clients])
                for k in ('x', 'y')}
  tx = optax.chain(
      dpsco_jax.dpsgd(loss_fn, l2_clip=clip, noise_multiplier=z, key=3,
                      num_steps=rounds,
                      neighboring_relation=dpsco_jax.NeighboringRelation
                      .REPLACE_ONE, normalize_by=sum(sizes)),
      optax.sgd(lr))
  state, x = tx.init(params), params
  reference_step = jax.jit(client_step(tx))
  for t in range(rounds):
    x, state = reference_step(x, state, everything, None)
    np.testing.assert_allclose(flat(got[t]), flat(x), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(flat(got[t]), flat(via_dp_gd[t]))
  assert np.linalg.norm(flat(x) - flat(params)) > 0.1


def test_no_noise_huge_clips_is_gradient_descent():
  """sigma = 0, clips that never bind: the SARAH/SPIDER recursion telescopes."""
  params = make_params()
  clients, batch, mask = make_clients()
  rounds, lr = 9, 0.1
  got, state = run_vmapped(diff2.diff2_gd(loss_fn, **kwargs(
      restart_interval=4, num_rounds=rounds, learning_rate=lr, grad_clip=1e6,
      diff_clip_factor=1e6, noise_multipliers=Diff2NoiseMultipliers(0, 0))),
      params, batch, mask, rounds)

  def objective_gradient(p):  # clients weighted equally, each by its mean
    means = [mean_gradient(p, c['x'], c['y']) for c in clients]
    return {k: np.mean([np.asarray(m[k]) for m in means], 0) for k in p}

  # In NumPy (float32, as the run): eager jnp ops would compile a program
  # per op and shape.
  x = {k: np.asarray(v) for k, v in params.items()}
  for t in range(rounds):
    gradient = objective_gradient(x)
    x = {k: x[k] - np.float32(lr) * gradient[k] for k in x}
    np.testing.assert_allclose(flat(got[t]), flat(x), rtol=1e-4, atol=1e-5)
  # The last estimate is the true gradient at the previous iterate.
  np.testing.assert_allclose(flat(state[0].estimate), flat(gradient),
                             rtol=1e-3, atol=1e-5)


@functools.cache
def default_estimator():
  """`diff2_estimator` with `kwargs()` (T = 3) and its update over clients,
  compiled once for the tests that read the estimate itself."""
  tx = diff2.diff2_estimator(
      loss_fn, **{k: v for k, v in kwargs().items() if k != 'learning_rate'})
  update = jax.jit(jax.vmap(
      lambda p, s, b, m: tx.update(None, s, p, batch=b, batch_mask=m),
      in_axes=(None, None, 0, 0), out_axes=None, axis_name=AXIS))
  return tx, update


def test_restart_resets_the_estimator():
  params = make_params()
  _, batch, mask = make_clients()
  tx, update = default_estimator()   # restarts at rounds 0 and 3
  state = tx.init(params)
  x = params
  poison = lambda s: s._replace(estimate=jax.tree_util.tree_map(
      lambda e: e + 1e3, s.estimate))
  for t in range(4):
    out, new_state = update(x, state, batch, mask)
    out_poisoned, _ = update(x, poison(state), batch, mask)
    difference = flat(out_poisoned) - flat(out)
    if t % 3 == 0:  # restart: the old estimate must not leak in
      np.testing.assert_array_equal(difference, 0.0)
    else:           # difference round: it is the base of the recursion
      np.testing.assert_allclose(difference, 1e3, rtol=1e-4)
    state = new_state
    x = jax.tree_util.tree_map(lambda p, v: p - 0.2 * v, x, out)


def test_one_changed_example_moves_the_aggregate_at_most_the_sensitivity():
  """Same key, one example of one client replaced: ||v - v'|| <= 2C/(n_p P).

  The replacement is NaN, 1e30 or an ordinary far-away example, in a restart
  round and in two difference rounds (clip C_2 ||x_t - x_{t-1}||).
  """
  params = make_params()
  _, batch, mask = make_clients()
  args = kwargs()
  tx, update = default_estimator()   # T = 3: rounds 1 and 2 are differences
  client, row = 2, 1
  n_p, num_clients = SIZES[client], len(SIZES)
  for value in (np.nan, 1e30, 40.0):
    changed = dict(batch, x=batch['x'].at[client, row].set(value),
                   y=batch['y'].at[client, row].set(-value))
    state, x = tx.init(params), params
    moved = []
    for t in range(3):  # a restart round, then two difference rounds
      out, new_state = update(x, state, batch, mask)
      out_changed, _ = update(x, state, changed, mask)
      if t == 0:
        bound = 2 * args['grad_clip'] / (n_p * num_clients)
      else:
        movement = np.linalg.norm(flat(x) - flat(state.prev_params))
        bound = 2 * args['diff_clip_factor'] * movement / (n_p * num_clients)
      distance = np.linalg.norm(flat(out_changed) - flat(out))
      assert np.all(np.isfinite(flat(out_changed)))
      assert distance <= bound * (1 + 1e-4) + 1e-7, (value, t, distance,
                                                      bound)
      moved.append(distance / bound)
      state = new_state
      x = jax.tree_util.tree_map(lambda p, v: p - 0.2 * v, x, out)
    if value == 40.0:
      # The bound is nearly attained: the test could catch a factor of 2.
      assert max(moved) > 0.5


def replicate(tree, copies):
  """`copies` copies of every leaf along a new leading axis (in NumPy where
  it can be: no eager program per leaf shape)."""
  def one(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = np.asarray(jax.random.key_data(x))
      return jax.random.wrap_key_data(
          np.broadcast_to(data, (copies,) + data.shape))
    return np.broadcast_to(np.asarray(x), (copies,) + np.shape(x))
  return jax.tree_util.tree_map(one, tree)


def make_tx(algorithm, **overrides):
  args = kwargs(**overrides)
  if algorithm == 'bvr':
    return diff2.diff2_bvr_local_sgd(loss_fn, local_steps=3,
                                     local_batch_size=4, **args)
  return diff2.diff2_gd(loss_fn, **args)


@pytest.mark.parametrize('algorithm', ['gd', 'bvr'])
def test_eight_devices_equal_eight_vmapped_clients(algorithm):
  sizes = (5, 8, 6, 7, 8, 4, 6, 5)
  params = make_params()
  _, batch, mask = make_clients(sizes)
  rounds = 4  # restarts at 0 and 3, difference rounds 1 and 2
  # Algorithm 1's output is kept too (for BVR key 3 draws k_hat = 3, the
  # active client's deepest local iterate): it must agree across devices.
  options = dict(num_rounds=rounds, output='random_iterate', output_key=3)
  vmap_traj, vmap_state = run_vmapped(make_tx(algorithm, **options), params,
                                      batch, mask, rounds)

  tx = make_tx(algorithm, **options)
  pmap_traj = []
  if algorithm == 'gd':  # pmap and shard_map share the code; spare a compile
    state, x = replicate(tx.init(params), 8), replicate(params, 8)
    step = jax.pmap(client_step(tx), axis_name=AXIS)
    for _ in range(rounds):
      x, state = step(x, state, batch, mask)
      pmap_traj.append(jax.tree_util.tree_map(lambda leaf: np.asarray(leaf)[0],
                                              x))

  mesh = jax.make_mesh((8,), (AXIS,))
  inner = client_step(tx)
  step = jax.jit(jax.shard_map(
      lambda p, s, b, m: inner(p, s, jax.tree_util.tree_map(lambda v: v[0], b),
                               m[0]),
      mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=(P(), P())))
  replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  state = jax.device_put(tx.init(params), replicated)
  x = jax.device_put(params, replicated)
  batch_s, mask_s = jax.device_put((batch, mask), sharded)
  shard_traj = []
  for _ in range(rounds):
    x, state = step(x, state, batch_s, mask_s)
    shard_traj.append(x)
  for t in range(rounds):
    if pmap_traj:
      np.testing.assert_allclose(flat(pmap_traj[t]), flat(vmap_traj[t]),
                                 rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat(shard_traj[t]), flat(vmap_traj[t]),
                               rtol=1e-5, atol=1e-6)
  assert np.linalg.norm(flat(vmap_traj[-1]) - flat(params)) > 0.05
  kept = flat(diff2.selected_iterate(vmap_state))
  np.testing.assert_allclose(flat(diff2.selected_iterate(state)), kept,
                             rtol=1e-5, atol=1e-6)
  if algorithm == 'bvr':   # a local iterate, not one of the round's x_t
    assert min(np.linalg.norm(kept - flat(x)) for x in [params] + vmap_traj
               ) > 1e-4


def test_padding_does_not_change_per_client_means():
  params = make_params()
  clients, batch, mask = make_clients()
  _, wide_batch, wide_mask = make_clients(pad_to=13)
  # Shuffle the padding among the real rows of client 0: order is irrelevant.
  order = np.random.default_rng(0).permutation(13)

  def shuffled(x):   # in NumPy: no eager program per op
    x = np.array(x)
    x[0] = x[0][order]
    return jnp.asarray(x)
  wide_batch = jax.tree_util.tree_map(shuffled, wide_batch)
  wide_mask = shuffled(wide_mask)
  narrow, _ = run_vmapped(default_gd(), params, batch, mask, 2)
  wide, _ = run_vmapped(make_tx('gd'), params, wide_batch, wide_mask, 2)
  for a, b in zip(narrow, wide):
    np.testing.assert_allclose(flat(a), flat(b), rtol=1e-5, atol=1e-6)
  # Noiseless first round: the mean over clients of each client's own mean.
  estimator = diff2.diff2_estimator(
      loss_fn, grad_clip=1e6, diff_clip_factor=1.0, restart_interval=2,
      num_rounds=1, noise_multipliers=(0.0, 0.0), key=0, axis_name=AXIS)
  out, _ = jax.jit(jax.vmap(
      lambda b, m: estimator.update(None, estimator.init(params), params,
                                    batch=b, batch_mask=m),
      in_axes=(0, 0), out_axes=None, axis_name=AXIS))(wide_batch, wide_mask)
  per_client = [flat(mean_gradient(params, c['x'], c['y'])) for c in clients]
  np.testing.assert_allclose(flat(out), np.mean(per_client, 0), rtol=1e-5,
                             atol=1e-6)


def test_bvr_with_one_local_step_is_diff2_gd():
  params = make_params()
  _, batch, mask = make_clients()
  args = kwargs()
  bvr, _ = run_vmapped(diff2.diff2_bvr_local_sgd(
      loss_fn, local_steps=1, local_batch_size=4, **args), params, batch,
      mask, 5)
  server_key = diff2.bvr_keys(args.pop('key'))[0]
  gd, _ = run_vmapped(diff2.diff2_gd(loss_fn, key=server_key, **args), params,
                      batch, mask, 5)
  for a, b in zip(bvr, gd):
    np.testing.assert_array_equal(flat(a), flat(b))
  assert np.linalg.norm(flat(gd[-1]) - flat(params)) > 0.05


def test_bvr_noiseless_full_minibatch_is_local_sarah_on_the_round_robin_client():
  """b = n_p, no noise, huge clips: K - 1 local recursive-gradient steps."""
  sizes = (6, 6, 6)
  params = make_params()
  clients, batch, mask = make_clients(sizes)
  lr, steps, rounds = 0.1, 3, 3
  make = lambda **output: diff2.diff2_bvr_local_sgd(
      loss_fn, learning_rate=lr, grad_clip=1e6, diff_clip_factor=1e6,
      restart_interval=2, num_rounds=rounds,
      noise_multipliers=Diff2NoiseMultipliers(0, 0, 0), key=1,
      local_steps=steps, local_batch_size=6, axis_name=AXIS, **output)
  got, plain_state = run_vmapped(make(), params, batch, mask, rounds)
  _, unravel = ravel_pytree(params)

  def local_grad(x, c):
    return flat(mean_gradient(unravel(jnp.asarray(x, jnp.float32)), c['x'],
                              c['y']))
  global_grad = lambda x: np.mean([local_grad(x, c) for c in clients], 0)
  x, x_prev, v = flat(params), None, None
  local_iterates = []   # per round: x_0 = x_t, x_1, ..., x_{K-1}
  for t in range(rounds):
    v = global_grad(x) if t % 2 == 0 else (
        global_grad(x) - global_grad(x_prev) + v)
    start = x
    active = clients[(t + 1) % len(clients)]
    x_prev_local, x_local, v_local = x, x - lr * v, v
    local_iterates.append([x, x_local])
    for _ in range(steps - 1):
      v_local = (local_grad(x_local, active) - local_grad(x_prev_local, active)
                 + v_local)
      x_prev_local, x_local = x_local, x_local - lr * v_local
      local_iterates[-1].append(x_local)
    local_iterates[-1].pop()   # x_K is the next round's x, not an output
    x_prev, x = start, x_local
    np.testing.assert_allclose(flat(got[t]), x, rtol=1e-4, atol=1e-5)
  # Algorithm 1's output: x_{k_hat - 1} of round t_hat, k_hat on {1..K}.
  seen = set()
  # Each key is a compile; these three draw (t_hat, k_hat) = (0, 3), (1, 2),
  # (2, 1): every round and every local step once.
  for output_key in (1, 3, 7):
    trajectory, state = run_vmapped(
        make(output='random_iterate', output_key=output_key), params, batch,
        mask, rounds)
    # The option only watches: the same iterates, up to the last place of
    # float32 (a second compiled program; XLA may order a fused
    # multiply-add differently once the kept iterate reads a value).
    for a, b in zip(got, trajectory):
      np.testing.assert_array_max_ulp(
          flat(a).astype(np.float32), flat(b).astype(np.float32), maxulp=2)
    t_hat, k_hat = (int(d) for d in diff2.bvr_output_draws(
        output_key, rounds, steps))
    assert int(state.output.selected) == t_hat
    np.testing.assert_allclose(flat(diff2.selected_iterate(state)),
                               local_iterates[t_hat][k_hat - 1], rtol=1e-4,
                               atol=1e-5)
    seen.add((t_hat, k_hat))
  assert {k for _, k in seen} == {1, 2, 3} and len({t for t, _ in seen}) > 1
  with pytest.raises(ValueError, match='expected one RandomIterateState'):
    diff2.selected_iterate(plain_state)


def zero_loss(params, example):
  return 0.0 * jnp.sum(params['w']) * jnp.sum(example['x'])


def test_noise_scales_with_the_clip_and_the_movement():
  """Restart: std 2 z1 C1 / (n_min P); difference: 2 z2 C2 ||dx|| / (n_min P)."""
  params = {'w': jnp.zeros((4000,))}
  sizes = (3, 5)
  batch = {'x': jnp.ones((2, 5, 1))}
  mask = jnp.arange(5)[None, :] < jnp.array(sizes)[:, None]
  z, clip, factor = Diff2NoiseMultipliers(0.7, 1.9), 0.5, 3.0
  tx = diff2.diff2_gd(zero_loss, learning_rate=0.01, grad_clip=clip,
                      diff_clip_factor=factor, restart_interval=3,
                      num_rounds=3, noise_multipliers=z, key=5,
                      axis_name=AXIS)
  trajectory, _ = run_vmapped(tx, params, batch, mask, 3)
  xs = [flat(params)] + [flat(x) for x in trajectory]
  v = [-(xs[t + 1] - xs[t]) / 0.01 for t in range(3)]
  unit = 2 / (min(sizes) * len(sizes))
  samples = [v[0] / (unit * z.restart * clip)]
  for t in (1, 2):
    movement = np.linalg.norm(xs[t] - xs[t - 1])
    samples.append((v[t] - v[t - 1]) / (unit * z.difference * factor *
                                        movement))
  for sample in samples:
    assert stats.kstest(sample, 'norm').pvalue > 1e-3
    assert stats.kstest(sample * 1.5, 'norm').pvalue < 1e-3
    assert stats.kstest(sample / 1.5, 'norm').pvalue < 1e-3


def test_iterate_that_does_not_move_gives_zero_increment_not_nan():
  """x_t = x_{t-1}: difference rounds have C_2 ||dx|| = 0, so no 0/0, no change.

  Every round is given the same params (the default step, compiled once,
  whose iterate is fed back unchanged, as a zero learning rate would).
  """
  params = make_params()
  _, batch, mask = make_clients()
  tx = default_gd()
  step = vmapped(tx)
  state = tx.init(params)
  estimates = []
  for _ in range(3):  # a restart, then two difference rounds
    x, state = step(params, state, batch, mask)
    estimates.append(flat(state[0].estimate))
    np.testing.assert_allclose(flat(x), flat(params) - 0.2 * estimates[-1],
                               rtol=1e-6, atol=1e-7)
  assert np.all(np.isfinite(estimates[0])) and np.any(estimates[0] != 0)
  np.testing.assert_array_equal(estimates[1], estimates[0])
  np.testing.assert_array_equal(estimates[2], estimates[0])


def test_rounds_beyond_calibration_are_refused():
  params = make_params()
  _, batch, mask = make_clients()
  tx = default_gd()   # calibrated for 7 rounds
  step = vmapped(tx)
  state = tx.init(params)
  for _ in range(7):
    params, state = step(params, state, batch, mask)
  with pytest.raises(REFUSED, match='capacity'):
    dpsco_jax.raise_if_refused(step(params, state, batch, mask))


def test_empty_client_and_small_client_are_refused():
  params = make_params()
  _, batch, mask = make_clients()
  tx = default_gd()
  with pytest.raises(REFUSED, match='no real examples'):
    dpsco_jax.raise_if_refused(
        vmapped(tx)(params, tx.init(params), batch, mask.at[1].set(False)))
  bvr = diff2.diff2_bvr_local_sgd(loss_fn, local_steps=2, local_batch_size=6,
                                  **kwargs())
  with pytest.raises(REFUSED, match='fewer real examples'):
    dpsco_jax.raise_if_refused(vmapped(bvr)(params, bvr.init(params), batch,
                                            mask))


@pytest.mark.parametrize('overrides,match', [
    (dict(grad_clip=0.0), 'l2_clip'),
    (dict(diff_clip_factor=-1.0), 'diff_clip_factor'),
    (dict(restart_interval=0), 'restart_interval'),
    (dict(num_rounds=0), 'num_rounds'),
    (dict(noise_multipliers=None), 'noise_multipliers'),
    (dict(noise_multipliers=(1.0, -1.0)), 'noise_multiplier'),
    (dict(key='zero'), 'key'),
    (dict(neighboring_relation=dpsco_jax.NeighboringRelation.ADD_OR_REMOVE),
     'replace-one'),
])
def test_bad_construction_arguments(overrides, match):
  with pytest.raises(ValueError, match=match):
    diff2.diff2_gd(loss_fn, **kwargs(**overrides))


@pytest.mark.parametrize('overrides,match', [
    (dict(local_steps=0), 'local_steps'),
    (dict(local_batch_size=0), 'local_batch_size'),
    (dict(local_clip_factor=float('inf')), 'local_clip_factor'),
])
def test_bad_bvr_arguments(overrides, match):
  args = dict(local_steps=2, local_batch_size=2)
  args.update(overrides)
  with pytest.raises(ValueError, match=match):
    diff2.diff2_bvr_local_sgd(loss_fn, **args, **kwargs())


def test_missing_batch_or_params():
  params = make_params()
  tx = make_tx('gd', axis_name=None)
  state = tx.init(params)
  with pytest.raises(ValueError, match='batch'):
    tx.update(None, state, params)
  with pytest.raises(ValueError, match='params are required'):
    tx.update(None, state, None, batch={'x': jnp.ones((2, 3)),
                                        'y': jnp.ones((2,))})


# ---------------------------------------------------------------------------
# Theorem 4.3's step-size condition and restart interval.


def test_step_size_bound_is_theorem_4_3_with_the_papers_sigma():
  # California Housing at epsilon 3 (notes §5): z_2 = 168.82 at T = 20,
  # n_min = 1651, P = 10, d = 101, C_2 = 3.
  z = diff2.Diff2NoiseMultipliers(19.36, 168.82)
  sigma_2 = 2 * 168.82 / (1651 * 10)   # the paper's sigma, replace-one
  expected = 1.0 / (2.0 * math.sqrt(20 * sigma_2**2 * 3.0**2 * 101))
  kwargs = dict(restart_interval=20, noise_multipliers=z,
                diff_clip_factor=3.0, num_params=101, min_client_size=1651,
                num_clients=10)
  result = diff2.step_size_stability(0.25, **kwargs)
  assert result.step_size_bound == pytest.approx(expected, rel=1e-12)
  assert result.step_size_bound == pytest.approx(0.1813, abs=1e-4)
  assert result.rho == pytest.approx(0.25 * sigma_2 * 3.0 * math.sqrt(101))
  assert not result.holds
  bound = result.step_size_bound
  assert diff2.step_size_stability(bound * (1 - 1e-9), **kwargs).holds
  assert not diff2.step_size_stability(bound * (1 + 1e-9), **kwargs).holds
  # At the bound sqrt(T) rho is exactly 1/2.
  at_bound = diff2.step_size_stability(bound, **kwargs)
  assert math.sqrt(20) * at_bound.rho == pytest.approx(0.5)
  # Zero-out neighbours halve the sensitivity, hence sigma_2: the bound
  # doubles.
  zero_out = diff2.step_size_stability(
      0.25, neighboring_relation=neighboring.NeighboringRelation.ZERO_OUT,
      **kwargs)
  assert zero_out.step_size_bound == pytest.approx(2 * bound)
  # DP-GD (T = 1) has no difference rounds: no bound.
  dp_gd = diff2.step_size_stability(
      10.0, **dict(kwargs, restart_interval=1))
  assert dp_gd.holds and math.isinf(dp_gd.step_size_bound)
  with pytest.raises(ValueError, match='learning_rate'):
    diff2.step_size_stability(-0.1, **kwargs)
  with pytest.raises(ValueError, match='replace-one'):
    diff2.step_size_stability(
        0.1, neighboring_relation=neighboring.NeighboringRelation
        .ADD_OR_REMOVE, **kwargs)


def test_restart_interval_preset_is_tau_r_clamped_to_one_and_r():
  tau = (1.0**2 * math.sqrt(101) / (1.0 * 16_512 * 3.0))**(2 / 3)
  assert diff2.restart_interval_preset(
      2000, grad_bound=1.0, smoothness=1.0, num_examples=16_512,
      epsilon=3.0, num_params=101) == round(tau * 2000) == 7
  # Tiny tau R: at least one round between restarts; huge: at most R.
  assert diff2.restart_interval_preset(
      10, grad_bound=0.01, smoothness=1.0, num_examples=10**6, epsilon=8.0,
      num_params=10) == 1
  assert diff2.restart_interval_preset(
      50, grad_bound=100.0, smoothness=0.01, num_examples=100, epsilon=0.1,
      num_params=10**4) == 50
  with pytest.raises(ValueError, match='epsilon'):
    diff2.restart_interval_preset(10, grad_bound=1.0, smoothness=1.0,
                                  num_examples=100, epsilon=0.0,
                                  num_params=10)


# ---------------------------------------------------------------------------
# Algorithm 1's random output iterate.


def test_random_output_iterate_keeps_the_selected_rounds_point():
  _, batch, mask = make_clients()
  params = make_params()
  plain, _ = run_vmapped(default_gd(), params, batch, mask, 7)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', dpsco_jax.keys.KeyReuseWarning)
    tx = diff2.diff2_gd(loss_fn, output='random_iterate', output_key=5,
                        **kwargs())
    trajectory, state = run_vmapped(tx, params, batch, mask, 7)
  # The selector only watches: the iterates are those of the plain run.
  for a, b in zip(plain, trajectory):
    np.testing.assert_array_equal(flat(a), flat(b))
  selected = int(state[0].selected)
  assert 0 <= selected < 7
  # x_{t_hat} is the point round t_hat's gradient was taken at.
  points = [params] + trajectory[:-1]
  np.testing.assert_array_equal(flat(diff2.selected_iterate(state)),
                                flat(points[selected]))


def test_random_output_round_is_uniform_and_read_only_once_reached():
  params = make_params()
  rounds = 10
  draws = [int(diff2.random_output_iterate(rounds, key=k).init(params)
               .selected) for k in range(1000)]
  counts = np.bincount(draws, minlength=rounds)
  assert len(counts) == rounds
  assert stats.chisquare(counts).pvalue > 1e-3
  tx = diff2.random_output_iterate(rounds, key=int(np.argmax(
      np.asarray(draws) == rounds - 1)))   # a key selecting the last round
  state = tx.init(params)
  for _ in range(rounds - 1):
    _, state = tx.update(params, state, params)
  with pytest.raises(ValueError, match='has not been reached'):
    diff2.selected_iterate(state)
  # Under jit the same refusal comes when the program runs.
  read = jax.jit(diff2.selected_iterate)
  with pytest.raises(Exception, match='has not been reached'):
    jax.block_until_ready(read(state))
  _, state = tx.update(params, state, params)
  np.testing.assert_array_equal(flat(read(state)),
                                flat(diff2.selected_iterate(state)))
  with pytest.raises(ValueError, match='expected one RandomIterateState'):
    diff2.selected_iterate((optax.EmptyState(),))
  with pytest.raises(ValueError, match="output must be 'last' or"):
    diff2.diff2_gd(loss_fn, output='best', **kwargs())
