"""The API reference (docs/api, Sphinx) builds with warnings as errors.

The build runs as a user runs it (`python -m sphinx -W --keep-going`, into a
temporary folder), so a public name without a docstring, a cross-reference
that resolves to nothing and a docstring reStructuredText cannot read fail
the suite. The hooks of docs/api/conf.py that read the docstrings' own
conventions are checked on small inputs, without a build.
"""

import importlib.util
import logging
import os
import subprocess
import sys
import types

import pytest

sphinx = pytest.importorskip('sphinx', reason='Sphinx is in the [test] extra')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, 'docs', 'api')


@pytest.fixture(scope='module')
def conf():
  """docs/api/conf.py, imported as a module."""
  spec = importlib.util.spec_from_file_location(
      'dpsco_jax_api_conf', os.path.join(SOURCE, 'conf.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_reference_builds_without_a_warning(tmp_path):
  out = tmp_path / 'html'
  result = subprocess.run(
      [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-q', '-b',
       'html', SOURCE, str(out)],
      capture_output=True, text=True, cwd=ROOT, check=False,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert result.returncode == 0, result.stderr[-6000:]
  pages = os.listdir(out / 'generated')
  # One page per public module, and the top-level names.
  for module in ('dpsco_jax', 'dpsco_jax.plans', 'dpsco_jax.accounting',
                 'dpsco_jax.algorithms.srg'):
    assert f'{module}.html' in pages
  top = (out / 'generated' / 'dpsco_jax.html').read_text()
  assert 'calibrate_noise_multiplier' in top


def test_every_public_name_has_a_page(conf):
  import dpsco_jax  # pylint: disable=g-import-not-at-top
  modules = conf.public_modules()
  for name in dpsco_jax.__all__:
    obj = getattr(dpsco_jax, name)
    home = (obj.__name__ if isinstance(obj, types.ModuleType)
            else obj.__module__)
    assert home in modules, name
  # Imported by the package but not in `__all__`: still documented.
  assert 'dpsco_jax.blt' in modules and 'dpsco_jax.rounding' in modules
  page = conf._module_page('dpsco_jax.checkpoint', modules)  # pylint: disable=protected-access
  # A name imported from another public module links to its home.
  assert ('.. py:exception:: dpsco_jax.checkpoint.CheckpointMismatchError'
          in page)
  assert ':py:exc:`dpsco_jax.ledger.LedgerMismatchError`' in page


def test_a_name_without_a_docstring_is_a_warning(conf, caplog):
  with caplog.at_level(logging.WARNING):
    conf.check_docstring(None, 'function', 'dpsco_jax.x.f', None, {}, [])
    conf.check_docstring(None, 'function', 'dpsco_jax.x.g', None, {},
                         ['Documented.'])
  warned = [r.getMessage() for r in caplog.records]
  assert warned == ['function dpsco_jax.x.f has no docstring']


def test_the_docstrings_conventions_are_read(conf):
  lines = ['The `GaussianRelease`s of a run:', '',
           '    x = f(a,', '          b)', '', 'Then, at indent 0.']
  conf.check_docstring(None, 'function', 'f', None, {}, lines)
  assert lines == ['The `GaussianRelease`\\ s of a run::', '',
                   '    x = f(a,', '          b)', '', 'Then, at indent 0.']
  # A block after a paragraph not ending in a colon, and a list, stay apart.
  assert conf._literal_blocks(['Text.', '', '  code', '', 'After.']) == [  # pylint: disable=protected-access
      'Text.', '', '::', '', '  code', '', 'After.']
  assert conf._literal_blocks(['List:', '', '  * item']) == [  # pylint: disable=protected-access
      'List:', '', '  * item']
  assert conf._joined_names([  # pylint: disable=protected-access
      'Args:', '  a, b,', '    c: shared.', '  d: own.']) == [
          'Args:', '  a, b, c: shared.', '  d: own.']
