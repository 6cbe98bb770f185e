"""Checkpoint and resume a private run, and export what is safe to release.

A checkpoint is a directory. Its arrays (the params and the optimizer
state) are stored with orbax-checkpoint, the JAX ecosystem's checkpoint
library; the step, a `PrivacyLedger`, the sampler's description, free-form
metadata and the description of every saved leaf (path, shape, dtype) are a
JSON manifest beside them. Any pytree round-trips bit for bit: typed PRNG
keys (stored as their key data and implementation name, rebuilt with
`jax.random.wrap_key_data`), integer counters, float buffers, bfloat16,
Python scalars.

    ledger = checkpoint.PrivacyLedger.create(
        mechanism, noise_multiplier, batches.participation, delta, key=key)
    ckpt = checkpoint.restore_or_init(path, params=params,
                                      opt_state=tx.init(params),
                                      ledger=ledger, sampler=batches)
    params, opt_state, ledger = ckpt.params, ckpt.opt_state, ckpt.ledger
    for step, indices in enumerate(batches.iterate(ckpt.step), ckpt.step + 1):
      params, opt_state = train_step(params, opt_state, indices)
      if step % 100 == 0 or step == batches.num_steps:
        ledger = checkpoint.save(path, params=params, opt_state=opt_state,
                                 step=step, ledger=ledger,
                                 sampler_state=batches)
    checkpoint.export_release('model', params, ledger, mechanism=mechanism)

Layout (format version 2; `path` is e.g. 'run/checkpoint'):

    path/                          mode 0700
      README.txt                   CONTAINS NON-PRIVATE STATE notice
      CURRENT                      the name of the current version, e.g.
                                   'ckpt-00000400-1f2e3d4c5b6a'
      ckpt-00000400-1f2e3d4c5b6a/  one complete checkpoint (the version)
        MANIFEST.json              format, version, step, ledger, sampler,
                                   metadata, leaf specs
        arrays/                    the orbax-checkpoint (written with
                                   StandardCheckpointHandler) of the tree
                                   {'params': {'0': ..}, 'opt_state':
                                   {'0': ..}}, keyed by leaf index

The checkpoint directory and each version are created with mode 0700, so
nothing in them is ever readable by others; before a save commits, every
file in the version is set to 0600 and every directory to 0700 (orbax
creates its own with the default modes). Leaves are stored by their index
in `jax.tree_util.tree_flatten` order, as host (NumPy) arrays; the manifest
lists each leaf's path, shape and dtype, so that a template that does not
match is refused, by path, before any array is read.
Zero-size leaves are described in the manifest only (orbax stores no empty
arrays). Arrays can be read without this library:
`orbax.checkpoint.Checkpointer(orbax.checkpoint.StandardCheckpointHandler())
.restore(f'{path}/{version}/arrays')`.

Atomicity: a save writes a new version directory beside the current one
(orbax itself writes `arrays/` to `arrays.orbax-checkpoint-tmp` and renames
it when complete), writes the manifest, syncs every file to disk, and then
commits by replacing `CURRENT` atomically (a temporary file, fsync,
`os.replace`, fsync of the directory). Only then are older versions and any
leftovers of interrupted saves deleted. A run killed at any moment leaves
`CURRENT` naming either the previous complete version or the new complete
one, never a torn one; readers only ever open the version `CURRENT` names.
One process writes a given checkpoint at a time.

A release (`export_release`) has the same layout with `release-<id>`
versions, files 0644 and directories 0755, and only the params in its orbax
tree; `load_release` reads it and `read_manifest` reads both.

Privacy rules the module enforces:

* Checkpoints hold NON-PRIVATE state (design convention 4): the noise key
  and buffers (`noise.NoiseState`) let anyone subtract the noise from the
  released params, and other states hold values computed from the data
  without noise (fingerprints and a bitmap of example ids, clean prefix
  sums, previous iterates; the Poisson sampler's seed reveals who was in
  which batch).
  Every checkpoint says so in its manifest (`"contains_nonprivate_state":
  true`) and in a `README.txt`, and is created readable by its owner only
  (files 0600 in directories 0700). `export_release` writes the only
  directory meant for publication: the params (post-noise) and the ledger's
  public summary with the epsilon spent, never the optimizer state, the key
  or the sampler.
* Steps spent are never forgotten: the ledger records the steps consumed;
  `save` refuses to replace a checkpoint with one at a lower step (a run
  restarted from scratch) unless told, and refuses a ledger or noise state
  whose step disagrees with the step saved.
* Noise is never re-spent: the noise state (key, step counter, buffers)
  comes back with the checkpoint, so the resumed run draws the noise of the
  following steps, not the first ones again. Steps run after the last
  checkpoint and lost with the process are redone with the same noise on
  the same batches, hence the same outputs: nothing new is revealed.
* A resume whose configuration differs from the checkpoint's (another
  mechanism, noise multiplier, participation, number of steps, delta,
  method, noise key, or sampler) is refused: its accounting would describe
  neither run.
"""

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any, Mapping, NamedTuple, Optional, Union

from absl import logging as absl_logging
import jax
import numpy as np
import orbax.checkpoint as ocp

from dpsco_jax import batching
from dpsco_jax import keys
from dpsco_jax import guards
from dpsco_jax import ledger as ledger_lib
from dpsco_jax import noise as noise_lib

PyTree = Any
Sampler = Union[batching.FixedOrderBatches, batching.ShuffledBatches,
                batching.PoissonBatches]

FORMAT = 'dpsco_jax.checkpoint'
RELEASE_FORMAT = 'dpsco_jax.release'
VERSION = 2
MANIFEST = 'MANIFEST.json'
README = 'README.txt'
CURRENT = 'CURRENT'
ARRAYS = 'arrays'

CHECKPOINT_README = """\
dpsco_jax checkpoint: CONTAINS NON-PRIVATE STATE. DO NOT PUBLISH OR SHARE.

This directory holds the optimizer state of a differentially private
training run, which the run's privacy guarantee does not cover:
- the noise keys and noise buffers determine the noise that was added:
  anyone holding them can subtract it from the released parameters;
- other state is computed from the training data without noise (e.g. clean
  prefix sums, previous iterates or gradients, fingerprints of the example
  ids of each batch), and the sampler description includes the seed that
  decides which examples were in which batch.
Store it with the same care as the training data. To publish a model, use
dpsco_jax.checkpoint.export_release, which writes only the parameters and
the privacy ledger's summary.
"""

RELEASE_README = """\
dpsco_jax release: differentially private model parameters.

The parameters were produced by a differentially private training run; the
privacy section of MANIFEST.json (in the directory CURRENT names) states the
mechanism, noise multiplier, participation pattern, steps, delta and the
epsilon spent. No optimizer state, noise key or sampler state is included.
"""

# A checkpoint that does not fit its run is the ledger's mismatch error.
CheckpointMismatchError = ledger_lib.LedgerMismatchError
PrivacyLedger = ledger_lib.PrivacyLedger
key_fingerprint = ledger_lib.key_fingerprint
noise_key_of = ledger_lib.noise_key_of

_SAMPLERS = {cls.__name__: cls for cls in (
    batching.FixedOrderBatches, batching.ShuffledBatches,
    batching.PoissonBatches)}

# Names this module writes inside a checkpoint or release directory: the
# versions, and the temporary files of `CURRENT` and `README.txt`.
_VERSION_NAME = re.compile(r'(ckpt-\d{8,}|release)-[0-9a-f]{12}')
_OWN_NAME = re.compile(
    r'(ckpt-\d{8,}|release)-[0-9a-f]{12}|\.(CURRENT|README\.txt)\..*\.tmp')


# ---------------------------------------------------------------- pytrees

def _leaf_spec(leaf: Any) -> dict:
  """Shape and dtype of a leaf (array, ShapeDtypeStruct or Python scalar)."""
  if isinstance(leaf, (bool, int, float, complex)):
    leaf = np.asarray(leaf)
  return {'shape': [int(d) for d in np.shape(leaf)],
          'dtype': str(leaf.dtype)}


def _to_numpy(leaf: Any) -> tuple[Optional[np.ndarray], dict]:
  """The stored host array of a leaf (None if empty) and its spec.

  Typed keys are stored as their key data (`stored_shape`, `stored_dtype`
  in the spec) and the implementation's name (`key_impl`).
  """
  spec = _leaf_spec(leaf)
  if keys.is_typed_key(leaf):
    impl, array, _ = keys.key_data(leaf)
    spec.update(key_impl=impl, stored_shape=list(array.shape),
                stored_dtype=str(array.dtype))
  else:
    array = np.asarray(jax.device_get(leaf))
  if array.size == 0:
    spec['empty'] = True  # orbax stores no zero-size array
    return None, spec
  return array, spec


def _flatten(tree: PyTree) -> tuple[dict, dict]:
  """`(description, arrays)` of a pytree, arrays keyed by leaf index."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  specs, arrays = [], {}
  for index, (path, leaf) in enumerate(leaves):
    array, spec = _to_numpy(leaf)
    spec['path'] = jax.tree_util.keystr(path)
    specs.append(spec)
    if array is not None:
      arrays[str(index)] = array
  return {'treedef': str(treedef), 'leaves': specs}, arrays


def _stored(spec: dict) -> tuple[list, str]:
  """The shape and dtype of a leaf's stored array."""
  return (spec.get('stored_shape', spec['shape']),
          spec.get('stored_dtype', spec['dtype']))


def _describe_mismatch(name: str, saved: dict, template: PyTree) -> list[str]:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  problems = []
  if len(leaves) != len(saved['leaves']):
    problems.append(f'{len(saved["leaves"])} leaves in the checkpoint, '
                    f'{len(leaves)} in the template')
  elif str(treedef) != saved['treedef']:
    problems.append('tree structure differs:\n    checkpoint '
                    f'{saved["treedef"]}\n    template   {treedef}')
  for (path, leaf), spec in zip(leaves, saved['leaves']):
    where = f'{name}{jax.tree_util.keystr(path)}'
    expected = _leaf_spec(leaf)
    if jax.tree_util.keystr(path) != spec['path']:
      problems.append(f'{where}: the checkpoint has {name}{spec["path"]} here')
    elif (expected['shape'], expected['dtype']) != (spec['shape'],
                                                     spec['dtype']):
      problems.append(
          f'{where}: checkpoint {spec["dtype"]}{spec["shape"]}, template '
          f'{expected["dtype"]}{expected["shape"]}')
  return problems


def _check_template(name: str, saved: dict, template: PyTree,
                    path: str) -> None:
  problems = _describe_mismatch(name, saved, template)
  if problems:
    shown = problems[:10] + ([f'... and {len(problems) - 10} more']
                             if len(problems) > 10 else [])
    raise CheckpointMismatchError(
        f'{path}: the saved {name} does not match its template:\n  ' +
        '\n  '.join(shown))


def _restore_target(saved: dict) -> dict:
  """Host arrays of the stored shapes and dtypes, for orbax to fill."""
  return {str(index): np.empty(shape, jax.numpy.dtype(dtype))
          for index, spec in enumerate(saved['leaves'])
          if not spec.get('empty')
          for shape, dtype in [_stored(spec)]}


def _unflatten(name: str, saved: dict, arrays: Mapping[str, np.ndarray],
               template: PyTree, path: str) -> PyTree:
  """The tree of `template`'s structure from the restored host arrays."""
  template_leaves, treedef = jax.tree_util.tree_flatten(template)
  leaves = []
  for index, (spec, like) in enumerate(zip(saved['leaves'], template_leaves)):
    shape, dtype = _stored(spec)
    if spec.get('empty'):
      array = np.zeros(shape, jax.numpy.dtype(dtype))
    else:
      array = np.asarray(arrays[str(index)])
    if (list(array.shape), str(array.dtype)) != (shape, dtype):
      raise CheckpointMismatchError(
          f'{path}: {name}{spec["path"]} is stored as {array.dtype}'
          f'{list(array.shape)}, its manifest says {dtype}{shape}: the '
          'checkpoint is damaged')
    if 'key_impl' in spec:
      leaves.append(jax.random.wrap_key_data(array, impl=spec['key_impl']))
    elif isinstance(like, (bool, int, float, complex)):
      leaves.append(type(like)(array.item()))
    elif isinstance(like, np.ndarray):
      leaves.append(array)
    else:
      leaves.append(jax.numpy.asarray(array))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_noise_state(opt_state: PyTree, ledger: PrivacyLedger,
                       step: int) -> None:
  """The ledger's noise key and mechanism are in `opt_state`, at step `step`.

  Optimizer states without a `NoiseState` (custom ones) are not checked.
  """
  states = ledger_lib._noise_states(opt_state)
  if not states:
    return
  ours = [state for state in states
          if ledger.key_fingerprint in keys.fingerprint_rows(state.key)]
  if not ours:
    raise CheckpointMismatchError(
        'the optimizer state has no noise state with the ledger\'s noise key: '
        'the ledger was made for another run (PrivacyLedger.create(..., '
        'key=) takes the key given to the transformation)')
  expected = noise_lib.identity_words(ledger.mechanism_fingerprint)
  for state in ours:
    if state.mechanism_id is None or np.any(
        np.asarray(state.mechanism_id) != expected):
      raise CheckpointMismatchError(
          f'the noise state was not made by the ledger\'s mechanism '
          f'({ledger.mechanism}): the run would continue under noise its '
          'accounting does not describe. Build the transformation with the '
          'mechanism the ledger was created with')
    counters = np.unique(np.asarray(state.step))
    if counters.tolist() != [step]:
      raise CheckpointMismatchError(
          f'the noise state has drawn {counters.tolist()} steps of noise, '
          f'but the checkpoint is for step {step}: save the state of the '
          'step being recorded')


def _check_same_mechanisms(saved: PyTree, template: PyTree) -> None:
  """The restored noise states were made by the template's mechanisms.

  Templates from `jax.eval_shape` hold no values and are not compared.
  """
  for restored, like in zip(ledger_lib._noise_states(saved), ledger_lib._noise_states(template)):
    words = like.mechanism_id
    if words is None or not hasattr(words, '__array__'):
      continue
    if restored.mechanism_id is None or np.any(
        np.asarray(restored.mechanism_id) != np.asarray(words)):
      raise CheckpointMismatchError(
          'the checkpoint\'s noise state was made by another noise mechanism '
          'than the transformation being resumed (opt_state_like): the '
          'resumed run would continue under noise its ledger does not '
          'describe. Resume with the transformation the checkpoint was '
          'saved with')


# ----------------------------------------------------------------- files


def _json_default(value: Any) -> Any:
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f'{type(value).__name__} is not JSON serializable')


def _dumps(value: Any, what: str) -> str:
  try:
    return json.dumps(value, indent=1, default=_json_default,
                      allow_nan=True)
  except (TypeError, ValueError) as error:
    raise ValueError(f'{what} must be JSON-serializable: {error}') from error


def _orbax() -> ocp.Checkpointer:
  """A synchronous orbax checkpointer of a pytree of arrays."""
  return ocp.Checkpointer(ocp.StandardCheckpointHandler())


_ORBAX_DIRECTORY = os.path.dirname(os.path.abspath(ocp.__file__))


def _not_orbax_info(record: logging.LogRecord) -> bool:
  return (record.levelno >= logging.WARNING or
          not os.path.abspath(record.pathname).startswith(_ORBAX_DIRECTORY))


@contextlib.contextmanager
def _quiet_orbax():
  """Drops orbax's INFO logging (about 20 lines per save) while it runs.

  Orbax logs through absl; its warnings and errors still come through, and
  so does everything else logged meanwhile.
  """
  logger = absl_logging.get_absl_logger()
  logger.addFilter(_not_orbax_info)
  try:
    yield
  finally:
    logger.removeFilter(_not_orbax_info)


def _fsync(path: str) -> None:
  """Syncs a file or directory to disk (best effort for directories)."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _write_file_atomically(directory: str, name: str, text: str,
                           mode: int) -> None:
  """Writes `directory/name` through a synced temporary file and a rename."""
  # mkstemp creates the file with mode 0600: never readable by others, not
  # even while it is being written.
  fd, temporary = tempfile.mkstemp(dir=directory, prefix=f'.{name}.',
                                   suffix='.tmp')
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(temporary, mode)
    os.replace(temporary, os.path.join(directory, name))
  except BaseException:
    if os.path.exists(temporary):
      os.unlink(temporary)
    raise
  _fsync(directory)


def _seal(directory: str, file_mode: int, dir_mode: int) -> None:
  """Sets the modes of everything under `directory` and syncs it to disk."""
  for root, dirs, files in os.walk(directory, topdown=False):
    for name in files:
      file = os.path.join(root, name)
      os.chmod(file, file_mode)
      _fsync(file)
    for name in dirs:
      os.chmod(os.path.join(root, name), dir_mode)
    _fsync(root)
  os.chmod(directory, dir_mode)


def _current_version(path: str) -> Optional[str]:
  """The name `path/CURRENT` gives, or None when there is no `CURRENT`.

  Raises:
    CheckpointMismatchError: if `path` is a file, or `CURRENT` does not name
      a version.
  """
  if os.path.isfile(path):
    raise CheckpointMismatchError(
        f'{path} is a file, not a dpsco_jax checkpoint or release: they are '
        f'directories (format version {VERSION}: orbax-checkpoint arrays and '
        'a JSON manifest). A version 1 checkpoint (one .npz file) is read by '
        'the dpsco_jax version that wrote it.')
  try:
    with open(os.path.join(path, CURRENT)) as f:
      name = f.read().strip()
  except (FileNotFoundError, NotADirectoryError):
    return None
  if not _VERSION_NAME.fullmatch(name):
    raise CheckpointMismatchError(
        f'{path} is not a dpsco_jax checkpoint or release: {CURRENT} holds '
        f'{name[:80]!r}')
  return name


def _check_writable(path: str) -> None:
  """Refuses to write into a file or a directory this module did not make."""
  if os.path.isfile(path):
    _current_version(path)  # raises
  if os.path.isdir(path) and _current_version(path) is None:
    foreign = sorted(name for name in os.listdir(path)
                     if name != README and not _OWN_NAME.fullmatch(name))
    if foreign:
      raise CheckpointMismatchError(
          f'{path} exists and is not a dpsco_jax checkpoint or release (it '
          f'holds {foreign[:5]}): refusing to write into it')


def _write(path: str, prefix: str, manifest: dict, readme: str,
           arrays: dict, *, private: bool) -> None:
  """Writes a new version of `path` and commits it by replacing `CURRENT`.

  Args:
    path: the checkpoint or release directory.
    prefix: the version name's prefix ('ckpt-00000012' or 'release').
    manifest: the manifest (JSON-serializable).
    readme: the text of `path/README.txt`.
    arrays: `{group: {index: host array}}`, saved with orbax.
    private: files 0600 and directories 0700, else 0644 and 0755.
  """
  file_mode, dir_mode = (0o600, 0o700) if private else (0o644, 0o755)
  manifest_text = _dumps(manifest, 'the manifest (metadata, sampler state)')
  _check_writable(path)
  os.makedirs(path, mode=dir_mode, exist_ok=True)
  os.chmod(path, dir_mode)
  name = f'{prefix}-{uuid.uuid4().hex[:12]}'
  version = os.path.join(path, name)
  os.mkdir(version, dir_mode)
  try:
    arrays = {group: leaves for group, leaves in arrays.items() if leaves}
    if arrays:
      # Orbax writes `arrays.orbax-checkpoint-tmp` and renames it to
      # `arrays` once complete.
      with _quiet_orbax():
        _orbax().save(os.path.abspath(os.path.join(version, ARRAYS)),
                      args=ocp.args.StandardSave(arrays))
    with open(os.path.join(version, MANIFEST), 'x') as f:
      f.write(manifest_text)
    _seal(version, file_mode, dir_mode)
    _fsync(path)
    if not _read_text(os.path.join(path, README)) == readme:
      _write_file_atomically(path, README, readme, file_mode)
    # The commit: from here on, readers see the new version.
    _write_file_atomically(path, CURRENT, name + '\n', file_mode)
  except BaseException:
    shutil.rmtree(version, ignore_errors=True)
    raise
  _discard_others(path, keep=name)


def _read_text(file: str) -> Optional[str]:
  try:
    with open(file) as f:
      return f.read()
  except FileNotFoundError:
    return None


def _discard_others(path: str, keep: str) -> None:
  """Deletes older versions and leftovers of interrupted saves."""
  for name in os.listdir(path):
    if name == keep or not _OWN_NAME.fullmatch(name):
      continue
    target = os.path.join(path, name)
    if os.path.isdir(target) and not os.path.islink(target):
      shutil.rmtree(target, ignore_errors=True)
    else:
      try:
        os.unlink(target)
      except OSError:
        pass


def _read(path: str) -> tuple[str, dict]:
  """`(version directory, manifest)` of the version `path/CURRENT` names."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'no checkpoint or release at {path}')
  name = _current_version(path)
  if name is None:
    raise FileNotFoundError(
        f'{path} holds no complete checkpoint or release (no {CURRENT})')
  version = os.path.join(path, name)
  try:
    with open(os.path.join(version, MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, json.JSONDecodeError) as error:
    raise CheckpointMismatchError(
        f'{path} is not a dpsco_jax checkpoint or release: {error}') from error
  if not isinstance(manifest, dict) or manifest.get('format') not in (
      FORMAT, RELEASE_FORMAT):
    raise CheckpointMismatchError(f'{path} is not a dpsco_jax checkpoint')
  if manifest.get('version') != VERSION:
    raise CheckpointMismatchError(
        f'{path} has format version {manifest.get("version")}, this library '
        f'reads version {VERSION}')
  return version, manifest


def _load_arrays(version: str, manifest: dict, names: tuple[str, ...]) -> dict:
  """`{name: {index: host array}}` of the trees `names`, read with orbax."""
  target = {name: _restore_target(manifest[name]) for name in names}
  target = {name: leaves for name, leaves in target.items() if leaves}
  if not target:
    return {name: {} for name in names}
  with _quiet_orbax():
    restored = _orbax().restore(os.path.abspath(os.path.join(version, ARRAYS)),
                                args=ocp.args.StandardRestore(target))
  return {name: restored.get(name, {}) for name in names}


def has_checkpoint(path: str) -> bool:
  """Whether `path` holds a complete checkpoint or release (a `CURRENT`).

  Example:
    >>> has_checkpoint('run/checkpoint')
    False

  Args:
    path: the directory.

  Returns:
    True if a save to `path` was committed.

  Raises:
    CheckpointMismatchError: if `path` is a file (e.g. a version 1 `.npz`
      checkpoint) or its `CURRENT` is not this module's.
  """
  return os.path.exists(path) and _current_version(path) is not None


def read_manifest(path: str) -> dict:
  """The manifest of a checkpoint or release, without loading arrays.

  Example:
    >>> read_manifest('run/checkpoint')['step']

  Args:
    path: the checkpoint or release directory.

  Returns:
    The manifest dict (`format`, `contains_nonprivate_state`, `step`,
    `ledger`, ...) of its current version.

  Raises:
    FileNotFoundError: if there is no directory, or no save to it completed.
    CheckpointMismatchError: if it is not a dpsco_jax checkpoint or release.
  """
  return _read(path)[1]


def describe_sampler(sampler: Union[Sampler, Mapping[str, Any]]) -> dict:
  """A JSON description of a batch sampler: its class and every field.

  With the step of a checkpoint it determines the rest of the data order
  (`sampler.iterate(start_step=step)`). It contains the sampler's seed, so
  it is kept in the (non-private) checkpoint, never exported.

  Example:
    >>> describe_sampler(batching.FixedOrderBatches(100, 10, seed=3))
    {'class': 'FixedOrderBatches', 'num_examples': 100, ...}

  Args:
    sampler: a `batching` sampler, or a dict describing a custom one
      (returned as is).

  Returns:
    A JSON-compatible dict.

  Raises:
    ValueError: for another type.
  """
  if isinstance(sampler, Mapping):
    return json.loads(_dumps(dict(sampler), 'the sampler state'))
  if type(sampler) not in _SAMPLERS.values():
    raise ValueError('sampler_state must be a batching sampler or a dict, got '
                     f'{type(sampler).__name__}')
  return json.loads(_dumps({'class': type(sampler).__name__,
                            **dataclasses.asdict(sampler)}, 'the sampler'))


def sampler_from_state(state: Mapping[str, Any]) -> Sampler:
  """The `batching` sampler that `describe_sampler` described.

  Example:
    >>> batches = sampler_from_state(ckpt.sampler_state)
    >>> for indices in batches.iterate(start_step=ckpt.step): ...

  Args:
    state: the description.

  Returns:
    The sampler.

  Raises:
    ValueError: if it does not describe a `batching` sampler.
  """
  fields = dict(state)
  name = fields.pop('class', None)
  if name not in _SAMPLERS:
    raise ValueError(f'not a batching sampler description: {state!r}')
  return _SAMPLERS[name](**fields)


class Checkpoint(NamedTuple):
  """A restored checkpoint.

  Attributes:
    step: steps completed; the next step to run is `step` (0-indexed).
    params: the params after `step` steps.
    opt_state: the optimizer state after `step` steps (NON-PRIVATE: see the
      module docstring).
    ledger: the privacy ledger, `steps_consumed == step`.
    sampler_state: the sampler description, or None.
    metadata: the free-form metadata saved with it, or None.
  """

  step: int
  params: PyTree
  opt_state: PyTree
  ledger: PrivacyLedger
  sampler_state: Optional[dict] = None
  metadata: Optional[dict] = None


def save(
    path: str,
    *,
    params: PyTree,
    opt_state: PyTree,
    step: int,
    ledger: PrivacyLedger,
    sampler_state: Union[None, Sampler, Mapping[str, Any]] = None,
    metadata: Optional[Mapping[str, Any]] = None,
    allow_lower_step: bool = False,
) -> PrivacyLedger:
  """Writes a checkpoint atomically (NON-PRIVATE: never publish it).

  Example:
    >>> ledger = save('run/checkpoint', params=params,
    ...               opt_state=opt_state, step=step, ledger=ledger,
    ...               sampler_state=batches)

  Args:
    path: the checkpoint directory; parent directories are created. Its
      current version is replaced atomically (see the module docstring);
      files are created with mode 0600, directories 0700.
    params: the params after `step` steps (any pytree of arrays).
    opt_state: the optimizer state after `step` steps (any pytree; typed
      PRNG keys are stored as key data plus implementation).
    step: steps completed so far.
    ledger: the run's ledger; it is saved with `steps_consumed = step`.
    sampler_state: the batch sampler (a `batching` sampler, described with
      `describe_sampler`) or a JSON dict for a custom one.
    metadata: JSON-compatible extra information (e.g. metrics so far).
    allow_lower_step: replace an existing checkpoint at a higher step. Off
      by default: a run that starts over at a lower step with the same key
      redraws noise that was already spent.

  Returns:
    The ledger as saved (`ledger.advance_to(step)`): keep it for the next
    save.

  Raises:
    ValueError: if `step` is below the ledger's steps consumed or past its
      `num_steps`, or metadata is not JSON-serializable.
    CheckpointMismatchError: if `path` holds a checkpoint at a higher step
      (and `allow_lower_step` is False) or something that is not a
      checkpoint, or the noise
      state's key or step counter disagrees with the ledger and `step`.
  """
  # A refused run is not saved: its state is poisoned, and a checkpoint of
  # it would resume a run whose accounting no longer holds.
  guards.raise_if_refused(opt_state)
  ledger = ledger.advance_to(step).with_key_of(opt_state)
  _check_noise_state(opt_state, ledger, ledger.steps_consumed)
  if has_checkpoint(path):
    existing = read_manifest(path)
    if existing.get('format') != FORMAT:
      raise CheckpointMismatchError(f'{path} exists and is not a checkpoint')
    if existing['step'] > ledger.steps_consumed and not allow_lower_step:
      raise CheckpointMismatchError(
          f'{path} holds a checkpoint at step {existing["step"]}; refusing '
          f'to replace it with step {ledger.steps_consumed}: a run that '
          'starts over with the same key redraws noise already spent. Resume '
          'from it (restore_or_init), or pass allow_lower_step=True.')
  params_spec, params_arrays = _flatten(params)
  state_spec, state_arrays = _flatten(opt_state)
  manifest = {
      'contains_nonprivate_state': True,
      'readme': CHECKPOINT_README,
      'format': FORMAT,
      'version': VERSION,
      'step': ledger.steps_consumed,
      'ledger': ledger.to_json(),
      'sampler_state': (None if sampler_state is None else
                        describe_sampler(sampler_state)),
      'metadata': None if metadata is None else dict(metadata),
      'params': params_spec,
      'opt_state': state_spec,
  }
  _write(path, f'ckpt-{ledger.steps_consumed:08d}', manifest,
         CHECKPOINT_README,
         {'params': params_arrays, 'opt_state': state_arrays}, private=True)
  return ledger


def restore(
    path: str,
    *,
    params_like: PyTree,
    opt_state_like: PyTree,
    ledger: Optional[PrivacyLedger] = None,
    sampler: Union[None, Sampler, Mapping[str, Any]] = None,
) -> Checkpoint:
  """Reads a checkpoint, checked against templates and the run's configuration.

  Example:
    >>> ckpt = restore('run/checkpoint', params_like=params,
    ...                opt_state_like=tx.init(params), ledger=ledger,
    ...                sampler=batches)
    >>> batches.iterate(start_step=ckpt.step)

  Args:
    path: the checkpoint directory.
    params_like: a pytree with the params' structure, shapes and dtypes
      (arrays or `jax.ShapeDtypeStruct`s, e.g. freshly initialized params).
    opt_state_like: the same for the optimizer state (e.g. `tx.init(params)`
      or `jax.eval_shape(tx.init, params)`).
    ledger: the ledger of the run being resumed, built from its
      configuration (`PrivacyLedger.create`); None skips the check.
    sampler: the run's batch sampler (or its description); None skips the
      check.

  Returns:
    The `Checkpoint`; arrays come back on the default device (re-replicate
    or re-shard them as the run needs).

  Raises:
    FileNotFoundError: if there is no checkpoint.
    CheckpointMismatchError: if `path` is not a checkpoint, a saved tree
      does not match its template (structure, shape or dtype, listed by
      path), or the ledger or sampler disagree with the checkpoint's.
  """
  version, manifest = _read(path)
  if manifest['format'] != FORMAT:
    raise CheckpointMismatchError(
        f'{path} is a release, not a checkpoint: it has no optimizer state')
  saved_ledger = PrivacyLedger.from_json(manifest['ledger'])
  if ledger is not None:
    ledger.check_same_run(saved_ledger)
    if ledger.steps_consumed > saved_ledger.steps_consumed:
      raise CheckpointMismatchError(
          f'the run has already spent {ledger.steps_consumed} steps but the '
          f'checkpoint is at step {saved_ledger.steps_consumed}: resuming '
          'from it would forget spent steps')
  if sampler is not None:
    expected = describe_sampler(sampler)
    if expected != manifest['sampler_state']:
      raise CheckpointMismatchError(
          f'the batch sampler differs from the checkpoint\'s '
          f'({expected} here, {manifest["sampler_state"]} saved): the resumed '
          'batches would not continue the run (and a fixed order would no '
          'longer be the order accounted for)')
  # Templates are checked against the manifest before orbax reads anything.
  _check_template('params', manifest['params'], params_like, path)
  _check_template('opt_state', manifest['opt_state'], opt_state_like, path)
  arrays = _load_arrays(version, manifest, ('params', 'opt_state'))
  params = _unflatten('params', manifest['params'], arrays['params'],
                      params_like, path)
  opt_state = _unflatten('opt_state', manifest['opt_state'],
                         arrays['opt_state'], opt_state_like, path)
  _check_noise_state(opt_state, saved_ledger, manifest['step'])
  _check_same_mechanisms(opt_state, opt_state_like)
  return Checkpoint(step=manifest['step'], params=params,
                    opt_state=opt_state, ledger=saved_ledger,
                    sampler_state=manifest['sampler_state'],
                    metadata=manifest['metadata'])


def restore_or_init(
    path: str,
    *,
    params: PyTree,
    opt_state: PyTree,
    ledger: PrivacyLedger,
    sampler: Union[None, Sampler, Mapping[str, Any]] = None,
) -> Checkpoint:
  """Resumes from the checkpoint at `path` if there is one, else step 0.

  The one entry point a resumable run needs: a run that always starts with
  it never restarts its step counter at 0 while a checkpoint of its key
  exists.

  Example:
    >>> ckpt = restore_or_init(path, params=init_params(),
    ...                        opt_state=tx.init(init_params()),
    ...                        ledger=ledger, sampler=batches)

  Args:
    path: the checkpoint directory (a directory with no completed save, as
      a run killed during its first save leaves, holds no checkpoint).
    params: the initial params (also the template when resuming).
    opt_state: the initial optimizer state (also the template).
    ledger: the run's ledger (`PrivacyLedger.create`).
    sampler: the run's batch sampler or its description.

  Returns:
    The restored `Checkpoint`, or one at step 0 with the given values.

  Raises:
    CheckpointMismatchError: as `restore`, or if there is no checkpoint but
      the ledger records steps already spent.
  """
  if has_checkpoint(path):
    return restore(path, params_like=params, opt_state_like=opt_state,
                   ledger=ledger, sampler=sampler)
  if ledger.steps_consumed:
    raise CheckpointMismatchError(
        f'the ledger records {ledger.steps_consumed} steps spent but there '
        f'is no checkpoint at {path} to resume them from')
  ledger = ledger.with_key_of(opt_state)
  _check_noise_state(opt_state, ledger, 0)
  return Checkpoint(step=0, params=params, opt_state=opt_state, ledger=ledger,
                    sampler_state=(None if sampler is None else
                                   describe_sampler(sampler)))


def _refuse_state(params: PyTree) -> None:
  """Refuses keys and optimizer states where only params belong."""

  def is_state(x):
    module = type(x).__module__ or ''
    return hasattr(x, '_fields') and module.split('.')[0] in ('optax',
                                                              'dpsco_jax')

  for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_state):
    if is_state(leaf):
      raise ValueError(
          f'export_release got a {type(leaf).__name__}: only params may be '
          'released, never optimizer or noise state')
    if keys.is_typed_key(leaf):
      raise ValueError('export_release got a PRNG key among the params: keys '
                       'determine the noise and are never released')


def export_release(
    path: str,
    params: PyTree,
    ledger: PrivacyLedger,
    *,
    mechanism: Optional[noise_lib.NoiseMechanism] = None,
    metadata: Optional[Mapping[str, Any]] = None,
) -> str:
  """Writes ONLY what is safe to publish: params, ledger summary, epsilon.

  The params of a private run are post-processing of its noisy outputs, so
  they are covered by the guarantee. Nothing else of the run is written: no
  optimizer state, no noise key or its fingerprint, no sampler state.

  Example:
    >>> export_release('model', params, ledger, mechanism=mechanism)
    >>> read_manifest('model')['privacy']['epsilon_spent']

  Args:
    path: the release directory, laid out as a checkpoint (module
      docstring) with files 0644: `README.txt`, `CURRENT`, and in the
      version it names `MANIFEST.json` and the orbax tree `arrays/` of
      `{'params': {'0': ..., '1': ...}}` (leaves in `tree_flatten` order).
      Replaced atomically if it exists.
    params: the params (pytree of arrays).
    ledger: the run's ledger, e.g. the one `save` returned last.
    mechanism: the run's noise mechanism, for the exact epsilon of a
      partial run (`PrivacyLedger.epsilon_spent`).
    metadata: JSON-compatible public information (e.g. test accuracy). It
      is published as given: put nothing computed from training data
      without privacy in it.

  Returns:
    `path`.

  Raises:
    ValueError: if `params` holds a PRNG key or an optimizer/noise state, or
      metadata is not JSON-serializable.
    CheckpointMismatchError: if `path` holds a checkpoint or something
      else that is not a release.
  """
  _refuse_state(params)
  params_spec, arrays = _flatten(params)
  manifest = {
      'contains_nonprivate_state': False,
      'readme': RELEASE_README,
      'format': RELEASE_FORMAT,
      'version': VERSION,
      'privacy': ledger.summary(mechanism),
      'metadata': None if metadata is None else dict(metadata),
      'params': params_spec,
  }
  if has_checkpoint(path) and read_manifest(path)['format'] != RELEASE_FORMAT:
    raise CheckpointMismatchError(
        f'{path} holds a checkpoint: refusing to replace it with a release')
  _write(path, 'release', manifest, RELEASE_README, {'params': arrays},
         private=False)
  return path


def load_release(path: str, *, params_like: PyTree) -> tuple[PyTree, dict]:
  """Reads a release written by `export_release`.

  Example:
    >>> params, manifest = load_release('model', params_like=params)
    >>> manifest['privacy']['epsilon_spent']

  Args:
    path: the release directory.
    params_like: a pytree with the params' structure, shapes and dtypes.

  Returns:
    `(params, manifest)`.

  Raises:
    CheckpointMismatchError: if it is not a release or the params do not
      match the template.
  """
  version, manifest = _read(path)
  if manifest['format'] != RELEASE_FORMAT:
    raise CheckpointMismatchError(f'{path} is not a release')
  _check_template('params', manifest['params'], params_like, path)
  arrays = _load_arrays(version, manifest, ('params',))
  params = _unflatten('params', manifest['params'], arrays['params'],
                      params_like, path)
  return params, manifest


__all__ = (
    'Checkpoint', 'CheckpointMismatchError', 'PrivacyLedger',
    'describe_sampler', 'export_release', 'has_checkpoint', 'key_fingerprint',
    'load_release', 'noise_key_of', 'read_manifest', 'restore',
    'restore_or_init', 'sampler_from_state', 'save')
