"""Fine-tuning knobs: which parameters train (``trainable=``), applied to nbmem's own copy of the model.

``nbmem.estimate(build, make, batch_size=8, trainable="lora")`` answers "can I
fine-tune this model on my card, and how?" (issue 14). nbmem builds the model
as always, then chooses what trains, before the optimizer exists, in the
estimate (fake tensors) and in a tracked or measured run alike:

- ``None`` (the default): as the model comes, each parameter's own
  ``requires_grad`` (a model you froze or wrapped with PEFT stays so);
- ``"all"``: every parameter trains (full fine-tuning);
- ``"head"``: the output layer only (see :func:`head_of`), the rest frozen;
- ``"lora"``: PEFT's LoRA with PEFT's own defaults (``LoraConfig()``: r=8,
  lora_alpha=8, the target modules PEFT lists for the model's type); for
  other settings pass a PEFT config itself, ``trainable=LoraConfig(r=16,
  target_modules=["q_proj", "v_proj"])`` (any ``peft.PeftConfig``);
- a predicate ``name -> bool`` over the names of ``model.named_parameters()``.

Frozen parameters get no gradient and, having none, no optimizer state
(torch.optim skips a parameter whose ``.grad`` is None); autograd itself
keeps activations only where a gradient must flow. Lists of name prefixes
are not taken: a sweep reads a list as values to sweep over; a predicate
says the same, ``lambda name: name.startswith(("classifier", "pooler"))``.

>>> import torch
>>> build = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> model = build()
>>> chosen = apply_trainable(model, "head", [])
>>> [name for name, parameter in chosen.named_parameters() if parameter.requires_grad]
['2.weight', '2.bias']
>>> trainable_label(lambda name: True), trainable_label(None), trainable_label("head")
('<lambda>', 'as built', 'head')
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from ..core.units import format_bytes
from .libraries import quantized_weight

__all__ = ["PRESETS", "AS_BUILT", "check_trainable", "trainable_label", "apply_trainable", "head_of", "Trained", "TrainedWatch"]

#: The named choices of ``trainable=``; None means "as the model comes".
PRESETS = ("all", "head", "lora")

#: What ``trainable=None`` is called in tables and menus.
AS_BUILT = "as built"


def _peft_config_class() -> type | None:
    try:
        from peft import PeftConfig
    except ImportError:
        return None
    return PeftConfig


def _is_peft_config(trainable: Any) -> bool:
    config_class = _peft_config_class() if type(trainable).__module__.startswith("peft") else None
    return config_class is not None and isinstance(trainable, config_class)


def check_trainable(trainable: Any) -> None:
    """Refuse a ``trainable=`` nbmem can't apply, before anything runs; import PEFT now for LoRA.

    PEFT is imported here, outside the fake mode: a library first imported
    under fake tensors keeps its import-time tensors fake, and they would be
    counted.

    >>> check_trainable("everything")
    Traceback (most recent call last):
    ...
    ValueError: unknown trainable='everything': use 'all', 'head', 'lora', a peft config (e.g. peft.LoraConfig(r=16)), a function name -> bool over model.named_parameters(), or None (the model as it comes)
    """
    if trainable is None or _is_peft_config(trainable):
        return
    if isinstance(trainable, str):
        if trainable not in PRESETS:
            raise ValueError(f"unknown trainable={trainable!r}: use {_CHOICES}")
        if trainable == "lora":
            try:
                import peft  # noqa: F401
                import peft.tuners.lora  # noqa: F401
            except ImportError as error:
                raise ValueError(
                    "trainable='lora' builds LoRA adapters with Hugging Face's peft, which is not installed here: "
                    "`pip install peft` (or nbmem's extra, `pip install nbmem[zoo]`), or choose trainable='head' "
                    "or 'all'"
                ) from error
        return
    if isinstance(trainable, (list, tuple, set)):
        raise ValueError(
            f"trainable={trainable!r} is a list: nbmem takes one choice (a sweep takes a list of choices). "
            "For parameters by name prefix pass a function, e.g. "
            "trainable=lambda name: name.startswith(('classifier', 'pooler'))"
        )
    if not callable(trainable):
        raise ValueError(f"trainable must be one of: {_CHOICES}; got {type(trainable).__name__}")


_CHOICES = ("'all', 'head', 'lora', a peft config (e.g. peft.LoraConfig(r=16)), a function name -> bool over "
            "model.named_parameters(), or None (the model as it comes)")


def trainable_label(trainable: Any) -> str:
    """A short name for tables and menus: the preset, the predicate's name, or the PEFT config's type and rank."""
    if trainable is None:
        return AS_BUILT
    if isinstance(trainable, str):
        return trainable
    if _is_peft_config(trainable):
        rank = getattr(trainable, "r", None)
        return f"{type(trainable).__name__}" + (f"(r={rank})" if rank is not None else "")
    return getattr(trainable, "__name__", type(trainable).__name__)


def apply_trainable(model: nn.Module, trainable: Any, notes: list[str]) -> nn.Module:
    """Choose what trains in nbmem's copy ``model``: the model to train (a PEFT model for LoRA), ``notes`` say how.

    Call it where the model was built (inside the fake mode and the tracker),
    before precision, checkpointing and the optimizer. Raises ValueError,
    naming a few parameters, when the choice leaves nothing to train.
    """
    if trainable is None:
        return model
    if trainable == "all":
        _train_only(model, lambda parameter: True)
        return model
    if trainable == "head":
        return _train_head(model, notes)
    if trainable == "lora" or _is_peft_config(trainable):
        return _with_adapters(model, trainable, notes)
    names = _names_by_parameter(model)
    chosen = {key for key, (parameter, aliases) in names.items() if any(trainable(name) for name in aliases)}
    if not chosen:
        raise ValueError(
            f"trainable={trainable_label(trainable)} matches none of the model's {len(names)} parameters, so nothing "
            f"would train. Its parameter names look like: {_a_few(model)}"
        )
    _train_only(model, lambda parameter: id(parameter) in chosen)
    return model


def _train_only(model: nn.Module, chosen: Any) -> None:
    """Freeze every parameter but the chosen ones; only floating-point ones can train (autograd refuses others), and
    never a quantized weight (bitsandbytes' stored as bf16, torchao's tensor subclasses: they can't train)."""
    for parameter in model.parameters():
        floating = parameter.is_floating_point() or parameter.is_complex()
        parameter.requires_grad_(bool(chosen(parameter)) and floating and not quantized_weight(parameter))


def _names_by_parameter(model: nn.Module) -> dict[int, tuple[nn.Parameter, list[str]]]:
    """Every parameter with all its names: a tied weight has one per module that holds it."""
    names: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), (parameter, []))[1].append(name)
    return names


def _a_few(model: nn.Module, count: int = 6) -> str:
    """The first, middle and last parameter names, so the user sees the pattern and the ends."""
    names = [name for name, _ in model.named_parameters()]
    if len(names) <= count:
        return ", ".join(names)
    middle = len(names) // 2
    return ", ".join([*names[:2], "...", *names[middle - 1:middle + 1], "...", *names[-2:]])


def head_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The output layer and its name: Hugging Face's ``get_output_embeddings()``, timm's ``get_classifier()``,
    else the last ``nn.Linear`` (a classifier head such as BERT's ``classifier`` or Llama's ``score``).

    >>> head_of(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))[0]
    '2'
    """
    found: Any = None
    for getter in ("get_output_embeddings", "get_classifier"):  # transformers; timm
        method = getattr(model, getter, None)
        if callable(method):
            candidate = method()
            if isinstance(candidate, nn.Module) and any(True for _ in candidate.parameters()):
                found = candidate
                break
    if found is None:
        linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        if not linears:
            raise ValueError(
                f"trainable='head' found no output layer in {type(model).__name__}: it has no "
                "get_output_embeddings() (Hugging Face), no get_classifier() (timm) and no nn.Linear. Pass a "
                f"function over parameter names instead, e.g. trainable=lambda name: name.startswith('fc'); its "
                f"parameters are {_a_few(model)}"
            )
        found = linears[-1]
    name = next(path for path, module in model.named_modules() if module is found)
    return name, found


def _train_head(model: nn.Module, notes: list[str]) -> nn.Module:
    name, head = head_of(model)
    own = {id(parameter) for parameter in head.parameters()}
    _train_only(model, lambda parameter: id(parameter) in own)
    tied = sorted({
        other for other, parameter in model.named_parameters(remove_duplicate=False)
        if id(parameter) in own and not other.startswith(f"{name}.")
    })
    # A tied head (GPT-2's lm_head is transformer.wte, BERT's decoder the word embeddings) is one tensor:
    # training the head trains the input embeddings too, its gradient and optimizer state full-sized.
    # nbmem trains it as the model is built rather than untie it, which would add a parameter copy.
    notes.append(
        f"trainable='head': {name} ({type(head).__name__}) trains, every other parameter is frozen"
        + (f"; its weight is tied to {', '.join(tied)} (one tensor), so those train too, with a full-sized "
           "gradient and optimizer state: untie them (e.g. tie_word_embeddings=False in a Hugging Face config) for "
           "a head of its own" if tied else "")
    )
    return model


def _with_adapters(model: nn.Module, trainable: Any, notes: list[str]) -> nn.Module:
    """The model wrapped by PEFT (LoRA's defaults for "lora", else the user's config, copied: PEFT fills it in)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        raise ValueError(
            f"trainable={trainable_label(trainable)!r} adds PEFT adapters, and the model is already a PEFT model: "
            "leave trainable unset (the model's own adapters train), or pass the base model"
        )
    config = LoraConfig() if trainable == "lora" else copy.deepcopy(trainable)
    fake = any(_is_fake(parameter) for parameter in model.parameters())
    with warnings.catch_warnings():
        # PEFT's own remarks while it wraps nbmem's copy (GPT-2's Conv1D sets fan_in_fan_out itself), not the user's
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        try:
            # On fake tensors the adapters are made on "meta" and made fake afterwards: PEFT moves each adapter
            # to its base layer's device with module.to(), which can't swap fake tensors in place, and it skips
            # adapters on "meta" (peft tuners_utils._move_adapter_to_device_of_base_layer).
            with torch.device("meta") if fake else contextlib.nullcontext():
                wrapped: nn.Module = get_peft_model(model, config)
        except ValueError as error:
            if "target_modules" not in str(error):
                raise
            linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                             if isinstance(module, nn.Linear)})
            raise ValueError(
                f"peft has no default LoRA target modules for {type(model).__name__} (model type "
                f"{getattr(getattr(model, 'config', None), 'model_type', 'unknown')!r}): pass "
                f"trainable=peft.LoraConfig(r=8, target_modules=[...]) naming its layers; its nn.Linear layers are "
                f"called {', '.join(linear[:8]) or 'nothing (it has none)'}"
            ) from error
    if fake:
        from .building import materialize_meta

        materialize_meta(wrapped, _device_of(model))
    training = sum(parameter.numel() for parameter in wrapped.parameters() if parameter.requires_grad)
    targets = getattr(config, "target_modules", None)
    notes.append(
        f"trainable={trainable_label(trainable)}: peft {type(config).__name__}(r={getattr(config, 'r', '?')}, "
        f"lora_alpha={getattr(config, 'lora_alpha', '?')}, target_modules={sorted(targets) if targets else targets}): "
        f"{training:,} parameters train (the adapters, and any modules_to_save), the base model's are frozen"
        + ("; the values are peft's defaults for this model type" if trainable == "lora" else "")
    )
    return wrapped


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@dataclass(frozen=True)
class Trained:
    """What the trained parameters themselves hold, read from the tracker's own records (the blocks it counts).

    ``parameter_bytes`` are the trained parameters' storages, ``gradient_bytes``
    their gradients (the largest each reached in a step; None when no gradient
    was seen), ``state_bytes`` the optimizer state the optimizer keeps for them
    after the last step (None when the user's step brought its own optimizer).
    Frozen parameters have no gradient and no state. ``what`` names them: "LoRA
    adapter", "head", "whole model", or "parameters you chose". Under a
    data-parallel strategy they are the reporting rank's: DDP's equal a
    launched rank's (tested); under ZeRO and FSDP they are what that rank's
    optimizer and gradient hooks see, not checked against a launch.
    """

    choice: str
    what: str
    parameters: int
    total_parameters: int
    parameter_bytes: int
    gradient_bytes: int | None
    state_bytes: int | None

    @property
    def share(self) -> float:
        """Trained parameters as a fraction of all."""
        return self.parameters / self.total_parameters if self.total_parameters else 0.0

    def rows(self, mode: str) -> list[tuple[str, str]]:
        """Two report lines: what trains, and its own bytes (each figure named and said to be per step)."""
        gradients = "none seen" if self.gradient_bytes is None else format_bytes(self.gradient_bytes)
        state = "your step's own optimizer, not read" if self.state_bytes is None else format_bytes(self.state_bytes)
        return [
            ("trainable", f"{self.choice}: {self.parameters:,} of {self.total_parameters:,} parameters "
                          f"({self.share:.2%}) train, the {self.what}"),
            (f"  {self.what}", f"parameters {format_bytes(self.parameter_bytes)}, gradients {gradients}, "
                               f"optimizer state {state} ({mode}, allocated; part of the breakdown above)"),
        ]


class TrainedWatch:
    """Reads the trained parameters' own bytes from ``tracker`` while the steps run (see :class:`Trained`).

    Gradients are read by a post-accumulate-grad hook on each trained
    parameter of nbmem's own copy (removed by :meth:`close`); nothing of
    the user's is touched or held.
    """

    def __init__(self, model: nn.Module, tracker: Any, trainable: Any) -> None:
        self.tracker = tracker
        self.trainable = trainable
        self.model = model
        self.gradients: dict[int, int] = {}
        self.handles = [parameter.register_post_accumulate_grad_hook(self._on_grad)
                        for parameter in self._trained()]

    def _trained(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for parameter in self.model.parameters():
            if parameter.requires_grad and id(parameter) not in seen:
                seen.add(id(parameter))
                yield parameter

    def _size(self, tensor: torch.Tensor) -> int:
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor (FSDP): this rank's shard
        record = self.tracker.record_of(local)
        return 0 if record is None else int(record.size)

    def _on_grad(self, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            key = id(parameter)
            self.gradients[key] = max(self.gradients.get(key, 0), self._size(parameter.grad))

    def close(self, optimizer: torch.optim.Optimizer | None) -> Trained:
        """Remove the hooks; what the trained parameters hold."""
        for handle in self.handles:
            handle.remove()
        trained = list(self._trained())
        state: int | None = None
        if optimizer is not None:
            storages: dict[Any, int] = {}
            for parameter in trained:
                for value in optimizer.state.get(parameter, {}).values():
                    if isinstance(value, torch.Tensor):
                        local = getattr(value, "_local_tensor", value)
                        storages[local.untyped_storage()._cdata] = self._size(value)
            state = sum(storages.values())
        from .quantization import parameter_count

        total = parameter_count(self.model)
        return Trained(
            choice=trainable_label(self.trainable),
            what=_what(self.trainable),
            parameters=sum(parameter.numel() for parameter in trained),
            total_parameters=total,
            parameter_bytes=sum(self._size(parameter) for parameter in trained),
            gradient_bytes=sum(self.gradients.values()) if self.gradients else None,
            state_bytes=state,
        )


def _what(trainable: Any) -> str:
    """What the trained parameters are, in the report's words."""
    if trainable == "lora" or type(trainable).__name__ == "LoraConfig":
        return "LoRA adapter"
    if _is_peft_config(trainable):
        return "PEFT adapter"
    return {"head": "head", "all": "whole model", None: "parameters left trainable"}.get(
        trainable if isinstance(trainable, str) or trainable is None else "", "parameters you chose")
