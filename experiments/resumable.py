"""A private training run that survives being killed: checkpoint and resume.

Logistic regression on scikit-learn's digits (the quickstart's model) with
DP-MEMF (matrix-factorization noise with its buffer of past noise), DP-FTRL
(tree noise) or DP-SGD (Poisson sampling), followed by SGD with momentum. A
checkpoint (`dpsco_jax.checkpoint`) is written every `--checkpoint_every`
steps; run the same command again after an interruption (even SIGKILL) and
it resumes from the last checkpoint, with the same batches and the same
noise, to the same final params bit for bit:

    python -m experiments.resumable --algorithm=dpmemf \
        --checkpoint=results/resumable/checkpoint \
        --release=results/resumable/release

The checkpoint is a directory (orbax-checkpoint arrays and a JSON manifest
with the privacy ledger, replaced atomically at each save) holding
non-private state (noise key and buffers, batch fingerprints, the sampler
seed): keep it private. The release directory
(`checkpoint.export_release`) holds only the final params and the privacy
ledger with the epsilon spent, and is the one to publish.
"""

import dataclasses
import time
from typing import Callable, NamedTuple, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np
import optax

from dpsco_jax import accounting
from dpsco_jax import checkpoint
from dpsco_jax import plans
from experiments import datasets
from experiments import models
from experiments import quickstart
from experiments import spine

ALGORITHMS = ('dpmemf', 'dpftrl', 'dpsgd')


def define_flags() -> None:
  """Defines the command-line flags.

  Called only when the module runs as a program, so that importing it (e.g.
  in tests) defines no flags.

  Example:
    >>> define_flags(); flags.FLAGS(['resumable', '--checkpoint=run/ckpt'])
  """
  flags.DEFINE_enum('algorithm', 'dpmemf', ALGORITHMS, 'The private algorithm.')
  flags.DEFINE_string(
      'checkpoint', None, 'Checkpoint directory (NON-PRIVATE: keep it '
      'private); resumed from when it holds a checkpoint.')
  flags.DEFINE_string(
      'release', None, 'Directory to export the final params and privacy '
      'ledger to (safe to publish).')
  flags.DEFINE_integer(
      'checkpoint_every', 4, 'Save a checkpoint every this many steps (and at '
      'the last step).')
  flags.DEFINE_integer('num_epochs', 4, 'Passes over the data.')
  flags.DEFINE_integer('batch_size', 239,
                       'Fixed-order batch size (DP-MEMF, DP-FTRL).')
  flags.DEFINE_integer('expected_batch_size', 128,
                       'Expected Poisson batch size (DP-SGD).')
  flags.DEFINE_float('learning_rate', 0.5, 'SGD step size.')
  flags.DEFINE_float('momentum', 0.9, 'SGD momentum.')
  flags.DEFINE_float('clip', 1.0, 'Per-example l2 clip norm.')
  flags.DEFINE_integer('seed', 0, 'Seeds batch order, sampling and noise key.')
  flags.DEFINE_float('epsilon', 2.0, 'Target epsilon.')
  flags.DEFINE_float('delta', 1e-5, 'Target delta.')
  flags.DEFINE_float(
      'noise_multiplier', None, 'Use this noise multiplier instead of '
      'calibrating one to --epsilon (the ledger then has no target).')
  flags.DEFINE_enum('accounting_method', 'pld', accounting.METHODS,
                    'Accounting method.')


@dataclasses.dataclass(frozen=True)
class Settings:
  """A run's configuration (the flags above, with the same defaults).

  Attributes:
    algorithm: 'dpmemf', 'dpftrl' or 'dpsgd'.
    checkpoint_every: steps between checkpoints.
    num_epochs: passes over the data (expected passes for DP-SGD).
    batch_size: fixed-order batch size.
    expected_batch_size: expected Poisson batch size.
    learning_rate: SGD step size.
    momentum: SGD momentum.
    clip: per-example clip norm.
    seed: seeds the batch order, the sampling and the noise key.
    epsilon: target epsilon (used when `noise_multiplier` is None).
    delta: delta.
    noise_multiplier: fixed noise multiplier, or None to calibrate.
    method: accounting method.
  """

  algorithm: str = 'dpmemf'
  checkpoint_every: int = 4
  num_epochs: int = 4
  batch_size: int = 239
  expected_batch_size: int = 128
  learning_rate: float = 0.5
  momentum: float = 0.9
  clip: float = 1.0
  seed: int = 0
  epsilon: float = 2.0
  delta: float = 1e-5
  noise_multiplier: Optional[float] = None
  method: str = 'pld'

  @classmethod
  def from_flags(cls) -> 'Settings':
    """The settings given on the command line (`define_flags`).

    Example:
      >>> settings = Settings.from_flags()   # inside absl's app.run

    Returns:
      The `Settings`.
    """
    f = flags.FLAGS
    return cls(algorithm=f.algorithm, checkpoint_every=f.checkpoint_every,
               num_epochs=f.num_epochs, batch_size=f.batch_size,
               expected_batch_size=f.expected_batch_size,
               learning_rate=f.learning_rate, momentum=f.momentum,
               clip=f.clip, seed=f.seed, epsilon=f.epsilon, delta=f.delta,
               noise_multiplier=f.noise_multiplier,
               method=f.accounting_method)


class Run(NamedTuple):
  """Everything a run needs, rebuilt identically on every (re)start.

  Attributes:
    plan: the run's plan (transformation, sampler, mechanism, ledger); the
      loop that steps it is `spine.run_plan`'s.
  """

  plan: plans.Plan

  @property
  def tx(self) -> optax.GradientTransformation:
    return self.plan.transformation


class Result(NamedTuple):
  """What `train` did.

  Attributes:
    params: the params at the last step run.
    ledger: the ledger at the last step run.
    start_step: the step it started (resumed) at.
    step: the last step run.
  """

  params: dict
  ledger: checkpoint.PrivacyLedger
  start_step: int
  step: int


def init_params() -> dict:
  """Zero-initialized logistic regression on the 64 digit pixels."""
  return models.linear_init(64, 10)


def build(settings: Settings, num_examples: int) -> Run:
  """The plan of a run.

  Everything is a function of `settings` (seeds included), so a resumed
  process rebuilds the same run (the checkpoint refuses a different one).

  Example:
    >>> run = build(Settings(algorithm='dpftrl'), num_examples=1437)
    >>> run.plan.ledger.planned_epsilon

  Args:
    settings: the configuration.
    num_examples: training set size.

  Returns:
    The `Run`.

  Raises:
    ValueError: for an unknown algorithm.
  """
  if settings.algorithm not in ALGORITHMS:
    raise ValueError(f'algorithm must be one of {ALGORITHMS}, got '
                     f'{settings.algorithm!r}')
  seed = lambda purpose: quickstart.seed_for(
      settings.seed, f'{settings.algorithm}/{purpose}')
  target = {'epsilon': settings.epsilon}
  if settings.noise_multiplier is not None:
    target = {'noise_multiplier': settings.noise_multiplier}
  common = dict(
      optimizer=optax.sgd(settings.learning_rate, momentum=settings.momentum),
      num_examples=num_examples, epochs=settings.num_epochs,
      l2_clip=settings.clip, delta=settings.delta, method=settings.method,
      seed=seed('batches'), key=jax.random.key(seed('noise')), **target)
  loss_fn = models.linear_example_loss
  if settings.algorithm == 'dpsgd':
    plan = plans.dpsgd(loss_fn, batch_size=settings.expected_batch_size,
                       **common)
  elif settings.algorithm == 'dpftrl':
    plan = plans.dpftrl(loss_fn, batch_size=settings.batch_size,
                        restart='epoch', **common)
  else:
    plan = plans.dpmemf(loss_fn, batch_size=settings.batch_size,
                        momentum=settings.momentum, **common)
  return Run(plan)


def train(settings: Settings, checkpoint_path: str,
          release_path: Optional[str] = None, *,
          on_step: Optional[Callable[[int], None]] = None,
          stop_after: Optional[int] = None) -> Result:
  """Trains from the checkpoint at `checkpoint_path` (or from scratch).

  Example:
    >>> train(Settings(algorithm='dpftrl'), 'run/checkpoint', 'run/release')

  Args:
    settings: the configuration (the same on every restart).
    checkpoint_path: the checkpoint directory, written every
      `settings.checkpoint_every` steps and at the last step.
    release_path: the directory to export the final params and ledger
      to, or None.
    on_step: called with each completed step number (after any checkpoint).
    stop_after: return after this step, as an interrupted run would (no
      release is written).

  Returns:
    The `Result`.

  Raises:
    checkpoint.CheckpointMismatchError: if the checkpoint belongs to a
      differently configured run.
  """
  train_data, test_data = datasets.load_digits()
  run = build(settings, len(train_data['y']))
  accuracy = lambda params: {'test_accuracy': float(np.mean(np.argmax(
      models.linear_logits(params, test_data['x']), -1) == test_data['y']))}
  result = spine.run_plan(
      settings.algorithm, run.plan, init_params(), train_data,
      evaluate=accuracy, eval_every=run.plan.num_steps,
      checkpoint_dir=checkpoint_path,
      checkpoint_every=settings.checkpoint_every, on_step=on_step,
      stop_after=stop_after)
  done = Result(result.params, result.ledger, result.first_step,
                result.last_step)
  if result.last_step < run.plan.num_steps:
    return done
  final_accuracy = result.rows[-1]['test_accuracy']
  logging.info('%s: done, test accuracy %.4f, epsilon spent %.4f at delta %g',
               settings.algorithm, final_accuracy,
               result.ledger.epsilon_spent(run.plan.mechanism),
               result.ledger.delta)
  if release_path is not None:
    checkpoint.export_release(release_path, result.params, result.ledger,
                              mechanism=run.plan.mechanism,
                              metadata={'test_accuracy': final_accuracy})
  return done


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  start = time.perf_counter()
  train(Settings.from_flags(), flags.FLAGS.checkpoint, flags.FLAGS.release)
  logging.info('wall time %.1f s', time.perf_counter() - start)


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['checkpoint'])
  app.run(main)
