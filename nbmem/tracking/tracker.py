"""Tracked mode: account every tensor storage on a device, without CUDA.

A ``TorchDispatchMode`` sees every ATen operation: factory functions (``torch.empty``, ``torch.randn``), module
construction (``nn.Linear`` builds its parameters with ``torch.empty``), autograd's backward (``.grad``) and the
optimizer (its state comes from ``zeros_like``). Each output storage nbmem has not seen is counted at its size
rounded as the CUDA allocator would round it, and a weak reference to the storage removes it again the moment it
is freed; nbmem never keeps a tensor or storage alive.

Storages made before tracking began are found when a scope opens (:meth:`Tracker.adopt_live`, see
:mod:`nbmem.tracking.live`) or when an operation uses them as input: allocated when the scope began ("adopted").

Ctrl-C may land at any bytecode (issue 12). Installing and removing are all or nothing (see
:mod:`nbmem.tracking.installed`); a storage's death is queued by a weakref callback that runs no Python code
(``deque.append``), and counted before the next op, so an interrupt can never be swallowed inside it; and
:meth:`Tracker.reconcile` rebuilds the counters from the records when an interrupt cut an update short: each
update counts itself in ``_unfinished`` from its first change to its last, and the next op, drain or scope that
finds one unfinished reconciles. Not only when the interrupt ends a scope: a loop that stops on Ctrl-C (``except
KeyboardInterrupt: break``) ends it without an error, and a record parted from its weak reference stayed counted
for good. With an allocator simulation fed (an estimate), each storage counts as the block it gives.
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .counters import PeakScopes
from .dispatch import TrackingMode, skip_dynamo
from ..core.records import (PeakDetail, Recording, StorageRecord, VirtualOOM, _device_test, _parts, _PLAIN,
                      _virtual_device_is_full, _wraps, rebuild_counters)
from .host_memory import HostMemory
from .installed import Activation, remove_dispatch_modes, remove_every_tracker, unwatch_resizes, watch_resizes
from .lines import LineCounter
from .live_view import LiveView
from .live import walk
from ..core.results import CATEGORIES
from ..core.units import CUDA_BLOCK, round_allocation

__all__ = ["Tracker", "default_tracker", "remove_every_tracker", "CATEGORIES", "StorageRecord", "PeakDetail", "Recording", "VirtualOOM"]

_Tensor = torch.Tensor
_RANK = {name: rank for rank, name in enumerate(CATEGORIES)}


class Tracker(Activation, HostMemory, LiveView):
    """Live bytes of the tensor storages on one device, with a running peak.

    A tracker is a peak counter (see :mod:`nbmem.tracking.counters`): scopes opened on
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

    def __init__(self, device: str | torch.device = "cpu", *, block: int = CUDA_BLOCK, whole_device: bool = False) -> None:
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
        #: A CachingAllocatorSimulation fed every allocation and free, when set; each storage is then charged the
        #: block it gives (an estimate's figures are the CUDA allocator's allocated bytes)
        self.simulator: Any = None
        #: Whether a storage first seen as an op's input is counted ("adopted"):
        #: one made before tracking began, or made where no dispatch mode sees it
        #: (a communication backend's worker thread). A launched rank, whose
        #: whole step is tracked, counts only what it saw made (see nbmem.launch).
        self.adopt_unseen = True
        #: Count fake tensors (an estimate's tracker); a tracker of real memory ignores them.
        self.fake = False
        #: Storages outside the device's allocator, never counted, by key (held weakly: nbmem.tracking.host_memory):
        #: an estimate's paged optimizer state, what FSDP's CPU offload keeps on the host, step counters.
        self.outside: dict[int, weakref.ref[Any]] = {}
        self._on_host = 0  # inside on_host(): new storages are host memory
        #: Whether a scope's baseline is every storage alive on the device (a
        #: default tracker: as a GPU counts, issue 12) or only what its ops touch
        #: (a tracker of one's own: a fresh device, as estimates use).
        self.whole_device = whole_device
        # storages a virtual capacity refused (see _check_capacity), by key
        self._refused: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._on_device = _device_test(self.device)
        self._storages: dict[int, StorageRecord] = {}
        self._refs: dict[int, weakref.KeyedRef[int, torch.UntypedStorage]] = {}
        # Storages that died since the last op, on any thread, counted as freed before the next op (drain). The
        # weakref callback is this deque's append, C code: Ctrl-C can't land there and be swallowed (issue 12), and
        # another thread letting go of tensors never changes the counters, which only this thread's drain does.
        self._foreign: collections.deque[weakref.KeyedRef[int, torch.UntypedStorage]] = collections.deque()
        # Updates of the records and counters begun and not finished (module docstring): above zero
        # between ops only if Ctrl-C cut one short. A count, not a flag: updates finishing later don't hide it.
        self._unfinished = 0
        self._categories = dict.fromkeys(CATEGORIES, 0)
        self._modules: dict[str | None, int] = {}
        self._allocated = 0
        self._peak = 0
        # The breakdown at the running peak, taken lazily: until a free or reclassification the live counters are it
        self._peak_detail: PeakDetail | None = None
        self._peak_op: tuple[int, Any, str | None] = (0, None, None)
        self._adopted = 0
        self._op_index = 0
        self._op: Any = None
        self._recordings: list[Recording] = []
        self._lines: LineCounter | None = None  # live and allocated bytes per user line, when asked for
        self._mode: TrackingMode | None = None
        #: A fake mode that reports every op to this tracker while it is active, in place of a TrackingMode
        #: (``FastKeyFakeTensorMode.carry``): set by an estimate before the tracker is first activated.
        self.host: Any = None
        self._attribution: Any = None
        # the garbage collector's count when adopt_live last found every live tensor (see nbmem.tracking.live)
        self._walked: tuple[int, int, int] | None = None
        # leaves that require grad, met by a walk, by id: each walk looks at their .grad (see nbmem.tracking.live)
        self._leaves: dict[int, weakref.ref[torch.Tensor]] = {}
        # who activated the tracker (a MemoryScope, None for a bare activate()): installed while any
        self._holders: list[object] = []
        self.scopes = PeakScopes(self)
        # A torch on which PyTorch still wraps __torch_dispatch__ (see nbmem.tracking.dispatch)
        # imports torch._dynamo at its first call (8 s loaded): pay that here, not in a timed cell.
        with TrackingMode(self):
            torch.empty(0)

    # -- the peak-counter protocol ----------------------------------------

    def allocated(self) -> int:
        self.drain()
        return self._allocated

    def reserved(self) -> None:
        return None

    def running_figures(self) -> tuple[int, int]:
        """(allocated, peak) as counted so far: plain reads from any thread, no drain (the live gauge's timer thread,
        nbmem.frontend.live_gauge: a drain there would race the cell's own). Storages that died since the last op
        are still in the figures."""
        return self._allocated, self._peak

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
            lines = self._lines.snapshot() if self._lines is not None else None
            self._peak_detail = PeakDetail(index, op, module, dict(self._categories), dict(self._modules), lines)

    # -- activation ---------------------------------------------------------

    def _install(self) -> None:
        from .categories import Attribution

        # each piece is noted before it goes in, so _uninstall finds it whatever the interrupt cut short
        self._attribution = Attribution(self)
        self._attribution.install()
        if self.host is not None:
            self.host.carry(self)  # an estimate's fake mode reports the ops itself (nbmem.estimation.fakemode)
        else:
            self._mode = TrackingMode(self)
            self._mode.__enter__()
        watch_resizes(self)

    def _uninstall(self) -> None:
        """Remove all this tracker installed, looking at torch's own state; safe to repeat."""
        from .categories import remove_global_hooks

        remove_dispatch_modes(self._owns)
        if self.host is not None:
            carried = self.host._nbmem_tracker
            if carried is not None and carried() is self:
                self.host.carry(None)
        unwatch_resizes(self)
        if self._attribution is not None:
            self._attribution.remove()
        remove_global_hooks(self)  # of an attribution an interrupted activation lost track of
        self._attribution = None
        self._mode, self._on_host = None, 0  # and no storage is host memory (an on_host() Ctrl-C cut short)
        self._lines = None  # no scope is left to want them

    def _owns(self, mode: TorchDispatchMode) -> bool:
        return isinstance(mode, TrackingMode) and mode.tracker is self

    # -- the baseline and repairs --------------------------------------------

    def adopt_live(self) -> int:
        """Count every storage alive on the device now, touched or not (a scope's baseline; see :mod:`nbmem.tracking.live`).

        Parameters found get gradient hooks while the tracker is active, so a
        backward in a cell of its own labels gradients. Returns the bytes adopted.

        >>> tracker, held = Tracker("cpu"), torch.ones(2048, 1024)   # 2048 * 1024 * 4 bytes = 8 MiB
        >>> tracker.adopt_live() >= 8 << 20, tracker.record_of(held).size
        (True, 8388608)
        """
        if not self.adopt_unseen:
            return 0
        self.reconcile()
        before = self._adopted
        walk(self, adopt=True)
        return self._adopted - before

    def count_made_unseen(self) -> int:
        """Count live tensors no op showed the tracker (made on another thread) as allocated now; returns their bytes.

        Called before a scope closes, after :meth:`adopt_live` found everything
        alive when it opened; never against a virtual capacity (they exist).
        Young objects only, a bounded cost (see :func:`nbmem.tracking.live.walk`).

        >>> import threading
        >>> tracker, made = Tracker("cpu"), []; _ = tracker.adopt_live()
        >>> with tracker:
        ...     worker = threading.Thread(target=lambda: made.append(torch.ones(256, 1024))); worker.start(); worker.join()
        >>> tracker.count_made_unseen()       # 256 * 1024 * 4 bytes = 1 MiB
        1048576
        """
        if not self.adopt_unseen:
            return 0
        self.drain()
        known = set(self._storages)
        capacity, self.capacity = self.capacity, None
        try:
            walk(self, adopt=False, young=True)
        finally:
            self.capacity = capacity
        return sum(record.size for key, record in self._storages.items() if key not in known)

    def recharge(self) -> None:
        """Charge each live storage the block its simulator holds for it now (an estimate's weights re-laid)."""
        self._settle_peak()  # the peak's breakdown as it was: the sizes change now, not at the peak
        detail = self._peak_detail
        for key, record in self._storages.items():
            record.size = self.simulator.block_size(key, record.size)
        self.reconcile()
        if self._allocated < self._peak:
            self._peak_detail = detail

    def reconcile(self) -> None:
        """Make the counters agree with the records again after Ctrl-C cut an update short (see rebuild_counters)."""
        self._drain_dead()
        orphans, allocated, categories, modules = rebuild_counters(self._storages, self._refs)
        if orphans:
            self._walked = None  # a storage dropped may be alive: the next walk must be whole to find it
        live_modules = {module: size for module, size in self._modules.items() if size}
        if (allocated, categories, modules) != (self._allocated, self._categories, live_modules):
            self._allocated, self._categories, self._modules = allocated, categories, modules
            self._peak = max(self._peak, allocated)
            self._peak_detail = None
        if self._lines is not None:
            self._lines.rebuild(self._storages.values())
        self._unfinished = 0  # last: a reconcile cut short is done again at the next look

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
        if is_traceable_wrapper_subclass(tensor) or tensor.layout is not torch.strided:
            for part in _parts(tensor):  # a DTensor's local shard, a sparse tensor's indices and values
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
        self._unfinished += 1  # until both moves are made (module docstring)
        if _RANK[category] < _RANK[record.category]:
            self._categories[record.category] -= record.size
            self._categories[category] += record.size
            if at_peak is not None:
                at_peak.categories[record.category] -= record.size
                at_peak.categories[category] += record.size
            record.category = category
        if module is not None and module != record.module:
            self._modules[record.module] = self._modules.get(record.module, 0) - record.size  # .get: see _release
            self._modules[module] = self._modules.get(module, 0) + record.size
            if at_peak is not None:
                at_peak.modules[record.module] = at_peak.modules.get(record.module, 0) - record.size
                at_peak.modules[module] = at_peak.modules.get(module, 0) + record.size
            record.module = module
        self._unfinished -= 1

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
                if not adopt and -(-storage.nbytes() // self.block) * self.block != record.asked:
                    self._resized(key, record, storage.nbytes())
                return
            if (held := self.outside.get(key)) is not None and held() is storage:  # not a dead one's key
                return
        if not self._on_device(tensor):
            return
        if storage is not None and not self.fake and storage.device.type == "meta":
            return  # a fake tensor (an estimate's inside a tracked cell): it says "cpu", its storage holds nothing
        if storage is None or (type(tensor) not in _PLAIN and _wraps(type(tensor))):
            # A sparse tensor has no storage of its own: its memory is that of
            # its index and value tensors; a DTensor's own storage is a
            # placeholder of the global size: its memory is its local shard.
            # Nested tensors are not counted.
            for part in _parts(tensor):
                self._count(part, adopt)
            return
        if self._on_host:
            self.keep_outside(tensor)
            return
        if adopt and not self.adopt_unseen:
            return
        if not storage.resizable() and not storage.is_shared():
            # memory the allocator never gave: a NumPy array's, DLPack's (from_blob storages can't resize);
            # torch.tensor(ndarray) wraps the array before copying it (issue 12). Shared memory can't resize
            # either, but is counted: a DataLoader worker's batch, which a GPU would hold (see nbmem.tracking.live)
            return
        size = asked = -(-storage.nbytes() // self.block) * self.block  # round_allocation, inline: once per new storage
        if not adopt and self.capacity is not None:
            self._check_capacity(size, storage)
        if self.simulator is not None:  # the block it gives, as CUDA's allocator counts it (a cached one may be larger)
            size = self.simulator.malloc(key, size)
        attribution = self._attribution
        module = attribution.current_module() if attribution is not None else None
        record = StorageRecord(size, -1 if adopt else self._op_index, None if adopt else self._op, module,
                               () if tensor.is_nested else tuple(tensor.shape), tensor.dtype, asked)  # a nested one has no sizes
        ref = weakref.KeyedRef(storage, self._foreign.append, key)
        self._unfinished += 1  # until the counters include it (module docstring)
        # one line, no call between the two stores: no line event (a trace function's) and no signal
        # (handled on calls and backward jumps, CPython's eval breaker) parts a record from its weak reference
        self._storages[key], self._refs[key] = record, ref
        if self._lines is not None:
            self._lines.made(record, adopt)
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
                if self._peak_detail.lines is not None:
                    self._peak_detail.lines[None] = self._peak_detail.lines.get(None, 0) + size
        else:
            self._grow(size, module)
        self._unfinished -= 1

    def _resized(self, key: int, record: StorageRecord, nbytes: int) -> None:
        """A storage resized in place (out= arguments, resize_, set_, ``storage.resize_``): count the change."""
        __tracebackhide__ = True
        size = asked = round_allocation(nbytes, self.block)
        if asked == record.asked:
            return
        if asked > record.asked:
            self._check_capacity(asked - record.asked)
        elif self._allocated == self._peak:
            self._settle_peak()
        self._unfinished += 1  # until the record and the counters have the new size (module docstring)
        if self.simulator is not None:  # the block the new size gets
            self.simulator.free(key)
            size = self.simulator.malloc(key, asked)  # 0 for a storage resized to nothing
        growth = size - record.size
        self._categories[record.category] += growth
        self._modules[record.module] = self._modules.get(record.module, 0) + growth  # .get: see _release
        # asked last, with the size: until then the next op sees the resize as not counted and counts it again
        record.size, record.asked = size, asked
        if self._lines is not None:
            self._lines.resized(record, growth)
        self._grow(growth, record.module)
        self._unfinished -= 1

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

    def _release(self, key: int, ref: weakref.KeyedRef[int, torch.UntypedStorage]) -> None:
        if self._refs.get(key) is ref:
            if self._allocated == self._peak:
                self._settle_peak()
            self._unfinished += 1  # until the counters are without it (module docstring)
            del self._refs[key]  # first: a repeat after an interrupt does nothing (reconcile finishes it)
            record = self._storages.pop(key, None)
            if record is not None:
                record.died = self._op_index
                if self.simulator is not None:
                    self.simulator.free(key)
                self._allocated -= record.size
                self._categories[record.category] -= record.size
                # .get: Ctrl-C between a record's store and its module's first count leaves no counter (reconcile
                # releases the dead, then rebuilds the sums); nor does a rebuild keep one at 0
                self._modules[record.module] = self._modules.get(record.module, 0) - record.size
                if self._lines is not None:
                    self._lines.freed(record)
            self._unfinished -= 1

    def drain(self) -> None:
        """Count the storages that died since the last op as freed; mend an update Ctrl-C cut short."""
        if self._unfinished:
            self.reconcile()  # drains too
        else:
            self._drain_dead()

    def _drain_dead(self) -> None:
        dead = self._foreign
        while dead:
            ref = dead[0]
            self._release(ref.key, ref)
            dead.popleft()  # after: an interrupted release is done again, harmlessly

    def settle(self) -> None:
        """Name what code interrupted by an error has made (see Attribution.settle)."""
        if self._attribution is not None:
            self._attribution.settle()

    def _check_capacity(self, size: int, storage: Any = None) -> None:
        __tracebackhide__ = True
        if self.capacity is not None and self._allocated + size > self.capacity:
            if storage is not None:
                # the refused tensor exists on the CPU, kept by the traceback, but a GPU never had it:
                # walks for a baseline must not count it (see nbmem.tracking.live.walk)
                self._refused[storage._cdata] = weakref.ref(storage)
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


@functools.cache
def _default_tracker(device: str) -> Tracker:
    return Tracker(device, whole_device=True)


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


skip_dynamo(Tracker.classify)  # called from hooks, which may run inside a compiled region (categories.py says why)
