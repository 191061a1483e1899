"""bitsandbytes' 8-bit and paged optimizers and torchao's low-bit AdamW, by Hugging Face's ``optim`` names for them.

``optimizer="paged_adamw_8bit"`` builds ``bitsandbytes.optim.AdamW(...,
optim_bits=8, is_paged=True)``, as transformers' Trainer does
(trainer_optimizer.py ``_get_bitsandbytes_optimizer``), with the Trainer's
rule that an ``nn.Embedding``'s weight keeps 32-bit state, and runs its real
``init_state`` and update ops (their fake implementations in an estimate).
The state bitsandbytes makes: per parameter of 4,096 elements or more, two
uint8 moments (Lion: one) and an fp32 absmax per 256-element block; under
4,096, fp32 moments; 2 KiB of code maps per optimizer.

Two things fake tensors need (:func:`prepare_low_bit`): the code maps are
built with ``.tolist()``, so nbmem builds them for real outside the fake
mode and lends fake copies; and a paged optimizer's state of parameters of
100,000 elements or more lives in CUDA managed memory (``cudaMallocManaged``,
bitsandbytes' ``get_paged``), outside PyTorch's caching allocator: on fake
tensors nbmem makes those buffers where the tracker does not count them and
adds their bytes up as :class:`ManagedMemory`, which the estimate shows
beside the allocated figures and counts against the device. A tracked run
on a CPU follows bitsandbytes' CPU fallback, which pages nothing.

``optimizer="adamw_torch_8bit"`` (or ``"adamw_torch_4bit"``) builds torchao's
``AdamW8bit`` (``AdamW4bit``) with the Trainer's arguments. Its step is
``torch.compile``'d with ``fullgraph=True``, which can't run under a dispatch
mode: an estimate runs it eagerly (as every compiled call), and so does a
tracked run with it, which says so.

>>> LOW_BIT["paged_adamw_8bit"]
('AdamW', 8, True)
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .libraries import library_module, require_bitsandbytes, require_library

__all__ = ["LOW_BIT", "TORCHAO_OPTIM", "torchao_note", "ManagedMemory", "low_bit_factory", "prepare_low_bit", "PAGED_MIN_ELEMENTS"]

#: Hugging Face's optim names for bitsandbytes' optimizers: (bitsandbytes class, state bits, paged).
LOW_BIT: dict[str, tuple[str, int, bool]] = {
    "adamw_bnb_8bit": ("AdamW", 8, False),
    "adamw_8bit": ("AdamW", 8, False),
    "paged_adamw_8bit": ("AdamW", 8, True),
    "paged_adamw_32bit": ("AdamW", 32, True),
    "paged_adamw": ("AdamW", 32, True),
    "lion_8bit": ("Lion", 8, False),
    "lion_32bit": ("Lion", 32, False),
    "paged_lion_8bit": ("Lion", 8, True),
    "paged_lion_32bit": ("Lion", 32, True),
}

#: Hugging Face's optim names for torchao's low-bit AdamW (transformers' trainer_optimizer _get_torchao_optimizer).
TORCHAO_OPTIM = {"adamw_torch_8bit": "AdamW8bit", "adamw_torch_4bit": "AdamW4bit"}

#: bitsandbytes pages the state of parameters with at least this many elements (optim/optimizer.py get_state_buffer).
PAGED_MIN_ELEMENTS = 100_000


@dataclass
class ManagedMemory:
    """Paged optimizer state an estimate placed in CUDA managed memory: its bytes and its buffers (held till the end)."""

    bytes: int = 0
    buffers: list[torch.Tensor] = field(default_factory=list, repr=False)


def low_bit_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
    """The factory for one of :data:`LOW_BIT`'s or :data:`TORCHAO_OPTIM`'s names (the library imported when it builds)."""
    return functools.partial(_build_torchao if name in TORCHAO_OPTIM else _build, name)


def _build_torchao(name: str, parameters: Any, **options: Any) -> torch.optim.Optimizer:
    require_library("torchao", f"optimizer={name!r}")
    options.pop("foreach", None)
    optim = library_module("torchao.optim")
    # torchao builds its code maps with .tolist() on first use and caches them (lru_cache): built here, for real
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        for bits in ("4bit", "8bit"):
            states = library_module(f"torchao.optim.subclass_{bits}")
            states.get_qmap_signed(), states.get_qmap_unsigned()
    # the Trainer's arguments: blocks of 256, no bf16 stochastic rounding
    optimizer: torch.optim.Optimizer = getattr(optim, TORCHAO_OPTIM[name])(parameters, block_size=256,
                                                                            bf16_stochastic_round=False, **options)
    return optimizer


def torchao_note(name: str, planned: bool = False) -> str:
    """What an estimate with torchao's low-bit AdamW assumed (``planned``: compile=True, inductor planned its step)."""
    bits = 8 if name.endswith("8bit") else 4
    step = ("its step is torch.compile'd (fullgraph), and with compile=True inductor planned it as it plans the model: "
            "the state is exact and the step's temporaries are the compiled plan's (for the CPU; untested on CUDA)"
            if planned else
            "its step is torch.compile'd (fullgraph), which a dispatch mode can't run: nbmem runs it eagerly, so the "
            "state is exact and the step's temporaries are eager's, at most what the compiled kernel holds (untested "
            "on CUDA)")
    return (f"optimizer: torchao {TORCHAO_OPTIM[name]}, {bits}-bit state (codes and an fp32 scale per 256 values for "
            "parameters of 4,096 elements or more whose size divides into blocks of 256; others keep state in their "
            f"own dtype); {step}")


def _build(name: str, parameters: Any, **options: Any) -> torch.optim.Optimizer:
    require_bitsandbytes(f"optimizer={name!r}")
    bnb = library_module("bitsandbytes")  # untyped: built as transformers' Trainer builds it

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    kind, bits, paged = LOW_BIT[name]
    options.pop("foreach", None)  # bitsandbytes' optimizers have one implementation
    parameters = list(parameters)
    tensors = [item for entry in parameters for item in (entry["params"] if isinstance(entry, dict) else [entry])]
    # an 8-bit optimizer builds its code maps as it is made, with .tolist(): made outside the fake mode, its maps are
    # real, and prepare_low_bit lends fake copies
    fake = any(isinstance(tensor, FakeTensor) for tensor in tensors)
    with _disable_current_modes() if fake else contextlib.nullcontext():
        optimizer: torch.optim.Optimizer = getattr(bnb.optim, kind)(parameters, optim_bits=bits, is_paged=paged,
                                                                     **options)
    # a manager of its own: the Trainer's embedding rule below would otherwise go into bitsandbytes' global one,
    # which keeps every module it is given
    manager = object.__new__(bnb.optim.GlobalOptimManager)
    manager.initialize()
    optimizer.mng = manager  # type: ignore[attr-defined]
    return optimizer


def prepare_low_bit(optimizer: Any, model: nn.Module, fake_mode: Any, tracker: Any, notes: list[str]) -> ManagedMemory | None:
    """Make a bitsandbytes optimizer ready for this run; the managed memory ledger of a paged one on fake tensors."""
    if optimizer is None or not type(optimizer).__module__.startswith("bitsandbytes."):
        return None
    bits, paged = optimizer.args.optim_bits, optimizer.is_paged
    if bits == 8:
        # transformers' Trainer: "skipped" embeddings keep 32-bit state (trainer.py create_optimizer)
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                optimizer.mng.register_module_override(module, "weight", {"optim_bits": 32})
    if fake_mode is not None:
        from torch.utils._python_dispatch import _disable_current_modes

        if "dynamic" not in optimizer.name2qmap:
            with _disable_current_modes():
                optimizer.fill_qmap()
        optimizer.name2qmap = {key: fake_mode.from_tensor(value) for key, value in optimizer.name2qmap.items()}
    words = (f"optimizer: bitsandbytes {type(optimizer).__name__}, {bits}-bit state"
             + (" (uint8 moments and an fp32 absmax per 256 values for parameters of 4,096 elements or more; "
                "embeddings keep 32-bit state, as the Trainer sets them)" if bits == 8 else ""))
    if not paged:
        notes.append(words)
        return None
    if fake_mode is None:
        notes.append(words + "; paged: on this CPU bitsandbytes falls back to ordinary tensors, counted as optimizer "
                     "state (on CUDA the state of parameters of 100,000 elements or more is managed memory)")
        return None
    managed = ManagedMemory()
    optimizer.get_state_buffer = functools.partial(_paged_buffer, managed, tracker)
    notes.append(words + "; paged: the state of each parameter of 100,000 elements or more is in CUDA managed "
                 "memory (cudaMallocManaged), outside PyTorch's allocator: shown as managed memory, counted against "
                 "the device, not in the allocated figures (untested on CUDA)")
    return managed


def _paged_buffer(managed: ManagedMemory, tracker: Any, parameter: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # bitsandbytes' get_state_buffer on CUDA: get_paged for 1e5 elements or more, else zeros_like
    if parameter.numel() < PAGED_MIN_ELEMENTS:
        return torch.zeros_like(parameter, dtype=dtype)
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # made without an op: the tracker never sees it born
        elem = torch.empty(parameter.shape, dtype=dtype, device="meta")
    buffer = FakeTensor(parameter.fake_mode, elem, parameter.device)  # type: ignore[attr-defined]
    tracker.keep_outside(buffer)
    managed.buffers.append(buffer)
    managed.bytes += buffer.numel() * buffer.element_size()
    return buffer
