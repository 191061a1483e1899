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

import functools
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode

from .counters import PeakScopes
from .units import CUDA_BLOCK, round_allocation

__all__ = ["Tracker", "default_tracker"]

_Tensor = torch.Tensor
# torch.tensor(data) builds its tensor outside the dispatcher and then hands it
# to lift_fresh: the storage is new although it is also the op's input.
_FRESH = {torch.ops.aten.lift_fresh.default}


class _TrackingMode(TorchDispatchMode):
    """Reports every op's inputs and outputs to its tracker; changes nothing."""

    def __init__(self, tracker: "Tracker") -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        tracker = self.tracker
        if func not in _FRESH:
            tracker._adopt_all(args)
            if kwargs:
                tracker._adopt_all(kwargs.values())
        out = func(*args, **kwargs) if kwargs else func(*args)
        tracker._note(out)
        return out


class Tracker:
    """Live bytes of the tensor storages on one device, with a running peak.

    A tracker is a peak counter (see :mod:`nbmem.counters`): scopes opened on
    ``tracker.scopes`` nest correctly. :meth:`activate` installs the dispatch
    mode (re-entrantly); storages it saw stay accounted between activations
    until they are freed.

    >>> tracker = Tracker("cpu")
    >>> with tracker:
    ...     a = torch.ones(1024, 1024)     # 1024 * 1024 * 4 bytes = 4 MiB
    >>> tracker.allocated()
    4194304
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
        self._on_device = _device_test(self.device)
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._allocated = 0
        self._peak = 0
        self._adopted = 0
        self._mode: _TrackingMode | None = None
        self._depth = 0
        self.scopes = PeakScopes(self)
        # PyTorch wraps __torch_dispatch__ so that its first call imports
        # torch._dynamo (about a second): pay that here, not in a timed cell.
        with _TrackingMode(self):
            torch.empty(0)

    # -- the peak-counter protocol ----------------------------------------

    def allocated(self) -> int:
        return self._allocated

    def reserved(self) -> None:
        return None

    def peak_allocated(self) -> int:
        return self._peak

    def peak_reserved(self) -> None:
        return None

    def reset_peak(self) -> None:
        self._peak = self._allocated

    @property
    def adopted(self) -> int:
        """Bytes found in use that were allocated before tracking saw them."""
        return self._adopted

    @property
    def live_storages(self) -> int:
        return len(self._sizes)

    # -- activation ---------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._depth > 0

    def activate(self) -> None:
        """Install the dispatch mode on this thread (nested calls just count)."""
        if self._depth == 0:
            self._mode = _TrackingMode(self)
            self._mode.__enter__()
        self._depth += 1

    def deactivate(self) -> None:
        """Undo one :meth:`activate`; the last one removes the dispatch mode."""
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and self._mode is not None:
            mode, self._mode = self._mode, None
            _remove_mode(mode)

    def __enter__(self) -> "Tracker":
        self.activate()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.deactivate()

    # -- the accounting (hot path: keep it lean) ----------------------------

    def _note(self, out: Any) -> None:
        if isinstance(out, _Tensor):
            self._count(out, adopt=False)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._note(item)

    def _adopt_all(self, values: Any) -> None:
        # Runs for every input of every op: most inputs are already known, so
        # that check comes first and costs no further call.
        sizes = self._sizes
        for value in values:
            if isinstance(value, _Tensor):
                try:
                    known = value.untyped_storage()._cdata in sizes
                except (RuntimeError, NotImplementedError):
                    known = False  # sparse: _count looks at its parts
                if not known:
                    self._count(value, adopt=True)
            elif isinstance(value, (tuple, list)):
                self._adopt_all(value)

    def _count(self, tensor: torch.Tensor, adopt: bool) -> None:
        if not self._on_device(tensor):
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            # A sparse tensor has no storage of its own: its memory is that of
            # its index and value tensors. Nested tensors are not counted.
            for part in _sparse_parts(tensor):
                self._count(part, adopt)
            return
        key = storage._cdata
        known = self._sizes.get(key)
        if known is not None:
            if adopt:
                return
            size = round_allocation(storage.nbytes(), self.block)
            if size == known:
                return
            # resized in place (out= arguments, resize_, set_): count the change
            self._sizes[key] = size
            self._grow(size - known)
            return
        size = round_allocation(storage.nbytes(), self.block)
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))
        if adopt:
            self._allocated += size
            self._peak += size
            self._adopted += size
            self.scopes.adopt(size)
        else:
            self._grow(size)

    def _grow(self, size: int) -> None:
        self._allocated += size
        if self._allocated > self._peak:
            self._peak = self._allocated

    def _free(self, key: int, ref: weakref.ref) -> None:
        if self._refs.get(key) is ref:
            del self._refs[key]
            self._allocated -= self._sizes.pop(key)


def _sparse_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors that hold a sparse tensor's memory (none for other layouts)."""
    layout = tensor.layout
    if layout is torch.sparse_coo:
        return (tensor._indices(), tensor._values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return (tensor.crow_indices(), tensor.col_indices(), tensor.values())
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return (tensor.ccol_indices(), tensor.row_indices(), tensor.values())
    return ()


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
        return lambda tensor: tensor.is_cpu
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
