"""DIFF2-GD against DP-GD and non-private GD on tabular regression (paper 003 §6).

One-hidden-layer MLP (10 softplus units, squared loss), P = 10 IID clients
simulated on one device with `jax.vmap(..., axis_name='clients')`, R = 2000
rounds of full local data, (epsilon, 1e-5)-DP at item level (replace-one),
noise from Proposition 4.1 (`config.accounting='paper'`, u = 1.25) or from
dp_accounting.

The search is the paper's (App. A):

* the grid: eta in {0.5^i : i = 0..9}; DP-GD: C_1 in {1, 3, 10, 30, 100};
  DIFF2-GD: C_1, C_2 in {1, 3, 10, 30, 100} (25 pairs) and
  T in {0.003, 0.01, 0.03, 0.1} R;
* the learning rate of each (C_1, C_2, T) point is searched from the largest
  down: the train loss is checked every 20 rounds, a run is abandoned when it
  is not finite or when a patience counter reaches 5 (up by one when the loss
  exceeds 1.05 x its running minimum, reset when it improves), and the first
  rate whose run completes all R rounds is taken
  (`sweeps.descending_step_size_selection`);
* among the points, train loss and squared gradient norm are each picked by
  their own minimum within R rounds, test loss by train loss.

Every point's search runs as one vmapped batch of lanes (point x seed), in
chunks of `chunk_checks` checks: abandoned lanes leave the batch, so early
rejection saves the compute it saves in the paper's sequential search.

Where this departs from the paper (each is a config field):

* hyperparameters are picked on `tuning_seeds` (the paper: on each of its 5
  seeds) and the picks are then run on the disjoint `eval_seeds`, whose
  numbers are reported: the per-seed pick favours whichever method's noise
  happened to be lucky, and tuning 5 seeds costs 5x the grid on this CPU. The
  tuning seed's own selected minima (the paper's protocol on one seed) are
  reported too;
* `step_size_guard='skip'` can leave out the rates above Theorem 4.3's
  bound (default 'report': searched as in the paper, each pick's bound and
  rho reported);
* every evaluation run also keeps Algorithm 1's output, the iterate of a
  uniformly random round (`diff2.random_output_iterate`), reported next to
  the last iterate, and the squared gradient norm over the final
  `final_rounds` rounds.

Selection uses the training data, so it is not a private result, as in the
paper.

    python -m experiments.diff2_tabular --output_dir=results/diff2_tabular

Writes `search.csv` (every grid point of every tuning seed: the rates tried
and why each stopped), `summary.csv` / `summary.md` (per dataset, epsilon,
algorithm and metric: the pick with its grid-edge flags and Theorem 4.3
check, the tuning seed's minimum, the evaluation seeds' minimum within R,
final value and random-iterate value, mean and std, and the one-sided paired
t-tests DIFF2-GD < DP-GD on them), `curves.csv`, one figure per dataset and
epsilon, and `run_record.json`.
"""

import math
import os
import time
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

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
from dpsco_jax import guards
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms import diff2_accounting
from experiments import cli
from experiments import outputs
from experiments import sweeps
from experiments import tabular_data

AXIS = 'clients'
ALGORITHMS = ('gd', 'dp_gd', 'diff2_gd')
METRICS = ('train_loss', 'grad_norm_sq', 'test_loss')
# Which metric picks the hyperparameters of each reported metric.
SELECTED_BY = {'train_loss': 'train_loss', 'grad_norm_sq': 'grad_norm_sq',
               'test_loss': 'train_loss'}


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


def num_params(dim: int, hidden: int) -> int:
  """d of the model (the paper's 101 for California, 111 for Gas Turbine)."""
  return dim * hidden + 2 * hidden + 1


def load(name: str, config: ml_collections.ConfigDict):
  """`(x, y)` of a data set: 'california', 'gas_turbine' or 'synthetic'."""
  if name == 'california':
    return tabular_data.load_california_housing(config.california_path)
  if name == 'gas_turbine':
    return tabular_data.load_gas_turbine(config.gas_turbine_path)
  if name == 'synthetic':
    return tabular_data.synthetic_regression(config.synthetic_examples,
                                             config.synthetic_dim)
  raise ValueError(f'unknown dataset {name!r}')


class SeedData(NamedTuple):
  """Per seed (stacked on axis 0): the split, clients, init and noise key.

  Attributes:
    seeds: the seeds, in stacking order.
    params: initial parameters.
    clients: `{'x' [P, n_max, d], 'y', 'mask'}` per seed.
    test: `{'x', 'y'}` per seed.
    keys: one noise key per seed.
    min_client_size: n_min (the same for every seed: only the dealing
      differs).
    dim: attributes d of the data.
  """

  seeds: Tuple[int, ...]
  params: Any
  clients: Any
  test: Any
  keys: jax.Array
  min_client_size: int
  dim: int


def seeded_data(name: str, config: ml_collections.ConfigDict,
                seeds: Sequence[int]) -> SeedData:
  """Each seed's own 80/20 split, client dealing, init and noise key."""
  x, y = load(name, config)
  clients, tests, params, keys = [], [], [], []
  for seed in seeds:
    train, test = tabular_data.prepare(x, y, seed)
    c = tabular_data.split_clients(train, config.num_clients, seed)
    clients.append({'x': c.x, 'y': c.y, 'mask': c.mask})
    tests.append(test)
    params.append(init_params(jax.random.key(1000 + seed), x.shape[1],
                              config.hidden_units))
    keys.append(jax.random.key_data(jax.random.key(2000 + seed)))
  stack = lambda trees: jax.tree_util.tree_map(
      lambda *a: jnp.stack([jnp.asarray(v) for v in a]), *trees)
  return SeedData(tuple(int(s) for s in seeds), stack(params), stack(clients),
                  stack(tests), jax.random.wrap_key_data(jnp.stack(keys)),
                  int(c.sizes.min()), x.shape[1])


def restart_interval(fraction: float, num_rounds: int) -> int:
  """T = max(1, round(fraction R)): the paper's T/R grid as intervals."""
  return max(1, round(fraction * num_rounds))


def grid(algorithm: str, config) -> Dict[str, Tuple[float, ...]]:
  """The axes searched for `algorithm` besides the learning rate."""
  if algorithm == 'gd':
    return {}
  if algorithm == 'dp_gd':
    return {'grad_clip': tuple(config.grad_clips)}
  return {'grad_clip': tuple(config.grad_clips),
          'diff_clip_factor': tuple(config.diff_clip_factors),
          'restart_fraction': tuple(config.restart_fractions)}


def grid_points(algorithm: str, config) -> List[Dict[str, float]]:
  """Every (C_1, C_2, T/R) point of `algorithm` (one empty point for GD)."""
  points = [{}]
  for axis, values in grid(algorithm, config).items():
    points = [dict(p, **{axis: v}) for p in points for v in values]
  return points


def interval_of(algorithm: str, point: Dict[str, float], config) -> int:
  """The restart interval T of a grid point (1 for DP-GD and GD)."""
  if algorithm == 'diff2_gd':
    return restart_interval(point['restart_fraction'], config.num_rounds)
  return 1


def noise_multipliers(algorithm: str, interval: int, epsilon: float, config
                      ) -> Optional[diff2.Diff2NoiseMultipliers]:
  """Proposition 4.1's (or dp_accounting's) multipliers for a run."""
  if algorithm == 'gd':
    return None
  split = config.budget_split if algorithm == 'diff2_gd' else None
  return diff2_accounting.calibrate(config.num_rounds, interval, epsilon,
                                    config.delta, method=config.accounting,
                                    budget_split=split)


def stability(algorithm: str, point: Dict[str, float], learning_rate: float,
              z, data: SeedData, config) -> diff2.Diff2Stability:
  """Theorem 4.3's step-size condition at a pick (always holds for T = 1)."""
  if algorithm != 'diff2_gd':
    return diff2.Diff2Stability(0.0, math.inf, True)
  return diff2.step_size_stability(
      learning_rate, restart_interval=interval_of(algorithm, point, config),
      noise_multipliers=z, diff_clip_factor=point['diff_clip_factor'],
      num_params=num_params(data.dim, config.hidden_units),
      min_client_size=data.min_client_size, num_clients=config.num_clients)


class _Engine(NamedTuple):
  init: Any
  chunk: Any
  evaluate: Any
  full_run: Any
  state_axes: Any


def _engine(algorithm: str, interval: int, z, config, data: SeedData
            ) -> _Engine:
  """Jitted, lane-vmapped functions of one (algorithm, T, noise) setting.

  A lane is one run: its own learning rate, clips, seed data and key. All
  lanes of a batch are at the same round, so the round counters in the
  state are shared (not vmapped) and DIFF2's restart `cond` stays a branch.
  """
  num_rounds, every = config.num_rounds, config.eval_every
  private = algorithm != 'gd'

  def build(lr, c1, c2, key, output='last', output_key=None):
    if not private:
      return optax.sgd(lr)
    return dpsco_jax.diff2_gd(
        example_loss, learning_rate=lr, grad_clip=c1, diff_clip_factor=c2,
        restart_interval=interval, num_rounds=num_rounds,
        noise_multipliers=z, key=key, axis_name=AXIS, output=output,
        output_key=output_key)

  def advance(tx, params, state, clients, rounds):
    if private:
      def client_step(p, s, x, y, mask):
        updates, s = tx.update(None, s, p, batch={'x': x, 'y': y},
                               batch_mask=mask)
        return optax.apply_updates(p, updates), s
      step = jax.vmap(client_step, in_axes=(None, None, 0, 0, 0),
                      out_axes=None, axis_name=AXIS)

      def round_fn(carry, _):
        return step(*carry, clients['x'], clients['y'], clients['mask']), None
    else:
      def round_fn(carry, _):
        p, s = carry
        updates, s = tx.update(jax.grad(client_objective)(p, clients), s, p)
        return (optax.apply_updates(p, updates), s), None
    return jax.lax.scan(round_fn, (params, state), None, length=rounds)[0]

  def checks(tx, params, state, clients, test, num_checks):
    def block(carry, _):
      carry = advance(tx, *carry, clients, every)
      return carry, evaluate(carry[0], clients, test)
    return jax.lax.scan(block, (params, state), None, length=num_checks)

  def init(lr, c1, c2, params, key):
    return build(lr, c1, c2, key).init(params)

  def chunk(num_checks, lr, c1, c2, params, state, clients, test):
    (params, state), metrics = checks(build(lr, c1, c2, None if not private
                                            else jax.random.key(0)),
                                      params, state, clients, test,
                                      num_checks)
    return params, state, metrics

  def full_run(lr, c1, c2, params, clients, test, key, output_key):
    """All R rounds: metrics at round 0 and every check, and (private) the
    metrics of Algorithm 1's random output iterate."""
    tx = build(lr, c1, c2, key, output='random_iterate' if private else
               'last', output_key=output_key)
    state = tx.init(params)
    (last, state), metrics = checks(tx, params, state, clients, test,
                                    num_rounds // every)
    curve = jnp.concatenate([evaluate(params, clients, test)[None], metrics])
    chosen = diff2.selected_iterate(state) if private else last
    return curve, evaluate(chosen, clients, test)

  example = jax.tree_util.tree_map(lambda a: a[0], data.params)
  shapes = jax.eval_shape(lambda p, k: init(0.1, 1.0, 1.0, p, k), example,
                          data.keys[0])
  # Scalar int32 leaves are round counters, equal across lanes (see above);
  # a refusal record is each lane's own.
  state_axes = jax.tree_util.tree_map(
      lambda s: (guards.Refusal(0, 0) if isinstance(s, guards.Refusal) else
                 None if (s.shape == () and s.dtype == jnp.int32) else 0),
      shapes, is_leaf=lambda s: isinstance(s, guards.Refusal))
  lanes = (0, 0, 0, 0)
  return _Engine(
      init=jax.jit(jax.vmap(init, in_axes=lanes + (0,),
                            out_axes=state_axes)),
      chunk=jax.jit(jax.vmap(chunk, in_axes=(None,) + lanes + (
          state_axes, 0, 0), out_axes=(0, state_axes, 0)),
                    static_argnums=0),
      evaluate=jax.jit(jax.vmap(evaluate)),
      full_run=jax.jit(jax.vmap(full_run)),
      state_axes=state_axes)


def _take(tree, index, axes=None):
  """Rows `index` of every lane-vmapped leaf (shared leaves as they are)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if axes is None:
    mapped = [True] * len(leaves)
  else:
    mapped = [a is not None for a in jax.tree_util.tree_leaves(
        axes, is_leaf=lambda a: a is None)]
  return jax.tree_util.tree_unflatten(treedef, [
      leaf[index] if m else leaf for leaf, m in zip(leaves, mapped)])


def _clips(algorithm, point):
  return (float(point.get('grad_clip', 1.0)),
          float(point.get('diff_clip_factor', 1.0)))


class Lane(NamedTuple):
  """One run of the search: a seed (index), a grid point (index), a rate."""

  seed: int
  point: int
  rate: int


def _wave(engine: _Engine, lanes: Sequence[Lane], algorithm: str,
          points, rates, data: SeedData, config
          ) -> List[Tuple[str, int, np.ndarray]]:
  """Runs the lanes together; each ends 'completed' or rejected.

  Returns per lane `(verdict, stopped_at, curve [checks + 1, 3])`: the
  verdict of `sweeps.descending_step_size_selection` ('completed', 'nan' or
  'patience'), the check it stopped at (-1) and its metrics so far.
  """
  seeds = np.array([lane.seed for lane in lanes])
  clips = np.array([_clips(algorithm, points[lane.point]) for lane in lanes],
                   np.float32)
  lr = jnp.asarray([rates[lane.rate] for lane in lanes], jnp.float32)
  c1, c2 = jnp.asarray(clips[:, 0]), jnp.asarray(clips[:, 1])
  # Every lane's noise is its own: the seed's key, folded with the point and
  # the rate tried.
  keys = jax.vmap(lambda k, p, r: jax.random.fold_in(jax.random.fold_in(
      k, p), r))(data.keys[seeds], jnp.asarray([l.point for l in lanes]),
                 jnp.asarray([l.rate for l in lanes]))
  params = _take(data.params, seeds)
  clients, test = _take(data.clients, seeds), _take(data.test, seeds)
  state = engine.init(lr, c1, c2, params, keys)
  history = [[row] for row in np.asarray(
      engine.evaluate(params, clients, test))]
  verdicts, stopped = ['completed'] * len(lanes), [-1] * len(lanes)
  batch = list(range(len(lanes)))   # lane of each batch row
  alive = [True] * len(lanes)
  total, done = config.num_rounds // config.eval_every, 0
  while done < total and batch:
    num = min(config.chunk_checks, total - done)
    params, state, metrics = engine.chunk(num, lr, c1, c2, params, state,
                                          clients, test)
    metrics = np.asarray(metrics)
    for row, lane in enumerate(batch):
      if not alive[lane]:
        continue
      history[lane].extend(metrics[row])
      train = np.asarray(history[lane])[1:, 0]   # checks from round `every`
      verdict = sweeps.descending_step_size_selection(
          [1.0], train[None], patience=config.patience,
          tolerance=config.tolerance)
      if verdict.selected is None:
        alive[lane] = False
        verdicts[lane], stopped[lane] = (verdict.verdicts[0],
                                         verdict.stopped_at[0])
    done += num
    keep = [row for row, lane in enumerate(batch) if alive[lane]]
    # Compact when a quarter of the batch has stopped (each new batch size
    # compiles once more; rows that stopped earlier ride along until then).
    if len(keep) <= 0.75 * len(batch):
      index = np.asarray(keep, np.int32)
      lr, c1, c2 = lr[index], c1[index], c2[index]
      params, clients, test = (_take(params, index), _take(clients, index),
                               _take(test, index))
      state = _take(state, index, engine.state_axes)
      batch = [batch[row] for row in keep]
  return [(verdicts[i], stopped[i], np.asarray(history[i]))
          for i in range(len(lanes))]


class SearchResult(NamedTuple):
  """The descending-rate search of one grid point on one seed.

  Attributes:
    seed: the seed.
    point: the grid point (`grid_points`).
    learning_rate: the first rate that completed, None if none did.
    trail: `(rate, verdict, stopped_at)` of every rate tried, largest first.
    curve: `[checks + 1, 3]` metrics of the completed run (None if none).
  """

  seed: int
  point: Dict[str, float]
  learning_rate: Optional[float]
  trail: Tuple[Tuple[float, str, int], ...]
  curve: Optional[np.ndarray]


def search(algorithm: str, epsilon: Optional[float], data: SeedData,
           config) -> List[SearchResult]:
  """Paper 003's search (App. A) of every grid point on every seed of `data`.

  The learning rates are tried from the largest down and the first to
  complete is kept. Points are grouped by T (each T has its own noise and
  compiles once); within a group all points and seeds run as one batch per
  rate.

  Example:
    >>> data = seeded_data('california', config, config.tuning_seeds)
    >>> results = search('diff2_gd', 3.0, data, config)
    >>> pick(results, 'train_loss')      # the point and rate picked

  Args:
    algorithm: 'gd', 'dp_gd' or 'diff2_gd'.
    epsilon: the privacy target (None for 'gd').
    data: the seeds to search on.
    config: the experiment's config.

  Returns:
    One `SearchResult` per (seed, grid point).
  """
  points = grid_points(algorithm, config)
  rates = sorted((float(r) for r in config.learning_rates), reverse=True)
  groups: Dict[int, List[int]] = {}
  for i, point in enumerate(points):
    groups.setdefault(interval_of(algorithm, point, config), []).append(i)
  trails = {(s, i): [] for s in range(len(data.seeds))
            for i in range(len(points))}
  found: Dict[Tuple[int, int], Tuple[Optional[float], Any]] = {}
  progress = outputs.Progress(
      f'{algorithm} search (eps {epsilon})', total=len(trails))
  for interval, indices in groups.items():
    z = noise_multipliers(algorithm, interval, epsilon, config)
    engine = _engine(algorithm, interval, z, config, data)
    lanes = _first_lanes(algorithm, points, indices, rates, z, data, config,
                         trails, found)
    while lanes:
      follow = []
      for lane, (verdict, stop, curve) in zip(
          lanes, _wave(engine, lanes, algorithm, points, rates, data,
                       config)):
        key = (lane.seed, lane.point)
        trails[key].append((rates[lane.rate], verdict, stop))
        if verdict == 'completed':
          found[key] = (rates[lane.rate], curve)
        elif lane.rate + 1 < len(rates):
          follow.append(lane._replace(rate=lane.rate + 1))
        else:
          found[key] = (None, None)
      lanes = follow
      progress.update(len(found))
  results = []
  for s, i in sorted(trails):
    rate, curve = found.get((s, i), (None, None))
    results.append(SearchResult(data.seeds[s], points[i], rate,
                                tuple(trails[(s, i)]), curve))
  return results


def _first_lanes(algorithm, points, indices, rates, z, data, config, trails,
                 found) -> List[Lane]:
  """The first lane of every (seed, point): its largest rate, or with
  `step_size_guard='skip'` its largest rate within Theorem 4.3's bound (the
  rates above it are recorded as 'skipped'; a point with none is done)."""
  lanes = []
  for s in range(len(data.seeds)):
    for i in indices:
      k = 0
      while (k < len(rates) and config.step_size_guard == 'skip' and
             not stability(algorithm, points[i], rates[k], z, data,
                           config).holds):
        trails[(s, i)].append((rates[k], 'skipped', -1))
        k += 1
      if k < len(rates):
        lanes.append(Lane(s, i, k))
      else:
        found[(s, i)] = (None, None)
  return lanes


class Pick(NamedTuple):
  """The hyperparameters picked for one metric on the tuning seeds."""

  point: Dict[str, float]
  learning_rate: float
  tuning_minimum: float


def pick(results: Sequence[SearchResult], metric: str) -> Optional[Pick]:
  """The grid point whose completed runs have the smallest minimum of the
  metric's criterion (mean over tuning seeds); its rate is the smallest
  completing rate of those seeds (the one rate with one seed)."""
  criterion = METRICS.index(SELECTED_BY[metric])
  by_point: Dict[str, List[SearchResult]] = {}
  for result in results:
    by_point.setdefault(repr(sorted(result.point.items())), []).append(result)
  best = None
  for runs in by_point.values():
    if any(r.learning_rate is None for r in runs):
      continue
    score = float(np.mean([np.min(r.curve[:, criterion]) for r in runs]))
    value = float(np.mean([np.min(r.curve[:, METRICS.index(metric)])
                           for r in runs]))
    if best is None or score < best[0]:
      best = (score, Pick(runs[0].point, min(r.learning_rate for r in runs),
                          value))
  return None if best is None else best[1]


def evaluate_pick(algorithm: str, epsilon, chosen: Pick, data: SeedData,
                  config) -> Tuple[np.ndarray, np.ndarray]:
  """The pick run for R rounds on every seed of `data`.

  Returns:
    `(curves [seeds, checks + 1, 3], random_iterate [seeds, 3])`.
  """
  interval = interval_of(algorithm, chosen.point, config)
  z = noise_multipliers(algorithm, interval, epsilon, config)
  engine = _engine(algorithm, interval, z, config, data)
  n = len(data.seeds)
  c1, c2 = _clips(algorithm, chosen.point)
  # Evaluation noise keys differ from every search key (fold 2^20 + seed).
  keys = jax.vmap(lambda k: jax.random.fold_in(k, 1 << 20))(data.keys)
  output_keys = jax.vmap(lambda k: jax.random.fold_in(k, (1 << 20) + 1))(
      data.keys)
  curves, chosen_metrics = engine.full_run(
      jnp.full((n,), chosen.learning_rate, jnp.float32),
      jnp.full((n,), c1, jnp.float32), jnp.full((n,), c2, jnp.float32),
      data.params, data.clients, data.test, keys, output_keys)
  return np.asarray(curves), np.asarray(chosen_metrics)


def paired_p_value(diff2_values: np.ndarray, dpgd_values: np.ndarray
                   ) -> float:
  """One-sided paired t-test, alternative: DIFF2-GD's values are smaller."""
  if (len(diff2_values) < 2 or np.any(~np.isfinite(diff2_values)) or
      np.any(~np.isfinite(dpgd_values))):
    return float('nan')
  return float(stats.ttest_rel(diff2_values, dpgd_values,
                               alternative='less').pvalue)


def search_rows(name, epsilon, algorithm, results, data, config
                ) -> List[Dict[str, Any]]:
  """One row per grid point and tuning seed: the rates tried and why each
  stopped, the minima of the completed run, Theorem 4.3 at its rate."""
  rows = []
  for r in results:
    interval = interval_of(algorithm, r.point, config)
    z = noise_multipliers(algorithm, interval, epsilon, config)
    check = (stability(algorithm, r.point, r.learning_rate, z, data, config)
             if r.learning_rate else None)
    row = {'dataset': name, 'epsilon': epsilon, 'algorithm': algorithm,
           'seed': r.seed, **r.point, 'restart_interval': interval,
           'learning_rate': r.learning_rate,
           'trail': '; '.join(f'{rate:g}:{verdict}' + (
               f'@{(stop + 1) * config.eval_every}' if stop >= 0 else '')
                              for rate, verdict, stop in r.trail),
           'rounds_run': sum(config.num_rounds if stop < 0 and v != 'skipped'
                             else (stop + 1) * config.eval_every
                             for _, v, stop in r.trail)}
    for k, metric in enumerate(METRICS):
      row[f'min_{metric}'] = (float(np.min(r.curve[:, k]))
                              if r.curve is not None else None)
    row['theorem_4_3_holds'] = None if check is None else check.holds
    row['rho'] = None if check is None else check.rho
    rows.append(row)
  return rows


def final_window(curves: np.ndarray, config) -> np.ndarray:
  """Mean of each seed's checks within the final `final_rounds` rounds."""
  checks = max(1, config.final_rounds // config.eval_every)
  return np.mean(curves[:, -checks:], axis=1)


def run_cell(name: str, epsilon: float, tuning: SeedData, evaluation: SeedData,
             config, gd_cache: Dict[str, Any]
             ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]],
                        Dict[str, Any]]:
  """One data set and epsilon: search, pick, evaluate, compare.

  Returns `(search_rows, summary_rows, curves)` with `curves[(algorithm,
  metric)] = [eval seeds, checks + 1]` (and `[eval seeds]` random-iterate
  values under `(algorithm, metric, 'random_iterate')`).
  """
  searched, summary, curves = [], [], {}
  evaluated = {}
  for algorithm in config.algorithms:
    if algorithm == 'gd' and 'gd' in gd_cache:
      results = gd_cache['gd']   # non-private GD does not depend on epsilon
    else:
      start = time.perf_counter()
      results = search(algorithm, None if algorithm == 'gd' else epsilon,
                       tuning, config)
      logging.info('%s %s eps %s: searched %d points x %d seeds in %.0f s',
                   name, algorithm, epsilon, len(grid_points(algorithm,
                                                             config)),
                   len(tuning.seeds), time.perf_counter() - start)
      if algorithm == 'gd':
        gd_cache['gd'] = results
    searched += search_rows(name, epsilon, algorithm, results, tuning, config)
    axes = dict(grid(algorithm, config),
                learning_rate=tuple(config.learning_rates))
    for metric in METRICS:
      chosen = pick(results, metric)
      row = {'dataset': name, 'epsilon': epsilon, 'algorithm': algorithm,
             'metric': metric}
      if chosen is None:
        summary.append(dict(row, note='no grid point completed'))
        continue
      key = (algorithm, repr(sorted(chosen.point.items())),
             chosen.learning_rate)
      if key not in evaluated:
        evaluated[key] = evaluate_pick(algorithm, epsilon, chosen,
                                       evaluation, config)
      run_curves, random_iterate = evaluated[key]
      k = METRICS.index(metric)
      curves[(algorithm, metric)] = run_curves[:, :, k]
      curves[(algorithm, metric, 'random_iterate')] = random_iterate[:, k]
      interval = interval_of(algorithm, chosen.point, config)
      check = stability(algorithm, chosen.point, chosen.learning_rate,
                        noise_multipliers(algorithm, interval, epsilon,
                                          config), evaluation, config)
      # A run that blew up keeps the minimum it reached before (its final
      # value is NaN, and `eval_runs_diverged` counts it).
      minima = np.nanmin(np.where(np.isfinite(run_curves[:, :, k]),
                                  run_curves[:, :, k], np.nan), axis=1)
      final = final_window(run_curves[:, :, k], config)
      summary.append(dict(
          row, **chosen.point, restart_interval=interval,
          learning_rate=chosen.learning_rate,
          grid_edge=sweeps.edge_report(
              dict(chosen.point, learning_rate=chosen.learning_rate), axes),
          theorem_4_3_holds=check.holds, rho=check.rho,
          step_size_bound=check.step_size_bound,
          tuning_minimum=chosen.tuning_minimum,
          min_mean=float(np.mean(minima)), min_std=float(np.std(minima)),
          final_mean=float(np.mean(final)), final_std=float(np.std(final)),
          random_iterate_mean=float(np.mean(random_iterate[:, k])),
          random_iterate_std=float(np.std(random_iterate[:, k])),
          eval_runs_diverged=int(np.sum(~np.all(np.isfinite(run_curves),
                                                axis=(1, 2)))),
          _minima=minima, _final=final, _random=random_iterate[:, k]))
  for metric in METRICS:
    rows = {r['algorithm']: r for r in summary
            if r['metric'] == metric and '_minima' in r}
    if 'diff2_gd' in rows and 'dp_gd' in rows:
      a, b = rows['diff2_gd'], rows['dp_gd']
      for row in (a, b):
        row['p_min'] = paired_p_value(a['_minima'], b['_minima'])
        row['p_final'] = paired_p_value(a['_final'], b['_final'])
        row['p_random_iterate'] = paired_p_value(a['_random'], b['_random'])
  for row in summary:
    for hidden in ('_minima', '_final', '_random'):
      row.pop(hidden, None)
  return searched, summary, curves


def plot_cell(path: str, name: str, epsilon: float, curves, summary, config
              ) -> None:
  """Median and quartiles over the evaluation seeds, per metric."""
  rounds = np.arange(0, config.num_rounds + 1, config.eval_every)
  figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for k, metric in enumerate(METRICS):
    for algorithm in config.algorithms:
      if (algorithm, metric) not in curves:
        continue
      values = curves[(algorithm, metric)]
      # Seeds whose run blew up leave the quantiles from where they did.
      finite = np.where(np.isfinite(values), values, np.nan)
      diverged = int(np.sum(~np.all(np.isfinite(values), axis=1)))
      with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)   # all-NaN rounds
        lower, median, upper = np.nanquantile(finite, [0.25, 0.5, 0.75],
                                              axis=0)
      label = algorithm + (f' ({diverged}/{len(values)} runs blew up)'
                           if diverged else '')
      (line,) = axes[k].plot(rounds, median, label=label)
      axes[k].fill_between(rounds, lower, upper, alpha=0.2, linewidth=0,
                           color=line.get_color())
    p = [r.get('p_min') for r in summary
         if r['metric'] == metric and r.get('p_min') is not None]
    axes[k].set_title(metric + (f'  (p min = {p[0]:.2g})' if p else ''),
                      fontsize=10)
    axes[k].set_yscale('log')
    axes[k].set_xlabel('round')
    axes[k].grid(alpha=0.3)
    axes[k].legend(fontsize=8)
  figure.suptitle(
      f'{name}, epsilon = {epsilon:g}, delta = {config.delta:g}, '
      f'P = {config.num_clients}: picks run on {len(config.eval_seeds)} '
      'evaluation seeds (median, quartiles)', fontsize=11)
  figure.tight_layout()
  figure.savefig(path, dpi=90)
  plt.close(figure)


def replot(output_dir: str, config) -> List[str]:
  """Redraws every figure of a finished run from its saved files.

  Example:
    >>> replot('results/diff2_tabular', config)   # after changing the plot

  Args:
    output_dir: a run's output folder (its `runs_*.npz` and `summary.csv`).
    config: the run's config (its delta, clients, rounds, seeds).

  Returns:
    The figures written.
  """
  summary = outputs.read_csv(os.path.join(output_dir, 'summary.csv'))
  for row in summary:
    row['epsilon'] = float(row['epsilon'])
    row['p_min'] = float(row['p_min']) if row.get('p_min') else None
  written = []
  for name in sorted(os.listdir(output_dir)):
    if not (name.startswith('runs_') and name.endswith('.npz')):
      continue
    dataset, eps = name[len('runs_'):-len('.npz')].rsplit('_eps', 1)
    with np.load(os.path.join(output_dir, name)) as saved:
      curves = {tuple(key.split('/')): saved[key] for key in saved.files
                if key.count('/') == 1}
    cell = [r for r in summary
            if r['dataset'] == dataset and r['epsilon'] == float(eps)]
    path = os.path.join(output_dir, f'{dataset}_eps{eps}.png')
    plot_cell(path, dataset, float(eps), curves, cell, config)
    written.append(path)
  return written


def markdown_table(rows: List[Dict[str, Any]]) -> str:
  """Per cell and metric: each method's pick and its numbers."""
  fmt = lambda v: '-' if v is None else f'{v:.3g}'
  lines = ['| dataset | eps | metric | method | pick (eta, C1, C2, T) | '
           'edge | Thm 4.3 | tuning seed min | min within R | final rounds '
           '| random iterate | p (DIFF2 < DP-GD): min / final |',
           '|' + '---|' * 12]
  for r in rows:
    if 'min_mean' not in r:
      lines.append(f"| {r['dataset']} | {r['epsilon']:g} | {r['metric']} | "
                   f"{r['algorithm']} | {r.get('note', '')} |" + ' |' * 7)
      continue
    pick_text = ', '.join(
        f'{v:g}' for v in (r['learning_rate'], r.get('grad_clip'),
                           r.get('diff_clip_factor'))
        if v is not None) + (f", T={r['restart_interval']}"
                             if r['algorithm'] == 'diff2_gd' else '')
    lines.append(
        f"| {r['dataset']} | {r['epsilon']:g} | {r['metric']} | "
        f"{r['algorithm']} | {pick_text} | {r['grid_edge'] or '-'} | "
        f"{'holds' if r['theorem_4_3_holds'] else 'violated'} "
        f"(rho {r['rho']:.2g}) | {fmt(r['tuning_minimum'])} | "
        f"{r['min_mean']:.4g} ± {r['min_std']:.2g} | "
        f"{r['final_mean']:.4g} ± {r['final_std']:.2g} | "
        f"{r['random_iterate_mean']:.4g} ± {r['random_iterate_std']:.2g} | "
        f"{fmt(r.get('p_min'))} / {fmt(r.get('p_final'))} |")
  return '\n'.join(lines) + '\n'


def privacy_entries(config) -> List[Dict[str, Any]]:
  """What every private grid point spends: its noise multipliers, its
  `dp_accounting` event and the epsilon, per target epsilon and T."""
  entries = []
  for epsilon in config.epsilons:
    for algorithm in config.algorithms:
      if algorithm == 'gd':
        continue
      intervals = sorted({interval_of(algorithm, p, config)
                          for p in grid_points(algorithm, config)})
      for interval in intervals:
        z = noise_multipliers(algorithm, interval, epsilon, config)
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


def validate(config) -> None:
  """Refuses configs the protocol cannot run, before any work."""
  if config.num_rounds % config.eval_every:
    raise ValueError(f'num_rounds ({config.num_rounds}) must be a multiple of '
                     f'eval_every ({config.eval_every})')
  if config.step_size_guard not in ('report', 'skip'):
    raise ValueError("step_size_guard must be 'report' or 'skip', got "
                     f'{config.step_size_guard!r}')
  unknown = set(config.algorithms) - set(ALGORITHMS)
  if unknown:
    raise ValueError(f'unknown algorithms {sorted(unknown)}; choose from '
                     f'{ALGORITHMS}')
  overlap = set(config.tuning_seeds) & set(config.eval_seeds)
  if overlap:
    raise ValueError(f'seeds {sorted(overlap)} are both tuning and evaluation '
                     'seeds: the evaluation would reuse the noise the picks '
                     'were tuned on')
  if len(config.eval_seeds) < 2:
    raise ValueError('the paired t-tests need at least 2 eval_seeds')
  sweeps.validate_seeds(tuple(config.tuning_seeds) + tuple(config.eval_seeds))


def run(config: ml_collections.ConfigDict, output_dir: str) -> List[Dict[str, Any]]:
  """The whole experiment; writes its files and returns the summary rows.

  Example:
    >>> rows = run(configs.diff2_tabular.get_config(), 'results/diff2')

  Raises:
    ValueError: for a config the protocol cannot run (`validate`).
  """
  validate(config)
  os.makedirs(output_dir, exist_ok=True)
  start = time.perf_counter()
  searched, summary, curve_rows, done = [], [], [], []
  rounds = np.arange(0, config.num_rounds + 1, config.eval_every)
  for name in config.datasets:
    tuning = seeded_data(name, config, config.tuning_seeds)
    evaluation = seeded_data(name, config, config.eval_seeds)
    logging.info('%s: d = %d attributes, %d parameters, n_min = %d', name,
                 tuning.dim, num_params(tuning.dim, config.hidden_units),
                 tuning.min_client_size)
    gd_cache = {}
    for epsilon in config.epsilons:
      cell_search, cell_summary, curves = run_cell(
          name, epsilon, tuning, evaluation, config, gd_cache)
      searched += cell_search
      summary += cell_summary
      np.savez_compressed(
          os.path.join(output_dir, f'runs_{name}_eps{epsilon:g}.npz'),
          **{'/'.join(key): values for key, values in curves.items()})
      for key, values in curves.items():
        if len(key) != 2:
          continue
        algorithm, metric = key
        for r, mean, std in zip(rounds, values.mean(0), values.std(0)):
          curve_rows.append({'dataset': name, 'epsilon': epsilon,
                             'algorithm': algorithm, 'metric': metric,
                             'round': int(r), 'mean': mean, 'std': std})
      plot_cell(os.path.join(output_dir, f'{name}_eps{epsilon:g}.png'), name,
                epsilon, curves, cell_summary, config)
      # Written after every cell, so a long run leaves what it has done.
      outputs.write_csv(os.path.join(output_dir, 'search.csv'), searched)
      outputs.write_csv(os.path.join(output_dir, 'summary.csv'), summary)
      outputs.write_csv(os.path.join(output_dir, 'curves.csv'), curve_rows)
      with open(os.path.join(output_dir, 'summary.md'), 'w') as f:
        f.write(markdown_table(summary))
      done.append(f'{name} eps {epsilon:g}')
      write_record(config, output_dir, time.perf_counter() - start, done)
  logging.info('total wall time %.1f s', time.perf_counter() - start)
  return summary


def write_record(config, output_dir: str, wall_seconds: float,
                 cells_done: Sequence[str],
                 command: Optional[str] = None) -> None:
  """`run_record.json`: the config, what every grid point spends, versions,
  and the (data set, epsilon) cells finished so far (a run stopped early
  says which it finished).

  Example:
    >>> write_record(config, 'results/diff2', 812.0, ['california eps 3'])

  Args:
    config: the run's config.
    output_dir: the run's output folder.
    wall_seconds: the run's wall time so far.
    cells_done: the cells finished, e.g. 'california eps 3'.
    command: the command line (default: `outputs.command_line()`).
  """
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, privacy=privacy_entries(config),
                         wall_seconds=wall_seconds,
                         extra={'experiment': 'experiments.diff2_tabular',
                                **({'command': command} if command else {}),
                                'cells_done': list(cells_done)}))


if __name__ == '__main__':
  cli.launch(run, 'configs/diff2_tabular.py',
             'DIFF2-GD against DP-GD and GD across clients on tabular '
             'regression (paper 003)', output_dir='results/diff2_tabular')
