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
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _raise_if(flag, anchor, message):
  # Under `vmap` this runs ONCE per step with every run's flag (the
  # 'expand_dims' method), not once per run: a sweep of many runs would
  # otherwise make one host round trip per run and step. With several
  # messages, `flag` has one entry per message on its last axis.
  if isinstance(message, str):
    if np.any(flag):
      raise ValueError(message)
    shape = np.shape(flag)
  else:
    flag = np.asarray(flag)
    for i, text in enumerate(message):
      if np.any(flag[..., i]):
        raise ValueError(text)
    shape = flag.shape[:-1]
  return np.zeros(np.broadcast_shapes(shape, np.shape(anchor)[:-1]),
                  dtype=bool)


def refuse(flag: Any, tree: PyTree,
           message: Union[str, Sequence[str]]) -> PyTree:
  """Raises `ValueError(message)` when `flag` holds; inside jit, also poisons.

  Several conditions, each with its own message, can share one check (one
  host callback a step under jit): pass a sequence of flags and a sequence
  of as many messages; the message of the first flag that holds is raised.

  Example:
    >>> updates = refuse(step >= capacity, updates, 'past the capacity')
    >>> updates = refuse((too_big, repeated), updates,
    ...                  ('an id is too big', 'an id is repeated'))

  Args:
    flag: bool scalar (Python or traced): True means refuse; or a sequence
      of them.
    tree: the output to protect (floating-point leaves).
    message: the error message, or one message per flag.

  Returns:
    `tree`, with every leaf NaN when a flag holds under tracing.

  Raises:
    ValueError: immediately when a flag is a concrete True.
  """
  several = not isinstance(message, str)
  flags = list(flag) if several else [flag]
  messages = tuple(message) if several else (message,)
  if len(flags) != len(messages):
    raise ValueError(f'{len(flags)} flags for {len(messages)} messages')
  if not any(isinstance(f, jax.core.Tracer) for f in flags):
    for f, text in zip(flags, messages):
      if bool(f):
        raise ValueError(text)
    return tree
  if several:
    flag = jnp.stack([jnp.asarray(f, bool) for f in flags], axis=-1)
    refused = jnp.any(flag, axis=-1)
  else:
    refused, messages = flag, messages[0]
  poisoned = jax.tree_util.tree_map(
      lambda x: jnp.where(refused, jnp.nan, x), tree)
  anchor = jnp.ravel(jax.tree_util.tree_leaves(poisoned)[0])[:1]
  # The output depends on the callback's (always False) result, so the check
  # can be neither dropped nor moved before the values it guards.
  checked = jax.pure_callback(
      functools.partial(_raise_if, message=messages),
      jax.ShapeDtypeStruct((), jnp.bool_), flag, anchor,
      vmap_method='expand_dims')
  return jax.tree_util.tree_map(
      lambda x: jnp.where(checked, jnp.nan, x), poisoned)
