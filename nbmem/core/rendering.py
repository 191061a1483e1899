"""How results are written: tables of text, a byte bar in HTML, a cell's first line, seconds.

Plain functions of strings and numbers, shared by the results (:mod:`nbmem.core.results`) and the frontends that
show them; they know nothing of what a result is.
"""

from __future__ import annotations

from typing import Sequence

from .charts import COLOURS
from .units import format_bytes

__all__ = ["stacked_bar_html", "text_table", "format_seconds", "first_line", "shorten"]


def stacked_bar_html(segments: list[tuple[str, int]], css_class: str, *, always: tuple[str, ...] = ()) -> str:
    """A horizontal bar of named byte segments, and its legend (segments of 0 B left out)."""
    total = sum(size for _, size in segments) or 1
    bar = "".join(
        f'<div class="nbmem-seg nbmem-seg-{name.replace(" ", "-")}" title="{name}: {format_bytes(size)}"'
        f' style="width:{100 * size / total:.3f}%;background:{COLOURS[name]}"></div>'
        for name, size in segments
        if size > 0
    )
    legend = " ".join(
        f'<span style="white-space:nowrap"><span style="display:inline-block;width:0.8em;height:0.8em;'
        f'background:{COLOURS[name]};margin-right:0.25em"></span>{name} {format_bytes(size)}</span>'
        for name, size in segments
        if size > 0 or name in always
    )
    return (
        f'<div class="{css_class}" style="display:flex;height:14px;border:1px solid #888;margin:4px 0">{bar}</div>'
        f"<div style='font-size:12px'>{legend}"
    )


def text_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns two spaces apart, a dashed rule under the header."""
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def format_seconds(seconds: float) -> str:
    """Seconds as a result shows them; NaN (a file that recorded no time) as "time not recorded"."""
    return f"{seconds:.3g} s" if seconds == seconds else "time not recorded"


def first_line(source: str) -> str:
    r"""The first non-blank line of a cell, stripped: how nbmem labels a cell; a cell magic's line (``%%time``)
    only where nothing else is there.

    >>> first_line("\n  loss.backward()\nopt.step()")
    'loss.backward()'
    >>> first_line("%%time\ntrain(64)")
    'train(64)'
    """
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    return next((line for line in lines if not line.startswith("%%")), lines[0] if lines else "")


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the last one an ellipsis when cut."""
    return text if len(text) <= width else text[: width - 1] + "…"
