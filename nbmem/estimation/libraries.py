"""The optional libraries quantized estimates run (bitsandbytes, torchao, transformers' Adafactor): found, and imported.

Kept apart so that every module that needs them imports this one, never
each other (nbmem.estimation.quantization imports quantized_layers).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["library_module", "require_library", "require_bitsandbytes"]


def require_bitsandbytes(what: str) -> None:
    """Raise ValueError, naming the extra, when bitsandbytes is not installed."""
    require_library("bitsandbytes", what)


def library_module(name: str) -> Any:
    """Import ``name`` (of bitsandbytes or torchao) outside every dispatch mode, untyped.

    A library first imported inside an estimate's fake mode would keep fake
    tensors as its module-level constants (torchao's code maps), which later
    steps then read with ``.tolist()``.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return importlib.import_module(name)


def require_library(library: str, what: str) -> None:
    """Raise ValueError, naming the extra, when ``library`` (bitsandbytes, torchao, transformers) is not installed."""
    if importlib.util.find_spec(library) is None:
        extra = "zoo" if library == "transformers" else "quant"
        raise ValueError(f"{what} needs {library}, an optional extra: pip install 'nbmem[{extra}]'")
