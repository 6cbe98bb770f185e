"""Every experiment's --help lists its config fields with their meaning."""

import os
import pathlib
import subprocess
import sys

import pytest

from experiments import cli

REPO = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = {
    'quickstart': 'configs/quickstart.py',
    'diff2_tabular': 'configs/diff2_tabular.py',
    'single_epoch_synthetic': 'configs/single_epoch_synthetic.py',
    'sweep_digits': 'configs/sweep_digits.py',
    'srg_memf': 'configs/srg_memf_digits.py',
    'flax_digits': 'configs/flax_digits.py',
    'nonsmooth_synthetic': 'configs/nonsmooth_synthetic.py',
}
CONFIGS = sorted(str(p.relative_to(REPO))
                 for p in (REPO / 'configs').glob('*.py')
                 if p.name != '__init__.py')


@pytest.mark.parametrize('path', CONFIGS)
def test_every_config_field_is_documented(path):
  fields = cli.config_fields(str(REPO / path))
  assert fields
  undocumented = [field.name for field in fields if not field.help]
  assert not undocumented, f'{path}: comment these fields: {undocumented}'


def test_fields_take_the_comment_right_above_or_trailing(tmp_path):
  (tmp_path / 'base.py').write_text(
      'import ml_collections\n'
      'def get_config():\n'
      '  config = ml_collections.ConfigDict()\n'
      '  # The first.\n'
      '  # Two lines.\n'
      '  config.a = 1\n'
      '  config.b = (1,\n'
      '              2)  \n'
      '  config.c = 3  # Trailing.\n'
      '  return config\n')
  fields = {f.name: f for f in cli.config_fields(str(tmp_path / 'base.py'))}
  assert fields['a'].help == 'The first. Two lines.'
  assert fields['b'].help == '' and fields['b'].default == (1, 2)
  assert fields['c'].help == 'Trailing.'


def test_help_of_every_experiment_lists_its_fields():
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu')
  runs = {name: subprocess.Popen(
      [sys.executable, '-m', f'experiments.{name}', '--help'], cwd=REPO,
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for name in EXPERIMENTS}
  for name, run in runs.items():
    output = run.communicate(timeout=300)[0]
    assert run.returncode in (0, 1) and "--config:" in output, output  # absl exits 1 after --help
    help_text = ' '.join(output.split())
    for field in cli.config_fields(str(REPO / EXPERIMENTS[name])):
      assert f'{field.name} = ' in help_text, (name, field.name)
      assert ' '.join(field.help.split())[:30] in help_text, (name, field)
