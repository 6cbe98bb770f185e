"""Paper 002 on synthetic users: does the privacy cost fall like 1/sqrt(m)?

The population: items z = (x, y) with x uniform on the unit sphere of R^d
and y = x . w* + U[-noise, noise]; the loss f(w; z) = (x . w - y)^2 / 2 on
the ball ||w|| <= radius is convex, 1-smooth and L-Lipschitz with
L = radius + ||w*|| + noise, and its excess population risk is exact:

    F(w) - F(w*) = ||w - w*||^2 / (2 d)      (E x x^T = I / d).

With `--config.loss=absolute` the loss is |x . w - y| (1-Lipschitz,
non-smooth, minimized at w* too) and the excess risk is still exact (a
one-dimensional integral, `excess_risk`); Algorithm 3 then runs on its ball
smoothing (Section 4, Theorem 4.1's radius).

n users hold m i.i.d. items each. Every method meets the same user-level
(epsilon, delta) under replace-one-user, the paper's relation:

* `item_dpsgd`: DP-SGD on the n m items (Poisson, add/remove), calibrated
  to (epsilon / (2m), delta / (2m e^epsilon)): replacing a user is 2m
  add/remove steps, and group privacy over 2m steps gives (epsilon, delta);
* `user_dpsgd`: user-level DP-SGD (Poisson over users, add/remove),
  calibrated to (epsilon / 2, delta / (1 + e^(epsilon/2))), which is
  (epsilon, delta) under replace-one;
* `phased_sgd`: Algorithm 1 (`user_level.phased_sgd`, the practical
  preset: the fewest groups whose score test costs at most epsilon / 2);
* `accelerated_erm`: Algorithm 3 with Algorithm 2
  (`user_level.accelerated_phased_erm`, the practical preset).

Each method's grid (DP-SGD: learning rate x clip; Algorithm 1: tau scale x
learning-rate multiplier; Algorithm 3: tau) is searched on `tuning_seeds`,
disjoint from the `seeds` reported; a pick on a grid edge extends that axis
past it (up to `grid_extensions` times) and a pick still on an edge is
flagged in the table.

    python -m experiments.user_level_synthetic --output_dir=results/user_level
    python -m experiments.user_level_synthetic --config.loss=absolute \
        --config.methods="('user_dpsgd','accelerated_erm')" \
        --config.erm_max_steps=100 --output_dir=results/user_level_absolute

Writes `runs.csv`, `summary.csv`, `summary.md`, `excess_risk.png` and
`run_record.json`. Results: docs/user_level_synthetic/README.md.
"""

import math
import os
import time
import warnings
from typing import Any, Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dpsco_jax import clipping
from dpsco_jax import plans
from dpsco_jax import user_level
from experiments import cli
from experiments import outputs
from experiments import quickstart
from experiments import spine
from experiments import sweeps

Row = dict[str, Any]
LOSSES = ('squared', 'absolute')



def lipschitz(config: ml_collections.ConfigDict) -> float:
  """L of the loss on the ball.

  Squared: |x . w - y| ||x|| <= radius + ||w*|| + noise; absolute: ||x|| = 1.
  """
  if config.loss == 'absolute':
    return 1.0
  return config.radius + config.target_norm + config.noise


def target(config: ml_collections.ConfigDict) -> np.ndarray:
  """w*, of norm `target_norm` in a direction fixed by `problem_seed`."""
  rng = np.random.default_rng(quickstart.seed_for(config.problem_seed, 'w'))
  w = rng.normal(size=config.dimension)
  return (config.target_norm * w / np.linalg.norm(w)).astype(np.float32)


def make_users(config: ml_collections.ConfigDict, m: int,
               seed: int) -> clipping.UserBatch:
  """n users with m fresh items each: leaves `[n, m, ...]`."""
  rng = np.random.default_rng(quickstart.seed_for(seed, f'data{m}'))
  shape = (config.num_users, m, config.dimension)
  x = rng.normal(size=shape).astype(np.float32)
  x /= np.linalg.norm(x, axis=-1, keepdims=True)
  y = x @ target(config) + rng.uniform(-config.noise, config.noise,
                                       shape[:2]).astype(np.float32)
  return clipping.UserBatch({'x': x, 'y': y.astype(np.float32)})


def loss_fn(w: jax.Array, item: Any) -> jax.Array:
  """(x . w - y)^2 / 2 for one item."""
  return 0.5 * (item['x'] @ w - item['y']) ** 2


def absolute_loss_fn(w: jax.Array, item: Any) -> jax.Array:
  """|x . w - y| for one item (1-Lipschitz, non-smooth)."""
  return jnp.abs(item['x'] @ w - item['y'])


def loss_of(config: ml_collections.ConfigDict) -> Callable:
  """The config's per-item loss."""
  if config.loss not in LOSSES:
    raise ValueError(f'loss must be one of {LOSSES}, got {config.loss!r}')
  return absolute_loss_fn if config.loss == 'absolute' else loss_fn


def excess_risk(config: ml_collections.ConfigDict, w: Any) -> float:
  """F(w) - F(w*), exactly.

  Squared loss: ||w - w*||^2 / (2 d) (E x x^T = I / d). Absolute loss, with
  a = x . (w - w*) and xi ~ U[-s, s]: E_xi |a - xi| - E_xi |xi| is
  a^2 / (2 s) for |a| <= s and |a| - s/2 beyond; a = ||w - w*|| t with t
  the first coordinate of a uniform unit vector (density proportional to
  (1 - t^2)^((d - 3)/2)), integrated by Gauss-Legendre quadrature.
  """
  w = np.asarray(w, np.float64)
  gap = float(np.linalg.norm(w - target(config)))
  d = config.dimension
  if config.loss != 'absolute':
    return gap ** 2 / (2 * d)
  s = config.noise
  nodes, weights = np.polynomial.legendre.leggauss(400)
  density = (1 - nodes ** 2) ** ((d - 3) / 2)
  a = np.abs(gap * nodes)
  excess = np.where(a <= s, a ** 2 / (2 * s), a - s / 2)
  return float(np.sum(weights * density * excess) / np.sum(weights * density))


def run_dpsgd(config, users, m, seed, *, item_level: bool,
              learning_rate: float, clip: float) -> float:
  """Item- or user-level DP-SGD; returns the excess risk of its last point."""
  n = config.num_users
  epsilon, delta = config.epsilon, config.delta
  common = dict(optimizer=optax.sgd(learning_rate), epochs=config.epochs,
                l2_clip=clip, seed=quickstart.seed_for(seed, 'batches'),
                key=jax.random.key(quickstart.seed_for(seed, 'noise')))
  if item_level:
    data = jax.tree_util.tree_map(
        lambda leaf: leaf.reshape((n * m,) + leaf.shape[2:]), users.items)
    steps = 2 * m
    plan = plans.dpsgd(loss_of(config), num_examples=n * m,
                       batch_size=config.users_per_batch * m,
                       epsilon=epsilon / steps,
                       delta=delta / (steps * math.exp(epsilon)), **common)
  else:
    data = users
    plan = plans.user_level_dpsgd(
        loss_of(config), num_users=n, users_per_batch=config.users_per_batch,
        epsilon=epsilon / 2, delta=delta / (1 + math.exp(epsilon / 2)),
        **common)
  w0 = jnp.zeros(config.dimension)
  result = spine.run_plan(
      'item_dpsgd' if item_level else 'user_dpsgd', plan, w0, data,
      evaluate=lambda w: {}, eval_every=plan.num_steps)
  w = result.params
  norm = float(jnp.linalg.norm(w))
  if norm > config.radius:  # the constraint set (post-processing)
    w = w * (config.radius / norm)
  return excess_risk(config, w)


def run_phased_sgd(config, users, m, seed, *, tau_scale: float,
                   learning_rate_scale: float) -> float:
  """Algorithm 1 from the practical preset; the excess risk of its output."""
  kwargs, _ = user_level.phased_sgd_preset(
      config.num_users, m, config.dimension, config.epsilon, config.delta,
      lipschitz=lipschitz(config), diameter=2 * config.radius,
      mode='practical', tau_scale=tau_scale,
      phase_decay=config.phase_decay)
  kwargs['learning_rate'] *= learning_rate_scale
  out = user_level.phased_sgd(
      loss_of(config), jnp.zeros(config.dimension), users,
      key=jax.random.key(quickstart.seed_for(seed, 'noise')), **kwargs)
  return excess_risk(config, out.params)


def run_accelerated_erm(config, users, m, seed, *,
                        tau_fraction: float) -> float:
  """Algorithm 3 from the practical preset; the excess risk of its output."""
  n, d = config.num_users, config.dimension
  smoothing_radius = None
  smoothness = 1.0
  if config.loss == 'absolute':
    # Theorem 4.1: r = sqrt(d) R / (eps n sqrt(m)), and the smoothed loss is
    # L sqrt(d) / r smooth (Lemma D.1).
    smoothing_radius = (math.sqrt(d) * 2 * config.radius /
                        (config.epsilon * n * math.sqrt(m)))
    smoothness = lipschitz(config) * math.sqrt(d) / smoothing_radius
  kwargs, _ = user_level.accelerated_phased_erm_preset(
      n, m, d, config.epsilon, config.delta,
      lipschitz=lipschitz(config), diameter=2 * config.radius,
      smoothness=smoothness, mode='practical',
      tau=tau_fraction * lipschitz(config), phase_decay=config.phase_decay,
      max_steps=config.erm_max_steps)
  out = user_level.accelerated_phased_erm(
      loss_of(config), jnp.zeros(d), users,
      key=jax.random.key(quickstart.seed_for(seed, 'noise')),
      smoothing_radius=smoothing_radius, **kwargs)
  return excess_risk(config, out.params)


def method_grid(config: ml_collections.ConfigDict,
                method: str) -> dict[str, list[float]]:
  """The hyperparameter axes searched for `method`."""
  if method in ('item_dpsgd', 'user_dpsgd'):
    return {'learning_rate': list(config.dpsgd_learning_rates),
            'clip': list(config.dpsgd_clips)}
  if method == 'phased_sgd':
    return {'tau_scale': list(config.phased_tau_scales),
            'learning_rate_scale': list(config.phased_learning_rate_scales)}
  return {'tau_fraction': list(config.erm_tau_fractions)}


def runner(method: str) -> Callable[..., float]:
  """The run function of `method`."""
  if method == 'item_dpsgd':
    return lambda *a, **k: run_dpsgd(*a, item_level=True, **k)
  if method == 'user_dpsgd':
    return lambda *a, **k: run_dpsgd(*a, item_level=False, **k)
  if method == 'phased_sgd':
    return run_phased_sgd
  return run_accelerated_erm


def tune(config, method: str, m: int, data_of) -> tuple[dict, dict, list]:
  """Picks `method`'s hyperparameters on the tuning seeds.

  Returns `(picked, grid searched, tuning rows)`; the grid is extended past
  an edge pick up to `grid_extensions` times (`sweeps.search_with_extension`).
  """
  def score(**point):
    risks = []
    for seed in config.tuning_seeds:
      try:
        risks.append(runner(method)(config, data_of(seed), m, seed, **point))
      except ValueError as error:  # infeasible at this m (e.g. K > n_i)
        logging.warning('%s m=%d %s: %s', method, m, point, error)
        risks.append(math.inf)
    return float(np.mean(risks))

  picked, grid, scores = sweeps.search_with_extension(
      method_grid(config, method), score,
      extensions=config.grid_extensions)
  rows = [{'method': method, 'm': m, **dict(zip(grid, values)),
           'tuning_excess_risk': value} for values, value in scores.items()]
  return picked, grid, rows


def run(config: ml_collections.ConfigDict, output_dir: str) -> list[Row]:
  """The whole study; writes the outputs and returns the summary rows."""
  os.makedirs(output_dir, exist_ok=True)
  start = time.time()
  warnings.simplefilter('ignore', UserWarning)
  runs, summary, tuning_rows = [], [], []
  for m in config.items_per_user:
    cache: dict[int, clipping.UserBatch] = {}

    def data_of(seed, m=m, cache=cache):
      if seed not in cache:
        cache.clear()
        cache[seed] = make_users(config, m, seed)
      return cache[seed]

    for method in config.methods:
      picked, grid, rows = tune(config, method, m, data_of)
      tuning_rows.extend(rows)
      risks = []
      for seed in config.seeds:
        try:
          risk = runner(method)(config, data_of(seed), m, seed, **picked)
        except ValueError as error:
          logging.warning('%s m=%d: %s', method, m, error)
          risk = math.inf
        risks.append(risk)
        runs.append({'method': method, 'm': m, 'seed': seed, **picked,
                     'excess_risk': risk})
      finite = np.isfinite(risks)
      mean, _, count, half = sweeps.mean_and_interval(
          np.asarray(risks)[finite]) if finite.any() else (
              math.inf, 0, 0, math.inf)
      edges = [f'{axis} {sweeps.grid_edge(grid[axis], picked[axis])}'
               for axis in grid if sweeps.grid_edge(grid[axis], picked[axis])]
      summary.append({'m': m, 'method': method, 'excess_risk': float(mean),
                      'ci95': float(half), 'runs': int(count),
                      **{k: v for k, v in picked.items()},
                      'grid_edge': '; '.join(edges)})
      logging.info('m=%d %s: %.3g +- %.2g (%s)%s', m, method, mean, half,
                   picked, f' EDGE {edges}' if edges else '')
      outputs.write_csv(os.path.join(output_dir, 'runs.csv'), runs)
  outputs.write_csv(os.path.join(output_dir, 'summary.csv'), summary)
  outputs.write_csv(os.path.join(output_dir, 'tuning.csv'), tuning_rows)
  write_table(config, summary, os.path.join(output_dir, 'summary.md'))
  plot(config, summary, os.path.join(output_dir, 'excess_risk.png'))
  outputs.write_json(os.path.join(output_dir, 'run_record.json'),
                     outputs.run_record(config, wall_seconds=time.time() -
                                        start, extra={
                                            'experiment':
                                                'experiments.user_level_synthetic'}))
  return summary


def write_table(config, summary: Sequence[Row], path: str) -> None:
  """Excess risk, mean and 95% interval, one row per m, one column per method."""
  lines = ['| m | ' + ' | '.join(config.methods) + ' |',
           '|---|' + '---|' * len(config.methods)]
  for m in config.items_per_user:
    cells = []
    for method in config.methods:
      row = next(r for r in summary if r['m'] == m and r['method'] == method)
      flag = f" (edge: {row['grid_edge']})" if row['grid_edge'] else ''
      cells.append(f"{row['excess_risk']:.3g} ± {row['ci95']:.2g}{flag}")
    lines.append(f'| {m} | ' + ' | '.join(cells) + ' |')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')


def plot(config, summary: Sequence[Row], path: str) -> None:
  """Excess risk against m, log-log, with 95% bands."""
  curves = []
  for method in config.methods:
    rows = [r for r in summary if r['method'] == method and
            math.isfinite(r['excess_risk'])]
    x = [r['m'] for r in rows]
    y = [r['excess_risk'] for r in rows]
    lower = [max(r['excess_risk'] - r['ci95'], 1e-12) for r in rows]
    upper = [r['excess_risk'] + r['ci95'] for r in rows]
    curves.append(outputs.Curve(method, x, y, lower, upper))
  outputs.plot_curves(
      path, curves, xlabel='items per user m', ylabel='excess risk',
      title=f'n = {config.num_users} users, d = {config.dimension}, '
      f'user-level (eps, delta) = ({config.epsilon:g}, {config.delta:g})',
      xscale='log', yscale='log', markers=True,
      xticks=list(config.items_per_user))


if __name__ == '__main__':
  cli.launch(run, 'configs/user_level_synthetic.py',
             'Paper 002: user-level DP methods over items per user m',
             output_dir='results/user_level',
             output_help='Where the CSVs, the table, the plot and the run '
             'record are written.')
