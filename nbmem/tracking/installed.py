"""What a tracker installs into torch, and how to take it out again whatever was cut short.

A tracker puts a dispatch mode on this thread's mode stack and replaces
``UntypedStorage.resize_`` (see :func:`watch_resizes`). Ctrl-C can land at any
bytecode, also half-way through installing or removing them (issue 12). So
removal here never trusts the tracker's own bookkeeping: it looks at torch's
state itself (the mode stack, the class attribute) and removes whatever of the
tracker's it finds. Every function is idempotent: when an interrupt cuts one
short, running it again finishes the job.

>>> import torch
>>> from nbmem.tracking.installed import dispatch_modes
>>> dispatch_modes(lambda mode: True)     # no mode on this thread's stack
[]
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

__all__ = ["Activation", "forget_trackers_in_forked_children", "note_native", "forget_native", "remove_every_tracker", "remove_last", "dispatch_modes", "remove_dispatch_modes", "watch_resizes", "unwatch_resizes", "resizes_watched_by"]


def dispatch_modes(belongs: Callable[[TorchDispatchMode], bool]) -> list[TorchDispatchMode]:
    """The modes on this thread's dispatch stack for which ``belongs`` is true, bottom first."""
    return [mode for mode in _get_current_dispatch_mode_stack() if belongs(mode)]


def remove_dispatch_modes(belongs: Callable[[TorchDispatchMode], bool]) -> None:
    """Take every mode ``belongs`` picks off this thread's dispatch stack, leaving the others in place.

    Code in a tracked cell may enter a dispatch mode and never leave it;
    popping the top would then remove theirs. Lift the modes above ours off,
    remove ours, put the others back in their order.
    """
    if not dispatch_modes(belongs):
        return
    above: list[TorchDispatchMode] = []
    try:
        while (top := _get_current_dispatch_mode()) is not None:
            if belongs(top):
                _exit_mode(top)
                if not dispatch_modes(belongs):
                    break
            else:
                above.append(_pop_mode())
    finally:
        for other in reversed(above):
            _push_mode(other)


def _exit_mode(mode: TorchDispatchMode) -> None:
    # TorchDispatchMode.__enter__ saves torch's "in a mode" flags on the mode
    # and __exit__ restores them (torch/utils/_python_dispatch.py); a mode whose
    # __enter__ was interrupted before it saved them is just popped.
    if getattr(mode, "old_dispatch_mode_flags", None):
        mode.__exit__(None, None, None)
    else:
        _pop_mode()


#: Trackers told of every ``UntypedStorage.resize_`` while any is active.
_RESIZE_WATCHERS: list[Any] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize_and_tell(storage: Any, size: int) -> Any:
    """``UntypedStorage.resize_`` while tracking: a storage-level resize is no dispatched op, so no mode sees it."""
    result = _ORIGINAL_RESIZE(storage, size)
    for tracker in _RESIZE_WATCHERS:
        tracker.storage_resized(storage)
    return result


def watch_resizes(tracker: Any) -> None:
    """Tell ``tracker`` of storage resizes (FSDP2 frees and refills gathered parameters this way)."""
    if tracker not in _RESIZE_WATCHERS:
        _RESIZE_WATCHERS.append(tracker)
    torch.UntypedStorage.resize_ = _resize_and_tell  # type: ignore[method-assign, assignment]  # torch types resize_ with two selves


def unwatch_resizes(tracker: Any) -> None:
    """Stop telling ``tracker``; the last one out puts torch's own ``resize_`` back."""
    while tracker in _RESIZE_WATCHERS:
        _RESIZE_WATCHERS.remove(tracker)
    if not _RESIZE_WATCHERS:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]


def resizes_watched_by(tracker: Any) -> bool:
    """Whether ``tracker`` is told of resizes now."""
    return tracker in _RESIZE_WATCHERS


def remove_last(holders: list[object], owner: object) -> None:
    """Remove the last entry of ``holders`` that *is* ``owner`` (by identity), if any.

    >>> first, second = object(), object()
    >>> holders = [first, None, second, None]
    >>> remove_last(holders, None); remove_last(holders, first); remove_last(holders, first)
    >>> holders == [None, second]
    True
    """
    for index in range(len(holders) - 1, -1, -1):
        if holders[index] is owner:
            del holders[index]
            return


class Activation:
    """Activation that survives Ctrl-C, for a tracker with ``_holders``, ``_install()`` and ``_uninstall()``.

    ``_uninstall`` must look at torch's own state and be safe to repeat; then
    an interrupt at any bytecode of :meth:`activate` or :meth:`deactivate`
    leaves everything installed for the holders there are, or nothing.
    """

    _holders: list[object]

    def _install(self) -> None:
        raise NotImplementedError

    def _uninstall(self) -> None:
        raise NotImplementedError

    @property
    def active(self) -> bool:
        return bool(self._holders)

    def activate(self, owner: object = None) -> None:
        """Install the tracker's engine and attribution hooks on this thread (nested calls just count).

        All or nothing: an interrupt at any bytecode leaves the tracker either
        activated once more for ``owner`` or exactly as it was.
        """
        forget_trackers_in_forked_children()
        holders = self._holders
        count = len(holders)
        try:
            if not holders:
                self._uninstall()  # what two quick Ctrl-Cs may have left of an earlier activation
                self._install()
            holders.append(owner)
        except BaseException:
            del holders[count:]
            if not holders:
                self._uninstall()
            raise

    def deactivate(self, owner: object = None) -> None:
        """Undo ``owner``'s :meth:`activate`; the last one removes the engine and every hook.

        Idempotent for an owner (a second call finds nothing of it), and all or
        nothing under an interrupt. With nothing active it still removes
        anything an interrupted activation left behind.
        """
        holders = self._holders
        count = len(holders)
        try:
            remove_last(holders, owner)
            if not holders:
                self._uninstall()
        except BaseException:
            if len(holders) == count:
                remove_last(holders, owner)
            if not holders:
                self._uninstall()
            raise

    def __enter__(self) -> Any:
        self.activate()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.deactivate()


#: Trackers whose engine lives outside Python's tables (the native engine's
#: counting allocator, registered with c10): noted before it goes in, until
#: it is unregistered (``%unload_ext nbmem``).
_NATIVE: list[Any] = []


def note_native(tracker: Any) -> None:
    if tracker not in _NATIVE:
        _NATIVE.append(tracker)


def forget_native(tracker: Any) -> None:
    while tracker in _NATIVE:
        _NATIVE.remove(tracker)


@functools.cache
def forget_trackers_in_forked_children() -> None:
    """From the first activation on, a process forked while a tracker is in starts without it.

    A fork copies the forking thread's dispatch mode stack, torch's global hook
    tables and nbmem's allocator: a DataLoader worker forked in a tracked cell
    ran every op through the copied tracker (about 7x slower, measured), and
    under a virtual ``capacity`` raised its out-of-memory error from a stale
    copy of the parent's counters. The child's copy counts nothing the parent
    sees (a worker's batches come back through shared memory, which the
    parent's tracker counts), so the child takes it all out: the handler runs
    :func:`remove_every_tracker`, which finds nothing to do in a process that
    forked with no tracker in. Registered once; ``os`` keeps no way to take a
    fork handler back, and this one changes nothing while nothing tracks.
    """
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_in_child)


def _forget_in_child() -> None:
    try:
        remove_every_tracker()
    except Exception:  # a forked child must start whatever this found; nbmem's copy is only left in place
        pass


def remove_every_tracker() -> int:
    """Take every tracker out of torch, whoever still holds it: ``%unload_ext nbmem``'s last step.

    Trackers are found in torch's own state (the dispatch mode stack, the
    global hook tables, the ``resize_`` watchers) and among the native
    engine's trackers noted before their allocator went in, so a scope that Ctrl-C cut
    off from its ``stop()`` can't keep hooks on every model for the rest of
    the session (issue 12). Returns how many trackers were still installed.

    >>> remove_every_tracker()
    0
    """
    from .categories import global_hooks

    found: dict[int, Any] = {}
    for mode in _get_current_dispatch_mode_stack():
        if hasattr(getattr(mode, "tracker", None), "_uninstall"):  # a tracker's dispatch mode
            found[id(mode.tracker)] = mode.tracker  # type: ignore[attr-defined]
    for hook in global_hooks():
        found[id(hook.__self__.tracker)] = hook.__self__.tracker
    for tracker in list(_RESIZE_WATCHERS) + [native for native in _NATIVE if native.installed()]:
        found[id(tracker)] = tracker
    for tracker in found.values():
        tracker._holders.clear()
        tracker._uninstall()
        tracker.scopes.close_above(0)  # the abandoned scope's figures
    for native in list(_NATIVE):
        native.unregister()  # its allocator, passing allocations through between blocks, goes too
    from .compiled import forget_watches
    from .host_counters import remove_every

    forget_watches()  # the probe that counts compiled calls (nbmem.tracking.compiled)
    remove_every()  # the optimizer hook of a scope tracked on the CPU (nbmem.tracking.host_counters)
    return len(found)
