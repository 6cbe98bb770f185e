"""Time and memory of `audit.audit_plan` on a realistic Poisson DP-SGD plan.

The plan: logistic regression on 8,000 rows of 8 features (synthetic,
fixed numpy seed), Poisson DP-SGD with expected batch 256 for 10 epochs
(312 steps, padded batches of 320), clip 1, epsilon 2 at delta 1e-5, SGD
with learning rate 0.5. The canary (row 0) uses a feature no row uses.
One invocation audits one plan: the correct one, or with
`--noise_divisor=10` a planted bug (a tenth of the noise, claiming the same
epsilon). It prints the bound, the wall time of the audit, the CPU time
the process spent in it (all threads: on a shared machine the wall time
grows with the load, the CPU time much less) and the peak resident memory
of the process (`resource.getrusage`).

With `--one_run`, the fast alternative instead: `run_one_run_gradient_audit`
of DP-SGD for the same 10 epochs in batches of 256 in a fixed order (31
per epoch, 310 steps, each canary in 10 of them), `--num_canaries` gradient canaries
(as many parameters), the noise multiplier calibrated to epsilon 2 for that
participation (`FixedOrder(10, 31)`: no amplification by sampling, which
this auditor does not simulate), divided by `--noise_divisor`.

    python benchmarks/audit_plan_scale.py --num_runs=500
    python benchmarks/audit_plan_scale.py --num_runs=500 --noise_divisor=10
    python benchmarks/audit_plan_scale.py --one_run --noise_divisor=10
"""

import argparse
import dataclasses
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpsco_jax
from dpsco_jax import audit


def _loss(params, example):
  logit = jnp.vdot(params['w'], example['x']) + params['b']
  return optax.sigmoid_binary_cross_entropy(logit, example['y'])


def problem(num_examples: int, num_features: int):
  """Data whose feature 0 no row uses, a canary that uses it, params."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(num_examples, num_features)).astype(np.float32)
  x[:, 0] = 0.0
  y = (x[:, 1] + rng.normal(size=num_examples) > 0).astype(np.int32)
  canary = {'x': np.eye(num_features, dtype=np.float32)[0] * 10.0,
            'y': np.int32(1)}
  params = {'w': jnp.zeros(num_features), 'b': jnp.zeros(())}
  return {'x': x, 'y': y}, canary, params


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--num_runs', type=int, default=500)
  parser.add_argument('--noise_divisor', type=float, default=1.0)
  parser.add_argument('--num_examples', type=int, default=8000)
  parser.add_argument('--batch_size', type=int, default=256)
  parser.add_argument('--epochs', type=int, default=10)
  parser.add_argument('--max_parallel', type=int, default=None)
  parser.add_argument('--key', type=int, default=0)
  parser.add_argument('--one_run', action='store_true')
  parser.add_argument('--num_canaries', type=int, default=1000)
  args = parser.parse_args(argv)
  if args.one_run:
    one_run(args)
    return
  data, canary, params = problem(args.num_examples, 8)

  def plan_of(**privacy):
    return dpsco_jax.plans.dpsgd(
        _loss, optimizer=optax.sgd(0.5), num_examples=args.num_examples,
        batch_size=args.batch_size, epochs=args.epochs, l2_clip=1.0,
        delta=1e-5, **privacy)

  plan = plan_of(epsilon=2.0)
  if args.noise_divisor != 1.0:
    weak = plan_of(noise_multiplier=plan.noise_multiplier / args.noise_divisor)
    plan = dataclasses.replace(plan, transformation=weak.transformation)
  print(f'jax {jax.__version__}, {jax.devices()[0].platform}; plan: '
        f'{plan.num_steps} Poisson steps, q = '
        f'{plan.batches.sampling_probability:.4f}, padded to '
        f'{plan.batches.pad_to_multiple}, noise multiplier '
        f'{plan.noise_multiplier:.3f} / {args.noise_divisor:g}')
  start, cpu = time.perf_counter(), _cpu_seconds()
  report = audit.audit_plan(plan, params=params, data=data, canary=canary,
                            loss_fn=_loss, num_runs=args.num_runs,
                            key=args.key, max_parallel=args.max_parallel)
  seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
  print(f'{args.num_runs} runs per arm: bound {report.epsilon_lower_bound:.2f}'
        f' against {report.claimed_epsilon:.2f} ({report.verdict()}); '
        f'{seconds:.0f} s ({cpu:.0f} CPU s), peak resident memory '
        f'{peak:.0f} MiB')


def one_run(args) -> None:
  """The one-run audit of DP-SGD with the plan's steps and batch size."""
  steps_per_epoch = args.num_examples // args.batch_size
  num_steps = args.epochs * steps_per_epoch
  participation = dpsco_jax.accounting.FixedOrder(args.epochs,
                                                  steps_per_epoch)
  mechanism = dpsco_jax.dpsgd_mechanism(num_steps)
  z = dpsco_jax.accounting.calibrate_noise_multiplier(
      mechanism, participation, 2.0, 1e-5)
  claimed = dpsco_jax.accounting.epsilon_spent(mechanism, z, participation,
                                               1e-5)
  start, cpu = time.perf_counter(), _cpu_seconds()
  report = audit.run_one_run_gradient_audit(
      lambda loss_fn, key: dpsco_jax.dpsgd(
          loss_fn, l2_clip=1.0, noise_multiplier=z / args.noise_divisor,
          num_steps=num_steps, key=key),
      num_canaries=args.num_canaries, num_steps=num_steps,
      steps_per_epoch=steps_per_epoch, batch_size=args.batch_size,
      claimed_epsilon=claimed, delta=1e-5, key=args.key)
  seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
  print(f'one run, {args.num_canaries} canaries, {num_steps} steps, noise '
        f'multiplier {z:.3f} / {args.noise_divisor:g}: bound '
        f'{report.epsilon_lower_bound:.2f} against {claimed:.2f} '
        f'({report.verdict()}); {seconds:.0f} s ({cpu:.0f} CPU s), peak '
        f'resident memory {peak:.0f} MiB')


if __name__ == '__main__':
  main(sys.argv[1:])
