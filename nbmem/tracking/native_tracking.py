"""Tracked mode's native engine: CPU allocations counted in C++ (issue 12's overhead).

The default engine (:mod:`nbmem.tracking.tracker`) sees every ATen op through a Python
dispatch mode; PyTorch charges any such mode 1.05-1.13x on small training steps
before it does anything (``benchmarks/bench_mode_floor.py``), and a mode on the
stack changes a little what PyTorch allocates (with one on the stack,
``at::isTensorSubclassLike`` is true of every tensor, and autograd accumulates
gradients out of place). The native engine takes no trip
into Python per op: c10's CPU allocator is wrapped by a small C++ one
(``nbmem/tracking/_native/allocations.cpp``, built once by :mod:`nbmem.tracking.native`) that,
while a block is tracked, counts each allocation and, whenever it happens, its
free, keeping the live blocks, bytes by category and module, the running peak
and the breakdown at it. Python still classifies from the same hooks
(:class:`nbmem.tracking.categories.Attribution`: parameters, gradients, optimizer state,
saved activations) and names the module running.

What it counts differs from the default engine, and results say so:

- allocations, not storages: a kernel's own scratch (an im2col buffer) is
  counted while it lives, as the GPU counts cuDNN's workspace; the op at the
  peak is not known (no op is seen), the module is;
- every CPU allocation in the process while a block runs, on any thread, and
  every free of those, wherever and whenever it happens (the allocator stays
  registered between blocks, passing allocations through, for mkldnn's frees);
  not what PyTorch allocates past the registered allocator
  (``torch.UntypedStorage(n)``). A DataLoader worker's batches, in shared
  memory no allocation here gave, are found at the block's end (see
  :mod:`nbmem.tracking.live`) and counted as made in it;
- the baseline is the storages alive when a block starts, found by walking
  Python's objects as the default engine does; one made before tracking and
  resized in place (``resize_``, FSDP2's parameter resizes) is counted at its
  old size until a whole walk finds it again;
- no virtual capacity and no timeline: those need every op (``engine="dispatch"``);
- lines (``lines=True``) are read from the Python stack of the thread that
  asked, at each allocation on any Python thread (the line that thread is at;
  an OpenMP worker's go to the line charged last), so compiled code runs
  compiled while its buffers are charged to the user's line that called it.

>>> import torch
>>> tracker = native_tracker()                        # doctest: +SKIP
>>> with tracker:                                    # doctest: +SKIP
...     kept = torch.ones(1024, 1024)                # 1024 * 1024 * 4 bytes = 4 MiB
>>> tracker.by_category()["other"] >= 4 << 20        # doctest: +SKIP
True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import weakref
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .categories import BACKWARD, Attribution, remove_global_hooks
from .counters import PeakScopes
from .installed import Activation, forget_native, note_native
from .dispatch import skip_dynamo
from .host_memory import keep_outside
from .live import walk
from .native import NativeUnavailable, library
from ..core.records import PeakDetail, StorageRecord, _device_test, _parts, _PLAIN, _wraps
from ..core.results import CATEGORIES
from ..core.units import CUDA_BLOCK

__all__ = ["NativeTracker", "native_tracker", "NativeUnavailable"]

_RANK = {name: rank for rank, name in enumerate(CATEGORIES)}
_NO_MODULE, _BACKWARD, _KEEP = -1, -2, -(2**31)  # the ids allocations.cpp uses
_FIGURES = 7


class NativeTracker(Activation):
    """Live bytes of the CPU allocator's blocks, with a running peak and its breakdown, counted in C++.

    The same protocol as :class:`nbmem.tracking.tracker.Tracker` for what scopes,
    attribution and the walk of live tensors ask of a tracker. There is one
    per process (the allocator is process-wide): :func:`native_tracker`.
    """

    _made = False

    whole_device = True
    adopt_unseen = True
    fake = False
    capacity: int | None = None
    capacity_label = ""
    last_oom = None

    def __init__(self) -> None:
        if NativeTracker._made:
            raise RuntimeError("the CPU allocator is process-wide: use nbmem.tracking.native_tracking.native_tracker()")
        self.device = torch.device("cpu")
        self.block = CUDA_BLOCK
        self._lib = library()  # raises NativeUnavailable saying why, before anything is installed
        NativeTracker._made = True
        self._on_device = _device_test(self.device)
        self._holders: list[object] = []
        self._attribution: Attribution | None = None
        self._refused: dict[int, Any] = {}  # nothing is refused: no virtual capacity here
        self._walked: tuple[int, int, int] | None = None
        self._leaves: dict[int, weakref.ref[torch.Tensor]] = {}  # as Tracker's (see nbmem.tracking.live)
        # the storages a walk met, by storage: (address, token, weak reference, adopted). The
        # references' callbacks (C functions: no Python runs in them, so Ctrl-C can't be swallowed
        # there) release the block their token watches, that block only if a resize moved the storage;
        # adopted: False only while nbmem_adopt has not returned (or Ctrl-C cut it off, see _count)
        self._watched: dict[int, tuple[int, int, weakref.ref[torch.UntypedStorage], bool]] = {}
        self._tokens = itertools.count(1)  # next() is one C call: no token is handed out twice
        self._module_ids: dict[str | None, int] = {None: _NO_MODULE, BACKWARD: _BACKWARD}
        self._module_names: dict[int, str | None] = {_NO_MODULE: None, _BACKWARD: BACKWARD}
        self._adopted_told = 0  # adopted bytes already passed to the open scopes
        self._figures = (ctypes.c_int64 * _FIGURES)()
        self._row = (ctypes.c_int64 * 4)()  # one block's (size, category, module, born)
        self._lines: NativeLines | None = None  # while a scope wants lines
        self.scopes = PeakScopes(self)
        #: Storages in host memory (an optimizer's step counters), never counted, by key (held weakly)
        self.outside: dict[int, weakref.ref[Any]] = {}

    # -- installing --------------------------------------------------------

    def _install(self) -> None:
        self._attribution = Attribution(self)
        self._attribution.module_changed = self._module_changed
        self._attribution.install()
        note_native(self)  # before the allocator is registered: %unload_ext finds it whatever happens next
        self._lib.nbmem_host_reset()
        refused = self._lib.nbmem_install()
        if refused >= 2:
            raise NativeUnavailable(
                "the CPU allocator registered with PyTorch can't be wrapped"
                + (" (another was registered since nbmem wrapped the first)" if refused == 3 else "")
                + ": use engine='dispatch'"
            )

    def _uninstall(self) -> None:
        """Stop counting and remove every hook, looking at torch's own state; safe to repeat.

        The counting allocator stays registered, passing allocations through: memory
        mkldnn raw-allocated in a block is freed through whichever allocator is
        registered then, and must still be counted out. :meth:`unregister` removes it.
        """
        self._lib.nbmem_uninstall()
        self._lib.nbmem_host_reset()  # what a Ctrl-C in on_host() may have left on, on any thread
        lines, self._lines = self._lines, None  # no scope is left to want them
        if lines is not None:
            lines.stop()
        self._lib.nbmem_lines_forget()  # also what a start Ctrl-C cut short left on
        if self._attribution is not None:
            self._attribution.remove()
        remove_global_hooks(self)
        self._attribution = None

    def unregister(self) -> None:
        """Put PyTorch's own CPU allocator back (``%unload_ext nbmem``); the next block registers nbmem's again."""
        self._uninstall()
        self._lib.nbmem_unregister()
        forget_native(self)

    def installed(self) -> bool:
        """Whether allocations are being counted now (a block is tracked)."""
        return bool(self._lib.nbmem_installed())

    def registered(self) -> bool:
        """Whether nbmem's allocator is PyTorch's CPU allocator now (counting, or passing through)."""
        return bool(self._lib.nbmem_registered())

    # -- the peak-counter protocol ----------------------------------------

    def _read(self) -> ctypes.Array[ctypes.c_int64]:
        figures = self._figures
        self._lib.nbmem_figures(figures)
        told, adopted = self._adopted_told, figures[2]
        if adopted != told:  # found late, there all along: raise every open scope alike
            self._adopted_told = adopted  # first: an interrupt in adopt() must not have it told twice
            self.scopes.adopt(adopted - told)
        return figures

    def allocated(self) -> int:
        return int(self._read()[0])

    def peak_allocated(self) -> int:
        return int(self._read()[1])

    def running_figures(self) -> tuple[int, int]:
        """(allocated, peak) now, from any thread (the live gauge's timer)."""
        figures = (ctypes.c_int64 * _FIGURES)()
        self._lib.nbmem_figures(figures)
        return figures[0], figures[1]

    def reserved(self) -> None:
        return None

    def peak_reserved(self) -> None:
        return None

    def reset_peak(self) -> None:
        self._lib.nbmem_reset_peak()

    def peak_detail(self) -> PeakDetail:
        figures = self._read()
        categories, modules = self._breakdown(at_peak=True)
        lines = self._lines.table(1) if self._lines is not None else None
        return PeakDetail(figures[5], None, self._module_names.get(figures[6]), categories, modules, lines)

    # -- lines -----------------------------------------------------------------

    def start_lines(self, owner: object) -> "NativeLines":
        """Charge every allocation from now on to the user's line (:func:`nbmem.tracking.lines.start_lines`)."""
        lines = self._lines
        if lines is None:
            lines = self._lines = NativeLines(self._lib)  # kept before it starts: stop_lines then finds it
            lines.start()
        else:
            self._lib.nbmem_lines_here()  # a scope on another thread: its stack from now on
        lines.owners.add(id(owner))
        return lines

    def stop_lines(self, owner: object) -> None:
        """``owner``'s scope no longer wants lines; the last one out stops them (safe to repeat)."""
        counter = self._lines
        if counter is not None:
            counter.owners.discard(id(owner))
            if not counter.owners:
                counter.stop()  # first: a repeat after Ctrl-C finds the counter and stops it again
                self._lines = None

    # -- what is live now ---------------------------------------------------

    @property
    def adopted(self) -> int:
        return int(self._read()[2])

    @property
    def op_count(self) -> int:
        """Allocator events seen (the native engine sees no ops)."""
        return int(self._read()[3])

    @property
    def live_storages(self) -> int:
        return int(self._read()[4])

    def _breakdown(self, at_peak: bool) -> tuple[dict[str, int], dict[str | None, int]]:
        room = len(CATEGORIES) + len(self._module_names) + 2
        values = (ctypes.c_int64 * room)()
        slots = self._lib.nbmem_breakdown(values, room, int(at_peak))
        if len(CATEGORIES) + slots > room:
            room = len(CATEGORIES) + slots
            values = (ctypes.c_int64 * room)()
            slots = self._lib.nbmem_breakdown(values, room, int(at_peak))
        categories = dict(zip(CATEGORIES, values[: len(CATEGORIES)]))
        modules: dict[str | None, int] = {}
        for index in range(slots):
            size = values[len(CATEGORIES) + index]
            if size:
                name = self._module_names.get(index - 2)
                modules[name] = modules.get(name, 0) + size
        return categories, modules

    def by_category(self) -> dict[str, int]:
        return self._breakdown(at_peak=False)[0]

    def by_module(self) -> dict[str | None, int]:
        return self._breakdown(at_peak=False)[1]

    def largest(self, count: int = 10) -> list[tuple[int, StorageRecord]]:
        """The ``count`` largest live blocks, as (address, record); shapes are not known to this engine."""
        total = self.live_storages + 16
        values = (ctypes.c_int64 * (total * 5))()
        rows = min(self._lib.nbmem_blocks(values, total * 5), total)
        blocks = sorted((values[index * 5: index * 5 + 5] for index in range(rows)), key=lambda row: -row[1])[:count]
        return [(address, self._record(size, category, module, born)) for address, size, category, module, born in blocks]

    def _record(self, size: int, category: int, module: int, born: int) -> StorageRecord:
        record = StorageRecord(size, born, None, self._module_names.get(module), (), None)
        record.category = CATEGORIES[category]
        return record

    def _block(self, tensor: torch.Tensor) -> int:
        """The address of ``tensor``'s accounted block, its (size, category, module, born) in ``_row``; 0: none."""
        address = self._address(tensor)
        return address if address and self._lib.nbmem_block(address, self._row) else 0

    def storage_key(self, tensor: torch.Tensor) -> int | None:
        """The address under which ``tensor``'s storage is accounted, None if it is not."""
        return self._block(tensor) or None

    def record_of(self, tensor: torch.Tensor) -> StorageRecord | None:
        return self._record(*self._row) if self._block(tensor) else None

    def module_of(self, tensor: torch.Tensor) -> str | None:
        """The module ``tensor``'s block belongs to (None: outside modules, or not accounted)."""
        return self._module_names.get(self._row[2]) if self._block(tensor) else None

    def current_module(self) -> str | None:
        return self._attribution.current_module() if self._attribution is not None else None

    # -- the baseline ----------------------------------------------------------

    def adopt_live(self) -> int:
        """Count every storage alive on the CPU now (a scope's baseline); returns the bytes adopted.

        Blocks counted earlier stay counted between blocks (the allocator's frees and the
        weak references' keep them right), so after the first walk only the young
        generations are looked at while no older one was collected (see :mod:`nbmem.tracking.live`).
        """
        if self._walked is None:
            self._watched = {key: known for key, known in self._watched.items() if known[2]() is not None}
        before = self.adopted
        walk(self, adopt=True)
        return self.adopted - before

    def count_made_unseen(self) -> int:
        """Count live tensors made where no allocation was seen (another allocator's) as allocated now."""
        before = self.allocated()
        walk(self, adopt=False, young=True)
        return max(self.allocated() - before, 0)

    def reconcile(self) -> None:
        """Pass adopted bytes on to the open scopes; nothing else to mend: each change to the accounts is one C call."""
        self._read()

    def settle(self) -> None:
        if self._attribution is not None:
            self._attribution.settle()

    def _count(self, tensor: torch.Tensor, adopt: bool) -> None:
        """A tensor found alive by the walk: its block adopted (or counted as made now), its death watched."""
        if type(tensor) not in _PLAIN and _wraps(type(tensor)) or tensor.layout is not torch.strided:
            for part in _parts(tensor):
                self._count(part, adopt)
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if storage.device.type != "cpu" or not storage.resizable() and not storage.is_shared():
            return  # memory the allocator never gave (NumPy's, from_blob's; a worker's shared memory counts), or a fake tensor's
        key = storage._cdata
        address, nbytes = self._lib.nbmem_storage_address(key), storage.nbytes()
        if not address or not nbytes:
            return
        host = self.outside.get(key)
        if host is not None and host() is storage:  # the same storage (a dead one's key may be a new storage's)
            return
        known = self._watched.get(key)
        if known is not None and known[2]() is storage:
            if known[0] == address:
                if not known[3]:  # Ctrl-C came between keeping its reference and adopting it: adopt now
                    self._lib.nbmem_adopt(address, nbytes, 0 if adopt else 1, known[1])
                    self._watched[key] = (address, known[1], known[2], True)
                return
            self._lib.nbmem_release(known[1], None)  # resized in place since: its old block is gone
        # The weak reference is kept before the block is adopted (allocations.cpp, Watch): Ctrl-C between
        # the two leaves a reference that releases nothing, where the other way round it left an adopted
        # block that nothing would release, counted for good after its storage died.
        token = next(self._tokens)
        watch = weakref.ref(storage, functools.partial(self._lib.nbmem_release, token))
        self._watched[key] = (address, token, watch, False)
        self._lib.nbmem_adopt(address, nbytes, 0 if adopt else 1, token)
        self._watched[key] = (address, token, watch, True)

    # -- host memory (nbmem.tracking.host_counters) ----------------------------

    def keep_outside(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is host memory: never counted (nor adopted by a walk), for as long as it lives."""
        keep_outside(self.outside, tensor)

    def moved_to_host(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage left the device: its block is no longer counted, nor ever again."""
        address = self._address(tensor)
        if address:
            self._lib.nbmem_forget(address)
        self.keep_outside(tensor)

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """This thread's allocations inside are host memory: passed through uncounted (see keep_outside)."""
        depth = self._lib.nbmem_host(-1)
        try:  # whatever line Ctrl-C lands on, the depth is put back (and the next install or uninstall resets it)
            self._lib.nbmem_host(depth + 1)
            yield
        finally:
            self._lib.nbmem_host(depth)

    # -- categories -----------------------------------------------------------

    def classify(self, tensor: torch.Tensor, category: str, module: str | None = None) -> None:
        """Say what ``tensor``'s block is for (and which module owns it); only ever more specific."""
        if type(tensor) not in _PLAIN:
            if _wraps(type(tensor)):  # a DTensor: what its local shard is for
                for part in _parts(tensor):
                    self.classify(part, category, module)
                return
            if isinstance(tensor, FakeTensor) or not self._on_device(tensor):
                return  # an estimate's, inside a tracked block: it holds no memory
        address = self._address(tensor)
        if not address:
            if tensor.layout is not torch.strided:  # a sparse tensor: what its indices and values are for
                for part in _parts(tensor):
                    self.classify(part, category, module)
            return
        module_id = _KEEP if module is None else self._module_id(module)
        if not self._lib.nbmem_classify(address, _RANK[category], module_id):
            self._count(tensor, adopt=True)  # made before tracking saw it, held only by C++ until now
            self._lib.nbmem_classify(address, _RANK[category], module_id)

    def _address(self, tensor: torch.Tensor) -> int:
        """The address of ``tensor``'s CPU storage (a copy-on-write one left shared); 0: none (a fake tensor's...)."""
        plain = type(tensor) in _PLAIN
        if (plain and not tensor.is_cpu) or (not plain and isinstance(tensor, FakeTensor)):
            return 0  # a fake tensor has no memory (asking for its data pointer warns)
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse: no storage of its own
            return 0
        if not plain and storage.device.type != "cpu":
            return 0
        return int(self._lib.nbmem_storage_address(storage._cdata))

    def _module_id(self, name: str | None) -> int:
        found = self._module_ids.get(name)
        if found is None:
            found = self._module_ids[name] = len(self._module_ids) - 2
            self._module_names[found] = name
        return found

    def _module_changed(self, name: str | None) -> None:
        # inside a backward (a checkpointed forward ran again) the allocator asks autograd itself
        self._lib.nbmem_set_module(_NO_MODULE if name == BACKWARD else self._module_id(name))


class NativeLines:
    """Bytes per line of the user's code, counted in C++ (allocations.cpp, lines); a :class:`LineCounter`'s face.

    One per run of lines: started once kept, stopped (its figures kept, the
    code objects C++ held let go) when the last scope that wanted it ends.
    """

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.owners: set[int] = set()
        self._where: dict[int, Any] = {0: None}  # slot -> (file name, line number); 0: alive before
        self._kept: dict[Any, int] | None = None  # allocated per line, once stopped

    def start(self) -> None:
        from .lines import NOT_THE_USERS_CHARS

        self._lib.nbmem_lines_start(NOT_THE_USERS_CHARS)

    def table(self, which: int) -> dict[Any, int]:
        """Bytes per line: 0 live now, 1 at the peak, 2 allocated since the lines began (nonzero ones only)."""
        room = len(self._where) + 16
        values = (ctypes.c_int64 * room)()
        slots = self._lib.nbmem_lines(values, room, which)
        if slots > room:
            values = (ctypes.c_int64 * slots)()
            slots = self._lib.nbmem_lines(values, slots, which)
        table: dict[Any, int] = {}
        for slot in range(min(slots, len(values))):  # (another thread may have added a line meanwhile)
            if values[slot]:
                line = self._line(slot)
                table[line] = table.get(line, 0) + values[slot]
        return table

    def _line(self, slot: int) -> Any:
        line = self._where.get(slot, self)
        if line is self:
            number = ctypes.c_int32()
            name = self._lib.nbmem_line_where(slot - 1, ctypes.byref(number))
            line = self._where[slot] = None if name is None else (os.fsdecode(name), number.value)
        return line

    @property
    def allocated(self) -> dict[Any, int]:
        return self._kept if self._kept is not None else self.table(2)

    def stop(self) -> None:
        """Keep what was allocated per line and let C++ go; safe to repeat."""
        self._lib.nbmem_lines_stop()
        if self._kept is None:
            self._kept = self.table(2)
        self._lib.nbmem_lines_forget()


@functools.cache
def native_tracker() -> NativeTracker:
    """The process's one native tracker (the CPU allocator is process-wide); builds the library first."""
    return NativeTracker()


skip_dynamo(NativeTracker.classify)  # called from hooks, which may run inside a compiled region (categories.py says why)
