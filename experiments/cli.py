"""The command line every experiment shares: a config flag whose --help lists the fields.

`ml_collections.config_flags` shows only `--config` in `--help`; a user
then has to read the config file to learn what can be set. `define_config`
defines the same flag with the config file as its default and a help text
that lists every field, its default and its meaning, taken from the comment
lines right above the field in the config file:

    # In configs/quickstart.py:
    #   # Privacy target of each private run.
    #   config.epsilon = 2.0
    cli.define_config('configs/quickstart.py', 'Private logistic regression')

    $ python -m experiments.quickstart --help
      --config: Private logistic regression. Config file (default
        configs/quickstart.py); override a field with --config.NAME=VALUE:
          epsilon = 2.0: Privacy target of each private run.
          ...
"""

import dataclasses
import importlib.util
import os
import re
import sys
from typing import Any, Callable, Optional, Sequence

from absl import app
from absl import flags
from ml_collections import config_flags

_FIELD = re.compile(r'^\s*config\.(\w+)\s*=')
_COMMENT = re.compile(r'^\s*#\s?(.*)$')
_BASE = re.compile(r'^from configs import (\w+)$', re.M)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field.

  Attributes:
    name: the field's name (`--config.NAME`).
    default: its default value.
    help: the comment above it in the config file ('' if none).
  """

  name: str
  default: Any
  help: str


def _load(path: str) -> Any:
  spec = importlib.util.spec_from_file_location('_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def config_fields(path: str) -> list[Field]:
  """The fields of a config file, in order, with their defaults and comments.

  A field's help is its trailing comment, or else the block of comment lines
  right above it (each field has its own). A config built on another one
  (`from configs import base` ... `base.get_config()`) lists the base's
  fields first, with the base's help unless it sets its own.

  Example:
    >>> [f.name for f in config_fields('configs/quickstart.py')][:2]
    ['seed', 'epsilon']

  Args:
    path: a config file defining `get_config()`.

  Returns:
    The `Field`s of the config's top-level keys.
  """
  config = _load(path)
  helps, order = {}, []
  with open(path) as f:
    source = f.read()
  for base in _BASE.findall(source):
    if f'{base}.get_config()' in source:
      for field in config_fields(os.path.join(os.path.dirname(path),
                                              f'{base}.py')):
        helps[field.name] = field.help
        order.append(field.name)
  comment, in_comment = [], False
  for line in source.splitlines():
    match = _FIELD.match(line)
    text = _COMMENT.match(line)
    if match:
      name = match.group(1)
      trailing = line.split('#', 1)[1].strip() if '#' in line else ''
      described = trailing or ' '.join(comment)
      if described or name not in helps:
        helps[name] = described
      if name not in order:
        order.append(name)
      comment = []
    elif text:
      comment = (comment if in_comment else []) + [text.group(1).strip()]
    elif not line.strip():
      comment = []
    in_comment = bool(text)
  return [Field(name, config[name], helps.get(name, ''))
          for name in order if name in config]


def config_help(path: str, description: str) -> str:
  """The help text of the config flag: the description and every field.

  Example:
    >>> print(config_help('configs/quickstart.py', 'Quickstart'))

  Args:
    path: the config file.
    description: one line on what the experiment does.

  Returns:
    The help text.
  """
  lines = [f'{description}. Config file (default {path}); override a field '
           'with --config.NAME=VALUE:']
  for field in config_fields(path):
    lines.append(f'  {field.name} = {field.default!r}'
                 + (f': {field.help}' if field.help else ''))
  return '\n'.join(lines)


def define_config(path: str, description: str,
                  module: Optional[str] = None) -> Any:
  """Defines `--config` with `path` as default and a help listing its fields.

  Example:
    >>> config = define_config('configs/quickstart.py', 'Quickstart')

  Args:
    path: the config file, relative to the repository root (the directory
      the experiments run from) or absolute.
    description: one line on what the experiment does.
    module: the program whose --help lists the flag (default: the caller).

  Returns:
    The flag holder (`config.value` is the loaded config).
  """
  absolute = path if os.path.isabs(path) else os.path.join(REPO, path)
  holder = config_flags.DEFINE_config_file(
      'config', path, config_help(absolute, description).replace(
          absolute, path))
  # Listed under the calling program in --help (absl shows the main
  # module's flags only, and registered this one under this module).
  caller = module or sys._getframe(1).f_globals.get('__name__')  # pylint: disable=protected-access
  if caller == '__main__':
    caller = sys.argv[0]
  flags.FLAGS.register_flag_by_module(caller, flags.FLAGS['config'])
  return holder


def launch(run: Callable[[Any, str], Any], config_path: str, description: str,
           output_dir: str,
           output_help: str = 'Where to write the CSVs, plots and run record.'
           ) -> None:
  """Runs an experiment as a program: its flags, then `run(config, output_dir)`.

  Every experiment ends with the same three lines this replaces: define
  `--config` (`define_config`) and `--output_dir`, refuse stray arguments,
  call the experiment's `run`. The flags are defined only here, when the
  experiment runs as a program, so that importing experiments side by side
  (tests, notebooks) defines no flags.

  Example:
    >>> if __name__ == '__main__':
    ...   cli.launch(run, 'configs/quickstart.py', 'Private logistic '
    ...              'regression on digits', output_dir='results/quickstart')

  Args:
    run: the experiment, `run(config, output_dir)`.
    config_path: its default config file (see `define_config`).
    description: one line on what the experiment does.
    output_dir: the default of `--output_dir`.
    output_help: the help of `--output_dir`.
  """
  caller = sys._getframe(1).f_globals.get('__name__')  # pylint: disable=protected-access
  config = define_config(config_path, description, module=caller)
  output = flags.DEFINE_string('output_dir', output_dir, output_help)

  def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    run(config.value, output.value)

  app.run(main)
