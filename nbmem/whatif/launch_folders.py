"""A launch's folder in the temporary folder, and the removal of those their launches left behind.

:func:`nbmem.launch` keeps each rank's log, answer and error, and gloo's
rendezvous file, in a folder of its own, removed when the launch ends in any
way Python can see (an error, Ctrl-C, SIGTERM). SIGKILL (or a crash in native
code) ends the process with no cleanup, and its ranks die with it (they ask
the kernel to, ``PR_SET_PDEATHSIG``): the folder stayed behind. So every
folder is locked while in use, by the launch and its ranks alike, and each
launch first removes the folders no process holds any more.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from typing import Iterator

__all__ = ["launch_folder", "remove_stale_folders"]

#: A launch folder's name: this prefix, the pid of the process that runs the launch, "-", mkdtemp's random part.
_FOLDER_PREFIX = "nbmem-launch-"
#: The file in a launch folder that its launch holds locked (flock) while the folder is in use.
_LOCK_NAME = "lock"


@contextlib.contextmanager
def launch_folder() -> Iterator[str]:
    """A new launch folder in the temporary folder, locked while in use and removed after; stale ones removed first.

    The lock is an ``flock`` on ``lock`` in the folder, taken before the
    folder is used and kept until it has been removed. The ranks inherit it
    with the fork (a flock belongs to the open file, which they share), so it
    is free only once this process *and* every rank has ended, however they
    ended: the kernel releases it. That is what :func:`remove_stale_folders`
    looks at; the pid in the name covers the moment before the lock exists.
    """
    remove_stale_folders(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
    lock = None
    try:
        # locked under another name, then put in place: a cleanup that finds the lock file finds it locked
        path = os.path.join(folder, _LOCK_NAME)
        lock = os.open(f"{path}.new", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file just made: nobody else holds it
        os.rename(f"{path}.new", path)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)  # after the removal: the folder is never unlocked while it exists


def remove_stale_folders(temporary: str) -> list[str]:
    """Remove the launch folders in ``temporary`` that no launch uses any more; returns their paths.

    A launch whose process was killed with SIGKILL (or died in native code)
    runs no cleanup, and its ranks die with it (``launcher._die_with_parent``): its
    folder stayed behind. A folder is stale when it is this user's and its
    lock is free (no process holds it: neither the launch nor any rank); one
    without a lock file (its launch was killed between creating the folder
    and locking it) when the pid in its name is not running. Anything else is
    left alone: another user's folder, a folder whose lock is held (a live
    launch, in this process or any other), one whose pid is running (or
    can't be told), and names this function did not make.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(temporary))
    except OSError:
        return removed
    for entry in entries:
        owner = _folder_owner(entry.name)
        if owner is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _folder_unused(entry.path, owner):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _folder_owner(name: str) -> int | None:
    """The pid in a launch folder's name; None for any other name (older launches' names carry none).

    >>> _folder_owner("nbmem-launch-4242-k3j_x9ab"), _folder_owner("nbmem-launch-k3j_x9ab"), _folder_owner("notes")
    (4242, None, None)
    """
    if not name.startswith(_FOLDER_PREFIX):
        return None
    pid, dash, _ = name[len(_FOLDER_PREFIX):].partition("-")
    return int(pid) if dash and pid.isdigit() else None


def _folder_unused(folder: str, owner: int) -> bool:
    """No process uses this launch folder: its lock is free, or, without a lock file, its owner's pid is not running."""
    try:
        lock = os.open(os.path.join(folder, _LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return not _running(owner)
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: a live launch, or a rank still running
    finally:
        os.close(lock)  # releases it, if taken
    return True


def _running(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal, another user's, counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
