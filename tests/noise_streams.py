"""Streams a noise mechanism step by step, for the tests that compare it
with an explicit matrix product (`C^-1 z`, `A C^-1 z`)."""

import jax
import numpy as np

from dpsco_jax import noise


def flat(tree):
  """All leaves of `tree` as one flat numpy vector."""
  return np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


def stream(mechanism, template, steps, seed=0):
  """`(rows, final state)`: the mechanism's first `steps` outputs, flat."""
  state = mechanism.init(template, jax.random.key(seed))
  next_noise = jax.jit(mechanism.next)
  rows = []
  for _ in range(steps):
    out, state = next_noise(state, template)
    rows.append(flat(out))
  return np.stack(rows), state


def gaussian_draws(template, steps, seed=0):
  """The z_t the mechanisms use: the i.i.d. mechanism's draws, same key."""
  rows, _ = stream(noise.gaussian(steps), template, steps, seed)
  return rows.astype(np.float64)
