"""CUDA's autocast rules, applied to CPU tensors: how an estimate made here follows a GPU's mixed precision.

CPU and CUDA autocast keep different op lists (aten/src/ATen/autocast_mode.cpp
and autocast_mode.h, torch 2.13): CUDA runs layer norm, softmax, ``exp``,
``sum`` and most losses in float32 and casts matmuls, convolutions and RNN
cells to the low precision; CPU autocast keeps layer norm in the input's dtype
and has lists of its own (FFTs, pooling, ``cat``). Which ops run in which dtype
decides what autograd saves, so an estimate of a CUDA step must follow CUDA's.

:class:`CudaAutocastPolicy` does that at the place autocast itself works: the
``AutocastCPU`` dispatch key, above autograd. While it is active it registers,
with ``torch.library``, a kernel for every op whose CUDA policy differs from
the CPU's (and a fallthrough for every op CPU autocast lists and CUDA does
not); the casts it makes are recorded by autograd, exactly as CUDA's are, and
composite ops (``cross_entropy``) decompose into listed ops as on CUDA. Ops
both devices cast to the low precision keep PyTorch's own C++ kernel, and with
it PyTorch's weight-cast cache. Leaving the context removes every
registration. The policy only acts while CPU autocast is on, so a step enters
``torch.autocast("cpu", dtype=...)`` through :meth:`CudaAutocastPolicy.region`.

>>> policy = CudaAutocastPolicy()
>>> layer_norm = nn.LayerNorm(8)
>>> x = torch.randn(2, 8, dtype=torch.float16)
>>> with policy, policy.region("cpu", dtype=torch.float16):
...     layer_norm(x).dtype             # CUDA runs layer norm in float32
torch.float32
>>> with torch.autocast("cpu", dtype=torch.float16):
...     layer_norm(x).dtype             # CPU autocast keeps the input's float16
torch.float16
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn  # noqa: F401  (the doctest's namespace)

from .kernels import ScopedKernels

__all__ = ["CUDA_POLICY", "CPU_LOWER_PRECISION", "CudaAutocastPolicy", "AUTOCAST_POLICIES"]

#: How the estimate's autocast chooses dtypes: CUDA's op lists (the default), or CPU autocast's own.
AUTOCAST_POLICIES = ("cuda", "cpu")

_LOWER = "lower_precision_fp"
_FP32 = "fp32"
_SET_OPT_DTYPE = "fp32_set_opt_dtype"
_APPEND_DTYPE = "fp32_append_dtype"
_PROMOTE = "promote"
_BANNED = "banned"

#: CUDA autocast's policy for each op (name.overload) it registers, from
#: aten/src/ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
#: AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE,
#: AT_FORALL_PROMOTE) and autocast_mode.cpp (cudnn_convolution*, the banned
#: binary_cross_entropy). tests/test_autocast_policy.py checks that this is
#: exactly the set the installed torch registers under ``AutocastCUDA``
#: (rms_norm is in 2.13's list, not in older headers).
CUDA_POLICY: dict[str, str] = {
    **dict.fromkeys(
        [
            "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
            "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
            "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
            "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
            "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
            "cudnn_convolution", "cudnn_convolution_transpose",
        ],
        _LOWER,
    ),
    **dict.fromkeys(
        [
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
            "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
            "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
            "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
            "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
            "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
            "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
            "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
            "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
            "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
        ],
        _FP32,
    ),
    **dict.fromkeys(
        [
            "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
            "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
        ],
        _SET_OPT_DTYPE,
    ),
    "norm.Scalar": _APPEND_DTYPE,
    "norm.ScalarOpt_dim": _APPEND_DTYPE,
    **dict.fromkeys(
        ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
         "scatter_add"],
        _PROMOTE,
    ),
    "binary_cross_entropy": _BANNED,
}

#: The ops CPU autocast casts to the low precision (autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU)).
#: Where CUDA does the same, PyTorch's own C++ kernel stays: its weight-cast cache is CUDA's.
CPU_LOWER_PRECISION = frozenset(
    {
        "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
        "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated",
        "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input",
        "conv_transpose3d.input", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
    }
)

# CUDA's error for the banned op, word for word (autocast_mode.cpp, binary_cross_entropy_banned).
_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def registered_ops(dispatch_key: str) -> set[str]:
    """The aten ops (``name.overload``, ``name`` for the default) with a kernel of their own under ``dispatch_key``."""
    return {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)
    }


@functools.cache
def _registrations() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """What a policy registers for AutocastCPU: (op, CUDA's policy) to replace, and the ops to fall through.

    Worked out once per process (about 20 ms, a third of what entering a
    policy cost: asking the dispatcher about each of its 3,600 ops), before
    any policy is active. Replaced: CUDA's list, less the ops that CPU autocast
    already lowers the same way, CUDA-only kernels and ops this torch lacks (an
    older torch may lack an op of 2.13's lists: it can't be called there
    either). Fallen through (no autocast, as on CUDA): every other aten op
    with a CPU autocast kernel when this first ran.
    """
    existing = {name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()}
    replaced = tuple(
        (name, policy) for name, policy in CUDA_POLICY.items()
        if not (policy == _LOWER and name in CPU_LOWER_PRECISION) and name in existing and not name.startswith("cudnn_")
    )
    return replaced, tuple(sorted(registered_ops("AutocastCPU") - CUDA_POLICY.keys()))


class CudaAutocastPolicy(ScopedKernels):
    """While active, CPU autocast follows CUDA's op lists (a context manager; see the module's docstring).

    ``region(device_type, dtype=...)`` is the autocast region of a step: it
    enters ``torch.autocast`` and, on leaving, drops the casts cached for the
    ops this policy casts itself (PyTorch clears its own cache there too).
    Those ops (RNN cells, einsum, mv, addmv, addr) cast a weight once per
    region, as CUDA does. Activation checkpointing recomputes a block under an
    autocast of its own, outside any region: there they cast a weight at each
    use (CUDA would cache it for the block), rather than keep casts alive past
    the block.
    """

    def __init__(self) -> None:
        super().__init__()
        # the casts of leaf weights, CUDA's cached_cast: id -> (weak reference to the source, the cast)
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._regions = 0  # how many regions are open: casts are cached only inside one

    def __enter__(self) -> CudaAutocastPolicy:
        entered: CudaAutocastPolicy = super().__enter__()
        return entered

    def register(self, library: torch.library.Library) -> None:
        replaced, passed = _registrations()
        for name, policy in replaced:
            library.impl(name, self._kernel(name, policy), "AutocastCPU")
        for name in passed:
            library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")

    def _undo(self) -> None:
        self._cache.clear()
        super()._undo()

    @contextlib.contextmanager
    def region(self, device_type: str, dtype: torch.dtype) -> Iterator[None]:
        """``torch.autocast(device_type, dtype=dtype)``; this policy's weight casts are dropped on leaving it."""
        self._regions += 1
        try:
            with torch.autocast(device_type, dtype=dtype):
                yield
        finally:
            self._regions -= 1
            if not self._regions:
                self._cache.clear()

    def _kernel(self, name: str, policy: str) -> Callable[..., Any]:
        op_name, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, op_name)
        op = getattr(packet, overload or "default")
        cast = self._cached_cast
        excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

        def lower_precision_fp(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                lower = torch.get_autocast_dtype("cpu")
                return op(*cast(lower, args), **cast(lower, kwargs))

        def fp32(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return op(*cast(torch.float32, args), **cast(torch.float32, kwargs))

        dtype_index = next((i for i, arg in enumerate(op._schema.arguments) if arg.name == "dtype"), -1)

        def fp32_set_opt_dtype(*args: Any, **kwargs: Any) -> Any:
            # no input cast: the op itself computes in float32 when given dtype=float32 (autocast_mode.h)
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                if _eligible(args[0]) and kwargs.get("dtype") is None:
                    if len(args) > dtype_index:
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)

        # norm's overloads without a dtype redispatch to the ones with it (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE)
        with_dtype = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype"}.get(overload, "")

        def fp32_append_dtype(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                out_type = torch.float32 if _eligible(args[0]) else args[0].dtype
                return getattr(packet, with_dtype)(*args, **kwargs, dtype=out_type)

        def promote(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                to_type = _promote_type(torch.get_autocast_dtype("cpu"), [*args, *kwargs.values()])
                return op(*cast(to_type, args), **cast(to_type, kwargs))

        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(_BANNED_MESSAGE)

        kernels = {_LOWER: lower_precision_fp, _FP32: fp32, _SET_OPT_DTYPE: fp32_set_opt_dtype,
                   _APPEND_DTYPE: fp32_append_dtype, _PROMOTE: promote, _BANNED: banned}
        return kernels[policy]

    def _cached_cast(self, dtype: torch.dtype, value: Any) -> Any:
        """CUDA's cached_cast (autocast_mode.cpp), over an argument, a list of them, or a dict of keyword arguments."""
        if isinstance(value, dict):
            return {key: self._cached_cast(dtype, item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._cached_cast(dtype, item) for item in value)
        if not (_eligible(value) and value.dtype != dtype):
            return value
        # Apex's heuristic, as CUDA does it: cache low-precision casts of fp32 leaf weights, once per region
        if (
            self._regions and dtype == torch.get_autocast_dtype("cpu") and value.dtype == torch.float32
            and value.requires_grad and value.is_leaf and not value._is_view()
        ):
            hit = self._cache.get(id(value))
            if hit is not None and hit[0]() is value:
                return hit[1]
            casted = value.to(dtype)
            self._cache[id(value)] = (weakref.ref(value), casted)
            return casted
        return value.to(dtype)


def _eligible(value: Any) -> bool:
    """autocast_mode.h's is_eligible for a CPU tensor: defined, on the CPU, floating point, not double."""
    return (
        isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_floating_point()
        and value.dtype != torch.float64
    )


def _promote_type(lower: torch.dtype, arguments: list[Any]) -> torch.dtype:
    """The widest floating type among the arguments: float32 wins over the low precision (autocast_mode.h's prioritize)."""
    current = lower
    for value in arguments:
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if not _eligible(tensor):
                continue
            if current == torch.float32 or tensor.dtype == torch.float32:
                current = torch.float32
            elif not (current == lower and tensor.dtype == lower):
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current
