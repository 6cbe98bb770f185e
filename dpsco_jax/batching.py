"""Batch formation that matches the accounting, and its in-step checks.

Each sampler yields example indices (host-side NumPy) and names the
participation pattern its batches really follow (`sampler.participation`), so
the epsilon a run reports is computed for the batches it actually used; each
guard refuses, inside the training step, a batch that does not follow the
pattern the accounting claims:

* `dpsco_jax.samplers` (host side): `FixedOrderBatches`, `ShuffledBatches`,
  `PoissonBatches`, `CyclicPoissonBatches`, `AnchoredSinglePass`,
  `group_by_user`, `reseeded`; what each pattern claims, and how the
  samplers resume mid-run, is in that module's docstring;
* `dpsco_jax.batch_guards` (in the step): `fixed_order_guard`,
  `shuffled_order_guard`, `poisson_batch_guard`, `participation_guard`.

This module re-exports both, and `batching.X` is the name users and the
library's own modules write.
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


__all__ = ('AnchoredSinglePass', 'batch_fingerprint', 'CyclicPoissonBatches',
           'EpochGuardState', 'fixed_order_guard', 'FixedOrderBatches',
           'FixedOrderGuardState', 'group_by_user', 'participation_guard',
           'poisson_batch_guard', 'poisson_size_bound', 'PoissonBatches',
           'PoissonGuardState', 'RemainderWarning', 'reseeded',
           'shuffled_order_guard', 'ShuffledBatches')
