"""Time and memory of `audit.audit_plan` on a realistic Poisson DP-SGD plan.

The plan: logistic regression on 8,000 rows of 8 features (synthetic,
fixed numpy seed), Poisson DP-SGD with expected batch 256 for 10 epochs
(312 steps, padded batches of 320), clip 1, epsilon 2 at delta 1e-5, SGD
with learning rate 0.5. The canary (row 0) uses a feature no row uses.
One invocation audits one plan: the correct one, or with
`--noise_divisor=10` a planted bug (a tenth of the noise, claiming the same
epsilon). It prints the bound, the wall time of the audit and the peak
resident memory of the process (`resource.getrusage`).

    python benchmarks/audit_plan_scale.py --num_runs=500
    python benchmarks/audit_plan_scale.py --num_runs=500 --noise_divisor=10
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


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--num_runs', type=int, default=500)
  parser.add_argument('--noise_divisor', type=float, default=1.0)
  parser.add_argument('--num_examples', type=int, default=8000)
  parser.add_argument('--batch_size', type=int, default=256)
  parser.add_argument('--epochs', type=int, default=10)
  parser.add_argument('--max_parallel', type=int, default=None)
  parser.add_argument('--key', type=int, default=0)
  args = parser.parse_args(argv)
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
  start = time.perf_counter()
  report = audit.audit_plan(plan, params=params, data=data, canary=canary,
                            loss_fn=_loss, num_runs=args.num_runs,
                            key=args.key, max_parallel=args.max_parallel)
  seconds = time.perf_counter() - start
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
  print(f'{args.num_runs} runs per arm: bound {report.epsilon_lower_bound:.2f}'
        f' against {report.claimed_epsilon:.2f} ({report.verdict()}); '
        f'{seconds:.0f} s, peak resident memory {peak:.0f} MiB')


if __name__ == '__main__':
  main(sys.argv[1:])
