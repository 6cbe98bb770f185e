"""Four ways to set the clip, compared at the same epsilon on digits.

    python -m experiments.clipping_choices --config=configs/clipping_choices.py

DP-SGD (the quickstart's logistic regression, SGD with momentum, fixed
public batch order accounted as FixedOrder) at each epsilon of the config,
over 20 seeds, with the clip set four ways:

1. **fixed clip, tuned non-privately** (the common protocol, and this
   repository's other results pages): every (learning rate, clip) of the
   grid is trained, the point with the best mean VALIDATION accuracy over
   the seeds is picked, its test accuracy reported. The epsilon is that of
   one run: the search itself is not accounted.
2. **adaptive clipping** (Andrew et al. 2021): the clip starts at 0.1 and
   follows a private estimate of the median gradient norm; no clip is
   searched, the learning rate is (non-privately, as in 1).
3. **automatic clipping** (Bu et al. 2023, AUTO-S): each gradient scaled to
   `g / (||g|| + 0.01)`; no clip at all, the learning rate searched as in 1.
4. **private random search** (Papernot & Steinke 2022): a random number of
   trials (truncated negative binomial), each a private run at a
   configuration drawn from the same lr x clip grid, scored by its
   validation accuracy RELEASED with noise, the best one's test accuracy
   reported. Its epsilon is the whole search's, calibrated to the target:
   each trial gets more noise than the runs of 1-3.

Rows 1-3 spend the target epsilon per run plus an unaccounted search over
the learning rate (and, in 1, the clip); row 4 spends the target epsilon
in all. Writes `summary.md`, `summary.csv`, `runs.csv`,
`privacy_utility.png` and `run_record.json` to `--output_dir`.
"""

import itertools
import os
import time
from typing import Any, Dict, Iterator, List, Sequence

from absl import logging
import dp_accounting
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import adaptive_clipping
from dpsco_jax import runs
from dpsco_jax import tuning
from experiments import cli
from experiments import datasets
from experiments import models
from experiments import outputs
from experiments import sweeps
from experiments.sweep_digits import Schedule

FIXED, ADAPTIVE, AUTOMATIC, SEARCH = (
    'fixed clip, tuned non-privately', 'adaptive clipping',
    'automatic clipping', 'private random search')
METHODS = (FIXED, ADAPTIVE, AUTOMATIC, SEARCH)
Row = Dict[str, Any]


def load_splits(num_validation: int) -> Dict[str, Dict[str, np.ndarray]]:
  """Digits cut into train, validation (both private) and test.

  Example:
    >>> splits = load_splits(287)
    >>> splits['validation']['x'].shape   # (287, 64)

  Args:
    num_validation: examples of the training split kept for validation.

  Returns:
    `{'train', 'validation', 'test'}` splits.

  Raises:
    ValueError: if `num_validation` leaves no training examples.
  """
  train, test = datasets.load_digits()
  n = len(train['y'])
  if not 0 < num_validation < n:
    raise ValueError(f'num_validation must be in (0, {n}), got '
                     f'{num_validation}')
  order = np.random.default_rng(0).permutation(n)
  pick = lambda idx: {k: v[idx] for k, v in train.items()}
  return {'train': pick(order[num_validation:]),
          'validation': pick(order[:num_validation]), 'test': test}


def private_gradient(config: ml_collections.ConfigDict, method: str,
                     hparams: Dict[str, jax.Array], noise_multiplier: float,
                     schedule: Schedule, key: jax.Array):
  """The DP-SGD transformation of one run, its clip set by `method`."""
  if method not in METHODS:
    raise ValueError(f'unknown method {method!r}; choose from {METHODS}')
  common = dict(noise_multiplier=noise_multiplier,
                num_steps=schedule.num_steps, key=key,
                normalize_by=schedule.batch_size)
  if method in (FIXED, SEARCH):
    return dpsco_jax.dpsgd(models.linear_example_loss,
                           l2_clip=hparams['clip'], **common)
  if method == ADAPTIVE:
    return dpsco_jax.dpsgd(
        models.linear_example_loss, l2_clip=config.adaptive_initial_clip,
        adaptive_clipping=adaptive_clipping.AdaptiveClipping(
            target_quantile=config.adaptive_quantile,
            learning_rate=config.adaptive_learning_rate), **common)
  if method == AUTOMATIC:
    return dpsco_jax.dpsgd(models.linear_example_loss, l2_clip=1.0,
                           automatic_clipping=config.automatic_stability,
                           **common)
  raise AssertionError(method)


def make_train_fn(config: ml_collections.ConfigDict, method: str,
                  schedule: Schedule, noise_multiplier: float):
  """One whole run as a pure function `(hparams, seed, data) -> metrics`.

  Example:
    >>> train_fn = make_train_fn(config, ADAPTIVE, schedule, 3.0)
    >>> jax.jit(train_fn)({'learning_rate': 0.5}, 0, splits)

  Args:
    config: the experiment config.
    method: one of `METHODS`.
    schedule: the run's shape.
    noise_multiplier: the calibrated multiplier.

  Returns:
    `train_fn`, returning validation and test accuracy, the per-example
    correctness on the validation split (what the search's score releases,
    with noise) and the final clip (adaptive clipping; NaN otherwise).
  """
  b, size = schedule.steps_per_epoch, schedule.batch_size

  def correct(params, split):
    predictions = jnp.argmax(models.linear_logits(params, split['x']), -1)
    return (predictions == split['y']).astype(jnp.float32)

  def train_fn(hparams, seed, data):
    key = jax.random.key(seed)
    # The run's public order: a permutation from the seed, not the data.
    order = jax.random.permutation(jax.random.fold_in(key, 0),
                                   schedule.num_examples)
    batches = order[:b * size].reshape(b, size)
    tx = optax.chain(
        private_gradient(config, method, hparams, noise_multiplier,
                         schedule, jax.random.fold_in(key, 1)),
        optax.sgd(hparams['learning_rate'], momentum=config.momentum))
    params = models.linear_init(64, 10)
    (params, state), _ = runs.scan_steps(
        tx, params, tx.init(params),
        (batches[jnp.arange(schedule.num_steps) % b], None),
        inputs_fn=runs.gathered_inputs(data['train']))
    clip = adaptive_clipping.current_clip(state)
    validation = correct(params, data['validation'])
    return {'validation_accuracy': jnp.mean(validation),
            'test_accuracy': jnp.mean(correct(params, data['test'])),
            'validation_correct': validation,
            'final_clip': jnp.nan if clip is None else clip}

  return train_fn


def grid_of(config: ml_collections.ConfigDict, method: str
            ) -> Dict[str, Sequence[float]]:
  """The hyperparameters searched for `method`."""
  if method == FIXED:
    return {'learning_rate': tuple(config.learning_rates),
            'clip': tuple(config.clips)}
  return {'learning_rate': tuple(config.learning_rates)}


def tuned_row(result: sweeps.SweepResult, grid, labels: Row) -> Row:
  """The grid point with the best mean validation accuracy, its test
  accuracy over the seeds (the selection is NOT private)."""
  validation = sweeps.summarize(result, 'validation_accuracy')
  picked = sweeps.best(validation)
  index = validation.index(picked)
  test = sweeps.summarize(result, 'test_accuracy')[index]
  point = {name: picked[name] for name in grid}
  clips = result.metrics['final_clip'][index]
  return {**labels, **point, 'mean': test['mean'],
          'ci_low': test['ci_low'], 'ci_high': test['ci_high'],
          'ci_half_width': test['ci_half_width'], 'n': test['n'],
          'final_clip': float(np.mean(clips)) if np.all(np.isfinite(clips))
                        else None,
          'grid_edge': sweeps.edge_report(point, grid) or 'no'}


def search_row(config, schedule, train_fn_of, mechanism, splits, epsilon,
               seeds: Sequence[int], trial_seeds: Iterator[int]
               ) -> tuple[Row, List[Row]]:
  """Private random searches (one per seed) at total `epsilon`; each trial
  takes the next of `trial_seeds` (its batch order and noise keys)."""
  distribution = tuning.truncated_negative_binomial(
      config.search_eta, config.search_mean_trials)
  score_noise = float(config.search_score_noise)

  def make_event(z):
    return dp_accounting.ComposedDpEvent([
        accounting.dp_event(mechanism, z, schedule.participation),
        dp_accounting.GaussianDpEvent(score_noise)])

  z = tuning.calibrate_trial_noise(epsilon, config.delta, distribution,
                                   make_event)
  run_one = jax.jit(train_fn_of(z))
  space = {'learning_rate': list(config.learning_rates),
           'clip': list(config.clips)}
  bests, per_run = [], []
  for seed in seeds:

    def run_trial(hparams, noise_multiplier):
      assert noise_multiplier == z
      trial_seed = next(trial_seeds)
      out = run_one({k: jnp.float32(v) for k, v in hparams.items()},
                    jnp.int32(trial_seed), splits)
      score = tuning.private_score(
          out['validation_correct'], noise_multiplier=score_noise,
          key=jax.random.fold_in(jax.random.key(trial_seed), 2))
      return score, out

    result = tuning.random_search(
        space, run_trial, distribution=distribution, delta=config.delta,
        score_source='private_release', noise_multiplier=z,
        make_event=make_event,
        key=jax.random.key(int(epsilon * 1000) * 100_003 + seed))
    bests.append(float(result.best.result['test_accuracy']))
    per_run.append({'method': SEARCH, 'epsilon': epsilon, 'seed': seed,
                    'trials': result.num_trials,
                    **result.best.config,
                    'test_accuracy': bests[-1],
                    'epsilon_spent': result.epsilon})
  mean, _, n, half = sweeps.mean_and_interval(np.asarray(bests))
  return ({'method': SEARCH, 'epsilon': epsilon,
           'epsilon_accounted': float(result.epsilon),
           'covers': 'the whole search', 'noise_multiplier': z,
           'mean_trials': float(np.mean([r['trials'] for r in per_run])),
           'mean': float(mean), 'ci_low': float(mean - half),
           'ci_high': float(mean + half), 'ci_half_width': float(half),
           'n': int(n), 'grid_edge': ''}, per_run)


def run(config: ml_collections.ConfigDict, output_dir: str) -> Dict[str, Any]:
  """Runs the comparison and writes its outputs to `output_dir`.

  Example:
    >>> out = run(configs.clipping_choices.get_config(), 'results/clip')
    >>> print(out['table'])

  Args:
    config: see `configs/clipping_choices.py`.
    output_dir: created if missing.

  Returns:
    `{'rows', 'runs', 'table', 'record'}`.
  """
  start = time.perf_counter()
  splits = load_splits(config.num_validation)
  schedule = Schedule(len(splits['train']['y']), config.batch_size,
                      config.num_epochs)
  mechanism = dpsco_jax.dpsgd_mechanism(schedule.num_steps)
  seeds = list(range(config.num_seeds))
  data = jax.tree_util.tree_map(jnp.asarray, splits)
  rows, per_run, privacy = [], [], []
  # One counter for every trial of every search: no two trials share a
  # batch order or a noise key (nor their scores' keys), and none shares
  # the seeds 0..num_seeds-1 of the sweeps.
  trial_seeds = itertools.count(10_000_000)
  for epsilon in sorted(float(e) for e in config.epsilons):
    z = dpsco_jax.calibrate_noise_multiplier(
        mechanism, schedule.participation, epsilon, config.delta)
    entry = outputs.privacy_entry(
        f'dpsgd@epsilon={epsilon:g}', mechanism, z, schedule.participation,
        config.delta, target_epsilon=epsilon)
    privacy.append(entry)
    for method in (FIXED, ADAPTIVE, AUTOMATIC):
      grid = grid_of(config, method)
      result = sweeps.run_sweep(
          make_train_fn(config, method, schedule, z), grid, seeds,
          max_parallel=config.max_parallel, data=data,
          name=f'{method} epsilon={epsilon:g}')
      rows.append(tuned_row(result, grid, {
          'method': method, 'epsilon': epsilon,
          'epsilon_accounted': entry['epsilon_spent'],
          'covers': 'one run (search not accounted)',
          'noise_multiplier': z}))
      per_run += sweeps.per_run_rows(
          result, ['validation_accuracy', 'test_accuracy'],
          labels={'method': method, 'epsilon': epsilon})
    row, searched = search_row(
        config, schedule,
        lambda z_trial: make_train_fn(config, SEARCH, schedule, z_trial),
        mechanism, data, epsilon, seeds, trial_seeds)
    rows.append(row)
    per_run += searched
    logging.info('epsilon %g done', epsilon)
  return write_outputs(config, output_dir, rows, per_run, privacy, schedule,
                       time.perf_counter() - start)


def write_outputs(config, output_dir, rows, per_run, privacy, schedule,
                  wall_seconds) -> Dict[str, Any]:
  """The table, CSVs, plot and run record."""
  os.makedirs(output_dir, exist_ok=True)
  columns = ['epsilon', 'method', 'epsilon_accounted', 'covers',
             'learning_rate', 'clip', 'final_clip', 'mean', 'ci_low',
             'ci_high', 'n', 'grid_edge']
  table = sweeps.format_table(rows, columns)
  outputs.write_csv(os.path.join(output_dir, 'summary.csv'), rows)
  outputs.write_csv(os.path.join(output_dir, 'runs.csv'), per_run)
  with open(os.path.join(output_dir, 'summary.md'), 'w') as f:
    f.write(f'# Setting the clip: four ways at the same epsilon '
            f'(digits, {config.num_seeds} seeds, delta={config.delta:g})\n\n'
            'Test accuracy, mean over seeds with a 95% Student-t interval. '
            'Rows 1-3 pick their grid point by mean validation accuracy, '
            'NOT privately; the private random search accounts for '
            'everything it does.\n\n' + table)
  outputs.plot_privacy_utility(
      os.path.join(output_dir, 'privacy_utility.png'),
      [outputs.Curve(method, [r['epsilon'] for r in rows
                              if r['method'] == method],
                     [r['mean'] for r in rows if r['method'] == method],
                     [r['ci_low'] for r in rows if r['method'] == method],
                     [r['ci_high'] for r in rows if r['method'] == method])
       for method in METHODS],
      title=f'digits, {config.num_seeds} seeds, delta={config.delta:g}')
  record = outputs.run_record(
      config, privacy=privacy, wall_seconds=wall_seconds,
      extra={'experiment': 'experiments.clipping_choices',
             'num_steps': schedule.num_steps, 'summary': rows})
  outputs.write_json(os.path.join(output_dir, 'run_record.json'), record)
  logging.info('summary (written to %s):\n%s', output_dir, table)
  return {'rows': rows, 'runs': per_run, 'table': table, 'record': record}


if __name__ == '__main__':
  cli.launch(run, 'configs/clipping_choices.py',
             'Fixed, adaptive and automatic clipping and a private random '
             'search, at the same epsilon on digits',
             output_dir='results/clipping_choices')
