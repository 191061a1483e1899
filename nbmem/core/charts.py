"""Charts: matplotlib figures of a history, a timeline and a sweep, made without pyplot.

The bottom of the house beside :mod:`nbmem.core.units`: results, timelines and
comparisons draw themselves through it (their ``plot()``), and the display
shows what it draws. It reads the objects it is given by their attributes and
imports nothing of nbmem's but units; matplotlib only when a figure is made.
"""

from __future__ import annotations

import io
from typing import Any

__all__ = ["COLOURS", "history_figure", "timeline_figure", "comparison_figure", "displayable", "figure_png"]

#: One colour per memory category and per part of a report's bar.
COLOURS = {
    "before": "#8d99ae",
    "cell peak": "#e76f51",
    "cached": "#f4d58d",
    "free": "#e9ecef",
    "parameter": "#264653",
    "buffer": "#6d597a",
    "optimizer state": "#2a9d8f",
    "gradient": "#e9c46a",
    "activation": "#e76f51",
    "kv cache": "#457b9d",
    "other": "#adb5bd",
    # what a loaded snapshot's frames can tell (nbmem.core.snapshot)
    "backward": "#e9c46a",
    "before the trace": "#8d99ae",
    "unknown": "#adb5bd",
}


def history_figure(history: Any) -> Any:
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

    figure = Figure(figsize=(7, 3.4), layout="constrained")
    axes = figure.add_subplot()
    top = max(timeline.peak_bytes, 1)
    exponent = max(0, min(4, (top.bit_length() - 1) // 10))
    unit, scale = ("B", "KiB", "MiB", "GiB", "TiB")[exponent], 1024**exponent
    names = [name for name, values in timeline.series if any(values)]
    values = [[value / scale for value in dict(timeline.series)[name]] for name in names]
    if names:
        axes.stackplot(timeline.steps, values, labels=names, colors=[COLOURS[name] for name in names], step="post")
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


def comparison_figure(comparison: Any, kind: str = "lines") -> Any:
    """A sweep's chart: peak against the context length (when swept), else the batch size, one line per
    variant, the capacity as a line; or stacked categories per configuration."""
    from matplotlib.figure import Figure

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
        axes.set_xlabel({"world_size": "GPUs (world size)", "prompt_length": "context length (prompt tokens)"}.get(
            row_axis or "", row_axis or "configuration"))
        if row_axis in ("batch_size", "world_size", "prompt_length"):
            axes.set_xscale("log", base=2)
            axes.set_xticks(row_values, [str(value) for value in row_values])
            axes.minorticks_off()
        axes.set_ylim(bottom=0)  # from zero: differences look as large as they are
    else:
        swept = comparison.axes or tuple(axis for axis, _ in comparison.rows[0].config[:1])
        labels = [", ".join(f"{axis}={row.value(axis)}" for axis in swept) for row in comparison.rows]
        bottoms = [0.0] * len(comparison.rows)
        shown = [row.result for row in comparison.rows if row.result is not None]
        for name in [name for name, _ in shown[0].breakdown.at_peak] if shown else []:  # in CATEGORIES order
            heights = [
                (dict(row.result.breakdown.at_peak)[name] / scale) if row.result is not None else 0.0
                for row in comparison.rows
            ]
            if any(heights):
                axes.bar(range(len(heights)), heights, bottom=bottoms, color=COLOURS[name], label=name)
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
    figure._repr_png_ = lambda: figure_png(figure)
    return figure


def figure_png(figure: Any) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer)
    return buffer.getvalue()


