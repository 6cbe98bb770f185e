"""Batch formation that matches the accounting.

Each sampler yields example indices (host-side NumPy) and names the
participation pattern its batches really follow, so the epsilon a run reports
is computed for the batches it actually used:

* `FixedOrderBatches` -> `accounting.FixedOrder`: one public order, the same
  batches in the same order every epoch (DP-FTRL, DP-MF, papers 000/001);
* `ShuffledBatches` -> `accounting.Shuffled`: a fresh permutation every epoch,
  no amplification claimed;
* `PoissonBatches` -> `accounting.PoissonSampling`: every example joins every
  batch independently with probability q; batches are padded to a multiple
  of a fixed size with a mask, so only a few shapes are ever compiled;
* `CyclicPoissonBatches` -> `accounting.CyclicPoissonSampling`: example i
  in partition i mod b, step t samples partition t mod b with probability
  q (Amplified BandMF, with a strategy of at most b bands); padded and
  masked like `PoissonBatches`, checked by `poisson_batch_guard(...,
  num_partitions=b)`;
* `AnchoredSinglePass` -> `accounting.single_epoch`: one pass with anchor
  batches every `period` steps and smaller batches between (paper 004).

`fixed_order_guard` checks, inside the training step, that batches really
come in the fixed order a `FixedOrder` accounting claims: every example in
one batch of the first epoch, at most once, and the same batches in the same
order in every later epoch.

Every sampler is deterministic given its seed and can resume mid-run:
`sampler.iterate(start_step=k)` yields exactly the batches `k, k + 1, ...`
that iterating from the start would have yielded (what a run restored from a
checkpoint at step k needs, see `dpsco_jax.checkpoint`), and the epoch
samplers also give any single batch with `batch_at(step)`.

The samplers live in `dpsco_jax.samplers` (host side) and the guards in
`dpsco_jax.batch_guards` (inside the step); this module re-exports both, and
`batching.X` is the name users and the library's own modules write.
"""

# pylint: disable=unused-import
from dpsco_jax.batch_guards import batch_fingerprint
from dpsco_jax.batch_guards import EpochGuardState
from dpsco_jax.batch_guards import fixed_order_guard
from dpsco_jax.batch_guards import FixedOrderGuardState
from dpsco_jax.batch_guards import participation_guard
from dpsco_jax.batch_guards import poisson_batch_guard
from dpsco_jax.batch_guards import poisson_size_bound
from dpsco_jax.batch_guards import PoissonGuardState
from dpsco_jax.batch_guards import shuffled_order_guard
from dpsco_jax.samplers import AnchoredSinglePass
from dpsco_jax.samplers import CyclicPoissonBatches
from dpsco_jax.samplers import FixedOrderBatches
from dpsco_jax.samplers import group_by_user
from dpsco_jax.samplers import PoissonBatches
from dpsco_jax.samplers import RemainderWarning
from dpsco_jax.samplers import reseeded
from dpsco_jax.samplers import ShuffledBatches
