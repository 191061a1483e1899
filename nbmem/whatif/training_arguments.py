"""Start from the training configuration you already have: a Hugging Face ``TrainingArguments`` or ``Trainer``.

:func:`estimate_trainer` reads the settings that change memory and estimates
the step they describe (:func:`nbmem.estimate`): the per-device batch,
gradient accumulation, ``bf16``/``fp16``, gradient (activation) checkpointing,
``optim``, FSDP (its wrapped layer class, CPU offload), a DeepSpeed
configuration (its ZeRO stage and CPU offload), ``torch_compile``.
:func:`knobs_from_training_arguments` returns what it read: the estimate's
knobs, a note on what each setting became, and the settings it did not
understand, which are never silently ignored: the estimate refuses them
(``strict=True``, the default) or lists them in its notes (``strict=False``).
transformers stays an optional dependency: nothing here imports it.

Example (with transformers installed)::

    args = TrainingArguments("out", per_device_train_batch_size=8, bf16=True, gradient_checkpointing=True)
    print(nbmem.estimate_trainer(args, model=build, batch=make_batch, device="A10G"))
    print(nbmem.estimate_trainer(trainer, device="A10G"))    # its model, its dataset and collator
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from ..estimation.estimate import Estimate, estimate
from ..estimation.low_bit import LOW_BIT, TORCHAO_OPTIM
from ..estimation.optimizers import HF_OPTIM
from ..estimation.userstep import estimating

__all__ = ["estimate_trainer", "knobs_from_training_arguments", "TrainingKnobs", "OPTIM"]

#: Hugging Face's ``optim`` names nbmem estimates, and the optimizer each means (the others are not understood yet:
#: GaLore, LOMO, schedule-free). bitsandbytes' and torchao's keep their own names.
OPTIM: dict[str, Any] = {**HF_OPTIM, **{name: name for name in (*LOW_BIT, *TORCHAO_OPTIM)}}

# FSDP options (transformers' FSDPOption) and what each is here
_FSDP = {"full_shard": "fsdp", "shard_grad_op": "fsdp-no-reshard"}


@dataclass(frozen=True)
class TrainingKnobs:
    """What a ``TrainingArguments`` says, as :func:`nbmem.estimate` knobs."""

    #: estimate's keyword arguments
    knobs: dict[str, Any]
    #: what each setting that matters became, in words
    read: tuple[str, ...]
    #: settings that change memory which nbmem does not estimate (never ignored silently)
    not_understood: tuple[str, ...]


def knobs_from_training_arguments(args: Any, world_size: int | None = None) -> TrainingKnobs:
    """The estimate knobs a ``transformers.TrainingArguments`` (or anything with its attributes) describes.

    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=8, bf16=True, fp16=False,
    ...                        gradient_checkpointing=True, optim="adamw_torch_fused")
    >>> knobs_from_training_arguments(args).knobs
    {'batch_size': 4, 'accumulation': 8, 'hold_output': False, 'precision': 'bf16', 'checkpointing': True, \
'optimizer': 'adamw-fused'}
    """
    knobs: dict[str, Any] = {}
    read: list[str] = []
    unknown: list[str] = []

    def setting(name: str, default: Any = None) -> Any:
        value = getattr(args, name, default)
        return getattr(value, "value", value)  # an enum (OptimizerNames, FSDPOption) by its value

    knobs["batch_size"] = int(setting("per_device_train_batch_size", 8))
    knobs["accumulation"] = int(setting("gradient_accumulation_steps", 1))
    read.append(f"per_device_train_batch_size={knobs['batch_size']}, gradient_accumulation_steps="
                f"{knobs['accumulation']}: batch_size and accumulation")
    # Trainer.training_step: loss = compute_loss(model, inputs) (the model's outputs are not returned), del inputs,
    # then backward(loss): only the loss and what autograd saved live through backward
    knobs["hold_output"] = False
    read.append("the Trainer's step: compute_loss returns the loss alone, so the model's output is gone before "
                "backward: hold_output=False" + (f" (it fetches the step's {knobs['accumulation']} micro-batches before "
                "the first; those not in use, a few bytes of token ids each, are not counted)"
                if knobs["accumulation"] > 1 else ""))
    if setting("bf16", False) and setting("fp16", False):
        unknown.append("bf16=True and fp16=True together (transformers refuses them too)")
    knobs["precision"] = "bf16" if setting("bf16", False) else "fp16" if setting("fp16", False) else "fp32"
    if knobs["precision"] != "fp32":
        read.append(f"{knobs['precision']}=True: {knobs['precision']} autocast over fp32 weights, as the Trainer's AMP")
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing; both may be there
    if setting("activation_checkpointing", False) or setting("gradient_checkpointing", False):
        knobs["checkpointing"] = True
        options = dict(setting("activation_checkpointing_kwargs") or setting("gradient_checkpointing_kwargs") or {})
        # the Trainer passes every_n_layers and offload to the model's switch, the rest to torch's checkpoint;
        # nbmem turns the switch on non-reentrant, every layer, nothing offloaded
        changed = {key: value for key, value in options.items()
                   if (key, value) not in (("every_n_layers", 1), ("offload", False), ("use_reentrant", False))
                   and key in ("every_n_layers", "offload", "use_reentrant")}
        unknown += [f"activation checkpointing {key}={value!r} (nbmem checkpoints every layer, non-reentrant, "
                    "nothing offloaded)" for key, value in changed.items()]
        rest = {key: value for key, value in options.items() if key not in changed}
        read.append("gradient checkpointing: the model's own switch, as the Trainer turns it on, every layer, "
                    "non-reentrant" + (f" (its kwargs {rest} change no memory nbmem counts)" if rest else ""))
    optim = str(setting("optim", "adamw_torch"))
    if optim in OPTIM:
        knobs["optimizer"] = OPTIM[optim]
        if optim != "adamw_torch":
            read.append(f"optim={optim!r}: " + ("transformers' Adafactor with the Trainer's arguments"
                                                if optim == "adafactor" else
                                                "bitsandbytes' own optimizer, as the Trainer builds it" if optim in LOW_BIT
                                                else "torchao's own optimizer, as the Trainer builds it"
                                                if optim in TORCHAO_OPTIM
                                                else repr(OPTIM[optim])))
    else:
        unknown.append(f"optim={optim!r} (nbmem estimates {', '.join(OPTIM)})")
    if setting("optim_args"):
        unknown.append(f"optim_args={setting('optim_args')!r}")
    _read_fsdp(setting, knobs, read, unknown, world_size)
    if setting("deepspeed"):
        _read_deepspeed(setting("deepspeed"), knobs, read, unknown, world_size if world_size is not None else
                        int(setting("world_size", 1) or 1))
    if setting("label_smoothing_factor", 0):
        unknown.append(f"label_smoothing_factor={setting('label_smoothing_factor')!r} (the Trainer takes the labels "
                       "out and smooths the loss over the logits itself: not the model's own loss nbmem runs)")
    if setting("torch_compile", False):
        mode, backend = setting("torch_compile_mode"), setting("torch_compile_backend")
        if mode not in (None, "default"):
            unknown.append(f"torch_compile_mode={mode!r} (nbmem plans inductor's default mode; CUDA graphs and "
                           "autotuning are not modelled)")
        if backend not in (None, "inductor"):
            unknown.append(f"torch_compile_backend={backend!r} (nbmem plans inductor's memory)")
        if knobs.get("parallel", "single") == "single":
            knobs["compile"] = True
            read.append("torch_compile=True: compile=True (inductor plans the step on fake tensors)")
        else:
            read.append(f"torch_compile=True: estimated as the eager step (compile=True is estimated on one device, "
                        f"and this is {knobs['parallel']})")
    if setting("use_liger_kernel", False):
        unknown.append("use_liger_kernel=True (Liger's fused kernels hold less than the model's own)")
    return TrainingKnobs(knobs, tuple(read), tuple(unknown))


def _read_fsdp(setting: Callable[..., Any], knobs: dict[str, Any], read: list[str], unknown: list[str],
               world_size: int | None) -> None:
    """FSDP as transformers 5 says it (fsdp=True, fsdp_config's reshard_after_forward, cpu_offload) or 4 (a list of
    FSDPOption such as "full_shard auto_wrap")."""
    fsdp = setting("fsdp") or False
    config = dict(setting("fsdp_config") or {})
    size = world_size if world_size is not None else int(setting("world_size", 1) or 1)
    version = config.pop("version", config.pop("fsdp_version", 2))
    if fsdp and str(version) != "2":
        unknown.append(f"fsdp_config version={version!r} (FSDP1: nbmem estimates FSDP2, fully_shard)")
    if fsdp is True:
        reshard = config.pop("reshard_after_forward", True)
        if isinstance(reshard, str):  # transformers reads it with str_to_bool
            reshard = reshard.strip().lower() in ("y", "yes", "t", "true", "on", "1")
        strategy = "fsdp" if reshard else "fsdp-no-reshard"
        said = f"fsdp=True, reshard_after_forward={strategy == 'fsdp'}"
    elif fsdp:
        options = [getattr(option, "value", option) for option in (fsdp.split() if isinstance(fsdp, str) else fsdp)]
        unknown += [f"fsdp option {option!r}" for option in options
                    if option not in _FSDP and option not in ("auto_wrap", "offload")]
        if "offload" in options:
            config["cpu_offload"] = True
        config.pop("reshard_after_forward", None)  # the options say it
        strategies = [_FSDP[option] for option in options if option in _FSDP]
        strategy, said = (strategies[0] if strategies else ""), f"fsdp={' '.join(options)}"
    else:
        strategy = ""
    if strategy:
        knobs["parallel"], knobs["world_size"] = strategy, size
        read.append(f"{said}: parallel={strategy!r} on {size} GPUs")
        if size < 2:
            unknown.append("FSDP on one process: pass world_size= (how many GPUs the run shards over)")
        layers = config.pop("transformer_layer_cls_to_wrap", None) or config.pop("fsdp_transformer_layer_cls_to_wrap", None)
        if layers:
            names = [layers] if isinstance(layers, str) else list(layers)
            knobs["block"] = names[0]
            read.append(f"transformer_layer_cls_to_wrap={names[0]!r}: block={names[0]!r}")
            if len(names) > 1:
                unknown.append(f"more than one layer class to wrap ({', '.join(names)}): the first is used")
        if config.pop("activation_checkpointing", False):
            knobs["checkpointing"] = True
            read.append("fsdp_config activation_checkpointing: checkpointing=True")
        for key in ("cpu_offload", "offload_params", "fsdp_offload_params"):
            if config.pop(key, False):
                knobs["cpu_offload"] = True
                read.append(f"fsdp_config {key}: cpu_offload=True (FSDP2's CPUOffloadPolicy)")
        if config.pop("min_num_params", 0):
            unknown.append("fsdp_config min_num_params (units chosen by size are not estimated: block= names them)")
        policy = config.pop("auto_wrap_policy", None)
        if policy not in (None, "TRANSFORMER_BASED_WRAP"):
            unknown.append(f"fsdp_config auto_wrap_policy={policy!r} (nbmem shards each repeated block as a unit)")
        unknown += [f"fsdp_config {key}={value!r}" for key, value in config.items() if key not in _FSDP_HARMLESS]
    elif size > 1:
        knobs["parallel"], knobs["world_size"] = "ddp", size
        read.append(f"{size} processes, no FSDP: parallel='ddp'")


# fsdp_config keys that change no memory nbmem counts (FSDP2 and the launcher's own switches)
_FSDP_HARMLESS = frozenset({"xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "sync_module_states", "use_orig_params",
                            "limit_all_gathers", "forward_prefetch", "backward_prefetch", "state_dict_type",
                            "cpu_ram_efficient_loading", "activation_cpu_offload"})
# DeepSpeed's ZeRO stages and what each is estimated as (PyTorch's counterparts: nbmem.estimation.parallel)
_ZERO_STAGES = {1: "zero1", 2: "zero2", 3: "zero3"}
# DeepSpeed's own buffers, which nbmem does not model: a number given for one is said, never ignored
_BUCKETS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
            "stage3_max_reuse_distance", "sub_group_size")


def _read_deepspeed(config: Any, knobs: dict[str, Any], read: list[str], unknown: list[str], size: int) -> None:
    """A DeepSpeed configuration (a dict or a JSON file's path, as TrainingArguments(deepspeed=) takes it)."""
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        import json

        try:
            with open(config) as file:
                config = json.load(file)
        except (OSError, ValueError) as error:
            unknown.append(f"deepspeed={config!r} (not a readable JSON file: {error}; pass its settings as knobs "
                           "instead: parallel='zero3', world_size=, cpu_offload=)")
            return
    if not isinstance(config, Mapping):
        unknown.append(f"deepspeed={config!r} (a dict or a JSON file's path is read)")
        return
    if config.get("optimizer"):  # the Trainer then builds DeepSpeed's optimizer, not args.optim
        unknown.append(f"deepspeed optimizer {(config['optimizer'] or {}).get('type', '?')!r} (the Trainer builds "
                       "DeepSpeed's own, not optim=: pass optimizer= for it)")
    zero = dict(config.get("zero_optimization") or {})
    stage = zero.get("stage", 0)
    strategy = _ZERO_STAGES.get(stage, "ddp" if stage == 0 and size > 1 else "")
    if stage not in (0, 1, 2, 3):
        unknown.append(f"deepspeed zero_optimization stage {stage!r} (stages 0 to 3 exist)")
    if strategy:
        knobs["parallel"], knobs["world_size"] = strategy, size
        read.append(f"deepspeed ZeRO stage {stage}: parallel={strategy!r} on {size} GPUs"
                    + (", PyTorch's counterpart; DeepSpeed's own communication buckets are not modelled"
                       if stage >= 2 else ""))
        if size < 2:
            unknown.append("DeepSpeed on one process: pass world_size= (how many GPUs the run spans)")
    offload = {part: str((zero.get(f"offload_{part}") or {}).get("device", "none")) for part in ("param", "optimizer")}
    if offload == {"param": "cpu", "optimizer": "cpu"} and stage == 3:
        knobs["cpu_offload"] = True
        read.append("deepspeed offload_param and offload_optimizer to the CPU: cpu_offload=True (FSDP2's "
                    "CPUOffloadPolicy, which offloads both)")
    elif offload != {"param": "none", "optimizer": "none"}:
        unknown.append(f"deepspeed offload (param to {offload['param']}, optimizer to {offload['optimizer']}): only "
                       "stage 3 with both on the CPU is estimated (cpu_offload=True); ZeRO-Offload of the optimizer "
                       "alone keeps the parameters on the GPU, which FSDP2's offload does not")
    unknown += [f"deepspeed {key}={zero[key]!r} (DeepSpeed's own buffers are not modelled)" for key in _BUCKETS
                if isinstance(zero.get(key), (int, float)) and not isinstance(zero.get(key), bool)]
    for precision in ("bf16", "fp16"):
        enabled = (config.get(precision) or {}).get("enabled", False)
        if enabled is True and knobs["precision"] != precision:
            unknown.append(f"deepspeed {precision} enabled while the arguments say {knobs['precision']} (set "
                           f"{precision}=True in the arguments, or precision={precision!r})")
    if knobs["precision"] in ("bf16", "fp16") and stage >= 2:
        # DeepSpeed does not autocast: its engine computes in bf16/fp16 weights and keeps fp32 master copies in the
        # optimizer's partitions, as FSDP2's mixed precision does with fp32 shards
        knobs["mp_policy"], knobs["precision"] = knobs["precision"], "fp32"
        read.append(f"{knobs['mp_policy']} under DeepSpeed ZeRO stage {stage}: mp_policy={knobs['mp_policy']!r} "
                    f"({knobs['mp_policy']} weights gathered and computed in, fp32 master shards and state), not autocast")
    elif knobs["precision"] in ("bf16", "fp16") and strategy:
        unknown.append(f"deepspeed {knobs['precision']} at stage {stage} ({knobs['precision']} weights with fp32 "
                       "master copies, estimated as autocast over fp32 weights)")


def estimate_trainer(source: Any, model: Any = None, batch: Any = None, *, strict: bool = True,
                     world_size: int | None = None, **knobs: Any) -> Estimate:
    """Estimate the training step a Hugging Face ``Trainer`` or ``TrainingArguments`` describes.

    ``source`` is a ``Trainer`` (its model, its train dataset through its
    data collator as the batch, its arguments) or a ``TrainingArguments``, or
    a dict of them (then pass ``model``, a module or a function that builds
    one, and ``batch``, a function of the batch size, as to
    :func:`nbmem.estimate`).
    Settings that change memory and that nbmem does not estimate raise
    ValueError naming them (``strict=False`` estimates without them and lists
    them in the notes); ``world_size`` is how many GPUs an FSDP or DDP run
    spans (the arguments know only this process). Any other keyword is an
    :func:`nbmem.estimate` knob and wins over the arguments (``device="A10G"``,
    ``optimizer="adamw"`` in place of one not understood).

    Example (with transformers installed)::

        args = TrainingArguments("out", per_device_train_batch_size=8, bf16=True, gradient_checkpointing=True)
        print(nbmem.estimate_trainer(args, model=build, batch=make_batch, device="A10G"))
        print(nbmem.estimate_trainer(trainer, device="A10G", mode="tracked"))   # a real step of it, on this CPU
    """
    args = getattr(source, "args", source)
    if isinstance(args, Mapping):  # the arguments as a dict (TrainingArguments(**it) may refuse bf16 on a CPU)
        args = SimpleNamespace(**{"per_device_train_batch_size": 8, **_checked_keys(args)})
    if isinstance(args, type):
        raise TypeError(f"estimate_trainer reads an instance: pass {args.__name__}(...) as your run makes it, not the "
                        "class")
    if not hasattr(args, "per_device_train_batch_size"):
        raise TypeError(f"estimate_trainer reads a transformers Trainer or TrainingArguments, not "
                        f"{type(source).__name__}")
    if model is None:
        model = getattr(source, "model", None)
        if model is None:
            raise ValueError("pass model= (a module or a function that builds one): TrainingArguments have no model")
    if batch is None:
        batch = _dataset_batches(source)
    read = knobs_from_training_arguments(args, world_size)
    found, reads, not_understood = dict(read.knobs), list(read.read), list(read.not_understood)
    own = _unwrapped(getattr(source, "optimizer", None)) if source is not args else None
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "adamw_torch")))
    if own is None or "optimizer" in knobs:  # none (yet), or a knob stands for it
        pass
    elif _built_from(own, optim):  # the one the Trainer built from optim= (it keeps it after training)
        reads.append(f"the Trainer's optimizer: {type(own).__name__}, as optim={optim!r} builds it")
    elif type(own).__module__.startswith("torch.optim."):  # Trainer(optimizers=(...)): its class and defaults
        found["optimizer"], said = rebuilt_optimizer(own)
        not_understood = [text for text in not_understood
                          if not text.startswith(("optim=", "optim_args=", "deepspeed optimizer"))]
        reads = [text for text in reads if not text.startswith("optim=")] + [f"the Trainer's optimizer: {said}"]
    else:  # another library's, given to the Trainer: its state is not read from its class
        not_understood.append(f"the Trainer's own optimizer {type(own).__module__}.{type(own).__name__} (pass "
                              "optimizer= the name or a factory that builds it)")
    settings = {**found, **knobs}
    if "step" in knobs:
        settings.pop("hold_output", None)  # the user's step holds what it holds
    if settings.get("mode", "estimated") != "estimated" and settings.get("compile") and "compile" not in knobs:
        settings["compile"] = False  # a real run of the step here: torch_compile's plan is an estimate's
    # a knob given explicitly answers for the setting it replaces
    unresolved = [text for text in not_understood if not _overridden(text, knobs)]
    if strict:
        refuse_unestimated("training", unresolved, "Pass the knob that stands for each (optimizer=..., world_size=...), "
                           "or strict=False to estimate without them")
    return with_reading(estimate(model, batch, **settings), "the training arguments", tuple(reads), unresolved)


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer under accelerate's AcceleratedOptimizer, which the Trainer keeps after training."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _built_from(optimizer: Any, optim: str) -> bool:
    """Whether ``optimizer`` is what the Trainer builds for ``optim`` (a name nbmem reads): the same library's class,
    and for torch.optim's the same class and fused setting."""
    if optim not in OPTIM:
        return False
    module, name = type(optimizer).__module__, type(optimizer).__name__
    if optim in LOW_BIT:
        return module.startswith("bitsandbytes")
    if optim in TORCHAO_OPTIM:
        return module.startswith("torchao")
    if optim == "adafactor":
        return name == "Adafactor"
    knob = str(OPTIM[optim])
    fused = any(group.get("fused") for group in optimizer.param_groups)
    return module.startswith("torch.optim.") and name.lower() == knob.removesuffix("-fused").replace("-", "") \
        and fused == knob.endswith("-fused")


def rebuilt_optimizer(optimizer: Any) -> tuple[Callable[..., Any], str]:
    """A factory that builds ``optimizer``'s class again with its defaults over new parameters, and what it says.

    Where neither ``foreach`` nor ``fused`` is set, a torch.optim optimizer
    gets ``foreach=True``: CUDA's default, where fake CPU tensors would loop
    tensor by tensor (nbmem.estimation.optimizers.target_optimizer_kwargs).

    >>> import torch
    >>> factory, said = rebuilt_optimizer(torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9))
    >>> said
    'SGD with its defaults (foreach=True, as CUDA defaults)'
    >>> factory([torch.zeros(3, requires_grad=True)]).defaults["momentum"]
    0.9
    """
    optimizer = _unwrapped(optimizer)
    kind = type(optimizer)
    accepted = inspect.signature(kind).parameters
    takes_any = any(parameter.kind is parameter.VAR_KEYWORD for parameter in accepted.values())
    defaults = {key: value for key, value in getattr(optimizer, "defaults", {}).items()
                if takes_any or key in accepted}
    said = f"{kind.__name__} with its defaults"
    if "foreach" in accepted and defaults.get("foreach") is None and not defaults.get("fused"):
        defaults["foreach"] = True
        said += " (foreach=True, as CUDA defaults)"

    def build(parameters: Any) -> Any:
        return kind(parameters, **defaults)

    build.__name__ = build.__qualname__ = kind.__name__
    return build, said


def refuse_unestimated(what: str, settings: list[str] | tuple[str, ...], fix: str) -> None:
    """The error for settings that change memory and that nbmem does not estimate (none: nothing to say)."""
    if settings:
        raise ValueError(f"these {what} settings change memory and nbmem does not estimate them: "
                         + "; ".join(settings) + f". {fix}")


def with_reading(result: Estimate, source: str, read: tuple[str, ...], unestimated: list[str] | tuple[str, ...],
                 *more: str) -> Estimate:
    """``result`` with notes first on what each setting of ``source`` became and what was not estimated."""
    notes = [f"from {source}: {text}" for text in read] + [f"not estimated: {text}" for text in unestimated]
    return dataclasses.replace(result, notes=(*notes, *more, *result.notes))


def _overridden(text: str, knobs: dict[str, Any]) -> bool:
    return ("optimizer" in knobs and text.startswith(("optim=", "optim_args="))) or \
        ("world_size" in knobs and "world_size=" in text)


def _checked_keys(arguments: Mapping[str, Any]) -> Mapping[str, Any]:
    """A dict of training arguments, each key one of TrainingArguments' fields (where transformers is here)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return arguments
    import difflib

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    wrong = [key for key in arguments if key not in fields]
    if wrong:
        hints = [f"{key!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(key, fields, 1))
                               else "") for key in wrong]
        deepspeed = {"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "zero_allow_untested_optimizer",
                     "gradient_clipping", "steps_per_print", "wall_clock_breakdown"} & set(wrong)
        more = (". They look like a DeepSpeed configuration: pass it as TrainingArguments' deepspeed=, e.g. "
                "{'deepspeed': config, 'per_device_train_batch_size': 8, 'bf16': True}" if deepspeed else "")
        raise TypeError(f"not TrainingArguments settings: {', '.join(hints)}{more}")
    return arguments


def _dataset_batches(trainer: Any) -> Callable[[int], Any]:
    """A Trainer's batches: its train dataset's first examples (repeated if it has fewer), through its collator."""
    dataset, collate = getattr(trainer, "train_dataset", None), getattr(trainer, "data_collator", None)
    if dataset is None or collate is None:
        raise ValueError("pass batch= (a function of the batch size): this has no train dataset and data collator "
                         "to make batches from")
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"the Trainer's train dataset ({type(dataset).__name__}) can't be indexed (an iterable "
                         "dataset): pass batch= (a function of the batch size)")
    if len(dataset) == 0:
        raise ValueError("the Trainer's train dataset is empty: pass batch= (a function of the batch size)")

    def batch(size: int) -> Any:
        if not estimating():  # a real run (mode="tracked" or "measured"): the real examples
            return collate([dataset[index % len(dataset)] for index in range(size)])
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the dataset's tensors are real: collated outside the fake mode
            real = collate([dataset[index % len(dataset)] for index in range(size)])
        # and made again inside it with their shapes and dtypes (an estimate needs no values)
        return tree_map(lambda value: torch.empty(value.shape, dtype=value.dtype)
                        if isinstance(value, torch.Tensor) else value, real)

    return batch
