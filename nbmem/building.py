"""Nbmem's own copy of the user's model, ready for a step: built under fake tensors or copied,
with the precision and activation checkpointing asked for.

Used by :mod:`nbmem.estimation`; nothing here runs a step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import torch
from torch import nn

from .fakemode import new_fake_mode

__all__ = ["fresh_model", "repeated_blocks", "apply_precision_and_checkpointing", "new_fake_mode", "FAKE_ERRORS",
           "without_onednn", "default_device"]


@contextlib.contextmanager
def without_onednn() -> Any:
    """oneDNN off, and back as it was (mkldnn.flags() also resets TF32 and warns each time)."""
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a ContextProp in torch's stubs
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


def _fake_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses import fake_tensor

    return (
        fake_tensor.DataDependentOutputException,
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.UnsupportedOperatorException,
    )


FAKE_ERRORS = _fake_errors()


def fresh_model(model: Any, fake_mode: Any, device: torch.device) -> nn.Module:
    """A model of nbmem's own on ``device``: built by the factory, or copied (as fake tensors when estimating)."""
    if isinstance(model, nn.Module):
        if fake_mode is None:
            return copy.deepcopy(model).to(device)
        # Copy the module's structure, with every parameter and buffer replaced
        # by a fake tensor of the same shape: the memo makes deepcopy use them.
        memo: dict[int, Any] = {}
        for parameter in model.parameters():
            memo[id(parameter)] = nn.Parameter(fake_mode.from_tensor(parameter), requires_grad=parameter.requires_grad)
        for buffer in model.buffers():
            memo[id(buffer)] = fake_mode.from_tensor(buffer)
        return copy.deepcopy(model, memo)
    if callable(model):
        copies = _FakeDeepcopy() if fake_mode is not None else contextlib.nullcontext()
        with copies, default_device(device):
            built = model()
        if not isinstance(built, nn.Module):
            raise ValueError(f"the model factory must return a torch.nn.Module, got {type(built).__name__}")
        return built.to(device) if device.type == "cuda" else built
    raise ValueError(f"model must be a torch.nn.Module or a function that builds one, got {type(model).__name__}")


class _FakeDeepcopy(torch.overrides.TorchFunctionMode):
    """Deep copies of fake tensors while a model is built, in the same fake mode.

    Models clone their blocks with ``copy.deepcopy`` (``nn.TransformerEncoder``
    does); a fake tensor's own deepcopy lands in a new FakeTensorMode, which
    then can't mix with the rest. A copy is a fresh tensor of the same shape
    and dtype in the current mode: distinct storage, as a real copy has.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.Tensor.__deepcopy__:
            from torch._subclasses.fake_tensor import FakeTensor

            tensor, memo = args
            if isinstance(tensor, FakeTensor) or isinstance(getattr(tensor, "data", None), FakeTensor):
                if id(tensor) in memo:
                    return memo[id(tensor)]
                copied = torch.empty_like(tensor.data if isinstance(tensor, nn.Parameter) else tensor)
                if isinstance(tensor, nn.Parameter):
                    copied = nn.Parameter(copied, requires_grad=tensor.requires_grad)
                else:
                    copied.requires_grad_(tensor.requires_grad)
                memo[id(tensor)] = copied
                return copied
        return func(*args, **(kwargs or {}))


def repeated_blocks(model: nn.Module) -> type[nn.Module] | None:
    """The block type to checkpoint: the outermost module type with parameters that repeats.

    >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64), 3, enable_nested_tensor=False)
    >>> repeated_blocks(encoder).__name__
    'TransformerEncoderLayer'
    """
    depths: dict[type, list[int]] = {}
    for name, module in model.named_modules():
        if name and any(True for _ in module.children()) and any(True for _ in module.parameters()):
            depths.setdefault(type(module), []).append(name.count("."))
    repeated = [(min(levels), kind) for kind, levels in depths.items() if len(levels) >= 2]
    return min(repeated, key=lambda item: item[0])[1] if repeated else None


def apply_precision_and_checkpointing(model: nn.Module, precision: str, checkpointing: Any, notes: list[str]) -> str:
    if precision.endswith("-weights"):
        # module.to() swaps fake tensors in place, which FakeTensorMode's own weak
        # references forbid: give nbmem's copy new parameters of the new dtype.
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        for module in model.modules():
            for name, parameter in module._parameters.items():
                if parameter is not None and parameter.is_floating_point():
                    module._parameters[name] = nn.Parameter(parameter.detach().to(dtype), parameter.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.to(dtype)
    if not checkpointing:
        return "off"
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if callable(checkpointing):
        check, chosen = checkpointing, "on (your predicate)"
    else:
        block = repeated_blocks(model)
        if block is None:
            notes.append("checkpointing: no repeated block with parameters found; pass checkpointing=<predicate>")
            return "off (no repeated block)"
        check, chosen = (lambda module: isinstance(module, block)), f"on ({block.__name__})"
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=check)
    return chosen


def default_device(device: torch.device) -> Any:
    """Factories called inside build on ``device`` (a CUDA run builds the model and batch there directly)."""
    return device if device.type == "cuda" else contextlib.nullcontext()
