"""Ctrl-C on a tracked scope's way out, held until the scope has closed (issue 12).

``MemoryScope.stop`` finishes whatever an interrupt cuts short, but Python
looks for a pending signal on entering a function, before its first line:
a Ctrl-C that landed on the entry of a scope's ``__exit__`` or ``stop`` left
the tracker, its dispatch mode and every hook installed. While a scope is
open, SIGINT therefore goes through :func:`_interrupted`: with one of the
functions marked :func:`on_the_way_out` on the stack it is only remembered,
and :func:`closed` raises it once the scope is closed; anywhere else it
raises KeyboardInterrupt at once, as Python's default handler does. The
previous handler is back as soon as no scope is open. Only in the main
thread (Python runs signal handlers nowhere else) and only where SIGINT has
Python's default handler: where it is ignored or the user's own, nothing
changes.

>>> def leave():
...     return "closed"
>>> _ = on_the_way_out(leave)
>>> class Scope:
...     running = True
>>> scope = Scope()
>>> opened(scope)
>>> signal.getsignal(signal.SIGINT) is _interrupted
True
>>> closed(scope)
>>> signal.getsignal(signal.SIGINT) is signal.default_int_handler
True
"""

from __future__ import annotations

import signal
import threading
import weakref
from types import CodeType, FrameType
from typing import Any, Callable, TypeVar

__all__ = ["on_the_way_out", "opened", "closed", "reset"]

Function = TypeVar("Function", bound=Callable[..., Any])

#: The code of the functions a scope leaves through: an interrupt with one on the stack waits for closed().
_WAY_OUT: set[CodeType] = set()
#: The scopes open on the main thread (a set: opening or closing one twice changes nothing; weak: a
#: scope forgotten open doesn't keep nbmem's handler for ever).
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
#: An interrupt remembered on a way out, raised by the next closed().
_held = False


def on_the_way_out(function: Function) -> Function:
    """Mark ``function`` as part of a scope's way out (a decorator)."""
    _WAY_OUT.add(function.__code__)
    return function


def opened(scope: object) -> None:
    """``scope`` is open: SIGINT goes through :func:`_interrupted` until every open scope is closed."""
    if threading.current_thread() is not threading.main_thread():
        return
    _OPEN.add(scope)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted)


def closed(scope: object, *, raise_held: bool = True) -> None:
    """``scope`` is closed; the last one gives SIGINT its handler back. A held Ctrl-C is raised now
    (dropped with ``raise_held=False``: an exception is already on its way, and one interrupt is enough)."""
    global _held
    if threading.current_thread() is not threading.main_thread():
        return
    _OPEN.discard(scope)
    for other in list(_OPEN):  # one an interrupt let out without closing it here: no longer running
        if not getattr(other, "running", True):
            _OPEN.discard(other)
    if not _OPEN and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _held:
        _held = False
        if raise_held:
            raise KeyboardInterrupt


def reset() -> None:
    """Forget every open scope and give SIGINT Python's own handler back (``%unload_ext nbmem``)."""
    global _held
    _OPEN.clear()
    _held = False
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted(number: int, frame: FrameType | None) -> None:
    global _held
    while frame is not None:
        if frame.f_code in _WAY_OUT:
            _held = True
            return
        frame = frame.f_back
    raise KeyboardInterrupt


on_the_way_out(closed)
