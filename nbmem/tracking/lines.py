"""Which line of the user's code holds the memory: storages charged to the innermost frame that is the user's.

While a scope asks for lines (``nbmem.track(lines=True)``, ``%%gpumem --lines``), the
dispatch engine's tracker tells a :class:`LineCounter` of every storage it counts: a new
one is charged to the innermost frame on the stack that is the user's (a cell, a
script, a file of theirs: not PyTorch, nbmem, the standard library or anything
installed in site-packages), so backward's allocations go to the ``loss.backward()``
line and the optimizer's to ``optimizer.step()``; a storage that existed before
goes to ``None`` (alive before the block). The counter keeps live bytes per line
(taken into the breakdown at each peak, as categories are) and bytes allocated per line.
The native engine keeps the same figures in C++ (its allocations charged from
the Python stack read at each one, with the same rules for which files are the
user's: :class:`nbmem.tracking.native_tracking.NativeLines`).

A line is ``(file name, line number)``, or None for storages alive before the block.
A stack walk per new storage, each file's verdict cached; nothing per op.

>>> counter = LineCounter()
>>> def made_here():
...     return counter.line_now()
>>> made_here()[1] == made_here.__code__.co_firstlineno + 1   # the doctest's own line is the user's
True
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from types import CodeType
from typing import Any, Iterable

import torch

from ..core.results import LineUsage

__all__ = ["LineCounter", "describe", "usage", "start_lines", "stop_lines"]

_NBMEM = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
#: a file name starting with one of these is not the user's: nbmem, PyTorch, the standard library, what is
#: installed, frozen modules, the code FX generates (``torch.fx`` graphs, ``aot_eager``'s)
NOT_THE_USERS_STARTING = tuple(sorted(
    {_NBMEM, _TORCH, "<frozen", "<eval_with_key>"}
    | {path + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib") if (path := sysconfig.get_paths().get(key))}
    | ({os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "")} if os.environ.get("TORCHINDUCTOR_CACHE_DIR") else set())
))
#: nor is one containing one of these (anything installed; inductor's generated code in its default cache)
NOT_THE_USERS_CONTAINING = ("site-packages", "dist-packages", os.sep + "torchinductor_")

#: the same rules for the native engine's C++: the prefixes one per line, an empty line, the parts
NOT_THE_USERS_CHARS = os.fsencode("\n".join(NOT_THE_USERS_STARTING) + "\n\n" + "\n".join(NOT_THE_USERS_CONTAINING))

#: file name -> whether its frames are the user's (by name: no code object is kept alive)
_VERDICTS: dict[str, bool] = {}


def _is_users(code: CodeType) -> bool:
    name = code.co_filename
    verdict = _VERDICTS.get(name)
    if verdict is None:
        verdict = not (name.startswith(NOT_THE_USERS_STARTING) or any(part in name for part in NOT_THE_USERS_CONTAINING))
        _VERDICTS[name] = verdict
    return verdict


#: the frames line_now skips when a storage is counted, all nbmem's: its own, made's, and the tracker's _count's
_FROM_MADE = 3


class LineCounter:
    """Live and allocated bytes per line of the user's code, for one tracker while lines are asked for."""

    def __init__(self, live_before: int = 0) -> None:
        #: the thread that asked for lines: storages made on another (CUDA's backward runs on its own threads)
        #: go to the line this one is at meanwhile (``loss.backward()``, waiting for them)
        self.thread = threading.get_ident()
        #: live bytes per line now; ``None``: storages alive before the lines were asked for
        self.live: dict[Any, int] = {None: live_before} if live_before else {}
        #: bytes allocated per line (never goes down)
        self.allocated: dict[Any, int] = {}
        self.owners: set[int] = set()  # ids of the scopes that asked for lines (nested scopes share one counter)

    def line_now(self, skip: int = 1) -> tuple[str, int] | None:
        """The innermost frame of the user's code on the asking thread's stack, or None (all PyTorch's or nbmem's).

        ``skip``: on the asking thread, the frames known to be nbmem's, this
        call's own included (the walk starts above them).
        """
        frame: Any = sys._getframe(skip) if threading.get_ident() == self.thread else sys._current_frames().get(self.thread)
        verdicts = _VERDICTS  # the cache read inline: this loop runs for every storage made (about 10 frames each)
        while frame is not None:
            code = frame.f_code
            verdict = verdicts.get(code.co_filename)
            if verdict or (verdict is None and _is_users(code)):
                return code.co_filename, frame.f_lineno
            frame = frame.f_back
        return None

    def made(self, record: Any, adopted: bool) -> None:
        """A storage counted: charged to the user's line running now (None when it existed before)."""
        size, live = record.size, self.live
        if adopted:
            record.line = None
            live[None] = live.get(None, 0) + size
            return
        record.line = line = self.line_now(_FROM_MADE)
        live[line] = live.get(line, 0) + size
        self.allocated[line] = self.allocated.get(line, 0) + size

    def resized(self, record: Any, growth: int) -> None:
        line = record.line
        self.live[line] = self.live.get(line, 0) + growth
        if growth > 0:
            self.allocated[line] = self.allocated.get(line, 0) + growth

    def freed(self, record: Any) -> None:
        line, live = record.line, self.live
        live[line] = live.get(line, 0) - record.size

    def snapshot(self) -> dict[Any, int]:
        return {line: size for line, size in self.live.items() if size}

    def rebuild(self, records: Iterable[Any]) -> None:
        """Live bytes from the records themselves (after Ctrl-C cut an update short)."""
        live: dict[Any, int] = {}
        for record in records:
            live[record.line] = live.get(record.line, 0) + record.size
        self.live = live


def start_lines(tracker: Any, owner: object) -> LineCounter:
    """Have ``tracker`` (the dispatch engine's) charge every storage it counts from now on to the user's line.

    Nested scopes (``owner``) share one counter. :func:`stop_lines` with the
    same owner ends its part, and is safe to repeat, or to run for a start
    Ctrl-C cut short anywhere.
    """
    native = getattr(tracker, "start_lines", None)
    if native is not None:  # the native engine keeps its lines in C++
        return native(owner)  # type: ignore[no-any-return]
    tracker.drain()
    counter: LineCounter | None = tracker._lines
    if counter is None:
        for record in tracker._storages.values():
            record.line = None  # a line an earlier counter gave is not this one's: all of them were there before
        tracker._settle_peak()
        counter = LineCounter(tracker._allocated)
        if tracker._peak_detail is not None and tracker._peak_detail.lines is None:
            # the peak settled now (a scope opening reset it) is this moment: everything alive was there before
            tracker._peak_detail.lines = {None: tracker._allocated} if tracker._allocated else {}
        tracker._lines = counter
    counter.owners.add(id(owner))
    return counter


def stop_lines(tracker: Any, owner: object) -> None:
    """``owner``'s scope no longer wants lines; the last one out stops them."""
    native = getattr(tracker, "stop_lines", None)
    if native is not None:
        native(owner)
        return
    counter = tracker._lines
    if counter is not None:
        counter.owners.discard(id(owner))
        if not counter.owners:
            tracker._lines = None


def _cell_numbers() -> dict[str, int]:
    """IPython's cell file names -> execution counts, if IPython runs here (never imported for it)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return dict(getattr(getattr(shell, "compile", None), "_filename_map", None) or {})


def describe(line: Any, cells: dict[str, int] | None = None) -> tuple[str, str]:
    """(where, source) of a line for a table: ``"cell [3], line 2"`` or ``"train.py:14"``, and its code.

    >>> describe(None)
    ('(alive before)', '')
    >>> describe(("/tmp/ipykernel_1/123.py", 2), {"/tmp/ipykernel_1/123.py": 3})
    ('cell [3], line 2', '')
    """
    if line is None:
        return "(alive before)", ""
    filename, number = line
    source = linecache.getline(filename, number).strip()
    cell = (cells or {}).get(filename)
    where = f"cell [{cell}], line {number}" if cell is not None else f"{os.path.basename(filename)}:{number}"
    return where, source


def usage(at_peak: dict[Any, int], allocated_now: dict[Any, int], allocated_before: dict[Any, int]) -> tuple[LineUsage, ...]:
    """A scope's lines: bytes alive at its peak by line, and bytes each line allocated since the scope began."""
    allocated = {line: size - allocated_before.get(line, 0) for line, size in allocated_now.items()}
    cells = _cell_numbers()
    rows = []
    for line in set(at_peak) | {line for line, size in allocated.items() if size}:
        where, source = describe(line, cells)
        rows.append(LineUsage(where, source, at_peak.get(line, 0), allocated.get(line, 0)))
    return tuple(sorted(rows, key=lambda row: (-row.at_peak, -row.allocated, row.where)))
