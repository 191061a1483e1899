"""What a launch's ranks leave in its folder, read back: answers, errors, logs and the stacks of stuck ranks.

Each rank of :func:`nbmem.launch` writes into the launch folder
(:mod:`nbmem.whatif.launch_folders`): ``rank{N}.log`` (its prints, and the
stacks faulthandler writes on SIGUSR1), ``rank{N}.result`` (its answer,
pickled), and ``rank{N}.error`` (when it failed, on the monotonic clock,
then its traceback). :mod:`nbmem.whatif.launcher` runs the processes; this
module only reads their files and says what they mean.
"""

from __future__ import annotations

import os
import pickle
import signal
from typing import Any

__all__: list[str] = []  # private to nbmem.whatif.launcher


def _stacks(dump: str, main_lines: int = 30, other_lines: int = 8) -> str:
    r"""A faulthandler dump of every thread, shortened: the rank's main thread first, where faulthandler puts it last.

    The main thread is cut at ``_rank_main`` (below it, the parent's frames the fork copied), to ``main_lines``
    frames; each other thread to ``other_lines``; the rank's own prints around the dump are left out.

    >>> dump = (
    ...     'Thread 0x1 (most recent call first):\n  File "w.py", line 3 in helper\n\n'
    ...     'Current thread 0x2 (most recent call first):\n  File "u.py", line 9 in target\n'
    ...     '  File "nbmem/whatif/launcher.py", line 390 in _rank_main\n  File "process.py", line 108 in run\n'
    ... )
    >>> print(_stacks(dump))
    Current thread 0x2 (most recent call first):
      File "u.py", line 9 in target
      File "nbmem/whatif/launcher.py", line 390 in _rank_main
    Thread 0x1 (most recent call first):
      File "w.py", line 3 in helper
    """
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.endswith("(most recent call first):"):
            blocks.append([line])
        elif blocks and line.startswith("  File "):
            blocks[-1].append(line)
    main = next((block for block in blocks if any(line.endswith(" in _rank_main") for line in block)), None)
    shown = []
    if main is not None:
        end = next(index for index, line in enumerate(main) if line.endswith(" in _rank_main"))
        shown += main[: min(end, main_lines) + 1]
    for block in blocks:
        if block is not main:
            shown += block[: other_lines + 1]
    return "\n".join(shown)


def _read_log(folder: str, rank: int, offset: int = 0) -> str:
    """What a rank's log holds from byte ``offset`` on ("" if unreadable); bytes that are not UTF-8 replaced."""
    try:
        with open(os.path.join(folder, f"rank{rank}.log"), "rb") as file:
            file.seek(offset)
            return file.read().decode(errors="replace")
    except OSError:
        return ""


def _log_size(folder: str, rank: int) -> int:
    try:
        return os.path.getsize(os.path.join(folder, f"rank{rank}.log"))
    except OSError:
        return 0


def _reported(folder: str, rank: int) -> bool:
    return os.path.exists(os.path.join(folder, f"rank{rank}.error"))


def _finished_at(folder: str, rank: int) -> float:
    """When a rank failed, on the machine's monotonic clock (the first to fail caused the others' failures).

    Read from the error file's first line: file times tick in jiffies, too
    coarse to order two ranks that fail a millisecond apart.
    """
    try:
        with open(os.path.join(folder, f"rank{rank}.error")) as file:
            return int(file.readline())
    except (OSError, ValueError):
        return float("inf")


def _failure(folder: str, rank: int, code: int | None, world_size: int, hung: str = "") -> str:
    try:
        with open(os.path.join(folder, f"rank{rank}.error")) as file:
            file.readline()  # when it failed
            text = file.read().rstrip()
    except OSError:
        text = f"it {_how_it_ended(code)} before reporting an error{_log_tail(folder, rank)}"
    return f"rank {rank} of {world_size} failed, so the launch was stopped and every rank killed:{hung}\n{text}"


def _how_it_ended(code: int | None) -> str:
    """A rank's exit code in words.

    >>> _how_it_ended(-9)
    "was killed by SIGKILL (signal 9; the kernel's out-of-memory killer sends it: `dmesg` says whether it did)"
    >>> _how_it_ended(-11)
    'was killed by SIGSEGV (signal 11: a segmentation fault, a crash in native code)'
    >>> _how_it_ended(3)
    'ended with exit code 3 (os._exit, or native code ending the process)'
    """
    if code is None or code >= 0:
        return f"ended with exit code {code} (os._exit, or native code ending the process)"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = {
        "SIGKILL": "; the kernel's out-of-memory killer sends it: `dmesg` says whether it did",
        "SIGSEGV": ": a segmentation fault, a crash in native code",
        "SIGABRT": ": an abort, e.g. a failed check in native code",
        "SIGBUS": ": a bus error, a crash in native code",
    }.get(name, "")
    return f"was killed by {name} (signal {-code}{why})"


def _log_tail(folder: str, rank: int, lines: int = 20) -> str:
    tail = _read_log(folder, rank).splitlines()[-lines:]
    return ("\nlast lines rank %d printed:\n" % rank + "\n".join(tail)) if tail else ""


def _load(folder: str, rank: int) -> Any:
    with open(os.path.join(folder, f"rank{rank}.result"), "rb") as file:
        return pickle.load(file)
