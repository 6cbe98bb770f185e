"""Paper 004 on a nonsmooth nonconvex problem with known structure.

The population: examples xi in R^d at distance `spread` from 0 in a uniform
direction; the loss is the distance to the sphere of radius r around xi,

    f(x; xi) = | ||x - xi|| - r |,

exactly 1-Lipschitz (L = 1, and ||grad f|| = 1 almost everywhere: no
plateau where noise could find a spurious stationary point), nonsmooth (at
xi and on the sphere) and nonconvex (inside the sphere it decreases away
from xi). F = E f depends on ||x|| only: its stationary points are 0 (a
local maximum) and the sphere ||x|| = rho* (the minimizers, rho* close to
r). The runs start at distance `start_distance` > r from 0, where ||grad F||
is about 0.97, so reaching the minimizing sphere takes a movement of about
`start_distance - r`, and noise (which pushes ||x|| up in high dimension)
never helps.

The measure is paper 004's target, Goldstein stationarity: the norm of the
average gradient over the alpha-ball around the output,

    ||grad F_alpha(x)|| = ||E_{y ~ B(x, alpha), xi} grad f(y; xi)||,

estimated from `proxy_samples` fresh (y, xi) pairs (its floor, the proxy
at the stationary point 0, is a column of the summary).

Two studies, one command each:

* `--config.study=dimension` (6a): at matched (epsilon, delta) and the same
  single pass over n examples, O2NC (Algorithm 2) with the zero-order
  oracle (Algorithm 3) clipped at the effective sensitivity (the
  concentration radius) against the worst-case one (L d), the first-order
  oracle (Algorithm 5), and DP-SGD (Poisson, several epochs) as the
  first-order baseline, over d. The O2NC step is eta = multiplier * D /
  (G_1 sqrt(M)) (Proposition 2.6 with G_1 = L + the oracle's noise norm);
  the multiplier (DP-SGD: the learning rate) is picked per method and d on
  `tuning_seeds` seeds disjoint from the `seeds` reported; a pick on the
  grid's edge extends the grid past it (up to `grid_extensions` values),
  and a pick still on an edge is flagged.
* `--config.study=sensitivity`: no training; the clips and noise of each
  O2NC method over a wider range of d (`sensitivity_dimensions`), where the
  sqrt(d) law of the effective clips shows directly.
* `--config.study=passes` (6b): the multi-pass ERM oracle (Algorithm 4,
  and its first-order variant) against the single-pass one (Algorithms 3
  and 5) on the same n examples, with
  the loss evaluations (zero-order oracle calls) each made and the proxy of
  both the population and the empirical loss.

    python -m experiments.nonsmooth_synthetic --output_dir=results/nonsmooth
    python -m experiments.nonsmooth_synthetic --config.study=passes \
        --output_dir=results/nonsmooth_passes

Writes `runs.csv` (every run), `summary.csv` and `summary.md` (mean and
95% interval over the reported seeds, the pick and its edge flag), a plot
and `run_record.json` to `--output_dir`. Results: docs/nonsmooth_synthetic.md.
"""

from concurrent import futures
import functools
import itertools
import json
import math
import multiprocessing
import os
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dpsco_jax import nonsmooth
from dpsco_jax import plans
from dpsco_jax import smoothing
from experiments import cli
from experiments import outputs
from experiments import quickstart
from experiments import spine
from experiments import sweeps

O2NC_METHODS = {'zero_effective': ('zero', 'effective'),
                'zero_worst_case': ('zero', 'worst_case'),
                'first_order': ('first', 'effective')}
METHODS = (*O2NC_METHODS, 'dpsgd')
STUDIES = ('dimension', 'passes', 'sensitivity')
Row = dict[str, Any]
# (method, d, n, m, multi_pass) -> the noise multiplier: the calibration
# depends on neither the seed nor the step size.
_CALIBRATED: dict[tuple[Any, ...], Any] = {}


class Problem(NamedTuple):
  """The start point of one dimension.

  Attributes:
    start: x_0, at `start_distance` from 0 in a direction fixed by
      `problem_seed`.
  """

  start: jax.Array


def unit_vectors(key: jax.Array, num: int, dimension: int) -> jax.Array:
  """`num` independent directions uniform on the unit sphere of R^d."""
  g = jax.random.normal(key, (num, dimension))
  return g / jnp.linalg.norm(g, axis=1, keepdims=True)


def make_problem(config: ml_collections.ConfigDict, dimension: int
                 ) -> Problem:
  """The start point of dimension d (from `problem_seed`)."""
  key = jax.random.key(quickstart.seed_for(config.problem_seed,
                                           f'd{dimension}'))
  return Problem(config.start_distance * unit_vectors(key, 1, dimension)[0])


def sample(config: ml_collections.ConfigDict, problem: Problem,
           key: jax.Array, num: int) -> jax.Array:
  """`num` i.i.d. examples xi of the population, shape [num, d]."""
  return config.spread * unit_vectors(key, num, problem.start.shape[0])


@functools.lru_cache(maxsize=None)
def example_loss(radius: float) -> Callable[[jax.Array, jax.Array],
                                            jax.Array]:
  """`loss(x, xi) = | ||x - xi|| - r |`; 1-Lipschitz, so L = 1."""

  def loss(x: jax.Array, xi: jax.Array) -> jax.Array:
    # The 1e-12 keeps the gradient finite at x = xi (norm < 1 there).
    return jnp.abs(jnp.sqrt(jnp.sum((x - xi) ** 2) + 1e-12) - radius)

  return loss


@functools.partial(jax.jit, static_argnames=('loss_fn', 'num_samples'))
def goldstein_proxy(loss_fn, x: jax.Array, examples: jax.Array,
                    key: jax.Array, radius: float, num_samples: int
                    ) -> jax.Array:
  """||mean of grad f(y_k; xi_k)||, y_k uniform in the ball B(x, radius).

  `examples` are the xi's: `num_samples` fresh population draws (the proxy
  of F) or the training set, cycled (the proxy of the empirical loss).
  """
  points = jax.vmap(lambda k: x + smoothing.ball_point(k, x, radius))(
      jax.random.split(key, num_samples))
  xis = examples[jnp.arange(num_samples) % examples.shape[0]]
  grads = jax.vmap(jax.grad(loss_fn))(points, xis)
  return jnp.linalg.norm(jnp.mean(grads, axis=0))


def num_directions(config: ml_collections.ConfigDict, order: str,
                   dimension: int) -> int:
  """m: the first-order m, or `directions_per_dimension * d` (zero order;
  `passes_directions_per_dimension * d` in the 'passes' study)."""
  if order == 'first':
    return config.first_order_directions
  return dimension * (config.passes_directions_per_dimension
                      if config.study == 'passes' else
                      config.directions_per_dimension)


def o2nc_plan(config: ml_collections.ConfigDict, method: str, dimension: int,
              scale: float, seed: int, *, multi_pass: bool = False,
              num_examples: int, directions: int,
              noise_multiplier: Any = None) -> plans.Plan:
  """The single-pass (or multi-pass) private O2NC plan of `method`.

  The step is Proposition 2.6's times `scale` (`learning_rate=
  'proposition_2_6'`: eta = scale D / ((L + G_0) sqrt(M)), G_0 the norm of
  the oracle's released noise). Calibrated to the config's epsilon, or with
  the given `noise_multiplier` (the epsilon is then computed: the same
  value for runs that differ only in their seed or step).
  """
  order, sensitivity = O2NC_METHODS[method]
  if noise_multiplier is None:
    privacy = dict(epsilon=config.epsilon)
  elif multi_pass:
    privacy = dict(noise_multipliers=noise_multiplier)
  else:
    privacy = dict(noise_multiplier=noise_multiplier)
  common = dict(
      order=order, num_examples=num_examples, dimension=dimension,
      lipschitz=1.0, smoothing_radius=config.smoothing_radius,
      movement_radius=config.movement_radius,
      learning_rate=nonsmooth.PROPOSITION_2_6, learning_rate_scale=scale,
      block_length=config.block_length, period=config.period,
      num_directions=directions, delta=config.delta, sensitivity=sensitivity,
      **privacy,
      key=jax.random.key(quickstart.seed_for(seed, 'noise')))
  loss = example_loss(config.sphere_radius)
  if multi_pass:
    return plans.nonsmooth_multi_pass(loss, num_steps=config.passes_num_steps,
                                      **common)
  passes = config.study == 'passes'
  return plans.nonsmooth_single_pass(
      loss, anchor_batch_size=(config.passes_anchor_batch_size if passes else
                               config.anchor_batch_size),
      batch_size=config.passes_batch_size if passes else config.batch_size,
      seed=quickstart.seed_for(seed, 'batches'), **common)


def evaluate_output(config, problem: Problem, x: jax.Array, seed: int,
                    train: jax.Array) -> Row:
  """The population and empirical Goldstein proxies and loss at `x`."""
  loss = example_loss(config.sphere_radius)
  key = jax.random.key(quickstart.seed_for(seed, 'proxy'))
  fresh = sample(config, problem, jax.random.fold_in(key, 0),
                 config.proxy_samples)
  return {
      'proxy': float(goldstein_proxy(loss, x, fresh, jax.random.fold_in(
          key, 1), config.smoothing_radius, config.proxy_samples)),
      'empirical_proxy': float(goldstein_proxy(
          loss, x, train, jax.random.fold_in(key, 2),
          config.smoothing_radius, config.proxy_samples)),
      'loss': float(jnp.mean(jax.vmap(loss, (None, 0))(x, fresh))),
      'norm': float(jnp.linalg.norm(x)),
  }


def run_one(config: ml_collections.ConfigDict, method: str, dimension: int,
            value: float, seed: int, *, multi_pass: bool = False
            ) -> tuple[Row, plans.Plan]:
  """One run of `method` (O2NC step multiplier or DP-SGD rate `value`)."""
  problem = make_problem(config, dimension)
  n = config.passes_num_examples if config.study == 'passes' else (
      config.num_examples)
  train = sample(config, problem, jax.random.key(
      quickstart.seed_for(seed, 'data')), n)
  loss = example_loss(config.sphere_radius)
  start = time.perf_counter()
  evaluate = lambda x: {}
  if method == 'dpsgd':
    plan = plans.dpsgd(
        loss, optimizer=optax.sgd(value), num_examples=n,
        batch_size=config.dpsgd_batch_size, epochs=config.dpsgd_epochs,
        l2_clip=1.0, epsilon=config.epsilon, delta=config.delta,
        seed=quickstart.seed_for(seed, 'batches'),
        key=jax.random.key(quickstart.seed_for(seed, 'noise')))
    result = spine.run_plan(method, plan, problem.start, train,
                            evaluate=evaluate, eval_every=plan.num_steps)
    out, last, noise, learning_rate = result.params, result.params, math.nan, (
        value)
  else:
    order = O2NC_METHODS[method][0]
    directions = num_directions(config, order, dimension)
    calibration = (method, dimension, n, directions, multi_pass)
    if calibration not in _CALIBRATED:  # the same for every seed and step
      _CALIBRATED[calibration] = o2nc_plan(
          config, method, dimension, value, seed, multi_pass=multi_pass,
          num_examples=n, directions=directions).noise_multiplier
    plan = o2nc_plan(config, method, dimension, value, seed,
                     multi_pass=multi_pass, num_examples=n,
                     directions=directions,
                     noise_multiplier=_CALIBRATED[calibration])
    noise = plan.hyperparameters['released_noise_norm']
    learning_rate = plan.hyperparameters['learning_rate']
    if plan.epsilon > config.epsilon * (1 + 1e-6):
      raise RuntimeError(f'{method}: epsilon {plan.epsilon} above the target')
    result = spine.run_plan(method, plan, problem.start, train,
                            evaluate=evaluate, eval_every=plan.num_steps)
    out = nonsmooth.o2nc_output(result.opt_state, 'uniform')
    last = nonsmooth.o2nc_output(result.opt_state, 'last')
  metrics = evaluate_output(config, problem, out, seed, train)
  del evaluate
  last_metrics = evaluate_output(config, problem, last, seed, train)
  clips = plan.hyperparameters.get('clips', {'anchor': 1.0,
                                             'difference': math.nan})
  row = {'method': method + ('_multi_pass' if multi_pass else ''),
         'dimension': dimension, 'value': value,
         'learning_rate': learning_rate, 'seed': seed,
         'num_steps': plan.num_steps, 'epsilon': plan.epsilon,
         'noise_multiplier': str(plan.noise_multiplier),
         'anchor_clip': clips['anchor'], 'difference_clip': clips['difference'],
         'noise_norm': noise, **metrics,
         'proxy_last_block': last_metrics['proxy'],
         'loss_evaluations': loss_evaluations(plan, n),
         'wall_seconds': time.perf_counter() - start}
  return row, plan


def loss_evaluations(plan: plans.Plan, num_examples: int) -> float:
  """Oracle calls of a run: loss values (zero order) or gradients.

  Zero order: 2 m loss values per estimate; first order: m gradients; a
  difference step makes two estimates per example. DP-SGD: one gradient
  per sampled example (expected).
  """
  hyper = plan.hyperparameters
  if 'order' not in hyper:
    return float(plan.num_steps * hyper.get('batch_size', num_examples))
  per_estimate = (2 if hyper['order'] == 'zero' else 1)
  period, steps = hyper['period'], plan.num_steps
  anchors = math.ceil(steps / period)
  if plan.batches is None:
    anchor_batch = batch = num_examples
  else:
    anchor_batch, batch = hyper['anchor_batch_size'], hyper['batch_size']
  return float(per_estimate * (
      anchors * anchor_batch * hyper['anchor_directions'] +
      (steps - anchors) * batch * 2 * hyper['num_directions']))


def tune_and_report(config: ml_collections.ConfigDict, method: str,
                    dimension: int, multi_pass: bool = False
                    ) -> tuple[list[Row], Row]:
  """One job: picks the step on the tuning seeds, then runs the reported ones.

  The pick minimizes the mean proxy at the LAST block average over the
  tuning seeds: the algorithm's x_out is one uniform draw among the blocks,
  whose spread (an early block is as likely as the last) would make the pick
  a lottery. Both are reported.
  """
  grid = (config.dpsgd_learning_rates if method == 'dpsgd' else
          config.learning_rate_multipliers)
  name = method + ('_multi_pass' if multi_pass else '')
  progress = outputs.Progress(f'{name} d={dimension}',
                              len(grid) * config.tuning_seeds + config.seeds)
  runs, means = [], {}

  def tune(value: float) -> None:
    proxies = []
    for seed in range(10_000, 10_000 + config.tuning_seeds):
      row, _ = run_one(config, method, dimension, value, seed,
                       multi_pass=multi_pass)
      runs.append({**row, 'phase': 'tuning'})
      proxies.append(row['proxy_last_block'])
      progress.update(len(runs), proxy_last_block=row['proxy_last_block'])
    means[value] = float(np.mean(proxies)) if np.all(
        np.isfinite(proxies)) else math.inf

  grid = sorted(grid)
  for value in grid:
    tune(value)
  picked = min(grid, key=lambda v: means[v])
  # A pick on the grid's edge may hide a better value beyond it: extend the
  # grid geometrically past that edge until the pick is interior (at most
  # `grid_extensions` values).
  for _ in range(config.grid_extensions):
    edge = sweeps.grid_edge(grid, picked)
    if not edge or len(grid) < 2:
      break
    if edge == 'lower':
      grid.insert(0, grid[0] * grid[0] / grid[1])
      tune(grid[0])
    else:
      grid.append(grid[-1] * grid[-1] / grid[-2])
      tune(grid[-1])
    picked = min(grid, key=lambda v: means[v])
  reported = []
  for seed in range(config.seeds):
    row, _ = run_one(config, method, dimension, picked, seed,
                     multi_pass=multi_pass)
    reported.append(row)
    runs.append({**row, 'phase': 'reported'})
    progress.update(len(runs), proxy_last_block=row['proxy_last_block'])
  summary = {'method': name, 'dimension': dimension, 'picked': picked,
             'grid_edge': sweeps.grid_edge(grid, picked),
             'grid': ' '.join(f'{v:.3g}' for v in grid)}
  for metric in ('proxy', 'proxy_last_block', 'empirical_proxy', 'loss',
                 'norm'):
    mean, _, n, half = sweeps.mean_and_interval(
        [r[metric] for r in reported])
    summary[metric] = float(mean)
    summary[f'{metric}_ci'] = float(half)
  for key in ('learning_rate', 'num_steps', 'epsilon', 'noise_multiplier',
              'anchor_clip', 'difference_clip', 'noise_norm',
              'loss_evaluations'):
    summary[key] = reported[0][key]
  summary['seeds'] = int(n)
  summary['proxy_at_stationary_point'] = stationary_floor(config, dimension)
  logging.info('%s d=%d: proxy at x_out %.4f +- %.4f, last block %.4f +- '
               '%.4f (pick %g%s)', name, dimension, summary['proxy'],
               summary['proxy_ci'], summary['proxy_last_block'],
               summary['proxy_last_block_ci'], picked,
               f', on the {summary["grid_edge"]} edge' if summary['grid_edge']
               else '')
  return runs, summary


def _job(config_dict: dict, cache_dir: Optional[str], job: tuple[Any, ...]
         ) -> tuple[list[Row], Row]:
  """A job in a worker process (spawned: its own JAX runtime)."""
  logging.set_verbosity(logging.INFO)
  if cache_dir:
    enable_compilation_cache(cache_dir)
  return tune_and_report(ml_collections.ConfigDict(config_dict), *job)


def enable_compilation_cache(cache_dir: str) -> None:
  """Runs that differ only in their seed compile to the same program, and
  their noise keys are constants of it: the persistent cache still saves the
  compilations of the evaluation functions and of repeated shapes."""
  jax.config.update('jax_compilation_cache_dir', cache_dir)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)


def stationary_floor(config, dimension: int) -> float:
  """The proxy at x* = 0: the Monte Carlo floor of the measure."""
  problem = make_problem(config, dimension)
  train = sample(config, problem, jax.random.key(1), 16)
  return evaluate_output(config, problem, jnp.zeros(dimension), 0,
                         train)['proxy']


def run(config: ml_collections.ConfigDict, output_dir: str,
        cache_dir: Optional[str] = None) -> list[Row]:
  """Runs the config's study; writes the outputs; returns the summary rows.

  Args:
    config: see `configs/nonsmooth_synthetic.py`.
    output_dir: created if missing.
    cache_dir: a persistent compilation cache for the worker processes.

  Returns:
    One summary row per (method, d) (or per oracle, 'passes').
  """
  if config.study not in STUDIES:
    raise ValueError(f'study must be one of {STUDIES}, got {config.study!r}')
  unknown = set(config.methods) - set(METHODS)
  if unknown:
    raise ValueError(f'unknown methods {sorted(unknown)}; have {METHODS}')
  start = time.perf_counter()
  if config.study == 'sensitivity':
    return write_sensitivity(config, output_dir, start)
  if config.study == 'dimension':
    jobs = [(m, d, False) for d in config.dimensions for m in config.methods]
  else:
    jobs = [(method, config.passes_dimension, multi_pass)
            for method in ('first_order', 'zero_effective')
            for multi_pass in (False, True)]
  runs, summary = [], []
  if config.workers > 1:
    context = multiprocessing.get_context('spawn')
    with futures.ProcessPoolExecutor(config.workers,
                                     mp_context=context) as pool:
      done = list(pool.map(_job, itertools.repeat(config.to_dict()),
                           itertools.repeat(cache_dir), jobs))
  else:
    done = [tune_and_report(config, *job) for job in jobs]
  for job_runs, row in done:
    runs += job_runs
    summary.append(row)
  os.makedirs(output_dir, exist_ok=True)
  outputs.write_csv(os.path.join(output_dir, 'runs.csv'), runs)
  outputs.write_csv(os.path.join(output_dir, 'summary.csv'), summary)
  with open(os.path.join(output_dir, 'summary.md'), 'w') as f:
    f.write(summary_table(summary))
  if config.study == 'dimension':
    plot_dimension(os.path.join(output_dir, 'proxy_vs_dimension.png'),
                   summary, dimension_title(config))
  write_record(config, output_dir, start, summary=summary)
  return summary


def write_record(config, output_dir: str, start: float, **extra: Any
                 ) -> None:
  """`run_record.json`: the config, versions, wall time and `extra`."""
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, wall_seconds=time.perf_counter() - start,
                         extra={'experiment': 'experiments.nonsmooth_synthetic',
                                **extra}))


def sensitivity_rows(config: ml_collections.ConfigDict) -> list[Row]:
  """Clips, noise multiplier and noise norm of each O2NC method over d.

  No training: the plans of the 'dimension' study's single pass, for the
  dimensions `sensitivity_dimensions` (wider than a run can afford).
  """
  rows = []
  for dimension in config.sensitivity_dimensions:
    noise = {}
    for method in O2NC_METHODS:
      order = O2NC_METHODS[method][0]
      plan = o2nc_plan(config, method, dimension, 1.0, 0,
                       num_examples=config.num_examples,
                       directions=num_directions(config, order, dimension))
      noise[method] = plan.hyperparameters['released_noise_norm']
      clips = plan.hyperparameters['clips']
      rows.append({'dimension': dimension, 'method': method,
                   'num_directions': plan.hyperparameters['num_directions'],
                   'anchor_clip': clips['anchor'],
                   'difference_clip': clips['difference'],
                   'noise_multiplier': plan.noise_multiplier,
                   'noise_norm': noise[method]})
    rows[-2]['worst_over_effective_noise'] = (noise['zero_worst_case'] /
                                              noise['zero_effective'])
  return rows


def write_sensitivity(config, output_dir: str, start: float) -> list[Row]:
  """The 'sensitivity' study: `sensitivity.csv` and `sensitivity.md`."""
  rows = sensitivity_rows(config)
  os.makedirs(output_dir, exist_ok=True)
  outputs.write_csv(os.path.join(output_dir, 'sensitivity.csv'), rows)
  lines = ['| d | method | m | clips (C1, C2) | noise multiplier | noise norm '
           'G_0 | worst / effective G_0 |', '|---|---|---|---|---|---|---|']
  for r in rows:
    ratio = r.get('worst_over_effective_noise')
    lines.append(
        f'| {r["dimension"]} | {r["method"]} | {r["num_directions"]} | '
        f'({r["anchor_clip"]:.3g}, {r["difference_clip"]:.3g}) | '
        f'{r["noise_multiplier"]:.4g} | {r["noise_norm"]:.3g} | '
        f'{"" if ratio is None else f"{ratio:.2f}"} |')
  with open(os.path.join(output_dir, 'sensitivity.md'), 'w') as f:
    f.write('\n'.join(lines) + '\n')
  write_record(config, output_dir, start, sensitivity=rows)
  return rows


def summary_table(summary: Sequence[Row]) -> str:
  """The summary as a markdown table (proxy with its 95% half-width)."""
  lines = ['| method | d | pick | proxy at x_out | proxy, last block | '
           'empirical proxy | clips (C1, C2) | noise norm G_0 | '
           'loss evaluations | floor |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for r in summary:
    edge = f' ({r["grid_edge"]} edge)' if r['grid_edge'] else ''
    lines.append(
        f'| {r["method"]} | {r["dimension"]} | {r["picked"]:g}{edge} | '
        f'{r["proxy"]:.4f} ± {r["proxy_ci"]:.4f} | '
        f'{r["proxy_last_block"]:.4f} ± {r["proxy_last_block_ci"]:.4f} | '
        f'{r["empirical_proxy"]:.4f} ± {r["empirical_proxy_ci"]:.4f} | '
        f'({r["anchor_clip"]:.3g}, {r["difference_clip"]:.3g}) | '
        f'{r["noise_norm"]:.3g} | {r["loss_evaluations"]:.3g} | '
        f'{r["proxy_at_stationary_point"]:.4f} |')
  return '\n'.join(lines) + '\n'


def plot_dimension(path: str, summary: Sequence[Row], title: str) -> None:
  """Proxy against d per method: x_out (left) and the last block (right)."""
  methods = list(dict.fromkeys(r['method'] for r in summary))
  dims = sorted({int(r['dimension']) for r in summary})
  figure, panels = outputs.plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for axes, metric, label in (
      (panels[0], 'proxy', 'x_out (uniform block: the theorem\'s output)'),
      (panels[1], 'proxy_last_block', 'last block average')):
    for k, method in enumerate(methods):
      rows = sorted((r for r in summary if r['method'] == method),
                    key=lambda r: int(r['dimension']))
      # Side by side around each d, so the intervals do not hide each other.
      x = [int(r['dimension']) * 1.07 ** (k - (len(methods) - 1) / 2)
           for r in rows]
      axes.errorbar(x, [float(r[metric]) for r in rows],
                    yerr=[float(r[f'{metric}_ci']) for r in rows],
                    marker='o', capsize=3,
                    label=method.replace('_', ' ') + (
                        ' (final iterate)' if method == 'dpsgd' else ''))
    axes.axhline(0.97, color='grey', linestyle='--', linewidth=1)
    axes.text(dims[0], 0.99, 'start x_0', color='grey', fontsize=8)
    axes.set_xscale('log')
    axes.xaxis.set_minor_formatter(outputs.ticker.NullFormatter())
    axes.set_xticks(dims, [str(d) for d in dims])
    axes.set_ylim(0.0, 1.08)
    axes.set_xlabel('dimension d')
    axes.set_title(label, fontsize=10)
    axes.grid(alpha=0.3)
  panels[0].set_ylabel('||grad F_alpha||, mean and 95% interval')
  panels[1].legend(fontsize=8, loc='center right')
  figure.suptitle(title, fontsize=10)
  figure.tight_layout()
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  figure.savefig(path, dpi=100)
  outputs.plt.close(figure)


def replot(output_dir: str) -> None:
  """Redraws `proxy_vs_dimension.png` from a finished run's `summary.csv`."""
  with open(os.path.join(output_dir, 'run_record.json')) as f:
    config = ml_collections.ConfigDict(json.load(f)['config'])
  plot_dimension(os.path.join(output_dir, 'proxy_vs_dimension.png'),
                 outputs.read_csv(os.path.join(output_dir, 'summary.csv')),
                 dimension_title(config))


def dimension_title(config) -> str:
  return (f'n={config.num_examples}, epsilon={config.epsilon:g}, '
          f'delta={config.delta:g}, alpha={config.smoothing_radius:g}; '
          f'{config.seeds} seeds per point')


def run_with_cache(config: ml_collections.ConfigDict, output_dir: str
                   ) -> list[Row]:
  """`run` with a persistent compilation cache under `output_dir`, shared by
  its worker processes (the command line's entry point)."""
  cache_dir = os.path.join(output_dir, '.compilation_cache')
  enable_compilation_cache(cache_dir)
  return run(config, output_dir, cache_dir)


if __name__ == '__main__':
  cli.launch(run_with_cache, 'configs/nonsmooth_synthetic.py',
             'Private nonsmooth nonconvex optimization (paper 004)',
             output_dir='results/nonsmooth_synthetic',
             output_help='Where to write the runs, summary, plot and record.')
