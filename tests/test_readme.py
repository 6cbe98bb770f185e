"""Every Python block of README.md runs as written, in order, on its tiny data.

The blocks share one namespace, as a reader pasting them into one session
would: the first defines the data, the model and the loss the others use.
"""

import os
import re
import shutil
import textwrap
import warnings

import matplotlib

matplotlib.use('Agg')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, 'README.md')
# A fenced block, possibly indented inside a list item.
BLOCK = re.compile(r'^( *)```python\n(.*?)^\1```', re.S | re.M)


def readme_blocks():
  with open(README) as f:
    text = f.read()
  return [textwrap.dedent(code) for _, code in BLOCK.findall(text)]


def test_readme_has_the_blocks_this_test_runs():
  blocks = readme_blocks()
  assert len(blocks) >= 8
  assert 'plans.dpftrl' in blocks[0]


def test_every_block_runs_in_order(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)    # blocks write run/checkpoint, run/model
  # Blocks read the shipped table by its path from the repository root.
  shutil.copytree(os.path.join(REPO, 'tests', 'data'),
                  tmp_path / 'tests' / 'data')
  namespace = {'__name__': '__readme__'}
  for number, code in enumerate(readme_blocks(), 1):
    with warnings.catch_warnings():
      warnings.simplefilter('ignore')
      try:
        exec(compile(code, f'README.md block {number}', 'exec'), namespace)  # pylint: disable=exec-used
      except Exception as error:
        raise AssertionError(
            f'README.md block {number} fails:\n{code}') from error
  printed = capsys.readouterr().out
  # The first block's loop reports the epsilon so far, ending at the target.
  assert 'epsilon so far 2.000' in printed
  # "Train on your own data": the shipped table's classes and rows.
  assert "('no', 'yes') yes 240" in printed
  assert namespace['plan'].epsilon <= 2.0 + 1e-9
  assert os.path.isdir(tmp_path / 'run' / 'checkpoint')
  assert os.path.isdir(tmp_path / 'run' / 'model')
