"""Refusals that hold inside `jit`, `pmap` and `shard_map`.

A private step must refuse to run when its guarantee would silently weaken
(a noise mechanism past its calibrated capacity, a noise key that differs
across devices). Inside a compiled program a Python `raise` is impossible, so
`refuse` does two things: it poisons the output with NaN, so that nothing
computed from it can pass for a private result, and it raises a clear
`ValueError` from a host callback. The callback takes the poisoned output as
an argument, so it runs only after everything that output depends on,
including the cross-device sums: a device that stops there never leaves
another waiting inside a collective. Under `jax.vmap` (sweeps of many runs)
the callback is made once per step for all runs, not once per run.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _raise_if(flag, anchor, message: str):
  # Under `vmap` this runs ONCE per step with every run's flag (the
  # 'expand_dims' method), not once per run: a sweep of many runs would
  # otherwise make one host round trip per run and step.
  if np.any(flag):
    raise ValueError(message)
  return np.zeros(np.broadcast_shapes(np.shape(flag), np.shape(anchor)[:-1]),
                  dtype=bool)


def refuse(flag: Any, tree: PyTree, message: str) -> PyTree:
  """Raises `ValueError(message)` when `flag` holds; inside jit, also poisons.

  Args:
    flag: bool scalar (Python or traced): True means refuse.
    tree: the output to protect (floating-point leaves).
    message: the error message.

  Returns:
    `tree`, with every leaf NaN when `flag` holds under tracing.

  Raises:
    ValueError: immediately when `flag` is a concrete True.
  """
  if not isinstance(flag, jax.core.Tracer):
    if bool(flag):
      raise ValueError(message)
    return tree
  poisoned = jax.tree_util.tree_map(
      lambda x: jnp.where(flag, jnp.nan, x), tree)
  anchor = jnp.ravel(jax.tree_util.tree_leaves(poisoned)[0])[:1]
  # The output depends on the callback's (always False) result, so the check
  # can be neither dropped nor moved before the values it guards.
  checked = jax.pure_callback(
      functools.partial(_raise_if, message=message),
      jax.ShapeDtypeStruct((), jnp.bool_), flag, anchor,
      vmap_method='expand_dims')
  return jax.tree_util.tree_map(
      lambda x: jnp.where(checked, jnp.nan, x), poisoned)
