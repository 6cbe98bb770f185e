"""Cross-device reductions for private steps under `pmap` / `shard_map`.

The rule every private step follows on several devices: each device clips its
own examples, the clipped SUMS are summed across devices (`psum`), and the
noise is drawn ONCE from a key that is identical on every device, so each
device adds the very same noise to the very same global sum. Drawing noise per
device and averaging would shrink its standard deviation by sqrt(devices) and
silently weaken privacy; `check_replicated` refuses a non-replicated key.
"""

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

PyTree = Any


def psum(tree: PyTree, axis_name: Optional[str]) -> PyTree:
  """Sums `tree` over the devices of `axis_name` (identity when None).

  Args:
    tree: a pytree of arrays.
    axis_name: the mapped axis name, or None for a single device.

  Returns:
    The summed pytree, identical on every device.
  """
  if axis_name is None:
    return tree
  return jax.lax.psum(tree, axis_name)


def axis_size(axis_name: Optional[str]) -> int:
  """Number of devices along `axis_name` (1 when None).

  Args:
    axis_name: the mapped axis name, or None.

  Returns:
    The static axis size.
  """
  if axis_name is None:
    return 1
  return jax.lax.axis_size(axis_name)


def _raise_not_replicated(mismatch, what: str) -> None:
  if mismatch:
    raise ValueError(
        f'{what} differs across devices. Noise must come from ONE key '
        'replicated on every device (never fold the device index into a '
        'noise key); otherwise each device adds different noise.')


def check_replicated(key: jax.Array, axis_name: Optional[str],
                     what: str = 'the noise key') -> None:
  """Raises (at run time) if `key` is not identical on every device.

  Costs one all-reduce of two integers.

  Args:
    key: a PRNG key (typed or raw).
    axis_name: the mapped axis name, or None (no check).
    what: the name used in the error message.
  """
  if axis_name is None:
    return
  data = key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
  data = data.astype(jnp.uint32).view(jnp.int32)
  mismatch = jnp.any(jax.lax.pmax(data, axis_name) !=
                     jax.lax.pmin(data, axis_name))
  jax.debug.callback(functools.partial(_raise_not_replicated, what=what),
                     mismatch)
