"""Smoke tests of `benchmarks/compiled_cost.py` on its small model.

Nothing is run, only compiled; no cost or ratio is asserted beyond what
holds by construction (the ratios belong to the benchmark's own output).
"""

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
import compiled_cost  # pylint: disable=g-import-not-at-top,wrong-import-position

SMALL = dataclasses.replace(compiled_cost.small_model(), batch_sizes=(32,))


@pytest.fixture(scope='module')
def records():
  got, skipped = compiled_cost.cost_rows(
      SMALL, ('non-private', 'dpsgd vmap', 'plans.dpsgd poisson'),
      log=lambda line: None)
  assert skipped == {}
  return got


def test_rows_are_costed_from_shapes(records):
  assert [r.row for r in records] == ['non-private', 'dpsgd vmap',
                                      'plans.dpsgd poisson']
  plain, vmap, plan = (r.cost for r in records)
  assert plain.host_callbacks == plain.conditionals_every_step == 0
  # Per-example gradients of 32 examples: more work than one gradient.
  assert vmap.flops > plain.flops > 0 and vmap.temp_bytes > plain.temp_bytes
  assert records[2].note == 'padded to 64'     # Poisson batch of 32
  assert plan.entry_ops > 0


def test_the_table_gives_each_ratio_to_the_non_private_step(records):
  table = compiled_cost.markdown_table(records)
  lines = table.splitlines()
  assert len(lines) == 2 + len(records)
  assert lines[2].startswith('| small | 32 | non-private |')
  assert lines[2].count('(1.00x)') == 4    # flops, bytes, temp, ops
  assert all(line.count('x)') == 4 for line in lines[3:])


def test_auto_reports_the_path_it_takes():
  batch = compiled_cost._batched(SMALL.example, 32)  # pylint: disable=protected-access
  assert compiled_cost.steps.auto_path(SMALL.loss_fn, SMALL.params,
                                       batch) == 'ghost'


def test_flags_need_the_non_private_row():
  assert compiled_cost.parse_args(['--small_only']).small_only
  with pytest.raises(SystemExit):
    compiled_cost.parse_args(['--rows', 'dpsgd vmap'])
