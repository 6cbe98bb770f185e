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
    'lora_finetune': 'configs/lora_finetune.py',
    'nonsmooth_synthetic': 'configs/nonsmooth_synthetic.py',
    'user_level_synthetic': 'configs/user_level_synthetic.py',
    'user_level_grouped': 'configs/user_level_grouped.py',
    'correlated_noise': 'configs/correlated_noise_digits.py',
    'clipping_choices': 'configs/clipping_choices.py',
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


# Runs each experiment as `python -m experiments.<name> --help` does
# (`runpy`, the module as `__main__`), all in one process: the imports are
# paid once, not once per experiment. The flags an experiment defines are
# removed after it, so the next one defines its own.
HELPS = """
import contextlib, io, runpy, sys
from absl import app, flags
app.define_help_flags()
for name in sys.argv[1:]:
  before = set(flags.FLAGS)
  sys.argv = [name, '--help']
  out, code = io.StringIO(), None
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
      runpy.run_module(f'experiments.{name}', run_name='__main__',
                       alter_sys=True)
    except SystemExit as exit_:
      code = exit_.code
  for flag in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, flag)
  flags.FLAGS.unparse_flags()
  print(f'\\0{name}\\0{code}\\0{out.getvalue()}', end='')
"""


def test_help_of_every_experiment_lists_its_fields():
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu')
  done = subprocess.run([sys.executable, '-c', HELPS, *EXPERIMENTS], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  parts = done.stdout.split('\0')[1:]
  helps = {name: (code, output) for name, code, output in zip(
      parts[0::3], parts[1::3], parts[2::3])}
  assert list(helps) == list(EXPERIMENTS), done.stdout
  for name, (code, output) in helps.items():
    # absl exits with 1 after --help.
    assert code in ('0', '1') and '--config:' in output, output
    help_text = ' '.join(output.split())
    for field in cli.config_fields(str(REPO / EXPERIMENTS[name])):
      assert f'{field.name} = ' in help_text, (name, field.name)
      assert ' '.join(field.help.split())[:30] in help_text, (name, field)


def _launch(tmp_path, *args):
  """Runs `cli.launch` as a program whose `run` writes what it was given."""
  script = ('import sys\n'
            'from experiments import cli\n'
            'def run(config, output_dir):\n'
            '  with open(output_dir, "w") as f:\n'
            '    f.write(repr((config.epsilon, config.num_epochs)))\n'
            'cli.launch(run, "configs/quickstart.py", "A test",\n'
            f'           output_dir={str(tmp_path / "default")!r})\n')
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-c', script, *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=120)


def test_launch_passes_the_config_and_output_dir_and_refuses_strays(
    tmp_path):
  out = tmp_path / 'given'
  done = _launch(tmp_path, '--config.epsilon=3.5', f'--output_dir={out}')
  assert done.returncode == 0, done.stderr
  default_epochs = cli._load(str(REPO / 'configs/quickstart.py')).num_epochs
  assert out.read_text() == repr((3.5, default_epochs))
  assert not (tmp_path / 'default').exists()

  done = _launch(tmp_path, 'stray')
  assert done.returncode != 0 and 'unexpected arguments' in done.stderr
  assert not (tmp_path / 'default').exists()
  assert _launch(tmp_path).returncode == 0
  assert (tmp_path / 'default').read_text().startswith('(')
