"""Argument checks shared by the modules, so every bad input reads the same."""

import math
import warnings
from typing import Any

import jax


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
