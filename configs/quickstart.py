"""Config of `experiments/quickstart.py`: private logistic regression on digits.

    python -m experiments.quickstart --config=configs/quickstart.py \
        --config.epsilon=1 --config.algorithms="('dpsgd', 'nonprivate')"

The defaults were picked by hand (a few tries on a validation split carved
out of the TRAIN split); they were not tuned on the test set.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default quickstart config."""
  config = ml_collections.ConfigDict()
  # Seeds the batch order, the Poisson sampling and the noise keys.
  config.seed = 0
  # Privacy target of each private run (delta < 1 / 1437 training examples).
  config.epsilon = 2.0
  # delta of each private run.
  config.delta = 1e-5
  # Per-example l2 clip norm. Every algorithm feeds its private gradient (or
  # the plain mean gradient) to `optax.sgd(learning_rate, momentum)`.
  config.clip = 1.0
  # SGD step size.
  config.learning_rate = 0.5
  # SGD momentum (also the momentum of the DP-MEMF workload).
  config.momentum = 0.9
  # Fixed-order batches (DP-FTRL, DP-MEMF and the non-private reference). The 1,437
  # training examples are 6 batches of 239 (+3 never used): a round 256
  # would leave 157 examples (11%) out of every epoch.
  config.batch_size = 239
  # Poisson sampling (DP-SGD): q = expected_batch_size / num_train_examples.
  config.expected_batch_size = 128
  # Passes over the training data; DP-SGD takes as many expected passes.
  config.num_epochs = 10
  # Evaluate (train loss, test accuracy) every this many steps and at the end.
  config.eval_every = 10
  # Algorithms to run, from 'dpsgd', 'dpftrl', 'dpmemf', 'nonprivate' (a
  # tuple, so that it can be overridden on the command line).
  config.algorithms = ('dpsgd', 'dpftrl', 'dpmemf', 'nonprivate')
  return config
