"""Argument checks shared by the modules, so every bad input reads the same."""

from typing import Any


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
