"""Audit reports: `AuditReport`, `audit_observations` and `plot_roc`.

What an audit returns, and how observations of runs with and without the
canary become one. Re-exported by `dpsco_jax.audit`.
"""

import dataclasses
import math
from typing import Optional, Sequence, Union

import numpy as np

from dpsco_jax.audit import statistics


# ---------------------------------------------------------------------------
# Reports.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The result of an audit: a lower bound beside the claimed epsilon.

  Attributes:
    name: what was audited (e.g. 'DP-SGD, white-box gradient canary').
    method: 'many-run' or 'one-run'.
    claimed_epsilon: the epsilon the run claims (from the accountant).
    epsilon_lower_bound: the empirical lower bound, >= 0.
    delta: the delta of the claim (and of the bound).
    alpha: error probability; the bound holds with confidence `1 - alpha`.
    num_runs: runs per arm (many-run: with and without the canary), or
      canaries (one-run).
    num_calibration_runs: runs per arm held out to fit the score and choose
      the thresholds (not used by the bound).
    bound: the many-run `EpsilonBound` (TPR/FPR table, ROC), or None.
    one_run: the `OneRunBound`, or None.
  """

  name: str
  method: str
  claimed_epsilon: float
  epsilon_lower_bound: float
  delta: float
  alpha: float
  num_runs: int
  num_calibration_runs: int = 0
  bound: Optional[statistics.EpsilonBound] = None
  one_run: Optional[statistics.OneRunBound] = None

  @property
  def confidence(self) -> float:
    """`1 - alpha`."""
    return 1.0 - self.alpha

  @property
  def exceeds_claim(self) -> bool:
    """Whether the lower bound is above the claimed epsilon, at confidence
    `1 - alpha`: a privacy bug (or a wrong claim)."""
    return self.epsilon_lower_bound > self.claimed_epsilon

  def verdict(self) -> str:
    """One line: whether the measurement contradicts the claim."""
    if self.exceeds_claim:
      return (f'VIOLATION: the run is not ({self.claimed_epsilon:.3g}, '
              f'{self.delta:.3g})-DP (confidence {self.confidence:.0%}); '
              'look for a privacy bug')
    return ('consistent with the claim (a lower bound below the claim '
            'never proves it)')

  def to_markdown(self) -> str:
    """The report as Markdown: summary, then the TPR/FPR table.

    Example:
      >>> print(report.to_markdown())

    Returns:
      A Markdown string.
    """
    lines = [f'### {self.name}', '', '| | |', '|---|---|',
             f'| method | {self.method} |',
             f'| claimed epsilon | {self.claimed_epsilon:.3f} '
             f'(delta = {self.delta:.3g}) |',
             f'| epsilon lower bound | {self.epsilon_lower_bound:.3f} '
             f'({self.confidence:.0%} confidence) |']
    if self.one_run is not None:
      one = self.one_run
      lines += [f'| canaries | {one.num_canaries} (each in with '
                'probability 1/2) |',
                f'| guesses | {one.num_correct} correct of '
                f'{one.num_guesses} |']
    else:
      lines += [f'| runs | {self.num_runs} with the canary, '
                f'{self.num_runs} without ({self.num_calibration_runs} of '
                'each held out to fit the score and pick thresholds) |']
      if self.bound is not None and self.bound.epsilon > 0:
        lines.append(f'| threshold | {self.bound.threshold:.4g} |')
    lines += [f'| verdict | {self.verdict()} |', '']
    if self.bound is not None:
      lines += ['| threshold | TPR | FPR | TPR lower | FPR upper | '
                'epsilon |', '|---|---|---|---|---|---|']
      b = self.bound
      for row in zip(b.thresholds, b.tpr, b.fpr, b.tpr_lower, b.fpr_upper,
                     b.epsilons):
        lines.append('| {:.4g} | {:.4f} | {:.4f} | {:.4f} | {:.4f} | '
                     '{:.3f} |'.format(*row))
      lines.append('')
    return '\n'.join(lines)


def _dp_boundary(fpr: np.ndarray, epsilon: float, delta: float) -> np.ndarray:
  """The largest TPR an (epsilon, delta)-DP run allows at each FPR."""
  return np.clip(np.minimum(math.exp(epsilon) * fpr + delta,
                            1.0 - math.exp(-epsilon) * (1.0 - fpr - delta)),
                 0.0, 1.0)


def plot_roc(reports: Union[AuditReport, Sequence[AuditReport]],
             path: str, *, title: Optional[str] = None,
             log_scale: bool = True) -> None:
  """Writes ROC curves of many-run audits, one panel per report, to `path`.

  Each panel shows the empirical ROC curve, the largest ROC that the
  claimed (epsilon, delta) allows, and the one that the measured lower
  bound allows. Log-log axes (the default) show the low-FPR corner, where
  `TPR <= e^eps FPR + delta` is broken and where rates rest on a few runs;
  linear axes show the whole curve at a glance. matplotlib is imported here
  (it is in the `experiments` and `test` extras, not a core dependency).

  Example:
    >>> plot_roc(report, 'docs/audit/roc.png')
    >>> plot_roc([report_a, report_b], 'roc_linear.png', log_scale=False)

  Args:
    reports: one report or several (many-run reports with a `bound`).
    path: the image file to write (format from the extension).
    title: an optional figure title.
    log_scale: log-log axes (True) or linear axes from 0 to 1 (False).

  Raises:
    ValueError: if a report has no ROC (a one-run report).
  """
  # A bare Figure (no pyplot) leaves the caller's backend and open figures
  # alone.
  from matplotlib import figure as mpl_figure  # pylint: disable=g-import-not-at-top

  if isinstance(reports, AuditReport):
    reports = [reports]
  for report in reports:
    if report.bound is None:
      raise ValueError(f'{report.name}: a one-run report has no ROC curve')
  columns = 2 if len(reports) == 4 else min(3, len(reports))
  rows = -(-len(reports) // columns)
  figure = mpl_figure.Figure(figsize=(4.6 * columns, 4.4 * rows))
  axes = figure.subplots(rows, columns, squeeze=False)
  for axis, report in zip(axes.ravel(), reports):
    bound = report.bound
    # On log axes, zero rates are drawn at half a run (a log axis has no 0).
    floor = 0.5 / max(bound.num_out, 1) if log_scale else 0.0
    grid = (np.geomspace(floor, 1.0, 200) if log_scale else
            np.linspace(0.0, 1.0, 201))
    axis.plot(np.maximum(bound.roc_fpr, floor), np.maximum(bound.roc_tpr,
                                                           floor),
              color='C0', lw=2, label='measured ROC')
    axis.plot(grid, np.maximum(_dp_boundary(grid, report.claimed_epsilon,
                                            report.delta), floor),
              color='C3', ls='--',
              label=f'claimed eps = {report.claimed_epsilon:.2f}')
    axis.plot(grid, np.maximum(_dp_boundary(grid, report.epsilon_lower_bound,
                                            report.delta), floor),
              color='C2', ls=':', lw=2,
              label=f'lower bound eps = {report.epsilon_lower_bound:.2f}')
    axis.plot(grid, grid, color='0.6', lw=1, label='chance')
    if log_scale:
      axis.set_xscale('log')
      axis.set_yscale('log')
      axis.set_xlim(floor, 1.0)
      axis.set_ylim(floor, 1.05)
    else:
      axis.set_xlim(0.0, 1.0)
      axis.set_ylim(0.0, 1.01)
      axis.set_aspect('equal')
    axis.set_xlabel('false positive rate (canary absent, guessed in)')
    axis.set_ylabel('true positive rate (canary present, guessed in)')
    axis.set_title(report.name, fontsize=10)
    axis.grid(True, which='major', alpha=0.3)
    axis.legend(loc='lower right', fontsize=8)
  for axis in axes.ravel()[len(reports):]:
    axis.set_visible(False)
  if title:
    figure.suptitle(title)
  figure.tight_layout()
  figure.savefig(path, dpi=120)


def audit_observations(
    observations_in: np.ndarray,
    observations_out: np.ndarray,
    *,
    claimed_epsilon: float,
    delta: float,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    name: str = 'canary audit',
) -> AuditReport:
  """Turns per-run observations of both arms into an `AuditReport`.

  The first `calibration_fraction` of each arm is held out: there, a
  linear score is fitted (`fit_linear_score`, when runs observe more than
  one number) and the thresholds are chosen (`candidate_thresholds`). The
  remaining runs are scored with them and give the bound
  (`epsilon_lower_bound`), so nothing the bound's confidence rests on was
  tuned on the runs it counts.

  Example:
    >>> report = audit_observations(obs[:n], obs[n:], claimed_epsilon=2.0,
    ...                             delta=1e-5)

  Args:
    observations_in: `[n, m]` (or `[n]`) observations with the canary.
    observations_out: `[n', m]` (or `[n']`) observations without it.
    claimed_epsilon: the epsilon the run claims.
    delta: the delta of the claim.
    alpha: error probability of the bound.
    calibration_fraction: the share of each arm held out, in (0, 1).
    num_thresholds: thresholds kept (Bonferroni over them).
    name: what was audited.

  Returns:
    The `AuditReport`.

  Raises:
    ValueError: on non-finite observations or a split leaving an arm empty.
  """
  obs_in = np.asarray(observations_in, np.float64)
  obs_out = np.asarray(observations_out, np.float64)
  obs_in = obs_in.reshape(len(obs_in), -1)
  obs_out = obs_out.reshape(len(obs_out), -1)
  statistics.checked_scores(obs_in, 'the observations with the canary')
  statistics.checked_scores(obs_out, 'the observations without the canary')
  if not 0.0 < calibration_fraction < 1.0:
    raise ValueError('calibration_fraction must be in (0, 1), got '
                     f'{calibration_fraction!r}')
  held_in = int(round(calibration_fraction * len(obs_in)))
  held_out = int(round(calibration_fraction * len(obs_out)))
  if min(held_in, held_out) < 2 or held_in >= len(obs_in) or (
      held_out >= len(obs_out)):
    raise ValueError('too few runs for the held-out split: use more runs')
  if obs_in.shape[1] == 1:
    weights = np.ones(1)
  else:
    weights = statistics.fit_linear_score(obs_in[:held_in], obs_out[:held_out])
  scores_in, scores_out = obs_in @ weights, obs_out @ weights
  thresholds = statistics.candidate_thresholds(
      scores_in[:held_in], scores_out[:held_out], delta=delta, alpha=alpha,
      num_thresholds=num_thresholds, num_eval_in=len(obs_in) - held_in,
      num_eval_out=len(obs_out) - held_out)
  bound = statistics.epsilon_lower_bound(
      scores_in[held_in:], scores_out[held_out:], delta, alpha,
      thresholds=thresholds)
  return AuditReport(
      name=name, method='many-run', claimed_epsilon=float(claimed_epsilon),
      epsilon_lower_bound=bound.epsilon, delta=float(delta),
      alpha=float(alpha), num_runs=min(len(obs_in), len(obs_out)),
      num_calibration_runs=min(held_in, held_out), bound=bound)
