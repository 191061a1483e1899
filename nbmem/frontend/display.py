"""Showing results: an ipywidgets view in notebooks, HTML and text everywhere else.

Every rich output carries a ``text/plain`` fallback with the same facts, so a
terminal, an nbclient run or a frontend without a widget manager loses nothing.
Never touches ``torch.cuda``.
"""

from __future__ import annotations

import html
import uuid
from typing import Any, Protocol

from ..core import _env
from ..core.charts import figure_png, history_figure, timeline_figure
from ..core.rendering import stacked_bar_html
from ..core.results import History, MemoryResult, report_html

__all__ = ["show_result", "show_line", "show_history", "show_timeline", "report_widget", "GaugeView", "clear_gauge"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _publish(bundle: dict[str, Any], display_id: str | None = None) -> None:
    """Publish a bundle; with ``display_id``, replace what that display showed (the live gauge) instead."""
    from IPython.display import display, update_display

    if display_id is None:
        display(bundle, raw=True)
    else:
        update_display(bundle, raw=True, display_id=display_id)


class _Reading(Protocol):
    def text(self) -> str: ...
    def html(self, *, compact: bool = False) -> str: ...


class GaugeView:
    """Shows a live gauge's readings (nbmem.frontend.live_gauge) in one output, updated in place.

    Called from the gauge's timer thread: the first reading displays an
    output with a display id, later ones update it (IPython's
    ``update_display``; ipykernel sends either from any thread). At the end
    the cell's report replaces it: pass :attr:`display_id` to
    :func:`show_result` or :func:`show_line`.
    """

    def __init__(self, *, compact: bool = False) -> None:
        self.compact = compact
        self.display_id = uuid.uuid4().hex
        self._displayed = False

    def __call__(self, reading: _Reading) -> None:
        from IPython.display import display

        bundle = {"text/plain": reading.text(), "text/html": reading.html(compact=self.compact)}
        display(bundle, raw=True, display_id=self.display_id, update=self._displayed)
        self._displayed = True


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


def show_result(
    result: MemoryResult, *, text: bool = False, breakdown: bool = False, shell: Any = None, display_id: str | None = None
) -> None:
    """Display one result: a widget where one can render, else HTML and text.

    ``text=True`` shows only the plain-text report; ``breakdown=True`` adds
    what the memory at the peak was for; ``display_id`` (a :class:`GaugeView`'s)
    puts the report in place of the live gauge.
    """
    plain = result.text(breakdown=breakdown)
    if text:
        _publish({"text/plain": plain}, display_id)
        return
    bundle = {"text/plain": plain, "text/html": report_html(result, breakdown=breakdown)}
    if _env.widgets_usable(shell):
        view = report_widget(result, breakdown=breakdown)
        widget_view = view._repr_mimebundle_()[WIDGET_MIME]
        bundle = {WIDGET_MIME: widget_view, **bundle}
    _publish(bundle, display_id)


def clear_gauge(display_id: str) -> None:
    """Empty a live gauge's output where no report takes its place (the result shown as ``Out``)."""
    _publish({"text/plain": ""}, display_id)


def show_line(result: MemoryResult, *, display_id: str | None = None) -> None:
    """Display the one-line summary ``%gpumem on`` prints after each cell (in place of its live line, given its id)."""
    line = result.summary()
    colour = "#b00020" if result.failed else "#555"
    _publish(
        {
            "text/plain": line,
            "text/html": f"<div class='nbmem-line' style='font-size:12px;color:{colour}'>{html.escape(line)}</div>",
        },
        display_id,
    )


def show_timeline(timeline: Any) -> None:
    """Display a timeline chart, with its one-line summary as the text fallback."""
    _publish({"image/png": figure_png(timeline_figure(timeline)), "text/plain": str(timeline)})


def show_history(history: History, *, text: bool = False) -> None:
    """Display the history table and, when there is something to chart, its bar chart."""
    if text or not len(history):
        _publish({"text/plain": str(history)})
        return
    _publish({"text/plain": str(history), "text/html": history._repr_html_()})
    _publish(
        {
            "image/png": figure_png(history_figure(history)),
            "text/plain": f"<bar chart: peak allocated of {len(history)} measured cells>",
        }
    )


def show_value(value: Any) -> None:
    """Display a cell's last value when the magic's own return slot holds the result (``-o``)."""
    from IPython.display import display

    display(value)
