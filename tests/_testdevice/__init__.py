"""``nbmemdev``: a test-only PyTorch device (PrivateUse1) whose memory is host memory.

It exists so that nbmem's measured mode (real allocator statistics through
``torch.accelerator``) runs in CI without a GPU. ``testdevice.cpp`` (same
folder) is compiled once with the system C++ compiler, the way
``nbmem/tracking/native.py`` builds its library, cached under ``$NBMEM_CACHE``
(default ``~/.cache/nbmem``) by a hash of the source, the torch build and the
compiler, and loaded with ctypes; its static registrations install the
allocator, device guard, hooks and kernels for PrivateUse1, and :func:`load`
names that backend ``nbmemdev``.

>>> device = load()                                    # doctest: +SKIP
>>> x = torch.empty(1000, device="nbmemdev")           # doctest: +SKIP
>>> torch.accelerator.memory_allocated(0)              # doctest: +SKIP
4096

The allocator rounds requests up to 512 bytes and caches freed blocks by size
(see the comment in ``testdevice.cpp``); its capacity (default 1 GiB) is
:func:`set_capacity`'s, and beyond it allocations raise ``torch.OutOfMemoryError``.
A process can hold only one PrivateUse1 backend, and renaming it can't be undone.
"""

from __future__ import annotations

import ctypes
import threading
import types
from pathlib import Path

__all__ = ["NAME", "SOURCE", "DeviceUnavailable", "load", "available", "set_capacity", "capacity", "cached_bytes", "build"]

NAME = "nbmemdev"
SOURCE = Path(__file__).with_name("testdevice.cpp")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_module: types.ModuleType | None = None


class DeviceUnavailable(RuntimeError):
    """The test device can't be built or loaded here; the message says why."""


def build() -> Path:
    """The built library's path, compiling it first if the cache has no build for this source and torch."""
    from nbmem.tracking.native import build_shared

    return build_shared(SOURCE, "testdevice", DeviceUnavailable)


def _device_module(library: ctypes.CDLL) -> types.ModuleType:
    """``torch.nbmemdev``: what torch asks of a backend's Python module (one device, index 0)."""
    import torch

    module = types.ModuleType(f"torch.{NAME}")

    def _check(device=None) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if index not in (None, 0):
            raise ValueError(f"{NAME} has one device (index 0), not {device!r}")

    def current_device() -> int:
        return 0

    def set_device(device) -> None:
        _check(device)

    def synchronize(device=None) -> None:
        _check(device)

    # Random numbers come from the CPU generator (the ops run on CPU kernels), so
    # torch.manual_seed already seeds the device; these keep torch.manual_seed quiet.
    def manual_seed(seed: int) -> None:
        torch.random.default_generator.manual_seed(int(seed))

    def get_rng_state(device=None) -> torch.Tensor:
        return torch.random.get_rng_state()

    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.random.set_rng_state(state)

    class device:
        """Context manager selecting a device (there is only device 0)."""

        def __init__(self, device) -> None:
            _check(device if not isinstance(device, str) else torch.device(device))

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc) -> bool:
            return False

    module.device = device
    functions = dict(
        is_available=lambda: True,
        device_count=lambda: 1,
        is_initialized=lambda: True,
        _lazy_init=lambda: None,
        _is_in_bad_fork=lambda: False,
        current_device=current_device,
        set_device=set_device,
        synchronize=synchronize,
        manual_seed=manual_seed,
        manual_seed_all=manual_seed,
        get_rng_state=get_rng_state,
        set_rng_state=set_rng_state,
        initial_seed=lambda: torch.random.initial_seed(),
        # autocast: torch.autocast("nbmemdev") asks which dtypes it may cast to
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16],
        is_bf16_supported=lambda including_emulation=True: True,
        get_device_name=lambda device=None: f"{NAME} (host memory, test device)",
        # memory, for code that asks the backend module rather than torch.accelerator
        memory_allocated=lambda device=None: torch.accelerator.memory_allocated(0),
        max_memory_allocated=lambda device=None: torch.accelerator.max_memory_allocated(0),
        memory_reserved=lambda device=None: torch.accelerator.memory_reserved(0),
        max_memory_reserved=lambda device=None: torch.accelerator.max_memory_reserved(0),
        memory_stats=lambda device=None: torch.accelerator.memory_stats(0),
        reset_peak_memory_stats=lambda device=None: torch.accelerator.reset_peak_memory_stats(0),
        empty_cache=lambda: torch.accelerator.empty_cache(),
        mem_get_info=lambda device=None: torch.accelerator.get_memory_info(0),
        set_capacity=set_capacity,
        capacity=capacity,
    )
    for name, function in functions.items():
        setattr(module, name, function)
    return module


def load() -> types.ModuleType:
    """Builds (once), loads and registers the device; returns ``torch.nbmemdev``. Idempotent.

    Raises DeviceUnavailable when it can't be built or loaded, or when this process
    already gave PrivateUse1 another name.
    """
    global _library, _module
    with _lock:
        if _module is not None:
            return _module
        import torch

        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", NAME):
            raise DeviceUnavailable(f"this process already named the PrivateUse1 backend {current!r}")
        try:
            # RTLD_GLOBAL is not needed: the library only registers itself with torch.
            library = ctypes.CDLL(str(build()))
        except OSError as error:
            raise DeviceUnavailable(f"loading the nbmemdev test device failed ({error})") from None
        library.nbmemdev_set_capacity.argtypes = [ctypes.c_int64]
        library.nbmemdev_set_capacity.restype = None
        for name in ("nbmemdev_capacity", "nbmemdev_cached_bytes"):
            getattr(library, name).argtypes = []
            getattr(library, name).restype = ctypes.c_int64
        _library = library
        if current != NAME:
            torch.utils.rename_privateuse1_backend(NAME)
        module = _device_module(library)
        torch._register_device_module(NAME, module)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
        _module = module
        return module


def available() -> bool:
    """Whether the test device can be built here (compiles it once, cached); never loads it.

    Loading is :func:`load`'s: it makes nbmemdev this process's accelerator for good, so a
    process that only asks (a parent that runs the device tests in a child) stays device-free.
    True once this process has loaded it.
    """
    if _module is not None:
        return True
    try:
        build()
    except DeviceUnavailable:
        return False
    return True


def _lib() -> ctypes.CDLL:
    load()
    assert _library is not None
    return _library


def set_capacity(nbytes: int) -> None:
    """Sets the device's capacity in bytes: reserved memory beyond it raises torch.OutOfMemoryError."""
    if nbytes < 0:
        raise ValueError(f"capacity must be >= 0 bytes, not {nbytes}")
    _lib().nbmemdev_set_capacity(int(nbytes))


def capacity() -> int:
    """The device's capacity in bytes (default 1 GiB); get_memory_info()'s total."""
    return int(_lib().nbmemdev_capacity())


def cached_bytes() -> int:
    """Bytes the allocator holds in freed, cached blocks (reserved minus allocated)."""
    return int(_lib().nbmemdev_cached_bytes())
