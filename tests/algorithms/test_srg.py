"""Stochastic recursive gradients: Algorithm 1 (000/001), Algorithm 3 (001).

References are float64 NumPy loops written from the papers' pseudocode (the
unnormalized prefix sums, the exponential weights, the coupled z/y/x
sequences), sharing no code path with the library's normalized recursions.
"""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import clipping
from dpsco_jax import noise
from dpsco_jax import strategies
from dpsco_jax.algorithms import srg
from tests.algorithms.test_baselines import loss_fn
from tests.algorithms.test_baselines import make_problem
from tests.algorithms.test_baselines import zero_loss

BATCH, DIM, CLASSES = 8, 5, 3


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(leaf, np.float64))
                         for leaf in jax.tree_util.tree_leaves(tree)])


def batches_and_iterates(num_steps, seed=0):
  """Fresh batches and an arbitrary sequence of query points x_0..x_{T-1}."""
  rng = np.random.default_rng(seed)
  batches = []
  for t in range(num_steps):
    _, batch = make_problem(batch_size=BATCH, dim=DIM, classes=CLASSES,
                            seed=seed * 1000 + t)
    batches.append(batch)
  iterates = [{'w': jnp.asarray(rng.normal(size=(DIM, CLASSES)), jnp.float32),
               'b': jnp.asarray(rng.normal(size=(CLASSES,)), jnp.float32)}
              for _ in range(num_steps)]
  return batches, iterates


_grad = jax.jit(jax.grad(loss_fn))


def example_grad(params, batch, i):
  return flat(_grad(params, jax.tree_util.tree_map(lambda x: x[i], batch)))


def clip(v, c):
  norm = np.linalg.norm(v)
  return v * min(1.0, c / norm) if norm > 0 else v


def feed(tx, iterates, batches, **extra):
  """Runs `tx` at the GIVEN query points; returns outputs and states."""
  state = tx.init(iterates[0])
  update = jax.jit(lambda s, p, b: tx.update(None, s, p, batch=b, **extra))
  outputs, states = [], []
  for params, batch in zip(iterates, batches):
    out, state = update(state, params, batch)
    outputs.append(out)
    states.append(state)
  return outputs, states


def compiled_update(tx):
  """`tx.update(None, state, params, batch=batch)` as one compiled program
  (not every op eagerly at every step); the same outputs."""
  return jax.jit(lambda s, p, b: tx.update(None, s, p, batch=b))


# ----------------------------------------------------------------- Alg 1 SRG


def test_normalized_recursion_equals_prefix_sum_over_eta():
  num_steps, clip_norm = 6, 0.7
  batches, iterates = batches_and_iterates(num_steps)
  tx = srg.srg_gradient(loss_fn, l2_clip=clip_norm, noise_multiplier=0.0,
                        num_steps=num_steps, key=0)
  outputs, states = feed(tx, iterates, batches)
  prefix, clipped_any = 0.0, False
  for t in range(num_steps):
    eta, eta_prev = t + 1.0, float(t)
    for i in range(BATCH):
      delta = (eta * example_grad(iterates[t], batches[t], i) -
               (eta_prev * example_grad(iterates[t - 1], batches[t], i)
                if t else 0.0))
      clipped_any |= np.linalg.norm(delta) > clip_norm
      prefix = prefix + clip(delta, clipping.effective_clip(clip_norm, BATCH)) / BATCH
    np.testing.assert_allclose(flat(states[t].grad), prefix / eta,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flat(outputs[t]), prefix / eta, rtol=1e-5,
                               atol=1e-6)
  assert clipped_any  # the clip is active, so clipping the DIFFERENCE matters


def test_prefix_noise_is_the_tree_over_batch_and_eta():
  """With every tree node equal to 1 the prefix noise at t is popcount(t+1)."""
  num_steps, clip_norm, z = 7, 0.5, 3.0
  mechanism = noise.tree(num_steps, release='prefix',
                         sampler=lambda key, shape, dtype: jnp.ones(shape,
                                                                    dtype))
  batches, iterates = batches_and_iterates(num_steps)
  tx = srg.srg_gradient(zero_loss, l2_clip=clip_norm, noise_multiplier=z,
                        mechanism=mechanism, key=0)
  outputs, _ = feed(tx, iterates, batches)
  for t, out in enumerate(outputs):
    expected = z * clip_norm * bin(t + 1).count('1') / (BATCH * (t + 1))
    np.testing.assert_allclose(flat(out), expected, rtol=1e-6)


def test_matrix_factorization_prefix_noise_plugs_in():
  num_steps, clip_norm, z = 5, 0.5, 2.0
  c = strategies.optimize_strategy(strategies.workload(num_steps), 1,
                                   cache_dir=None)
  mechanism = noise.matrix_factorization(c, release='prefix')
  batches, iterates = batches_and_iterates(num_steps)
  tx = srg.srg_gradient(zero_loss, l2_clip=clip_norm, noise_multiplier=z,
                        mechanism=mechanism, key=4)
  outputs, _ = feed(tx, iterates, batches)
  state = mechanism.init(iterates[0], jax.random.key(4))
  next_noise = jax.jit(mechanism.next)   # one program, not every op eagerly
  for t, out in enumerate(outputs):
    draw, state = next_noise(state, iterates[0])
    np.testing.assert_allclose(
        flat(out), flat(draw) * z * clip_norm / (BATCH * (t + 1)), rtol=1e-5,
        atol=1e-7)


@functools.cache
def masked_srg_step(num_steps, clip_norm):
  """`srg_gradient` (key 11, z = 2) and its masked update, compiled once:
  every neighbouring data set below runs the same program."""
  tx = srg.srg_gradient(loss_fn, l2_clip=clip_norm, noise_multiplier=2.0,
                        num_steps=num_steps, key=11, normalize_by=BATCH)
  return tx, jax.jit(lambda s, p, b, m: tx.update(None, s, p, batch=b,
                                                  batch_mask=m))


@pytest.mark.parametrize('change', ['remove', 'nan', 'huge', 'other'])
def test_one_changed_example_changes_exactly_one_delta(change):
  """Sensitivity on the real code path: same key, neighbouring data sets."""
  num_steps, clip_norm, changed_step, changed_row = 6, 0.4, 3, 5
  batches, iterates = batches_and_iterates(num_steps, seed=1)
  neighbour = [dict(b) for b in batches]
  mask = jnp.ones((BATCH,), bool)
  masks = [mask] * num_steps
  x = batches[changed_step]['x']
  if change == 'remove':
    masks = list(masks)
    masks[changed_step] = mask.at[changed_row].set(False)
    bound = clip_norm / BATCH
  else:
    value = {'nan': np.nan, 'huge': 1e6, 'other': -3.0}[change]
    neighbour[changed_step] = dict(
        batches[changed_step], x=x.at[changed_row].set(value))
    bound = 2 * clip_norm / BATCH
  tx, update = masked_srg_step(num_steps, clip_norm)

  def released(data, masks):
    state = tx.init(iterates[0])
    outs = []
    for params, batch, m in zip(iterates, data, masks):
      out, state = update(state, params, batch, m)
      outs.append(flat(out))
    return outs

  ones = [mask] * num_steps
  first = released(batches, ones)
  second = released(neighbour, masks)
  # eta_t Gradtilde_t is the noisy prefix sum; its increments are the Deltas.
  def deltas(outs):
    prefix = [(t + 1) * o for t, o in enumerate(outs)]
    return [prefix[0]] + [prefix[t] - prefix[t - 1]
                          for t in range(1, num_steps)]
  for t, (a, b) in enumerate(zip(deltas(first), deltas(second))):
    moved = np.linalg.norm(a - b)
    if t == changed_step:
      assert 0 < moved <= bound * (1 + 1e-4)
    else:
      assert moved < 1e-5, (t, moved)


def test_refuses_to_run_past_num_steps():
  """The step after num_steps is refused as users run it, compiled: NaN out,
  the refusal recorded in the state (the program of the test above)."""
  num_steps, clip_norm = 6, 0.4
  batches, iterates = batches_and_iterates(num_steps + 1, seed=1)
  tx, update = masked_srg_step(num_steps, clip_norm)
  mask = jnp.ones((BATCH,), bool)
  state = tx.init(iterates[0])
  for t in range(num_steps):
    out, state = update(state, iterates[t], batches[t], mask)
  dpsco_jax.raise_if_refused(state)   # every step within the capacity
  assert np.all(np.isfinite(flat(out)))
  out, state = update(state, iterates[num_steps], batches[num_steps], mask)
  assert np.all(np.isnan(flat(out)))
  with pytest.raises(dpsco_jax.PrivacyGuardError, match='capacity'):
    dpsco_jax.raise_if_refused(state)


def test_purity_same_state_same_output():
  batches, iterates = batches_and_iterates(2)
  tx = srg.accelerated_dp_srgd(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                               num_steps=2, beta=5.0, radius=None, key=3)
  state = tx.init(iterates[0])
  update = jax.jit(lambda s, p, b: tx.update(None, s, p, batch=b))
  a, _ = update(state, iterates[0], batches[0])
  b, _ = update(state, iterates[0], batches[0])
  np.testing.assert_array_equal(flat(a), flat(b))


# ------------------------------------------------------- Alg 1 acceleration


def _quadratic_hessian(dim=20):
  rng = np.random.default_rng(0)
  q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
  return (q * np.logspace(-3, 0, dim)) @ q.T


def quadratic_problem(dim=20):
  """F(x) = mean_d 0.5 (x - a_d)^T H (x - a_d); condition number 1000."""
  hessian = _quadratic_hessian(dim)
  targets = np.random.default_rng(1).normal(size=(16, dim))
  minimizer = targets.mean(0)

  def loss(params, example):
    diff = params['x'] - example['a']
    return 0.5 * diff @ (jnp.asarray(hessian, jnp.float32) @ diff)

  def risk(x):
    diff = x - minimizer
    return 0.5 * diff @ hessian @ diff

  return loss, risk, {'a': jnp.asarray(targets, jnp.float32)}, minimizer


def test_nonprivate_accelerated_srg_has_the_one_over_t_squared_term():
  """sigma = 0, no clipping, the full batch every step: SRG telescopes to the
  exact gradient and Algorithm 1 is an accelerated method, with
  F(y_T) - F* <= 2 beta ||x_0 - x*||^2 / eta_{0:T-1} (the potential of the
  proofs), while gradient descent with the same step 1/beta is far slower."""
  loss, risk, batch, minimizer = quadratic_problem()
  num_steps, beta = 150, 1.0
  tx = srg.accelerated_dp_srgd(loss, l2_clip=1e9, noise_multiplier=0.0,
                               num_steps=num_steps, beta=beta, radius=None,
                               key=0)
  params = {'x': jnp.zeros((20,), jnp.float32)}
  state = tx.init(params)
  update = jax.jit(lambda s, p: tx.update(None, s, p, batch=batch))
  full_grad = jax.jit(jax.grad(
      lambda p: jnp.mean(jax.vmap(loss, (None, 0))(p, batch))))
  start = float(np.sum(minimizer ** 2))
  for t in range(num_steps):
    gradient = flat(full_grad(params))
    updates, state = update(state, params)
    # The recursion's clean estimate is the exact gradient at x_t.
    np.testing.assert_allclose(flat(state.estimator.grad), gradient,
                               rtol=2e-4, atol=2e-5)
    params = optax.apply_updates(params, updates)
    excess = risk(flat(srg.final_params(state)))
    eta_sum = (t + 1) * (t + 2) / 2  # eta_{0:t}, the steps taken so far
    assert excess <= 2 * beta * start / eta_sum * (1 + 1e-3), (t, excess)
  accelerated = risk(flat(srg.final_params(state)))
  descent = _gradient_descent_risk(num_steps, beta)
  assert accelerated < descent / 5, (accelerated, descent)


def _gradient_descent_risk(num_steps, beta):
  """Gradient descent with step 1/beta on the same quadratic, in float64."""
  _, risk, _, minimizer = quadratic_problem()
  hessian = _quadratic_hessian()
  x = np.zeros(20)
  for _ in range(num_steps):
    x = x - hessian @ (x - minimizer) / beta
  return risk(x)


def coupling_reference(gradients, x0, beta, radius):
  """Algorithm 1's z/y/x sequences from given (noisy) gradient estimates."""
  def proj(v):
    norm = np.linalg.norm(v)
    return v if radius is None or norm <= radius else v * radius / norm
  x, z, ys = x0.copy(), x0.copy(), []
  for t, grad_fn in enumerate(gradients):
    g = grad_fn(x)
    eta = t + 1.0
    z = proj(z - eta / beta * g)
    y = proj(x - g / beta)
    tau = 2.0 / (t + 3.0)
    x = (1 - tau) * y + tau * z
    ys.append(y)
  return x, ys


def test_independent_gradient_variant_matches_the_coupling_reference():
  num_steps, beta, radius = 5, 4.0, 0.6
  batches, _ = batches_and_iterates(num_steps, seed=2)
  params, _ = make_problem(dim=DIM, classes=CLASSES)
  params = srg.project_l2_ball(params, radius)
  tx = srg.accelerated_dp_srgd(loss_fn, l2_clip=1e9, noise_multiplier=0.0,
                               num_steps=num_steps, beta=beta, radius=radius,
                               key=0, gradient='independent')
  state, update = tx.init(params), compiled_update(tx)
  for batch in batches:
    updates, state = update(state, params, batch)
    params = optax.apply_updates(params, updates)
  template = jax.tree_util.tree_structure(params)
  shapes = [np.shape(l) for l in jax.tree_util.tree_leaves(params)]

  def unflat(v):
    leaves, start = [], 0
    for shape in shapes:
      size = int(np.prod(shape))
      leaves.append(jnp.asarray(v[start:start + size].reshape(shape),
                                jnp.float32))
      start += size
    return jax.tree_util.tree_unflatten(template, leaves)

  def minibatch_gradient(batch):
    return lambda x: np.mean([example_grad(unflat(x), batch, i)
                              for i in range(BATCH)], axis=0)

  x0 = flat(srg.project_l2_ball(make_problem(dim=DIM, classes=CLASSES)[0],
                                radius))
  x_ref, ys = coupling_reference([minibatch_gradient(b) for b in batches],
                                 x0, beta, radius)
  np.testing.assert_allclose(flat(params), x_ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(flat(srg.final_params(state)), ys[-1],
                             rtol=1e-4, atol=1e-5)
  assert np.linalg.norm(ys[-1]) <= radius * (1 + 1e-6)


def test_z_and_y_share_one_noise_draw():
  """(z_t - z_{t+1}) / eta_t and x_t - y_{t+1} are both Gradtilde_t / beta."""
  num_steps, beta = 5, 3.0
  batches, _ = batches_and_iterates(num_steps)
  params, _ = make_problem(dim=DIM, classes=CLASSES)
  tx = srg.accelerated_dp_srgd(loss_fn, l2_clip=1.0, noise_multiplier=50.0,
                               num_steps=num_steps, beta=beta, radius=None,
                               key=9)
  state, update = tx.init(params), compiled_update(tx)
  for t, batch in enumerate(batches):
    updates, new_state = update(state, params, batch)
    via_z = (flat(state.z) - flat(new_state.z)) / (t + 1)
    via_y = flat(params) - flat(new_state.y)
    np.testing.assert_allclose(via_z, via_y, rtol=1e-4, atol=1e-5)
    # The noise dominates: the step is not the clean gradient's.
    clean = flat(new_state.estimator.grad) / beta
    assert np.linalg.norm(via_y - clean) > np.linalg.norm(clean)
    params = optax.apply_updates(params, updates)
    state = new_state


def test_projection_uses_the_global_norm_after_the_noise():
  num_steps, radius = 4, 0.5
  batches, _ = batches_and_iterates(num_steps)
  params = {'w': jnp.zeros((DIM, CLASSES)), 'b': jnp.zeros((CLASSES,))}
  tx = srg.accelerated_dp_srgd(loss_fn, l2_clip=1.0, noise_multiplier=100.0,
                               num_steps=num_steps, beta=1.0, radius=radius,
                               key=5)
  state, update = tx.init(params), compiled_update(tx)
  for batch in batches:
    updates, state = update(state, params, batch)
    params = optax.apply_updates(params, updates)
    for point in (state.y, state.z, params):
      assert np.linalg.norm(flat(point)) <= radius * (1 + 1e-5)
    # Huge noise: y and z sit on the sphere, not leaf by leaf.
    np.testing.assert_allclose(np.linalg.norm(flat(state.y)), radius,
                               rtol=1e-5)
    assert np.linalg.norm(np.asarray(state.y['b'])) < radius * 0.99


def test_unaccelerated_srg_is_projected_sgd_on_the_srg_estimate():
  num_steps, beta, radius, clip_norm = 5, 2.0, 1.0, 0.5
  batches, _ = batches_and_iterates(num_steps, seed=3)
  params = {'w': jnp.zeros((DIM, CLASSES)), 'b': jnp.zeros((CLASSES,))}
  srg_tx = srg.srg_gradient(loss_fn, l2_clip=clip_norm, noise_multiplier=1.5,
                            num_steps=num_steps, key=2)
  tx = srg.unaccelerated_dp_srg(loss_fn, l2_clip=clip_norm,
                                noise_multiplier=1.5, num_steps=num_steps,
                                beta=beta, radius=radius, key=2)
  state, srg_state = tx.init(params), srg_tx.init(params)
  update, srg_update = compiled_update(tx), compiled_update(srg_tx)
  for batch in batches:
    estimate, srg_state = srg_update(srg_state, params, batch)
    expected = srg.project_l2_ball(
        jax.tree_util.tree_map(lambda p, g: p - g / beta, params, estimate),
        radius)
    updates, state = update(state, params, batch)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(flat(params), flat(expected), rtol=1e-5,
                               atol=1e-6)


# ------------------------------------------------------------ Alg 3 (001)


def test_srg_memf_normalized_form_equals_exponential_weights():
  """Grad_t = c Grad_{t-1} + Delta_t is sum_i eta_i Delta_i / eta_t with
  eta_i = c^{-i} (computable in float64 only for short runs)."""
  num_steps, c, clip_norm = 6, 0.3, 0.5
  batches, iterates = batches_and_iterates(num_steps, seed=4)
  identity = np.eye(num_steps)
  tx = srg.dp_srg_memf(loss_fn, l2_clip=clip_norm, noise_multiplier=0.0,
                       strategy=identity, steps_per_epoch=num_steps, decay=c,
                       key=0, check_order=False)
  outputs, _ = feed(tx, iterates, batches)
  weighted = 0.0
  for t in range(num_steps):
    c_t = 0.0 if t == 0 else c
    delta = sum(clip(example_grad(iterates[t], batches[t], i) -
                     c_t * example_grad(iterates[t - 1], batches[t], i),
                     clipping.effective_clip(clip_norm, BATCH))
                for i in range(BATCH)) / BATCH
    weighted = weighted + c ** (-t) * delta
    np.testing.assert_allclose(flat(outputs[t]), weighted / c ** (-t),
                               rtol=1e-5, atol=1e-6)


def test_srg_memf_stays_finite_where_exponential_weights_overflow():
  num_steps, c = 300, math.exp(-2.5)
  with np.errstate(over='ignore', divide='ignore'):
    assert np.isinf(np.float64(1.0) / np.float64(c) ** (num_steps - 1))
  params, batch = make_problem(batch_size=BATCH, dim=DIM, classes=CLASSES)
  tx = optax.chain(
      srg.dp_srg_memf(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                      strategy=np.eye(num_steps), steps_per_epoch=num_steps,
                      decay=c, key=0, check_order=False),
      optax.sgd(0.1, momentum=0.9))
  state = tx.init(params)

  def body(carry, _):
    params, state = carry
    updates, state = tx.update(None, state, params, batch=batch)
    return (optax.apply_updates(params, updates), state), None

  (params, state), _ = jax.jit(
      lambda p, s: jax.lax.scan(body, (p, s), None, length=num_steps))(
          params, state)
  assert np.all(np.isfinite(flat(params)))


def test_srg_memf_adds_the_noise_once_and_decays_it():
  num_steps, c, clip_norm, z = 6, 0.5, 0.5, 2.0
  strategy = strategies.optimize_strategy(
      strategies.workload(num_steps, 'true', momentum=0.9, decay=c), 1,
      cache_dir=None)
  batches, iterates = batches_and_iterates(num_steps)
  tx = srg.dp_srg_memf(zero_loss, l2_clip=clip_norm, noise_multiplier=z,
                       strategy=strategy, steps_per_epoch=num_steps, decay=c,
                       key=8, check_order=False)
  outputs, _ = feed(tx, iterates, batches)
  mechanism = dpsco_jax.dpmemf_mechanism(strategy)
  state = mechanism.init(iterates[0], jax.random.key(8))
  next_noise = jax.jit(mechanism.next)   # one program, not every op eagerly
  expected = 0.0
  for t, out in enumerate(outputs):
    draw, state = next_noise(state, iterates[0])
    expected = (0.0 if t == 0 else c) * expected + (
        flat(draw) * z * clip_norm / BATCH)
    np.testing.assert_allclose(flat(out), expected, rtol=1e-5, atol=1e-6)


def test_srg_memf_with_zero_decay_is_dpmemf():
  num_epochs, steps_per_epoch = 2, 3
  num_steps = num_epochs * steps_per_epoch
  params, data = make_problem(batch_size=steps_per_epoch * BATCH, dim=DIM,
                              classes=CLASSES)
  strategy = strategies.optimize_strategy(
      strategies.workload(num_steps, 'true', momentum=0.9), num_epochs,
      cache_dir=None)
  order = list(dpsco_jax.batching.FixedOrderBatches(
      steps_per_epoch * BATCH, BATCH, num_epochs, seed=1))
  common = dict(l2_clip=0.3, noise_multiplier=1.2, strategy=strategy,
                steps_per_epoch=steps_per_epoch,
                num_examples=steps_per_epoch * BATCH, key=6)

  def train(private):
    tx = optax.chain(private, optax.sgd(0.2, momentum=0.9))
    state, p = tx.init(params), params

    @jax.jit
    def step(p, state, batch, ids):
      updates, state = tx.update(None, state, p, batch=batch, example_ids=ids)
      return optax.apply_updates(p, updates), state

    for indices in order:
      batch = jax.tree_util.tree_map(lambda x, i=indices: x[i], data)
      p, state = step(p, state, batch, jnp.asarray(indices))
    return p

  memf = train(dpsco_jax.dpmemf(loss_fn, **common))
  srg_memf = train(srg.dp_srg_memf(loss_fn, decay=0.0, **common))
  np.testing.assert_allclose(flat(srg_memf), flat(memf), rtol=1e-6,
                             atol=1e-7)
  assert np.linalg.norm(flat(memf) - flat(params)) > 1e-2


def test_srg_memf_refuses_a_reshuffled_epoch():
  """Compiled, as users run it: the step that breaks the fixed order is
  refused (its release NaN, the refusal in the state). The same guard
  (`mf.with_order_check`) refuses at once eagerly: tests/algorithms/
  test_mf.py."""
  steps_per_epoch = 2
  params, data = make_problem(batch_size=steps_per_epoch * BATCH, dim=DIM,
                              classes=CLASSES)
  data = jax.tree_util.tree_map(np.asarray, data)
  tx = srg.dp_srg_memf(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                       strategy=np.eye(2 * steps_per_epoch),
                       steps_per_epoch=steps_per_epoch, decay=0.1,
                       num_examples=steps_per_epoch * BATCH, key=0)
  state = tx.init(params)
  update = jax.jit(lambda s, b, ids: tx.update(None, s, params, batch=b,
                                               example_ids=ids))
  order = [np.arange(BATCH), np.arange(BATCH, 2 * BATCH),
           np.arange(BATCH, 2 * BATCH)]  # epoch 2 starts with batch 2
  for step, indices in enumerate(order):
    batch = jax.tree_util.tree_map(lambda x, i=indices: x[i], data)
    out, state = update(state, batch, indices)
    if step < steps_per_epoch:   # the first epoch: no refusal
      dpsco_jax.raise_if_refused(state)
  assert all(np.all(np.isnan(np.asarray(leaf)))
             for leaf in jax.tree_util.tree_leaves(out))
  with pytest.raises(dpsco_jax.PrivacyGuardError, match='reshuffles'):
    dpsco_jax.raise_if_refused(state)


# ------------------------------------------------------ presets and errors


def test_constrained_presets_follow_the_theorems():
  n, eps, delta, lip, smooth, radius = 10 ** 4, 1.0, 1e-6, 2.0, 0.5, 3.0
  common = dict(num_examples=n, epsilon=eps, delta=delta, lipschitz=lip,
                smoothness=smooth, radius=radius, dimension=10)
  p000 = srg.srgd_preset('constrained', **common)
  assert (p000.batch_size, p000.num_steps) == (100, 100)
  c_m = smooth * radius / lip
  assert p000.beta == pytest.approx(
      (16 * c_m + 8) * lip * n ** 1.5 / (radius * 100 ** 2))
  assert p000.l2_clip == pytest.approx((8 * c_m + 4) * lip)
  p001 = srg.srgd_preset('001', batch_size=50, **common)
  assert (p001.batch_size, p001.num_steps) == (50, 200)
  assert p001.beta == pytest.approx(
      smooth + (8 * lip + 16 * smooth * radius) * n ** 1.5 /
      (radius * 50 ** 2))
  assert p001.l2_clip == pytest.approx(4 * lip + 8 * smooth * radius)
  # The noise is the accountant's for the tree the run uses.
  assert p001.noise_multiplier == pytest.approx(
      accounting.calibrate_noise_multiplier(
          srg.srg_mechanism(200), accounting.single_epoch(200), eps, delta))
  paper = srg.srgd_preset('001', batch_size=50, method='gdp_paper', **common)
  levels = math.floor(math.log2(200)) + 1
  assert paper.noise_multiplier == pytest.approx(
      math.sqrt(levels) * math.sqrt(2 * math.log(2.5 / delta)) / eps)
  assert paper.noise_multiplier > p001.noise_multiplier


def test_interior_preset_refuses_vacuous_constants():
  with pytest.raises(ValueError, match='vacuous'):
    srg.srgd_preset('interior', num_examples=10 ** 4, epsilon=1.0,
                    delta=1e-6, lipschitz=1.0, smoothness=1.0, radius=1.0,
                    dimension=10)


@pytest.mark.parametrize('kwargs, match', [
    (dict(beta=0.0), 'beta'),
    (dict(beta=-1.0), 'beta'),
    (dict(radius=0.0), 'radius'),
    (dict(gradient='momentum'), 'gradient'),
    (dict(mechanism=noise.gaussian(4)), 'PREFIX'),
    (dict(gradient='independent',
          mechanism=noise.tree(4, release='prefix')), 'per-step'),
    (dict(mechanism=noise.tree(5, release='prefix')), 'disagrees'),
    (dict(l2_clip=0.0), 'l2_clip'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier'),
])
def test_bad_arguments_raise(kwargs, match):
  args = dict(l2_clip=1.0, noise_multiplier=1.0, num_steps=4, beta=1.0,
              radius=1.0, key=0)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    srg.accelerated_dp_srgd(loss_fn, **args)


def test_initial_params_outside_the_ball_are_refused():
  tx = srg.accelerated_dp_srgd(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                               num_steps=4, beta=1.0, radius=0.1, key=0)
  params, _ = make_problem(dim=DIM, classes=CLASSES)
  params = jax.tree_util.tree_map(lambda x: x + 1.0, params)
  with pytest.raises(ValueError, match='radius'):
    tx.init(params)


@pytest.mark.parametrize('decay', [-0.1, 1.5, float('nan')])
def test_bad_decay_raises(decay):
  with pytest.raises(ValueError, match='decay'):
    srg.dp_srg_memf(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                    strategy=np.eye(4), steps_per_epoch=4, decay=decay, key=0)


def test_bad_preset_arguments_raise():
  common = dict(num_examples=10 ** 4, epsilon=1.0, delta=1e-6, lipschitz=1.0,
                smoothness=1.0, radius=1.0, dimension=10)
  with pytest.raises(ValueError, match='sqrt'):
    srg.srgd_preset('constrained', batch_size=101, **common)
  with pytest.raises(ValueError, match='regime'):
    srg.srgd_preset('unknown', **common)
  with pytest.raises(ValueError, match='epsilon'):
    srg.srgd_preset('001', **dict(common, epsilon=0.0))


def test_final_params_needs_the_algorithm_state():
  with pytest.raises(ValueError, match='AcceleratedSrgdState'):
    srg.final_params((optax.EmptyState(),))


# ------------------------------------------------- Algorithm 1's {eta_t}


def _run_accelerated(weights, num_steps=5, beta=4.0, radius=None, clip=0.7,
                     noise_multiplier=0.5, **kwargs):
  batches, _ = batches_and_iterates(num_steps, seed=4)
  params, _ = make_problem(dim=DIM, classes=CLASSES)
  tx = srg.accelerated_dp_srgd(loss_fn, l2_clip=clip,
                               noise_multiplier=noise_multiplier,
                               num_steps=num_steps, beta=beta, radius=radius,
                               key=11, weights=weights, **kwargs)
  state = tx.init(params)
  step = jax.jit(lambda s, p, b: tx.update(None, s, p, batch=b))
  points, states = [], []
  for batch in batches:
    points.append(params)
    updates, state = step(state, params, batch)
    params = optax.apply_updates(params, updates)
    states.append(state)
  return points, states, batches


def test_the_linear_schedule_as_weights_is_the_default_bit_for_bit():
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', dpsco_jax.keys.KeyReuseWarning)
    default_points, default_states, _ = _run_accelerated(None)
    points, states, _ = _run_accelerated(srg.srg_weights(5))
  for a, b in zip(default_points, points):
    np.testing.assert_array_equal(flat(a), flat(b))
  for a, b in zip(default_states, states):
    np.testing.assert_array_equal(flat(a.y), flat(b.y))
    np.testing.assert_array_equal(flat(a.z), flat(b.z))
    np.testing.assert_array_equal(flat(a.estimator.grad),
                                  flat(b.estimator.grad))


def test_a_general_schedule_follows_algorithm_1_written_out():
  """eta_t = sqrt(t + 1) (inside the theory) against a float64 reference of
  Algorithm 1 with that schedule: Delta_t, G_t / eta_t, the z step eta_t /
  beta and tau_{t+1} = eta_{t+1} / eta_{0:t+1}."""
  num_steps, beta, radius = 5, 3.0, 2.0
  eta = np.sqrt(np.arange(1, num_steps + 1, dtype=np.float64))
  points, states, batches = _run_accelerated(
      eta, num_steps=num_steps, beta=beta, radius=radius, clip=1e9,
      noise_multiplier=0.0)

  def proj(v):
    norm = np.linalg.norm(v)
    return v if norm <= radius else v * radius / norm

  def mean_grad(x_tree, batch):
    return np.mean([example_grad(x_tree, batch, i) for i in range(BATCH)], 0)

  prefix = 0.0
  z = flat(points[0])
  for t in range(num_steps):
    # The run's own query points are the reference's inputs; the reference
    # recomputes every output from them and Algorithm 1.
    prefix = prefix + eta[t] * mean_grad(points[t], batches[t])
    if t:
      prefix = prefix - eta[t - 1] * mean_grad(points[t - 1], batches[t])
    grad = prefix / eta[t]
    np.testing.assert_allclose(flat(states[t].estimator.grad), grad,
                               rtol=1e-4, atol=1e-5)
    z = proj(z - eta[t] / beta * grad)
    y = proj(flat(points[t]) - grad / beta)
    np.testing.assert_allclose(flat(states[t].z), z, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(flat(states[t].y), y, rtol=1e-4, atol=1e-5)
    if t + 1 < num_steps:
      tau = eta[t + 1] / np.sum(eta[:t + 2])
      np.testing.assert_allclose(flat(points[t + 1]), (1 - tau) * y + tau * z,
                                 rtol=1e-4, atol=1e-5)
  # The schedule differs from t + 1, so the default would not pass.
  assert not np.allclose(eta, np.arange(1, num_steps + 1))


def test_weight_schedules_are_validated():
  exponential = srg.srg_weights(50, 'exponential', rate=0.5)
  with pytest.raises(ValueError, match=r'fails at t = 5 .*outside_theory'):
    srg.validate_weights(exponential, 50)
  with pytest.warns(srg.ScheduleOutsideTheoryWarning, match='t = 5'):
    srg.validate_weights(exponential, 50, outside_theory='warn')
  np.testing.assert_array_equal(
      srg.validate_weights(exponential, 50, outside_theory='allow'),
      exponential)
  with pytest.raises(ValueError, match='overflow float32'):
    srg.validate_weights(srg.srg_weights(200, 'exponential', rate=0.5), 200,
                         outside_theory='allow')
  with pytest.raises(ValueError, match='non-decreasing'):
    srg.validate_weights([1.0, 3.0, 2.0], 3)
  with pytest.raises(ValueError, match='T = 4 values'):
    srg.validate_weights([1.0, 2.0, 3.0], 4)
  with pytest.raises(ValueError, match='finite and positive'):
    srg.validate_weights([0.0, 1.0], 2)
  with pytest.raises(ValueError, match="gradient='srg'"):
    srg.accelerated_dp_srgd(loss_fn, l2_clip=1.0, noise_multiplier=1.0,
                            num_steps=3, beta=1.0, radius=None, key=0,
                            gradient='independent', weights=[1.0, 2.0, 3.0])
  # Paper 001's e^(lambda t) runs when asked to, with the warning.
  with pytest.warns(srg.ScheduleOutsideTheoryWarning):
    _, states, _ = _run_accelerated(srg.srg_weights(5, 'exponential',
                                                    rate=2.0),
                                    outside_theory='warn')
  assert np.all(np.isfinite(flat(states[-1].y)))
