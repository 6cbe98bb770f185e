"""Every public plan describes, accounts and caches the same run as recorded.

`tests/data/plan_identity.json` records, for each of the 11 plan functions
(tiny sizes, fixed seeds and keys; a calibrated `epsilon=` case and a given
noise case), what a user and a checkpoint can read of the plan:
`describe()` (but `'clipping_path'`, which changes once a step runs), the
epsilon of the whole run and of two prefixes, the `dp_accounting` event,
the ledger, the mechanism identity stored in noise states, and the names of
the calibration cache files the build wrote. A change to how plans are
assembled must leave all of it equal: strings, ints and bools exactly,
floats to 1e-12 relative.

Regenerate the record (only when a change of the run is intended, and say
so in the commit): `python -m tests.test_plan_identity --regenerate`.
"""

import contextlib
import functools
import json
import math
import os
import sys
import tempfile
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping
import warnings

import attr
import numpy as np
import optax
import pytest

from dpsco_jax import accounting
from dpsco_jax import plans
from dpsco_jax import strategies

GOLDEN = os.path.join(os.path.dirname(__file__), 'data', 'plan_identity.json')
REL_TOL = 1e-12

N, FEATURES, BATCH, EPOCHS, DELTA = 60, 3, 10, 2, 1e-5
COMMON = dict(num_examples=N, batch_size=BATCH, l2_clip=1.0, delta=DELTA,
              seed=0, key=0)
NONSMOOTH = dict(num_examples=N, dimension=FEATURES + 1, lipschitz=1.0,
                 smoothing_radius=0.1, movement_radius=0.01,
                 block_length=2, period=2, num_directions=2, key=0)
RELEASE = accounting.GaussianRelease('feature mean and variance', 40.0)


def linear_loss(params, example):
  """The squared error of a linear model on ONE example (what users write)."""
  prediction = example['x'] @ params['w'] + params['b']
  return optax.squared_error(prediction, example['y'])


# name -> the plan, built as a user would. Each family has a calibrated
# (`epsilon=`) case and a given-noise case; the options that change the
# run's description (sampling, restarts, strategies, releases, physical
# batches, output selection) appear in at least one. The DIFF2-accounted
# cases calibrate with RDP: their calibration is not cached, and PLD's takes
# seconds.
CASES: dict[str, Callable[[], plans.Plan]] = {
    'dpsgd_poisson_epsilon': lambda: plans.dpsgd(
        linear_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS, epsilon=2.0,
        releases=[RELEASE], **COMMON),
    'dpsgd_fixed_noise': lambda: plans.dpsgd(
        linear_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS,
        noise_multiplier=1.5, sampling='fixed', physical_batch_size=4,
        microbatch_size=2, clipping_method='vmap', **COMMON),
    'dpftrl_epsilon': lambda: plans.dpftrl(
        linear_loss, optimizer=optax.sgd(0.1, momentum=0.9), epochs=EPOCHS,
        epsilon=2.0, **COMMON),
    'dpftrl_noise_shuffled_honaker': lambda: plans.dpftrl(
        linear_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS,
        noise_multiplier=3.0, restart=None, honaker=True, sampling='shuffled',
        **COMMON),
    'dpmemf_epsilon_banded_sqrt': lambda: plans.dpmemf(
        linear_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS, epsilon=2.0,
        strategy='banded_sqrt', bands=2, momentum=0.9, **COMMON),
    'dpmemf_noise_cyclic_poisson': lambda: plans.dpmemf(
        linear_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS,
        noise_multiplier=2.0, strategy='banded_sqrt', bands=2,
        sampling='cyclic_poisson', **COMMON),
    'accelerated_dp_srgd_epsilon': lambda: plans.accelerated_dp_srgd(
        linear_loss, beta=10.0, radius=1.0, epsilon=2.0, **COMMON),
    'accelerated_dp_srgd_noise_independent': lambda: plans.accelerated_dp_srgd(
        linear_loss, beta=10.0, radius=None, noise_multiplier=2.0,
        gradient='independent', physical_batch_size=4, **COMMON),
    'unaccelerated_dp_srg_epsilon': lambda: plans.unaccelerated_dp_srg(
        linear_loss, beta=10.0, radius=None, epsilon=2.0, **COMMON),
    'unaccelerated_dp_srg_noise': lambda: plans.unaccelerated_dp_srg(
        linear_loss, beta=10.0, radius=1.0, noise_multiplier=2.0, **COMMON),
    'dp_srg_memf_epsilon_banded_sqrt': lambda: plans.dp_srg_memf(
        linear_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS, decay=0.5,
        epsilon=2.0, strategy='banded_sqrt', bands=2, **COMMON),
    'dp_srg_memf_noise_banded_inverse_sqrt': lambda: plans.dp_srg_memf(
        linear_loss, optimizer=optax.sgd(0.1), epochs=EPOCHS, decay=0.5,
        noise_multiplier=2.0, strategy='banded_inverse_sqrt', bands=3,
        physical_batch_size=4, **COMMON),
    'diff2_gd_epsilon': lambda: plans.diff2_gd(
        linear_loss, learning_rate=0.1, num_rounds=8, restart_interval=4,
        grad_clip=1.0, diff_clip_factor=1.5, num_examples=N, epsilon=3.0,
        delta=DELTA, method='rdp', key=0),
    'diff2_gd_noise_random_iterate': lambda: plans.diff2_gd(
        linear_loss, learning_rate=0.1, num_rounds=4, restart_interval=2,
        grad_clip=1.0, diff_clip_factor=1.5, num_examples=N,
        noise_multipliers=(2.0, 3.0), delta=DELTA, method='rdp',
        output='random_iterate', output_key=2, key=0),
    'dp_gd_epsilon': lambda: plans.dp_gd(
        linear_loss, learning_rate=0.1, num_rounds=6, grad_clip=1.0,
        num_examples=N, epsilon=3.0, delta=DELTA, method='rdp', key=0),
    'dp_gd_noise': lambda: plans.dp_gd(
        linear_loss, learning_rate=0.1, num_rounds=6, grad_clip=1.0,
        num_examples=N, noise_multiplier=5.0, delta=DELTA, key=0),
    'user_level_dpsgd_epsilon': lambda: plans.user_level_dpsgd(
        linear_loss, optimizer=optax.sgd(0.1), num_users=N,
        users_per_batch=BATCH, epochs=EPOCHS, l2_clip=1.0, epsilon=2.0,
        delta=DELTA, seed=0, key=0),
    'user_level_dpsgd_noise': lambda: plans.user_level_dpsgd(
        linear_loss, optimizer=optax.sgd(0.1), num_users=N,
        users_per_batch=BATCH, epochs=EPOCHS, l2_clip=1.0,
        noise_multiplier=1.5, delta=DELTA, seed=0, key=0,
        physical_batch_size=4),
    'nonsmooth_single_pass_epsilon': lambda: plans.nonsmooth_single_pass(
        linear_loss, order='first', learning_rate='proposition_2_6',
        anchor_batch_size=8, batch_size=4, num_steps=4, epsilon=2.0,
        delta=1e-6, seed=0, **NONSMOOTH),
    'nonsmooth_single_pass_noise': lambda: plans.nonsmooth_single_pass(
        linear_loss, order='zero', learning_rate=0.05, anchor_batch_size=8,
        batch_size=4, num_steps=4, noise_multiplier=1.0,
        sensitivity='worst_case', delta=1e-6, seed=0, **NONSMOOTH),
    'nonsmooth_multi_pass_epsilon': lambda: plans.nonsmooth_multi_pass(
        linear_loss, order='zero', num_steps=4, learning_rate=0.05,
        epsilon=2.0, delta=1e-6, method='rdp', **NONSMOOTH),
    'nonsmooth_multi_pass_noise': lambda: plans.nonsmooth_multi_pass(
        linear_loss, order='first', num_steps=4,
        learning_rate='proposition_2_6', learning_rate_scale=0.5,
        noise_multipliers=(1.0, 2.0), delta=1e-6, **NONSMOOTH),
}

PLAN_FUNCTIONS = ('dpsgd', 'dpftrl', 'dpmemf', 'accelerated_dp_srgd',
                  'unaccelerated_dp_srg', 'dp_srg_memf', 'diff2_gd', 'dp_gd',
                  'user_level_dpsgd', 'nonsmooth_single_pass',
                  'nonsmooth_multi_pass')


def _plain(value: Any) -> Any:
  """`value` as JSON values: dp_accounting events by class and fields."""
  if attr.has(type(value)):
    return {'class': type(value).__name__,
            **{f.name: _plain(getattr(value, f.name))
               for f in attr.fields(type(value))}}
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, (np.integer, np.floating, np.bool_)):
    return value.item()
  if isinstance(value, np.ndarray):
    return _plain(value.tolist())
  return value


@contextlib.contextmanager
def _fresh_cache(seeded: Mapping[str, float]) -> Iterator[str]:
  """A cache root of its own holding only the `seeded` calibrations.

  The record names the calibration files a build writes. Seeded with the
  recorded files (file name -> noise multiplier), a build whose cache key is
  unchanged reads its multiplier instead of calibrating again (seconds per
  Poisson run), and one whose key changed calibrates and writes a file of
  another name, which the comparison reports.
  """
  old = os.environ.get(strategies.CACHE_ENV_VAR)
  with tempfile.TemporaryDirectory(prefix='plan_identity_') as root:
    if seeded:
      os.makedirs(os.path.join(root, 'calibrations'))
    for file_name, multiplier in seeded.items():
      with open(os.path.join(root, 'calibrations', file_name), 'w') as f:
        json.dump({'noise_multiplier': multiplier}, f)
    os.environ[strategies.CACHE_ENV_VAR] = root
    try:
      yield root
    finally:
      if old is None:
        del os.environ[strategies.CACHE_ENV_VAR]
      else:
        os.environ[strategies.CACHE_ENV_VAR] = old


def record(name: str, seeded: Mapping[str, float] = MappingProxyType({})
           ) -> dict[str, Any]:
  """What the plan of case `name` says of its run, as JSON values.

  Args:
    name: a key of `CASES`.
    seeded: calibration cache files to start from (see `_fresh_cache`).
  """
  with _fresh_cache(seeded) as root, warnings.catch_warnings():
    warnings.simplefilter('ignore')
    plan = CASES[name]()
    calibrations = os.path.join(root, 'calibrations')
    cache_files = sorted(os.listdir(calibrations)) if os.path.isdir(
        calibrations) else []
  described = plan.describe()
  del described['clipping_path']
  steps = plan.num_steps
  return _plain({
      'describe': described,
      'epsilon': plan.epsilon,
      'epsilon_at': {str(t): plan.epsilon_at(t)
                     for t in sorted({1, max(1, steps // 2)})},
      'event': plan.event,
      'ledger': None if plan.ledger is None else plan.ledger.to_json(),
      'mechanism_identity': plan.mechanism.identity,
      'calibration_cache_files': cache_files,
  })


def _compare(got: Any, want: Any, where: str) -> list[str]:
  """The differences between two records (floats to REL_TOL relative)."""
  if isinstance(want, float) or isinstance(got, float):
    if not (isinstance(got, (int, float)) and isinstance(want, (int, float))
            and not isinstance(got, bool) and not isinstance(want, bool)):
      return [f'{where}: {got!r} != {want!r}']
    if math.isnan(want) and math.isnan(got):
      return []
    if got == want or math.isclose(got, want, rel_tol=REL_TOL, abs_tol=0.0):
      return []
    return [f'{where}: {got!r} != {want!r}']
  if isinstance(want, dict) and isinstance(got, dict):
    problems = [f'{where}: keys {sorted(set(got) ^ set(want))} differ'
                ] if set(got) != set(want) else []
    for key in sorted(set(got) & set(want)):
      problems += _compare(got[key], want[key], f'{where}.{key}')
    return problems
  if isinstance(want, list) and isinstance(got, list):
    if len(got) != len(want):
      return [f'{where}: {len(got)} items != {len(want)}']
    return [p for i, (g, w) in enumerate(zip(got, want))
            for p in _compare(g, w, f'{where}[{i}]')]
  if type(got) is not type(want) or got != want:
    return [f'{where}: {got!r} != {want!r}']
  return []


@functools.cache
def _golden() -> dict[str, Any]:
  with open(GOLDEN) as handle:
    return json.load(handle)


def test_every_plan_function_is_recorded():
  for function in PLAN_FUNCTIONS:
    cases = [name for name in _golden() if name.startswith(function + '_')]
    assert any('_epsilon' in name for name in cases), function
    assert any('_noise' in name for name in cases), function
  assert set(_golden()) == set(CASES)


def _seeded(want: Mapping[str, Any]) -> dict[str, float]:
  """The recorded calibrations of a case, as cache files to start from."""
  return {file_name: want['describe']['noise_multiplier']
          for file_name in want['calibration_cache_files']}


@pytest.mark.parametrize('name', sorted(CASES))
def test_plan_is_the_recorded_run(name):
  want = _golden()[name]
  problems = _compare(record(name, _seeded(want)), want, name)
  assert not problems, '\n'.join(problems)


def test_the_comparison_sees_a_float_change():
  want = _golden()['dpsgd_poisson_epsilon']
  got = json.loads(json.dumps(want))
  got['epsilon_at']['1'] *= 1.0 + 1e-10
  assert _compare(got, want, 'case')
  got = json.loads(json.dumps(want))
  got['describe']['mechanism_identity'] += 'x'
  assert _compare(got, want, 'case')


def _regenerate() -> None:
  records = {name: record(name) for name in sorted(CASES)}
  os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
  with open(GOLDEN, 'w') as handle:
    json.dump(records, handle, indent=1, sort_keys=True)
    handle.write('\n')
  print(f'wrote {len(records)} records to {GOLDEN}')


if __name__ == '__main__':
  if sys.argv[1:] != ['--regenerate']:
    sys.exit('usage: python -m tests.test_plan_identity --regenerate')
  _regenerate()
