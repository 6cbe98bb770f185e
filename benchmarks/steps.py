"""The training steps the benchmarks time or cost, each built in one place.

Every builder takes a per-example loss `loss(params, example)` and an optax
optimizer, and returns a `Step`: `step(params, state, batch) -> (params,
state)` (not jitted: `harness.step_row` jits it with donation,
`dpsco_jax.compiled_cost` compiles it from shapes) and the `init` of its
state. Clip 1 and noise multiplier 1 throughout.

Example::

    built = dpsgd(loss, optax.adam(1e-4), clipping_method='ghost')
    row = harness.step_row('dpsgd ghost', built.step, params,
                           built.init(params), batch)
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import harness  # first: it puts the checkout's dpsco_jax on the path
import dpsco_jax  # pylint: disable=g-bad-import-order
from dpsco_jax import estimators  # pylint: disable=g-bad-import-order

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

L2_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
# dpsgd's capacity: far more steps than any benchmark runs (its refusal
# runs every step all the same).
NUM_STEPS = 2**30


class Step(NamedTuple):
  """A training step and the init of its state.

  Attributes:
    step: `step(params, state, batch) -> (params, state)`.
    init: `init(params) -> state`.
  """

  step: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
  init: Callable[[PyTree], PyTree]


def _applied(tx: optax.GradientTransformation,
             grads: Callable[[PyTree, PyTree], PyTree]) -> Step:
  """`tx` fed `grads(params, batch)`, its updates applied."""

  def step(params, state, batch):
    updates, state = tx.update(grads(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  return Step(step, tx.init)


def non_private(loss: LossFn, optimizer: optax.GradientTransformation
                ) -> Step:
  """`jax.grad` of the batch-mean loss, then `optimizer`.

  Example:
    >>> built = non_private(loss, optax.sgd(0.1))
  """
  batch_loss = jax.vmap(loss, in_axes=(None, 0))
  return _applied(optimizer, jax.grad(
      lambda params, batch: jnp.mean(batch_loss(params, batch))))


def dpsgd(loss: LossFn, optimizer: optax.GradientTransformation,
          clipping_method: str = 'auto') -> Step:
  """`optax.chain(dpsco_jax.dpsgd(...), optimizer)` as a user writes it.

  Example:
    >>> built = dpsgd(loss, optax.adam(1e-4), clipping_method='ghost')
  """
  return transformation(optax.chain(
      dpsco_jax.dpsgd(loss, l2_clip=L2_CLIP,
                      noise_multiplier=NOISE_MULTIPLIER, num_steps=NUM_STEPS,
                      key=0, clipping_method=clipping_method),
      optimizer))


def transformation(tx: optax.GradientTransformationExtraArgs) -> Step:
  """A private transformation's step: `tx.update(None, ..., batch=batch)`.

  Example:
    >>> built = transformation(optax.chain(dpsco_jax.srg_gradient(...),
    ...                                    optax.sgd(0.1)))
  """

  def step(params, state, batch):
    updates, state = tx.update(None, state, params, batch=batch)
    return optax.apply_updates(params, updates), state

  return Step(step, tx.init)


def clipped_sum(loss: LossFn, optimizer: optax.GradientTransformation,
                clipping_method: str, batch_size: int,
                noise: bool = True) -> Step:
  """DP-SGD from the library's parts: clipped sum, Gaussian noise, / B.

  `dpsco_jax.clipped_grad_sum(clipping_method=...)`, the estimator's
  `privatize_sum` with DP-SGD's mechanism, then `optimizer`. With
  `noise=False` the clipped sum over B alone (NOT private: it isolates the
  cost of clipping from the noise and the refusals).

  Example:
    >>> built = clipped_sum(loss, optax.sgd(0.1), 'vmap', batch_size=500)
  """
  statistic = dpsco_jax.clipped_grad_sum(loss, L2_CLIP,
                                         clipping_method=clipping_method)
  if not noise:
    return _applied(optimizer, lambda params, batch: jax.tree_util.tree_map(
        lambda s: s / batch_size, statistic(batch, params).sum))
  mechanism = dpsco_jax.dpsgd_mechanism(NUM_STEPS)
  stddev = NOISE_MULTIPLIER * statistic.sensitivity()

  def step(params, state, batch):
    noise_state, opt_state = state
    grads, noise_state = estimators.privatize_sum(
        statistic(batch, params), noise_state, mechanism, stddev,
        normalize_by=batch_size)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), (noise_state, opt_state)

  return Step(step, lambda params: (mechanism.init(params, jax.random.key(0)),
                                    optimizer.init(params)))


def optax_contrib(loss: LossFn, learning_rate: float) -> Step:
  """`optax.contrib.dpsgd` fed `jax.vmap`-ed per-example gradients."""
  per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))
  return _applied(optax.contrib.dpsgd(
      learning_rate=learning_rate, l2_norm_clip=L2_CLIP,
      noise_multiplier=NOISE_MULTIPLIER, seed=0), per_example)


def jax_privacy(loss: LossFn, optimizer: optax.GradientTransformation,
                batch_size: int, module: Optional[ModuleType]) -> Step:
  """`jax_privacy.clipped_grad` sum, Gaussian privatizer, / B, `optimizer`.

  Raises:
    ImportError: when `module` (jax_privacy) is None.
  """
  if module is None:
    raise ImportError('jax_privacy is not installed')
  clipped = module.clipped_grad(loss, l2_clip_norm=L2_CLIP, batch_argnums=1,
                                keep_batch_dim=False)
  tx = optax.chain(
      module.noise_addition.gaussian_privatizer(
          stddev=L2_CLIP * NOISE_MULTIPLIER, prng_key=jax.random.key(0)),
      optax.scale(1.0 / batch_size), optimizer)
  return _applied(tx, clipped)


def max_relative_difference(tree: PyTree, reference: PyTree) -> float:
  """`max |tree - reference| / max |reference|` over all leaves.

  Example:
    >>> max_relative_difference(ghost_sum.sum, vmap_sum.sum)
    4.8e-05
  """
  flat = [np.concatenate([np.ravel(leaf) for leaf in
                          jax.tree_util.tree_leaves(t)])
          for t in (tree, reference)]
  return float(np.max(np.abs(flat[0] - flat[1])) / np.max(np.abs(flat[1])))


def auto_choice(loss: LossFn, params: PyTree, batch: PyTree):
  """The `ClippingChoice` of 'auto' on `batch` (None: no ghost path applies).

  Read from shapes only: the analysis runs under `jax.eval_shape`.

  Example:
    >>> auto_choice(loss, params, batch).path
    'ghost'
  """
  statistic = dpsco_jax.clipped_grad_sum(loss, L2_CLIP)
  chosen = []
  jax.eval_shape(lambda b, p: chosen.append(
      statistic.clipping_choice(b, p)) or 0, batch, params)
  return chosen[0]


def auto_path(loss: LossFn, params: PyTree, batch: PyTree) -> str:
  """The path `clipping_method='auto'` takes on `batch`: 'ghost' or 'vmap'."""
  choice = auto_choice(loss, params, batch)
  return 'vmap' if choice is None else choice.path


def torch_lm_rows(make_model: Callable[[], Any], batch: Any, vocab: int,
                  names: tuple[str, ...], opacus: Optional[ModuleType],
                  learning_rate: float, seed: int
                  ) -> dict[str, Callable[[], Any]]:
  """Builders of PyTorch language-model rows (imports torch lazily).

  Each row is a training step of `make_model()` (every row from the same
  initial weights) on the token batch `{'x', 'y'}` (`[B, T]`), each
  sequence's loss the mean next-token cross-entropy, `torch.optim.Adam`:
  ``torch non-private``, or Opacus' `PrivacyEngine.make_private` with
  `grad_sample_mode='ghost'` (``opacus ghost``) or `'hooks'`
  (``opacus hooks``).

  Example:
    >>> builders = torch_lm_rows(lambda: torch_decoder(config), batch,
    ...                          vocab, ('torch non-private',), None,
    ...                          1e-4, 0)

  Returns:
    Row name -> a function building its `harness.Row`.
  """
  import torch  # pylint: disable=g-import-not-at-top
  device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
  x = torch.as_tensor(batch['x'], dtype=torch.long, device=device)
  y = torch.as_tensor(batch['y'], dtype=torch.long, device=device)
  torch.manual_seed(seed)
  initial = make_model().state_dict()

  def make(name: str):
    model = make_model().to(device)
    model.load_state_dict(initial)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    criterion = torch.nn.CrossEntropyLoss()
    shape = tuple(x.shape)
    if name != 'torch non-private':
      loader = torch.utils.data.DataLoader(
          torch.utils.data.TensorDataset(x, y), batch_size=len(x))
      made = opacus.PrivacyEngine().make_private(
          module=model, optimizer=optimizer, data_loader=loader,
          noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=L2_CLIP,
          poisson_sampling=False, criterion=criterion,
          grad_sample_mode=name.split()[1])
      model, optimizer = made[0], made[1]
      if name == 'opacus ghost':
        criterion = made[2]

    def step() -> None:
      flat = (model(x).reshape(-1, vocab), y.reshape(-1))
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

    return harness.Row(name, run, peak_bytes)

  return {name: (lambda name=name: make(name)) for name in names}
