"""Refusals that hold inside `jit`, `pmap` and `shard_map`.

A private step must refuse to run when its guarantee would silently weaken
(a noise mechanism past its calibrated capacity, a noise key that differs
across devices). Inside a compiled program a Python `raise` is impossible, so
`refuse` does two things: it poisons the output with NaN, so that nothing
computed from it can pass for a private result, and it raises a clear
`PrivacyGuardError` (a `ValueError`) from a host callback, which JAX
reports inside its runtime error; `library_errors(step)` turns that back
into the library's short exception. The callback takes the poisoned output as
an argument, so it runs only after everything that output depends on,
including the cross-device sums: a device that stops there never leaves
another waiting inside a collective. Under `jax.vmap` (sweeps of many runs)
the callback is made once per step for all runs, not once per run.
"""

import functools
import logging
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class PrivacyGuardError(ValueError):
  """A private step refused to run: what it would do is not what was accounted.

  Raised at once by an eager step; under `jit` / `pmap` raised from a host
  callback, which JAX reports inside a longer runtime error: a plan's
  `Plan.step` raises this exception itself, and `library_errors` wraps a
  compiled step of your own to do the same, the library's message alone.
  """


# The last refusal raised from a callback, for `library_errors` (the
# runtime error JAX raises does not chain it; callbacks run on XLA's
# threads, so this is process-wide, not thread-local).
_refusals = types.SimpleNamespace(message=None)


class _OwnRefusals(logging.Filter):
  """Drops JAX's log of a callback failure when the failure is a refusal:
  the refusal is raised to the caller with its own message."""

  def filter(self, record: logging.LogRecord) -> bool:
    info = record.exc_info
    return not (info and isinstance(info[1], PrivacyGuardError))


logging.getLogger('jax._src.callback').addFilter(_OwnRefusals())


def _refuse_now(message: str) -> None:
  _refusals.message = message
  raise PrivacyGuardError(message)


def library_errors(step: Callable[..., Any], *, block: bool = True
                   ) -> Callable[..., Any]:
  """`step`, raising a refusal as a short `PrivacyGuardError`.

  Under `jit`, a refusal reaches the caller as JAX's runtime error, whose
  first lines are XLA's ("INTERNAL: CpuCallback error calling callback:
  Traceback ...") with the library's message at the end. The wrapped step
  raises `PrivacyGuardError(message)` instead, the library's message first
  and alone.

  Example:
    >>> step = guards.library_errors(jax.jit(train_step))
    >>> params, opt_state = step(params, opt_state, batch)

  Args:
    step: a (compiled) training step.
    block: wait for the step's outputs before returning (default), so that a
      refusal is raised here and not at a later use of the outputs; False
      keeps JAX's asynchronous dispatch.

  Returns:
    The wrapped step.
  """

  @functools.wraps(step)
  def wrapped(*args, **kwargs):
    _refusals.message = None
    try:
      outputs = step(*args, **kwargs)
      if block:
        outputs = jax.block_until_ready(outputs)
      return outputs
    except PrivacyGuardError:
      raise
    except Exception as error:  # pylint: disable=broad-except
      message = _refusals.message
      if message is None or message not in str(error):
        raise
      raise PrivacyGuardError(message) from None

  return wrapped


def _raise_if(flag, anchor, message):
  # Under `vmap` this runs ONCE per step with every run's flag (the
  # 'expand_dims' method), not once per run: a sweep of many runs would
  # otherwise make one host round trip per run and step.
  if isinstance(message, tuple):
    # Several conditions checked in one host call: the flags' last axis.
    flags = np.reshape(flag, (-1, len(message)))
    for index, text in enumerate(message):
      if np.any(flags[:, index]):
        _refuse_now(text)
    batch_shape = np.shape(flag)[:-1]
  else:
    if np.any(flag):
      _refuse_now(message)
    batch_shape = np.shape(flag)
  return np.zeros(np.broadcast_shapes(batch_shape, np.shape(anchor)[:-1]),
                  dtype=bool)


def refuse(flag: Any, tree: PyTree, message: str) -> PyTree:
  """Raises `ValueError(message)` when `flag` holds; inside jit, also poisons.

  Example:
    >>> noise = refuse(step >= capacity, noise, 'past the capacity')

  Args:
    flag: bool scalar (Python or traced): True means refuse.
    tree: the output to protect (floating-point leaves).
    message: the error message.

  Returns:
    `tree`, with every leaf NaN when `flag` holds under tracing.

  Raises:
    PrivacyGuardError: (a ValueError) immediately when `flag` is a concrete
      True.
  """
  return refuse_any([(flag, message)], tree)


def refuse_any(conditions: Sequence[tuple[Any, str]], tree: PyTree) -> PyTree:
  """`refuse` for several conditions at the cost of one host check.

  Concrete conditions are checked at once, in order; the traced ones share
  one host callback, which raises the message of the first that holds.

  Example:
    >>> noise = refuse_any([(step >= capacity, 'past the capacity'),
    ...                     (wrong_state, 'another mechanism')], noise)

  Args:
    conditions: `(flag, message)` pairs; a flag is a bool scalar (Python or
      traced), True meaning refuse.
    tree: the output to protect (floating-point leaves).

  Returns:
    `tree`, with every leaf NaN when a traced flag holds.

  Raises:
    PrivacyGuardError: (a ValueError) immediately, with the first concrete
      flag that holds.
  """
  traced = []
  for flag, message in conditions:
    if isinstance(flag, jax.core.Tracer):
      traced.append((flag, message))
    elif bool(flag):
      raise PrivacyGuardError(message)
  if not traced:
    return tree
  flag = functools.reduce(jnp.logical_or, [f for f, _ in traced])
  poisoned = jax.tree_util.tree_map(
      lambda x: jnp.where(flag, jnp.nan, x), tree)
  anchor = jnp.ravel(jax.tree_util.tree_leaves(poisoned)[0])[:1]
  if len(traced) == 1:
    flags, message = traced[0]
  else:
    flags = jnp.stack([jnp.asarray(f, bool) for f, _ in traced], axis=-1)
    message = tuple(m for _, m in traced)
  callback = functools.partial(_raise_if, message=message)

  def host_check(flags, anchor):
    return jax.pure_callback(callback, jax.ShapeDtypeStruct((), jnp.bool_),
                             flags, anchor, vmap_method='expand_dims')

  # The host round trip is made only when a flag holds (a step that passes
  # its checks pays for a `cond`, not a callback; under `vmap` the `cond`
  # becomes a select and the one batched call runs every step). The output
  # depends on the callback's (always False) result, so the check can be
  # neither dropped nor moved before the values it guards.
  checked = jax.lax.cond(flag, host_check,
                         lambda flags, anchor: jnp.zeros((), jnp.bool_),
                         flags, anchor)
  return jax.tree_util.tree_map(
      lambda x: jnp.where(checked, jnp.nan, x), poisoned)
