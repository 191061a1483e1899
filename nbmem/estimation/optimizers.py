"""How an estimate builds the optimizer it names, and with which implementation (foreach, fused) the GPU would run it."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .plan import OPTIMIZERS

__all__ = ["optimizer_factory", "target_optimizer_kwargs"]


def optimizer_factory(optimizer: str | Callable[..., torch.optim.Optimizer] | None) -> Callable[..., Any]:
    """How nbmem builds the optimizer: by name, the user's factory, or (None: the user's step brings its own) none."""
    if optimizer is None:
        return lambda parameters, **kwargs: None
    return OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer


def target_optimizer_kwargs(optimizer: Any, foreach: bool | None, mode: str, notes: list[str]) -> dict[str, Any]:
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
