"""The benchmarks' models, in one place: classifiers, a CNN, transformers.

* classifiers on 784 float inputs and 10 classes (`dense_init`, `dense`,
  `logreg_apply`, `mlp_init` / `mlp_apply`), their softmax cross-entropy
  per example (`example_loss_fn`) and synthetic batches (`make_batch`);
* a small CNN on 28x28 images (`cnn_init` / `cnn_apply`);
* a one-block transformer encoder classifying 32 tokens (`transformer_init`
  / `transformer_apply`, `make_token_batch`);
* the GPT-style decoder of `decoder_step.py` (`DecoderConfig`, `VARIANTS`,
  `decoder_init`, `decoder_apply`, `sequence_loss_fn`, `decoder_batch`,
  and the same architecture in PyTorch, `torch_decoder`).

Every model is a pure function of its params (plain dicts of float32
arrays), with a per-example loss as `dpsco_jax` takes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
Batch = dict[str, Any]
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]

INPUT_DIM = 784
NUM_CLASSES = 10


# ------------------------------------------------------------- classifiers


def dense_init(rng: np.random.Generator, fan_in: int, fan_out: int) -> dict:
  """`{'w', 'b'}` of a dense layer: scaled-normal weights, zero bias.

  Example:
    >>> dense_init(np.random.default_rng(0), 784, 10)['w'].shape
    (784, 10)
  """
  w = rng.normal(size=(fan_in, fan_out)) / np.sqrt(fan_in)
  return {'w': jnp.asarray(w, jnp.float32),
          'b': jnp.zeros((fan_out,), jnp.float32)}


def dense(layer: dict, x: jax.Array) -> jax.Array:
  """Applies a dense layer to `x` (one example or a batch)."""
  return x @ layer['w'] + layer['b']


def logreg_apply(params: dict, x: jax.Array) -> jax.Array:
  """Logits of logistic regression (`params` from `dense_init`)."""
  return dense(params, x)


def mlp_init(rng: np.random.Generator, widths: list[int]) -> dict:
  """Params of a ReLU MLP with these layer widths: `{'layer_k': dense}`.

  Example:
    >>> params = mlp_init(np.random.default_rng(0), [784, 256, 10])
    >>> sorted(params)
    ['layer_0', 'layer_1']
  """
  return {f'layer_{k}': dense_init(rng, fan_in, fan_out)
          for k, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:]))}


def mlp_apply(params: dict, x: jax.Array) -> jax.Array:
  """Logits of a ReLU MLP built by `mlp_init`."""
  for k in range(len(params)):
    x = dense(params[f'layer_{k}'], x)
    if k < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def example_loss_fn(apply: ApplyFn) -> Callable[[PyTree, Batch], jax.Array]:
  """Softmax cross-entropy of `apply` on one example `{'x', 'y'}`.

  Example:
    >>> loss = example_loss_fn(logreg_apply)
  """

  def loss(params: PyTree, example: Batch) -> jax.Array:
    logits = apply(params, example['x'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])

  return loss


def make_batch(rng: np.random.Generator, batch_size: int,
               input_dim: int = INPUT_DIM) -> Batch:
  """A synthetic batch `{'x': [B, input_dim] float32, 'y': [B] int32}`."""
  return {
      'x': jnp.asarray(rng.normal(size=(batch_size, input_dim)), jnp.float32),
      'y': jnp.asarray(rng.integers(0, NUM_CLASSES, size=batch_size),
                       jnp.int32),
  }


# ------------------------------------------------- CNN and encoder


# The transformer encoder: vocabulary, sequence length, width, heads.
VOCABULARY, SEQUENCE, WIDTH, HEADS = 1000, 32, 64, 4


def transformer_init(rng: np.random.Generator,
                     vocabulary: int = VOCABULARY) -> dict:
  """A one-block pre-norm transformer encoder.

  116,426 parameters at the default vocabulary (1000); a large vocabulary
  makes it embedding-heavy.

  Example:
    >>> params = transformer_init(np.random.default_rng(0))
    >>> params['embed'].shape
    (1000, 64)
  """
  normal = lambda *shape, scale: jnp.asarray(
      rng.normal(size=shape) * scale, jnp.float32)
  dense = lambda a, b: normal(a, b, scale=1 / np.sqrt(a))
  return {
      'embed': normal(vocabulary, WIDTH, scale=1.0),
      'position': normal(SEQUENCE, WIDTH, scale=0.1),
      'norm1': {'scale': jnp.ones(WIDTH), 'bias': jnp.zeros(WIDTH)},
      'query': dense(WIDTH, WIDTH), 'key': dense(WIDTH, WIDTH),
      'value': dense(WIDTH, WIDTH), 'attention_out': dense(WIDTH, WIDTH),
      'norm2': {'scale': jnp.ones(WIDTH), 'bias': jnp.zeros(WIDTH)},
      'mlp_in': dense(WIDTH, 4 * WIDTH), 'mlp_in_bias': jnp.zeros(4 * WIDTH),
      'mlp_out': dense(4 * WIDTH, WIDTH), 'mlp_out_bias': jnp.zeros(WIDTH),
      'head': dense(WIDTH, NUM_CLASSES), 'head_bias': jnp.zeros(NUM_CLASSES),
  }


def _layer_norm(x: jax.Array, norm: dict) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centred = x - mean
  scale = jax.lax.rsqrt(jnp.mean(centred**2, axis=-1, keepdims=True) + 1e-5)
  return centred * scale * norm['scale'] + norm['bias']


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int,
               mask: np.ndarray | None = None) -> jax.Array:
  """Multi-head attention of projected `[..., T, width]` queries, keys, values.

  `mask[q, k]` (a constant, data to the ghost analysis) says which keys a
  query may attend to; None: all.
  """
  split = lambda y: y.reshape(y.shape[:-1] + (heads, -1))
  q, k, v = split(q), split(k), split(v)
  scores = jnp.einsum('...qhd,...khd->...hqk', q, k) / np.sqrt(q.shape[-1])
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  mixed = jnp.einsum('...hqk,...khd->...qhd', jax.nn.softmax(scores), v)
  return mixed.reshape(mixed.shape[:-2] + (-1,))


def transformer_apply(params: dict, tokens: jax.Array) -> jax.Array:
  """Logits for token ids `[..., SEQUENCE]` (any leading axes)."""
  h = jnp.take(params['embed'], tokens, axis=0) + params['position']
  x = _layer_norm(h, params['norm1'])
  mixed = _attention(*(x @ params[name] for name in ('query', 'key', 'value')),
                     HEADS)
  h = h + mixed @ params['attention_out']
  x = _layer_norm(h, params['norm2'])
  h = h + (jax.nn.relu(x @ params['mlp_in'] + params['mlp_in_bias'])
           @ params['mlp_out'] + params['mlp_out_bias'])
  return jnp.mean(h, axis=-2) @ params['head'] + params['head_bias']


def make_token_batch(rng: np.random.Generator, batch_size: int,
                     vocabulary: int = VOCABULARY) -> Batch:
  """A synthetic batch {"x": [B, SEQUENCE] int32 ids, "y": [B] int32}."""
  return {
      'x': jnp.asarray(rng.integers(0, vocabulary, (batch_size, SEQUENCE)),
                       jnp.int32),
      'y': jnp.asarray(rng.integers(0, NUM_CLASSES, size=batch_size),
                       jnp.int32),
  }


# The CNN: image side, channels of its two convolutions.
IMAGE_SIDE, CNN_CHANNELS = 28, (16, 32)


def cnn_init(rng: np.random.Generator) -> dict:
  """Two 3x3 convolutions (HWIO kernels) and a dense head (20,490 params)."""
  params, fan_in = {}, 1
  for k, channels in enumerate(CNN_CHANNELS):
    params[f'conv_{k}'] = {
        'kernel': jnp.asarray(rng.normal(size=(3, 3, fan_in, channels)) /
                              np.sqrt(9 * fan_in), jnp.float32),
        'bias': jnp.zeros(channels, jnp.float32)}
    fan_in = channels
  side = IMAGE_SIDE // 2**len(CNN_CHANNELS)
  params['head'] = dense_init(rng, side * side * fan_in,
                                         NUM_CLASSES)
  return params


def cnn_apply(params: dict, x: jax.Array) -> jax.Array:
  """Logits for flattened 28x28 images `[..., 784]` (any leading axes)."""
  lead = x.shape[:-1]
  h = x.reshape((-1, IMAGE_SIDE, IMAGE_SIDE, 1))
  for k in range(len(CNN_CHANNELS)):
    layer = params[f'conv_{k}']
    h = jax.lax.conv_general_dilated(
        h, layer['kernel'], (1, 1), 'SAME',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    h = jax.nn.relu(h + layer['bias'])
    n, height, width, channels = h.shape
    h = jnp.mean(h.reshape(n, height // 2, 2, width // 2, 2, channels),
                 axis=(2, 4))
  logits = dense(params['head'], h.reshape(h.shape[0], -1))
  return logits.reshape(lead + (NUM_CLASSES,))


# ----------------------------------------------------------------- decoder


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Shape of the decoder and of its training batch.

  Attributes:
    vocab: vocabulary size (embedding rows and LM-head outputs).
    width: model width.
    depth: number of pre-LN blocks.
    heads: attention heads per block (they divide `width`).
    mlp: hidden width of each block's MLP.
    seq_len: tokens per sequence (T).
    batch_size: sequences per batch (B).
  """

  vocab: int
  width: int
  depth: int
  heads: int
  mlp: int
  seq_len: int
  batch_size: int

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'{field.name} must be a positive int, got {value!r}')
    if self.width % self.heads:
      raise ValueError(f'heads ({self.heads}) must divide width '
                       f'({self.width})')


VARIANTS = {
    'default': DecoderConfig(vocab=16384, width=512, depth=6, heads=8,
                             mlp=2048, seq_len=256, batch_size=32),
    'wide': DecoderConfig(vocab=16384, width=2048, depth=6, heads=16,
                          mlp=8192, seq_len=256, batch_size=32),
    'tiny': DecoderConfig(vocab=32, width=16, depth=2, heads=2, mlp=64,
                          seq_len=16, batch_size=4),
}

# ----------------------------------------------------------------- JAX model


def decoder_init(key: jax.Array, config: DecoderConfig) -> dict:
  """Initial parameters of the decoder (a dict of float32 arrays).

  Weights are normal with standard deviation 1/sqrt(fan-in) (embeddings
  0.02), biases zero, layer-norm scales one. Pure in `key`, so
  `jax.eval_shape` counts the parameters without allocating them.

  Example:
    >>> config = VARIANTS['tiny']
    >>> params = decoder_init(jax.random.key(0), config)
    >>> params['embed'].shape
    (32, 16)

  Args:
    key: a JAX PRNG key.
    config: the shapes.

  Returns:
    `{'embed', 'position', 'blocks': [per block {'norm1', 'query', 'key',
    'value', 'attention_out', 'norm2', 'mlp_in', 'mlp_out'}], 'norm_out',
    'head'}`; dense layers are `{'w': [in, out], 'b': [out]}`, layer norms
    `{'scale', 'bias'}`.
  """
  d, keys = config.width, iter(jax.random.split(key, 3 + 6 * config.depth))

  def dense(fan_in, fan_out):
    return {'w': jax.random.normal(next(keys), (fan_in, fan_out)) /
                 np.sqrt(fan_in),
            'b': jnp.zeros((fan_out,))}

  def norm():
    return {'scale': jnp.ones((d,)), 'bias': jnp.zeros((d,))}

  params = {
      'embed': 0.02 * jax.random.normal(next(keys), (config.vocab, d)),
      'position': 0.02 * jax.random.normal(next(keys), (config.seq_len, d)),
      'blocks': [],
  }
  for _ in range(config.depth):
    params['blocks'].append({
        'norm1': norm(), 'query': dense(d, d), 'key': dense(d, d),
        'value': dense(d, d), 'attention_out': dense(d, d),
        'norm2': norm(), 'mlp_in': dense(d, config.mlp),
        'mlp_out': dense(config.mlp, d)})
  params['norm_out'] = norm()
  params['head'] = dense(d, config.vocab)
  return params


def count_params(config: DecoderConfig) -> int:
  """The decoder's parameter count, from shapes only (`jax.eval_shape`).

  Example:
    >>> count_params(VARIANTS['default'])
    35840000
  """
  shapes = jax.eval_shape(lambda k: decoder_init(k, config),
                          jax.random.key(0))
  return sum(int(np.prod(leaf.shape))
             for leaf in jax.tree_util.tree_leaves(shapes))


def decoder_apply(params: dict, tokens: jax.Array,
                  config: DecoderConfig) -> jax.Array:
  """Next-token logits `[..., T, vocab]` for token ids `[..., T]`.

  Args:
    params: as built by `decoder_init`.
    tokens: int token ids, any leading axes, last axis `config.seq_len`.
    config: the shapes.

  Returns:
    The logits, float32.
  """
  t, heads = config.seq_len, config.heads
  # A constant of the traced loss (data to the ghost analysis, not a
  # parameter): position p attends to positions <= p.
  causal = np.tril(np.ones((t, t), dtype=bool))
  h = jnp.take(params['embed'], tokens, axis=0) + params['position']
  for block in params['blocks']:
    x = _layer_norm(h, block['norm1'])
    mixed = _attention(*(dense(block[name], x)
                         for name in ('query', 'key', 'value')), heads, causal)
    h = h + dense(block['attention_out'], mixed)
    x = _layer_norm(h, block['norm2'])
    h = h + dense(block['mlp_out'], jax.nn.gelu(dense(block['mlp_in'], x)))
  return dense(params['head'], _layer_norm(h, params['norm_out']))


def sequence_loss_fn(config: DecoderConfig
                     ) -> Callable[[dict, Batch], jax.Array]:
  """`loss(params, example)`: one sequence's mean next-token cross-entropy.

  Example:
    >>> config = VARIANTS['tiny']
    >>> loss = sequence_loss_fn(config)
    >>> batch = decoder_batch(np.random.default_rng(0), config)
    >>> example = jax.tree_util.tree_map(lambda a: a[0], batch)
    >>> loss(decoder_init(jax.random.key(0), config), example).shape
    ()

  Args:
    config: the shapes.

  Returns:
    The per-example (per-sequence) loss: `example` is `{'x': [T] int32
    inputs, 'y': [T] int32 next tokens}`; the result is a scalar.
  """

  def loss(params: dict, example: Batch) -> jax.Array:
    logits = decoder_apply(params, example['x'], config)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, example['y']))

  return loss


def decoder_batch(rng: np.random.Generator, config: DecoderConfig) -> Batch:
  """A synthetic batch: `{'x': [B, T], 'y': [B, T]}` int32, y = x shifted.

  Args:
    rng: numpy generator (the tokens are uniform over the vocabulary).
    config: the shapes.

  Returns:
    The batch as numpy arrays (each framework moves it to its device).
  """
  tokens = rng.integers(0, config.vocab,
                        (config.batch_size, config.seq_len + 1))
  return {'x': tokens[:, :-1].astype(np.int32),
          'y': tokens[:, 1:].astype(np.int32)}


def torch_decoder(config: DecoderConfig):
  """The same decoder as a `torch.nn.Module` (imports torch lazily).

  Args:
    config: the shapes.

  Returns:
    An `nn.Module` mapping int64 tokens `[B, T]` to logits `[B, T, vocab]`.
  """
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  functional = torch.nn.functional

  class Block(nn.Module):
    """Pre-LN block: causal self-attention, then a GELU MLP."""

    def __init__(self):
      super().__init__()
      d = config.width
      self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
      self.query, self.key, self.value = (nn.Linear(d, d) for _ in range(3))
      self.attention_out = nn.Linear(d, d)
      self.mlp_in = nn.Linear(d, config.mlp)
      self.mlp_out = nn.Linear(config.mlp, d)

    def forward(self, h):
      b, t, d = h.shape
      x = self.norm1(h)
      q, k, v = (layer(x).view(b, t, config.heads, -1).transpose(1, 2)
                 for layer in (self.query, self.key, self.value))
      mixed = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      h = h + self.attention_out(mixed.transpose(1, 2).reshape(b, t, d))
      return h + self.mlp_out(functional.gelu(self.mlp_in(self.norm2(h))))

  class Decoder(nn.Module):
    """Embeddings, blocks, final layer norm, untied LM head."""

    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(config.vocab, config.width)
      self.position = nn.Embedding(config.seq_len, config.width)
      self.blocks = nn.ModuleList(Block() for _ in range(config.depth))
      self.norm_out = nn.LayerNorm(config.width)
      self.head = nn.Linear(config.width, config.vocab)

    def forward(self, tokens):
      # Positions with a batch axis, contiguous: Opacus' per-sample hooks
      # need one, and its ghost norms of embeddings `view` the ids.
      positions = torch.arange(tokens.shape[1], device=tokens.device)
      positions = positions.expand_as(tokens).contiguous()
      h = self.embed(tokens) + self.position(positions)
      for block in self.blocks:
        h = block(h)
      return self.head(self.norm_out(h))

  return Decoder()
