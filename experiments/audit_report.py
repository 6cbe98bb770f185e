r"""Audits every algorithm family: lower bounds beside the claimed epsilons.

For each family (DP-SGD, DP-FTRL, DP-MEMF, DP-SRG-MEMF,
Accelerated-DP-SRGD, DP-GD and DIFF2-GD), the noise multiplier is calibrated
with the library's accountant to `--epsilon` at `--delta` for the
mechanism and participation the run uses, and `dpsco_jax.audit` runs a
white-box gradient-canary audit (tiny model: 4 parameters, batches of 8,
8 steps) of

* the correct build (the lower bound must stay below the claim);
* a null audit (no canary in either arm; about 0);
* two planted bugs, still claiming the correct build's epsilon: noise on
  the mean instead of the sum (multiplier / batch size) and sigma / 10.

Usage:
  python -m experiments.audit_report                      # under a minute
  python -m experiments.audit_report --num_runs=4000      # tighter bounds

Writes `audit_report.md` (the table and every report's TPR/FPR table),
`roc.png` (the correct builds), `roc_bugs.png` (the planted bugs of
DP-SGD and DP-MEMF, log-log axes) and `roc_bugs_linear.png` (the same on
linear axes) to `--output_dir`.
"""

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
import optax

import dpsco_jax
from dpsco_jax import accounting
from dpsco_jax import audit
from dpsco_jax.algorithms import diff2_accounting
from dpsco_jax.neighboring import NeighboringRelation
from experiments import outputs

FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program, so that importing this module (tests)
  # does not clash with other experiments' flags.
  flags.DEFINE_float('epsilon', 2.0, 'Target (claimed) epsilon.')
  flags.DEFINE_float('delta', 1e-5, 'Delta of the claim.')
  flags.DEFINE_integer('num_runs', 2000, 'Runs per arm of each audit.')
  flags.DEFINE_integer('seed', 0, 'Seed the runs\' noise keys come from.')
  flags.DEFINE_string('output_dir', 'docs/audit',
                      'Where audit_report.md and the ROC plots go.')


NUM_STEPS = 8
STEPS_PER_EPOCH = 4
BATCH_SIZE = 8
BUGS = (('noise on the mean', BATCH_SIZE), ('sigma / 10', 10.0))


@dataclasses.dataclass(frozen=True)
class Family:
  """One audited configuration.

  Attributes:
    name: the algorithm.
    setting: the mechanism and participation, in words.
    claimed: the accountant's epsilon at the calibrated multiplier.
    noise_multiplier: the calibrated multiplier.
    build: `noise_multiplier -> make_transformation`.
    runner_args: keyword arguments of `run_gradient_canary_audit`.
  """

  name: str
  setting: str
  claimed: float
  noise_multiplier: Any
  build: Callable[[Any], audit.MakeTransformation]
  runner_args: dict


def _library_family(name, setting, mechanism, participation, build,
                    runner_args, epsilon, delta) -> Family:
  z = accounting.calibrate_noise_multiplier(mechanism, participation,
                                            epsilon, delta)
  return Family(name, setting,
                accounting.epsilon_spent(mechanism, z, participation, delta),
                z, build, runner_args)


def families(epsilon: float, delta: float) -> list[Family]:
  """Every family, calibrated to (epsilon, delta)."""
  k = NUM_STEPS // STEPS_PER_EPOCH
  fixed = accounting.FixedOrder(k, STEPS_PER_EPOCH)
  epochs = dict(steps_per_epoch=STEPS_PER_EPOCH)
  strategy = dpsco_jax.optimize_strategy(dpsco_jax.workload(NUM_STEPS),
                                         num_epochs=k)
  fixed_text = f'FixedOrder({k}, {STEPS_PER_EPOCH})'
  result = [
      _library_family(
          'DP-SGD (`dpsgd`)', f'i.i.d. Gaussian, {fixed_text}',
          dpsco_jax.dpsgd_mechanism(NUM_STEPS), fixed,
          lambda z: lambda loss_fn, key: dpsco_jax.dpsgd(
              loss_fn, l2_clip=1.0, noise_multiplier=z,
              num_steps=NUM_STEPS, key=key), epochs, epsilon, delta),
      _library_family(
          'DP-FTRL (`dpftrl` + momentum SGD)', f'binary tree, {fixed_text}',
          dpsco_jax.dpftrl_mechanism(NUM_STEPS), fixed,
          lambda z: lambda loss_fn, key: optax.chain(
              dpsco_jax.dpftrl(loss_fn, l2_clip=1.0, noise_multiplier=z,
                               num_steps=NUM_STEPS, key=key),
              optax.sgd(0.1, momentum=0.9)), epochs, epsilon, delta),
      _library_family(
          'DP-MEMF (`dpmemf`)', f'optimized MF, {fixed_text}',
          dpsco_jax.dpmemf_mechanism(strategy), fixed,
          lambda z: lambda loss_fn, key: dpsco_jax.dpmemf(
              loss_fn, l2_clip=1.0, noise_multiplier=z, strategy=strategy,
              steps_per_epoch=STEPS_PER_EPOCH,
              num_examples=STEPS_PER_EPOCH * BATCH_SIZE, key=key), epochs,
          epsilon, delta),
      _library_family(
          'DP-SRG-MEMF (`dp_srg_memf`, c = 0.5)',
          f'optimized MF, {fixed_text}', dpsco_jax.dpmemf_mechanism(strategy),
          fixed,
          lambda z: lambda loss_fn, key: optax.chain(
              dpsco_jax.dp_srg_memf(
                  loss_fn, l2_clip=1.0, noise_multiplier=z,
                  strategy=strategy, steps_per_epoch=STEPS_PER_EPOCH,
                  decay=0.5, num_examples=STEPS_PER_EPOCH * BATCH_SIZE,
                  key=key),
              optax.sgd(0.1)), epochs, epsilon, delta),
      _library_family(
          'Accelerated-DP-SRGD (`accelerated_dp_srgd`)',
          f'tree on prefix sums, single_epoch({NUM_STEPS})',
          dpsco_jax.srg_mechanism(NUM_STEPS),
          accounting.single_epoch(NUM_STEPS),
          lambda z: lambda loss_fn, key: dpsco_jax.accelerated_dp_srgd(
              loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=NUM_STEPS,
              beta=10.0, radius=None, key=key),
          dict(steps_per_epoch=NUM_STEPS, canary_batch=2), epsilon, delta),
  ]
  replace_one = dict(steps_per_epoch=1,
                     neighboring_relation=NeighboringRelation.REPLACE_ONE)
  z_gd = diff2_accounting.calibrate(NUM_STEPS, 1, epsilon, delta)
  result.append(Family(
      'DP-GD (`dp_gd`, DIFF2 with T = 1)',
      f'Gaussian every round, {NUM_STEPS} full-batch rounds, replace-one',
      diff2_accounting.epsilon_spent(NUM_STEPS, 1, z_gd, delta), z_gd,
      lambda z: lambda loss_fn, key: dpsco_jax.dp_gd(
          loss_fn, learning_rate=0.1, grad_clip=1.0,
          noise_multiplier=z.restart, num_rounds=NUM_STEPS, key=key),
      replace_one))
  z_diff2 = diff2_accounting.calibrate(NUM_STEPS, 4, epsilon, delta)
  result.append(Family(
      'DIFF2-GD (`diff2_gd`, T = 4)',
      f'restarts + differences, {NUM_STEPS} rounds, replace-one',
      diff2_accounting.epsilon_spent(NUM_STEPS, 4, z_diff2, delta), z_diff2,
      lambda z: lambda loss_fn, key: dpsco_jax.diff2_gd(
          loss_fn, learning_rate=0.1, grad_clip=1.0, diff_clip_factor=1.0,
          restart_interval=4, num_rounds=NUM_STEPS, noise_multipliers=z,
          key=key), replace_one))
  return result


def _scaled(noise_multiplier: Any, divisor: float) -> Any:
  if isinstance(noise_multiplier, dpsco_jax.Diff2NoiseMultipliers):
    return dpsco_jax.Diff2NoiseMultipliers(
        *(value / divisor for value in noise_multiplier))
  return noise_multiplier / divisor


def audit_family(family: Family, *, divisor: float = 1.0,
                 canary_norm: float = 1e3, label: str = 'correct',
                 num_runs: int, delta: float, seed: int) -> audit.AuditReport:
  """One white-box audit of `family` (multiplier / `divisor`)."""
  return audit.run_gradient_canary_audit(
      family.build(_scaled(family.noise_multiplier, divisor)),
      num_steps=NUM_STEPS, batch_size=BATCH_SIZE, num_runs=num_runs,
      claimed_epsilon=family.claimed, delta=delta, key=seed,
      canary_norm=canary_norm, name=f'{family.name}: {label}',
      **family.runner_args)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  start = time.time()
  common = dict(num_runs=FLAGS.num_runs, delta=FLAGS.delta, seed=FLAGS.seed)
  rows, correct_reports, bug_reports, details = [], [], [], []
  for family in families(FLAGS.epsilon, FLAGS.delta):
    correct = audit_family(family, **common)
    null = audit_family(family, canary_norm=0.0, label='null', **common)
    bugs = [audit_family(family, divisor=divisor, label=bug, **common)
            for bug, divisor in BUGS]
    correct_reports.append(correct)
    if family.name.startswith(('DP-SGD', 'DP-MEMF')):
      bug_reports.extend(bugs)
    details.extend([correct, null] + bugs)
    rows.append(
        f'| {family.name} | {family.setting} | {family.claimed:.2f} | '
        f'{correct.epsilon_lower_bound:.2f} | {null.epsilon_lower_bound:.2f}'
        ' | ' + ' | '.join(
            f'{b.epsilon_lower_bound:.2f}' + (' (caught)' if b.exceeds_claim
                                              else '') for b in bugs) + ' |')
    print(rows[-1], flush=True)
  header = [
      f'Lower bounds at {1 - correct_reports[0].alpha:.0%} confidence, '
      f'delta = {FLAGS.delta:g}, {FLAGS.num_runs} runs per arm per audit '
      f'({correct_reports[0].num_calibration_runs} held out), white-box '
      f'gradient canary, {NUM_STEPS} steps, batch {BATCH_SIZE}, 4 '
      'parameters. Planted bugs claim the correct build\'s epsilon.', '',
      '| family | mechanism, participation | claimed epsilon | lower bound '
      '(correct) | null audit | ' + ' | '.join(
          f'bug: {bug}' for bug, _ in BUGS) + ' |',
      '|---|---|---|---|---|' + '---|' * len(BUGS)]
  table = '\n'.join(header + rows)
  os.makedirs(FLAGS.output_dir, exist_ok=True)
  with open(os.path.join(FLAGS.output_dir, 'audit_report.md'), 'w') as f:
    f.write('# Audit report\n\nGenerated by `python -m '
            f'experiments.audit_report --num_runs={FLAGS.num_runs} '
            f'--seed={FLAGS.seed}` in {time.time() - start:.0f} s.\n\n')
    f.write(table + '\n\n## Every audit\n\n')
    f.write('\n'.join(report.to_markdown() for report in details))
  audit.plot_roc(correct_reports, os.path.join(FLAGS.output_dir, 'roc.png'),
                 title='White-box canary audits of correct builds')
  audit.plot_roc(bug_reports, os.path.join(FLAGS.output_dir,
                                           'roc_bugs.png'),
                 title='Planted bugs (claiming the correct epsilon)')
  audit.plot_roc(bug_reports, os.path.join(FLAGS.output_dir,
                                           'roc_bugs_linear.png'),
                 title='Planted bugs, linear axes', log_scale=False)
  outputs.write_json(
      os.path.join(FLAGS.output_dir, 'run_record.json'),
      outputs.run_record(
          {'epsilon': FLAGS.epsilon, 'delta': FLAGS.delta,
           'num_runs': FLAGS.num_runs, 'seed': FLAGS.seed},
          privacy=[{'name': report.name, 'audit_method': report.method,
                    'claimed_epsilon': report.claimed_epsilon,
                    'epsilon_lower_bound': report.epsilon_lower_bound,
                    'delta': report.delta} for report in details],
          wall_seconds=time.time() - start,
          extra={'experiment': 'experiments.audit_report'}))
  print(table)
  print(f'wrote {FLAGS.output_dir} in {time.time() - start:.0f} s')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
