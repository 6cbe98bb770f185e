"""Rounding in the ghost norms never lets a contribution past the clip norm.

The Gram form `sum_{p,q} (a_p . a_q)(g_p . g_q)` (and the cross terms of a
gradient difference) add products of both signs. When they cancel, float32
rounding can put the computed squared norm anywhere within about
`n u sum|terms|` of the truth, below it too, so an example built to cancel
could have its true norm under-measured and escape clipping. The ghost
path adds a rounding margin to every layer's squared norm; these tests feed
such examples and check the clipped sum's norm against the clip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpsco_jax import clipping

POSITIONS, FEATURES, OUT = 6, 8, 3


def _loss(params, example):
  # The output gradient is the same vector r at every position, so the
  # weight's gradient is (sum_p x_p) r^T: large positions that cancel.
  return jnp.sum((example['x'] @ params['w']) * example['r'])


@pytest.mark.parametrize('seed', range(6))
def test_cancelling_positions_are_still_clipped(seed):
  rng = np.random.default_rng(seed)
  scale = 10.0 ** rng.uniform(6, 9)
  base = rng.normal(size=(POSITIONS // 2, FEATURES))
  # Pairs of positions that nearly cancel: what remains is about 1 to 100
  # clip norms, the positions themselves 1e6 to 1e9.
  remainder = rng.normal(size=base.shape) * 10.0 ** rng.uniform(0, 2) / scale
  x = np.concatenate([base, -base + remainder]) * scale
  batch = {'x': jnp.asarray(x[None], jnp.float32),
           'r': jnp.asarray(rng.normal(size=(1, OUT)) / np.sqrt(OUT),
                            jnp.float32)}
  params = {'w': jnp.zeros((FEATURES, OUT), jnp.float32)}
  clip = 1.0
  stat = clipping.clipped_grad_sum(_loss, clip, method='ghost')
  out = stat(batch, params)
  norm = float(jnp.linalg.norm(out.sum['w']))
  assert norm <= clip * (1 + 1e-5), norm
