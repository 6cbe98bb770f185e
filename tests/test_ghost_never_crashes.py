"""The ghost-norm analysis never crashes a step.

Constants of a traced loss (literals, closed-over arrays of any type, dtype
or rank, masks) are data to the analysis: they never reach a hash or an
equality test. Any other failure of the analysis, or of tracing the ghost
passes from its plan, becomes a fallback to per-example gradients under
`'auto'` (one `GhostClippingFallbackWarning` naming the reason) and a
`GhostClippingUnsupported` chained to the original error under `'ghost'`.
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import clipping
from dpsco_jax import ghost

T, V, D = 4, 7, 5
CLIP = 0.01  # binds for every example below


def _logistic_batch_of_one():
  """Logistic regression written with a batch axis of one, optax loss."""
  rng = np.random.default_rng(0)
  # Cast in numpy: `jnp.asarray(x, dtype)` of another dtype and `jnp.zeros`
  # compile a program per shape.
  params = {'w': jnp.asarray(rng.normal(size=(4, 3)).astype(np.float32)),
            'b': jnp.asarray(np.zeros(3, np.float32))}

  def loss_fn(p, ex):
    logits = ex['x'][None] @ p['w'] + p['b']
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, ex['y'][None]).mean()

  batch = {'x': jnp.asarray(rng.normal(size=(8, 4)).astype(np.float32)),
           'y': jnp.asarray(rng.integers(0, 3, 8).astype(np.int32))}
  return loss_fn, params, batch


_CLOSED_MASK = jnp.tril(jnp.ones((T, T), bool))


def _attention_lm(mask: str):
  """One-head attention LM; cross-entropy over `(T, V)` logits.

  `mask`: 'none', 'closed' (a causal mask closed over) or 'inside' (the
  same mask built inside the loss).
  """
  rng = np.random.default_rng(1)

  def normal(*shape):
    return jnp.asarray((rng.normal(size=shape) * 0.5).astype(np.float32))

  params = {'emb': normal(V, D), 'q': normal(D, D), 'k': normal(D, D),
            'out': normal(D, V)}

  def loss_fn(p, ex):
    h = p['emb'][ex['tokens']]                       # (T, D)
    s = (h @ p['q']) @ (h @ p['k']).T / jnp.sqrt(D)  # (T, T)
    if mask == 'closed':
      s = jnp.where(_CLOSED_MASK, s, -1e9)
    elif mask == 'inside':
      s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    logits = (jax.nn.softmax(s) @ h) @ p['out']      # (T, V)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, ex['labels']).mean()

  batch = {'tokens': jnp.asarray(rng.integers(0, V, (8, T)).astype(np.int32)),
           'labels': jnp.asarray(rng.integers(0, V, (8, T)).astype(np.int32))}
  return loss_fn, params, batch


ISSUE_LOSSES = {
    'logistic_batch_of_one': _logistic_batch_of_one,
    'lm_loss_over_T_V_logits': lambda: _attention_lm('none'),
    'causal_mask_closed_over': lambda: _attention_lm('closed'),
    'causal_mask_built_inside': lambda: _attention_lm('inside'),
}


def _relative_l2(x, y):
  # numpy: eager jnp would compile a program per leaf shape.
  x = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(x)])
  y = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(y)])
  return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def _jitted(stat):
  """`stat` as one compiled program (eagerly, every op compiles its own)."""
  return jax.jit(lambda batch, params: stat(batch, params))


def _clipped_sum_of_gradients(per_example, clip):
  """numpy float64: `(sum of the rows of per_example clipped to clip, units
  clipped)`; the gradients' leaves flattened per example."""
  rows = np.concatenate([
      np.asarray(g, np.float64).reshape(len(g), -1)
      for g in jax.tree_util.tree_leaves(per_example)], axis=1)
  norms = np.linalg.norm(rows, axis=1)
  return np.minimum(1.0, clip / norms) @ rows, int(np.sum(norms > clip))


@pytest.mark.parametrize('name', sorted(ISSUE_LOSSES))
def test_issue_losses_take_the_ghost_path_through_dpsgd(name):
  loss_fn, params, batch = ISSUE_LOSSES[name]()
  tx = optax.chain(
      dpsco_jax.dpsgd(loss_fn, l2_clip=CLIP, noise_multiplier=1.0,
                      num_steps=10, key=0),
      optax.sgd(0.1))
  stat = clipping.clipped_grad_sum(loss_fn, CLIP, clipping_method='ghost')
  assert stat.ghost_plan(batch, params) is not None

  @jax.jit   # one program: the step, the ghost path, per-example gradients
  def run(params, batch):
    updates, _ = tx.update(None, tx.init(params), params, batch=batch)
    return (updates, stat(batch, params),
            jax.vmap(jax.grad(loss_fn), (None, 0))(params, batch))

  with warnings.catch_warnings():
    # The default path must be the ghost one: a fallback would warn.
    warnings.simplefilter('error', clipping.GhostClippingFallbackWarning)
    updates, ghost_sum, per_example = run(params, batch)
  assert all(np.all(np.isfinite(u))
             for u in jax.tree_util.tree_leaves(updates))
  # The ghost path agrees with per-example gradients clipped to the clip
  # the statistic documents (`clipping.effective_clip`), in numpy.
  expected, clipped = _clipped_sum_of_gradients(
      per_example, clipping.effective_clip(CLIP, 8))
  assert int(ghost_sum.num_clipped) == clipped == 8
  assert _relative_l2(ghost_sum.sum, expected) < 1e-4


# Constants of every kind, each through a structural operation
# (`broadcast_in_dim`, `reshape`, `convert_element_type`) and then used
# with a parameter.
CONSTANTS = {
    'python_float': lambda: 2.0,
    'python_int': lambda: 3,
    'python_bool': lambda: True,
    'numpy_0d': lambda: np.float32(1.5),
    'numpy_vector': lambda: np.arange(3, dtype=np.float32),
    'numpy_int_matrix': lambda: np.ones((3, 3), np.int32),
    'jax_bool_mask': lambda: jnp.tril(jnp.ones((3, 3), bool)),
    'jax_float16_matrix': lambda: jnp.ones((3, 3), jnp.float16),
    'jax_rank3': lambda: jnp.ones((1, 3, 3)),
}


@pytest.mark.parametrize('kind', sorted(CONSTANTS))
def test_constants_of_any_type_are_data(kind):
  constant = CONSTANTS[kind]()
  params = {'w': jnp.ones((3, 3)), 'b': jnp.zeros(3)}

  def loss_fn(p, x):
    c = jnp.broadcast_to(jnp.asarray(constant), (1, 3, 3)).reshape(9)
    c = c.reshape(3, 3).astype(jnp.float32)
    h = x[None] @ p['w'] + p['b']          # a parameter, then the constant
    return jnp.sum(jnp.where(c > 0, h @ c, h))

  batch = jnp.ones((4, 3))
  plan = ghost.analyze(loss_fn, params, batch)
  assert sorted(tap.rule for tap in plan.taps) == ['add', 'dot_general']
  out = _jitted(clipping.clipped_grad_sum(
      loss_fn, CLIP, clipping_method='ghost'))(batch, params)
  assert np.all(np.isfinite(out.sum['w']))


def test_a_constant_meeting_a_parameter_in_one_operation_is_data():
  # `w * c` with a closed-over array `c`: the constant is the operation's
  # other operand, never mistaken for a parameter.
  c = jnp.arange(3.0)
  params = {'w': jnp.ones(3)}

  def loss_fn(p, x):
    return jnp.sum(jnp.broadcast_to(c, (3,)) * p['w'] * x)

  plan = ghost.analyze(loss_fn, params, jnp.ones((4, 3)))
  assert [tap.rule for tap in plan.taps] == ['mul']


def _failing(*args, **kwargs):
  raise TypeError("unhashable type: 'ArrayImpl'")


def test_any_analysis_error_is_unsupported_and_chained(monkeypatch):
  loss_fn, params, batch = _logistic_batch_of_one()
  monkeypatch.setattr(ghost, '_find_taps', _failing)
  with pytest.raises(ghost.GhostClippingUnsupported,
                     match=r"analysis failed \(TypeError: unhashable") as info:
    ghost.analyze(loss_fn, params, batch)
  assert isinstance(info.value.__cause__, TypeError)


def test_any_analysis_error_falls_back_once_under_auto(monkeypatch):
  loss_fn, params, batch = _logistic_batch_of_one()
  monkeypatch.setattr(ghost, '_find_taps', _failing)
  stat = clipping.clipped_grad_sum(loss_fn, CLIP)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    out = _jitted(stat)(batch, params)
    _jitted(stat)(batch, params)  # traced again: announced once all the same
  fallbacks = [w for w in caught
               if issubclass(w.category, clipping.GhostClippingFallbackWarning)]
  assert len(fallbacks) == 1
  assert "analysis failed (TypeError: unhashable type: 'ArrayImpl')" in str(
      fallbacks[0].message)
  vmap_sum = _jitted(clipping.clipped_grad_sum(
      loss_fn, CLIP, clipping_method='vmap'))(batch, params)
  assert _relative_l2(out.sum, vmap_sum.sum) < 1e-6


@pytest.mark.parametrize('target', ['analyze', 'signature'])
def test_under_ghost_only_unsupported_leaves(monkeypatch, target):
  # An unexpected error in the analysis, or in the statistic's own
  # preparation of it, reaches the user as GhostClippingUnsupported with
  # the original error chained.
  loss_fn, params, batch = _logistic_batch_of_one()
  stat = clipping.clipped_grad_sum(loss_fn, CLIP, clipping_method='ghost')
  if target == 'analyze':
    monkeypatch.setattr(ghost, 'analyze', _failing)
  else:
    stat = dataclasses.replace(stat, ghost_form=clipping.GhostForm(
        signature=_failing, terms=clipping.GRADIENT_FORM.terms))
  with pytest.raises(ghost.GhostClippingUnsupported,
                     match=r"clipping_method='ghost' cannot apply: the analysis failed "
                     r"\(TypeError") as info:
    stat(batch, params)
  assert isinstance(info.value.__cause__, TypeError)


def test_describe_error_is_short_and_refuses_a_tiny_limit():
  assert ghost.describe_error(ValueError('a\nb')) == 'ValueError: a'
  assert ghost.describe_error(KeyError()) == 'KeyError'
  assert len(ghost.describe_error(ValueError('x' * 1000), limit=50)) == 50
  with pytest.raises(ValueError, match='at least 20'):
    ghost.describe_error(ValueError('x'), limit=5)
