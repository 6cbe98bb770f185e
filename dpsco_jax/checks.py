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
