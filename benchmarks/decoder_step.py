"""Training-step time and memory of a GPT-style decoder, private and not.

The model (issue 31): a decoder-only transformer with a learned token
embedding, learned positions, pre-LN blocks (causal multi-head
self-attention, then a GELU MLP), a final layer norm and an untied LM head
with bias. The privacy unit is one sequence: its loss is the mean
next-token cross-entropy over its positions (`optax`), with a causal mask
closed over as a constant. Adam follows every gradient.

Variants (`--variant`):

* ``default``: vocabulary 16384, width 512, 6 blocks of 8 heads, MLP
  512-2048-512, T = 256, batch 32 sequences: 35,840,000 parameters;
* ``wide``: the same four times wider (width 2048, 16 heads of 128, MLP
  2048-8192-2048): 369,803,264 parameters, 1.4 GiB in float32. Its ghost
  and non-private steps should fit one 80 GB GPU (an estimate from the
  shapes); rows that hold per-example gradients (32 x 1.4 GiB more) may
  not, and then print why;
* ``tiny``: vocabulary 32, width 16, 2 blocks of 2 heads, MLP 16-64-16,
  T = 16, batch 4 (7,904 parameters): a smoke run on a CPU, not a speed
  claim.

Rows, each one full jitted (or PyTorch) training step:

* ``jax non-private``: `jax.grad` of the batch-mean loss, `optax.adam`;
* ``dpsgd ghost`` / ``dpsgd vmap`` / ``dpsgd auto``:
  `optax.chain(dpsco_jax.dpsgd(..., clipping_method=...), optax.adam(...))`;
* ``jax_privacy``: `jax_privacy.clipped_grad` (per-example gradients,
  clipped sum), `noise_addition.gaussian_privatizer`, a division by the
  batch size and `optax.adam` (when `jax_privacy` imports);
* ``torch non-private``, ``opacus ghost``, ``opacus hooks``: the same
  architecture in PyTorch (`nn.Linear`, `nn.Embedding`, `nn.LayerNorm`,
  `F.scaled_dot_product_attention` with `is_causal=True`), `torch.optim.Adam`,
  and Opacus' `PrivacyEngine.make_private` with `grad_sample_mode='ghost'`
  or `'hooks'` (when `torch` and `opacus` import).

Clip 1, noise multiplier 1, learning rate 1e-4. Rows are timed in
interleaved rounds with a rotating order (machine-load drift hits all
alike); a row's time is the median over rounds of its mean per-step time,
and every ratio comes from the same run. A row that cannot be built,
compiled or run prints its reason and is left out; the others go on.

Peak memory: for JAX rows, XLA's account of the compiled step
(`compiled.memory_analysis()`: arguments + outputs + temporaries - the
donated buffers the outputs reuse; parameters and optimizer state are
donated as in a training loop). It is per row and independent of the
order the rows run in, which the process-wide `peak_bytes_in_use` is not.
For PyTorch rows, `torch.cuda.max_memory_allocated()` over one step after
`reset_peak_memory_stats()` (the model, optimizer state and batch
included); not reported on a CPU.

`--compile_only` compiles the JAX rows from shapes alone and reports their
memory analysis, with no device memory used, no timing and no PyTorch rows.

Usage (from the repository root)::

    python benchmarks/decoder_step.py [--variant default|wide|tiny]
        [--rounds 7] [--iters 10] [--warmup 2] [--rows ROW,ROW]
        [--compile_only]
        [--output benchmarks/results/decoder_step_<device>.md]
"""

from __future__ import annotations

import os

# Several frameworks share the device: JAX must not take 75% of it upfront.
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import csv
import dataclasses
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dpsgd_step

import dpsco_jax
# pylint: enable=g-import-not-at-top,wrong-import-position

PyTree = Any
Batch = dict[str, Any]

L2_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 1e-4
DATA_SEED = 0
# dpsgd's capacity: far more steps than any run times.
NUM_STEPS = 2**30


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

ROWS = ('jax non-private', 'dpsgd ghost', 'dpsgd vmap', 'dpsgd auto',
        'jax_privacy', 'torch non-private', 'opacus ghost', 'opacus hooks')
# Each row's framework baseline (the denominator of its ratio).
BASELINE = {'jax': 'jax non-private', 'torch': 'torch non-private'}


def framework_of(row: str) -> str:
  """'torch' for the PyTorch rows, 'jax' for the others."""
  return 'torch' if row.startswith(('torch', 'opacus')) else 'jax'


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


def _layer_norm(x: jax.Array, norm: dict) -> jax.Array:
  mean = jnp.mean(x, axis=-1, keepdims=True)
  centred = x - mean
  inv = jax.lax.rsqrt(jnp.mean(centred**2, axis=-1, keepdims=True) + 1e-5)
  return centred * inv * norm['scale'] + norm['bias']


def _dense(layer: dict, x: jax.Array) -> jax.Array:
  return x @ layer['w'] + layer['b']


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
  split = lambda y: y.reshape(y.shape[:-1] + (heads, -1))
  for block in params['blocks']:
    x = _layer_norm(h, block['norm1'])
    q, k, v = (split(_dense(block[name], x))
               for name in ('query', 'key', 'value'))
    scores = jnp.einsum('...qhd,...khd->...hqk', q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    mixed = jnp.einsum('...hqk,...khd->...qhd', jax.nn.softmax(scores), v)
    h = h + _dense(block['attention_out'], mixed.reshape(h.shape))
    x = _layer_norm(h, block['norm2'])
    h = h + _dense(block['mlp_out'], jax.nn.gelu(_dense(block['mlp_in'], x)))
  return _dense(params['head'], _layer_norm(h, params['norm_out']))


def sequence_loss_fn(config: DecoderConfig
                     ) -> Callable[[dict, Batch], jax.Array]:
  """`loss(params, example)`: one sequence's mean next-token cross-entropy.

  Example:
    >>> config = VARIANTS['tiny']
    >>> loss = sequence_loss_fn(config)
    >>> batch = make_batch(np.random.default_rng(0), config)
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


def make_batch(rng: np.random.Generator, config: DecoderConfig) -> Batch:
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


# ------------------------------------------------------------------ rows


@dataclasses.dataclass
class Row:
  """One timed training step.

  Attributes:
    name: the row's name (one of `ROWS`).
    run: `run(n)` runs n steps and waits for the device.
    peak_bytes: `peak_bytes()`: the step's peak memory, None if unknown.
    note: what the row did that the table should say (e.g. the path taken).
  """

  name: str
  run: Callable[[int], None]
  peak_bytes: Callable[[], Optional[int]]
  note: str = ''


def _is_abstract(tree: PyTree) -> bool:
  """Whether `tree` holds shapes (`jax.ShapeDtypeStruct`), not arrays."""
  return any(isinstance(leaf, jax.ShapeDtypeStruct)
             for leaf in jax.tree_util.tree_leaves(tree))


def _init(init_fn: Callable[[PyTree], PyTree], params: PyTree) -> PyTree:
  """`init_fn(params)`, or its shapes when `params` are shapes."""
  return (jax.eval_shape(init_fn, params) if _is_abstract(params)
          else init_fn(params))


def _jax_row(name: str, step: Callable, params: dict, state: PyTree,
             batch: Batch, note: str = '') -> Row:
  """Compiles `step(params, state, batch)` (params and state donated).

  With shapes (`jax.ShapeDtypeStruct`) in place of arrays the step is only
  compiled: its memory is known, running it raises.
  """
  abstract = _is_abstract((params, state, batch))
  # Each row owns its buffers: donation invalidates what it is passed.
  carry = ((params, state) if abstract else
           jax.tree_util.tree_map(jnp.copy, (params, state)))
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      *carry, batch).compile()

  def run(n: int) -> None:
    nonlocal carry
    if abstract:
      raise RuntimeError(f'{name} was compiled from shapes only')
    for _ in range(n):
      carry = compiled(*carry, batch)
    jax.block_until_ready(carry)

  def peak_bytes() -> Optional[int]:
    analysis = compiled.memory_analysis()
    if analysis is None:
      return None
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
               + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)

  return Row(name, run, peak_bytes, note)


def jax_non_private_row(config: DecoderConfig, params: dict,
                        batch: Batch) -> Row:
  """`jax.grad` of the batch-mean sequence loss, then `optax.adam`."""
  batch_loss = jax.vmap(sequence_loss_fn(config), in_axes=(None, 0))
  adam = optax.adam(LEARNING_RATE)

  def step(params, state, batch):
    grads = jax.grad(lambda p: jnp.mean(batch_loss(p, batch)))(params)
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return _jax_row('jax non-private', step, params,
                  _init(adam.init, params), batch)


def dpsgd_row(config: DecoderConfig, params: dict, batch: Batch,
              method: str) -> Row:
  """`optax.chain(dpsco_jax.dpsgd(clipping_method=method), optax.adam)`."""
  loss = sequence_loss_fn(config)
  tx = optax.chain(
      dpsco_jax.dpsgd(loss, l2_clip=L2_CLIP,
                      noise_multiplier=NOISE_MULTIPLIER, num_steps=NUM_STEPS,
                      key=0, clipping_method=method),
      optax.adam(LEARNING_RATE))

  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  note = ''
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always', dpsco_jax.GhostClippingFallbackWarning)
    row = _jax_row(f'dpsgd {method}', step, params, _init(tx.init, params),
                   batch)
  fallbacks = [w for w in caught if issubclass(
      w.category, dpsco_jax.GhostClippingFallbackWarning)]
  if method == 'auto':
    plan = dpsco_jax.clipped_grad_sum(loss, L2_CLIP).ghost_plan(
        batch, params)
    note = 'took the vmap path' if plan is None else 'took the ghost path'
    if fallbacks:
      note += f' ({str(fallbacks[0].message).splitlines()[0][:120]})'
  row.note = note
  return row


def jax_privacy_row(config: DecoderConfig, params: dict, batch: Batch,
                    jax_privacy) -> Row:
  """`jax_privacy.clipped_grad` sum + Gaussian privatizer, / B, adam."""
  clipped_sum = jax_privacy.clipped_grad(
      sequence_loss_fn(config), l2_clip_norm=L2_CLIP, batch_argnums=1,
      keep_batch_dim=False)
  tx = optax.chain(
      jax_privacy.noise_addition.gaussian_privatizer(
          stddev=L2_CLIP * NOISE_MULTIPLIER, prng_key=jax.random.key(0)),
      optax.scale(1.0 / config.batch_size),
      optax.adam(LEARNING_RATE))

  def step(params, state, batch):
    updates, state = tx.update(clipped_sum(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  return _jax_row('jax_privacy', step, params, _init(tx.init, params),
                  batch)


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


def torch_rows(config: DecoderConfig, batch: Batch, names: tuple[str, ...],
               opacus) -> dict[str, Row | str]:
  """The PyTorch rows in `names`: a `Row`, or the reason it is missing."""
  import torch  # pylint: disable=g-import-not-at-top
  device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
  x = torch.as_tensor(batch['x'], dtype=torch.long, device=device)
  y = torch.as_tensor(batch['y'], dtype=torch.long, device=device)
  torch.manual_seed(DATA_SEED)
  initial = torch_decoder(config).state_dict()
  out: dict[str, Row | str] = {}

  def make(name: str) -> Row:
    model = torch_decoder(config).to(device)
    model.load_state_dict(initial)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    criterion = torch.nn.CrossEntropyLoss()
    shape = (config.batch_size, config.seq_len)
    if name != 'torch non-private':
      loader = torch.utils.data.DataLoader(
          torch.utils.data.TensorDataset(x, y), batch_size=config.batch_size)
      made = opacus.PrivacyEngine().make_private(
          module=model, optimizer=optimizer, data_loader=loader,
          noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=L2_CLIP,
          poisson_sampling=False, criterion=criterion,
          grad_sample_mode=name.split()[1])
      model, optimizer = made[0], made[1]
      if name == 'opacus ghost':
        criterion = made[2]

    def step() -> None:
      logits = model(x)
      flat = (logits.reshape(-1, config.vocab), y.reshape(-1))
      # The mean over B * T tokens is the mean of the sequences' mean
      # losses (equal lengths); Opacus ghost takes `shape` to clip per
      # sequence.
      loss = (criterion(*flat, shape=shape) if name == 'opacus ghost'
              else criterion(*flat))
      loss.backward()
      optimizer.step()
      optimizer.zero_grad(set_to_none=True)

    def run(n: int) -> None:
      for _ in range(n):
        step()
      if device.type == 'cuda':
        torch.cuda.synchronize()

    def peak_bytes() -> Optional[int]:
      if device.type != 'cuda':
        return None
      torch.cuda.synchronize()
      torch.cuda.reset_peak_memory_stats()
      run(1)
      return int(torch.cuda.max_memory_allocated())

    run(1)   # builds Adam's state (and Opacus' buffers) outside the timing
    return Row(name, run, peak_bytes)

  for name in names:
    try:
      out[name] = make(name)
    except Exception as err:  # pylint: disable=broad-except
      out[name] = _reason(err)
  return out


def _reason(err: BaseException) -> str:
  """A one-line reason from an exception."""
  text = str(err).strip().splitlines()
  return f'{type(err).__name__}: {text[0][:200] if text else ""}'


def build_rows(config: DecoderConfig, names: tuple[str, ...],
               compile_only: bool = False
               ) -> tuple[dict[str, Row], dict[str, str]]:
  """Builds (compiles, warms) each row in `names`.

  Args:
    config: the shapes.
    names: rows to build, a subset of `ROWS`.
    compile_only: compile the JAX rows from shapes alone (nothing is
      allocated or run: their memory analysis without the device memory);
      the PyTorch rows are then skipped.

  Returns:
    `(rows, skipped)`: the rows built, and for each row that could not be
    built, its reason.
  """
  batch = make_batch(np.random.default_rng(DATA_SEED), config)
  rows: dict[str, Row] = {}
  skipped: dict[str, str] = {}
  jax_names = [n for n in names if framework_of(n) == 'jax']
  if jax_names:
    if compile_only:
      params = jax.eval_shape(lambda k: decoder_init(k, config),
                              jax.random.key(DATA_SEED))
      jax_batch = jax.tree_util.tree_map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    else:
      params = decoder_init(jax.random.key(DATA_SEED), config)
      jax_batch = jax.tree_util.tree_map(jnp.asarray, batch)
    jax_privacy, reason = dpsgd_step.optional_import('jax_privacy')
    builders = {
        'jax non-private': lambda: jax_non_private_row(config, params,
                                                       jax_batch),
        'jax_privacy': lambda: jax_privacy_row(config, params, jax_batch,
                                               jax_privacy),
    }
    for method in ('ghost', 'vmap', 'auto'):
      builders[f'dpsgd {method}'] = (
          lambda m=method: dpsgd_row(config, params, jax_batch, m))
    for name in jax_names:
      if name == 'jax_privacy' and jax_privacy is None:
        skipped[name] = f'jax_privacy {reason}'
        continue
      try:
        rows[name] = builders[name]()
        if not compile_only:
          rows[name].run(1)
      except Exception as err:  # pylint: disable=broad-except
        rows.pop(name, None)
        skipped[name] = _reason(err)
  torch_names = tuple(n for n in names if framework_of(n) == 'torch')
  if compile_only:
    skipped.update({n: 'not built with --compile_only (JAX rows only)'
                    for n in torch_names})
    torch_names = ()
  if torch_names:
    torch_module, reason = dpsgd_step.optional_import('torch')
    opacus, opacus_reason = dpsgd_step.optional_import('opacus')
    if torch_module is None:
      skipped.update({n: f'torch {reason}' for n in torch_names})
      torch_names = ()
    elif opacus is None:
      skipped.update({n: f'opacus {opacus_reason}' for n in torch_names
                      if n != 'torch non-private'})
      torch_names = tuple(n for n in torch_names if n == 'torch non-private')
    built = torch_rows(config, batch, torch_names, opacus) if torch_names else {}
    for name, row in built.items():
      if isinstance(row, Row):
        rows[name] = row
      else:
        skipped[name] = row
  return {n: rows[n] for n in names if n in rows}, skipped


def time_rows(rows: dict[str, Row], iters: int, warmup: int, rounds: int,
              skipped: dict[str, str]) -> dict[str, list[float]]:
  """Interleaved rounds, rotating order: per row, seconds per step a round.

  A row that raises while timed is dropped (its reason goes to `skipped`).
  """
  names = list(rows)
  for name in names:
    try:
      rows[name].run(warmup)
    except Exception as err:  # pylint: disable=broad-except
      skipped[name] = _reason(err)
  names = [n for n in names if n not in skipped]
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      if name in skipped:
        continue
      start = time.perf_counter()
      try:
        rows[name].run(iters)
      except Exception as err:  # pylint: disable=broad-except
        skipped[name] = _reason(err)
        continue
      times[name].append((time.perf_counter() - start) / iters)
  return {n: ts for n, ts in times.items() if n not in skipped}


# ---------------------------------------------------------------- output


def device_name() -> str:
  """The first JAX device's kind, e.g. 'NVIDIA H100 80GB HBM3' or 'cpu'."""
  return jax.devices()[0].device_kind


def device_slug(name: str) -> str:
  """A file-name form of a device name ('NVIDIA H100 80GB HBM3' -> ...)."""
  return re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_') or 'device'


def default_output(variant: str, compile_only: bool = False) -> str:
  """`benchmarks/results/decoder_step[_<variant>][_compiled]_<device>.md`."""
  stem = 'decoder_step' + ('' if variant == 'default' else f'_{variant}')
  stem += '_compiled' if compile_only else ''
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results',
                      f'{stem}_{device_slug(device_name())}.md')


def table_records(times: dict[str, list[float]],
                  peaks: dict[str, Optional[int]],
                  notes: dict[str, str]) -> list[dict[str, str]]:
  """One record per row: times, ratios to its baseline, memory.

  A row with no times (compiled only) gets 'n/a' for them.
  """
  medians = {n: statistics.median(ts) for n, ts in times.items() if ts}
  ms = lambda seconds: f'{1e3 * seconds:.3f}'
  records = []
  for name, ts in times.items():
    base = BASELINE[framework_of(name)]
    peak, base_peak = peaks.get(name), peaks.get(base)
    records.append({
        'row': name,
        'median ms': ms(medians[name]) if ts else 'n/a',
        'min ms': ms(min(ts)) if ts else 'n/a',
        'max ms': ms(max(ts)) if ts else 'n/a',
        'time / non-private': (f'{medians[name] / medians[base]:.2f}x'
                               if ts and base in medians else 'n/a'),
        'peak MiB': f'{peak / 2**20:.1f}' if peak is not None else 'n/a',
        'memory / non-private': (f'{peak / base_peak:.2f}x'
                                 if peak is not None and base_peak
                                 else 'n/a'),
        'note': notes.get(name, ''),
    })
  return records


def versus_jax_privacy(times: dict[str, list[float]],
                       peaks: dict[str, Optional[int]]) -> list[str]:
  """Lines `dpsgd <m> / jax_privacy: time ..x, memory ..x`."""
  if 'jax_privacy' not in times:
    return []
  ref = times['jax_privacy']
  lines = []
  for name in ('dpsgd ghost', 'dpsgd vmap', 'dpsgd auto'):
    if name in times:
      memory = ('n/a' if peaks.get(name) is None or not peaks.get(
          'jax_privacy') else f'{peaks[name] / peaks["jax_privacy"]:.2f}x')
      time_ratio = 'n/a'
      if times[name] and ref:
        ratio = statistics.median(times[name]) / statistics.median(ref)
        time_ratio = f'{ratio:.2f}x'
      lines.append(f'{name} / jax_privacy: time {time_ratio}, memory '
                   f'{memory}')
  return lines


def header_lines(args: argparse.Namespace, config: DecoderConfig,
                 argv: list[str]) -> list[str]:
  """Device, versions, variant, settings and the command line."""
  versions = [f'jax {jax.__version__}', f'optax {optax.__version__}',
              f'dpsco_jax {getattr(dpsco_jax, "__version__", "?")}']
  for name in ('jax_privacy', 'torch', 'opacus'):
    module, _ = dpsgd_step.optional_import(name)
    versions.append(f'{name} {getattr(module, "__version__", "?")}'
                    if module is not None else f'{name} not installed')
  torch_device = ''
  torch_module, _ = dpsgd_step.optional_import('torch')
  if torch_module is not None:
    torch_device = ('; torch device ' + torch_module.cuda.get_device_name(0)
                    if torch_module.cuda.is_available() else
                    '; torch device cpu')
    # Float32 matmul precision differs by default between the frameworks on
    # GPUs (TF32 or not): the header says which each used.
    torch_device += (' (float32 matmul precision '
                     f'{torch_module.get_float32_matmul_precision()})')
  return [
      f'device: {device_name()} (JAX backend {jax.default_backend()}, '
      f'{jax.device_count()} device(s)){torch_device}; '
      f'{os.cpu_count()} CPU cores, load average '
      f'{", ".join(f"{x:.1f}" for x in os.getloadavg())} at the start; '
      f'python {platform.python_version()}',
      'versions: ' + ', '.join(versions) + '; JAX default matmul '
      f'precision {jax.config.jax_default_matmul_precision or "default"}',
      f'variant: {args.variant} ({config}); '
      f'{count_params(config):,} parameters',
      f'clip {L2_CLIP}, noise multiplier {NOISE_MULTIPLIER}, adam lr '
      f'{LEARNING_RATE}; {args.rounds} rounds x {args.iters} steps per row, '
      f'{args.warmup} warmup steps after compilation; rotating order',
      'peak memory: JAX rows XLA compiled memory_analysis (arguments + '
      'outputs + temporaries - donated aliases); PyTorch rows '
      'torch.cuda.max_memory_allocated over one step (n/a on CPU)',
      'command: python benchmarks/decoder_step.py ' + ' '.join(argv),
  ]


def render_markdown(header: list[str], records: list[dict[str, str]],
                    skipped: dict[str, str], extra: list[str]) -> str:
  """The markdown report: header, table, ratios, skipped rows."""
  lines = ['# decoder_step', ''] + [f'- {line}' for line in header] + ['']
  if records:
    keys = list(records[0])
    lines.append('| ' + ' | '.join(keys) + ' |')
    lines.append('|' + '---|' * len(keys))
    lines.extend('| ' + ' | '.join(r[k] for k in keys) + ' |'
                 for r in records)
    lines.append('')
  lines.extend(f'- {line}' for line in extra)
  lines.extend(f'- skipped {name}: {reason}'
               for name, reason in skipped.items())
  return '\n'.join(lines) + '\n'


def write_outputs(path: str, markdown: str,
                  records: list[dict[str, str]]) -> str:
  """Writes `path` (markdown) and the same table as CSV beside it."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(markdown)
  csv_path = os.path.splitext(path)[0] + '.csv'
  with open(csv_path, 'w', newline='', encoding='utf-8') as f:
    if records:
      writer = csv.DictWriter(f, fieldnames=list(records[0]))
      writer.writeheader()
      writer.writerows(records)
  return csv_path


def parse_args(argv: list[str]) -> argparse.Namespace:
  """Parses command-line flags."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--variant', choices=sorted(VARIANTS),
                      default='default')
  parser.add_argument('--rows', default=','.join(ROWS),
                      help=f'comma-separated subset of {ROWS}')
  parser.add_argument('--iters', type=int, default=10,
                      help='timed steps per row per round')
  parser.add_argument('--warmup', type=int, default=2,
                      help='untimed steps per row after compilation')
  parser.add_argument('--rounds', type=int, default=7,
                      help='interleaved timing rounds')
  parser.add_argument('--compile_only', action='store_true',
                      help='compile the JAX rows from shapes and report '
                      'their memory analysis only (no device memory, no '
                      'timing, no PyTorch rows)')
  parser.add_argument('--output', default='',
                      help='markdown path (CSV beside it); default '
                      'benchmarks/results/decoder_step[_<variant>]_'
                      '<device>.md')
  args = parser.parse_args(argv)
  if min(args.iters, args.rounds) < 1 or args.warmup < 0:
    parser.error('--iters and --rounds must be >= 1, --warmup >= 0')
  args.rows = tuple(r for r in args.rows.split(',') if r)
  unknown = sorted(set(args.rows) - set(ROWS))
  if unknown or not args.rows:
    parser.error(f'unknown rows {unknown}; choose from {ROWS}')
  return args


def main(argv: list[str]) -> None:
  """Builds, times and reports the rows of `--variant`."""
  args = parse_args(argv)
  # Every dpsgd row reuses one fixed noise key on purpose: the run only
  # times steps and releases nothing.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  # Opacus' notices (its fast, not cryptographically secure, noise; backward
  # hooks on modules whose inputs need no gradient) say nothing on timing.
  warnings.filterwarnings('ignore', message='Secure RNG turned off')
  warnings.filterwarnings('ignore', message='Full backward hook is firing')
  config = VARIANTS[args.variant]
  header = header_lines(args, config, argv)
  print('\n'.join(header), flush=True)
  start = time.perf_counter()
  rows, skipped = build_rows(config, args.rows, args.compile_only)
  print(f'built {len(rows)} rows in {time.perf_counter() - start:.1f} s',
        flush=True)
  for name, reason in skipped.items():
    print(f'skipped {name}: {reason}', flush=True)
  if args.compile_only:
    times = {name: [] for name in rows}
  else:
    times = time_rows(rows, args.iters, args.warmup, args.rounds, skipped)
  peaks = {}
  for name in times:
    try:
      peaks[name] = rows[name].peak_bytes()
    except Exception as err:  # pylint: disable=broad-except
      peaks[name] = None
      print(f'peak memory of {name} not measured: {_reason(err)}')
  records = table_records(times, peaks, {n: r.note for n, r in rows.items()})
  extra = versus_jax_privacy(times, peaks)
  markdown = render_markdown(header, records, skipped, extra)
  print(markdown)
  path = args.output or default_output(args.variant, args.compile_only)
  csv_path = write_outputs(path, markdown, records)
  print(f'wrote {path} and {csv_path}')


if __name__ == '__main__':
  main(sys.argv[1:])
