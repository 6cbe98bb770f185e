"""Config of `experiments/diff2_tabular.py`: DIFF2-GD vs DP-GD vs GD.

    python -m experiments.diff2_tabular --config=configs/diff2_tabular.py

The grids are the paper's (App. A): eta in {0.5^i, i = 0..9} searched from
the largest down with the patience rule, C_1, C_2 in {1, 3, 10, 30, 100},
T/R in {0.003, 0.01, 0.03, 0.1}. The picks are made on `tuning_seeds` and
run on `eval_seeds` (the paper picks on each of its seeds). The default data
set is synthetic, so the command runs in a fresh clone; the paper's two
data sets are `--config.datasets=california,gas_turbine` with the copies
in ../shared/data (or your own, see the path fields).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the default config."""
  config = ml_collections.ConfigDict()
  # Data sets to run: 'synthetic' (generated), 'california' and
  # 'gas_turbine' (files under the paths below).
  config.datasets = ('synthetic',)
  # Folder of California Housing's housing.csv (paths are relative to the
  # repository root; point them at your copies).
  config.california_path = '../shared/data/california_housing'
  # Folder of the Gas Turbine gt_*.csv files.
  config.gas_turbine_path = '../shared/data/gas_turbine'
  # Rows of the synthetic N >> d regression (before the 80/20 split).
  config.synthetic_examples = 20000
  # Features of the synthetic regression.
  config.synthetic_dim = 4
  # Clients the training rows are split across (one per vmapped slot).
  config.num_clients = 10
  # Width of the one-hidden-layer network.
  config.hidden_units = 10
  # Privacy targets; every grid point is searched at each epsilon.
  config.epsilons = (3.0, 5.0)
  # delta of every private run.
  config.delta = 1e-5
  # Communication rounds R (the noise is calibrated for R).
  config.num_rounds = 2000
  # The train loss is checked (and every metric recorded) every this many rounds.
  config.eval_every = 20
  # Checks per compiled chunk of the search; stopped runs leave the batch between chunks.
  config.chunk_checks = 5
  # Seeds the hyperparameters are picked on (each: its own split, dealing, init and noise).
  config.tuning_seeds = (0,)
  # Seeds the picks are run on and reported over (disjoint from tuning_seeds).
  config.eval_seeds = (1, 2, 3, 4, 5)
  # Accounting: 'paper' is Proposition 4.1 with u = budget_split (what the
  # paper ran); 'pld' / 'rdp' are dp_accounting compositions (less noise,
  # same guarantee).
  config.accounting = 'paper'
  # u of Proposition 4.1: the restarts get 1/u of the RDP budget.
  config.budget_split = 1.25
  # Learning rates, tried from the largest down for every grid point.
  config.learning_rates = tuple(0.5 ** i for i in range(10))
  # C_1, the per-example gradient clip of the restart rounds (and of DP-GD).
  config.grad_clips = (1.0, 3.0, 10.0, 30.0, 100.0)
  # C_2: the difference clip is C_2 ||x_t - x_{t-1}||.
  config.diff_clip_factors = (1.0, 3.0, 10.0, 30.0, 100.0)
  # T / R: restart every T = fraction * R rounds.
  config.restart_fractions = (0.003, 0.01, 0.03, 0.1)
  # The patience rule: a run stops when its loss exceeds tolerance x its best at this many checks.
  config.patience = 5
  # The factor of the patience rule.
  config.tolerance = 1.05
  # 'report': search every rate (the paper) and report Theorem 4.3's bound; 'skip': leave out rates above it.
  config.step_size_guard = 'report'
  # The final value of a metric is its mean over this many final rounds.
  config.final_rounds = 100
  # Algorithms: 'gd' (non-private), 'dp_gd', 'diff2_gd'.
  config.algorithms = ('gd', 'dp_gd', 'diff2_gd')
  return config
