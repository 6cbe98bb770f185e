"""DIFF2-GD against DP-GD and non-private GD on tabular regression (paper 003 §6).

One-hidden-layer MLP (10 softplus units, squared loss), P = 10 IID clients
simulated on one device with `jax.vmap(..., axis_name='clients')`, R rounds
of full local data, (epsilon, 1e-5)-DP at item level (replace-one), noise
from Proposition 4.1 (`config.accounting='paper'`, u = 1.25) or from
dp_accounting. Every grid point runs all seeds (vmapped, with the learning
rates); for each seed and metric the hyperparameters with the smallest
minimum over rounds are kept (train loss and squared gradient norm by their
own criterion, test loss by train loss: the paper's protocol, App. A),
among runs whose train loss stays finite. The paper's patience rule (train
loss above 1.05 x its running minimum at 5 checks) is only reported: after
the fact it rejects nearly every noisy private curve. Selection uses the
training data, so it is not a private result, as in the paper.

    python -m experiments.diff2_tabular --config=configs/diff2_tabular.py \
        --output_dir=results/diff2_tabular

Writes `curves.csv` (mean and std over seeds per round), `summary.csv`
(per dataset, epsilon, algorithm and metric: minimum within R rounds and
final value, mean and std over seeds, chosen hyperparameters, and the
one-sided paired t-test DIFF2-GD < DP-GD on the per-seed minima, df =
seeds - 1), `summary.md`, one figure per dataset and epsilon, and
`runs_<dataset>.npz` (every run's metrics, to re-select offline).
"""

import csv
import math
import os
import time
from typing import Any, Dict, List, Sequence

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import matplotlib
matplotlib.use('Agg')
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
import ml_collections
import numpy as np
import optax
from scipy import stats

import dpsco_jax
from dpsco_jax.algorithms import diff2_accounting
from experiments import cli
from experiments import outputs
from experiments import tabular_data

AXIS = 'clients'
METRICS = ('train_loss', 'grad_norm_sq', 'test_loss')
# Which metric picks the hyperparameters of each reported metric.
SELECTED_BY = {'train_loss': 'train_loss', 'grad_norm_sq': 'grad_norm_sq',
               'test_loss': 'train_loss'}
PATIENCE, RISE = 5, 1.05


def init_params(key: jax.Array, dim: int, hidden: int) -> Dict[str, jax.Array]:
  """Uniform(+-1/sqrt(fan_in)) init (the paper prints +-sqrt(fan_in))."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  a, b = 1 / math.sqrt(dim), 1 / math.sqrt(hidden)
  return {'w1': jax.random.uniform(k1, (dim, hidden), minval=-a, maxval=a),
          'b1': jax.random.uniform(k2, (hidden,), minval=-a, maxval=a),
          'w2': jax.random.uniform(k3, (hidden,), minval=-b, maxval=b),
          'b2': jax.random.uniform(k4, (), minval=-b, maxval=b)}


def predict(params, x):
  hidden = jax.nn.softplus(x @ params['w1'] + params['b1'])
  return hidden @ params['w2'] + params['b2']


def example_loss(params, example):
  """Squared error of ONE example (what the private statistics clip)."""
  return (predict(params, example['x']) - example['y']) ** 2


def mean_loss(params, x, y):
  return jnp.mean((predict(params, x) - y) ** 2)


def client_objective(params, clients):
  """f = (1/P) sum_p f_p, each client by its own mean (paper §1.1)."""
  losses = jax.vmap(jax.vmap(example_loss, (None, 0)), (None, 0))(
      params, {'x': clients['x'], 'y': clients['y']})
  sizes = jnp.sum(clients['mask'], axis=1)
  per_client = jnp.sum(jnp.where(clients['mask'], losses, 0.0), 1) / sizes
  return jnp.mean(per_client)


def evaluate(params, clients, test):
  loss, grad = jax.value_and_grad(client_objective)(params, clients)
  grad_sq = sum(jnp.sum(g ** 2) for g in jax.tree_util.tree_leaves(grad))
  return jnp.stack([loss, grad_sq, mean_loss(params, test['x'], test['y'])])


def make_runner(algorithm: str, hyper: Dict[str, Any],
                config: ml_collections.ConfigDict):
  """A jitted `(lrs, params0, clients, test, keys) -> metrics`.

  Vmapped over learning rates and seeds: metrics `[lrs, seeds, evals, 3]`.
  """
  num_rounds, eval_every = config.num_rounds, config.eval_every

  def one_run(lr, params, clients, test, key):
    if algorithm == 'gd':
      tx = optax.sgd(lr)

      def round_fn(carry, _):
        params, state = carry
        grads = jax.grad(client_objective)(params, clients)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None
      state = tx.init(params)
    else:
      tx = dpsco_jax.diff2_gd(
          example_loss, learning_rate=lr, grad_clip=hyper['grad_clip'],
          diff_clip_factor=hyper.get('diff_clip_factor', 1.0),
          restart_interval=hyper['restart_interval'], num_rounds=num_rounds,
          noise_multipliers=hyper['noise_multipliers'], key=0,
          axis_name=AXIS)
      state = tx.init(params)
      # The seed's own noise key (the state holds the key).
      state = (state[0]._replace(noise=state[0].noise._replace(key=key)),) + (
          tuple(state[1:]))

      def client_step(params, state, x, y, mask):
        updates, state = tx.update(None, state, params,
                                   batch={'x': x, 'y': y}, batch_mask=mask)
        return optax.apply_updates(params, updates), state
      step = jax.vmap(client_step, in_axes=(None, None, 0, 0, 0),
                      out_axes=None, axis_name=AXIS)

      def round_fn(carry, _):
        params, state = carry
        return step(params, state, clients['x'], clients['y'],
                    clients['mask']), None

    def block(carry, _):
      carry, _ = jax.lax.scan(round_fn, carry, None, length=eval_every)
      return carry, evaluate(carry[0], clients, test)

    _, metrics = jax.lax.scan(block, (params, state), None,
                              length=num_rounds // eval_every)
    start = evaluate(params, clients, test)
    return jnp.concatenate([start[None], metrics])

  over_seeds = jax.vmap(one_run, in_axes=(None, 0, 0, 0, 0))
  return jax.jit(jax.vmap(over_seeds, in_axes=(0, None, None, None, None)))


def diverged(train_loss: np.ndarray) -> bool:
  """A run is discarded when its train loss is ever NaN or infinite."""
  return not np.all(np.isfinite(train_loss))


def rejected(train_loss: np.ndarray) -> bool:
  """The paper's early rejection (NaN, or patience 5 on a rising loss).

  Not used for selection: applied after the fact to whole 2000-round curves
  it rejects nearly every private run, whose loss plateaus with noise (the
  paper used it to stop a descending learning-rate search early). Kept to
  report how many runs it would have rejected.
  """
  if diverged(train_loss):
    return True
  patience, best = 0, np.inf
  for value in train_loss:
    if value < best:
      patience, best = 0, value
    elif value > RISE * best:
      patience += 1
      if patience >= PATIENCE:
        return True
  return False


def load(name: str, config: ml_collections.ConfigDict):
  if name == 'california':
    return tabular_data.load_california_housing(config.california_path)
  if name == 'gas_turbine':
    return tabular_data.load_gas_turbine(config.gas_turbine_path)
  if name == 'synthetic':
    return tabular_data.synthetic_regression(config.synthetic_examples,
                                             config.synthetic_dim)
  raise ValueError(f'unknown dataset {name!r}')


def seeded_data(name, config):
  """Per seed: split, clients, init params and noise key, stacked."""
  x, y = load(name, config)
  clients, tests, params, keys = [], [], [], []
  for seed in config.seeds:
    train, test = tabular_data.prepare(x, y, seed)
    c = tabular_data.split_clients(train, config.num_clients, seed)
    clients.append({'x': c.x, 'y': c.y, 'mask': c.mask})
    tests.append(test)
    params.append(init_params(jax.random.key(1000 + seed), x.shape[1],
                              config.hidden_units))
    keys.append(jax.random.key_data(jax.random.key(2000 + seed)))
  stack = lambda trees: jax.tree_util.tree_map(
      lambda *a: jnp.stack([jnp.asarray(v) for v in a]), *trees)
  sizes = c.sizes
  return (stack(params), stack(clients), stack(tests),
          jax.random.wrap_key_data(jnp.stack(keys)), sizes, x.shape[1])


def grid(algorithm: str, epsilon: float, config) -> List[Dict[str, Any]]:
  """Hyperparameter points (besides the vmapped learning rate)."""
  method, split = config.accounting, config.budget_split
  if algorithm == 'gd':
    return [{}]
  if algorithm == 'dp_gd':
    z = diff2_accounting.calibrate(config.num_rounds, 1, epsilon,
                                   config.delta, method=method)
    return [{'grad_clip': c, 'restart_interval': 1, 'noise_multipliers': z}
            for c in config.grad_clips]
  points = []
  for fraction in config.restart_fractions:
    interval = max(1, round(fraction * config.num_rounds))
    z = diff2_accounting.calibrate(config.num_rounds, interval, epsilon,
                                   config.delta, method=method,
                                   budget_split=split)
    for c1 in config.grad_clips:
      for c2 in config.diff_clip_factors:
        points.append({'grad_clip': c1, 'diff_clip_factor': c2,
                       'restart_interval': interval, 'noise_multipliers': z})
  return points


def run_algorithm(algorithm, epsilon, data, config, raw):
  """All grid points; returns per-seed selected curves and choices.

  Every run's metrics are also stored in `raw[(algorithm, epsilon)]` as
  `(hyperparameters, [seeds, evals, 3])` pairs.
  """
  params, clients, tests, keys, _, _ = data
  lrs = config.gd_learning_rates if algorithm == 'gd' else (
      config.learning_rates)
  candidates = []  # (label, metrics [seeds, evals, 3])
  for hyper in grid(algorithm, epsilon, config):
    start = time.perf_counter()
    metrics = np.asarray(make_runner(algorithm, hyper, config)(
        jnp.asarray(lrs, jnp.float32), params, clients, tests, keys))
    for i, lr in enumerate(lrs):
      label = dict(hyper, learning_rate=lr)
      label.pop('noise_multipliers', None)
      candidates.append((label, metrics[i]))
    logging.info('%s eps=%s %s: %d learning rates x %d seeds in %.1f s',
                 algorithm, epsilon,
                 {k: v for k, v in hyper.items() if k != 'noise_multipliers'},
                 len(lrs), len(config.seeds), time.perf_counter() - start)
  raw[(algorithm, epsilon)] = candidates
  selected = {}
  for metric in METRICS:
    criterion = METRICS.index(SELECTED_BY[metric])
    curves, choices = [], []
    for s in range(len(config.seeds)):
      best, best_value = None, np.inf
      for label, m in candidates:
        if diverged(m[s, :, 0]):
          continue
        value = np.min(m[s, :, criterion])
        if value < best_value:
          best, best_value = (label, m[s, :, METRICS.index(metric)]), value
      if best is None:  # every run diverged: report NaN honestly
        curves.append(np.full(candidates[0][1].shape[1], np.nan))
        choices.append(None)
      else:
        choices.append(best[0])
        curves.append(best[1])
    selected[metric] = (np.stack(curves), choices)
  return selected


def paired_p_value(diff2: np.ndarray, dpgd: np.ndarray) -> float:
  """One-sided paired t-test, alternative: DIFF2-GD's minimum is smaller."""
  if np.any(~np.isfinite(diff2)) or np.any(~np.isfinite(dpgd)):
    return float('nan')
  return float(stats.ttest_rel(diff2, dpgd, alternative='less').pvalue)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  config, output_dir = flags.FLAGS.config, flags.FLAGS.output_dir
  os.makedirs(output_dir, exist_ok=True)
  total_start = time.perf_counter()
  curve_rows, summary_rows = [], []
  rounds = np.arange(0, config.num_rounds + 1, config.eval_every)
  for name in config.datasets:
    data = seeded_data(name, config)
    sizes, dim = data[4], data[5]
    logging.info('%s: d = %d attributes, client sizes %s', name, dim,
                 sorted(set(sizes.tolist())))
    raw = {}
    nonprivate = (run_algorithm('gd', None, data, config, raw)
                  if 'gd' in config.algorithms else None)
    for epsilon in config.epsilons:
      # Non-private GD does not depend on epsilon: run once per data set.
      results = {a: nonprivate if a == 'gd' else
                 run_algorithm(a, epsilon, data, config, raw)
                 for a in config.algorithms}
      save_raw(os.path.join(output_dir, f'runs_{name}.npz'), raw)
      figure, axes = plt.subplots(1, 3, figsize=(15, 4))
      for k, metric in enumerate(METRICS):
        minima = {}
        for algorithm in config.algorithms:
          curves, choices = results[algorithm][metric]
          mean, std = np.mean(curves, 0), np.std(curves, 0)
          for r, m, s in zip(rounds, mean, std):
            curve_rows.append({'dataset': name, 'epsilon': epsilon,
                               'algorithm': algorithm, 'metric': metric,
                               'round': int(r), 'mean': m, 'std': s})
          # On a log axis a mean - std band falls below zero and fills the
          # plot; the median and the quartiles over seeds stay readable.
          lower, median, upper = np.quantile(curves, [0.25, 0.5, 0.75], 0)
          axes[k].plot(rounds, median, label=algorithm)
          axes[k].fill_between(rounds, lower, upper, alpha=0.25)
          minima[algorithm] = np.min(curves, axis=1)
          runs = raw[(algorithm, None if algorithm == 'gd' else epsilon)]
          per_seed = [m[s, :, 0] for _, m in runs
                      for s in range(len(config.seeds))]
          summary_rows.append({
              'dataset': name, 'epsilon': epsilon, 'algorithm': algorithm,
              'metric': metric,
              'min_mean': float(np.mean(minima[algorithm])),
              'min_std': float(np.std(minima[algorithm])),
              'final_mean': float(np.mean(curves[:, -1])),
              'final_std': float(np.std(curves[:, -1])),
              'runs': len(per_seed),
              'runs_diverged': sum(diverged(c) for c in per_seed),
              'runs_patience_rule_would_reject': sum(
                  rejected(c) for c in per_seed),
              'choices': '; '.join(str(c) for c in choices)})
        if 'diff2_gd' in minima and 'dp_gd' in minima:
          p = paired_p_value(minima['diff2_gd'], minima['dp_gd'])
          for row in summary_rows[-len(config.algorithms):]:
            row['p_diff2_less_than_dpgd'] = p
          axes[k].set_title(f'{metric} (p = {p:.3g})')
        else:
          axes[k].set_title(metric)
        axes[k].set_yscale('log')
        axes[k].set_xlabel('round')
        axes[k].legend()
      figure.suptitle(f'{name}, epsilon = {epsilon:g}, delta = '
                      f'{config.delta:g}, P = {config.num_clients}, '
                      f'{len(config.seeds)} seeds (median and quartiles)')
      figure.tight_layout()
      figure.savefig(os.path.join(output_dir, f'{name}_eps{epsilon:g}.png'),
                     dpi=90)
      plt.close(figure)
      write_outputs(output_dir, curve_rows, summary_rows)
  write_outputs(output_dir, curve_rows, summary_rows)
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, privacy=privacy_entries(config),
                         wall_seconds=time.perf_counter() - total_start,
                         extra={'experiment': 'experiments.diff2_tabular'}))
  logging.info('total wall time %.1f s', time.perf_counter() - total_start)


def privacy_entries(config) -> List[Dict[str, Any]]:
  """What every private grid point spends: its noise multipliers, its
  `dp_accounting` event and the epsilon, per target epsilon."""
  entries = []
  for epsilon in config.epsilons:
    for algorithm in config.algorithms:
      if algorithm == 'gd':
        continue
      seen = set()
      for point in grid(algorithm, epsilon, config):
        interval, z = point['restart_interval'], point['noise_multipliers']
        if interval in seen:
          continue
        seen.add(interval)
        event = diff2_accounting.diff2_dp_event(config.num_rounds, interval,
                                                z)
        entries.append({
            'name': f'{algorithm}, epsilon {epsilon:g}, T = {interval}',
            'noise_multipliers': z._asdict(), 'delta': config.delta,
            'target_epsilon': epsilon, 'accounting_method': config.accounting,
            'epsilon_spent': diff2_accounting.epsilon_spent(
                config.num_rounds, interval, z, config.delta,
                method=config.accounting),
            'dp_event': outputs.event_to_dict(event),
            'dp_event_repr': repr(event)})
  return entries


def save_raw(path: str, raw: Dict[Any, list]) -> None:
  """Every run's metrics (all grid points and seeds), to re-select offline."""
  arrays, labels = {}, []
  for (algorithm, epsilon), candidates in raw.items():
    for label, metrics in candidates:
      key = f'run{len(labels)}'
      arrays[key] = metrics
      labels.append(repr({'algorithm': algorithm, 'epsilon': epsilon,
                          **label}))
  np.savez_compressed(path, labels=np.array(labels), **arrays)


def write_outputs(output_dir, curve_rows, summary_rows):
  write_csv(os.path.join(output_dir, 'curves.csv'), curve_rows)
  write_csv(os.path.join(output_dir, 'summary.csv'), summary_rows)
  with open(os.path.join(output_dir, 'summary.md'), 'w') as f:
    f.write(markdown_table(summary_rows))


def write_csv(path: str, rows: List[Dict[str, Any]]) -> None:
  if not rows:
    return
  columns = list(dict.fromkeys(k for row in rows for k in row))
  with open(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)


def markdown_table(rows: List[Dict[str, Any]]) -> str:
  """Minimum within R rounds (mean +- std over seeds) and the p-values."""
  lines = ['| dataset | eps | metric | GD | DP-GD | DIFF2-GD | p (DIFF2 < DP-GD) |',
           '|---|---|---|---|---|---|---|']
  keys = dict.fromkeys((r['dataset'], r['epsilon'], r['metric'])
                       for r in rows)
  for dataset, epsilon, metric in keys:
    cells = {}
    p = float('nan')
    for r in rows:
      if (r['dataset'], r['epsilon'], r['metric']) == (dataset, epsilon,
                                                       metric):
        cells[r['algorithm']] = f"{r['min_mean']:.4g} +- {r['min_std']:.2g}"
        p = r.get('p_diff2_less_than_dpgd', p)
    lines.append(f"| {dataset} | {epsilon:g} | {metric} | "
                 f"{cells.get('gd', '-')} | {cells.get('dp_gd', '-')} | "
                 f"{cells.get('diff2_gd', '-')} | {p:.3g} |")
  return '\n'.join(lines) + '\n'


def define_flags() -> None:
  """The command-line flags; defined only when run as a program, so that
  importing this module next to other experiments defines no flags."""
  cli.define_config(
      'configs/diff2_tabular.py',
      'DIFF2-GD against DP-GD and GD across clients on tabular regression (paper 003)')
  flags.DEFINE_string('output_dir', 'results/diff2_tabular',
                      'Where to write CSVs and plots.')


if __name__ == '__main__':
  define_flags()
  app.run(main)
