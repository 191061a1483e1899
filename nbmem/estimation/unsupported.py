"""What an estimate can't run as it is, and the words it says instead: compiled code, bitsandbytes.

``torch.compile``'d code runs as its eager Python in an estimate (fake tensors
can't run compiled kernels): :func:`compiled_note` says so in the result.
bitsandbytes' quantized layers and optimizers can't run on fake tensors at
all (their weights quantize when the model moves to a device; their kernels
read values): :func:`bitsandbytes_message` says what to run instead.
"""

from __future__ import annotations

import os

__all__ = ["compiled_note", "from_bitsandbytes", "bitsandbytes_message"]


def from_bitsandbytes(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) was raised in bitsandbytes' code."""
    seen: BaseException | None = error
    while seen is not None:
        trace = seen.__traceback__
        while trace is not None:
            if f"{os.sep}bitsandbytes{os.sep}" in trace.tb_frame.f_code.co_filename:
                return True
            trace = trace.tb_next
        seen = seen.__cause__ or seen.__context__
    return False


def compiled_note(mode: str, calls: int) -> str:
    """What an estimate says when the step called ``torch.compile``'d code."""
    how = (
        "as its eager Python (torch.compiler.set_stance('force_eager'): fake tensors can't run compiled kernels)"
        if mode == "estimated"
        else "eagerly (PyTorch runs no compiled frame under the tracker's dispatch mode)"
    )
    return (
        f"estimated as eager: the step called torch.compile'd code {calls} time(s), run {how}. Compiled code often "
        "holds less: inductor's forward and backward held 11-38 % less than eager for an MLP, a CNN and a GPT-2 on "
        "the CPU (benchmarks/bench_compiled.py) and up to 37 % less on an H100 (2026-11); nbmem.track() measures "
        "it compiled on the CPU (the native engine)"
    )


def bitsandbytes_message(error: BaseException, mode: str) -> str:
    """The error an estimate raises when bitsandbytes' code failed under it, saying what to run instead.

    >>> print(bitsandbytes_message(AssertionError(), "tracked")[:63])
    bitsandbytes' code failed in the step (AssertionError): a 4-bit
    """
    what = f"{type(error).__name__}{': ' + str(error).splitlines()[0][:200] if str(error) else ''}"
    if mode == "estimated":
        return (
            f"bitsandbytes' quantized layers or optimizers can't be estimated on fake tensors ({what}): their weights "
            "are quantized when the model moves to a device, and their kernels read values. Run it for real instead: "
            "mode='tracked' with a factory that moves the model to the CPU (make().to('cpu')), which quantizes it with "
            "bitsandbytes' CPU kernels (a 4096x11008 nf4 layer took 23,264,768 B there and 23,787,520 B on an H100), "
            "or mode='measured' on a GPU"
        )
    return (
        f"bitsandbytes' code failed in the step ({what}): a 4-bit or 8-bit layer quantizes its weights only when the "
        "model moves to a device; have the factory move it (make().to('cpu') here, make().cuda() on a GPU)"
    )
