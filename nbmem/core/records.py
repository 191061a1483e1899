"""What a tracker records: one storage, the breakdown at a peak, a recording for a timeline, a virtual OOM.

Plain records, kept apart from :mod:`nbmem.tracking.tracker`'s accounting.

>>> record = StorageRecord(4096, born=3, op=None, module="Linear", shape=(1024,), dtype="float32")
>>> record.category, record.died
('other', None)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .units import torch_format_size

__all__ = ["StorageRecord", "PeakDetail", "Recording", "VirtualOOM", "rebuild_counters"]


class StorageRecord:
    """What the tracker knows of one live (or, in a recording, past) storage."""

    __slots__ = ("size", "category", "module", "born", "died", "op", "shape", "dtype", "line", "asked")

    def __init__(self, size: int, born: int, op: Any, module: str | None, shape: tuple[int, ...], dtype: Any,
                 asked: int | None = None) -> None:
        self.size = size  # bytes counted: the block an allocator simulation gave, where one is fed
        self.asked = size if asked is None else asked  # its bytes rounded to the allocator's 512 B, as asked for
        self.category = "other"
        self.module = module
        self.born = born  # op index; -1 for storages made before tracking saw them
        self.died: int | None = None
        self.op = op
        self.shape = shape
        self.dtype = dtype
        self.line: Any = None  # the user's line that made it, while lines are asked for (nbmem.tracking.lines)


class PeakDetail:
    """Live bytes by category and by top-level module at the moment of a peak."""

    __slots__ = ("op_index", "op", "module", "categories", "modules", "lines")

    def __init__(
        self, op_index: int, op: Any, module: str | None, categories: dict[str, int], modules: dict[str | None, int],
        lines: dict[Any, int] | None = None,
    ) -> None:
        self.op_index = op_index
        self.op = op
        self.module = module
        self.categories = categories
        self.modules = modules
        self.lines = lines  # live bytes per user line, when lines were asked for


class Recording:
    """Every storage alive during a stretch of ops, for a timeline of the stretch."""

    def __init__(self, start: int, alive: list[StorageRecord]) -> None:
        self.start = start
        self.storages = alive
        self.ops: list[Any] = []


def _virtual_device_is_full(oom: "VirtualOOM") -> None:
    # IPython always shows the frame that raises, so it is this one: the op in
    # the frame above tried to allocate more than the virtual device has left.
    raise torch.OutOfMemoryError(oom.message())


@dataclass(frozen=True)
class VirtualOOM:
    """An allocation that did not fit a virtual device's capacity."""

    request: int
    allocated: int
    capacity: int
    label: str
    device: str
    op: Any = None
    module: str | None = None

    def message(self) -> str:
        """The error text, in PyTorch's own format (c10/cuda/CUDACachingAllocator.cpp), then nbmem's note."""
        free = max(self.capacity - self.allocated, 0)
        name = f" ({self.label})" if self.label else ""
        return (
            f"CUDA out of memory. Tried to allocate {torch_format_size(self.request)}. GPU 0 has a total capacity of "
            f"{torch_format_size(self.capacity)} of which {torch_format_size(free)} is free. Of the allocated memory "
            f"{torch_format_size(self.allocated)} is allocated by PyTorch. "
            f"[nbmem: virtual device{name}, tracked on {self.device}; no CUDA memory was used. "
            f"The op was {self.op}{' in ' + self.module if self.module else ''}.]"
        )


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _device_test(device: torch.device) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor is on ``device``, in the fastest test for a tracker's hot path."""
    if device.type == "cpu":
        # is_cpu is the fastest test on a plain tensor; on a FakeTensor it is a
        # dispatched op (prim.device, about 4 us) where .device is a property
        return lambda tensor: tensor.is_cpu if type(tensor) in _PLAIN else tensor.device.type == "cpu"
    index = device.index
    kind = device.type
    return lambda tensor: tensor.device.type == kind and tensor.get_device() == index


@functools.cache
def _wraps(kind: type) -> bool:
    """``is_traceable_wrapper_subclass`` (a DTensor; not a FakeTensor) of a tensor of this subclass, once per type."""
    # torch's own _has_traceable_wrapper_subclass_protocol is this test, but only
    # from 2.12 on (2.11 has none: seen on a GPU machine, 2026-11-25)
    return hasattr(kind, "__tensor_flatten__") and hasattr(kind, "__tensor_unflatten__")


def _parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors that hold the memory of a tensor without a storage of its own.

    A sparse tensor's are its index and value tensors; a wrapper subclass's
    (a DTensor, as FSDP2's sharded parameters are) its inner tensors, e.g.
    the local shard. Nested tensors and other layouts: none.
    """
    layout = tensor.layout
    if layout is torch.sparse_coo:
        return (tensor._indices(), tensor._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return tuple(inner for inner in (getattr(tensor, name) for name in names) if isinstance(inner, torch.Tensor))
    return ()


def rebuild_counters(
    storages: dict[int, StorageRecord], refs: dict[int, Any]
) -> tuple[list[int], int, dict[str, int], dict[str | None, int]]:
    """The tracker's counters taken again from its records, after an interrupt cut an update short.

    Each step of the accounting changes several counters one after the
    other; Ctrl-C between two of them leaves them out of step (issue 12). The
    records are the truth. A record without its weak reference (or the
    reverse, or a dead one) is dropped from both dicts; its keys are returned
    ("orphans": a storage still alive is found again by the next walk), then
    allocated bytes, bytes per category, bytes per module.

    >>> records = {1: StorageRecord(512, 0, None, "Linear", (4,), "float32"), 2: StorageRecord(1024, 0, None, None, (8,), "float32")}
    >>> class Alive:
    ...     def __call__(self): return self
    >>> rebuild_counters(records, {1: Alive()})[:2], list(records)
    (([2], 512), [1])
    """
    from .results import CATEGORIES

    for key in [key for key, ref in refs.items() if key not in storages or ref() is None]:
        refs.pop(key, None)
    orphans = [key for key in storages if key not in refs]
    for key in orphans:
        storages.pop(key, None)
    categories = dict.fromkeys(CATEGORIES, 0)
    modules: dict[str | None, int] = {}
    for record in storages.values():
        categories[record.category] += record.size
        modules[record.module] = modules.get(record.module, 0) + record.size
    return orphans, sum(categories.values()), categories, {module: size for module, size in modules.items() if size}
