"""Reductions as CUDA runs them: the staging buffer a split reduction takes, in an estimate.

PyTorch's CUDA reductions (``sum``, ``mean``, ``amax``, ``var``, vector norms:
``gpu_reduce_kernel`` in aten/src/ATen/native/cuda/Reduce.cuh) split a long
reduction across thread blocks when each output has many inputs and there are
few outputs to spread over the GPU. The blocks then meet in global memory: the
kernel takes a staging buffer and a semaphore per output block from the
caching allocator, after its output, and frees both when it returns (the
semaphore first). A bias's gradient is such a reduction (a sum over every
row of the batch), and so is a normalisation weight's: on an H100, a BERT
layer's backward took five 2 MiB buffers and one of 8 MiB (hidden 256,
intermediate 1,024, 1,024 rows), enough to make the allocator reserve one more
20 MiB segment than an estimate without them
(``benchmarks/results/2026-11-27-gpu/misses.json``). PyTorch's CPU kernels,
which an estimate runs on fake tensors, take none.

The buffer's size is arithmetic, no heuristics: ``setReduceConfig`` picks the
launch from the reduction's layout (TensorIterator's: reduced dimensions first,
adjacent ones merged) and the GPU's SM count and resident threads per SM;
the buffer is ``sizeof(accumulator) * outputs * blocks per output``, times the
block's width and vector size where lanes hold different outputs.
:func:`staging_bytes` computes it; :class:`CudaReductions` makes an estimate
take it for the reductions listed in ``_OPS``, on fake tensors (an estimate) and CPU tensors (an estimate's
tracked run: a CPU buffer of that size, never touched), not under ``torch.inference_mode()`` (no kernel below
autograd runs there), and not inside ``rms_norm`` where CUDA runs its fused kernel.

>>> staging_bytes((1024, 1024), (1024, 1), (0,), torch.bfloat16, "sum", "H100-80GB")  # the H100: 8,388,608 and 32
(8388608, 32)
>>> staging_bytes((1024, 256), (256, 1), (0,), torch.bfloat16, "sum", "H100-80GB")    # the H100: 2,097,152 and 8
(2097152, 8)
>>> staging_bytes((1024, 256), (256, 1), (1,), torch.float32, "sum", "H100-80GB")     # along rows: no split
(0, 0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensor

from ..core.devices import SM_COUNT, gpu_or_h100, threads_per_sm
from .kernels import ScopedKernels

__all__ = ["CudaReductions", "staging_bytes"]

#: Reduce.cuh's launch constants (CUDA; ROCm's differ and are not modelled)
_MAX_NUM_THREADS = 512
_WARP = 32
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
#: a reduction's input elements a thread loads at once (vt0; input_vec_size follows it): 2 for Welford's
_VT0 = {"welford": 2}
#: the reductions' families, by what their partial results are: float sums (sum, mean, norms), Welford's
#: (var, std), the input's own type (amax, amin)
_FAMILIES = ("sum", "welford", "extreme")


def _accumulator_bytes(kind: str, dtype: torch.dtype) -> int:
    """sizeof(arg_t): what each partial result takes in the staging buffer, for a reduction computing in ``dtype``
    (its output's: the iterator's common dtype)."""
    wide = dtype in (torch.float64, torch.complex128)
    if kind == "welford":  # WelfordData<acc, int32_t>: mean, m2, n, nf (with padding for double)
        return 32 if wide else 16
    if kind == "extreme":  # amax/amin accumulate in the input's own type
        return dtype.itemsize
    if dtype.is_complex:
        return 16 if wide else 8
    if not dtype.is_floating_point:
        return dtype.itemsize  # integers accumulate in their output's type (int64 unless a dtype is given)
    return 8 if wide else 4  # float accumulates half, bfloat16 and float


def _layout(shape: Sequence[int], strides: Sequence[int], dims: Sequence[int], in_bytes: int,
            out_bytes: int) -> tuple[list[int], list[int], int]:
    """TensorIterator's reduction layout: the iterator's shape and the input's byte strides (reduced dimensions
    first, then by stride; adjacent ones merged), and how many leading dimensions it reduces."""
    ndim = len(shape)
    reduced = set(dims) if dims else set(range(ndim))
    # the output: contiguous in the kept dimensions, stride 0 where the input is reduced (broadcast)
    out_strides = [0] * ndim
    running = out_bytes
    for dim in reversed(range(ndim)):
        if dim not in reduced:
            out_strides[dim] = running
            running *= shape[dim]
    operands = [out_strides, [stride * in_bytes for stride in strides]]

    def should_swap(dim0: int, dim1: int) -> int:  # TensorIteratorBase::reorder_dimensions
        for index, stride in enumerate(operands):
            stride0, stride1 = stride[dim0], stride[dim1]
            if index == 0 and (stride0 == 0) != (stride1 == 0):
                return 1 if stride1 == 0 else -1  # reduced dimensions to the front
            if stride0 == 0 or stride1 == 0:
                continue
            if stride0 != stride1:
                return -1 if stride0 < stride1 else 1
        return 0

    perm = list(reversed(range(ndim)))
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    sizes = [shape[dim] for dim in perm]
    operands = [[stride[dim] for dim in perm] for stride in operands]
    # TensorIteratorBase::coalesce_dimensions
    previous = 0
    for dim in range(1, len(sizes)):
        if sizes[previous] == 1 or sizes[dim] == 1 or all(
                sizes[previous] * stride[previous] == stride[dim] for stride in operands):
            if sizes[previous] == 1:
                for stride in operands:
                    stride[previous] = stride[dim]
            sizes[previous] *= sizes[dim]
        else:
            previous += 1
            if previous != dim:
                for stride in operands:
                    stride[previous] = stride[dim]
                sizes[previous] = sizes[dim]
    kept = previous + 1 if sizes else 0
    sizes, operands = sizes[:kept], [stride[:kept] for stride in operands]
    return sizes, operands[1], sum(1 for stride in operands[0] if stride == 0)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def staging_bytes(shape: Sequence[int], strides: Sequence[int], dims: Sequence[int], dtype: torch.dtype, op: str,
                  device_label: str, *, out_dtype: torch.dtype | None = None, storage_offset: int = 0) -> tuple[int, int]:
    """The staging buffer and the semaphores (bytes asked for) a CUDA reduction of a tensor of ``shape`` and
    ``strides`` (elements) over ``dims`` (all when empty) takes on the NVIDIA GPU ``device_label`` names: (0, 0)
    where it does not split across blocks. ``op`` names its family: "sum" (sum, mean, nansum, norms), "welford"
    (var, std) or "extreme" (amax, amin). Follows ``setReduceConfig`` in Reduce.cuh (torch 2.11-2.13).

    >>> staging_bytes((8, 128, 512), (65536, 512, 1), (0, 1), torch.float32, "sum", "H100-80GB")  # 512 outputs
    (4194304, 16)
    """
    if op not in _FAMILIES:
        raise ValueError(f"op must be one of {', '.join(_FAMILIES)} (a reduction's family), got {op!r}")
    numel = math.prod(shape)
    if numel == 0:
        return 0, 0
    in_bytes = dtype.itemsize
    sizes, in_strides, reduce_dims = _layout(shape, strides, dims, in_bytes, (out_dtype or dtype).itemsize)
    ndim = len(sizes)
    outputs = math.prod(sizes[reduce_dims:])
    per_output = numel // outputs
    vt0 = _VT0.get(op, 4)
    if ndim > 0:
        on_fastest = reduce_dims == ndim or in_strides[0] < in_strides[reduce_dims]
        if on_fastest:
            dim0, dim1, fastest = per_output, outputs, in_strides[0]
        else:
            dim0, dim1, fastest = outputs, per_output, in_strides[reduce_dims]
    else:
        on_fastest, dim0, dim1, fastest = True, 1, 1, in_bytes
    vec = 1
    if fastest == in_bytes:
        if on_fastest and dim0 >= 128 and reduce_dims == 1:
            dim0 //= vt0  # vectorised along the input
        elif not on_fastest:  # get_output_vec_size: along the outputs, where every stride and the address allow
            vec = 4
            for n in [storage_offset, sizes[reduce_dims]] + [
                    stride // in_bytes for index, stride in enumerate(in_strides) if index != reduce_dims]:
                while n % vec:
                    vec //= 2
            dim0 //= vec
    # ReduceConfig::set_block_dimension (mnt_wrapper: 256 threads for complex double, 512 for the rest)
    most = (256 if dtype == torch.complex128 else _MAX_NUM_THREADS) // vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < most else most
    dim1_pow2 = _last_pow2(dim1) if dim1 < most else most
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, most // width)
    width = min(dim0_pow2, most // height)
    threads = width * height
    step_input = step_output = 1
    block_x_reduce = ndim == 0 or on_fastest
    if block_x_reduce:
        step_input *= width
    else:
        step_output *= width
    values_per_thread = -(-per_output // step_input)
    split_warps = values_per_thread >= min(height * 16, _MAX_VALUES_PER_THREAD)
    if split_warps:
        step_input *= height
    else:
        step_output *= height
    values_per_thread = -(-per_output // step_input)
    grid = -(-(outputs // vec) // step_output)
    target = SM_COUNT[device_label] * (threads_per_sm(device_label) // threads)
    if not (split_warps and values_per_thread >= _MAX_VALUES_PER_THREAD and grid <= target):
        return 0, 0
    ctas = max(min(-(-target // grid), -(-values_per_thread // _MIN_VALUES_PER_THREAD)),
               -(-values_per_thread // _MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    computed = out_dtype if out_dtype is not None else dtype
    if computed in (torch.float16, torch.bfloat16):  # half and bfloat16 outputs accumulate in float
        computed = torch.float32
    staging = _accumulator_bytes(op, dtype if op == "extreme" else computed) * outputs * ctas
    if not block_x_reduce:
        staging *= width * vec
    return staging, 4 * grid


def _stand_in(tensor: Any) -> bool:
    """Whether ``tensor`` stands in for a CUDA one: a fake tensor (an estimate) or a CPU one (a tracked run)."""
    return (isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided
            and (isinstance(tensor, FakeTensor) or tensor.device.type == "cpu"))


def _dims(dim: Any, ndim: int) -> list[int]:
    if dim is None:
        return []
    listed = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % ndim if ndim else 0 for d in listed})


def _input_and_dims(index: int | None) -> Any:
    """How to read (input, dims, None) from a reduction's arguments: its dims at ``index`` (None: all)."""
    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        return args[0], kwargs.get("dim", args[index] if index is not None and len(args) > index else None), None
    return read


def _loss(index: int) -> Any:
    """How to read a loss's arguments: with its reduction (at ``index``) a mean or a sum of the elementwise loss
    (every element of the inputs' broadcast shape: ATen's ``apply_loss_reduction``, or ``mean_out`` into the result),
    else nothing to read."""
    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        if kwargs.get("reduction", args[index] if len(args) > index else 1) == 0:
            return None, None, None
        return args[0], None, torch.broadcast_shapes(args[0].shape, args[1].shape)
    return read


#: the reductions modelled: op overload -> (family, how to read (input, dims, shape reduced) from its arguments)
_OPS: dict[str, tuple[str, Any]] = {
    "sum.default": ("sum", _input_and_dims(None)),
    "sum.dim_IntList": ("sum", _input_and_dims(1)),
    "mean.default": ("sum", _input_and_dims(None)),
    "mean.dim": ("sum", _input_and_dims(1)),
    "nansum.default": ("sum", _input_and_dims(1)),
    "linalg_vector_norm.default": ("sum", _input_and_dims(2)),
    "amax.default": ("extreme", _input_and_dims(1)),
    "amin.default": ("extreme", _input_and_dims(1)),
    "var.correction": ("welford", _input_and_dims(1)),
    "std.correction": ("welford", _input_and_dims(1)),
    "var_mean.correction": ("welford", _input_and_dims(1)),
    "std_mean.correction": ("welford", _input_and_dims(1)),
    # losses whose kernels reduce their elementwise loss inside (one op on fake tensors)
    "mse_loss.default": ("sum", _loss(2)),
    "smooth_l1_loss.default": ("sum", _loss(2)),
    "huber_loss.default": ("sum", _loss(2)),
    "soft_margin_loss.default": ("sum", _loss(2)),
    "binary_cross_entropy.default": ("sum", _loss(3)),
    "binary_cross_entropy_with_logits.default": ("sum", _loss(4)),
}


_RMS_NORM = torch.ops.aten.rms_norm.default
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


class _Unstaged(torch.autograd.Function):
    """A weight broadcast to ``shape`` (a view, no memory), whose gradient is summed back without a staging buffer."""

    @staticmethod
    def forward(ctx: Any, rule: "CudaReductions", weight: torch.Tensor, shape: Any) -> torch.Tensor:
        ctx.rule, ctx.dims = rule, tuple(range(len(shape) - weight.dim()))
        return weight.expand(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.rule._unstaged += 1
        try:
            return None, grad.sum(ctx.dims), None
        finally:
            ctx.rule._unstaged -= 1


class CudaReductions(ScopedKernels):
    """While active, the reductions in ``_OPS`` on fake or CPU tensors take the staging buffer and semaphores CUDA's split
    reductions take (the module's docstring), right after their output, on the GPU ``device_label`` names (an H100
    when it names none or no NVIDIA GPU with a known SM count). ``calls`` counts the reductions that took one."""

    def __init__(self, device_label: str | None = None) -> None:
        super().__init__()
        self.device_label = gpu_or_h100(device_label)
        self.calls = 0
        #: while above 0, reductions take nothing: a kernel of CUDA's own computes them (rms_norm's fused backward)
        self._unstaged = 0

    def register(self, library: torch.library.Library) -> None:
        for name, (family, read) in _OPS.items():
            packet, overload = name.split(".")
            # below autograd's kernel (which still records the node), as the CUDA kernel runs below it
            library.impl(name.removesuffix(".default"), self._kernel(getattr(getattr(torch.ops.aten, packet), overload),
                                                                     family, read), "ADInplaceOrView")
        library.impl("rms_norm", self._rms_norm, "AutogradCPU")

    def _rms_norm(self, input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
        """``rms_norm`` as CUDA runs it where the weight's dtype is the input's: ``_fused_rms_norm``, whose backward
        computes the weight's gradient in its own kernel (layer_norm.cpp). Its composite here sums it through
        autograd (a reduction over every row); that sum takes no staging buffer."""
        if weight is None or weight.dtype != input.dtype or not _stand_in(input) or not (
                torch.is_grad_enabled() and weight.requires_grad):
            return _RMS_NORM._op_dk(_COMPOSITE, input, normalized_shape, weight, eps)  # type: ignore[no-any-return]
        normed = _RMS_NORM._op_dk(_COMPOSITE, input, normalized_shape, None, eps)
        return normed * _Unstaged.apply(self, weight, normed.shape)  # type: ignore[no-any-return]

    def _kernel(self, op: Any, family: str, read: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._AutoDispatchBelowADInplaceOrView():
                out = op(*args, **kwargs)
                source, dim, shape = read(args, kwargs)
                if _stand_in(source):
                    self.stage(source, dim, family, out, shape)
            return out
        return kernel

    def stage(self, source: torch.Tensor, dim: Any, family: str, out: Any, shape: Sequence[int] | None = None) -> None:
        """Take and free the staging buffer and semaphores of reducing ``source`` over ``dim`` into ``out``; with
        ``shape``, every element of a contiguous tensor of that shape in ``source``'s dtype (a loss's own)."""
        first = out[0] if isinstance(out, tuple) else out
        strides: Sequence[int]
        if shape is None:
            shape, strides, offset = source.shape, source.stride(), int(source.storage_offset())
        else:
            strides, offset = make_contiguous_strides_for(tuple(shape)), 0
        if math.prod(shape) * source.element_size() > 2**31 - 1:
            return  # past 32-bit byte offsets CUDA splits it into parts, each its own launch: not modelled
        staging, semaphores = staging_bytes(shape, strides, _dims(dim, len(shape)), source.dtype, family,
                                            self.device_label, out_dtype=first.dtype, storage_offset=offset)
        if staging and not self._unstaged:
            self.calls += 1
            held = [source.new_empty(staging, dtype=torch.uint8), source.new_empty(semaphores, dtype=torch.uint8)]
            del held[1], held[0]  # the semaphores go first, as the kernel's DataPtrs do

    def notes(self, steps: int = 1) -> list[str]:
        """What the estimate assumed about reductions in each of ``steps`` steps."""
        if not self.calls:
            return []
        per_step = self.calls // steps
        return [f"CUDA reductions: {per_step} reduction{'s' if per_step != 1 else ''} per step (a bias's or a norm "
                f"weight's gradient, for one) took the staging buffer a reduction split across thread blocks takes, "
                f"sized by PyTorch's launch rule (Reduce.cuh) for the {self.device_label}'s "
                f"{SM_COUNT[self.device_label]} SMs"]
