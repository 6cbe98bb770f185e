"""DIFF2: private gradient DIFFERENCES across clients (paper 003).

Murata & Suzuki, *DIFF2: Differential private optimization via gradient
differences for nonconvex distributed learning* (ICML 2023). P clients each
hold a local data set; a server keeps a running estimator of the global
gradient `f = (1/P) sum_p f_p` (clients weighted equally, `f_p` the mean loss
of client p) and restarts it every T rounds (Algorithm 1):

* restart rounds (`t % T == 0`, t = r - 1 counted from 0): every client sends
  the mean over its data of per-example gradients clipped to `C_1`
  (ClippedMean, Algorithm 2) and the server sets
  `v_t = (1/P) sum_p d_p + N(0, (sigma_1 C_1)^2 I)`;
* other rounds: clients send the mean of per-example DIFFERENCES
  `grad l(x_t, z) - grad l(x_{t-1}, z)` clipped to the public, iterate-dependent
  radius `C_{2,t} = C_2 ||x_t - x_{t-1}||`, and
  `v_t = (1/P) sum_p d_p + v_{t-1} + N(0, (sigma_2 C_{2,t})^2 I)`.

`diff2_estimator` releases `v_t`. Chained with `optax.sgd(lr)` it is DIFF2-GD
(Algorithm 3, `diff2_gd`); with T = 1 it is DP-GD (`dp_gd`, paper §6).
`diff2_bvr_local_sgd` adds the BVR-L-SGD routine (Algorithm 4): after the
server's step one round-robin client runs K - 1 local variance-reduced steps
on minibatches of size b drawn without replacement, with its own noise.

Clients. Each client is one slot of the named axis given as `axis_name`:
a device under `jax.pmap` / `jax.shard_map`, or a vmapped slot under
`jax.vmap(step, in_axes=(None, None, 0, 0), axis_name=...)` to simulate P
clients on one device. The same transformation runs under all three; the
`batch` seen by `update` is that client's WHOLE local data set (full-batch
GD), padded to a common size with `batch_mask` marking the real rows.

How the noise meets the data (privacy):

* Each client's clipped SUM `S_p` is weighted by `n_min / n_p <= 1`, where
  `n_p` is its number of real rows and `n_min` the smallest over clients; the
  weighted sums are summed across clients (`parallel.psum`), ONE noise draw
  from the replicated key is added (`estimators.privatize_sum`), and only
  then is the result divided by `n_min P`. The output is
  `(1/P) sum_p S_p / n_p + noise`: the per-client means of the paper, with
  noise calibrated to the sum. Replacing one example of any client moves the
  weighted sum by at most `2 C` (replace-one), whatever the example (NaN and
  Inf contributions are dropped by `dpsco_jax.clipping`), so the released
  `v_t` moves by at most `2 C / (n_min P)`.
* The local sizes `n_p` are public under replace-one (and zero-out)
  neighbours, which is why those are the only relations accepted: under
  add/remove, dividing by a client's size would release it.
* The difference clip `C_2 ||x_t - x_{t-1}||` depends only on released
  iterates. It is applied as a FIXED clip `C_2` to differences divided by the
  movement, and the noisy result is multiplied back by the movement: the
  same numbers as clipping to `C_{2,t}`, with a sensitivity that never
  depends on the iterates. When the iterate did not move, the differences,
  the noise and the increment are all exactly zero (no 0/0).
* Noise multipliers are in the library's convention (noise std over the
  replace-one sensitivity of the clipped sum): `z = sigma n_min P / 2` in
  terms of the paper's `sigma` (see `diff2_accounting`). The accounting does
  not depend on `n_p`, `P` or the clips.
* A run refuses to go past `num_rounds` (and the local noise past
  `num_rounds * (K - 1)` draws), the numbers its noise was calibrated for.
* With `adaptive_clipping=` (Andrew et al. 2021, Algorithm 1) C_2 is held
  in the state and follows a private quantile of the per-example
  differences over the movement: each difference round also releases the
  centered count of unclipped differences, summed over clients, with its
  own noise, and the sum's noise is `z_sum = (z_2^-2 - z_b^-2)^-1/2` times
  the sensitivity at the round's C_2, so the round is still ONE Gaussian of
  multiplier z_2 and the accounting is unchanged. Restart rounds release
  no count and keep C_2 (`_adaptive_rounds`). With T = 1 C_1 adapts every
  round instead.

Released values: `v_t`, the iterates and, with adaptive clipping, the clip.
The state's `count`, `prev_params`, `estimate` and `adaptive.clip` are
public (functions of released values); its noise states, the count's key
and the minibatch sampling key are SECRET (they determine the noise and the
minibatches): checkpoint them privately, never publish them.

References:
  T. Murata, T. Suzuki. DIFF2: Differential private optimization via gradient
  differences for nonconvex distributed learning. ICML 2023. Algorithms 1-4,
  Proposition 4.1 (accounting), Proposition E.2 (BVR accounting).
"""

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from dpsco_jax import adaptive_clipping as adaptive_lib
from dpsco_jax import checks
from dpsco_jax import clipping
from dpsco_jax import estimators
from dpsco_jax import keys
from dpsco_jax import guards
from dpsco_jax import keywords
from dpsco_jax import neighboring
from dpsco_jax import noise as noise_lib
from dpsco_jax import parallel
from dpsco_jax import physical

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]

_RELATIONS = (neighboring.NeighboringRelation.REPLACE_ONE,
              neighboring.NeighboringRelation.ZERO_OUT)
_EMPTY_CLIENT_MESSAGE = (
    'DIFF2: a client has no real examples (its batch_mask is all False); '
    'every client needs at least one example, and the noise is scaled to the '
    'smallest client')
_SMALL_CLIENT_MESSAGE = (
    'DIFF2-BVR-L-SGD: a client holds fewer real examples than '
    'local_batch_size; minibatches are drawn without replacement from the '
    'real rows')


class Diff2NoiseMultipliers(NamedTuple):
  """Noise multipliers of DIFF2 (std over the replace-one sensitivity).

  Calibrate them with `dpsco_jax.algorithms.diff2_accounting`.

  Attributes:
    restart: z_1, restart rounds (clipped gradients, clip `C_1`).
    difference: z_2, difference rounds (clip `C_2 ||x_t - x_{t-1}||`).
    local: z_3, the local steps of DIFF2-BVR-L-SGD (unused by DIFF2-GD).
  """

  restart: float
  difference: float
  local: float = 0.0


class Diff2State(NamedTuple):
  """State of `diff2_estimator`.

  Attributes:
    count: int32 round counter t (rounds done so far); public.
    prev_params: the iterate of the previous round, `x_{t-1}` (at t = 0 the
      initial params; unused there because round 0 is a restart). Public: a
      released iterate.
    estimate: the last released estimator `v_{t-1}` (float32, or wider),
      zero before the first round. Public: it is the private output.
    noise: the server noise state. SECRET: its key determines the noise.
    adaptive: with `adaptive_clipping=`, the adapted clip (C_2, or C_1 when
      T = 1) of the next round and the count noise's key
      (`adaptive_clipping.AdaptiveClipState`: its clip is public, a
      function of released counts; its key SECRET); None otherwise, so a
      state without it keeps its shape.
  """

  count: jax.Array
  prev_params: PyTree
  estimate: PyTree
  noise: noise_lib.NoiseState
  adaptive: Optional[adaptive_lib.AdaptiveClipState] = None


class Diff2BvrState(NamedTuple):
  """State of `diff2_bvr_local_sgd`.

  Attributes:
    server: the `Diff2State` of the server estimator (public parts as there).
    local_noise: the noise state of the local steps. SECRET.
    sampling_key: key of the local minibatch sampling. SECRET: amplification
      by subsampling holds only while the minibatches stay hidden.
    output: with `output='random_iterate'`, Algorithm 1's output kept so
      far (`x_{k_hat - 1}` of round `t_hat`, read with `selected_iterate`);
      None otherwise.
  """

  server: Diff2State
  local_noise: noise_lib.NoiseState
  sampling_key: jax.Array
  output: Optional['RandomIterateState'] = None


@keywords.checked
def paper_sigma(noise_multiplier: float, min_client_size: int,
                num_clients: int,
                neighboring_relation: neighboring.NeighboringRelation = (
                    neighboring.NeighboringRelation.REPLACE_ONE)) -> float:
  """The paper's sigma of a server round: `Delta z / (n_min P)`.

  `Delta` is the sensitivity factor of the relation: 2 under replace-one
  (the paper's: `2 z / (n_min P)`), 1 under zero-out.

  Example:
    >>> paper_sigma(77.46, 1651, 10)   # DP-GD, California Housing, eps 3
    0.00938...

  Args:
    noise_multiplier: z (std over the sensitivity of the clipped sum).
    min_client_size: n_min.
    num_clients: P.
    neighboring_relation: the relation z was calibrated for.

  Returns:
    sigma, with per-coordinate noise std `sigma C` on `v_t`.
  """
  return neighboring.sensitivity_factor(
      _validate_relation(neighboring_relation)) * float(noise_multiplier) / (
          checks.positive_int(min_client_size, 'min_client_size') *
          checks.positive_int(num_clients, 'num_clients'))


class Diff2Stability(NamedTuple):
  """Theorem 4.3's step-size condition for DIFF2-GD at one configuration.

  Attributes:
    rho: `eta sigma_2 C_2 sqrt(d)`, the noise injected per difference round
      relative to the movement it is scaled by (notes §4.1).
    step_size_bound: `1 / (2 sqrt(T) sigma_2 C_2 sqrt(d))`, the largest eta
      the proof allows (inf when there are no difference rounds).
    holds: whether `sqrt(T) rho <= 1/2`, i.e. eta is within the bound.
  """

  rho: float
  step_size_bound: float
  holds: bool


@keywords.checked
def step_size_stability(
    learning_rate: float, *, restart_interval: int,
    noise_multipliers: Diff2NoiseMultipliers, diff_clip_factor: float,
    num_params: int, min_client_size: int, num_clients: int,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.REPLACE_ONE)) -> Diff2Stability:
  """Whether eta meets paper 003 Theorem 4.3's step-size bound.

  A difference round adds noise of std `sigma_2 C_2 ||x_t - x_{t-1}||` per
  coordinate, `sigma_2 = Delta z_2 / (n_min P)` (`Delta` = 2 under
  replace-one, 1 under zero-out), so the step it feeds moves the iterate by
  about `rho = eta sigma_2 C_2 sqrt(d)` times the last movement. Over the T
  rounds between restarts the proof (Proposition D.2, with its printed
  `1 / (sqrt(T) sigma_2^2 C_2^2 d)` corrected to
  `1 / (2 sqrt(T sigma_2^2 C_2^2 d))`, notes §4.1) needs
  `sqrt(T) rho <= 1/2`; above it noise makes bigger steps, bigger steps
  bigger clips and bigger noise, and runs blow up. The bound says nothing
  about privacy, which holds for any eta.

  Example:
    >>> z = diff2_accounting.calibrate(2000, 20, 3.0, 1e-5, method='paper')
    >>> step_size_stability(0.25, restart_interval=20, noise_multipliers=z,
    ...                     diff_clip_factor=3.0, num_params=101,
    ...                     min_client_size=1651, num_clients=10).holds
    False

  Args:
    learning_rate: eta.
    restart_interval: T.
    noise_multipliers: the run's `Diff2NoiseMultipliers` (library
      convention: std over the sensitivity of the clipped sum).
    diff_clip_factor: C_2.
    num_params: d, the number of model parameters.
    min_client_size: n_min, the smallest client's number of examples.
    num_clients: P.
    neighboring_relation: the relation the multipliers were calibrated for.

  Returns:
    A `Diff2Stability`.

  References:
    Murata & Suzuki (2023), Theorem 4.3 and Proposition D.2.
  """
  eta = checks.positive_finite(learning_rate, 'learning_rate')
  interval = checks.positive_int(restart_interval, 'restart_interval')
  multipliers = _validate_multipliers(noise_multipliers)
  factor = checks.positive_finite(diff_clip_factor, 'diff_clip_factor')
  sigma_2 = paper_sigma(multipliers.difference, min_client_size, num_clients,
                        neighboring_relation)
  noise_per_movement = (sigma_2 * factor *
                        checks.positive_int(num_params, 'num_params') ** 0.5)
  if interval == 1 or noise_per_movement == 0.0:
    return Diff2Stability(0.0, float('inf'), True)
  rho = eta * noise_per_movement
  bound = 1.0 / (2.0 * interval ** 0.5 * noise_per_movement)
  return Diff2Stability(float(rho), float(bound), bool(eta <= bound))


@keywords.checked
def restart_interval_preset(num_rounds: int, *, grad_bound: float,
                            smoothness: float, num_examples: int,
                            epsilon: float, num_params: int) -> int:
  """Theorem 4.3's restart interval `T = max(1, tau R)`, rounded, <= R.

  `tau = (G^2 sqrt(d) / (L N epsilon))^(2/3)` balances the restart noise
  against the accumulated difference noise; the theorem fixes T only up to
  a constant, taken here as 1 (the paper's experiments grid T/R over
  {0.003, 0.01, 0.03, 0.1} instead).

  Example:
    >>> restart_interval_preset(2000, grad_bound=1.0, smoothness=1.0,
    ...                         num_examples=16_512, epsilon=3.0,
    ...                         num_params=101)
    7

  Args:
    num_rounds: R.
    grad_bound: G, a bound on per-example gradient norms (C_1's target).
    smoothness: L, the per-example smoothness (C_2's target).
    num_examples: N, all clients' examples together.
    epsilon: the privacy target.
    num_params: d.

  Returns:
    T in [1, R].

  References:
    Murata & Suzuki (2023), Theorem 4.3.
  """
  rounds = checks.positive_int(num_rounds, 'num_rounds')
  tau = (checks.positive_finite(grad_bound, 'grad_bound') ** 2 *
         checks.positive_int(num_params, 'num_params') ** 0.5 /
         (checks.positive_finite(smoothness, 'smoothness') *
          checks.positive_int(num_examples, 'num_examples') *
          checks.positive_finite(epsilon, 'epsilon'))) ** (2.0 / 3.0)
  return int(min(rounds, max(1, round(tau * rounds))))


class RandomIterateState(NamedTuple):
  """State of `random_output_iterate`.

  Attributes:
    count: int32 rounds done so far.
    selected: int32 `t_hat`, drawn once at init, uniform on `[0, R)`.
    iterate: `x_{t_hat}` once round `t_hat` has been reached, else the
      initial params.
  """

  count: jax.Array
  selected: jax.Array
  iterate: PyTree


def random_output_iterate(num_rounds: int,
                          key: estimators.KeyLike = None
                          ) -> optax.GradientTransformation:
  """Keeps the iterate of one uniformly random round: Algorithm 1's output.

  Paper 003's Algorithm 1 outputs `x_{t_hat}` with `t_hat` uniform on
  `{0, ..., R - 1}` (the paper's `x_{r-1}`, r uniform on `[R]`), the point
  its Theorem 4.3 bounds `E ||grad f||^2` at. `t_hat` is drawn at init from
  `key` (data-independent; keep it apart from the noise key); the
  transformation passes updates through unchanged and records the params
  it sees at round `t_hat`, so chain it FIRST (it must see `x_t`, the
  point the round's gradient is taken at). Read the result with
  `selected_iterate(state)` after the last round.

  Example:
    >>> tx = optax.chain(random_output_iterate(2000, key=1),
    ...                  diff2_estimator(...), optax.sgd(0.125))
    >>> ...   # 2000 rounds
    >>> output = selected_iterate(state)

  Args:
    num_rounds: R.
    key: PRNG key or int seed of the draw of `t_hat`; None: fresh from OS
      entropy.

  Returns:
    An `optax.GradientTransformation` with `RandomIterateState`.

  References:
    Murata & Suzuki (2023), Algorithm 1 (output) and Theorem 4.3.
  """
  num_rounds = checks.positive_int(num_rounds, 'num_rounds')
  key = keys.fresh_key() if key is None else keys.as_key(key)

  def init_fn(params):
    selected = jax.random.randint(key, (), 0, num_rounds, jnp.int32)
    return RandomIterateState(count=jnp.zeros([], jnp.int32),
                              selected=selected, iterate=params)

  def update_fn(updates, state, params=None):
    checks.state_type(state, RandomIterateState, 'random_output_iterate')
    if params is None:
      raise ValueError('random_output_iterate needs params (x_t)')
    here = state.count == state.selected
    iterate = jax.tree_util.tree_map(lambda p, kept: jnp.where(here, p, kept),
                                     params, state.iterate)
    return updates, RandomIterateState(state.count + 1, state.selected,
                                       iterate)

  return optax.GradientTransformation(init_fn, update_fn)


def output_selector(output: str, num_rounds: int,
                    key: estimators.KeyLike = None
                    ) -> tuple[optax.GradientTransformation, ...]:
  """The transformations to chain first for DIFF2's `output` option.

  Example:
    >>> tx = optax.chain(*output_selector('random_iterate', 2000, key=1),
    ...                  diff2_estimator(...), optax.sgd(0.125))

  Args:
    output: 'last' (nothing to keep: the iterates are the output) or
      'random_iterate' (Algorithm 1's `x_{t_hat}`).
    num_rounds: R.
    key: key or seed of t_hat (None: fresh).

  Returns:
    `()` or `(random_output_iterate(num_rounds, key),)`.

  Raises:
    ValueError: for another `output`.
  """
  return (() if _validate_output(output) == 'last' else
          (random_output_iterate(num_rounds, key),))


def _validate_output(output: str) -> str:
  if output not in ('last', 'random_iterate'):
    raise ValueError(
        f"output must be 'last' or 'random_iterate', got {output!r}")
  return output


def selected_iterate(state: Any) -> PyTree:
  """`x_{t_hat}` from the state of a chain holding `random_output_iterate`.

  Example:
    >>> output = selected_iterate(state)   # after the last round

  Args:
    state: a `RandomIterateState` or a (nested) tuple holding one.

  Returns:
    The iterate of the selected round.

  Raises:
    ValueError: if no `RandomIterateState` is found, or the selected round
      has not been reached yet (the run is not finished; under `jax.jit`
      the refusal is raised when the step runs, `guards.refuse`).
  """
  state = checks.find_state(state, RandomIterateState, 'random_output_iterate')
  if isinstance(state.count, jax.core.Tracer):
    # Inside jit / vmap: the same refusal, at run time.
    return guards.refuse(state.count <= state.selected, state.iterate,
                         'the selected round has not been reached: finish '
                         'the run first')
  if int(state.count) <= int(state.selected):
    raise ValueError(
        f'the selected round {int(state.selected)} has not been reached '
        f'({int(state.count)} rounds done): finish the run first')
  return state.iterate


def diff2_mechanism(num_rounds: int) -> noise_lib.NoiseMechanism:
  """The server noise mechanism of DIFF2: one i.i.d. Gaussian draw per round.

  Example:
    >>> mechanism = diff2_mechanism(2000)   # refuses a 2001st round

  Args:
    num_rounds: R, the rounds the noise was calibrated for.

  Returns:
    `noise.gaussian(num_rounds)`.
  """
  return noise_lib.gaussian(checks.positive_int(num_rounds, 'num_rounds'))


def _validate_relation(relation: neighboring.NeighboringRelation
                       ) -> neighboring.NeighboringRelation:
  relation = neighboring.NeighboringRelation(relation)
  if relation not in _RELATIONS:
    raise ValueError(
        'DIFF2 divides by each client\'s data set size, which is public only '
        'under replace-one (or zero-out) neighbours; got '
        f'{relation.value}')
  return relation


def _validate_multipliers(noise_multipliers: Any) -> Diff2NoiseMultipliers:
  if not isinstance(noise_multipliers, Diff2NoiseMultipliers):
    if noise_multipliers is None:
      raise ValueError('noise_multipliers are required (Diff2NoiseMultipliers'
                       '(restart=z1, difference=z2)); calibrate them with '
                       'dpsco_jax.algorithms.diff2_accounting')
    noise_multipliers = Diff2NoiseMultipliers(*noise_multipliers)
  validated = Diff2NoiseMultipliers(
      *(estimators.validate_noise_multiplier(z) for z in noise_multipliers))
  if validated.restart == 0.0:
    # z_2 = 0 (T = 1) and z_3 = 0 (no local steps) are unused, not missing.
    checks.warn_no_noise('DIFF2 (restart multiplier z_1 = 0)')
  return validated


def _float32_norm(tree: PyTree) -> jax.Array:
  """Global l2 norm in float32 (or wider), over all leaves."""
  leaves = jax.tree_util.tree_leaves(tree)
  return jnp.sqrt(sum(jnp.sum(jnp.square(
      x.astype(jnp.promote_types(x.dtype, jnp.float32)))) for x in leaves))


def _movement(params: PyTree, prev_params: PyTree) -> tuple[jax.Array,
                                                            jax.Array]:
  """`||params - prev_params||` and its safe inverse (0 when it is 0).

  Both iterates are released, so the movement is public.
  """
  movement = _float32_norm(jax.tree_util.tree_map(
      lambda p, q: p.astype(jnp.float32) - q.astype(jnp.float32), params,
      prev_params))
  moved = movement > 0
  inverse = jnp.where(moved, 1.0 / jnp.where(moved, movement, 1.0), 0.0)
  return movement, inverse


class _RoundCoefficients(NamedTuple):
  """How one round's statistic is formed and scaled back (`_round_coefficients`).

  Attributes:
    a: float32 scalar, the weight of the gradient at the current params.
    b: float32 scalar, the weight of the gradient at the second point.
    scale: float32 scalar, what the noisy mean is multiplied by after the
      noise (post-processing).
  """

  a: jax.Array
  b: jax.Array
  scale: jax.Array


def _round_coefficients(is_restart: jax.Array, grad_clip: float,
                        diff_clip: float, movement: jax.Array,
                        inverse: jax.Array) -> _RoundCoefficients:
  """The coefficients that make every round ONE difference statistic.

  A round privatizes `sum_i clip_{C_2}(a g_i - b h_i)`, `g_i` the gradient
  of example i at the params and `h_i` at a second point, both on the SAME
  example, and multiplies the noisy result by `scale`:

  * difference round: `a = b = 1 / ||x_t - x_{t-1}||` (0 if the iterate did
    not move), `h_i` at `x_{t-1}`, `scale = ||x_t - x_{t-1}||`: the paper's
    clip `C_2 ||x_t - x_{t-1}||`, as before;
  * restart round: `a = C_2 / C_1`, `b = 0`, `h_i` at the params themselves,
    `scale = C_1 / C_2`. Since `clip_{C_2}((C_2 / C_1) g) = (C_2 / C_1)
    clip_{C_1}(g)`, the released value is the clipped-gradient sum at clip
    `C_1` (to float rounding, a few ulp), and its noise, drawn at
    `z_1 * sensitivity(C_2)` and scaled by `C_1 / C_2`, is the restart's
    `z_1 * sensitivity(C_1)`. Taking `h_i` at the params keeps
    `0 * h_i = 0` wherever `g_i` is finite, so a non-finite gradient at the
    previous point cannot drop an example on a restart.

  Privacy: on both kinds of round each example's contribution is clipped to
  the statistic's `C_2` by `dpsco_jax.clipping` (the same per-example
  clipping and rounding margins; the state's C_2 when it adapts), the noise
  std is the round's multiplier times `sensitivity(C_2)`, and `scale` is
  applied after the noise: the ratio of noise to sensitivity is `z_1` on
  restarts and `z_2` otherwise, as accounted (with adaptive clipping,
  `z_sum` and the count's share on difference rounds, together `z_2`).

  Cost: a restart round also evaluates the second gradient (at the params,
  weighted by 0), one extra gradient per example once every T rounds. That
  is preferred to a `lax.cond` between two statistics: a conditional in the
  compiled step makes the device read its predicate back to the host and
  synchronize the stream EVERY round (DESIGN.md, "Hot path").

  Args:
    is_restart: bool scalar, whether this round restarts the estimator.
    grad_clip: C_1.
    diff_clip: C_2, the statistic's clip (a float32 scalar when it adapts:
      the restart's `a = C_2 / C_1` uses the round's C_2).
    movement: `||x_t - x_{t-1}||` (public).
    inverse: its safe inverse (0 when it is 0).

  Returns:
    The `_RoundCoefficients`.
  """
  return _RoundCoefficients(
      a=jnp.where(is_restart, jnp.asarray(diff_clip / grad_clip, jnp.float32),
                  inverse),
      b=jnp.where(is_restart, jnp.float32(0.0), inverse),
      scale=jnp.where(is_restart,
                      jnp.asarray(grad_clip / diff_clip, jnp.float32),
                      movement))


def _select(predicate: jax.Array, on_true: PyTree, on_false: PyTree) -> PyTree:
  """`jnp.where(predicate, x, y)` leaf by leaf (a select, not a branch)."""
  return jax.tree_util.tree_map(lambda x, y: jnp.where(predicate, x, y),
                                on_true, on_false)


def _statistics(
    loss_fn: LossFn, grad_clip: float, diff_clip_factor: float,
    microbatch_size: Optional[int], clipping_method: str
) -> tuple[clipping.ClippedStatistic, clipping.ClippedStatistic]:
  """The clipped-gradient statistic (clip C_1) and the difference one (C_2).

  Differences are divided by the public movement before clipping, so the
  difference statistic's clip is the constant C_2 (see the module
  docstring). With T > 1 restarts run it too (`_round_coefficients`): no
  branch per round.
  """
  return (
      clipping.clipped_grad_sum(loss_fn, grad_clip,
                                microbatch_size=microbatch_size,
                                clipping_method=clipping_method),
      clipping.clipped_grad_difference_sum(
          loss_fn, clipping.validate_clip(diff_clip_factor,
                                          'diff_clip_factor'),
          microbatch_size=microbatch_size, clipping_method=clipping_method))


def _round_clip(state: Diff2State, fixed_clip: float) -> Any:
  """The clip of the round's statistic: the adapted one, else `fixed_clip`.

  With adaptive clipping the state holds the clip of this round (C_2, or
  C_1 when T = 1), a function of earlier releases only; `fixed_clip` is the
  statistic's constructed clip otherwise.
  """
  return fixed_clip if state.adaptive is None else state.adaptive.clip


def _round_arguments(state: Diff2State, params: PyTree, *,
                     restart_interval: int, grad_clip: float,
                     diff_clip: float) -> tuple[tuple[Any, ...], jax.Array]:
  """The round's statistic arguments after the batch, and its post-noise scale.

  With T = 1 (DP-GD) the statistic is the clipped gradient at `(params,)`
  and the scale 1; otherwise the difference statistic at `(params, second
  point, a, b)` of `_round_coefficients`, at the state's adapted C_2 when
  it holds one (`_round_clip`). Shared by the one-call update and the
  physical batches (`diff2_physical_form`), so both evaluate the same
  statistic.
  """
  if restart_interval == 1:
    return (params,), jnp.float32(1.0)
  is_restart = state.count % restart_interval == 0
  movement, inverse = _movement(params, state.prev_params)
  coefficients = _round_coefficients(
      is_restart, grad_clip, _round_clip(state, diff_clip), movement,
      inverse)
  return ((params, _select(is_restart, params, state.prev_params),
           coefficients.a, coefficients.b), coefficients.scale)


@keywords.checked
def diff2_physical_form(loss_fn: LossFn, *, grad_clip: float,
                        diff_clip_factor: float, restart_interval: int,
                        physical_batch_size: int,
                        microbatch_size: Optional[int] = None,
                        clipping_method: str = 'auto',
                        state_of: Callable[[Any], Any] = lambda s: s,
                        ) -> physical.PhysicalForm:
  """The physical form of `diff2_estimator` built with these arguments.

  A client's round is a full-batch statistic, a sum over its examples: each
  physical batch adds its clipped gradients (T = 1) or clipped differences
  at the round's points and coefficients, read from the estimator's state
  (`_round_arguments`); the estimator then takes the sum as `update(...,
  clipped_sum=...)`, with its count as the client's size n_p. One client
  only: on a client axis each client's data is its own logical batch. With
  adaptive clipping the coefficients use the state's C_2 and
  `physical.LogicalStep` clips each physical batch at it
  (`adaptive_clipping.current_clip`), as the one-call step does.

  Example:
    >>> form = diff2_physical_form(loss_fn, grad_clip=1.0,
    ...                            diff_clip_factor=1.5, restart_interval=20,
    ...                            physical_batch_size=256,
    ...                            state_of=lambda opt_state: opt_state[0])

  Args:
    loss_fn, grad_clip, diff_clip_factor, restart_interval, microbatch_size,
      clipping_method: as given to `diff2_estimator`.
    physical_batch_size: P.
    state_of: the `Diff2State` within the whole chain's state.

  Returns:
    A `physical.PhysicalForm`.
  """
  restart_interval = checks.positive_int(restart_interval, 'restart_interval')
  grad_statistic, diff_statistic = _statistics(
      loss_fn, grad_clip, diff_clip_factor, microbatch_size, clipping_method)

  def arguments(opt_state, params):
    return _round_arguments(
        state_of(opt_state), params, restart_interval=restart_interval,
        grad_clip=grad_statistic.l2_clip, diff_clip=diff_statistic.l2_clip)[0]

  return physical.PhysicalForm(
      statistic=grad_statistic if restart_interval == 1 else diff_statistic,
      arguments=arguments, physical_batch_size=physical_batch_size)


def _local_size(batch: PyTree, batch_mask: Optional[jax.Array]) -> jax.Array:
  """This client's number of real rows (public under replace-one)."""
  if batch_mask is None:
    return jnp.int32(clipping.batch_size_of(batch))
  return jnp.sum(jnp.asarray(batch_mask).astype(bool), dtype=jnp.int32)


def _zeros_like_f32(params: PyTree) -> PyTree:
  return jax.tree_util.tree_map(
      lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(
          jnp.result_type(p), jnp.float32)), params)


class _LocalRound(NamedTuple):
  """What every local step of one round of Algorithm 4 reads.

  Attributes:
    batch: the client's local data.
    mask: `[rows]` bool, its real rows.
    size: rows, real and padding.
    round_key: the round's sampling key (one fold per local step).
    local_batch_size: b, rows per local step.
    statistic: the clipped gradient-difference sum of a minibatch.
    mechanism: the local steps' noise mechanism.
    stddev: the local noise std.
    learning_rate: the step size.
    k_hat: Algorithm 1's output step with `output='random_iterate'`, else
      None.
  """

  batch: PyTree
  mask: jax.Array
  size: int
  round_key: jax.Array
  local_batch_size: int
  statistic: Any
  mechanism: Any
  stddev: Any
  learning_rate: float
  k_hat: Any


def _local_step(local: _LocalRound, carry: tuple, k: jax.Array
                ) -> tuple[tuple, None]:
  """Local step k of Algorithm 4: `v_k = private difference + v_{k-1}`.

  `carry` is `(x_{k-1}, x_{k-2}, v_{k-1}, displacement, noise state,
  output)`; a `lax.scan` body.
  """
  x_cur, x_prev, v_prev, displacement, noise_state, x_out = carry
  # x_cur is x_{k-1}: the output when k = k_hat (kept in round t_hat).
  if local.k_hat is not None:
    x_out = jax.tree_util.tree_map(
        lambda a, b: jnp.where(k == local.k_hat, a, b), x_cur, x_out)
  movement, inverse = _movement(x_cur, x_prev)
  # b uniform real rows without replacement: the b smallest of i.i.d.
  # uniforms, padding rows pushed past every real row.
  scores = jax.random.uniform(jax.random.fold_in(local.round_key, k),
                              (local.size,))
  _, rows = jax.lax.top_k(-jnp.where(local.mask, scores, 2.0),
                          local.local_batch_size)
  minibatch = jax.tree_util.tree_map(lambda x: x[rows], local.batch)
  clipped = local.statistic(minibatch, x_cur, x_prev, inverse, inverse)
  # One client adds this noise: no aggregation, axis_name=None.
  private, noise_state = estimators.privatize_sum(
      clipped, noise_state, local.mechanism, local.stddev,
      normalize_by=float(local.local_batch_size))
  v_k = jax.tree_util.tree_map(lambda a, b: movement * a + b, private,
                               v_prev)
  step_update = jax.tree_util.tree_map(lambda g: -local.learning_rate * g,
                                       v_k)
  x_next = jax.tree_util.tree_map(jnp.add, x_cur, step_update)
  displacement = jax.tree_util.tree_map(jnp.add, displacement, step_update)
  return (x_next, x_cur, v_k, displacement, noise_state, x_out), None


def _kept_output(kept: Optional[RandomIterateState], params: PyTree,
                 x_out: PyTree) -> Optional[RandomIterateState]:
  """Algorithm 1's output after this round (None without the option)."""
  if kept is None:
    return None
  here = kept.count == kept.selected
  iterate = jax.tree_util.tree_map(
      lambda x, p, old: jnp.where(here, x.astype(p.dtype), old), x_out,
      params, kept.iterate)
  return RandomIterateState(kept.count + 1, kept.selected, iterate)


def _from_active_client(tree: PyTree, count: jax.Array,
                        axis_name: str) -> PyTree:
  """The value of round `count`'s active client (`(count + 1) mod C`), on
  every client."""
  active = (count + 1) % parallel.axis_size(axis_name)
  is_active = jax.lax.axis_index(axis_name) == active
  return parallel.psum(jax.tree_util.tree_map(
      lambda u: jnp.where(is_active, u, jnp.zeros_like(u)), tree), axis_name)


class _AdaptiveRounds(NamedTuple):
  """Adaptive clipping of `diff2_estimator`, checked (`_adaptive_rounds`).

  Attributes:
    config: the `adaptive_clipping.AdaptiveClipping`, validated.
    count_stddev: sigma_b, the count noise's std (in examples).
    sum_multiplier: z_sum, the clipped sum's multiplier on the adapted
      rounds (`adaptive_clipping.sum_noise_multiplier`).
  """

  config: adaptive_lib.AdaptiveClipping
  count_stddev: float
  sum_multiplier: float


def _adaptive_rounds(config: Optional[adaptive_lib.AdaptiveClipping],
                     multipliers: Diff2NoiseMultipliers,
                     restart_interval: int,
                     mechanism: noise_lib.NoiseMechanism,
                     relation: neighboring.NeighboringRelation
                     ) -> Optional[_AdaptiveRounds]:
  """How DIFF2 adapts its clip (Andrew et al. 2021, Algorithm 1), or None.

  The clip adapted is the one every round's statistic is computed at
  (`_round_coefficients`): C_2 (paper 003's Algorithm 1 difference clip,
  `C_2 ||x_t - x_{t-1}||`), or C_1 when T = 1 (DP-GD: every round clips
  gradients at C_1, as DP-SGD).

  * Adapted rounds (difference rounds; every round when T = 1) also
    release the centered count of unclipped per-example values, noised
    with std sigma_b (its own key), and noise the sum at z_sum times the
    sensitivity at the round's clip: sum and count are ONE Gaussian
    mechanism of the accounted multiplier (z_2; z_1 when T = 1), so the
    accounting (`diff2_accounting`) is unchanged. The count is summed over
    clients before its one noise draw and divided by the examples over all
    clients (public under replace-one and zero-out), as the sum is.
  * Restart rounds (T > 1) release no count: their bits would measure
    `||g|| <= C_1`, not the differences. Their sum is noised at the plain
    z_1 (exactly the accounted Gaussian) and C_2 is unchanged; the restart
    coefficient `a = C_2 / C_1` uses the current C_2 (post-processing of
    earlier releases).

  Args:
    config: the user's `AdaptiveClipping`, or None.
    multipliers: the run's noise multipliers.
    restart_interval: T.
    mechanism: the server noise mechanism.
    relation: the neighbouring relation.

  Returns:
    An `_AdaptiveRounds`, or None without `config`.

  Raises:
    ValueError: see `adaptive_clipping.validate`, `check_mechanism` and
      `sum_noise_multiplier` (z_b must exceed the adapted rounds'
      multiplier); and without `count_stddev`.
  """
  if config is None:
    return None
  config = adaptive_lib.validate(config)
  adaptive_lib.check_mechanism(mechanism)
  if config.count_stddev is None:
    raise ValueError(
        'DIFF2 with adaptive clipping needs AdaptiveClipping(count_stddev='
        '...): a round runs on each client\'s whole data, whose size is '
        'known only at update, so the default 0.05 x the batch size cannot '
        'be computed here (plans.diff2_gd and plans.dp_gd use 0.05 x '
        'num_examples, all clients\' examples)')
  adapted = (multipliers.restart if restart_interval == 1 else
             multipliers.difference)
  return _AdaptiveRounds(config, config.count_stddev,
                         adaptive_lib.sum_noise_multiplier(
                             adapted, adaptive_lib.count_noise_multiplier(
                                 config.count_stddev, relation)))


def _next_adaptive_state(adaptive: _AdaptiveRounds,
                         state: adaptive_lib.AdaptiveClipState,
                         clipped: clipping.ClippedSum, *, adapts: jax.Array,
                         num_examples: jax.Array,
                         refusal: Optional[guards.Refusal],
                         axis_name: Optional[str]
                         ) -> adaptive_lib.AdaptiveClipState:
  """The adapted clip after a round (`_adaptive_rounds`).

  The noisy fraction is drawn every round (one fold of the count key per
  round, never reused) and used only where `adapts`: a select, not a
  branch (DESIGN.md "Hot path"). A refused round poisons the clip.

  Args:
    adaptive: the checked configuration.
    state: the clip and count key before the round.
    clipped: this client's clipped statistic of the round (its counters).
    adapts: bool scalar, whether this round moves the clip.
    num_examples: the examples over all clients (the count's divisor).
    refusal: the noise state's refusal record after the round.
    axis_name: the client axis, or None.

  Returns:
    The `AdaptiveClipState` of the next round.
  """
  fraction, state = adaptive_lib.unclipped_fraction(
      clipped, state, stddev=adaptive.count_stddev,
      batch_size=jnp.maximum(num_examples, 1).astype(jnp.float32),
      axis_name=axis_name)
  moved = jnp.where(adapts, adaptive_lib.next_clip(
      state.clip, fraction, adaptive.config), state.clip)
  return state._replace(clip=adaptive_lib.poisoned(moved, refusal))


@keywords.checked
def diff2_estimator(
    loss_fn: LossFn,
    *,
    grad_clip: float,
    diff_clip_factor: float,
    restart_interval: int,
    num_rounds: int,
    noise_multipliers: Diff2NoiseMultipliers,
    key: estimators.KeyLike = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.REPLACE_ONE),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> optax.GradientTransformationExtraArgs:
  """DIFF2's private running gradient estimator `v_t` (paper 003, Alg. 1).

  Round t (from 0) is a restart when `t % restart_interval == 0`: the
  estimator is RESET to the clients' mean clipped gradient (clip
  `grad_clip`) plus noise `z_1`. Otherwise it adds the clients' mean
  clipped gradient difference between the current and the previous params
  (clip `diff_clip_factor * ||params - prev_params||`) plus noise `z_2`
  scaled by the same movement to the previous estimate. Clients are the
  slots of `axis_name` (see the module docstring); the noise is ONE draw
  from the replicated key per round, after the cross-client sum.

  Example:
    >>> z = diff2_accounting.calibrate(2000, 20, epsilon=3.0, delta=1e-5)
    >>> tx = optax.chain(
    ...     diff2_estimator(loss_fn, grad_clip=1.0, diff_clip_factor=3.0,
    ...                     restart_interval=20, num_rounds=2000,
    ...                     noise_multipliers=z, key=0, axis_name='clients'),
    ...     optax.sgd(0.25))
    >>> step = jax.vmap(client_step, in_axes=(None, None, 0, 0),
    ...                 out_axes=None, axis_name='clients')

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    grad_clip: `C_1`, the per-example gradient clip of restart rounds.
    diff_clip_factor: `C_2`; per-example differences are clipped to
      `C_2 ||x_t - x_{t-1}||` (a guess of the per-example smoothness L).
    restart_interval: T; T = 1 gives DP-GD.
    num_rounds: R, the rounds the noise was calibrated for; round R + 1 is
      refused.
    noise_multipliers: `Diff2NoiseMultipliers(restart=z1, difference=z2)`.
    key: PRNG key or int seed for the server noise, the same on every client.
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    neighboring_relation: REPLACE_ONE (the paper's) or ZERO_OUT.
    microbatch_size: optional cap on per-example gradients held at once.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the client axis (pmap / shard_map / vmap), None for one
      client.
    adaptive_clipping: None (fixed clips), or an
      `adaptive_clipping.AdaptiveClipping` with its `count_stddev` given
      (each client's size is known only at update; plans fill in 0.05 x
      the examples over all clients): the clip of the statistic every
      round is computed at, C_2 (`diff_clip_factor` is its initial value;
      with T = 1, C_1, `grad_clip`), follows a private quantile of the
      per-example norms, in the state (`Diff2State.adaptive`); see
      `_adaptive_rounds` for which rounds count and the privacy.

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=local_data, batch_mask=None)`, or
    `update(None, state, params, clipped_sum=...)` with the round's
    statistic accumulated over physical batches (`diff2_physical_form`,
    `dpsco_jax.physical`). The output `v_t` has the params' structure and
    dtypes.

  Raises:
    ValueError: for a bad clip, interval, round count, multiplier, key,
      relation or adaptive clipping (at construction); a missing batch or
      params, a client with no real rows, or a round past `num_rounds` (at
      update; recorded in the state, the adapted clip then NaN).

  References:
    Murata & Suzuki (2023), Algorithms 1-2, Lemma C.1 (sensitivity).
    Andrew, Thakkar, McMahan, Ramaswamy (NeurIPS 2021), Algorithm 1 and
    Section 3.2 (adaptive clipping).
  """
  grad_statistic, diff_statistic = _statistics(
      loss_fn, grad_clip, diff_clip_factor, microbatch_size, clipping_method)
  restart_interval = checks.positive_int(restart_interval, 'restart_interval')
  mechanism = diff2_mechanism(num_rounds)
  relation = _validate_relation(neighboring_relation)
  multipliers = _validate_multipliers(noise_multipliers)
  diff_sensitivity = diff_statistic.sensitivity(relation)
  statistic = grad_statistic if restart_interval == 1 else diff_statistic
  adaptive = _adaptive_rounds(adaptive_clipping, multipliers,
                              restart_interval, mechanism, relation)
  key = keys.noise_key(key, 'diff2_estimator')
  count_key = None
  if adaptive is not None:
    # Two streams from one key: the sum's noise never shares a draw with
    # the count's (as `estimators.noisy_statistic`).
    key, count_key = jax.random.split(estimators.as_key(key))

  def init_fn(params):
    estimators.check_params(params)
    return Diff2State(count=jnp.zeros((), jnp.int32), prev_params=params,
                      estimate=_zeros_like_f32(params),
                      noise=mechanism.init(params, key),
                      adaptive=(None if adaptive is None else
                                adaptive_lib.init(statistic.l2_clip,
                                                  count_key)))

  def update_fn(updates, state, params=None, *, batch=None, batch_mask=None,
                clipped_sum=None, **extra_args):
    del extra_args
    estimators.check_first_in_chain(updates, 'diff2_estimator')
    checks.state_type(state, Diff2State, 'diff2_estimator')
    estimators.check_params(params)
    is_restart = state.count % restart_interval == 0
    clip = _round_clip(state, statistic.l2_clip)
    arguments, scale = _round_arguments(
        state, params, restart_interval=restart_interval,
        grad_clip=grad_statistic.l2_clip, diff_clip=diff_statistic.l2_clip)
    if clipped_sum is not None:
      # Accumulated over physical batches (`dpsco_jax.physical`) at this
      # round's arguments (`diff2_physical_form`); its count is this
      # client's n_p, checked against the logical batch_mask.
      clipped = clipped_sum
    elif batch is None:
      raise ValueError('the batch (this client\'s local data) is required: '
                       'update(None, state, params, batch=batch)')
    else:
      clipped = statistic(batch, *parallel.per_device(arguments, axis_name),
                          mask=batch_mask, axis_name=axis_name,
                          l2_clip=None if adaptive is None else clip)
    restart_z, difference_z = multipliers.restart, multipliers.difference
    if adaptive is None:
      sensitivity = (grad_statistic.sensitivity(relation)
                     if restart_interval == 1 else diff_sensitivity)
    else:
      # At the clip this round was computed at; the adapted rounds give
      # the sum z_sum, the rest of the accounted multiplier is the count's.
      sensitivity = statistic.sensitivity(relation, clip)
      if restart_interval == 1:
        restart_z = adaptive.sum_multiplier
      else:
        difference_z = adaptive.sum_multiplier
    if restart_interval == 1:
      # Every round is a restart, known on the host (DP-GD): one gradient
      # per example, clipped to C_1.
      stddev = restart_z * sensitivity
    else:
      # Both kinds of round privatize a sum clipped to C_2.
      stddev = jnp.where(is_restart, restart_z * sensitivity,
                         difference_z * sensitivity)
    local_size = clipped.count
    smallest = jax.lax.pmin(local_size, axis_name) if axis_name else local_size
    # Weights n_min / n_p <= 1 keep each example's weight in the sum <= 1,
    # so the sum's sensitivity stays the statistic's.
    weight = (smallest.astype(jnp.float32) /
              jnp.maximum(local_size, 1).astype(jnp.float32))
    clipped = clipped._replace(sum=jax.tree_util.tree_map(
        lambda s: s * weight.astype(s.dtype), clipped.sum))
    divisor = (jnp.maximum(smallest, 1).astype(jnp.float32) *
               parallel.axis_size(axis_name))
    private, noise_state = estimators.privatize_sum(
        clipped, state.noise, mechanism, stddev, normalize_by=divisor,
        axis_name=axis_name)
    estimate = jax.tree_util.tree_map(
        lambda v, previous: scale.astype(v.dtype) * v + jnp.where(
            is_restart, jnp.zeros_like(previous), previous).astype(v.dtype),
        private, state.estimate)
    estimate, refusal = guards.record(
        [(smallest < 1, _EMPTY_CLIENT_MESSAGE, 'batch')], estimate,
        noise_state.refusal, state.count)
    noise_state = noise_state._replace(refusal=refusal)
    adaptive_state = None
    if adaptive is not None:
      adaptive_state = _next_adaptive_state(
          adaptive, state.adaptive, clipped,
          adapts=(jnp.bool_(True) if restart_interval == 1 else
                  jnp.logical_not(is_restart)),
          num_examples=parallel.psum(local_size, axis_name),
          refusal=noise_state.refusal, axis_name=axis_name)
    new_state = Diff2State(count=state.count + 1, prev_params=params,
                           estimate=estimate, noise=noise_state,
                           adaptive=adaptive_state)
    return estimators.cast_like(estimate, params), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@keywords.checked
def diff2_gd(
    loss_fn: LossFn,
    *,
    learning_rate: float,
    grad_clip: float,
    diff_clip_factor: float,
    restart_interval: int,
    num_rounds: int,
    noise_multipliers: Diff2NoiseMultipliers,
    key: estimators.KeyLike = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.REPLACE_ONE),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    output: str = 'last',
    output_key: estimators.KeyLike = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> optax.GradientTransformationExtraArgs:
  """DIFF2-GD (paper 003, Alg. 1 with the GD routine, Alg. 3).

  `x_{t+1} = x_t - learning_rate * v_t` with `v_t` from `diff2_estimator`.
  Any other optimizer chained after `diff2_estimator` is equally private
  (post-processing); this is the one the paper analyses (Theorem 4.3).
  `output='random_iterate'` also keeps Algorithm 1's output `x_{t_hat}`,
  t_hat uniform on `[0, R)` (`random_output_iterate`; read it with
  `selected_iterate(state)`); `step_size_stability` says whether
  `learning_rate` meets Theorem 4.3's bound.

  Example:
    >>> tx = diff2_gd(loss_fn, learning_rate=0.25, grad_clip=1.0,
    ...               diff_clip_factor=3.0, restart_interval=20,
    ...               num_rounds=2000, noise_multipliers=z, key=0,
    ...               axis_name='clients')
    >>> updates, state = tx.update(None, state, params, batch=local_data,
    ...                            batch_mask=local_mask)

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    learning_rate: eta.
    grad_clip: see `diff2_estimator`.
    diff_clip_factor: see `diff2_estimator`.
    restart_interval: see `diff2_estimator`.
    num_rounds: see `diff2_estimator`.
    noise_multipliers: see `diff2_estimator`.
    key: see `diff2_estimator`.
    neighboring_relation: see `diff2_estimator`.
    microbatch_size: see `diff2_estimator`.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: see `diff2_estimator`.
    output: 'last' (the iterates only) or 'random_iterate' (also keep
      `x_{t_hat}`).
    output_key: key or seed of t_hat with 'random_iterate' (None: fresh).
    adaptive_clipping: see `diff2_estimator` (C_2 adapts).

  Returns:
    `optax.chain(diff2_estimator(...), optax.sgd(learning_rate))`, with
    `random_output_iterate(num_rounds, output_key)` first for
    'random_iterate'.

  Raises:
    ValueError: as `diff2_estimator`, or for an unknown `output`.

  References:
    Murata & Suzuki (2023), Algorithms 1 and 3, Proposition 4.1, Theorem 4.3.
  """
  return optax.chain(
      *output_selector(output, num_rounds, output_key),
      diff2_estimator(
          loss_fn, grad_clip=grad_clip, diff_clip_factor=diff_clip_factor,
          restart_interval=restart_interval, num_rounds=num_rounds,
          noise_multipliers=noise_multipliers, key=key,
          neighboring_relation=neighboring_relation,
          microbatch_size=microbatch_size,
          clipping_method=clipping_method, axis_name=axis_name,
          adaptive_clipping=adaptive_clipping),
      optax.sgd(learning_rate))


@keywords.checked
def dp_gd(
    loss_fn: LossFn,
    *,
    learning_rate: float,
    grad_clip: float,
    noise_multiplier: float,
    num_rounds: int,
    key: estimators.KeyLike = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.REPLACE_ONE),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> optax.GradientTransformationExtraArgs:
  """DP-GD across clients: DIFF2-GD with a restart every round (T = 1).

  `x_{t+1} = x_t - lr ((1/P) sum_p ClippedMean_p + N(0, (sigma C_1)^2 I))`,
  the paper's baseline (§6), accounted as R Gaussian mechanisms.

  Example:
    >>> z = diff2_accounting.calibrate(2000, 1, 3.0, 1e-5).restart
    >>> tx = dp_gd(loss_fn, learning_rate=0.5, grad_clip=1.0,
    ...            noise_multiplier=z, num_rounds=2000, key=0,
    ...            axis_name='clients')

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    learning_rate: eta.
    grad_clip: `C_1`.
    noise_multiplier: noise std over the replace-one sensitivity `2 C_1`.
    num_rounds: R; round R + 1 is refused.
    key: PRNG key or int seed of the server noise (same on every client).
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    neighboring_relation: see `diff2_estimator`.
    microbatch_size: see `diff2_estimator`.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the client axis, None for one client.
    adaptive_clipping: None, or an `adaptive_clipping.AdaptiveClipping`
      with `count_stddev`: `grad_clip` is the initial C_1, which follows a
      private quantile of the gradient norms every round, as in DP-SGD
      (`diff2_estimator`); the accounting of `noise_multiplier` is
      unchanged.

  Returns:
    `diff2_gd(..., restart_interval=1)`.

  Raises:
    ValueError: as `diff2_estimator`.

  References:
    Murata & Suzuki (2023), §4 (DP-GD is T = 1) and §6.
  """
  return diff2_gd(
      loss_fn, learning_rate=learning_rate, grad_clip=grad_clip,
      # Never used with T = 1: every round is a restart.
      diff_clip_factor=1.0, restart_interval=1, num_rounds=num_rounds,
      noise_multipliers=Diff2NoiseMultipliers(noise_multiplier, 0.0),
      key=key, neighboring_relation=neighboring_relation,
      microbatch_size=microbatch_size,
      clipping_method=clipping_method, axis_name=axis_name,
      adaptive_clipping=adaptive_clipping)


def bvr_keys(key: estimators.KeyLike) -> tuple[jax.Array, jax.Array,
                                                jax.Array]:
  """The three purpose keys `diff2_bvr_local_sgd` derives from its key.

  Example:
    >>> server_key, local_noise_key, sampling_key = bvr_keys(0)

  Args:
    key: the key (or int seed) given to `diff2_bvr_local_sgd`.

  Returns:
    `(server noise key, local noise key, minibatch sampling key)`: a split,
    so no two purposes share a key.
  """
  server, local, sampling = jax.random.split(estimators.as_key(key), 3)
  return server, local, sampling


def bvr_output_draws(output_key: estimators.KeyLike, num_rounds: int,
                     local_steps: int) -> tuple[jax.Array, jax.Array]:
  """`(t_hat, k_hat)` of DIFF2-BVR-L-SGD's output, both from `output_key`.

  `t_hat` is uniform on `[0, R)` (the round) and `k_hat` uniform on
  `{1, ..., K}` (the local iterate `x_{k_hat - 1}` of that round); neither
  depends on the data.

  Example:
    >>> t_hat, k_hat = bvr_output_draws(7, num_rounds=500, local_steps=5)

  Args:
    output_key: PRNG key or int seed.
    num_rounds: R.
    local_steps: K.

  Returns:
    Two int32 scalars.
  """
  round_key, step_key = jax.random.split(keys.as_key(output_key))
  return (jax.random.randint(round_key, (), 0,
                             checks.positive_int(num_rounds, 'num_rounds'),
                             jnp.int32),
          jax.random.randint(step_key, (), 1, checks.positive_int(
              local_steps, 'local_steps') + 1, jnp.int32))


@keywords.checked
def diff2_bvr_local_sgd(
    loss_fn: LossFn,
    *,
    learning_rate: float,
    grad_clip: float,
    diff_clip_factor: float,
    restart_interval: int,
    num_rounds: int,
    noise_multipliers: Diff2NoiseMultipliers,
    key: estimators.KeyLike = None,
    local_steps: int,
    local_batch_size: int,
    local_clip_factor: Optional[float] = None,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.REPLACE_ONE),
    microbatch_size: Optional[int] = None,
    clipping_method: str = 'auto',
    axis_name: Optional[str] = None,
    output: str = 'last',
    output_key: estimators.KeyLike = None,
    adaptive_clipping: Optional[adaptive_lib.AdaptiveClipping] = None,
) -> optax.GradientTransformationExtraArgs:
  """DIFF2-BVR-L-SGD (paper 003, Alg. 1 with the BVR-L-SGD routine, Alg. 4).

  Round t: the server estimator `v_t` (as `diff2_estimator`) gives
  `x_{1} = x_t - lr v_t`. Then client `p = (t + 1) mod P` (the paper's
  `p_r = 1 + (r mod P)` with r = t + 1) runs K - 1 local steps, k = 2..K:
  a minibatch of `local_batch_size` real rows drawn without replacement,
  their clipped differences `grad l(x_{k-1}) - grad l(x_{k-2})` (clip
  `C_3 ||x_{k-1} - x_{k-2}||`), `v_k = mean + v_{k-1} + N(0, (sigma_3
  C_{3,k})^2 I)` (noise on the minibatch SUM, then divided by b), and
  `x_k = x_{k-1} - lr v_k`. The local estimator is discarded after the
  round; the next round's server difference spans the whole local
  trajectory. The update returned is `x_K - x_t` (apply it as is: the
  learning rate is inside). Every client runs the local loop on its own data
  and only the active client's result is kept (a select, then a cross-client
  sum), so the computation has no data-dependent control flow.

  `output='random_iterate'` also keeps the output the paper's utility bound
  (Theorem 5.3) is about: `t_hat` uniform on `[0, R)` drawn at init, and in
  round `t_hat` the local iterate `x_{k_hat - 1}` with `k_hat` uniform on
  `{1, ..., K}` (`x_0 = x_t`; the paper's Algorithm 4 line 12, the iterate
  its analysis averages over, where line 13 prints `x_{k_hat}`; notes
  §2.6), of the active client. Both draws come from `output_key`
  (`bvr_output_draws`), not from the data. Read it with
  `selected_iterate(state)`.

  Example:
    >>> tx = diff2_bvr_local_sgd(
    ...     loss_fn, learning_rate=0.1, grad_clip=1.0, diff_clip_factor=3.0,
    ...     restart_interval=20, num_rounds=500, noise_multipliers=z, key=0,
    ...     local_steps=5, local_batch_size=64, axis_name='clients')

  Args:
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    learning_rate: eta (server and local steps).
    grad_clip: see `diff2_estimator`.
    diff_clip_factor: see `diff2_estimator`.
    restart_interval: see `diff2_estimator`.
    num_rounds: see `diff2_estimator`; the local noise is built for
      `num_rounds * (local_steps - 1)` draws.
    noise_multipliers: `Diff2NoiseMultipliers(z1, z2, local=z3)`; z3 is
      the local noise std over the replace-one sensitivity `2 C_3` of the
      minibatch sum.
    key: PRNG key or int seed; split by `bvr_keys` into the server noise,
      local noise and sampling keys.
      None (default): a fresh secret key from OS entropy
      (`dpsco_jax.keys`); an int seed makes the noise known to anyone
      who knows the seed. Never give one key to two runs.
    local_steps: K >= 1 (K = 1 is DIFF2-GD).
    local_batch_size: b, at most the smallest client's size.
    local_clip_factor: `C_3` (default `C_2`, as in Theorem 5.3).
    neighboring_relation: see `diff2_estimator`.
    microbatch_size: see `diff2_estimator`.
    clipping_method: 'auto' (default: ghost norms when the loss qualifies,
      else per-example gradients, announced once), 'ghost' or 'vmap'
      (`dpsco_jax.clipping`).
    axis_name: the client axis, None for one client.
    output: 'last' (the iterates only) or 'random_iterate' (also keep
      Algorithm 1's output, above).
    output_key: key or seed of t_hat and k_hat with 'random_iterate'
      (None: fresh).
    adaptive_clipping: see `diff2_estimator`: the SERVER rounds' C_2
      adapts (their accounting unchanged); the local steps keep the fixed
      `C_3` (`local_clip_factor`, default the initial C_2) and release no
      count.

  Returns:
    An `optax.GradientTransformationExtraArgs`; call
    `update(None, state, params, batch=local_data, batch_mask=None)`.

  Raises:
    ValueError: as `diff2_estimator`, and for a bad K, b, `C_3` or
      `output`; at update, a client with fewer than b real rows.

  References:
    Murata & Suzuki (2023), Algorithm 4, Proposition E.2, Theorem 5.3.
  """
  server_key, local_key, sampling_key = bvr_keys(
      keys.noise_key(key, 'diff2_bvr_local_sgd'))
  server = diff2_estimator(
      loss_fn, grad_clip=grad_clip, diff_clip_factor=diff_clip_factor,
      restart_interval=restart_interval, num_rounds=num_rounds,
      noise_multipliers=noise_multipliers, key=server_key,
      neighboring_relation=neighboring_relation,
      microbatch_size=microbatch_size,
      clipping_method=clipping_method, axis_name=axis_name,
      adaptive_clipping=adaptive_clipping)
  num_local = checks.positive_int(local_steps, 'local_steps') - 1
  local_batch_size = checks.positive_int(local_batch_size, 'local_batch_size')
  local_clip = clipping.validate_clip(
      diff_clip_factor if local_clip_factor is None else local_clip_factor,
      'local_clip_factor')
  local_statistic = clipping.clipped_grad_difference_sum(
      loss_fn, local_clip, microbatch_size=microbatch_size,
                           clipping_method=clipping_method)
  relation = _validate_relation(neighboring_relation)
  local_stddev = (_validate_multipliers(noise_multipliers).local *
                  local_statistic.sensitivity(relation))
  local_mechanism = (noise_lib.gaussian(num_rounds * num_local)
                     if num_local else None)
  learning_rate = float(learning_rate)
  keep_output = _validate_output(output) == 'random_iterate'
  if keep_output:
    t_hat, k_hat = bvr_output_draws(
        keys.fresh_key() if output_key is None else output_key, num_rounds,
        num_local + 1)

  def init_fn(params):
    local_noise = (local_mechanism.init(params, local_key) if num_local else
                   noise_lib.NoiseState(key=local_key,
                                        step=jnp.zeros((), jnp.int32)))
    kept = None
    if keep_output:
      kept = RandomIterateState(count=jnp.zeros([], jnp.int32),
                                selected=t_hat, iterate=params)
    return Diff2BvrState(server=server.init(params), local_noise=local_noise,
                         sampling_key=sampling_key, output=kept)

  def update_fn(updates, state, params=None, *, batch=None, batch_mask=None,
                **extra_args):
    del extra_args
    estimators.check_first_in_chain(updates, 'diff2_bvr_local_sgd')
    checks.state_type(state, Diff2BvrState, 'diff2_bvr_local_sgd')
    kept = state.output if keep_output else None
    count = state.server.count
    v, server_state = server.update(None, state.server, params, batch=batch,
                                    batch_mask=batch_mask)
    v = jax.tree_util.tree_map(lambda x: x.astype(jnp.promote_types(
        x.dtype, jnp.float32)), v)
    # x_1 = x_t - lr v_t, written as optax.sgd writes it, so that K = 1 is
    # exactly DIFF2-GD.
    first = jax.tree_util.tree_map(lambda g: -learning_rate * g, v)
    if not num_local:   # K = 1: k_hat = 1, the output is x_t itself
      return estimators.cast_like(first, params), state._replace(
          server=server_state, output=_kept_output(kept, params, params))
    local_size = _local_size(batch, batch_mask)
    smallest = jax.lax.pmin(local_size, axis_name) if axis_name else local_size
    size = clipping.batch_size_of(batch)
    mask = (jnp.ones((size,), bool) if batch_mask is None else
            jnp.asarray(batch_mask).astype(bool))
    round_key = jax.random.fold_in(state.sampling_key, count)
    x_start = parallel.per_device(params, axis_name)
    x_start = jax.tree_util.tree_map(lambda p, v_: p.astype(v_.dtype), x_start,
                                     v)
    x_first = jax.tree_util.tree_map(jnp.add, x_start, first)
    first = parallel.per_device(first, axis_name)
    v = parallel.per_device(v, axis_name)

    step = functools.partial(_local_step, _LocalRound(
        batch=batch, mask=mask, size=size, round_key=round_key,
        local_batch_size=local_batch_size, statistic=local_statistic,
        mechanism=local_mechanism, stddev=local_stddev,
        learning_rate=learning_rate, k_hat=k_hat if keep_output else None))

    carry = (x_first, x_start, v, first, state.local_noise, x_start)
    (_, _, _, displacement, local_noise, x_out), _ = jax.lax.scan(
        step, carry, jnp.arange(2, num_local + 2))
    total = displacement
    if axis_name is not None:
      total = _from_active_client(displacement, count, axis_name)
      if keep_output:
        x_out = _from_active_client(x_out, count, axis_name)
    total, refusal = guards.record(
        [(smallest < local_batch_size, _SMALL_CLIENT_MESSAGE, 'batch')],
        total, server_state.noise.refusal, count)
    adaptive = server_state.adaptive
    if adaptive is not None:
      # A refused round releases no clip either.
      adaptive = adaptive._replace(
          clip=adaptive_lib.poisoned(adaptive.clip, refusal))
    server_state = server_state._replace(
        noise=server_state.noise._replace(refusal=refusal), adaptive=adaptive)
    return estimators.cast_like(total, params), Diff2BvrState(
        server=server_state, local_noise=local_noise,
        sampling_key=state.sampling_key,
        output=_kept_output(kept, params, x_out))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
