"""Tests for `dpsco_jax.noise`: noise scales, trees, restarts and capacity.

Expected variances come from the node decomposition of each step, derived
here independently of the library: the standard tree's prefix noise at step t
sums popcount(t+1) independent nodes and its residual noise 1 + ctz(t+1); the
Honaker estimates are rebuilt as explicit combinations of the node draws.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from scipy import stats

import dpsco_jax
from dpsco_jax import noise

STEPS = 40
RESTART = 5
# One leaf of 20000 coordinates: the sample variance is within ~1% (one
# standard error) of the truth. A single leaf because every leaf adds node
# draws to a tree's `next`, whose compilation dominates these tests.
LARGE = {'w': np.zeros((100, 200), np.float32)}
# The KS tests use the first few steps and ~4096 coordinates of each draw.
KS_STEPS = 8
KS_COORDINATES = 4096
SMALL = {'w': np.zeros((3, 2), np.float32), 'b': np.zeros(5, np.float32)}
# Two leaves of one shape, so a key reused across leaves shows as equal noise.
PAIR = {'a': np.zeros(64, np.float32), 'b': np.zeros(64, np.float32)}


def _popcount(n):
  return bin(n).count('1')


def _ctz(n):
  return (n & -n).bit_length() - 1


def _ones(key, shape, dtype):
  del key
  return jnp.ones(shape, dtype)


@functools.cache
def _honaker_prefix_rows(tree_size):
  """Each step's Honaker prefix noise as coefficients on the node draws.

  A node's estimate is the inverse-variance weighted mean of its own
  unit-variance draw and the sum of its children's estimates.

  Args:
    tree_size: leaves of the tree.

  Returns:
    `[tree_size, num_nodes]`; row t is the prefix noise of step t.
  """
  num_levels = tree_size.bit_length()
  nodes = [(level, index) for level in range(num_levels)
           for index in range(1, (tree_size >> level) + 1)]
  estimates = {}
  for node, draw in zip(nodes, np.eye(len(nodes))):
    level, index = node
    if level == 0:
      estimates[node] = draw
      continue
    children = (estimates[(level - 1, 2 * index - 1)] +
                estimates[(level - 1, 2 * index)])
    variance = children @ children
    estimates[node] = (variance * draw + children) / (variance + 1.0)
  return np.stack([
      sum(estimates[(level, i >> level)] for level in range(num_levels)
          if (i >> level) & 1)
      for i in range(1, tree_size + 1)])


def _honaker_prefix_variance(t):
  return sum(1.0 / (2.0 - 2.0 ** -level)
             for level in range((t + 1).bit_length()) if ((t + 1) >> level) & 1)


def _honaker_residual_variance(t):
  rows = _honaker_prefix_rows(STEPS)
  residual = rows[t] - (rows[t - 1] if t else 0.0)
  return residual @ residual


# (release, honaker) -> variance of one coordinate at local step t of a tree.
LOCAL_VARIANCE = {
    ('prefix', False): lambda t: _popcount(t + 1),
    ('per_step', False): lambda t: 1 + _ctz(t + 1),
    ('prefix', True): _honaker_prefix_variance,
    ('per_step', True): _honaker_residual_variance,
}


def _tree_name(release, honaker, restart_every):
  restarted = ['restarted'] if restart_every else []
  return '_'.join(['honaker' if honaker else 'tree', release] + restarted)


def _tree_case(release, honaker, restart_every):
  """A tree mechanism factory and its per-step variance."""
  tree_size = restart_every or STEPS
  local_variance = LOCAL_VARIANCE[(release, honaker)]
  return (lambda: noise.tree(STEPS, release=release, honaker=honaker,
                             restart_every=restart_every),
          lambda t: local_variance(t % tree_size))


# name -> (mechanism factory, variance of one noise coordinate at step t).
MECHANISMS = {
    'gaussian': (noise.gaussian, lambda t: 1.0),
    **{_tree_name(*case): _tree_case(*case)
       for case in itertools.product(('per_step', 'prefix'), (False, True),
                                     (None, RESTART))},
}


def _draws(mech, template, num_steps):
  """The first `num_steps` noises of `mech`, as `[num_steps, coordinates]`.

  One jitted scan (eager steps compile every `lax.cond` afresh), from the
  fixed key 0 so that every test is deterministic.

  Args:
    mech: a `NoiseMechanism`.
    template: the params-like pytree.
    num_steps: how many steps to draw.

  Returns:
    A float64 numpy array, the leaves of each step's noise concatenated.
  """
  def run(key, template):
    def step(state, _):
      noise_t, state = mech.next(state, template)
      return state, noise_t
    _, noises = jax.lax.scan(step, mech.init(template, key), None,
                             length=num_steps)
    return noises

  noises = jax.jit(run)(jax.random.key(0), template)
  return np.concatenate(
      [np.asarray(leaf, np.float64).reshape(num_steps, -1)
       for leaf in jax.tree_util.tree_leaves(noises)], axis=1)


@functools.cache
def _large_draws(name):
  """Shared by the distribution tests, so each mechanism compiles once."""
  return _draws(MECHANISMS[name][0](), LARGE, STEPS)


@pytest.mark.parametrize('name', sorted(MECHANISMS))
def test_noise_std_passes_ks_only_at_the_right_scale(name):
  variance = MECHANISMS[name][1]
  p_values = []
  for t, draw in enumerate(_large_draws(name)[:KS_STEPS, :KS_COORDINATES]):
    normalized = draw / np.sqrt(variance(t))
    p_values.append(stats.kstest(normalized, 'norm').pvalue)
    for wrong in (2 / 3, 3 / 2):
      assert stats.kstest(normalized / wrong, 'norm').pvalue < 0.01, (
          f'step {t}: a std off by {wrong} is not detected')
  # One test per mechanism over its steps (Bonferroni): at 0.01 per step,
  # ~70 step-level tests would reject a correct mechanism by chance about
  # half the time, whatever the seed.
  assert min(p_values) * KS_STEPS > 0.01, p_values


@pytest.mark.parametrize('name', sorted(MECHANISMS))
def test_noise_variance_matches_node_decomposition(name):
  variance = MECHANISMS[name][1]
  # The mean square, not the variance about the sample mean: a bias fails too.
  np.testing.assert_allclose(np.mean(_large_draws(name) ** 2, axis=1),
                             [variance(t) for t in range(STEPS)], rtol=0.05)


@pytest.mark.parametrize('num_steps', [16, 17, 19, 1024])
def test_tree_with_ones_sampler_counts_nodes_exactly(num_steps):
  # Every node is 1, so the noise at step t counts the nodes it sums. 1024
  # steps also cover t = 0..31 of a larger tree.
  prefix = _draws(noise.tree(num_steps, release='prefix', sampler=_ones),
                  SMALL, num_steps)
  per_step = _draws(noise.tree(num_steps, sampler=_ones), SMALL, num_steps)
  counts = [_popcount(t + 1) for t in range(num_steps)]
  expected = np.broadcast_to(np.array(counts, float)[:, None], prefix.shape)
  np.testing.assert_array_equal(prefix, expected)
  assert prefix[-1, 0] == _popcount(num_steps)
  np.testing.assert_array_equal(np.cumsum(per_step, axis=0), expected)


def _with_finished_trees(prefix, restart_every):
  """The sum of per-step noises: the current tree's prefix noise plus the
  final prefix noise of every finished tree, which stays in the iterate."""
  if restart_every is None:
    return prefix
  finals = prefix[restart_every - 1::restart_every]
  return prefix + np.stack([finals[:t // restart_every].sum(axis=0)
                            for t in range(len(prefix))])


@pytest.mark.parametrize('honaker', [False, True])
@pytest.mark.parametrize('restart_every', [None, RESTART])
def test_per_step_noise_accumulates_to_prefix_noise(honaker, restart_every):
  # Same key, so the same nodes: each node must be regenerated identically.
  per_step = _large_draws(_tree_name('per_step', honaker, restart_every))
  prefix = _large_draws(_tree_name('prefix', honaker, restart_every))
  np.testing.assert_allclose(np.cumsum(per_step, axis=0),
                             _with_finished_trees(prefix, restart_every),
                             rtol=1e-5, atol=1e-4)


def test_restarted_tree_with_ones_sampler():
  num_steps = 17
  local = np.array([_popcount(t % RESTART + 1) for t in range(num_steps)])
  finished = np.arange(num_steps) // RESTART * _popcount(RESTART)
  prefix = _draws(noise.tree(num_steps, release='prefix',
                             restart_every=RESTART, sampler=_ones),
                  SMALL, num_steps)
  per_step = _draws(noise.tree(num_steps, restart_every=RESTART,
                               sampler=_ones), SMALL, num_steps)
  np.testing.assert_array_equal(prefix[:, 0], local)
  np.testing.assert_array_equal(np.cumsum(per_step, axis=0)[:, 0],
                                local + finished)


@pytest.mark.parametrize(
    'name', ['tree_per_step_restarted', 'tree_prefix_restarted'])
def test_restarted_trees_are_independent(name):
  # Steps 0 and RESTART are each the first leaf node of their own tree.
  first_tree, second_tree = _large_draws(name)[[0, RESTART]]
  assert not np.allclose(first_tree, second_tree)
  assert abs(np.corrcoef(first_tree, second_tree)[0, 1]) < 0.05


@functools.cache
def _capped(name):
  """Three-step mechanisms, cached so their jitted `next` compiles once.

  The trees use the ones sampler: the refusal does not depend on the node
  values, and an eager tree step with real draws takes seconds.

  Args:
    name: 'gaussian', 'tree' or 'honaker_prefix'.

  Returns:
    The `NoiseMechanism`.
  """
  return {
      'gaussian': lambda: noise.gaussian(num_steps=3),
      'tree': lambda: noise.tree(3, sampler=_ones),
      'honaker_prefix': lambda: noise.tree(3, release='prefix', honaker=True,
                                           sampler=_ones),
  }[name]()


def _state_at_capacity(mech):
  """The state after `num_steps` real draws, each finite."""
  state = mech.init(SMALL, jax.random.key(0))
  for _ in range(mech.num_steps):
    noise_t, state = jax.jit(mech.next)(state, SMALL)
    for leaf in jax.tree_util.tree_leaves(noise_t):
      assert np.all(np.isfinite(leaf))
  return state


@pytest.mark.parametrize('name', ['gaussian', 'tree'])
def test_eager_next_past_capacity_raises(name):
  mech = _capped(name)
  state = _state_at_capacity(mech)
  with pytest.raises(ValueError, match='capacity'):
    mech.next(state, SMALL)


@pytest.mark.parametrize('name', ['gaussian', 'tree', 'honaker_prefix'])
def test_jitted_next_past_capacity_raises(name):
  mech = _capped(name)
  state = _state_at_capacity(mech)
  # Inside jit: the noise is NaN and the refusal is recorded in the state.
  noise, state = jax.jit(mech.next)(state, SMALL)
  assert all(np.all(np.isnan(np.asarray(leaf)))
             for leaf in jax.tree_util.tree_leaves(noise))
  with pytest.raises(dpsco_jax.PrivacyGuardError) as info:
    dpsco_jax.raise_if_refused(state)
  assert 'capacity' in str(info.value)
  assert info.value.step == mech.num_steps


def _assert_identical(tree_a, tree_b):
  assert (jax.tree_util.tree_structure(tree_a) ==
          jax.tree_util.tree_structure(tree_b))
  for a, b in zip(jax.tree_util.tree_leaves(tree_a),
                  jax.tree_util.tree_leaves(tree_b)):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))



# Two-step trees: the smallest with two steps, the quickest to compile.
@pytest.mark.parametrize('make', [
    noise.gaussian,
    lambda: noise.tree(2),
    lambda: noise.tree(2, release='prefix'),
    lambda: noise.tree(2, honaker=True),
], ids=['gaussian', 'tree_per_step', 'tree_prefix', 'honaker_per_step'])
def test_jitted_next_is_pure_and_never_reuses_a_key(make):
  mech = make()
  next_noise = jax.jit(mech.next)
  state = mech.init(PAIR, jax.random.key(0))
  first = next_noise(state, PAIR)
  _assert_identical(first, next_noise(state, PAIR))
  second_step, _ = next_noise(first[1], PAIR)
  other_key, _ = next_noise(mech.init(PAIR, jax.random.key(1)), PAIR)
  noise_t = first[0]
  # Identical leaves would mean one key drawn twice.
  assert not np.allclose(noise_t['a'], noise_t['b'])
  assert not np.allclose(noise_t['a'], second_step['a'])
  assert not np.allclose(noise_t['a'], other_key['a'])


def test_eager_next_is_pure():
  # The Honaker tree is the one mechanism whose state carries noise buffers;
  # a one-step tree keeps the (slow) eager evaluation short.
  mech = noise.tree(1, honaker=True)
  state = mech.init(SMALL, jax.random.key(0))
  first = mech.next(state, SMALL)
  _assert_identical(first, mech.next(state, SMALL))
  assert int(first[1].step) == 1
  assert np.any(np.asarray(jax.tree_util.tree_leaves(first[1].buffers)[0]))


@pytest.mark.parametrize('name', sorted(MECHANISMS))
def test_noise_is_float32_and_shaped_like_the_template(name):
  mech = MECHANISMS[name][0]()
  template = {'half': np.zeros((3, 2), jnp.bfloat16),
              'single': np.zeros(5, np.float32)}
  state = mech.init(template, jax.random.key(0))
  noise_t, next_state = jax.eval_shape(mech.next, state, template)
  for key, leaf in template.items():
    assert noise_t[key].shape == leaf.shape
    assert noise_t[key].dtype == jnp.float32
  for buffer in jax.tree_util.tree_leaves(next_state.buffers):
    assert buffer.dtype == jnp.float32


@pytest.mark.parametrize('num_steps', [1, 2, 5, 8, 17, 64])
def test_tree_encoder_counts_one_node_per_level_for_the_first_step(num_steps):
  matrix = noise.tree_encoder_matrix(num_steps)
  num_levels = noise.tree_num_levels(num_steps)
  assert num_levels == int(np.log2(num_steps)) + 1
  assert set(np.unique(matrix)) <= {0.0, 1.0}
  # The first step is in one node per level: the worst-case column.
  assert matrix[:, 0].sum() == num_levels
  assert matrix.sum(axis=0).max() <= num_levels


def test_restarted_tree_encoder_is_block_diagonal():
  matrix = noise.tree_encoder_matrix(12, restart_every=RESTART)
  expected = scipy.linalg.block_diag(*[
      noise.tree_encoder_matrix(size) for size in (RESTART, RESTART, 2)])
  np.testing.assert_array_equal(matrix, expected)
  np.testing.assert_array_equal(
      noise.tree(12, restart_every=RESTART).encoder_matrix(), matrix)


@pytest.mark.parametrize('name', sorted(MECHANISMS))
def test_decoder_gives_the_exact_variance_of_every_step(name):
  make = MECHANISMS[name][0]
  mech = make(STEPS) if name == 'gaussian' else make()
  decoder = mech.decoder_matrix()
  assert decoder.shape == (STEPS, mech.encoder_matrix().shape[0])
  np.testing.assert_allclose(np.sum(decoder ** 2, axis=1),
                             [MECHANISMS[name][1](t) for t in range(STEPS)],
                             rtol=1e-12)


@pytest.mark.parametrize('honaker', [False, True])
@pytest.mark.parametrize('restart_every', [None, RESTART])
def test_tree_prefix_decoder_is_unbiased(honaker, restart_every):
  # Decoding the noiseless node sums must give back the prefix sums of the
  # current tree: D C = A within each tree.
  mech = noise.tree(STEPS, release='prefix', honaker=honaker,
                    restart_every=restart_every)
  tree_size = restart_every or STEPS
  steps = np.arange(STEPS)
  same_tree = np.equal.outer(steps // tree_size, steps // tree_size)
  expected = np.tril(np.ones((STEPS, STEPS))) * same_tree
  np.testing.assert_allclose(mech.decoder_matrix() @ mech.encoder_matrix(),
                             expected, atol=1e-12)


def test_honaker_decoder_matches_the_independent_reconstruction():
  decoder = noise.tree(STEPS, release='prefix', honaker=True).decoder_matrix()
  np.testing.assert_allclose(decoder, _honaker_prefix_rows(STEPS), atol=1e-12)


@pytest.mark.parametrize('release', ['per_step', 'prefix'])
@pytest.mark.parametrize('restart_every', [None, RESTART])
def test_standard_tree_decoder_reproduces_the_ones_sampler(release,
                                                           restart_every):
  num_steps = 17
  decoded = noise.tree(num_steps, release=release,
                       restart_every=restart_every).decoder_matrix().sum(axis=1)
  drawn = _draws(noise.tree(num_steps, release=release, sampler=_ones,
                            restart_every=restart_every), SMALL, num_steps)
  np.testing.assert_array_equal(drawn, np.broadcast_to(decoded[:, None],
                                                       drawn.shape))


@pytest.mark.parametrize('template', [
    {'w': np.zeros(4, np.float32)},
    {'v': np.zeros(3, np.float32)},
])
def test_honaker_state_must_match_the_template(template):
  mech = noise.tree(4, honaker=True)
  state = mech.init({'w': np.zeros(3, np.float32)}, jax.random.key(0))
  with pytest.raises(ValueError, match='does not match'):
    mech.next(state, template)


@pytest.mark.parametrize('make, match', [
    (lambda: noise.tree(0), 'num_steps must be a positive integer'),
    (lambda: noise.tree(10, release='bad'),
     "release must be 'per_step' or 'prefix'"),
    (lambda: noise.gaussian(num_steps=-1),
     'num_steps must be a positive integer'),
])
def test_invalid_arguments_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize('restart_every', [None, 5])
def test_running_prefix_equals_regenerated_prefix(restart_every):
  template = {'w': jnp.zeros((3, 2)), 'b': jnp.zeros(4, jnp.bfloat16)}
  kinds = {storage: noise.tree(13, release='prefix',
                               restart_every=restart_every,
                               prefix_storage=storage)
           for storage in ('regenerate', 'running')}
  assert kinds['running'].identity != kinds['regenerate'].identity
  np.testing.assert_array_equal(kinds['running'].encoder_matrix(),
                                kinds['regenerate'].encoder_matrix())
  states = {k: m.init(template, jax.random.key(2)) for k, m in kinds.items()}
  for _ in range(13):
    draws = {}
    for k, m in kinds.items():
      draws[k], states[k] = m.next(states[k], template)
    for a, b in zip(jax.tree.leaves(draws['running']),
                    jax.tree.leaves(draws['regenerate'])):
      np.testing.assert_allclose(np.asarray(a, np.float32),
                                 np.asarray(b, np.float32), rtol=1e-5,
                                 atol=1e-5)
  with pytest.raises(ValueError, match='past'):
    kinds['running'].next(states['running'], template)


def test_running_prefix_is_only_for_plain_prefix_trees():
  with pytest.raises(ValueError, match="prefix_storage='running'"):
    noise.tree(8, release='per_step', prefix_storage='running')
  with pytest.raises(ValueError, match="prefix_storage='running'"):
    noise.tree(8, release='prefix', honaker=True, prefix_storage='running')
  with pytest.raises(ValueError, match='regenerate'):
    noise.tree(8, release='prefix', prefix_storage='cached')
