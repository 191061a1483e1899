"""Tracked mode: account every tensor storage on a device, without CUDA.

A ``TorchDispatchMode`` sees every ATen operation: factory functions
(``torch.empty``, ``torch.randn``), module construction (``nn.Linear`` builds
its parameters with ``torch.empty``), autograd's backward (``.grad``) and the
optimizer (its state comes from ``zeros_like``). Each output storage nbmem has
not seen is counted at its size rounded as the CUDA allocator would round it,
and a weak reference to the storage removes it again the moment it is freed;
nbmem never keeps a tensor or storage alive.

Storages made before tracking began are found when an operation uses them as
input: they count as already allocated when the scope began ("adopted").
"""

from __future__ import annotations

import collections
import functools
import heapq
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
    is_traceable_wrapper_subclass,
)

from .counters import PeakScopes
from .results import CATEGORIES
from .units import CUDA_BLOCK, round_allocation, torch_format_size

__all__ = ["Tracker", "default_tracker", "CATEGORIES", "StorageRecord", "PeakDetail", "Recording", "VirtualOOM"]

_Tensor = torch.Tensor
# torch.tensor(data) builds its tensor outside the dispatcher and then hands it
# to lift_fresh: the storage is new although it is also the op's input.
_FRESH = {torch.ops.aten.lift_fresh.default}


class _TrackingMode(TorchDispatchMode):
    """Reports every op's inputs and outputs to its tracker; changes nothing."""

    def __init__(self, tracker: "Tracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # nbmem's frames stay out of tracebacks: a virtual out-of-memory error
        # should read like CUDA's, ending at the user's op
        __tracebackhide__ = True
        tracker = self.tracker
        if tracker._foreign:
            tracker.drain()
        tracker._op_index += 1
        tracker._op = func
        if tracker._recordings:
            for recording in tracker._recordings:
                recording.ops.append(func)
        if func not in _FRESH:
            tracker._adopt_all(args)
            if kwargs:
                tracker._adopt_all(kwargs.values())
        out = func(*args, **kwargs) if kwargs else func(*args)
        if tracker._foreign:  # freed while the op ran: before its outputs, which may reuse the storage's place
            tracker.drain()
        if isinstance(out, _Tensor):  # most ops: one tensor out, counted without the walk through _note
            tracker._count(out, False)
        elif isinstance(out, (tuple, list)):
            tracker._note(out)
        return out


_RANK = {name: rank for rank, name in enumerate(CATEGORIES)}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class StorageRecord:
    """What the tracker knows of one live (or, in a recording, past) storage."""

    __slots__ = ("size", "category", "module", "born", "died", "op", "shape", "dtype")

    def __init__(self, size: int, born: int, op: Any, module: str | None, shape: tuple[int, ...], dtype: Any) -> None:
        self.size = size
        self.category = "other"
        self.module = module
        self.born = born  # op index; -1 for storages made before tracking saw them
        self.died: int | None = None
        self.op = op
        self.shape = shape
        self.dtype = dtype


class PeakDetail:
    """Live bytes by category and by top-level module at the moment of a peak."""

    __slots__ = ("op_index", "op", "module", "categories", "modules")

    def __init__(
        self, op_index: int, op: Any, module: str | None, categories: dict[str, int], modules: dict[str | None, int]
    ) -> None:
        self.op_index = op_index
        self.op = op
        self.module = module
        self.categories = categories
        self.modules = modules


class Recording:
    """Every storage alive during a stretch of ops, for a timeline of the stretch."""

    def __init__(self, start: int, alive: list[StorageRecord]) -> None:
        self.start = start
        self.storages = alive
        self.ops: list[Any] = []


class Tracker:
    """Live bytes of the tensor storages on one device, with a running peak.

    A tracker is a peak counter (see :mod:`nbmem.counters`): scopes opened on
    ``tracker.scopes`` nest correctly. :meth:`activate` installs the dispatch
    mode and the attribution hooks (re-entrantly); storages it saw stay
    accounted between activations until they are freed. Each storage has a
    category (:data:`CATEGORIES`) and the top-level module that made or owns
    it; the categories always sum to :meth:`allocated`.

    >>> tracker = Tracker("cpu")
    >>> with tracker:
    ...     a = torch.ones(1024, 1024)     # 1024 * 1024 * 4 bytes = 4 MiB
    >>> tracker.allocated(), tracker.by_category()["other"]
    (4194304, 4194304)
    >>> del a; tracker.allocated()
    0
    """

    def __init__(self, device: str | torch.device = "cpu", *, block: int = CUDA_BLOCK) -> None:
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ValueError("meta tensors hold no memory: track 'cpu' or a 'cuda:N' device instead")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.block = block
        #: Bytes a virtual device holds: an allocation beyond it raises
        #: torch.OutOfMemoryError as CUDA would. None: no limit.
        self.capacity: int | None = None
        self.capacity_label = ""
        #: What the last virtual out-of-memory error saw (see VirtualOOM).
        self.last_oom: VirtualOOM | None = None
        #: A CachingAllocatorSimulation fed every allocation and free, when set.
        self.simulator: Any = None
        #: Whether a storage first seen as an op's input is counted ("adopted"):
        #: one made before tracking began, or made where no dispatch mode sees it
        #: (a communication backend's worker thread). A launched rank, whose
        #: whole step is tracked, counts only what it saw made (see nbmem.launch).
        self.adopt_unseen = True
        self._on_device = _device_test(self.device)
        self._storages: dict[int, StorageRecord] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        # Storages that died on another thread (a communication backend's
        # worker letting go of a collective's tensors), counted as freed before
        # this thread's next op: the counters are only ever changed here.
        self._thread = threading.get_ident()
        self._foreign: collections.deque[tuple[int, weakref.ref[torch.UntypedStorage]]] = collections.deque()
        self._categories = dict.fromkeys(CATEGORIES, 0)
        self._modules: dict[str | None, int] = {}
        self._allocated = 0
        self._peak = 0
        # The breakdown at the running peak. Taken lazily: while nothing has been
        # freed or reclassified since the peak, the live counters *are* the peak.
        self._peak_detail: PeakDetail | None = None
        self._peak_op: tuple[int, Any, str | None] = (0, None, None)
        self._adopted = 0
        self._op_index = 0
        self._op: Any = None
        self._recordings: list[Recording] = []
        self._mode: _TrackingMode | None = None
        self._attribution: Any = None
        self._depth = 0
        self.scopes = PeakScopes(self)
        # PyTorch wraps __torch_dispatch__ so that its first call imports
        # torch._dynamo (about a second): pay that here, not in a timed cell.
        with _TrackingMode(self):
            torch.empty(0)

    # -- the peak-counter protocol ----------------------------------------

    def allocated(self) -> int:
        self.drain()
        return self._allocated

    def reserved(self) -> None:
        return None

    def peak_allocated(self) -> int:
        self.drain()
        return self._peak

    def peak_reserved(self) -> None:
        return None

    def reset_peak(self) -> None:
        self._peak = self._allocated
        self._peak_detail = None
        self._peak_op = (self._op_index, self._op, self.current_module())

    def peak_detail(self) -> PeakDetail:
        """Categories and modules at the running peak; they sum to :meth:`peak_allocated`."""
        self._settle_peak()
        return self._peak_detail  # type: ignore[return-value]

    def _settle_peak(self) -> None:
        """Take the peak's breakdown now if live memory is still at the peak (before it changes)."""
        if self._peak_detail is None:
            index, op, module = self._peak_op
            self._peak_detail = PeakDetail(index, op, module, dict(self._categories), dict(self._modules))

    # -- what is live now ---------------------------------------------------

    @property
    def adopted(self) -> int:
        """Bytes found in use that were allocated before tracking saw them."""
        return self._adopted

    @property
    def op_count(self) -> int:
        """Operations this tracker has seen (its op index)."""
        return self._op_index

    @property
    def live_storages(self) -> int:
        return len(self._storages)

    def by_category(self) -> dict[str, int]:
        """Live bytes per category now; the values sum to :meth:`allocated`."""
        return dict(self._categories)

    def by_module(self) -> dict[str | None, int]:
        """Live bytes per top-level module now (None: made outside any module)."""
        return {module: size for module, size in self._modules.items() if size}

    def largest(self, count: int = 10) -> list[tuple[int, StorageRecord]]:
        """The ``count`` largest live storages, as (storage key, record)."""
        return heapq.nlargest(count, self._storages.items(), key=lambda item: item[1].size)

    def storage_key(self, tensor: torch.Tensor) -> int | None:
        """The key under which ``tensor``'s storage is tracked, None if it is not."""
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
        return key if key in self._storages else None

    def record_of(self, tensor: torch.Tensor) -> StorageRecord | None:
        key = self.storage_key(tensor)
        return None if key is None else self._storages[key]

    # -- activation ---------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._depth > 0

    def activate(self) -> None:
        """Install the dispatch mode and attribution hooks on this thread (nested calls just count)."""
        if self._depth == 0:
            from .categories import Attribution

            self._attribution = Attribution(self)
            self._attribution.install()
            self._mode = _TrackingMode(self)
            try:
                self._mode.__enter__()
            except BaseException:
                self._attribution.remove()
                raise
            _watch_resizes(self)
        self._depth += 1

    def deactivate(self) -> None:
        """Undo one :meth:`activate`; the last one removes the dispatch mode and every hook."""
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self._mode is not None:
            mode, self._mode = self._mode, None
            attribution, self._attribution = self._attribution, None
            try:
                _remove_mode(mode)
            finally:
                _unwatch_resizes(self)
                attribution.remove()

    def __enter__(self) -> "Tracker":
        self.activate()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.deactivate()

    def current_module(self) -> str | None:
        """The top-level module running now (forward or backward), None outside modules."""
        return self._attribution.current_module() if self._attribution is not None else None

    # -- recordings (timelines) --------------------------------------------

    def start_recording(self) -> Recording:
        recording = Recording(self._op_index, list(self._storages.values()))
        self._recordings.append(recording)
        return recording

    def stop_recording(self, recording: Recording) -> Recording:
        if recording in self._recordings:
            self._recordings.remove(recording)
        return recording

    # -- categories ----------------------------------------------------------

    def classify(self, tensor: torch.Tensor, category: str, module: str | None = None) -> None:
        """Say what ``tensor``'s storage is for (and which module owns it).

        A storage only moves to a more specific category (:data:`CATEGORIES`).
        Tensors made before tracking saw them are adopted first. Bytes that were
        alive at the running peak move in the peak's breakdown too, so the peak
        is described by what each storage turned out to be.
        """
        # Most calls (saved activations, parameters at every forward, optimizer state
        # at every step) name a known storage what it already is: nothing to change.
        try:
            record = self._storages.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            record = None
        if (record is not None and _RANK[category] >= _RANK[record.category]
                and (module is None or module == record.module)):
            return
        if not self._on_device(tensor):
            return
        if is_traceable_wrapper_subclass(tensor):  # a DTensor: what its local shard is for
            for part in _parts(tensor):
                self.classify(part, category, module)
            return
        key = self.storage_key(tensor)
        if key is None:
            self._count(tensor, adopt=True)
            key = self.storage_key(tensor)
            if key is None:
                return
        record = self._storages[key]
        self._settle_peak()
        detail = self._peak_detail
        # the peak's breakdown, when this storage was alive at the peak
        at_peak = detail if detail is not None and record.born <= detail.op_index else None
        if _RANK[category] < _RANK[record.category]:
            self._categories[record.category] -= record.size
            self._categories[category] += record.size
            if at_peak is not None:
                at_peak.categories[record.category] -= record.size
                at_peak.categories[category] += record.size
            record.category = category
        if module is not None and module != record.module:
            self._modules[record.module] -= record.size
            self._modules[module] = self._modules.get(module, 0) + record.size
            if at_peak is not None:
                at_peak.modules[record.module] = at_peak.modules.get(record.module, 0) - record.size
                at_peak.modules[module] = at_peak.modules.get(module, 0) + record.size
            record.module = module

    # -- the accounting (hot path: keep it lean) ----------------------------

    def _note(self, out: Any) -> None:
        __tracebackhide__ = True
        if isinstance(out, _Tensor):
            self._count(out, adopt=False)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._note(item)

    def _adopt_all(self, values: Any) -> None:
        # Runs for every input of every op: most inputs are already known, so
        # that check comes first and costs no further call (the device test
        # waits for storages not seen yet: a FakeTensor's is_cpu is itself a
        # dispatched op, about 4 us).
        storages = self._storages
        for value in values:
            if isinstance(value, _Tensor):
                try:
                    known = value.untyped_storage()._cdata in storages
                except (RuntimeError, NotImplementedError):
                    known = False  # sparse: _count looks at its parts
                if not known:
                    self._count(value, adopt=True)
            elif isinstance(value, (tuple, list)) and value and not isinstance(value[0], (int, float)):
                # ATen's lists hold one type (int[], float[], Tensor[], Tensor?[]): sizes and dims hold no tensor
                self._adopt_all(value)

    def _count(self, tensor: torch.Tensor, adopt: bool) -> None:
        __tracebackhide__ = True
        # Known storages first (a view's output, an in-place op's): only this
        # tracker's device is ever recorded, so they need no device test.
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            storage = None
        if storage is not None:
            key = storage._cdata
            record = self._storages.get(key)
            if record is not None:
                # an in-place op's or a view's output: resized only if its rounded size changed
                # (round_allocation, inline: this runs for most ops)
                if not adopt and -(-storage.nbytes() // self.block) * self.block != record.size:
                    self._resized(key, record, storage.nbytes())
                return
        if not self._on_device(tensor):
            return
        if storage is None or (type(tensor) not in _PLAIN and is_traceable_wrapper_subclass(tensor)):
            # A sparse tensor has no storage of its own: its memory is that of
            # its index and value tensors; a DTensor's own storage is a
            # placeholder of the global size: its memory is its local shard.
            # Nested tensors are not counted.
            for part in _parts(tensor):
                self._count(part, adopt)
            return
        if adopt and not self.adopt_unseen:
            return
        size = -(-storage.nbytes() // self.block) * self.block  # round_allocation, inline: once per new storage
        if not adopt and self.capacity is not None:
            self._check_capacity(size)
        attribution = self._attribution
        module = attribution.current_module() if attribution is not None else None
        record = StorageRecord(size, -1 if adopt else self._op_index, None if adopt else self._op, module,
                               tuple(tensor.shape), tensor.dtype)
        self._storages[key] = record
        self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
        if self.simulator is not None:
            self.simulator.malloc(key, size)
        self._categories["other"] += size
        self._modules[module] = self._modules.get(module, 0) + size
        if self._recordings:
            for recording in self._recordings:
                recording.storages.append(record)
        if adopt:
            self._allocated += size
            self._peak += size
            self._adopted += size
            self.scopes.adopt(size)
            if self._peak_detail is not None:
                self._peak_detail.categories["other"] += size
                self._peak_detail.modules[module] = self._peak_detail.modules.get(module, 0) + size
        else:
            self._grow(size, module)

    def _resized(self, key: int, record: StorageRecord, nbytes: int) -> None:
        """A storage resized in place (out= arguments, resize_, set_, ``storage.resize_``): count the change."""
        __tracebackhide__ = True
        size = round_allocation(nbytes, self.block)
        if size == record.size:
            return
        if size > record.size:
            self._check_capacity(size - record.size)
        elif self._allocated == self._peak:
            self._settle_peak()
        self._categories[record.category] += size - record.size
        self._modules[record.module] += size - record.size
        growth, record.size = size - record.size, size
        if self.simulator is not None:
            self.simulator.free(key)
            if size:
                self.simulator.malloc(key, size)
        self._grow(growth, record.module)

    def storage_resized(self, storage: Any) -> None:
        """``storage.resize_()`` ran (FSDP2 frees and refills gathered parameters this way)."""
        record = self._storages.get(storage._cdata)
        if record is not None:
            self._resized(storage._cdata, record, storage.nbytes())

    def _grow(self, size: int, module: str | None) -> None:
        self._allocated += size
        if self._allocated > self._peak:
            self._peak = self._allocated
            self._peak_detail = None
            self._peak_op = (self._op_index, self._op, module)

    def _free(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        if threading.get_ident() != self._thread:
            self._foreign.append((key, ref))  # deque.append is atomic; counted by drain()
            return
        self._release(key, ref)

    def _release(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        if self._refs.get(key) is ref:
            if self._allocated == self._peak:
                self._settle_peak()
            del self._refs[key]
            record = self._storages.pop(key)
            record.died = self._op_index
            if self.simulator is not None:
                self.simulator.free(key)
            self._allocated -= record.size
            self._categories[record.category] -= record.size
            self._modules[record.module] -= record.size

    def drain(self) -> None:
        """Count the storages that died on other threads since the last op as freed."""
        while self._foreign:
            self._release(*self._foreign.popleft())

    def settle(self) -> None:
        """Name what code interrupted by an error has made (see Attribution.settle)."""
        if self._attribution is not None:
            self._attribution.settle()

    def _check_capacity(self, size: int) -> None:
        __tracebackhide__ = True
        if self.capacity is not None and self._allocated + size > self.capacity:
            self.settle()
            self.last_oom = VirtualOOM(
                request=size,
                allocated=self._allocated,
                capacity=self.capacity,
                label=self.capacity_label,
                device=str(self.device),
                op=self._op,
                module=self.current_module(),
            )
            _virtual_device_is_full(self.last_oom)


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


#: Trackers active now, told of every ``UntypedStorage.resize_`` while any is.
_RESIZE_WATCHERS: list[Tracker] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _resize_and_tell(storage: Any, size: int) -> Any:
    """``UntypedStorage.resize_`` while tracking: a storage-level resize is no dispatched op, so no mode sees it."""
    result = _ORIGINAL_RESIZE(storage, size)
    for tracker in _RESIZE_WATCHERS:
        tracker.storage_resized(storage)
    return result


def _watch_resizes(tracker: Tracker) -> None:
    if not _RESIZE_WATCHERS:
        torch.UntypedStorage.resize_ = _resize_and_tell  # type: ignore[method-assign, assignment]  # torch types resize_ with two selves
    _RESIZE_WATCHERS.append(tracker)


def _unwatch_resizes(tracker: Tracker) -> None:
    if tracker in _RESIZE_WATCHERS:
        _RESIZE_WATCHERS.remove(tracker)
    if not _RESIZE_WATCHERS:
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]


def _remove_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off this thread's dispatch stack, leaving any mode above it in place.

    Code in a tracked cell may enter a dispatch mode and never leave it; popping
    the top would then remove theirs. Lift those off, remove ours, put them back.
    """
    above = []
    while (top := _get_current_dispatch_mode()) is not None and top is not mode:
        above.append(_pop_mode())
    try:
        if top is mode:
            mode.__exit__(None, None, None)
    finally:
        for other in reversed(above):
            _push_mode(other)


def _device_test(device: torch.device) -> Callable[[torch.Tensor], bool]:
    if device.type == "cpu":
        # is_cpu is the fastest test on a plain tensor; on a FakeTensor it is a
        # dispatched op (prim.device, about 4 us) where .device is a property
        return lambda tensor: tensor.is_cpu if type(tensor) in _PLAIN else tensor.device.type == "cpu"
    index = device.index
    kind = device.type
    return lambda tensor: tensor.device.type == kind and tensor.get_device() == index


@functools.cache
def _default_tracker(device: str) -> Tracker:
    return Tracker(device)


def default_tracker(device: str | torch.device = "cpu") -> Tracker:
    """The shared tracker for ``device``.

    Storages and their lifetimes are process-wide, so every tracked scope on a
    device (a cell, ``%gpumem on``, a ``with nbmem.track()`` inside them) uses
    one tracker: that is what lets the scopes nest and lets a cell's starting
    figure include tensors earlier tracked cells left alive.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _default_tracker(str(device))
