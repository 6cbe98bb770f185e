"""Whole runs of a plan as one compiled function, with the guards on.

A plan (`dpsco_jax.plans`) describes a run: its transformation, its sampler,
its accounting. `whole_run(plan, params, data)` runs all of it as ONE
compiled program: the steps in a `jax.lax.scan` over the sampler's own
batches, the data an argument of the program (never a constant baked into
it). With `num_runs=`, the runs are `jax.vmap`-ed, each with its own noise
keys and its own sampler seed (`batching.reseeded`): what an experiment
averaging over seeds and the auditor (`dpsco_jax.audit.audit_plan`) need.

The plan's transformation runs as built: every in-step guard (the batch
checks, the fixed-order check, the capacity of the noise) stays on. A
refused step poisons the release and is recorded in the optimizer state
(`dpsco_jax.guards`); `whole_run` raises it at the end through
`plan.check_refusals`, with the plan keyword that fixes it.

The pieces, for loops of your own:

* `scan_steps`: the traceable scan of a transformation over a run's
  batches (jit it, vmap it over runs, differentiate through it);
* `run_batches`: the batches of runs with given sampler seeds, laid out for
  `vmap` (Poisson batches padded to one size, padding masked out);
* `run_keys`, `sampler_seeds`, `fresh_run_keys`: run i's noise keys and
  sampler seed, from one key;
* `refusal_metrics`, `raise_refusal_metrics`: the guards' record carried out
  of runs vmapped inside a sweep, and raised on the host;
* `non_private`: the non-private reference step, shaped like the private
  ones.

Example:
  >>> plan = dpsco_jax.plans.dpsgd(loss_fn, optimizer=optax.sgd(0.1),
  ...                              num_examples=1000, batch_size=100,
  ...                              epochs=3, l2_clip=1.0, epsilon=2.0,
  ...                              delta=1e-5, seed=0)
  >>> result = runs.whole_run(plan, params, {'x': x, 'y': y})
  >>> result.params                       # after plan.num_steps steps
"""

from typing import Any, Callable, NamedTuple, Optional, Sequence, Union
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats

from dpsco_jax import batching
from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import keys as keys_lib
from dpsco_jax import noise as noise_lib
from dpsco_jax.algorithms import nonsmooth
from dpsco_jax.algorithms import srg

PyTree = Any
InputsFn = Callable[[Optional[jax.Array], Optional[jax.Array]], dict]
MetricFn = Callable[[PyTree, PyTree], PyTree]

# The share of runs allowed to need a wider padding than the common one.
_WIDE_RUN_SHARE = 0.01


class RunResult(NamedTuple):
  """What `whole_run` returns.

  Attributes:
    params: the params after the last step (leading axis: the runs, with
      `num_runs`).
    opt_state: the optimizer state after the last step. It may hold values
      that are not private (clean prefix sums, previous gradients): never
      log or release it.
    metrics: `metric_fn(params, opt_state)` after each step, leading axis
      `num_steps` (after the runs' axis, with `num_runs`); None without
      `metric_fn`.
  """

  params: PyTree
  opt_state: PyTree
  metrics: Optional[PyTree]


# ----------------------------------------------------------- keys and seeds


def run_keys(key: Any, count: int) -> jax.Array:
  """The noise keys of runs `0, ..., count - 1`: `fold_in(key, i)`.

  Run i's key depends on `key` and i only, not on how many runs there are:
  more runs repeat the runs of fewer (same key) and add new ones, and any
  single run can be replayed on its own.

  Example:
    >>> keys = run_keys(0, 4)      # [4] keys, keys[i] = fold_in(key(0), i)

  Args:
    key: a JAX key (typed or raw) or an int seed.
    count: the number of runs.

  Returns:
    `[count]` keys, all distinct.

  Raises:
    ValueError: if `key` is None (runs never draw keys silently).
  """
  if key is None:
    raise ValueError('runs need a key (or int seed): an audit or a sweep '
                     'never draws keys silently')
  if isinstance(key, (int, np.integer)):
    key = jax.random.key(int(key))
  count = checks.positive_int(count, 'count')
  return _fold_in_each(key, np.arange(count, dtype=np.uint32))


# One compiled program per run count (eagerly, every op of the vmapped
# fold-in compiled a program of its own for each new count).
_fold_in_each = jax.jit(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))


def sampler_seeds(key: Any, count: int) -> list[int]:
  """One sampler seed per run, from a key (or int seed) and the run's index.

  Drawn through NumPy's `SeedSequence`, apart from the noise keys of
  `run_keys(key, count)` (another generator, another purpose).

  Example:
    >>> seeds = sampler_seeds(0, 4)   # four 63-bit ints

  Args:
    key: a JAX key or an int seed.
    count: the number of runs.

  Returns:
    `count` non-negative ints; run i's depends on `key` and i only.

  Raises:
    ValueError: if `key` is None.
  """
  if key is None:
    raise ValueError('runs need a key (or int seed): an audit or a sweep '
                     'never draws keys silently')
  if isinstance(key, (int, np.integer)):
    words = [int(key) & 0xFFFFFFFF, (int(key) >> 32) & 0xFFFFFFFF]
  else:
    words = [int(w) for w in keys_lib.key_data(key)[1].ravel()]
  return [int(np.random.SeedSequence(words + [0x5A4D, run]).generate_state(
      2, np.uint64)[0] >> np.uint64(1)) for run in range(count)]


def fresh_run_keys(state: PyTree, key: jax.Array) -> PyTree:
  """`state` with every noise key replaced by one folded from `key`.

  Every `noise.NoiseState`'s key (typed or raw) and every other typed key
  leaf (e.g. an output-iterate draw) gets `fold_in(key, j)` for its own j,
  so a run draws all its randomness from its run key, as the plan would
  with that key given as `key=`. Traceable (vmap it over run keys).

  Example:
    >>> state = fresh_run_keys(plan.init(params), jax.random.key(3))

  Args:
    state: an optimizer state.
    key: the run's typed key.

  Returns:
    The state, its keys replaced.
  """
  count = [0]

  def fresh(old):
    count[0] += 1
    new = jax.random.fold_in(key, count[0])
    return new if keys_lib.is_typed_key(old) else jax.random.key_data(new)

  def visit(node):
    if isinstance(node, noise_lib.NoiseState):
      return node._replace(key=fresh(node.key))
    if keys_lib.is_typed_key(node):
      return fresh(node)
    return node

  return jax.tree_util.tree_map(
      visit, state, is_leaf=lambda node: isinstance(
          node, noise_lib.NoiseState) or keys_lib.is_typed_key(node))


# ------------------------------------------------------------- the batches


def _padded_size(size: int, multiple: int) -> int:
  return max(1, -(-int(size) // multiple)) * multiple


def poisson_widths(sampler: Any) -> Optional[tuple[int, int]]:
  """`(common, widest)` padded batch sizes for a Poisson sampler, else None.

  `common` is the smallest multiple of the sampler's `pad_to_multiple` that
  holds every batch of a run with probability at least 0.99 (a union bound
  over the steps; usually the sampler's own padded size); `widest` the
  multiple that holds the largest batch the plan's size check accepts
  (`batching.poisson_size_bound`). Both are multiples of `pad_to_multiple`,
  as the check requires.

  Example:
    >>> common, widest = poisson_widths(plan.batches)

  Args:
    sampler: a plan's sampler.

  Returns:
    The two sizes, or None for a sampler whose batches have one size.
  """
  if isinstance(sampler, batching.CyclicPoissonBatches):
    population = sampler.largest_partition
  elif isinstance(sampler, batching.PoissonBatches):
    population = sampler.num_examples
  else:
    return None
  q, pad = float(sampler.sampling_probability), sampler.pad_to_multiple
  fits = int(stats.binom.isf(_WIDE_RUN_SHARE / sampler.num_steps,
                             population, q))
  common = _padded_size(fits, pad)
  widest = _padded_size(batching.poisson_size_bound(population, q), pad)
  return common, max(common, widest)


def drawn_batches(sampler: Any, seed: Optional[int]) -> list[Any]:
  """One run's batches: those of `sampler` reseeded with `seed` (None: its
  own seed)."""
  if seed is not None:
    sampler = batching.reseeded(sampler, seed)
  return list(sampler.iterate())


def needed_width(batches: Sequence[Any], multiple: int) -> int:
  """The padded size that holds every real example of a run's batches."""
  return _padded_size(max(int(np.sum(mask)) for _, mask in batches),
                      multiple)


def padded_runs(runs: Sequence[Sequence[Any]], width: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """Poisson runs as `[runs, steps, width]` indices and masks.

  Every step's real examples, in the sampler's order, followed by padding
  (index 0, masked out): the same batches, padded to one common size.

  Example:
    >>> indices, masks = padded_runs([drawn_batches(plan.batches, 1)], 64)

  Args:
    runs: each run's `(indices, mask)` batches.
    width: the padded size (at least every batch's real examples).

  Returns:
    `(indices int32, masks bool)`, each `[runs, steps, width]`.
  """
  shape = (len(runs), len(runs[0]), width)
  indices, masks = np.zeros(shape, np.int32), np.zeros(shape, bool)
  for run, batches in enumerate(runs):
    for step, (ids, keep) in enumerate(batches):
      real = ids[keep]
      indices[run, step, :len(real)] = real
      masks[run, step, :len(real)] = True
  return indices, masks


def run_batches(sampler: Any, seeds: Sequence[Optional[int]],
                width: Optional[int] = None) -> Any:
  """The batches of runs with these sampler seeds, laid out for `vmap`.

  Example:
    >>> indices, masks = run_batches(plan.batches, sampler_seeds(0, 8))

  Args:
    sampler: a plan's sampler (`plan.batches`).
    seeds: one sampler seed per run (None: the sampler's own).
    width: the padded size of Poisson batches (default: the widest run's
      need, a multiple of `pad_to_multiple`).

  Returns:
    Poisson samplers (`(indices, mask)` batches): `(indices, masks)`, each
    `[runs, steps, width]` (`padded_runs`); batches of one size:
    `(indices [runs, steps, batch], None)`; batches whose size varies
    across steps (the anchored single pass): a tuple of per-step
    `(indices [runs, batch_t], None)`.
  """
  runs = [drawn_batches(sampler, seed) for seed in seeds]
  if isinstance(runs[0][0], tuple):
    if width is None:
      width = max(needed_width(batches, sampler.pad_to_multiple)
                  for batches in runs)
    return padded_runs(runs, width)
  if len({len(batch) for batch in runs[0]}) == 1:
    return np.asarray(runs, np.int32), None
  return tuple((np.stack([batches[step] for batches in runs]).astype(
      np.int32), None) for step in range(len(runs[0])))


def one_run(batches: Any) -> Any:
  """Run 0 of `run_batches`'s layout (drops the runs' axis)."""
  if batches is None:
    return None
  return jax.tree_util.tree_map(lambda a: a[0], batches)


# ----------------------------------------------------------------- the scan


def gathered_inputs(data: PyTree) -> InputsFn:
  """`update`'s inputs for a step's `(indices, mask)`: the default of
  `scan_steps`.

  Example:
    >>> inputs = gathered_inputs({'x': x, 'y': y})(indices, mask)

  Args:
    data: the training set (leading axis: the examples); the whole of it
      is the batch of a full-batch step (indices None).

  Returns:
    `inputs_fn(indices, mask)` -> `{'batch', 'example_ids'}` and, with a
    mask, `'batch_mask'`; `{'batch': data}` for a full-batch step.
  """

  def inputs_fn(indices, mask):
    if indices is None:
      return {'batch': data}
    inputs = {'batch': jax.tree_util.tree_map(lambda leaf: leaf[indices],
                                              data),
              'example_ids': indices}
    if mask is not None:
      inputs['batch_mask'] = mask
    return inputs

  return inputs_fn


def scan_steps(transformation: optax.GradientTransformationExtraArgs,
               params: PyTree, opt_state: PyTree, batches: Any, *,
               inputs_fn: InputsFn, num_steps: Optional[int] = None,
               metric_fn: Optional[MetricFn] = None
               ) -> tuple[tuple[PyTree, PyTree], Optional[PyTree]]:
  """Steps `transformation` over one run's batches; traceable.

  Each step is `transformation.update(None, opt_state, params,
  **inputs_fn(indices, mask))` followed by `optax.apply_updates`, exactly
  what `plans.Plan.step` compiles; the steps are one `jax.lax.scan` (a
  Python loop only over batches whose size changes across steps). Nothing
  is switched off: the transformation's guards run in every step.

  Example:
    >>> (params, state), accuracy = scan_steps(
    ...     tx, params, tx.init(params), (indices, None),
    ...     inputs_fn=gathered_inputs(data),
    ...     metric_fn=lambda p, s: accuracy(p, test))

  Args:
    transformation: the whole update (private estimator and optimizer).
    params: the initial params.
    opt_state: the initial optimizer state.
    batches: `(indices [T, B], mask [T, B] or None)` scanned over; a tuple
      of per-step `(indices [B_t], None)` (sizes that vary); or None (a
      full-batch run of `num_steps` steps, `inputs_fn(None, None)`).
    inputs_fn: `(indices, mask) -> update's keyword inputs`
      (`gathered_inputs(data)` for the plain case).
    num_steps: the steps of a full-batch run (batches None).
    metric_fn: `(params, opt_state) -> pytree` after each step.

  Returns:
    `((params, opt_state), metrics)`, metrics stacked over the steps (None
    without `metric_fn`).

  Raises:
    ValueError: for batches None without `num_steps`.
  """

  def one_step(carry, step_batch):
    params, state = carry
    updates, state = transformation.update(None, state, params,
                                           **inputs_fn(*step_batch))
    params = optax.apply_updates(params, updates)
    return (params, state), (None if metric_fn is None else
                             metric_fn(params, state))

  carry = (params, opt_state)
  if batches is None:
    if num_steps is None:
      raise ValueError('a full-batch run (batches None) needs num_steps')
    return jax.lax.scan(lambda c, _: one_step(c, (None, None)), carry,
                        None, length=num_steps)
  if isinstance(batches[0], tuple):
    # Batch sizes that vary across steps (the anchored single pass).
    metrics = []
    for step_batch in batches:
      carry, metric = one_step(carry, step_batch)
      metrics.append(metric)
    stacked = None if metric_fn is None else jax.tree_util.tree_map(
        lambda *m: jnp.stack(m), *metrics)
    return carry, stacked
  return jax.lax.scan(one_step, carry, batches)


def non_private(mean_loss: Callable[[PyTree, PyTree], jax.Array],
                optimizer: optax.GradientTransformation
                ) -> optax.GradientTransformationExtraArgs:
  """The non-private reference step, shaped like a private transformation.

  `update(None, state, params, batch=...)` takes the gradient of
  `mean_loss(params, batch)` and hands it to `optimizer`, so the
  non-private baseline of an experiment runs through `scan_steps` like the
  private runs it is compared with. It releases the raw gradient: never use
  it on data that needs privacy.

  Example:
    >>> tx = non_private(mean_loss, optax.sgd(0.1, momentum=0.9))
    >>> (params, state), _ = scan_steps(tx, params, tx.init(params),
    ...                                 (indices, None),
    ...                                 inputs_fn=gathered_inputs(data))

  Args:
    mean_loss: `mean_loss(params, batch) -> scalar`, the batch's mean loss.
    optimizer: the optax optimizer.

  Returns:
    An `optax.GradientTransformationExtraArgs` (call with `batch=`; other
    extra arguments are ignored).
  """

  def update_fn(updates, state, params=None, *, batch, **extra_args):
    del updates, extra_args
    grads = jax.grad(mean_loss)(params, batch)
    return optimizer.update(grads, state, params)

  return optax.GradientTransformationExtraArgs(optimizer.init, update_fn)


def refusal_metrics(opt_state: PyTree) -> dict[str, jax.Array]:
  """The run's first refusal as two metrics (traceable), for sweeps.

  A sweep that vmaps whole runs over hyperparameters returns metrics, not
  states: these two carry the guards' record (`guards.Refusal`) out of the
  compiled program, and `raise_refusal_metrics` raises it on the host.

  Example:
    >>> def train_fn(hparams, seed):
    ...   (params, state), _ = scan_steps(...)
    ...   return {'accuracy': accuracy(params), **refusal_metrics(state)}
    >>> result = sweeps.run_sweep(train_fn, grid, seeds)
    >>> raise_refusal_metrics(result.metrics)

  Args:
    opt_state: a run's final optimizer state.

  Returns:
    `{'refusal_check', 'refusal_step'}`: the first record set in the
    state's order (check 0 and step -1 when none is).
  """
  first = guards.no_refusal()
  for record in guards.refusals_in(opt_state):
    take = (first.check == 0) & (record.check != 0)
    first = guards.Refusal(jnp.where(take, record.check, first.check),
                           jnp.where(take, record.step, first.step))
  return {'refusal_check': first.check, 'refusal_step': first.step}


def raise_refusal_metrics(metrics: Any) -> None:
  """Raises the refusal `refusal_metrics` carried out of runs, if any.

  Example:
    >>> raise_refusal_metrics(result.metrics)

  Args:
    metrics: a mapping holding `refusal_check` and `refusal_step` arrays
      (any leading axes: grid points, seeds).

  Raises:
    PrivacyGuardError: a step of one of the runs was refused.
  """
  guards.raise_if_refused(guards.Refusal(
      np.asarray(metrics['refusal_check']),
      np.asarray(metrics['refusal_step'])))


def plan_output(plan: Any) -> Callable[[PyTree, PyTree], PyTree]:
  """What a plan's family releases as its model after the last step.

  Example:
    >>> model = plan_output(plan)(result.params, result.opt_state)

  Args:
    plan: a `plans.Plan`.

  Returns:
    `(params, opt_state) -> output`: `final_params` for
    Accelerated-DP-SRGD, the O2NC output for the nonsmooth plans, else the
    params.
  """
  if plan.algorithm == 'accelerated_dp_srgd':
    return lambda params, state: srg.final_params(state)
  if plan.algorithm.startswith('nonsmooth_'):
    return lambda params, state: nonsmooth.o2nc_output(state)
  return lambda params, state: params


# ------------------------------------------------------------ a whole run


# Compiled whole runs, per plan (by identity) and metric function: a second
# `whole_run` of the same plan reuses the program.
_PROGRAMS: dict[tuple[int, Any], Callable[..., Any]] = {}


def _program(plan: Any, metric_fn: Optional[MetricFn], many: bool
             ) -> Callable[..., Any]:
  """The jitted whole run of `plan` (vmapped over runs when `many`)."""
  cache_key = (id(plan), metric_fn, many)
  if cache_key not in _PROGRAMS:
    # The program holds the transformation, never the plan (so that the
    # plan, and with it this entry, can be freed).
    transformation, num_steps = plan.transformation, plan.num_steps

    def run(params, state, run_key, batches, data):
      if run_key is not None:
        state = fresh_run_keys(state, run_key)
      (params, state), metrics = scan_steps(
          transformation, params, state, batches,
          inputs_fn=gathered_inputs(data), num_steps=num_steps,
          metric_fn=metric_fn)
      return RunResult(params, state, metrics)

    if many:
      run = jax.vmap(run, in_axes=(None, None, 0, 0, None))
    _PROGRAMS[cache_key] = jax.jit(run)
    weakref.finalize(plan, _PROGRAMS.pop, cache_key, None)
  return _PROGRAMS[cache_key]


def _seeds(seed: Any, key: Any, num_runs: Optional[int]
           ) -> list[Optional[int]]:
  """The sampler seed of each run (None: the plan's own)."""
  if num_runs is None:
    if seed is not None and not isinstance(seed, (int, np.integer)):
      raise TypeError(f'seed= of one run is an int, got {seed!r}')
    return [None if seed is None else int(seed)]
  if seed is None:
    return sampler_seeds(key, num_runs)
  if isinstance(seed, (int, np.integer)):
    return sampler_seeds(int(seed), num_runs)
  seeds = [int(s) for s in seed]
  if len(seeds) != num_runs:
    raise ValueError(f'seed= gives {len(seeds)} sampler seeds for '
                     f'num_runs = {num_runs}')
  return seeds


def whole_run(plan: Any, params: PyTree, data: PyTree, *,
              seed: Union[None, int, Sequence[int]] = None,
              key: Any = None, num_runs: Optional[int] = None,
              metric_fn: Optional[MetricFn] = None) -> RunResult:
  """A whole run of `plan` as ONE compiled program, its guards on.

  The steps are those of `for inputs in plan.batches_of(data):
  params, opt_state = plan.step(params, opt_state, inputs)`, in one
  `jax.lax.scan` over the sampler's batches (drawn on the host first), the
  plan's transformation unchanged. Poisson batches are padded to one size
  (the widest a run needs, a multiple of the sampler's `pad_to_multiple`;
  padding masked out); full-batch plans (DIFF2, DP-GD, multi-pass O2NC) use
  all of `data` every step. A refused step (a guard of the transformation)
  is raised at the end, with `plan.check_refusals`.

  Randomness:

  * one run (`num_runs` None): the sampler is the plan's own, or reseeded
    with `seed` (`batching.reseeded`); the noise keys are the plan's own,
    or, with `key`, replaced by keys folded from it (`fresh_run_keys`).
  * `num_runs` runs, vmapped: run i's noise keys come from
    `run_keys(key, num_runs)[i]` (key required) and its sampler seed is
    `seed[i]` for a sequence of seeds, else `sampler_seeds(seed or key,
    num_runs)[i]`. The accounting is the plan's for each run.

  Example:
    >>> result = whole_run(plan, params, {'x': x, 'y': y})
    >>> results = whole_run(plan, params, {'x': x, 'y': y}, key=0,
    ...                     num_runs=8,
    ...                     metric_fn=lambda p, s: accuracy(p, test))
    >>> results.metrics.shape                  # (8, plan.num_steps)

  Args:
    plan: a `plans.Plan` built without `axis_name` and without
      `physical_batch_size` (one device, one program).
    params: the initial params (shared by every run).
    data: the training set: a pytree whose leaves' leading axis is
      `plan.num_examples`.
    seed: the sampler seed (one run), or the runs' seeds (a sequence, or an
      int they are derived from).
    key: the noise key (typed, raw or int) of the run, or of the runs.
    num_runs: how many runs (None: one, without a runs' axis).
    metric_fn: `(params, opt_state) -> pytree` recorded after each step.

  Returns:
    A `RunResult` (with `num_runs`, every leaf has a leading runs' axis).

  Raises:
    PrivacyGuardError: a step of a run was refused (`plan.check_refusals`).
    ValueError: for data that do not hold `plan.num_examples` rows, a plan
      with a physical form, or `num_runs` without `key`.
  """
  if getattr(plan, 'physical_form', None) is not None:
    raise ValueError('whole_run runs one program on one device: build the '
                     'plan without physical_batch_size= (or run it with '
                     'plan.step)')
  if num_runs is not None:
    num_runs = checks.positive_int(num_runs, 'num_runs')
    if key is None:
      raise ValueError('num_runs= runs need key= (run i\'s noise key is '
                       'fold_in(key, i))')
  seeds = _seeds(seed, key, num_runs)
  data = jax.tree_util.tree_map(jnp.asarray, data)
  _check_rows(data, plan.num_examples)
  batches = None if plan.batches is None else run_batches(plan.batches, seeds)
  state = plan.init(params)
  if num_runs is None:
    run_key = None if key is None else _typed(keys_lib.as_key(key))
    result = _program(plan, metric_fn, False)(
        params, state, run_key, one_run(batches), data)
  else:
    result = _program(plan, metric_fn, True)(
        params, state, run_keys(key, num_runs), batches, data)
  plan.check_refusals(result.opt_state)
  return result


def _typed(key: jax.Array) -> jax.Array:
  return key if keys_lib.is_typed_key(key) else jax.random.wrap_key_data(key)


def _check_rows(data: PyTree, num_examples: int) -> None:
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None
           for leaf in jax.tree_util.tree_leaves(data)}
  if sizes != {num_examples}:
    raise ValueError(f'the data\'s leading axes are {sorted(map(str, sizes))};'
                     f' the plan is for num_examples = {num_examples}')
