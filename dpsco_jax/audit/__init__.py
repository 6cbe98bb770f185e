"""Empirical privacy auditing: lower bounds on the epsilon a run really has.

An audit attacks a training run with a canary and measures how well the
attacker tells "the canary was in the data" from "it was not". Differential
privacy caps that: an (epsilon, delta)-DP run has, for every test,

    TPR <= e^eps FPR + delta   and   1 - FPR <= e^eps (1 - TPR) + delta.

Observed rates (with confidence intervals) that break these for a given
epsilon prove, at the stated confidence, that the run is NOT (epsilon,
delta)-DP: the largest such epsilon is an empirical LOWER bound. It never
proves a run private; it catches bugs that make the real epsilon much larger
than the claim (noise on the mean instead of the sum, sigma off by a factor,
a key reused, a sensitivity undercounted).

Statistics (NumPy/SciPy, on the host):

* `clopper_pearson_lower` / `clopper_pearson_upper`: exact one-sided
  binomial confidence bounds.
* `epsilon_lower_bound(scores_in, scores_out, delta, thresholds=...)`: the
  many-run bound, with thresholds fixed in advance and a Bonferroni
  correction over them.
* `one_run_epsilon_lower_bound(scores, included, ...)`: the one-run bound of
  Steinke, Nasr and Jagielski (2023), Theorem 3.1 (with its delta term).

Runners (one vmapped, jit-compiled program for all runs):

* `audit_plan(plan, ...)`: a `plans.Plan` as it runs (its transformation,
  its sampler reseeded per run, Poisson sampling included, its noise with
  a key per run), your data and a canary row; the bound beside
  `plan.epsilon`. Its program is called on chunks of runs of bounded
  memory, with a progress line.
* `run_canary_audit(train_fn, ...)`: any whole run written as a pure
  function `train_fn(key, include) -> observations`; this is how to audit
  your own training loop.
* `run_gradient_canary_audit(make_transformation, ...)`: white-box gradient
  canary against any transformation of the library (or your own).
* `run_input_canary_audit(make_transformation, ...)`: black-box input
  canary with your loss, data and score.
* `run_one_run_gradient_audit(make_transformation, ...)`: many gradient
  canaries in ONE run.

Run i's noise key is `fold_in(key, i)` (`run_keys`); even runs have the
canary, odd runs do not.

Results are `AuditReport`s (`to_markdown`, `plot_roc`). See docs/audit.md.

The package holds one concern per module: `statistics` (the bounds),
`reports` (`AuditReport`, `audit_observations`, `plot_roc`), `runners`
(canary runs of a transformation or a loop) and `plan_audit` (`audit_plan`,
over `dpsco_jax.runs`); every name is re-exported here.
"""

# pylint: disable=g-importing-member,unused-import
from dpsco_jax import progress as progress_lib
from dpsco_jax.audit import plan_audit
from dpsco_jax.audit import reports
from dpsco_jax.audit import runners
from dpsco_jax.audit import statistics
from dpsco_jax.audit.statistics import (
    clopper_pearson_upper,
    clopper_pearson_lower,
    epsilon_from_rates,
    EpsilonBound,
    roc_curve,
    epsilon_lower_bound,
    OneRunBound,
    one_run_p_value,
    one_run_epsilon_lower_bound,
    fit_linear_score,
    candidate_thresholds,
)
from dpsco_jax.audit.reports import (
    AuditReport,
    plot_roc,
    audit_observations,
)
from dpsco_jax.audit.runners import (
    TrainFn,
    simulate_runs,
    run_keys,
    run_canary_audit,
    linear_loss,
    gradient_canary_train_fn,
    run_gradient_canary_audit,
    input_canary_train_fn,
    run_input_canary_audit,
    run_one_run_gradient_audit,
)
from dpsco_jax.audit.plan_audit import (
    DEFAULT_AUDIT_MEMORY_BYTES,
    audit_plan,
)
from dpsco_jax.audit.plan_audit import _plan_scores
from dpsco_jax.audit.runners import MakeTransformation
