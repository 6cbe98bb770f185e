"""Paper 001 §5: DP-MEMF against DP-SRG-MEMF, "ones" and "true" strategies.

Multiclass logistic regression (flattened pixels -> classes, with bias, zero
init), batches of a fixed public order repeated every epoch (no shuffling,
no amplification), SGD with momentum 0.9 after the private gradient:

* `dpmemf_ones` / `dpmemf_true`: DP-MEMF (001 Algorithm 2) with the strategy
  optimized for the prefix-sum workload A, or for the momentum workload M A;
* `srg_ones` / `srg_true`: DP-SRG-MEMF (001 Algorithm 3, corrected) with the
  strategy optimized for A, or for M A L (L the decay matrix of c);
* `nonprivate`: the same optimizer on the plain mean gradient.

Every private run is accounted as the paper does: zCDP for the strategy's
sensitivity under `FixedOrder(k, b)`, converted with
`epsilon = rho + 2 sqrt(rho log(1/delta))` (`method='zcdp'`).

Protocol (honest tuning): the official training split is cut into a
training part and a validation part (`config.validation_size` examples,
seeded). Learning rate, clip and c are tuned on the validation part with
`config.tuning_seeds` seeds; while the pick sits on the edge of an axis, that
axis is extended past it (`config.grid_extensions` times at most) and a
pick still on an edge is flagged in the results. The chosen setting then
runs with `config.num_seeds` fresh seeds, on the whole training split
(`config.final_on_full_train`: strategy and noise made for that size), and
the mean TEST accuracy is reported with a 95% Student-t interval. Tuning on validation data is still not private
(the selection itself leaks a little about the training data); the test
split is never looked at before the final runs. Each seed draws its own
public batch order (fixed across epochs) and its own noise.

All seeds of one setting run as ONE compiled program: the whole training
run is a `jax.lax.scan` over steps (`dpsco_jax.runs.scan_steps`, the
fixed-order guard on), `jax.vmap`-ed over seeds, with the
data passed as an argument (not baked into the program).

    python -m experiments.srg_memf --config=configs/srg_memf_fashion_mnist.py
    python -m experiments.srg_memf --config=configs/srg_memf_digits.py

Writes `results.csv` (one row per algorithm: setting, mean, interval),
`tuning.csv` (every validation score), `runs.csv` (every final run),
`results.md`, `accuracy.png` and `run_record.json` (config, dp_accounting
events, epsilon spent, versions, wall time) to `--output_dir`.
"""

import os
import time
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import matplotlib
matplotlib.use('Agg')  # Files only: no display is needed (or available).
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
import ml_collections
import numpy as np
import optax
from scipy import stats

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import runs
from dpsco_jax import strategies
from experiments import cli
from experiments import datasets
from experiments import outputs
from experiments import sweeps

Params = Dict[str, jax.Array]
Split = Dict[str, np.ndarray]
ALGORITHMS = ('dpmemf_ones', 'dpmemf_true', 'srg_ones', 'srg_true',
              'nonprivate')


class Data(NamedTuple):
  """Device arrays of one experiment: train, validation and test parts."""

  train_x: jax.Array
  train_y: jax.Array
  val_x: jax.Array
  val_y: jax.Array
  test_x: jax.Array
  test_y: jax.Array


def split_validation(train: Split, validation_size: int,
                     seed: int) -> Tuple[Split, Split]:
  """Cuts a seeded validation part out of the training split.

  Args:
    train: the official training split.
    validation_size: examples moved to the validation part.
    seed: seed of the cut.

  Returns:
    `(training part, validation part)`.
  """
  n = len(train['y'])
  if not 0 < validation_size < n:
    raise ValueError(f'validation_size must be in (0, {n}), got '
                     f'{validation_size}')
  order = np.random.default_rng(seed).permutation(n)
  held, kept = order[:validation_size], order[validation_size:]
  return ({k: v[kept] for k, v in train.items()},
          {k: v[held] for k, v in train.items()})


def load_data(config: ml_collections.ConfigDict) -> Data:
  """Loads the config's data set and moves the three parts to the device."""
  kwargs = dict(config.get('data_kwargs', {}))
  train, test = datasets.load(config.dataset, config.get('data_path') or None,
                              **kwargs)
  train, val = split_validation(train, config.validation_size,
                                config.split_seed)
  as_x = lambda a: jnp.asarray(a, jnp.float32)
  as_y = lambda a: jnp.asarray(a, jnp.int32)
  return Data(as_x(train['x']), as_y(train['y']), as_x(val['x']),
              as_y(val['y']), as_x(test['x']), as_y(test['y']))


def example_loss(params: Params, example: Dict[str, jax.Array]) -> jax.Array:
  """Softmax cross-entropy of ONE example (what the private code clips)."""
  logits = example['x'] @ params['w'] + params['b']
  return optax.softmax_cross_entropy_with_integer_labels(logits, example['y'])


def mean_loss(params: Params, batch: Dict[str, jax.Array]) -> jax.Array:
  """Mean cross-entropy of a batch (the non-private gradient)."""
  logits = batch['x'] @ params['w'] + params['b']
  return jnp.mean(
      optax.softmax_cross_entropy_with_integer_labels(logits, batch['y']))


def accuracy(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
  """Fraction of correct predictions."""
  return jnp.mean(jnp.argmax(x @ params['w'] + params['b'], -1) == y)


class Setup(NamedTuple):
  """Everything fixed for one algorithm: strategy, noise, shape of the run.

  Attributes:
    algorithm: one of `ALGORITHMS`.
    strategy: the MF strategy C (None for `nonprivate`).
    noise_multiplier: calibrated with zCDP (0 for `nonprivate`).
    num_epochs: k.
    steps_per_epoch: b.
    batch_size: B.
    epsilon: the epsilon the run spends (None for `nonprivate`).
  """

  algorithm: str
  strategy: Any
  noise_multiplier: float
  num_epochs: int
  steps_per_epoch: int
  batch_size: int
  epsilon: Any


def workload_of(algorithm: str, num_steps: int, momentum: float,
                decay: float) -> np.ndarray:
  """The workload the algorithm's strategy is optimized for (001 §2.4)."""
  if algorithm.endswith('_ones'):
    return strategies.workload(num_steps, 'ones')
  if algorithm == 'dpmemf_true':
    return strategies.workload(num_steps, 'true', momentum=momentum)
  return strategies.workload(num_steps, 'true', momentum=momentum,
                             decay=decay)


def make_setup(algorithm: str, config: ml_collections.ConfigDict,
               num_train: int, decay: float) -> Setup:
  """Optimizes (or loads) the strategy and calibrates the noise.

  Args:
    algorithm: one of `ALGORITHMS`.
    config: the experiment config.
    num_train: training examples (b = num_train // batch_size).
    decay: c, used by the "true" SRG workload.

  Returns:
    The `Setup`.
  """
  b = num_train // config.batch_size
  k = config.num_epochs
  if algorithm == 'nonprivate':
    return Setup(algorithm, None, 0.0, k, b, config.batch_size, None)
  strategy = strategies.optimize_strategy(
      workload_of(algorithm, k * b, config.momentum, decay), k)
  mechanism = dpsco_jax.dpmemf_mechanism(strategy)
  participation = accounting.FixedOrder(k, b)
  z = accounting.calibrate_noise_multiplier(
      mechanism, participation, config.epsilon, config.delta, method='zcdp')
  spent = accounting.epsilon_spent(mechanism, z, participation, config.delta,
                                   method='zcdp')
  return Setup(algorithm, strategy, z, k, b, config.batch_size, spent)


def make_run(setup: Setup, decay: float, momentum: float, num_classes: int):
  """One whole training run as a pure function of (hparams, seed, data).

  Args:
    setup: the algorithm's fixed pieces.
    decay: c for DP-SRG-MEMF.
    momentum: SGD momentum.
    num_classes: number of classes (static: it shapes the params).

  Returns:
    `run(learning_rate, clip, seed, data) -> (val accuracy, test accuracy,
    refusal)`, traceable (vmap over seeds and hyperparameters, jit once);
    `refusal` is the guards' record (`runs.refusal_metrics`).
  """
  k, b, batch_size = setup.num_epochs, setup.steps_per_epoch, setup.batch_size

  def run(learning_rate, clip, seed, data: Data):
    order_key, noise_key = jax.random.split(jax.random.key(seed))
    n = data.train_y.shape[0]
    # The public order of this run: drawn from its seed, never from the
    # data, and repeated every epoch (what FixedOrder(k, b) accounts for).
    order = jax.random.permutation(order_key, n)[:b * batch_size].reshape(
        b, batch_size)
    sgd = optax.sgd(learning_rate, momentum=momentum)
    if setup.algorithm == 'nonprivate':
      tx = runs.non_private(mean_loss, sgd)
    else:
      common = dict(l2_clip=clip, noise_multiplier=setup.noise_multiplier,
                    strategy=setup.strategy, steps_per_epoch=b,
                    num_examples=n, key=noise_key)
      if setup.algorithm.startswith('dpmemf'):
        private = dpsco_jax.dpmemf(example_loss, **common)
      else:
        private = dpsco_jax.dp_srg_memf(example_loss, decay=decay, **common)
      tx = optax.chain(private, sgd)
    params = {'w': jnp.zeros((data.train_x.shape[1], num_classes),
                             jnp.float32),
              'b': jnp.zeros((num_classes,), jnp.float32)}
    # Step t uses batch t mod b; the example ids let the fixed-order guard
    # check every epoch.
    (params, state), _ = runs.scan_steps(
        tx, params, tx.init(params), (order[jnp.arange(k * b) % b], None),
        inputs_fn=runs.gathered_inputs({'x': data.train_x,
                                        'y': data.train_y}))
    return (accuracy(params, data.val_x, data.val_y),
            accuracy(params, data.test_x, data.test_y),
            runs.refusal_metrics(state))

  return run


def run_many(setup: Setup, decay: float, momentum: float, num_classes: int,
             grid: Dict[str, Sequence[float]], seeds: Sequence[int],
             data: Data, name: str) -> sweeps.SweepResult:
  """Runs every grid point x seed as one vmapped program (`sweeps`).

  Args:
    setup: the algorithm's fixed pieces.
    decay: c.
    momentum: SGD momentum.
    num_classes: number of classes.
    grid: `{'learning_rate': [...], 'clip': [...]}` (their product is run).
    seeds: the seeds, run for every grid point.
    data: the device arrays (an argument of the program, not a constant).
    name: label of the progress lines.

  Returns:
    The `sweeps.SweepResult`, metrics `val_accuracy` and `test_accuracy`
    shaped `[grid points, seeds]`.
  """
  run = make_run(setup, decay, momentum, num_classes)

  def train_fn(hparams, seed, data):
    val, test, refusal = run(hparams['learning_rate'], hparams['clip'], seed,
                             data)
    return {'val_accuracy': val, 'test_accuracy': test, **refusal}

  result = sweeps.run_sweep(train_fn, grid, seeds, data=data, name=name)
  # A step refused by a guard (the fixed-order check) stops the experiment.
  runs.raise_refusal_metrics(result.metrics)
  return result


def _extend(axis: str, values: List[float], edge: str) -> List[float]:
  """`values` extended past `edge` (unchanged when not on an edge).

  The decay c lives in [0, 1) (c = eta_{t-1} / eta_t, and the decay
  workload's L needs c < 1): past its upper edge the new value is halfway
  from the largest to 1, so the axis approaches 1 without reaching it.
  """
  if not edge:
    return values
  if axis == 'decay' and edge == 'upper':
    return sorted(values) + [(max(values) + 1.0) / 2.0]
  return sweeps.extend_axis(values, edge)


def tune_and_run(algorithm: str, config: ml_collections.ConfigDict,
                 data: Data, num_classes: int) -> Dict[str, Any]:
  """Tunes on validation, then runs the chosen setting with fresh seeds.

  Args:
    algorithm: one of `ALGORITHMS`.
    config: the experiment config.
    data: the device arrays.
    num_classes: number of classes.

  Returns:
    A dict with the chosen setting, the tuning table and the final runs.
  """
  srg = algorithm.startswith('srg')
  axes = {'learning_rate': sorted(float(v) for v in config.learning_rates),
          'clip': (sorted(float(v) for v in config.clips)
                   if algorithm != 'nonprivate' else [1.0]),
          'decay': (sorted(float(v) for v in config.decays) if srg
                    else [0.0])}
  tuning_seeds = [10_000 + s for s in range(config.tuning_seeds)]
  num_train = int(data.train_y.shape[0])
  scores: Dict[Tuple[float, float, float], float] = {}
  setups: Dict[float, Setup] = {}
  start = time.time()
  # Tune; while the pick sits on the edge of an axis searched, extend that
  # axis past it (up to `grid_extensions` times) and tune the new points.
  for extension in range(int(config.grid_extensions) + 1):
    for decay in axes['decay']:
      grid = {'learning_rate': axes['learning_rate'], 'clip': axes['clip']}
      if all((lr, clip, decay) in scores for lr in grid['learning_rate']
             for clip in grid['clip']):
        continue
      if decay not in setups:
        setups[decay] = make_setup(algorithm, config, num_train, decay)
      result = run_many(setups[decay], decay, config.momentum, num_classes,
                        grid, tuning_seeds, data,
                        f'{algorithm} tuning c={decay:.3g}')
      for g in range(result.num_points):
        point = result.point(g)
        scores[(float(point['learning_rate']), float(point['clip']),
                decay)] = float(result.metrics['val_accuracy'][g].mean())
    best_lr, best_clip, best_decay = max(scores, key=scores.get)
    picked = {'learning_rate': best_lr, 'clip': best_clip,
              'decay': best_decay}
    edges = {axis: sweeps.grid_edge(values, picked[axis])
             for axis, values in axes.items()}
    extended = {axis: _extend(axis, values, edges[axis])
                for axis, values in axes.items()}
    if extended == axes or extension == int(config.grid_extensions):
      break
    axes = extended
  tuning_rows = [dict(algorithm=algorithm, decay=decay, val_accuracy=score,
                      learning_rate=lr, clip=clip)
                 for (lr, clip, decay), score in sorted(scores.items())]
  point = {'learning_rate': best_lr, 'clip': best_clip}
  decay = best_decay
  logging.info('%s: tuned in %.0f s: %s, c %g (val %.4f)', algorithm,
               time.time() - start, point, decay, scores[(best_lr, best_clip,
                                                          best_decay)])
  final_data = data
  if config.final_on_full_train:
    # The chosen setting trains on the whole official training split (the
    # validation part included): its strategy and noise are made for that
    # n, so the epsilon reported is the one this run spends.
    final_data = data._replace(
        train_x=jnp.concatenate([data.train_x, data.val_x]),
        train_y=jnp.concatenate([data.train_y, data.val_y]))
    setup = make_setup(algorithm, config, int(final_data.train_y.shape[0]),
                       decay)
  else:
    setup = setups[decay]
  final = run_many(setup, decay, config.momentum, num_classes,
                   {k: [v] for k, v in point.items()},
                   range(config.num_seeds), final_data, f'{algorithm} final')
  test = final.metrics['test_accuracy'][0]
  mean, _, _, half = sweeps.mean_and_interval(test)
  privacy = None
  if setup.strategy is not None:
    privacy = outputs.privacy_entry(
        algorithm, dpsco_jax.dpmemf_mechanism(setup.strategy),
        setup.noise_multiplier,
        accounting.FixedOrder(setup.num_epochs, setup.steps_per_epoch),
        config.delta, target_epsilon=config.epsilon, method='zcdp')
  logging.info('%s: test accuracy %.4f +- %.4f over %d seeds (eps %s)',
               algorithm, mean, half, len(test), setup.epsilon)
  return {'algorithm': algorithm, 'learning_rate': point['learning_rate'],
          'clip': point['clip'],
          'grid_edge': sweeps.edge_report(picked, axes),
          'grid_searched': '; '.join(
              f'{axis} ' + ' '.join(f'{v:.4g}' for v in values)
              for axis, values in axes.items() if len(values) > 1),
          'num_train_final': int(final_data.train_y.shape[0]),
          'decay': decay if algorithm.startswith('srg') else '',
          'noise_multiplier': setup.noise_multiplier,
          'epsilon_spent': setup.epsilon if setup.epsilon is not None else '',
          'num_seeds': len(test), 'mean_test_accuracy': float(mean),
          'ci95': float(half), 'runs': test.tolist(), 'tuning': tuning_rows,
          'privacy': privacy}


def format_results(config: ml_collections.ConfigDict,
                   results: List[Dict[str, Any]]) -> str:
  """The results as a markdown table (test accuracy in %)."""
  lines = [
      f'{config.dataset}, {config.num_epochs} epoch(s) of '
      f'{results[0]["num_seeds"]} seeds; private runs at '
      f'({config.epsilon}, {config.delta})-DP via zCDP; batch '
      f'{config.batch_size}; hyperparameters tuned on a validation part of '
      'the training split; mean test accuracy with 95% interval.', '',
      '| algorithm | test accuracy (%) | lr | clip | c | noise multiplier | '
      'pick on a grid edge |',
      '|---|---|---|---|---|---|---|']
  for r in results:
    noise_multiplier = (f'{r["noise_multiplier"]:.3f}'
                        if r['algorithm'] != 'nonprivate' else '-')
    decay = '-' if r['decay'] == '' else f'{r["decay"]:.4g}'
    clip = '-' if r['algorithm'] == 'nonprivate' else f'{r["clip"]:g}'
    lines.append(
        f'| {r["algorithm"]} | {100 * r["mean_test_accuracy"]:.3f} +- '
        f'{100 * r["ci95"]:.3f} | {r["learning_rate"]:g} | {clip} | '
        f'{decay} | {noise_multiplier} | {r["grid_edge"] or "no"} |')
  paired = paired_differences({r['algorithm']: r['runs'] for r in results})
  if len(paired) > 2:
    lines += [''] + paired
  return '\n'.join(lines) + '\n'


PAIRS = (('srg_ones', 'dpmemf_ones'), ('srg_true', 'dpmemf_true'),
         ('dpmemf_true', 'dpmemf_ones'), ('srg_true', 'srg_ones'))


def paired_differences(runs: Dict[str, Sequence[float]]) -> List[str]:
  """Per-seed differences of test accuracy between algorithms, as lines.

  Seed s of every algorithm uses the same public batch order and noise key,
  so the per-seed difference removes the order's share of the variance (and
  all of the noise's when the two strategies are equal).

  Example:
    >>> paired_differences({'srg_true': [0.80, 0.81], 'dpmemf_true': [0.79,
    ...                     0.80]})

  Args:
    runs: algorithm -> test accuracy per seed (seeds in the same order).

  Returns:
    Markdown table lines: mean difference (points), 95% interval and the
    two-sided paired t-test p-value, for each pair of `PAIRS` present.
  """
  lines = ['| comparison (same seeds) | difference (points) | p (paired t) |',
           '|---|---|---|']
  for first, second in PAIRS:
    if first not in runs or second not in runs:
      continue
    diff = 100 * (np.asarray(runs[first]) - np.asarray(runs[second]))
    mean, _, _, half = sweeps.mean_and_interval(diff)
    p = stats.ttest_rel(runs[first], runs[second]).pvalue
    lines.append(f'| {first} - {second} | {mean:+.3f} +- {half:.3f} | '
                 f'{p:.3g} |')
  return lines


def plot(path: str, results: List[Dict[str, Any]]) -> None:
  """Mean test accuracy with 95% intervals, one point per algorithm.

  Points, not bars: a bar's length would be read from an axis that does not
  start at 0. The axis holds every interval whole.
  """
  fig, ax = plt.subplots(figsize=(7, 3.5))
  names = [r['algorithm'] for r in results]
  means = np.array([100 * r['mean_test_accuracy'] for r in results])
  halves = np.array([100 * r['ci95'] for r in results])
  ax.errorbar(names, means, yerr=halves, fmt='o', capsize=5,
              color='tab:blue')
  low, high = np.min(means - halves), np.max(means + halves)
  margin = max(0.5, 0.08 * (high - low))
  ax.set_ylim(low - margin, high + margin)
  ax.set_ylabel('test accuracy (%), mean and 95% interval')
  ax.grid(axis='y', alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(config: ml_collections.ConfigDict, output_dir: str
        ) -> List[Dict[str, Any]]:
  """Runs every algorithm of the config and writes the outputs.

  Args:
    config: the experiment config.
    output_dir: where the tables and the plot go.

  Returns:
    One result dict per algorithm.

  Raises:
    ValueError: for fewer than 2 seeds (the results are means with a 95%
      interval, which one seed does not have).
  """
  if int(config.num_seeds) < 2:
    raise ValueError('num_seeds must be at least 2: the results report a '
                     f'95% interval over seeds, got {config.num_seeds}')
  os.makedirs(output_dir, exist_ok=True)
  start = time.time()
  data = load_data(config)
  num_classes = int(max(int(data.train_y.max()), int(data.test_y.max())) + 1)
  logging.info('%s: %d train, %d validation, %d test examples, %d features',
               config.dataset, data.train_y.shape[0], data.val_y.shape[0],
               data.test_y.shape[0], data.train_x.shape[1])
  results = [tune_and_run(a, config, data, num_classes)
             for a in config.algorithms]
  outputs.write_csv(os.path.join(output_dir, 'results.csv'),
            [{k: v for k, v in r.items()
              if k not in ('runs', 'tuning', 'privacy')} for r in results])
  outputs.write_csv(os.path.join(output_dir, 'tuning.csv'),
            [row for r in results for row in r['tuning']])
  outputs.write_csv(os.path.join(output_dir, 'runs.csv'),
            [{'algorithm': r['algorithm'], 'seed': s, 'test_accuracy': v}
             for r in results for s, v in enumerate(r['runs'])])
  table = format_results(config, results)
  with open(os.path.join(output_dir, 'results.md'), 'w') as f:
    f.write(table)
  plot(os.path.join(output_dir, 'accuracy.png'), results)
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config,
                         privacy=[r['privacy'] for r in results
                                  if r['privacy'] is not None],
                         wall_seconds=time.time() - start))
  print(table)
  return results


if __name__ == '__main__':
  cli.launch(run, 'configs/srg_memf_digits.py',
             'DP-SRG-MEMF against DP-MEMF (paper 001 section 5); other '
             'configs: configs/srg_memf_*.py', output_dir='results/srg_memf')
