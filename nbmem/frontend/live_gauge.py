"""The live gauge: current and peak-so-far memory while a long cell runs (issue 15).

Not :mod:`nbmem.tracking.live`, which walks the garbage collector for live storages.

A daemon thread wakes every :data:`INTERVAL` seconds, reads the running
scope's counters (:meth:`MemoryScope.so_far`: the allocator's in measured
mode, the tracker's plain integers in tracked mode) and hands a
:class:`GaugeReading` to a ``show`` callable. It never runs on the per-op
path, so tracked mode's cost per op is unchanged; the thread takes the GIL a
few times a second (``benchmarks/bench_gauge.py`` measures what that costs).

The gauge never raises into the user's cell: the first exception in the
thread turns it off with one warning, and the cell runs on. It stops when
:meth:`LiveGauge.stop` is called, and by itself as soon as its scope is no
longer running (so a Ctrl-C that skips ``stop()`` still ends the thread).

>>> import nbmem, torch
>>> readings = []
>>> with nbmem.track("cpu") as scope:
...     gauge = LiveGauge(scope, readings.append, delay=0.0, interval=0.01).start()
...     kept = torch.zeros(1024, 1024)          # 4 MiB
...     while not readings or readings[-1].allocated == 0:
...         _ = gauge.thread.join(0.01)         # wait for a tick that saw it
>>> _ = gauge.stop()
>>> readings[-1].allocated, readings[-1].peak    # 1024 * 1024 * 4 bytes = 4 MiB
(4194304, 4194304)
>>> readings[-1].text().startswith("gpumem live · tracked on cpu · allocated now +4.00 MiB")
True
"""

from __future__ import annotations

import contextvars
import html
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..core.charts import COLOURS
from ..core.units import format_bytes

if TYPE_CHECKING:
    from ..tracking.scope import MemoryScope

__all__ = ["GaugeReading", "LiveGauge", "capacity_of", "virtual_label", "INTERVAL", "CELL_DELAY", "LINE_DELAY", "THREAD_NAME"]

#: Seconds between two readings: "a few times a second at most" (issue 15).
INTERVAL = 0.5
#: ``%%gpumem``: first shown at the first tick, so a shorter cell shows nothing live (no flicker).
CELL_DELAY = 0.5
#: ``%gpumem on``: the compact live line only for cells that run longer than about 2 s (issue 15).
LINE_DELAY = 2.0
#: The timer thread's name, so that a test (or a user) can find it.
THREAD_NAME = "nbmem-live-gauge"


@dataclass(frozen=True)
class GaugeReading:
    """One reading of a running cell, in bytes above what was allocated before it.

    >>> reading = GaugeReading("tracked", "cpu", allocated=3 << 20, peak=4 << 20, capacity=16 << 20, seconds=2.5)
    >>> reading.text()
    'gpumem live · tracked on cpu · allocated now +3.00 MiB · peak so far +4.00 MiB (25.0% of 16.0 MiB) · 2.5 s'
    """

    mode: str
    device: str
    allocated: int
    peak: int
    capacity: int | None
    seconds: float
    #: What the capacity is, when not the device's own: "virtual" for ``--capacity``.
    capacity_label: str = ""

    def text(self) -> str:
        """One line saying what each figure is: mode, device, allocated now and peak so far."""
        label = f"{self.capacity_label} " if self.capacity_label else ""
        share = f" ({self.peak / self.capacity:.1%} of {label}{format_bytes(self.capacity)})" if self.capacity else ""
        return (
            f"gpumem live · {self.mode} on {self.device} · allocated now {format_bytes(self.allocated, signed=True)}"
            f" · peak so far {format_bytes(self.peak, signed=True)}{share} · {self.seconds:.1f} s"
        )

    def html(self, *, compact: bool = False) -> str:
        """The line, and (unless ``compact``) a bar of now and peak against the capacity."""
        line = f"<div class='nbmem-gauge-text' style='font-size:12px;color:#555'>{html.escape(self.text())}</div>"
        if compact:
            return f"<div class='nbmem-gauge nbmem-gauge-line'>{line}</div>"
        # without a capacity the bar is scaled to the peak, and says so
        scale = self.capacity or max(self.peak, self.allocated, 1)
        now = 100 * max(self.allocated, 0) / scale
        peak = 100 * max(self.peak, 0) / scale
        bar = (
            "<div class='nbmem-gauge-bar' style='position:relative;height:10px;border:1px solid #888;margin:3px 0;"
            f"max-width:48em;background:{COLOURS['free']}'>"
            f"<div style='position:absolute;left:0;top:0;bottom:0;width:{min(now, 100):.2f}%;background:{COLOURS['cell peak']}'></div>"
            f"<div title='peak so far' style='position:absolute;top:0;bottom:0;left:{min(peak, 100):.2f}%;"
            "width:2px;background:#000'></div></div>"
        )
        scaled = "" if self.capacity else "<div style='font-size:11px;color:#777'>no device capacity known: bar scaled to the peak so far</div>"
        return f"<div class='nbmem-gauge' style='font-family:sans-serif'>{line}{bar}{scaled}</div>"


class LiveGauge:
    """A timer thread that reads a running :class:`MemoryScope` and shows each reading.

    ``show`` is called from the timer thread, at most every ``interval``
    seconds (default :data:`INTERVAL`), first after ``delay`` seconds. ``capacity`` (bytes, or None)
    is what the readings' share is of, and ``capacity_label`` what it is ("virtual").
    """

    def __init__(
        self,
        scope: "MemoryScope",
        show: Callable[[GaugeReading], None],
        *,
        capacity: int | None = None,
        capacity_label: str = "",
        delay: float = CELL_DELAY,
        interval: float | None = None,
    ) -> None:
        self.scope = scope
        self.show = show
        self.capacity = capacity
        self.capacity_label = capacity_label
        self.delay = delay
        self.interval = INTERVAL if interval is None else interval  # read now: a test may set INTERVAL
        #: How many readings were shown; read by the cell's thread after :meth:`stop`.
        self.shown = 0
        #: The exception that turned the gauge off, if one did.
        self.failure: BaseException | None = None
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> "LiveGauge":
        # the thread runs in a copy of the cell's context: ipykernel keeps the running cell's
        # message header in a context variable, and a display sent from the thread belongs to it
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=context.run, args=(self._run,), name=THREAD_NAME, daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> int:
        """Stop the thread and wait for it (idempotent); the number of readings shown.

        The wait is bounded: a ``show`` stuck in a frontend can't hang the
        cell; the thread, told to stop, ends by itself after that ``show``.
        """
        self._stop.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return self.shown

    @property
    def usable(self) -> bool:
        """Shown at least once and never failed: the cell's report may replace what it showed."""
        return self.shown > 0 and self.failure is None

    def _run(self) -> None:
        wait = self.delay
        while not self._stop.wait(wait):
            wait = self.interval
            try:
                figures = self.scope.so_far()
                if figures is None:  # the scope was stopped (a Ctrl-C may have skipped our stop())
                    return
                allocated, peak, seconds = figures
                reading = GaugeReading(
                    self.scope.mode, str(self.scope.device), allocated, peak, self.capacity, seconds, self.capacity_label
                )
                if self._stop.is_set():  # stopped while reading: the cell's report may be on its way
                    return
                self.show(reading)
                self.shown += 1
            except Exception as error:  # never into the user's cell (issue 15): one warning, gauge off
                self.failure = error
                warnings.warn(
                    f"nbmem's live gauge stopped: {type(error).__name__}: {error}. The cell runs on and its "
                    "report comes at the end as usual; `%%gpumem --no-live` turns the gauge off",
                    RuntimeWarning,
                    stacklevel=1,
                )
                return


def virtual_label(scope: "MemoryScope") -> str:
    """``"virtual"`` for a ``--capacity`` device, so a gauge never passes it off as the real one."""
    return "virtual" if scope.capacity is not None else ""


def capacity_of(scope: "MemoryScope") -> int | None:
    """What a gauge's readings are a share of: the virtual capacity, else the device's memory (where its backend says), else None.

    Read on the cell's thread when the gauge starts, not on every tick.
    """
    if scope.capacity is not None:
        return scope.capacity
    if scope.mode == "measured":
        from ..tracking.accelerators import device_counter

        return device_counter(scope.device).total_memory()
    return None
