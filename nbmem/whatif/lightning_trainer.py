"""Start from a Lightning ``Trainer`` and ``LightningModule``: the trainer's precision, accumulation and strategy,
the module's own ``training_step`` and ``configure_optimizers``.

:func:`estimate_lightning` estimates the step Lightning would run: each
micro-batch through the module's ``training_step`` (its loss, or the dict's
``"loss"``) and ``backward()``, then the optimizer ``configure_optimizers``
gives steps and zeroes. Lightning keeps the batch size in the data loader, so
``batch_size=`` is needed. Settings nbmem does not estimate (FSDP, DeepSpeed,
64-bit precision, a module with several optimizers) are named, never ignored,
as in :func:`nbmem.estimate_trainer`. lightning stays optional: nothing here
imports it.

Example (with lightning installed)::

    trainer = lightning.Trainer(precision="bf16-mixed", accumulate_grad_batches=4)
    print(nbmem.estimate_lightning(trainer, MyModule, make_batch, batch_size=8, device="A10G"))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..estimation.estimate import Estimate, estimate
from .training_arguments import TrainingKnobs, refuse_unestimated, with_reading

__all__ = ["estimate_lightning", "knobs_from_lightning", "lightning_step"]

#: Lightning's precision names and nbmem's.
PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-true": "bf16-weights",
             "16-true": "fp16-weights"}


#: Lightning's precision plugins that stand for a precision string (and say it in their ``precision``).
_PLUGINS = ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision", "FSDPPrecision", "DeepSpeedPrecision")


def knobs_from_lightning(trainer: Any, world_size: int | None = None) -> TrainingKnobs:
    """What a Lightning ``Trainer`` or ``Fabric`` says, as estimate knobs (its batch size lives elsewhere: pass it)."""
    read: list[str] = []
    unknown: list[str] = []
    knobs: dict[str, Any] = {}
    strategy_object = getattr(trainer, "strategy", None)
    fabric = type(trainer).__name__ == "Fabric" or not hasattr(trainer, "accumulate_grad_batches")
    # a Trainer's plugin is strategy.precision_plugin, a Fabric's strategy.precision
    plugin = getattr(strategy_object, "precision_plugin", None) or getattr(strategy_object, "precision", None)
    if strategy_object is None or plugin is None:
        raise TypeError(f"estimate_lightning reads a lightning Trainer or Fabric, not {type(trainer).__name__}: "
                        "pass the Trainer(...) or Fabric(...) your run uses")
    precision = str(getattr(plugin, "precision", None) if fabric else getattr(trainer, "precision", "32-true"))
    if type(plugin).__name__ not in _PLUGINS:  # bitsandbytes', Transformer Engine's: layers of their own
        unknown.append(f"precision plugin {type(plugin).__name__} (its layers are not estimated; quantization= "
                       "estimates bitsandbytes' for nbmem.estimate)")
    elif precision in PRECISION:
        knobs["precision"] = PRECISION[precision]
        read.append(f"precision={precision!r}: {knobs['precision']!r}")
    else:
        unknown.append(f"precision={precision!r} (nbmem estimates {', '.join(PRECISION)})")
    accumulation = 1 if fabric else int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    if accumulation > 1:
        read.append(f"accumulate_grad_batches={accumulation}: that many micro-batches per optimizer step")
    strategy = type(strategy_object).__name__
    size = world_size if world_size is not None else int(getattr(trainer, "world_size", 1) or 1)
    if strategy == "DDPStrategy" and size > 1:
        knobs["parallel"], knobs["world_size"] = "ddp", size
        read.append(f"DDPStrategy on {size} processes: parallel='ddp'")
    elif strategy not in ("SingleDeviceStrategy", "DDPStrategy"):
        unknown.append(f"strategy {strategy} (nbmem estimates single-device and DDP Lightning runs; "
                       "nbmem.estimate(parallel='fsdp', ...) with your own step for FSDP)")
    elif size > 1:
        unknown.append(f"world_size={size} with {strategy} (one process: give the trainer strategy='ddp' and its "
                       "devices, or leave world_size out)")
    if getattr(trainer, "gradient_clip_val", None):
        read.append("gradient_clip_val: clipping's norms, a few scalars, are not counted")
    return TrainingKnobs({**knobs, "accumulation": accumulation}, tuple(read), tuple(unknown))


def _optimizer_of(module: torch.nn.Module) -> torch.optim.Optimizer:
    """The one optimizer ``configure_optimizers`` gives (an optimizer, a list, a tuple, a dict); kept on the module."""
    found: Any = module.__dict__.get("_nbmem_optimizer")
    if found is not None:
        return found  # type: ignore[no-any-return]
    given: Any = module.configure_optimizers()  # type: ignore[operator]
    if isinstance(given, dict):
        given = given["optimizer"]
    several = ValueError("this module's configure_optimizers gives several optimizers (Lightning runs them only with "
                         "manual optimization): estimate it with nbmem.estimate(..., step=your_step), which builds "
                         "them as your loop does")
    if isinstance(given, (list, tuple)):
        if len(given) > 1 and not isinstance(given[0], (list, tuple)):  # [optimizer, optimizer], not ([...], [...])
            raise several
        given = given[0] if given else None
        if isinstance(given, (list, tuple)):  # ([optimizers], [schedulers])
            if len(given) != 1:
                raise several
            given = given[0]
        if isinstance(given, dict):
            given = given["optimizer"]
    if given is None or not hasattr(given, "step"):
        raise ValueError(f"this module's configure_optimizers gives {type(given).__name__}, no optimizer to step: "
                         "estimate it with nbmem.estimate(..., step=your_step)")
    if isinstance(given, torch.optim.Optimizer) and type(given).__module__.startswith("torch.optim."):
        for group in given.param_groups:  # CUDA's default where neither is set; fake CPU tensors would loop
            if group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable"):
                group["foreach"] = True
    module.__dict__["_nbmem_optimizer"] = given
    return given  # type: ignore[no-any-return]


def lightning_step(batch_fn: Callable[[int], Any], batch_size: int, accumulation: int) -> Callable[..., None]:
    """The step Lightning's automatic optimization runs, for :func:`nbmem.estimate`'s ``step=``.

    As lightning/pytorch/loops/optimization/automatic.py orders it: for each
    micro-batch, ``training_step``, then (on the first of an accumulation
    cycle) ``zero_grad()`` between the loss and ``backward()``, so the last
    step's gradients live through the forward; after the last micro-batch,
    ``optimizer.step()``. The loop holds each batch until its step is done.
    """

    def step(model: torch.nn.Module, batch: Any, optimizer: Any) -> None:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module  # DDP's reducer hooks on the parameters still fire in backward
        if getattr(model, "automatic_optimization", True) is False:
            raise ValueError("this module optimizes manually (automatic_optimization = False): estimate it with "
                             "nbmem.estimate(..., step=your_step), which runs your loop as written")
        optimizer = _optimizer_of(model)
        for index in range(accumulation):
            micro_batch = batch if index == 0 else batch_fn(batch_size)
            loss = model.training_step(micro_batch, index)  # type: ignore[operator]
            loss = loss["loss"] if isinstance(loss, dict) else loss
            if index == 0:
                optimizer.zero_grad(set_to_none=True)
            (loss / accumulation if accumulation > 1 else loss).backward()
            del loss
        optimizer.step()

    step.__name__ = "lightning_training_step"
    return step


def estimate_lightning(trainer: Any, module: Any, batch: Callable[[int], Any], *, batch_size: int,
                       strict: bool = True, world_size: int | None = None, **knobs: Any) -> Estimate:
    """Estimate the step a Lightning ``Trainer`` would run for ``module`` (a LightningModule or a function making one).

    ``batch`` makes a batch of a given size, as ``training_step`` receives it.
    Settings nbmem does not estimate raise ValueError naming them
    (``strict=False`` lists them in the notes instead); other keywords are
    :func:`nbmem.estimate` knobs (``device="T4"``).

    Example (with lightning installed)::

        trainer = lightning.Trainer(precision="bf16-mixed", accumulate_grad_batches=4)
        print(nbmem.estimate_lightning(trainer, MyModule, make_batch, batch_size=8, device="A10G"))
    """
    read = knobs_from_lightning(trainer, world_size)
    if strict:
        refuse_unestimated("Lightning", read.not_understood, "Pass strict=False to estimate without them")
    settings = dict(read.knobs)
    accumulation = settings.pop("accumulation")
    step = lightning_step(batch, batch_size, accumulation)
    result = estimate(module, batch, batch_size=batch_size, optimizer=None, step=step, **{**settings, **knobs})
    # the step ran Lightning's micro-batches itself: the result says how many, as an estimate with accumulation= does
    result = dataclasses.replace(result, accumulation=accumulation)
    return with_reading(result, "the Lightning trainer", read.read, read.not_understood,
                        "the step: the module's training_step per micro-batch, zero_grad() before the first backward(), "
                        "then its optimizer's step() (a torch.optim one with foreach, as CUDA defaults), as "
                        "Lightning's automatic optimization runs them")
