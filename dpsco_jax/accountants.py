"""Accountants: a plan's noise calibration, epsilon, event and ledger in one.

A plan enters accounting once, through its accountant, which answers every
privacy question of the run from the same calibrated values:

* `noise_multiplier`: calibrated to the target (or given);
* `epsilon` and `epsilon_at(step)`: spent by the run and by its prefixes;
* `event`: the run's `dp_accounting` event;
* `ledger`: the `ledger.PrivacyLedger` checkpoints store, or None;
* `check_state(opt_state)`: the state is the accounted mechanism's.

Two implementations serve the families:

* `GaussianAccountant`: one noise mechanism under a participation pattern
  (DP-SGD, DP-FTRL, MF, SRG, user-level, single-pass O2NC), calibrated by
  `accounting.calibrate_noise_multiplier` (cached on disk), with a ledger;
* `Diff2Accountant`: two Gaussian multipliers, one for restart rounds and
  one for difference rounds (DIFF2, DP-GD, multi-pass O2NC), accounted by
  `algorithms.diff2_accounting`; its two multipliers are not one
  mechanism's, so it keeps no ledger.

Either may account for less delta than the run's (`accounting_delta`): the
nonsmooth plans spend the rest on the event that a clip binds
(`clip_event_budget`).

    accountant = GaussianAccountant.create(
        mechanism, sampler.participation, target, relation)
    accountant.epsilon_at(100)
"""

import abc
import dataclasses
import json
import math
from typing import Any, Optional, Sequence

import dp_accounting

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax import ledger as ledger_lib
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax import plan_config
from dpsco_jax import progress
from dpsco_jax import strategies
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms import diff2_accounting

PyTree = Any
Relation = neighboring.NeighboringRelation


_TARGET_EPSILON_DOC = 'The epsilon asked for, or None when the noise was given.'
_DELTA_DOC = "The run's delta."


def _target_epsilon(accountant: 'Accountant') -> Optional[float]:
  return accountant.target.target_epsilon


def _delta(accountant: 'Accountant') -> float:
  return float(accountant.target.delta)


class Accountant(abc.ABC):
  """What a plan asks of its accounting (see the module docstring).

  Attributes:
    noise_multiplier: the calibrated (or given) noise.
    participation: how the batches are formed, or None (full-batch rounds).
    event: the `dp_accounting` event of the whole run.
    ledger: the run's `PrivacyLedger`, or None.
    epsilon: spent by the whole run.
    target_epsilon: the epsilon asked for, or None when the noise was given.
    delta: the run's delta.
    method: the accounting method.
    num_steps: the steps (rounds) accounted for.
    target: the `plan_config.PrivacyTarget` the run was built for.
  """

  target: plan_config.PrivacyTarget
  noise_multiplier: Any
  participation: Optional[accounting.Participation]
  event: dp_accounting.DpEvent
  ledger: Optional[ledger_lib.PrivacyLedger]
  epsilon: float
  target_epsilon: Optional[float]
  delta: float
  method: str
  num_steps: int

  @abc.abstractmethod
  def epsilon_at(self, step: int) -> float:
    """The epsilon spent by the first `step` steps (earlier releases included).

    Example:
      >>> accountant.epsilon_at(100)

    Args:
      step: in `[0, num_steps]`.

    Returns:
      epsilon; `epsilon` at `num_steps`.

    Raises:
      ValueError: for a step past `num_steps`.
    """

  @property
  def releases(self) -> tuple[accounting.GaussianRelease, ...]:
    """The earlier releases of the same data the run spends too."""
    return self.target.releases

  def noise_record(self) -> Any:
    """The noise multiplier as JSON values (for `Plan.describe`).

    Example:
      >>> json.dumps(accountant.noise_record())

    Returns:
      A float.
    """
    return float(self.noise_multiplier)

  def check_state(self, opt_state: PyTree) -> None:
    """Refuses an optimizer state of another mechanism (with a ledger).

    Example:
      >>> accountant.check_state(opt_state)

    Args:
      opt_state: the state of a run of the plan.
    """
    if self.ledger is not None:
      self.ledger.check_state(opt_state)


@dataclasses.dataclass(frozen=True)
class GaussianAccountant(Accountant):
  """One noise mechanism under a participation pattern, with a ledger.

  Example:
    >>> accountant = GaussianAccountant.create(
    ...     dpsco_jax.dpsgd_mechanism(12), PoissonSampling(1 / 6, 12),
    ...     PrivacyTarget(delta=1e-5, epsilon=2.0), Relation.ADD_OR_REMOVE)

  Attributes:
    mechanism: the noise mechanism the private transformation draws from.
    ledger: the run's `PrivacyLedger` (its delta is the accounted one).
    target: the privacy target.
    event: the run's `dp_accounting` event.
  """

  mechanism: noise.NoiseMechanism = dataclasses.field(repr=False)
  ledger: ledger_lib.PrivacyLedger = dataclasses.field(repr=False)
  target: plan_config.PrivacyTarget
  event: dp_accounting.DpEvent = dataclasses.field(repr=False)

  @classmethod
  def create(cls, mechanism: noise.NoiseMechanism,
             participation: accounting.Participation,
             target: plan_config.PrivacyTarget, relation: Relation, *,
             accounting_delta: Optional[float] = None
             ) -> 'GaussianAccountant':
    """Calibrates (or takes) the noise and accounts for the run once.

    Example:
      >>> GaussianAccountant.create(mechanism, participation, target,
      ...                           Relation.ZERO_OUT)

    Args:
      mechanism: the noise mechanism, built once by the family.
      participation: the sampler's participation pattern.
      target: the privacy target.
      relation: the neighbouring relation the noise is calibrated for.
      accounting_delta: the delta the mechanism is accounted for (default:
        the target's).

    Returns:
      The accountant.

    Raises:
      AssertionError: if the mechanism and the participation disagree on the
        number of steps.
    """
    if mechanism.num_steps != participation.num_steps:
      raise AssertionError('the mechanism and the sampler disagree on the '
                           'number of steps')
    delta = target.delta if accounting_delta is None else accounting_delta
    multiplier = noise_multiplier(
        mechanism, participation, target.epsilon, delta,
        target.noise_multiplier, target.method, relation, target.releases)
    ledger = ledger_lib.PrivacyLedger.create(
        mechanism, multiplier, participation, delta, key=None,
        target_epsilon=target.epsilon, method=target.method,
        neighboring_relation=relation, releases=target.releases)
    return cls(mechanism=mechanism, ledger=ledger, target=target,
               event=accounting.dp_event(mechanism, multiplier, participation,
                                         target.releases))

  noise_multiplier = property(
      lambda self: self.ledger.noise_multiplier,
      doc='The calibrated (or given) noise multiplier (the ledger\'s).')
  participation = property(lambda self: self.ledger.participation,
                           doc='How the batches are formed.')
  epsilon = property(lambda self: self.ledger.planned_epsilon,
                     doc='Spent by the whole run (the ledger\'s plan).')
  target_epsilon = property(_target_epsilon, doc=_TARGET_EPSILON_DOC)
  delta = property(_delta, doc=_DELTA_DOC)
  method = property(lambda self: self.target.method,
                    doc='The accounting method.')
  num_steps = property(lambda self: self.ledger.num_steps,
                       doc='The steps accounted for.')

  def epsilon_at(self, step: int) -> float:
    # The ledger checks the step itself and spends the releases from step 0.
    return self.ledger.epsilon_at(step, self.mechanism)


@dataclasses.dataclass(frozen=True)
class Diff2Accountant(Accountant):
  """Gaussian restart rounds (z_1) and difference rounds (z_2), no ledger.

  Accounted by `algorithms.diff2_accounting`: one restart every `period`
  rounds, replace-one item-level privacy.

  Example:
    >>> accountant = Diff2Accountant.create(
    ...     20, 5, PrivacyTarget(delta=1e-5, epsilon=3.0))

  Attributes:
    num_steps: the rounds R.
    period: rounds per restart T.
    noise_multiplier: `Diff2NoiseMultipliers(restart, difference)`.
    target: the privacy target.
    accounting_delta: the delta the mechanism is accounted for.
    method: 'pld', 'rdp' or 'paper'.
    epsilon: spent by the whole run.
  """

  num_steps: int
  period: int
  noise_multiplier: diff2.Diff2NoiseMultipliers
  target: plan_config.PrivacyTarget
  accounting_delta: float
  method: str
  epsilon: float = dataclasses.field(init=False)
  ledger = None
  participation = None

  def __post_init__(self):
    object.__setattr__(self, 'epsilon', self._spent(self.num_steps))

  @classmethod
  def create(cls, num_steps: int, period: int,
             target: plan_config.PrivacyTarget, *,
             budget_split: Optional[float] = None,
             accounting_delta: Optional[float] = None) -> 'Diff2Accountant':
    """Calibrates the two multipliers (Proposition 4.1's split) or takes them.

    Example:
      >>> Diff2Accountant.create(2000, 20, target, budget_split=1.25)

    Args:
      num_steps: the rounds R.
      period: rounds per restart T.
      target: the privacy target (`noise_multiplier`: the pair).
      budget_split: u, the restart rounds' share 1/u of the budget
        (`diff2_accounting.calibrate`; None: its default).
      accounting_delta: the delta the mechanism is accounted for (default:
        the target's).

    Returns:
      The accountant.
    """
    delta = target.delta if accounting_delta is None else accounting_delta
    method = target.method or 'pld'
    if target.noise_multiplier is None:
      multipliers = diff2_accounting.calibrate(
          num_steps, period, target.epsilon, delta, method=method,
          budget_split=budget_split)
    else:
      multipliers = diff2.Diff2NoiseMultipliers(*target.noise_multiplier)
    return cls(num_steps=num_steps, period=period,
               noise_multiplier=multipliers, target=target,
               accounting_delta=delta, method=method)

  target_epsilon = property(_target_epsilon, doc=_TARGET_EPSILON_DOC)
  delta = property(_delta, doc=_DELTA_DOC)

  def noise_record(self) -> dict[str, float]:
    """The two multipliers by name, e.g. `{'restart': 2.0, 'difference': 3.0}`.

    Example:
      >>> accountant.noise_record()

    Returns:
      A dict of floats.
    """
    return {name: float(value)
            for name, value in self.noise_multiplier._asdict().items()}

  @property
  def event(self) -> dp_accounting.DpEvent:
    """The `dp_accounting` event of the R rounds."""
    return diff2_accounting.diff2_dp_event(self.num_steps, self.period,
                                           self.noise_multiplier)

  def epsilon_at(self, step: int) -> float:
    step = ledger_lib._non_negative_int(step, 'step')  # pylint: disable=protected-access
    if step > self.num_steps:
      raise ValueError(f'step {step} is past the {self.num_steps} steps of '
                       'the plan')
    return 0.0 if step == 0 else self._spent(step)

  def _spent(self, step: int) -> float:
    return diff2_accounting.epsilon_spent(
        step, self.period, self.noise_multiplier, self.accounting_delta,
        method=self.method)


def clip_event_budget(sensitivity: str, epsilon: float, delta: float
                      ) -> tuple[float, float]:
  """`(mechanism delta, failure probability)` of a nonsmooth run.

  Effective clips: half of delta goes to the mechanism, and the failure
  probability g is the largest with `(1 + e^epsilon) g <= delta / 2`: a
  mechanism that equals this (epsilon, delta/2)-DP run except with
  probability g on every data set is (epsilon, delta/2 + (1 + e^eps) g)-DP,
  so the paper's unclipped algorithm is covered too (docs/nonsmooth.md).
  Worst-case clips never bind for an L-Lipschitz loss: all of delta.

  Example:
    >>> clip_event_budget('effective', 2.0, 1e-6)

  Args:
    sensitivity: 'effective' or 'worst_case'.
    epsilon: the run's epsilon (the target, or what it spends).
    delta: the run's delta.

  Returns:
    `(mechanism_delta, failure_probability)`.

  References:
    Paper 004, §4 (the clipped estimates of Algorithms 3-5).
  """
  if sensitivity == 'worst_case':
    return delta, 0.0
  return delta / 2, (delta / 2) / (1.0 + math.exp(min(epsilon, 700.0)))


# ------------------------------------------------ the calibration cache


def noise_multiplier(mechanism: noise.NoiseMechanism,
                     participation: accounting.Participation,
                     epsilon: Optional[float], delta: float,
                     given: Optional[float], method: str, relation: Relation,
                     releases: Sequence[accounting.GaussianRelease] = ()
                     ) -> float:
  """The given noise multiplier, or the one calibrated to (epsilon, delta).

  A calibration is cached on disk (`strategies.cache_root()/calibrations`),
  keyed by everything it depends on; a cached value only saves time: the
  plan's ledger recomputes the epsilon it spends and refuses one that
  misses the target.

  Example:
    >>> noise_multiplier(mechanism, participation, 2.0, 1e-5, None, 'pld',
    ...                  Relation.ZERO_OUT)

  Args:
    mechanism: the noise mechanism.
    participation: the participation pattern.
    epsilon: the target (ignored when `given`).
    delta: the accounted delta.
    given: a given noise multiplier, or None to calibrate.
    method: the accounting method.
    relation: the neighbouring relation.
    releases: earlier releases of the same data.

  Returns:
    The noise multiplier.
  """
  if given is not None:
    return checks.noise_multiplier(given)
  path = calibration_path(mechanism, participation, epsilon, delta, method,
                          relation, releases)
  name = mechanism.name.split('(')[0]

  def calibrate() -> float:
    # PLD calibration of a long run takes seconds: say so on stderr.
    with progress.task(f'dpsco_jax: calibrating the {name} noise to epsilon '
                       f'{epsilon:g} ({method})'):
      return accounting.calibrate_noise_multiplier(
          mechanism, participation, epsilon, delta, method=method,
          neighboring_relation=relation, releases=releases)

  if path is None:
    return calibrate()
  return strategies.cached_calibration(path, calibrate)


# Bumped whenever calibration changes what it returns (2: matrix-factorization
# noise accounted with the float32 coefficients the device applies).
CALIBRATION_CACHE_VERSION = 2


def calibration_path(mechanism: noise.NoiseMechanism,
                     participation: accounting.Participation,
                     epsilon: float, delta: float, method: str,
                     relation: Relation,
                     releases: Sequence[accounting.GaussianRelease]
                     ) -> Optional[str]:
  """The cache file of a calibration, or None if it cannot be keyed.

  Example:
    >>> calibration_path(mechanism, participation, 2.0, 1e-5, 'pld',
    ...                  Relation.ZERO_OUT, ())

  Args:
    mechanism: the noise mechanism (None for a mechanism without identity).
    participation: the participation pattern.
    epsilon: the target.
    delta: the accounted delta.
    method: the accounting method.
    relation: the neighbouring relation.
    releases: earlier releases of the same data.

  Returns:
    A path under `strategies.cache_root()`, or None.
  """
  if not mechanism.identity:
    return None
  return strategies.calibration_file('noise', {
      'version': CALIBRATION_CACHE_VERSION,
      'dp_accounting': getattr(dp_accounting, '__version__', None),
      'mechanism': [mechanism.identity, mechanism.name, mechanism.num_steps],
      'participation': [type(participation).__name__,
                        dataclasses.asdict(participation)],
      'epsilon': float(epsilon), 'delta': float(delta), 'method': method,
      'relation': Relation(relation).value,
      'releases': [dataclasses.asdict(r) for r in releases],
  })
