"""Config of `experiments/sweep_digits.py`: a seeds x (lr, clip) sweep on digits.

    python -m experiments.sweep_digits --config=configs/sweep_digits.py \
        --config.num_seeds=5 --config.algorithm=dpsgd

Private multiclass logistic regression on scikit-learn's digits, as in the
quickstart (same batches: 10 epochs of 6 batches of 239 in a fixed public
order), for every seed and every (learning rate, clip) of the grid, as one
vmapped program per privacy target. The grid is centred on the quickstart's
hand-picked values (learning rate 0.5, clip 1.0).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default sweep config."""
  config = ml_collections.ConfigDict()
  # 'dpmemf' (matrix-factorization noise, strategy optimized for the momentum
  # workload) or 'dpsgd' (i.i.d. noise); both on fixed-order batches,
  # accounted as FixedOrder(num_epochs, steps_per_epoch), no amplification.
  config.algorithm = 'dpmemf'
  # Seeds 0..num_seeds-1; each seed draws its run's public batch order and
  # its noise key.
  config.num_seeds = 20
  # Learning-rate grid (tuples, so they can be overridden on the command
  # line).
  config.learning_rates = (0.25, 0.5, 1.0)
  # Clip grid.
  config.clips = (0.5, 1.0, 2.0)
  # SGD momentum (also the DP-MEMF workload momentum).
  config.momentum = 0.9
  # Privacy target of the table.
  config.epsilon = 2.0
  # Privacy targets of the privacy-utility plot (should contain `epsilon`).
  config.epsilons = (0.5, 1.0, 2.0, 4.0, 8.0)
  # delta of every private run.
  config.delta = 1e-5
  # Fixed-order batch size: 1,437 training examples are 6 batches of 239.
  config.batch_size = 239
  # Passes over the training data.
  config.num_epochs = 10
  # Runs per compiled call (memory cap); None runs the whole sweep at once.
  config.max_parallel = 90
  # Also train the non-private reference (same batches, each learning rate).
  config.nonprivate = True
  return config
