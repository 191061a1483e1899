"""How a block is measured: the backend (measured on an accelerator, or tracked) and tracked mode's engine.

:func:`resolve_backend` turns a ``backend`` and a ``device`` into a mode and
a device, or a ValueError saying how to fix a request that can't work;
:func:`native_engine` does the same for ``engine="native"``. The scopes, the
magics and the callbacks all decide here, so they say the same thing.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from .accelerators import accelerator_type, current_device, device_count

__all__ = ["Backend", "BACKENDS", "Engine", "ENGINES", "resolve_backend", "native_engine"]

Backend = Literal["auto", "measured", "cuda", "tracked"]
BACKENDS = ("auto", "measured", "cuda", "tracked")
Engine = Literal["auto", "dispatch", "native"]
#: How tracked mode sees memory: every op through a Python dispatch mode (the
#: default: exact storages, the op at the peak, virtual capacity, timelines), or
#: the CPU allocator's blocks counted in C++ (nbmem.tracking.native_tracking: no trip
#: into Python per op).
ENGINES = ("auto", "dispatch", "native")


#: How messages name a device type.
_NAMES = {"cuda": "CUDA", "mps": "MPS", "xpu": "XPU"}


def resolve_backend(backend: str = "auto", device: str | torch.device | None = None) -> tuple[str, torch.device]:
    """Decide how to measure: ``("measured", device)`` on an accelerator, or ``("tracked", device)``.

    ``auto`` measures on this machine's accelerator (CUDA, ROCm, MPS, XPU,
    a PrivateUse1 backend: :mod:`nbmem.tracking.accelerators`) when it has
    one (or one is named) and tracks otherwise; ``measured`` needs one;
    ``cuda`` needs CUDA. Raises ValueError saying how to fix a request that
    can't work.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    kind = accelerator_type()
    # torch.accelerator prefers an out-of-tree (PrivateUse1) backend to CUDA when both are there; CUDA stays measurable
    cuda = kind == "cuda" or torch.cuda.is_available()
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"can't read device {str(device)!r}: write e.g. 'cuda:0', 'cuda' or 'cpu'") from error
        if device.type != "cpu" and device.type != kind and not (device.type == "cuda" and cuda):
            raise ValueError(
                f"no {_NAMES.get(device.type, device.type)} device is available, so {device} can't be measured: drop "
                "--device (nbmem then tracks on the cpu) or use --backend tracked --device cpu" if kind is None else
                f"this machine's accelerator is {kind}, so {device} can't be measured: name '{kind}:N' or drop --device"
            )
    if device is not None and device.type != "cpu":
        current = current_device(device.type)
        index = current.index if device.index is None and current is not None else device.index or 0
        count = device_count(device.type)
        if index >= count:
            raise ValueError(f"{device} does not exist: this machine has {count} {device.type} device(s), "
                             f"{device.type}:0 to {device.type}:{count - 1}")
        device = torch.device(device.type, index)
    accelerator = current_device(kind) if kind is not None else None
    if backend == "cuda" and cuda:
        accelerator = current_device("cuda")
    if backend in ("cuda", "measured"):
        wanted = "a CUDA device" if backend == "cuda" else "an accelerator (CUDA, ROCm, MPS, XPU, ...)"
        if accelerator is None or (backend == "cuda" and not cuda):
            raise ValueError(f"backend {backend!r} needs {wanted} and none is available: use 'tracked' or 'auto'")
        named = "cuda" if backend == "cuda" else kind
        if device is not None and device.type != named:
            raise ValueError(f"backend {backend!r} measures {wanted}, not {device}: drop --device or name "
                             f"'{named}:N'")
        return "measured", device or accelerator
    if device is None:
        device = accelerator or torch.device("cpu")
    if backend == "tracked":
        return "tracked", device
    return ("measured" if device.type != "cpu" else "tracked"), device


def native_engine(mode: str, device: torch.device, capacity: Any, timeline: bool) -> Any:
    """The native engine's tracker, or a ValueError saying which request it can't serve."""
    if mode != "tracked" or device.type != "cpu":
        raise ValueError(f"engine 'native' tracks the cpu, not {device} ({mode}): drop engine or use backend='tracked', device='cpu'")
    if capacity is not None or timeline:
        wants = "a virtual capacity" if capacity is not None else "a timeline"
        raise ValueError(f"{wants} needs every op, which only engine 'dispatch' sees: drop engine='native'")
    from .native_tracking import native_tracker

    return native_tracker()
