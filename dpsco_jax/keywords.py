"""Keyword names of the public API: old spellings and "did you mean".

One idea has one keyword across the library: `clipping_method=` is the
clipping path ('auto', 'ghost' or 'vmap') everywhere, `method=` the
accounting method ('pld', 'rdp', ...) everywhere, `l2_clip=` the clip norm,
`epsilon=`/`delta=` the privacy target, `noise_multiplier=` the noise.
The public builders are wrapped by `checked`, which

* accepts a keyword's old spelling for a deprecation period, moving it to
  the new name with a `DeprecationWarning` that says which version removes
  it (`clipped_grad_sum(method='vmap')` is `clipping_method='vmap'`);
* answers a keyword the function does not take with a `TypeError` that
  names the one meant: the spellings of other libraries (`l2_norm_clip=`
  of optax.contrib and TF Privacy, Opacus' `max_grad_norm=`, `eps=`,
  `noise_scale=`) and close misspellings (`difflib`);
* refuses a clipping path given as the accounting method
  (`plans.dpsgd(method='vmap')`), naming `clipping_method=`.

Calls with the function's own keywords go straight through: the check
costs one set difference per call, at build time (never inside a step).

    @keywords.checked(renamed={'method': 'clipping_method'})
    def clipped_grad_sum(loss_fn, l2_clip, *, clipping_method='auto'): ...
"""

import difflib
import functools
import inspect
import warnings
from typing import Any, Callable, Mapping, Optional, TypeVar

# The release that drops the old spellings `checked(renamed=...)` accepts.
REMOVED_IN = '0.3.0'

# The clipping paths (`clipping.METHODS`), repeated here so that this module
# imports nothing of the library (every module may use it).
CLIPPING_METHODS = ('auto', 'vmap', 'ghost')

# Keywords of other libraries, or common guesses, and the names meant here
# (the first one the function takes), with where the spelling comes from.
FOREIGN: Mapping[str, tuple[tuple[str, ...], str]] = {
    'l2_norm_clip': (('l2_clip', 'grad_clip'),
                     'optax.contrib and TF Privacy call the clip norm '
                     'l2_norm_clip'),
    'max_grad_norm': (('l2_clip', 'grad_clip'),
                      'Opacus calls the clip norm max_grad_norm'),
    'clip_norm': (('l2_clip', 'grad_clip'), 'the per-example clip norm'),
    'clipping_norm': (('l2_clip', 'grad_clip'), 'the per-example clip norm'),
    'max_norm': (('l2_clip', 'grad_clip'), 'the per-example clip norm'),
    'eps': (('epsilon',), 'the privacy target is epsilon='),
    'target_epsilon': (('epsilon',), 'the privacy target is epsilon='),
    'target_delta': (('delta',), 'the privacy target is delta='),
    'noise_scale': (('noise_multiplier', 'noise_multipliers'),
                    'the noise standard deviation over the sensitivity'),
    'sigma': (('noise_multiplier', 'noise_multipliers'),
              'the noise standard deviation over the sensitivity'),
    'noise_std': (('noise_multiplier', 'noise_multipliers'),
                  'the noise is given relative to the sensitivity'),
    'accounting_method': (('method',), 'method= is the accounting method'),
    'accountant': (('method',), 'method= is the accounting method '
                   "('pld', 'rdp', ...)"),
    'clipping': (('clipping_method',), "the clipping path: 'auto', 'ghost' "
                 "or 'vmap'"),
    'lr': (('learning_rate',), 'the step size'),
    'dataset_size': (('num_examples',), 'the training set size'),
    'sample_rate': (('batch_size',),
                    'plans take the expected batch size (q = batch_size / '
                    'num_examples)'),
    'num_epochs': (('epochs',), 'passes over the data'),
}

F = TypeVar('F', bound=Callable[..., Any])


def _accepted(fn: Callable[..., Any]) -> tuple[frozenset, bool]:
  """The keyword names `fn` takes, and whether it takes `**kwargs`."""
  parameters = inspect.signature(fn).parameters.values()
  names = frozenset(p.name for p in parameters if p.kind in (
      p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
  return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _suggestion(name: str, accepted: frozenset) -> Optional[str]:
  """'did you mean x=?' for an unknown keyword, or None."""
  if name in FOREIGN:
    targets, why = FOREIGN[name]
    for target in targets:
      if target in accepted:
        return f'did you mean {target}=? ({why})'
  close = difflib.get_close_matches(name, sorted(accepted), n=2, cutoff=0.75)
  if close:
    return 'did you mean ' + ' or '.join(f'{c}=' for c in close) + '?'
  return None


def _unknown_keywords(where: str, unknown: list[str],
                      accepted: frozenset) -> TypeError:
  lines = []
  for name in unknown:
    hint = _suggestion(name, accepted)
    lines.append(f'{where} got an unexpected keyword argument {name!r}'
                 + (f'; {hint}' if hint else ''))
  if not all(_suggestion(name, accepted) for name in unknown):
    lines.append(f'{where} takes: ' + ', '.join(
        f'{name}=' for name in sorted(accepted)))
  return TypeError('\n'.join(lines))


def _renamed(where: str, kwargs: dict, renamed: Mapping[str, str],
             stacklevel: int) -> dict:
  """`kwargs` with old spellings moved to their new names (warned)."""
  kwargs = dict(kwargs)
  for old, new in renamed.items():
    if old not in kwargs:
      continue
    if new in kwargs:
      raise TypeError(f'{where} got both {new}= and {old}=, its old '
                      f'spelling: give {new}= only')
    warnings.warn(
        f'{where}: {old}= is now {new}= (the same values); {old}= is '
        f'deprecated and stops working in dpsco_jax {REMOVED_IN}',
        DeprecationWarning, stacklevel=stacklevel + 1)
    kwargs[new] = kwargs.pop(old)
  return kwargs


def _check_values(where: str, kwargs: Mapping[str, Any],
                  accepted: frozenset) -> None:
  """Refuses a clipping path given as the accounting method."""
  value = kwargs.get('method')
  if ('clipping_method' in accepted and isinstance(value, str) and
      value in CLIPPING_METHODS):
    raise ValueError(
        f"{where}: method={value!r} is a clipping path, but method= is the "
        "accounting method ('pld', 'rdp', ...); did you mean "
        f'clipping_method={value!r}?')


def checked(fn: Optional[F] = None, *,
            renamed: Optional[Mapping[str, str]] = None,
            home: Optional[str] = None) -> Any:
  """Wraps a public function: old keyword spellings and "did you mean".

  Use it bare (`@checked`) or with the renamed keywords
  (`@checked(renamed={'old': 'new'})`). The wrapper has the function's
  signature and docstring (`functools.wraps`); a call whose keywords the
  function takes runs it directly.

  Example:
    >>> @checked(renamed={'method': 'clipping_method'})
    ... def clipped(loss_fn, l2_clip, *, clipping_method='auto'):
    ...   return clipping_method
    >>> clipped(None, 1.0, method='vmap')    # DeprecationWarning
    'vmap'
    >>> clipped(None, l2_norm_clip=1.0)
    Traceback (most recent call last):
    TypeError: clipped() got an unexpected keyword argument 'l2_norm_clip'; did you mean l2_clip=? (...)

  Args:
    fn: the function (or a class's `__init__`).
    renamed: old keyword -> new keyword, accepted with a
      `DeprecationWarning` until `REMOVED_IN`.
    home: the module users reach the function through, as the messages
      name it (`'user_level'` for `user_level.phased_sgd()`); default: the
      module that defines it.

  Returns:
    The wrapped function (or, without `fn`, the decorator).

  Raises:
    TypeError: (from the wrapper) for a keyword the function does not take,
      with the keyword meant; for a keyword given under both spellings.
    ValueError: (from the wrapper) for a clipping path given as `method=`
      to a function that also takes `clipping_method=`.
  """
  if fn is None:
    return lambda f: checked(f, renamed=renamed, home=home)
  renamed = dict(renamed or {})
  accepted, takes_any = _accepted(fn)
  name = fn.__qualname__
  if name.endswith('.__init__'):
    name = name[:-len('.__init__')]
  module = home or fn.__module__.rsplit('.', 1)[-1]
  where = f'{name}()' if module in ('dpsco_jax', '__main__') else (
      f'{module}.{name}()')

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if kwargs.keys() - accepted:
      kwargs = _renamed(where, kwargs, renamed, stacklevel=2)
      unknown = [] if takes_any else sorted(kwargs.keys() - accepted)
      if unknown:
        raise _unknown_keywords(where, unknown, accepted)
    if 'method' in kwargs:
      _check_values(where, kwargs, accepted)
    return fn(*args, **kwargs)

  wrapper.renamed_keywords = renamed
  return wrapper


def is_checked(fn: Callable[..., Any]) -> bool:
  """Whether `fn` (or a class's `__init__`) is wrapped by `checked`.

  Example:
    >>> is_checked(dpsco_jax.plans.dpsgd)
    True

  Args:
    fn: a function or a class.

  Returns:
    True when its keywords are checked.
  """
  target = fn.__init__ if inspect.isclass(fn) else fn
  return hasattr(target, 'renamed_keywords')
