"""The public context managers: ``nbmem.measure()`` and ``nbmem.track()``.

The magics are thin shells around :class:`MemoryScope`; it works the same in
plain Python and in pytest::

    with nbmem.measure() as scope:
        loss = model(x).sum(); loss.backward()
    print(scope.result.peak)
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from . import compiled
from .accelerators import DeviceCounter, device_counter
from .backends import ENGINES, Backend, Engine, native_engine, resolve_backend
from .counters import OpenScope
from .host_counters import HostStepCounters
from .lines import LineCounter, start_lines, stop_lines, usage as line_usage
from ..core.cudnn import notes_for
from ..core.results import CATEGORIES, Breakdown, MemoryResult
from ..core.units import format_bytes
from .timeline import op_name
from .tracker import Recording, Tracker, default_tracker

if TYPE_CHECKING:
    from .native_tracking import NativeTracker

__all__ = ["MemoryScope", "measure", "track", "tracker_alongside_note"]

def _cudnn_calls(tracker: Any) -> dict[str, int]:
    """Calls so far of layers cuDNN's kernels would run on an NVIDIA GPU, by kind, as the tracker's hooks counted them."""
    attribution = getattr(tracker, "_attribution", None)
    return attribution.cudnn_calls if attribution is not None else {}


def tracker_alongside_note(same_without: str) -> str:
    """What a measurement with nbmem's tracker beside it says of its peak: ``same_without`` names the run without it.

    While any Python dispatch mode is on the stack, ``at::isTensorSubclassLike``
    answers yes for every tensor, and autograd sums some gradients out of place
    (ATen/TensorSubclassLikeUtils.h; measured on the CPU, tests/test_native.py).
    """
    return (
        "the tracker's Python dispatch mode was on the stack, and PyTorch then sums some gradients out of place: "
        f"the measured peak can be a little above the same {same_without} (seen on the CPU; untested on CUDA)"
    )


class MemoryScope:
    """Measure the memory of a block of code; the result is in ``.result`` afterwards.

    Use it as a context manager, or call :meth:`start` and :meth:`stop` (as
    the ``%gpumem on`` hooks do). An exception inside the block propagates
    unchanged; the result is still made, with ``error`` set to its type.

    >>> with measure(backend="tracked", device="cpu") as scope:
    ...     kept = torch.zeros(1024, 1024)          # 4 MiB
    ...     dropped = torch.zeros(1024, 1024); del dropped
    >>> scope.result.peak >> 20, scope.result.retained >> 20
    (8, 4)
    """

    def __init__(
        self,
        backend: Backend = "auto",
        device: str | torch.device | None = None,
        *,
        label: str = "",
        execution_count: int | None = None,
        tracker: Any = None,
        breakdown: bool = False,
        capacity: int | str | None = None,
        timeline: bool = False,
        engine: Engine = "auto",
        expect_compiled: bool = False,
        lines: bool = False,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
        if tracker is not None:
            backend, device = "tracked", tracker.device
        self.mode, self.device = resolve_backend(backend, device)
        #: the engine chose itself ("auto") because the block will run compiled code
        self.chose_native = False
        if engine == "auto":
            self.chose_native = _native_for_compiled(self.mode, self.device, tracker, capacity, timeline, expect_compiled)
            engine = "native" if self.chose_native else "dispatch"
        if engine == "native" and tracker is None:
            tracker = native_engine(self.mode, self.device, capacity, timeline)
        self.engine = "native" if tracker is not None and not isinstance(tracker, Tracker) else "dispatch"
        self.label = label
        self.execution_count = execution_count
        self.result: MemoryResult | None = None
        self.capacity: int | None = None
        self.capacity_label = ""
        if capacity is not None:
            from ..core.devices import parse_capacity

            self.capacity, self.capacity_label = parse_capacity(capacity)
        self._counter: DeviceCounter | Tracker | NativeTracker = (
            device_counter(self.device)
            if self.mode == "measured"
            else (tracker or default_tracker(self.device))
        )
        # The tracker that explains the figures (categories, modules, virtual
        # capacity): the counter itself in tracked mode; in measured mode one
        # runs alongside only when asked for, as it slows every op.
        self._tracker: Any = (
            self._counter
            if not isinstance(self._counter, DeviceCounter)
            else (default_tracker(self.device) if breakdown or timeline or lines or capacity is not None else None)
        )
        self._timeline = timeline
        self._want_lines = lines
        self._lines: LineCounter | None = None  # the tracker's, while this scope wants lines
        self._lines_from: dict[Any, int] = {}
        self._cudnn_from: dict[str, int] = {}  # calls of layers cuDNN would run, before the block (nbmem.core.cudnn)
        self._cudnn_ran: list[str] = []  # the kinds of those layers the block ran
        self._show_breakdown = breakdown
        self._recording: Recording | None = None
        self._scope: OpenScope | None = None
        self._tracker_scope: OpenScope | None = None
        self._saved_capacity: tuple[int | None, str] = (None, "")
        self._capacity_set = False
        self._started = 0.0
        self._compiled_from: tuple[int, int] | None = None  # compiled calls counted before the block (compiled.watch)
        #: torch.compile'd regions the block entered (None: nobody could count them)
        self.compiled_calls: int | None = None
        self._compiled_eagerly = 0  # of them, run eagerly by a dispatch-mode scope (this one or another)
        self._dynamo_before = False
        # a CPU tracker stands in for a GPU, where torch.optim's step counters are host memory (host_counters.py)
        self._hosting = HostStepCounters(self._tracker) if self.mode == "tracked" and self.device.type == "cpu" else None

    @property
    def running(self) -> bool:
        return self._scope is not None

    def so_far(self) -> tuple[int, int, float] | None:
        """(allocated now, peak so far) above the start, and seconds since it; None when not running.

        Changes nothing, so the live gauge's timer thread may call it while the
        block runs: measured mode reads the allocator's counters, tracked mode
        the tracker's (:meth:`Tracker.running_figures`).
        """
        scope = self._scope
        if scope is None:
            return None
        allocated, peak = self._counter.running_figures()
        peak = max(peak, scope.peak_allocated)  # a scope opened inside this one reset the counter's peak
        return allocated - scope.allocated_before, peak - scope.allocated_before, time.perf_counter() - self._started

    @property
    def tracker(self) -> Any:
        """The tracker behind this scope's breakdown (None in measured mode unless asked for)."""
        return self._tracker

    def start(self) -> "MemoryScope":
        """Open the scope; all or nothing, whatever bytecode Ctrl-C lands on (issue 12)."""
        if self._scope is not None:
            raise RuntimeError("this MemoryScope is already running: make a new one for each block")
        tracker, counter = self._tracker, self._counter
        open_before = (len(counter.scopes), len(tracker.scopes) if tracker is not None else 0)
        try:
            if tracker is not None:
                was_active = tracker.active
                tracker.activate(self)
                if not was_active and tracker.whole_device:
                    # the baseline: every storage alive now, touched by the block or not (with
                    # the hooks in, so that parameters found get their gradient hooks)
                    tracker.adopt_live()
                if tracker is not counter:
                    self._tracker_scope = tracker.scopes.open()
            self._scope = counter.scopes.open()
            if tracker is not None:
                if self._tracker_scope is None:
                    self._tracker_scope = self._scope
                if self._timeline:
                    self._recording = tracker.start_recording()
                self._cudnn_from = dict(_cudnn_calls(tracker))
                if self._want_lines:
                    self._lines = start_lines(tracker, self)
                    self._lines_from = dict(self._lines.allocated)
                if self.capacity is not None:
                    self._saved_capacity = (tracker.capacity, tracker.capacity_label)
                    self._capacity_set = True
                    tracker.capacity, tracker.capacity_label = self.capacity, self.capacity_label
                if self._hosting is not None:
                    self._hosting.__enter__()
            self._dynamo_before = "torch._dynamo" in sys.modules
            self._compiled_from = compiled.watch(self, eager=self._runs_a_dispatch_mode())
            self._started = time.perf_counter()
            return self
        except BaseException:
            self._scope = self._tracker_scope = None
            self._close_tracking(open_before)
            if tracker is not None:
                tracker.reconcile()  # adopt_live may have been cut short half-way through a storage
            raise

    def _close_tracking(self, open_before: tuple[int, int] | None = None) -> None:
        """Undo what :meth:`start` did to the counters and tracker; idempotent, so a repeat finishes an interrupted one.

        ``open_before``: how many scopes each counter had open before an
        interrupted start; the scopes it opened above them are closed.
        """
        tracker, counter = self._tracker, self._counter
        compiled.unwatch(self)
        if self._hosting is not None:
            self._hosting.__exit__()  # idempotent
        if open_before is not None:
            counter.scopes.close_above(open_before[0])
        if tracker is not None:
            if self._recording is not None:
                tracker.stop_recording(self._recording)
            if self._want_lines and getattr(tracker, "_lines", None) is not None:
                stop_lines(tracker, self)  # by owner: also what a start Ctrl-C cut short attached
            if open_before is not None and tracker is not counter:
                tracker.scopes.close_above(open_before[1])
            if self._capacity_set:
                tracker.capacity, tracker.capacity_label = self._saved_capacity
                self._capacity_set = False
            tracker.deactivate(self)

    def _close_scopes(self, scope: OpenScope, tracker_scope: OpenScope | None) -> None:
        # self._scope is cleared last: a repeat after an interrupt finds the scopes again
        self._counter.scopes.close(scope)
        if tracker_scope is not None and self._tracker is not None:
            self._tracker.scopes.close(tracker_scope)
        self._close_tracking()
        self._scope = self._tracker_scope = None

    def stop(self, error: BaseException | type[BaseException] | None = None) -> MemoryResult:
        """End the scope and build its result; ``error`` marks it failed.

        Whatever bytecode Ctrl-C lands on after the first line, the tracker is
        left inactive and every counter's scope closed, and the interrupt goes on.
        """
        try:  # first: only an interrupt on this very line (a function's entry) can't be caught here
            scope, tracker_scope = self._scope, self._tracker_scope
            if scope is None:
                raise RuntimeError("this MemoryScope is not running: call start() first")
            counter, tracker = self._counter, self._tracker
            if tracker is not None and error is not None:
                tracker.settle()
            if isinstance(counter, DeviceCounter) and error is None:
                counter.synchronize()  # the wall time includes the GPU work the block queued
            seconds = time.perf_counter() - self._started
            counted = compiled.calls_since(self._compiled_from)
            self.compiled_calls, self._compiled_eagerly = counted if counted is not None else (None, 0)
            unseen = 0
            refused = error is not None and issubclass(error if isinstance(error, type) else type(error), torch.OutOfMemoryError)
            if tracker is counter and not isinstance(counter, DeviceCounter) and counter.whole_device and not refused:
                # another thread's ops pass no dispatch mode of this thread: count what they left (issue 12).
                # Not after a virtual out-of-memory error: the refused tensor exists on the CPU, held by
                # the traceback, but was never allocated on the device.
                unseen = counter.count_made_unseen()
            if tracker is not None:  # before the tracker's hooks go with the scope
                ran = _cudnn_calls(tracker)
                self._cudnn_ran = [kind for kind, calls in ran.items() if calls > self._cudnn_from.get(kind, 0)]
            self._close_scopes(scope, tracker_scope)
            if tracker is not None and error is not None:
                tracker.reconcile()  # an interrupt in the accounting may have cut an update short
            self.result = self._result(scope, tracker_scope, seconds, error, unseen)
            return self.result
        except BaseException:
            # Ctrl-C in here: finish what it cut short (each step is idempotent), then let it through
            if self._scope is not None:
                self._close_scopes(self._scope, self._tracker_scope)
            if self._tracker is not None:
                self._tracker.reconcile()
            raise

    def _result(
        self,
        scope: OpenScope,
        tracker_scope: OpenScope | None,
        seconds: float,
        error: BaseException | type[BaseException] | None,
        unseen: int = 0,
    ) -> MemoryResult:
        counter, tracker = self._counter, self._tracker
        name = capacity = free = None
        notes: list[str] = []
        if unseen and self.engine == "native":
            notes.append(
                f"{format_bytes(unseen)} in tensors no allocation of the block showed (another allocator's: a "
                "DataLoader worker's shared memory...) were found at its end and counted as allocated then"
            )
        elif unseen:
            notes.append(
                f"{format_bytes(unseen)} in tensors made on another thread during the block were found at its end and "
                "counted as allocated then; tracking follows only this thread's ops, so what other threads made and "
                "freed inside the block is not in the peak"
            )
        if self.engine == "native":
            notes.append(
                "native engine: every block the CPU allocator gave while the block ran, on any thread, "
                "kernels' scratch included, counted in C++; the op at the peak is not known"
            )
        ran_as, said = self._compiled_figures()
        notes += said + (self._hosting.notes if self._hosting is not None else [])
        if self.mode == "tracked" and self.device.type == "cpu":  # PyTorch's CPU kernels ran, not cuDNN's
            notes += notes_for(self._cudnn_ran)
        if isinstance(counter, DeviceCounter):
            name, capacity, free = counter.device_view()
            missing = counter.missing_note()
            if missing:
                notes.append(missing)
        if self.capacity is not None:
            label = self.capacity_label or format_bytes(self.capacity)
            name, capacity = f"virtual {label}", self.capacity
            free = max(self.capacity - counter.allocated(), 0)
            notes.append(f"virtual capacity {label} = {format_bytes(self.capacity)}: an allocation beyond it raises torch.OutOfMemoryError")
        if error is not None and not isinstance(error, type):
            error = type(error)
        breakdown = _breakdown(tracker_scope, tracker) if tracker is not None and tracker_scope is not None else None
        by_line = None
        if self._lines is not None and tracker_scope is not None:
            detail = tracker_scope.peak_detail
            at_peak = detail.lines if detail is not None and detail.lines is not None else {}
            by_line = line_usage(at_peak, self._lines.allocated, self._lines_from)
        timeline = None
        if tracker is not None and self._recording is not None:
            from .timeline import build_timeline

            recording, self._recording = self._recording, None
            timeline = build_timeline(recording, tracker.op_count, module=breakdown.module if breakdown else None)
        if tracker is not None and self.mode == "measured":
            if breakdown is not None:
                notes.append("breakdown tracked alongside the measurement (tensors on the device, 512 B rounding)")
                breakdown, unattributed = _with_unattributed(breakdown, scope.peak_allocated)
                if unattributed:
                    notes.append(
                        f"'other' at the peak includes {format_bytes(unattributed)} the caching allocator gave out "
                        "beside every tensor nbmem saw: library workspaces (cuBLAS keeps one per stream and thread, "
                        "32 MiB on Hopper, and backward runs on its own thread) or tensors made in C++"
                    )
            notes.append(tracker_alongside_note("block's without --breakdown, --timeline or --capacity"))
        return MemoryResult(
            mode=self.mode,  # type: ignore[arg-type]
            device=str(self.device),
            allocated_before=scope.allocated_before,
            peak_allocated=scope.peak_allocated,
            allocated_after=counter.allocated(),
            seconds=seconds,
            reserved_before=scope.reserved_before,
            peak_reserved=scope.peak_reserved,
            reserved_after=counter.reserved(),
            device_name=name,
            capacity=capacity,
            device_free=free,
            error=None if error is None else error.__name__,
            label=self.label,
            execution_count=self.execution_count,
            notes=tuple(notes),
            breakdown=breakdown,
            timeline=timeline,
            show_breakdown=self._show_breakdown,
            compiled=ran_as,
            lines=by_line,
        )

    def _runs_a_dispatch_mode(self) -> bool:
        """Whether the block runs under a dispatch mode: the dispatch engine's, or a tracker's alongside a measurement
        (not an estimate's tracker, which a fake mode carries: Dynamo compiles under that infra mode)."""
        return self.engine == "dispatch" and self._tracker is not None and getattr(self._tracker, "host", None) is None

    def _compiled_figures(self) -> tuple[str | None, list[str]]:
        """How compiled code in the block ran ("compiled", "eager", "unknown" or None: none ran), and the notes."""
        calls = self.compiled_calls
        eager = self._runs_a_dispatch_mode()
        if calls is None and eager and not self._dynamo_before and compiled.dynamo_saw_frames():
            return "unknown", [
                "torch.compile was first used inside this block, so nbmem could not see whether compiled code ran: "
                "if it did, it ran eagerly under tracking and these figures are the eager code's, and PyTorch, "
                "which skipped its frames under the tracker's dispatch mode, runs it eagerly from now on: "
                "torch._dynamo.reset() compiles it afresh. Blocks are watched from now on"
            ]
        if not calls:
            return None, []
        if eager or self._compiled_eagerly:
            compiled.note_seen()  # later "auto" scopes pick the native engine
            if not eager:  # a scope of the dispatch engine (inside or around this one) was open meanwhile
                return "eager", [
                    f"EAGER FIGURES: {self._compiled_eagerly} of the block's {calls} torch.compile'd call(s) ran their "
                    "eager Python, because a scope with a dispatch mode (tracked mode's dispatch engine, or a "
                    "tracker alongside a measurement) was open at the same time, nested in this one or around it"
                ]
            why = (
                "without --breakdown, --capacity and --timeline, measured mode (the allocator's own counters) sees "
                "compiled code as it runs"
                if self.mode == "measured"
                else "--capacity and --timeline need every op, which only the dispatch engine sees"
                if self.capacity is not None or self._timeline
                else "the native engine measures compiled code compiled (CPU, engine='native' or %%gpumem --engine native)"
                if self.device.type == "cpu"
                else f"on {self.device}, measured mode (the allocator's own counters) sees compiled code as it runs"
            )
            how = "tracked mode's dispatch engine is" if self.mode == "tracked" else "the tracker alongside the measurement is"
            return "eager", [
                f"EAGER FIGURES: the block called torch.compile'd code {calls} time(s), and it ran its eager Python: "
                f"{how} a dispatch mode, under which PyTorch runs no compiled frame. The "
                f"compiled code's own memory (fused kernels, inductor's buffers) was not measured; {why}"
            ]
        if compiled.past_recompile_limit():
            return "unknown", [compiled.RECOMPILE_LIMIT_NOTE]
        if self.mode == "measured":
            return "compiled", [
                "torch.compile'd code ran compiled; a CUDA graph (mode='reduce-overhead') allocates from its own "
                "pool when recorded, so a replay's memory is not this block's unless the block recorded it"
            ]
        chose = " (chosen for it: the default engine would have run it eagerly)" if self.chose_native else ""
        return "compiled", [f"torch.compile'd code ran compiled ({calls} call(s)), its buffers counted by the native engine{chose}"]

    def __enter__(self) -> "MemoryScope":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        self.stop(exc_type)


def _native_for_compiled(mode: str, device: torch.device, tracker: Any, capacity: Any, every_op: bool, expect: bool) -> bool:
    """Whether an "auto" scope takes the native engine: the block will run compiled code, and it can serve the rest
    (``every_op``: a timeline was asked for, which only the dispatch engine gives)."""
    if tracker is not None or mode != "tracked" or device.type != "cpu" or capacity is not None or every_op:
        return False
    if not (expect or compiled.seen()):
        return False
    from .native import available

    return available()


def _breakdown(scope: OpenScope, tracker: Any) -> Breakdown | None:
    detail = scope.peak_detail
    if detail is None:
        return None
    modules = sorted(
        ((name or "(outside modules)", size) for name, size in detail.modules.items() if size),
        key=lambda item: -item[1],
    )
    return Breakdown(
        at_peak=tuple((name, detail.categories.get(name, 0)) for name in CATEGORIES),
        after=tuple(tracker.by_category().items()),
        modules_at_peak=tuple(modules),
        op=op_name(detail.op),
        module=detail.module,
    )


def _with_unattributed(breakdown: Breakdown, peak_allocated: int) -> tuple[Breakdown, int]:
    """A measured breakdown whose peak sums to the device's: what no tensor explains goes to "other"."""
    gap = peak_allocated - sum(size for _, size in breakdown.at_peak)
    if gap <= 0:
        return breakdown, 0
    at_peak = tuple((name, size + gap if name == "other" else size) for name, size in breakdown.at_peak)
    return dataclasses.replace(breakdown, at_peak=at_peak), gap


def measure(
    device: str | torch.device | None = None,
    *,
    backend: Backend = "auto",
    label: str = "",
    breakdown: bool = False,
    capacity: int | str | None = None,
    timeline: bool = False,
    engine: Engine = "auto",
    lines: bool = False,
) -> MemoryScope:
    """Measure a block: on CUDA with the allocator's statistics, else tracked.

    ``breakdown=True`` also runs the tracker on a CUDA device, so the result
    says what the memory was for (tracked mode always does). ``capacity``
    (``"16GiB"``, ``"T4"``...) makes a virtual device: an allocation beyond it
    raises ``torch.OutOfMemoryError`` as CUDA would. ``timeline=True`` records
    live memory op by op (``scope.result.timeline.plot()``).

    >>> with measure() as scope:
    ...     x = torch.ones(256)       # 256 * 4 bytes = 1 KiB
    >>> scope.result.retained if scope.result.mode == "tracked" else 1024
    1024
    """
    return MemoryScope(backend, device, label=label, breakdown=breakdown, capacity=capacity, timeline=timeline, engine=engine,
                       expect_compiled=engine == "auto" and _caller_expects_compiled(), lines=lines)


def track(
    device: str | torch.device | None = None,
    *,
    label: str = "",
    capacity: int | str | None = None,
    engine: Engine = "auto",
    lines: bool = False,
    timeline: bool = False,
) -> MemoryScope:
    """Track a block: every tensor storage on ``device`` is accounted, CUDA or not.

    ``engine="auto"`` (the default) is the dispatch engine, unless the block
    will run ``torch.compile``'d code (the code around the ``with`` names a
    compiled model or function, or ``compile``; locals are looked at from
    Python 3.13 on, globals always; or compiled code already ran under a
    tracker): then the native engine, under which it runs compiled
    (:mod:`nbmem.tracking.compiled`). Compiled code that ran eagerly under the
    dispatch engine is said in the result (``result.compiled == "eager"``).
    ``engine="native"`` (CPU only) counts the CPU allocator's blocks in C++
    instead of seeing every op in Python: about 1.0x the untracked time
    where the default costs 1.1-1.2x (``benchmarks/bench_overhead.py``). It
    builds a small library with the system's C++ compiler on first use and has
    no virtual capacity, no timeline and no op at the peak
    (:mod:`nbmem.tracking.native_tracking` says what else differs).

    >>> with track("cpu") as scope:
    ...     x = torch.ones(1)         # 4 bytes, rounded to one 512 B block
    >>> scope.result.retained
    512
    >>> dict(scope.result.breakdown.after)["other"] >= 512   # on the device after: x among it, not a parameter...
    True
    """
    return MemoryScope("tracked", device, label=label, capacity=capacity, engine=engine, timeline=timeline,
                       expect_compiled=engine == "auto" and _caller_expects_compiled(), lines=lines)


def _caller_expects_compiled() -> bool:
    """Whether the code that called measure() or track() names compiled things (compiled.expects_compiled)."""
    frame = sys._getframe(2)
    if sys.version_info >= (3, 13):  # f_locals is a view (PEP 667)
        return compiled.expects_compiled(frame.f_code, frame.f_locals, frame.f_globals)
    # Before 3.13, reading f_locals leaves a copy of every local on the frame, and with it the user's tensors
    # alive after they `del` them (seen in tests/test_interrupts.py): globals only, a cell's namespace among them
    return compiled.expects_compiled(frame.f_code, frame.f_globals)
