"""Checkpoint and resume a private run, and export what is safe to release.

A checkpoint is one file (a NumPy `.npz` zip, no extra dependency) holding
the params, the optimizer state, the step, a `PrivacyLedger`, the sampler's
description and free-form metadata. It is written atomically (a temporary
file in the same directory, fsync, `os.replace`), so a run killed at any
moment leaves either the previous checkpoint or the new one, never a torn
file. Any pytree round-trips bit for bit: typed PRNG keys (stored as their
key data and implementation), integer counters, float buffers, bfloat16.

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
    checkpoint.export_release('model.npz', params, ledger,
                              mechanism=mechanism)

Privacy rules the module enforces:

* Checkpoints hold NON-PRIVATE state (design convention 4): the noise key
  and buffers (`noise.NoiseState`) let anyone subtract the noise from the
  released params, and other states hold values computed from the data
  without noise (fingerprints and a bitmap of example ids, clean prefix
  sums, previous iterates; the Poisson sampler's seed reveals who was in
  which batch).
  Every checkpoint says so in its manifest (`"contains_nonprivate_state":
  true`) and in a `README.txt` member, and is created readable by its owner
  only (mode 0600). `export_release` writes the only file meant for
  publication: the params (post-noise) and the ledger's public summary with
  the epsilon spent, never the optimizer state, the key or the sampler.
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

import dataclasses
import json
import os
import tempfile
import zipfile
from typing import Any, Mapping, NamedTuple, Optional, Union

import jax
import numpy as np

from dpsco_jax import batching
from dpsco_jax import keys
from dpsco_jax import ledger as ledger_lib
from dpsco_jax import noise as noise_lib

PyTree = Any
Sampler = Union[batching.FixedOrderBatches, batching.ShuffledBatches,
                batching.PoissonBatches]

FORMAT = 'dpsco_jax.checkpoint'
RELEASE_FORMAT = 'dpsco_jax.release'
VERSION = 1
MANIFEST = 'MANIFEST.json'
README = 'README.txt'

CHECKPOINT_README = """\
dpsco_jax checkpoint: CONTAINS NON-PRIVATE STATE. DO NOT PUBLISH OR SHARE.

This file holds the optimizer state of a differentially private training
run, which the run's privacy guarantee does not cover:
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
privacy section of MANIFEST.json states the mechanism, noise multiplier,
participation pattern, steps, delta and the epsilon spent. No optimizer
state, noise key or sampler state is included.
"""

# A checkpoint that does not fit its run is the ledger's mismatch error.
CheckpointMismatchError = ledger_lib.LedgerMismatchError
PrivacyLedger = ledger_lib.PrivacyLedger
key_fingerprint = ledger_lib.key_fingerprint
noise_key_of = ledger_lib.noise_key_of

_SAMPLERS = {cls.__name__: cls for cls in (
    batching.FixedOrderBatches, batching.ShuffledBatches,
    batching.PoissonBatches)}


# ---------------------------------------------------------------- pytrees

def _leaf_spec(leaf: Any) -> dict:
  """Shape and dtype of a leaf (array, ShapeDtypeStruct or Python scalar)."""
  if isinstance(leaf, (bool, int, float, complex)):
    leaf = np.asarray(leaf)
  return {'shape': [int(d) for d in np.shape(leaf)],
          'dtype': str(leaf.dtype)}


def _to_numpy(leaf: Any) -> tuple[np.ndarray, dict]:
  """The stored array of a leaf and its spec (keys as their key data)."""
  spec = _leaf_spec(leaf)
  if keys.is_typed_key(leaf):
    impl, data, _ = keys.key_data(leaf)
    spec['key_impl'] = impl
    return data, spec
  array = np.asarray(leaf)
  if not (array.dtype.isbuiltin and array.dtype.kind in 'biufc'):
    # bfloat16 and friends: store the bits, restore the view.
    array = array.view(f'u{array.dtype.itemsize}')
    spec['stored_as'] = str(array.dtype)
  return array, spec


def _flatten(tree: PyTree, prefix: str) -> tuple[dict, dict]:
  """`(description, arrays)` of a pytree, arrays keyed `prefix/i`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  specs, arrays = [], {}
  for index, (path, leaf) in enumerate(leaves):
    array, spec = _to_numpy(leaf)
    spec['path'] = jax.tree_util.keystr(path)
    specs.append(spec)
    arrays[f'{prefix}/{index}'] = array
  return {'treedef': str(treedef), 'leaves': specs}, arrays


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


def _unflatten(name: str, saved: dict, arrays: Any, template: PyTree,
               path: str) -> PyTree:
  problems = _describe_mismatch(name, saved, template)
  if problems:
    shown = problems[:10] + ([f'... and {len(problems) - 10} more']
                             if len(problems) > 10 else [])
    raise CheckpointMismatchError(
        f'{path}: the saved {name} does not match its template:\n  ' +
        '\n  '.join(shown))
  template_leaves, treedef = jax.tree_util.tree_flatten(template)
  leaves = []
  for index, (spec, like) in enumerate(zip(saved['leaves'], template_leaves)):
    array = arrays[f'{name}/{index}']
    if 'key_impl' in spec:
      array = jax.random.wrap_key_data(array, impl=spec['key_impl'])
    elif 'stored_as' in spec:
      array = array.view(jax.numpy.dtype(spec['dtype']))
    if (list(array.shape), str(array.dtype)) != (spec['shape'],
                                                 spec['dtype']):
      raise CheckpointMismatchError(
          f'{path}: {name}{spec["path"]} is stored as {array.dtype}'
          f'{list(array.shape)}, its manifest says {spec["dtype"]}'
          f'{spec["shape"]}: the file is damaged')
    if 'key_impl' in spec:
      leaves.append(array)
      continue
    if isinstance(like, (bool, int, float, complex)):
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


def _write_atomically(path: str, manifest: dict, readme: str, arrays: dict,
                      mode: int) -> None:
  """Writes the zip to a temporary file beside `path`, then renames it."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  manifest_text = _dumps(manifest, 'the manifest (metadata, sampler state)')
  # mkstemp creates the file with mode 0600: a checkpoint is never readable
  # by others, not even while it is being written.
  fd, temporary = tempfile.mkstemp(
      dir=directory, prefix=f'.{os.path.basename(path)}.', suffix='.tmp')
  try:
    with os.fdopen(fd, 'wb') as f:
      with zipfile.ZipFile(f, 'w', zipfile.ZIP_STORED,
                           allowZip64=True) as archive:
        archive.writestr(README, readme)
        archive.writestr(MANIFEST, manifest_text)
        for name, array in arrays.items():
          with archive.open(name + '.npy', 'w', force_zip64=True) as member:
            # np.ascontiguousarray would turn a scalar into shape [1].
            np.lib.format.write_array(member, np.asarray(array, order='C'),
                                      allow_pickle=False)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(temporary, mode)
    os.replace(temporary, path)
  except BaseException:
    if os.path.exists(temporary):
      os.unlink(temporary)
    raise
  # The rename itself is durable only once the directory is synced.
  try:
    dir_fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(dir_fd)
  except OSError:
    pass
  finally:
    os.close(dir_fd)


def read_manifest(path: str) -> dict:
  """The manifest of a checkpoint or release file, without loading arrays.

  Example:
    >>> read_manifest('run/checkpoint.npz')['step']

  Args:
    path: the file.

  Returns:
    The manifest dict (`format`, `contains_nonprivate_state`, `step`,
    `ledger`, ...).

  Raises:
    FileNotFoundError: if there is no file.
    CheckpointMismatchError: if it is not a dpsco_jax checkpoint or release.
  """
  try:
    with zipfile.ZipFile(path) as archive:
      manifest = json.loads(archive.read(MANIFEST))
  except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as error:
    raise CheckpointMismatchError(
        f'{path} is not a dpsco_jax checkpoint or release: {error}') from error
  if manifest.get('format') not in (FORMAT, RELEASE_FORMAT):
    raise CheckpointMismatchError(f'{path} is not a dpsco_jax checkpoint')
  if manifest.get('version') != VERSION:
    raise CheckpointMismatchError(
        f'{path} has format version {manifest.get("version")}, this library '
        f'reads version {VERSION}')
  return manifest


def describe_sampler(sampler: Union[Sampler, Mapping[str, Any]]) -> dict:
  """A JSON description of a batch sampler: its class and every field.

  With the step of a checkpoint it determines the rest of the data order
  (`sampler.iterate(start_step=step)`). It contains the sampler's seed, so
  it is kept in the (non-private) checkpoint, never exported.

  Example:
    >>> describe_sampler(batching.FixedOrderBatches(100, 10, order_seed=3))
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
  """Writes a checkpoint atomically (NON-PRIVATE: never publish the file).

  Example:
    >>> ledger = save('run/checkpoint.npz', params=params,
    ...               opt_state=opt_state, step=step, ledger=ledger,
    ...               sampler_state=batches)

  Args:
    path: the file to write (conventionally `*.npz`); parent directories are
      created. It is replaced atomically and created with mode 0600.
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
    CheckpointMismatchError: if the file exists at a higher step (and
      `allow_lower_step` is False) or is not a checkpoint, or the noise
      state's key or step counter disagrees with the ledger and `step`.
  """
  ledger = ledger.advance_to(step).with_key_of(opt_state)
  _check_noise_state(opt_state, ledger, ledger.steps_consumed)
  if os.path.exists(path):
    existing = read_manifest(path)
    if existing.get('format') != FORMAT:
      raise CheckpointMismatchError(f'{path} exists and is not a checkpoint')
    if existing['step'] > ledger.steps_consumed and not allow_lower_step:
      raise CheckpointMismatchError(
          f'{path} holds a checkpoint at step {existing["step"]}; refusing '
          f'to replace it with step {ledger.steps_consumed}: a run that '
          'starts over with the same key redraws noise already spent. Resume '
          'from it (restore_or_init), or pass allow_lower_step=True.')
  params_spec, params_arrays = _flatten(params, 'params')
  state_spec, state_arrays = _flatten(opt_state, 'opt_state')
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
  _write_atomically(path, manifest, CHECKPOINT_README,
                    {**params_arrays, **state_arrays}, mode=0o600)
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
    >>> ckpt = restore('run/checkpoint.npz', params_like=params,
    ...                opt_state_like=tx.init(params), ledger=ledger,
    ...                sampler=batches)
    >>> batches.iterate(start_step=ckpt.step)

  Args:
    path: the checkpoint file.
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
    FileNotFoundError: if there is no file.
    CheckpointMismatchError: if the file is not a checkpoint, a saved tree
      does not match its template (structure, shape or dtype, listed by
      path), or the ledger or sampler disagree with the checkpoint's.
  """
  manifest = read_manifest(path)
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
  with np.load(path, allow_pickle=False) as arrays:
    params = _unflatten('params', manifest['params'], arrays, params_like,
                        path)
    opt_state = _unflatten('opt_state', manifest['opt_state'], arrays,
                           opt_state_like, path)
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
  """Resumes from `path` if it exists, else starts at step 0.

  The one entry point a resumable run needs: a run that always starts with
  it never restarts its step counter at 0 while a checkpoint of its key
  exists.

  Example:
    >>> ckpt = restore_or_init(path, params=init_params(),
    ...                        opt_state=tx.init(init_params()),
    ...                        ledger=ledger, sampler=batches)

  Args:
    path: the checkpoint file.
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
  if os.path.exists(path):
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
    >>> export_release('model.npz', params, ledger, mechanism=mechanism)
    >>> read_manifest('model.npz')['privacy']['epsilon_spent']

  Args:
    path: the file to write (a `.npz` zip: `np.load(path)['params/0']`...).
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
  """
  _refuse_state(params)
  params_spec, arrays = _flatten(params, 'params')
  manifest = {
      'contains_nonprivate_state': False,
      'readme': RELEASE_README,
      'format': RELEASE_FORMAT,
      'version': VERSION,
      'privacy': ledger.summary(mechanism),
      'metadata': None if metadata is None else dict(metadata),
      'params': params_spec,
  }
  _write_atomically(path, manifest, RELEASE_README, arrays, mode=0o644)
  return path


def load_release(path: str, *, params_like: PyTree) -> tuple[PyTree, dict]:
  """Reads a file written by `export_release`.

  Example:
    >>> params, manifest = load_release('model.npz', params_like=params)
    >>> manifest['privacy']['epsilon_spent']

  Args:
    path: the release file.
    params_like: a pytree with the params' structure, shapes and dtypes.

  Returns:
    `(params, manifest)`.

  Raises:
    CheckpointMismatchError: if it is not a release or the params do not
      match the template.
  """
  manifest = read_manifest(path)
  if manifest['format'] != RELEASE_FORMAT:
    raise CheckpointMismatchError(f'{path} is not a release')
  with np.load(path, allow_pickle=False) as arrays:
    params = _unflatten('params', manifest['params'], arrays, params_like,
                        path)
  return params, manifest


__all__ = (
    'Checkpoint', 'CheckpointMismatchError', 'PrivacyLedger',
    'describe_sampler', 'export_release', 'key_fingerprint', 'load_release',
    'read_manifest', 'restore', 'restore_or_init', 'sampler_from_state',
    'save')
