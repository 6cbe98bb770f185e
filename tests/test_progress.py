"""No silent minute: progress on stderr, and strategies cached on disk.

Building a DP-MEMF plan optimizes a strategy and calibrates its noise; the
first build says so on stderr, the second of the same plan reads the
strategy from the cache and is fast. `DELAY_SECONDS` is set to 0 so that the
tiny work of a test shows its line (real work shows it after a second).
"""

import contextlib
import io
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import progress
from dpsco_jax import strategies

N, BATCH, EPOCHS = 40, 10, 2


def _loss(params, example):
  return (example['x'] @ params - example['y']) ** 2


def _dpmemf(momentum=0.9):
  return dpsco_jax.plans.dpmemf(
      _loss, optimizer=optax.sgd(0.1, momentum=momentum), num_examples=N,
      batch_size=BATCH, epochs=EPOCHS, l2_clip=1.0, epsilon=2.0, delta=1e-5,
      momentum=momentum, key=0, seed=0)


@pytest.fixture(name='cache')
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv(strategies.CACHE_ENV_VAR, str(tmp_path))
  monkeypatch.delenv(progress.ENV_VAR, raising=False)
  monkeypatch.setattr(progress, 'DELAY_SECONDS', 0.0)
  return tmp_path / 'strategies'


def _entries(directory):
  return sorted(os.listdir(directory)) if directory.exists() else []


def test_first_build_reports_on_stderr_second_is_cached_and_fast(cache,
                                                                capfd):
  first = _dpmemf()
  err = capfd.readouterr().err
  assert 'dpsco_jax: optimizing a 8x8 strategy (k=2' in err
  assert 'done in' in err
  assert 'dpsco_jax: calibrating the matrix_factorization noise' in err
  assert len(_entries(cache)) == 1
  assert len(_entries(cache.parent / 'calibrations')) == 1

  start = time.perf_counter()
  second = _dpmemf()
  seconds = time.perf_counter() - start
  err = capfd.readouterr().err
  assert seconds < 2.0, seconds
  assert 'optimizing' not in err                    # read from the cache
  assert 'calibrating' not in err
  assert second.mechanism.identity == first.mechanism.identity
  assert second.noise_multiplier == first.noise_multiplier


def test_cache_is_keyed_by_what_determines_the_strategy(cache):
  _dpmemf(momentum=0.9)
  _dpmemf(momentum=0.5)                             # another workload
  assert len(_entries(cache)) == 2
  workload = strategies.workload(8, 'true', momentum=0.9)
  strategies.optimize_strategy(workload, 2)         # the same: no entry
  assert len(_entries(cache)) == 2
  strategies.optimize_strategy(workload, 2, bands=2)
  strategies.optimize_strategy(workload, 1)
  strategies.optimize_strategy(workload, 2, tolerance=1e-3)
  assert len(_entries(cache)) == 5
  strategies.optimize_strategy(workload, 4, cache_dir=False)
  assert len(_entries(cache)) == 5


def test_quiet_when_asked(cache, capfd, monkeypatch):
  workload = strategies.workload(8, 'ones')
  strategies.optimize_strategy(workload, 2, progress=False)
  assert capfd.readouterr().err == ''
  monkeypatch.setenv(progress.ENV_VAR, '0')
  strategies.optimize_strategy(workload, 1, cache_dir=False)
  _dpmemf()
  assert capfd.readouterr().err == ''


def test_short_work_is_silent_by_default(monkeypatch, capfd):
  monkeypatch.delenv(progress.ENV_VAR, raising=False)
  with progress.task('something quick'):
    pass
  assert capfd.readouterr().err == ''


def test_a_terminal_gets_one_rewritten_line(monkeypatch):
  class Terminal(io.StringIO):

    def isatty(self):
      return True

  terminal = Terminal()
  monkeypatch.setattr('sys.stderr', terminal)
  monkeypatch.setattr(progress, 'DELAY_SECONDS', 0.0)
  with progress.task('long work', progress=True) as report:
    report('half way')
    time.sleep(0.3)
  text = terminal.getvalue()
  assert text.startswith('\rlong work')
  assert text.count('\n') == 1 and text.endswith('\n')
  assert text.split('\r')[-1].startswith('long work: done in 0.3 s')
  assert 'half way' in text


def test_progress_argument_is_checked():
  with pytest.raises(TypeError, match='progress must be'):
    progress.enabled('yes')
  with pytest.raises(TypeError, match='progress must be'):
    strategies.optimize_strategy(strategies.workload(4, 'ones'), 1,
                                 cache_dir=False, progress=3)


def test_first_compiled_step_reports_the_compilation(cache, capfd):
  plan = dpsco_jax.plans.dpsgd(
      _loss, optimizer=optax.sgd(0.1), num_examples=N, batch_size=BATCH,
      epochs=1, l2_clip=1.0, noise_multiplier=1.0, delta=1e-5, key=0,
      seed=0)
  data = {'x': np.ones((N, 2), np.float32), 'y': np.ones(N, np.float32)}
  params = jnp.zeros(2)
  opt_state = plan.init(params)
  batches = plan.batches_of(data)
  params, opt_state = plan.step(params, opt_state, next(batches))
  assert 'dpsco_jax: compiling the dpsgd step' in capfd.readouterr().err
  params, opt_state = plan.step(params, opt_state, next(batches))
  jax.block_until_ready(params)
  assert capfd.readouterr().err == ''


def test_the_line_shows_the_optimizer_iteration(cache, monkeypatch):
  details = []

  @contextlib.contextmanager
  def recording_task(what, progress=None):
    del progress
    details.append(what)
    yield details.append

  monkeypatch.setattr(progress, 'task', recording_task)
  strategies.optimize_strategy(strategies.workload(8, 'true', momentum=0.9),
                               2)
  assert details[0].startswith('dpsco_jax: optimizing a 8x8 strategy')
  assert details[1].startswith('L-BFGS iteration 1 (at most 5000), loss ')


def test_a_cached_calibration_cannot_weaken_the_plan(cache):
  plan = _dpmemf()
  (entry,) = (cache.parent / 'calibrations').iterdir()
  entry.write_text(json.dumps(
      {'noise_multiplier': 0.5 * plan.noise_multiplier}))
  with pytest.raises(ValueError, match='more than its target'):
    _dpmemf()                                       # the ledger refuses
  entry.write_text('not json')
  assert _dpmemf().noise_multiplier == plan.noise_multiplier  # recalibrated
