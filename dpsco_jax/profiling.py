"""What a compiled step costs, read from XLA's compiled program (no run).

A private step is meant to run where users train: on an accelerator, many
steps queued ahead of the device. Two things in its compiled program decide
whether it can: the work (flops, bytes moved, temporary memory) and host
round trips. A host callback (`jax.pure_callback`, `jax.experimental.
io_callback`, `jax.debug.callback`) stops the device for the host; a
`conditional` (`lax.cond`, `lax.switch`) that runs every step makes a GPU
read its predicate back to the host and wait on the stream. Both drain the
queue of kernels, once per step.

`compiled_cost(fn, *args)` compiles `jax.jit(fn).lower(*args).compile()` for
the default backend from the arguments' shapes (`jax.ShapeDtypeStruct`s, or
arrays, whose values are never read) and never executes it. It reports
`cost_analysis()` (flops, bytes accessed), `memory_analysis()` (temporary,
argument and output memory), and what the optimized HLO (`as_text()`) says
about host round trips. `tests/test_compiled_steps.py` uses it to keep every
private step free of them; `benchmarks/compiled_cost.py` prints the costs of
private steps as ratios to the non-private step.
"""

import dataclasses
import re
from typing import Any, Callable, Mapping, Optional

import jax

# Custom-call targets of JAX's host callbacks: `xla_ffi_python_cpu_callback`
# on the CPU (jax 0.10, all three callback kinds), `xla_ffi_python_gpu_callback`
# on GPUs, `xla_python_cpu_callback` / `xla_python_gpu_callback` in older
# releases. Any target naming a callback counts, so a renamed one still does.
_CALLBACK_TARGET = re.compile(r'callback', re.I)
# Instructions that move data to or from the host outside a custom call (how
# callbacks are lowered on TPUs, and host transfers in general).
_HOST_TRANSFER_OPS = ('infeed', 'outfeed')
# ENTRY instructions that are bookkeeping, not work: not counted as ops.
_NOT_WORK = frozenset(
    ('parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast'))

_COMPUTATION = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
# The opcode: the first lowercase word followed by '(' after the shape (a
# shape is `f32[4]{0}` or a tuple `(f32[4]{0}, s32[])`; layout tiles such as
# `T(8,128)` are upper case).
_OPCODE = re.compile(r'(?<![\w.\-%])([a-z][a-z0-9\-]*)\(')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# Computations an instruction calls, and whether they run whenever it does.
_ALWAYS_CALLED = re.compile(
    r'\b(?:calls|to_apply|body|condition|scatter|select)=%?([\w.\-]+)')
_CALLED_LIST = re.compile(r'\bcalls=\{([^}]*)\}')
_BRANCHES = re.compile(
    r'\b(?:branch_computations=\{([^}]*)\}|'
    r'(?:true|false)_computation=%?([\w.\-]+))')


@dataclasses.dataclass(frozen=True)
class HloCounts:
  """What the optimized HLO text says about host round trips and size.

  Example:
    >>> counts = hlo_counts(jax.jit(step).lower(*shapes).compile().as_text())
    >>> counts.host_callbacks, counts.conditionals_every_step
    (0, 0)

  Attributes:
    host_callbacks: host callbacks anywhere in the program (custom calls
      whose target names a callback, plus host transfers such as `outfeed`
      or a `send`/`recv` with `is_host_transfer=true`).
    host_callbacks_in_conditionals: of those, the ones reachable only
      through a `conditional`'s branch (they run when the branch is taken).
    conditionals: `conditional` instructions anywhere in the program.
    conditionals_every_step: `conditional`s that run whenever the program
      does: in ENTRY, or in a computation reached from ENTRY through calls,
      fusions, while bodies and conditions, reductions and the like, but
      not through another conditional's branch. One in a while body counts
      once (it runs at least once per step when the loop does).
    entry_ops: instructions of the ENTRY computation, bookkeeping
      (parameters, constants, tuples, get-tuple-element, bitcasts) left
      out: a rough count of the top-level operations (kernels, calls,
      loops) the program launches.
  """

  host_callbacks: int
  host_callbacks_in_conditionals: int
  conditionals: int
  conditionals_every_step: int
  entry_ops: int


@dataclasses.dataclass(frozen=True)
class CompiledCost:
  """The cost of one compiled program, from XLA's own analyses.

  Example:
    >>> cost = dpsco_jax.compiled_cost(step, params, opt_state, batch)
    >>> cost.bytes_accessed, cost.temp_bytes, cost.host_round_trips

  Attributes:
    flops: `cost_analysis()['flops']` (XLA's count; 0 where absent).
    bytes_accessed: `cost_analysis()['bytes accessed']`.
    temp_bytes: `memory_analysis().temp_size_in_bytes`.
    argument_bytes: `memory_analysis().argument_size_in_bytes`.
    output_bytes: `memory_analysis().output_size_in_bytes`.
    host_callbacks: see `HloCounts`.
    host_callbacks_in_conditionals: see `HloCounts`.
    conditionals: see `HloCounts`.
    conditionals_every_step: see `HloCounts`.
    entry_ops: see `HloCounts`.
    backend: the platform compiled for (e.g. 'cpu').
  """

  flops: float
  bytes_accessed: float
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  host_callbacks: int
  host_callbacks_in_conditionals: int
  conditionals: int
  conditionals_every_step: int
  entry_ops: int
  backend: str

  @property
  def host_round_trips(self) -> int:
    """Host callbacks plus conditionals run every step (0 on a clean step)."""
    return self.host_callbacks + self.conditionals_every_step

  def ratio_to(self, other: 'CompiledCost') -> dict[str, float]:
    """This program's work and memory over `other`'s (e.g. a non-private step).

    Example:
      >>> private = compiled_cost(private_step, params, state, batch)
      >>> plain = compiled_cost(plain_step, params, adam_state, batch)
      >>> private.ratio_to(plain)['bytes_accessed']
      1.51

    Args:
      other: the denominator.

    Returns:
      `{'flops', 'bytes_accessed', 'temp_bytes', 'argument_bytes',
      'output_bytes', 'entry_ops'}` -> ratio; `inf` where `other`'s value
      is 0 and this one's is not, 1.0 where both are 0.
    """
    ratios = {}
    for name in ('flops', 'bytes_accessed', 'temp_bytes', 'argument_bytes',
                 'output_bytes', 'entry_ops'):
      mine, theirs = float(getattr(self, name)), float(getattr(other, name))
      ratios[name] = (mine / theirs if theirs else
                      (1.0 if mine == 0 else float('inf')))
    return ratios


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
  """`{computation name: its instruction lines}` and the ENTRY's name."""
  computations: dict[str, list[str]] = {}
  entry, current = '', None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not _INSTRUCTION.match(line):
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
    elif line.strip() == '}':
      current = None
    elif current is not None and _INSTRUCTION.match(line):
      computations[current].append(line)
  return computations, entry


def _opcode(line: str) -> str:
  rest = _INSTRUCTION.match(line).group(2)
  found = _OPCODE.search(rest)
  return found.group(1) if found else ''


def _is_host_callback(line: str, opcode: str) -> bool:
  if opcode == 'custom-call':
    target = _TARGET.search(line)
    return bool(target and _CALLBACK_TARGET.search(target.group(1)))
  if opcode in _HOST_TRANSFER_OPS:
    return True
  return opcode in ('send', 'recv') and 'is_host_transfer=true' in line


def _names(text: str) -> list[str]:
  return [name.strip().lstrip('%') for name in text.split(',') if name.strip()]


def hlo_counts(hlo_text: str) -> HloCounts:
  """Host callbacks, conditionals and ENTRY ops of an optimized HLO module.

  Example:
    >>> compiled = jax.jit(step).lower(*shapes).compile()
    >>> hlo_counts(compiled.as_text()).conditionals_every_step
    0

  Args:
    hlo_text: `compiled.as_text()` (one HLO module).

  Returns:
    `HloCounts`.

  Raises:
    ValueError: if the text has no ENTRY computation.
  """
  computations, entry = _computations(hlo_text)
  if not entry:
    raise ValueError('no ENTRY computation in the HLO text')
  always: dict[str, set[str]] = {}
  branches: dict[str, set[str]] = {}
  callbacks: dict[str, int] = {}
  conditionals: dict[str, int] = {}
  for name, lines in computations.items():
    always[name], branches[name] = set(), set()
    callbacks[name] = conditionals[name] = 0
    for line in lines:
      opcode = _opcode(line)
      callbacks[name] += _is_host_callback(line, opcode)
      conditionals[name] += opcode == 'conditional'
      if opcode == 'conditional':
        for listed, single in _BRANCHES.findall(line):
          branches[name].update(_names(listed) if listed else [single])
      for listed in _CALLED_LIST.findall(line):
        always[name].update(_names(listed))
      always[name].update(_ALWAYS_CALLED.findall(line))

  def reach(starts: set[str], edges_of) -> set[str]:
    seen, stack = set(), list(starts)
    while stack:
      name = stack.pop()
      if name in seen or name not in computations:
        continue
      seen.add(name)
      stack.extend(edges_of(name))
    return seen

  every_step = reach({entry}, lambda n: always[n])
  anywhere = reach({entry}, lambda n: always[n] | branches[n])
  entry_ops = sum(_opcode(line) not in _NOT_WORK
                  for line in computations[entry])
  return HloCounts(
      host_callbacks=sum(callbacks[n] for n in anywhere),
      host_callbacks_in_conditionals=sum(
          callbacks[n] for n in anywhere - every_step),
      conditionals=sum(conditionals[n] for n in anywhere),
      conditionals_every_step=sum(conditionals[n] for n in every_step),
      entry_ops=entry_ops)


def _cost_entry(analysis: Any, name: str) -> float:
  # A dict on jax 0.10; a list of one dict per program on older releases.
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  if not isinstance(analysis, Mapping):
    return 0.0
  return float(analysis.get(name, 0.0))


def _memory(analysis: Optional[Any], name: str) -> int:
  return int(getattr(analysis, name, 0) or 0) if analysis is not None else 0


def compiled_cost(fn: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> CompiledCost:
  """Compiles `fn` for its arguments' shapes and reads what it costs.

  `jax.jit(fn).lower(*args, **kwargs).compile()`, never executed: pass
  `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape(tx.init, params)`) to
  allocate nothing, or arrays (only their shapes, dtypes and shardings are
  used). A function already wrapped in `jax.jit` is compiled the same way.

  Example:
    >>> tx = optax.chain(dpsco_jax.dpsgd(loss_fn, l2_clip=1.0,
    ...                                  noise_multiplier=1.0, num_steps=100),
    ...                  optax.sgd(0.1))
    >>> def step(params, state, batch):
    ...   updates, state = tx.update(None, state, params, batch=batch)
    ...   return optax.apply_updates(params, updates), state
    >>> shapes = jax.eval_shape(lambda: (params, tx.init(params), batch))
    >>> cost = dpsco_jax.compiled_cost(step, *shapes)
    >>> cost.host_callbacks, cost.conditionals_every_step
    (0, 0)

  Args:
    fn: the step, `fn(*args, **kwargs)`.
    *args: its positional arguments (shapes or arrays, pytrees of them).
    **kwargs: its keyword arguments (alike).

  Returns:
    A `CompiledCost` for the default backend.
  """
  compiled = jax.jit(fn).lower(*args, **kwargs).compile()
  analysis = compiled.cost_analysis()
  memory = compiled.memory_analysis()
  counts = hlo_counts(compiled.as_text())
  return CompiledCost(
      flops=_cost_entry(analysis, 'flops'),
      bytes_accessed=_cost_entry(analysis, 'bytes accessed'),
      temp_bytes=_memory(memory, 'temp_size_in_bytes'),
      argument_bytes=_memory(memory, 'argument_size_in_bytes'),
      output_bytes=_memory(memory, 'output_size_in_bytes'),
      host_callbacks=counts.host_callbacks,
      host_callbacks_in_conditionals=counts.host_callbacks_in_conditionals,
      conditionals=counts.conditionals,
      conditionals_every_step=counts.conditionals_every_step,
      entry_ops=counts.entry_ops,
      backend=jax.default_backend())
