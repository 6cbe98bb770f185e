"""Does `clipping_method='auto'` take the faster path? Timed side by side.

For each model, one jitted DP-SGD step as a user writes it
(`optax.chain(dpsco_jax.dpsgd(..., clipping_method=m), optax.sgd(0.1))`)
with `m` = ``ghost``, ``vmap`` and ``auto``, timed in the same run by
`harness.time_rows` (interleaved rounds, rotating order). The table gives
each median, the path 'auto' took (`ClippingChoice.path`, with the cost
model's two estimates), the faster of ghost and vmap, and `auto / min(ghost,
vmap)`: above about 1.1, 'auto' took the slower path.

Models (`models.py`), synthetic data, 10 classes:

* ``mlp``: MLP 784-256-10 (ReLU), B=256;
* ``cnn``: two 3x3 convolutions (16, 32 channels) with pooling, dense head,
  28x28 inputs, B=128;
* ``transformer``: one pre-norm encoder block (embedding 1000x64, 32
  tokens, 4 heads), B=64;
* ``embedding``: the same block with a 30,000-token vocabulary (1.9M of its
  2.0M parameters in the embedding), B=64.

Usage (from the repository root)::

    python benchmarks/auto_choice.py [--iters 3] [--warmup 1] [--rounds 5]
        [--only mlp,cnn] [--batch_scale 1.0] [--output PATH]
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import harness
import models
import steps

import dpsco_jax
# pylint: enable=g-import-not-at-top,wrong-import-position

METHODS = ('ghost', 'vmap', 'auto')
LEARNING_RATE = 0.1


class Problem(NamedTuple):
  """A model, its params and the batch size it is timed at.

  Attributes:
    name: the model's name in the table.
    params: `params_fn(rng)` builds its params.
    apply: `apply(params, x)` gives logits.
    batch_size: B.
    batch: `batch(rng, B)` builds a synthetic batch.
  """

  name: str
  params: Callable[[np.random.Generator], Any]
  apply: Callable[..., Any]
  batch_size: int
  batch: Callable[[np.random.Generator, int], Any]


EMBEDDING_VOCABULARY = 30_000
PROBLEMS = {
    'mlp': Problem('MLP 784-256-10', lambda rng: models.mlp_init(
        rng, [models.INPUT_DIM, 256, models.NUM_CLASSES]), models.mlp_apply,
                   256, models.make_batch),
    'cnn': Problem('CNN conv16-conv32-dense', models.cnn_init,
                   models.cnn_apply, 128, models.make_batch),
    'transformer': Problem('transformer block (vocab 1000)',
                           models.transformer_init, models.transformer_apply,
                           64, models.make_token_batch),
    'embedding': Problem(
        f'transformer block (vocab {EMBEDDING_VOCABULARY:,})',
        lambda rng: models.transformer_init(rng, EMBEDDING_VOCABULARY),
        models.transformer_apply, 64,
        lambda rng, b: models.make_token_batch(rng, b, EMBEDDING_VOCABULARY)),
}


def problem_rows(problem: Problem, batch_size: int,
                 rng: np.random.Generator
                 ) -> tuple[dict[str, harness.Row], dict[str, str], Any]:
  """The three rows of one model (built and compiled), and auto's choice."""
  params = problem.params(rng)
  batch = problem.batch(rng, batch_size)
  loss = models.example_loss_fn(problem.apply)

  def build(method: str) -> harness.Row:
    built = steps.dpsgd(loss, optax.sgd(LEARNING_RATE), method)
    return harness.step_row(method, built.step, params, built.init(params),
                            batch)

  rows, skipped = harness.build_rows(
      {m: (lambda m=m: build(m)) for m in METHODS})
  return rows, skipped, steps.auto_choice(loss, params, batch)


def record(problem: Problem, batch_size: int, times: dict[str, list[float]],
           choice) -> dict[str, str]:
  """One table row: the three medians, auto's path, the faster path."""
  medians = harness.summarize(times, baseline='ghost')
  ms = {r['row']: r['median ms'] for r in medians}
  picked = 'vmap (no ghost path)' if choice is None else choice.path
  faster = harness.fastest(times, ('ghost', 'vmap')) or 'n/a'
  estimates = ('n/a' if choice is None else
               f'{choice.ghost:.3g} / {choice.vmap:.3g}')
  return {'model': problem.name, 'B': str(batch_size),
          'ghost ms': ms.get('ghost', 'n/a'), 'vmap ms': ms.get('vmap', 'n/a'),
          'auto ms': ms.get('auto', 'n/a'),
          'vmap / ghost': harness.ratio(times, 'vmap', 'ghost'),
          'auto took': picked, 'faster': faster,
          'auto / faster': harness.ratio(times, 'auto', faster),
          'estimates ghost / vmap': estimates}


def parse_args(argv: list[str]):
  """Parses command-line flags."""
  parser = harness.timing_parser(__doc__, iters=3, warmup=1, rounds=5)
  parser.add_argument('--only', default=','.join(PROBLEMS),
                      help=f'comma-separated subset of {tuple(PROBLEMS)}')
  parser.add_argument('--batch_scale', type=float, default=1.0,
                      help='multiplies every batch size (tiny runs: < 1)')
  parser.add_argument('--output', default='',
                      help='markdown path (JSON and CSV beside it); '
                      'default: print only')
  args = harness.parse_timing(parser, argv)
  args.only = harness.split_choices(parser, args.only, tuple(PROBLEMS),
                                    '--only')
  if args.batch_scale <= 0:
    parser.error('--batch_scale must be positive')
  return args


def main(argv: list[str]) -> list[dict[str, str]]:
  """Times the three paths on each model and prints (writes) the table."""
  args = parse_args(argv)
  # One fixed noise key per row on purpose: the run releases nothing.
  warnings.filterwarnings('ignore', category=dpsco_jax.keys.KeyReuseWarning)
  header = harness.header_lines('auto_choice.py', argv, optional=())
  print('\n'.join(header), flush=True)
  rng = np.random.default_rng(0)
  records, skipped = [], {}
  for key in args.only:
    problem = PROBLEMS[key]
    batch_size = max(1, round(problem.batch_size * args.batch_scale))
    rows, missed, choice = problem_rows(problem, batch_size, rng)
    times = harness.time_rows(rows, args.iters, args.warmup, args.rounds,
                              missed)
    skipped.update({f'{key} {m}': why for m, why in missed.items()})
    records.append(record(problem, batch_size, times, choice))
    print(harness.markdown_table(records[-1:]), flush=True)
  markdown = harness.render_markdown('auto_choice', header, records, skipped)
  print(markdown)
  if args.output:
    harness.write_report(args.output, markdown, records, header)
  return records


if __name__ == '__main__':
  main(sys.argv[1:])
