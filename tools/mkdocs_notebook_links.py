"""A mkdocs hook: links inside the notebooks' pages that mkdocs-jupyter leaves broken.

mkdocs checks the links of Markdown pages, not those in the HTML that
mkdocs-jupyter makes of a notebook, and two kinds break there:

- a notebook's link to another (``[notebook 01](01-quickstart.ipynb)``, which
  works in Jupyter and on GitHub) points at a file the site doesn't have: the
  other notebook is the page ``../01-quickstart/``;
- the page's table of contents links a heading by a slug made without the
  heading's code spans (``#2-what-is-the-memory-for``), while nbconvert's id
  keeps them (``2-what-is-the-memory-for-breakdown``): the link goes to the one
  id whose words hold the slug's in order.

Both are rewritten in the built page. ``tests/test_site.py`` checks every
link of the built notebook pages.
"""

from __future__ import annotations

import re
from typing import Any

_NOTEBOOK_LINK = re.compile(r'href="(\d\d-[\w-]+)\.ipynb(#[^"]*)?"')
_ANCHOR = re.compile(r'href="#([^"]+)"')
_ID = re.compile(r'\bid="([^"]+)"')


def on_post_page(output: str, page: Any, config: Any) -> str:
    """Rewrite the notebook page's links to other notebooks and its table of contents' anchors."""
    if not page.file.src_path.endswith(".ipynb"):
        return output
    output = _NOTEBOOK_LINK.sub(lambda link: f'href="../{link.group(1)}/{link.group(2) or ""}"', output)
    ids = set(_ID.findall(output))

    def anchor(link: re.Match[str]) -> str:
        target = link.group(1)
        if target in ids:
            return link.group(0)
        # the id's words hold the slug's in order, with the code spans' words among them
        longer = sorted(name for name in ids if _holds_in_order(name.split("-"), target.split("-")))
        return f'href="#{longer[0]}"' if len(longer) == 1 else link.group(0)

    return _ANCHOR.sub(anchor, output)


def _holds_in_order(words: list[str], wanted: list[str]) -> bool:
    """Whether ``wanted`` is ``words`` with some words left out, the first kept.

    >>> _holds_in_order("5-check-it-for-real-a-tracked-gpumem-run".split("-"), "5-check-it-for-real-a-tracked-run".split("-"))
    True
    >>> _holds_in_order(["2", "why"], ["3", "why"])
    False
    """
    if not wanted or not words or words[0] != wanted[0]:
        return False
    rest = iter(words)
    return all(word in rest for word in wanted)
