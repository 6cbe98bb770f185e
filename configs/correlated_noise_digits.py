"""Config of `experiments/correlated_noise.py` on scikit-learn's digits.

DP-SGD with Poisson sampling against dense DP-MEMF, Amplified BandMF and
BLT at epsilon 1, 2 and 8, on the digits bundled with scikit-learn (runs
anywhere, no download):

    python -m experiments.correlated_noise \
        --config=configs/correlated_noise_digits.py \
        --output_dir=docs/correlated_noise

Digits has 1,437 training examples (287 held out for tuning leave 1,150 =
23 batches of 50, so a fixed order uses every example), a small proxy of
the papers' data sets.
"""

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
  # Batch size (fixed order), expected batch size (Poisson, cyclic Poisson).
  config.batch_size = 50
  # Passes over the training data (expected passes under Poisson sampling).
  config.num_epochs = 5
  # Privacy targets; one result per method and epsilon.
  config.epsilons = (1.0, 2.0, 8.0)
  # delta of every private run.
  config.delta = 1e-5
  # SGD momentum (also the workload momentum of the MF strategies).
  config.momentum = 0.9
  # Learning-rate grid (extended past an edge pick). Wide from the start:
  # small clips with large rates do well here, and every extension round
  # costs a compilation.
  config.learning_rates = (0.1, 0.3, 1.0, 3.0, 10.0)
  # Clip grid (extended past an edge pick).
  config.clips = (0.01, 0.03, 0.1, 0.3, 1.0)
  # Bands b of Amplified BandMF (x2 or /2 past an edge, within [1, n // batch_size]).
  config.bands = (2, 4, 8, 16)
  # Buffers of the BLT strategy.
  config.blt_buffers = 4
  # Seeds each grid point is tuned on (10000, 10001, ...; validation part).
  config.tuning_seeds = 5
  # Seeds the picks are reported on (0, 1, ...; test split).
  config.num_seeds = 50
  # Times an axis is extended past a pick on its edge (0: never).
  config.grid_extensions = 2
  # Final runs on the whole training split (validation part included),
  # with plans made for that size; False: on the part tuned on, with the
  # same plans (T and noise) the picks were tuned for.
  config.final_on_full_train = False
  # Methods (a subset of experiments.correlated_noise.METHODS).
  config.methods = ('dpsgd_poisson', 'dpmemf_dense', 'banded_amplified',
                    'blt', 'nonprivate')
  return config
