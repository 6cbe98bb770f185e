"""Config of `experiments/srg_memf.py`: paper 001 §5 on CIFAR-10 (6 epochs).

The paper's CIFAR-10 setting (batch 500, fixed public order, 6 epochs at
(2, 1e-6)-DP via zCDP, momentum 0.9) on the "CIFAR-10 python version"
(www.cs.toronto.edu/~kriz/cifar.html) that you extracted:

    python -m experiments.srg_memf --config=configs/srg_memf_cifar10.py \
        --config.data_path=/path/to/cifar-10-batches-py \
        --output_dir=results/srg_memf_cifar10

44,000 training examples remain after the 6,000 held out for tuning: 88
batches per epoch, 528 steps in all; the strategies (528 x 528) take a
minute or two each to optimize, then come from the cache.
"""

import ml_collections

from configs import srg_memf_fashion_mnist


def get_config() -> ml_collections.ConfigDict:
  """Returns the CIFAR-10 config."""
  config = srg_memf_fashion_mnist.get_config()
  # Data set (loaded from data_path).
  config.dataset = 'cifar10'
  # Required: the folder or file you downloaded (see the docstring).
  config.data_path = ml_collections.config_dict.placeholder(str)
  # The paper's CIFAR-10 setting: 6 epochs at epsilon 2.
  config.num_epochs = 6
  # Privacy target (accounted with zCDP, as the paper).
  config.epsilon = 2.0
  return config
