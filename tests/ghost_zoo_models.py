"""A zoo of models written the way users write them, for the ghost-norm tests.

Each builder returns `(loss_fn, params, batch)`: `loss_fn(params, example)`
for ONE example (flax models called on a batch of one, `model(x[None])`,
then `.mean()` of an optax loss), `params` the trainable pytree and `batch`
a dict of arrays with a leading example axis of `NUM_EXAMPLES`. Shapes are
tiny: the tests check the path each model takes and the clipped sums, not
speed. `docs/ghost_zoo.md` lists the models and their paths.
"""

from typing import Any, Callable

from flax import linen
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

NUM_EXAMPLES = 6   # reshaped to 3 users of 2 items for user-level sums
T, V, D, H = 4, 11, 8, 2   # positions, vocabulary, width, heads
CLASSES = 3


def _rng(seed: int) -> np.random.Generator:
  return np.random.default_rng(seed)


def _normal(rng, *shape, scale=0.5):
  # Cast in numpy: `jnp.asarray(x, dtype)` of another dtype compiles a
  # program per shape.
  return jnp.asarray((rng.normal(size=shape) * scale).astype(np.float32))


def _images(rng, size=8, channels=3):
  return {'x': _normal(rng, NUM_EXAMPLES, size, size, channels, scale=1.0),
          'y': jnp.asarray(rng.integers(0, CLASSES, NUM_EXAMPLES).astype(
              np.int32))}


def _vectors(rng, features=6):
  return {'x': _normal(rng, NUM_EXAMPLES, features, scale=1.0),
          'y': jnp.asarray(rng.integers(0, CLASSES, NUM_EXAMPLES).astype(
              np.int32))}


def _tokens(rng):
  return {'tokens': jnp.asarray(rng.integers(0, V, (NUM_EXAMPLES, T)).astype(
      np.int32)),
          'labels': jnp.asarray(rng.integers(0, V, (NUM_EXAMPLES, T)).astype(
              np.int32))}


def _classify(logits, y):
  """The batch-of-one form: `[1, classes]` logits, `.mean()` of optax."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, y[None]).mean()


def _next_token(logits, labels, weights=None):
  """optax integer-label cross-entropy over `(T, V)` logits."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  if weights is None:
    return losses.mean()
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _built(module_class: type[nnx.Module]) -> nnx.Module:
  """`module_class(nnx.Rngs(0))`, its initializers run as ONE program.

  Built eagerly, every initializer of every layer shape would compile a
  program of its own.
  """
  return nnx.jit(lambda: module_class(nnx.Rngs(0)))()


def _nnx_loss(model: nnx.Module, forward: Callable[[Any, Any], jax.Array],
              wrt: Any = nnx.Param):
  """`(loss_fn, params)` for an nnx model: params are its `wrt` state.

  The rest of the model's state (frozen weights, anything not `wrt`) is
  closed over, as `nnx.split(model, wrt, ...)` users do.
  """
  graphdef, params, rest = nnx.split(model, wrt, ...)

  def loss_fn(params, example):
    return forward(nnx.merge(graphdef, params, rest), example)

  return loss_fn, params


# ----------------------------------------------------------------------------
# Plain JAX.


def logistic_batch_of_one():
  rng = _rng(0)
  params = {'w': _normal(rng, 6, CLASSES), 'b': _normal(rng, CLASSES)}

  def loss_fn(p, ex):
    return _classify(ex['x'][None] @ p['w'] + p['b'], ex['y'])

  return loss_fn, params, _vectors(rng)


def _attention(q, k, v, mask=None):
  """Multi-head attention over `(T, H, D/H)` queries, keys and values."""
  s = jnp.einsum('thd,shd->hts', q, k) / np.sqrt(q.shape[-1])
  if mask is not None:
    s = jnp.where(mask, s, -1e9)
  return jnp.einsum('hts,shd->thd', jax.nn.softmax(s, axis=-1), v)


def _decoder_params(rng, tied=False):
  p = {'emb': _normal(rng, V, D), 'qkv': _normal(rng, D, 3 * D),
       'proj': _normal(rng, D, D), 'up': _normal(rng, D, 2 * D),
       'down': _normal(rng, 2 * D, D)}
  if not tied:
    p['head'] = _normal(rng, D, V)
  return p


def _decoder(p, tokens, mask, rope=False, tied=False):
  """A pre-norm-free GPT block: attention and MLP, then the LM head."""
  h = p['emb'][tokens]                                   # (T, D)
  q, k, v = jnp.split(h @ p['qkv'], 3, axis=-1)
  q, k, v = (x.reshape(T, H, D // H) for x in (q, k, v))
  if rope:
    q, k = _rotary(q), _rotary(k)
  h = h + _attention(q, k, v, mask).reshape(T, D) @ p['proj']
  h = h + jax.nn.gelu(h @ p['up']) @ p['down']
  return h @ (p['emb'].T if tied else p['head'])        # (T, V)


_CAUSAL = jnp.tril(jnp.ones((T, T), bool))


def decoder_lm_mask_built_inside():
  rng = _rng(1)

  def loss_fn(p, ex):
    mask = jnp.tril(jnp.ones((T, T), bool))
    return _next_token(_decoder(p, ex['tokens'], mask), ex['labels'])

  return loss_fn, _decoder_params(rng), _tokens(rng)


def padding_mask():
  rng = _rng(2)
  batch = _tokens(rng)
  lengths = rng.integers(1, T + 1, NUM_EXAMPLES)
  batch['valid'] = jnp.asarray(np.arange(T)[None] < lengths[:, None])

  def loss_fn(p, ex):
    valid = ex['valid']
    mask = _CAUSAL & valid[None, :] & valid[:, None]
    logits = _decoder(p, ex['tokens'], mask)
    return _next_token(logits, ex['labels'], valid.astype(jnp.float32))

  return loss_fn, _decoder_params(rng), batch


def _rotary(x, base=10000.0):
  """Rotary position embeddings on `(T, H, d)`, angles built in the loss."""
  half = x.shape[-1] // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None] * freqs
  cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def rotary_embeddings():
  rng = _rng(3)

  def loss_fn(p, ex):
    return _next_token(_decoder(p, ex['tokens'], _CAUSAL, rope=True),
                       ex['labels'])

  return loss_fn, _decoder_params(rng), _tokens(rng)


def swiglu():
  rng = _rng(4)
  params = {'gate': _normal(rng, 6, 8), 'up': _normal(rng, 6, 8),
            'down': _normal(rng, 8, CLASSES)}

  def loss_fn(p, ex):
    x = ex['x'][None]
    h = jax.nn.silu(x @ p['gate']) * (x @ p['up'])
    return _classify(h @ p['down'], ex['y'])

  return loss_fn, params, _vectors(rng)


def dropout_per_example_keys():
  rng = _rng(5)
  params = {'w1': _normal(rng, 6, 8), 'b1': _normal(rng, 8),
            'w2': _normal(rng, 8, CLASSES)}
  batch = _vectors(rng)
  batch['key'] = jax.random.split(jax.random.key(0), NUM_EXAMPLES)

  def loss_fn(p, ex):
    h = jax.nn.relu(ex['x'][None] @ p['w1'] + p['b1'])
    keep = jax.random.bernoulli(ex['key'], 0.75, h.shape)
    h = jnp.where(keep, h / 0.75, 0.0)
    return _classify(h @ p['w2'], ex['y'])

  return loss_fn, params, batch


def lora_base_closed_over():
  rng = _rng(6)
  base = {'w1': _normal(rng, 6, 8), 'w2': _normal(rng, 8, CLASSES)}
  params = {'a': _normal(rng, 6, 2), 'b': _normal(rng, 2, 8)}

  def loss_fn(p, ex):
    x = ex['x'][None]
    h = jax.nn.relu(x @ base['w1'] + (x @ p['a']) @ p['b'])
    return _classify(h @ base['w2'], ex['y'])

  return loss_fn, params, _vectors(rng)


def tied_embeddings():
  rng = _rng(7)

  def loss_fn(p, ex):
    return _next_token(_decoder(p, ex['tokens'], _CAUSAL, tied=True),
                       ex['labels'])

  return loss_fn, _decoder_params(rng, tied=True), _tokens(rng)


def lax_scan_layers():
  rng = _rng(8)
  layers = 3
  params = {'w': _normal(rng, layers, 6, 6), 'b': _normal(rng, layers, 6),
            'head': _normal(rng, 6, CLASSES)}

  def loss_fn(p, ex):
    def layer(h, wb):
      w, b = wb
      return jnp.tanh(h @ w + b), None

    h, _ = jax.lax.scan(layer, ex['x'][None], (p['w'], p['b']))
    return _classify(h @ p['head'], ex['y'])

  return loss_fn, params, _vectors(rng)


# ----------------------------------------------------------------------------
# flax nnx and linen.


class _Mlp(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(6, 8, rngs=rngs)
    self.out = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def mlp_nnx():
  rng = _rng(9)
  loss_fn, params = _nnx_loss(
      _built(_Mlp), lambda m, ex: _classify(m(ex['x'][None]), ex['y']))
  return loss_fn, params, _vectors(rng)


def mlp_linen():
  rng = _rng(10)

  class Mlp(linen.Module):

    @linen.compact
    def __call__(self, x):
      return linen.Dense(CLASSES)(linen.relu(linen.Dense(8)(x)))

  model = Mlp()
  batch = _vectors(rng)
  # One compiled init (an eager one compiles a program per operation).
  params = jax.jit(model.init)(jax.random.key(0), batch['x'][:1])['params']

  def loss_fn(p, ex):
    return _classify(model.apply({'params': p}, ex['x'][None]), ex['y'])

  return loss_fn, params, batch


class _Cnn(nnx.Module):

  def __init__(self, rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.norm = nnx.GroupNorm(8, num_groups=2, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (3, 3), strides=2, rngs=rngs)
    self.head = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    return self.head(x.mean(axis=(1, 2)))


def cnn_groupnorm_nnx():
  rng = _rng(11)
  loss_fn, params = _nnx_loss(
      _built(_Cnn), lambda m, ex: _classify(m(ex['x'][None]), ex['y']))
  return loss_fn, params, _images(rng)


class _Residual(nnx.Module):

  def __init__(self, rngs):
    self.inp = nnx.Linear(6, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.fc2 = nnx.Linear(16, 8, rngs=rngs)
    self.head = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    h = self.inp(x)
    h = h + self.fc2(nnx.gelu(self.fc1(self.norm(h))))
    return self.head(h)


def residual_block_nnx():
  rng = _rng(12)
  loss_fn, params = _nnx_loss(
      _built(_Residual),
      lambda m, ex: _classify(m(ex['x'][None]), ex['y']))
  return loss_fn, params, _vectors(rng)


class _Vit(nnx.Module):
  """Patch convolution, learned position embedding, one encoder block."""

  def __init__(self, rngs, patch=4, size=8):
    self.patches = nnx.Conv(3, D, (patch, patch), strides=patch,
                            padding='VALID', rngs=rngs)
    num = (size // patch) ** 2
    self.position = nnx.Param(
        jax.random.normal(rngs.params(), (1, num, D)) * 0.1)
    self.norm1 = nnx.LayerNorm(D, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=H, in_features=D, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(D, rngs=rngs)
    self.fc1 = nnx.Linear(D, 2 * D, rngs=rngs)
    self.fc2 = nnx.Linear(2 * D, D, rngs=rngs)
    self.head = nnx.Linear(D, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = self.patches(x)
    x = x.reshape(x.shape[0], -1, D) + self.position
    x = x + self.attention(self.norm1(x))
    x = x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))
    return self.head(x.mean(axis=1))


def vit_nnx():
  rng = _rng(13)
  loss_fn, params = _nnx_loss(
      _built(_Vit), lambda m, ex: _classify(m(ex['x'][None]), ex['y']))
  return loss_fn, params, _images(rng)


class _Decoder(nnx.Module):
  """A GPT block in nnx: embedding, causal self-attention, MLP, LM head."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.norm1 = nnx.LayerNorm(D, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=H, in_features=D, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(D, rngs=rngs)
    self.fc1 = nnx.Linear(D, 2 * D, rngs=rngs)
    self.fc2 = nnx.Linear(2 * D, D, rngs=rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens, mask):
    x = self.embed(tokens)
    x = x + self.attention(self.norm1(x), mask=mask)
    x = x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))
    return self.head(x)


_NNX_CAUSAL = nnx.make_causal_mask(jnp.ones((1, T)))   # (1, 1, T, T)


def decoder_lm_nnx_mask_closed_over():
  rng = _rng(14)

  def forward(m, ex):
    logits = m(ex['tokens'][None], _NNX_CAUSAL)[0]       # (T, V)
    return _next_token(logits, ex['labels'])

  loss_fn, params = _nnx_loss(_built(_Decoder), forward)
  return loss_fn, params, _tokens(rng)


class _RmsMlp(nnx.Module):

  def __init__(self, rngs):
    self.inp = nnx.Linear(6, 8, use_bias=False, rngs=rngs)
    self.norm = nnx.RMSNorm(8, rngs=rngs)
    self.out = nnx.Linear(8, CLASSES, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(nnx.silu(self.inp(x))))


def rmsnorm_nnx():
  rng = _rng(15)
  loss_fn, params = _nnx_loss(
      _built(_RmsMlp), lambda m, ex: _classify(m(ex['x'][None]), ex['y']))
  return loss_fn, params, _vectors(rng)


class _LoraMlp(nnx.Module):
  """Frozen `nnx.Param` base layers with `nnx.LoRA` adapters."""

  def __init__(self, rngs):
    self.hidden = nnx.LoRA(6, 2, 8, base_module=nnx.Linear(6, 8, rngs=rngs),
                           b_initializer=nnx.initializers.normal(0.5),
                           rngs=rngs)
    self.out = nnx.LoRA(8, 2, CLASSES,
                        base_module=nnx.Linear(8, CLASSES, rngs=rngs),
                        b_initializer=nnx.initializers.normal(0.5), rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def lora_nnx_frozen_state():
  rng = _rng(16)
  # Only the adapters are trained; the base is the non-trainable rest of the
  # state, merged back inside the loss.
  loss_fn, params = _nnx_loss(
      _built(_LoraMlp),
      lambda m, ex: _classify(m(ex['x'][None]), ex['y']), wrt=nnx.LoRAParam)
  return loss_fn, params, _vectors(rng)


class _Block(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(6, 6, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


class _ScannedMlp(nnx.Module):
  """Layers created with `nnx.vmap` and applied with `nnx.scan`."""

  def __init__(self, rngs, layers=3):

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return _Block(rngs)

    self.blocks = create(rngs)
    self.head = nnx.Linear(6, CLASSES, rngs=rngs)

  def __call__(self, x):

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def apply(x, block):
      return block(x)

    return self.head(apply(x, self.blocks))


def nnx_scan_layers():
  rng = _rng(17)
  loss_fn, params = _nnx_loss(
      _built(_ScannedMlp),
      lambda m, ex: _classify(m(ex['x'][None]), ex['y']))
  return loss_fn, params, _vectors(rng)


MODELS = {
    'logistic_batch_of_one': logistic_batch_of_one,
    'mlp_nnx': mlp_nnx,
    'mlp_linen': mlp_linen,
    'cnn_groupnorm_nnx': cnn_groupnorm_nnx,
    'residual_block_nnx': residual_block_nnx,
    'vit_nnx': vit_nnx,
    'decoder_lm_nnx_mask_closed_over': decoder_lm_nnx_mask_closed_over,
    'decoder_lm_mask_built_inside': decoder_lm_mask_built_inside,
    'padding_mask': padding_mask,
    'rotary_embeddings': rotary_embeddings,
    'rmsnorm_nnx': rmsnorm_nnx,
    'swiglu': swiglu,
    'dropout_per_example_keys': dropout_per_example_keys,
    'lora_base_closed_over': lora_base_closed_over,
    'lora_nnx_frozen_state': lora_nnx_frozen_state,
    'tied_embeddings': tied_embeddings,
    'lax_scan_layers': lax_scan_layers,
    'nnx_scan_layers': nnx_scan_layers,
}
