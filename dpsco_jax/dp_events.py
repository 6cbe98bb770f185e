"""Sensitivity of a whole run and its `dp_accounting` event.

Without amplification every mechanism of `dpsco_jax.noise` is ONE Gaussian
mechanism `C x + z` on the whole stream: its sensitivity is derived from the
mechanism's encoder matrix `C` and the participation pattern
(`participation_sensitivity`, `mechanism_sensitivity`), and `dp_event` states
the run as `GaussianDpEvent(noise_multiplier / sensitivity)`; Poisson-sampled
DP-SGD is `SelfComposed(PoissonSampled(q, Gaussian(z)), T)` and cyclic Poisson
sampling its amplified form (`cyclic_poisson_structure`).

`dpsco_jax.accounting` re-exports every public name here.
"""

import functools
from typing import Optional

import dp_accounting
import numpy as np

from dpsco_jax import checks
from dpsco_jax import noise as noise_lib
from dpsco_jax.participation import _releases
from dpsco_jax.participation import _validate_participation
from dpsco_jax.participation import CyclicPoissonSampling
from dpsco_jax.participation import FixedOrder
from dpsco_jax.participation import Participation
from dpsco_jax.participation import PoissonSampling


def participation_sensitivity(encoder: np.ndarray,
                              participation: Participation) -> float:
  """l2 sensitivity of `x -> C x` when one example changes.

  One example contributes a vector of norm <= 1 (after dividing by the
  per-step sensitivity) at each step it takes part in. With G = C^T C the
  squared sensitivity is the largest `sum_{s,t} |G[s, t]|` over the steps
  s, t one example can share. This is exact when those entries of G can be
  made non-negative by flipping the signs of the example's contributions:
  non-negative C (trees, identity, non-negative factorizations), strategies
  whose Gram is zero between steps an example shares (the orthogonality of
  `strategies.optimize_strategy`), and any C when an example takes part at
  most twice. Otherwise it is an upper bound, never an underestimate. For `Shuffled`, the worst step in each pair of epochs is
  taken, which is exact when G has no cross-epoch entries (e.g. trees
  restarted every epoch) and an upper bound otherwise.

  Args:
    encoder: `C`, shape `[rows, num_steps]`.
    participation: `FixedOrder` or `Shuffled`.

  Returns:
    The sensitivity in units of one step's sensitivity.

  Raises:
    ValueError: if the pattern's step count differs from the encoder's.
  """
  _validate_participation(participation)
  if isinstance(participation, (PoissonSampling, CyclicPoissonSampling)):
    raise ValueError('Poisson sampling has no fixed participation; it is '
                     'accounted by amplification instead')
  encoder = np.asarray(encoder, dtype=np.float64)
  k, b = participation.num_epochs, participation.steps_per_epoch
  if encoder.shape[1] != k * b:
    raise ValueError(
        f'the mechanism covers {encoder.shape[1]} steps but the participation '
        f'pattern has {k} x {b} = {k * b}')
  gram = np.abs(encoder.T @ encoder).reshape(k, b, k, b)
  if isinstance(participation, FixedOrder):
    # Example in batch j: steps (i*b + j) for every epoch i.
    per_batch = np.einsum('ijlj->j', gram)
    return float(np.sqrt(per_batch.max()))
  worst = gram.max(axis=(1, 3))
  return float(np.sqrt(worst.sum()))


def _encoder_for(mechanism: noise_lib.NoiseMechanism,
                 participation: Participation) -> np.ndarray:
  if mechanism.num_steps is None:
    return np.eye(participation.num_steps)
  if mechanism.num_steps != participation.num_steps:
    raise ValueError(
        f'the mechanism was built for {mechanism.num_steps} steps but the '
        f'participation pattern has {participation.num_steps}: account for '
        'exactly the steps the noise allows')
  return mechanism.encoder_matrix()


def _is_iid(mechanism: noise_lib.NoiseMechanism, steps: int) -> bool:
  if mechanism.num_steps is None or mechanism.name == 'gaussian':
    return mechanism.release == 'per_step'
  encoder = mechanism.encoder_matrix()
  return (mechanism.release == 'per_step' and encoder.shape == (steps, steps)
          and np.array_equal(encoder, np.eye(steps)))


def mechanism_sensitivity(mechanism: noise_lib.NoiseMechanism,
                          participation: Participation) -> float:
  """Sensitivity of a whole run of `mechanism` under `participation`.

  Args:
    mechanism: a noise mechanism.
    participation: `FixedOrder` or `Shuffled`.

  Returns:
    The run's l2 sensitivity in units of one step's sensitivity.
  """
  _validate_participation(participation)
  if isinstance(participation, CyclicPoissonSampling):
    return cyclic_poisson_structure(mechanism, participation)[0]
  if (not isinstance(participation, PoissonSampling) and
      participation.num_epochs == 1):
    # One participation per example: the largest column norm of C, exactly.
    # Mechanisms that know it spare building C (T x T for a long i.i.d. run).
    if (mechanism.num_steps is not None and
        mechanism.num_steps != participation.num_steps):
      _encoder_for(mechanism, participation)  # raises the mismatch error
    if mechanism.single_participation_sensitivity is not None:
      return float(mechanism.single_participation_sensitivity())
    encoder = np.asarray(_encoder_for(mechanism, participation), np.float64)
    return float(np.sqrt(np.max(np.sum(encoder ** 2, axis=0))))
  if (isinstance(participation, FixedOrder) and
      mechanism.fixed_order_sensitivity is not None and
      mechanism.num_steps == participation.num_steps):
    value = mechanism.fixed_order_sensitivity(participation.num_epochs,
                                              participation.steps_per_epoch)
    if value is not None:
      return float(value)
  return participation_sensitivity(_encoder_for(mechanism, participation),
                                   participation)


def dp_event(mechanism: noise_lib.NoiseMechanism, noise_multiplier: float,
             participation: Participation, releases=()
             ) -> dp_accounting.DpEvent:
  """The `dp_accounting` event of a whole run.

  Args:
    mechanism: the noise mechanism used by the run.
    noise_multiplier: node/step noise std over one step's sensitivity.
    participation: how batches were formed.
    releases: `GaussianRelease`s of the same data besides the steps.

  Returns:
    A `dp_accounting.DpEvent`: the steps' event, composed after the
    releases' `GaussianDpEvent`s when there are any.

  Raises:
    ValueError: for bad inputs (a negative, NaN or infinite noise
      multiplier among them), Poisson sampling with correlated noise (its
      amplification is not accounted here), or cyclic Poisson sampling with
      an encoder whose columns of one partition overlap
      (`cyclic_poisson_structure`).
  """
  _validate_participation(participation)
  noise_multiplier = checks.noise_multiplier(noise_multiplier)
  if isinstance(participation, PoissonSampling):
    if not _is_iid(mechanism, participation.num_steps):
      raise ValueError(
          'Poisson-sampling amplification is only accounted for i.i.d. '
          f'Gaussian noise, not {mechanism.name}; use FixedOrder or Shuffled')
    if (mechanism.num_steps is not None and
        mechanism.num_steps != participation.num_steps):
      raise ValueError('the mechanism and the participation pattern disagree '
                       'on the number of steps')
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            participation.sampling_probability,
            dp_accounting.GaussianDpEvent(noise_multiplier)),
        participation.num_steps)
  elif isinstance(participation, CyclicPoissonSampling):
    sensitivity, compositions = cyclic_poisson_structure(mechanism,
                                                         participation)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            participation.sampling_probability,
            dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity)),
        compositions)
  else:
    sensitivity = mechanism_sensitivity(mechanism, participation)
    event = dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity)
  releases = _releases(releases)
  if not releases:
    return event
  return dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(r.noise_multiplier) for r in releases]
      + [event])


@functools.lru_cache(maxsize=8)  # Each entry keeps its mechanism's encoder.
def cyclic_poisson_structure(mechanism: noise_lib.NoiseMechanism,
                             participation: CyclicPoissonSampling
                             ) -> tuple[float, int]:
  """What the amplified accounting of cyclic Poisson sampling needs.

  Amplified BandMF (Choquette-Choo et al. 2023, restated here): an
  example of partition j can only contribute at steps
  `S_j = {j, j + b, ...}`. If the encoder's columns for two distinct steps
  of `S_j` never share a non-zero row (true for a lower-triangular C with
  at most b bands), the rows of `C x + z` that depend on the example split
  into disjoint blocks, one per step of `S_j`; the block of step s is a
  Gaussian mechanism of sensitivity `||C e_s||` applied to a contribution
  that is present with probability q, independently across steps (Poisson
  coins), and the other rows are post-processing of what is common to both
  neighbours. The release is then the adaptive composition (rows are
  streamed, later batches may depend on earlier outputs) of at most
  `|S_j|` Poisson-subsampled Gaussians of noise multiplier
  `z / max_s ||C e_s||`: the `dp_accounting` event
  `SelfComposed(PoissonSampled(q, Gaussian(z / s)), m)`, m the largest
  number of non-zero columns of one partition (`ceil(T / b)` for a whole
  run; fewer for the prefix of a run, whose later columns are zero). This
  is DP-SGD's event with the same q for m steps. Valid under add/remove
  or zero-out neighbours of an example whose partition does not move
  (plans use zero-out: the data set keeps its size and order).

  Example:
    >>> cyclic_poisson_structure(noise.matrix_factorization(c),
    ...                          CyclicPoissonSampling(0.1, 100, 10))

  Args:
    mechanism: the noise mechanism (its `encoder_matrix()` is read).
    participation: the cyclic Poisson sampling.

  Returns:
    `(sensitivity, compositions)`: the largest column norm of C and m.

  Raises:
    ValueError: if two steps of one partition share a row of C (e.g. more
      than b bands): the blocks are not disjoint and this accounting does
      not hold.
  """
  _validate_participation(participation)
  encoder = np.asarray(_encoder_for(mechanism, participation), np.float64)
  steps, b = participation.num_steps, participation.num_partitions
  magnitude = np.abs(encoder)
  overlap = magnitude.T @ magnitude
  same_partition = np.equal.outer(np.arange(steps) % b, np.arange(steps) % b)
  np.fill_diagonal(same_partition, False)
  if np.any(overlap[same_partition] > 0):
    raise ValueError(
        f'{mechanism.name}: two steps of one partition (b = {b} apart) share '
        'a row of the encoder, so their noise is correlated and the '
        'amplified cyclic-Poisson accounting does not hold. Use a banded '
        f'strategy with at most {b} bands (optimize_strategy(..., bands=b)).')
  norms = np.sqrt(np.diag(overlap))
  used = norms > 0
  compositions = max(int(np.sum(used[j::b])) for j in range(min(b, steps)))
  return float(norms.max()), max(compositions, 1)


def tree_aggregation_event(noise_multiplier: float, num_steps: int,
                           restart_every: Optional[int] = None
                           ) -> dp_accounting.DpEvent:
  """`dp_accounting`'s own single-epoch tree event (RDP only).

  Each example in at most one step over all trees. Offered as an independent
  cross-check of `dp_event` for trees (they agree under RDP).

  Args:
    noise_multiplier: node noise std over one step's sensitivity.
    num_steps: total steps.
    restart_every: steps per tree (None: one tree).

  Returns:
    A `dp_accounting.SingleEpochTreeAggregationDpEvent`.

  Raises:
    ValueError: for a negative, NaN or infinite noise multiplier (the RDP
      accountant would report epsilon 0 for NaN) or a bad step count.
  """
  noise_multiplier = checks.noise_multiplier(noise_multiplier)
  num_steps = checks.positive_int(num_steps, 'num_steps')
  size = restart_every or num_steps
  counts = [size] * (num_steps // size)
  if num_steps % size:
    counts.append(num_steps % size)
  return dp_accounting.SingleEpochTreeAggregationDpEvent(noise_multiplier,
                                                         counts)
