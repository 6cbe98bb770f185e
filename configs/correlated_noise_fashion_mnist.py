"""Config of `experiments/correlated_noise.py` on Fashion-MNIST.

The digits protocol (`configs/correlated_noise_digits.py`) on Fashion-MNIST
(60,000 training images, 6,000 held out for tuning), which ships in Debian
(`apt-get install dataset-fashion-mnist`, read from
`/usr/share/datasets/fashion-mnist`) or comes from a folder you give:

    python -m experiments.correlated_noise \
        --config=configs/correlated_noise_fashion_mnist.py \
        --output_dir=results/correlated_noise_fashion_mnist

54,000 examples in batches of 500 are 108 steps per epoch, 540 in five
epochs: the dense strategy then keeps 539 params-sized noise buffers and
takes minutes to optimize (once; it is cached on disk).
"""

from configs import correlated_noise_digits


def get_config():
  """Returns the Fashion-MNIST config."""
  config = correlated_noise_digits.get_config()
  # Data set: 'digits', 'fashion_mnist', 'mnist', 'cifar10' or 'tfds:NAME'.
  config.dataset = 'fashion_mnist'
  # Data folder; empty: Debian's /usr/share/datasets/fashion-mnist.
  config.data_path = ''
  # Extra arguments of the data set loader.
  config.data_kwargs = {}
  # 6,000 training examples held out for tuning: 54,000 = 108 x 500 remain.
  config.validation_size = 6000
  # Batch size (fixed order), expected batch size (Poisson, cyclic Poisson).
  config.batch_size = 500
  # Bands b of Amplified BandMF (x2 or /2 past an edge, within [1, n // batch_size]).
  config.bands = (4, 16, 64)
  # Seeds each grid point is tuned on (10000, 10001, ...; validation part).
  config.tuning_seeds = 2
  # Seeds the picks are reported on (0, 1, ...; test split).
  config.num_seeds = 10
  return config
