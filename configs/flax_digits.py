"""Config of `experiments/flax_digits.py`: a flax model trained by a plan on digits.

    python -m experiments.flax_digits --config.model=cnn --config.algorithm=dpsgd
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default config."""
  config = ml_collections.ConfigDict()
  # Model: 'mlp' (64-64-10, ReLU) or 'cnn' (two 3x3 convolutions on the 8x8
  # images, then a linear classifier).
  config.model = 'mlp'
  # Plan family: 'dpsgd', 'dpftrl', 'dpmemf' or 'dp_srg_memf'.
  config.algorithm = 'dpsgd'
  # Privacy target of the run.
  config.epsilon = 2.0
  # delta of the run (below 1 / 1437 training examples).
  config.delta = 1e-5
  # Per-example l2 clip norm (of each gradient, or each difference for
  # dp_srg_memf).
  config.clip = 1.0
  # SGD step size.
  config.learning_rate = 0.5
  # SGD momentum (also the workload momentum of the DP-MEMF strategies).
  config.momentum = 0.9
  # SRG decay c of dp_srg_memf.
  config.decay = 0.1
  # Batch size (expected size under DP-SGD's Poisson sampling).
  config.batch_size = 239
  # Passes over the training data.
  config.num_epochs = 10
  # Evaluate every this many steps (and at the start and end).
  config.eval_every = 10
  # Seeds the model's initialization, the batches and the noise key.
  config.seed = 0
  return config
