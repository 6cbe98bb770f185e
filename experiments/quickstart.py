"""Quickstart: DP-SGD, DP-FTRL and DP-MEMF against non-private SGD on digits.

Trains multiclass logistic regression (a flax `models.MLP([64, 10])`, zero
init) on scikit-learn's bundled digits, each private run built by ONE plan
(`dpsco_jax.plans`) from the config's (epsilon, delta):

* `dpsgd`: Poisson-sampled batches, amplified accounting;
* `dpftrl`: a fixed public order repeated every epoch, a fresh tree every
  epoch, accounted as `FixedOrder` (checked in every step);
* `dpmemf`: DP-MEMF (paper 001 Algorithm 2) on the same fixed order, with
  a strategy optimized for the momentum workload of the run;
* `nonprivate`: the same optimizer on the plain mean gradient of the same
  fixed-order batches.

    python -m experiments.quickstart --config=configs/quickstart.py \
        --config.epsilon=2 --output_dir=results/quickstart

Writes `metrics.csv` (with the epsilon spent so far at every evaluation),
`summary.csv`, `learning_curves.png` and `run_record.json` to
`--output_dir`. The train loss and test accuracy are diagnostics computed
outside the privacy guarantee (they are never fed back into training).
"""

import math
import os
import time
import zlib
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from dpsco_jax import batching
from dpsco_jax import plans
from experiments import cli
from experiments import datasets
from experiments import models
from experiments import outputs
from experiments import spine

ALGORITHMS = ('dpsgd', 'dpftrl', 'dpmemf', 'nonprivate')
METRICS_COLUMNS = ('algorithm', 'step', 'epoch', 'epsilon', 'train_loss',
                   'test_accuracy')
SUMMARY_COLUMNS = ('algorithm', 'num_steps', 'noise_multiplier',
                   'target_epsilon', 'epsilon_spent', 'delta',
                   'test_accuracy')
Row = dict[str, Any]


def seed_for(seed: int, purpose: str) -> int:
  """An independent seed per purpose, so that no two random streams coincide."""
  sequence = np.random.SeedSequence([seed, zlib.crc32(purpose.encode())])
  return int(sequence.generate_state(1)[0])


def make_plan(name: str, loss_fn, config: ml_collections.ConfigDict,
              num_examples: int) -> plans.Plan:
  """The plan of one private algorithm, from the config."""
  common = dict(
      optimizer=optax.sgd(config.learning_rate, momentum=config.momentum),
      num_examples=num_examples, epochs=config.num_epochs,
      l2_clip=config.clip, epsilon=config.epsilon, delta=config.delta,
      seed=seed_for(config.seed, f'{name}/batches'),
      key=jax.random.key(seed_for(config.seed, f'{name}/noise')))
  if name == 'dpsgd':
    return plans.dpsgd(loss_fn, batch_size=config.expected_batch_size,
                       **common)
  if name == 'dpftrl':
    return plans.dpftrl(loss_fn, batch_size=config.batch_size,
                        restart='epoch', **common)
  return plans.dpmemf(loss_fn, batch_size=config.batch_size,
                      momentum=config.momentum, **common)


def run_algorithm(name: str, config: ml_collections.ConfigDict,
                  train: dict, test: dict) -> tuple[spine.RunResult,
                                                    Row, Any]:
  """Trains one algorithm; returns its result, summary row and plan."""
  graphdef, params = models.split(models.MLP([64, 10], rngs=nnx.Rngs(0)))
  # Zero init: the loss is convex, there is no symmetry to break.
  params = jax.tree_util.tree_map(jnp.zeros_like, params)
  train_loss, accuracy = models.mean_loss(graphdef), jax.jit(
      lambda p: models.accuracy(graphdef, p, test))
  evaluate = lambda p: {'train_loss': train_loss(p, train),
                        'test_accuracy': accuracy(p)}
  n = len(train['y'])
  if name == 'nonprivate':
    sampler = batching.FixedOrderBatches(
        n, config.batch_size, config.num_epochs,
        seed=seed_for(config.seed, 'dpftrl/batches'))
    result = spine.run_optimizer(
        name, optax.sgd(config.learning_rate, momentum=config.momentum),
        train_loss, params, train, sampler, num_steps=sampler.num_steps,
        steps_per_epoch=sampler.steps_per_epoch, evaluate=evaluate,
        eval_every=config.eval_every)
    row = {'num_steps': sampler.num_steps, 'noise_multiplier': 0.0,
           'target_epsilon': None, 'epsilon_spent': math.inf, 'delta': None}
    plan = None
  else:
    plan = make_plan(name, models.example_loss(graphdef), config, n)
    result = spine.run_plan(name, plan, params, train, evaluate=evaluate,
                            eval_every=config.eval_every)
    row = {'num_steps': plan.num_steps,
           'noise_multiplier': plan.noise_multiplier,
           'target_epsilon': config.epsilon, 'epsilon_spent': plan.epsilon,
           'delta': config.delta}
  return result, {'algorithm': name, **row,
                  'test_accuracy': result.rows[-1]['test_accuracy']}, plan


def run(config: ml_collections.ConfigDict, output_dir: str) -> list[Row]:
  """Runs the quickstart and writes its outputs to `output_dir`.

  Args:
    config: see `configs/quickstart.py`.
    output_dir: created if missing.

  Returns:
    One summary row per algorithm (columns `SUMMARY_COLUMNS`).
  """
  unknown = set(config.algorithms) - set(ALGORITHMS)
  if unknown:
    raise ValueError(f'unknown algorithms {sorted(unknown)}; choose from '
                     f'{ALGORITHMS}')
  start = time.perf_counter()
  train, test = datasets.load_digits()
  metrics, summary, privacy = [], [], []
  for name in config.algorithms:
    result, row, plan = run_algorithm(name, config, train, test)
    metrics += result.rows
    summary.append(row)
    if plan is not None:
      privacy.append(spine.privacy_entry(name, plan))
    logging.info('%s: test accuracy %.4f, epsilon %.4g, %.1f s', name,
                 row['test_accuracy'], row['epsilon_spent'],
                 result.wall_seconds)
  os.makedirs(output_dir, exist_ok=True)
  outputs.write_csv(os.path.join(output_dir, 'metrics.csv'), metrics,
                    METRICS_COLUMNS)
  outputs.write_csv(os.path.join(output_dir, 'summary.csv'), summary,
                    SUMMARY_COLUMNS)
  outputs.plot_curves(
      os.path.join(output_dir, 'learning_curves.png'),
      [outputs.Curve(name, [r['epoch'] for r in metrics
                            if r['algorithm'] == name],
                     [r['test_accuracy'] for r in metrics
                      if r['algorithm'] == name])
       for name in config.algorithms],
      xlabel='epoch', ylabel='test accuracy',
      title=(f'digits: private runs at epsilon={config.epsilon:g}, '
             f'delta={config.delta:g}'))
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, privacy=privacy,
                         wall_seconds=time.perf_counter() - start,
                         extra={'experiment': 'experiments.quickstart',
                                'summary': summary}))
  return summary


if __name__ == '__main__':
  cli.launch(run, 'configs/quickstart.py',
             'Private logistic regression on digits: DP-SGD, DP-FTRL, DP-MEMF '
             'against SGD', output_dir='results/quickstart')
