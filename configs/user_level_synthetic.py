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
  # User-level epsilon of every run (replace one user's whole data).
  config.epsilon = 4.0
  # User-level delta of every run.
  config.delta = 1e-6
  # The per-item loss: 'squared' ((x . w - y)^2 / 2, smooth) or 'absolute'
  # (|x . w - y|, non-smooth: Algorithm 3 runs on its ball smoothing,
  # Section 4). Both have an exact excess risk.
  config.loss = 'squared'
  # Half-width of the label noise: y = x . w* + U[-noise, noise], x uniform
  # on the unit sphere; the loss (x . w - y)^2 / 2 on the ball of `radius`
  # has L <= radius + target_norm + noise and beta = 1.
  config.noise = 0.5
  # ||w*||.
  config.target_norm = 0.5
  # Radius of the constraint ball around 0 (the diameter R is twice it).
  config.radius = 1.0
  # Methods: item_dpsgd (DP-SGD on items, group privacy over the user's m
  # items), user_dpsgd (user-level DP-SGD), phased_sgd (Algorithm 1),
  # accelerated_erm (Algorithm 3 with Algorithm 2).
  config.methods = ('item_dpsgd', 'user_dpsgd', 'phased_sgd',
                    'accelerated_erm')
  # DP-SGD (both levels): expected users per batch (items: times m).
  config.users_per_batch = 500
  # DP-SGD epochs.
  config.epochs = 5
  # DP-SGD learning rates searched (picked on the tuning seeds).
  config.dpsgd_learning_rates = (0.3, 1.0, 3.0)
  # DP-SGD clip norms searched.
  config.dpsgd_clips = (0.5, 2.0)
  # Algorithm 1: tau_scale values searched (tau_i = tau_scale eta_i L
  # sqrt(T_i)).
  config.phased_tau_scales = (0.5, 2.0)
  # Algorithm 1: multipliers of the theorem's learning rate searched.
  config.phased_learning_rate_scales = (1.0, 10.0)
  # Algorithm 3: tau searched, as fractions of L.
  config.erm_tau_fractions = (0.25, 0.5, 1.0)
  # Algorithm 3: the most steps per phase (None: Lemma D.2's T_i). The
  # smoothed absolute loss has beta = L sqrt(d) / r and T_i in the tens of
  # thousands; its study caps T_i (--config.erm_max_steps=100).
  config.erm_max_steps = ml_collections.FieldReference(None, field_type=int)
  # Phase decay q of Algorithms 1 and 3 (the presets' theoretical q, about
  # 0.1 here, leaves too few users per phase for the tests).
  config.phase_decay = 0.5
  # Seeds reported.
  config.seeds = tuple(range(10))
  # Seeds the grids are searched on (disjoint from the reported ones).
  config.tuning_seeds = (100,)
  # A pick on a grid edge extends the grid past it, up to this many times.
  config.grid_extensions = 2
  # Seed of w*.
  config.problem_seed = 0
  return config
