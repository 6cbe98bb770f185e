"""Cross-device reductions for private steps under `pmap` / `shard_map`.

The rule every private step follows on several devices: each device clips its
own examples, the clipped SUMS are summed across devices (`psum`), and the
noise is drawn ONCE from a key that is identical on every device, so each
device adds the very same noise to the very same global sum. Drawing noise per
device and averaging would shrink its standard deviation by sqrt(devices) and
silently weaken privacy; `check_replicated` detects a non-replicated key so
that the step can refuse it (`dpsco_jax.guards`).
"""

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


def gather(x: jax.Array, axis_name: Optional[str]) -> jax.Array:
  """Every device's `x`, concatenated along the first axis, on every device.

  Built from `psum` (each device writes its block into zeros), so the result
  is replicated (invariant under `shard_map`'s type checks, unlike
  `lax.all_gather`) and works the same under `pmap`, `shard_map` and a
  `vmap` with an axis name. Meant for small per-step values (a batch's ids),
  not for data.

  Example:
    >>> all_ids = gather(local_ids, 'devices')   # [devices * local, ...]

  Args:
    x: this device's block (integer or bool; bools are gathered exactly).
    axis_name: the mapped axis name, or None (identity).

  Returns:
    `[axis_size * x.shape[0], ...]`, device 0's block first.
  """
  if axis_name is None:
    return x
  x = jnp.asarray(x)
  dtype = x.dtype
  if dtype == jnp.bool_:
    x = x.astype(jnp.int32)
  blocks = jnp.zeros((axis_size(axis_name),) + x.shape, x.dtype)
  blocks = blocks.at[jax.lax.axis_index(axis_name)].set(x)
  gathered = jax.lax.psum(blocks, axis_name).astype(dtype)
  return gathered.reshape((-1,) + x.shape[1:])


def per_device(tree: PyTree, axis_name: Optional[str]) -> PyTree:
  """Marks replicated values as device-varying before per-example work.

  Under `shard_map`, differentiating with respect to a replicated (invariant)
  value sums the gradient over devices automatically. Per-example gradients
  taken at replicated params would then mix the examples of different
  devices BEFORE clipping, breaking the per-example bound. Casting params to
  device-varying first keeps each device's gradients its own; the clipped
  sums are then added explicitly with `psum`. Under `pmap` it is a no-op.
  Under `jax.vmap(..., axis_name=...)` (clients simulated on one device) it
  is the identity too: a vmapped function never sums gradients over the
  mapped axis, and `pcast` is undefined there.

  Args:
    tree: a pytree of replicated arrays (e.g. params).
    axis_name: the mapped axis name, or None (identity).

  Returns:
    The same values, typed as varying along `axis_name`.
  """
  if axis_name is None:
    return tree

  def one(x):
    if not _is_manual_axis(x, axis_name):
      return x
    return jax.lax.pcast(x, axis_name, to='varying')

  return jax.tree_util.tree_map(one, tree)


def _is_manual_axis(x: Any, axis_name: str) -> bool:
  """Whether `axis_name` is a pmap / shard_map (manual) axis of `x`'s trace.

  Asks the trace's mesh as well as `x`'s type: a value closed over by the
  mapped function (params a user's step captures instead of taking them as
  an argument) has no mesh in its type, yet differentiating with respect to
  it inside `shard_map` sums the gradient over the devices all the same.
  """
  mesh = getattr(getattr(jax.typeof(x), 'sharding', None), 'mesh', None)
  if axis_name in getattr(mesh, 'manual_axes', ()):
    return True
  get_abstract_mesh = getattr(jax.sharding, 'get_abstract_mesh', None)
  if get_abstract_mesh is None:
    return False
  return axis_name in getattr(get_abstract_mesh(), 'manual_axes', ())


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


def check_replicated(key: jax.Array, axis_name: Optional[str]
                     ) -> Optional[jax.Array]:
  """Whether `key` differs across the devices of `axis_name`.

  Costs one all-reduce of two integers. Pass the flag to
  `guards.record` together with the step's output and the state's record.

  Args:
    key: a PRNG key (typed or raw).
    axis_name: the mapped axis name, or None (no check).

  Returns:
    A bool scalar, True when the key differs across devices (None when
    `axis_name` is None).
  """
  if axis_name is None:
    return None
  data = key
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
  data = data.astype(jnp.uint32).view(jnp.int32)
  return jnp.any(jax.lax.pmax(data, axis_name) !=
                 jax.lax.pmin(data, axis_name))


NOT_REPLICATED_MESSAGE = (
    'the noise key differs across devices. Noise must come from ONE key '
    'replicated on every device (never fold the device index into a noise '
    'key); otherwise each device adds different noise.')
