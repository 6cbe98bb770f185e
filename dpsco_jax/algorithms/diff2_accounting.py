"""Privacy accounting of DIFF2-GD, DP-GD and DIFF2-BVR-L-SGD (paper 003).

Every round of DIFF2 releases `v_t`, a Gaussian mechanism on a weighted
clipped sum whose replace-one sensitivity the noise multiplier already
contains (`dpsco_jax.algorithms.diff2`): a restart round is a
`Gaussian(z_1)`, a difference round a `Gaussian(z_2)`, whatever the clips,
the client sizes or the iterates. Each example takes part in all R rounds
(full local data, no sampling); an example of client p also takes part in the
local steps of DIFF2-BVR-L-SGD when p is the active client, at most
`ceil(R / P)` rounds of `K - 1` steps, each a Gaussian(z_3) on a minibatch of
b rows drawn without replacement from `n_p >= n_min` rows.

Methods (`method=`):

* 'pld' (default without local steps): `dp_accounting`'s privacy-loss
  distribution of the composed Gaussians (nearly exact);
* 'rdp': `dp_accounting`'s Renyi accountant, best order, replace-one
  neighbours (its subsampling-without-replacement bound is Wang, Balle and
  Kasiviswanathan 2019, Theorem 27); the only dp_accounting method with
  local steps;
* 'paper': the paper's closed forms, Proposition 4.1 (and E.2 with local
  steps, using the subsampling bound B.7 = WBK19 Theorem 9 exactly). To
  calibrate, it fixes the order `alpha = 1 + ceil(2 log(1/delta) / epsilon)`
  and splits the RDP budget `epsilon / 2` with the constant `u`:
  `z_1^2 = u alpha ceil(R/T) / epsilon`,
  `z_2^2 = u/(u-1) alpha (R - ceil(R/T)) / epsilon` (the paper's
  `sigma = 2 z / (n_min P)`; T = 1 is DP-GD with `z^2 = alpha R / epsilon`).
  Its epsilon for given multipliers is the same RDP bound at the best
  integer order.

Calibration with 'pld' / 'rdp' keeps the paper's split (the ratios between
z_1, z_2 and z_3 of the 'paper' calibration) and scales all multipliers by
the smallest common factor that meets (epsilon, delta): less noise than the
closed forms for the same guarantee. With local steps, 'rdp' measures the
local steps' share of the split with its own subsampling bound instead of
B.7 (z_1 and z_2 are the same either way: both accountants give a Gaussian
round `alpha / (2 z^2)`).

B.7 bounds the terms `j >= 3` by a constant for the Gaussian, so it has a
floor: however large z_3, one local release costs at least
`paper_subsampled_rdp(alpha, b / n_min, inf) > 0`. When the local releases'
floor reaches their share of the budget, no z_3 meets it and the 'paper'
calibration raises a ValueError that says so; dp_accounting's bound (method
'rdp') tends to 0 and has no floor.

Convention: noise multiplier = noise std over the replace-one sensitivity of
the clipped sum, so `z = sigma n_min P / 2` for the server rounds and
`z_3 = sigma_3 b / 2` for the local steps, with the paper's sigmas.

References:
  T. Murata, T. Suzuki. DIFF2. ICML 2023, Proposition 4.1, Proposition E.2,
  Lemmas B.4, B.6, B.7.
  Y.-X. Wang, B. Balle, S. Kasiviswanathan. Subsampled Renyi differential
  privacy and analytical moments accountant. AISTATS 2019.
"""

import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import dp_accounting
from scipy import optimize
from scipy import special

from dpsco_jax import accounting
from dpsco_jax import checks
from dpsco_jax.algorithms import diff2
from dpsco_jax.algorithms.diff2 import Diff2NoiseMultipliers

METHODS = ('pld', 'rdp', 'paper')
# Integer orders for the 'paper' method's epsilon (B.7 needs integers).
_PAPER_ORDERS = tuple(range(2, 257))
BudgetSplit = Union[float, Sequence[float]]
# The calibration searches double or halve a multiplier (or a common scale)
# at most this many times from their start: 2^20 times more noise than the
# start is far past any useful run, and dp_accounting's subsampling bound
# loses precision (math domain error) for multipliers near 2^30.
_MAX_DOUBLINGS = 20


class LocalSteps(NamedTuple):
  """The local steps of DIFF2-BVR-L-SGD, as the accountant needs them.

  Attributes:
    local_steps: K (K - 1 noisy local steps per round).
    local_batch_size: b, drawn without replacement.
    min_client_size: n_min, the smallest client (largest sampling ratio).
    num_clients: P (each client is active in `ceil(R / P)` rounds).
  """

  local_steps: int
  local_batch_size: int
  min_client_size: int
  num_clients: int


def num_restarts(num_rounds: int, restart_interval: int) -> int:
  """Restart rounds among R rounds: `ceil(R / T)` (rounds 0, T, 2T, ...).

  Example:
    >>> num_restarts(2000, 20)
    100

  Args:
    num_rounds: R.
    restart_interval: T.

  Returns:
    The number of restart rounds.
  """
  num_rounds = checks.positive_int(num_rounds, 'num_rounds')
  restart_interval = checks.positive_int(restart_interval, 'restart_interval')
  return -(-num_rounds // restart_interval)


def paper_order(epsilon: float, delta: float) -> int:
  """The paper's fixed RDP order `1 + ceil(2 log(1/delta) / epsilon)`.

  It makes the conversion term `log(1/delta) / (alpha - 1) <= epsilon / 2`
  (Proposition 4.1).

  Example:
    >>> paper_order(3.0, 1e-5)
    9

  Args:
    epsilon: target epsilon.
    delta: target delta.

  Returns:
    alpha.
  """
  accounting.validate_epsilon_delta(epsilon, delta)
  return 1 + math.ceil(2 * math.log(1 / delta) / epsilon)


# The paper's sigma lives with the estimator it describes (Theorem 4.3's
# step-size bound uses it); it stays part of this module's API.
paper_sigma = diff2.paper_sigma


def _validate(num_rounds, restart_interval, noise_multipliers, local):
  num_restarts(num_rounds, restart_interval)
  if local is not None:
    local = LocalSteps(*local)
    checks.positive_int(local.local_steps, 'local_steps')
    checks.positive_int(local.local_batch_size, 'local_batch_size')
    checks.positive_int(local.num_clients, 'num_clients')
    if checks.positive_int(local.min_client_size, 'min_client_size') < (
        local.local_batch_size):
      raise ValueError('local_batch_size must not exceed min_client_size')
    if local.local_steps == 1:
      local = None  # K = 1 has no local steps.
  if noise_multipliers is not None:
    noise_multipliers = Diff2NoiseMultipliers(*(
        checks.noise_multiplier(z, f'the {field} entry of the noise '
                                   'multipliers')
        for field, z in zip(Diff2NoiseMultipliers._fields,
                            Diff2NoiseMultipliers(*noise_multipliers))))
  return local, noise_multipliers


def _counts(num_rounds, restart_interval, local):
  restarts = num_restarts(num_rounds, restart_interval)
  local_releases = 0
  if local is not None:
    local_releases = (local.local_steps - 1) * -(-num_rounds //
                                                 local.num_clients)
  return restarts, num_rounds - restarts, local_releases


def diff2_dp_event(
    num_rounds: int,
    restart_interval: int,
    noise_multipliers: Diff2NoiseMultipliers,
    local: Optional[LocalSteps] = None,
) -> dp_accounting.DpEvent:
  """The `dp_accounting` event of a whole DIFF2 run, for one example.

  Example:
    >>> event = diff2_dp_event(2000, 20, Diff2NoiseMultipliers(19.4, 169.))

  Args:
    num_rounds: R.
    restart_interval: T.
    noise_multipliers: (z_1, z_2[, z_3]).
    local: the local steps of DIFF2-BVR-L-SGD, or None.

  Returns:
    A composition of Gaussian events (and subsampled-without-replacement
    Gaussian events for the local steps).

  Raises:
    ValueError: for bad inputs.
  """
  local, z = _validate(num_rounds, restart_interval, noise_multipliers, local)
  restarts, differences, local_releases = _counts(num_rounds,
                                                  restart_interval, local)
  events = [dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(z.restart), restarts)]
  if differences:
    events.append(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(z.difference), differences))
  if local_releases:
    events.append(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            local.min_client_size, local.local_batch_size,
            dp_accounting.GaussianDpEvent(z.local)), local_releases))
  return dp_accounting.ComposedDpEvent(events)


def _log_expm1(x: float) -> float:
  """`log(e^x - 1)` for x >= 0, without overflow for a large x."""
  if x == 0:
    return -math.inf
  return x + math.log(-math.expm1(-x))


def paper_subsampled_rdp(order: int, sampling_ratio: float,
                         noise_multiplier: float) -> float:
  """RDP of a Gaussian on a without-replacement subsample, paper Lemma B.7.

  With `eps(j) = j / (2 z^2)` (the Gaussian's RDP, Lemma B.6) and, for the
  Gaussian, `eps(inf) = inf` so each `min{2, .}` is 2:
  `1/(a-1) log(1 + g^2 C(a,2) min{4(e^eps(2) - 1), 2 e^eps(2)}
  + sum_{j=3}^a g^j C(a,j) e^{(j-1) eps(j)} 2)`, computed in log space.

  The bound does not vanish with the noise: its limit as z grows (pass
  `math.inf`) is `1/(a-1) log(1 + 2 sum_{j=3}^a g^j C(a,j))`.

  Example:
    >>> paper_subsampled_rdp(9, 0.01, 5.0)
    >>> paper_subsampled_rdp(9, 0.01, math.inf)   # the floor, > 0

  Args:
    order: integer alpha >= 2.
    sampling_ratio: gamma = b / n.
    noise_multiplier: z (std over the replace-one sensitivity of the sum);
      `math.inf` gives the bound's floor.

  Returns:
    The RDP bound at `order` (inf without noise).

  Raises:
    ValueError: if `order` < 2.
  """
  order = int(order)
  if order < 2:
    raise ValueError(f'order must be an integer >= 2, got {order}')
  if noise_multiplier == 0:
    return math.inf
  gamma = float(sampling_ratio)
  # Divisions, not `z ** 2`: a float power raises OverflowError for a huge z,
  # a division goes to 0 (or inf for a tiny z) as the bound's limits do.
  eps = lambda j: j / 2.0 / noise_multiplier / noise_multiplier
  log_gamma = math.log(gamma)
  log_binom = lambda j: (special.gammaln(order + 1) - special.gammaln(j + 1) -
                         special.gammaln(order - j + 1))
  second = min(math.log(4.0) + _log_expm1(eps(2)), math.log(2.0) + eps(2))
  terms = [0.0, 2 * log_gamma + log_binom(2) + second]
  terms += [j * log_gamma + log_binom(j) + (j - 1) * eps(j) + math.log(2.0)
            for j in range(3, order + 1)]
  return float(special.logsumexp(terms)) / (order - 1)


def _paper_rdp(order, num_rounds, restart_interval, z, local):
  restarts, differences, local_releases = _counts(num_rounds,
                                                  restart_interval, local)
  total = 0.0
  for count, multiplier in ((restarts, z.restart),
                            (differences, z.difference)):
    if count:
      total += (math.inf if multiplier == 0 else
                count * order / (2.0 * multiplier ** 2))
  if local_releases:
    total += local_releases * paper_subsampled_rdp(
        order, local.local_batch_size / local.min_client_size, z.local)
  return total


def epsilon_spent(
    num_rounds: int,
    restart_interval: int,
    noise_multipliers: Diff2NoiseMultipliers,
    delta: float,
    *,
    method: Optional[str] = None,
    local: Optional[LocalSteps] = None,
) -> float:
  """The epsilon of a DIFF2 run at `delta` (replace-one, item level).

  Example:
    >>> epsilon_spent(2000, 20, Diff2NoiseMultipliers(19.36, 168.82), 1e-5,
    ...               method='paper')   # <= 3

  Args:
    num_rounds: R.
    restart_interval: T (1 for DP-GD).
    noise_multipliers: (z_1, z_2[, z_3]).
    delta: target delta.
    method: 'pld', 'rdp' or 'paper' (module docstring); default 'pld', or
      'rdp' with local steps.
    local: the local steps of DIFF2-BVR-L-SGD, or None.

  Returns:
    epsilon (inf when a used multiplier is 0, under every method).

  Raises:
    ValueError: for bad inputs (a negative, NaN or infinite multiplier, even
      an unused one, is refused before any method runs), or 'pld' with local
      steps.
  """
  accounting.validate_epsilon_delta(None, delta)
  local, z = _validate(num_rounds, restart_interval, noise_multipliers, local)
  method = method or ('pld' if local is None else 'rdp')
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}')
  if method == 'paper':
    # Lemma B.4 at the best integer order.
    return min(_paper_rdp(a, num_rounds, restart_interval, z, local) +
               math.log(1 / delta) / (a - 1) for a in _PAPER_ORDERS)
  event = diff2_dp_event(num_rounds, restart_interval, z, local)
  if method == 'pld':
    if local is not None:
      raise ValueError("'pld' cannot account the local steps' sampling "
                       "without replacement; use 'rdp' or 'paper'")
    return accounting.event_epsilon(event, delta)
  return accounting.event_epsilon(
      event, delta, method='rdp',
      relation=dp_accounting.NeighboringRelation.REPLACE_ONE)


def _split(budget_split: BudgetSplit, local) -> tuple[float, float, float]:
  """Fractions of the RDP budget for restarts, differences, local steps."""
  if local is None:
    u = float(budget_split if not isinstance(budget_split, (tuple, list))
              else budget_split[0])
    if not u > 1:
      raise ValueError(f'budget_split u must be > 1, got {budget_split!r}')
    return 1 / u, 1 - 1 / u, 0.0
  if not isinstance(budget_split, (tuple, list)) or len(budget_split) != 2:
    raise ValueError('with local steps, budget_split is the pair (u_1, u_2) '
                     'of Proposition E.2')
  u1, u2 = map(float, budget_split)
  if not (u1 > 1 and u2 > 1 and 1 / u1 + 1 / u2 < 1):
    raise ValueError(f'need u_1, u_2 > 1 and 1/u_1 + 1/u_2 < 1, got '
                     f'{budget_split!r}')
  return 1 / u1, 1 / u2, 1 - 1 / u1 - 1 / u2


def _smallest_meeting(gap: Callable[[float], float], what: str) -> float:
  """The smallest x (to 1e-9) with `gap(x) <= 0`, for a decreasing `gap`.

  x is a log multiplier or a log scale, searched from 0 by steps of log 2,
  at most `_MAX_DOUBLINGS` each way, so the search ends (and never
  overflows) whatever `gap` does.

  Args:
    gap: epsilon (or RDP) spent minus the budget, decreasing in x.
    what: what x is the logarithm of, for the error message.

  Returns:
    x with `gap(x) <= 0`.

  Raises:
    ValueError: if `gap` is still positive at `_MAX_DOUBLINGS log 2`.
  """
  step = math.log(2.0)
  upper = 0.0
  for _ in range(_MAX_DOUBLINGS):
    if gap(upper) <= 0:
      break
    upper += step
  else:
    if gap(upper) > 0:
      raise ValueError(
          f'no {what} up to 2^{_MAX_DOUBLINGS} times its start meets the '
          'budget')
  lower = upper - step
  for _ in range(_MAX_DOUBLINGS):
    if gap(lower) > 0:
      break
    lower -= step
  else:
    return lower  # Meets the budget with 2^-20 of the start: no root near.
  xtol = 1e-9
  x = optimize.brentq(gap, lower, upper, xtol=xtol)
  # Brent's method may stop on either side of the root; step towards
  # `upper` (where the budget is met) until the budget is met.
  while gap(x) > 0:
    x = min(x + xtol, upper)
    xtol *= 2.0
  return x


def _local_rdp(method: str, order: int,
               local: LocalSteps) -> Callable[[float], float]:
  """RDP at `order` of one local release, as a function of z_3."""
  gamma = local.local_batch_size / local.min_client_size
  if method == 'paper':
    return lambda z: paper_subsampled_rdp(order, gamma, z)

  def accountant_rdp(z: float) -> float:
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        local.min_client_size, local.local_batch_size,
        dp_accounting.GaussianDpEvent(z))
    accountant = dp_accounting.rdp.RdpAccountant(
        orders=[order],
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    with accounting.quiet_excluded_orders():
      return float(accountant.compose(event).rdp[0])

  return accountant_rdp


def _split_multipliers(method, num_rounds, restart_interval, epsilon, delta,
                       budget_split, local) -> Diff2NoiseMultipliers:
  """The multipliers that give each part its share of the RDP at alpha."""
  order = paper_order(epsilon, delta)
  restarts, differences, local_releases = _counts(num_rounds,
                                                  restart_interval, local)
  share_restart, share_difference, share_local = _split(budget_split, local)
  if not differences:
    # DP-GD (T = 1): the whole budget goes to the restarts (u -> 1).
    share_restart, share_local = 1.0 - share_local, share_local
  # Each part gets its share of the RDP budget epsilon / 2:
  # count * alpha / (2 z^2) = share * epsilon / 2.
  multiplier = lambda count, share: math.sqrt(count * order /
                                              (share * epsilon))
  z1 = multiplier(restarts, share_restart)
  z2 = multiplier(differences, share_difference) if differences else 0.0
  z3 = 0.0
  if local_releases:
    budget = share_local * epsilon / 2
    rdp = _local_rdp(method, order, local)
    if method == 'paper':
      floor = local_releases * rdp(math.inf)
      if floor >= budget:
        gamma = local.local_batch_size / local.min_client_size
        raise ValueError(
            f"the paper's subsampling bound (Lemma B.7) cannot fit the local "
            f'steps into their share of the budget at any noise: at order '
            f'alpha = {order}, {local_releases} local releases at sampling '
            f'ratio b / n_min = {gamma:.4g} cost at least {floor:.4g} of RDP '
            f'however large z_3 is (B.7 bounds its terms j >= 3 by a '
            f'constant), and their share is {budget:.4g} ({share_local:.4g} '
            f'of epsilon / 2). Use method=\'rdp\' (its bound has no floor), '
            f'a larger local share (budget_split), a larger epsilon, a '
            f'smaller local_batch_size / min_client_size, or fewer local '
            f'steps or rounds.')
    log_z3 = _smallest_meeting(
        lambda log_z: local_releases * rdp(math.exp(log_z)) - budget,
        'local noise multiplier z_3')
    z3 = math.exp(log_z3)
  return Diff2NoiseMultipliers(z1, z2, z3)


def calibrate(
    num_rounds: int,
    restart_interval: int,
    epsilon: float,
    delta: float,
    *,
    method: Optional[str] = None,
    budget_split: Optional[BudgetSplit] = None,
    local: Optional[LocalSteps] = None,
) -> Diff2NoiseMultipliers:
  """Noise multipliers that make a DIFF2 run (epsilon, delta)-DP.

  Example:
    >>> calibrate(2000, 20, 3.0, 1e-5, method='paper')   # the paper's
    Diff2NoiseMultipliers(restart=19.36..., difference=168.8..., local=0.0)
    >>> calibrate(2000, 20, 3.0, 1e-5)                   # PLD, less noise
    >>> calibrate(60, 6, 4.0, 1e-5, local=LocalSteps(3, 5, 20, 4))  # RDP
    Diff2NoiseMultipliers(restart=6.34..., difference=14.17..., local=5.67...)
    >>> calibrate(60, 6, 4.0, 1e-5, method='paper',
    ...           local=LocalSteps(3, 5, 20, 4))
    Traceback (most recent call last):
    ValueError: the paper's subsampling bound (Lemma B.7) cannot fit ...

  Args:
    num_rounds: R, fixed before training (the noise depends on it).
    restart_interval: T (1 for DP-GD).
    epsilon: target epsilon.
    delta: target delta.
    method: 'pld', 'rdp' or 'paper' (module docstring); default 'pld', or
      'rdp' with local steps.
    budget_split: u > 1 of Proposition 4.1 (default 1.25, the paper's
      experiments): the restarts get 1/u of the RDP budget, the difference
      rounds the rest. With local steps the pair (u_1, u_2) of Proposition
      E.2 (default (3, 3): a third each for restarts, differences and local
      steps).
    local: the local steps of DIFF2-BVR-L-SGD, or None.

  Returns:
    `Diff2NoiseMultipliers` (z_2 = 0 when T = 1, z_3 = 0 without local
    steps) whose `epsilon_spent` under the same method is at most `epsilon`
    ('pld' and 'rdp': within a relative 1e-6 of it).

  Raises:
    ValueError: for bad inputs, 'pld' with local steps, or when no noise
      meets the budget: with 'paper', the local releases' B.7 floor reaches
      their share (module docstring); with any method, a multiplier 2^20
      times its starting point still not enough (a bounded search).
  """
  accounting.validate_epsilon_delta(epsilon, delta)
  local, _ = _validate(num_rounds, restart_interval, None, local)
  method = method or ('pld' if local is None else 'rdp')
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}')
  if method == 'pld' and local is not None:
    raise ValueError("'pld' cannot account the local steps' sampling "
                     "without replacement; use 'rdp' or 'paper'")
  if budget_split is None:
    budget_split = 1.25 if local is None else (3.0, 3.0)
  split = _split_multipliers(method, num_rounds, restart_interval,
                             float(epsilon), float(delta), budget_split, local)
  if method == 'paper':
    return split

  scaled = lambda log_scale: Diff2NoiseMultipliers(
      *(math.exp(log_scale) * z for z in split))

  def gap(log_scale: float) -> float:
    return epsilon_spent(num_rounds, restart_interval, scaled(log_scale),
                         delta, method=method, local=local) - epsilon

  # The split meets the target at scale 1 (the RDP at alpha is epsilon / 2
  # and its conversion costs at most epsilon / 2), so the search starts
  # there and only goes down.
  return scaled(_smallest_meeting(gap, 'common scale of the multipliers'))
