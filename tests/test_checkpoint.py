"""Checkpoint and resume: bit-identical state, a ledger that never forgets,
releases that hold nothing secret, and a run that survives SIGKILL."""

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import checkpoint
from dpsco_jax import noise
from dpsco_jax import strategies
from experiments import resumable

REPO = pathlib.Path(__file__).resolve().parent.parent
NUM_EXAMPLES, BATCH, EPOCHS = 48, 8, 2          # 6 batches per epoch
NUM_STEPS = (NUM_EXAMPLES // BATCH) * EPOCHS    # 12
KEY = 987654321


def _loss(params, example):
  logits = example['x'] @ params['w'] + params['b']
  return -jax.nn.log_softmax(logits)[example['y']]


def _data():
  rng = np.random.default_rng(0)
  return {'x': rng.normal(size=(NUM_EXAMPLES, 5)).astype(np.float32),
          'y': rng.integers(0, 3, NUM_EXAMPLES).astype(np.int32)}


def _params():
  return {'w': jnp.zeros((5, 3), jnp.float32),
          'b': jnp.zeros((3,), jnp.float32)}


@functools.lru_cache(maxsize=None)
def _setup(name, *, key=KEY, noise_multiplier=1.5, num_steps=NUM_STEPS):
  """(tx, mechanism, ledger, sampler) of a small run of `name` (cached, so
  that each algorithm's step compiles once)."""
  sampler = batching.FixedOrderBatches(NUM_EXAMPLES, BATCH, EPOCHS,
                                       order_seed=1)
  common = dict(l2_clip=1.0, noise_multiplier=noise_multiplier, key=key)
  if name == 'dpsgd':
    private = dpsco_jax.dpsgd(_loss, num_steps=num_steps, **common)
    mechanism = dpsco_jax.dpsgd_mechanism(num_steps)
  elif name == 'dpftrl':
    # Honaker's tree keeps one noise buffer per level.
    private = dpsco_jax.dpftrl(_loss, num_steps=num_steps, restart_every=6,
                               honaker=True, **common)
    mechanism = dpsco_jax.dpftrl_mechanism(num_steps, 6, honaker=True)
  elif name == 'dp_srg_memf':
    # A recursive state: the previous params and the decayed gradient.
    strategy = strategies.optimize_strategy(
        strategies.workload(num_steps, 'true', momentum=0.9, decay=0.1),
        EPOCHS)
    private = dpsco_jax.dp_srg_memf(_loss, strategy=strategy,
                                    steps_per_epoch=6, decay=0.1,
                                    num_examples=NUM_EXAMPLES, **common)
    mechanism = dpsco_jax.dpmemf_mechanism(strategy)
  else:
    strategy = strategies.optimize_strategy(
        strategies.workload(num_steps, 'true', momentum=0.9), EPOCHS)
    private = dpsco_jax.dpmemf(_loss, strategy=strategy, steps_per_epoch=6,
                               num_examples=NUM_EXAMPLES, **common)
    mechanism = dpsco_jax.dpmemf_mechanism(strategy)
  tx = optax.chain(private, optax.sgd(0.1, momentum=0.9))
  participation = accounting.FixedOrder(EPOCHS, num_steps // EPOCHS)
  # RDP: the cheapest accountant, and these tests call it often.
  ledger = checkpoint.PrivacyLedger.create(
      mechanism, noise_multiplier, participation, 1e-5, key=key,
      method='rdp')
  return tx, mechanism, ledger, sampler


@functools.lru_cache(maxsize=None)
def _step_of(tx):

  @jax.jit
  def step(params, state, batch, indices):
    updates, state = tx.update(None, state, params, batch=batch,
                               example_ids=indices)
    return optax.apply_updates(params, updates), state

  return step


def _train(tx, params, state, sampler, start, stop):
  data = _data()
  step = _step_of(tx)
  for _, indices in zip(range(start, stop), sampler.iterate(start)):
    params, state = step(params, state, {k: v[indices] for k, v in
                                         data.items()}, indices)
  return params, state


def _leaf_bytes(leaf):
  if jax.dtypes.issubdtype(getattr(leaf, 'dtype', None), jax.dtypes.prng_key):
    return (str(leaf.dtype), leaf.shape,
            np.asarray(jax.random.key_data(leaf)).tobytes())
  array = np.asarray(leaf)
  return (str(array.dtype), array.shape, array.tobytes(), type(leaf))


def _assert_identical(a, b):
  """Same structure, and every leaf the same dtype, shape, type and bits."""
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    assert _leaf_bytes(x) == _leaf_bytes(y)


@pytest.mark.parametrize('name', ['dpsgd', 'dpftrl', 'dpmemf', 'dp_srg_memf'])
def test_opt_state_round_trips_bit_for_bit(tmp_path, name):
  tx, _, ledger, sampler = _setup(name)
  params, state = _train(tx, _params(), tx.init(_params()), sampler, 0, 7)
  path = str(tmp_path / 'checkpoint.npz')
  saved = checkpoint.save(path, params=params, opt_state=state, step=7,
                          ledger=ledger, sampler_state=sampler,
                          metadata={'note': 'seven steps'})
  assert saved == ledger.advance_to(7)
  for template in (tx.init(_params()), jax.eval_shape(tx.init, _params())):
    restored = checkpoint.restore(path, params_like=_params(),
                                  opt_state_like=template, ledger=ledger,
                                  sampler=sampler)
    _assert_identical(restored.params, params)
    _assert_identical(restored.opt_state, state)
  assert restored.step == 7 and restored.ledger == saved
  assert restored.metadata == {'note': 'seven steps'}
  assert checkpoint.sampler_from_state(restored.sampler_state) == sampler
  # Continuing from the restored state is continuing the run: same noise.
  _assert_identical(
      _train(tx, restored.params, restored.opt_state, sampler, 7, NUM_STEPS),
      _train(tx, params, state, sampler, 7, NUM_STEPS))


def test_any_pytree_round_trips(tmp_path):
  tree = {
      'raw_key': jax.random.PRNGKey(3),
      'rbg_key': jax.random.key(4, impl='rbg'),
      'keys': jax.random.split(jax.random.key(5), 3),
      'bf16': jnp.arange(4, dtype=jnp.bfloat16) / 3,
      'counter': jnp.int32(7),
      'flags': np.array([True, False]),
      'int64': np.arange(3, dtype=np.int64),
      'python': (2, 0.5),
      'empty': (),
      'nested': optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                       mu={'a': jnp.ones(2)},
                                       nu={'a': jnp.full(2, jnp.nan)}),
  }
  ledger = _setup('dpsgd')[2]
  path = str(tmp_path / 'tree.npz')
  checkpoint.save(path, params={'w': jnp.ones(2)}, opt_state=tree, step=0,
                  ledger=ledger)
  restored = checkpoint.restore(path, params_like={'w': jnp.ones(2)},
                                opt_state_like=tree)
  _assert_identical(restored.opt_state, tree)


def test_state_replicated_over_devices_round_trips(tmp_path):
  # Under pmap the state carries a leading device axis; the key on every
  # device is the ledger's.
  tx, _, ledger, sampler = _setup('dpsgd')
  params, state = _train(tx, _params(), tx.init(_params()), sampler, 0, 2)
  replicate = lambda tree: jax.tree_util.tree_map(  # noqa: E731
      lambda x: jnp.stack([x] * 8), tree)
  path = str(tmp_path / 'replicated.npz')
  checkpoint.save(path, params=replicate(params), opt_state=replicate(state),
                  step=2, ledger=ledger)
  restored = checkpoint.restore(path, params_like=replicate(params),
                                opt_state_like=replicate(state),
                                ledger=ledger)
  _assert_identical(restored.opt_state, replicate(state))


def _saved(tmp_path, name='dpsgd'):
  tx, _, ledger, sampler = _setup(name)
  params, state = _train(tx, _params(), tx.init(_params()), sampler, 0, 3)
  path = str(tmp_path / 'checkpoint.npz')
  checkpoint.save(path, params=params, opt_state=state, step=3,
                  ledger=ledger, sampler_state=sampler)
  return path, tx, ledger, sampler, params, state


@pytest.mark.parametrize('params_like, expected', [
    ({'w': jnp.zeros((5, 4)), 'b': jnp.zeros(3)}, r"params\['w'\].*\[5, 3\]"),
    ({'w': jnp.zeros((5, 3), jnp.bfloat16), 'b': jnp.zeros(3)},
     r"params\['w'\]: checkpoint float32.*template bfloat16"),
    ({'w': jnp.zeros((5, 3))}, '2 leaves in the checkpoint, 1 in the template'),
    ({'v': jnp.zeros((5, 3)), 'b': jnp.zeros(3)}, "checkpoint has params"),
    ([jnp.zeros((5, 3)), jnp.zeros(3)], 'tree structure differs'),
])
def test_mismatched_template_is_refused(tmp_path, params_like, expected):
  path, tx, *_ = _saved(tmp_path)
  with pytest.raises(checkpoint.CheckpointMismatchError, match=expected):
    checkpoint.restore(path, params_like=params_like,
                       opt_state_like=tx.init(_params()))


def test_mismatched_opt_state_template_is_refused(tmp_path):
  path, *_ = _saved(tmp_path, 'dpsgd')
  other_tx = _setup('dpftrl')[0]  # Honaker buffers: more leaves.
  with pytest.raises(checkpoint.CheckpointMismatchError, match='opt_state'):
    checkpoint.restore(path, params_like=_params(),
                       opt_state_like=other_tx.init(_params()))


def test_lower_step_is_refused_unless_allowed(tmp_path):
  path, tx, ledger, _, params, _ = _saved(tmp_path)
  fresh = tx.init(_params())
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match='step 3.*step 0'):
    checkpoint.save(path, params=params, opt_state=fresh, step=0,
                    ledger=ledger)
  assert checkpoint.read_manifest(path)['step'] == 3
  checkpoint.save(path, params=params, opt_state=fresh, step=0,
                  ledger=ledger, allow_lower_step=True)
  assert checkpoint.read_manifest(path)['step'] == 0


def test_save_checks_the_noise_state_against_the_ledger(tmp_path):
  tx, _, ledger, sampler = _setup('dpmemf')
  params, state = _train(tx, _params(), tx.init(_params()), sampler, 0, 2)
  path = str(tmp_path / 'c.npz')
  with pytest.raises(checkpoint.CheckpointMismatchError, match='drawn'):
    checkpoint.save(path, params=params, opt_state=state, step=3,
                    ledger=ledger)
  other_key = _setup('dpmemf', key=1)[2]
  with pytest.raises(checkpoint.CheckpointMismatchError, match='noise key'):
    checkpoint.save(path, params=params, opt_state=state, step=2,
                    ledger=other_key)
  assert checkpoint.key_fingerprint(KEY) == checkpoint.key_fingerprint(
      jax.random.PRNGKey(KEY)) != checkpoint.key_fingerprint(KEY + 1)
  with pytest.raises(ValueError, match='past the 12 steps'):
    ledger.advance_to(13)
  with pytest.raises(ValueError, match='forget'):
    ledger.advance_to(5).advance_to(4)
  assert not os.path.exists(path)


@pytest.mark.parametrize('change', [
    dict(noise_multiplier=1.6), dict(key=KEY + 1), dict(num_steps=18)])
def test_resume_with_another_configuration_is_refused(tmp_path, change):
  path, tx, *_ = _saved(tmp_path)
  other = _setup('dpsgd', **change)[2]
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match='configured differently'):
    checkpoint.restore(path, params_like=_params(),
                       opt_state_like=tx.init(_params()), ledger=other)


def test_resume_with_another_sampler_or_an_older_checkpoint_is_refused(
    tmp_path):
  path, tx, ledger, *_ = _saved(tmp_path)
  reordered = batching.FixedOrderBatches(NUM_EXAMPLES, BATCH, EPOCHS,
                                         order_seed=2)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='sampler'):
    checkpoint.restore(path, params_like=_params(),
                       opt_state_like=tx.init(_params()), sampler=reordered)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='forget'):
    checkpoint.restore(path, params_like=_params(),
                       opt_state_like=tx.init(_params()),
                       ledger=ledger.advance_to(5))


def test_restore_or_init(tmp_path):
  tx, _, ledger, sampler = _setup('dpftrl')
  path = str(tmp_path / 'c.npz')
  start = checkpoint.restore_or_init(path, params=_params(),
                                     opt_state=tx.init(_params()),
                                     ledger=ledger, sampler=sampler)
  assert start.step == 0 and start.ledger == ledger
  with pytest.raises(checkpoint.CheckpointMismatchError, match='no checkpoint'):
    checkpoint.restore_or_init(path, params=_params(),
                               opt_state=tx.init(_params()),
                               ledger=ledger.advance_to(2))
  params, state = _train(tx, start.params, start.opt_state, sampler, 0, 4)
  checkpoint.save(path, params=params, opt_state=state, step=4, ledger=ledger,
                  sampler_state=sampler)
  resumed = checkpoint.restore_or_init(path, params=_params(),
                                       opt_state=tx.init(_params()),
                                       ledger=ledger, sampler=sampler)
  assert resumed.step == resumed.ledger.steps_consumed == 4
  _assert_identical(resumed.opt_state, state)


@pytest.mark.parametrize('name', ['dpftrl', 'dpmemf', 'dpsgd'])
def test_ledger_accounts_the_steps_consumed(name):
  _, mechanism, ledger, _ = _setup(name)
  steps = (0, 1, 5, 6, 7, 11, 12)
  spent = dict(zip(steps, [ledger.advance_to(t).epsilon_spent(mechanism)
                           for t in steps]))
  assert spent[0] == 0.0
  assert spent[12] == ledger.planned_epsilon == accounting.epsilon_spent(
      mechanism, 1.5, accounting.FixedOrder(EPOCHS, 6), 1e-5, method='rdp')
  values = [spent[t] for t in steps]
  assert all(a <= b + 1e-9 for a, b in zip(values, values[1:]))
  assert spent[6] < spent[7]  # the second epoch spends again
  # Without the mechanism, a partial run reports the planned run's bound.
  assert ledger.advance_to(5).epsilon_spent() == ledger.planned_epsilon
  assert checkpoint.PrivacyLedger.from_json(
      json.loads(json.dumps(ledger.advance_to(5).to_json()))) == (
          ledger.advance_to(5))
  with pytest.raises(checkpoint.CheckpointMismatchError, match='mechanism'):
    ledger.advance_to(5).epsilon_spent(noise.gaussian(NUM_STEPS + 1))


def test_ledger_of_poisson_sampling_composes_the_steps_consumed():
  mechanism = dpsco_jax.dpsgd_mechanism(50)
  ledger = checkpoint.PrivacyLedger.create(
      mechanism, 1.1, accounting.PoissonSampling(0.05, 50), 1e-5, key=0,
      target_epsilon=10.0, method='rdp')
  assert ledger.advance_to(20).epsilon_spent(mechanism) == pytest.approx(
      accounting.epsilon_spent(noise.gaussian(20), 1.1,
                               accounting.PoissonSampling(0.05, 20), 1e-5,
                               method='rdp'))
  with pytest.raises(ValueError, match='more than its target'):
    checkpoint.PrivacyLedger.create(
        mechanism, 1.1, accounting.PoissonSampling(0.05, 50), 1e-5, key=0,
        target_epsilon=0.1, method='rdp')


def test_checkpoint_says_it_holds_nonprivate_state(tmp_path):
  path, *_ = _saved(tmp_path)
  with zipfile.ZipFile(path) as archive:
    assert archive.namelist()[:2] == ['README.txt', 'MANIFEST.json']
    assert b'DO NOT PUBLISH' in archive.read('README.txt')
    manifest = json.loads(archive.read('MANIFEST.json'))
  assert manifest['contains_nonprivate_state'] is True
  assert next(iter(manifest)) == 'contains_nonprivate_state'
  assert 'NON-PRIVATE' in manifest['readme']
  assert os.stat(path).st_mode & 0o777 == 0o600


def test_export_release_holds_only_params_and_the_ledger(tmp_path):
  path, tx, ledger, _, params, state = _saved(tmp_path, 'dpmemf')
  saved = checkpoint.read_manifest(path)['ledger']
  mechanism = _setup('dpmemf')[1]
  release = str(tmp_path / 'release.npz')
  checkpoint.export_release(release, params, ledger.advance_to(3),
                            mechanism=mechanism,
                            metadata={'test_accuracy': 0.5})
  with zipfile.ZipFile(release) as archive:
    names = archive.namelist()
    manifest = json.loads(archive.read('MANIFEST.json'))
  assert names == ['README.txt', 'MANIFEST.json', 'params/0.npy',
                   'params/1.npy']
  assert manifest['contains_nonprivate_state'] is False
  assert set(manifest) == {'contains_nonprivate_state', 'readme', 'format',
                           'version', 'privacy', 'metadata', 'params'}
  privacy = manifest['privacy']
  assert 'key_fingerprint' not in privacy
  assert privacy['steps_consumed'] == 3 and privacy['epsilon_exact']
  assert privacy['epsilon_spent'] == ledger.advance_to(3).epsilon_spent(
      mechanism)
  contents = pathlib.Path(release).read_bytes()
  key_data = np.asarray(jax.random.key_data(state[0][0].noise.key))
  assert key_data.tobytes() not in contents
  assert saved['key_fingerprint'].encode() not in contents
  for leaf in jax.tree_util.tree_leaves(state[0][0].noise.buffers):
    assert np.asarray(leaf).tobytes()[:64] not in contents
  with np.load(release) as arrays:
    assert sorted(arrays.files) == ['MANIFEST.json', 'README.txt',
                                    'params/0', 'params/1']
  loaded, _ = checkpoint.load_release(release, params_like=_params())
  _assert_identical(loaded, params)
  with pytest.raises(ValueError, match='never'):
    checkpoint.export_release(str(tmp_path / 'bad.npz'), state, ledger)
  with pytest.raises(ValueError, match='PRNG key'):
    checkpoint.export_release(str(tmp_path / 'bad.npz'),
                              {'w': params['w'], 'k': jax.random.key(0)},
                              ledger)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='release'):
    checkpoint.restore(release, params_like=_params(),
                       opt_state_like=tx.init(_params()))


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  path, tx, ledger, sampler, params, state = _saved(tmp_path)
  before = pathlib.Path(path).read_bytes()
  params, state = _train(tx, params, state, sampler, 3, 5)
  calls = []

  def failing_write(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
      raise OSError('disk full')
    return real_write(*args, **kwargs)

  real_write = np.lib.format.write_array
  monkeypatch.setattr(np.lib.format, 'write_array', failing_write)
  with pytest.raises(OSError, match='disk full'):
    checkpoint.save(path, params=params, opt_state=state, step=5,
                    ledger=ledger)
  assert pathlib.Path(path).read_bytes() == before
  assert os.listdir(tmp_path) == ['checkpoint.npz']


# --------------------------------------------------------- whole runs

_FAST = dict(noise_multiplier=1.0, method='rdp', checkpoint_every=4,
             num_epochs=3)


def test_interrupted_poisson_run_resumes_to_the_same_params(tmp_path):
  # In process, so cheaper than the SIGKILL test below: the Poisson sampler
  # and DP-SGD's noise state (DP-FTRL's is covered by the round trips).
  settings = resumable.Settings(algorithm='dpsgd', **_FAST)
  full = resumable.train(settings, str(tmp_path / 'full.npz'))
  path = str(tmp_path / 'interrupted.npz')
  stopped = resumable.train(settings, path, stop_after=6)
  assert stopped.step == 6 and checkpoint.read_manifest(path)['step'] == 4
  resumed = resumable.train(settings, path)
  assert resumed.start_step == 4 and resumed.step == full.step
  _assert_identical(resumed.params, full.params)
  assert resumed.ledger == full.ledger
  assert full.ledger.steps_consumed == full.ledger.num_steps


def _command(checkpoint_path, release_path, *extra):
  flags = [f'--{name}={value}' for name, value in _FAST.items()
           if name != 'method']
  return [sys.executable, '-m', 'tests.checkpoint_run', '--algorithm=dpmemf',
          '--accounting_method=rdp', f'--checkpoint={checkpoint_path}',
          f'--release={release_path}', *flags, *extra]


def test_killed_run_resumes_bit_identically(tmp_path):
  """SIGKILL after the checkpoint at step 4 (steps 5, 6 run, unsaved)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO)] + [p for p in [env.get('PYTHONPATH')] if p])
  marker = tmp_path / 'paused'
  run = lambda *args: subprocess.Popen(  # noqa: E731
      _command(*args), cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  # The uninterrupted reference runs alongside the run that gets killed.
  reference = run(tmp_path / 'reference.npz',
                  tmp_path / 'reference-release.npz')
  victim = run(tmp_path / 'run.npz', tmp_path / 'run-release.npz',
               '--pause_after_step=6', f'--pause_marker={marker}')
  deadline = time.monotonic() + 120
  while not marker.exists():
    assert victim.poll() is None, victim.communicate()[0]
    assert time.monotonic() < deadline, 'the run never reached step 6'
    time.sleep(0.05)
  assert checkpoint.read_manifest(str(tmp_path / 'run.npz'))['step'] == 4
  victim.send_signal(signal.SIGKILL)
  victim.communicate()
  assert victim.returncode == -signal.SIGKILL
  assert not (tmp_path / 'run-release.npz').exists()
  assert reference.wait(timeout=120) == 0, reference.communicate()[0]

  resumed = run(tmp_path / 'run.npz', tmp_path / 'run-release.npz')
  output = resumed.communicate(timeout=120)[0]
  assert resumed.returncode == 0, output
  assert 'resumed from step 4 of 18' in output

  like = resumable.quickstart.init_params()
  params, release = checkpoint.load_release(
      str(tmp_path / 'run-release.npz'), params_like=like)
  reference_params, reference_release = checkpoint.load_release(
      str(tmp_path / 'reference-release.npz'), params_like=like)
  for name in like:
    assert np.array_equal(params[name], reference_params[name])
  assert release == reference_release
  final = checkpoint.read_manifest(str(tmp_path / 'run.npz'))
  reference_final = checkpoint.read_manifest(str(tmp_path / 'reference.npz'))
  assert final['ledger'] == reference_final['ledger']
  assert final['step'] == final['ledger']['steps_consumed'] == 18
  # The whole final state (noise key, MF buffer, guard, momentum) agrees.
  with zipfile.ZipFile(tmp_path / 'run.npz') as a, zipfile.ZipFile(
      tmp_path / 'reference.npz') as b:
    assert a.namelist() == b.namelist()
    for name in a.namelist():
      assert a.read(name) == b.read(name), name
