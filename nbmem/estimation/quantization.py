"""Quantized weights (``quantization=``, issue 25): bitsandbytes' 4-bit and 8-bit layers, made by its own code.

Every tool that answers "will QLoRA fit?" multiplies the weights by a bit
width. nbmem runs bitsandbytes itself: the model's linear layers become
``bnb.nn.Linear4bit`` / ``Linear8bitLt`` as ``from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))`` makes them (transformers'
``replace_with_bnb_linear``, with its default of layers left unquantized:
``lm_head``, tied and output embeddings), and each weight is quantized by
``bitsandbytes.functional`` (``quantize_4bit``, ``int8_vectorwise_quant``),
on fake tensors in an estimate and for real (bitsandbytes' CPU kernels) in
a tracked run, so the packed weights and every piece of their quantization
state have the sizes bitsandbytes gives them. bitsandbytes' forward and
backward then run as they are (its ops have fake implementations).

Fake tensors can't become ``Params4bit`` or ``Int8Params`` (a tensor
subclass can't wrap a FakeTensor): an estimate's quantized weight is a
plain fake Parameter carrying the same attributes (``quant_state``,
``CB``/``SCB``), which is all bitsandbytes' layers read.

``quantization=`` takes ``"nf4"`` and ``"fp4"`` (QLoRA's recipe: double
quantization, bf16 compute), ``"int8"`` (LLM.int8()), a transformers
``BitsAndBytesConfig``, or a :class:`Quantization`; or a torchao weight
config (``Int8WeightOnlyConfig()``, ``Float8WeightOnlyConfig()``, NF4's
``NF4WeightOnlyConfig()``), which torchao's own ``quantize_`` applies to the
same layers (its tensor subclasses run on fake tensors as they are). When something trains
(``trainable=``), peft's ``prepare_model_for_kbit_training`` casts come
first, as the QLoRA recipe runs them: every parameter frozen, every fp16 or
bf16 parameter that is not a 4-bit weight cast to fp32
(``Quantization(kbit_casts=False)`` skips them).

>>> Quantization.of("nf4").label
'nf4, double quant, bf16 compute'
>>> Quantization.of("int4")
Traceback (most recent call last):
...
ValueError: unknown quantization 'int4': use 'nf4', 'fp4', 'int8', a transformers BitsAndBytesConfig or nbmem.Quantization(...)
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .libraries import library_module, quantized_weight, require_library

__all__ = ["Quantization", "SHORTHANDS", "fake_layer_states", "quantization_label", "quantized", "classify_quantization_state", "quantize_model", "prepare_quantized", "kbit_casts", "parameter_count"]

#: The names ``quantization=`` takes as strings.
SHORTHANDS = ("nf4", "fp4", "int8")

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32, "uint8": torch.uint8}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "uint8"}


def _torchao(model: nn.Module, config: Any, skip: list[str] | None) -> None:
    """torchao's ``quantize_`` on the linear layers transformers' loader would quantize (TorchAoConfig's)."""
    quantize_ = library_module("torchao.quantization").quantize_
    chosen: list[str] = []

    def converted(module: nn.Module, name: str) -> bool:
        if _quantizable(module) and _converted(name, skip):
            chosen.append(name)  # torchao converts each as soon as it is chosen: the last one is the one that failed
            return True
        return False

    try:
        quantize_(model, config, filter_fn=converted)
    except AssertionError as error:  # NF4WeightOnlyConfig: a weight of fewer or other values than its blocks take
        if "divisible" not in str(error):
            raise
        blocks = getattr(config, "block_size", 64), getattr(config, "scaler_block_size", 256)
        raise ValueError(
            f"torchao's {type(config).__name__} can't quantize layer {chosen[-1] if chosen else '?'!r}: {str(error).strip()}. "
            + (f"Its NF4 needs each weight to hold a multiple of block_size x scaler_block_size = {blocks[0]} x "
               f"{blocks[1]} = {blocks[0] * blocks[1]:,} values: leave that layer out with nbmem.Quantization("
               f"'torchao', config=..., skip=({chosen[-1] if chosen else 'name'!r}, ...)), or lower the config's "
               "scaler_block_size" if "NF4" in type(config).__name__ else "leave that layer out with "
               "nbmem.Quantization('torchao', config=..., skip=(name, ...))")
        ) from error
    except ImportError as error:  # a config whose kernels live in a package of their own (Int4WeightOnlyConfig: mslk)
        raise ValueError(
            f"torchao's {type(config).__name__} needs a kernel package torchao could not import ({error}): install "
            "it, or use Int8WeightOnlyConfig() or Float8WeightOnlyConfig(), or bitsandbytes' quantization='nf4'"
        ) from error


@dataclass(frozen=True)
class Quantization:
    """How the linear layers are quantized, in BitsAndBytesConfig's terms.

    ``method`` is ``"nf4"``, ``"fp4"`` or ``"int8"`` (bitsandbytes), or
    ``"torchao"`` with ``config`` a torchao weight config
    (``Int8WeightOnlyConfig()``, ``Float8WeightOnlyConfig()``,
    ``NF4WeightOnlyConfig()``, ...), applied
    with torchao's own ``quantize_``; ``double_quant`` and
    ``compute_dtype``, ``quant_storage`` and ``blocksize`` are 4-bit's
    (``bnb_4bit_use_double_quant``, ...); ``skip`` names modules left
    unquantized (``llm_int8_skip_modules``; None: transformers' default,
    the output layer and tied weights); ``threshold`` is int8's outlier
    threshold as configured (the run assumes no outlier columns: they
    depend on the data); ``kbit_casts`` applies peft's
    ``prepare_model_for_kbit_training`` casts when something trains.
    Pass one as ``nbmem.estimate(..., quantization=...)``.

    >>> Quantization("fp4", double_quant=False, compute_dtype="fp16").label
    'fp4, no double quant, fp16 compute'
    >>> Quantization("nf4", kbit_casts=False) == Quantization.of("nf4")
    False
    """

    method: str
    double_quant: bool = True
    compute_dtype: torch.dtype = torch.bfloat16
    quant_storage: torch.dtype = torch.uint8
    blocksize: int = 64
    skip: tuple[str, ...] | None = None
    threshold: float = 0.0
    kbit_casts: bool = True
    #: torchao's config, for method "torchao".
    config: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.method not in (*SHORTHANDS, "torchao"):
            raise ValueError(f"unknown quantization method {self.method!r}: use one of {', '.join(SHORTHANDS)}, "
                             "or pass a torchao config")
        if (self.method == "torchao") != (self.config is not None):
            raise ValueError("a torchao quantization needs its config: pass the config itself as quantization=")
        for name in ("compute_dtype", "quant_storage"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value not in _DTYPES:
                    raise ValueError(f"{name}={value!r} is not a dtype: use torch.bfloat16, torch.float16 or torch.float32")
                object.__setattr__(self, name, _DTYPES[value])
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError(f"blocksize={self.blocksize} is not one bitsandbytes takes: a power of two from 32 to 4096")
        if self.skip is not None:
            object.__setattr__(self, "skip", tuple(self.skip))

    @classmethod
    def of(cls, value: Any) -> Quantization:
        """A Quantization from what ``quantization=`` takes (a shorthand, a BitsAndBytesConfig, or one of these)."""
        if isinstance(value, Quantization):
            return value
        if isinstance(value, str):
            if value not in SHORTHANDS:
                raise ValueError(f"unknown quantization {value!r}: use {', '.join(map(repr, SHORTHANDS))}, a "
                                 "transformers BitsAndBytesConfig or nbmem.Quantization(...)")
            # QLoRA's recipe (Dettmers et al. 2023; what people pass): double quantization, bf16 compute
            return cls(value)
        if type(value).__name__ == "BitsAndBytesConfig":
            return cls._of_config(value)
        if type(value).__module__.startswith("torchao.") and type(value).__name__.endswith("Config"):
            return cls("torchao", config=value)
        raise ValueError(f"quantization= takes {', '.join(map(repr, SHORTHANDS))}, a transformers BitsAndBytesConfig, "
                         f"a torchao config or nbmem.Quantization(...), got {type(value).__name__}")

    @classmethod
    def _of_config(cls, config: Any) -> Quantization:
        # transformers adds its default skips only when llm_int8_skip_modules is None (an empty list skips nothing)
        skip = tuple(config.llm_int8_skip_modules) if config.llm_int8_skip_modules is not None else None
        if config.load_in_8bit:
            if config.llm_int8_has_fp16_weight:
                raise ValueError("BitsAndBytesConfig(llm_int8_has_fp16_weight=True) keeps fp16 weights and quantizes "
                                 "them in each forward, which nbmem does not estimate: leave it False (the default)")
            return cls("int8", skip=skip, threshold=float(config.llm_int8_threshold))
        if not config.load_in_4bit:
            raise ValueError("the BitsAndBytesConfig quantizes nothing: set load_in_4bit=True or load_in_8bit=True")
        return cls(config.bnb_4bit_quant_type, double_quant=bool(config.bnb_4bit_use_double_quant),
                   compute_dtype=_dtype(config.bnb_4bit_compute_dtype), quant_storage=_dtype(config.bnb_4bit_quant_storage),
                   skip=skip)

    @property
    def bits(self) -> int:
        return 8 if self.method == "int8" else 4

    @property
    def library(self) -> str:
        return "torchao" if self.method == "torchao" else "bitsandbytes"

    @property
    def label(self) -> str:
        if self.method == "torchao":
            return ", ".join([f"torchao {type(self.config).__name__}"] + self._choices())
        if self.method == "int8":
            return ", ".join(["int8 (LLM.int8())"] + self._choices())
        parts = [self.method, "double quant" if self.double_quant else "no double quant",
                 f"{_NAMES.get(self.compute_dtype, str(self.compute_dtype))} compute"]
        if self.quant_storage != torch.uint8:
            parts.append(f"{_NAMES.get(self.quant_storage, str(self.quant_storage))} storage")
        if self.blocksize != 64:
            parts.append(f"blocks of {self.blocksize}")
        return ", ".join(parts + self._choices())

    def _choices(self) -> list[str]:
        """What a label says beyond the format: skipped layers, peft's casts left out (so that sweeps tell them apart)."""
        return ([f"skip {', '.join(self.skip)}" if self.skip else "skip nothing"] if self.skip is not None else []) + (
            [] if self.kbit_casts else ["no kbit casts"])


def quantization_label(value: Any) -> str:
    """How a table names a quantization: "none", a shorthand, or a config's method and settings.

    >>> quantization_label(None), quantization_label("nf4"), quantization_label(Quantization("nf4", double_quant=False))
    ('none', 'nf4', 'nf4, no double quant, bf16 compute')
    """
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    return Quantization.of(value).label


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value is None:
        return torch.float32
    return _DTYPES[str(value).removeprefix("torch.")]


def quantize_model(model: nn.Module, quantization: Quantization, notes: list[str]) -> nn.Module:
    """Quantize ``model``'s linear layers in place, as ``from_pretrained`` with a BitsAndBytesConfig would.

    Works on fake tensors (an estimate's model) and real ones (a tracked run's,
    with bitsandbytes' CPU kernels). Call it where the model was built, inside
    the fake mode and the tracker: each quantized weight and its state are born
    there, the full-precision weight it replaces is freed.

    >>> import importlib.util
    >>> if importlib.util.find_spec("bitsandbytes"):
    ...     layer = quantize_model(nn.Sequential(nn.Linear(128, 64)), Quantization.of("nf4"), [])
    ...     print(type(layer[0]).__name__, tuple(layer[0].weight.shape), layer[0].weight.dtype)
    ... else:
    ...     print("Linear4bit (4096, 1) torch.uint8")
    Linear4bit (4096, 1) torch.uint8
    """
    require_library(quantization.library, "quantization=")
    skip = _skipped(model, quantization)
    targets = [(name, module) for name, module in model.named_modules() if _quantizable(module)
               and _converted(name, skip)]
    if not targets:
        linear = sum(1 for module in model.modules() if _quantizable(module))
        raise ValueError(
            f"quantization={quantization.method!r} quantizes nn.Linear layers, and "
            + (f"the model has none ({type(model).__name__})" if not linear else
               f"all {linear} of the model's are left unquantized (skip={list(skip or [])})")
            + ": pass a model built from nn.Linear layers (a transformer), or leave quantization out"
        )
    count = len(targets)
    if quantization.method == "torchao":
        _torchao(model, quantization.config, skip)
    else:
        from .quantized_layers import quantized_layer

        names = [name for name, _ in targets]
        del targets  # each full-precision layer goes as soon as its quantized one replaces it
        for name in names:
            _set_submodule(model, name, quantized_layer(model.get_submodule(name), quantization))
        # what peft and transformers read (peft chooses its bnb LoRA layers by it)
        setattr(model, "is_loaded_in_4bit" if quantization.bits == 4 else "is_loaded_in_8bit", True)
    skipped = sorted(name for name, module in model.named_modules() if _quantizable(module) and not _converted(name, skip))
    notes.append(
        f"quantization: {count} linear layers quantized to {quantization.label} by {quantization.library}'s own "
        f"functions (as from_pretrained with a {'TorchAoConfig' if quantization.method == 'torchao' else 'BitsAndBytesConfig'}"
        "); left as they were: "
        f"{', '.join(skipped[:4]) + (' ...' if len(skipped) > 4 else '') if skipped else 'none'}, and every other layer"
    )
    if quantization.method == "int8":
        notes.append(
            f"int8: outlier columns (llm_int8_threshold={quantization.threshold:g}) depend on the data; the run assumes "
            "none, so no fp16 outlier matmul is counted" if quantization.threshold > 0 else
            "int8: llm_int8_threshold=0, no outlier decomposition"
        )
    return model


def prepare_quantized(model: nn.Module, quantization: Quantization, trains: bool, notes: list[str],
                      as_built: bool = False) -> nn.Module:
    """:func:`quantize_model`, then peft's casts when ``trains`` (something is chosen to train).

    ``as_built``: the model trains as it comes, which needs a parameter left
    that can (quantized weights can't). An estimate runs it inside :func:`code_maps`.
    """
    model = quantize_model(model, quantization, notes)
    if as_built and not any(parameter.requires_grad for parameter in model.parameters()):
        raise ValueError(
            f"quantization={quantization.label!r} left nothing to train: quantized weights are frozen, "
            "and the model has no other parameter that trains. Pass trainable='lora' (QLoRA) or a peft config, or "
            "leave some layers unquantized with nbmem.Quantization(..., skip=[their names])"
        )
    if trains and quantization.kbit_casts:
        kbit_casts(model, notes, cast=quantization.method != "torchao")
    return model


def quantized(model: nn.Module) -> bool:
    """Whether any weight of ``model`` is one bitsandbytes quantized (nbmem's, or the user's own)."""
    return any(quantized_weight(parameter, "bitsandbytes") for parameter in model.parameters())


def classify_quantization_state(model: nn.Module, classify: Callable[[torch.Tensor, str], None]) -> None:
    """File every quantized weight's state (absmax, codes, scales) under "parameter", with the weight it describes
    (an int8 layer that ran a forward keeps its scales on the layer's ``state``)."""
    for parameter in _unique(model.parameters()):
        for tensor in state_tensors(parameter):
            classify(tensor, "parameter")
    for module in model.modules():
        state = getattr(module, "state", None)
        if type(state).__name__ == "MatmulLtState":
            for name in ("CB", "SCB"):
                if isinstance(getattr(state, name, None), torch.Tensor):
                    classify(getattr(state, name), "parameter")


def _quantizable(module: nn.Module) -> bool:
    # transformers' replace_with_bnb_linear converts exactly these: nn.Linear itself (not subclasses) and GPT-2's Conv1D
    return type(module) is nn.Linear or (type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers."))


def _skipped(model: nn.Module, quantization: Quantization) -> list[str] | None:
    """The modules left unquantized: the user's, plus transformers' defaults for a transformers model."""
    skip = list(quantization.skip or [])
    if type(model).__module__.startswith("transformers."):
        if quantization.skip is None:
            skip += _default_skips(model)
        skip += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return skip or None


def _default_skips(model: nn.Module) -> list[str]:
    """transformers' get_keys_to_not_convert: the output layer, tied weights, the last module (5.x and 4.x)."""
    try:
        if hasattr(model, "all_tied_weights_keys"):  # transformers 5
            from transformers.quantizers.base import get_keys_to_not_convert
        else:  # transformers 4
            from transformers.integrations import get_keys_to_not_convert  # type: ignore[attr-defined,no-redef]
        return list(get_keys_to_not_convert(model))
    except (ImportError, AttributeError, TypeError):
        output = getattr(model, "get_output_embeddings", lambda: None)()
        return [name for name, module in model.named_modules() if output is not None and module is output]


def _converted(name: str, patterns: list[str] | None) -> bool:
    # transformers' should_convert_module (quantizers/quantizers_utils.py): a prefix up to a module boundary, a
    # regex with the same boundary, or a suffix
    if not patterns:
        return True
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in patterns)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def state_tensors(weight: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors of a quantized weight's state: 4-bit's absmax, code, offset and nested state; int8's scales."""
    pending = [getattr(weight, "quant_state", None)]
    while pending:
        state = pending.pop()
        if state is None:
            continue
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif type(value).__name__ == "QuantState":
                pending.append(value)
    scales = getattr(weight, "SCB", None)
    if isinstance(scales, torch.Tensor):
        yield scales


def kbit_casts(model: nn.Module, notes: list[str], cast: bool = True) -> None:
    """peft's ``prepare_model_for_kbit_training`` casts (peft/utils/other.py), on nbmem's copy.

    Every parameter frozen; every fp16/bf16 one that is not a 4-bit weight
    cast to fp32 (``param.data = param.data.to(torch.float32)``, as peft
    does). Its other steps are nbmem's own knobs: gradient checkpointing is
    ``checkpointing=``; ``enable_input_require_grads`` adds no tensor. A
    torchao model is frozen, not cast (``cast=False``), as peft does.
    """
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if not cast:  # peft casts nothing for a torchao model
        notes.append("peft's prepare_model_for_kbit_training: every parameter frozen before the adapters (no casts to "
                     "fp32 for a torchao model, as peft does)")
        return
    widened = 0
    for parameter in model.parameters():
        if parameter.dtype in (torch.float16, torch.bfloat16) and not quantized_weight(parameter, "4bit"):
            parameter.data = parameter.data.to(torch.float32)
            widened += parameter.numel()
    notes.append("peft's prepare_model_for_kbit_training casts: every parameter frozen before the adapters, and "
                 + (f"{widened:,} fp16/bf16 parameters (norms, embeddings, the output layer) cast to fp32; "
                    "Quantization(..., kbit_casts=False) leaves them" if widened else
                    "nothing to cast to fp32: the parameters left unquantized are fp32 already (a model loaded in "
                    "bf16 would have its norms, embeddings and output layer cast)"))


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, a 4-bit weight counted by its logical shape (two values per packed byte, or more)."""
    total = 0
    for parameter in _unique(model.parameters()):
        state = getattr(parameter, "quant_state", None)
        shape = getattr(state, "shape", None)
        total += int(torch.Size(shape).numel()) if shape is not None else parameter.numel()
    return total


def _unique(parameters: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for parameter in parameters:
        if id(parameter) not in seen:
            seen.add(id(parameter))
            yield parameter


@contextlib.contextmanager
def code_maps(fake_mode: Any, device: torch.device) -> Iterator[None]:
    """bitsandbytes' shared 8-bit code map, as a run of this mode needs it (a fake one restored after).

    ``quantize_blockwise`` (4-bit double quantization's second stage) builds
    the map with ``.tolist()`` the first time and caches it in
    ``bitsandbytes.functional.name2qmap``. Fake tensors can't answer
    ``.tolist()``: an estimate builds it for real, outside the fake mode, and
    lends a fake copy for the whole run, as a process keeps the real one on
    its device for good (1 KiB). A real run makes it as bitsandbytes would,
    where the allocator sees it (``torch.tensor(list)`` on a CPU wraps memory
    no allocator gave, which a tracked run would miss the first time only).
    """
    import bitsandbytes.functional as functional
    from torch.utils._python_dispatch import _disable_current_modes

    had = "dynamic" in functional.name2qmap
    before = functional.name2qmap.get("dynamic")
    if fake_mode is None:
        if not had:
            functional.name2qmap["dynamic"] = functional.create_dynamic_map().to(device).clone()
        yield
        return
    with _disable_current_modes():
        real = before if had and not _is_fake(before) else functional.create_dynamic_map()
    lent = fake_mode.from_tensor(real)
    try:
        functional.name2qmap["dynamic"] = lent
        yield
    finally:
        if had and not _is_fake(before):
            functional.name2qmap["dynamic"] = before
        else:  # (a fake one is what an estimate Ctrl-C cut short left: never put back)
            functional.name2qmap.pop("dynamic", None)


def _is_fake(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def fake_quant_attributes(parameter: torch.Tensor, make: Any, memo: dict[int, Any]) -> dict[str, Any]:
    """A bitsandbytes weight's attributes with every tensor in them made by ``make`` (an instance's fake copy)."""
    attributes = {}
    for name in ("quant_state", "CB", "SCB", "blocksize", "compress_statistics", "quant_type", "quant_storage",
                 "bnb_quantized", "has_fp16_weights"):
        if hasattr(parameter, name):
            attributes[name] = _converted_value(getattr(parameter, name), make, memo)
    return attributes


def fake_layer_states(model: nn.Module, make: Any, memo: dict[int, Any]) -> None:
    """Put in ``memo`` a copy of each bitsandbytes int8 layer's ``state`` (after a forward it holds the weight's
    CB and SCB) with its tensors made by ``make``, so that deepcopy meets no real tensor there."""
    for module in model.modules():
        state = getattr(module, "state", None)
        if type(state).__name__ == "MatmulLtState" and id(state) not in memo:
            copied = copy.copy(state)
            for name, value in vars(state).items():
                if isinstance(value, torch.Tensor):
                    setattr(copied, name, _converted_value(value, make, memo))
            memo[id(state)] = copied


def _converted_value(value: Any, make: Any, memo: dict[int, Any]) -> Any:
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        made = make(value)
    elif type(value).__name__ == "QuantState":
        made = copy.copy(value)
        for name, item in vars(value).items():
            if isinstance(item, torch.Tensor) or type(item).__name__ == "QuantState":
                setattr(made, name, _converted_value(item, make, memo))
    else:
        return value
    memo[id(value)] = made
    return made
