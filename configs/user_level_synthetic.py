"""Config of `experiments/user_level_synthetic.py`: paper 002's 1/sqrt(m) study.

    python -m experiments.user_level_synthetic --output_dir=results/user_level
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default config."""
  config = ml_collections.ConfigDict()
  # Users n (fixed over m; fresh data per seed).
  config.num_users = 20_000
  # Items per user m, swept.
  config.items_per_user = (1, 4, 16, 64, 256)
  # Parameter dimension d.
  config.dimension = 10
  # User-level privacy target of every run (replace one user's whole data).
  config.epsilon = 4.0
  config.delta = 1e-6
  # The model: x uniform on the unit sphere, y = x . w* + U[-noise, noise],
  # ||w*|| = target_norm, the loss (x . w - y)^2 / 2 on the ball of
  # `radius` (so L <= radius + target_norm + noise, beta = 1).
  config.noise = 0.5
  config.target_norm = 0.5
  config.radius = 1.0
  # Methods: item_dpsgd (DP-SGD on items, group privacy over the user's m
  # items), user_dpsgd (user-level DP-SGD), phased_sgd (Algorithm 1),
  # accelerated_erm (Algorithm 3 with Algorithm 2).
  config.methods = ('item_dpsgd', 'user_dpsgd', 'phased_sgd',
                    'accelerated_erm')
  # DP-SGD (both levels): expected users per batch (items: times m), epochs.
  config.users_per_batch = 500
  config.epochs = 5
  # DP-SGD grids: learning rates and clip norms (picked on tuning seeds).
  config.dpsgd_learning_rates = (0.3, 1.0, 3.0)
  config.dpsgd_clips = (0.5, 2.0)
  # Algorithm 1 grid: tau_scale (tau_i = tau_scale eta_i L sqrt(T_i)) and a
  # multiplier on the theorem's eta.
  config.phased_tau_scales = (0.5, 2.0)
  config.phased_learning_rate_scales = (1.0, 10.0)
  # Algorithm 3 grid: tau as a fraction of L.
  config.erm_tau_fractions = (0.25, 0.5, 1.0)
  # Phase decay q of Algorithms 1 and 3 (the presets' theoretical q, about
  # 0.1 here, leaves too few users per phase for the tests).
  config.phase_decay = 0.5
  # Seeds reported, and the disjoint seeds the grids are picked on.
  config.seeds = tuple(range(10))
  config.tuning_seeds = (100,)
  # A pick on a grid edge extends the grid past it, up to this many times.
  config.grid_extensions = 2
  # Seed of w*.
  config.problem_seed = 0
  return config
