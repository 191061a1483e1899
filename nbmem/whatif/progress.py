"""Progress of long what-ifs: which configuration or trial runs, how many remain, what each finished one gave.

A sweep of 72 configurations takes about 50 s and a batch-size search with
real trials minutes (issue 15): :class:`Progress` shows the work while it
runs, where someone can see it, and nowhere else:

- in a Jupyter kernel with ipywidgets: one widget (a bar, the running line,
  the finished ones), published with the widget's mime type only. It carries
  no ``text/plain`` on purpose: a notebook run by nbclient (``nbmem profile``,
  the notebook tests) keeps exactly the text outputs it had without it, and a
  frontend without a widget manager shows nothing of it. Its last state (done,
  or interrupted) stays on the page;
- on a terminal (``sys.stderr`` is a TTY): one status line, rewritten with
  ``\\r`` and erased when the work ends, so the screen afterwards holds what
  it held without it;
- elsewhere (a pipe, a log file, pytest's capture, ``progress=False``): nothing.

Why not tqdm: it is no dependency of nbmem's (torch, ipython, ipywidgets,
matplotlib), and its notebook bar is itself an ipywidgets view; nbmem's own
widget shows what a what-if needs beside a count (each finished
configuration's peak or OOM) in the style of its other reports, for no new
dependency.

It is updated once per configuration or trial (and once per finished rank),
never per op, so its cost is a few widget messages against seconds of work.
It holds strings only, never a user's tensor, and never raises into the call
it reports on: a view that fails is turned off with one warning.

>>> with Progress("gpumem sweep, estimated", 2, enabled=True) as shown:   # no kernel, no TTY here: shows nothing
...     shown.begin("batch_size=8")
...     shown.done("peak 7 KiB allocated")
>>> shown.finished, shown.summary()
(1, 'gpumem sweep, estimated: done: 1 of 2 configurations')
"""

from __future__ import annotations

import contextlib
import html
import shutil
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Protocol

from ..core import _env

__all__ = ["Progress", "check_progress"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def check_progress(progress: Any) -> bool:
    """``progress=`` takes True or False only (a string such as ``"no"`` would read as True).

    >>> check_progress(False)
    False
    >>> check_progress(0)
    Traceback (most recent call last):
    ...
    ValueError: progress=0 is not a bool: pass progress=True (show which configuration runs, where it can be seen) or progress=False (show nothing)
    """
    if not isinstance(progress, bool):
        raise ValueError(
            f"progress={progress!r} is not a bool: pass progress=True (show which configuration runs, where it can "
            "be seen) or progress=False (show nothing)"
        )
    return progress


class _View(Protocol):
    def show(self, progress: Progress) -> None: ...

    def close(self, progress: Progress) -> None: ...


class Progress:
    """The state of one long call, and the view that shows it (a widget, a terminal line, or none).

    ``total`` is the number of items planned (None for a search, whose length
    is not known ahead). :meth:`begin` starts an item (``unit`` names it:
    "configuration", "estimate", "real trial"), :meth:`note` adds how the
    running item is going (ranks finished), :meth:`done` says what it gave.
    Used as a context manager, it closes the view on the way out; an
    exception (Ctrl-C included) marks it interrupted and goes on unchanged.
    """

    def __init__(self, title: str, total: int | None, *, unit: str = "configuration", enabled: bool = True,
                 shell: Any = None) -> None:
        self.title = title
        self.total = total
        self.unit = unit
        self.finished = 0
        self.running: str | None = None  # "configuration 5 of 12: batch_size=64, precision=bf16"
        self.status = ""  # how the running item is going
        self.results: list[str] = []  # "batch_size=8: peak 7 KiB allocated", one per finished item
        self.interrupted = False
        self._cut: KeyboardInterrupt | None = None  # the Ctrl-C that stopped the work (see attempt())
        self.started = time.perf_counter()
        self._counts: dict[str, int] = {}
        self._label = ""
        self._view: _View | None = _choose_view(shell) if enabled else None
        self._refresh()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        if kind is not None:
            self.interrupted = True
        self.close()

    def begin(self, label: str, unit: str | None = None) -> None:
        """An item starts: ``label`` names it (its knobs); ``unit=""`` shows the label alone."""
        unit = self.unit if unit is None else unit
        self._counts[unit] = self._counts.get(unit, 0) + 1
        number = self._counts[unit]
        of = f" of {self.total}" if self.total is not None and unit == self.unit else ""
        self.running = f"{unit} {number}{of}: {label}" if unit else label
        self._label = label
        self.status = ""
        self._refresh()

    def note(self, status: str) -> None:
        """How the running item is going (``"1 of 2 ranks finished"``)."""
        self.status = status
        self._refresh()

    def ranks(self, finished: int, world_size: int) -> None:
        """A launch's hook: ``finished`` of ``world_size`` ranks have ended well."""
        self.note(f"{finished} of {world_size} ranks finished")

    def done(self, outcome: str) -> None:
        """The running item ended with ``outcome`` ("peak 12 MiB allocated, tracked", "OOM")."""
        self.finished += 1
        self.results.append(f"{self._label}: {outcome}")
        self.running = None
        self.status = ""
        self._refresh()

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around one item's run: remembers the Ctrl-C that stops it, before its cleanup (``finally``) runs.

        A second Ctrl-C raised during that cleanup is then told apart from the
        first by :meth:`first_interrupt`, and goes through: it interrupts for real.
        """
        try:
            yield
        except KeyboardInterrupt as error:
            if self._cut is None:
                self._cut = error
            raise

    def first_interrupt(self, error: KeyboardInterrupt) -> bool:
        """True (and marked interrupted) for the Ctrl-C that stopped the work, False for a second one."""
        if self._cut is not None and error is not self._cut:
            return False
        self.interrupted = True
        return True

    @property
    def remaining(self) -> int | None:
        return None if self.total is None else max(self.total - self.finished, 0)

    def headline(self) -> str:
        """The running line: what runs now, and how many remain."""
        if self.running is None:
            return self.summary()
        status = f" ({self.status})" if self.status else ""
        remaining = f"; {self.finished} done, {self.remaining} remaining" if self.remaining is not None else ""
        return f"{self.title}: {self.running}{status}{remaining}"

    def summary(self) -> str:
        """The last line: how much was done, and whether the work was cut short."""
        ended = "interrupted after" if self.interrupted else "done:"
        if self.total is not None:
            units = self.unit if self.total == 1 else f"{self.unit}s"
            return f"{self.title}: {ended} {self.finished} of {self.total} {units}"
        counts = ", ".join(f"{count} {unit}{'s' if count != 1 else ''}" for unit, count in self._counts.items() if unit)
        return f"{self.title}: {ended.rstrip(':')}" + (f" ({counts})" if counts else "")

    def close(self) -> None:
        """Show the last state (widget) or erase the line (terminal); idempotent."""
        view, self._view = self._view, None
        if view is not None:
            self.running = None
            _safely(lambda: view.close(self))

    def _refresh(self) -> None:
        view = self._view
        if view is not None and not _safely(lambda: view.show(self)):
            self._view = None


def _safely(action: Callable[[], None]) -> bool:
    """Run a view's update; a failure turns the view off with one warning instead of failing the user's call."""
    try:
        action()
    except Exception as error:  # noqa: BLE001  # a display problem must never end a sweep (KeyboardInterrupt passes)
        warnings.warn(f"nbmem: the progress view failed ({error!r}) and is off for the rest of this call; the "
                      "work goes on", RuntimeWarning, stacklevel=3)
        return False
    return True


def _choose_view(shell: Any) -> _View | None:
    """A widget in a kernel with ipywidgets, a line on a terminal's stderr, else nothing (see the module's notes)."""
    if _env.widgets_usable(shell):
        return _WidgetView()
    if _env.frontend(shell) != "kernel" and _isatty(sys.stderr):
        return _TerminalView(sys.stderr)
    return None


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _TerminalView:
    """One status line on stderr, rewritten in place with ``\\r`` and erased at the end."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.shown = 0  # characters on the line now

    def show(self, progress: Progress) -> None:
        # a line wider than the terminal wraps, and \r then rewrites only its last part
        width = shutil.get_terminal_size((80, 24)).columns - 1
        line = progress.headline()
        line = line if len(line) <= width else line[: max(width - 1, 0)] + "…"
        self.stream.write("\r" + line + " " * max(self.shown - len(line), 0))
        self.stream.flush()
        self.shown = len(line)

    def close(self, progress: Progress) -> None:
        self.stream.write("\r" + " " * self.shown + "\r")
        self.stream.flush()
        self.shown = 0


class _WidgetView:
    """A bar, the running line and the finished items, published once and updated in place."""

    def __init__(self) -> None:
        import ipywidgets as widgets
        from IPython.display import display

        self.bar = widgets.IntProgress(value=0, min=0, max=1, bar_style="info",
                                       layout=widgets.Layout(width="16em", min_width="16em"))
        self.line = widgets.HTML()
        self.line.add_class("nbmem-progress-line")
        self.log = widgets.HTML()
        self.log.add_class("nbmem-progress-log")
        self.box = widgets.VBox([widgets.HBox([self.bar, self.line]), self.log])
        self.box.add_class("nbmem-progress")
        self.shown = 0  # finished items already in the log
        # the widget's mime type alone: no text/plain, so text outputs stay as they were (module notes)
        display({WIDGET_MIME: self.box._repr_mimebundle_()[WIDGET_MIME]}, raw=True)

    def show(self, progress: Progress) -> None:
        if progress.total is not None:
            self.bar.max = max(progress.total, 1)
            self.bar.value = progress.finished
        else:
            self.bar.layout.display = "none"  # a search: no count to fill
        self.line.value = f"<div style='font-size:12px;line-height:1.4'>{html.escape(progress.headline())}</div>"
        if len(progress.results) != self.shown:
            self.shown = len(progress.results)
            items = "".join(f"<div>{html.escape(result)}</div>" for result in progress.results)
            self.log.value = (f"<div style='font-size:12px;line-height:1.4;color:#555;max-height:10em;overflow-y:auto'>"
                              f"{items}</div>")

    def close(self, progress: Progress) -> None:
        self.bar.bar_style = "warning" if progress.interrupted else "success"
        self.show(progress)
        seconds = time.perf_counter() - progress.started
        self.line.value = (f"<div style='font-size:12px;line-height:1.4'>{html.escape(progress.summary())} "
                           f"in {seconds:.1f} s</div>")
