"""Test configuration: virtual devices, caches, and whole files per worker.

- Eight virtual CPU devices for the multi-device tests, and XLA:CPU's
  quicker-to-compile loop emitters. XLA reads its flags when the backend
  starts, so they are set before any test compiles.
- One cache directory per test run, shared by the pytest-xdist workers (the
  process that starts first makes it, the workers it starts inherit it,
  and it is removed at exit):
  - the library's cache (`$DPSCO_JAX_CACHE`: optimized strategies and
    calibrated noise multipliers) and the tests' own slow results
    (tests/shared_results.py), so a calibration is computed once per run,
    not once per worker, and the user's own cache stays untouched;
  - JAX's persistent compilation cache, so a program compiled by one test
    is loaded, not compiled again, by every later test (in either worker)
    that lowers to the same program. Tracing and lowering still run for
    every new function, so trace-time warnings and `_cache_size()` counts
    are what they would be without it.
- The pytest-xdist workers take whole test files, slowest first
  (`SLOWEST_FIRST`), so no file's shared programs and fixtures are built
  by both workers.
- `DPSCO_JAX_TEST_CACHE=<dir>` keeps the compilation cache in `<dir>`
  across runs instead (e.g. `.test_cache/`, ignored by git): a rerun
  compiles only what changed. Its entries are keyed by the compiled program
  itself, so a changed library never reads a stale one; calibrations stay
  per run.
"""

import atexit
import os
import shutil
import sys
import tempfile
import uuid

import jaxlib.version  # pylint: disable=g-import-not-at-top

# The name of XLA:CPU's option for its MLIR loop-fusion emitters.
_FUSION_EMITTERS = 'xla_cpu_use_fusion_emitters'
_FLAGS = ['--xla_force_host_platform_device_count=8']
# XLA:CPU's older loop emitters compile the tests' programs in half the
# time (measured with jaxlib 0.10.2: the suite's backend compilation went
# from 748 to 359 s). Tests marked `xla_optimized` compile with the fusion
# emitters users get (`_user_compile_options`). XLA stops the process on a
# flag it does not know, so the flag is passed only to the jaxlib versions
# it was measured with; a later jaxlib runs the same tests, slower.
if tuple(int(p) for p in jaxlib.version.__version__.split('.')[:2]) == (0, 10):
  _FLAGS.append(f'--{_FUSION_EMITTERS}=false')
for _flag in _FLAGS:
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (
        os.environ.get('XLA_FLAGS', '') + ' ' + _flag).strip()

# `experiments` and `configs` are top-level folders of the repository, not
# part of the installed package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

# Set by the first process of a run; the xdist workers inherit it.
_RUN_CACHE_VAR = '_DPSCO_JAX_TEST_RUN_CACHE'


def _run_cache_dir() -> str:
  """The directory this test run's caches live in (made once per run)."""
  if not os.environ.get(_RUN_CACHE_VAR):
    os.environ[_RUN_CACHE_VAR] = tempfile.mkdtemp(prefix='dpsco_jax_tests_')
    # Only the process that made it removes it, after its workers are done.
    atexit.register(shutil.rmtree, os.environ[_RUN_CACHE_VAR],
                    ignore_errors=True)
  return os.environ[_RUN_CACHE_VAR]


def _write_compilations_atomically() -> None:
  """Makes the compilation cache write each entry under its name at once.

  Without a size limit JAX writes an entry in place, so a worker could read
  another worker's half-written entry (JAX then warns and compiles again).
  Writing it under a unique name and renaming it (atomic on one file
  system) means a reader finds no entry or a whole one.
  """
  from jax._src import lru_cache  # pylint: disable=g-import-not-at-top
  put = lru_cache.LRUCache.put
  suffix = getattr(lru_cache, '_CACHE_SUFFIX', None)
  if suffix is None or getattr(put, 'atomic', False):
    return

  def atomic_put(self, key, value):
    if getattr(self, 'eviction_enabled', True):
      return put(self, key, value)  # Already under a file lock.
    partial = f'{key}.partial-{uuid.uuid4().hex}'
    put(self, partial, value)
    os.replace(self.path / f'{partial}{suffix}', self.path / f'{key}{suffix}')

  atomic_put.atomic = True
  lru_cache.LRUCache.put = atomic_put


_CACHE = _run_cache_dir()
# Optimized strategies and calibrations: out of the user's cache.
os.environ['DPSCO_JAX_CACHE'] = os.path.join(_CACHE, 'library')
jax.config.update('jax_compilation_cache_dir', os.path.abspath(
    os.environ.get('DPSCO_JAX_TEST_CACHE') or os.path.join(_CACHE, 'xla')))
# Every program, however quick to compile: the tests' programs are small and
# many of them are the same program built again by a later test.
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
_write_compilations_atomically()
# Machine code at XLA's backend optimization level 0 (LLVM's cheap passes),
# for every test program: the tests' programs are small and run a few
# times, so the machine code's optimization costs more compile time than it
# saves (a fifth of the suite's CPU time). XLA's HLO passes (fusion,
# layout, the program the assertions of test_compiled_steps read) run as
# before. Tests about the arithmetic of the code the device really runs
# (rounding bounds, precision) are marked `xla_optimized` and compile with
# every optimization, as users' programs do.
jax.config.update('jax_disable_most_optimizations', True)
# The same for the processes the tests start (experiment CLIs, Sphinx,
# benchmark scripts, killed-and-resumed runs).
os.environ['JAX_DISABLE_MOST_OPTIMIZATIONS'] = 'true'


def _user_compile_options() -> None:
  """Compiles with XLA's default loop emitters when optimizations are on.

  The suite's `XLA_FLAGS` turn XLA:CPU's fusion emitters off for speed;
  a test marked `xla_optimized` (optimizations on) compiles the code users
  get, so its programs take the emitters back through the per-program
  option overrides, which win over `XLA_FLAGS` (and are part of the
  compilation cache's key).
  """
  from jax._src import compiler  # pylint: disable=g-import-not-at-top
  get = compiler.get_compile_options
  if getattr(get, 'user_emitters', False):
    return

  def get_compile_options(*args, **kwargs):
    options = get(*args, **kwargs)
    if (f'--{_FUSION_EMITTERS}=false' in _FLAGS and
        not jax.config.read('jax_disable_most_optimizations')):
      options.env_option_overrides = (
          list(options.env_option_overrides) + [(_FUSION_EMITTERS, True)])
    return options

  get_compile_options.user_emitters = True
  compiler.get_compile_options = get_compile_options


_user_compile_options()


def pytest_configure(config: pytest.Config) -> None:
  config.addinivalue_line(
      'markers', 'xla_optimized: compile this test\'s programs with every '
      'XLA optimization (the default for users), not at the suite\'s '
      'backend optimization level 0')


@pytest.fixture(autouse=True)
def _xla_optimization_level(request: pytest.FixtureRequest):
  """Every XLA optimization for tests marked `xla_optimized`."""
  if request.node.get_closest_marker('xla_optimized') is None:
    yield
    return
  jax.config.update('jax_disable_most_optimizations', False)
  try:
    yield
  finally:
    jax.config.update('jax_disable_most_optimizations', True)


# The test files, slowest first, from a profile of the suite's seconds per
# file (a ranking, not a budget; a file missing here runs after them, in
# its collection place). The workers take whole files
# (`pytest_xdist_make_scheduler`) in this order: the slow files start first and the run ends on the many
# quick ones, which even out the two workers.
SLOWEST_FIRST = (
    'tests/test_audit.py',
    'tests/test_ghost_zoo.py',
    'tests/test_readme.py',
    'tests/test_compiled_steps.py',
    'tests/test_plans.py',
    'tests/test_physical.py',
    'tests/test_parallel.py',
    'tests/test_outlier_removal.py',
    'tests/algorithms/test_diff2.py',
    'tests/test_nonsmooth.py',
    'tests/test_ghost_statistics.py',
    'tests/test_benchmarks_smoke.py',
    'tests/test_adaptive_clipping.py',
    'tests/test_blt.py',
    'tests/experiments/test_diff2_tabular.py',
    'tests/test_checkpoint.py',
    'tests/test_api_reference.py',
    'tests/test_accounting.py',
    'tests/experiments/test_single_epoch_synthetic.py',
    'tests/algorithms/test_srg.py',
    'tests/algorithms/test_diff2_accounting.py',
    'tests/test_preprocessing.py',
    'tests/test_ghost_clipping.py',
    'tests/algorithms/test_mf.py',
    'tests/experiments/test_srg_memf.py',
    'tests/experiments/test_lora_finetune.py',
    'tests/experiments/test_correlated_noise.py',
    'tests/test_physical_sharded.py',
    'tests/test_multiprocess.py',
    'tests/experiments/test_flax_digits.py',
    'tests/test_noise.py',
    'tests/test_noise_matrix_factorization.py',
    'tests/test_mixed_precision.py',
    'tests/experiments/test_nonsmooth_synthetic.py',
    'tests/test_diff2_adaptive.py',
    'tests/test_blt_jax_privacy.py',
    'tests/algorithms/test_baselines.py',
    'tests/test_data.py',
    'tests/algorithms/test_accelerated_phased_erm.py',
    'tests/test_plan_identity.py',
    'tests/test_batching.py',
    'tests/experiments/test_user_level_experiments.py',
    'tests/test_precision.py',
    'tests/test_clipping.py',
    'tests/test_ghost_never_crashes.py',
    'tests/experiments/test_quickstart.py',
    'tests/test_sharding.py',
    'tests/algorithms/test_phased_sgd.py',
    'tests/experiments/test_sweep_digits.py',
    'tests/test_ghost_rounding.py',
    'tests/test_runs.py',
)


@pytest.hookimpl(optionalhook=True)   # pytest-xdist's hook, when it is on
def pytest_xdist_make_scheduler(config: pytest.Config, log):
  """Whole test files per worker, in `SLOWEST_FIRST` order.

  pytest-xdist's default (load) scheduling deals the first quarter of the
  tests out one by one, alternating between the workers, so both workers
  trace and compile every program the slow files share between their
  tests (module-level jitted functions, a fixture's model and step) and
  build every module-scoped fixture. Whole files avoid that work twice.
  An explicit `--dist` other than load is kept.

  Args:
    config: pytest's configuration.
    log: xdist's logger for the scheduler.

  Returns:
    The scheduler, or None for xdist's own choice.
  """
  if config.getoption('dist') != 'load':
    return None
  from xdist import scheduler  # pylint: disable=g-import-not-at-top
  # xdist would otherwise sort the files by their number of tests.
  config.option.loadscopereorder = False
  return scheduler.LoadFileScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  """Runs the files of `SLOWEST_FIRST` first, in that order.

  A stable sort by file: the tests of one file keep pytest's order (so
  module-scoped fixtures are built at most once per worker), and every
  other file keeps its place after them. Both xdist workers sort the same collection
  the same way, as xdist requires.

  Args:
    items: the collected tests, reordered in place.
  """
  rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def key(item: pytest.Item) -> int:
    path = os.path.relpath(str(item.path), root).replace(os.sep, '/')
    return rank.get(path, len(rank))

  items.sort(key=key)
