"""Noise mechanisms: streams of (correlated) Gaussian noise shaped like params.

Every mechanism is a linear Gaussian mechanism in the matrix-factorization
view: an encoder matrix `C` (rows: independent unit-variance Gaussian
coordinates, e.g. tree nodes; columns: steps) is applied to the stream of
per-step statistics and noised, `C x + z`, and the algorithm releases a
decoding of it. What the algorithm adds at step t is the decoded noise
`(D z)_t` with `D C = W` for the workload `W`:

* `release='per_step'`: `W = I`, noise for each step's statistic, for
  SGD-style updates (DP-SGD's i.i.d. noise, the tree's residual noise,
  matrix-factorization noise `C^-1 z`);
* `release='prefix'`: `W = A` (all-ones lower triangle), noise for the prefix
  sum `x_0 + ... + x_t` (DP-FTRL's noisy prefix sums, Accelerated-DP-SRGD).

One interface serves all of them:

* `mechanism.init(template, key) -> NoiseState`;
* `mechanism.next(state, template) -> (noise, state)`: the noise for the next
  step, a pytree shaped like `template` in float32 (or wider), with unit
  noise multiplier: the caller scales it by `noise_multiplier * sensitivity`;
* `mechanism.encoder_matrix()`: the explicit `C` for `num_steps` steps, from
  which `dpsco_jax.accounting` derives the sensitivity under any
  participation pattern (so accounting is derived, not hand-copied);
* `mechanism.num_steps`: the capacity. Drawing past it is refused with a
  clear error (and, inside `jit`, the noise is also poisoned with NaN so a
  run that ignores the error cannot continue with weaker privacy).

The pieces: `dpsco_jax.noise_protocol` (the state, the interface, the
identities and refusals), `dpsco_jax.noise_tree` (binary-tree noise) and this
module (i.i.d. Gaussian and matrix-factorization noise), which re-exports the
public names of the others.

Keys: the mechanism key is one purpose key, identical on every device. Each
draw folds in the step (or tree node) and the leaf index, so no key is ever
reused and a tree node is regenerated identically whenever it is needed.
"""

import hashlib
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from scipy import linalg

from dpsco_jax import rounding
from dpsco_jax.noise_protocol import _check_buffers
from dpsco_jax.noise_protocol import check_state
from dpsco_jax.noise_protocol import _draw
from dpsco_jax.noise_protocol import _identified_init
from dpsco_jax.noise_protocol import mechanism_identity
from dpsco_jax.noise_protocol import _noise_dtype
from dpsco_jax.noise_protocol import NoiseMechanism
from dpsco_jax.noise_protocol import NoiseState
from dpsco_jax.noise_protocol import _refuse_invalid
from dpsco_jax.noise_protocol import Sampler
from dpsco_jax.noise_protocol import _sampler_name
from dpsco_jax.noise_protocol import _validate_steps
from dpsco_jax.noise_protocol import _zeros
# pylint: disable=unused-import
# Re-exported: `noise.X` is the name users and the library write.
from dpsco_jax.noise_protocol import identity_words
from dpsco_jax.noise_protocol import PyTree
from dpsco_jax.noise_tree import tree
from dpsco_jax.noise_tree import tree_decoder_matrix
from dpsco_jax.noise_tree import tree_encoder_matrix
from dpsco_jax.noise_tree import tree_num_levels
# pylint: enable=unused-import


def gaussian(num_steps: Optional[int] = None, *,
             sampler: Sampler = jax.random.normal) -> NoiseMechanism:
  """I.i.d. Gaussian noise, a fresh draw each step (DP-SGD).

  Example:
    >>> mech = gaussian(num_steps=100)
    >>> state = mech.init(params, jax.random.key(0))
    >>> noise, state = mech.next(state, params)   # N(0, 1) per coordinate

  Args:
    num_steps: optional capacity; if set, drawing more steps is refused.
    sampler: `(key, shape, dtype) -> array` unit-variance sampler (tests
      replace it; keep the default in real use).

  Returns:
    A `NoiseMechanism` with identity encoder and per-step release.
  """
  num_steps = _validate_steps(num_steps, 'num_steps', required=False)
  name = 'gaussian'
  identity = mechanism_identity('gaussian', num_steps=num_steps,
                                sampler=_sampler_name(sampler))

  def init(template, key):
    del template
    return NoiseState(key=key, step=jnp.zeros((), jnp.int32))

  def next_noise(state, template):
    check_state(state, identity, name)
    noise = _draw(jax.random.fold_in(state.key, state.step), template, sampler)
    noise, refusal = _refuse_invalid(state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, refusal=refusal)

  def encoder_matrix():
    if num_steps is None:
      raise ValueError('gaussian(num_steps=None) has no finite encoder matrix; '
                       'give num_steps to account for it')
    return np.eye(num_steps)

  return NoiseMechanism(init=_identified_init(init, identity), next=next_noise,
                        encoder_matrix=encoder_matrix, num_steps=num_steps,
                        release='per_step', name=name,
                        decoder_matrix=encoder_matrix,
                        single_participation_sensitivity=lambda: 1.0,
                        identity=identity)


def _bandwidth(strategy: np.ndarray) -> int:
  """Number of non-zero diagonals of a lower-triangular matrix."""
  rows, cols = np.nonzero(strategy)
  return int(np.max(rows - cols)) + 1


def validate_strategy(strategy: np.ndarray) -> np.ndarray:
  """Returns `strategy` as float64, or raises if it is not a usable `C`.

  Args:
    strategy: the matrix-factorization strategy `C`, `[T, T]`.

  Returns:
    The matrix as a float64 array.

  Raises:
    ValueError: unless `C` is square, finite, lower-triangular (the noise at
      step t may only depend on draws up to t) with a non-zero diagonal.
  """
  strategy = np.asarray(strategy, dtype=np.float64)
  if strategy.ndim != 2 or strategy.shape[0] != strategy.shape[1]:
    raise ValueError(f'the strategy must be a square matrix, got shape '
                     f'{strategy.shape}')
  if not np.all(np.isfinite(strategy)):
    raise ValueError('the strategy has non-finite entries')
  if np.any(np.triu(strategy, 1) != 0):
    raise ValueError('the strategy must be lower-triangular: streaming noise '
                     'at step t may only use the draws of steps <= t')
  if np.any(np.diag(strategy) == 0):
    raise ValueError('the strategy must have a non-zero diagonal (invertible)')
  return strategy


def matrix_factorization(
    strategy: np.ndarray,
    *,
    inverse: Optional[np.ndarray] = None,
    release: str = 'per_step',
    storage: str = 'buffer',
    sampler: Sampler = jax.random.normal,
) -> NoiseMechanism:
  """Matrix-factorization noise `C^-1 z`, streamed one step at a time.

  For a lower-triangular strategy `C` (`[T, T]`) the per-step noise is
  `w = C^-1 z` with `z_t` drawn from `fold_in(key, t)` (the same draws as
  `gaussian`, so `C = I` reproduces it exactly). Strategies for DP-MF /
  DP-MEMF (paper 001 Alg 2; `dpsco_jax.strategies.optimize_strategy`) plug
  in here; the accountant derives the sensitivity from `C` and the
  participation pattern. Two ways to stream it, same values up to float32
  round-off:

  * `storage='buffer'` (default): forward substitution
    `w_t = (z_t - sum_{0 < j < b} C[t, t-j] w_{t-j}) / C[t, t]`, keeping the
    last `b - 1` noise vectors in a ring buffer, b the number of non-zero
    diagonals of `C`: O(bands x params) memory for banded strategies,
    O(T x params) for dense ones, one draw per step.
  * `storage='regenerate'`: `w_t = sum_{s <= t} (C^-1)[t, s] z_s`, redrawing
    every `z_s` from its key: no buffer at all, but t + 1 draws at step t.
    For memory-bound runs (see `benchmarks/mf_noise.py` for the cost).

  A dense C can have a banded inverse (the banded inverse square root,
  `strategies.banded_inverse_square_root`): then give that inverse as
  `inverse=`, and `storage='buffer'` computes `w_t = sum_{0 <= j < b'}
  (C^-1)[t, t-j] z_(t-j)` directly, keeping the last `b' - 1` draws z (b'
  the number of non-zero diagonals of `C^-1`) when that is fewer than the
  `b - 1` noise vectors of the forward substitution. The noise is then
  exactly `inverse @ z`; C (checked to be its inverse to 1e-8) remains the
  mechanism's identity.

  The accountant reads the strategy the device applies
  (`encoder_matrix()`): the float32 values of C for the forward
  substitution, `inv(float32(C^-1))` when the noise is drawn with the
  (given or regenerated) decoder, as `blt` does with its coefficients
  (`rounding.float32_values`): a decoder coefficient rounded up can make
  the device's strategy more sensitive than the float64 C (3e-5 at T =
  1024, `tests/test_precision.py`).

  With `release='prefix'` the prefix noise `A C^-1 z` is released instead
  (the running sum of `w`).

  Example:
    >>> c = strategies.optimize_strategy(strategies.workload(120), 1)
    >>> mech = matrix_factorization(c)
    >>> state = mech.init(params, jax.random.key(0))
    >>> noise, state = mech.next(state, params)

  Args:
    strategy: `C`, lower-triangular `[T, T]` with a non-zero diagonal; T is
      the capacity.
    inverse: optional `C^-1`, exactly (e.g. the banded inverse of
      `strategies.banded_inverse_square_root(..., with_inverse=True)`); it
      defines the noise when given.
    release: 'per_step' (`C^-1 z`) or 'prefix' (`A C^-1 z`).
    storage: 'buffer' or 'regenerate' (see above).
    sampler: `(key, shape, dtype) -> array` unit-variance sampler (tests
      replace it; keep the default in real use).

  Returns:
    A `NoiseMechanism`.

  Raises:
    ValueError: for an invalid strategy (`validate_strategy`), release or
      storage, or an `inverse` that is not lower-triangular, of another
      shape, or not the inverse of `strategy`.
  """
  strategy = validate_strategy(strategy)
  if inverse is not None:
    inverse = _validate_inverse(strategy, inverse)
  if release not in ('per_step', 'prefix'):
    raise ValueError(f"release must be 'per_step' or 'prefix', got {release!r}")
  if storage not in ('buffer', 'regenerate'):
    raise ValueError(
        f"storage must be 'buffer' or 'regenerate', got {storage!r}")
  num_steps = strategy.shape[0]
  bands = _bandwidth(strategy)
  extra = {}
  inverse_bands = None
  if inverse is not None:
    inverse_bands = _bandwidth(inverse)
    # Only the inverse's own hash and bands are new: a mechanism built
    # without it keeps its identity (and its checkpoints stay valid).
    extra['inverse_sha256'] = _sha256(inverse)
  name = (f'matrix_factorization(T={num_steps}, bands={bands}, '
          + (f'inverse_bands={inverse_bands}, ' if inverse is not None
             else '') + f'release={release}, storage={storage})')
  identity = mechanism_identity(
      'matrix_factorization', release=release, storage=storage,
      sampler=_sampler_name(sampler), shape=list(strategy.shape),
      strategy_sha256=_sha256(strategy), **extra)

  def decoder_matrix():
    if inverse is not None:
      decoder = inverse.copy()
    else:
      decoder = linalg.solve_triangular(strategy, np.eye(num_steps),
                                        lower=True)
    return np.cumsum(decoder, axis=0) if release == 'prefix' else decoder

  if storage == 'regenerate':
    next_noise, init = _regenerated_noise(decoder_matrix(), num_steps, name,
                                          identity, sampler)
    applied = 'decoder'
  elif inverse is not None and inverse_bands < bands:
    next_noise, init = _banded_decoder_noise(inverse, inverse_bands, release,
                                             num_steps, name, identity,
                                             sampler)
    applied = 'inverse'
  else:
    next_noise, init = _buffered_noise(strategy, bands, release, num_steps,
                                       name, identity, sampler)
    applied = 'strategy'

  def encoder_matrix():
    # The strategy the device applies: its float32 coefficients.
    if applied == 'strategy':
      return rounding.float32_values(strategy)
    decoder = rounding.float32_values(
        decoder_matrix() if applied == 'decoder' else inverse)
    if applied == 'decoder' and release == 'prefix':
      decoder = np.diff(decoder, axis=0, prepend=0.0)   # A^-1 (A C^-1)
    return linalg.solve_triangular(decoder, np.eye(num_steps), lower=True)

  return NoiseMechanism(
      init=_identified_init(init, identity), next=next_noise,
      identity=identity, encoder_matrix=encoder_matrix,
      num_steps=num_steps, release=release, name=name,
      decoder_matrix=decoder_matrix)


def _sha256(matrix: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(
      matrix, dtype='<f8').tobytes()).hexdigest()


def _validate_inverse(strategy: np.ndarray, inverse: np.ndarray
                      ) -> np.ndarray:
  """Returns `inverse` as float64, or raises unless it is `C^-1` of C.

  `C C^-1` is formed from the diagonals of `C^-1` (O(T^2 b') for b'
  diagonals), and must be the identity to 1e-8 relative to the sizes of
  the factors: the accountant reads C while the noise is drawn with the
  inverse, so they must describe one mechanism.
  """
  inverse = validate_strategy(inverse)
  if inverse.shape != strategy.shape:
    raise ValueError(f'the inverse has shape {inverse.shape}, the strategy '
                     f'{strategy.shape}')
  num_steps = strategy.shape[0]
  product = np.zeros_like(strategy)
  for lag in range(_bandwidth(inverse)):
    diagonal = np.diagonal(inverse, -lag)
    if np.any(diagonal):
      # (C C^-1)[:, j] gets C[:, j + lag] C^-1[j + lag, j].
      product[:, :num_steps - lag] += strategy[:, lag:] * diagonal
  scale = np.abs(strategy).max() * np.abs(inverse).sum(axis=0).max()
  error = np.abs(product - np.eye(num_steps)).max()
  if not error <= 1e-8 * max(scale, 1.0):
    raise ValueError(f'inverse is not the inverse of the strategy: '
                     f'max |C inverse - I| = {error:.3g}')
  return inverse


def _banded_decoder_noise(inverse: np.ndarray, bands: int, release: str,
                          num_steps: int, name: str, identity: str,
                          sampler: Sampler):
  """`next`/`init` of `w_t = sum_(j < b') C^-1[t, t-j] z_(t-j)`.

  For a banded `C^-1` (b' diagonals): a ring buffer of the last b' - 1
  draws z, one draw per step.
  """

  def combine(row0, z_leaf, correction):
    current = row0.astype(z_leaf.dtype) * z_leaf
    return current if correction is None else current + correction

  return _ring_buffer_noise(inverse, bands, release, num_steps, name,
                            identity, sampler, buffer_name='past_draws',
                            combine=combine, keep_draws=True)


def _buffered_noise(strategy: np.ndarray, bands: int, release: str,
                    num_steps: int, name: str, identity: str,
                    sampler: Sampler):
  """`next`/`init` of the forward substitution with a ring buffer."""

  def substitute(row0, z_leaf, correction):
    if correction is None:
      return z_leaf / row0.astype(z_leaf.dtype)
    return (z_leaf - correction) / row0.astype(z_leaf.dtype)

  return _ring_buffer_noise(strategy, bands, release, num_steps, name,
                            identity, sampler, buffer_name='past',
                            combine=substitute, keep_draws=False)


def _ring_buffer_noise(matrix: np.ndarray, bands: int, release: str,
                       num_steps: int, name: str, identity: str,
                       sampler: Sampler, *, buffer_name: str,
                       combine: Callable[..., jax.Array], keep_draws: bool):
  """`next`/`init` of a banded recursion over the last `bands - 1` vectors.

  Step t forms `combine(M[t, t], z_t, sum_(1 <= j < bands) M[t, t-j]
  v_(t-j))` (the correction None when `bands` is 1), with v the kept
  vectors: the draws z (`keep_draws`: `M = C^-1`, a banded decoder) or the
  outputs w (the forward substitution of `M = C`).
  """
  # band[t, j] = M[t, t - j] (zero above the first row), in float32 for the
  # device; row t drives step t.
  band = np.zeros((num_steps, bands))
  for j in range(bands):
    band[j:, j] = np.diagonal(matrix, -j)
  band = jnp.asarray(band, jnp.float32)
  slots = max(bands - 1, 1)

  def init(template, key):
    past = jax.tree_util.tree_map(
        lambda leaf: jnp.zeros((bands - 1,) + jnp.shape(leaf),
                               _noise_dtype(leaf)), template)
    buffers = {buffer_name: past}
    if release == 'prefix':
      buffers['prefix'] = _zeros(template)
    return NoiseState(key=key, step=jnp.zeros((), jnp.int32), buffers=buffers)

  def next_noise(state, template):
    check_state(state, identity, name)
    _check_buffers(state.buffers[buffer_name], template, (bands - 1,))
    if release == 'prefix':
      _check_buffers(state.buffers['prefix'], template, ())
    step = jnp.asarray(state.step)
    row = band[jnp.minimum(step, num_steps - 1)]
    # Slot m holds v_s for the latest s < t with s = m (mod slots): lag
    # t - s = ((t - 1 - m) mod slots) + 1. Writing one slot per step (instead
    # of shifting the whole buffer) keeps the update in place under jit.
    lags = (step - 1 - jnp.arange(slots)) % slots + 1
    coefficients = row[lags] if bands > 1 else None
    z = _draw(jax.random.fold_in(state.key, state.step), template, sampler)

    def one_leaf(z_leaf, past_leaf):
      correction = None if coefficients is None else jnp.tensordot(
          coefficients.astype(z_leaf.dtype), past_leaf, axes=1,
          precision=jax.lax.Precision.HIGHEST)  # not TF32: C as accounted
      return combine(row[0], z_leaf, correction)

    noise = jax.tree_util.tree_map(one_leaf, z, state.buffers[buffer_name])
    if bands > 1:
      kept = z if keep_draws else noise
      past = jax.tree_util.tree_map(
          lambda past_leaf, v: jax.lax.dynamic_update_index_in_dim(
              past_leaf, v.astype(past_leaf.dtype), step % slots, 0),
          state.buffers[buffer_name], kept)
    else:
      past = state.buffers[buffer_name]
    buffers = {buffer_name: past}
    if release == 'prefix':
      buffers['prefix'] = jax.tree_util.tree_map(
          jnp.add, state.buffers['prefix'], noise)
      noise = buffers['prefix']
    noise, refusal = _refuse_invalid(state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, buffers=buffers,
                                 refusal=refusal)

  return next_noise, init


def _regenerated_noise(decoder: np.ndarray, num_steps: int, name: str,
                       identity: str, sampler: Sampler):
  """`next`/`init` of `sum_{s <= t} decoder[t, s] z_s`, redrawing every z_s."""
  decoder = jnp.asarray(decoder, jnp.float32)

  def init(template, key):
    del template
    return NoiseState(key=key, step=jnp.zeros((), jnp.int32))

  def next_noise(state, template):
    check_state(state, identity, name)
    step = jnp.asarray(state.step)
    row = decoder[jnp.minimum(step, num_steps - 1)]

    def accumulate(s, total):
      z = _draw(jax.random.fold_in(state.key, s), template, sampler)
      return jax.tree_util.tree_map(
          lambda t, z_leaf: t + row[s].astype(t.dtype) * z_leaf, total, z)

    noise = jax.lax.fori_loop(0, jnp.minimum(step, num_steps - 1) + 1,
                              accumulate, _zeros(template))
    noise, refusal = _refuse_invalid(state, noise, num_steps, name, identity)
    return noise, state._replace(step=state.step + 1, refusal=refusal)

  return next_noise, init


def noise_buffer_count(mechanism: NoiseMechanism) -> int:
  """How many params-sized buffers the mechanism's state keeps.

  Found by tracing `init` on a scalar template with `jax.eval_shape` (so
  nothing is allocated): every buffer leaf then has one entry per
  params-sized buffer. The noise state takes about this many times the
  memory of the params (in float32 or wider).

  Example:
    >>> noise_buffer_count(matrix_factorization(np.eye(5)))   # dense: T - 1
    4

  Args:
    mechanism: a noise mechanism.

  Returns:
    The number of params-sized buffers (0 for i.i.d. noise, `bands - 1`
    for a banded strategy or a strategy given with its banded inverse, the
    number of buffers of a BLT).
  """
  state = jax.eval_shape(mechanism.init, jax.ShapeDtypeStruct((), jnp.float32),
                         jax.random.key(0))
  return int(sum(math.prod(leaf.shape)
                 for leaf in jax.tree_util.tree_leaves(state.buffers)))


__all__ = ('check_state', 'gaussian', 'identity_words', 'matrix_factorization',
           'mechanism_identity', 'noise_buffer_count', 'NoiseMechanism',
           'NoiseState', 'tree', 'tree_decoder_matrix', 'tree_encoder_matrix',
           'tree_num_levels', 'validate_strategy')
