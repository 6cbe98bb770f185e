"""The single-epoch large-batch claim on a synthetic problem (issue 4, exp. 5b).

Papers 000/001 claim that Accelerated-DP-SRGD (Algorithm 1) reaches the
optimal DP-SCO excess risk in ONE pass with batches as large as sqrt(n)
(T = sqrt(n) steps), where single-pass DP-SGD at that batch size gets only
T = sqrt(n) plain steps and the unaccelerated SRG needs B = O(1) (notes
§1.2, §6). This experiment measures it.

Problem (`datasets.synthetic_convex`): least squares, features uniform on
the sphere of radius sqrt(p) (bounded), a planted w*, the l2 ball of radius
R as constraint set, with w* inside it or outside it, and an anisotropic
case (`condition_number`, E[x x^T] = diag(Lambda)). The excess population
risk `F(w) - F(w_C)` (w_C the constrained optimum) is exact in closed form.

Methods (each one pass, each example used once, (epsilon, delta)-DP with
its noise multiplier calibrated by `accounting.calibrate_noise_multiplier`
for exactly the mechanism it runs and `accounting.single_epoch(T)`):

* `srgd`: `accelerated_dp_srgd` (tree noise on prefix sums), output
  `final_params(state)` = y_T;
* `srgd_independent`: the same with `gradient='independent'` (000 Thm
  5.13: clipped minibatch gradients, i.i.d. Gaussian noise);
* `srgd_preset`: `accelerated_dp_srgd` with every parameter from
  `srgd_preset('constrained', method='gdp_paper')` (untuned; `preset`);
* `unaccelerated_srg`: `unaccelerated_dp_srg` (000/001 §4.3);
* `unaccelerated_srg_4_3`: the same at the sketch's step
  `1/beta = B / (M sqrt(n))` (`section_4_3_beta`), only the clip tuned;
* `dpsgd`: `dpsgd` -> `optax.sgd(lr)` -> `srg.projection(R)`;
* `dpftrl`: `dpftrl` (tree residual noise) -> `optax.sgd(lr)` ->
  `srg.projection(R)`: DP-FTRL with a projection after every step (the
  greedy projected variant; without projection it is the lazy FTRL of the
  prefix sums).

Every (method, n, B) compiles ONE program: a `jax.lax.scan` over the T
steps whose batch t is `dynamic_slice(data, t B, B)` (the public fixed
order, one pass), vmapped over a flat list of runs (hyperparameters, case,
data seed, noise key). The hyperparameters are traced: the learning rate
and clip norm directly; beta through an exact reparametrization (below),
since the library takes beta as a Python float.

Beta reparametrization. For the two SRG-type algorithms with loss `s f`,
clip `s C` and beta = 1, every clipped per-example statistic is `s` times
the one of (f, C) (clipping is scale-equivariant), the noise std `z s C`
is `s` times that of (f, C), so the noisy estimate is `s Gradtilde`, and
the steps `Gradtilde / beta` become `s Gradtilde`: the run IS the one with
(f, C, beta = 1 / s), up to float rounding. `tests/experiments/
test_single_epoch_synthetic.py` checks it against a plain Python loop of
`tx.update` at the original beta.

Selection. For every (method, n, B, case), each grid point runs on the
`tune_seeds`; an axis whose best point sits on its edge is extended past it
(up to `grid_extensions` times, `sweeps.search_with_extension`; a pick
still on an edge is flagged in `grid_edge`); the point with the smallest
mean excess risk is re-run on the `eval_seeds` (fresh data and noise),
whose mean and 95% Student-t interval are reported. Selecting by the population risk is NOT a private
hyperparameter selection (the privacy cost of tuning is not accounted).

    python -m experiments.single_epoch_synthetic \
        --config=configs/single_epoch_synthetic.py \
        --output_dir=results/single_epoch_synthetic

Writes `results.csv` (every method, n, B, case: noise multiplier, epsilon
spent, chosen hyperparameters, mean excess risk, interval), `results.md`
(the headline table and the full table), `tuning.csv` (every grid point's
mean excess risk on the tuning seeds), `excess_vs_batch.png`,
`excess_vs_n.png` and `run_record.json`.
"""

import dataclasses
import functools
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import matplotlib
matplotlib.use('Agg')
from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
from matplotlib import ticker  # pylint: disable=g-import-not-at-top
import ml_collections
import numpy as np
import optax
from scipy import stats

from configs import single_epoch_synthetic as default_config
from dpsco_jax import accounting
from dpsco_jax import noise
from dpsco_jax import runs as runs_lib
from dpsco_jax.algorithms import baselines
from dpsco_jax.algorithms import srg
from experiments import cli
from experiments import datasets
from experiments import outputs
from experiments import sweeps

LABELS = {
    'srgd': 'Accelerated-DP-SRGD',
    'srgd_preset': "Accelerated-DP-SRGD, srgd_preset('constrained')",
    'srgd_independent': 'Accelerated, independent gradients',
    'unaccelerated_srg': 'Unaccelerated DP-SRG',
    'unaccelerated_srg_4_3': 'Unaccelerated DP-SRG, §4.3 step B/sqrt(n)',
    'dpsgd': 'DP-SGD (projected)',
    'dpftrl': 'DP-FTRL (tree, projected)',
}
# Which hyperparameter each method sweeps besides the clip norm.
HYPER = {'srgd': 'beta', 'srgd_preset': 'beta', 'srgd_independent': 'beta',
         'unaccelerated_srg': 'beta', 'unaccelerated_srg_4_3': 'beta',
         'dpsgd': 'lr', 'dpftrl': 'lr'}
ACCELERATED = ('srgd', 'srgd_preset', 'srgd_independent')
# Methods that run another's transformation with parameters set by a rule.
BASE = {'srgd_preset': 'srgd', 'unaccelerated_srg_4_3': 'unaccelerated_srg'}


def base(method: str) -> str:
  """The transformation `method` runs (itself unless it is a parameter rule)."""
  if method not in LABELS:
    raise ValueError(f'unknown method {method!r}; choose from {sorted(LABELS)}')
  return BASE.get(method, method)


def mechanism(method: str, num_steps: int) -> noise.NoiseMechanism:
  """The noise mechanism `method` runs for T = `num_steps` steps.

  Args:
    method: a key of `LABELS`.
    num_steps: T.

  Returns:
    The mechanism the transformation builds (and the accountant sees).
  """
  method = base(method)
  if method in ('srgd', 'unaccelerated_srg'):
    return srg.srg_mechanism(num_steps)
  if method in ('srgd_independent', 'dpsgd'):
    # `accelerated_dp_srgd(gradient='independent')` defaults to
    # `noise.gaussian(T)`, the same mechanism as DP-SGD.
    return baselines.dpsgd_mechanism(num_steps)
  if method == 'dpftrl':
    return baselines.dpftrl_mechanism(num_steps)
  raise ValueError(f'unknown method {method!r}')


@functools.lru_cache(maxsize=None)
def noise_multiplier(method: str, num_steps: int, epsilon: float,
                     delta: float) -> float:
  """Calibrated noise multiplier of `method` for one pass of T steps.

  Example:
    >>> z = noise_multiplier('srgd', 100, 1.0, 1e-6)

  Args:
    method: a key of `LABELS`.
    num_steps: T.
    epsilon: target epsilon.
    delta: target delta.

  Returns:
    The smallest multiplier with `accounting.epsilon_spent <= epsilon`.
  """
  return accounting.calibrate_noise_multiplier(
      mechanism(method, num_steps), accounting.single_epoch(num_steps),
      epsilon, delta)


def epsilon_spent(method: str, num_steps: int, multiplier: float,
                  delta: float) -> float:
  """The epsilon of a run of `method` with `multiplier` (PLD accounting)."""
  return accounting.epsilon_spent(mechanism(method, num_steps), multiplier,
                                  accounting.single_epoch(num_steps), delta)


def transformation(method: str, loss: Callable[..., jax.Array], *,
                   num_steps: int, multiplier: float, hyper: Any, clip: Any,
                   radius: float, key: jax.Array
                   ) -> optax.GradientTransformationExtraArgs:
  """The library transformation of `method` with TRACEABLE hyperparameters.

  `hyper` is the learning rate (DP-SGD, DP-FTRL) or beta (SRG-type); both
  it and `clip` may be tracers. Beta enters by the reparametrization of
  the module docstring: loss `s f` with `s = 1 / beta`, clip `s C` and the
  library's beta (or step) fixed to 1.

  Example:
    >>> tx = transformation('srgd', problem.loss, num_steps=100,
    ...                     multiplier=9.0, hyper=30.0, clip=1.0,
    ...                     radius=1.0, key=jax.random.key(0))

  Args:
    method: a key of `LABELS`.
    loss: the per-example loss `loss(w, example)`.
    num_steps: T.
    multiplier: the calibrated noise multiplier.
    hyper: learning rate or beta.
    clip: clip norm (per-example gradient, or difference for SRG).
    radius: R.
    key: the run's noise key.

  Returns:
    An `optax.GradientTransformationExtraArgs` (call with `batch=`).
  """
  method = base(method)
  if HYPER[method] == 'beta':
    scale = 1.0 / hyper
    scaled_loss = lambda w, example: scale * loss(w, example)
    common = dict(l2_clip=scale * clip, noise_multiplier=multiplier,
                  num_steps=num_steps, beta=1.0, radius=radius, key=key)
    if method == 'srgd':
      return srg.accelerated_dp_srgd(scaled_loss, **common)
    if method == 'srgd_independent':
      return srg.accelerated_dp_srgd(scaled_loss, gradient='independent',
                                     **common)
    return srg.unaccelerated_dp_srg(scaled_loss, **common)
  if method == 'dpsgd':
    private = baselines.dpsgd(loss, l2_clip=clip, noise_multiplier=multiplier,
                              num_steps=num_steps, key=key)
  else:
    private = baselines.dpftrl(loss, l2_clip=clip,
                               noise_multiplier=multiplier,
                               num_steps=num_steps, key=key)
  return optax.chain(private, optax.sgd(hyper), srg.projection(radius))


def output(method: str, params: jax.Array, state: Any) -> jax.Array:
  """The algorithm's output: y_T for the accelerated ones, else x_T."""
  return srg.final_params(state) if method in ACCELERATED else params


def train(method: str, loss: Callable[..., jax.Array], x: jax.Array,
          y: jax.Array, *, batch_size: int, num_steps: int,
          multiplier: float, hyper: Any, clip: Any, radius: float,
          key: jax.Array) -> jax.Array:
  """One single-pass run as a `lax.scan`; returns the output w.

  Batch t is examples `[t B, (t + 1) B)` of the data (fixed public order,
  each example used once), stepped by `dpsco_jax.runs.scan_steps`.

  Example:
    >>> w = train('dpsgd', problem.loss, x, y, batch_size=10, num_steps=100,
    ...           multiplier=3.4, hyper=0.1, clip=1.0, radius=1.0,
    ...           key=jax.random.key(0))

  Args:
    method: a key of `LABELS`.
    loss: the per-example loss.
    x: features `[n, p]` (n >= B T).
    y: targets `[n]`.
    batch_size: B.
    num_steps: T.
    multiplier: calibrated noise multiplier.
    hyper: learning rate or beta (may be traced).
    clip: clip norm (may be traced).
    radius: R.
    key: noise key.

  Returns:
    The output parameters `[p]`.
  """
  tx = transformation(method, loss, num_steps=num_steps,
                      multiplier=multiplier, hyper=hyper, clip=clip,
                      radius=radius, key=key)
  params = jnp.zeros(x.shape[1], x.dtype)
  # Step t's batch: examples [t B, (t + 1) B).
  step_ids = jnp.arange(num_steps * batch_size).reshape(num_steps,
                                                          batch_size)
  (params, state), _ = runs_lib.scan_steps(
      tx, params, tx.init(params), (step_ids, None),
      inputs_fn=runs_lib.gathered_inputs({'x': x, 'y': y}))
  return output(method, params, state)


def train_python_loop(method: str, loss: Callable[..., jax.Array],
                      x: np.ndarray, y: np.ndarray, *, batch_size: int,
                      num_steps: int, multiplier: float, hyper: float,
                      clip: float, radius: float, key: jax.Array
                      ) -> jax.Array:
  """Reference: the library's transformations stepped by a Python loop.

  Beta goes to the library as is (no reparametrization), so this checks
  `train` end to end.

  Args:
    method: a key of `LABELS`.
    loss: the per-example loss.
    x: features `[n, p]`.
    y: targets `[n]`.
    batch_size: B.
    num_steps: T.
    multiplier: noise multiplier.
    hyper: learning rate or beta.
    clip: clip norm.
    radius: R.
    key: noise key.

  Returns:
    The output parameters `[p]`.
  """
  common = dict(l2_clip=clip, noise_multiplier=multiplier,
                num_steps=num_steps, key=key)
  method = base(method)
  if method == 'srgd':
    tx = srg.accelerated_dp_srgd(loss, beta=hyper, radius=radius, **common)
  elif method == 'srgd_independent':
    tx = srg.accelerated_dp_srgd(loss, beta=hyper, radius=radius,
                                 gradient='independent', **common)
  elif method == 'unaccelerated_srg':
    tx = srg.unaccelerated_dp_srg(loss, beta=hyper, radius=radius, **common)
  elif method == 'dpsgd':
    tx = optax.chain(baselines.dpsgd(loss, **common), optax.sgd(hyper),
                     srg.projection(radius))
  else:
    tx = optax.chain(baselines.dpftrl(loss, **common), optax.sgd(hyper),
                     srg.projection(radius))
  params = jnp.zeros(x.shape[1], jnp.float32)
  state = tx.init(params)
  # Jitted once (same shapes every step) only to keep the loop fast.
  update = jax.jit(lambda params, state, batch: tx.update(
      None, state, params, batch=batch))
  for t in range(num_steps):
    batch = {'x': jnp.asarray(x[t * batch_size:(t + 1) * batch_size]),
             'y': jnp.asarray(y[t * batch_size:(t + 1) * batch_size])}
    updates, state = update(params, state, batch)
    params = optax.apply_updates(params, updates)
  return output(method, params, state)


@dataclasses.dataclass
class Data:
  """Per data seed: the features of each feature law and each case's targets.

  Cases with the same condition number share their features (the same
  seed draws the same features and label noise; only ||w*|| differs).

  Attributes:
    x: float32 `[seeds, kinds, n, p]`, one slice per distinct condition
      number.
    y: float32 `[seeds, cases, n]`.
    kinds: per case, its index into `x`'s second axis.
    problems: `problems[s][c]`, the `ConvexProblem` (closed-form risk).
  """

  x: np.ndarray
  y: np.ndarray
  kinds: List[int]
  problems: List[List[datasets.ConvexProblem]]


def make_data(num_examples: int, seeds: Sequence[int],
              config: ml_collections.ConfigDict) -> Data:
  """Draws one training sample per seed (every case) with no test split."""
  conditions = list(config.condition_numbers)
  distinct = sorted(set(conditions), key=conditions.index)
  kinds = [distinct.index(c) for c in conditions]
  xs, ys, problems = [], [], []
  for seed in seeds:
    per_case = [datasets.synthetic_convex(
        'linear_regression', num_train=num_examples, num_test=0,
        dim=config.dim, optimum_norm=norm, noise_std=config.noise_std,
        features='sphere', condition_number=condition, seed=seed)
                for norm, condition in zip(config.optimum_norms, conditions)]
    features = []
    for kind in range(len(distinct)):
      first = per_case[kinds.index(kind)].train['x']
      for case, problem in enumerate(per_case):
        # Sharing x saves memory; it relies on the generator drawing the
        # features independently of ||w*||.
        if kinds[case] == kind and not np.array_equal(problem.train['x'],
                                                      first):
          raise AssertionError('cases with one seed and one condition '
                               'number must share the features')
      features.append(first)
    xs.append(np.stack(features))
    ys.append(np.stack([p.train['y'] for p in per_case]))
    problems.append([dataclasses.replace(p, train={}, test={})
                     for p in per_case])
  return Data(x=np.stack(xs), y=np.stack(ys), kinds=kinds, problems=problems)


def excess_risk(problem: datasets.ConvexProblem, w: np.ndarray,
                radius: float) -> float:
  """F(w) - F(w_C), exact (closed form), w_C the constrained optimum."""
  if not np.all(np.isfinite(w)):
    return math.inf
  return (problem.population_risk(w) -
          problem.population_risk(problem.constrained_optimum(radius)))


def make_runner(method: str, batch_size: int, num_steps: int,
                multiplier: float, radius: float, loss: Callable[..., Any]):
  """One run `(inputs, x, y) -> w` for `sweeps.run_in_chunks` (`run_list`).

  `inputs` holds one run's slot, case, kind, hyper, clip and key seed; the
  run trains on `x[slot, kind]`, `y[slot, case]`. One compilation per
  (method, n, B) and chunk size.
  """

  def one(inputs, x, y):
    return train(method, loss, x[inputs['slot'], inputs['kind']],
                 y[inputs['slot'], inputs['case']], batch_size=batch_size,
                 num_steps=num_steps, multiplier=multiplier,
                 hyper=inputs['hyper'], clip=inputs['clip'], radius=radius,
                 key=jax.random.key(inputs['key']))

  return one


def run_list(runner, data: Data, runs: List[Dict[str, Any]], chunk: int,
             key_base: int) -> np.ndarray:
  """Runs `runs` (dicts slot, case, hyper, clip, seed) in chunks of `chunk`.

  Run r's noise key is `jax.random.key(key_base + seed)`. Returns the
  outputs `[len(runs), p]`.
  """
  per_run = {'slot': np.asarray([r['slot'] for r in runs], np.int32),
             'case': np.asarray([r['case'] for r in runs], np.int32),
             'kind': np.asarray([data.kinds[r['case']] for r in runs],
                                np.int32),
             'hyper': np.asarray([r['hyper'] for r in runs], np.float32),
             'clip': np.asarray([r['clip'] for r in runs], np.float32),
             'key': np.asarray([key_base + r['seed'] for r in runs],
                               np.uint32)}
  done = sweeps.run_in_chunks(runner, per_run, max_parallel=chunk,
                              shared=(jnp.asarray(data.x),
                                      jnp.asarray(data.y)), name='runs')
  return np.asarray(done.outputs, np.float64)


def batch_sizes(num_examples: int, rules: Sequence[Tuple[float, float]]
                ) -> List[int]:
  """B = max(1, round(c n^e)) for each rule (c, e)."""
  return [max(1, int(round(c * num_examples ** e))) for c, e in rules]


def hyper_grid(method: str, num_steps: int,
               config: ml_collections.ConfigDict, *, num_examples: int = 0,
               batch_size: int = 1,
               problem: Optional[datasets.ConvexProblem] = None
               ) -> List[float]:
  """The learning rates or betas `method` starts its search from at T steps.

  `unaccelerated_srg_4_3` has one beta, the §4.3 sketch's
  (`section_4_3_beta`, which needs `num_examples`, `batch_size` and
  `problem`).
  """
  if method == 'unaccelerated_srg_4_3':
    return [section_4_3_beta(num_examples, batch_size, problem)]
  if method in ACCELERATED:
    return [r * num_steps ** 1.5 for r in config.accelerated_relative_betas]
  if method == 'unaccelerated_srg':
    return list(config.srg_betas)
  return list(config.learning_rates)


def section_4_3_beta(num_examples: int, batch_size: int,
                     problem: datasets.ConvexProblem) -> float:
  """Papers 000/001 §4.3's step `1/beta = B / (M sqrt(n))`.

  The sketch takes L = R = M = 1 and `1/beta = B / sqrt(n)`; here M is the
  population smoothness `max(E[x x^T])` (1 for the isotropic cases), so the
  step is the sketch's in the problem's own scale.

  Example:
    >>> section_4_3_beta(10**4, 100, problem)   # 1.0 for isotropic features
  """
  smoothness = float(np.max(problem.spectrum))
  return smoothness * math.sqrt(num_examples) / batch_size


def preset_constants(problem: datasets.ConvexProblem,
                     config: ml_collections.ConfigDict) -> Tuple[float, float]:
  """The (L, M) given to `srgd_preset`: per-example bounds on the ball.

  With `||x|| <= x_max = sqrt(d max(Lambda))` (sphere features) and
  `|y| <= ||w*|| x_max + 3 sigma` (the label noise cut at 3 sigma: a 0.27%
  tail, which the clip bounds like any other example, so privacy does not
  rest on it), the gradient `(<w, x> - y) x` on `||w|| <= R` has norm at
  most `L = x_max ((R + ||w*||) x_max + 3 sigma)`, and the Hessian `x x^T`
  norm at most `M = x_max^2`.

  Example:
    >>> lipschitz, smoothness = preset_constants(problem, config)
  """
  x_max = math.sqrt(config.dim * float(np.max(problem.spectrum)))
  lipschitz = x_max * ((config.radius + float(np.linalg.norm(
      problem.optimum))) * x_max + 3.0 * config.noise_std)
  return lipschitz, x_max ** 2


def preset(num_examples: int, problem: datasets.ConvexProblem,
           config: ml_collections.ConfigDict) -> srg.SrgdParameters:
  """`srgd_preset('constrained')` (paper 000 Thm 5.12) with the papers'
  GDP calibration (`method='gdp_paper'`) for one case.

  Example:
    >>> preset(10**5, problem, config).beta   # with preset_constants' L, M
  """
  lipschitz, smoothness = preset_constants(problem, config)
  return srg.srgd_preset(
      'constrained', num_examples=num_examples, epsilon=config.epsilon,
      delta=num_examples ** -config.delta_exponent, lipschitz=lipschitz,
      smoothness=smoothness, radius=config.radius, dimension=config.dim,
      method='gdp_paper')


def t_interval(values: np.ndarray) -> Tuple[float, float]:
  """Mean and half-width of the 95% Student-t interval."""
  values = np.asarray(values, np.float64)
  mean = float(np.mean(values))
  if len(values) < 2 or not np.all(np.isfinite(values)):
    return mean, math.nan
  half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / (
      math.sqrt(len(values)))
  return mean, float(half)


def run_cell(method: str, num_examples: int, batch_size: int,
             tune: Data, evaluate: Data, config: ml_collections.ConfigDict,
             tuning_rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
  """Tunes and evaluates one (method, n, B) for every case.

  Each case searches its own grid of (learning rate or beta) x clip on the
  tuning seeds, extending an axis whose pick sits on its edge
  (`sweeps.search_with_extension`, up to `config.grid_extensions` times);
  the pick is run on the evaluation seeds. `srgd_preset` is not tuned: it
  runs the preset's B, T, beta, clip and noise.

  Returns one result row per case; appends every grid point's tuning mean
  to `tuning_rows`.
  """
  delta = num_examples ** -config.delta_exponent
  cases = range(len(config.cases))
  loss = tune.problems[0][0].loss  # the same loss for every seed and case
  hyper_name = HYPER[method]
  start = time.perf_counter()
  chosen = {}
  if method == 'srgd_preset':
    presets = [preset(num_examples, evaluate.problems[0][k], config)
               for k in cases]
    batch_size, num_steps = presets[0].batch_size, presets[0].num_steps
    multiplier = presets[0].noise_multiplier  # depends on T, eps, delta only
    for k in cases:
      chosen[k] = ({hyper_name: presets[k].beta, 'clip': presets[k].l2_clip},
                   '')
  else:
    num_steps = num_examples // batch_size
    multiplier = noise_multiplier(method, num_steps, config.epsilon, delta)
  spent = epsilon_spent(method, num_steps, multiplier, delta)
  runner = make_runner(method, batch_size, num_steps, multiplier,
                       config.radius, loss)
  chunk = max(1, config.examples_per_call // batch_size)
  for k in cases if method != 'srgd_preset' else ():

    def score_points(points, k=k):
      runs = [{'slot': s, 'case': k, 'hyper': p[hyper_name],
               'clip': p['clip'], 'seed': seed, 'point': i}
              for i, p in enumerate(points)
              for s, seed in enumerate(config.tune_seeds)]
      out = run_list(runner, tune, runs, min(chunk, len(runs)),
                     key_base=10_000)
      risks = np.array([excess_risk(tune.problems[r['slot']][k], w,
                                    config.radius)
                        for r, w in zip(runs, out)])
      means = []
      for i in range(len(points)):
        mean = float(np.mean(risks[[r['point'] == i for r in runs]]))
        means.append(mean if np.isfinite(mean) else math.inf)
      return means

    grid = {hyper_name: hyper_grid(method, num_steps, config,
                                   num_examples=num_examples,
                                   batch_size=batch_size,
                                   problem=tune.problems[0][k]),
            'clip': list(config.clips)}
    picked, searched, scores = sweeps.search_with_extension(
        grid, score_points=score_points, extensions=config.grid_extensions)
    for values, mean in scores.items():
      point = dict(zip(searched, values))
      tuning_rows.append({'method': method, 'n': num_examples,
                          'batch_size': batch_size, 'case': config.cases[k],
                          hyper_name: point[hyper_name],
                          'clip': point['clip'], 'tune_mean_excess': mean})
    chosen[k] = (picked, sweeps.edge_report(picked, searched))
  eval_runs = [{'slot': s, 'case': k, 'hyper': chosen[k][0][hyper_name],
                'clip': chosen[k][0]['clip'], 'seed': seed}
               for k in cases for s, seed in enumerate(config.eval_seeds)]
  outputs_eval = run_list(runner, evaluate, eval_runs,
                          min(chunk, len(eval_runs)), key_base=20_000)
  risks_eval = np.array([
      excess_risk(evaluate.problems[r['slot']][r['case']], w, config.radius)
      for r, w in zip(eval_runs, outputs_eval)])
  seconds = time.perf_counter() - start
  rows = []
  for k in cases:
    values = risks_eval[[r['case'] == k for r in eval_runs]]
    mean, half = t_interval(values)
    point, edge = chosen[k]
    rows.append({
        'method': method, 'label': LABELS[method], 'n': num_examples,
        'batch_size': batch_size, 'num_steps': num_steps,
        'case': config.cases[k], 'epsilon_target': config.epsilon,
        'delta': delta, 'noise_multiplier': multiplier,
        'epsilon_spent': spent, 'hyper_name': hyper_name,
        'hyper': point[hyper_name], 'clip': point['clip'],
        'grid_edge': edge, 'chosen_on_grid_edge': bool(edge),
        'excess_mean': mean, 'excess_ci95': half,
        'excess_median': float(np.median(values)),
        'eval_seeds': len(values), 'seconds': seconds})
  logging.info('%s n=%d B=%d T=%d z=%.3f: %s (%.1f s)', method,
               num_examples, batch_size, num_steps, multiplier,
               ', '.join(f"{r['case']} {r['excess_mean']:.3g}"
                         f"+-{r['excess_ci95']:.2g}" for r in rows), seconds)
  return rows


def fmt(mean: float, half: float) -> str:
  if not math.isfinite(mean):
    return 'diverged'
  return f'{mean:.3g} ± {half:.2g}'


def markdown(rows: List[Dict[str, Any]], config: ml_collections.ConfigDict
             ) -> str:
  """The headline table (sqrt(n) and small batch) and the full table."""
  ns = sorted({r['n'] for r in rows})
  lines = [
      f"Excess population risk F(w) - F(w_C) (exact), mean ± 95% Student-t "
      f"half-width over {len(config.eval_seeds)} evaluation seeds (fresh "
      f"data and noise); epsilon = {config.epsilon:g}, delta = "
      f"n^-{config.delta_exponent:g}, one pass. Hyperparameters were "
      f"selected on {len(config.tune_seeds)} other seeds by the population "
      'risk: NOT a private selection (its privacy cost is not accounted). '
      'Each grid axis (lr or beta, and clip) was extended past an edge pick '
      f'up to {config.grid_extensions} times; `*`: a pick still on an edge '
      '(`grid_edge` in results.csv says which).', '']
  for case in config.cases:
    lines += [f'### {case}', '',
              '| method | B | ' + ' | '.join(f'n = {n:,}' for n in ns) + ' |',
              '|---|---|' + '---|' * len(ns)]
    for method in config.methods:
      for rule_name, rule in (('sqrt(n)', config.headline_rule),
                              ('n^(1/4)', config.small_rule)):
        if method == 'srgd_preset' and rule != config.headline_rule:
          continue   # the preset runs only its own B = floor(sqrt(n))
        cells, sizes = [], []
        for n in ns:
          b = batch_sizes(n, config.batch_rules)[rule]
          match = [r for r in rows if r['n'] == n and r['method'] == method
                   and r['case'] == case and (
                       r['batch_size'] == b or method == 'srgd_preset')]
          if match:
            r = match[0]
            b = r['batch_size']
            cells.append(fmt(r['excess_mean'], r['excess_ci95']) +
                         ('*' if r['chosen_on_grid_edge'] else ''))
            sizes.append(str(b))
          else:
            cells.append('-')
        lines.append(f'| {LABELS[method]} | {rule_name} '
                     f"({'/'.join(sizes)}) | " + ' | '.join(cells) + ' |')
    lines.append('')
  lines += ['### All runs', '',
            '| case | n | B | T | method | z | eps spent | hyper | clip | '
            'excess (mean ± 95%) |', '|---|---|---|---|---|---|---|---|---|---|']
  for r in sorted(rows, key=lambda r: (r['case'], r['n'], r['batch_size'],
                                       config.methods.index(r['method']))):
    lines.append(
        f"| {r['case']} | {r['n']:,} | {r['batch_size']} | {r['num_steps']} "
        f"| {r['label']} | {r['noise_multiplier']:.3f} | "
        f"{r['epsilon_spent']:.4f} | {r['hyper_name']}={r['hyper']:.3g} | "
        f"{r['clip']:g} | {fmt(r['excess_mean'], r['excess_ci95'])}"
        f"{'*' if r['chosen_on_grid_edge'] else ''} |")
  return '\n'.join(lines) + '\n'


def _log_error_bars(rows: List[Dict[str, Any]]) -> np.ndarray:
  """Asymmetric `yerr` that stays above 0 on a log axis.

  An interval reaching 0 cannot be drawn on a log axis: its lower bar is cut
  at 5% of the mean (the figures say so); the upper bar is the interval's.
  """
  means = np.array([r['excess_mean'] for r in rows], np.float64)
  halves = np.nan_to_num(np.array([r['excess_ci95'] for r in rows],
                                  np.float64))
  return np.stack([np.minimum(halves, 0.95 * means), halves])




def plot(rows: List[Dict[str, Any]], config: ml_collections.ConfigDict,
         output_dir: str) -> None:
  """Excess risk vs B (per n and case) and vs n at B = sqrt(n) and n^(1/4).

  One colour per method in both figures, ticks at the B and n values run,
  one legend below the panels.
  """
  ns = sorted({r['n'] for r in rows})
  cases = list(config.cases)
  colors = {m: f'C{i}' for i, m in enumerate(config.methods)}
  note = ('mean and 95% interval over the evaluation seeds; a lower bar '
          'reaching 0 is cut at 5% of the mean')
  figure, axes = plt.subplots(len(cases), len(ns),
                              figsize=(4.2 * len(ns), 3.2 * len(cases) + 1.2),
                              squeeze=False)
  for i, case in enumerate(cases):
    for j, n in enumerate(ns):
      ax = axes[i][j]
      used = sorted({r['batch_size'] for r in rows if r['n'] == n})
      for method in config.methods:
        sel = sorted((r for r in rows if r['n'] == n and r['case'] == case
                      and r['method'] == method),
                     key=lambda r: r['batch_size'])
        if sel:
          ax.errorbar([r['batch_size'] for r in sel],
                      [r['excess_mean'] for r in sel],
                      yerr=_log_error_bars(sel), marker='o', capsize=2,
                      color=colors[method], label=LABELS[method])
      ax.axvline(math.sqrt(n), color='gray', linestyle=':', linewidth=1)
      ax.set_xscale('log')
      ax.set_yscale('log')
      ax.set_xlim(min(used) / 1.6, max(used) * 1.6)
      ax.xaxis.set_minor_formatter(ticker.NullFormatter())
      ticks = [b for k, b in enumerate(used)
               if k == 0 or b > 1.15 * used[k - 1]]   # no overlapping labels
      ax.set_xticks(ticks, [str(b) for b in ticks])
      ax.set_xlabel('batch size B (T = n / B)')
      ax.set_ylabel('excess population risk')
      ax.set_title(f'{case}, n = {n:,}', fontsize=10)
      ax.grid(alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  figure.legend(handles, labels, loc='lower center', ncol=3, fontsize=8)
  figure.suptitle(f'one pass, epsilon = {config.epsilon:g}, delta = '
                  f'n^-{config.delta_exponent:g}; dotted: B = sqrt(n)\n'
                  f'{note}', fontsize=9)
  figure.tight_layout(rect=(0, 1.0 / (3.2 * len(cases) + 1.2), 1, 1))
  figure.savefig(os.path.join(output_dir, 'excess_vs_batch.png'), dpi=90)
  plt.close(figure)

  figure, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.6),
                              squeeze=False)
  for i, case in enumerate(cases):
    ax = axes[0][i]
    for method in config.methods:
      for rule, style in ((config.headline_rule, '-'),
                          (config.small_rule, '--')):
        sel = []
        for n in ns:
          b = batch_sizes(n, config.batch_rules)[rule]
          sel += [r for r in rows if r['n'] == n and r['method'] == method
                  and r['case'] == case and (
                      r['batch_size'] == b or (method == 'srgd_preset' and
                                               rule == config.headline_rule))]
        if not sel:
          continue
        name = 'sqrt(n)' if rule == config.headline_rule else 'n^(1/4)'
        ax.errorbar([r['n'] for r in sel], [r['excess_mean'] for r in sel],
                    yerr=_log_error_bars(sel), linestyle=style, marker='o',
                    capsize=2, color=colors[method],
                    label=f'{LABELS[method]}, B = {name}')
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlim(min(ns) / 1.6, max(ns) * 1.6)
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xticks(ns, [f'{n:,}' for n in ns])
    ax.set_xlabel('n')
    ax.set_ylabel('excess population risk')
    ax.set_title(case, fontsize=10)
    ax.grid(alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  figure.legend(handles, labels, loc='lower center', ncol=3, fontsize=8)
  figure.suptitle('solid: B = sqrt(n), dashed: B = n^(1/4); ' + note,
                  fontsize=9)
  figure.tight_layout(rect=(0, 0.2, 1, 1))
  figure.savefig(os.path.join(output_dir, 'excess_vs_n.png'), dpi=90)
  plt.close(figure)


def replot(output_dir: str, config: ml_collections.ConfigDict) -> None:
  """Redraws the figures and `results.md` of a finished run from its
  `results.csv` (e.g. after a change to the plots).

  Example:
    >>> replot('results/single_epoch_synthetic', config)

  Args:
    output_dir: the run's output folder.
    config: the run's config.
  """
  if config.quick:
    config = default_config.quick(config)
  rows = outputs.read_csv(os.path.join(output_dir, 'results.csv'))
  for row in rows:
    for key in ('n', 'batch_size', 'num_steps', 'eval_seeds'):
      row[key] = int(row[key])
    for key in ('excess_mean', 'excess_ci95', 'excess_median', 'hyper',
                'clip', 'noise_multiplier', 'epsilon_spent', 'delta'):
      row[key] = float(row[key])
    row['chosen_on_grid_edge'] = row['chosen_on_grid_edge'] == 'True'
  with open(os.path.join(output_dir, 'results.md'), 'w') as f:
    f.write(markdown(rows, config))
  plot(rows, config, output_dir)


def run(config: ml_collections.ConfigDict, output_dir: str
        ) -> List[Dict[str, Any]]:
  """The whole experiment; writes the outputs and returns the result rows.

  Example:
    >>> rows = run(configs.single_epoch_synthetic.get_config(), 'results')

  Args:
    config: see `configs/single_epoch_synthetic.py`.
    output_dir: where to write.

  Returns:
    One dict per (method, n, B, case).
  """
  if config.quick:
    config = default_config.quick(config)
  os.makedirs(output_dir, exist_ok=True)
  total = time.perf_counter()
  rows, tuning_rows = [], []
  for n in config.num_examples:
    tune = make_data(n, config.tune_seeds, config)
    evaluate = make_data(n, config.eval_seeds, config)
    sizes = batch_sizes(n, config.batch_rules)
    headline = sizes[config.headline_rule]
    if n > config.all_batch_sizes_up_to:
      sizes = [headline]
    for b in sizes:
      for method in config.methods:
        if method == 'srgd_preset' and b != headline:
          continue   # the preset sets its own B <= sqrt(n)
        rows += run_cell(method, n, b, tune, evaluate, config, tuning_rows)
        outputs.write_csv(os.path.join(output_dir, 'results.csv'), rows)
    del tune, evaluate
    # Complete outputs after every n, so a partial run is usable.
    outputs.write_csv(os.path.join(output_dir, 'tuning.csv'), tuning_rows)
    with open(os.path.join(output_dir, 'results.md'), 'w') as f:
      f.write(markdown(rows, config))
    plot(rows, config, output_dir)
  wall_seconds = time.perf_counter() - total
  privacy = [{'name': f"{r['method']}, n {r['n']}, B {r['batch_size']}",
              'mechanism': mechanism(r['method'], r['num_steps']).name,
              'participation': {'class_name': 'FixedOrder', 'num_epochs': 1,
                                'steps_per_epoch': r['num_steps']},
              'noise_multiplier': r['noise_multiplier'], 'delta': r['delta'],
              'target_epsilon': r['epsilon_target'],
              'epsilon_spent': r['epsilon_spent']}
             for r in {(r['method'], r['n'], r['batch_size']): r
                       for r in rows}.values()]
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, privacy=privacy, wall_seconds=wall_seconds,
                         extra={'experiment':
                                'experiments.single_epoch_synthetic'}))
  logging.info('total wall time %.1f s', wall_seconds)
  return rows


if __name__ == '__main__':
  cli.launch(run, 'configs/single_epoch_synthetic.py',
             'Single-epoch private linear regression: Accelerated-DP-SRGD and '
             'its ablations (papers 000/001)',
             output_dir='results/single_epoch_synthetic',
             output_help='Where to write the tables and plots.')
