"""Smoke tests of the benchmarks, at tiny sizes: the decoder, the harness,
the 'auto' timing.

No timing is asserted: speed belongs in the benchmarks' own output.
"""

import csv
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
import decoder_step  # pylint: disable=g-import-not-at-top,wrong-import-position

TINY = decoder_step.VARIANTS['tiny']


def test_default_decoder_has_the_issues_parameter_count():
  # 35.8M: embedding and untied head 16384 x 512 each, 256 positions,
  # 6 blocks of 4 512x512 projections and a 512-2048-512 MLP.
  count = decoder_step.count_params(decoder_step.VARIANTS['default'])
  assert abs(count - 35.8e6) <= 0.01 * 35.8e6, count


def test_wide_variant_is_four_times_wider():
  default, wide = (decoder_step.VARIANTS[v] for v in ('default', 'wide'))
  assert (wide.width, wide.mlp) == (4 * default.width, 4 * default.mlp)
  assert (wide.vocab, wide.depth, wide.seq_len, wide.batch_size) == (
      default.vocab, default.depth, default.seq_len, default.batch_size)


def test_config_rejects_bad_shapes():
  with pytest.raises(ValueError, match='heads'):
    decoder_step.DecoderConfig(vocab=8, width=10, depth=1, heads=3, mlp=4,
                               seq_len=4, batch_size=2)
  with pytest.raises(ValueError, match='positive'):
    decoder_step.DecoderConfig(vocab=8, width=8, depth=0, heads=2, mlp=4,
                               seq_len=4, batch_size=2)


def test_decoder_is_causal_and_loss_is_near_log_vocab():
  # One program for the init and one for both sequences' logits and the
  # loss (run eagerly, every operation would compile a program of its own).
  params = jax.jit(lambda key: decoder_step.decoder_init(key, TINY))(
      jax.random.key(0))
  batch = decoder_step.make_batch(np.random.default_rng(0), TINY)
  tokens = np.asarray(batch['x'][0])
  changed = tokens.copy()
  changed[-1] = (tokens[-1] + 1) % TINY.vocab

  @jax.jit
  def logits_and_loss(params, tokens, changed, targets):
    apply = lambda t: decoder_step.decoder_apply(params, t, TINY)  # noqa: E731
    loss = decoder_step.sequence_loss_fn(TINY)(
        params, {'x': tokens, 'y': targets})
    return apply(tokens), apply(changed), loss

  before, after, loss = jax.device_get(logits_and_loss(
      params, tokens, changed, np.asarray(batch['y'][0])))
  # Changing the last token moves no earlier position's logits.
  np.testing.assert_allclose(before[:-1], after[:-1], rtol=0, atol=1e-6)
  assert not np.allclose(before[-1], after[-1])
  np.testing.assert_array_equal(batch['x'][:, 1:], batch['y'][:, :-1])
  # A mean over positions (not a sum): about log(vocab) at initialization.
  assert abs(float(loss) - np.log(TINY.vocab)) < 1.5, float(loss)


def test_one_tiny_private_step_runs_and_is_reported(tmp_path):
  rows, skipped = decoder_step.build_rows(
      TINY, ('jax non-private', 'dpsgd vmap'))
  assert skipped == {} and list(rows) == ['jax non-private', 'dpsgd vmap']
  times = decoder_step.time_rows(rows, iters=1, warmup=0, rounds=2,
                                 skipped=skipped)
  assert skipped == {} and all(len(ts) == 2 for ts in times.values())
  # The peak is the memory analysis of the program the row ran, and a row
  # compiled from shapes only reports the same program's.
  peaks = {'jax non-private': rows['jax non-private'].peak_bytes()}
  shapes_only, _ = decoder_step.build_rows(TINY, ('jax non-private',),
                                           compile_only=True)
  assert peaks['jax non-private'] > 0
  assert shapes_only['jax non-private'].peak_bytes() == peaks[
      'jax non-private']
  records = decoder_step.table_records(times, peaks, {})
  assert [r['time / non-private'] for r in records][0] == '1.00x'
  assert [r['memory / non-private'] for r in records] == ['1.00x', 'n/a']
  path = tmp_path / 'decoder.md'
  csv_path = decoder_step.harness.write_report(
      str(path), decoder_step.harness.render_markdown(
          'decoder_step', ['h'], records, {}), records)
  with open(csv_path, encoding='utf-8') as f:
    assert [r['row'] for r in csv.DictReader(f)] == list(times)
  assert '| dpsgd vmap |' in path.read_text()


def test_a_failing_row_is_skipped_with_its_reason():
  rows = {'ok': decoder_step.Row('ok', lambda n: None, lambda: None),
          'bad': decoder_step.Row(
              'bad', lambda n: (_ for _ in ()).throw(RuntimeError('oom')),
              lambda: None)}
  skipped = {}
  times = decoder_step.time_rows(rows, iters=1, warmup=1, rounds=2,
                                 skipped=skipped)
  assert list(times) == ['ok'] and skipped == {'bad': 'RuntimeError: oom'}


def test_missing_frameworks_skip_their_rows_with_a_reason():
  names = ('torch non-private', 'opacus hooks')
  rows, skipped = decoder_step.build_rows(TINY, names)
  assert set(rows) | set(skipped) == set(names)
  assert not set(rows) & set(skipped)
  torch_module, _ = decoder_step.harness.optional_import('torch')
  if torch_module is None:
    assert rows == {} and all(reason.startswith('torch not installed')
                              for reason in skipped.values())


def test_compile_only_reports_memory_without_running():
  rows, skipped = decoder_step.build_rows(
      TINY, ('jax non-private', 'dpsgd vmap', 'torch non-private'),
      compile_only=True)
  assert list(rows) == ['jax non-private', 'dpsgd vmap']
  assert skipped['torch non-private'].startswith('not built')
  peaks = {name: row.peak_bytes() for name, row in rows.items()}
  # Per-example gradients of 4 sequences take more than one gradient.
  assert peaks['dpsgd vmap'] > peaks['jax non-private'] > 0
  with pytest.raises(RuntimeError, match='shapes only'):
    rows['dpsgd vmap'].run(1)


# ------------------------------------------------------- the shared harness

harness = decoder_step.harness


def test_harness_rotates_the_order_and_reports_medians(tmp_path):
  calls = []
  durations = {'a': [1.0, 3.0, 2.0], 'b': [4.0, 4.0, 5.0]}

  def fake_row(name):
    def run(n):
      calls.append((name, n))
    return harness.Row(name, run)

  rows = {'a': fake_row('a'), 'b': fake_row('b')}
  times = harness.time_rows(rows, iters=2, warmup=1, rounds=3, skipped={})
  # Warm-up once each, then rounds in a rotating order.
  assert calls == [('a', 1), ('b', 1), ('a', 2), ('b', 2), ('b', 2),
                   ('a', 2), ('a', 2), ('b', 2)]
  assert set(times) == {'a', 'b'} and all(len(t) == 3 for t in times.values())
  records = harness.summarize(durations, baseline='a', peaks={'a': 2**20,
                                                               'b': 2**21})
  assert [r['median ms'] for r in records] == ['2000.000', '4000.000']
  assert [r['time / non-private'] for r in records] == ['1.00x', '2.00x']
  assert records[1]['memory / non-private'] == '2.00x'
  assert harness.fastest(durations, ('a', 'b')) == 'a'
  path = tmp_path / 'r.md'
  harness.write_report(str(path), harness.render_markdown(
      't', ['h'], records, {'c': 'why'}), records, ['h'])
  with open(tmp_path / 'r.json', encoding='utf-8') as f:
    assert json.load(f)['rows'] == records
  assert '- skipped c: why' in path.read_text()


def test_the_flags_are_checked_alike():
  parser = harness.timing_parser('doc', iters=3, warmup=1, rounds=5)
  assert harness.parse_timing(parser, []).iters == 3
  for bad in (['--iters', '0'], ['--warmup', '-1']):
    with pytest.raises(SystemExit):
      harness.parse_timing(parser, bad)
  with pytest.raises(SystemExit):
    decoder_step.parse_args(['--rows', 'nope'])


def test_auto_choice_times_the_three_paths_and_names_the_one_taken():
  import auto_choice  # pylint: disable=g-import-not-at-top
  records = auto_choice.main(['--only', 'mlp', '--batch_scale', '0.02',
                              '--iters', '1', '--rounds', '2',
                              '--warmup', '0'])
  (record,) = records
  assert record['B'] == '5' and record['auto took'] == 'ghost'
  assert record['faster'] in ('ghost', 'vmap')
  for key in ('ghost ms', 'vmap ms', 'auto ms'):
    assert float(record[key]) > 0
  ghost, vmap = (float(record[k]) for k in ('ghost ms', 'vmap ms'))
  assert record['faster'] == ('ghost' if ghost <= vmap else 'vmap')


def test_every_step_of_the_cpu_benchmarks_builds_and_runs():
  import ghost_step  # pylint: disable=g-import-not-at-top
  import srg_step  # pylint: disable=g-import-not-at-top
  models = ghost_step.models
  rng = np.random.default_rng(0)
  problem = ghost_step.Problem('tiny MLP', models.mlp_init(rng, [4, 8, 10]),
                               models.mlp_apply, 6, 1)
  batch = models.make_batch(rng, 6, input_dim=4)
  built = ghost_step.make_variants(problem)
  built.update({f'srg {name}': step for name, step in srg_step.make_variants(
      problem.apply, ('dpsgd', 'srg', 'srg clip only')).items()})
  rows, skipped = ghost_step.dpsgd_step.step_rows(built, problem.params,
                                                  batch)
  assert skipped == {}
  times = harness.time_rows(rows, iters=1, warmup=0, rounds=1,
                            skipped=skipped)
  assert skipped == {} and set(times) == set(built)
  assert 'ghost ' in ghost_step.memory_line(
      {n: rows[n] for n in ('non-private', 'ghost')})
  assert 'max |diff| / max |sum|' in ghost_step.check_agreement(problem,
                                                                batch)
