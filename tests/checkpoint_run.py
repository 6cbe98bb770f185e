"""`experiments.resumable` as a subprocess of tests/test_checkpoint.py.

Its checkpoint (`--checkpoint`, a directory: orbax-checkpoint arrays and a
JSON manifest) is resumed from when the command runs again.

With `--pause_after_step=k` the run stops after step k (checkpointed or
not), writes `--pause_marker`, and sleeps, so that the test can SIGKILL it
at a known point:

    python -m tests.checkpoint_run --checkpoint=... --pause_after_step=6 \
        --pause_marker=/tmp/paused
"""

import pathlib
import time
from typing import Sequence

from absl import app
from absl import flags

from experiments import resumable


def main(argv: Sequence[str]) -> None:
  del argv
  pause_after = flags.FLAGS.pause_after_step

  def on_step(step: int) -> None:
    if step == pause_after:
      pathlib.Path(flags.FLAGS.pause_marker).write_text(str(step))
      time.sleep(600)  # Until the test kills the process.

  resumable.train(resumable.Settings.from_flags(), flags.FLAGS.checkpoint,
                  flags.FLAGS.release, on_step=on_step)


if __name__ == '__main__':
  resumable.define_flags()
  flags.DEFINE_integer('pause_after_step', None, 'Step after which to pause.')
  flags.DEFINE_string('pause_marker', None, 'File written when pausing.')
  app.run(main)
