"""The noise protocol: the state and interface every noise mechanism shares.

* `NoiseState` and `NoiseMechanism` (`init`, `next`, the encoder and decoder
  matrices the accounting derives sensitivities from, the capacity);
* a mechanism's identity (`mechanism_identity`, `identity_words`), carried
  by its states so that a state is never continued by another mechanism
  (`check_state`), and the refusals of a draw past the capacity;
* the draws themselves: one unit-variance draw per leaf, a distinct key per
  leaf.

`dpsco_jax.noise` re-exports every public name here.
"""

import hashlib
import json
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax import checks
from dpsco_jax import guards


PyTree = Any
Sampler = Callable[[jax.Array, tuple, Any], jax.Array]


class NoiseState(NamedTuple):
  """State of a noise mechanism.

  Attributes:
    key: the mechanism's PRNG key (replicated across devices).
    step: int32, how many noise vectors have been drawn.
    buffers: mechanism-specific arrays (empty for the stateless mechanisms;
      the Honaker tree keeps one node estimate per level, matrix
      factorization its last noise vectors). They hold noise, never data.
    mechanism_id: uint32[4], the identity of the mechanism that made the
      state (`NoiseMechanism.identity`: its kind and every parameter that
      determines the noise). `next` refuses a state made by another
      mechanism, and `dpsco_jax.checkpoint` checks it against the ledger, so
      a run cannot continue one mechanism's state under another while its
      accounting describes the first. Not secret.
    refusal: the `guards.Refusal` record of the checks made with this state
      (the capacity, the identity, and the checks of the estimator that
      adds this noise): once set, every later draw is NaN, and
      `guards.raise_if_refused` reports it. Not secret.

  The key and buffers determine the noise, so the state is secret: it can be
  checkpointed privately but must never be logged or released.
  """

  key: jax.Array
  step: jax.Array
  buffers: PyTree = ()
  mechanism_id: Optional[jax.Array] = None
  refusal: Optional[guards.Refusal] = None


class NoiseMechanism(NamedTuple):
  """A stream of correlated Gaussian noise (see the module docstring).

  Attributes:
    init: `(template, key) -> NoiseState`.
    next: `(state, template) -> (noise, state)`.
    encoder_matrix: `() -> np.ndarray`, the strategy matrix `C` (float64,
      shape `[num_coordinates, num_steps]`) for the whole run, as the
      device applies it (its float32 coefficients).
    num_steps: capacity: how many steps the noise was built for (None: no
      limit, only for i.i.d. Gaussian noise).
    release: 'per_step' or 'prefix'.
    name: a human-readable description.
    decoder_matrix: `() -> np.ndarray`, the linear map `N` (float64,
      `[num_steps, num_coordinates]`) from the unit-variance draws (one per
      row of the encoder) to the released noise: step t releases
      `sum_j N[t, j] xi_j`. It gives the mechanism's error on any workload
      (`dpsco_jax.strategies.workload_errors`).
    single_participation_sensitivity: optional `() -> float`, the largest
      column norm of the encoder, `max_t ||C e_t||`: the sensitivity of a
      run in which each example takes part in one step, computed without
      building `C` (a million-step tree or i.i.d. run has a `C` too large
      to form). None: the accountant computes it from `encoder_matrix`.
    identity: 32 hex digits naming the mechanism's kind and every parameter
      that determines its noise (`mechanism_identity`); the states it makes
      carry it (`NoiseState.mechanism_id`) and `next` refuses any other.
      Empty only for mechanisms built by hand for accounting.
    fixed_order_sensitivity: optional `(k, b) -> float or None`, the exact
      sensitivity under `FixedOrder(k, b)` without building C (a BLT's
      closed form; O(T) instead of the O(T^3) Gram matrix). None, or a
      None result: the accountant computes it from `encoder_matrix`.
    truncated: optional `(steps) -> NoiseMechanism`, the mechanism that
      accounts for the first `steps` steps of a run (`ledger.epsilon_at`):
      its encoder is the rows of C those steps' releases use, cut to the
      first `steps` columns (the later columns zero), with `num_steps` the
      whole run's, and its own sensitivity routes (a BLT's are O(T d)).
      None: the ledger cuts `encoder_matrix()` itself (T x T).
  """

  init: Callable[[PyTree, jax.Array], NoiseState]
  next: Callable[[NoiseState, PyTree], tuple[PyTree, NoiseState]]
  encoder_matrix: Callable[[], np.ndarray]
  num_steps: Optional[int]
  release: str
  name: str
  decoder_matrix: Optional[Callable[[], np.ndarray]] = None
  single_participation_sensitivity: Optional[Callable[[], float]] = None
  identity: str = ''
  fixed_order_sensitivity: Optional[Callable[[int, int],
                                             Optional[float]]] = None
  truncated: Optional[Callable[[int], 'NoiseMechanism']] = None


def mechanism_identity(kind: str, **parameters: Any) -> str:
  """The identity of a noise mechanism: a hash of its kind and parameters.

  Two mechanisms have the same identity exactly when they draw the same
  noise from the same key (the parameters must include everything that
  determines the noise: capacity, release, restarts, the strategy matrix,
  a non-default sampler).

  Example:
    >>> mechanism_identity('tree', num_steps=16, release='prefix',
    ...                    tree_size=16, honaker=False, sampler=None)
    '...'   # 32 hex digits

  Args:
    kind: the mechanism family, e.g. 'gaussian'.
    **parameters: JSON-serializable values that determine the noise.

  Returns:
    32 hex digits (128 bits of SHA-256).
  """
  text = json.dumps({'kind': kind, **parameters}, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


def identity_words(identity: str) -> np.ndarray:
  """The identity as the uint32[4] a `NoiseState` carries.

  Example:
    >>> identity_words(mechanism.identity).shape
    (4,)

  Args:
    identity: 32 hex digits (`NoiseMechanism.identity`).

  Returns:
    uint32 array of shape [4].
  """
  return np.frombuffer(bytes.fromhex(identity), dtype='>u4').astype(np.uint32)


def _sampler_name(sampler: Sampler) -> Optional[str]:
  """None for the default sampler, else a name that sets the noise apart."""
  if sampler is jax.random.normal:
    return None
  return (f'{getattr(sampler, "__module__", "")}.'
          f'{getattr(sampler, "__qualname__", type(sampler).__name__)}')


def check_state(state: Any, identity: str, name: str) -> Any:
  """Raises unless `state` is a noise state this mechanism could have made.

  Structure is checked at once; the identity is compared at once when it is
  concrete, and returned as a traced flag under `jit`/`vmap`/`pmap` (for
  `guards.refuse_any`).

  Example:
    >>> flag = check_state(state, mechanism.identity, mechanism.name)

  Args:
    state: the state handed to `next`.
    identity: the mechanism's identity.
    name: the mechanism's name, for the messages.

  Returns:
    A bool flag (Python False, or traced) that is True when the state was
    made by another mechanism.

  Raises:
    ValueError: if `state` is not a `NoiseState` with an identity of the
      right shape, or (when concrete) was made by another mechanism.
  """
  if not isinstance(state, NoiseState):
    raise ValueError(
        f'{name}: expected the NoiseState made by this mechanism\'s init, got '
        f'{type(state).__name__}: the optimizer state does not belong to this '
        'transformation')
  words = state.mechanism_id
  if words is None:
    raise ValueError(
        f'{name}: the noise state carries no mechanism identity (it was not '
        'made by a mechanism\'s init); build it with mechanism.init')
  if jnp.shape(words)[-1:] != (4,) or jnp.result_type(words) != jnp.uint32:
    raise ValueError(
        f'{name}: the noise state\'s mechanism identity has shape '
        f'{jnp.shape(words)} and dtype {jnp.result_type(words)}, not uint32[4]')
  expected = identity_words(identity)
  if isinstance(words, jax.core.Tracer):
    return jnp.any(words != jnp.asarray(expected))
  if np.any(np.asarray(words) != expected):
    raise ValueError(_other_mechanism_message(name, identity))
  return False


def _other_mechanism_message(name: str, identity: str) -> str:
  return (f'{name}: the noise state was made by another noise mechanism '
          f'(this one is {identity}): continuing one mechanism\'s state under '
          'another would release noise its accounting never described. Start '
          'from this mechanism\'s init, or restore the checkpoint of the run '
          'this state belongs to with that run\'s transformation.')


def _validate_steps(value: Optional[int], name: str,
                    required: bool) -> Optional[int]:
  if value is None:
    if required:
      raise ValueError(f'{name} is required')
    return None
  return checks.positive_int(value, name)


def _noise_dtype(leaf) -> jnp.dtype:
  return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def _draw(key: jax.Array, template: PyTree, sampler: Sampler) -> PyTree:
  """One unit-variance draw per leaf of `template`, a distinct key per leaf."""
  leaves, treedef = jax.tree_util.tree_flatten(template)
  # Drawing flat then reshaping gives the same values as drawing in the leaf's
  # shape, but compiles much faster for multi-dimensional leaves.
  noise = [
      sampler(jax.random.fold_in(key, index), (math.prod(jnp.shape(leaf)),),
              _noise_dtype(leaf)).reshape(jnp.shape(leaf))
      for index, leaf in enumerate(leaves)
  ]
  return jax.tree_util.tree_unflatten(treedef, noise)


def _zeros(template: PyTree) -> PyTree:
  return jax.tree_util.tree_map(
      lambda leaf: jnp.zeros(jnp.shape(leaf), _noise_dtype(leaf)), template)


def _refuse_invalid(state: NoiseState, noise: PyTree,
                    num_steps: Optional[int], name: str,
                    identity: str) -> tuple[PyTree, guards.Refusal]:
  """Refuses a state of another mechanism, and a draw past the capacity.

  Both refusals go through one `dpsco_jax.guards.record`: a
  `PrivacyGuardError` at once when the values are concrete; under tracing
  NaN-poisoned noise and the refusal recorded in the state (no host round
  trip). A state whose record is already set draws NaN.

  Returns:
    `(noise, refusal)`: the (possibly poisoned) noise and the state's new
    record.
  """
  conditions = [(check_state(state, identity, name),
                 _other_mechanism_message(name, identity), 'mechanism')]
  step = state.step
  if num_steps is not None:
    if not isinstance(step, jax.core.Tracer):
      step = int(np.max(np.asarray(step)))
    conditions.append((
        step >= num_steps,
        f'{name}: a step past the capacity of {num_steps} steps its noise was '
        'calibrated for; running further would silently weaken privacy. Build '
        'a mechanism (and accounting) for more steps.', 'capacity'))
  refusal = state.refusal if state.refusal is not None else (
      guards.no_refusal())
  return guards.record(conditions, noise, refusal, state.step)


def _identified_init(init: Callable[[PyTree, jax.Array], NoiseState],
                     identity: str) -> Callable[[PyTree, jax.Array],
                                                NoiseState]:
  """`init` whose states carry the mechanism's identity."""
  words = identity_words(identity)

  def identified(template, key):
    return init(template, key)._replace(mechanism_id=jnp.asarray(words),
                                        refusal=guards.no_refusal())

  return identified


def _check_buffers(buffers: PyTree, template: PyTree,
                   leading: tuple[int, ...]) -> None:
  """Raises a clear error if the noise buffers do not match `template`.

  Args:
    buffers: a pytree like `template` whose leaves have extra leading axes.
    template: the params-like pytree the noise is drawn for.
    leading: the extra leading axes of every buffer leaf.
  """
  expected = jax.tree_util.tree_structure(template)
  actual = jax.tree_util.tree_structure(buffers)
  if expected != actual:
    raise ValueError('noise state does not match the params pytree: state has '
                     f'{actual}, params have {expected}')
  for leaf, buffer in zip(jax.tree_util.tree_leaves(template),
                          jax.tree_util.tree_leaves(buffers)):
    if tuple(buffer.shape) != tuple(leading) + tuple(jnp.shape(leaf)):
      raise ValueError(
          'noise state does not match the params: a buffer of shape '
          f'{buffer.shape} for a leaf of shape {jnp.shape(leaf)}')
