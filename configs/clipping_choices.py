"""Config of `experiments/clipping_choices.py`: four ways to set the clip.

    python -m experiments.clipping_choices --config=configs/clipping_choices.py

DP-SGD on scikit-learn's digits (the quickstart's multiclass logistic
regression, SGD with momentum), fixed public batch order, accounted as
FixedOrder(num_epochs, steps_per_epoch). The training split is cut into
training and validation examples (the validation ones are private data
too: they pick hyperparameters).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default config."""
  config = ml_collections.ConfigDict()
  # Seeds 0..num_seeds-1 (each: a batch order and noise keys; for the
  # private search, one whole search).
  config.num_seeds = 20
  # The privacy targets (for the search: of the whole search).
  config.epsilons = (1.0, 2.0, 8.0)
  # delta of every run (and of the search).
  config.delta = 1e-5
  # The 1,437 training examples of digits: the last `num_validation` (after
  # a fixed shuffle) pick hyperparameters, the rest train (5 batches of 230).
  config.num_validation = 287
  # Examples per batch, in a fixed public order per seed.
  config.batch_size = 230
  # Passes over the training examples.
  config.num_epochs = 10
  # SGD momentum.
  config.momentum = 0.9
  # The learning rates searched (non-privately for rows 1-3; the private
  # random search draws from learning rate x clip).
  config.learning_rates = (0.03125, 0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0,
                           8.0, 16.0, 32.0, 64.0)
  # The clips searched (the fixed clip's grid, and the private search's).
  config.clips = (0.03125, 0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
  # Adaptive clipping (Andrew et al. 2021): the initial clip (the paper's
  # 0.1).
  config.adaptive_initial_clip = 0.1
  # Adaptive clipping: the target quantile of the norms (the median).
  config.adaptive_quantile = 0.5
  # Adaptive clipping: the clip's learning rate (the paper's 0.2); the count
  # noise is 0.05 x the batch size.
  config.adaptive_learning_rate = 0.2
  # Automatic clipping (Bu et al. 2023, AUTO-S): stability constant r, at
  # clip C = 1 (C only rescales the learning rate).
  config.automatic_stability = 0.01
  # Private random search (Papernot & Steinke 2022): the number of trials is
  # truncated negative binomial with this eta ...
  config.search_eta = 0.5
  # ... and this mean number of trials.
  config.search_mean_trials = 8.0
  # The noise multiplier of each trial's released score (on the count of
  # correct validation examples, sensitivity 1).
  config.search_score_noise = 10.0
  # Runs per compiled call of the sweeps.
  config.max_parallel = 400
  return config
