"""How an estimate builds the optimizer it names, and with which implementation (foreach, fused) the GPU would run it."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from .low_bit import LOW_BIT, TORCHAO_OPTIM, low_bit_factory, torchao_note

__all__ = ["OPTIMIZERS", "HF_OPTIM", "known_optimizer", "library_optimizer", "optimizer_names", "optimizer_factory",
           "target_optimizer_kwargs", "OptimizerInBackward", "in_backward", "HostStepCounters"]

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
    from transformers.optimization import Adafactor

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
    if optimizer in TORCHAO_OPTIM:
        notes.append(torchao_note(optimizer))
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


class HostStepCounters:
    """While entered, torch.optim's optimizers keep their 0-dim step counters in host memory, as on a GPU.

    Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, Rprop and
    Adafactor keep a step count per parameter (NAdam also its ``mu_product``)
    as a CPU tensor, made by ``torch.tensor(0.0)`` or ``torch.zeros(())``
    without a device, unless the group is ``fused`` or ``capturable``, where
    it is made on the parameter's device (torch/optim/adam.py: "Deliberately
    host `step` on CPU if both capturable and fused are off"). ASGD makes
    its own on the device. An estimate runs everything on the CPU, so its
    tracker is told: the 0-dim tensors such an optimizer makes from a number
    in its ``_init_group`` (where its state is made, in its first step) are
    host memory, never counted nor seen by the allocator simulation. Those
    made in a constructor (Adagrad's) leave the figures before its first
    step (the simulation saw their 512 B blocks, and then saw them freed).
    Every optimizer the estimate runs is seen, the user's own too (a
    Lightning module's, a step's): a global step pre-hook finds them. 512 B a
    parameter tensor, measured on the test device (tests/on_device) and on an
    H100: a residual MLP's and a transformer encoder's AdamW steps allocated
    8,192 B and 26,112 B (16 and 51 parameter tensors) less than nbmem then
    estimated, and now exactly what it estimates (tests/test_h100_figures.py).

    >>> import contextlib
    >>> from nbmem.tracking.tracker import Tracker
    >>> def first_step(host):
    ...     tracker, notes = Tracker("cpu"), []
    ...     layer = torch.nn.Linear(256, 256)                  # 2 parameter tensors
    ...     layer(torch.ones(1, 256)).sum().backward()
    ...     with tracker, (HostStepCounters(tracker, notes) if host else contextlib.nullcontext()):
    ...         adam = torch.optim.Adam(layer.parameters(), foreach=True)
    ...         adam.step()
    ...     return tracker.peak_allocated(), notes
    >>> (counted, _), (hosted, notes) = first_step(False), first_step(True)
    >>> counted - hosted                                       # 2 counters of 512 B
    1024
    >>> notes[0][:40]
    "optimizer: Adam's step counters (a 0-dim"
    """

    def __init__(self, tracker: Any, notes: list[str]) -> None:
        self.tracker, self.notes = tracker, notes
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handle: Any = None
        self._thread: int | None = None  # the thread that entered: the estimate's

    def __enter__(self) -> HostStepCounters:
        self._thread = threading.get_ident()
        self._handle = register_optimizer_step_pre_hook(self._before_step)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()
        for optimizer in list(self._seen):  # an optimizer that outlives the estimate steps as it did before
            optimizer.__dict__.pop("_init_group", None)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # the hook is global: another thread's optimizer (a notebook's training in the background) is not the estimate's
        if threading.get_ident() != self._thread or optimizer in self._seen or not _counts_on_host(optimizer):
            return
        self._seen.add(optimizer)
        made = [value for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor) and value.dim() == 0]
        for counter in made:  # made in its constructor (a user's Adagrad): out of the figures from now on
            self.tracker.moved_to_host(counter)
        if made:
            self.say(optimizer)
        if hasattr(type(optimizer), "_init_group"):  # where torch.optim's make their state, in the first step
            optimizer._init_group = functools.partial(
                _init_group_on_host, weakref.ref(self), weakref.ref(optimizer), type(optimizer)._init_group)

    def say(self, optimizer: Any) -> None:
        """The estimate's note, once (not once per parameter's optimizer, in backward)."""
        if not any("step counters" in note for note in self.notes):
            self.notes.append(f"optimizer: {type(optimizer).__name__}'s step counters (a 0-dim float32 per parameter "
                              "tensor) are CPU tensors on a GPU (neither fused nor capturable), outside the figures")


_ON_DEVICE = ("ASGD",)  # torch.optim's that make their counters on the parameters' device


def _counts_on_host(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of torch.optim's that keeps its step counters on the host (see above)."""
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and type(optimizer).__module__.startswith("torch.optim.")
        and type(optimizer).__name__ not in _ON_DEVICE
        and not any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    )


def _init_group_on_host(counters: weakref.ref[HostStepCounters], owner: weakref.ref[Any], init: Callable[..., Any],
                        *args: Any, **kwargs: Any) -> Any:
    # both held weakly: optimizer -> this -> the optimizer would be a cycle, kept until a collection
    optimizer, hosting = owner(), counters()
    assert optimizer is not None, "the estimate's optimizer was let go before its step"
    group = args[0] if args else kwargs.get("group")
    if hosting is None or (isinstance(group, dict) and all(optimizer.state.get(p) for p in group["params"])):
        return init(optimizer, *args, **kwargs)  # the estimate is over, or every state (counters too) exists already
    with _HostScalars(hosting) as making:
        result = init(optimizer, *args, **kwargs)
    if making.made:
        hosting.say(optimizer)
    return result


class _HostScalars(TorchFunctionMode):
    """Inside: a 0-dim tensor made from a number (``torch.tensor(0.0)``, ``torch.zeros(())``) is host memory."""

    def __init__(self, counters: HostStepCounters) -> None:
        super().__init__()
        self.counters = counters
        self.made = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _makes_scalar(func, args, kwargs):
            return func(*args, **kwargs)
        self.made += 1
        with self.counters.tracker.on_host():
            return func(*args, **kwargs)


def _makes_scalar(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    if func is torch.tensor:
        data = args[0] if args else kwargs.get("data")
        return isinstance(data, (bool, int, float))
    if func is torch.zeros or func is torch.ones:
        size = args if args and not isinstance(args[0], (tuple, list, torch.Size)) else (args[0] if args else kwargs.get("size"))
        return size is not None and len(size) == 0
    return False
