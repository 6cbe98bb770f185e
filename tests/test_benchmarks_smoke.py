"""Smoke tests of `benchmarks/decoder_step.py`: its model and one private step.

No timing is asserted: speed belongs in the benchmark's own output.
"""

import csv
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
  params = decoder_step.decoder_init(jax.random.key(0), TINY)
  batch = decoder_step.make_batch(np.random.default_rng(0), TINY)
  tokens = jnp.asarray(batch['x'][0])
  changed = tokens.at[-1].set((tokens[-1] + 1) % TINY.vocab)
  before, after = (decoder_step.decoder_apply(params, t, TINY)
                   for t in (tokens, changed))
  # Changing the last token moves no earlier position's logits.
  np.testing.assert_allclose(before[:-1], after[:-1], rtol=0, atol=1e-6)
  assert not np.allclose(before[-1], after[-1])
  np.testing.assert_array_equal(batch['x'][:, 1:], batch['y'][:, :-1])
  example = {'x': tokens, 'y': jnp.asarray(batch['y'][0])}
  loss = decoder_step.sequence_loss_fn(TINY)(params, example)
  # A mean over positions (not a sum): about log(vocab) at initialization.
  assert abs(float(loss) - np.log(TINY.vocab)) < 1.5, float(loss)


def test_one_tiny_private_step_runs_and_is_reported(tmp_path):
  rows, skipped = decoder_step.build_rows(
      TINY, ('jax non-private', 'dpsgd vmap'))
  assert skipped == {} and list(rows) == ['jax non-private', 'dpsgd vmap']
  times = decoder_step.time_rows(rows, iters=1, warmup=0, rounds=2,
                                 skipped=skipped)
  assert skipped == {} and all(len(ts) == 2 for ts in times.values())
  peaks = {name: rows[name].peak_bytes() for name in times}
  assert all(peak > 0 for peak in peaks.values())
  records = decoder_step.table_records(times, peaks, {})
  assert [r['time / non-private'] for r in records][0] == '1.00x'
  path = tmp_path / 'decoder.md'
  csv_path = decoder_step.write_outputs(
      str(path), decoder_step.render_markdown(['h'], records, {}, []),
      records)
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
  torch_module, _ = decoder_step.dpsgd_step.optional_import('torch')
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
