"""A flax model trained privately by a plan: the shortest complete user path.

A flax nnx MLP or CNN (`experiments.models`) on scikit-learn's digits, one
plan (`dpsco_jax.plans`) from the config's (epsilon, delta), the shared
loop (`experiments.spine`) with the epsilon spent so far, and the outputs
every experiment writes (`metrics.csv`, `learning_curve.png`,
`run_record.json`):

    python -m experiments.flax_digits --config.model=cnn \
        --config.algorithm=dpftrl --output_dir=results/flax_digits

Both models take the ghost-norm path under the default clipping method
(no per-example gradients; the convolutions included).
"""

import os
import time

from flax import nnx
import jax
import ml_collections
import optax

from dpsco_jax import plans
from experiments import cli
from experiments import datasets
from experiments import models
from experiments import outputs
from experiments import quickstart
from experiments import spine

MODELS = ('mlp', 'cnn')
ALGORITHMS = ('dpsgd', 'dpftrl', 'dpmemf', 'dp_srg_memf')


def make_model(name: str, seed: int) -> nnx.Module:
  """The config's model, initialized from `seed`."""
  if name == 'mlp':
    return models.MLP([64, 64, 10], rngs=nnx.Rngs(seed))
  if name == 'cnn':
    return models.CNN(10, image_size=8, channels=(16, 32),
                      rngs=nnx.Rngs(seed))
  raise ValueError(f'model must be one of {MODELS}, got {name!r}')


def make_plan(config: ml_collections.ConfigDict, loss_fn,
              num_examples: int) -> plans.Plan:
  """The config's plan."""
  seed = lambda purpose: quickstart.seed_for(config.seed, purpose)
  common = dict(
      optimizer=optax.sgd(config.learning_rate, momentum=config.momentum),
      num_examples=num_examples, batch_size=config.batch_size,
      epochs=config.num_epochs, l2_clip=config.clip, epsilon=config.epsilon,
      delta=config.delta, seed=seed('batches'),
      key=jax.random.key(seed('noise')))
  if config.algorithm == 'dpsgd':
    return plans.dpsgd(loss_fn, **common)
  if config.algorithm == 'dpftrl':
    return plans.dpftrl(loss_fn, **common)
  if config.algorithm == 'dpmemf':
    return plans.dpmemf(loss_fn, momentum=config.momentum, **common)
  if config.algorithm == 'dp_srg_memf':
    return plans.dp_srg_memf(loss_fn, momentum=config.momentum,
                             decay=config.decay, **common)
  raise ValueError(f'algorithm must be one of {ALGORITHMS}, got '
                   f'{config.algorithm!r}')


def run(config: ml_collections.ConfigDict, output_dir: str) -> spine.RunResult:
  """Trains the config's model with its plan; writes the outputs.

  Args:
    config: see `configs/flax_digits.py`.
    output_dir: created if missing.

  Returns:
    The run's `spine.RunResult`.
  """
  start = time.perf_counter()
  train, test = datasets.load_digits()
  if config.model == 'cnn':  # 8x8 images for the convolutions
    train, test = ({'x': s['x'].reshape(-1, 8, 8), 'y': s['y']}
                   for s in (train, test))
  graphdef, params = models.split(make_model(config.model, config.seed))
  plan = make_plan(config, models.example_loss(graphdef), len(train['y']))
  accuracy = jax.jit(lambda p: models.accuracy(graphdef, p, test))
  result = spine.run_plan(
      config.algorithm, plan, params, train, eval_every=config.eval_every,
      evaluate=lambda p: {'test_accuracy': accuracy(p)})
  os.makedirs(output_dir, exist_ok=True)
  outputs.write_csv(os.path.join(output_dir, 'metrics.csv'), result.rows)
  outputs.plot_curves(
      os.path.join(output_dir, 'learning_curve.png'),
      [outputs.Curve(f'{config.model}, {config.algorithm}',
                     [r['epoch'] for r in result.rows],
                     [r['test_accuracy'] for r in result.rows])],
      xlabel='epoch', ylabel='test accuracy',
      title=(f'digits, epsilon={plan.epsilon:.3g}, delta={config.delta:g}'))
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, privacy=[spine.privacy_entry(
          config.algorithm, plan)], wall_seconds=time.perf_counter() - start,
                         extra={'experiment': 'experiments.flax_digits'}))
  return result


if __name__ == '__main__':
  cli.launch(run, 'configs/flax_digits.py',
             'A flax model on digits, trained privately by one plan',
             output_dir='results/flax_digits')
