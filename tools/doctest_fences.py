"""A Griffe extension for the docs site (mkdocs.yml): docstrings' ``>>>`` examples rendered as code.

nbmem's docstrings keep their examples as doctests (they run under
``--doctest-modules``). Markdown would read them as prose, and an output such
as ``[7168, 11264]`` as a link; each doctest block (from a ``>>>`` line to the
next blank line) is fenced as Python console code instead.
"""

from __future__ import annotations

from typing import Any

try:
    from griffe import Extension
except ImportError:  # without the docs extra: fenced() still works (and its doctest runs)
    Extension = object  # type: ignore[misc, assignment]


def fenced(text: str) -> str:
    r"""``text`` with each doctest block fenced.

    >>> fenced("Sizes:\n\n>>> [1][0]\n1\n\nDone.").splitlines()
    ['Sizes:', '', '```pycon', '>>> [1][0]', '1', '```', '', 'Done.']
    """
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if not inside and line.lstrip().startswith(">>>"):
            out.append("```pycon")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestFences(Extension):  # type: ignore[misc]
    """Fence the doctest blocks of every docstring Griffe loads."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fenced(obj.docstring.value)
