"""Cost of the in-step refusals (mechanism identity and capacity) per step.

Every private step checks, inside the compiled program, that its noise state
was made by its own mechanism and that the step is within the capacity the
noise was calibrated for (`dpsco_jax.guards.record`: the output poisoned
with a select and the refusal recorded in the state, no host round trip).
This script times the jitted DP-SGD step (logistic regression 784->10,
`steps.dpsgd`) with the checks and, side by side in the same process, with
the checks replaced by a pass-through, on `harness.time_rows` (interleaved
rounds, rotating order), and prints the ratio of the medians.

    python benchmarks/refusal_overhead.py --batch_size=500 --rounds=7
"""

import os
import sys
import warnings

import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import harness
import models
import steps

import dpsco_jax
from dpsco_jax import noise
# pylint: enable=g-import-not-at-top,wrong-import-position


def _row(name: str, params, batch) -> harness.Row:
  """The DP-SGD step as a compiled row (compiled now: see `main`)."""
  built = steps.dpsgd(models.example_loss_fn(models.logreg_apply),
                      optax.sgd(0.1))
  row = harness.step_row(name, built.step, params, built.init(params), batch)
  row.run(1)
  return row


def main(argv: list[str]) -> None:
  """Times the step with and without the refusals; prints the ratio."""
  parser = harness.timing_parser(__doc__, iters=200, warmup=1, rounds=7)
  parser.add_argument('--batch_size', type=int, default=500)
  parser.add_argument('--repeats', type=int, default=None,
                      help='an older name of --iters')
  args = harness.parse_timing(parser, argv)
  iters = args.repeats or args.iters
  rng = np.random.default_rng(0)
  params = models.dense_init(rng, models.INPUT_DIM, models.NUM_CLASSES)
  batch = models.make_batch(rng, args.batch_size)
  # The same key on purpose: both steps do the same work.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  rows = {'with refusals': _row('with refusals', params, batch)}
  original = noise._refuse_invalid  # pylint: disable=protected-access
  # The same step without the in-step refusals (eager checks still run),
  # compiled while the pass-through is in place.
  noise._refuse_invalid = lambda state, tree, *unused: (tree, state.refusal)  # pylint: disable=protected-access
  try:
    rows['without'] = _row('without', params, batch)
  finally:
    noise._refuse_invalid = original  # pylint: disable=protected-access
  skipped = {}
  times = harness.time_rows(rows, iters, args.warmup, args.rounds, skipped)
  print('\n'.join(harness.header_lines('refusal_overhead.py', argv, ())))
  print(f'logistic regression 784->10, batch {args.batch_size}, '
        f'{args.rounds} interleaved rounds of {iters} steps')
  for with_checks, without in zip(*times.values()):
    print(f'  with refusals {1e3 * with_checks:.3f} ms/step, without '
          f'{1e3 * without:.3f} ms/step')
  print('ratio of the medians (with / without): '
        f'{harness.ratio(times, "with refusals", "without")}')


if __name__ == '__main__':
  main(sys.argv[1:])
