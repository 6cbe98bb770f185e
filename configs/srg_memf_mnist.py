"""Config of `experiments/srg_memf.py`: paper 001 §5 on MNIST (1 epoch).

The paper's MNIST setting (batch 500, fixed public order, 1 epoch at
(0.1, 1e-6)-DP via zCDP, momentum 0.9). MNIST is not installable offline:
give the IDX folder or `mnist.npz` you downloaded,

    python -m experiments.srg_memf --config=configs/srg_memf_mnist.py \
        --config.data_path=/path/to/mnist --output_dir=results/srg_memf_mnist

or, with `tensorflow_datasets` and its prepared data,
`--config.dataset=tfds:mnist --config.data_path=/path/to/tensorflow_datasets`.
"""

import ml_collections

from configs import srg_memf_fashion_mnist


def get_config() -> ml_collections.ConfigDict:
  """Returns the MNIST config (Fashion-MNIST's protocol, MNIST's data)."""
  config = srg_memf_fashion_mnist.get_config()
  # Data set (loaded from data_path).
  config.dataset = 'mnist'
  # Required: the folder or file you downloaded (see the docstring).
  config.data_path = ml_collections.config_dict.placeholder(str)
  return config
