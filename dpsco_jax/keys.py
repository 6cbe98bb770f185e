"""Noise keys: where they come from, how a run is recognized by its key, and
the warning when one key is given to two private transformations.

The privacy of every release rests on the noise being unknown to whoever sees
it, so the noise key is a secret:

* `key=None` (the default of every transformation) draws a fresh key from
  the operating system's entropy (`os.urandom`). It is kept in the optimizer
  state (and so in the private checkpoint, `dpsco_jax.checkpoint`), never
  logged or exported; `dpsco_jax.checkpoint.noise_key(opt_state)` gets it
  back for the ledger.
* An int seed (or a key the caller made) gives reproducible noise, for
  experiments: anyone who knows the seed can regenerate and subtract the
  noise, so a seed written in source code protects nothing against its
  readers.
* The same key given to two transformations draws the same base noise: two
  runs on neighbouring data with one key release outputs whose difference
  cancels the noise. `noise_key` warns (`KeyReuseWarning`) when a key it
  has already handed to a transformation in this process comes again. It
  cannot see keys reused across processes or machines.
"""

import hashlib
import os
import warnings
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

KeyLike = Union[int, jax.Array, None]


class KeyReuseWarning(UserWarning):
  """A noise key was given to a second private transformation."""


# Fingerprints of the explicit keys handed to transformations in this
# process, with the transformation they went to (never the key itself).
_KEYS_GIVEN: dict[str, str] = {}


def as_key(key: KeyLike) -> jax.Array:
  """Returns a PRNG key from an int seed or a key.

  Example:
    >>> as_key(0)
    Array((), dtype=key<fry>) overlaying: [0 0]

  Args:
    key: an int seed, a typed key, or a raw uint32 key.

  Returns:
    A key usable with `jax.random`.

  Raises:
    ValueError: if `key` is None or not a key.
  """
  if key is None:
    raise ValueError('a PRNG key (or int seed) for the noise is required')
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    return jax.random.key(int(key))
  if not isinstance(key, jax.Array):
    try:
      key = jnp.asarray(key)
    except TypeError as error:
      raise ValueError(
          f'key must be an int seed or a jax PRNG key, got {key!r}') from error
  if not (jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or
          key.dtype == jnp.uint32):
    raise ValueError(f'key must be an int seed or a jax PRNG key, got {key!r}')
  return key


def fresh_key() -> jax.Array:
  """A noise key drawn from the operating system's entropy.

  Example:
    >>> key = fresh_key()   # differs every call; never log it

  Returns:
    A typed key of the default implementation, as secret as `os.urandom`.
  """
  impl = jax.random.key_impl(jax.random.key(0))
  shape = jax.random.key_data(jax.random.key(0)).shape
  words = np.frombuffer(os.urandom(4 * int(np.prod(shape))), dtype=np.uint32)
  return jax.random.wrap_key_data(words.reshape(shape), impl=impl)


def is_typed_key(leaf) -> bool:
  """Whether `leaf` is a typed PRNG key array (`jax.random.key`)."""
  dtype = getattr(leaf, 'dtype', None)
  return dtype is not None and jax.dtypes.issubdtype(dtype,
                                                     jax.dtypes.prng_key)


def key_data(key: jax.Array) -> tuple[str, np.ndarray, int]:
  """`(impl name, key data, leading dims indexing keys)` of a key array.

  Example:
    >>> impl, data, batch_dims = key_data(jax.random.key(0))

  Args:
    key: a typed key array or a raw uint32 key array.

  Returns:
    The implementation's name, the key data as NumPy, and how many leading
    axes index keys (not key words).
  """
  if is_typed_key(key):
    return (str(jax.random.key_impl(key)),
            np.asarray(jax.random.key_data(key)), key.ndim)
  # jax.random reads a raw uint32 key with the default implementation, so
  # `PRNGKey(0)` and `key(0)` are the same key and get the same fingerprint.
  data = np.asarray(key)
  return str(jax.config.jax_default_prng_impl), data, data.ndim - 1


def fingerprint_rows(key: jax.Array) -> list[str]:
  """One fingerprint (32 hex digits) per key in `key` (several when
  replicated over devices).

  Example:
    >>> fingerprint_rows(as_key(0)) == fingerprint_rows(jax.random.PRNGKey(0))
    True

  Args:
    key: a concrete key array (typed or raw).

  Returns:
    A list of SHA-256 prefixes, one per key.
  """
  impl, data, batch_dims = key_data(key)
  rows = data.reshape((-1,) + data.shape[batch_dims:]) if batch_dims else (
      data[None])
  return [hashlib.sha256(impl.encode() + b':' + np.ascontiguousarray(
      row, dtype='<u4').tobytes()).hexdigest()[:32] for row in rows]


def noise_key(key: KeyLike, transformation: str) -> jax.Array:
  """The noise key of a private transformation being built.

  None draws a fresh secret key (`fresh_key`). A key or seed given
  explicitly is remembered by its fingerprint: giving it to a second
  transformation in this process warns (`KeyReuseWarning`), since two runs
  with one noise key release outputs whose difference cancels the noise.
  Rebuilding the same run to resume it from a checkpoint also warns; silence
  it for that call with `warnings.catch_warnings()` if that is what happens.
  Traced keys (a vmapped sweep of seeds) are not checked.

  Example:
    >>> key = noise_key(None, 'dpsgd')   # fresh, from OS entropy

  Args:
    key: None, an int seed or a key.
    transformation: what the key is for, for the warning.

  Returns:
    A key usable with `jax.random`.

  Raises:
    ValueError: if `key` is not None and not a key.
  """
  if key is None:
    return fresh_key()
  key = as_key(key)
  if isinstance(key, jax.core.Tracer):
    return key
  for fingerprint in set(fingerprint_rows(key)):
    if fingerprint in _KEYS_GIVEN:
      warnings.warn(
          f'the noise key given to {transformation} was already given to '
          f'{_KEYS_GIVEN[fingerprint]} in this process: runs that share a '
          'noise key draw the same noise, and two of them on neighbouring '
          'data release outputs whose difference cancels it. Give each run '
          'its own key (key=None draws a fresh one from OS entropy).',
          KeyReuseWarning, stacklevel=3)
    else:
      _KEYS_GIVEN[fingerprint] = transformation
  return key


def forget_keys() -> None:
  """Forgets the keys `noise_key` has seen (for tests and notebooks).

  Example:
    >>> forget_keys()
  """
  _KEYS_GIVEN.clear()

