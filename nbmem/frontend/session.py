"""``%gpumem on``: the session's state and the IPython events that measure every cell.

:class:`Session` is nbmem's state for one shell (its history, the every-cell
options, the scope a running cell is measured in); :class:`EveryCellHooks`
is the part of :class:`~nbmem.frontend.magics.GpuMemMagics` that
``%gpumem on``/``off`` switch and IPython's ``pre_run_cell``/``post_run_cell``
events call (registered by :func:`nbmem.frontend.magics.load`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import CodeType
from typing import TYPE_CHECKING, Any

from ..core import _env
from ..core.rendering import first_line
from ..core.results import History, MemoryResult
from ..tracking.diagnosis import diagnose, is_out_of_memory
from ..tracking.history import AllocatorHistory
from ..tracking.backends import Backend, Engine, resolve_backend
from ..tracking.scope import MemoryScope
from . import display
from .cell_snapshots import records_history, start_history, write_cell_snapshot
from .cells import _cell_expects_compiled, _is_nbmem_cell
from .live_gauge import LINE_DELAY, LiveGauge, capacity_of, virtual_label

__all__ = ["EveryCell", "Session", "EveryCellHooks", "stop_gauge"]


@dataclass
class EveryCell:
    """How ``%gpumem on`` measures each cell."""

    backend: Backend = "auto"
    device: str | None = None
    quiet: bool = False
    capacity: str | None = None
    live: bool = True  # the compact live line for long cells; `%gpumem on --no-live` turns it off
    engine: Engine = "auto"
    lines: bool = False  # `nbmem profile --lines`: each cell's lines (nbmem.tracking.lines)
    snapshots: str | None = None  # `nbmem profile --snapshot DIR`: each cell written there as exec-N.pickle


@dataclass
class Session:
    """nbmem's state for one IPython shell (kept on the magics instance, never global)."""

    history: History = field(default_factory=History)
    every_cell: EveryCell | None = None
    log_path: str | None = None  # `nbmem profile` appends one JSON line per measured cell
    log_options: EveryCell = field(default_factory=lambda: EveryCell(quiet=True))
    pending: MemoryScope | None = None
    pending_gauge: LiveGauge | None = None
    #: measured on CUDA with a snapshot folder: PyTorch's allocator history, recording for the running cell
    pending_history: AllocatorHistory | None = None
    #: Whether a frontend is watching live (None outside a kernel, or for `nbmem profile`'s log).
    frontend: _env.FrontendProbe | None = None
    #: The running cell's number as its In[n] shows it; IPython has already
    #: advanced shell.execution_count when the cell runs.
    cell_number: int | None = None
    #: A %%gpumem cell and its code, compiled by check_cell for the magic that runs next (see there).
    compiled: tuple[str, tuple[CodeType, CodeType | None]] | None = None

    def record(self, result: MemoryResult) -> None:
        self.history.append(result)
        if self.log_path:
            with open(self.log_path, "a", encoding="utf-8") as log:
                log.write(json.dumps(History([result]).to_records()[0]) + "\n")


def stop_gauge(gauge: LiveGauge | None) -> str | None:
    """Stop a cell's gauge; the display id its report goes in place of, or None (the report shows as usual)."""
    if gauge is None:
        return None
    gauge.stop()
    view = gauge.show
    return view.display_id if gauge.usable and isinstance(view, display.GaugeView) else None


class EveryCellHooks:
    """``%gpumem on``/``off`` and the two cell events (a mixin of GpuMemMagics: it uses the magics' shell and
    session, and their test of whether a frontend watches)."""

    shell: Any
    session: Session

    if TYPE_CHECKING:
        def _live(self, quiet: bool, no_live: bool) -> bool: ...  # GpuMemMagics'

    def _action_on(self, args: Any) -> None:
        self.session.every_cell = EveryCell(
            args.backend, args.device, args.quiet, args.capacity, live=not args.no_live, engine=args.engine
        )
        if not args.quiet:
            mode, device = resolve_backend(args.backend, args.device)
            engine = " (native engine)" if args.engine == "native" else ""
            print(f"gpumem: every cell from now on is {mode} on {device}{engine} (`%gpumem off` stops)")

    def _action_off(self, args: Any) -> None:
        self.session.every_cell = None
        if not args.quiet:
            print("gpumem: stopped measuring every cell; `%gpumem history` shows what was measured")

    # -- the cell events ------------------------------------------------------

    def pre_run_cell(self, info: Any) -> None:
        session = self.session
        if session.pending is not None:  # a previous post_run_cell never came, or was interrupted
            if session.pending.running:
                session.pending.stop()
            session.pending = None
        stop_gauge(session.pending_gauge)
        session.pending_gauge = None
        if session.pending_history is not None:
            session.pending_history.stop()
            session.pending_history = None
        stored = getattr(info, "store_history", True)
        session.cell_number = self.shell.execution_count - 1 if stored else None
        if session.every_cell is None and session.log_path is None:
            return
        raw = getattr(info, "raw_cell", "") or ""
        if _is_nbmem_cell(raw):
            return
        options = session.every_cell or session.log_options
        history = records_history(options, session.cell_number)  # PyTorch's own record, or nbmem's timeline
        scope = MemoryScope(
            options.backend, options.device, label=first_line(raw), execution_count=session.cell_number,
            capacity=options.capacity, engine=options.engine, lines=options.lines,
            timeline=options.snapshots is not None and not history,
            expect_compiled=options.engine == "auto" and _cell_expects_compiled(self.shell, raw),
        )
        if history:
            session.pending_history = start_history(options.snapshots, session.cell_number)  # type: ignore[arg-type]
        session.pending = scope.start()
        every = session.every_cell
        if every is not None and every.live and self._live(every.quiet, False):
            view = display.GaugeView(compact=True)
            session.pending_gauge = LiveGauge(
                scope, view, capacity=capacity_of(scope), capacity_label=virtual_label(scope), delay=LINE_DELAY
            ).start()

    def post_run_cell(self, result: Any) -> None:
        session = self.session
        scope = session.pending  # cleared once stopped: a Ctrl-C on stop()'s entry leaves it to the next cell
        gauge, session.pending_gauge = session.pending_gauge, None
        session.cell_number = session.compiled = None
        if scope is None:
            stop_gauge(gauge)
            return
        error = None
        if result is not None:
            error = result.error_in_exec or result.error_before_exec
        measured = scope.stop(error)
        session.pending = None
        recorder, session.pending_history = session.pending_history, None
        if recorder is not None:  # before the checks below: a cell that ran `%gpumem off` stops recording too
            write_cell_snapshot(measured, None, recorder)
        in_place = stop_gauge(gauge)  # after the scope: the join is not in the cell's time
        if session.every_cell is None and session.log_path is None:
            if in_place is not None:
                display.clear_gauge(in_place)
            return  # this cell ran `%gpumem off`
        session.record(measured)
        if recorder is None:
            write_cell_snapshot(measured, (session.every_cell or session.log_options).snapshots, None)
        if session.every_cell is not None and not session.every_cell.quiet:
            display.show_line(measured, display_id=in_place)
            if error is not None and is_out_of_memory(error):  # as %%gpumem diagnoses its cell's
                display.show_value(diagnose(measured, scope.tracker, self.shell.user_ns, error))
