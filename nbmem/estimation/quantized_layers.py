"""One linear layer made a bitsandbytes layer, its weight quantized by bitsandbytes' own functions.

:func:`quantized_layer` is what transformers' loader does to each layer it
quantizes (``replace_with_bnb_linear``, then ``Bnb4bitQuantize`` /
``Bnb8bitQuantize`` on the loaded weight), on the weight nbmem's copy of the
model already holds: fake in an estimate, real in a tracked run. The new
layer's shell is made on "meta" outside every dispatch mode (bitsandbytes'
parameter classes can't wrap a fake tensor); its weight is then the
quantized tensor, and its bias the old layer's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .libraries import library_module

__all__ = ["quantized_layer", "follow_cuda"]


def quantized_layer(module: nn.Module, quantization: Any) -> nn.Module:
    """The bitsandbytes layer that replaces ``module`` (an ``nn.Linear``, or transformers' ``Conv1D``).

    ``quantization`` is a :class:`nbmem.estimation.quantization.Quantization` (read for its settings only: that
    module imports this one).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    bnb = _bitsandbytes()
    original: torch.Tensor = module.weight  # type: ignore[assignment]  # an nn.Linear's or a Conv1D's
    weight = original.detach()
    if type(module).__name__ == "Conv1D":
        weight = weight.t()  # Conv1D keeps (in, out): bitsandbytes quantizes (out, in), as transformers does
    out_features, in_features = weight.shape
    bias = module.bias
    with _disable_current_modes(), torch.device("meta"):
        if quantization.method == "int8":
            new: Any = bnb.nn.Linear8bitLt(in_features, out_features, bias is not None, has_fp16_weights=False,
                                                 threshold=0.0)
        else:
            new = bnb.nn.Linear4bit(in_features, out_features, bias is not None, quantization.compute_dtype,
                                    compress_statistics=quantization.double_quant, quant_type=quantization.method,
                                    quant_storage=quantization.quant_storage)
    new.source_cls = type(module)  # as transformers records it
    new.weight = _int8_weight(weight) if quantization.method == "int8" else _4bit_weight(weight, new, quantization)
    if bias is not None:
        new.bias = bias
        bias.requires_grad_(False)  # transformers freezes the quantized layer whole
    new.train(module.training)
    layer: nn.Module = new
    follow_cuda(layer)
    return layer


def follow_cuda(model: nn.Module) -> None:
    """Make bitsandbytes' 4-bit layers in ``model`` take CUDA's path, also on CPU tensors (fake or real).

    On a CPU bitsandbytes repacks a 4-bit weight for AVX-512 in eval mode; the
    step nbmem runs stands for a GPU's, so that is not done. (The int8 layers'
    path is nbmem.estimation.quantized_kernels'.)
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)


def _fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _bitsandbytes() -> Any:
    """bitsandbytes, untyped: its classes are read and built as transformers does, not checked here."""
    return library_module("bitsandbytes")


def _4bit_weight(weight: torch.Tensor, layer: Any, quantization: Any) -> torch.Tensor:
    bnb = _bitsandbytes()

    # bitsandbytes' Params4bit._quantize, on the weight as loaded
    packed, state = bnb.functional.quantize_4bit(
        weight.contiguous(), blocksize=quantization.blocksize, compress_statistics=quantization.double_quant,
        quant_type=quantization.method, quant_storage=quantization.quant_storage,
    )
    attributes: dict[str, Any] = dict(blocksize=quantization.blocksize, compress_statistics=quantization.double_quant,
                                      quant_type=quantization.method, quant_storage=quantization.quant_storage)
    layer.quant_state = state  # Params4bit._quantize sets it on its module too
    if _fake(packed):
        parameter = nn.Parameter(packed, requires_grad=False)
        for name, value in dict(attributes, quant_state=state, bnb_quantized=True, module=layer).items():
            setattr(parameter, name, value)
        return parameter
    quantized: torch.Tensor = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, module=layer,
                                                bnb_quantized=True, **attributes)
    return quantized


def _int8_weight(weight: torch.Tensor) -> torch.Tensor:
    bnb = _bitsandbytes()

    # bitsandbytes' Int8Params._quantize: row-wise int8 of the fp16 weight, and its fp32 scales
    rows, scales, _ = bnb.functional.int8_vectorwise_quant(weight.contiguous().to(torch.float16))
    if _fake(rows):
        parameter = nn.Parameter(rows, requires_grad=False)
        for name, value in (("CB", rows), ("SCB", scales), ("has_fp16_weights", False)):
            setattr(parameter, name, value)
        return parameter
    quantized: torch.Tensor = bnb.nn.Int8Params(rows, requires_grad=False, has_fp16_weights=False, CB=rows, SCB=scales)
    return quantized
