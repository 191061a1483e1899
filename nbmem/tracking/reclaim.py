"""Give back the memory a failed cell left behind, without restarting the kernel.

After an exception IPython keeps the failing frames alive, and with them every
tensor that was a local variable of a function the cell called (ipython issues
13103 and 14129, pytorch issue 27600). In IPython 9 the last error is kept by

* ``sys.last_type``, ``sys.last_value``, ``sys.last_traceback`` (and
  ``sys.last_exc`` on Python 3.12+), set by ``InteractiveShell._get_exc_info``;
* ``shell.InteractiveTB.tb``, which ``VerboseTB.structured_traceback`` stores
  for ``%debug`` and only ``debugger()`` deletes;
* ``shell.last_execution_result.error_in_exec``, the exception object, whose
  ``__traceback__`` holds the frames;
* after a ``%debug`` session, the debugger: ``botframe`` and, on Python 3.11,
  ``curframe_locals``, which ``pdb.forget()`` leaves in place.

Dropping those references is not enough when anything else still holds a frame
(a user's saved exception, a chained ``__context__``), so :func:`free` also
clears the frames' locals, as ``traceback.clear_frames`` does. The formatter
has already copied each frame's locals into its ``f_locals`` dict, which
``frame.clear()`` leaves alone on Python before 3.13; reading ``f_locals``
after the clear syncs that dict and empties it.

Values shown as a cell's output are kept too: ``Out[n]`` (``_oh``), ``_n``,
``_``, ``__`` and ``___`` (also in ``user_ns_hidden``), the display hook's own
``_``/``__``/``___`` and ``last_execution_result.result``. :func:`free` lets go
of those that hold tensors, as ``InteractiveShell.del_var`` would.

nbmem calls ``gc.collect()`` and the device's ``empty_cache()`` (CUDA's, or
any accelerator's) only here, when the user asks.
"""

from __future__ import annotations

import gc
import html
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from .accelerators import device_counter
from .backends import resolve_backend
from .tracker import default_tracker
from ..core.units import format_bytes

__all__ = ["Reclaimed", "free", "release_error", "release_error_once_shown", "forget_pending"]

#: Where the interpreter keeps the last uncaught error; IPython sets these too.
_SYS_LAST = ("last_type", "last_value", "last_traceback", "last_exc")
#: The first words of the ``released`` entry for the last error's traceback.
_TRACEBACK_RELEASED = "the last traceback's"
_UNDERSCORES = ("_", "__", "___")
# On Python 3.13+ f_locals is a live view (PEP 667); before it is a dict copy.
_SYNC_LOCALS = sys.version_info < (3, 13)


@dataclass(frozen=True)
class Reclaimed:
    """What :func:`free` gave back. Sizes in bytes.

    >>> r = Reclaimed(device="cpu", mode="tracked", allocated_before=96 << 20,
    ...               allocated_after=32 << 20, reserved_before=None, reserved_after=None,
    ...               released=("the last traceback's 3 frames (ValueError)",))
    >>> r.freed
    67108864
    >>> print(r)  # doctest: +NORMALIZE_WHITESPACE
    gpumem free: 64.0 MiB came back (tracked on cpu): 96.0 MiB -> 32.0 MiB allocated;
    released: the last traceback's 3 frames (ValueError);
    %debug is no longer available for the last error
    """

    device: str
    mode: str  # "tracked" or "measured"
    allocated_before: int
    allocated_after: int
    #: The CUDA caching allocator's reserved bytes; None in tracked mode.
    reserved_before: int | None
    reserved_after: int | None
    #: What nbmem let go of, in words, e.g. "Out[4] (a Tensor)".
    released: tuple[str, ...]

    @property
    def freed(self) -> int:
        """Allocated bytes that came back (negative if something allocated meanwhile)."""
        return self.allocated_before - self.allocated_after

    @property
    def debug_lost(self) -> bool:
        """True when the last error's traceback was let go, so ``%debug`` has nothing to open."""
        return any(item.startswith(_TRACEBACK_RELEASED) for item in self.released)

    def _parts(self) -> list[str]:
        came_back = f"{format_bytes(self.freed)} came back" if self.freed > 0 else "nothing came back"
        parts = [
            f"gpumem free: {came_back} ({self.mode} on {self.device}):"
            f" {format_bytes(self.allocated_before)} -> {format_bytes(self.allocated_after)} allocated"
        ]
        if self.reserved_before is not None and self.reserved_after is not None:
            parts.append(f"{format_bytes(self.reserved_before)} -> {format_bytes(self.reserved_after)} reserved")
        parts.append("released: " + (", ".join(self.released) if self.released else "nothing"))
        if self.debug_lost:
            parts.append("%debug is no longer available for the last error")
        return parts

    def __str__(self) -> str:
        return "; ".join(self._parts())

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        head, *rest = self._parts()
        items = "".join(f"<li>{html.escape(part)}</li>" for part in rest)
        return (
            f'<div class="nbmem-free" style="font-family:sans-serif;font-size:13px">'
            f"<b>{html.escape(head)}</b><ul style='margin:2px 0'>{items}</ul></div>"
        )


def free(shell: Any = None, *, device: str | torch.device | None = None, empty_cache: bool = True) -> Reclaimed:
    """Let go of the last error's frames and of tensors in the output cache, then collect.

    ``shell`` defaults to the running IPython shell; outside IPython only
    ``sys.last_*`` is cleared. Figures are measured on CUDA when it is
    available (``device`` defaults to the current CUDA device) and tracked on
    the cpu otherwise. ``empty_cache=False`` keeps the CUDA allocator's cache.
    After this, ``%debug`` can no longer open the last error.

    >>> result = free()
    >>> result.freed >= 0
    True
    """
    if shell is None:
        shell = _running_shell()

    def release() -> list[str]:
        released = _release_last_error(shell)
        if shell is not None:
            released += _release_outputs(shell)
        return released

    return _reclaim(release, device, empty_cache)


def release_error(error: BaseException, *, device: str | torch.device | None = None, empty_cache: bool = True) -> Reclaimed:
    """Clear the locals of the frames of ``error``, an error still being raised.

    For ``%%gpumem --free-on-oom``: the traceback stays, so IPython still shows
    every line of it, but the tensors the failed code held in its frames go
    now, before IPython files the error away. ``%debug`` can't inspect them.
    """

    def release() -> list[str]:
        chain = list(_chained([error]))
        frames = _clear_frames(e.__traceback__ for e in chain if e.__traceback__ is not None)
        count = f"{frames} frame" + ("" if frames == 1 else "s")
        return [f"{_TRACEBACK_RELEASED} {count} ({type(error).__name__})"]

    return _reclaim(release, device, empty_cache)


def release_error_once_shown(shell: Any, error: BaseException, device: str | torch.device | None,
                             show: Callable[[Reclaimed], Any] | None) -> None:
    """:func:`release_error` once IPython has shown the error's traceback (its next ``post_run_cell``, once).

    Cleared before, nbmem's frames lose their ``__tracebackhide__`` with their
    locals, and IPython showed them in the user's traceback. ``show`` gets
    what came back (None: nothing shown).
    """

    def release(*_: Any) -> None:
        try:
            shell.events.unregister("post_run_cell", release)
        except ValueError:
            pass
        if release in _PENDING:
            _PENDING.remove(release)
        reclaimed = release_error(error, device=device)
        if show is not None:
            show(reclaimed)

    _PENDING.append(release)  # first: a Ctrl-C between the two leaves nothing registered that forget_pending misses
    shell.events.register("post_run_cell", release)


#: The callbacks release_error_once_shown registered and that have not run yet.
_PENDING: list[Callable[..., None]] = []


def forget_pending(shell: Any) -> None:
    """Unregister every :func:`release_error_once_shown` callback not run yet (``%unload_ext``)."""
    while _PENDING:
        release = _PENDING.pop()
        try:
            shell.events.unregister("post_run_cell", release)
        except ValueError:
            pass


def _reclaim(release: Callable[[], list[str]], device: str | torch.device | None, empty_cache: bool) -> Reclaimed:
    """Measure, let go of what ``release`` drops, collect, empty the CUDA cache, measure again."""
    mode, where = _measuring(device)
    allocated_before, reserved_before = _figures(mode, where)
    released = release()
    gc.collect()
    if empty_cache and mode == "measured":
        device_counter(where).empty_cache()
    allocated_after, reserved_after = _figures(mode, where)
    return Reclaimed(
        device=str(where),
        mode=mode,
        allocated_before=allocated_before,
        allocated_after=allocated_after,
        reserved_before=reserved_before,
        reserved_after=reserved_after,
        released=tuple(released),
    )


# -- measuring --------------------------------------------------------------


def _running_shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _measuring(device: str | torch.device | None) -> tuple[str, torch.device]:
    return resolve_backend("auto", device)


def _figures(mode: str, where: torch.device) -> tuple[int, int | None]:
    if mode == "measured":
        counter = device_counter(where)
        return counter.allocated(), counter.reserved()
    tracker = default_tracker(where)
    if not tracker.active:
        # every storage alive, as a cell's baseline counts it (issue 12), and counters an interrupt
        # left out of step made whole again (adopt_live reconciles first)
        tracker.adopt_live()
    return tracker.allocated(), None


# -- the last error -----------------------------------------------------------


def _release_last_error(shell: Any) -> list[str]:
    """Clear the frames of the last error and drop every reference IPython keeps to it."""
    errors: list[BaseException] = []
    tracebacks: list[types.TracebackType] = []
    for name in _SYS_LAST:
        _collect(getattr(sys, name, None), errors, tracebacks)
    formatters: list[Any] = []
    result = None
    debugger = None
    if shell is not None:
        for attribute in ("InteractiveTB", "SyntaxTB"):
            formatter = getattr(shell, attribute, None)
            held = getattr(formatter, "tb", None)
            if held is not None:
                formatters.append(formatter)
                # a chained exception's traceback is stored as a tuple (ultratb.FormattedTB)
                for item in held if isinstance(held, tuple) else (held,):
                    _collect(item, errors, tracebacks)
        result = getattr(shell, "last_execution_result", None)
        _collect(getattr(result, "error_in_exec", None), errors, tracebacks)
        debugger = getattr(getattr(shell, "InteractiveTB", None), "pdb", None)

    chain = list(_chained(errors))
    for error in chain:
        if error.__traceback__ is not None:
            tracebacks.append(error.__traceback__)
    frames = _clear_frames(tracebacks)

    # The error itself may outlive its frames (on the execution result): only frames count.
    had_error = bool(tracebacks)
    for name in _SYS_LAST:
        if hasattr(sys, name):
            delattr(sys, name)
    for formatter in formatters:
        formatter.tb = None  # VerboseTB.debugger() tests `self.tb is not None`
    # The exception stays on the execution result as the record of the failure; its frames go.
    for error in chain:
        error.__traceback__ = None
    debugger_held = _forget_debugger(debugger)

    released = []
    if had_error:
        kind = type(chain[0]).__name__ if chain else "error"
        count = f"{frames} frame" + ("" if frames == 1 else "s")
        released.append(f"{_TRACEBACK_RELEASED} {count} ({kind})")
    if debugger_held:
        released.append("the debugger's frames from the last %debug")
    return released


def _collect(value: Any, errors: list[BaseException], tracebacks: list[types.TracebackType]) -> None:
    if isinstance(value, BaseException):
        errors.append(value)
    elif isinstance(value, types.TracebackType):
        tracebacks.append(value)


def _chained(errors: Iterable[BaseException]) -> Iterator[BaseException]:
    """Each error with its causes, contexts and group members, once each."""
    seen: set[int] = set()
    pending = list(errors)
    while pending:
        error = pending.pop(0)
        if id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        pending += [linked for linked in (error.__cause__, error.__context__) if linked is not None]
        pending += list(getattr(error, "exceptions", ()) or ())  # ExceptionGroup


def _clear_frames(tracebacks: Iterable[types.TracebackType | None]) -> int:
    """Clear the locals of every finished frame in ``tracebacks``; returns how many frames.

    As ``traceback.clear_frames``: a frame still running (the caller's own, if
    the error was caught in it) refuses with RuntimeError and is left as it is.
    """
    seen: set[int] = set()
    cleared = 0
    for traceback in tracebacks:
        while traceback is not None:
            frame = traceback.tb_frame
            traceback = traceback.tb_next
            if id(frame) in seen:
                continue
            seen.add(id(frame))
            try:
                frame.clear()
            except RuntimeError:
                continue
            cleared += 1
            if _SYNC_LOCALS and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
                # The traceback formatter filled f_locals; this read empties it
                # of the variables clear() dropped (PyFrame_FastToLocals). Only
                # a function's: a module's or class body's f_locals is its namespace.
                frame.f_locals
    return cleared


def _forget_debugger(debugger: Any) -> bool:
    """Drop the frames an IPython ``Debugger`` keeps after a ``%debug`` session."""
    if debugger is None:
        return False
    held = any(getattr(debugger, name, None) is not None for name in ("botframe", "curframe")) or bool(
        getattr(debugger, "curframe_locals", None)
    )
    if not held:
        return False
    debugger.forget()  # stack, curframe
    debugger.botframe = None
    debugger.stopframe = debugger.returnframe = None
    if hasattr(debugger, "curframe_locals"):
        debugger.curframe_locals = {}  # pdb's setup() sets it again before each use
    return True


# -- the output cache -----------------------------------------------------------


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, (torch.Tensor, torch.nn.Module)) for item in value)
    if isinstance(value, dict):
        return any(isinstance(item, (torch.Tensor, torch.nn.Module)) for item in value.values())
    return False


def _what(value: Any) -> str:
    if isinstance(value, torch.nn.Module):
        name = f"{type(value).__name__} module"
    elif isinstance(value, (list, tuple, dict)):
        name = f"{type(value).__name__} holding tensors"
    else:
        name = type(value).__name__
    return ("an " if name[0].lower() in "aeiou" else "a ") + name


def _release_outputs(shell: Any) -> list[str]:
    """Remove output-cache values that hold tensors from every place IPython keeps them."""
    user_ns = getattr(shell, "user_ns", None)
    if not isinstance(user_ns, dict):
        return []
    hidden = getattr(shell, "user_ns_hidden", None)
    namespaces = [user_ns] + ([hidden] if isinstance(hidden, dict) else [])
    history = getattr(shell, "history_manager", None)
    output_cache = getattr(history, "output_hist", None)
    if not isinstance(output_cache, dict):
        output_hist = user_ns.get("_oh")
        output_cache = output_hist if isinstance(output_hist, dict) else {}
    displayhook = getattr(shell, "displayhook", None)
    result = getattr(shell, "last_execution_result", None)

    # Candidates in order: Out[n] first, then what only the display hook holds.
    # A `_` the user assigned is theirs: it goes only if it is an output too.
    candidates: dict[int, Any] = {}
    for value in list(output_cache.values()):
        candidates.setdefault(id(value), value)
    for name in _UNDERSCORES:
        value = getattr(displayhook, name, None)
        if value is not None:
            candidates.setdefault(id(value), value)
    if result is not None and getattr(result, "result", None) is not None:
        candidates.setdefault(id(result.result), result.result)

    released = []
    for value in candidates.values():
        if not _holds_tensors(value):
            continue
        numbers = sorted(number for number, cached in output_cache.items() if cached is value)
        names = [name for name in _UNDERSCORES if user_ns.get(name) is value or getattr(displayhook, name, None) is value]
        for number in numbers:
            del output_cache[number]
        for namespace in namespaces:
            for name in [key for key, held in namespace.items() if held is value and _is_output_name(key)]:
                del namespace[name]
        for name in _UNDERSCORES:
            if displayhook is not None and getattr(displayhook, name, None) is value:
                setattr(displayhook, name, None)  # as InteractiveShell.del_var does
        if result is not None and getattr(result, "result", None) is value:
            result.result = None
        where = ", ".join([f"Out[{number}]" for number in numbers] or names or ["the last output"])
        released.append(f"{where} ({_what(value)})")
    return released


def _is_output_name(name: Any) -> bool:
    """``_``, ``__``, ``___`` or ``_<n>``: the names the display hook writes."""
    return isinstance(name, str) and (name in _UNDERSCORES or (name[:1] == "_" and name[1:].isdigit()))
