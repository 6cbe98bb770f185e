"""Audit runners: canary runs of a transformation or of any training loop.

Each runner simulates many runs as ONE vmapped, jit-compiled program and
reports through `reports.audit_observations`; run i's noise key is
`runs.run_keys(key, count)[i]`. Re-exported by `dpsco_jax.audit`.
"""

from typing import Any, Callable, Optional

import jax
from jax import flatten_util
import jax.numpy as jnp
import numpy as np
import optax

from dpsco_jax import checks
from dpsco_jax import neighboring
from dpsco_jax import runs
from dpsco_jax.audit import reports
from dpsco_jax.audit import statistics


PyTree = Any
MakeTransformation = Callable[[Callable[[PyTree, PyTree], jax.Array],
                               jax.Array], optax.GradientTransformation]


# ---------------------------------------------------------------------------
# Many runs as one program.
# ---------------------------------------------------------------------------

TrainFn = Callable[[jax.Array, jax.Array], jax.Array]


def simulate_runs(train_fn: TrainFn, keys: jax.Array, includes: jax.Array, *,
                  max_parallel: Optional[int] = None) -> np.ndarray:
  """Runs `train_fn(key, include)` for every pair as ONE compiled program.

  Example:
    >>> obs = simulate_runs(train_fn, run_keys(0, 8),
    ...                     jnp.arange(8) < 4)

  Args:
    train_fn: a whole run (e.g. a `lax.scan` over the steps) as a pure
      function of its noise key and a bool scalar: whether the canary is
      in. Returns its observations (a scalar or a vector).
    keys: one key per run, `[runs]`.
    includes: one bool per run, `[runs]`.
    max_parallel: runs vmapped at once (`lax.map` in chunks of this size, to
      cap memory); None runs them all at once.

  Returns:
    The observations, `[runs, m]` float64 (m = 1 for scalar scores).
  """
  def run_all(keys, includes):
    if max_parallel is None:
      return jax.vmap(train_fn)(keys, includes)
    return jax.lax.map(lambda args: train_fn(*args), (keys, includes),
                       batch_size=int(max_parallel))

  observations = np.asarray(jax.jit(run_all)(keys, includes), np.float64)
  return observations.reshape(observations.shape[0], -1)


run_keys = runs.run_keys


def run_canary_audit(
    train_fn: TrainFn,
    *,
    num_runs: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    name: str = 'canary audit',
) -> reports.AuditReport:
  """Audits any training run written as `train_fn(key, include)`.

  Runs `num_runs` runs with the canary and `num_runs` without, each with
  its own noise key, as one vmapped, jit-compiled program, then reports
  (`audit_observations`). This is how to audit your own training loop: put
  the loop (a `lax.scan` over the steps) in `train_fn`, insert the canary
  when `include` is True and the neighbouring example (or nothing) when it
  is False, build the private transformation from `key`, and return what
  an attacker sees (a score, or per-step observations that a linear score
  is fitted to on held-out runs).

  Example:
    >>> def train_fn(key, include):
    ...   tx = dpsco_jax.dpsgd(loss_fn, l2_clip=1.0, noise_multiplier=z,
    ...                        num_steps=T, key=key)
    ...   ...                               # scan over T steps
    ...   return -loss_fn(final_params, canary)
    >>> report = run_canary_audit(train_fn, num_runs=1000,
    ...                           claimed_epsilon=2.0, delta=1e-5, key=0)

  Args:
    train_fn: `(key, include) -> observations` (scalar or `[m]`), pure and
      traceable; the key is traced, so the library's key-reuse check does
      not apply to it (run i's key is `fold_in(key, i)`, all distinct; see
      `run_keys`).
    num_runs: runs per arm.
    claimed_epsilon: the epsilon the run claims, from the accountant.
    delta: the delta of the claim.
    key: key or int seed; run i's noise key is `fold_in(key, i)`, even
      runs with the canary, odd runs without.
    alpha: error probability of the bound (confidence `1 - alpha`).
    calibration_fraction: the share of each arm held out to fit the score
      and choose the thresholds.
    num_thresholds: thresholds kept (Bonferroni over them).
    max_parallel: runs vmapped at once (None: all).
    name: what was audited, for the report.

  Returns:
    The `AuditReport`.
  """
  num_runs = checks.positive_int(num_runs, 'num_runs')
  keys = run_keys(key, 2 * num_runs)
  # Even runs have the canary, odd runs do not: run i's key and arm depend
  # on i only, so a larger audit extends a smaller one.
  includes = jnp.arange(2 * num_runs) % 2 == 0
  observations = simulate_runs(train_fn, keys, includes,
                               max_parallel=max_parallel)
  return reports.audit_observations(
      observations[0::2], observations[1::2],
      claimed_epsilon=claimed_epsilon, delta=delta, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds, name=name)


# ---------------------------------------------------------------------------
# White-box gradient canaries.
# ---------------------------------------------------------------------------


def linear_loss(params: jax.Array, example: PyTree) -> jax.Array:
  """The white-box canary loss `<params, x>`: its gradient is `x` everywhere.

  Example:
    >>> linear_loss(jnp.ones(3), {'x': jnp.array([1.0, 2.0, 3.0])})   # 6.0

  Args:
    params: a flat parameter vector `[d]`.
    example: `{'x': [d]}`.

  Returns:
    The scalar loss.
  """
  return jnp.vdot(params, example['x'])


def _steps_per_epoch(steps_per_epoch: Optional[int], num_steps: int) -> int:
  if steps_per_epoch is None:
    return num_steps
  return checks.positive_int(steps_per_epoch, 'steps_per_epoch')


def _release_vector(release: PyTree) -> jax.Array:
  return flatten_util.ravel_pytree(release)[0]


def _example_ids(steps_per_epoch: int, batch_size: int) -> jax.Array:
  """`[steps_per_epoch, batch_size]` ids of the fixed-order batches."""
  return jnp.arange(steps_per_epoch * batch_size, dtype=jnp.int32).reshape(
      steps_per_epoch, batch_size)


def _run_fixed_order(tx, params, *, num_steps: int, steps_per_epoch: int,
                     update_args: Callable[[jax.Array], dict],
                     release_fn=None, record: bool = True):
  """Runs `tx` from `params` over batches in a fixed order (`lax.scan`).

  Step t calls `tx.update(None, state, params, **update_args(t mod
  steps_per_epoch))`. Returns `(final params, final state, releases)`,
  releases the `[num_steps, ...]` flattened release of each step (the
  updates, or `release_fn(updates, state)`), or None without `record`.
  """

  def step(carry, t):
    params, state = carry
    updates, state = tx.update(None, state, params,
                               **update_args(t % steps_per_epoch))
    release = None
    if record:
      release = _release_vector(
          updates if release_fn is None else release_fn(updates, state))
    return (optax.apply_updates(params, updates), state), release

  (params, state), releases = jax.lax.scan(
      step, (params, tx.init(params)), jnp.arange(num_steps))
  return params, state, releases


def gradient_canary_train_fn(
    make_transformation: MakeTransformation,
    *,
    num_steps: int,
    batch_size: int,
    steps_per_epoch: Optional[int] = None,
    dimension: int = 4,
    canary_norm: float = 1e3,
    canary_batch: int = 0,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    data_gradient_norm: float = 0.0,
    release_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    data_key: Any = 0,
) -> TrainFn:
  """The white-box gradient-canary run as `train_fn(key, include)`.

  The model is a vector of `dimension` parameters (zeros at the start) and
  the loss is `linear_loss`, so every example's gradient is its `x`,
  wherever the params are. The data are `steps_per_epoch` batches of
  `batch_size` examples taken in a fixed order (step t uses batch
  `t mod steps_per_epoch`, with `example_ids`), whose gradients are zero
  (or, with `data_gradient_norm`, random and orthogonal to the canary). The
  canary is the first example of batch `canary_batch`: gradient
  `canary_norm e_0`, which the transformation clips to its clip norm.

  The neighbouring data set (include = False) puts, in the canary's slot:

  * ADD_OR_REMOVE / ZERO_OUT: a zero-gradient example. With the batch size
    (the public normalizer) the same in both arms, a zero-gradient example
    adds exactly nothing to the clipped sum, so the run is, bit for bit,
    the run on the data set without the canary: that IS the add/remove
    neighbour (and the zero-out one).
  * REPLACE_ONE: the negated canary, `-canary_norm e_0`: the clipped sum
    moves by twice the clip norm, the whole replace-one sensitivity.

  Each step observes the projection of what the step releases (the updates,
  or `release_fn(updates, state)`) on the canary direction e_0; the
  observations are the `[num_steps]` projections. Noise of the library is
  isotropic and data gradients are orthogonal to e_0, so nothing else in
  the release carries information about the canary.

  Args:
    make_transformation: `(loss_fn, key) -> transformation`: builds the
      private transformation audited, with the given loss and noise key.
      It is called inside the vmapped program with a traced key.
    num_steps: steps per run.
    batch_size: examples per batch (the same in both arms).
    steps_per_epoch: batches per epoch (default `num_steps`: one pass).
    dimension: number of parameters (>= 2 when `data_gradient_norm` > 0).
    canary_norm: the canary gradient's norm; larger than the clip norm so
      the canary is clipped to exactly the clip norm. 0 gives a null audit
      (no canary in either arm).
    canary_batch: the batch holding the canary.
    neighboring_relation: which neighbour the out arm runs on.
    data_gradient_norm: norm of the data examples' gradients (orthogonal to
      the canary); 0 for zero gradients.
    release_fn: `(updates, state) -> pytree` of what the step releases
      (default: the updates).
    data_key: key or seed of the data gradients (the same for every run).

  Returns:
    `train_fn(key, include) -> [num_steps]` projections.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  steps_per_epoch = _steps_per_epoch(steps_per_epoch, num_steps)
  dimension = checks.positive_int(dimension, 'dimension')
  if not 0 <= canary_batch < steps_per_epoch:
    raise ValueError(f'canary_batch must be in [0, {steps_per_epoch}), got '
                     f'{canary_batch!r}')
  relation = neighboring.NeighboringRelation(neighboring_relation)
  canary = jnp.zeros(dimension, jnp.float32).at[0].set(canary_norm)
  neighbour = -canary if relation is (
      neighboring.NeighboringRelation.REPLACE_ONE) else jnp.zeros_like(canary)
  data = jnp.zeros((steps_per_epoch, batch_size, dimension), jnp.float32)
  if data_gradient_norm:
    if dimension < 2:
      raise ValueError('data gradients orthogonal to the canary need '
                       'dimension >= 2')
    data_key = jax.random.key(data_key) if isinstance(
        data_key, (int, np.integer)) else data_key
    directions = jax.random.normal(data_key, data.shape).at[..., 0].set(0.0)
    directions /= jnp.linalg.norm(directions, axis=-1, keepdims=True)
    data = data_gradient_norm * directions
  example_ids = _example_ids(steps_per_epoch, batch_size)

  def train_fn(key, include):
    slot = jnp.where(include, canary, neighbour)
    run_data = data.at[canary_batch, 0].set(slot)
    _, _, releases = _run_fixed_order(
        make_transformation(linear_loss, key),
        jnp.zeros(dimension, jnp.float32), num_steps=num_steps,
        steps_per_epoch=steps_per_epoch, release_fn=release_fn,
        update_args=lambda position: dict(
            batch={'x': run_data[position]},
            example_ids=example_ids[position]))
    return releases[:, 0]

  return train_fn


def run_gradient_canary_audit(
    make_transformation: MakeTransformation,
    *,
    num_steps: int,
    batch_size: int,
    num_runs: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    steps_per_epoch: Optional[int] = None,
    dimension: int = 4,
    canary_norm: float = 1e3,
    canary_batch: int = 0,
    neighboring_relation: neighboring.NeighboringRelation = (
        neighboring.NeighboringRelation.ADD_OR_REMOVE),
    data_gradient_norm: float = 0.0,
    release_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    name: str = 'white-box gradient canary',
) -> reports.AuditReport:
  """White-box gradient-canary audit of any private transformation.

  `2 num_runs` runs (half with the canary, half on the neighbouring data
  set, see `gradient_canary_train_fn`) as one vmapped, jit-compiled
  program; each run observes its per-step releases projected on the canary
  direction. The score is the linear combination of those projections that
  separates the arms best on held-out runs (`fit_linear_score`): for i.i.d.
  noise (DP-SGD) it weighs the steps where the canary took part; for
  correlated noise (trees, matrix factorization, recursive gradients,
  DIFF2) it also undoes the noise correlation across steps, which is the
  likelihood-ratio test of the Gaussian mechanism. The bound is valid
  whatever the score; a better score only makes it tighter.

  Example:
    >>> T, b, z = 8, 4, 2.82
    >>> report = run_gradient_canary_audit(
    ...     lambda loss_fn, key: dpsco_jax.dpsgd(
    ...         loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=T,
    ...         key=key),
    ...     num_steps=T, steps_per_epoch=b, batch_size=8, num_runs=2000,
    ...     claimed_epsilon=2.0, delta=1e-5, key=0)
    >>> report.epsilon_lower_bound <= report.claimed_epsilon

  Args:
    make_transformation: `(loss_fn, key) -> transformation` (see
      `gradient_canary_train_fn`).
    num_steps, batch_size, steps_per_epoch, dimension, canary_norm,
      canary_batch, neighboring_relation, data_gradient_norm, release_fn:
      see `gradient_canary_train_fn`.
    num_runs: runs per arm.
    claimed_epsilon: the epsilon the transformation claims for this
      participation (from `dpsco_jax.accounting`).
    delta: the delta of the claim.
    key: key or int seed the runs' noise keys are folded from (`run_keys`).
    alpha, calibration_fraction, num_thresholds, max_parallel, name: see
      `run_canary_audit`.

  Returns:
    The `AuditReport`.
  """
  train_fn = gradient_canary_train_fn(
      make_transformation, num_steps=num_steps, batch_size=batch_size,
      steps_per_epoch=steps_per_epoch, dimension=dimension,
      canary_norm=canary_norm, canary_batch=canary_batch,
      neighboring_relation=neighboring_relation,
      data_gradient_norm=data_gradient_norm, release_fn=release_fn)
  return run_canary_audit(
      train_fn, num_runs=num_runs, claimed_epsilon=claimed_epsilon,
      delta=delta, key=key, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds, max_parallel=max_parallel, name=name)


# ---------------------------------------------------------------------------
# Black-box input canaries.
# ---------------------------------------------------------------------------


def _batched(data: PyTree, steps_per_epoch: int, batch_size: int) -> PyTree:
  def reshape(leaf):
    leaf = jnp.asarray(leaf)
    if leaf.ndim < 1 or leaf.shape[0] != steps_per_epoch * batch_size:
      raise ValueError(
          f'the data must hold steps_per_epoch * batch_size = '
          f'{steps_per_epoch * batch_size} examples (leading axis), got a '
          f'leaf of shape {leaf.shape}')
    return leaf.reshape((steps_per_epoch, batch_size) + leaf.shape[1:])
  return jax.tree_util.tree_map(reshape, data)


def input_canary_train_fn(
    make_transformation: MakeTransformation,
    *,
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    data: PyTree,
    canary: PyTree,
    score_fn: Callable[[PyTree, PyTree], jax.Array],
    num_steps: int,
    batch_size: int,
    steps_per_epoch: Optional[int] = None,
    canary_batch: int = 0,
    replacement: Optional[PyTree] = None,
    output_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
) -> TrainFn:
  """The black-box input-canary run as `train_fn(key, include)`.

  Trains from `params` on `data` (`steps_per_epoch * batch_size` examples
  taken in a fixed order of batches, step t using batch
  `t mod steps_per_epoch`, with `example_ids`) and scores the final params.
  The canary takes the first slot of batch `canary_batch`; that slot's
  own data example is never used by either arm. The neighbouring data set:

  * `replacement=None` (add/remove): the canary's slot is masked out
    (`batch_mask`), so the run sees the data set WITHOUT the canary. Build
    the transformation with `normalize_by=batch_size`: the library refuses
    a mask without a public normalizer, and the normalizer is then the same
    in both arms.
  * `replacement` given (replace-one): that example takes the slot.

  Args:
    make_transformation: `(loss_fn, key) -> transformation`.
    loss_fn: `loss_fn(params, example) -> scalar` for ONE example.
    params: the initial params (the same in every run).
    data: a pytree of examples with leading axis
      `steps_per_epoch * batch_size`.
    canary: one example (the data's structure without the leading axis),
      e.g. mislabeled or out of distribution.
    score_fn: `(final_params, canary) -> scalar`, higher meaning "more
      likely trained on the canary", e.g. `-loss_fn(params, canary)`.
    num_steps: steps per run.
    batch_size: examples per batch.
    steps_per_epoch: batches per epoch (default `num_steps`: one pass).
    canary_batch: the batch holding the canary.
    replacement: the example replacing the canary in the out arm
      (replace-one), or None (add/remove, masked out).
    output_fn: `(params, state) -> final params` to score (default: the
      params after the last step; e.g. `lambda p, s: final_params(s)` for
      Accelerated-DP-SRGD's y_T).

  Returns:
    `train_fn(key, include) -> score`.
  """
  num_steps = checks.positive_int(num_steps, 'num_steps')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  steps_per_epoch = _steps_per_epoch(steps_per_epoch, num_steps)
  if not 0 <= canary_batch < steps_per_epoch:
    raise ValueError(f'canary_batch must be in [0, {steps_per_epoch}), got '
                     f'{canary_batch!r}')
  batches = _batched(data, steps_per_epoch, batch_size)
  example_ids = _example_ids(steps_per_epoch, batch_size)
  masked = replacement is None
  neighbour = canary if masked else replacement

  def train_fn(key, include):
    slot = jax.tree_util.tree_map(
        lambda c, n: jnp.where(include, jnp.asarray(c), jnp.asarray(n)),
        canary, neighbour)
    run_batches = jax.tree_util.tree_map(
        lambda leaf, s: leaf.at[canary_batch, 0].set(s.astype(leaf.dtype)),
        batches, slot)
    masks = jnp.ones((steps_per_epoch, batch_size), bool).at[
        canary_batch, 0].set(include)
    def update_args(position):
      batch = jax.tree_util.tree_map(lambda leaf: leaf[position], run_batches)
      extra = {'batch_mask': masks[position]} if masked else {}
      return dict(batch=batch, example_ids=example_ids[position], **extra)

    final, state, _ = _run_fixed_order(
        make_transformation(loss_fn, key), params, num_steps=num_steps,
        steps_per_epoch=steps_per_epoch, update_args=update_args,
        record=False)
    if output_fn is not None:
      final = output_fn(final, state)
    return jnp.asarray(score_fn(final, canary), jnp.float32)

  return train_fn


def run_input_canary_audit(
    make_transformation: MakeTransformation,
    *,
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    params: PyTree,
    data: PyTree,
    canary: PyTree,
    score_fn: Callable[[PyTree, PyTree], jax.Array],
    num_steps: int,
    batch_size: int,
    num_runs: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    steps_per_epoch: Optional[int] = None,
    canary_batch: int = 0,
    replacement: Optional[PyTree] = None,
    output_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    name: str = 'black-box input canary',
) -> reports.AuditReport:
  """Black-box input-canary audit: your loss, data, canary and score.

  Only the final params are scored (what a model's user sees), so the bound
  is usually far below the white-box one (`run_gradient_canary_audit`):
  noise from steps the canary missed, and data gradients along the
  canary's, hide it. A bound above the claim is still proof of a bug.

  Example:
    >>> report = run_input_canary_audit(
    ...     lambda loss_fn, key: dpsco_jax.dpsgd(
    ...         loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=4,
    ...         normalize_by=8, key=key),
    ...     loss_fn=loss_fn, params=params, data=data, canary=canary,
    ...     score_fn=lambda p, c: -loss_fn(p, c), num_steps=4, batch_size=8,
    ...     steps_per_epoch=1, num_runs=2000, claimed_epsilon=2.0,
    ...     delta=1e-5, key=0)

  Args:
    make_transformation, loss_fn, params, data, canary, score_fn,
      num_steps, batch_size, steps_per_epoch, canary_batch, replacement,
      output_fn: see `input_canary_train_fn`.
    num_runs: runs per arm.
    claimed_epsilon: the epsilon claimed for this run.
    delta: the delta of the claim.
    key: key or int seed the runs' noise keys are folded from (`run_keys`).
    alpha, calibration_fraction, num_thresholds, max_parallel, name: see
      `run_canary_audit`.

  Returns:
    The `AuditReport`.
  """
  train_fn = input_canary_train_fn(
      make_transformation, loss_fn=loss_fn, params=params, data=data,
      canary=canary, score_fn=score_fn, num_steps=num_steps,
      batch_size=batch_size, steps_per_epoch=steps_per_epoch,
      canary_batch=canary_batch, replacement=replacement,
      output_fn=output_fn)
  return run_canary_audit(
      train_fn, num_runs=num_runs, claimed_epsilon=claimed_epsilon,
      delta=delta, key=key, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds, max_parallel=max_parallel, name=name)


# ---------------------------------------------------------------------------
# One run, many canaries.
# ---------------------------------------------------------------------------


def run_one_run_gradient_audit(
    make_transformation: MakeTransformation,
    *,
    num_canaries: int,
    num_steps: int,
    batch_size: int,
    claimed_epsilon: float,
    delta: float,
    key: Any,
    steps_per_epoch: Optional[int] = None,
    canary_norm: float = 1e3,
    score_sign: float = 1.0,
    release_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    num_positive_guesses: Optional[int] = None,
    num_negative_guesses: Optional[int] = None,
    alpha: float = 0.05,
    name: str = 'one-run gradient canaries',
) -> reports.AuditReport:
  """One-run audit (Steinke, Nasr, Jagielski 2023) with gradient canaries.

  ONE run of `make_transformation` on a model of `num_canaries` parameters:
  canary i has gradient `canary_norm e_i` and sits in batch
  `i mod steps_per_epoch`; each is included independently with
  probability 1/2 (drawn from a key independent of the noise key), an
  excluded canary's slot holding a zero-gradient example (the add/remove
  neighbour, as in `gradient_canary_train_fn`). Canary i's score is
  `score_sign` times the sum, over the steps where its batch was used, of
  the released update's coordinate i; then `one_run_epsilon_lower_bound`.

  The score weighs the canary's own steps only (right for i.i.d. noise;
  valid but looser for correlated noise). Use `score_sign=-1` when the
  release is a descent step (an optimizer such as `optax.sgd` chained after
  the estimator). Needs `steps_per_epoch * batch_size >= num_canaries`.

  Example:
    >>> report = run_one_run_gradient_audit(
    ...     lambda loss_fn, key: dpsco_jax.dpsgd(
    ...         loss_fn, l2_clip=1.0, noise_multiplier=z, num_steps=4,
    ...         key=key),
    ...     num_canaries=1000, num_steps=4, batch_size=250,
    ...     claimed_epsilon=2.0, delta=1e-5, key=0)

  Args:
    make_transformation: `(loss_fn, key) -> transformation`.
    num_canaries: m.
    num_steps: steps of the run.
    batch_size: examples per batch (canaries and zero-gradient fillers).
    claimed_epsilon: the epsilon claimed for this run.
    delta: the delta of the claim.
    key: key or int seed (`run_keys(key, 2)`: the inclusion key, then the
      noise key).
    steps_per_epoch: batches per epoch (default `num_steps`).
    canary_norm: the canaries' gradient norm (above the clip norm).
    score_sign: +1 when the release moves along the gradient (a raw
      estimator output), -1 after a descent step.
    release_fn: `(updates, state) -> pytree` released (default: updates).
    num_positive_guesses, num_negative_guesses: k+ and k- (default m // 10
      each), fixed in advance.
    alpha: error probability (confidence `1 - alpha`).
    name: what was audited.

  Returns:
    An `AuditReport` with `method='one-run'` and its `one_run` bound.
  """
  m = checks.positive_int(num_canaries, 'num_canaries')
  num_steps = checks.positive_int(num_steps, 'num_steps')
  batch_size = checks.positive_int(batch_size, 'batch_size')
  steps_per_epoch = _steps_per_epoch(steps_per_epoch, num_steps)
  if steps_per_epoch * batch_size < m:
    raise ValueError(f'{m} canaries need steps_per_epoch * batch_size >= '
                     f'{m}, got {steps_per_epoch * batch_size}')
  inclusion_key, noise_key = run_keys(key, 2)
  included = jax.random.bernoulli(inclusion_key, 0.5, (m,))
  canaries = jnp.arange(m)
  batch_of = canaries % steps_per_epoch
  data = jnp.zeros((steps_per_epoch, batch_size, m), jnp.float32).at[
      batch_of, canaries // steps_per_epoch, canaries].set(
          canary_norm * included.astype(jnp.float32))
  example_ids = _example_ids(steps_per_epoch, batch_size)

  def run(key, data):
    _, _, releases = _run_fixed_order(
        make_transformation(linear_loss, key), jnp.zeros(m, jnp.float32),
        num_steps=num_steps, steps_per_epoch=steps_per_epoch,
        release_fn=release_fn,
        update_args=lambda position: dict(
            batch={'x': data[position]}, example_ids=example_ids[position]))
    return releases

  # The noise key is an argument of the compiled program (traced), like
  # every run's key in the many-run audits.
  releases = np.asarray(jax.jit(run)(noise_key, data), np.float64)
  own_steps = (np.arange(num_steps)[:, None] % steps_per_epoch ==
               np.asarray(batch_of)[None, :])
  scores = float(score_sign) * (releases * own_steps).sum(axis=0)
  bound = statistics.one_run_epsilon_lower_bound(
      scores, np.asarray(included), delta=delta, alpha=alpha,
      num_positive_guesses=num_positive_guesses,
      num_negative_guesses=num_negative_guesses)
  return reports.AuditReport(
      name=name, method='one-run', claimed_epsilon=float(claimed_epsilon),
      epsilon_lower_bound=bound.epsilon, delta=float(delta),
      alpha=float(alpha), num_runs=m, one_run=bound)
