"""Bytes: formatting in binary units, parsing user-written sizes, CUDA rounding.

This is the one place where nbmem turns integers into text and back, so every
figure in every report uses the same units.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "parse_bytes", "round_allocation", "torch_format_size", "CUDA_BLOCK"]

#: The CUDA caching allocator rounds every request up to a multiple of 512 bytes
#: (kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp); a zero-byte request
#: allocates nothing.
CUDA_BLOCK = 512

_BINARY = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def round_allocation(nbytes: int, block: int = CUDA_BLOCK) -> int:
    """Bytes the CUDA caching allocator hands out for a request of ``nbytes``.

    >>> round_allocation(4)     # one float32 still takes a whole 512 B block
    512
    >>> round_allocation(0)
    0
    """
    if nbytes <= 0:
        return 0
    return -(-nbytes // block) * block


def format_bytes(nbytes: int | float | None, *, signed: bool = False) -> str:
    """Format a byte count in binary units (KiB = 1024 B), three significant digits.

    >>> format_bytes(8 * 1024**2)
    '8.00 MiB'
    >>> format_bytes(-4 * 1024**2, signed=True)
    '-4.00 MiB'
    >>> format_bytes(512, signed=True)
    '+512 B'
    """
    if nbytes is None:
        return "n/a"
    sign = "-" if nbytes < 0 else ("+" if signed and nbytes > 0 else "")
    size = abs(nbytes)
    exponent = 0
    while size >= 1024 and exponent < len(_BINARY) - 1:
        size /= 1024
        exponent += 1
    if exponent == 0:
        return f"{sign}{int(size)} B"
    digits = 2 if size < 10 else (1 if size < 100 else 0)
    return f"{sign}{size:.{digits}f} {_BINARY[exponent]}"


def torch_format_size(nbytes: int) -> str:
    """A size as PyTorch's out-of-memory message writes it (format_size in CUDACachingAllocator.cpp).

    Used only to reproduce that message; every other figure uses :func:`format_bytes`.

    >>> torch_format_size(20 * 1024**2), torch_format_size(512)
    ('20.00 MiB', '512 bytes')
    """
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576:.2f} MiB"
    return f"{nbytes / 1073741824:.2f} GiB"


def parse_bytes(text: str | int) -> int:
    """Parse a size such as ``"2GiB"``, ``"1.5 GB"``, ``"512MiB"`` or ``4096``.

    Binary units (KiB, MiB, GiB, TiB, or just K, M, G, T) are powers of 1024;
    decimal units (KB, MB, GB, TB) are powers of 1000; a bare number is bytes.

    >>> parse_bytes("2GiB")
    2147483648
    >>> parse_bytes("1.5 GB")
    1500000000
    """
    if isinstance(text, bool):
        raise ValueError(f"expected a size such as '16GiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size can't be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"can't read {text!r} as a size: write a number with an optional unit, "
            "e.g. '16GiB', '512 MiB', '1.5GB' or '4096' (bytes); "
            "binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"size {text!r} is too large")
    return int(round(value))
