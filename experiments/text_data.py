"""Text for the language-model experiments: vocabulary, sequences, corpora.

Text becomes token ids over a vocabulary of 96 symbols (newline, the 95
printable ASCII characters; a tab is read as a space and every other
character as '?'), small
enough for a tiny model. A corpus is cut into non-overlapping windows of
`context + 1` tokens; each window is ONE example (`{'x': ids[:-1],
'y': ids[1:]}`), so the privacy unit of a private run on it is one
sequence:

    text = text_data.read_fortunes('/usr/share/games/fortunes', ['computers'])
    data = text_data.sequences(text_data.encode(text), context=64)
    train, heldout = text_data.split(data, heldout_fraction=0.1, seed=0)

Two sources, both read from a path or made on the spot (nothing is
downloaded):

* `read_fortunes(directory, names)`: the fortune-cookie files of Debian's
  `fortunes` package (`apt-get install fortunes`; read from
  `/usr/share/games/fortunes`), by topic, so that one set of topics can be
  public text and another the private domain.
* `generated_corpus(domain, num_chars, seed)`: sentences drawn from a small
  grammar per domain ('weather' and 'kitchen'), for tests and a quick start.
"""

import os
from typing import Dict, Sequence, Tuple

import numpy as np

FORTUNES_PATH = '/usr/share/games/fortunes'
# Newline, then the printable ASCII characters ' ' (32) to '~' (126).
VOCABULARY = '\n' + ''.join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCABULARY)
_UNKNOWN = VOCABULARY.index('?')
_IDS = np.full(256, _UNKNOWN, np.int32)
for _id, _char in enumerate(VOCABULARY):
  _IDS[ord(_char)] = _id
_IDS[ord('\t')] = VOCABULARY.index(' ')  # indentation, not an unknown
_FORTUNES_HELP = (
    'Debian\'s fortunes package ships the fortune files: `apt-get install '
    'fortunes` (read from /usr/share/games/fortunes), or point the loader at '
    'any folder of plain-text files, one fortune after another with a line '
    '"%" between them')

Split = Dict[str, np.ndarray]


def encode(text: str) -> np.ndarray:
  """Token ids of `text` (int32; a tab reads as ' ', other characters outside
  `VOCABULARY` as '?').

  Example:
    >>> decode(encode('Hi!\\n'))
    'Hi!\\n'

  Args:
    text: any string.

  Returns:
    int32 [len(text)] ids in [0, VOCAB_SIZE).
  """
  codes = np.frombuffer(text.encode('utf-32-le'), np.uint32)
  return _IDS[np.minimum(codes, 255)].astype(np.int32)


def decode(ids: Sequence[int]) -> str:
  """The text of token ids (the inverse of `encode` on the vocabulary)."""
  ids = np.asarray(ids)
  if ids.size and (ids.min() < 0 or ids.max() >= VOCAB_SIZE):
    raise ValueError(f'token ids must be in [0, {VOCAB_SIZE}), got '
                     f'[{ids.min()}, {ids.max()}]')
  return ''.join(VOCABULARY[i] for i in ids)


def sequences(ids: np.ndarray, context: int) -> Split:
  """The corpus cut into non-overlapping next-token examples.

  Window i is `ids[i (T + 1) : (i + 1)(T + 1)]` with T = `context`; its
  first T tokens are the input and its last T the targets. No token is in
  two windows, so one window (one example) is the privacy unit; a tail
  shorter than a window is dropped.

  Example:
    >>> data = sequences(encode('abcdefghij'), context=4)
    >>> data['x'].shape, decode(data['y'][1])
    ((2, 4), 'ghij')

  Args:
    ids: int token ids [n].
    context: T, the tokens per example.

  Returns:
    `{'x': int32 [m, T], 'y': int32 [m, T]}`, m = n // (T + 1).

  Raises:
    ValueError: if `context` < 1 or the corpus is shorter than one window.
  """
  if context < 1:
    raise ValueError(f'context must be >= 1, got {context}')
  ids = np.asarray(ids, np.int32)
  count = len(ids) // (context + 1)
  if count == 0:
    raise ValueError(f'a corpus of {len(ids)} tokens holds no window of '
                     f'{context + 1}')
  windows = ids[:count * (context + 1)].reshape(count, context + 1)
  return {'x': windows[:, :-1].copy(), 'y': windows[:, 1:].copy()}


def split(data: Split, heldout_fraction: float, seed: int
          ) -> Tuple[Split, Split]:
  """A random (train, held-out) split of the examples.

  Example:
    >>> train, heldout = split(data, heldout_fraction=0.1, seed=0)

  Args:
    data: examples with a leading axis.
    heldout_fraction: the held-out share, in (0, 1).
    seed: seeds the permutation.

  Returns:
    `(train, heldout)`, each with at least one example.

  Raises:
    ValueError: if the fraction is outside (0, 1) or leaves a side empty.
  """
  if not 0 < heldout_fraction < 1:
    raise ValueError(f'heldout_fraction must be in (0, 1), got '
                     f'{heldout_fraction}')
  n = len(data['x'])
  heldout = int(round(n * heldout_fraction))
  if not 0 < heldout < n:
    side = 'training' if heldout else 'held-out'
    raise ValueError(f'{n} examples leave no {side} example at '
                     f'heldout_fraction={heldout_fraction}')
  order = np.random.default_rng(seed).permutation(n)
  pick = lambda rows: {k: v[rows] for k, v in data.items()}
  return pick(np.sort(order[heldout:])), pick(np.sort(order[:heldout]))


def read_fortunes(directory: str = FORTUNES_PATH,
                  names: Sequence[str] = ('fortunes',)) -> str:
  """The text of fortune files, fortunes separated by blank lines.

  Example:
    >>> text = read_fortunes('/usr/share/games/fortunes', ['computers'])

  Args:
    directory: the folder of fortune files.
    names: the files (topics) to read, in order.

  Returns:
    Their fortunes, each followed by a blank line (the "%" separator lines
    are dropped).

  Raises:
    FileNotFoundError: if a file is missing (with how to get them).
    ValueError: if `names` is empty.
  """
  if not names:
    raise ValueError('names must list at least one fortune file')
  parts = []
  for name in names:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise FileNotFoundError(f'no fortune file {path}. {_FORTUNES_HELP}')
    with open(path, encoding='utf-8', errors='replace') as f:
      lines = f.read().splitlines()
    parts.append('\n'.join('' if line == '%' else line for line in lines))
  return '\n\n'.join(parts) + '\n'


_GRAMMAR = {
    'weather': (
        ('the morning', 'by noon the sky', 'tonight the wind', 'the coast',
         'the valley', 'over the hills the cloud'),
        ('turns', 'stays', 'grows', 'looks', 'becomes'),
        ('cold and grey', 'bright and dry', 'wet with rain', 'calm',
         'foggy near the sea', 'warm in the sun'),
        ('.', ', then clears.', ' all day.', ' again.')),
    'kitchen': (
        ('chop the onions', 'stir the sauce', 'whisk two eggs',
         'melt the butter', 'rinse the rice', 'season the soup'),
        ('slowly', 'gently', 'for five minutes', 'until golden', 'well'),
        ('in a wide pan', 'over low heat', 'with a wooden spoon',
         'in a small bowl', 'with salt and pepper'),
        ('.', ' and serve.', ', then rest.', ' and taste.')),
}
DOMAINS = tuple(_GRAMMAR)


def generated_corpus(domain: str, num_chars: int, seed: int) -> str:
  """Sentences drawn from a small grammar of one domain (synthetic text).

  Each sentence picks one phrase from each of four slots at random; the
  two domains share the alphabet but not the phrases, so a model trained
  on one has something to learn on the other.

  Example:
    >>> generated_corpus('kitchen', 60, seed=0)[:20]  # doctest: +SKIP
    'Whisk two eggs gentl'

  Args:
    domain: one of `DOMAINS`.
    num_chars: the corpus length (in characters).
    seed: seeds the draws.

  Returns:
    A string of exactly `num_chars` characters, one sentence per line.

  Raises:
    ValueError: for an unknown domain or `num_chars` < 1.
  """
  if domain not in _GRAMMAR:
    raise ValueError(f'domain must be one of {DOMAINS}, got {domain!r}')
  if num_chars < 1:
    raise ValueError(f'num_chars must be >= 1, got {num_chars}')
  rng = np.random.default_rng(seed)
  slots = _GRAMMAR[domain]
  lines, length = [], 0
  while length < num_chars:
    subject, verb, rest, end = (slot[rng.integers(len(slot))]
                                for slot in slots)
    line = f'{subject.capitalize()} {verb} {rest}{end}'
    lines.append(line)
    length += len(line) + 1
  return ('\n'.join(lines) + '\n')[:num_chars]
