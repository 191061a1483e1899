"""How an estimate builds the optimizer it names, and with which implementation (foreach, fused) the GPU would run it."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from .low_bit import LOW_BIT, TORCHAO_OPTIM, low_bit_factory, torchao_note
from .libraries import library_module

__all__ = ["OPTIMIZERS", "HF_OPTIM", "known_optimizer", "library_optimizer", "optimizer_names", "optimizer_factory",
           "target_optimizer_kwargs", "OptimizerInBackward", "in_backward"]

#: Optimizer names and how nbmem builds them (learning rates don't change memory).
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.01),
    "sgd-momentum": functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    # one kernel per parameter group, updating in place: no foreach temporaries (Hugging Face's adamw_torch_fused)
    "adam-fused": functools.partial(torch.optim.Adam, fused=True),
    "adamw-fused": functools.partial(torch.optim.AdamW, fused=True),
}


def adafactor(parameters: Any, **options: Any) -> Any:
    """transformers' Adafactor with the Trainer's own settings for ``optim="adafactor"``."""
    # imported outside the estimate's modes: a first import there (transformers.optimization imports peft's layers,
    # whose default arguments are tensors) counted its module-level tensors as the step's memory, 1,024 B (seen)
    Adafactor = library_module("transformers.optimization").Adafactor

    # transformers' trainer_optimizer.py: scale_parameter=False, relative_step=False, and a learning rate
    return Adafactor(parameters, scale_parameter=False, relative_step=False, lr=1e-3, **options)


#: Hugging Face's ``TrainingArguments.optim`` names beyond bitsandbytes' (nbmem.estimation.low_bit.LOW_BIT):
#: torch's optimizers by nbmem's name for them, and transformers' Adafactor.
HF_OPTIM: dict[str, str | Callable[..., Any]] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "sgd": "sgd",
    "adagrad": "adagrad",
    "rmsprop": "rmsprop",
    "adafactor": adafactor,
}


def known_optimizer(name: str) -> bool:
    """Whether ``optimizer=name`` is one nbmem builds."""
    return name in OPTIMIZERS or name in HF_OPTIM or name in LOW_BIT or name in TORCHAO_OPTIM


def library_optimizer(name: str) -> bool:
    """Whether ``optimizer=name`` is built by a library of its own: bitsandbytes, torchao, transformers (Adafactor)."""
    return name in LOW_BIT or name in TORCHAO_OPTIM or not isinstance(_canonical(name), str)


def optimizer_names() -> str:
    """Every name ``optimizer=`` takes, for an error message."""
    return (f"{', '.join(OPTIMIZERS)}; Hugging Face's optim names {', '.join(n for n in HF_OPTIM if n not in OPTIMIZERS)}"
            f", bitsandbytes' {', '.join(LOW_BIT)}, and torchao's {', '.join(TORCHAO_OPTIM)}")


def _canonical(name: str) -> str | Callable[..., Any]:
    return HF_OPTIM.get(name, name)


def optimizer_factory(optimizer: str | Callable[..., torch.optim.Optimizer] | None) -> Callable[..., Any]:
    """How nbmem builds the optimizer: by name, the user's factory, or (None: the user's step brings its own) none."""
    if optimizer is None:
        return lambda parameters, **kwargs: None
    if not isinstance(optimizer, str):
        return optimizer
    if optimizer in LOW_BIT or optimizer in TORCHAO_OPTIM:
        return low_bit_factory(optimizer)
    named = _canonical(optimizer)
    return OPTIMIZERS[named] if isinstance(named, str) else named


def target_optimizer_kwargs(optimizer: Any, foreach: bool | None, mode: str, notes: list[str], *,
                            planned: bool = False) -> dict[str, Any]:
    """The optimizer's implementation on the GPU the estimate is for, named in ``notes``.

    On CUDA, torch.optim's built-in optimizers default to the foreach
    implementation when neither ``foreach`` nor ``fused`` is given: all
    parameters are plain tensors, parameters or DTensors on a foreach device,
    and "cpu" is not one (torch/optim/optimizer.py _default_to_fused_or_foreach;
    fused is never the default). Foreach holds temporaries for a whole
    parameter group at once (Adam's sqrt of the second moments), so on fake CPU
    tensors, which default to the per-tensor loop, nbmem asks for it. CPU's
    foreach ops loop per tensor (foreach_tensor_*_slow) but allocate the same
    list of outputs as CUDA's fast path, so the peak is CUDA's.
    """
    if foreach is not None:
        notes.append(f"optimizer: foreach={foreach}, as asked")
        return {"foreach": foreach}
    if optimizer is None:  # the user's step builds its own
        return {}
    if not isinstance(optimizer, str):
        notes.append("optimizer: your factory's own defaults (built-in optimizers default to foreach on CUDA)")
        return {}
    if optimizer in TORCHAO_OPTIM:
        notes.append(torchao_note(optimizer, planned))
        return {}
    if optimizer in LOW_BIT or not isinstance(_canonical(optimizer), str):
        return {}  # bitsandbytes' (nbmem.estimation.low_bit says which) and Adafactor: one implementation each
    optimizer = str(_canonical(optimizer))
    if optimizer.endswith("-fused"):
        notes.append(f"optimizer: {optimizer.removesuffix('-fused')} with fused=True: one kernel per parameter group, "
                     "updating in place, no temporaries (as the meta kernels say; untested on CUDA)")
        return {}
    if mode == "measured":
        notes.append(f"optimizer: {optimizer} with CUDA's default, the foreach implementation")
        return {}
    notes.append(
        f"optimizer: {optimizer} with the foreach implementation, CUDA's default (on a CPU PyTorch would loop "
        "tensor by tensor); pass foreach=False for the per-tensor loop"
    )
    return {"foreach": True}


class OptimizerInBackward:
    """The optimizer step fused into backward: one optimizer per parameter, stepped by its post-accumulate-grad hook.

    PyTorch's recipe ("How to save memory by fusing the optimizer step into
    the backward pass"): as soon as a parameter's gradient is complete, its
    own optimizer steps and the gradient is freed, so the gradients never all
    live at once. The training loop's ``step()`` and ``zero_grad()`` then have
    nothing left to do. ``state`` gathers the per-parameter optimizers' state.
    """

    def __init__(self, parameters: Any, factory: Callable[..., Any], **options: Any) -> None:
        self.optimizers: dict[torch.Tensor, Any] = {}
        self._handles = []
        # the hooks hold this object weakly: parameter -> hook -> self -> parameter would be a cycle, which keeps
        # the model alive until the garbage collector runs (nbmem never runs it: that would change what it measures)
        hook = functools.partial(_step_in_backward, weakref.ref(self))
        for parameter in parameters:
            if parameter.requires_grad and parameter not in self.optimizers:
                self.optimizers[parameter] = factory([parameter], **options)
                self._handles.append(parameter.register_post_accumulate_grad_hook(hook))

    def _step(self, parameter: torch.Tensor) -> None:
        optimizer = self.optimizers[parameter]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {parameter: optimizer.state[parameter] for parameter, optimizer in self.optimizers.items()
                if parameter in optimizer.state}

    def step(self) -> None:
        """Nothing: each parameter stepped in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each gradient was freed in backward."""

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _step_in_backward(owner: weakref.ref[OptimizerInBackward], parameter: torch.Tensor) -> None:
    stepping = owner()
    if stepping is not None:
        stepping._step(parameter)


def in_backward(factory: Callable[..., Any]) -> Callable[..., OptimizerInBackward]:
    """``factory``, made to step each parameter inside backward (:class:`OptimizerInBackward`)."""
    return lambda parameters, **options: OptimizerInBackward(parameters, factory, **options)
