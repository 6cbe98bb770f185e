"""Progress lines on stderr for long work, so that no wait is silent.

Strategy optimization, noise calibration and the compilation of a big step
can take from seconds to minutes before a run starts. A plain
`python script.py` shows no absl INFO log, so the library reports such work
itself: a line on stderr, rewritten in place (carriage return) on a
terminal, or one line every ten seconds in a log file or pipe, and a final
line with the time taken. Work that ends within `DELAY_SECONDS` prints
nothing.

Quiet when asked: set the environment variable `DPSCO_JAX_PROGRESS=0`
(also 'false', 'off', 'no'), or pass `progress=False` where a function takes
it (`strategies.optimize_strategy`).

Example:
  >>> with progress.task('optimizing a 600x600 strategy') as report:
  ...   for iteration in range(1000):
  ...     report(f'iteration {iteration}, loss {loss:.4g}')
"""

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional

ENV_VAR = 'DPSCO_JAX_PROGRESS'
# Work shorter than this prints nothing.
DELAY_SECONDS = 1.0
# How often the line is rewritten on a terminal, and written elsewhere.
_TERMINAL_INTERVAL = 0.5
_LOG_INTERVAL = 10.0
_QUIET_VALUES = ('0', 'false', 'off', 'no')


def enabled(progress: Optional[bool] = None) -> bool:
  """Whether progress is shown: `progress` if given, else the environment.

  Example:
    >>> progress.enabled()          # True unless DPSCO_JAX_PROGRESS=0

  Args:
    progress: True or False to decide here; None to follow
      `$DPSCO_JAX_PROGRESS` (shown unless it is '0', 'false', 'off', 'no').

  Returns:
    Whether to show progress.

  Raises:
    TypeError: if `progress` is neither None nor a bool.
  """
  if progress is not None:
    if not isinstance(progress, bool):
      raise TypeError(f'progress must be True, False or None, got '
                      f'{progress!r}')
    return progress
  value = os.environ.get(ENV_VAR, '1').strip().lower()
  return value not in _QUIET_VALUES


class _Line:
  """One progress line, written by a background ticker."""

  def __init__(self, what: str, delay: float):
    self.what = what
    self.delay = delay
    self.detail = ''
    self.start = time.perf_counter()
    self.shown = False
    self.width = 0
    self.last_write = -float('inf')
    self.lock = threading.Lock()
    self.done = threading.Event()

  def _stream(self):
    # Looked up at every write: tests and notebooks replace sys.stderr.
    return sys.stderr

  def write(self, final: bool = False) -> None:
    with self.lock:
      now = time.perf_counter()
      elapsed = now - self.start
      if not final and elapsed < self.delay:
        return
      if final and not self.shown:
        return
      stream = self._stream()
      terminal = _isatty(stream)
      if not final and not terminal and (
          now - self.last_write < _LOG_INTERVAL):
        return
      if final:
        text = f'{self.what}: done in {elapsed:.1f} s'
      else:
        detail = f', {self.detail}' if self.detail else ''
        text = f'{self.what}{detail} ({elapsed:.0f} s)'
      if terminal:
        # Pad over the previous, longer line; no newline until the end.
        padded = text.ljust(self.width)
        self.width = max(self.width, len(text))
        stream.write('\r' + padded + ('\n' if final else ''))
      else:
        stream.write(text + '\n')
      stream.flush()
      self.shown = True
      self.last_write = now


def _isatty(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):
    return False


@contextlib.contextmanager
def task(what: str, *, progress: Optional[bool] = None,
         delay: Optional[float] = None) -> Iterator[Callable[[str], None]]:
  """Reports `what` on stderr while the block runs, if it runs long.

  A background thread writes the line once the block has run `delay`
  seconds, then keeps it current (elapsed time and the last detail given);
  the block's end writes `what: done in X s`. A block that ends sooner
  writes nothing.

  Example:
    >>> with progress.task('calibrating the noise') as report:
    ...   report('bisection step 3')        # optional detail
    ...   z = slow_calibration()

  Args:
    what: what is being done, e.g. 'optimizing a 600x600 strategy'.
    progress: True or False to show it or not; None (default) follows
      `$DPSCO_JAX_PROGRESS`.
    delay: seconds before the first line (default `DELAY_SECONDS`).

  Yields:
    `report(detail)`, which sets the detail shown after `what`.
  """
  if not enabled(progress):
    yield lambda detail: None
    return
  line = _Line(str(what), DELAY_SECONDS if delay is None else float(delay))

  def report(detail: str) -> None:
    line.detail = str(detail)

  def tick() -> None:
    interval = min(_TERMINAL_INTERVAL, max(line.delay, 0.05))
    while True:
      line.write()
      if line.done.wait(interval):
        return

  ticker = threading.Thread(target=tick, name='dpsco_jax-progress',
                            daemon=True)
  ticker.start()
  try:
    yield report
  finally:
    line.done.set()
    ticker.join()
    line.write(final=True)
