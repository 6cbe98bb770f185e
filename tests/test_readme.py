"""Every Python block of README.md and of the guides under docs/ runs as written.

README.md's blocks run in order in one namespace, as a reader pasting them
into one session would: the first defines the data, the model and the loss
the others use. Each guide that continues from it (`GUIDES`) runs its own
blocks in order, in a copy of the namespace the README's blocks left: a
reader arrives at a guide from the README's first example.
"""

import os
import re
import shutil
import textwrap
import warnings

import matplotlib
import pytest

matplotlib.use('Agg')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = 'README.md'
# The guides whose blocks continue from the README's, with a text each page
# must hold in one of its blocks (so that a page emptied by mistake fails).
GUIDES = {
    'docs/by_hand.md': 'ledger.check_state(state)',
    'docs/algorithms.md': 'plans.accelerated_dp_srgd',
    'docs/your_data.md': 'data.load_table',
    'docs/experiments.md': 'checkpoint.restore_or_init',
    'docs/privacy.md': 'audit.run_gradient_canary_audit',
    'docs/fast_clipping.md': 'clipped_grad_sum',
}
# A fenced block, possibly indented inside a list item.
BLOCK = re.compile(r'^( *)```python\n(.*?)^\1```', re.S | re.M)


def page_blocks(page: str) -> list[str]:
  with open(os.path.join(REPO, page)) as f:
    text = f.read()
  return [textwrap.dedent(code) for _, code in BLOCK.findall(text)]


def readme_blocks() -> list[str]:
  return page_blocks(README)


def run_blocks(page: str, namespace: dict) -> None:
  """Runs a page's blocks in order in `namespace`, naming a failing one."""
  for number, code in enumerate(page_blocks(page), 1):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      try:
        exec(compile(code, f'{page} block {number}', 'exec'), namespace)  # pylint: disable=exec-used
      except Exception as error:
        raise AssertionError(
            f'{page} block {number} fails:\n{code}') from error


@pytest.fixture(scope='module')
def readme_run(tmp_path_factory):
  """The README's blocks, run once: (namespace, what they printed)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  where = tmp_path_factory.mktemp('readme')
  printed = io.StringIO()
  cwd = os.getcwd()
  namespace = {'__name__': '__readme__'}
  try:
    os.chdir(where)
    with contextlib.redirect_stdout(printed):
      run_blocks(README, namespace)
  finally:
    os.chdir(cwd)
  return namespace, printed.getvalue()


def test_the_pages_have_the_blocks_this_test_runs():
  blocks = readme_blocks()
  assert blocks and 'plans.dpftrl' in blocks[0]
  for page, text in GUIDES.items():
    assert any(text in block for block in page_blocks(page)), page
  # The README held 17 blocks before its guides moved to docs/: none lost.
  assert len(blocks) + sum(len(page_blocks(p)) for p in GUIDES) >= 17


def test_the_readme_blocks_run_in_order(readme_run):
  namespace, printed = readme_run
  # The first block's loop reports the epsilon so far, ending at the target.
  assert 'epsilon so far 2.000' in printed
  assert namespace['plan'].epsilon <= 2.0 + 1e-9


@pytest.mark.parametrize('page', sorted(GUIDES))
def test_every_guide_block_runs_in_order(page, readme_run, tmp_path,
                                         monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)    # blocks write run/checkpoint, run/model
  # Blocks read the shipped table by its path from the repository root.
  shutil.copytree(os.path.join(REPO, 'tests', 'data'),
                  tmp_path / 'tests' / 'data')
  namespace = dict(readme_run[0])
  run_blocks(page, namespace)
  printed = capsys.readouterr().out
  if page == 'docs/your_data.md':
    # "Train on your own data": the shipped table's classes and rows.
    assert "('no', 'yes') yes 240" in printed
  if page == 'docs/experiments.md':
    assert os.path.isdir(tmp_path / 'run' / 'checkpoint')
    assert os.path.isdir(tmp_path / 'run' / 'model')
  # Every plan a page makes stays within its target.
  assert namespace['plan'].epsilon <= 2.0 + 1e-9
