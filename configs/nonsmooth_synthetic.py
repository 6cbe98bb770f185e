"""Config of `experiments/nonsmooth_synthetic.py`: paper 004's sqrt(d) study.

    python -m experiments.nonsmooth_synthetic --output_dir=results/nonsmooth
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default config."""
  config = ml_collections.ConfigDict()
  # Study: 'dimension' (6a: effective against worst-case clips, zero against
  # first order, DP-SGD, over d), 'sensitivity' (no training: each method's
  # clips and noise over a wider range of d) or 'passes' (6b: the multi-pass
  # ERM oracle against the single-pass one at the same n, with oracle-call
  # counts).
  config.study = 'dimension'
  # Parameter dimensions d swept by the 'dimension' study.
  config.dimensions = (4, 16, 64)
  # Parameter dimensions d of the 'sensitivity' study.
  config.sensitivity_dimensions = (4, 16, 64, 256, 1024)
  # Parameter dimension of the 'passes' study.
  config.passes_dimension = 16
  # Methods of the 'dimension' study: zero_effective, zero_worst_case,
  # first_order (O2NC with paper 004's oracles) and dpsgd (the first-order
  # baseline on the unsmoothed loss).
  config.methods = ('zero_effective', 'zero_worst_case', 'first_order',
                    'dpsgd')
  # Training examples n (fresh draws of the population per seed).
  config.num_examples = 50_000
  # Training examples n of the 'passes' study (each multi-pass step reads all).
  config.passes_num_examples = 2_000
  # Zero-order directions m = this times d in the 'passes' study (single and
  # multi pass alike: each multi-pass step reads all n examples).
  config.passes_directions_per_dimension = 1
  # Single-pass anchor batch size B_1 of the 'passes' study (its n is small).
  config.passes_anchor_batch_size = 40
  # Single-pass difference batch size B_2 of the 'passes' study.
  config.passes_batch_size = 10
  # Steps T of the multi-pass runs (the 'passes' study).
  config.passes_num_steps = 200
  # Privacy target of every run.
  config.epsilon = 4.0
  # delta of every run (the effective-clip runs spend half on the clip event).
  config.delta = 1e-6
  # Goldstein radius alpha: the smoothing radius of the oracles and the ball
  # of the stationarity proxy.
  config.smoothing_radius = 0.1
  # O2NC block length M (steps per block average).
  config.block_length = 10
  # O2NC movement radius D (M D = alpha: a block stays in the alpha-ball).
  config.movement_radius = 0.01
  # Restart period Sigma of the variance-reduced oracles (anchor every Sigma).
  config.period = 10
  # Anchor batch size B_1.
  config.anchor_batch_size = 200
  # Difference batch size B_2.
  config.batch_size = 100
  # Zero order: directions per estimate m = this times d (the concentration
  # radius, so the effective clip, shrinks like d / sqrt(m)).
  config.directions_per_dimension = 8
  # First order: ball points per estimate m.
  config.first_order_directions = 4
  # O2NC step eta = multiplier * D / (G_1 sqrt(M)) (Proposition 2.6 with
  # G_1 = L + the oracle's noise norm); the multipliers tuned per method and d.
  config.learning_rate_multipliers = (0.1, 0.3, 1.0, 3.0, 10.0)
  # DP-SGD learning rates tuned per d (plain SGD on the noisy mean).
  config.dpsgd_learning_rates = (0.003, 0.01, 0.03, 0.1, 0.3)
  # Values added past an edge of a grid whose pick sits on that edge.
  config.grid_extensions = 3
  # DP-SGD expected batch size (Poisson sampling).
  config.dpsgd_batch_size = 200
  # DP-SGD passes over the data.
  config.dpsgd_epochs = 5
  # Seeds that pick the step size (disjoint from the reported seeds; the pick
  # minimizes the mean proxy at the last block average).
  config.tuning_seeds = 2
  # Seeds of the reported runs at the picked step size (95% intervals).
  config.seeds = 10
  # Radius r of the sphere around each example (the loss is the distance to
  # it, | ||x - xi|| - r |).
  config.sphere_radius = 1.0
  # Distance of every example xi from 0.
  config.spread = 0.5
  # Distance of the start x_0 from 0 (the minimizing sphere has radius about
  # r; the proxy there is about 0.97).
  config.start_distance = 2.0
  # (y, xi) pairs of the Goldstein proxy's Monte Carlo estimate.
  config.proxy_samples = 65_536
  # Seeds the start point's direction.
  config.problem_seed = 0
  # Worker processes, one (method, d) job each (1: all in this process).
  config.workers = 1
  return config
