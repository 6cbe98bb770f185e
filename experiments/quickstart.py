"""Quickstart: DP-SGD, DP-FTRL and DP-MEMF against non-private SGD on digits.

Trains multiclass logistic regression (64 pixels -> 10 classes, with bias,
zero init) on scikit-learn's bundled digits with

* `dpsgd`: DP-SGD on Poisson-sampled batches (`batching.PoissonBatches`),
  accounted with privacy amplification (`accounting.PoissonSampling`);
* `dpftrl`: DP-FTRL on batches in a fixed public order repeated every epoch
  (`batching.FixedOrderBatches`), one binary tree per epoch, accounted as
  `accounting.FixedOrder` (no amplification);
* `dpmemf`: DP-MEMF (paper 001 Algorithm 2) on the same fixed-order batches,
  with a strategy optimized for the momentum workload of the run
  (`strategies.optimize_strategy`), accounted as `accounting.FixedOrder`
  and checked in every step (`batching.fixed_order_guard`);
* `nonprivate`: the same optimizer on the plain mean gradient of the same
  fixed-order batches.

Each private run calibrates its noise multiplier to the config's (epsilon,
delta) for exactly the noise mechanism its transformation builds and the
participation pattern of its sampler, then reports the epsilon it spent.

    python -m experiments.quickstart --config=configs/quickstart.py \
        --config.epsilon=2 --output_dir=results/quickstart

Writes `metrics.csv`, `summary.csv`, `learning_curves.png` and
`run_record.json` (config, dp_accounting events, epsilon spent, versions,
wall time) to `--output_dir`. The train loss and test accuracy are diagnostics computed
outside the privacy guarantee (they are never fed back into training).
"""

import math
import os
import time
import zlib
from typing import (Any, Callable, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple)

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import batching
from dpsco_jax import noise
from dpsco_jax import strategies
from experiments import datasets
from experiments import outputs

ALGORITHMS = ('dpsgd', 'dpftrl', 'dpmemf', 'nonprivate')
METRICS_COLUMNS = ('algorithm', 'step', 'train_loss', 'test_accuracy')
SUMMARY_COLUMNS = ('algorithm', 'num_steps', 'noise_multiplier',
                   'target_epsilon', 'epsilon_spent', 'delta',
                   'test_accuracy')
NUM_FEATURES = 64
NUM_CLASSES = 10

Params = Dict[str, jax.Array]
Split = Dict[str, np.ndarray]
Row = Dict[str, Any]
# Host-side batches: example indices and a padding mask (None: no padding).
HostBatches = Iterator[Tuple[np.ndarray, Optional[np.ndarray]]]
StepFn = Callable[[Params, optax.OptState, Dict[str, jax.Array],
                   Optional[jax.Array]], Tuple[Params, optax.OptState]]


class Privacy(NamedTuple):
  """What a private run is accounted with.

  Attributes:
    mechanism: the noise mechanism, built exactly as the transformation
      builds its own (same kind, steps and restarts).
    participation: the sampler's participation pattern.
    noise_multiplier: calibrated to the target (epsilon, delta).
  """

  mechanism: noise.NoiseMechanism
  participation: accounting.Participation
  noise_multiplier: float


class Setup(NamedTuple):
  """Everything one algorithm needs to train.

  Attributes:
    tx: the gradient transformation chain.
    step: the jitted training step.
    batches: returns a fresh iterator of host-side (indices, mask) batches.
    num_steps: how many batches it yields.
    privacy: None for the non-private reference.
  """

  tx: optax.GradientTransformation
  step: StepFn
  batches: Callable[[], HostBatches]
  num_steps: int
  privacy: Optional[Privacy]


def seed_for(seed: int, purpose: str) -> int:
  """An independent seed per purpose, so that no two random streams coincide."""
  sequence = np.random.SeedSequence([seed, zlib.crc32(purpose.encode())])
  return int(sequence.generate_state(1)[0])


def init_params() -> Params:
  """Zero weights and bias (the loss is convex: no symmetry to break)."""
  return {'w': jnp.zeros((NUM_FEATURES, NUM_CLASSES), jnp.float32),
          'b': jnp.zeros((NUM_CLASSES,), jnp.float32)}


def logits(params: Params, x: jax.Array) -> jax.Array:
  """Class scores of one example `[64]` or a batch `[n, 64]`."""
  return x @ params['w'] + params['b']


def example_loss(params: Params, example: Dict[str, jax.Array]) -> jax.Array:
  """Softmax cross-entropy of ONE example (what the private gradients clip)."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits(params, example['x']), example['y'])


def mean_loss(params: Params, batch: Dict[str, jax.Array]) -> jax.Array:
  """Mean cross-entropy of a batch (non-private training and evaluation)."""
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits(params, batch['x']), batch['y']))


@jax.jit
def evaluate(params: Params, train: Dict[str, jax.Array],
             test: Dict[str, jax.Array]) -> Tuple[jax.Array, jax.Array]:
  """Returns (mean train loss, number of correct test predictions)."""
  predictions = jnp.argmax(logits(params, test['x']), axis=-1)
  return mean_loss(params, train), jnp.sum(predictions == test['y'])


def private_step(tx: optax.GradientTransformationExtraArgs) -> StepFn:
  """A jitted step of a private transformation (it computes the gradients)."""

  @jax.jit
  def step(params, opt_state, batch, mask, indices):
    # The example ids let a fixed-order algorithm check the batch order.
    updates, opt_state = tx.update(None, opt_state, params, batch=batch,
                                   batch_mask=mask, example_ids=indices)
    return optax.apply_updates(params, updates), opt_state

  return step


def nonprivate_step(tx: optax.GradientTransformation) -> StepFn:
  """A jitted step of plain optax on the mean gradient of the batch."""

  @jax.jit
  def step(params, opt_state, batch, mask, indices):
    del mask, indices  # Fixed-order batches are never padded.
    grads = jax.grad(mean_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def optimizer(
    config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The optimizer every algorithm ends with (post-processing when private)."""
  return optax.sgd(config.learning_rate, momentum=config.momentum)


def calibrate(mechanism: noise.NoiseMechanism,
              participation: accounting.Participation,
              config: ml_collections.ConfigDict) -> Privacy:
  """Calibrates the noise multiplier of `mechanism` to the config's target."""
  noise_multiplier = dpsco_jax.calibrate_noise_multiplier(
      mechanism, participation, config.epsilon, config.delta)
  return Privacy(mechanism, participation, noise_multiplier)


def fixed_order_batches(config: ml_collections.ConfigDict,
                        num_examples: int) -> batching.FixedOrderBatches:
  """The batches of DP-FTRL and of the non-private reference.

  The order is public: drawn from the config seed, not from the data.

  Args:
    config: the quickstart config.
    num_examples: training set size.

  Returns:
    The sampler.
  """
  return batching.FixedOrderBatches(
      num_examples, config.batch_size, config.num_epochs,
      order_seed=seed_for(config.seed, 'fixed_order'))


def unpadded(sampler: batching.FixedOrderBatches) -> HostBatches:
  """Fixed-size batches have no padding: pair each with a None mask."""
  for indices in sampler:
    yield indices, None


def setup_dpsgd(config: ml_collections.ConfigDict,
                num_examples: int) -> Setup:
  """DP-SGD on Poisson-sampled batches, for `num_epochs` expected epochs."""
  num_steps = round(config.num_epochs * num_examples /
                    config.expected_batch_size)
  sampling_probability = config.expected_batch_size / num_examples
  sampler = batching.PoissonBatches(
      num_examples, sampling_probability, num_steps,
      seed=seed_for(config.seed, 'dpsgd/sampling'))
  # Account for exactly the mechanism `dpsgd` builds.
  privacy = calibrate(dpsco_jax.dpsgd_mechanism(num_steps),
                      sampler.participation, config)
  tx = optax.chain(
      dpsco_jax.dpsgd(
          example_loss, l2_clip=config.clip,
          noise_multiplier=privacy.noise_multiplier, num_steps=num_steps,
          key=jax.random.key(seed_for(config.seed, 'dpsgd/noise')),
          # Divide by the public expected size, never the realized one.
          normalize_by=sampler.expected_batch_size),
      optimizer(config))
  return Setup(tx, private_step(tx), lambda: iter(sampler), num_steps, privacy)


def setup_dpftrl(config: ml_collections.ConfigDict,
                 num_examples: int) -> Setup:
  """DP-FTRL on fixed-order batches, one tree per epoch."""
  sampler = fixed_order_batches(config, num_examples)
  restart_every = sampler.steps_per_epoch
  # Account for exactly the mechanism `dpftrl` builds.
  mechanism = dpsco_jax.dpftrl_mechanism(sampler.num_steps, restart_every)
  privacy = calibrate(mechanism, sampler.participation, config)
  tx = optax.chain(
      dpsco_jax.dpftrl(
          example_loss, l2_clip=config.clip,
          noise_multiplier=privacy.noise_multiplier,
          num_steps=sampler.num_steps, restart_every=restart_every,
          key=jax.random.key(seed_for(config.seed, 'dpftrl/noise'))),
      optimizer(config))
  return Setup(tx, private_step(tx), lambda: unpadded(sampler),
               sampler.num_steps, privacy)


def setup_dpmemf(config: ml_collections.ConfigDict,
                 num_examples: int) -> Setup:
  """DP-MEMF on fixed-order batches, strategy optimized for the run."""
  sampler = fixed_order_batches(config, num_examples)
  # The "true" workload: what SGD with this momentum does with the noise.
  strategy = strategies.optimize_strategy(
      strategies.workload(sampler.num_steps, 'true',
                          momentum=config.momentum),
      sampler.num_epochs)
  # Account for exactly the mechanism `dpmemf` builds.
  privacy = calibrate(dpsco_jax.dpmemf_mechanism(strategy),
                      sampler.participation, config)
  tx = optax.chain(
      dpsco_jax.dpmemf(
          example_loss, l2_clip=config.clip,
          noise_multiplier=privacy.noise_multiplier, strategy=strategy,
          steps_per_epoch=sampler.steps_per_epoch, num_examples=num_examples,
          key=jax.random.key(seed_for(config.seed, 'dpmemf/noise'))),
      optimizer(config))
  return Setup(tx, private_step(tx), lambda: unpadded(sampler),
               sampler.num_steps, privacy)


def setup_nonprivate(config: ml_collections.ConfigDict,
                     num_examples: int) -> Setup:
  """Plain optax SGD on the same fixed-order batches as DP-FTRL."""
  sampler = fixed_order_batches(config, num_examples)
  tx = optimizer(config)
  return Setup(tx, nonprivate_step(tx), lambda: unpadded(sampler),
               sampler.num_steps, None)


SETUPS = {'dpsgd': setup_dpsgd, 'dpftrl': setup_dpftrl,
          'dpmemf': setup_dpmemf, 'nonprivate': setup_nonprivate}


def train(name: str, setup: Setup, train_data: Split, test_data: Split,
          eval_every: int) -> Tuple[float, List[Row]]:
  """Runs one algorithm; returns its final test accuracy and its metrics."""
  device_train = jax.device_put(train_data)
  device_test = jax.device_put(test_data)
  params = init_params()
  opt_state = setup.tx.init(params)
  records = []

  def record(step: int, params: Params) -> float:
    train_loss, num_correct = evaluate(params, device_train, device_test)
    train_loss = float(train_loss)
    accuracy = int(num_correct) / len(test_data['y'])
    records.append({'algorithm': name, 'step': step,
                    'train_loss': train_loss, 'test_accuracy': accuracy})
    logging.info('%-10s step %4d/%d  train loss %.4f  test accuracy %.4f',
                 name, step, setup.num_steps, train_loss, accuracy)
    return accuracy

  accuracy = record(0, params)
  for step, (indices, mask) in enumerate(setup.batches(), start=1):
    # Gather on the host, then one transfer per step.
    batch, mask = jax.device_put(({'x': train_data['x'][indices],
                                   'y': train_data['y'][indices]}, mask))
    params, opt_state = setup.step(params, opt_state, batch, mask, indices)
    if step % eval_every == 0 or step == setup.num_steps:
      accuracy = record(step, params)
  return accuracy, records


def summarize(name: str, setup: Setup, accuracy: float,
              config: ml_collections.ConfigDict
              ) -> Tuple[Row, Optional[Dict[str, Any]]]:
  """The summary row and the run record's privacy entry (None if non-private).

  A private run re-derives the epsilon it spent from its mechanism, noise
  multiplier and participation (`outputs.privacy_entry`).
  """
  row = {'algorithm': name, 'num_steps': setup.num_steps,
         'test_accuracy': accuracy}
  if setup.privacy is None:
    return {**row, 'noise_multiplier': 0.0, 'target_epsilon': None,
            'epsilon_spent': math.inf, 'delta': None}, None
  privacy = setup.privacy
  entry = outputs.privacy_entry(
      name, privacy.mechanism, privacy.noise_multiplier,
      privacy.participation, config.delta, target_epsilon=config.epsilon)
  return {**row, 'noise_multiplier': privacy.noise_multiplier,
          'target_epsilon': config.epsilon,
          'epsilon_spent': entry['epsilon_spent'],
          'delta': config.delta}, entry


def run_algorithms(
    config: ml_collections.ConfigDict, train_data: Split, test_data: Split,
    privacy_entries: Optional[List[Dict[str, Any]]] = None
) -> Tuple[List[Row], List[Row]]:
  """Trains every configured algorithm; returns (metrics, summary) rows.

  Args:
    config: the quickstart config.
    train_data: the training split.
    test_data: the test split.
    privacy_entries: if given, each private run's `outputs.privacy_entry`
      is appended to it.

  Returns:
    `(metrics, summary)` rows.
  """
  unknown = set(config.algorithms) - set(ALGORITHMS)
  if unknown:
    raise ValueError(f'unknown algorithms {sorted(unknown)}; choose from '
                     f'{ALGORITHMS}')
  if config.eval_every < 1:
    raise ValueError(f'eval_every must be >= 1, got {config.eval_every}')
  num_examples = len(train_data['y'])
  metrics, summary = [], []
  for name in config.algorithms:
    start = time.perf_counter()
    setup = SETUPS[name](config, num_examples)
    if setup.privacy is not None:
      logging.info('%s: noise multiplier %.4f for (%g, %g)-DP over %d steps',
                   name, setup.privacy.noise_multiplier, config.epsilon,
                   config.delta, setup.num_steps)
    accuracy, records = train(name, setup, train_data, test_data,
                              config.eval_every)
    metrics.extend(records)
    row, entry = summarize(name, setup, accuracy, config)
    summary.append(row)
    if entry is not None and privacy_entries is not None:
      privacy_entries.append(entry)
    if setup.privacy is not None:
      logging.info('%s: epsilon spent %.6f (target %g) at delta %g', name,
                   summary[-1]['epsilon_spent'], config.epsilon, config.delta)
    logging.info('%s: done in %.1f s (calibration, compilation, training)',
                 name, time.perf_counter() - start)
  return metrics, summary


def write_csv(path: str, columns: Sequence[str], rows: List[Row]) -> None:
  """Writes `rows` (dicts) with the header `columns`; None is left empty."""
  outputs.write_csv(path, rows, columns)


def plot_learning_curves(path: str, metrics: List[Row],
                         config: ml_collections.ConfigDict) -> None:
  """Test accuracy against step, one line per algorithm."""
  curves = []
  for name in config.algorithms:
    rows = [row for row in metrics if row['algorithm'] == name]
    curves.append(outputs.Curve(name, [row['step'] for row in rows],
                                [row['test_accuracy'] for row in rows]))
  outputs.plot_curves(
      path, curves, xlabel='step', ylabel='test accuracy',
      title=(f'digits: private runs at epsilon={config.epsilon:g}, '
             f'delta={config.delta:g}'))


def format_summary(summary: List[Row]) -> str:
  """The summary as a fixed-width text table."""

  def cell(value: Any) -> str:
    if value is None:
      return '-'
    return f'{value:.4g}' if isinstance(value, float) else str(value)

  table = [list(SUMMARY_COLUMNS)] + [
      [cell(row[column]) for column in SUMMARY_COLUMNS] for row in summary]
  widths = [max(len(line[i]) for line in table)
            for i in range(len(SUMMARY_COLUMNS))]
  return '\n'.join('  '.join(text.ljust(width) for text, width in
                             zip(line, widths)) for line in table)


def run(config: ml_collections.ConfigDict, output_dir: str) -> List[Row]:
  """Runs the quickstart and writes its outputs to `output_dir`.

  Args:
    config: see `configs/quickstart.py`.
    output_dir: created if missing.

  Returns:
    One summary row per algorithm (columns `SUMMARY_COLUMNS`).
  """
  start = time.perf_counter()
  train_data, test_data = datasets.load_digits()
  privacy_entries = []
  metrics, summary = run_algorithms(config, train_data, test_data,
                                    privacy_entries)
  os.makedirs(output_dir, exist_ok=True)
  write_csv(os.path.join(output_dir, 'metrics.csv'), METRICS_COLUMNS, metrics)
  write_csv(os.path.join(output_dir, 'summary.csv'), SUMMARY_COLUMNS, summary)
  plot_learning_curves(os.path.join(output_dir, 'learning_curves.png'),
                       metrics, config)
  outputs.write_json(
      os.path.join(output_dir, 'run_record.json'),
      outputs.run_record(config, privacy=privacy_entries,
                         wall_seconds=time.perf_counter() - start,
                         extra={'experiment': 'experiments.quickstart',
                                'summary': summary}))
  logging.info('summary (written to %s):\n%s', output_dir,
               format_summary(summary))
  return summary


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  start = time.perf_counter()
  run(flags.FLAGS.config, flags.FLAGS.output_dir)
  logging.info('total wall time %.1f s', time.perf_counter() - start)


def define_flags() -> None:
  """The command-line flags; defined only when run as a program, so that
  importing this module next to other experiments defines no flags."""
  config_flags.DEFINE_config_file(
      'config', None, 'Path to the config file (configs/quickstart.py).')
  flags.DEFINE_string('output_dir', 'results/quickstart',
                      'Where to write CSVs, the plot and the run record.')
  flags.mark_flags_as_required(['config'])


if __name__ == '__main__':
  define_flags()
  app.run(main)
