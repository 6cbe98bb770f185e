"""Flax (nnx) models for the experiments, and the one-example loss they need.

Every private transformation of dpsco_jax takes `loss_fn(params, example)`
for ONE example (no batch axis) and a params pytree. A flax nnx model is
both code and state; `split` separates them once, and `example_loss` makes
the one-example loss from the model's code (it adds the batch axis of one
that flax layers expect, and takes it off again):

    model = models.MLP([64, 128, 10], rngs=nnx.Rngs(0))
    graphdef, params = models.split(model)
    loss_fn = models.example_loss(graphdef, models.cross_entropy)
    plan = dpsco_jax.plans.dpsgd(loss_fn, optimizer=optax.sgd(0.1), ...)
    opt_state = plan.init(params)
    ...
    logits = models.apply(graphdef, params, test['x'])   # a batch

Under the default `clipping_method='auto'` the MLP and the CNN both take
the ghost-norm path of `dpsco_jax.clipping` (no per-example gradients;
`ClippedStatistic.clipping_choice` shows the path and its cost estimates);
a loss the ghost analysis cannot follow falls back to per-example
gradients, announced once (`GhostClippingFallbackWarning`).

`Decoder` is a small GPT-style language model whose dense layers carry
LoRA adapters; `split_trainable` picks the adapters or the base to train
and `lm_example_loss` is its one-sequence loss, the rest closed over.

flax is an experiments dependency (the `experiments` extra), not a core
one: the library itself only needs a params pytree and a loss function.
"""

from typing import Any, Callable, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import optax

PyTree = Any


class MLP(nnx.Module):
  """A ReLU multilayer perceptron.

  Example:
    >>> model = MLP([64, 128, 10], rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((5, 64))).shape
    (5, 10)

  Args:
    sizes: input, hidden... and output widths.
    rngs: flax's random streams (for the initialization).
  """

  def __init__(self, sizes: Sequence[int], *, rngs: nnx.Rngs):
    if len(sizes) < 2:
      raise ValueError(f'an MLP needs an input and an output size, got '
                       f'{list(sizes)}')
    self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                            for a, b in zip(sizes[:-1], sizes[1:])])

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    for layer in self.layers[:-1]:
      x = jax.nn.relu(layer(x))
    return self.layers[-1](x)


class CNN(nnx.Module):
  """A small convolutional network for square grey images ([B, S, S]).

  Two 3x3 convolutions with ReLU, 2x2 average pooling after the first, then
  a linear classifier on the flattened features (no normalization layers:
  batch statistics mix examples, which per-example clipping forbids).

  Example:
    >>> model = CNN(num_classes=10, image_size=8, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((5, 8, 8))).shape
    (5, 10)

  Args:
    num_classes: outputs.
    image_size: S, the images' side (even).
    channels: the two convolutions' widths.
    rngs: flax's random streams.
  """

  def __init__(self, num_classes: int, image_size: int,
               channels: Sequence[int] = (16, 32), *, rngs: nnx.Rngs):
    if image_size < 2 or image_size % 2:
      raise ValueError(f'image_size must be even and >= 2, got {image_size}')
    first, second = channels
    self.conv1 = nnx.Conv(1, first, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(first, second, kernel_size=(3, 3), rngs=rngs)
    self.head = nnx.Linear((image_size // 2) ** 2 * second, num_classes,
                           rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x[..., None]                                   # [B, S, S, 1]
    x = jax.nn.relu(self.conv1(x))
    x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = jax.nn.relu(self.conv2(x))
    return self.head(x.reshape(x.shape[0], -1))


def split(model: nnx.Module) -> tuple[nnx.GraphDef, PyTree]:
  """The model's code and its parameters (the pytree that is trained).

  Example:
    >>> graphdef, params = split(MLP([4, 2], rngs=nnx.Rngs(0)))

  Args:
    model: an nnx module whose state is all `nnx.Param`s.

  Returns:
    `(graphdef, params)`.

  Raises:
    ValueError: if the model holds state other than parameters (batch
      statistics, counters): per-example clipping cannot train them.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree_util.tree_leaves(rest):
    raise ValueError(
        'the model holds state other than nnx.Param (e.g. BatchNorm '
        'statistics), which mixes examples and cannot be trained with '
        'per-example clipping; use a model without it (GroupNorm/LayerNorm '
        'are per-example)')
  return graphdef, params


def apply(graphdef: nnx.GraphDef, params: PyTree, x: jax.Array) -> jax.Array:
  """The model's outputs on a batch `x` (leading axis the batch).

  Example:
    >>> logits = apply(graphdef, params, test['x'])

  Args:
    graphdef: from `split`.
    params: the parameters.
    x: a batch of inputs.

  Returns:
    The model's outputs, one row per example.
  """
  return nnx.merge(graphdef, params)(x)


def cross_entropy(logits: jax.Array, label: jax.Array) -> jax.Array:
  """Softmax cross-entropy of one example's logits and integer label."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, label)


def example_loss(graphdef: nnx.GraphDef,
                 loss: Callable[[jax.Array, jax.Array], jax.Array] = (
                     cross_entropy)
                 ) -> Callable[[PyTree, PyTree], jax.Array]:
  """`loss_fn(params, example)` of ONE example `{'x': ..., 'y': ...}`.

  flax layers expect a batch axis: the example gets one of size 1 and the
  output loses it, so the private transformations' one-example contract
  holds.

  Example:
    >>> loss_fn = example_loss(graphdef)
    >>> loss_fn(params, {'x': x[0], 'y': y[0]}).shape
    ()

  Args:
    graphdef: from `split`.
    loss: `loss(outputs, label) -> scalar` of one example.

  Returns:
    The one-example loss.
  """

  def loss_fn(params: PyTree, example: PyTree) -> jax.Array:
    outputs = apply(graphdef, params, example['x'][None])[0]
    return loss(outputs, example['y'])

  return loss_fn


def mean_loss(graphdef: nnx.GraphDef,
              loss: Callable[[jax.Array, jax.Array], jax.Array] = (
                  cross_entropy)
              ) -> Callable[[PyTree, PyTree], jax.Array]:
  """The batch-mean loss (non-private training and evaluation).

  Example:
    >>> value = mean_loss(graphdef)(params, {'x': x, 'y': y})

  Args:
    graphdef: from `split`.
    loss: as in `example_loss`.

  Returns:
    `loss_fn(params, batch) -> scalar`.
  """

  def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
    outputs = apply(graphdef, params, batch['x'])
    return jnp.mean(jax.vmap(loss)(outputs, batch['y']))

  return loss_fn


def accuracy(graphdef: nnx.GraphDef, params: PyTree, data: PyTree
             ) -> jax.Array:
  """The fraction of `data` whose argmax output is its label.

  Example:
    >>> accuracy(graphdef, params, test)

  Args:
    graphdef: from `split`.
    params: the parameters.
    data: `{'x': [n, ...], 'y': [n]}`.

  Returns:
    A scalar in [0, 1].
  """
  predictions = jnp.argmax(apply(graphdef, params, data['x']), axis=-1)
  return jnp.mean(predictions == data['y'])


# ------------------------------------------------ plain-JAX linear model


def linear_init(num_features: int, num_classes: int) -> dict[str, jax.Array]:
  """Zero weights and bias of multiclass logistic regression (a plain dict).

  The loss is convex: zero init has no symmetry to break. The same model as
  `MLP([num_features, num_classes])`, without flax, for code that wants a
  dict of arrays (checkpoint tests, vmapped sweeps).

  Example:
    >>> params = linear_init(64, 10)

  Args:
    num_features: inputs.
    num_classes: outputs.

  Returns:
    `{'w': [num_features, num_classes], 'b': [num_classes]}`.
  """
  return {'w': jnp.zeros((num_features, num_classes), jnp.float32),
          'b': jnp.zeros((num_classes,), jnp.float32)}


def linear_logits(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Class scores of one example `[features]` or a batch `[n, features]`."""
  return x @ params['w'] + params['b']


def linear_example_loss(params: dict[str, jax.Array],
                        example: PyTree) -> jax.Array:
  """Softmax cross-entropy of ONE example (what private gradients clip)."""
  return cross_entropy(linear_logits(params, example['x']), example['y'])


def linear_mean_loss(params: dict[str, jax.Array],
                     batch: PyTree) -> jax.Array:
  """Mean cross-entropy of a batch (non-private training, evaluation)."""
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      linear_logits(params, batch['x']), batch['y']))


# ------------------------------------------------ decoder language model


class DecoderBlock(nnx.Module):
  """A pre-norm transformer block: causal self-attention, then an MLP.

  Every dense layer is an `nnx.LoRALinear`: a base `nnx.Param` kernel and
  bias plus low-rank adapters `lora_a` [in, r] and `lora_b` [r, out]
  (`nnx.LoRAParam`, `lora_b` zero at initialization, so a fresh adapter
  leaves the base's outputs unchanged). Which of the two is trained is the
  caller's choice (`split_trainable`).

  Example:
    >>> block = DecoderBlock(32, heads=4, lora_rank=2, rngs=nnx.Rngs(0))
    >>> mask = jnp.tril(jnp.ones((8, 8), bool))
    >>> block(jnp.zeros((3, 8, 32)), mask).shape
    (3, 8, 32)

  Args:
    width: the model width d (a multiple of `heads`).
    heads: attention heads.
    lora_rank: rank r of the adapters.
    rngs: flax's random streams.
  """

  def __init__(self, width: int, *, heads: int, lora_rank: int,
               rngs: nnx.Rngs):
    if width % heads:
      raise ValueError(f'width {width} is not a multiple of heads {heads}')
    dense = lambda a, b: nnx.LoRALinear(a, b, lora_rank=lora_rank, rngs=rngs)
    self.heads = heads
    self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
    self.query, self.key, self.value, self.output = (
        dense(width, width) for _ in range(4))
    self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = dense(width, 4 * width)
    self.down = dense(4 * width, width)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    per_head = width // self.heads
    heads = lambda y: y.reshape(batch, length, self.heads, per_head)
    h = self.attention_norm(x)
    q, k, v = heads(self.query(h)), heads(self.key(h)), heads(self.value(h))
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / jnp.sqrt(per_head)
    # Masked positions get a large negative score, not -inf: a row's softmax
    # stays finite (every row keeps its own position).
    scores = jnp.where(mask, scores, -1e9)
    attended = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(scores, axis=-1),
                          v).reshape(batch, length, width)
    x = x + self.output(attended)
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Decoder(nnx.Module):
  """A small GPT-style decoder language model over integer tokens.

  Token and learned position embeddings, `depth` pre-norm blocks with a
  causal mask (position t sees positions <= t), a final layer norm and an
  untied output layer: `model(tokens [B, T]) -> logits [B, T, vocab]`.

  Example:
    >>> model = Decoder(vocab_size=96, context=16, width=32, depth=2,
    ...                 heads=4, lora_rank=2, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((5, 16), jnp.int32)).shape
    (5, 16, 96)

  Args:
    vocab_size: V, the number of token ids.
    context: the longest sequence T the position table covers.
    width: d.
    depth: number of blocks.
    heads: attention heads per block.
    lora_rank: rank of every dense layer's adapters.
    rngs: flax's random streams.
  """

  def __init__(self, vocab_size: int, *, context: int, width: int,
               depth: int, heads: int, lora_rank: int, rngs: nnx.Rngs):
    if min(vocab_size, context, width, depth, heads, lora_rank) < 1:
      raise ValueError(
          'vocab_size, context, width, depth, heads and lora_rank must all '
          f'be >= 1, got {(vocab_size, context, width, depth, heads)} and '
          f'{lora_rank}')
    self.context = context
    self.embed = nnx.Embed(vocab_size, width, rngs=rngs)
    self.positions = nnx.Embed(context, width, rngs=rngs)
    self.blocks = nnx.List([
        DecoderBlock(width, heads=heads, lora_rank=lora_rank, rngs=rngs)
        for _ in range(depth)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab_size, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    length = tokens.shape[-1]
    if length > self.context:
      raise ValueError(f'{length} tokens exceed the context {self.context}')
    x = self.embed(tokens) + self.positions(jnp.arange(length))
    mask = jnp.tril(jnp.ones((length, length), bool))
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def split_trainable(model: nnx.Module, trainable: Any
                    ) -> tuple[nnx.GraphDef, PyTree, PyTree]:
  """The model's code, the parameters to train and the frozen rest.

  Example:
    >>> graphdef, adapters, base = split_trainable(model, nnx.LoRAParam)
    >>> graphdef, base, adapters = split_trainable(model, 'base')

  Args:
    model: an nnx module whose state is all `nnx.Param`s (LoRA adapters
      included: `nnx.LoRAParam` is a `Param`).
    trainable: an nnx filter of the trained variables (`nnx.LoRAParam`:
      the adapters), or 'base' for every `nnx.Param` that is not a LoRA
      adapter (pretraining, full fine-tuning).

  Returns:
    `(graphdef, trained, frozen)`; `nnx.merge(graphdef, trained, frozen)`
    rebuilds the model.

  Raises:
    ValueError: if the model holds non-parameter state (see `split`), or if
      the filter selects nothing.
  """
  split(model)  # refuses state that mixes examples
  if isinstance(trainable, str):
    if trainable != 'base':
      raise ValueError(f"trainable must be an nnx filter or 'base', got "
                       f'{trainable!r}')
    graphdef, frozen, trained = nnx.split(model, nnx.LoRAParam, ...)
  else:
    graphdef, trained, frozen = nnx.split(model, trainable, ...)
  if not jax.tree_util.tree_leaves(trained):
    raise ValueError(f'the filter {trainable!r} selects no parameter')
  return graphdef, trained, frozen


def lm_example_loss(graphdef: nnx.GraphDef, frozen: PyTree
                    ) -> Callable[[PyTree, PyTree], jax.Array]:
  """`loss_fn(trained, example)`: mean next-token cross-entropy of ONE sequence.

  The example is `{'x': int [T], 'y': int [T]}` (`y` is `x` shifted by one
  token); the frozen part of the model is closed over, so the private
  transformations see only the trained parameters. Written as a flax user
  writes it: a batch axis of one, optax's integer-label cross-entropy over
  the (T, V) logits, its mean over positions.

  Example:
    >>> graphdef, adapters, base = split_trainable(model, nnx.LoRAParam)
    >>> loss_fn = lm_example_loss(graphdef, base)
    >>> loss_fn(adapters, {'x': tokens[0], 'y': targets[0]}).shape
    ()

  Args:
    graphdef: from `split_trainable`.
    frozen: the parameters that stay fixed.

  Returns:
    The one-example loss.
  """

  def loss_fn(trained: PyTree, example: PyTree) -> jax.Array:
    logits = nnx.merge(graphdef, trained, frozen)(example['x'][None])[0]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, example['y']).mean()

  return loss_fn


def lm_mean_loss(graphdef: nnx.GraphDef, frozen: PyTree
                 ) -> Callable[[PyTree, PyTree], jax.Array]:
  """The mean next-token cross-entropy of a batch `{'x': [B, T], 'y': [B, T]}`.

  Non-private training and evaluation; `exp` of it is the perplexity.

  Example:
    >>> perplexity = jnp.exp(lm_mean_loss(graphdef, base)(adapters, heldout))

  Args:
    graphdef: from `split_trainable`.
    frozen: the parameters that stay fixed.

  Returns:
    `loss_fn(trained, batch) -> scalar`.
  """

  def loss_fn(trained: PyTree, batch: PyTree) -> jax.Array:
    logits = nnx.merge(graphdef, trained, frozen)(batch['x'])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['y']).mean()

  return loss_fn
