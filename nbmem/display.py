"""Showing results: an ipywidgets view in notebooks, HTML and text everywhere else.

Every rich output carries a ``text/plain`` fallback with the same facts, so a
terminal, an nbclient run or a frontend without a widget manager loses nothing.
Never touches ``torch.cuda``.
"""

from __future__ import annotations

import html
import io
from typing import Any

from . import _env
from .results import History, MemoryResult, report_html, stacked_bar_html

__all__ = ["show_result", "show_line", "show_history", "show_timeline", "report_widget", "history_figure", "timeline_figure"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _publish(bundle: dict[str, Any]) -> None:
    from IPython.display import display

    display(bundle, raw=True)


def report_widget(result: MemoryResult, *, breakdown: bool = False) -> Any:
    """An ipywidgets view of one result: the capacity bar and summary, details folded."""
    import ipywidgets as widgets

    bar = widgets.HTML(value=report_html(result).split("<table", 1)[0] + "</div>")
    bar.add_class("nbmem-bar-widget")
    children = [bar]
    if breakdown and result.breakdown is not None:
        categories = widgets.HTML(value=stacked_bar_html(list(result.breakdown.at_peak), "nbmem-breakdown") + "</div>")
        categories.add_class("nbmem-breakdown-widget")
        children.append(categories)
    details = widgets.HTML(value="<pre style='font-size:12px'>" + html.escape(result.text(breakdown=breakdown)) + "</pre>")
    folded = widgets.Accordion(children=[details], titles=("details",), selected_index=None)
    summary = widgets.HTML(value=f"<span style='font-size:12px'>{html.escape(result.summary())}</span>")
    view = widgets.VBox([*children, summary, folded])
    view.add_class("nbmem-report-widget")
    return view


def show_result(result: MemoryResult, *, text: bool = False, breakdown: bool = False, shell: Any = None) -> None:
    """Display one result: a widget where one can render, else HTML and text.

    ``text=True`` shows only the plain-text report; ``breakdown=True`` adds
    what the memory at the peak was for.
    """
    plain = result.text(breakdown=breakdown)
    if text:
        _publish({"text/plain": plain})
        return
    bundle = {"text/plain": plain, "text/html": report_html(result, breakdown=breakdown)}
    if _env.widgets_usable(shell):
        view = report_widget(result, breakdown=breakdown)
        widget_view = view._repr_mimebundle_()[WIDGET_MIME]
        bundle = {WIDGET_MIME: widget_view, **bundle}
    _publish(bundle)


def show_line(result: MemoryResult) -> None:
    """Display the one-line summary ``%gpumem on`` prints after each cell."""
    line = result.summary()
    colour = "#b00020" if result.failed else "#555"
    _publish(
        {
            "text/plain": line,
            "text/html": f"<div class='nbmem-line' style='font-size:12px;color:{colour}'>{html.escape(line)}</div>",
        }
    )


def history_figure(history: History) -> Any:
    """A matplotlib Figure of a history: per cell, what was in use before and its peak on top."""
    from matplotlib.figure import Figure

    results = list(history)
    figure = Figure(figsize=(max(5.0, 0.6 * len(results) + 2), 3.4), layout="constrained")
    axes = figure.add_subplot()
    labels = [
        f"[{r.execution_count}] {_short(r.label)}" if r.execution_count is not None else _short(r.label)
        for r in results
    ]
    positions = list(range(len(results)))
    # Plot in one binary unit so the ticks fall on round values (1, 2, 5 MiB...).
    top = max((r.peak_allocated for r in results), default=0)
    exponent = max(0, min(4, (max(top, 1).bit_length() - 1) // 10))
    unit, scale = ("B", "KiB", "MiB", "GiB", "TiB")[exponent], 1024**exponent
    before = [max(r.allocated_before, 0) / scale for r in results]
    peaks = [max(r.peak, 0) / scale for r in results]
    axes.bar(positions, before, color="#8d99ae", label="allocated before the cell")
    axes.bar(positions, peaks, bottom=before, color="#e76f51", label="cell's peak above that")
    for position, result in zip(positions, results):
        if result.failed:
            axes.annotate("failed", (position, result.peak_allocated / scale), ha="center", va="bottom", color="#b00020")
    axes.set_xticks(positions, labels, rotation=30, ha="right", fontsize=8)
    modes = sorted({f"{r.mode} on {r.device}" for r in results})
    axes.set_ylabel(f"allocated ({unit})")
    axes.set_title(f"gpumem history: peak allocated per cell ({', '.join(modes) or 'no cells'})", fontsize=10)
    axes.legend(fontsize=8, loc="upper left")
    return displayable(figure)


def timeline_figure(timeline: Any) -> Any:
    """Stacked live memory per category through a block, the peak marked with its op and module."""
    from matplotlib.figure import Figure

    from .results import _COLOURS

    figure = Figure(figsize=(7, 3.4), layout="constrained")
    axes = figure.add_subplot()
    top = max(timeline.peak_bytes, 1)
    exponent = max(0, min(4, (top.bit_length() - 1) // 10))
    unit, scale = ("B", "KiB", "MiB", "GiB", "TiB")[exponent], 1024**exponent
    names = [name for name, values in timeline.series if any(values)]
    values = [[value / scale for value in dict(timeline.series)[name]] for name in names]
    if names:
        axes.stackplot(timeline.steps, values, labels=names, colors=[_COLOURS[name] for name in names], step="post")
    axes.axvline(timeline.peak_step, color="#b00020", linewidth=0.8)
    where = f"{timeline.peak_op or ''}{' in ' + timeline.peak_module if timeline.peak_module else ''}"
    axes.annotate(
        f"peak {timeline.peak_bytes / scale:.3g} {unit}\n{where}",
        (timeline.peak_step, timeline.peak_bytes / scale),
        xytext=(6, -4),
        textcoords="offset points",
        va="top",
        fontsize=8,
        color="#b00020",
    )
    axes.set_xlabel(f"op ({timeline.ops} in all)")
    axes.set_ylabel(f"allocated ({unit})")
    axes.set_title("gpumem timeline: live memory by category", fontsize=10)
    axes.set_xlim(0, max(timeline.ops, 1))
    axes.legend(fontsize=7, loc="upper left")
    return displayable(figure)


def show_timeline(timeline: Any) -> None:
    """Display a timeline chart, with its one-line summary as the text fallback."""
    _publish({"image/png": _figure_png(timeline_figure(timeline)), "text/plain": str(timeline)})


def comparison_figure(comparison: Any, kind: str = "lines") -> Any:
    """A sweep's chart: peak against batch size per variant, or stacked categories per configuration."""
    from matplotlib.figure import Figure

    from .results import CATEGORIES, _COLOURS

    unit, scale = comparison.unit
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    axes = figure.add_subplot()
    if kind == "lines":
        row_axis, row_values, columns, cells = comparison._grid()
        for key in columns:
            points = [(value, cells[(value, key)].peak) for value in row_values if cells.get((value, key)) is not None]
            fitted = [(value, peak / scale) for value, peak in points if peak is not None]
            if fitted:
                axes.plot(*zip(*fitted), marker="o", label=comparison._column_name(key))
            failed = [value for value, peak in points if peak is None]
            if failed:
                axes.scatter(failed, [0] * len(failed), marker="x", color="#b00020", label=f"OOM ({comparison._column_name(key)})")
        if comparison.capacity is not None:
            axes.axhline(comparison.capacity / scale, color="#b00020", linestyle="--",
                         label=f"capacity {comparison.capacity_label or ''}".strip())
        axes.set_xlabel({"world_size": "GPUs (world size)"}.get(row_axis or "", row_axis or "configuration"))
        if row_axis in ("batch_size", "world_size"):
            axes.set_xscale("log", base=2)
            axes.set_xticks(row_values, [str(value) for value in row_values])
            axes.minorticks_off()
        axes.set_ylim(bottom=0)  # from zero: differences look as large as they are
    else:
        swept = comparison.axes or tuple(axis for axis, _ in comparison.rows[0].config[:1])
        labels = [", ".join(f"{axis}={row.value(axis)}" for axis in swept) for row in comparison.rows]
        bottoms = [0.0] * len(comparison.rows)
        for name in CATEGORIES:
            heights = [
                (dict(row.result.breakdown.at_peak)[name] / scale) if row.result is not None else 0.0
                for row in comparison.rows
            ]
            if any(heights):
                axes.bar(range(len(heights)), heights, bottom=bottoms, color=_COLOURS[name], label=name)
                bottoms = [bottom + height for bottom, height in zip(bottoms, heights)]
        axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    per_gpu = " per GPU" if any(row.value("world_size") != 1 for row in comparison.rows) else ""
    axes.set_ylabel(f"peak allocated{per_gpu} ({unit})")
    axes.set_title(f"gpumem sweep ({comparison.mode})", fontsize=10)
    axes.legend(fontsize=7)
    return displayable(figure)


def _short(text: str, width: int = 28) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def displayable(figure: Any) -> Any:
    """Give a Figure made without pyplot its own PNG repr, so a notebook shows it.

    IPython draws matplotlib figures only once ``%matplotlib inline`` (or
    pyplot) registered a formatter; nbmem's charts must show without that. A
    registered formatter still takes precedence, so nothing is drawn twice.
    """
    figure._repr_png_ = lambda: _figure_png(figure)
    return figure


def _figure_png(figure: Any) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


def show_history(history: History, *, text: bool = False) -> None:
    """Display the history table and, when there is something to chart, its bar chart."""
    if text or not len(history):
        _publish({"text/plain": str(history)})
        return
    _publish({"text/plain": str(history), "text/html": history._repr_html_()})
    _publish(
        {
            "image/png": _figure_png(history_figure(history)),
            "text/plain": f"<bar chart: peak allocated of {len(history)} measured cells>",
        }
    )


def show_value(value: Any) -> None:
    """Display a cell's last value when the magic's own return slot holds the result (``-o``)."""
    from IPython.display import display

    display(value)
