"""Slow results (calibrations) computed once per test run, on first use.

A test module that needs a calibration that takes seconds asks for it here
instead of computing it at import: pytest-xdist imports every test module in
every worker to collect it, so a module-level calibration is paid once per
worker even where no test of the module runs. Here it is paid by the first
test that needs it, and stored in the run's cache directory
(`$DPSCO_JAX_CACHE`, one per run: tests/conftest.py) for the other worker.
"""

import functools
import hashlib
import os
import pickle
import tempfile
from typing import Any, Callable


@functools.lru_cache(maxsize=None)
def _memo(fn: Callable[..., Any], args: tuple, kwargs: tuple) -> Any:
  """`fn(*args, **dict(kwargs))`, read from the run's cache when there."""
  key = pickle.dumps((fn.__module__, fn.__qualname__, args, kwargs))
  directory = os.path.join(os.environ['DPSCO_JAX_CACHE'], 'tests')
  path = os.path.join(directory, hashlib.sha256(key).hexdigest() + '.pkl')
  try:
    with open(path, 'rb') as handle:
      return pickle.load(handle)
  except (OSError, EOFError, pickle.UnpicklingError):
    pass
  value = fn(*args, **dict(kwargs))
  os.makedirs(directory, exist_ok=True)
  # Written under a unique name, then renamed: the other worker reads no
  # entry or a whole one.
  with tempfile.NamedTemporaryFile(dir=directory, suffix='.partial',
                                   delete=False) as handle:
    pickle.dump(value, handle)
  os.replace(handle.name, path)
  return value


def once(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """`fn(*args, **kwargs)` computed once per test run (arguments hashable).

  Example:
    >>> cal = once(outlier_removal.calibrate, 400, 0.05, 4.0, 1e-5)

  Args:
    fn: a deterministic module-level function whose result pickles.
    *args: its positional arguments.
    **kwargs: its keyword arguments.

  Returns:
    What `fn` returns.
  """
  return _memo(fn, args, tuple(sorted(kwargs.items())))
