"""Ghost clipping on a zoo of models written the way users write them.

Every model of `ghost_zoo_models.MODELS` runs through `clipped_grad_sum`,
`clipped_grad_difference_sum` and `clipped_user_grad_sum` with the default
`'auto'` method, and must: not crash; take the ghost path, or fall back with
the reason `docs/ghost_zoo.md` documents (asserted verbatim); give the
clipped sum of the per-example gradients (`jax.vmap(jax.grad(loss_fn))`,
clipped to `clipping.effective_clip` and summed in float64 numpy) to 1e-4
relative l2 with a clip that
binds for every unit; and keep every unit's contribution within
[0.999, 1] of the clip.
"""

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping
from tests import ghost_zoo_models as zoo

CLIP = 1e-3   # far below every unit's gradient norm: the clip binds
USERS, ITEMS = 3, 2
assert USERS * ITEMS == zoo.NUM_EXAMPLES

# The documented fallback reason of each model that does not take the ghost
# path (None: the ghost path), quoted verbatim in docs/ghost_zoo.md.
FALLBACKS = {
    'lax_scan_layers': (
        "params leaf ['b'] is used by `scan` (layers stacked with `lax.scan` "
        'or `nnx.scan`): ghost norms do not follow a parameter into a loop or '
        'branch body; apply the layers in a Python loop to take the ghost '
        'path'),
    'nnx_scan_layers': (
        "params leaf ['blocks']['linear']['bias'].value is used by `scan` "
        '(layers stacked with `lax.scan` or `nnx.scan`): ghost norms do not '
        'follow a parameter into a loop or branch body; apply the layers in '
        'a Python loop to take the ghost path'),
}

STATISTICS = ('grad', 'difference', 'user')


@functools.lru_cache(maxsize=None)
def _model(name):
  return zoo.MODELS[name]()


def _shifted(params, seed=0):
  """A nearby previous point for the gradient difference."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  rng = np.random.default_rng(seed)
  # numpy: eager jnp arithmetic would compile a program per leaf shape.
  return jax.tree_util.tree_unflatten(treedef, [
      np.asarray(leaf) + (rng.normal(size=leaf.shape) * 0.05).astype(
          leaf.dtype) for leaf in leaves])


@functools.lru_cache(maxsize=None)
def _per_example_gradients(name):
  """Every example's gradient at `params` and at `_shifted(params)`.

  Two `[examples, parameters]` float64 numpy arrays (leaves in `_flat`'s
  order), from ONE compiled `vmap(grad)` per model, shared by the model's
  three statistics: the reference each statistic's clipped sum is held to.
  """
  loss_fn, params, batch = _model(name)
  grads = jax.jit(jax.vmap(jax.grad(loss_fn), (None, 0)))

  def flat(tree):
    return np.concatenate([
        np.asarray(leaf, np.float64).reshape(zoo.NUM_EXAMPLES, -1)
        for leaf in jax.tree_util.tree_leaves(tree)], axis=1)

  return flat(grads(params, batch)), flat(grads(_shifted(params), batch))


def _reference(name, kind):
  """`(clipped sum, units clipped)` of the statistic `kind`, in numpy.

  A unit's contribution is its example's gradient (`'grad'`),
  `1.5 g(params) - 1.0 g(shifted)` (`'difference'`, the coefficients of
  `_arguments`) or the mean of its items' gradients (`'user'`), scaled by
  `min(1, clip / norm)` and summed, `clip` the documented clip of a batch
  of that many units (`clipping.effective_clip`: 2.1e-4 below `CLIP`, the
  margin that pays for the rounding of the batch sum).
  """
  at_params, at_shifted = _per_example_gradients(name)
  contributions = {
      'grad': at_params,
      'difference': 1.5 * at_params - 1.0 * at_shifted,
      'user': at_params.reshape(USERS, ITEMS, -1).mean(axis=1)}[kind]
  norms = np.linalg.norm(contributions, axis=1)
  clip = clipping.effective_clip(CLIP, len(contributions))
  factors = np.minimum(1.0, clip / norms)
  return factors @ contributions, int(np.sum(norms > CLIP))


def _statistic(kind, loss_fn, method):
  make = {'grad': clipping.clipped_grad_sum,
          'difference': clipping.clipped_grad_difference_sum,
          'user': clipping.clipped_user_grad_sum}[kind]
  return make(loss_fn, CLIP, clipping_method=method)


def _arguments(kind, params, batch):
  """`(batch, *args)` of the statistic `kind`."""
  if kind == 'grad':
    return batch, (params,)
  if kind == 'difference':
    return batch, (params, _shifted(params), 1.5, 1.0)
  # numpy where it can (key arrays stay jax arrays): eager jnp reshapes
  # would compile a program per leaf shape.
  host = lambda x: x if jax.dtypes.issubdtype(
      x.dtype, jax.dtypes.prng_key) else np.asarray(x)
  users = jax.tree_util.tree_map(
      lambda x: host(x).reshape((USERS, ITEMS) + x.shape[1:]), batch)
  return users, (params,)


def _flat(tree):
  return jnp.concatenate([jnp.ravel(x).astype(jnp.float32)
                          for x in jax.tree_util.tree_leaves(tree)])


def _fallbacks(caught):
  return [str(w.message) for w in caught
          if issubclass(w.category, clipping.GhostClippingFallbackWarning)]


def _cases():
  for name in sorted(zoo.MODELS):
    for kind in STATISTICS:
      yield pytest.param(name, kind, id=f'{name}-{kind}')


@pytest.mark.parametrize('name,kind', list(_cases()))
def test_zoo(name, kind):
  loss_fn, params, batch = _model(name)
  batch, args = _arguments(kind, params, batch)
  units = jax.tree_util.tree_leaves(batch)[0].shape[0]
  auto = _statistic(kind, loss_fn, 'auto')

  # One compiled call: every unit's contribution alone (a one-hot mask) on
  # the 'auto' path (their sum is the clipped sum). `lax.map`, not `vmap`,
  # over the masks: the 'auto' path is compiled once as the loop's body
  # instead of batched over the masks (a larger program to compile).
  @jax.jit
  def run(batch, args):
    one = lambda mask: _flat(auto(batch, *args, mask=mask).sum)
    return jax.lax.map(one, jnp.eye(units, dtype=bool))

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    rows = run(batch, args)
  # The path: 'auto' warns exactly when it falls back (once per reason).
  reason = FALLBACKS.get(name)
  assert _fallbacks(caught) == ([] if reason is None else [
      f'ghost clipping does not apply ({reason}); the clipped sum uses '
      'per-example gradients (vmap) instead: same result, slower'])
  expected, clipped = _reference(name, kind)
  assert clipped == units   # the clip binds for every unit
  # Measured in float64 numpy (eager jnp would compile per shape).
  rows = np.asarray(rows, np.float64)
  error = float(np.linalg.norm(np.sum(rows, axis=0) - expected) /
                np.linalg.norm(expected))
  assert error < 1e-4, error
  ratios = np.linalg.norm(rows, axis=1) / CLIP
  # 1e-6: the float32 measurement of a norm at the clip, not the clipping.
  assert np.all(ratios <= 1.0 + 1e-6) and np.all(ratios >= 0.999), ratios


def test_the_ghost_path_is_taken_where_documented():
  # The warning-based path check above, confirmed by the plan itself.
  for name in ('tied_embeddings', 'lax_scan_layers'):
    loss_fn, params, batch = _model(name)
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', clipping.GhostClippingFallbackWarning)
      plan = clipping.clipped_grad_sum(loss_fn, CLIP).ghost_plan(batch, params)
    assert (plan is None) == (name in FALLBACKS)


def test_every_fallback_reason_is_documented_verbatim():
  page = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'docs',
                      'ghost_zoo.md')
  with open(page, encoding='utf-8') as f:
    text = f.read()
  for name in zoo.MODELS:
    assert f'`{name}`' in text, name
  for reason in FALLBACKS.values():
    assert reason in text, reason
