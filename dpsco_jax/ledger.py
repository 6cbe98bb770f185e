"""The privacy ledger: what a run was calibrated for, and what it has spent.

A `PrivacyLedger` is the run's privacy record: the noise mechanism's
identity, the noise multiplier, how batches are formed (the participation
pattern), delta, the accounting method, a fingerprint of the noise key and
the steps taken. The training loop asks it for the epsilon spent so far at
any step (`epsilon_at`), checks that the optimizer state it steps was made
by the mechanism the ledger accounts for (`check_state`), and a checkpoint
stores it beside the state (`dpsco_jax.checkpoint`), refusing a resume
that is configured differently.

    ledger = PrivacyLedger.create(mechanism, noise_multiplier,
                                  batches.participation, delta)
    ledger = ledger.with_key_of(opt_state)
    ledger.check_state(opt_state)          # the state's noise is accounted
    ...
    ledger = ledger.advance_to(step)
    print(ledger.epsilon_spent(mechanism))  # epsilon so far

A plan (`dpsco_jax.plans`) builds the ledger from the same description as
the transformation and the batches, so the three cannot disagree.
"""

import dataclasses
from typing import Any, Mapping, Optional

import jax
import numpy as np

from dpsco_jax import accounting
from dpsco_jax import estimators
from dpsco_jax import guards
from dpsco_jax import keys
from dpsco_jax import neighboring
from dpsco_jax import noise as noise_lib

PyTree = Any

_PARTICIPATIONS = {cls.__name__: cls for cls in (
    accounting.FixedOrder, accounting.Shuffled, accounting.PoissonSampling,
    accounting.CyclicPoissonSampling)}


class LedgerMismatchError(ValueError):
  """A ledger, checkpoint or state does not fit the run given for it."""


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
    raise LedgerMismatchError(f'unknown participation pattern {kind!r}')
  return _PARTICIPATIONS[kind](**fields)


def _prefix_epsilon(mechanism: noise_lib.NoiseMechanism,
                    noise_multiplier: float,
                    participation: accounting.Participation, delta: float,
                    steps: int, method: str,
                    relation: neighboring.NeighboringRelation,
                    releases=()) -> float:
  """Epsilon of the first `steps` steps of a run (`accounting.epsilon_spent`).

  Poisson sampling: the same i.i.d. Gaussian mechanism composed `steps`
  times. Otherwise the first `steps` releases are a linear decoding of the
  encoder rows they use (`decoder_matrix()[:steps] != 0`; every row when the
  mechanism has no decoder) applied to the first `steps` steps' statistics,
  so the encoder is cut to those rows and to its first `steps` columns, the
  later columns set to zero: no later step adds sensitivity. The result
  never exceeds the whole run's epsilon. A mechanism that knows its own cut
  (`NoiseMechanism.truncated`, e.g. a BLT's in O(T d)) gives it without the
  T x T matrices.
  """
  if isinstance(participation, accounting.PoissonSampling):
    return accounting.epsilon_spent(
        noise_lib.gaussian(steps), noise_multiplier,
        accounting.PoissonSampling(participation.sampling_probability, steps),
        delta, method=method, neighboring_relation=relation,
        releases=releases)
  if mechanism.truncated is not None:
    return accounting.epsilon_spent(mechanism.truncated(steps),
                                    noise_multiplier, participation, delta,
                                    method=method,
                                    neighboring_relation=relation,
                                    releases=releases)
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
                                  neighboring_relation=relation,
                                  releases=releases)


# Fields that define a run: a resume must agree on all of them.
_RUN_FIELDS = ('mechanism', 'mechanism_fingerprint', 'release',
               'noise_multiplier', 'participation', 'num_steps', 'delta',
               'target_epsilon', 'method', 'neighboring_relation',
               'key_fingerprint', 'releases')


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
    releases: `accounting.GaussianRelease`s of the same data besides the
      steps (private preprocessing): spent before step 0, composed with
      every step in the epsilons reported.
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
  releases: tuple = ()

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
      releases=(),
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
      releases: `accounting.GaussianRelease`s of the same data besides the
        steps (e.g. `preprocessing.dp_standardization(...).release`).

    Returns:
      A `PrivacyLedger` with its `planned_epsilon` computed by
      `accounting.epsilon_spent` for the whole run, releases included.

    Raises:
      ValueError: if the mechanism, participation and delta do not make an
        accountable run, or the planned epsilon exceeds `target_epsilon`.
    """
    relation = neighboring.NeighboringRelation(neighboring_relation)
    releases = tuple(releases or ())
    planned = accounting.epsilon_spent(
        mechanism, noise_multiplier, participation, delta, method=method,
        neighboring_relation=relation, releases=releases)
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
                        float(target_epsilon)),
        releases=releases)

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
      LedgerMismatchError: if the state holds no noise state of the
        ledger's mechanism, or several with different keys.
    """
    if self.key_fingerprint is not None:
      return self
    rows = {row for state in _noise_states(opt_state,
                                           self.mechanism_fingerprint)
            for row in keys.fingerprint_rows(state.key)}
    if len(rows) != 1:
      raise LedgerMismatchError(
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
      LedgerMismatchError: listing every field that differs.
    """
    # A ledger without a key (the transformation drew a fresh one) resumes
    # with the checkpoint's key, which the restored state carries.
    differences = [
        f'{name}: {getattr(self, name)!r} here, {getattr(other, name)!r} in '
        'the checkpoint' for name in _RUN_FIELDS
        if getattr(self, name) != getattr(other, name) and not (
            name == 'key_fingerprint' and self.key_fingerprint is None)]
    if differences:
      raise LedgerMismatchError(
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
      The epsilon spent; the releases' alone before the first step (0
      without releases), `planned_epsilon` after the last.

    Raises:
      LedgerMismatchError: if `mechanism` is not the run's mechanism.
    """
    if mechanism is not None and (
        _mechanism_fingerprint(mechanism) != self.mechanism_fingerprint):
      raise LedgerMismatchError(
          f'{mechanism.name} is not the mechanism this ledger accounts for '
          f'({self.mechanism})')
    if self.steps_consumed == 0:
      return accounting.releases_epsilon(self.releases, self.delta,
                                         method=self.method)
    if mechanism is None or self.steps_consumed == self.num_steps:
      return self.planned_epsilon
    return _prefix_epsilon(
        mechanism, self.noise_multiplier, self.participation, self.delta,
        self.steps_consumed, self.method,
        neighboring.NeighboringRelation(self.neighboring_relation),
        self.releases)

  def epsilon_at(self, step: int,
                 mechanism: Optional[noise_lib.NoiseMechanism] = None
                 ) -> float:
    """The epsilon of the run's first `step` steps, at the ledger's delta.

    What a training loop reports as "epsilon so far" (the ledger itself is
    left as it is; `advance_to` records steps spent). Exact with
    `mechanism`; without it, a partial run reports the planned run's
    epsilon (see `epsilon_spent`).

    Example:
      >>> [ledger.epsilon_at(t, mechanism) for t in (10, 20, 30)]

    Args:
      step: in `[0, num_steps]`.
      mechanism: the run's noise mechanism (checked against the ledger's).

    Returns:
      epsilon, non-decreasing in `step`.

    Raises:
      ValueError: if `step` is out of range.
      LedgerMismatchError: if `mechanism` is not the run's mechanism.
    """
    step = _non_negative_int(step, 'step')
    if step > self.num_steps:
      raise ValueError(f'step {step} is past the {self.num_steps} steps the '
                       'noise was calibrated for')
    return dataclasses.replace(self, steps_consumed=step).epsilon_spent(
        mechanism)

  def check_state(self, opt_state: PyTree) -> None:
    """Raises unless every noise state in `opt_state` is the ledger's.

    A transformation built by hand can disagree with the accounting it is
    reported under (built without the `restart_every` it was calibrated
    with, or for more steps): its noise state then carries another
    mechanism identity, and this refuses it before a step is taken.

    Example:
      >>> ledger = PrivacyLedger.create(dpftrl_mechanism(100, 17), z, ...)
      >>> ledger.check_state(tx.init(params))   # tx built with 17 too

    Args:
      opt_state: the run's optimizer state (e.g. `tx.init(params)`).

    Raises:
      LedgerMismatchError: if the state holds no noise state, or one made
        by another mechanism (the message names both).
      PrivacyGuardError: if a step of the run was refused (its record in
        the state, `guards.raise_if_refused`).
    """
    guards.raise_if_refused(opt_state)
    states = _noise_states(opt_state)
    if not states:
      raise LedgerMismatchError(
          'the optimizer state holds no dpsco_jax noise state: it is not the '
          'state of a private transformation of this library, and the ledger '
          'cannot vouch for it')
    expected = noise_lib.identity_words(self.mechanism_fingerprint)
    for state in states:
      words = state.mechanism_id
      if words is None or np.any(np.asarray(words) != expected):
        found = ('none' if words is None else np.asarray(words).reshape(
            -1, 4)[0].astype('>u4').tobytes().hex())
        raise LedgerMismatchError(
            f'the optimizer state\'s noise was made by another mechanism '
            f'(identity {found}) than the one this ledger accounts for '
            f'({self.mechanism}, identity {self.mechanism_fingerprint}): the '
            'run would spend a different epsilon than reported. Build the '
            'transformation with the same mechanism parameters (num_steps, '
            'restart_every, ...) as the calibration, or use dpsco_jax.plans')

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
    value['releases'] = [dataclasses.asdict(r) for r in self.releases]
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
      LedgerMismatchError: if fields are missing or unknown.
    """
    fields = dict(value)
    try:
      fields['participation'] = _participation_from_json(
          fields['participation'])
      # Ledgers written before releases existed had none.
      fields['releases'] = tuple(accounting.GaussianRelease(**r)
                                 for r in fields.get('releases', ()))
      return cls(**fields)
    except (KeyError, TypeError) as error:
      raise LedgerMismatchError(
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


# ---------------------------------------------------------------- helpers


def _non_negative_int(value: Any, name: str) -> int:
  try:
    integral = not isinstance(value, bool) and int(value) == value
  except (TypeError, ValueError):
    integral = False
  if not integral or value < 0:
    raise ValueError(f'{name} must be a non-negative integer, got {value!r}')
  return int(value)


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


