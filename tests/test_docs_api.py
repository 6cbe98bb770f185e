"""Every `name=` keyword the docs show for a library call is one it accepts.

README.md's Python blocks run as a test (`test_readme.py`), but prose and
inline code are not run: a keyword the API does not have (`method='vmap'`
where the function's keyword is `clipping_method=`) survives there until a
user copies it. This test reads README.md and the pages under docs/:

* fenced ```python blocks, parsed with `ast` (the blocks of one page share
  a namespace, as in test_readme.py, so `plan = plans.dpftrl(...)` makes
  `plan.step(...)` resolvable through the return annotation);
* inline code spans, scanned for calls `name(... key=...)`, written in full
  or elided (`f(..., key=)`);
* inline spans that are a keyword alone (`clipping_method='vmap'`), checked
  against the library functions the same paragraph (list item, table row)
  names, or against the function `MEANT` says it belongs to; unchecked
  where neither names one.

A call is checked when its callee resolves to a dpsco_jax object (through
`dpsco_jax.`, a dpsco_jax module name such as `plans.` or
`preprocessing.`, a top-level dpsco_jax name, or a variable a block made);
calls of jax, optax, numpy or the reader's own functions are not. The
function must name the keyword in its signature; a `**kwargs` catch-all
counts only where `FORWARDS` says which function receives it.
"""

import ast
import dataclasses
import glob
import inspect
import os
import re
import types
import typing
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest

import dpsco_jax
from dpsco_jax import algorithms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, 'README.md')] + sorted(
    glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))

# Functions taking `**kwargs` that pass them on, and the function that
# receives them: a keyword is accepted when the receiver names it.
FORWARDS: dict[str, Callable[[], Callable[..., Any]]] = {}

# Keywords written alone in prose whose paragraph does not name the function
# they belong to: (page, keyword) -> that function, as the docs mean it, and
# it is checked like any other; None where it is the `update` of an optax
# transformation (extra arguments, no signature to check).
MEANT: dict[tuple[str, str], Optional[str]] = {
    ('README.md', 'sampling'): 'plans.dpsgd',
    ('docs/by_hand.md', 'batch_mask'): None,  # "pass batch_mask= to update"
    ('docs/by_hand.md', 'key'): 'dpsco_jax.dpsgd',  # each process's tx
    ('docs/algorithms.md', 'sampling'): 'plans.dpsgd',
    ('docs/algorithms.md', 'storage'): 'noise.matrix_factorization',
    ('docs/privacy.md', 'releases'): 'plans.dpsgd',
    ('docs/algorithms.md', 'gradient'): 'dpsco_jax.accelerated_dp_srgd',
    ('docs/fast_clipping.md', 'physical_batch_size'): 'plans.dpsgd',
    ('docs/sharp_edges.md', 'sampling'): 'plans.dpsgd',
    ('docs/audit.md', 'release_fn'): 'audit.run_gradient_canary_audit',
    ('docs/audit.md', 'steps_per_epoch'): 'audit.run_gradient_canary_audit',
    ('docs/audit.md', 'normalize_by'): 'dpsco_jax.dpsgd',
    ('docs/audit.md', 'replacement'): 'audit.audit_plan',
    ('docs/nonsmooth.md', 'learning_rate'): 'plans.nonsmooth_single_pass',
    ('docs/nonsmooth.md', 'budget_split'): 'plans.nonsmooth_multi_pass',
}

FENCE = re.compile(r'^( *)```(\w*)\n(.*?)^\1```', re.S | re.M)
INLINE = re.compile(r'(?<!`)`([^`]+)`(?!`)')
CALLEE = re.compile(r'([A-Za-z_][\w.]*)\s*\(')
BARE_KEYWORD = re.compile(r'^\s*([A-Za-z_]\w*)\s*=(?!=)')
# A keyword written alone in prose: `name=value` or `name=`, no spaces
# (`T = max(1, tau R)` is an equation), not an environment variable.
ALONE = re.compile(r'^([a-z_]\w*)=(?!=)')


@dataclasses.dataclass(frozen=True)
class Use:
  """A keyword shown for a call (or alone) at a place in a page."""
  where: str           # 'README.md:123'
  callee: str          # as written, e.g. 'plans.dpsgd'; '' for a bare keyword
  keyword: str
  fn: Any = None       # what the callee resolves to (None: not the library)
  candidates: tuple = ()   # for a bare keyword: the functions in context


# ------------------------------------------------------------ resolution


def _library(obj: Any) -> bool:
  module = getattr(obj, '__module__', None) or (
      obj.__name__ if isinstance(obj, types.ModuleType) else '')
  return module.split('.')[0] == 'dpsco_jax'


def _attribute(owner: Any, name: str) -> Any:
  """`owner.name`, or for a class the annotated type of field `name`."""
  try:
    return getattr(owner, name)
  except AttributeError:
    pass
  if isinstance(owner, type):
    try:
      hints = typing.get_type_hints(owner)
    except Exception:  # pylint: disable=broad-except
      hints = getattr(owner, '__annotations__', {})
    if name in hints:
      return _class_of(hints[name])
  raise AttributeError(name)


def _class_of(annotation: Any) -> Any:
  """The dpsco_jax class an annotation names (Optional[X] -> X), or None."""
  if isinstance(annotation, type):
    return annotation
  for arg in typing.get_args(annotation):
    if isinstance(arg, type) and _library(arg):
      return arg
  return None


def _returns(fn: Any) -> Any:
  """The class a library callable returns, from its annotation, or None."""
  if isinstance(fn, type):
    return fn
  try:
    hint = typing.get_type_hints(fn).get('return')
  except Exception:  # pylint: disable=broad-except
    hint = None
  cls = _class_of(hint)
  return cls if cls is not None and _library(cls) else None


def _homes(name: str) -> list[Any]:
  """The distinct public library objects called `name` in any module."""
  found = []
  for module in list(vars(dpsco_jax).values()) + list(
      vars(algorithms).values()):
    if isinstance(module, types.ModuleType) and _library(module):
      obj = getattr(module, name, None)
      if (obj is not None and callable(obj) and _library(obj) and
          all(obj is not other for other in found)):
        found.append(obj)
  return found


def resolve(callee: str, variables: dict[str, Any]) -> Optional[Any]:
  """The dpsco_jax object a dotted name written in the docs stands for."""
  parts = callee.split('.')
  if parts[0] in variables:
    owner, rest = variables[parts[0]], parts[1:]
  elif parts[0] == 'dpsco_jax':
    owner, rest = dpsco_jax, parts[1:]
  elif hasattr(dpsco_jax, parts[0]):
    owner, rest = dpsco_jax, parts
  elif hasattr(algorithms, parts[0]):
    owner, rest = algorithms, parts
  elif len(parts) == 1 and len(_homes(parts[0])) == 1:
    # A bare name defined in exactly one library module (`phased_sgd_preset`).
    return _homes(parts[0])[0]
  else:
    return None
  try:
    for name in rest:
      owner = _attribute(owner, name)
  except AttributeError:
    # A name the library does not have is an error of the docs too.
    return AttributeError(f'dpsco_jax has no {callee}')
  if owner is None or not _library(owner) or not callable(owner):
    return None
  return owner


def accepts(fn: Callable[..., Any], keyword: str) -> bool:
  """Whether `fn(..., keyword=...)` is a call `fn` accepts by name."""
  try:
    parameters = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return True   # No signature to check (a builtin): not the docs' error.
  parameter = parameters.get(keyword)
  if parameter is not None and parameter.kind in (
      parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
    return True
  if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
    receiver = FORWARDS.get(f'{fn.__module__}.{fn.__qualname__}')
    return receiver is not None and accepts(receiver(), keyword)
  return False


# ------------------------------------------------------------ extraction


def _matching_paren(text: str, start: int) -> int:
  """The index of the ')' closing the '(' at `start` (or len(text))."""
  depth, quote = 0, None
  for index in range(start, len(text)):
    char = text[index]
    if quote:
      if char == quote:
        quote = None
    elif char in '\'"':
      quote = char
    elif char in '([{':
      depth += 1
    elif char in ')]}':
      depth -= 1
      if depth == 0:
        return index
  return len(text)


def _top_level_arguments(text: str) -> Iterator[str]:
  """The comma-separated arguments of a call's inside, at depth 0."""
  depth, quote, start = 0, None, 0
  for index, char in enumerate(text):
    if quote:
      if char == quote:
        quote = None
    elif char in '\'"':
      quote = char
    elif char in '([{':
      depth += 1
    elif char in ')]}':
      depth -= 1
    elif char == ',' and depth == 0:
      yield text[start:index]
      start = index + 1
  yield text[start:]


def scan_calls(code: str) -> Iterator[tuple[str, str]]:
  """(callee, keyword) of every `name(... keyword=...)` in a code fragment.

  Works on fragments that are not Python (`f(a=, b=)`, `f(..., x=...)`).
  """
  for match in CALLEE.finditer(code):
    open_at = match.end() - 1
    inside = code[open_at + 1:_matching_paren(code, open_at)]
    for argument in _top_level_arguments(inside):
      keyword = BARE_KEYWORD.match(argument)
      if keyword:
        yield match.group(1), keyword.group(1)


def _ast_calls(code: str, variables: dict[str, Any]
               ) -> Iterator[tuple[int, Any, str, str]]:
  """(line, resolved callee, callee, keyword) of a Python block.

  Statements are read in order; a variable a statement makes from a library
  call (`plan = plans.dpftrl(...)`) resolves the calls after it
  (`plan.step(...)`), in this block and the next ones.
  """
  for statement in ast.parse(code).body:
    for node in ast.walk(statement):
      if not isinstance(node, ast.Call):
        continue
      callee = ast.unparse(node.func)
      fn = resolve(callee, variables)
      for keyword in node.keywords:
        if keyword.arg is not None:             # not **inputs
          yield node.lineno, fn, callee, keyword.arg
    if (isinstance(statement, ast.Assign) and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name) and
        isinstance(statement.value, ast.Call)):
      fn = resolve(ast.unparse(statement.value.func), variables)
      cls = (None if fn is None or isinstance(fn, Exception)
             else _returns(fn))
      if cls is not None:
        variables[statement.targets[0].id] = cls
      else:
        variables.pop(statement.targets[0].id, None)


def _line_of(text: str, offset: int) -> int:
  return text.count('\n', 0, offset) + 1


def uses(path: str) -> Iterator[Use]:
  """Every keyword a page shows for a call, or alone in inline code."""
  with open(path) as f:
    text = f.read()
  name = os.path.relpath(path, ROOT)
  if name.startswith('..'):        # a copy elsewhere: named as the original
    parts = os.path.normpath(path).split(os.sep)
    name = '/'.join(parts[-2:] if parts[-2] == 'docs' else parts[-1:])
  variables: dict[str, Any] = {}
  fences = list(FENCE.finditer(text))
  # Fenced Python blocks, in order (they share a namespace).
  for fence in fences:
    if fence.group(2) != 'python':
      continue
    code = re.sub(r'^' + fence.group(1), '', fence.group(3), flags=re.M)
    first = _line_of(text, fence.start(3))
    try:
      calls = list(_ast_calls(code, variables))
    except SyntaxError:
      calls = [(1, resolve(callee, variables), callee, keyword)
               for callee, keyword in scan_calls(code)]
    for line, fn, callee, keyword in calls:
      yield Use(f'{name}:{first + line - 1}', callee, keyword, fn)
  # Prose: inline code, paragraph by paragraph, fences blanked out.
  prose = list(text)
  for fence in fences:
    prose[fence.start():fence.end()] = ''.join(
        c if c == '\n' else ' ' for c in fence.group(0))
  prose = ''.join(prose)
  offset = 0
  # Paragraphs, and each item of a list and row of a table on its own.
  for paragraph in re.split(r'(\n\s*\n|\n(?=\s*(?:[-*|]|\d+\.) ))',
                            prose):
    start, offset = offset, offset + len(paragraph)
    named, bare = [], []
    for span in INLINE.finditer(paragraph):
      code = span.group(1)
      where = f'{name}:{_line_of(text, start + span.start())}'
      keyword = ALONE.match(code)
      if keyword and not CALLEE.match(code):
        bare.append((where, keyword.group(1)))
        continue
      for callee, keyword in scan_calls(code):
        yield Use(where, callee, keyword, resolve(callee, variables))
      for callee in [m.group(1) for m in CALLEE.finditer(code)] + (
          [code.strip()] if re.fullmatch(r'\s*[A-Za-z_][\w.]*\s*', code)
          else []):
        fn = resolve(callee, variables)
        if (fn is not None and not isinstance(fn, Exception) and
            not (isinstance(fn, type) and issubclass(fn, BaseException))):
          named.append(fn)
    for where, keyword in bare:
      if (name, keyword) in MEANT:
        meant = MEANT[name, keyword]
        if meant is not None:
          yield Use(where, meant, keyword, resolve(meant, {}))
      else:
        yield Use(where, '', keyword, candidates=tuple(named))


def problems(paths: Sequence[str]) -> list[str]:
  """What the pages show that the API does not accept, one line each."""
  found = []
  for path in paths:
    for use in uses(path):
      if not use.callee:
        # A keyword alone, in a paragraph that names no library function:
        # nothing to check it against (MEANT can say what it belongs to).
        if use.candidates and not any(accepts(fn, use.keyword)
                                      for fn in use.candidates):
          names = sorted({f'{fn.__module__}.{fn.__qualname__}'
                          for fn in use.candidates})
          found.append(f'{use.where}: `{use.keyword}=` is accepted by none of '
                       f'{names}')
        continue
      fn = use.fn
      if fn is None:
        continue
      if isinstance(fn, Exception):
        found.append(f'{use.where}: {fn}')
      elif not accepts(fn, use.keyword):
        found.append(f'{use.where}: {use.callee}() has no keyword '
                     f'`{use.keyword}=`')
  return sorted(set(found))


# ----------------------------------------------------------------- tests


def test_every_keyword_the_docs_show_is_accepted():
  assert problems(PAGES) == []


def test_the_docs_are_read():
  readme = list(uses(PAGES[0]))
  fenced = [u for u in readme if u.callee and u.where and u.keyword ==
            'restart']
  assert fenced, 'the first block (plans.dpftrl(..., restart=)) was not read'
  by_hand = list(uses(os.path.join(ROOT, 'docs', 'by_hand.md')))
  assert any(u.callee == 'dpsco_jax.dpsgd' and u.keyword == 'num_steps'
             for u in by_hand)                      # inline, elided values
  fast_clipping = list(uses(os.path.join(ROOT, 'docs', 'fast_clipping.md')))
  assert any(not u.callee and u.keyword == 'clipping_method'
             for u in fast_clipping)
  assert len({u.where.split(':')[0] for u in
              (u for p in PAGES for u in uses(p))}) >= 3


@pytest.mark.parametrize('page, original, misspelled', [
    # in a fenced block
    ('README.md', "restart='epoch'", "restrat='epoch'"),
    # in a method call on an object a block made
    ('README.md', 'plan.epsilon_at(t)', 'plan.epsilon_at(step=t, stpe=1)'),
    # inline, elided values
    ('docs/by_hand.md', 'dpsco_jax.dpsgd(loss_fn, l2_clip=...,',
     'dpsco_jax.dpsgd(loss_fn, l2_clipp=...,'),
    # a keyword alone in prose (the issue's `method='vmap'`)
    ('docs/fast_clipping.md', "pass `clipping_method='vmap'` there",
     "pass `method='vmap'` there"),
    # a name the library does not have
    ('docs/algorithms.md', 'dpsco_jax.srgd_preset(',
     'dpsco_jax.srgd_presets('),
])
def test_a_misspelled_keyword_in_a_copy_of_a_page_fails(
    tmp_path, page, original, misspelled):
  path = os.path.join(ROOT, page)
  with open(path) as f:
    text = f.read()
  assert original in text
  # The copy sits at the same place below tmp_path, so that it is named as
  # the original (MEANT's keys) and its relative layout is the same.
  copy = tmp_path / page
  copy.parent.mkdir(parents=True, exist_ok=True)
  copy.write_text(text.replace(original, misspelled, 1))
  assert problems([path]) == []
  found = problems([str(copy)])
  assert found, misspelled
  assert len(found) == 1, found


def test_a_forwarding_catch_all_is_checked_at_its_receiver(monkeypatch):
  def receiver(*, rate):
    return rate

  def forwarding(**kwargs):
    return receiver(**kwargs)

  assert not accepts(forwarding, 'rate')          # unknown catch-all
  monkeypatch.setitem(FORWARDS, f'{__name__}.{forwarding.__qualname__}',
                      lambda: receiver)
  assert accepts(forwarding, 'rate')
  assert not accepts(forwarding, 'rates')
