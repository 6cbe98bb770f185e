"""Correlated noise against DP-SGD: test accuracy at several epsilons.

Multiclass logistic regression (pixels -> classes, bias, zero init; the
model of `experiments.srg_memf`), SGD with momentum after the private
gradient, the same epochs, expected batch size and accounting method (each
plan's default, PLD) for every private method:

* `dpsgd_poisson`: DP-SGD with Poisson sampling (`plans.dpsgd`,
  amplification by sampling);
* `dpmemf_dense`: DP-MEMF with the dense strategy optimized for the
  momentum workload, one public batch order every epoch
  (`plans.dpmemf(strategy=None)`, `FixedOrder(k, b)`); its noise keeps
  `k b - 1` params-sized buffers, so `max_noise_buffers` is raised to
  `k b`;
* `banded_amplified`: Amplified BandMF (`plans.dpmemf(strategy='banded',
  bands=b, sampling='cyclic_poisson')`), b tuned with the learning rate and
  clip;
* `blt`: a buffered-linear-Toeplitz strategy (`plans.dpmemf(
  strategy='blt', n_buffers=...)`), fixed batch order;
* `nonprivate`: the same optimizer on the plain mean gradient of batches of
  a fixed order.

Batches come from each plan's own sampler (`plan.batches`, re-seeded per
run with `sampler_for_seed`: same class and parameters, so the same
participation and accounting); Poisson and cyclic Poisson batches vary in
size and are padded, with the sampler's masks, to one shape so that a run
is one `lax.scan` (`padded_batches`). The padded rows are masked out of the
clipped sum (`padding_is_masked` checks it on every final plan). Each
step runs the plan's whole transformation, including its in-step check of
the batches its accounting assumes.

Protocol (as `experiments.srg_memf`): a seeded validation part is cut from
the training split; learning rate x clip (x bands for the banded method)
are tuned on it with `config.tuning_seeds` seeds (10000, 10001, ...),
extending an axis past an edge pick (`sweeps.search_with_extension`, at
most `config.grid_extensions` times, bands bounded by `n // batch_size`)
and flagging a pick still on an edge; the pick then runs with
`config.num_seeds` fresh seeds (0, 1, ...), disjoint from the tuning ones,
and the mean TEST accuracy is reported with a 95% Student-t interval. All
seeds (and grid points) of one setting run as ONE compiled program
(`sweeps.run_sweep`).

    python -m experiments.correlated_noise \
        --config=configs/correlated_noise_digits.py

Writes `results.csv`, `tuning.csv`, `runs.csv`, `results.md`,
`accuracy.png` and `run_record.json` (config, seeds, each final plan's
description, dp_accounting event and epsilon spent) to `--output_dir`.
"""

import functools
import math
import os
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple
import warnings

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

from dpsco_jax import batching
from dpsco_jax import plans
from dpsco_jax import runs
from experiments import cli
from experiments import outputs
from experiments import spine
from experiments import srg_memf
from experiments import sweeps

Row = Dict[str, Any]
METHODS = ('dpsgd_poisson', 'dpmemf_dense', 'banded_amplified', 'blt',
           'nonprivate')
# Names on the plot and the page.
LABELS = {
    'dpsgd_poisson': 'DP-SGD, Poisson sampling',
    'dpmemf_dense': 'DP-MEMF dense, fixed order',
    'banded_amplified': 'Amplified BandMF, cyclic Poisson',
    'blt': 'BLT, fixed order',
    'nonprivate': 'non-private',
}
# Seeds of the tuning runs start here; final runs use 0, 1, ... (disjoint).
TUNING_SEED_BASE = 10_000
# Samplers whose batches vary in size: padded and masked.
_MASKED_SAMPLERS = (batching.PoissonBatches, batching.CyclicPoissonBatches)


class RunData(NamedTuple):
  """The device arrays of one compiled sweep.

  Attributes:
    data: the train / validation / test parts (`srg_memf.Data`).
    seeds: `[S]` int32, the seeds whose batches `indices` holds.
    indices: `[S, T, P]` int32 example ids of every step of every seed
      (padding rows hold 0).
    masks: `[S, T, P]` bool, False on padding (all True for fixed-size
      batches).
  """

  data: srg_memf.Data
  seeds: jax.Array
  indices: jax.Array
  masks: jax.Array


def _check_method(method: str) -> None:
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}')


def make_plan(method: str, config: ml_collections.ConfigDict,
              num_examples: int, *, epsilon: Optional[float] = None,
              noise_multiplier: Optional[float] = None,
              bands: Optional[int] = None, l2_clip: Any = 1.0,
              learning_rate: Any = 1.0, seed: int = 0,
              key: Any = None) -> plans.Plan:
  """The plan of one private method (SGD with `config.momentum` after it).

  Called on the host (calibrated to `epsilon`; its sampler gives the
  batches) and inside the compiled run (given the host plan's
  `noise_multiplier`, with traced `l2_clip`, `learning_rate` and `key`).

  Example:
    >>> plan = make_plan('banded_amplified', config, 1150, epsilon=2.0,
    ...                  bands=4)
    >>> plan.batches          # CyclicPoissonBatches(..., num_partitions=4)

  Args:
    method: one of `METHODS` except 'nonprivate'.
    config: the experiment config (batch_size, num_epochs, delta,
      momentum, blt_buffers).
    num_examples: training examples n.
    epsilon: the target (or give `noise_multiplier`).
    noise_multiplier: the noise (or give `epsilon`).
    bands: b of `banded_amplified` (partitions and bands).
    l2_clip: the clip norm.
    learning_rate: SGD's learning rate.
    seed: the sampler's seed.
    key: the noise key.

  Returns:
    The `plans.Plan`.

  Raises:
    ValueError: for an unknown or non-private method, or `bands` missing
      for (or given to) another method than `banded_amplified`.
  """
  _check_method(method)
  if method == 'nonprivate':
    raise ValueError('nonprivate has no plan (no privacy is accounted)')
  if (bands is None) == (method == 'banded_amplified'):
    raise ValueError(f'bands= is for banded_amplified only (and needed '
                     f'there); got method {method!r} with bands={bands!r}')
  common = dict(
      optimizer=optax.sgd(learning_rate, momentum=config.momentum),
      num_examples=num_examples, batch_size=config.batch_size,
      epochs=config.num_epochs, l2_clip=l2_clip, delta=config.delta,
      epsilon=epsilon, noise_multiplier=noise_multiplier, seed=seed,
      key=key)
  loss = srg_memf.example_loss
  if method == 'dpsgd_poisson':
    return plans.dpsgd(loss, sampling='poisson', **common)
  if method == 'dpmemf_dense':
    # A dense strategy keeps k b - 1 buffers; the plan refuses more than
    # max_noise_buffers, so the limit is raised to what this run needs.
    steps = config.num_epochs * (num_examples // config.batch_size)
    return plans.dpmemf(loss, strategy=None, momentum=config.momentum,
                        max_noise_buffers=max(steps, 1), **common)
  if method == 'banded_amplified':
    return plans.dpmemf(loss, strategy='banded', bands=int(bands),
                        sampling='cyclic_poisson', momentum=config.momentum,
                        **common)
  return plans.dpmemf(loss, strategy='blt', n_buffers=config.blt_buffers,
                      momentum=config.momentum, **common)


def nonprivate_sampler(config: ml_collections.ConfigDict,
                       num_examples: int) -> batching.FixedOrderBatches:
  """The non-private reference's batches: one order every epoch."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', batching.RemainderWarning)
    return batching.FixedOrderBatches(num_examples, config.batch_size,
                                      config.num_epochs, seed=0)


def sampler_for_seed(sampler: Any, seed: int) -> Any:
  """A plan's sampler with another seed: same class and parameters.

  The accounting depends on the sampler's class and parameters, never on
  its seed, so every run of a setting draws its own batches from the plan's
  sampler without building the plan again.

  Example:
    >>> batches = sampler_for_seed(plan.batches, 3)
    >>> batches.participation == plan.participation   # True

  Args:
    sampler: a `plan.batches` (or `nonprivate_sampler`).
    seed: the run's seed.

  Returns:
    The re-seeded sampler.

  Raises:
    ValueError: for a sampler without a seed field.
  """
  return batching.reseeded(sampler, seed)


def padded_batches(sampler: Any, seeds: Sequence[int]
                   ) -> Tuple[np.ndarray, np.ndarray]:
  """Every step's example ids of every seed, padded to one shape, and masks
  (`dpsco_jax.runs.run_batches`).

  A Poisson batch is padded by its sampler to a multiple of
  `pad_to_multiple` (with index 0, mask False); a rare larger batch to a
  larger multiple. Padding every batch further, with index 0 and mask False,
  to the largest size drawn keeps the width a multiple of `pad_to_multiple`
  (what the plan's in-step check asks) and gives the `[S, T, P]` arrays a
  scan over steps and a vmap over seeds need.

  Example:
    >>> indices, masks = padded_batches(plan.batches, range(5))
    >>> indices.shape            # (5, plan.num_steps, P)

  Args:
    sampler: the plan's sampler (`plan.batches`).
    seeds: one seed per run.

  Returns:
    `(indices [S, T, P] int32, masks [S, T, P] bool)`; masks all True for
    fixed-size batches.
  """
  batches = runs.run_batches(sampler, list(seeds))
  if isinstance(batches[0], tuple):
    raise ValueError('batches whose size changes across steps need a loop, '
                     'not one [S, T, P] array')
  indices, masks = batches
  if masks is None:
    masks = np.ones(indices.shape, bool)
  return indices, masks


def step_inputs(train_x: jax.Array, train_y: jax.Array, ids: jax.Array,
                mask: Optional[jax.Array]) -> Dict[str, Any]:
  """The keyword inputs of one `plan.transformation.update` call.

  Example:
    >>> inputs = step_inputs(x, y, indices[s, t], masks[s, t])
    >>> updates, state = plan.transformation.update(None, state, params,
    ...                                             **inputs)

  Args:
    train_x: the training features.
    train_y: the training labels.
    ids: the step's example ids (padding included).
    mask: False on padding; None for fixed-size batches (no padding).

  Returns:
    `{'batch', 'example_ids'}` and, with a mask, `'batch_mask'` (which the
    clipping uses to leave the padding out of the clipped sum).
  """
  inputs = {'batch': {'x': train_x[ids], 'y': train_y[ids]},
            'example_ids': ids}
  if mask is not None:
    inputs['batch_mask'] = mask
  return inputs


def padding_is_masked(plan: plans.Plan, data: srg_memf.Data, ids: np.ndarray,
                      mask: np.ndarray, num_classes: int) -> bool:
  """Whether a plan's private step ignores the padded rows of a batch.

  Runs the plan's private estimator twice from the same state (so with the
  same noise) on one batch: its padded rows pointing at example 0 (what
  the sampler pads with), then at other examples. The releases are equal
  exactly when the padding is left out of the clipped sum.

  Example:
    >>> indices, masks = padded_batches(plan.batches, [0])
    >>> padding_is_masked(plan, data, indices[0, 0], masks[0, 0], 10)

  Args:
    plan: a plan with Poisson or cyclic Poisson batches.
    data: the data (its training part is indexed by `ids`).
    ids: one step's padded example ids.
    mask: its mask.
    num_classes: classes of the model.

  Returns:
    True when the two releases are identical.

  Raises:
    ValueError: if the batch has no padding to check.
  """
  ids, mask = np.asarray(ids), np.asarray(mask, bool)
  if mask.all():
    raise ValueError('the batch has no padded row to check')
  n = int(data.train_y.shape[0])
  # Other examples in the padded rows (a label different from example 0's,
  # so their gradients differ from its).
  other = int(np.flatnonzero(np.asarray(data.train_y) !=
                             int(data.train_y[0]))[0])
  moved = np.where(mask, ids, other % n)
  params = {'w': jnp.full((data.train_x.shape[1], num_classes), 0.01),
            'b': jnp.zeros((num_classes,))}
  tx = plan.private_transformation
  state = tx.init(params)

  @jax.jit
  def release(ids, mask):
    updates, _ = tx.update(None, state, params,
                           **step_inputs(data.train_x, data.train_y, ids,
                                         mask))
    return updates

  first = release(jnp.asarray(ids), jnp.asarray(mask))
  second = release(jnp.asarray(moved), jnp.asarray(mask))
  return all(bool(jnp.array_equal(a, b)) for a, b in zip(
      jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)))


def make_run(method: str, config: ml_collections.ConfigDict,
             host_plan: Optional[plans.Plan], bands: Optional[int],
             num_classes: int, masked: bool):
  """One whole training run as a pure function of (hparams, seed, data).

  Args:
    method: one of `METHODS`.
    config: the experiment config.
    host_plan: the calibrated plan of the setting (None for 'nonprivate'):
      its noise multiplier is used, and the plan built inside must have its
      mechanism and participation.
    bands: b of `banded_amplified`.
    num_classes: number of classes.
    masked: whether the batches are padded and masked.

  Returns:
    `train_fn(hparams, seed, run_data) -> {'val_accuracy', 'test_accuracy'}`
    for `sweeps.run_sweep`.
  """

  def train_fn(hparams, seed, run: RunData):
    data = run.data
    n = int(data.train_y.shape[0])
    row = jnp.argmax(run.seeds == seed)
    params = {'w': jnp.zeros((data.train_x.shape[1], num_classes),
                             jnp.float32),
              'b': jnp.zeros((num_classes,), jnp.float32)}
    if method == 'nonprivate':
      tx = optax.sgd(hparams['learning_rate'], momentum=config.momentum)
    else:
      # Noise key and sampler seed both come from the run's seed, through
      # different generators (JAX's and NumPy's).
      plan = make_plan(
          method, config, n, noise_multiplier=host_plan.noise_multiplier,
          bands=bands, l2_clip=hparams['clip'],
          learning_rate=hparams['learning_rate'],
          key=jax.random.fold_in(jax.random.key(seed), 1))
      if (plan.participation != host_plan.participation or
          plan.mechanism.identity != host_plan.mechanism.identity):
        raise AssertionError('the compiled run\'s plan is not the host '
                             'plan\'s mechanism and participation')
      tx = plan.transformation

    if method == 'nonprivate':
      tx = runs.non_private(srg_memf.mean_loss, tx)
    masks = run.masks[row] if masked else None
    (params, state), _ = runs.scan_steps(
        tx, params, tx.init(params), (run.indices[row], masks),
        inputs_fn=functools.partial(step_inputs, data.train_x, data.train_y))
    return {**runs.refusal_metrics(state),
            'val_accuracy': srg_memf.accuracy(params, data.val_x,
                                              data.val_y),
            'test_accuracy': srg_memf.accuracy(params, data.test_x,
                                               data.test_y)}

  return train_fn


def run_many(method: str, config: ml_collections.ConfigDict,
             host_plan: Optional[plans.Plan], bands: Optional[int],
             num_classes: int, grid: Dict[str, Sequence[float]],
             seeds: Sequence[int], data: srg_memf.Data,
             name: str) -> sweeps.SweepResult:
  """Every grid point x seed of one setting as one vmapped program.

  Args:
    method: one of `METHODS`.
    config: the experiment config.
    host_plan: the setting's plan (None for 'nonprivate').
    bands: b of `banded_amplified`.
    num_classes: number of classes.
    grid: `{'learning_rate': [...], 'clip': [...]}` (their product runs).
    seeds: the seeds.
    data: the data (an argument of the program, not a constant).
    name: label of the progress lines.

  Returns:
    The `sweeps.SweepResult` (`val_accuracy`, `test_accuracy`).
  """
  n = int(data.train_y.shape[0])
  sampler = (nonprivate_sampler(config, n) if host_plan is None
             else host_plan.batches)
  indices, masks = padded_batches(sampler, seeds)
  run = RunData(data, jnp.asarray(np.asarray(seeds), jnp.int32),
                jnp.asarray(indices), jnp.asarray(masks))
  train_fn = make_run(method, config, host_plan, bands, num_classes,
                      masked=isinstance(sampler, _MASKED_SAMPLERS))
  result = sweeps.run_sweep(train_fn, grid, seeds, data=run, name=name)
  # A step refused by a guard of the plan stops the experiment.
  runs.raise_refusal_metrics(result.metrics)
  return result


def largest_bands(config: ml_collections.ConfigDict, num_examples: int) -> int:
  """The most bands (partitions) whose batches can have the expected size:
  b B <= n."""
  return max(1, num_examples // int(config.batch_size))


def extend_bounded(axis: str, values: List[float], edge: str, *,
                   max_bands: int) -> List[float]:
  """`sweeps.search_with_extension`'s `extend`: bands x2 or /2 within
  [1, max_bands] (unchanged at a bound), other axes geometric."""
  if axis != 'bands':
    return sweeps.extend_axis(values, edge)
  if edge == 'upper':
    new = float(min(max_bands, 2 * int(max(values))))
  else:
    new = float(max(1, int(min(values)) // 2))
  return values if new in values else sorted(values + [new])


def tune_and_run(method: str, config: ml_collections.ConfigDict,
                 data: srg_memf.Data, epsilon: Optional[float],
                 num_classes: int) -> Row:
  """Tunes one method at one epsilon on validation, then runs fresh seeds.

  Args:
    method: one of `METHODS`.
    config: the experiment config.
    data: the data.
    epsilon: the target (None for 'nonprivate').
    num_classes: number of classes.

  Returns:
    A result row: the pick, its edge flags and the grid searched, the final
    plan's privacy (noise multiplier, epsilon spent, noise buffers,
    steps), the test accuracies and the tuning rows.
  """
  start = time.time()
  n = int(data.train_y.shape[0])
  private = method != 'nonprivate'
  axes = {'learning_rate': [float(v) for v in config.learning_rates],
          'clip': [float(v) for v in config.clips] if private else [1.0]}
  if method == 'banded_amplified':
    max_bands = largest_bands(config, n)
    axes['bands'] = sorted({float(min(int(b), max_bands))
                            for b in config.bands})
  tuning_seeds = [TUNING_SEED_BASE + s for s in range(config.tuning_seeds)]
  host_plans: Dict[Optional[int], plans.Plan] = {}
  computed: Dict[Tuple[float, ...], float] = {}
  label = f'{method} eps={epsilon:g}' if private else method

  def plan_for(bands: Optional[int]) -> Optional[plans.Plan]:
    if not private:
      return None
    if bands not in host_plans:
      host_plans[bands] = make_plan(method, config, n, epsilon=epsilon,
                                    bands=bands)
    return host_plans[bands]

  def score_points(points: List[Dict[str, float]]) -> List[float]:
    groups: Dict[Optional[int], List[Dict[str, float]]] = {}
    for point in points:
      bands = int(point['bands']) if 'bands' in point else None
      groups.setdefault(bands, []).append(point)
    for bands, group in groups.items():
      grid = {'learning_rate': sorted({p['learning_rate'] for p in group}),
              'clip': sorted({p['clip'] for p in group})}
      result = run_many(
          method, config, plan_for(bands), bands, num_classes, grid,
          tuning_seeds, data,
          f'{label} tuning' + (f' b={bands}' if bands else ''))
      for g in range(result.num_points):
        point = result.point(g)
        key = (point['learning_rate'], point['clip']) + (
            (float(bands),) if bands is not None else ())
        computed[key] = float(result.metrics['val_accuracy'][g].mean())
    return [-computed[tuple(p.values())] for p in points]

  extend = functools.partial(extend_bounded,
                             max_bands=largest_bands(config, n))
  picked, searched, _ = sweeps.search_with_extension(
      axes, score_points=score_points, extensions=int(config.grid_extensions),
      extend=extend)
  bands = int(picked['bands']) if 'bands' in picked else None
  tuning_rows = [dict(method=method, epsilon=epsilon if private else '',
                      learning_rate=key[0], clip=key[1] if private else '',
                      bands=key[2] if len(key) > 2 else '',
                      val_accuracy=score)
                 for key, score in sorted(computed.items())]
  logging.info('%s: tuned in %.0f s: %s (val %.4f)', label,
               time.time() - start, picked, computed[tuple(picked.values())])

  final_data = data
  if config.final_on_full_train:
    final_data = data._replace(
        train_x=jnp.concatenate([data.train_x, data.val_x]),
        train_y=jnp.concatenate([data.train_y, data.val_y]))
  n_final = int(final_data.train_y.shape[0])
  final_plan = None
  if private:
    # The plan as the final runs use it: picked clip and learning rate (for
    # its description), the same calibration.
    final_plan = make_plan(method, config, n_final, epsilon=epsilon,
                           bands=bands, l2_clip=picked['clip'],
                           learning_rate=picked['learning_rate'])
  seeds = list(range(int(config.num_seeds)))
  final = run_many(method, config, final_plan, bands, num_classes,
                   {'learning_rate': [picked['learning_rate']],
                    'clip': [picked['clip']]}, seeds, final_data,
                   f'{label} final')
  test = final.metrics['test_accuracy'][0]
  mean, _, _, half = sweeps.mean_and_interval(test)
  row = {'method': method, 'label': LABELS[method],
         'epsilon_target': epsilon if private else '',
         'learning_rate': picked['learning_rate'],
         'clip': picked['clip'] if private else '',
         'bands': bands if bands is not None else '',
         'grid_edge': sweeps.edge_report(picked, searched),
         'grid_searched': '; '.join(
             f'{axis} ' + ' '.join(f'{v:.4g}' for v in values)
             for axis, values in searched.items() if len(values) > 1),
         'num_train_final': n_final, 'num_seeds': len(test),
         'mean_test_accuracy': float(mean), 'ci95': float(half),
         'runs': test.tolist(), 'tuning': tuning_rows, 'privacy': None}
  if final_plan is not None:
    description = final_plan.describe()
    masked = isinstance(final_plan.batches, _MASKED_SAMPLERS)
    if masked:
      indices, masks = padded_batches(final_plan.batches, [seeds[0]])
      step = int(np.argmin(masks[0].sum(-1)))  # the most padding
      if not padding_is_masked(final_plan, final_data, indices[0, step],
                               masks[0, step], num_classes):
        raise AssertionError(f'{label}: padded rows changed the release')
    row.update(
        noise_multiplier=float(final_plan.noise_multiplier),
        epsilon_spent=float(final_plan.epsilon),
        noise_buffers=int(description['noise_buffers']),
        num_steps=int(final_plan.num_steps),
        sampling=type(final_plan.batches).__name__,
        padding_checked=masked,
        privacy=spine.privacy_entry(label, final_plan))
  else:
    row.update(noise_multiplier='', epsilon_spent='', noise_buffers='',
               num_steps=nonprivate_sampler(config, n_final).num_steps,
               sampling='FixedOrderBatches', padding_checked=False)
  logging.info('%s: test accuracy %.4f +- %.4f over %d seeds (epsilon %s)',
               label, mean, half, len(test), row['epsilon_spent'])
  return row


def _cell(row: Row) -> str:
  return (f'{100 * row["mean_test_accuracy"]:.2f} +- '
          f'{100 * row["ci95"]:.2f}')


def format_results(config: ml_collections.ConfigDict,
                   results: List[Row]) -> str:
  """The results as markdown: accuracy per method x epsilon, then details.

  Example:
    >>> print(format_results(config, results))

  Args:
    config: the experiment config.
    results: the rows of `tune_and_run`.

  Returns:
    The markdown text.
  """
  epsilons = [float(e) for e in config.epsilons]
  private = [r for r in results if r['method'] != 'nonprivate']
  num_seeds = results[0]['num_seeds']
  lines = [
      f'{config.dataset}, {config.num_epochs} epochs, expected batch '
      f'{config.batch_size}, delta {config.delta:g}, SGD momentum '
      f'{config.momentum}, PLD accounting; test accuracy (%) over '
      f'{num_seeds} seeds, mean +- 95% Student-t half-width; '
      'hyperparameters tuned on a validation part with seeds '
      f'{TUNING_SEED_BASE}..{TUNING_SEED_BASE + config.tuning_seeds - 1}, '
      f'final seeds 0..{num_seeds - 1}.', '',
      '| method | ' + ' | '.join(f'epsilon {e:g}' for e in epsilons) + ' |',
      '|---|' + '---|' * len(epsilons)]
  for method in [m for m in METHODS if m != 'nonprivate']:
    rows = {float(r['epsilon_target']): r for r in private
            if r['method'] == method}
    if rows:
      lines.append(f'| {LABELS[method]} | ' + ' | '.join(
          (_cell(rows[e]) + (' (edge)' if rows[e]['grid_edge'] else ''))
          if e in rows else '-' for e in epsilons) + ' |')
  for r in results:
    if r['method'] == 'nonprivate':
      lines.append(f'| {LABELS["nonprivate"]} (no epsilon) | '
                   + ' | '.join([_cell(r)] * len(epsilons)) + ' |')
  lines += [
      '', '| method | epsilon | lr | clip | bands | pick on a grid edge | '
      'noise multiplier | epsilon spent | noise buffers | steps | sampler |',
      '|---|---|---|---|---|---|---|---|---|---|---|']
  for r in results:
    eps = '-' if r['epsilon_target'] == '' else f'{r["epsilon_target"]:g}'
    z = ('-' if r['noise_multiplier'] == ''
         else f'{r["noise_multiplier"]:.3f}')
    spent = '-' if r['epsilon_spent'] == '' else f'{r["epsilon_spent"]:.4f}'
    lines.append(
        f'| {r["label"]} | {eps} | {r["learning_rate"]:.4g} | '
        f'{"-" if r["clip"] == "" else format(r["clip"], ".4g")} | '
        f'{r["bands"] if r["bands"] != "" else "-"} | '
        f'{r["grid_edge"] or "no"} | {z} | {spent} | '
        f'{r["noise_buffers"] if r["noise_buffers"] != "" else "-"} | '
        f'{r["num_steps"]} | {r["sampling"]} |')
  baseline = {float(r['epsilon_target']): r for r in private
              if r['method'] == 'dpsgd_poisson'}
  if baseline and len(private) > len(baseline):
    lines += ['', '| method - DP-SGD | ' + ' | '.join(
        f'epsilon {e:g}' for e in epsilons) + ' |',
              '|---|' + '---|' * len(epsilons)]
    for method in [m for m in METHODS
                   if m not in ('nonprivate', 'dpsgd_poisson')]:
      rows = {float(r['epsilon_target']): r for r in private
              if r['method'] == method}
      if not rows:
        continue
      cells = []
      for e in epsilons:
        if e not in rows or e not in baseline:
          cells.append('-')
          continue
        diff = 100 * (rows[e]['mean_test_accuracy'] -
                      baseline[e]['mean_test_accuracy'])
        p = stats.ttest_ind(rows[e]['runs'], baseline[e]['runs'],
                            equal_var=False).pvalue
        cells.append(f'{diff:+.2f} (p = {p:.2g})')
      lines.append(f'| {LABELS[method]} | ' + ' | '.join(cells) + ' |')
    lines.append('')
    lines.append('Differences in points; p: two-sided Welch t-test over the '
                 'final seeds (the methods draw different batches, so the '
                 'seeds are not paired).')
  return '\n'.join(lines) + '\n'


def plot(path: str, config: ml_collections.ConfigDict,
         results: List[Row]) -> None:
  """Test accuracy against epsilon, one line per method, 95% error bars.

  The non-private reference is a horizontal line with its interval shaded.
  Points of the methods are shifted a little sideways so that their error
  bars do not hide each other.
  """
  fig, ax = plt.subplots(figsize=(7, 4.5))
  methods = [m for m in METHODS if m != 'nonprivate' and any(
      r['method'] == m for r in results)]
  epsilons = [float(e) for e in config.epsilons]
  for i, method in enumerate(methods):
    rows = sorted((r for r in results if r['method'] == method),
                  key=lambda r: float(r['epsilon_target']))
    shift = 1.0 + 0.04 * (i - (len(methods) - 1) / 2)
    xs = [float(r['epsilon_target']) * shift for r in rows]
    ax.errorbar(xs, [100 * r['mean_test_accuracy'] for r in rows],
                yerr=[100 * r['ci95'] for r in rows], marker='o',
                capsize=4, label=LABELS[method])
  for r in results:
    if r['method'] == 'nonprivate':
      mean, half = 100 * r['mean_test_accuracy'], 100 * r['ci95']
      ax.axhline(mean, color='k', linestyle='--', linewidth=1,
                 label=LABELS['nonprivate'])
      if math.isfinite(half):
        ax.axhspan(mean - half, mean + half, color='k', alpha=0.08)
  ax.set_xscale('log')
  ax.set_xticks(epsilons, [f'{e:g}' for e in epsilons])
  ax.minorticks_off()
  ax.set_xlabel(f'epsilon (delta = {config.delta:g})')
  ax.set_ylabel('test accuracy (%), mean and 95% interval')
  ax.set_title(f'{config.dataset}: {config.num_epochs} epochs, expected '
               f'batch {config.batch_size}, {results[0]["num_seeds"]} seeds',
               fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc='lower right')
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run(config: ml_collections.ConfigDict, output_dir: str) -> List[Row]:
  """Runs every method at every epsilon and writes the outputs.

  Example:
    >>> results = run(correlated_noise_digits.get_config(), '/tmp/cn')

  Args:
    config: the experiment config.
    output_dir: where the tables, the plot and the run record go.

  Returns:
    One result row per (method, epsilon); one for 'nonprivate'.

  Raises:
    ValueError: for fewer than 2 final seeds (no interval), an unknown
      method, or an epsilon that is not positive.
  """
  if int(config.num_seeds) < 2:
    raise ValueError('num_seeds must be at least 2: the results report a '
                     f'95% interval over seeds, got {config.num_seeds}')
  for method in config.methods:
    _check_method(method)
  if not config.epsilons or not all(float(e) > 0 for e in config.epsilons):
    raise ValueError(f'epsilons must be positive, got {config.epsilons!r}')
  os.makedirs(output_dir, exist_ok=True)
  start = time.time()
  data = srg_memf.load_data(config)
  num_classes = int(max(int(data.train_y.max()), int(data.test_y.max())) + 1)
  logging.info('%s: %d train, %d validation, %d test examples, %d features',
               config.dataset, data.train_y.shape[0], data.val_y.shape[0],
               data.test_y.shape[0], data.train_x.shape[1])
  results = []
  for method in config.methods:
    for epsilon in ([float(e) for e in config.epsilons]
                    if method != 'nonprivate' else [None]):
      results.append(tune_and_run(method, config, data, epsilon,
                                  num_classes))
  hidden = ('runs', 'tuning', 'privacy')
  outputs.write_csv(os.path.join(output_dir, 'results.csv'),
                    [{k: v for k, v in r.items() if k not in hidden}
                     for r in results])
  outputs.write_csv(os.path.join(output_dir, 'tuning.csv'),
                    [row for r in results for row in r['tuning']])
  outputs.write_csv(os.path.join(output_dir, 'runs.csv'), [
      {'method': r['method'], 'epsilon': r['epsilon_target'], 'seed': s,
       'test_accuracy': v} for r in results for s, v in enumerate(r['runs'])])
  table = format_results(config, results)
  with open(os.path.join(output_dir, 'results.md'), 'w') as f:
    f.write(table)
  plot(os.path.join(output_dir, 'accuracy.png'), config, results)
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(
          config, privacy=[r['privacy'] for r in results if r['privacy']],
          wall_seconds=time.time() - start,
          extra={'seeds': {
              'tuning': [TUNING_SEED_BASE,
                         TUNING_SEED_BASE + int(config.tuning_seeds) - 1],
              'final': [0, int(config.num_seeds) - 1]}}))
  print(table)
  return results


if __name__ == '__main__':
  cli.launch(run, 'configs/correlated_noise_digits.py',
             'DP-SGD (Poisson) against dense DP-MEMF, Amplified BandMF and '
             'BLT at several epsilons; other configs: '
             'configs/correlated_noise_*.py',
             output_dir='results/correlated_noise')
