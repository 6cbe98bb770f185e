"""Refusals that hold inside `jit`, `pmap` and `shard_map`, with no host round trip.

A private step must refuse to run when its guarantee would silently weaken
(a noise mechanism past its calibrated capacity, a noise key that differs
across devices, a batch its accounting does not describe). Inside a compiled
program a Python `raise` is impossible, and a host callback (or a `cond`
guarding one) would make every step read a value back from the device: on a
GPU each executed `conditional` copies its predicate to the host and waits
on the stream, which drains the queue of kernels. So the hot path refuses
on the device alone (`record`):

* the output is poisoned with NaN (`jnp.where`, a select, not a branch), so
  nothing computed from it can pass for a private result;
* the refusal is recorded in the state of whatever checked it (a `Refusal`:
  which check, at which step), and the record is sticky: every later step of
  that state is poisoned too, so nothing after a refusal is released either.

The host learns of a refusal without waiting on the device:

* `raise_if_refused(state)` raises `PrivacyGuardError` (naming the check and
  the step) from any pytree holding records: the one call a hand-written
  loop makes, e.g. every few steps or at the end of the run;
* `RefusalMonitor` checks the records of dispatched steps once they are
  ready and waits for one only when it falls `max_lag` steps behind
  (`plans.Plan.step` uses one);
* the ledger's reads, checkpoint saves and a plan's `finish` call
  `raise_if_refused`.

Eager (concrete) checks still raise at once. `refuse`/`refuse_any` remain
for code that has no state to record in (they call back to the host, and
only when a check fails, through a `cond`): no library step uses them.
"""

import functools
import logging
import types
import zlib
from collections import deque
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class PrivacyGuardError(ValueError):
  """A private step refused to run: what it would do is not what was accounted.

  Raised at once by an eager step. A compiled step records the refusal in
  its state (see the module docstring): `raise_if_refused(state)`,
  `plans.Plan.step`, the ledger's reads and checkpoint saves raise this
  exception from the record, naming the check and the step.

  Attributes:
    check: the refused check's message (what failed and what to do).
    step: the step the check refused (the checking state's own step
      counter, from 0), or None when raised at once by an eager step.
    kind: a short tag of the check ('capacity', 'mechanism', 'batch',
      'replication', ...; '' when untagged), for callers that add advice
      of their own (a plan names its keyword).
  """

  def __init__(self, message: str, *, check: Optional[str] = None,
               step: Optional[int] = None, kind: str = ''):
    super().__init__(message)
    self.check = message if check is None else check
    self.step = step
    self.kind = kind


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

  With `block=True` the wrapped step waits for its outputs and raises the
  refusal recorded in them (`raise_if_refused`). A refusal raised from a
  host callback (`refuse`, in code with no state to record in) reaches the
  caller as JAX's runtime error, whose first lines are XLA's; the wrapped
  step raises `PrivacyGuardError(message)` instead, the library's message
  first and alone.

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
        raise_if_refused(outputs)
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


# ------------------------------------------------ refusals kept in the state

# The messages of the checks that can be recorded, by code: filled when a
# step is traced (a check's message is static text), read when a record is
# raised. The code is a hash of the text, so it is the same in every process
# that traces the same check.
_CHECKS: dict[int, tuple[str, str]] = {}


class Refusal(NamedTuple):
  """The refusal record a checking state carries (see the module docstring).

  Attributes:
    check: uint32, 0 while every check has passed; else the code of the
      first check that failed (its message is looked up by
      `raise_if_refused`).
    step: int32, the step (the checking state's own counter) at which that
      check failed; -1 while none has.

  Not secret: it says whether and when a check failed, nothing about the
  data beyond the failure itself.
  """

  check: jax.Array
  step: jax.Array


def no_refusal() -> Refusal:
  """The record of a state that has refused nothing (for `init`).

  Example:
    >>> state = MyState(step=jnp.zeros((), jnp.int32), refusal=no_refusal())

  Returns:
    `Refusal(check=0, step=-1)`.
  """
  return Refusal(check=jnp.zeros((), jnp.uint32),
                 step=jnp.full((), -1, jnp.int32))


def check_code(message: str, kind: str = '') -> int:
  """The code under which a check is recorded (registering its message).

  Example:
    >>> code = check_code('past the capacity', kind='capacity')

  Args:
    message: the check's message.
    kind: a short tag (see `PrivacyGuardError.kind`).

  Returns:
    A positive int below 2**32, the same for the same message in any
    process.
  """
  code = zlib.crc32(message.encode()) % 0xFFFFFFFF + 1
  _CHECKS[code] = (message, kind)
  return code


def record(conditions: Sequence[tuple[Any, str]], tree: PyTree,
           refusal: Refusal, step: Any, *, kind: str = ''
           ) -> tuple[PyTree, Refusal]:
  """Refuses on the device: poisons `tree` and records the first failed check.

  No host callback and no branch: the poisoning is a select, so a step that
  passes its checks runs the same program as one that fails them, and never
  waits on the host. A record already set (an earlier step refused) poisons
  this step too and is kept: the first refusal is the one reported.

  Example:
    >>> noise, refusal = record(
    ...     [(state.step >= capacity, 'past the capacity')], noise,
    ...     state.refusal, state.step, kind='capacity')

  Args:
    conditions: `(flag, message)` pairs; a flag is a bool scalar (Python or
      traced), True meaning refuse.
    tree: the output to protect (floating-point leaves).
    refusal: the state's current record.
    step: the state's step counter (recorded with a failure).
    kind: a tag for the messages' kind (see `PrivacyGuardError.kind`); a
      `(flag, message, kind)` triple in `conditions` overrides it.

  Returns:
    `(tree, refusal)`: every leaf NaN when a check fails now or failed
    before; the updated record.

  Raises:
    PrivacyGuardError: at once, when a flag is a concrete True and the
      record is concrete and clear (an eager step).
  """
  traced = []
  for condition in conditions:
    flag, message = condition[0], condition[1]
    tag = condition[2] if len(condition) > 2 else kind
    if isinstance(flag, jax.core.Tracer):
      traced.append((flag, check_code(message, tag)))
    elif bool(np.any(flag)):
      if isinstance(refusal.check, jax.core.Tracer):
        traced.append((jnp.asarray(True), check_code(message, tag)))
      else:
        raise PrivacyGuardError(message, check=message, kind=tag)
  if not traced and not isinstance(refusal.check, jax.core.Tracer):
    # An eager step: a record set by an earlier (compiled) step is raised
    # at once, as a failing check would be.
    error = _error_from(refusal)
    if error is not None:
      raise error
    return tree, refusal
  refused_before = refusal.check != 0
  code = jnp.zeros((), jnp.uint32)
  for flag, value in reversed(traced):   # the first failed check wins
    code = jnp.where(flag, jnp.uint32(value), code)
  failed = code != 0
  check = jnp.where(refused_before, refusal.check, code).astype(jnp.uint32)
  at = jnp.where(refused_before | ~failed, refusal.step,
                 jnp.asarray(step, jnp.int32)).astype(jnp.int32)
  poison = refused_before | failed
  tree = jax.tree_util.tree_map(lambda x: jnp.where(poison, jnp.nan, x), tree)
  return tree, Refusal(check=check, step=at)


def refusals_in(tree: PyTree) -> list[Refusal]:
  """Every `Refusal` record in a pytree (an optimizer state, a step's outputs).

  Example:
    >>> len(refusals_in(opt_state))   # one per checking state

  Args:
    tree: any pytree.

  Returns:
    The records, in the pytree's order.
  """
  return [leaf for leaf in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda x: isinstance(x, Refusal))
          if isinstance(leaf, Refusal)]


def _on_host(array: Any) -> np.ndarray:
  # A record replicated over the devices of several processes is not fully
  # addressable here; every process holds a full copy of it.
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    array = array.addressable_data(0)
  return np.asarray(array)


def _error_from(refusal: Refusal) -> Optional[PrivacyGuardError]:
  codes = _on_host(refusal.check).reshape(-1)
  if not codes.any():
    return None
  where = int(np.flatnonzero(codes)[0])
  steps = np.broadcast_to(_on_host(refusal.step),
                          np.shape(refusal.check)).reshape(-1)
  code, step = int(codes[where]), int(steps[where])
  message, kind = _CHECKS.get(code, (
      f'a privacy check (code {code:#010x}) refused the step; its message '
      'is known to the process that compiled the step', ''))
  # Several records side by side (vmapped runs, replicated devices): say
  # which, when they differ.
  run = ''
  if codes.size > 1 and not np.all(codes == codes[0]):
    run = f', in entry {where} of the {codes.size} batched runs or devices'
  return PrivacyGuardError(
      f'{message} (refused at step {step}{run}; nothing from that step on '
      'was released: its outputs and every later one are NaN)',
      check=message, step=step, kind=kind)


def raise_if_refused(tree: PyTree) -> None:
  """Raises `PrivacyGuardError` if any refusal record in `tree` is set.

  The one call a hand-written loop makes to learn of a refusal (the step
  itself never waits on the host). It reads the records, so it waits for
  the step that made them: call it every few steps, or once the outputs
  are needed anyway (logging, evaluation, a checkpoint, the end of the run).

  Example:
    >>> for batch in batches:
    ...   params, opt_state = train_step(params, opt_state, batch)
    >>> guards.raise_if_refused(opt_state)   # names the check and the step

  Args:
    tree: an optimizer state, or any pytree holding states (batched over
      vmapped runs or replicated over devices).

  Raises:
    PrivacyGuardError: the first record set, with the check's message and
      the step it refused.
  """
  for refusal in refusals_in(tree):
    error = _error_from(refusal)
    if error is not None:
      raise error


def _ready(refusal: Refusal) -> bool:
  return all(getattr(x, 'is_ready', lambda: True)() for x in refusal)


class RefusalMonitor:
  """Learns of refusals without waiting on the device.

  `watch(state)` after dispatching each step: records already computed are
  read at once (a few bytes, no wait); a record is waited for only when
  `max_lag` newer steps have been dispatched since, so a refusal is raised
  at most `max_lag` calls of `watch` after the step that made it, and the
  device keeps `max_lag` steps of work queued. `flush()` waits for all.

  Example:
    >>> monitor = RefusalMonitor(max_lag=2)
    >>> for batch in batches:
    ...   params, opt_state = train_step(params, opt_state, batch)
    ...   monitor.watch(opt_state)
    >>> monitor.flush()

  Args:
    max_lag: how many steps a refusal may be raised late (>= 0; 0 waits for
      every step, as a blocking step would).
  """

  def __init__(self, max_lag: int = 2):
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or (
        max_lag < 0):
      raise ValueError(f'max_lag must be an int >= 0, got {max_lag!r}')
    self.max_lag = max_lag
    self._pending: deque = deque()

  def watch(self, tree: PyTree) -> None:
    """Adds a dispatched step's records; raises any refusal found ready.

    Args:
      tree: the step's new state (or outputs).

    Raises:
      PrivacyGuardError: a watched record is set.
    """
    records = refusals_in(tree)
    for refusal in records:
      for array in refusal:
        copy = getattr(array, 'copy_to_host_async', None)
        if copy is not None:
          copy()
    self._pending.append(records)
    while self._pending and (len(self._pending) > self.max_lag or all(
        _ready(r) for r in self._pending[0])):
      self._check(self._pending.popleft())

  def flush(self) -> None:
    """Waits for every watched record and raises any refusal.

    Raises:
      PrivacyGuardError: a watched record is set.
    """
    while self._pending:
      self._check(self._pending.popleft())

  def _check(self, records: list[Refusal]) -> None:
    for refusal in records:
      error = _error_from(refusal)
      if error is not None:
        self._pending.clear()
        raise error


def record_in(conditions: Sequence[tuple[Any, str]], state: PyTree,
              step: Any, *, kind: str = '') -> PyTree:
  """`record` into every refusal record of a state, poisoning nothing else.

  For a check made outside the transformation that owns the records (the
  physical-batch bookkeeping around a plan's step, `dpsco_jax.physical`):
  each record of `state` takes the refusal, so every later step of the
  state is poisoned (the caller poisons this step's output itself).

  Example:
    >>> opt_state = record_in([(count != expected, 'other examples')],
    ...                       opt_state, step)

  Args:
    conditions: `(flag, message)` pairs, as for `record`.
    state: a pytree holding `Refusal` records (an optimizer state).
    step: the step the check belongs to.
    kind: as for `record`.

  Returns:
    `state` with every record updated.

  Raises:
    ValueError: if `state` holds no record to keep the refusal in.
  """
  if not refusals_in(state):
    raise ValueError('the state holds no refusal record (it was not made by '
                     'a dpsco_jax private transformation\'s init)')

  def update(leaf):
    if isinstance(leaf, Refusal):
      return record(conditions, (), leaf, step, kind=kind)[1]
    return leaf

  return jax.tree_util.tree_map(update, state,
                                is_leaf=lambda x: isinstance(x, Refusal))
