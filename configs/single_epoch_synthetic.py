"""Config of `experiments/single_epoch_synthetic.py` (issue 4, experiment 5b).

    python -m experiments.single_epoch_synthetic \
        --config=configs/single_epoch_synthetic.py \
        --output_dir=results/single_epoch_synthetic

`--config.quick=True` shrinks everything (n = 2,000 and 20,000, two batch
sizes, a 2-point grid, 2 + 2 seeds) to a smoke run of a minute or two.

Problem: least squares with features uniform on the sphere of radius
sqrt(p) (bounded, E[x x^T] = I), label noise 0.5, p = 20, constraint set
the l2 ball of radius R = 1; the population minimizer w* has norm 0.5
('inside') or 2 ('outside', constrained optimum w* / 2); 'anisotropic' is
'outside' with E[x x^T] of condition number 100 (same mean eigenvalue).

Privacy: (epsilon, delta) = (1, n^-1.1) for every method, one pass in a
fixed public order (`accounting.single_epoch(T)`), add-or-remove (zero-out)
neighbours, PLD accounting.

Grids: SGD-type methods sweep the learning rate, SRG-type methods the
scaling beta (step 1 / beta), all of them the clip norm; an axis whose pick
sits on its edge is extended (up to `grid_extensions` times) and a pick
still on an edge is flagged. The accelerated methods' beta grid is relative
to `T^{3/2}` (the stochastic accelerated methods' beta grows like
sigma T^{3/2} / R), so one relative grid serves every (n, B).
`unaccelerated_srg_4_3` fixes beta at the §4.3 sketch's `M sqrt(n) / B`
and tunes only the clip; `srgd_preset` runs `srgd_preset('constrained')`
with the papers' GDP calibration, untuned, at its own B = floor(sqrt(n)).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default (full) config."""
  config = ml_collections.ConfigDict()
  # True: the smoke-test grid of `quick()` below (minutes, not hours).
  config.quick = False
  # Dimension d of the linear regression.
  config.dim = 20
  # Radius R of the l2-ball constraint set.
  config.radius = 1.0
  # Standard deviation of the label noise.
  config.noise_std = 0.5
  # Cases: the optimum w* inside the ball, outside it, and outside it with anisotropic features.
  config.cases = ('inside', 'outside', 'anisotropic')
  # ||w*|| of each case (same order as `cases`).
  config.optimum_norms = (0.5, 2.0, 2.0)
  # Condition number of E[x x^T] of each case (1: isotropic).
  config.condition_numbers = (1.0, 1.0, 100.0)
  # Data set sizes n (one pass each).
  config.num_examples = (10_000, 100_000, 1_000_000)
  # B = round(c * n^e) for (c, e) below: n^{1/4}, sqrt(n), 4 sqrt(n). The
  # 'headline' batch is sqrt(n) (index 1) and the 'small' one n^{1/4}
  # (index 0).
  config.batch_rules = ((1.0, 0.25), (1.0, 0.5), (4.0, 0.5))
  # Larger n run only the headline batch size.
  config.all_batch_sizes_up_to = 100_000
  # Index in batch_rules of the headline batch size.
  config.headline_rule = 1
  # Index in batch_rules of the small batch size.
  config.small_rule = 0
  # Privacy target of every run.
  config.epsilon = 1.0
  # delta = n^-delta_exponent.
  config.delta_exponent = 1.1
  # Methods compared (Algorithm 1, its ablations, DP-SGD, DP-FTRL).
  config.methods = ('srgd', 'srgd_preset', 'unaccelerated_srg',
                    'unaccelerated_srg_4_3', 'dpsgd', 'dpftrl')
  # Learning-rate grid of DP-SGD and DP-FTRL.
  config.learning_rates = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
  # beta grid of unaccelerated SRG.
  config.srg_betas = (1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
  # beta / T^1.5 grid of the two accelerated methods.
  config.accelerated_relative_betas = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
  # Clip grid (per-example gradient or difference).
  config.clips = (1.0, 4.0, 16.0, 64.0)
  # Times an axis whose pick is on its edge is extended past it.
  config.grid_extensions = 6
  # Seeds hyperparameters are picked on (their mean excess risk); they are
  # reported on `eval_seeds`, fresh data and noise, so that the reported
  # numbers carry no selection bias.
  config.tune_seeds = (0, 1, 2)
  # Seeds the picked hyperparameters are reported on.
  config.eval_seeds = tuple(range(100, 110))
  # Runs x B examples per compiled call (caps the memory of per-example
  # gradients; the chunking never changes the results).
  config.examples_per_call = 1 << 19
  return config


def quick(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The smoke-test version of `config` (used when `config.quick`)."""
  config = config.copy_and_resolve_references()
  config.num_examples = (2_000, 20_000)
  config.batch_rules = ((1.0, 0.25), (1.0, 0.5))
  config.all_batch_sizes_up_to = 2_000
  config.headline_rule = 1
  config.small_rule = 0
  config.learning_rates = (0.1, 0.3)
  config.srg_betas = (3.0, 10.0)
  config.accelerated_relative_betas = (0.1, 0.3)
  config.clips = (2.0,)
  config.grid_extensions = 1
  config.tune_seeds = (0, 1)
  config.eval_seeds = (100, 101)
  return config
