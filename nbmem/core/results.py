"""Result objects: plain frozen dataclasses of integers (bytes) and seconds.

A :class:`MemoryResult` is what one measured block or notebook cell produced;
:class:`History` is the list of them that ``%gpumem`` keeps. Both render
themselves as text and HTML; charts and widgets live in :mod:`nbmem.frontend.display`.
"""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator, Literal, Sequence

from .rendering import format_seconds, shorten, stacked_bar_html, text_table
from .units import format_bytes

__all__ = ["MemoryResult", "Breakdown", "report_html", "CATEGORIES", "History", "MODES", "CELL_COLUMNS", "cell_figures"]

Mode = Literal["measured", "tracked"]

#: What a byte of tracked memory is for, most specific first. A storage moves
#: only towards the front of this list: a parameter saved for backward stays a
#: parameter, a tensor autograd saves becomes an activation. "kv cache" is what a
#: generate run's KV cache holds (nbmem.estimation.tasks).
CATEGORIES = ("parameter", "buffer", "optimizer state", "gradient", "activation", "kv cache", "other")

@dataclass(frozen=True)
class Breakdown:
    """What the memory was for: by category and by top-level module, at the peak and after.

    ``at_peak`` sums to the result's ``peak_allocated``; ``after`` to its
    ``allocated_after``. Tracked: exact for the tensors nbmem saw.

    A result has one in tracked mode, or measured with ``breakdown=True``
    (``%%gpumem --breakdown``): ``result.breakdown``; every
    :class:`~nbmem.Estimate` has one too. :meth:`category` reads one
    category at the peak (see :data:`CATEGORIES`); ``op`` and ``module``
    say where the peak was.

    >>> import torch
    >>> from nbmem import MemoryScope, Tracker
    >>> with MemoryScope(tracker=Tracker("cpu")) as scope:
    ...     layer = torch.nn.Linear(16, 16)     # weight 1 KiB + bias 64 B, in 512 B blocks
    >>> breakdown = scope.result.breakdown
    >>> breakdown.category("parameter"), breakdown.category("activation")
    (1536, 0)
    """

    at_peak: tuple[tuple[str, int], ...]
    after: tuple[tuple[str, int], ...]
    modules_at_peak: tuple[tuple[str, int], ...]
    op: str | None = None
    module: str | None = None

    def category(self, name: str) -> int:
        """Bytes of category ``name`` at the peak."""
        if name not in CATEGORIES:
            raise ValueError(f"unknown category {name!r}: use one of {', '.join(CATEGORIES)}")
        return dict(self.at_peak)[name]

    def rows(self) -> list[tuple[str, str]]:
        after = dict(self.after)
        rows = [
            (name, f"{format_bytes(size)} at the peak, {format_bytes(after.get(name, 0))} after")
            for name, size in self.at_peak
            if size or after.get(name, 0)
        ]
        where = f"{self.op}" + (f" in {self.module}" if self.module else "")
        if where != "None":
            rows.append(("peak at", where))
        modules = ", ".join(f"{name} {format_bytes(size)}" for name, size in self.modules_at_peak if size)
        if modules:
            rows.append(("by module", modules))
        return rows

def allocator_of(device: str) -> str:
    """Whose counters a measurement on ``device`` read: "the CUDA caching allocator", "the mps allocator"...

    >>> allocator_of("cuda:0"), allocator_of("xpu:1")
    ('the CUDA caching allocator', 'the xpu allocator')
    """
    kind = device.partition(":")[0]
    return "the CUDA caching allocator" if kind == "cuda" else f"the {kind} allocator"


#: What each mode means, in the words every report uses.
MODES: dict[str, str] = {
    "measured": "measured by the CUDA caching allocator",
    "tracked": (
        "tracked on {device}, no CUDA device used: bytes a GPU would allocate "
        "for the same tensors (512 B rounding)"
    ),
}


@dataclass(frozen=True)
class LineUsage:
    """One line of the user's code in a result's ``lines`` (``nbmem.track(lines=True)``, ``%%gpumem --lines``).

    ``at_peak``: bytes alive at the block's peak that this line allocated;
    ``allocated``: bytes it allocated while the block ran, freed or not. A
    storage is charged to the innermost frame of the user's code when it is
    made (backward's to the ``loss.backward()`` line); ``where`` is
    ``"(alive before)"`` for what existed before the block.
    """

    where: str
    source: str
    at_peak: int
    allocated: int


def lines_table(lines: Sequence[LineUsage], limit: int = 12) -> list[str]:
    """The lines as text rows, most held at the peak first (``limit`` rows, then how many more)."""
    shown = list(lines[:limit])
    rows = text_table(
        ("line", "at the peak", "allocated", "code"),
        [(line.where, format_bytes(line.at_peak), format_bytes(line.allocated), line.source[:60]) for line in shown],
    )
    if len(lines) > limit:
        rows.append(f"... and {len(lines) - limit} more lines")
    return rows


def _device_index(device: str) -> int:
    """``"cuda:1"`` (or any accelerator's ``"xpu:1"``) -> 1; the cpu (a tracked run stands for a GPU) -> 0."""
    _, _, index = device.partition(":")
    return int(index) if not device.startswith("cpu") and index.isdigit() else 0


#: The line a result's text and HTML lead with when its figures may not be the compiled code's.
COMPILED_WARNING = {
    "eager": "EAGER FIGURES: torch.compile'd code in the block ran eagerly under tracking (see the notes)",
    "unknown": "torch.compile was first used in the block: whether its code ran compiled is not known (see the notes)",
}


@dataclass(frozen=True)
class MemoryResult:
    """The memory one cell (or one ``with nbmem.measure():`` block) used.

    All sizes are bytes. ``*_before`` is just before the block ran,
    ``*_after`` just after, ``peak_*`` the highest value while it ran.

    >>> r = MemoryResult(mode="tracked", device="cpu", allocated_before=0,
    ...                  peak_allocated=8 << 20, allocated_after=4 << 20, seconds=0.01)
    >>> r.peak, r.retained
    (8388608, 4194304)
    """

    mode: Mode
    device: str
    allocated_before: int
    peak_allocated: int
    allocated_after: int
    #: wall-clock seconds; NaN where nothing recorded time (a snapshot nbmem wrote, whose times are op counts)
    seconds: float
    #: Memory the caching allocator holds (allocated + cached free blocks);
    #: None where nobody measured it (tracked mode simulates no allocator).
    reserved_before: int | None = None
    peak_reserved: int | None = None
    reserved_after: int | None = None
    #: The device's own view (``torch.cuda.mem_get_info``): total and free,
    #: including the CUDA context and other processes.
    device_name: str | None = None
    capacity: int | None = None
    device_free: int | None = None
    #: Name of the exception that ended the block, None when it succeeded.
    error: str | None = None
    label: str = ""
    execution_count: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: What the memory was for (tracked mode, or measured with a tracker alongside).
    breakdown: Breakdown | None = None
    #: Live memory op by op (nbmem.tracking.timeline.Timeline), when asked for.
    timeline: Any = field(default=None, compare=False, repr=False)
    #: Whether this result's own text and HTML include the breakdown (it was
    #: asked for), e.g. when `%%gpumem -o --breakdown` shows it as Out.
    show_breakdown: bool = field(default=False, compare=False)
    #: How torch.compile'd code in the block ran: "compiled" (measured as it runs), "eager" (it ran its eager
    #: Python under tracking: the figures are not the compiled code's), "unknown", or None (none ran).
    compiled: str | None = None
    #: Memory by line of the user's code, most held at the peak first (when asked for: ``lines=True``).
    lines: tuple[LineUsage, ...] | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "MemoryResult":
        """Rebuild a result from one of :meth:`History.to_records`'s dicts.

        ``peak`` and ``retained`` are derived in the record; keys a newer nbmem
        may add are dropped rather than refused.

        >>> r = MemoryResult(mode="tracked", device="cpu", allocated_before=0,
        ...                  peak_allocated=1024, allocated_after=512, seconds=0.1, notes=("a",))
        >>> MemoryResult.from_record(History([r]).to_records()[0]) == r
        True
        """
        known = {item.name for item in fields(cls)}
        values = {key: value for key, value in record.items() if key in known}
        values["notes"] = tuple(values.get("notes") or ())
        if values.get("breakdown"):
            breakdown: dict[str, Any] = {
                key: tuple(tuple(pair) for pair in value) if isinstance(value, list) else value
                for key, value in values["breakdown"].items()
            }
            values["breakdown"] = Breakdown(**breakdown)
        if values.get("lines"):
            values["lines"] = tuple(LineUsage(**line) for line in values["lines"])
        return cls(**values)

    @property
    def peak(self) -> int:
        """Highest allocated bytes while the block ran, above what was allocated before it."""
        return self.peak_allocated - self.allocated_before

    @property
    def retained(self) -> int:
        """Allocated after minus allocated before: what the block left behind (may be negative)."""
        return self.allocated_after - self.allocated_before

    @property
    def cached(self) -> int | None:
        """Reserved but unallocated bytes after the block: the allocator's cache."""
        if self.reserved_after is None:
            return None
        return self.reserved_after - self.allocated_after

    @property
    def share(self) -> float | None:
        """The block's peak as a fraction of the device's capacity (None if unknown)."""
        if not self.capacity:
            return None
        return self.peak / self.capacity

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def source(self) -> str:
        """One phrase saying how the figures were obtained and on which device."""
        where = f"{self.device} ({self.device_name})" if self.device_name else self.device
        if self.mode == "measured":
            return f"measured on {where} by {allocator_of(self.device)}"
        return MODES["tracked"].format(device=where)

    # -- text -------------------------------------------------------------

    def summary(self) -> str:
        """One compact line, as ``%gpumem on`` prints it."""
        label = f"[{self.execution_count}] " if self.execution_count is not None else ""
        failed = f" · FAILED ({self.error})" if self.error else ""
        failed += " · compiled code ran EAGER (see notes)" if self.compiled == "eager" else ""
        return (
            f"gpumem {label}peak {format_bytes(self.peak, signed=True)} allocated"
            f" · retained {format_bytes(self.retained, signed=True)}"
            f" · {format_seconds(self.seconds)} · {self.mode} on {self.device}{failed}"
        )

    def _rows(self) -> list[tuple[str, str]]:
        share = f" ({self.share:.1%} of {format_bytes(self.capacity)})" if self.share is not None else ""
        rows = [
            (
                "peak",
                f"{format_bytes(self.peak, signed=True)} allocated above the start{share};"
                f" {format_bytes(self.peak_allocated)} in use at the peak",
            ),
            (
                "retained",
                f"{format_bytes(self.retained, signed=True)} allocated"
                f" ({format_bytes(self.allocated_before)} before, {format_bytes(self.allocated_after)} after)",
            ),
        ]
        if self.peak_reserved is not None:
            rows.append(
                (
                    "reserved",
                    f"{format_bytes(self.peak_reserved)} at the peak, {format_bytes(self.reserved_after)} after"
                    f" ({format_bytes(self.cached)} cached: freed blocks PyTorch keeps for reuse)",
                )
            )
        else:
            rows.append(("reserved", "not known in tracked mode (no caching allocator ran)"))
        if self.capacity is not None:
            free = format_bytes(self.device_free) if self.device_free is not None else "n/a"
            rows.append(
                (
                    "device",
                    f"{free} free of {format_bytes(self.capacity)}"
                    " (device view: includes the CUDA context and other processes)",
                )
            )
        rows.append(("time", f"{format_seconds(self.seconds)} wall" if self.seconds == self.seconds else "not recorded"))
        return rows

    def text(self, *, breakdown: bool = False) -> str:
        """The report as text; ``breakdown=True`` adds what the memory was for."""
        head = f"gpumem{' ' + self.label if self.label else ''}: {self.source}"
        if self.error:
            head += f"\n  FAILED with {self.error}: figures cover the cell up to the failure"
        if self.compiled in ("eager", "unknown"):
            head += f"\n  {COMPILED_WARNING[self.compiled]}"
        rows = self._rows()
        if breakdown and self.breakdown is not None:
            rows += self.breakdown.rows()
        width = max(len(name) for name, _ in rows)
        lines = [head] + [f"  {name:<{width}}  {text}" for name, text in rows]
        if self.lines is not None:
            lines.append("  by line of your code (bytes it made that were alive at the peak; all it made):")
            lines += [f"    {row}" for row in lines_table(self.lines)]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text(breakdown=self.show_breakdown)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def to_snapshot(self, path: str, alloc_conf: Any = None) -> None:
        """Write the block as a PyTorch memory snapshot pickle, for pytorch.org/memory_viz or ``torch.cuda._memory_viz``.

        Needs the block's allocations, which a timeline keeps: measure with
        ``timeline=True`` (``%%gpumem --timeline``, or ``--snapshot FILE``,
        which writes it). Addresses and segments are nbmem's allocator
        simulation's, under ``alloc_conf`` (a PYTORCH_ALLOC_CONF string; by
        default this process's environment), the frames your lines (with
        ``lines=True``) and nbmem's categories and modules;
        ``nbmem.load_snapshot`` reads it back. A block measured on a GPU
        keeps its timeline from the tracker beside the measurement: the file
        holds the tensors it saw, not what the allocator gave out beside them
        (library workspaces), and reads back as tracked, saying so.

        Example::

            with nbmem.track("cpu", timeline=True, lines=True) as scope:
                train_step()
            scope.result.to_snapshot("step.pickle")
        """
        events = getattr(self.timeline, "events", None)
        if events is None:
            raise ValueError(
                "to_snapshot needs the block's allocations, which only a timeline keeps: measure it with "
                "timeline=True (nbmem.track(timeline=True), %%gpumem --timeline) or %%gpumem --snapshot FILE"
            )
        from .allocator_settings import resolve_alloc_conf
        from .snapshot_export import snapshot_of, write_snapshot

        settings = resolve_alloc_conf(alloc_conf)
        # the block's own figures: a measured block's are the allocator's, of which its timeline (the tracker beside
        # the measurement) saw the tensors only; load_snapshot says so
        source = {"mode": self.mode, "device": self.device, "label": self.label,
                  "peak_allocated": self.peak_allocated, "allocated_before": self.allocated_before}
        write_snapshot(snapshot_of(events, _device_index(self.device), source, settings), path)

    # -- HTML (static, no widgets: renders wherever HTML does) ------------

    def bar_segments(self) -> list[tuple[str, int]]:
        """The capacity bar's segments, in bytes, left to right.

        Before the cell, the cell's peak on top of it, reserved but free
        (cached) at the peak, and free. Without a known capacity the bar ends
        at the larger of the peaks.
        """
        before = max(self.allocated_before, 0)
        cell = max(self.peak, 0)
        reserved = self.peak_reserved if self.peak_reserved is not None else self.peak_allocated
        cached = max(reserved - before - cell, 0)
        used = before + cell + cached
        free = max(self.capacity - used, 0) if self.capacity else 0
        return [("before", before), ("cell peak", cell), ("cached", cached), ("free", free)]

    def _repr_html_(self) -> str:
        return report_html(self, breakdown=self.show_breakdown)


def report_html(result: MemoryResult, *, breakdown: bool = False) -> str:
    """Self-contained HTML for one result: the capacity bar and the figures.

    ``breakdown=True`` adds a bar of what the memory at the peak was for.
    """
    capacity_bar = stacked_bar_html(result.bar_segments(), "nbmem-bar", always=("cell peak",))
    rows = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{name}</th><td style='text-align:left'>"
        f"{html.escape(text)}</td></tr>"
        for name, text in result._rows()
    )
    for_what = ""
    if breakdown and result.breakdown is not None:
        for_what = (
            "<div style='margin-top:6px'><b>at the peak, by category</b></div>"
            + stacked_bar_html(list(result.breakdown.at_peak), "nbmem-breakdown")
            + "</div><table style='font-size:12px'>"
            + "".join(
                f"<tr><th style='text-align:left;padding-right:1em'>{name}</th><td style='text-align:left'>"
                f"{html.escape(text)}</td></tr>"
                for name, text in result.breakdown.rows()
            )
            + "</table>"
        )
    failed = (
        f"<div style='color:#b00020'><b>FAILED</b> with {html.escape(result.error)}:"
        " figures cover the cell up to the failure</div>"
        if result.error
        else ""
    )
    if result.compiled in COMPILED_WARNING:
        failed += f"<div style='color:#b00020'>{html.escape(COMPILED_WARNING[result.compiled])}</div>"
    notes = "".join(f"<div><i>note:</i> {html.escape(note)}</div>" for note in result.notes)
    if result.lines is not None:
        cells = "".join(
            f"<tr><td style='text-align:left'>{html.escape(line.where)}</td><td>{format_bytes(line.at_peak)}</td>"
            f"<td>{format_bytes(line.allocated)}</td><td style='text-align:left'><code>{html.escape(line.source[:80])}"
            "</code></td></tr>"
            for line in result.lines[:12]
        )
        notes = (
            "<div style='margin-top:6px'><b>by line of your code</b></div><table class='nbmem-lines' "
            "style='font-size:12px'><tr><th>line</th><th>at the peak</th><th>allocated</th><th>code</th></tr>"
            f"{cells}</table>{notes}"
        )
    scale = "" if result.capacity else " (no device capacity known: bar scaled to the peak)"
    return (
        f'<div class="nbmem-report" style="font-family:sans-serif;font-size:13px;max-width:48em">'
        f"<div><b>gpumem</b> {html.escape(result.label)} — {html.escape(result.source)}</div>{failed}"
        f"{capacity_bar}{scale}</div>"
        f"<table style='font-size:12px;margin-top:4px'>{rows}</table>{for_what}{notes}</div>"
    )


class History:
    """Every measured cell of a session, in execution order.

    The session's is ``nbmem.history()`` (or ``%gpumem history -o``). It is a
    sequence of :class:`MemoryResult` (``len``, index, iterate), and
    :meth:`to_records`, :meth:`to_dataframe` (pandas) and :meth:`plot`
    (matplotlib) export or chart it.

    >>> h = History()
    >>> h.append(MemoryResult(mode="tracked", device="cpu", allocated_before=0,
    ...                       peak_allocated=1024, allocated_after=0, seconds=0.1,
    ...                       label="x = torch.ones(256)", execution_count=3))
    >>> h.to_records()[0]["peak"]
    1024
    """

    def __init__(self, results: list[MemoryResult] | None = None) -> None:
        self._results: list[MemoryResult] = list(results or [])

    def append(self, result: MemoryResult) -> None:
        self._results.append(result)

    def clear(self) -> None:
        self._results.clear()

    def __len__(self) -> int:
        return len(self._results)

    def __iter__(self) -> Iterator[MemoryResult]:
        return iter(self._results)

    def __getitem__(self, index: int) -> MemoryResult:
        return self._results[index]

    @property
    def peak(self) -> int:
        """The highest in-use allocated bytes over every recorded cell (0 when empty)."""
        return max((r.peak_allocated for r in self._results), default=0)

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per cell: every field plus ``peak`` and ``retained``."""
        records = []
        for result in self._results:
            record = asdict(result)
            record.pop("timeline")  # records hold figures; a timeline can be 100k points long
            record.pop("show_breakdown")
            record["notes"] = list(result.notes)
            record["peak"] = result.peak
            record["retained"] = result.retained
            records.append(record)
        return records

    def to_dataframe(self) -> Any:
        """The records as a pandas DataFrame (needs pandas: ``pip install pandas``)."""
        try:
            import pandas
        except ImportError as error:
            raise ImportError(
                "History.to_dataframe() needs pandas: `pip install pandas`, "
                "or use History.to_records() for a list of dicts"
            ) from error
        return pandas.DataFrame.from_records(self.to_records())

    def to_snapshots(self, folder: str, alloc_conf: Any = None) -> list[str]:
        """Each result that kept its allocations (a timeline) as a snapshot in ``folder``: ``exec-N.pickle`` for a
        cell, ``result-I.pickle`` otherwise (one file each: each stands on its own start); the paths written."""
        import os

        written = []
        os.makedirs(folder, exist_ok=True)
        for index, result in enumerate(self._results):
            if getattr(result.timeline, "events", None):
                name = f"exec-{result.execution_count}" if result.execution_count is not None else f"result-{index}"
                path = os.path.join(folder, f"{name}.pickle")
                result.to_snapshot(path, alloc_conf)
                written.append(path)
        if not written:
            raise ValueError("no result here kept its allocations: measure cells with %%gpumem --timeline (or "
                             "--snapshot FILE), or profile a notebook with nbmem profile --snapshot DIR")
        return written

    def plot(self) -> Any:
        """A matplotlib Figure: one bar per cell, its peak above the start."""
        from .charts import history_figure

        return history_figure(self)

    def _table_rows(self) -> list[tuple[str, ...]]:
        return [
            ("" if r.execution_count is None else str(r.execution_count), shorten(r.label, 40), *cell_figures(r))
            for r in self._results
        ]

    def __str__(self) -> str:
        if not self._results:
            return "gpumem history: no cells measured yet (use %%gpumem or %gpumem on)"
        lines = text_table(CELL_COLUMNS, self._table_rows())
        lines.append(f"highest in use: {format_bytes(self.peak)} allocated")
        return "gpumem history\n" + "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        if not self._results:
            return f"<p>{html.escape(str(self))}</p>"
        head = "".join(f"<th style='text-align:left'>{name}</th>" for name in CELL_COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(cell)}</td>" for cell in row) + "</tr>"
            for row in self._table_rows()
        )
        return (
            f"<table class='nbmem-history'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<p>highest in use: {format_bytes(self.peak)} allocated</p>"
        )


#: The columns of every per-cell table: ``%gpumem history`` and ``nbmem profile``.
CELL_COLUMNS = ("cell", "first line", "peak", "in use at peak", "retained", "time", "how")


def cell_figures(result: MemoryResult) -> tuple[str, str, str, str, str]:
    """A result's columns of a per-cell table: peak, in use at peak, retained, time, how."""
    how = f"{result.mode} on {result.device}" + (f" · FAILED ({result.error})" if result.error else "")
    return (
        format_bytes(result.peak, signed=True),
        format_bytes(result.peak_allocated),
        format_bytes(result.retained, signed=True),
        format_seconds(result.seconds),
        how,
    )
