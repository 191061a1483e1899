"""The devices measured mode reads: CUDA, and every accelerator ``torch.accelerator`` knows.

Measured mode reads a real allocator's own counters. CUDA's (ROCm's too:
PyTorch calls a ROCm GPU ``cuda``) come from ``torch.cuda``, which never
initialises the device to answer. Every other accelerator (Apple's MPS,
Intel's XPU, an out-of-tree PrivateUse1 backend such as PyTorch's OpenReg
or the test device this project's CI builds) is read through PyTorch's
device-generic API, ``torch.accelerator.memory_allocated`` and friends,
which ask the backend's ``DeviceAllocator``. A backend that keeps no such
figure (no peak counter, no reserved figure) gets None for it here, and
the result says which figures it could not give: nbmem never shows a
number the device did not measure. Untested on real CUDA, ROCm, MPS and
XPU hardware from this module; its generic path runs in CI on the test
device (tests/_testdevice).

>>> DeviceCounter(torch.device("cpu"))
Traceback (most recent call last):
...
ValueError: measured mode reads an accelerator's allocator, and cpu is not one: track the CPU instead (backend='tracked')
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

from .counters import PeakScopes

__all__ = ["accelerator_type", "current_device", "device_count", "DeviceCounter", "device_counter", "FIGURES"]

#: The figures a counter reads, by the names its result reports missing ones with.
FIGURES = ("allocated", "reserved", "peak allocated", "peak reserved")


def accelerator_type() -> str | None:
    """This process's accelerator ("cuda", "mps", "xpu", a PrivateUse1 backend's name), None without one available.

    Asks nothing that initialises a device (``torch.cuda.is_available`` does not).
    """
    generic = getattr(torch, "accelerator", None)
    if generic is not None:
        try:
            device = generic.current_accelerator(check_available=True)
        except (RuntimeError, TypeError):
            device = None
        if device is not None and (device.type == "cuda" or _allocator_readable()):
            return str(device.type)
    return "cuda" if torch.cuda.is_available() else None


def _allocator_state() -> bool | None:
    """Whether the accelerator's allocator is up (True) or not yet (False); None where torch.accelerator can't read
    it (PyTorch raises for a backend whose allocator is not a ``DeviceAllocator``, e.g. an older out-of-tree
    plugin). A torch without the question: up."""
    ready = getattr(torch._C, "_accelerator_isAllocatorInitialized", None)
    if ready is None:
        return True
    try:
        return bool(ready())
    except RuntimeError:
        return None


def _allocator_readable() -> bool:
    """Whether the accelerator's allocator answers torch.accelerator's memory functions."""
    return _allocator_state() is not None


def current_device(device_type: str | None = None) -> torch.device | None:
    """The accelerator's current device (``cuda:0`` before CUDA is touched: reading it would initialise CUDA)."""
    kind = device_type or accelerator_type()
    if kind is None:
        return None
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
    try:
        index = int(torch.accelerator.current_device_index())
    except (RuntimeError, AttributeError):
        index = 0
    return torch.device(kind, max(index, 0))


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` this machine has (0 for a type that is not its accelerator)."""
    if device_type == "cuda":
        return int(torch.cuda.device_count())
    if device_type != accelerator_type():
        return 0
    try:
        return int(torch.accelerator.device_count())
    except (RuntimeError, AttributeError):
        return 1


def _answer(read: Callable[[], Any]) -> int | None:
    """A backend's figure, None where it has none (not implemented, or not kept)."""
    try:
        value = read()
    except (RuntimeError, NotImplementedError, AttributeError, AssertionError, TypeError):
        return None
    return int(value) if value is not None else None


class DeviceCounter:
    """One device's allocator counters: CUDA's through ``torch.cuda``, any other accelerator's through
    ``torch.accelerator``. Never initialises a device itself: before the process has used it every figure
    is zero and there is no peak to reset.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type == "cpu":
            raise ValueError("measured mode reads an accelerator's allocator, and cpu is not one: track the CPU "
                             "instead (backend='tracked')")
        self.device = device
        self.index = device.index if device.index is not None else 0
        self.cuda = device.type == "cuda"
        self._module: Any = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu, a backend's
        self.scopes = PeakScopes(self)
        self._missing: tuple[str, ...] | None = () if self.cuda else None
        self._read = self._readers()  # made once: the live gauge reads twice a second

    @property
    def missing(self) -> tuple[str, ...]:
        """The figures this backend can't give (FIGURES' names): asked once its allocator is up (before, every
        figure reads 0 and says nothing)."""
        if self._missing is None:
            if not self._used():
                return ()
            self._missing = tuple(name for name, read in zip(FIGURES, self._read) if _answer(read) is None)
        return self._missing

    # -- reading ------------------------------------------------------------

    def _used(self) -> bool:
        """Whether the device's allocator is up (nothing to read, nor to reset, before)."""
        if self.cuda:
            return bool(torch.cuda.is_initialized())
        return bool(_allocator_state())  # None: not a DeviceAllocator, nothing torch.accelerator can read

    def _readers(self) -> tuple[Callable[[], Any], ...]:
        index, module = self.index, self._module
        generic: Any = getattr(torch, "accelerator", None)
        if self.cuda:
            return (lambda: torch.cuda.memory_allocated(index), lambda: torch.cuda.memory_reserved(index),
                    lambda: torch.cuda.max_memory_allocated(index), lambda: torch.cuda.max_memory_reserved(index))
        if self.device.type == "mps" and module is not None:  # MPS keeps no peaks; its driver's figure is reserved
            return (lambda: module.current_allocated_memory(), lambda: module.driver_allocated_memory(), _none, _none)
        return (lambda: generic.memory_allocated(index), lambda: generic.memory_reserved(index),
                lambda: generic.max_memory_allocated(index), lambda: generic.max_memory_reserved(index))

    def _figure(self, which: int) -> int | None:
        if not self._used():
            return 0
        if FIGURES[which] in self.missing:
            return None
        return _answer(self._read[which])

    def allocated(self) -> int:
        return self._figure(0) or 0

    def reserved(self) -> int | None:
        return self._figure(1)

    def peak_allocated(self) -> int:
        """The allocator's peak since its last reset; where it keeps none, what is allocated now."""
        peak = self._figure(2)
        return peak if peak is not None else self.allocated()

    def peak_reserved(self) -> int | None:
        return self._figure(3)

    def running_figures(self) -> tuple[int, int]:
        """(allocated, peak allocated) now: the allocator's counters, safe to read from any thread."""
        return self.allocated(), self.peak_allocated()

    def reset_peak(self) -> None:
        if not self._used() or "peak allocated" in self.missing:
            return
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.index)
        else:
            torch.accelerator.reset_peak_memory_stats(self.index)

    # -- the device ---------------------------------------------------------

    def device_view(self) -> tuple[str | None, int | None, int | None]:
        """(name, total bytes, free bytes) from the driver, None while the device is untouched or can't say."""
        if not self._used():
            return None, None, None
        if self.cuda:
            free, total = torch.cuda.mem_get_info(self.index)
            return torch.cuda.get_device_name(self.index), total, free
        name = None
        if hasattr(self._module, "get_device_name"):
            name = str(self._module.get_device_name(self.index))
        limit = mps_limit(self._module) if self.device.type == "mps" else None
        if limit is not None:  # what an allocation may take before MPS raises, not the Mac's memory
            return name or "mps", limit, max(limit - int(self._module.driver_allocated_memory()), 0)
        try:
            free, total = torch.accelerator.get_memory_info(self.index)
        except (RuntimeError, NotImplementedError, AttributeError):
            return name or str(self.device), None, None
        return name or str(self.device), int(total), int(free)

    def total_memory(self) -> int | None:
        """The device's capacity in bytes (None where the backend can't say)."""
        if self.cuda:
            return int(torch.cuda.get_device_properties(self.index).total_memory)
        return self.device_view()[1]

    def synchronize(self) -> None:
        """Wait for the device's queued work, so a wall time includes it."""
        if not self._used():
            return
        if self.cuda:
            torch.cuda.synchronize(self.index)
        else:
            torch.accelerator.synchronize(self.index)

    def empty_cache(self) -> None:
        """Give the allocator's cached free blocks back to the device (only where nbmem is asked to)."""
        if not self._used():
            return
        if self.cuda:
            torch.cuda.empty_cache()
        else:
            torch.accelerator.empty_cache()

    def missing_note(self) -> str | None:
        """What a result on this device says about the figures its backend does not keep, if any."""
        if not self.missing:
            return None
        said = {"peak allocated": "no peak counter: the peak is the larger of the figures read at the block's start "
                                  "and end, and may miss a higher one between",
                "reserved": "no reserved figure", "peak reserved": "no peak of reserved memory",
                "allocated": "no allocated figure (shown as 0)"}
        return f"{self.device.type} keeps " + "; ".join(said[name] for name in self.missing)


def _none() -> None:
    return None


def mps_limit(module: Any) -> int | None:
    """The bytes MPS may take before it raises out of memory (its message's "max allowed"), None if unlimited.

    Metal's recommended working set times ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``
    (1.7 unless set; 0 lifts the limit), as PyTorch's MPS allocator sets it when
    it starts (``torch.mps.set_per_process_memory_fraction`` moves it later,
    unseen here). Untested on a real Mac.

    >>> class SixteenGigabyteMac:       # Metal recommends 2/3 of 16 GB
    ...     def recommended_max_memory(self): return 16 * 2**30 * 2 // 3
    >>> f"{mps_limit(SixteenGigabyteMac()) / 2**30:.2f} GiB"    # "max allowed: 18.13 GB" in its OOM message
    '18.13 GiB'
    """
    try:
        ratio = float(os.environ.get("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "1.7"))
        recommended = int(module.recommended_max_memory())
    except (ValueError, RuntimeError, AttributeError):
        return None
    return int(ratio * recommended) if ratio > 0 else None


@functools.cache
def device_counter(device: torch.device) -> DeviceCounter:
    """The one counter (and scope stack) for ``device``.

    Cached on purpose: it mirrors the process-wide counter inside the device's
    allocator, and all of nbmem's scopes on a device must share one stack.
    """
    return DeviceCounter(device)
