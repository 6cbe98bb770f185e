"""Seeds x (learning rate, clip) sweep of private logistic regression on digits.

Every run trains the quickstart's model (multiclass logistic regression, zero
init, `optax.sgd(lr, momentum)`) on scikit-learn's digits with DP-MEMF
(default) or DP-SGD on batches in a fixed public order, repeated every epoch,
and is accounted as `accounting.FixedOrder(num_epochs, steps_per_epoch)`
(no amplification). A whole run is one `lax.scan` over its steps
(`dpsco_jax.runs.scan_steps`), so
`experiments.sweeps.run_sweep` runs all seeds and grid points as one vmapped
program per privacy target:

    python -m experiments.sweep_digits --config=configs/sweep_digits.py

Each seed draws, inside the program, its run's public batch order
(`jax.random.permutation`, independent of the data) and its noise key, so
the intervals cover both sources of run-to-run variation. The order is
fixed for the whole run: step t uses batch `t mod steps_per_epoch` of it,
which is what the `FixedOrder` accounting assumes, and what DP-MEMF's
order check verifies at every step from the example ids (a refused step
would poison the run's metrics with NaN).

The noise multiplier is calibrated once per epsilon on the host (it depends
on neither the clip nor the learning rate: the noise scales with the clip).
The non-private reference trains on the plain mean gradient of the same
batches, for each learning rate.

Writes to `--output_dir`: `summary.md` and `summary.csv` (mean test accuracy
over seeds with 95% Student-t intervals, per grid point), `runs.csv` (every
run's final metrics), `privacy_utility.csv`, `learning_curves.png` (mean
test accuracy per step with 95% bands), `privacy_utility.png` (test accuracy
against epsilon), `run_record.json` (config, dp_accounting events, epsilon
spent, versions, wall time) and TensorBoard scalars of the mean curves when a
TensorBoard backend is installed. Test accuracy is a diagnostic outside the
privacy guarantee, and choosing the best grid point by it (as the
privacy-utility plot's "best of grid" line does) is optimistic: the
hyperparameter search itself is not accounted.
"""

import os
import time
from typing import Any, Dict, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import noise
from dpsco_jax import runs as runs_lib
from dpsco_jax import strategies
from experiments import cli
from experiments import datasets
from experiments import outputs
from experiments import models
from experiments import sweeps

ALGORITHMS = ('dpmemf', 'dpsgd')
Split = Dict[str, np.ndarray]
Row = Dict[str, Any]


class Schedule:
  """The run's shape: fixed-order epochs of equal batches.

  Attributes:
    num_examples: training set size.
    batch_size: examples per batch.
    steps_per_epoch: batches per epoch (the leftover examples are unused).
    num_epochs: passes.
    num_steps: total steps.
    participation: `FixedOrder(num_epochs, steps_per_epoch)`.
  """

  def __init__(self, num_examples: int, batch_size: int, num_epochs: int):
    if not 0 < batch_size <= num_examples:
      raise ValueError(f'batch_size must be in [1, {num_examples}], got '
                       f'{batch_size}')
    if num_epochs < 1:
      raise ValueError(f'num_epochs must be >= 1, got {num_epochs}')
    self.num_examples = num_examples
    self.batch_size = batch_size
    self.steps_per_epoch = num_examples // batch_size
    self.num_epochs = num_epochs
    self.num_steps = num_epochs * self.steps_per_epoch
    self.participation = accounting.FixedOrder(num_epochs,
                                               self.steps_per_epoch)


def mechanism_for(config: ml_collections.ConfigDict,
                  schedule: Schedule) -> Dict[str, Any]:
  """The noise mechanism of the configured algorithm (and its strategy).

  Example:
    >>> mechanism_for(config, Schedule(1437, 239, 10))['mechanism'].name

  Args:
    config: the sweep config.
    schedule: the run's shape.

  Returns:
    `{'mechanism': NoiseMechanism, 'strategy': [T, T] array or None}`.

  Raises:
    ValueError: for an unknown algorithm.
  """
  if config.algorithm == 'dpmemf':
    # The "true" workload: what SGD with this momentum does with the noise.
    strategy = strategies.optimize_strategy(
        strategies.workload(schedule.num_steps, 'true',
                            momentum=config.momentum),
        schedule.num_epochs)
    return {'mechanism': dpsco_jax.dpmemf_mechanism(strategy),
            'strategy': strategy}
  if config.algorithm == 'dpsgd':
    return {'mechanism': dpsco_jax.dpsgd_mechanism(schedule.num_steps),
            'strategy': None}
  raise ValueError(f'unknown algorithm {config.algorithm!r}; choose from '
                   f'{ALGORITHMS}')


def make_train_fn(config: ml_collections.ConfigDict, train_data: Split,
                  test_data: Split, schedule: Schedule, *,
                  noise_multiplier: Optional[float] = None,
                  strategy: Optional[np.ndarray] = None) -> sweeps.TrainFn:
  """One whole training run as a pure function of (hyperparameters, seed).

  Example:
    >>> train_fn = make_train_fn(config, train, test, schedule,
    ...                          noise_multiplier=2.0, strategy=c)
    >>> jax.jit(train_fn)({'learning_rate': 0.5, 'clip': 1.0}, 0)

  Args:
    config: the sweep config (algorithm, momentum).
    train_data: training split.
    test_data: test split.
    schedule: the run's shape.
    noise_multiplier: the calibrated multiplier; None for the non-private
      reference (which then needs only `hparams['learning_rate']`).
    strategy: DP-MEMF's strategy (ignored by DP-SGD).

  Returns:
    `train_fn(hparams, seed)` with `hparams` = {'learning_rate', 'clip'}
    scalars, returning 'test_accuracy' and 'train_loss' (final),
    'test_accuracy_curve' `[num_steps]` (after each step), and the guards'
    record ('refusal_check', 'refusal_step': `dpsco_jax.runs.refusal_metrics`).
  """
  x_train = jnp.asarray(train_data['x'])
  y_train = jnp.asarray(train_data['y'])
  test = {'x': jnp.asarray(test_data['x']), 'y': jnp.asarray(test_data['y'])}
  train_all = {'x': x_train, 'y': y_train}
  b, size = schedule.steps_per_epoch, schedule.batch_size

  def accuracy(params):
    predictions = jnp.argmax(models.linear_logits(params, test['x']), axis=-1)
    return jnp.mean((predictions == test['y']).astype(jnp.float32))

  def train_fn(hparams: Dict[str, jax.Array],
               seed: jax.Array) -> Dict[str, jax.Array]:
    key = jax.random.key(seed)
    # Public order of this run: a permutation from the seed, not the data.
    order = jax.random.permutation(jax.random.fold_in(key, 0),
                                   schedule.num_examples)
    batches = order[:b * size].reshape(b, size)
    noise_key = jax.random.fold_in(key, 1)
    sgd = optax.sgd(hparams['learning_rate'], momentum=config.momentum)
    if noise_multiplier is None:
      tx = runs_lib.non_private(models.linear_mean_loss, sgd)
    elif config.algorithm == 'dpmemf':
      tx = optax.chain(
          dpsco_jax.dpmemf(
              models.linear_example_loss, l2_clip=hparams['clip'],
              noise_multiplier=noise_multiplier, strategy=strategy,
              steps_per_epoch=b, key=noise_key,
              # The order check runs on the example ids of every step.
              num_examples=schedule.num_examples),
          sgd)
    else:
      tx = optax.chain(
          dpsco_jax.dpsgd(
              models.linear_example_loss, l2_clip=hparams['clip'],
              noise_multiplier=noise_multiplier,
              num_steps=schedule.num_steps, key=noise_key),
          sgd)
    params = models.linear_init(64, 10)
    # Step t uses batch t mod b of the run's order (FixedOrder(k, b)).
    step_ids = batches[jnp.arange(schedule.num_steps) % b]
    (params, state), curve = runs_lib.scan_steps(
        tx, params, tx.init(params), (step_ids, None),
        inputs_fn=runs_lib.gathered_inputs(train_all),
        metric_fn=lambda params, _: accuracy(params))
    return {**runs_lib.refusal_metrics(state), 'test_accuracy': curve[-1],
            'train_loss': models.linear_mean_loss(params, train_all),
            'test_accuracy_curve': curve}

  return train_fn


def _curve(label: str, result: sweeps.SweepResult, point: int) -> outputs.Curve:
  values = result.metrics['test_accuracy_curve'][point]  # [seeds, steps]
  mean, _, _, half = sweeps.mean_and_interval(values, axis=0)
  steps = np.arange(1, values.shape[1] + 1)
  return outputs.Curve(label, steps, mean, mean - half, mean + half)


def _point_index(result: sweeps.SweepResult, row: Row) -> int:
  for g in range(result.num_points):
    if all(result.point(g)[n] == row[n] for n in result.names):
      return g
  raise KeyError(row)


def run(config: ml_collections.ConfigDict, output_dir: str) -> Dict[str, Any]:
  """Runs the sweep and writes its outputs to `output_dir`.

  Example:
    >>> out = run(configs.sweep_digits.get_config(), 'results/sweep_digits')
    >>> print(out['table'])

  Args:
    config: see `configs/sweep_digits.py`.
    output_dir: created if missing.

  Returns:
    `{'rows': summary rows at config.epsilon (private, then non-private),
    'privacy_utility': rows, 'table': markdown, 'record': run record}`.

  Raises:
    ValueError: for an unknown algorithm, or `config.epsilon` not in
      `config.epsilons`.
  """
  start = time.perf_counter()
  if config.algorithm not in ALGORITHMS:
    raise ValueError(f'unknown algorithm {config.algorithm!r}; choose from '
                     f'{ALGORITHMS}')
  epsilons = sorted(float(e) for e in config.epsilons)
  if float(config.epsilon) not in epsilons:
    raise ValueError(f'epsilon {config.epsilon} must be one of epsilons '
                     f'{config.epsilons}')
  # Checked here too so a bad grid fails before any calibration.
  grid = {'learning_rate': tuple(config.learning_rates),
          'clip': tuple(config.clips)}
  sweeps.validate_grid(grid)
  seeds = list(range(config.num_seeds))
  train_data, test_data = datasets.load_digits()
  schedule = Schedule(len(train_data['y']), config.batch_size,
                      config.num_epochs)
  built = mechanism_for(config, schedule)
  mechanism: noise.NoiseMechanism = built['mechanism']

  rows, runs, privacy, pu_rows, timings = [], [], [], [], []
  table_result = None
  for epsilon in epsilons:
    z = dpsco_jax.calibrate_noise_multiplier(
        mechanism, schedule.participation, epsilon, config.delta)
    logging.info('%s: noise multiplier %.4f for (%g, %g)-DP over %d steps',
                 config.algorithm, z, epsilon, config.delta,
                 schedule.num_steps)
    entry = outputs.privacy_entry(
        f'{config.algorithm}@epsilon={epsilon:g}', mechanism, z,
        schedule.participation, config.delta, target_epsilon=epsilon)
    privacy.append(entry)
    train_fn = make_train_fn(config, train_data, test_data, schedule,
                             noise_multiplier=z, strategy=built['strategy'])
    result = sweeps.run_sweep(train_fn, grid, seeds,
                              max_parallel=config.max_parallel,
                              name=f'{config.algorithm} epsilon={epsilon:g}')
    # A step refused by a guard (the order check) stops the sweep.
    runs_lib.raise_refusal_metrics(result.metrics)
    timings.append({'epsilon': epsilon, 'runs': result.num_points *
                    result.num_seeds, 'compile_seconds': result.compile_seconds,
                    'run_seconds': result.run_seconds})
    labels = {'algorithm': config.algorithm, 'epsilon': epsilon,
              'epsilon_spent': entry['epsilon_spent'], 'noise_multiplier': z}
    summary = sweeps.summarize(result, 'test_accuracy', labels=labels)
    runs += sweeps.per_run_rows(result, ['test_accuracy', 'train_loss'],
                                labels={'algorithm': config.algorithm,
                                        'epsilon': epsilon})
    top = sweeps.best(summary)
    centre = summary[len(summary) // 2]
    top_edge = sweeps.edge_report(
        {axis: top[axis] for axis in grid}, grid) or 'no'
    for selection, row, edge in (('best of grid (on test)', top, top_edge),
                                 ('grid centre', centre, '')):
      pu_rows.append({'selection': selection, **row, 'grid_edge': edge})
    if epsilon == float(config.epsilon):
      rows += summary
      table_result = result

  nonprivate_result = None
  if config.nonprivate:
    train_fn = make_train_fn(config, train_data, test_data, schedule)
    nonprivate_result = sweeps.run_sweep(
        train_fn, {'learning_rate': grid['learning_rate']}, seeds,
        max_parallel=config.max_parallel, name='nonprivate')
    rows += sweeps.summarize(
        nonprivate_result, 'test_accuracy',
        labels={'algorithm': 'nonprivate', 'epsilon': float('inf'),
                'epsilon_spent': float('inf'), 'noise_multiplier': 0.0})
    runs += sweeps.per_run_rows(nonprivate_result,
                                ['test_accuracy', 'train_loss'],
                                labels={'algorithm': 'nonprivate',
                                        'epsilon': float('inf')})

  columns = ['algorithm', 'epsilon', 'learning_rate', 'clip', 'mean', 'ci',
             'std', 'n']
  table = sweeps.format_table(rows, columns)
  os.makedirs(output_dir, exist_ok=True)
  outputs.write_csv(os.path.join(output_dir, 'summary.csv'), rows)
  outputs.write_csv(os.path.join(output_dir, 'runs.csv'), runs)
  outputs.write_csv(os.path.join(output_dir, 'privacy_utility.csv'), pu_rows)
  heading = (f'# Digits sweep: {config.algorithm}, {len(seeds)} seeds, '
             f'(epsilon={config.epsilon:g}, delta={config.delta:g})\n\n'
             'Final test accuracy, mean over seeds with a 95% Student-t '
             'interval for the mean.\n\n')
  pu_table = sweeps.format_table(
      pu_rows, ['selection', 'epsilon', 'learning_rate', 'clip', 'mean', 'ci',
                'n', 'grid_edge'])
  with open(os.path.join(output_dir, 'summary.md'), 'w') as f:
    f.write(heading + table + '\n## Privacy-utility\n\n' + pu_table)

  # Learning curves at the table's epsilon: the best and centre grid points,
  # and the best non-private learning rate.
  private_rows = [r for r in rows if r['algorithm'] == config.algorithm]
  top = sweeps.best(private_rows)
  curves = [_curve(f"{config.algorithm} best (lr={top['learning_rate']:g}, "
                   f"clip={top['clip']:g})", table_result,
                   _point_index(table_result, top))]
  centre = private_rows[len(private_rows) // 2]
  if centre is not top:
    curves.append(_curve(
        f"{config.algorithm} (lr={centre['learning_rate']:g}, "
        f"clip={centre['clip']:g})", table_result,
        _point_index(table_result, centre)))
  reference = None
  if nonprivate_result is not None:
    np_rows = [r for r in rows if r['algorithm'] == 'nonprivate']
    np_top = sweeps.best(np_rows)
    reference = np_top['mean']
    curves.append(_curve(f"non-private (lr={np_top['learning_rate']:g})",
                         nonprivate_result,
                         _point_index(nonprivate_result, np_top)))
  outputs.plot_curves(
      os.path.join(output_dir, 'learning_curves.png'), curves,
      xlabel='step', ylabel='test accuracy (mean, 95% band)',
      title=(f'digits, {len(seeds)} seeds, epsilon={config.epsilon:g}, '
             f'delta={config.delta:g}'))
  pu_curves = []
  for selection in ('best of grid (on test)', 'grid centre'):
    sel = [r for r in pu_rows if r['selection'] == selection]
    pu_curves.append(outputs.Curve(
        f'{config.algorithm}, {selection}', [r['epsilon'] for r in sel],
        [r['mean'] for r in sel], [r['ci_low'] for r in sel],
        [r['ci_high'] for r in sel]))
  outputs.plot_privacy_utility(
      os.path.join(output_dir, 'privacy_utility.png'), pu_curves,
      reference=reference,
      title=f'digits, {len(seeds)} seeds, delta={config.delta:g}')

  with outputs.scalar_writer(os.path.join(output_dir, 'tensorboard')) as tb:
    for curve in curves:
      for step, value in zip(curve.x, curve.y):
        tb.scalar(f'{curve.label}/test_accuracy_mean', value, int(step))

  record = outputs.run_record(
      config, privacy=privacy, wall_seconds=time.perf_counter() - start,
      extra={'experiment': 'experiments.sweep_digits',
             'num_steps': schedule.num_steps,
             'steps_per_epoch': schedule.steps_per_epoch,
             'sweep_timings': timings,
             'summary': rows})
  outputs.write_json(os.path.join(output_dir, 'run_record.json'), record)
  logging.info('summary (written to %s):\n%s', output_dir, table)
  return {'rows': rows, 'privacy_utility': pu_rows, 'table': table,
          'record': record}


if __name__ == '__main__':
  cli.launch(run, 'configs/sweep_digits.py',
             'A seeds x (learning rate, clip) sweep of private logistic '
             'regression on digits', output_dir='results/sweep_digits')
