"""Nestable peak scopes over a process-wide peak counter (a device's: nbmem.tracking.accelerators; the tracker's).

CUDA keeps one peak counter per device (``torch.cuda.max_memory_allocated``),
reset by ``torch.cuda.reset_peak_memory_stats``. Two profilers that both reset
it corrupt each other (pytorch issue 16266). nbmem keeps a stack of open
scopes per counter and, before every reset, folds the running peak into every
open scope, so a scope opened inside another (a ``%%gpumem`` cell while
``%gpumem on`` is active, a sweep inside a cell) leaves the outer one correct.

The tracker in :mod:`nbmem.tracking.tracker` is a counter too, so both modes share this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["PeakCounter", "PeakScopes", "OpenScope"]


class PeakCounter(Protocol):
    """What a scope needs from a memory counter. Sizes in bytes."""

    def allocated(self) -> int: ...
    def reserved(self) -> int | None: ...
    def peak_allocated(self) -> int: ...
    def peak_reserved(self) -> int | None: ...
    def reset_peak(self) -> None: ...


@dataclass(eq=False)
class OpenScope:
    """The running figures of one open scope.

    Compared by identity: two scopes with the same figures are still two
    scopes, and closing one must never remove the other from the stack.
    """

    allocated_before: int
    reserved_before: int | None
    peak_allocated: int
    peak_reserved: int | None
    closed: bool = False
    #: What the counter says about its peak (the tracker's PeakDetail), if anything.
    peak_detail: Any = None


class PeakScopes:
    """The open scopes on one counter; opening or closing one never corrupts another.

    >>> class StandIn:  # a counter whose peak we set by hand
    ...     now = peak = 0
    ...     def allocated(self): return self.now
    ...     def reserved(self): return None
    ...     def peak_allocated(self): return self.peak
    ...     def peak_reserved(self): return None
    ...     def reset_peak(self): self.peak = self.now
    >>> counter = StandIn(); scopes = PeakScopes(counter)
    >>> outer = scopes.open(); counter.now = counter.peak = 100; counter.now = 10
    >>> inner = scopes.open(); counter.now = counter.peak = 50
    >>> scopes.close(inner).peak_allocated, scopes.close(outer).peak_allocated
    (50, 100)
    """

    def __init__(self, counter: PeakCounter) -> None:
        self.counter = counter
        self._open: list[OpenScope] = []

    def __len__(self) -> int:
        return len(self._open)

    def _fold(self) -> None:
        peak_allocated = self.counter.peak_allocated()
        peak_reserved = self.counter.peak_reserved()
        detail = getattr(self.counter, "peak_detail", None)
        for scope in self._open:
            if detail is not None and (
                peak_allocated > scope.peak_allocated or (peak_allocated == scope.peak_allocated and scope.peak_detail is None)
            ):
                scope.peak_detail = detail()
            scope.peak_allocated = max(scope.peak_allocated, peak_allocated)
            if peak_reserved is not None:
                scope.peak_reserved = max(scope.peak_reserved or 0, peak_reserved)

    def open(self) -> OpenScope:
        """Open a scope: its peak counts from now, every open scope keeps its own."""
        self._fold()
        self.counter.reset_peak()
        allocated, reserved = self.counter.allocated(), self.counter.reserved()
        scope = OpenScope(allocated, reserved, allocated, reserved)
        self._open.append(scope)
        return scope

    def close(self, scope: OpenScope) -> OpenScope:
        """Close a scope (in any order) and return it with its final peak."""
        if scope.closed:
            return scope
        self._fold()
        if scope in self._open:  # a close cut short by Ctrl-C may have removed it already
            self._open.remove(scope)
        scope.closed = True
        return scope

    def close_above(self, count: int) -> None:
        """Close every scope opened after the first ``count`` (what an interrupted start opened)."""
        for scope in self._open[count:]:
            self.close(scope)

    def adopt(self, nbytes: int) -> None:
        """Add bytes that existed before every open scope began (found late).

        The tracker learns of tensors made before tracking started only when an
        operation uses them; they were there all along, so they raise every open
        scope's starting point and peak alike.
        """
        for scope in self._open:
            scope.allocated_before += nbytes
            scope.peak_allocated += nbytes
