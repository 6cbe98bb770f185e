"""Every relative link of README.md and of the pages under docs/ resolves.

A link `[text](path)` or `[text](path#anchor)` that is not a URL must name a
file or folder of the repository, relative to the page; its `#anchor`, and a
link `(#anchor)` within the page, must be a heading of the target page as
GitHub renders it (lower case, punctuation dropped, spaces as hyphens).
Links inside code (fenced blocks, inline spans) are not links.
"""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(
    [os.path.join(ROOT, 'README.md'),
     os.path.join(ROOT, 'benchmarks', 'README.md')] +
    glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))

FENCE = re.compile(r'^ *```.*?^ *```', re.S | re.M)
INLINE = re.compile(r'`[^`\n]*`')
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
HEADING = re.compile(r'^#{1,6} +(.+?) *#* *$', re.M)


def _prose(text: str) -> str:
  """The page without its code, which holds no links."""
  return INLINE.sub('', FENCE.sub('', text))


def slug(heading: str) -> str:
  """The anchor GitHub gives a heading."""
  heading = re.sub(r'`|\*\*|__', '', heading).strip().lower()
  heading = re.sub(r'[^\w\- ]', '', heading)
  return heading.replace(' ', '-')


def anchors(path: str) -> set[str]:
  """The anchors of a page's headings (GitHub numbers repeated ones)."""
  with open(path) as f:
    text = FENCE.sub('', f.read())
  found, seen = set(), {}
  for heading in HEADING.findall(text):
    base = slug(heading)
    count = seen.get(base, 0)
    found.add(base if count == 0 else f'{base}-{count}')
    seen[base] = count + 1
  return found


def broken_links(page: str) -> list[str]:
  """The relative links of `page` that resolve to nothing, one line each."""
  with open(page) as f:
    text = f.read()
  name = os.path.relpath(page, ROOT)
  found = []
  for target in LINK.findall(_prose(text)):
    if re.match(r'[a-z][a-z0-9+.-]*:', target):       # http:, mailto:
      continue
    path, _, anchor = target.partition('#')
    resolved = (os.path.normpath(os.path.join(os.path.dirname(page), path))
                if path else page)
    if not os.path.exists(resolved):
      found.append(f'{name}: ({target}): no file {path}')
    elif anchor and resolved.endswith('.md') and (
        anchor not in anchors(resolved)):
      found.append(f'{name}: ({target}): no heading #{anchor} in {path or name}')
  return found


def test_every_relative_link_resolves():
  assert [line for page in PAGES for line in broken_links(page)] == []


def test_links_are_read():
  readme = os.path.join(ROOT, 'README.md')
  with open(readme) as f:
    targets = LINK.findall(_prose(f.read()))
  assert 'docs/algorithms.md' in targets
  assert any('#' in target for target in targets)
  assert slug('Users as the privacy unit (paper 002\'s baseline)') == (
      'users-as-the-privacy-unit-paper-002s-baseline')
  assert slug('Long work: progress on stderr, and the on-disk cache') == (
      'long-work-progress-on-stderr-and-the-on-disk-cache')


@pytest.mark.parametrize('original, broken', [
    ('](docs/algorithms.md)', '](docs/algorithm.md)'),        # a file
    ('](docs/algorithms.md#diff2-across-clients-paper-003)',  # an anchor
     '](docs/algorithms.md#diff2-across-clients)'),
])
def test_a_broken_link_in_a_copy_of_the_readme_fails(tmp_path, original,
                                                      broken):
  with open(os.path.join(ROOT, 'README.md')) as f:
    text = f.read()
  assert original in text
  # The copy sits where its relative links resolve: beside docs/.
  copy = tmp_path / 'README.md'
  os.symlink(os.path.join(ROOT, 'docs'), tmp_path / 'docs')
  copy.write_text(text.replace(original, broken, 1))
  os.symlink(os.path.join(ROOT, 'benchmarks'), tmp_path / 'benchmarks')
  found = broken_links(str(copy))
  assert len(found) == 1, found
