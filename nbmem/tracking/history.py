"""PyTorch's own allocator history, recorded around a measured block and written as the real snapshot.

On a CUDA device, ``%%gpumem --snapshot FILE`` (and ``nbmem profile --snapshot
DIR``) writes what the caching allocator itself recorded:
``torch.cuda.memory._record_memory_history()`` is turned on before the block
(unless it already was), ``torch.cuda.memory._dump_snapshot(FILE)`` writes the
snapshot after it, also when the block fails (an out-of-memory error's
snapshot is the one worth reading), and recording is turned off again only
if nbmem turned it on. Without CUDA, nbmem writes its own tracked storages
instead (:meth:`nbmem.MemoryResult.to_snapshot`).

Untested on CUDA hardware so far: the calls are PyTorch's documented private
API (torch/cuda/memory.py), exercised here against stand-ins.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["AllocatorHistory", "MAX_ENTRIES"]

#: Allocator events kept (PyTorch's default is 100,000; a training step makes a few thousand).
MAX_ENTRIES = 100_000


class AllocatorHistory:
    """Record CUDA's allocator history for a block and dump the snapshot to ``path`` when it ends.

    ``start()`` turns recording on (unless it already was); ``finish()`` writes
    the snapshot and turns recording off again if ``start()`` turned it on;
    ``finish(failed=True)`` does the same after the block failed and never
    raises (the block's error is the one to see); ``stop()`` only turns
    recording off (after an interrupt). All three may be called again.

    Example (on a CUDA machine)::

        with AllocatorHistory("step.pickle"):
            train_step()
        snapshot = nbmem.load_snapshot("step.pickle")
    """

    def __init__(self, path: str | os.PathLike[str], max_entries: int = MAX_ENTRIES) -> None:
        self.path = os.fspath(path)
        self.max_entries = max_entries
        self._started = False
        #: whether the snapshot was written
        self.written = False

    def start(self) -> AllocatorHistory:
        if not _history_enabled():
            self._started = True  # first: an interrupt inside the call below still turns it off in stop()
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        return self

    def finish(self, failed: bool = False) -> None:
        """Write the snapshot (before recording stops: stopping clears PyTorch's record), then stop."""
        try:
            if not self.written:
                torch.cuda.memory._dump_snapshot(self.path)
                self.written = True
        except Exception:
            if not failed:
                raise
        finally:
            self.stop()

    def stop(self) -> None:
        if self._started:
            self._started = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def __enter__(self) -> AllocatorHistory:
        return self.start()

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        self.finish(failed=kind is not None)


def _history_enabled() -> bool:
    """Whether something (the user, a profiler) already records the allocator's history."""
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(probe()) if probe is not None else False
