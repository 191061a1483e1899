"""The optional libraries quantized estimates run (bitsandbytes, torchao, transformers' Adafactor): found, and imported.

Kept apart so that every module that needs them imports this one, never
each other (nbmem.estimation.quantization imports quantized_layers).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = ["library_module", "require_library", "require_bitsandbytes", "quantized_weight"]


def require_bitsandbytes(what: str) -> None:
    """Raise ValueError, naming the extra, when bitsandbytes is not installed."""
    require_library("bitsandbytes", what)


def library_module(name: str) -> Any:
    """Import ``name`` (of bitsandbytes, torchao or transformers) outside every dispatch mode, untyped.

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


def quantized_weight(parameter: Any, reach: str = "any") -> bool:
    """Whether ``parameter`` is a weight one of these libraries quantized, of the kinds ``reach`` names.

    ``"4bit"``: bitsandbytes' 4-bit weights (``Params4bit``, or an
    estimate's fake weight carrying a ``quant_state``), peft's rule for what
    ``prepare_model_for_kbit_training`` leaves uncast; ``"bitsandbytes"``:
    its int8 weights too (``SCB``), the ones nbmem's kernel stand-ins serve;
    ``"any"``: torchao's tensor subclasses too, the weights that never train.
    """
    four = type(parameter).__name__ == "Params4bit" or getattr(parameter, "quant_state", None) is not None
    if reach == "4bit" or four:
        return four
    bitsandbytes = getattr(parameter, "SCB", None) is not None or type(parameter).__module__.startswith("bitsandbytes.")
    if reach == "bitsandbytes" or bitsandbytes:
        return bitsandbytes
    return type(parameter).__module__.startswith("torchao.")

