"""Config of `experiments/user_level_grouped.py`: users with real records.

    pip install -e ".[grouped]"
    python -m experiments.user_level_grouped --output_dir=results/grouped
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default config."""
  config = ml_collections.ConfigDict()
  # User-level epsilons (replace one student's whole data).
  config.epsilons = (2.0, 8.0)
  # User-level delta.
  config.delta = 1e-6
  # Items kept per student (the first m in data order; fewer are masked).
  config.items_per_user = 16
  # Fraction of students held out for the test loss.
  config.test_fraction = 0.2
  # Fraction of students held out for picking hyperparameters (disjoint
  # from the training and test students).
  config.validation_fraction = 0.2
  # The constraint ball's radius (the loss's L is radius + 1: ||x|| <= 1,
  # |y| <= 1).
  config.radius = 2.0
  # Methods: user_dpsgd (user-level DP-SGD) and accelerated_erm (Algorithm 3
  # with Algorithm 2, the practical preset); the non-private least squares
  # and the zero predictor are reported beside them.
  config.methods = ('user_dpsgd', 'accelerated_erm')
  # User-level DP-SGD: expected students per batch.
  config.users_per_batch = 200
  # User-level DP-SGD epochs.
  config.epochs = 10
  # User-level DP-SGD learning rates searched.
  config.dpsgd_learning_rates = (0.1, 0.3, 1.0)
  # User-level DP-SGD clip norms searched.
  config.dpsgd_clips = (0.25, 1.0)
  # Algorithm 3: phase decay q (q = 1 puts the most students in phase 1).
  config.phase_decay = 1.0
  # Algorithm 3: tau searched, as fractions of L.
  config.erm_tau_fractions = (0.125, 0.25, 0.5)
  # A pick on a grid edge extends the grid past it, up to this many times.
  config.grid_extensions = 2
  # Noise seeds reported (the student split is fixed by split_seed).
  config.seeds = tuple(range(10))
  # Seed of the training / validation / test split of the students.
  config.split_seed = 0
  return config
