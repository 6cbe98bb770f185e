"""Auditing a plan: `audit_plan`, the plan's own runs with a canary row.

The runs are the plan's whole runs (`dpsco_jax.runs.scan_steps`, its
transformation and guards unchanged), vmapped over chunks of runs of
bounded memory. Re-exported by `dpsco_jax.audit`.
"""

import functools
import time
from typing import Any, Callable, Optional, Sequence
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from dpsco_jax import batching
from dpsco_jax import checks
from dpsco_jax import guards
from dpsco_jax import neighboring
from dpsco_jax import progress as progress_lib
from dpsco_jax import runs
from dpsco_jax.audit import reports


PyTree = Any


# ---------------------------------------------------------------------------
# Auditing a plan.
# ---------------------------------------------------------------------------


# The chunk size `audit_plan` starts from: enough runs to vectorize the
# step over, few enough that progress is reported often and a chunk's
# batches stay small on the host.
_DEFAULT_RUNS_PER_CHUNK = 64
# `audit_plan`'s default bound on one chunk's memory.
DEFAULT_AUDIT_MEMORY_BYTES = 2**30


def _poisson_chunk(sampler: Any, seeds: Sequence[int], run_ids: np.ndarray,
                   width: int) -> tuple[np.ndarray, Any, list[Any]]:
  """A chunk of Poisson runs: those that fit `width`, and the others.

  Returns `(ids, (indices, masks) or None, wide)`: the runs whose batches
  all fit `width`, their batches padded to it (`runs.padded_runs`), and for
  every other run `(id, batches, needed width)`, its batches compacted to
  their real examples until they run at a wider size.
  """
  drawn = [runs.drawn_batches(sampler, seed) for seed in seeds]
  needed = [runs.needed_width(b, sampler.pad_to_multiple) for b in drawn]
  fits = [k for k, size in enumerate(needed) if size <= width]
  wide = [(run_ids[k], [(ids[keep].astype(np.int32),
                         np.ones(int(np.sum(keep)), bool))
                        for ids, keep in drawn[k]], needed[k])
          for k in range(len(run_ids)) if needed[k] > width]
  batches = runs.padded_runs([drawn[k] for k in fits], width) if fits else None
  return run_ids[fits], batches, wide


def _even_chunks(total: int, most: int) -> int:
  """The chunk size, at most `most`, that splits `total` runs most evenly
  into the fewest chunks (the last chunk is filled with discarded runs)."""
  chunks = -(-total // min(total, most))
  return -(-total // chunks)


def _chunk_size(memory_of: Callable[[int], Optional[int]], total: int, *,
                max_parallel: Optional[int], max_memory_bytes: int,
                data_bytes: int) -> tuple[int, Optional[int]]:
  """`(runs per chunk, its program's bytes)` for `audit_plan`.

  `max_parallel` if given; else from `_DEFAULT_RUNS_PER_CHUNK` down until
  `memory_of(runs)` (a compilation) is at most `max_memory_bytes`, the
  memory beyond the data taken as proportional to the runs. Warns when
  even one run takes more.
  """
  count = _even_chunks(total, max_parallel or _DEFAULT_RUNS_PER_CHUNK)
  memory = memory_of(count)
  if max_parallel is not None or memory is None:
    return count, memory
  while count > 1 and memory > max_memory_bytes:
    per_run = max(1.0, (memory - data_bytes) / count)
    count = _even_chunks(total, max(1, min(
        count - 1, int((max_memory_bytes - data_bytes) // per_run))))
    memory = memory_of(count)
  if memory > max_memory_bytes:
    warnings.warn(
        f'one run of the audit takes {memory / 2**20:.0f} MiB, more than '
        f'max_memory_bytes = {max_memory_bytes}: the runs go one at a time',
        stacklevel=4)
  return count, memory


def _program_bytes(compiled: Any) -> Optional[int]:
  """What XLA says a compiled program holds at once: its arguments,
  outputs and temporaries (None where the backend does not say)."""
  try:
    memory = compiled.memory_analysis()
  except (AttributeError, NotImplementedError, RuntimeError):
    return None
  if memory is None:
    return None
  return int(memory.argument_size_in_bytes + memory.output_size_in_bytes +
             memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def _tree_bytes(tree: PyTree) -> int:
  return sum(int(np.prod(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree_util.tree_leaves(tree))


def _plan_relation(plan: Any) -> neighboring.NeighboringRelation:
  if plan.ledger is not None:
    return neighboring.NeighboringRelation(plan.ledger.neighboring_relation)
  # The full-batch families (DIFF2, DP-GD, multi-pass O2NC) are replace-one.
  return neighboring.NeighboringRelation.REPLACE_ONE
def _canary_train_fn(plan: Any, *, params: PyTree, canary: PyTree,
                     replacement: PyTree, canary_index: int, masked: bool,
                     score_fn: Callable[[PyTree, PyTree], jax.Array],
                     output_fn: Callable[[PyTree, PyTree], PyTree]
                     ) -> Callable[..., Any]:
  """One run of the plan with or without the canary, scored.

  Returns `train_fn(data, run_key, include, batches) -> (score, refusals)`:
  the plan's whole run (`runs.scan_steps`, its transformation unchanged)
  from its own initial state with its noise keys replaced by the run's,
  on `data` whose canary row holds the canary (`include`) or its
  neighbour, and the guards' records of the run.
  """
  n = plan.num_examples
  tx = plan.transformation
  # The plan's own initial state (its checks run here, on the host); each
  # run swaps in its own noise keys.
  initial_state = tx.init(params)

  def batch_of(data, indices, include):
    # The rows at `indices` (None: all) of this run's data set: the canary's
    # row holds the canary or its neighbour (masked out of every batch when
    # `masked`, so then its value is never used). Gathered per step, so no
    # run holds a copy of the data.
    if indices is None:
      batch, at_row = data, jnp.arange(n) == canary_index
    else:
      batch = jax.tree_util.tree_map(lambda leaf: leaf[indices], data)
      at_row = indices == canary_index

    def patch(leaf, inserted, neighbour):
      row = jnp.where(include, jnp.asarray(inserted, leaf.dtype),
                      jnp.asarray(neighbour, leaf.dtype))
      return jnp.where(at_row.reshape(at_row.shape + (1,) * (
          leaf.ndim - at_row.ndim)), row, leaf)

    return jax.tree_util.tree_map(patch, batch, canary, replacement)

  def step_inputs(data, include, indices, mask):
    if indices is None:              # full batch: every row, every step
      return {'batch': batch_of(data, None, include)}
    inputs = {'batch': batch_of(data, indices, include),
              'example_ids': indices}
    keep = jnp.ones(indices.shape, bool) if mask is None else mask
    if masked:
      keep = keep & ~((indices == canary_index) & ~include)
    if mask is not None or masked:
      inputs['batch_mask'] = keep
    return inputs

  def train_fn(data, run_key, include, batches):
    (p, s), _ = runs.scan_steps(
        tx, params, runs.fresh_run_keys(initial_state, run_key), batches,
        inputs_fn=functools.partial(step_inputs, data, include),
        num_steps=plan.num_steps)
    # The guards' records come back with the score: a refused run raises.
    return (jnp.asarray(score_fn(output_fn(p, s), canary), jnp.float32),
            guards.refusals_in(s))

  return train_fn


class _Programs:
  """The compiled chunk programs: one per (padded width, runs per chunk).

  A chunk's program is `train_fn` vmapped over its runs' keys, arms and
  batches, with the data an argument shared by all.
  """

  def __init__(self, plan: Any, train_fn: Callable[..., Any], data: PyTree,
               run_key_array: jax.Array, includes: np.ndarray,
               seeds: Optional[list[int]]):
    self._plan, self._data, self._seeds = plan, data, seeds
    self._examples = (run_key_array[:1], includes[:1])
    self._run_chunk = jax.vmap(train_fn, in_axes=(None, 0, 0, 0))
    self._compiled = {}

  def _example_batches(self, width: Optional[int]) -> Any:
    sampler = self._plan.batches
    if sampler is None:
      return None
    if width is None:
      return runs.run_batches(sampler, self._seeds[:1])
    shape = (1, self._plan.num_steps, width)
    return np.zeros(shape, np.int32), np.zeros(shape, bool)

  def __call__(self, width: Optional[int], count: int) -> Any:
    # One compilation per (padded size, chunk size): the common size, and
    # the widest only if some run needs it.
    if (width, count) not in self._compiled:
      specs = jax.tree_util.tree_map(
          lambda a: jax.ShapeDtypeStruct((count,) + a.shape[1:], a.dtype),
          (*self._examples, self._example_batches(width)))
      self._compiled[(width, count)] = jax.jit(self._run_chunk).lower(
          self._data, *specs).compile()
    return self._compiled[(width, count)]


class _Chunks:
  """Chunks of runs in flight: launched, then collected in order.

  Collecting a chunk raises its runs' refusals (`plan.check_refusals`),
  stores their scores and reports the runs done and the time left (from
  the chunks after the first, which paid the compilation).
  """

  def __init__(self, plan: Any, programs: _Programs, data: PyTree,
               run_key_array: jax.Array, includes: np.ndarray, count: int,
               report: Callable[[str], None], chunk_note: str):
    self._plan, self._programs, self._data = plan, programs, data
    self._keys, self._includes, self._count = run_key_array, includes, count
    self._report, self._note = report, chunk_note
    self.scores = np.full(len(includes), np.nan)
    self._in_flight = []
    self._done, self._since, self._done_since = 0, None, 0

  def launch(self, run_ids: np.ndarray, batches: Any,
             width: Optional[int]) -> None:
    # A short chunk is filled with repeats of its first run, discarded.
    fill = self._count - len(run_ids)
    chosen = np.concatenate([run_ids, np.full(fill, run_ids[0])])
    batches = jax.tree_util.tree_map(
        lambda a: np.concatenate([a, np.repeat(a[:1], fill, axis=0)]),
        batches)
    self._in_flight.append((run_ids, self._programs(width, self._count)(
        self._data, self._keys[chosen], self._includes[chosen], batches)))

  def collect(self, keep: int = 0) -> None:
    """Collects chunks until at most `keep` are in flight."""
    while len(self._in_flight) > keep:
      run_ids, (out, refusals) = self._in_flight.pop(0)
      self._plan.check_refusals(refusals)
      self.scores[run_ids] = np.asarray(out, np.float64)[:len(run_ids)]
      self._done += len(run_ids)
      self._report_progress()

  def _report_progress(self) -> None:
    total, now = len(self.scores), time.perf_counter()
    if self._since is None:     # the first chunk paid the compilation
      self._since, self._done_since = now, self._done
      eta = ''
    else:
      rate = (self._done - self._done_since) / (now - self._since)
      eta = f', eta {(total - self._done) / rate:.0f} s'
    self._report(f'{self._done}/{total} runs ({self._note}){eta}')


def _chunk_batches(sampler: Any, seeds: list[int], run_ids: np.ndarray,
                   common: Optional[int]) -> tuple[np.ndarray, Any, list]:
  """`(run ids, batches, runs too wide)` of one chunk of runs."""
  if sampler is None:
    return run_ids, None, []
  if common is None:
    return run_ids, runs.run_batches(sampler, [seeds[i] for i in run_ids]), []
  return _poisson_chunk(sampler, [seeds[i] for i in run_ids], run_ids,
                        common)


def _plan_scores(plan: Any, *, params: PyTree, data: PyTree, canary: PyTree,
                 replacement: PyTree, canary_index: int, masked: bool,
                 score_fn: Callable[[PyTree, PyTree], jax.Array],
                 output_fn: Callable[[PyTree, PyTree], PyTree],
                 num_runs: int, key: Any, max_parallel: Optional[int],
                 max_memory_bytes: int, progress: Optional[bool]
                 ) -> np.ndarray:
  """`audit_plan`'s runs: the score of run i at index i, `[2 num_runs]`.

  `data` holds jnp arrays, `replacement` the neighbour's row (ignored where
  `masked`: the row is then masked out of the runs without the canary).
  """
  train_fn = _canary_train_fn(
      plan, params=params, canary=canary, replacement=replacement,
      canary_index=canary_index, masked=masked, score_fn=score_fn,
      output_fn=output_fn)
  total = 2 * num_runs
  run_key_array = runs.run_keys(key, total)
  includes = np.arange(total) % 2 == 0
  sampler = plan.batches
  seeds = None if sampler is None else runs.sampler_seeds(key, total)
  widths = None if sampler is None else runs.poisson_widths(sampler)
  common = None if widths is None else widths[0]
  programs = _Programs(plan, train_fn, data, run_key_array, includes, seeds)
  what = (f'dpsco_jax: auditing the {plan.algorithm} plan ({total} runs of '
          f'{plan.num_steps} steps)')
  with progress_lib.task(what, progress=progress) as report:
    report('compiling')
    count, memory = _chunk_size(
        lambda count: _program_bytes(programs(common, count)), total,
        max_parallel=max_parallel, max_memory_bytes=max_memory_bytes,
        data_bytes=_tree_bytes(data))
    chunks = _Chunks(plan, programs, data, run_key_array, includes, count,
                     report, f'{count} runs per chunk' + (
                         '' if memory is None else
                         f' of about {memory / 2**20:.0f} MiB'))

    def launch_wide(group):
      width = max([widths[1]] + [needed for _, _, needed in group])
      chunks.launch(np.array([run for run, _, _ in group]), runs.padded_runs(
          [batches for _, batches, _ in group], width), width)

    wide = []
    for start in range(0, total, count):
      run_ids, batches, too_wide = _chunk_batches(
          sampler, seeds, np.arange(start, min(start + count, total)), common)
      wide += too_wide
      if len(run_ids):
        chunks.launch(run_ids, batches, common)
      while len(wide) >= count:
        launch_wide(wide[:count])
        wide = wide[count:]
      chunks.collect(keep=1)
    if wide:
      launch_wide(wide)
    chunks.collect()
  return chunks.scores
def audit_plan(
    plan: Any,
    *,
    params: PyTree,
    data: PyTree,
    canary: PyTree,
    num_runs: int,
    key: Any,
    loss_fn: Optional[Callable[[PyTree, PyTree], jax.Array]] = None,
    score_fn: Optional[Callable[[PyTree, PyTree], jax.Array]] = None,
    canary_index: int = 0,
    replacement: Optional[PyTree] = None,
    output_fn: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
    alpha: float = 0.05,
    calibration_fraction: float = 0.25,
    num_thresholds: int = 5,
    max_parallel: Optional[int] = None,
    max_memory_bytes: int = DEFAULT_AUDIT_MEMORY_BYTES,
    progress: Optional[bool] = None,
    name: Optional[str] = None,
) -> reports.AuditReport:
  """Black-box canary audit of a `plans.Plan`: its lower bound beside its epsilon.

  What is simulated: `2 num_runs` whole runs of the plan, each the plan
  itself with fresh randomness:

  * its transformation (`plan.transformation`: the private estimator with
    the plan's calibrated noise multiplier and clip, the in-step batch
    check, your optimizer), initialized once from `params` and stepped
    `plan.num_steps` times;
  * its noise: the mechanism state the transformation makes, with every
    noise key replaced by one folded from the run's key (`run_keys`), so
    that runs draw independent noise exactly as the plan draws it;
  * its sampler: `plan.batches` (the same class, sizes and padding)
    reseeded per run from the audit's key, iterated on the host; under
    Poisson sampling every run draws its own Bernoulli batches, so the
    amplification the plan's epsilon counts on is what is attacked.
    Full-batch plans (DIFF2, DP-GD, multi-pass O2NC) use all of `data`
    every step.

  How it runs: ONE compiled program (the steps in a `lax.scan`, a chunk of
  runs `jax.vmap`-ed) is called chunk after chunk; the host draws the next
  chunk's batches while the current one runs. Poisson batches are the
  sampler's own, re-padded to one common size: the smallest multiple of
  its `pad_to_multiple` that holds all of a run's batches with probability
  0.99 (usually the sampler's own padded size), so every step has one
  shape. The rare run with a larger batch is run afterwards, in chunks of
  its own, at the padded size of the largest batch the plan's check
  accepts (one more compilation, only if such a run occurs). Padding is
  masked out; the batches are exactly the sampler's. The cost is about
  `2 num_runs x plan.num_steps` steps of the plan's batch (see
  docs/audit.md for measured times), plus the host's draws (under Poisson
  sampling `num_examples` uniforms per run and step).

  Memory: a chunk's program holds `data`, the chunk's batch indices and
  masks (`runs x num_steps x width` int32 and bool) and, for each run, the
  params, the optimizer state and one step's work (e.g. per-example
  gradients, `width x` the params). Without `max_parallel`, the chunk
  starts at 64 runs and is shrunk until the compiled program's memory, as
  XLA reports it (arguments, outputs and temporaries), is at most
  `max_memory_bytes`; two chunks' batches are alive at once on the host.
  The progress line says the chunk size and its memory.

  A faster, looser alternative where it applies: many canaries in ONE run
  (`run_one_run_gradient_audit`, Steinke, Nasr and Jagielski 2023): one
  training run instead of `2 num_runs`, but white-box gradient canaries
  against a transformation (not this plan's sampler) and a bound far below
  this one's for the same mechanism.

  How the canary is inserted: `data` (the plan's `num_examples` rows) gets
  the `canary` at row `canary_index`. The neighbouring data set, for the
  plan's neighbouring relation:

  * add/remove or zero-out: the canary's row is masked out (`batch_mask`
    False) wherever the sampler puts it. Under Poisson sampling this is
    exactly the data set without that row: every other row's draws are
    unchanged, and the canary takes part in a step only when the run's
    sampler draws its row (probability q per step), as any example would.
    The noisy sum is divided by the plan's public normalizer in both arms.
  * replace-one (DIFF2, DP-GD, the nonsmooth plans): the row holds
    `replacement` (default: `data`'s own row at `canary_index`).

  Under add/remove or zero-out, a given `replacement` takes the row instead
  of the mask: it must then be an example whose clipped contribution is
  zero (a zero-gradient example, the zero-out neighbour). A shuffled plan
  needs one, since its batch check refuses a batch with a masked example.

  Each run is scored on what the plan releases as its model (the params
  after the last step; `final_params` for Accelerated-DP-SRGD, the O2NC
  output for the nonsmooth plans; or `output_fn(params, state)`):
  `score_fn(output, canary)`, by default `-loss_fn(output, canary)` (a low
  canary loss says "in"). The claim is `plan.epsilon` at `plan.delta`
  (with any preprocessing releases, which are not simulated: the claim
  is then larger than what is attacked, and the bound still valid).
  A canary the data do not explain (a feature no real row uses, a
  mislabeled outlier) gives the tightest bound.

  Example:
    >>> plan = plans.dpsgd(loss_fn, optimizer=optax.sgd(0.5),
    ...                    num_examples=64, batch_size=48, epochs=2,
    ...                    l2_clip=1.0, epsilon=2.0, delta=1e-5,
    ...                    clipping_method='vmap')
    >>> report = audit_plan(plan, params=params, data=data, canary=canary,
    ...                     loss_fn=loss_fn, num_runs=1000, key=0)
    >>> report.epsilon_lower_bound, report.claimed_epsilon

  Args:
    plan: a `plans.Plan` (any family), built without `axis_name` (the
      runs are vmapped on one device).
    params: the initial params of every run.
    data: the plan's training set: a pytree whose leaves' leading axis is
      `plan.num_examples`.
    canary: one example (the data's structure without the leading axis).
    num_runs: runs per arm.
    key: key or int seed: run i's noise key is `fold_in(key, i)` (even runs
      with the canary, odd runs without) and its sampler seed is derived
      from the key and i; neither depends on the chunking.
    loss_fn: `loss_fn(params, example) -> scalar`, the plan's loss, for the
      default score.
    score_fn: `(output, canary) -> scalar`, higher meaning "in" (instead of
      `loss_fn`).
    canary_index: the row the canary takes.
    replacement: the row's example in the runs without the canary: for
      replace-one plans any example (default: `data`'s own row); for the
      others a zero-contribution example (default: none, the row is masked
      out).
    output_fn: `(params, state) -> output` scored (default: see above).
    alpha, calibration_fraction, num_thresholds: see `run_canary_audit`.
    max_parallel: runs per chunk (vmapped at once); None (default) picks it
      from `max_memory_bytes`.
    max_memory_bytes: the bound on one chunk's compiled program when
      `max_parallel` is None (default `DEFAULT_AUDIT_MEMORY_BYTES`, 1 GiB).
      A single run above it runs alone, with a warning.
    progress: a progress line on stderr (runs done, runs per chunk, time
      left); None follows `$DPSCO_JAX_PROGRESS` (`dpsco_jax.progress`).
    name: what was audited (default: the plan's algorithm).

  Returns:
    The `AuditReport` (`claimed_epsilon` is `plan.epsilon`).

  Raises:
    ValueError: if neither `loss_fn` nor `score_fn` is given, the data do
      not hold `plan.num_examples` rows, `canary_index` is out of range, or
      a shuffled plan is given no `replacement`.
  """
  if (loss_fn is None) == (score_fn is None):
    raise ValueError('give loss_fn= (the score is minus the canary\'s loss) '
                     'or score_fn=, not both')
  if score_fn is None:
    score_fn = lambda output, example: -loss_fn(output, example)
  num_runs = checks.positive_int(num_runs, 'num_runs')
  if max_parallel is not None:
    max_parallel = checks.positive_int(max_parallel, 'max_parallel')
  max_memory_bytes = checks.positive_int(max_memory_bytes, 'max_memory_bytes')
  n = plan.num_examples
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None
           for leaf in jax.tree_util.tree_leaves(data)}
  if sizes != {n}:
    raise ValueError(f'the data\'s leading axes are {sorted(map(str, sizes))};'
                     f' the plan is for num_examples = {n}')
  if not 0 <= int(canary_index) < n:
    raise ValueError(f'canary_index must be in [0, {n}), got '
                     f'{canary_index!r}')
  canary_index = int(canary_index)
  relation = _plan_relation(plan)
  replace_one = relation is neighboring.NeighboringRelation.REPLACE_ONE
  masked = not replace_one and replacement is None
  if masked and isinstance(plan.batches, batching.ShuffledBatches):
    raise ValueError(
        'a shuffled plan checks that every batch holds exactly batch_size '
        'real examples, so the canary\'s row cannot be masked out of it: give '
        'replacement= an example whose clipped contribution is zero for your '
        'loss (the zero-out neighbour), or audit the plan with '
        "sampling='poisson' or 'fixed'")
  data = jax.tree_util.tree_map(jnp.asarray, data)
  if replacement is None:
    replacement = jax.tree_util.tree_map(lambda leaf: leaf[canary_index],
                                         data)
  output_fn = runs.plan_output(plan) if output_fn is None else output_fn
  scores = _plan_scores(
      plan, params=params, data=data, canary=canary, replacement=replacement,
      canary_index=canary_index, masked=masked, score_fn=score_fn,
      output_fn=output_fn, num_runs=num_runs, key=key,
      max_parallel=max_parallel, max_memory_bytes=max_memory_bytes,
      progress=progress)
  return reports.audit_observations(
      scores[0::2], scores[1::2], claimed_epsilon=plan.epsilon,
      delta=plan.delta, alpha=alpha,
      calibration_fraction=calibration_fraction,
      num_thresholds=num_thresholds,
      name=name or f'{plan.algorithm} plan, canary row {canary_index}')
