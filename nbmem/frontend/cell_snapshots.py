"""Each measured cell written as a PyTorch memory snapshot (``nbmem profile --snapshot DIR``): ``exec-N.pickle``.

Measured on CUDA, the file is what the caching allocator itself recorded
(:class:`~nbmem.tracking.history.AllocatorHistory`, started before the cell and
dumped after it); tracked, nbmem's own storages with its categories and lines
(:meth:`nbmem.MemoryResult.to_snapshot`). An IPython hook must never break the
cell that ran: a snapshot that can't be written is said, not raised.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.results import MemoryResult
from ..tracking.history import AllocatorHistory
from ..tracking.backends import resolve_backend

__all__ = ["records_history", "records_pytorch_history", "start_history", "write_cell_snapshot"]


def records_history(options: Any, cell_number: int | None) -> bool:
    """Whether this cell's snapshot comes from PyTorch's own history: a folder, a numbered cell, measured on CUDA
    (the only backend that records one)."""
    return options.snapshots is not None and cell_number is not None and records_pytorch_history(options.backend,
                                                                                                  options.device)


def records_pytorch_history(backend: str, device: Any) -> bool:
    """Whether a cell measured with these options gets PyTorch's own allocator history: measured on CUDA, the only
    backend that records one (elsewhere a snapshot is made from nbmem's timeline)."""
    mode, where = resolve_backend(backend, device)
    return mode == "measured" and where.type == "cuda"


def start_history(folder: str, cell_number: int) -> AllocatorHistory:
    return AllocatorHistory(os.path.join(folder, f"exec-{cell_number}.pickle")).start()


def write_cell_snapshot(measured: MemoryResult, folder: str | None, recorder: AllocatorHistory | None) -> None:
    """The cell's snapshot: PyTorch's (dumped now, recording stopped) or nbmem's from its timeline."""
    if recorder is not None:
        try:
            recorder.finish(failed=True)
        finally:
            if not recorder.written:
                print(f"gpumem: no snapshot of cell [{measured.execution_count}] (PyTorch could not write "
                      f"{recorder.path})")
        return
    if folder is not None and getattr(measured.timeline, "events", None) and measured.execution_count is not None:
        try:
            measured.to_snapshot(os.path.join(folder, f"exec-{measured.execution_count}.pickle"))
        except Exception as error:  # an IPython hook: say it, never break the cell that ran
            print(f"gpumem: no snapshot of cell [{measured.execution_count}] ({type(error).__name__}: {error})")
