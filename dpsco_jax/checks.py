"""Argument checks shared by the modules, so every bad input reads the same."""

import collections
import math
import sys
import warnings
import weakref
from typing import Any

import jax
import numpy as np


def positive_int(value: Any, name: str) -> int:
  """Returns `value` as an int, or raises if it is not a positive integer.

  Example:
    >>> positive_int(3, 'num_steps')
    3

  Args:
    value: the argument (bools are refused, integral floats accepted).
    name: the argument name used in the error message.

  Returns:
    `int(value)`.

  Raises:
    ValueError: unless `value` is an integer >= 1.
  """
  try:
    integral = not isinstance(value, bool) and int(value) == value
  except (TypeError, ValueError):
    integral = False
  if not integral or value < 1:
    raise ValueError(f'{name} must be a positive integer, got {value!r}')
  return int(value)


def state_type(state: Any, expected: Any, transformation: str) -> Any:
  """Returns `state`, or raises if it is not the state `transformation` makes.

  A state from another transformation (or another optax chain position)
  would otherwise fail deep inside the step with an unrelated
  AttributeError, or worse, be read field by field as if it were this one.

  Example:
    >>> state_type(state, NoisyGradientState, 'noisy_gradient')

  Args:
    state: the state handed to `update`.
    expected: the state class (or a tuple of classes) `init` returns.
    transformation: the transformation's name, for the message.

  Returns:
    `state`.

  Raises:
    ValueError: if `state` is not an instance of `expected`.
  """
  if not isinstance(state, expected):
    names = ' or '.join(cls.__name__ for cls in (
        expected if isinstance(expected, tuple) else (expected,)))
    raise ValueError(
        f'{transformation}.update got a {type(state).__name__}, not the '
        f'{names} its init makes: the optimizer state belongs to another '
        'transformation (or to another position of an optax chain)')
  return state


def find_state(state: Any, expected: type, transformation: str) -> Any:
  """The one `expected` state inside `state` (any pytree of states).

  An algorithm's output lives in its own state (Algorithm 1's y_T, AC-SA's
  x_ag, O2NC's block averages, DIFF2's random output iterate); the user
  holds the state of the whole optax chain (or wrapper) around it.

  Example:
    >>> find_state(opt_state, AcSaState, 'ac_sa').aggregate

  Args:
    state: a state, or a pytree (an optax chain's tuple, a wrapper's
      state) holding one.
    expected: the state class to find.
    transformation: its transformation's name, for the error.

  Returns:
    The instance found.

  Raises:
    ValueError: if there is none, or more than one (which one would be
      ambiguous).
  """
  found = [part for part in jax.tree_util.tree_leaves(
      state, is_leaf=lambda part: isinstance(part, expected))
           if isinstance(part, expected)]
  if len(found) != 1:
    raise ValueError(
        f'expected one {expected.__name__} (the state of {transformation}), '
        f'found {len(found)}: pass the state of {transformation} or of a '
        'chain containing it once')
  return found[0]


class NoPrivacyWarning(UserWarning):
  """A run built to add no noise, or calibrated to a nominal epsilon."""


# Above this target epsilon, e^epsilon bounds nothing a user would call
# private: calibration goes on, with a NoPrivacyWarning.
NOMINAL_EPSILON = 100.0


def warn_no_noise(what: str) -> None:
  """Warns that `what` adds no noise (`NoPrivacyWarning`).

  Example:
    >>> warn_no_noise('dpsgd')

  Args:
    what: the transformation, for the message.
  """
  warnings.warn(
      f'{what} is built with noise_multiplier=0: it adds no noise, so its '
      'epsilon is infinite (a non-private run). Use it only as a '
      'non-private reference; calibrate the noise with '
      'dpsco_jax.calibrate_noise_multiplier or a plan.', NoPrivacyWarning,
      stacklevel=4)


def noise_multiplier(value: Any, name: str = 'noise_multiplier') -> float:
  """Returns `value` as a float, or raises if it is not a valid multiplier.

  A noise multiplier is a noise standard deviation over a sensitivity: it is
  finite and >= 0. Zero is accepted (no noise; the accountants report an
  infinite epsilon for it). A negative value would be read as its absolute
  value by a Gaussian and NaN or infinity make every epsilon meaningless, so
  they are refused here, once, for the noise code and every accountant alike.

  Example:
    >>> noise_multiplier(1.1)
    1.1

  Args:
    value: the argument (a Python or NumPy/JAX scalar).
    name: the argument name used in the error message.

  Returns:
    `float(value)`.

  Raises:
    ValueError: if `value` is negative, NaN, infinite or not a number.
  """
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = math.nan
  if not 0.0 <= number < math.inf:
    raise ValueError(
        f'{name} must be a non-negative finite number, got {value!r}')
  return number


def positive_finite(value: Any, name: str) -> float:
  """Returns `value` as a float, or raises unless it is positive and finite.

  The one check for step sizes, radii, smoothness and Lipschitz constants:
  zero, a negative value, NaN, infinity or a non-number is refused.

  Example:
    >>> positive_finite(0.5, 'radius')
    0.5

  Args:
    value: the argument.
    name: the argument name used in the error message.

  Returns:
    `float(value)`.

  Raises:
    ValueError: if `value` is not a positive finite number.
  """
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = math.nan
  if not 0.0 < number < math.inf:
    raise ValueError(f'{name} must be positive and finite, got {value!r}')
  return number


def _user_stacklevel() -> int:
  """The `stacklevel` of the first frame outside dpsco_jax (the user's
  call), counted from the caller of `warnings.warn`'s caller."""
  package = __name__.rsplit('.', 1)[0]
  frame, level = sys._getframe(2), 2  # pylint: disable=protected-access
  while frame is not None and frame.f_globals.get(
      '__name__', '').split('.')[0] == package:
    frame, level = frame.f_back, level + 1
  return level


class LargeDeltaWarning(UserWarning):
  """A delta of at least 1/n: the guarantee allows publishing whole records."""


def warn_large_delta(delta: float, num_examples: int,
                     unit: str = 'example') -> None:
  """Warns (`LargeDeltaWarning`) when `delta >= 1/num_examples`.

  An (epsilon, delta) guarantee holds for a mechanism that publishes each
  record in the clear with probability delta (and nothing else): with
  `delta >= 1/n` it may publish about one whole record, or more. The usual
  choice is delta well below 1/n: `1/n^1.1`, or 1e-5 for n around 1e5
  (Dwork and Roth, The Algorithmic Foundations of Differential Privacy,
  §2.3). The accounting is still exact for the delta given, so the run
  goes on (a refusal would also stop tests, audits and the reproduction of
  published settings that chose a large delta on purpose); the warning
  says the number means little. The one check of every plan and of the
  accounting entry points that know n.

  Example:
    >>> warn_large_delta(1e-6, 8000)            # silent
    >>> warn_large_delta(0.01, 8000)            # LargeDeltaWarning

  Args:
    delta: the target delta, in (0, 1).
    num_examples: n, the number of privacy units (examples, or users for
      user-level privacy).
    unit: what one privacy unit is, for the message.
  """
  n = positive_int(num_examples, 'num_examples')
  if float(delta) * n < 1.0:
    return
  usual = 1.0 / n ** 1.1
  warnings.warn(
      f'delta = {float(delta):.3g} is at least 1/n = 1/{n:,} (the number of '
      f'{unit}s): a guarantee that still holds for a mechanism publishing '
      f'about {float(delta) * n:.3g} whole {unit}(s) in the clear, so it '
      f'protects little. The usual choice is delta well below 1/n, e.g. '
      f'1/n^1.1 = {usual:.2g} (or 1e-5 for n around 1e5).',
      LargeDeltaWarning, stacklevel=_user_stacklevel())


class NonFiniteDataWarning(UserWarning):
  """Training data with NaN or infinite values (their rows add nothing)."""


# Data already checked by `warn_non_finite`: the ids of its leaves, with
# weak references that tell a reused id from the same array. Bounded: a
# loop over many data objects keeps the last few.
_CHECKED: 'collections.OrderedDict[tuple, tuple]' = collections.OrderedDict()
_CHECKED_SIZE = 32


def _already_checked(leaves: list) -> bool:
  ids = tuple(id(leaf) for leaf in leaves)
  refs = _CHECKED.get(ids)
  if refs is not None and all(ref() is leaf for ref, leaf in zip(
      refs, leaves)):
    _CHECKED.move_to_end(ids)
    return True
  try:
    _CHECKED[ids] = tuple(weakref.ref(leaf) for leaf in leaves)
  except TypeError:  # a leaf without weak references: check every time
    return False
  if len(_CHECKED) > _CHECKED_SIZE:
    _CHECKED.popitem(last=False)
  return False


def non_finite_rows(data: Any) -> tuple[int, int]:
  """`(rows with a NaN or infinite value, rows)` of a pytree of arrays.

  Rows index the leading axis of every leaf; integer leaves are finite.
  Device arrays are reduced on their device (one count comes back).

  Example:
    >>> non_finite_rows({'x': np.array([[1.0, np.nan], [2.0, 3.0]]),
    ...                  'y': np.array([0, 1])})
    (1, 2)

  Args:
    data: a pytree of arrays with one leading (row) axis.

  Returns:
    `(bad, n)`.
  """
  leaves = [leaf for leaf in jax.tree_util.tree_leaves(data)
            if np.ndim(leaf)]
  if not leaves:
    return 0, 0
  n = int(np.shape(leaves[0])[0])
  bad = np.zeros(n, bool)
  for leaf in leaves:
    module = jax.numpy if isinstance(leaf, jax.Array) else np
    leaf = leaf if module is jax.numpy else np.asarray(leaf)
    if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
      continue
    rows = ~module.isfinite(leaf).reshape(leaf.shape[0], -1).all(axis=1)
    bad |= np.asarray(rows)
  return int(bad.sum()), n


def warn_non_finite(data: Any, what: str) -> None:
  """Warns (`NonFiniteDataWarning`) once per data object with NaN or Inf.

  A plan's clipping zeroes the contribution of an example whose gradient
  is not finite (so privacy holds), which silently trains on fewer rows
  than the user believes. `data.load_table` refuses such cells; data
  handed straight to a plan is checked here, once per data object (the
  same arrays again are not read twice).

  Example:
    >>> warn_non_finite({'x': x, 'y': y}, 'plan.batches_of')

  Args:
    data: a pytree of arrays with a leading row axis.
    what: the call that received it, for the message.
  """
  leaves = [leaf for leaf in jax.tree_util.tree_leaves(data)
            if np.ndim(leaf)]
  if not leaves or _already_checked(leaves):
    return
  bad, n = non_finite_rows(data)
  if bad:
    warnings.warn(
        f'{what}: {bad:,} of {n:,} rows of the data hold NaN or infinite '
        'values. Their gradients are not finite, so the clipping zeroes '
        'their contribution: they are trained on as if absent. Drop or '
        'impute them first (and build the plan for the rows left).',
        NonFiniteDataWarning, stacklevel=_user_stacklevel())
