"""Config of `experiments/srg_memf.py` on scikit-learn's bundled digits.

A small proxy of paper 001 §5 that runs anywhere in minutes:

    python -m experiments.srg_memf --config=configs/srg_memf_digits.py \
        --output_dir=results/srg_memf_digits

Digits has about 40x fewer training examples than MNIST, so the batch is 50
(not 500) and epsilon is raised (2 for one epoch, 4 for six) to keep the
noise per example comparable. Six epochs: `--config.num_epochs=6
--config.epsilon=4`.
"""

import math

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the digits config."""
  config = ml_collections.ConfigDict()
  # Data set: 'digits', 'fashion_mnist', 'mnist', 'cifar10' or 'tfds:NAME'.
  config.dataset = 'digits'
  # Unused for digits (bundled with scikit-learn).
  config.data_path = ''
  # Extra arguments of the data set loader.
  config.data_kwargs = {'test_fraction': 0.2, 'seed': 0}
  # Cut from the training split for tuning; the test split is for the end.
  config.validation_size = 287
  # Seed of the validation split.
  config.split_seed = 0
  # Fixed-order batch size.
  config.batch_size = 50
  # Passes over the training data (k).
  config.num_epochs = 1
  # Privacy target (accounted with zCDP, as the paper).
  config.epsilon = 2.0
  # delta of every private run.
  config.delta = 1e-6
  # SGD momentum (also the workload momentum of the strategies).
  config.momentum = 0.9
  # Learning-rate grid (the paper's grids are unpublished: log-spaced).
  config.learning_rates = (0.1, 0.3, 1.0)
  # Clip grid.
  config.clips = (0.3, 1.0, 3.0)
  # SRG decay c grid (around the paper's e^-2.5).
  config.decays = (math.exp(-1.5), math.exp(-2.5), math.exp(-3.5))
  # Seeds each grid point is tuned on (validation split).
  config.tuning_seeds = 5
  # Seeds the picked hyperparameters are reported on (test split).
  config.num_seeds = 50
  # Times an axis is extended past a pick on its edge (0: never).
  config.grid_extensions = 3
  # Final runs train on the whole training split (validation part
  # included), with the strategy and noise made for that size.
  config.final_on_full_train = True
  # Algorithms: DP-MEMF and DP-SRG-MEMF with the ones or true workload, and the non-private reference.
  config.algorithms = ('dpmemf_ones', 'dpmemf_true', 'srg_ones', 'srg_true',
                       'nonprivate')
  return config
