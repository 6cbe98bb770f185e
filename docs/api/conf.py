"""Sphinx configuration of the dpsco_jax API reference.

The reference is built from the docstrings (autodoc, Google style through
napoleon). Its pages are generated at every build from the package itself
(`write_pages`), so a new public module or name appears without editing
any page:

* the public modules are those `dpsco_jax/__init__.py` imports as modules,
  and those that define a name of `dpsco_jax.__all__`;
* a module's public names are its `__all__`, or else the functions and
  classes it defines whose names do not start with an underscore.

A public name without a docstring is a warning, and so (`nitpicky`) is a
cross-reference that resolves to nothing; `tests/test_api_reference.py`
builds with `-W --keep-going`, so either fails the suite.

Build it locally (from the repository root):

    python -m sphinx -W --keep-going -b html docs/api build/api
"""

import ast
import importlib
import inspect
import os
import re
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# Document the package of this checkout, not an installed copy.
sys.path.insert(0, ROOT)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import dpsco_jax  # pylint: disable=g-import-not-at-top,wrong-import-position

from sphinx.util import logging  # pylint: disable=g-import-not-at-top

project = 'dpsco_jax'
author = 'dpsco_jax authors'
release = dpsco_jax.__version__
extensions = ['sphinx.ext.autodoc', 'sphinx.ext.napoleon']
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# A class's `Attributes:` section as fields of its description: autodoc
# documents the attributes themselves only where no such section does.
napoleon_use_ivar = True
# Docstrings write code between single backticks, as markdown does.
default_role = 'code'
autodoc_default_options = {
    'members': True,
    'undoc-members': True,        # so that a missing docstring is seen
    'member-order': 'bysource',
}
autodoc_typehints = 'signature'
# A reference that resolves to nothing is a warning...
nitpicky = True
# ...except references to other packages' names in type hints: no network,
# so no intersphinx inventories of jax, optax, numpy or the standard library.
nitpick_ignore_regex = [
    (r'py:.*', r'(jax|jnp|jaxlib|optax|chex|np|numpy|scipy|dp_accounting|'
               r'orbax|flax|pandas|typing|collections|enum|abc|dataclasses|'
               r'types|os|pathlib|concurrent|threading|functools|'
               r'contextlib|warnings|builtins)(\..*)?'),
    # Builtin and typing names as autodoc writes them.
    (r'py:.*', r'(Any|Callable|Optional|Union|Sequence|Mapping|Iterable|'
               r'Iterator|Tuple|List|Dict|Type|NamedTuple|Literal|'
               r'TypeVar|Protocol|ArrayLike|ArrayTree|PRNGKey|PyTree|'
               r'int|float|bool|str|bytes|tuple|list|dict|set|object|'
               r'type|None|Ellipsis|Exception|ValueError|TypeError|'
               r'RuntimeError|UserWarning|Warning|DeprecationWarning|'
               r'AssertionError|NotImplementedError|KeyError|'
               r'PyTreeDef|Array|Params|Updates|Batch|.*\.T)'),
    # Private classes (and the internal `physical` module) in the type hints
    # of public names: not part of the reference, so nothing to link to.
    (r'py:.*', r'dpsco_jax\.(.*\.)?_\w+'),
    (r'py:.*', r'dpsco_jax\.physical\..*'),
]
exclude_patterns = ['_build']
html_theme = 'alabaster'

GENERATED = 'generated'
_logger = logging.getLogger('dpsco_jax.api')


def public_modules() -> list[str]:
  """The modules the reference has a page for, in name order."""
  names = set()
  with open(os.path.join(ROOT, 'dpsco_jax', '__init__.py')) as f:
    tree = ast.parse(f.read())
  for node in tree.body:
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.split('.')[0] == 'dpsco_jax'):
      for alias in node.names:
        full = f'{node.module}.{alias.name}'
        if isinstance(getattr(importlib.import_module(node.module),
                              alias.name, None), types.ModuleType):
          names.add(full)
  for name in dpsco_jax.__all__:
    obj = getattr(dpsco_jax, name)
    module = (obj.__name__ if isinstance(obj, types.ModuleType)
              else getattr(obj, '__module__', None))
    if module and module.split('.')[0] == 'dpsco_jax':
      names.add(module)
  return sorted(names)


def public_names(module: types.ModuleType) -> list[str]:
  """A module's public names: its `__all__`, or what it defines."""
  if hasattr(module, '__all__'):
    return list(module.__all__)
  return [name for name, obj in vars(module).items()
          if not name.startswith('_') and
          (inspect.isfunction(obj) or inspect.isclass(obj)) and
          obj.__module__ == module.__name__]


def _home(obj) -> str:
  """The documented path of a top-level name (where it is defined)."""
  if isinstance(obj, types.ModuleType):
    return obj.__name__
  return f'{obj.__module__}.{obj.__qualname__}'


def _title(text: str) -> str:
  return f'{text}\n{"=" * len(text)}\n'


def _directive(obj) -> tuple[str, str]:
  """The directive documenting `obj`, and the role that refers to it."""
  if inspect.isclass(obj):
    if issubclass(obj, BaseException):
      return 'exception', 'exc'
    return 'class', 'class'
  if callable(obj):
    return 'function', 'func'
  return 'data', 'data'


def _module_page(name: str, modules: list[str]) -> str:
  """A module's page: its docstring, then each public name's."""
  module = importlib.import_module(name)
  lines = [_title(f'``{name}``'), f'.. automodule:: {name}',
           '   :no-members:', '']
  for member in public_names(module):
    obj = getattr(module, member)
    home = getattr(obj, '__module__', name)
    if (home != name and home in modules and not inspect.ismodule(obj) and
        getattr(obj, '__name__', None) in public_names(
            importlib.import_module(home))):
      # A name imported from another public module is documented there,
      # once; here it links to it (under its own name, so that references
      # such as a `Raises:` entry resolve).
      kind, role = _directive(obj)
      lines += [f'.. py:{kind}:: {name}.{member}', '',
                f'   :py:{role}:`{home}.{obj.__name__}`, imported here.', '']
    elif inspect.isclass(obj):
      kind = ('autoexception' if issubclass(obj, BaseException)
              else 'autoclass')
      lines += [f'.. {kind}:: {name}.{member}', '']
    elif callable(obj):
      lines += [f'.. autofunction:: {name}.{member}', '']
    else:
      lines += [f'.. autodata:: {name}.{member}', '   :no-value:', '']
  return '\n'.join(lines)


def _top_level_page(modules: list[str]) -> str:
  lines = [_title('``dpsco_jax``'), '.. automodule:: dpsco_jax',
           '   :no-members:', '', 'Names exported by ``dpsco_jax``',
           '-------------------------------', '',
           'Each is documented in the module that defines it.', '']
  for name in dpsco_jax.__all__:
    obj = getattr(dpsco_jax, name)
    role = 'mod' if isinstance(obj, types.ModuleType) else 'obj'
    lines.append(f'* :py:{role}:`dpsco_jax.{name} <{_home(obj)}>`')
  lines += ['', '.. toctree::', '   :maxdepth: 1', '']
  lines += [f'   {module}' for module in modules]
  return '\n'.join(lines) + '\n'


def _write_if_changed(path: str, text: str) -> None:
  # An unchanged page keeps its time stamp, so an incremental build skips it.
  if os.path.exists(path):
    with open(path) as f:
      if f.read() == text:
        return
  with open(path, 'w') as f:
    f.write(text)


def write_pages(app) -> None:
  """Writes one page per public module and the top-level page."""
  out = os.path.join(app.srcdir, GENERATED)
  os.makedirs(out, exist_ok=True)
  modules = public_modules()
  pages = {'dpsco_jax': _top_level_page(modules)}
  pages.update({module: _module_page(module, modules)
                for module in modules})
  for stale in set(os.listdir(out)) - {f'{page}.rst' for page in pages}:
    os.remove(os.path.join(out, stale))
  for page, text in pages.items():
    _write_if_changed(os.path.join(out, f'{page}.rst'), text)


_DOCUMENTED_KINDS = ('module', 'class', 'exception', 'function', 'method',
                     'property', 'classmethod', 'staticmethod')


# A plural of a code span, `GaussianRelease`s, as the docstrings write it:
# reStructuredText ends inline markup only before a space or punctuation, so
# the `s` is attached with an escaped space (which renders as nothing).
_PLURAL = re.compile(r'(`[^`\s][^`]*`)(s\b)')


_BULLET = re.compile(r'\s*([-*+]|\d+\.|>>>)\s')


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _literal_blocks(lines: list[str]) -> list[str]:
  """Marks the docstrings' indented code blocks as literal blocks.

  The docstrings show code (a formula, a usage sketch) as a block indented
  further than the paragraph before it, after a blank line, as markdown
  does; reStructuredText needs `::` to read it as a literal block, and reads
  it as a quotation (whose ragged indentation it refuses) otherwise. The
  paragraph's closing `:` becomes `::`; after any other paragraph a `::`
  paragraph (which renders as nothing) is put before the block. A further
  indented list or doctest stays what it is.
  """
  out, literal = [], None
  for i, line in enumerate(lines):
    out.append(line)
    if not line.strip():
      continue
    if literal is not None:
      if _indent(line) > literal:
        continue                 # inside a literal block
      literal = None
    following = lines[i + 1:i + 3]
    if (len(following) == 2 and not following[0].strip() and
        following[1].strip() and _indent(following[1]) > _indent(line) and
        not _BULLET.match(following[1]) and
        not line.rstrip().endswith('::')):
      if line.rstrip().endswith(':'):
        out[-1] = line.rstrip() + ':'
      else:
        out += ['', ' ' * _indent(line) + '::']
      literal = _indent(line)
  return out


_SECTION = re.compile(r'(\s*)(Args|Arguments|Parameters|Attributes):\s*$')
_NAMES = r'[A-Za-z_]\w*(, *[A-Za-z_]\w*)*'


def _joined_names(lines: list[str]) -> list[str]:
  """Joins an `Args:` entry whose list of names runs over several lines.

  The docstrings document parameters that share a description together,
  `a, b,` and `c: description`, over as many lines as the names take;
  napoleon reads an entry's names from one line only.
  """
  out, section, i = [], None, 0
  while i < len(lines):
    line = lines[i]
    heading = _SECTION.match(line)
    if heading:
      section = len(heading.group(1))
    elif line.strip() and section is not None and _indent(line) <= section:
      section = None
    if section is not None and re.fullmatch(rf'\s*{_NAMES},\s*', line):
      j = i + 1
      while j < len(lines) and re.fullmatch(rf'\s*{_NAMES},\s*', lines[j]):
        j += 1
      names, colon, rest = lines[j].partition(':') if j < len(lines) else (
          '', '', '')
      if colon and re.fullmatch(rf'\s*{_NAMES}', names):
        out.append(' '.join([line.rstrip()] +
                            [l.strip() for l in lines[i + 1:j]] +
                            [names.strip() + ':' + rest]))
        i = j + 1
        continue
    out.append(line)
    i += 1
  return out


def join_names(app, what, name, obj, options, lines):
  """Before napoleon reads a docstring: `_joined_names`."""
  del app, what, name, obj, options
  lines[:] = _joined_names(lines)


def check_docstring(app, what, name, obj, options, lines):
  """Warns about a public name (or public method) without a docstring.

  Also reads the docstrings' plural code spans (`name`s) and indented code
  blocks as written.
  """
  del app, obj, options
  lines[:] = _literal_blocks(
      [_PLURAL.sub(r'\1\\ \2', line) for line in lines])
  if what in _DOCUMENTED_KINDS and not any(line.strip() for line in lines):
    _logger.warning('%s %s has no docstring', what, name,
                    type='dpsco_jax', subtype='undocumented')


def skip_tuple_fields(app, what, name, obj, skip, options):
  """Skips NamedTuple fields: the class's `Attributes:` documents them."""
  del app, what, name, options
  if (obj.__class__.__name__ == '_tuplegetter' or
      (isinstance(obj, property) and (obj.__doc__ or '').startswith(
          'Alias for field number'))):
    return True
  return skip


def setup(app):
  app.connect('builder-inited', write_pages)
  app.connect('autodoc-skip-member', skip_tuple_fields)
  # Before napoleon's own handler (priority 500), after it.
  app.connect('autodoc-process-docstring', join_names, priority=400)
  app.connect('autodoc-process-docstring', check_docstring, priority=600)
  return {'parallel_read_safe': True}
