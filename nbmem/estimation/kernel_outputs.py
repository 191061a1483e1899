"""Ops whose PyTorch meta functions make other outputs than their kernels: made as the kernels make them.

An estimate runs each op's meta function (through ``FakeTensorMode``), and
counts what it makes as a GPU would hold it. Where a meta function's output
differs from what the CPU and CUDA kernels allocate (bytes, strides, or
refusing inputs the kernels take), :class:`~nbmem.estimation.fakemode.FastKeyFakeTensorMode`
calls the function :data:`KERNEL_OUTPUTS` gives for the op instead. Each was
found by running real training steps' ops again on fake tensors and
comparing (tests/test_fakemode.py holds each against the real kernel).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["KERNEL_OUTPUTS", "grouped_mm_notes"]

_META = torch.device("meta")
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reduced_in_place(mode: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """A loss ATen reduces into its elementwise buffer: the scalar holds that buffer's storage, as a real one does.

    ``mse_loss``, ``smooth_l1_loss`` and ``soft_margin_loss`` with a mean
    or sum reduction return a 0-dim tensor whose storage holds one value
    per input element: ATen's structured kernel allocates its output at
    the inputs' broadcast size, then resizes it to a scalar, which keeps
    the storage (Loss.cpp, the same code on CPU and CUDA; on the CPU:
    1,280 B behind the loss of a 32 x 10 input, where PyTorch's meta
    function makes 4 B). It lives as long as the loss (through
    backward), and so here. Untested on CUDA (the test device, whose
    kernels are the CPU's, showed it).
    """
    out: Any = FakeTensorMode.dispatch(mode, func, types, args, kwargs)
    reduction = kwargs.get("reduction", args[2] if len(args) > 2 else 1)
    if reduction == 0 or not isinstance(out, FakeTensor) or out.dim() != 0:
        return out
    values = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
    with torch._C._DisableTorchDispatch():
        buffer = torch.empty((max(values, 1),), dtype=out.dtype, device=_META)
        scalar = buffer.as_strided((), (), 0)
    return mode._fake_tensor(scalar, out.fake_device)


def layer_norm_backward(mode: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """``native_layer_norm_backward`` with its input's gradient contiguous, as its kernels make it.

    The CPU and CUDA kernels allocate it as ``empty_like(input,
    LEGACY_CONTIGUOUS_MEMORY_FORMAT)`` (layer_norm.cpp,
    layer_norm_kernel.cu); PyTorch's meta function (its decomposition)
    gives it the incoming gradient's strides, so where that gradient is
    a transposed view (Swin's patch merging) the next reshape copied it
    on fake tensors alone: 4,096 B more in a tiny Swin's step than a
    tracked run of it.
    """
    out: Any = FakeTensorMode.dispatch(mode, func, types, args, kwargs)
    grad = out[0]
    if type(grad) is not FakeTensor or grad.is_contiguous():
        return out
    with torch._C._DisableTorchDispatch():
        made = torch.empty(grad.shape, dtype=grad.dtype, device=_META)
    return (mode._fake_tensor(made, grad.fake_device), *out[1:])


def grouped_mm(mode: Any, mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> Any:
    """``_grouped_mm``'s output as its CPU and CUDA kernels make it, in each dtype they take.

    torch 2.13's meta function refuses anything but bf16 (its CUTLASS
    path's rule), where the kernels also multiply fp32 and fp16 (as a loop
    of ``mm``: GroupedMMUtils.h, ``_grouped_mm_fallback``). transformers 5
    calls it for every mixture-of-experts layer (Mixtral, Qwen-MoE, OLMoE:
    ``integrations/moe.py``) in the weights' dtype, so an fp32 estimate of
    them failed. The output is ``create_grouped_gemm_output_tensor``'s:
    rows padded to 16 bytes (for the Hopper kernel's TMA; CPU and CUDA
    builds alike). Checked as the kernel checks its inputs.
    """
    __tracebackhide__ = True
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        torch._check(mat.dtype in _GROUPED_MM_DTYPES,
                     lambda: f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}")
        torch._check(mat.dim() in (2, 3), lambda: f"{name} has to be 2 or 3d")
    for mat in (mat_a, mat_b):  # row- or column-major, the other stride a multiple of 16 bytes
        rows, columns = mat.stride()[-2:]
        alignment = 16 // mat.element_size()
        if rows == 1 and columns >= max(1, mat.shape[-2]):
            torch._check(columns % alignment == 0, lambda: "strides should be multiple of 16 bytes")
        else:
            torch._check(columns == 1 and rows >= max(1, mat.shape[-1]),
                         lambda: f"Invalid strides/sizes, got {mat.stride()} for strides and {mat.shape} for sizes")
            torch._check(rows % alignment == 0, lambda: "strides should be multiple of 16 bytes")
    torch._check(mat_a.dtype == mat_b.dtype,
                 lambda: f"expected m1 and m2 to have the same dtype, but got: {mat_a.dtype} != {mat_b.dtype}")
    torch._check(bias is None, lambda: "Bias not supported yet")
    torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                 lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    mode._nbmem_grouped_mm += 1
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    torch._check((offs is not None) == (a_2d or b_2d), lambda: "Have to provide offsets if there is a 2d matrix")
    torch._check(offs is None or offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    if not (a_2d and b_2d):
        torch._check(mat_a.size(-1) == mat_b.size(-2),
                     lambda: "contraction dimension of mat_a and mat_b must match")
    if a_2d and b_2d:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        torch._check(offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = 16 // mat_a.element_size()
    padded = -(-size[-1] // alignment) * alignment
    stride = [padded, 1] if a_2d != b_2d else [size[1] * padded, padded, 1]
    with torch._C._DisableTorchDispatch():
        out = torch.empty_strided(size, stride, dtype=mat_a.dtype, device=_META)
    return mode._fake_tensor(out, mat_a.fake_device)


def _grouped_mm_op(mode: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
    __tracebackhide__ = True
    if all(type(arg) is FakeTensor and arg.fake_mode is mode for arg in args[:2]):
        return grouped_mm(mode, *args, **kwargs)
    return FakeTensorMode.dispatch(mode, func, types, args, kwargs)


def grouped_mm_notes(mode: Any, steps: int = 1) -> list[str]:
    """What an estimate assumed about mixture-of-experts layers' grouped products (none if none ran in ``mode``)."""
    calls = getattr(mode, "_nbmem_grouped_mm", 0) // steps
    if not calls:
        return []
    return [f"mixture of experts: {calls} grouped matrix product{'s' if calls != 1 else ''} per step "
            "(torch._grouped_mm, recomputed ones too) with the outputs PyTorch's kernels make; in bf16 on a Hopper "
            "or Blackwell GPU its CUTLASS kernel also takes an argument buffer and a workspace during each call, "
            "not modelled: on an H100 (torch 2.11) 60 B per expert and 66 KiB, freed as the call returns; in fp32 "
            "none"]


#: op -> function(mode, op, types, args, kwargs) that makes its outputs as its kernels do
KERNEL_OUTPUTS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.mse_loss.default: reduced_in_place,
    torch.ops.aten.smooth_l1_loss.default: reduced_in_place,
    torch.ops.aten.soft_margin_loss.default: reduced_in_place,
    torch.ops.aten.native_layer_norm_backward.default: layer_norm_backward,
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    KERNEL_OUTPUTS[torch.ops.aten._grouped_mm.default] = _grouped_mm_op
