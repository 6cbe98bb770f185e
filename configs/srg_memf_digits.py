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
  config.dataset = 'digits'
  config.data_path = ''
  config.data_kwargs = {'test_fraction': 0.2, 'seed': 0}
  # Cut from the training split for tuning; the test split is for the end.
  config.validation_size = 287
  config.split_seed = 0
  config.batch_size = 50
  config.num_epochs = 1
  config.epsilon = 2.0
  config.delta = 1e-6
  config.momentum = 0.9
  # Grids (the paper's are unpublished): log-spaced learning rates and clips,
  # and c around the paper's e^-2.5.
  config.learning_rates = (0.1, 0.3, 1.0)
  config.clips = (0.3, 1.0, 3.0)
  config.decays = (math.exp(-1.5), math.exp(-2.5), math.exp(-3.5))
  config.tuning_seeds = 5
  config.num_seeds = 20
  config.algorithms = ('dpmemf_ones', 'dpmemf_true', 'srg_ones', 'srg_true',
                       'nonprivate')
  return config
