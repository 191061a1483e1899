"""Dropout as a GPU runs it: one fused kernel that keeps a one-byte mask, also on the CPU.

In training, ``dropout`` on a CUDA, XPU or PrivateUse1 tensor runs
``native_dropout``, one kernel that saves a bool mask for backward
(aten/src/ATen/native/Dropout.cpp, ``is_fused_kernel_acceptable``: 0 < p < 1
and some elements). On the CPU (and on MPS) it multiplies the input by a
noise tensor of the input's dtype, which autograd saves: 4 bytes an element
in fp32 where the GPU keeps 1. A small GPT-2 has 13 dropouts on its hidden
states; estimated so, its fp32 step held 19.5 MiB more at the peak than an
H100 measured (the 2026-11-25 campaign): exactly those masks' difference. Hugging Face's
eager attention drops out its (batch, heads, sequence, sequence) weights the
same way.

:class:`FusedDropout` makes the CPU step do what the GPU would: while active,
``dropout``'s autograd kernel for CPU tensors runs ``native_dropout`` where
such a GPU would, and PyTorch's own composite kernel otherwise (evaluation,
p of 0 or 1, no elements). The values differ from the CPU's own dropout (a
different random stream); the memory is the GPU's.

>>> x = torch.ones(4, 8, requires_grad=True)
>>> with FusedDropout() as fused:
...     y = torch.nn.functional.dropout(x, 0.5)
>>> y.grad_fn.name(), fused.calls
('NativeDropoutBackward0', 1)
"""

from __future__ import annotations

from typing import Any

import torch

from .kernels import ScopedKernels

__all__ = ["FusedDropout"]

_DROPOUT = torch.ops.aten.dropout.default
_NATIVE = torch.ops.aten.native_dropout.default


class FusedDropout(ScopedKernels):
    """While active, CPU dropout in training keeps what a GPU's fused kernel keeps (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        #: calls run as the fused kernel (a one-byte mask kept)
        self.calls = 0

    def register(self, library: torch.library.Library) -> None:
        library.impl("dropout", self._kernel, "AutogradCPU")

    def _kernel(self, input: torch.Tensor, p: float, train: bool) -> Any:
        if train and 0 < p < 1 and input.numel() > 0:  # is_fused_kernel_acceptable, for a GPU's tensor
            self.calls += 1
            return _NATIVE(input, p, train)[0]
        # PyTorch's own C++ composite kernel, which this replaces (returns the input itself where it drops nothing;
        # decompose() would run torch._decomp's Python one, which copies it)
        return _DROPOUT._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, input, p, train)

    def notes(self, steps: int = 1) -> list[str]:
        """What the estimate assumed about dropout in each of ``steps`` steps (none without dropout in training)."""
        if not self.calls:
            return []
        calls = self.calls // steps
        return [f"dropout: {calls} call{'s' if calls != 1 else ''} per step (recomputed ones too) ran as a GPU's fused "
                "kernel (native_dropout), which keeps a one-byte mask where backward needs one; on a CPU or MPS, "
                "PyTorch keeps a mask of the input's dtype"]
