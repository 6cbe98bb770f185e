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
import hashlib
import json
import os
import tempfile
import zipfile
from typing import Any, Mapping, NamedTuple, Optional, Union

import jax
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import estimators
from dpsco_jax import keys
from dpsco_jax import neighboring
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

_PARTICIPATIONS = {cls.__name__: cls for cls in (
    accounting.FixedOrder, accounting.Shuffled, accounting.PoissonSampling)}
_SAMPLERS = {cls.__name__: cls for cls in (
    batching.FixedOrderBatches, batching.ShuffledBatches,
    batching.PoissonBatches)}


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit the templates, run or sampler given for it."""


# ----------------------------------------------------------------- keys


def key_fingerprint(key: estimators.KeyLike) -> str:
  """A fingerprint of a noise key, to recognize the run it belongs to.

  It is a hash of the key data, kept in the (non-private) checkpoint to
  refuse a resume with another key; it is never exported (a key made from a
  small int seed could be found from its hash).

  Example:
    >>> key_fingerprint(0) == key_fingerprint(jax.random.PRNGKey(0))
    True

  Args:
    key: an int seed, typed key or raw uint32 key, as given to the
      transformation.

  Returns:
    32 hex digits.

  Raises:
    ValueError: if `key` is not a key, or holds several different keys.
  """
  rows = keys.fingerprint_rows(estimators.as_key(key))
  if len(set(rows)) != 1:
    raise ValueError('the key holds several different keys; give the one '
                     'noise key of the run')
  return rows[0]


def noise_key_of(opt_state: PyTree,
                 mechanism: Optional[noise_lib.NoiseMechanism] = None
                 ) -> jax.Array:
  """The noise key in an optimizer state, e.g. one drawn from OS entropy.

  A transformation built with `key=None` draws its key itself; the ledger
  of the run needs it (`PrivacyLedger.create(..., key=noise_key_of(...))`).
  The key is a secret: keep it in the private checkpoint, never log it.

  Example:
    >>> opt_state = tx.init(params)
    >>> ledger = PrivacyLedger.create(mechanism, z, participation, delta,
    ...                               key=noise_key_of(opt_state, mechanism))

  Args:
    opt_state: the optimizer state (any pytree holding `NoiseState`s).
    mechanism: the run's mechanism; picks its noise state when the state
      holds several (None: there must be exactly one key).

  Returns:
    The noise key (replicated copies are returned as they are).

  Raises:
    ValueError: if no noise state (of `mechanism`) is found, or several
      with different keys.
  """
  states = _noise_states(opt_state, None if mechanism is None else
                         _mechanism_fingerprint(mechanism))
  distinct = {tuple(keys.fingerprint_rows(state.key)): state.key
              for state in states}
  made_by = '' if mechanism is None else f' made by {mechanism.name}'
  if not distinct:
    raise ValueError(f'the optimizer state holds no noise state{made_by}')
  if len(distinct) > 1:
    raise ValueError(
        f'the optimizer state holds {len(distinct)} noise states{made_by} '
        'with different keys: pass the run\'s mechanism to pick one')
  return next(iter(distinct.values()))


# --------------------------------------------------------------- ledger


def _mechanism_fingerprint(mechanism: noise_lib.NoiseMechanism) -> str:
  """The mechanism's identity, which its noise states also carry."""
  if not mechanism.identity:
    raise ValueError(
        f'{mechanism.name} has no identity (a NoiseMechanism built by hand): '
        'a ledger records the mechanism its noise states were made by; use a '
        'mechanism of dpsco_jax.noise')
  return mechanism.identity


def _participation_to_json(participation: accounting.Participation) -> dict:
  return {'kind': type(participation).__name__,
          **dataclasses.asdict(participation)}


def _participation_from_json(value: Mapping[str, Any]
                             ) -> accounting.Participation:
  fields = dict(value)
  kind = fields.pop('kind')
  if kind not in _PARTICIPATIONS:
    raise CheckpointMismatchError(f'unknown participation pattern {kind!r}')
  return _PARTICIPATIONS[kind](**fields)


def _prefix_epsilon(mechanism: noise_lib.NoiseMechanism,
                    noise_multiplier: float,
                    participation: accounting.Participation, delta: float,
                    steps: int, method: str,
                    relation: neighboring.NeighboringRelation) -> float:
  """Epsilon of the first `steps` steps of a run (`accounting.epsilon_spent`).

  Poisson sampling: the same i.i.d. Gaussian mechanism composed `steps`
  times. Otherwise the first `steps` releases are a linear decoding of the
  encoder rows they use (`decoder_matrix()[:steps] != 0`; every row when the
  mechanism has no decoder) applied to the first `steps` steps' statistics,
  so the encoder is cut to those rows and to its first `steps` columns, the
  later columns set to zero: no later step adds sensitivity. The result
  never exceeds the whole run's epsilon.
  """
  if isinstance(participation, accounting.PoissonSampling):
    return accounting.epsilon_spent(
        noise_lib.gaussian(steps), noise_multiplier,
        accounting.PoissonSampling(participation.sampling_probability, steps),
        delta, method=method, neighboring_relation=relation)
  total = participation.num_steps
  if mechanism.num_steps is None:
    encoder, rows = np.eye(total), np.arange(total) < steps
  else:
    encoder = np.asarray(mechanism.encoder_matrix(), np.float64)
    rows = np.ones(encoder.shape[0], bool)
    if mechanism.decoder_matrix is not None:
      rows = np.any(np.asarray(mechanism.decoder_matrix())[:steps] != 0,
                    axis=0)
  prefix = np.zeros((int(rows.sum()), total))
  prefix[:, :steps] = encoder[rows, :steps]
  truncated = noise_lib.NoiseMechanism(
      init=mechanism.init, next=mechanism.next,
      encoder_matrix=lambda: prefix, num_steps=total,
      release=mechanism.release,
      name=f'{mechanism.name}, first {steps} steps')
  return accounting.epsilon_spent(truncated, noise_multiplier, participation,
                                  delta, method=method,
                                  neighboring_relation=relation)


# Fields that define a run: a resume must agree on all of them.
_RUN_FIELDS = ('mechanism', 'mechanism_fingerprint', 'release',
               'noise_multiplier', 'participation', 'num_steps', 'delta',
               'target_epsilon', 'method', 'neighboring_relation',
               'key_fingerprint')


@dataclasses.dataclass(frozen=True)
class PrivacyLedger:
  """What a private run was calibrated for, and how much of it is spent.

  Build it with `PrivacyLedger.create` at the start of a run; `save` records
  it in every checkpoint with `steps_consumed` set to the checkpoint's step,
  and `restore` gives it back (refusing a run configured differently).

  Example:
    >>> mech = dpsco_jax.dpftrl_mechanism(60, restart_every=6)
    >>> ledger = PrivacyLedger.create(mech, 10.9, FixedOrder(10, 6), 1e-5,
    ...                               key=0, target_epsilon=2.0)
    >>> ledger.advance_to(30).epsilon_spent(mech)   # after 30 of 60 steps

  Attributes:
    mechanism: the noise mechanism's name.
    mechanism_fingerprint: the mechanism's identity
      (`noise.NoiseMechanism.identity`: its kind and every parameter that
      determines the noise), which its noise states carry too.
    release: 'per_step' or 'prefix'.
    noise_multiplier: noise std over one step's sensitivity.
    participation: how batches are formed (`accounting.Participation`).
    num_steps: steps the noise and accounting were made for.
    delta: the run's delta.
    method: the accounting method ('pld', 'rdp', 'zcdp', 'gdp_paper').
    neighboring_relation: the relation's value, e.g. 'add_or_remove'.
    key_fingerprint: `key_fingerprint` of the noise key (never exported);
      None until the run's optimizer state supplies it (`with_key_of`).
    planned_epsilon: epsilon of the whole planned run.
    target_epsilon: the epsilon the noise was calibrated to, if any.
    steps_consumed: steps run so far.
  """

  mechanism: str
  mechanism_fingerprint: str
  release: str
  noise_multiplier: float
  participation: accounting.Participation
  num_steps: int
  delta: float
  method: str
  neighboring_relation: str
  key_fingerprint: Optional[str]
  planned_epsilon: float
  target_epsilon: Optional[float] = None
  steps_consumed: int = 0

  @classmethod
  def create(
      cls,
      mechanism: noise_lib.NoiseMechanism,
      noise_multiplier: float,
      participation: accounting.Participation,
      delta: float,
      *,
      key: estimators.KeyLike = None,
      target_epsilon: Optional[float] = None,
      method: str = 'pld',
      neighboring_relation: neighboring.NeighboringRelation = (
          neighboring.NeighboringRelation.ADD_OR_REMOVE),
  ) -> 'PrivacyLedger':
    """The ledger of a run that has not started (`steps_consumed = 0`).

    Example:
      >>> ledger = PrivacyLedger.create(
      ...     dpsco_jax.dpsgd_mechanism(112), 2.13, PoissonSampling(0.09, 112),
      ...     1e-5, key=jax.random.key(7), target_epsilon=2.0)

    Args:
      mechanism: the noise mechanism the transformation builds (e.g.
        `dpftrl_mechanism(...)`), as passed to accounting.
      noise_multiplier: the noise multiplier given to the transformation.
      participation: the sampler's participation pattern.
      delta: the run's delta.
      key: the noise key (or int seed) given to the transformation; None
        when the transformation drew a fresh key itself (`key=None`): the
        ledger then takes the key of the run's optimizer state at the first
        `save` / `restore_or_init`, and on a resume the checkpoint's
        (`with_key_of`).
      target_epsilon: the epsilon the noise was calibrated to, if any.
      method: accounting method (`accounting.METHODS`).
      neighboring_relation: the relation the noise was calibrated for.

    Returns:
      A `PrivacyLedger` with its `planned_epsilon` computed by
      `accounting.epsilon_spent` for the whole run.

    Raises:
      ValueError: if the mechanism, participation and delta do not make an
        accountable run, or the planned epsilon exceeds `target_epsilon`.
    """
    relation = neighboring.NeighboringRelation(neighboring_relation)
    planned = accounting.epsilon_spent(
        mechanism, noise_multiplier, participation, delta, method=method,
        neighboring_relation=relation)
    if target_epsilon is not None:
      accounting.validate_epsilon_delta(target_epsilon, delta)
      if planned > float(target_epsilon) * (1.0 + 1e-9):
        raise ValueError(
            f'the run spends epsilon {planned:.6g} (method {method!r}), more '
            f'than its target {target_epsilon}: calibrate the noise '
            'multiplier with the same mechanism, participation and method')
    return cls(
        mechanism=mechanism.name,
        mechanism_fingerprint=_mechanism_fingerprint(mechanism),
        release=mechanism.release,
        noise_multiplier=float(noise_multiplier),
        participation=participation,
        num_steps=int(participation.num_steps),
        delta=float(delta), method=method,
        neighboring_relation=relation.value,
        key_fingerprint=None if key is None else key_fingerprint(key),
        planned_epsilon=float(planned),
        target_epsilon=(None if target_epsilon is None else
                        float(target_epsilon)))

  def advance_to(self, step: int) -> 'PrivacyLedger':
    """This ledger with `steps_consumed = step` (steps are never given back).

    Example:
      >>> ledger = ledger.advance_to(ledger.steps_consumed + 1)

    Args:
      step: steps run so far, in `[steps_consumed, num_steps]`.

    Returns:
      The updated ledger.

    Raises:
      ValueError: if `step` is below the steps already consumed (they were
        spent) or beyond the steps the noise was calibrated for.
    """
    step = _non_negative_int(step, 'step')
    if step < self.steps_consumed:
      raise ValueError(
          f'the ledger already records {self.steps_consumed} steps spent; '
          f'going back to step {step} would forget spent privacy')
    if step > self.num_steps:
      raise ValueError(
          f'step {step} is past the {self.num_steps} steps the noise was '
          'calibrated for')
    return dataclasses.replace(self, steps_consumed=step)

  def with_key_of(self, opt_state: PyTree) -> 'PrivacyLedger':
    """This ledger with the key of the run's noise state, if it had none.

    Example:
      >>> ledger = PrivacyLedger.create(mech, z, participation, delta)
      >>> ledger = ledger.with_key_of(tx.init(params))   # fresh key

    Args:
      opt_state: the run's optimizer state; its noise state made by the
        ledger's mechanism holds the key.

    Returns:
      The ledger, with `key_fingerprint` set.

    Raises:
      CheckpointMismatchError: if the state holds no noise state of the
        ledger's mechanism, or several with different keys.
    """
    if self.key_fingerprint is not None:
      return self
    rows = {row for state in _noise_states(opt_state,
                                           self.mechanism_fingerprint)
            for row in keys.fingerprint_rows(state.key)}
    if len(rows) != 1:
      raise CheckpointMismatchError(
          f'the ledger takes its key from the optimizer state, which holds '
          f'{len(rows)} noise keys of {self.mechanism}: build the ledger with '
          'key= the noise key of the run')
    return dataclasses.replace(self, key_fingerprint=rows.pop())

  def check_same_run(self, other: 'PrivacyLedger') -> None:
    """Raises unless `other` describes the same run (steps consumed aside).

    Example:
      >>> configured.check_same_run(ckpt.ledger)

    Args:
      other: another ledger, e.g. the one in a checkpoint.

    Raises:
      CheckpointMismatchError: listing every field that differs.
    """
    # A ledger without a key (the transformation drew a fresh one) resumes
    # with the checkpoint's key, which the restored state carries.
    differences = [
        f'{name}: {getattr(self, name)!r} here, {getattr(other, name)!r} in '
        'the checkpoint' for name in _RUN_FIELDS
        if getattr(self, name) != getattr(other, name) and not (
            name == 'key_fingerprint' and self.key_fingerprint is None)]
    if differences:
      raise CheckpointMismatchError(
          'the run is configured differently from the checkpoint it resumes '
          '(its privacy accounting would describe neither run); start a new '
          'run with a fresh key instead:\n  ' + '\n  '.join(differences))

  def epsilon_spent(
      self, mechanism: Optional[noise_lib.NoiseMechanism] = None) -> float:
    """The epsilon spent by the `steps_consumed` steps run so far, at `delta`.

    With `mechanism` (the run's own; checked against the fingerprint) the
    partial run is accounted exactly as far as `accounting.epsilon_spent`
    goes: Poisson sampling composes `steps_consumed` subsampled Gaussians,
    and a fixed or shuffled order accounts the encoder rows the first steps
    release, restricted to those steps. Without it (a mechanism's matrix is
    not stored in the ledger) a partial run reports the whole planned run's
    epsilon: an upper bound, since stopping early is post-processing of the
    full run.

    Example:
      >>> ledger.epsilon_spent(mechanism)

    Args:
      mechanism: the run's noise mechanism, for the exact partial account.

    Returns:
      epsilon: 0 before the first step, `planned_epsilon` after the last.

    Raises:
      CheckpointMismatchError: if `mechanism` is not the run's mechanism.
    """
    if mechanism is not None and (
        _mechanism_fingerprint(mechanism) != self.mechanism_fingerprint):
      raise CheckpointMismatchError(
          f'{mechanism.name} is not the mechanism this ledger accounts for '
          f'({self.mechanism})')
    if self.steps_consumed == 0:
      return 0.0
    if mechanism is None or self.steps_consumed == self.num_steps:
      return self.planned_epsilon
    return _prefix_epsilon(
        mechanism, self.noise_multiplier, self.participation, self.delta,
        self.steps_consumed, self.method,
        neighboring.NeighboringRelation(self.neighboring_relation))

  def to_json(self) -> dict:
    """The ledger as a JSON-compatible dict (inverse: `from_json`).

    Example:
      >>> PrivacyLedger.from_json(ledger.to_json()) == ledger
      True

    Returns:
      A dict of plain values.
    """
    value = dataclasses.asdict(self)
    value['participation'] = _participation_to_json(self.participation)
    return value

  @classmethod
  def from_json(cls, value: Mapping[str, Any]) -> 'PrivacyLedger':
    """The ledger `to_json` wrote.

    Example:
      >>> PrivacyLedger.from_json(json.loads(text))

    Args:
      value: the dict.

    Returns:
      The `PrivacyLedger`.

    Raises:
      CheckpointMismatchError: if fields are missing or unknown.
    """
    fields = dict(value)
    try:
      fields['participation'] = _participation_from_json(
          fields['participation'])
      return cls(**fields)
    except (KeyError, TypeError) as error:
      raise CheckpointMismatchError(
          f'not a privacy ledger (fields {sorted(fields)}): {error}') from error

  def summary(self, mechanism: Optional[noise_lib.NoiseMechanism] = None
              ) -> dict:
    """The public part of the ledger and the epsilon spent, for a release.

    The key fingerprint is left out (a hash of a key made from a small seed
    would reveal the key, hence the noise).

    Example:
      >>> print(json.dumps(ledger.summary(mechanism), indent=2))

    Args:
      mechanism: as in `epsilon_spent`.

    Returns:
      A JSON-compatible dict, with `epsilon_spent` and whether it is
      `epsilon_exact` for the steps consumed or the planned run's bound.
    """
    value = self.to_json()
    del value['key_fingerprint']
    value['epsilon_spent'] = self.epsilon_spent(mechanism)
    value['epsilon_exact'] = (mechanism is not None or
                              self.steps_consumed in (0, self.num_steps))
    return value


# ---------------------------------------------------------------- pytrees


def _non_negative_int(value: Any, name: str) -> int:
  try:
    integral = not isinstance(value, bool) and int(value) == value
  except (TypeError, ValueError):
    integral = False
  if not integral or value < 0:
    raise ValueError(f'{name} must be a non-negative integer, got {value!r}')
  return int(value)


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


def _noise_states(tree: PyTree, identity: Optional[str] = None
                  ) -> list[noise_lib.NoiseState]:
  """The noise states in `tree` (made by the mechanism `identity`, if given)."""
  is_state = lambda x: isinstance(x, noise_lib.NoiseState)
  states = [leaf for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_state)
            if is_state(leaf)]
  if identity is None:
    return states
  words = noise_lib.identity_words(identity)
  return [state for state in states if state.mechanism_id is not None
          and np.all(np.asarray(state.mechanism_id) == words)]


def _check_noise_state(opt_state: PyTree, ledger: PrivacyLedger,
                       step: int) -> None:
  """The ledger's noise key and mechanism are in `opt_state`, at step `step`.

  Optimizer states without a `NoiseState` (custom ones) are not checked.
  """
  states = _noise_states(opt_state)
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
  for restored, like in zip(_noise_states(saved), _noise_states(template)):
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
