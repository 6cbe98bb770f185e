"""dpsco_jax: differentially private optimizers as optax transformations.

The curated public API. Modules, one concern each:

* `dpsco_jax.clipping`: clipped per-example / per-difference / per-user sums
  and the sensitivity they guarantee (automatic clipping, Bu et al. 2023,
  as `automatic_clipping=`);
* `dpsco_jax.adaptive_clipping`: the clip following a private quantile of
  the norms (Andrew et al. 2021), sum and count one Gaussian mechanism of
  the accounted noise multiplier;
* `dpsco_jax.ghost`: ghost-norm clipping, the per-example clipped gradient
  sum without per-example gradients (the default path of `clipped_grad_sum`
  when the loss qualifies);
* `dpsco_jax.noise`: noise mechanisms (i.i.d. Gaussian, binary tree with
  residual or prefix release, Honaker, restarts, matrix factorization)
  behind one interface;
* `dpsco_jax.strategies`: matrix-factorization workloads, strategy
  optimization and the error of any mechanism on a workload;
* `dpsco_jax.blt`: buffered-linear-Toeplitz strategies: noise streamed with
  a few params-sized buffers, their min-separation sensitivity, errors and
  optimization;
* `dpsco_jax.accounting`: epsilon spent and noise calibration
  (`dp_accounting` PLD/RDP, the papers' zCDP and GDP closed forms);
* `dpsco_jax.estimators`: private gradient estimators as optax
  transformations;
* `dpsco_jax.smoothing`: randomized smoothing for nonsmooth losses: zero-
  and first-order estimators of the smoothed gradient, their clipped
  statistics and clip radii (paper 004);
* `dpsco_jax.outlier_removal`: the outlier-removal private mean of
  user-level DP-SCO (paper 002): concentration score, soft inclusion, an
  explicit sensitivity and its calibration;
* `dpsco_jax.algorithms`: the algorithms (DP-SGD, DP-FTRL, DP-MEMF,
  Accelerated-DP-SRGD and DP-SRG-MEMF, DIFF2 across clients, user-level
  DP-SGD and phased SGD with outlier-iterate removal as
  `dpsco_jax.user_level`, private O2NC for nonsmooth losses as
  `dpsco_jax.nonsmooth`) and their accounting
  (`algorithms.diff2_accounting`);
* `dpsco_jax.parallel`: cross-device sums and the replicated-key check;
* `dpsco_jax.guards`: refusals that hold inside compiled steps;
* `dpsco_jax.keys`: noise keys (fresh from OS entropy by default), run
  fingerprints and the warning on a key given to two runs;
* `dpsco_jax.batching`: batch formation matching the accounting, and the
  in-step check of a fixed batch order;
* `dpsco_jax.plans`: one call from a privacy target to a run: the
  calibrated transformation chained with your optimizer, the batches it is
  accounted for (checked in every step), the accounting event and the
  ledger, all from one description, and its compiled step (`Plan.step`);
* `dpsco_jax.plan_config`: the validated configs every plan shares
  (privacy target, sampling, clipping, devices, noise key), each keyword
  documented once;
* `dpsco_jax.accountants`: one accounting interface for plans (calibrate,
  epsilon at a step, event, ledger) and its implementations;
* `dpsco_jax.runs`: a whole run of a plan as one compiled program
  (`Plan.run`), vmapped over runs, with the guards on;
* `dpsco_jax.progress`: progress lines on stderr for long work (strategy
  optimization, calibration, compilation); `DPSCO_JAX_PROGRESS=0` silences
  them;
* `dpsco_jax.profiling`: what a compiled step costs, read from XLA's
  compiled program without running it (`compiled_cost`: flops, bytes,
  temporary memory, host callbacks and conditionals run every step);
* `dpsco_jax.ledger`: the run's privacy record (mechanism identity, noise
  multiplier, participation, steps taken), which the loop asks for the
  epsilon spent so far;
* `dpsco_jax.preprocessing`: feature standardization from public bounds,
  or from a noisy mean and variance whose release the run's plan and
  ledger spend with the steps (`releases=`);
* `dpsco_jax.rounding`: certified floating-point bounds for the
  comparisons privacy rests on (clip factors, outlier-removal distances):
  rounding can only make them stricter;
* `dpsco_jax.data`: your own table (a CSV file or a pandas DataFrame)
  as a plan's data in one call, with explicit features and target, and
  scaling by public bounds or by a DP release the plan spends;
* `dpsco_jax.checkpoint`: checkpoint and resume with a privacy ledger, and
  releases that hold only what is safe to publish;
* `dpsco_jax.tuning`: private hyperparameter tuning: random search with a
  random number of trials (Papernot & Steinke 2022), the whole search's
  epsilon, and the per-trial noise calibrated from a target;
* `dpsco_jax.audit`: empirical privacy auditing: canary runs of any
  transformation (or your own training loop) as one vmapped program, and
  epsilon lower bounds (Clopper-Pearson, one-run) to set beside the claim.
"""

from dpsco_jax import accountants
from dpsco_jax import accounting
from dpsco_jax import adaptive_clipping
from dpsco_jax import audit
from dpsco_jax import batching
from dpsco_jax import blt
from dpsco_jax import checkpoint
from dpsco_jax import clipping
from dpsco_jax import data
from dpsco_jax import estimators
from dpsco_jax import ghost
from dpsco_jax import guards
from dpsco_jax import keys
from dpsco_jax import ledger
from dpsco_jax import neighboring
from dpsco_jax import noise
from dpsco_jax import outlier_removal
from dpsco_jax import parallel
from dpsco_jax import plan_config
from dpsco_jax import plans
from dpsco_jax import preprocessing
from dpsco_jax import profiling
from dpsco_jax import progress
from dpsco_jax import rounding
from dpsco_jax import runs
from dpsco_jax import smoothing
from dpsco_jax import strategies
from dpsco_jax import tuning
from dpsco_jax.algorithms import nonsmooth
from dpsco_jax.algorithms import user_level
from dpsco_jax.accounting import calibrate_noise_multiplier
from dpsco_jax.adaptive_clipping import AdaptiveClipping
from dpsco_jax.accounting import epsilon_spent
from dpsco_jax.accounting import FixedOrder
from dpsco_jax.accounting import GaussianRelease
from dpsco_jax.accounting import PoissonSampling
from dpsco_jax.accounting import Shuffled
from dpsco_jax.accounting import single_epoch
from dpsco_jax.algorithms.baselines import dpftrl
from dpsco_jax.algorithms.baselines import dpftrl_mechanism
from dpsco_jax.algorithms.baselines import dpsgd
from dpsco_jax.algorithms.baselines import dpsgd_mechanism
from dpsco_jax.algorithms.mf import dpmemf
from dpsco_jax.algorithms.mf import dpmemf_mechanism
from dpsco_jax.algorithms.srg import accelerated_dp_srgd
from dpsco_jax.algorithms.srg import AcceleratedSrgdState
from dpsco_jax.algorithms.srg import dp_srg_memf
from dpsco_jax.algorithms.srg import ScheduleOutsideTheoryWarning
from dpsco_jax.algorithms.srg import srg_weights
from dpsco_jax.algorithms.srg import final_params
from dpsco_jax.algorithms.srg import nesterov_coupling
from dpsco_jax.algorithms.srg import project_l2_ball
from dpsco_jax.algorithms.srg import srg_gradient
from dpsco_jax.algorithms.srg import srg_mechanism
from dpsco_jax.algorithms.srg import SrgdParameters
from dpsco_jax.algorithms.srg import srgd_preset
from dpsco_jax.algorithms.srg import SrgGradientState
from dpsco_jax.algorithms.srg import SrgMemfState
from dpsco_jax.algorithms.srg import unaccelerated_dp_srg
from dpsco_jax.batching import fixed_order_guard
from dpsco_jax.algorithms import diff2_accounting
from dpsco_jax.algorithms.user_level import user_level_dpsgd
from dpsco_jax.algorithms.user_level import user_level_dpsgd_mechanism
from dpsco_jax.algorithms.diff2 import bvr_keys
from dpsco_jax.algorithms.diff2 import bvr_output_draws
from dpsco_jax.algorithms.diff2 import Diff2BvrState
from dpsco_jax.algorithms.diff2 import diff2_bvr_local_sgd
from dpsco_jax.algorithms.diff2 import diff2_estimator
from dpsco_jax.algorithms.diff2 import diff2_gd
from dpsco_jax.algorithms.diff2 import diff2_mechanism
from dpsco_jax.algorithms.diff2 import Diff2NoiseMultipliers
from dpsco_jax.algorithms.diff2 import Diff2Stability
from dpsco_jax.algorithms.diff2 import Diff2State
from dpsco_jax.algorithms.diff2 import dp_gd
from dpsco_jax.algorithms.diff2 import random_output_iterate
from dpsco_jax.algorithms.diff2 import RandomIterateState
from dpsco_jax.algorithms.diff2 import restart_interval_preset
from dpsco_jax.algorithms.diff2 import selected_iterate
from dpsco_jax.algorithms.diff2 import step_size_stability
from dpsco_jax.clipping import clipped_grad_difference_sum
from dpsco_jax.clipping import clipped_grad_sum
from dpsco_jax.clipping import clipped_user_grad_sum
from dpsco_jax.clipping import ClippedStatistic
from dpsco_jax.clipping import ClippedSum
from dpsco_jax.clipping import GhostClippingFallbackWarning
from dpsco_jax.clipping import UserBatch
from dpsco_jax.estimators import noisy_gradient
from dpsco_jax.checks import LargeDeltaWarning
from dpsco_jax.checks import NonFiniteDataWarning
from dpsco_jax.checks import NoPrivacyWarning
from dpsco_jax.data import ClippedValuesWarning
from dpsco_jax.guards import PrivacyGuardError
from dpsco_jax.guards import raise_if_refused
from dpsco_jax.guards import Refusal
from dpsco_jax.ledger import PrivacyLedger
from dpsco_jax.neighboring import NeighboringRelation
from dpsco_jax.noise import NoiseMechanism
from dpsco_jax.noise import NoiseState
from dpsco_jax.profiling import compiled_cost
from dpsco_jax.profiling import CompiledCost
from dpsco_jax.strategies import optimize_strategy
from dpsco_jax.strategies import workload
from dpsco_jax.tuning import calibrate_trial_noise
from dpsco_jax.tuning import random_search
from dpsco_jax.tuning import search_epsilon

__all__ = (
    'accountants',
    'accounting',
    'adaptive_clipping',
    'audit',
    'batching',
    'checkpoint',
    'clipping',
    'data',
    'estimators',
    'ghost',
    'guards',
    'keys',
    'ledger',
    'neighboring',
    'noise',
    'outlier_removal',
    'parallel',
    'plan_config',
    'plans',
    'preprocessing',
    'profiling',
    'progress',
    'runs',
    'smoothing',
    'strategies',
    'tuning',
    'nonsmooth',
    'user_level',
    'AdaptiveClipping',
    'calibrate_noise_multiplier',
    'epsilon_spent',
    'FixedOrder',
    'GaussianRelease',
    'PoissonSampling',
    'Shuffled',
    'single_epoch',
    'dpftrl',
    'dpftrl_mechanism',
    'dpsgd',
    'dpsgd_mechanism',
    'dpmemf',
    'dpmemf_mechanism',
    'accelerated_dp_srgd',
    'AcceleratedSrgdState',
    'dp_srg_memf',
    'ScheduleOutsideTheoryWarning',
    'srg_weights',
    'final_params',
    'nesterov_coupling',
    'project_l2_ball',
    'srg_gradient',
    'srg_mechanism',
    'SrgdParameters',
    'srgd_preset',
    'SrgGradientState',
    'SrgMemfState',
    'unaccelerated_dp_srg',
    'fixed_order_guard',
    'diff2_accounting',
    'user_level_dpsgd',
    'user_level_dpsgd_mechanism',
    'bvr_keys',
    'bvr_output_draws',
    'Diff2BvrState',
    'diff2_bvr_local_sgd',
    'diff2_estimator',
    'diff2_gd',
    'diff2_mechanism',
    'Diff2NoiseMultipliers',
    'Diff2Stability',
    'Diff2State',
    'dp_gd',
    'random_output_iterate',
    'RandomIterateState',
    'restart_interval_preset',
    'selected_iterate',
    'step_size_stability',
    'clipped_grad_difference_sum',
    'clipped_grad_sum',
    'clipped_user_grad_sum',
    'ClippedStatistic',
    'ClippedSum',
    'GhostClippingFallbackWarning',
    'UserBatch',
    'noisy_gradient',
    'LargeDeltaWarning',
    'NonFiniteDataWarning',
    'NoPrivacyWarning',
    'ClippedValuesWarning',
    'PrivacyGuardError',
    'raise_if_refused',
    'Refusal',
    'PrivacyLedger',
    'NeighboringRelation',
    'NoiseMechanism',
    'NoiseState',
    'compiled_cost',
    'CompiledCost',
    'optimize_strategy',
    'workload',
    'calibrate_trial_noise',
    'random_search',
    'search_epsilon',
)

__version__ = '0.1.0'
