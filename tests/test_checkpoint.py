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

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
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
                                       seed=1)
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
  path = str(tmp_path / 'checkpoint')
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


def test_a_relative_path_works(tmp_path, monkeypatch):
  # orbax wants absolute paths; a user's 'run/checkpoint' must still work.
  monkeypatch.chdir(tmp_path)
  tx, _, ledger, sampler = _setup('dpsgd')
  params, state = _train(tx, _params(), tx.init(_params()), sampler, 0, 2)
  checkpoint.save('run/checkpoint', params=params, opt_state=state, step=2,
                  ledger=ledger, sampler_state=sampler)
  restored = checkpoint.restore('run/checkpoint', params_like=_params(),
                                opt_state_like=tx.init(_params()),
                                ledger=ledger, sampler=sampler)
  _assert_identical(restored.opt_state, state)
  checkpoint.export_release('run/model', params, restored.ledger)
  released, _ = checkpoint.load_release('run/model', params_like=_params())
  _assert_identical(released, params)


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
  path = str(tmp_path / 'tree')
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
  path = str(tmp_path / 'replicated')
  checkpoint.save(path, params=replicate(params), opt_state=replicate(state),
                  step=2, ledger=ledger)
  restored = checkpoint.restore(path, params_like=replicate(params),
                                opt_state_like=replicate(state),
                                ledger=ledger)
  _assert_identical(restored.opt_state, replicate(state))


def _saved(tmp_path, name='dpsgd'):
  tx, _, ledger, sampler = _setup(name)
  params, state = _train(tx, _params(), tx.init(_params()), sampler, 0, 3)
  path = str(tmp_path / 'checkpoint')
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
  path = str(tmp_path / 'c')
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
                                         seed=2)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='sampler'):
    checkpoint.restore(path, params_like=_params(),
                       opt_state_like=tx.init(_params()), sampler=reordered)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='forget'):
    checkpoint.restore(path, params_like=_params(),
                       opt_state_like=tx.init(_params()),
                       ledger=ledger.advance_to(5))


def test_restore_or_init(tmp_path):
  tx, _, ledger, sampler = _setup('dpftrl')
  path = str(tmp_path / 'c')
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


def _files(directory):
  """`{relative path: bytes}` of every file under `directory`."""
  return {str(file.relative_to(directory)): file.read_bytes()
          for file in sorted(pathlib.Path(directory).rglob('*'))
          if file.is_file()}


def _version(path):
  return pathlib.Path(path) / (pathlib.Path(path) / 'CURRENT').read_text(
  ).strip()


def test_checkpoint_says_it_holds_nonprivate_state(tmp_path):
  path, *_ = _saved(tmp_path)
  assert b'DO NOT PUBLISH' in (pathlib.Path(path) / 'README.txt').read_bytes()
  assert b'NON-PRIVATE' in (pathlib.Path(path) / 'README.txt').read_bytes()
  manifest = json.loads((_version(path) / 'MANIFEST.json').read_text())
  assert manifest == checkpoint.read_manifest(path)
  assert manifest['contains_nonprivate_state'] is True
  assert next(iter(manifest)) == 'contains_nonprivate_state'
  assert 'NON-PRIVATE' in manifest['readme']
  assert manifest['format'] == 'dpsco_jax.checkpoint'
  assert manifest['version'] == 2
  # Readable by its owner only: every file 0600, every directory 0700.
  assert os.stat(path).st_mode & 0o777 == 0o700
  entries = list(pathlib.Path(path).rglob('*'))
  assert any(entry.name == 'manifest.ocdbt' for entry in entries)  # orbax
  for entry in entries:
    assert entry.stat().st_mode & 0o777 == (
        0o700 if entry.is_dir() else 0o600), entry


def test_the_arrays_are_an_orbax_checkpoint(tmp_path):
  path, _, _, _, params, state = _saved(tmp_path)
  arrays = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
      _version(path) / 'arrays')
  assert sorted(arrays) == ['opt_state', 'params']
  leaves = jax.tree_util.tree_leaves(params)
  assert sorted(arrays['params']) == [str(i) for i in range(len(leaves))]
  for index, leaf in enumerate(leaves):
    np.testing.assert_array_equal(arrays['params'][str(index)], leaf)


def test_export_release_holds_only_params_and_the_ledger(tmp_path):
  path, tx, ledger, _, params, state = _saved(tmp_path, 'dpmemf')
  saved = checkpoint.read_manifest(path)['ledger']
  mechanism = _setup('dpmemf')[1]
  release = str(tmp_path / 'release')
  checkpoint.export_release(release, params, ledger.advance_to(3),
                            mechanism=mechanism,
                            metadata={'test_accuracy': 0.5})
  manifest = checkpoint.read_manifest(release)
  version = _version(release)
  assert sorted(os.listdir(release)) == ['CURRENT', 'README.txt',
                                         version.name]
  assert sorted(os.listdir(version)) == ['MANIFEST.json', 'arrays']
  assert b'No optimizer state' in (pathlib.Path(release) /
                                   'README.txt').read_bytes()
  # The orbax tree holds the params' two leaves and nothing else.
  arrays = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
      version / 'arrays')
  assert jax.tree_util.tree_structure(arrays) == jax.tree_util.tree_structure(
      {'params': {'0': 0, '1': 0}})
  assert manifest['contains_nonprivate_state'] is False
  assert set(manifest) == {'contains_nonprivate_state', 'readme', 'format',
                           'version', 'privacy', 'metadata', 'params'}
  assert [leaf['path'] for leaf in manifest['params']['leaves']] == [
      "['b']", "['w']"]
  privacy = manifest['privacy']
  assert 'key_fingerprint' not in privacy
  assert privacy['steps_consumed'] == 3 and privacy['epsilon_exact']
  assert privacy['epsilon_spent'] == ledger.advance_to(3).epsilon_spent(
      mechanism)
  contents = b''.join(_files(release).values())
  key_data = np.asarray(jax.random.key_data(state[0][0].noise.key))
  assert key_data.tobytes() not in contents
  assert saved['key_fingerprint'].encode() not in contents
  for leaf in jax.tree_util.tree_leaves(state[0][0].noise.buffers):
    assert np.asarray(leaf).tobytes()[:64] not in contents
  # Publishable: readable by all.
  assert all(entry.stat().st_mode & 0o777 == (0o755 if entry.is_dir() else
                                              0o644)
             for entry in pathlib.Path(release).rglob('*'))
  loaded, _ = checkpoint.load_release(release, params_like=_params())
  _assert_identical(loaded, params)
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"\['w'\]"):
    checkpoint.load_release(release, params_like={'w': jnp.zeros((5, 4)),
                                                  'b': jnp.zeros(3)})
  with pytest.raises(ValueError, match='never'):
    checkpoint.export_release(str(tmp_path / 'bad'), state, ledger)
  with pytest.raises(ValueError, match='PRNG key'):
    checkpoint.export_release(str(tmp_path / 'bad'),
                              {'w': params['w'], 'k': jax.random.key(0)},
                              ledger)
  assert not os.path.exists(tmp_path / 'bad')
  with pytest.raises(checkpoint.CheckpointMismatchError, match='release'):
    checkpoint.restore(release, params_like=_params(),
                       opt_state_like=tx.init(_params()))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match='holds a checkpoint'):
    checkpoint.export_release(path, params, ledger)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match='not a checkpoint'):
    checkpoint.save(release, params=params, opt_state=state, step=3,
                    ledger=ledger)


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
  path, tx, ledger, sampler, params, state = _saved(tmp_path)
  before = _files(path)
  params, state = _train(tx, params, state, sampler, 3, 5)

  def failing_save(*args, **kwargs):
    raise OSError('disk full')

  monkeypatch.setattr(ocp.StandardCheckpointHandler, 'save', failing_save)
  with pytest.raises(OSError, match='disk full'):
    checkpoint.save(path, params=params, opt_state=state, step=5,
                    ledger=ledger)
  assert _files(path) == before
  assert os.listdir(tmp_path) == ['checkpoint']


@pytest.mark.parametrize('killed_in', ['orbax', 'manifest', 'commit'])
def test_a_killed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch,
                                                      killed_in):
  """A save killed before its commit leaves what a killed process leaves
  (nothing cleaned up), and readers still see the previous checkpoint."""

  class Killed(BaseException):
    pass

  def kill(*args, **kwargs):
    raise Killed

  path, tx, ledger, sampler, params, state = _saved(tmp_path)
  before = _files(path)
  newer_params, newer_state = _train(tx, params, state, sampler, 3, 5)
  # A killed process runs no clean-up.
  monkeypatch.setattr(checkpoint.shutil, 'rmtree', lambda *a, **k: None)
  if killed_in == 'orbax':
    # Orbax has written the arrays to its temporary directory and is about
    # to rename it to its final name.
    monkeypatch.setattr(
        ocp.path.atomicity.AtomicRenameTemporaryPath, 'finalize', kill)
  elif killed_in == 'manifest':
    monkeypatch.setattr(checkpoint, '_seal', kill)
  else:
    real = checkpoint._write_file_atomically
    monkeypatch.setattr(
        checkpoint, '_write_file_atomically',
        lambda directory, name, *args: kill() if name == 'CURRENT' else real(
            directory, name, *args))
  with pytest.raises(Killed):
    checkpoint.save(path, params=newer_params, opt_state=newer_state,
                    step=5, ledger=ledger)
  monkeypatch.undo()
  left = sorted(set(_files(path)) - set(before))
  assert left, 'the killed save left nothing behind'
  if killed_in == 'orbax':
    # Orbax wrote to a temporary directory, not to its final one.
    assert all('arrays.orbax-checkpoint-tmp/' in name for name in left), left
  assert checkpoint.read_manifest(path)['step'] == 3
  restored = checkpoint.restore(path, params_like=_params(),
                                opt_state_like=tx.init(_params()),
                                ledger=ledger, sampler=sampler)
  assert restored.step == 3
  _assert_identical(restored.params, params)
  _assert_identical(restored.opt_state, state)
  # The next save commits, and removes the leftovers and the old version.
  checkpoint.save(path, params=newer_params, opt_state=newer_state, step=5,
                  ledger=ledger)
  assert sorted(os.listdir(path)) == ['CURRENT', 'README.txt',
                                      _version(path).name]
  _assert_identical(checkpoint.restore(path, params_like=_params(),
                                       opt_state_like=tx.init(_params())
                                       ).opt_state, newer_state)


def test_a_directory_without_a_completed_save_holds_no_checkpoint(tmp_path):
  tx, _, ledger, sampler = _setup('dpsgd')
  # A run killed during its first save leaves a version without CURRENT.
  path = tmp_path / 'checkpoint'
  (path / 'ckpt-00000004-0123456789ab' / 'arrays.orbax-checkpoint-tmp'
   ).mkdir(parents=True)
  assert not checkpoint.has_checkpoint(str(path))
  with pytest.raises(FileNotFoundError, match='no complete checkpoint'):
    checkpoint.read_manifest(str(path))
  start = checkpoint.restore_or_init(str(path), params=_params(),
                                     opt_state=tx.init(_params()),
                                     ledger=ledger, sampler=sampler)
  assert start.step == 0


def test_what_is_not_a_checkpoint_is_neither_read_nor_overwritten(tmp_path):
  tx, _, ledger, _ = _setup('dpsgd')
  state = tx.init(_params())
  old = tmp_path / 'old.npz'   # e.g. a checkpoint of format version 1
  old.write_bytes(b'PK\x03\x04')
  foreign = tmp_path / 'results'
  foreign.mkdir()
  (foreign / 'metrics.csv').write_text('step,loss\n')
  for path, message in [(old, 'is a file'), (foreign, 'not a dpsco_jax')]:
    with pytest.raises(checkpoint.CheckpointMismatchError, match=message):
      checkpoint.save(str(path), params=_params(), opt_state=state, step=0,
                      ledger=ledger)
  with pytest.raises(checkpoint.CheckpointMismatchError, match='version 1'):
    checkpoint.restore_or_init(str(old), params=_params(), opt_state=state,
                               ledger=ledger)
  assert old.read_bytes() == b'PK\x03\x04'
  assert os.listdir(foreign) == ['metrics.csv']


# --------------------------------------------------------- whole runs

_FAST = dict(noise_multiplier=1.0, method='rdp', checkpoint_every=4,
             num_epochs=3)


def test_interrupted_poisson_run_resumes_to_the_same_params(tmp_path):
  # In process, so cheaper than the SIGKILL test below: the Poisson sampler
  # and DP-SGD's noise state (DP-FTRL's is covered by the round trips).
  settings = resumable.Settings(algorithm='dpsgd', **_FAST)
  full = resumable.train(settings, str(tmp_path / 'full'))
  path = str(tmp_path / 'interrupted')
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


def _compilation_settings() -> dict[str, str]:
  """The test run's compilation settings, for the runs it starts.

  The subprocesses compile as the tests do (tests/conftest.py): in the
  run's persistent compilation cache (the resumed run loads the programs
  the in-process reference compiled) and at the same XLA backend
  optimization level, so the reference and the resumed run compare the
  same programs.
  """
  settings = {'JAX_DISABLE_MOST_OPTIMIZATIONS': str(
      bool(jax.config.values.get('jax_disable_most_optimizations'))).lower()}
  cache = jax.config.values.get('jax_compilation_cache_dir')
  if cache:
    settings.update(JAX_COMPILATION_CACHE_DIR=str(cache),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='-1')
  return settings


def test_killed_run_resumes_bit_identically(tmp_path):
  """SIGKILL after the checkpoint at step 4 (steps 5, 6 run, unsaved)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO)] + [p for p in [env.get('PYTHONPATH')] if p])
  env.update(_compilation_settings())
  marker = tmp_path / 'paused'
  run = lambda *args: subprocess.Popen(  # noqa: E731
      _command(*args), cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  victim = run(tmp_path / 'run', tmp_path / 'run-release',
               '--pause_after_step=6', f'--pause_marker={marker}')
  # The uninterrupted reference runs in this process (the same settings and
  # compilation settings as the subprocesses), while the victim starts.
  resumable.train(resumable.Settings(algorithm='dpmemf', **_FAST),
                  str(tmp_path / 'reference'),
                  str(tmp_path / 'reference-release'))
  deadline = time.monotonic() + 120
  while not marker.exists():
    assert victim.poll() is None, victim.communicate()[0]
    assert time.monotonic() < deadline, 'the run never reached step 6'
    time.sleep(0.05)
  assert checkpoint.read_manifest(str(tmp_path / 'run'))['step'] == 4
  victim.send_signal(signal.SIGKILL)
  victim.communicate()
  assert victim.returncode == -signal.SIGKILL
  assert not (tmp_path / 'run-release').exists()

  resumed = run(tmp_path / 'run', tmp_path / 'run-release')
  output = resumed.communicate(timeout=120)[0]
  assert resumed.returncode == 0, output
  assert 'resumed from step 4 of 18' in output

  like = resumable.init_params()
  params, release = checkpoint.load_release(
      str(tmp_path / 'run-release'), params_like=like)
  reference_params, reference_release = checkpoint.load_release(
      str(tmp_path / 'reference-release'), params_like=like)
  for name in like:
    assert np.array_equal(params[name], reference_params[name])
  assert release == reference_release
  final = checkpoint.read_manifest(str(tmp_path / 'run'))
  reference_final = checkpoint.read_manifest(str(tmp_path / 'reference'))
  assert final['ledger'] == reference_final['ledger']
  assert final['step'] == final['ledger']['steps_consumed'] == 18
  assert final == reference_final
  # The whole final state (noise key, MF buffer, guard, momentum) agrees,
  # read back through orbax.
  built = resumable.build(resumable.Settings(algorithm='dpmemf', **_FAST),
                          final['sampler_state']['num_examples'])
  like = dict(params_like=like, opt_state_like=built.tx.init(like))
  _assert_identical(
      checkpoint.restore(str(tmp_path / 'run'), **like)[:3],
      checkpoint.restore(str(tmp_path / 'reference'), **like)[:3])
