"""Config of `experiments/srg_memf.py`: paper 001 §5 on Fashion-MNIST.

The paper's MNIST protocol (batch 500, fixed public order, 1 epoch at
(0.1, 1e-6)-DP via zCDP, SGD with momentum 0.9) on Fashion-MNIST, which has
the same format and ships in Debian (`apt-get install
dataset-fashion-mnist`):

    python -m experiments.srg_memf --config=configs/srg_memf_fashion_mnist.py \
        --output_dir=results/srg_memf_fashion_mnist

The paper's other setting (6 epochs at (2, 1e-6)-DP): `--config.num_epochs=6
--config.epsilon=2`. MNIST or CIFAR-10 from files you provide:
`--config.dataset=mnist --config.data_path=/path/to/mnist` (IDX folder or
`mnist.npz`), `--config.dataset=cifar10
--config.data_path=/path/to/cifar-10-batches-py`; with `tensorflow_datasets`
and its prepared data: `--config.dataset=tfds:mnist`.
"""

import math

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the Fashion-MNIST config."""
  config = ml_collections.ConfigDict()
  # Data set: 'digits', 'fashion_mnist', 'mnist', 'cifar10' or 'tfds:NAME'.
  config.dataset = 'fashion_mnist'
  config.data_path = ''  # Data folder; empty: Debian's /usr/share/datasets/fashion-mnist.
  # Extra arguments of the data set loader.
  config.data_kwargs = {}
  # 6,000 training examples are held out for tuning: 54,000 remain, i.e.
  # 108 batches of 500 per epoch.
  config.validation_size = 6000
  # Seed of the validation split.
  config.split_seed = 0
  # Fixed-order batch size.
  config.batch_size = 500
  # Passes over the training data (k).
  config.num_epochs = 1
  # Privacy target (accounted with zCDP, as the paper).
  config.epsilon = 0.1
  # delta of every private run.
  config.delta = 1e-6
  # SGD momentum (also the workload momentum of the strategies).
  config.momentum = 0.9
  # Learning-rate grid (the paper's grids are unpublished).
  config.learning_rates = (0.1, 0.3, 1.0)
  # Clip grid.
  config.clips = (0.3, 1.0, 3.0)
  # SRG decay c grid (around the paper's e^-2.5).
  config.decays = (math.exp(-1.5), math.exp(-2.5), math.exp(-3.5))
  # Seeds each grid point is tuned on (validation split).
  config.tuning_seeds = 3
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
