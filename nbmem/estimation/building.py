"""Nbmem's own copy of the user's model, ready for a step: built under fake tensors or copied,
with the precision and activation checkpointing asked for.

Used by :mod:`nbmem.estimation.estimate`; nothing here runs a step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .fakemode import new_fake_mode

__all__ = ["fresh_model", "repeated_blocks", "apply_precision_and_checkpointing", "new_fake_mode", "FAKE_ERRORS",
           "without_onednn", "default_device", "fake_failure", "materialize_meta"]


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
#: What a factory raises when its constructor can't run on fake tensors: FAKE_ERRORS, and the
#: RuntimeError of module.to(), which can't swap fake tensors in place (PEFT moves its adapters so)
_FAKE_BUILD_ERRORS: tuple[type[BaseException], ...] = (*FAKE_ERRORS, RuntimeError)


def fresh_model(
    model: Any, fake_mode: Any, device: torch.device, notes: list[str] | None = None, require_trainable: bool = True
) -> nn.Module:
    """A model of nbmem's own on ``device``: built by the factory, or copied (as fake tensors when estimating).

    Call it inside ``fake_mode`` (and inside the tracker, which then sees the
    copy's parameters born). A factory whose constructor reads tensor values
    (timm's drop-path rates: ``.item()``, ``.tolist()``), which fake tensors
    can't answer, is built for real with its parameters and buffers on the
    meta device, as accelerate's ``init_empty_weights`` does, and those are
    then made fake; ``notes`` says so. A model with nothing to train is a
    ValueError that says what to do (unless ``require_trainable`` is False:
    the caller chooses what trains, nbmem.estimation.finetune).

    >>> copied = fresh_model(nn.Linear(4, 2), None, torch.device("cpu"))
    >>> copied.weight.shape
    torch.Size([2, 4])
    """
    if isinstance(model, nn.Module):
        built = _copied(model, fake_mode, device)
        in_place = [name or "the model" for name, module in model.named_modules()
                    if getattr(module, "_compiled_call_impl", None) is not None]
        if in_place and notes is not None:
            notes.append(f"compiled in place (Module.compile()): {', '.join(in_place[:3])}"
                         f"{' and more' if len(in_place) > 3 else ''}; a copy of a module does not keep that, so the "
                         "estimate runs it as written: eagerly, or with compile=True compiled again with inductor's "
                         "defaults")
    elif callable(model):
        built = _built(model, fake_mode, device, notes if notes is not None else [])
    else:
        raise ValueError(f"model must be a torch.nn.Module or a function that builds one, got {type(model).__name__}")
    if require_trainable:
        _check_trainable(built)
    return built


def _copied(model: nn.Module, fake_mode: Any, device: torch.device) -> nn.Module:
    # Copy the module's structure, with every parameter and buffer replaced by
    # a new tensor of the same shape: the memo makes deepcopy use them.
    memo: dict[int, Any] = {}
    if fake_mode is None:
        # Real copies made from nothing the tracker sees: reading the user's
        # own tensors through an op would make the tracker adopt them, one
        # full copy of the parameters too many (issue 11: ResNet-18 +44.6 MiB).
        from torch.utils._mode_utils import no_dispatch
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        def real(tensor: torch.Tensor) -> torch.Tensor:
            if is_traceable_wrapper_subclass(tensor):  # torchao's quantized weights: copy what they wrap
                names, meta = tensor.__tensor_flatten__()
                inner = {name: real(getattr(tensor, name)) for name in names}
                return type(tensor).__tensor_unflatten__(inner, meta, tensor.size(), tensor.stride())
            copied = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            with no_dispatch(), torch.no_grad():
                copied.copy_(tensor.detach())
            return copied

        make = real
    else:
        make = fake_mode.from_tensor
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(make(parameter), requires_grad=parameter.requires_grad)
        if fake_mode is not None and type(parameter).__module__.startswith("bitsandbytes."):
            # a model bitsandbytes quantized: the fake weight carries its state, made fake too (shared with its
            # layer's own quant_state through the memo)
            from .quantization import fake_quant_attributes

            for name, value in fake_quant_attributes(parameter, make, memo).items():
                setattr(memo[id(parameter)], name, value)
    if fake_mode is not None and any(type(module).__module__.startswith("bitsandbytes.") for module in model.modules()):
        from .quantization import fake_layer_states

        fake_layer_states(model, make, memo)
    for buffer in model.buffers():
        memo[id(buffer)] = make(buffer)
    copied: nn.Module = copy.deepcopy(model, memo)
    return copied.to(device) if fake_mode is None else copied


def _built(factory: Callable[[], Any], fake_mode: Any, device: torch.device, notes: list[str]) -> nn.Module:
    copies = _FakeDeepcopy() if fake_mode is not None else contextlib.nullcontext()
    try:
        with copies, default_device(device):
            built = factory()
    except _FAKE_BUILD_ERRORS as error:
        # Fake tensors can't answer a constructor's .item()/.tolist() (timm's drop-path
        # rates), nor be swapped in place by module.to() (PEFT moves its adapters so).
        if fake_mode is None:
            raise
        why = fake_failure(error)
        _release_failed_build(error)
        built = _built_with_empty_weights(factory, device, why, error)
        notes.append(
            f"the model's constructor can't run on fake tensors ({why}): nbmem built it for real with its "
            "parameters and buffers on the meta device (as accelerate's init_empty_weights does), then made "
            "those fake"
        )
    except Exception as error:
        if _is_download_error(error):
            raise ValueError(
                f"the model factory failed to download or read files ({type(error).__name__}, chained above). nbmem "
                "needs only the model's structure, never its weights: build it from a config with random weights, "
                "e.g. AutoModelForCausalLM.from_config(GPT2Config(...)) for Hugging Face or "
                "timm.create_model(name, pretrained=False); when estimating, nothing is allocated"
            ) from error
        raise
    if not isinstance(built, nn.Module):
        raise ValueError(f"the model factory must return a torch.nn.Module, got {type(built).__name__}")
    return built.to(device) if device.type != "cpu" else built


def _built_with_empty_weights(factory: Callable[[], Any], device: torch.device, why: str,
                              first: BaseException) -> nn.Module:
    """Build for real, parameters and buffers on "meta", then give each a fake tensor on ``device``.

    The construction runs outside every dispatch mode (the fake mode and the
    tracker): its temporaries are real and small, and not part of a step.
    Where it fails as the fake build did (``first``'s type) and not for the
    meta device (a bug of the factory's own, such as a shape mismatch), that
    error is raised as it is, with the factory's own traceback.
    """
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )
    from torch.utils._python_dispatch import _disable_current_modes

    def empty_parameter(module: nn.Module, name: str, parameter: Any) -> Any:
        if parameter is None or parameter.is_meta:
            return None
        return nn.Parameter(parameter.detach().to("meta"), requires_grad=parameter.requires_grad)

    def empty_buffer(module: nn.Module, name: str, buffer: Any) -> Any:
        return None if buffer is None or buffer.is_meta else buffer.to("meta")

    hooks = [register_module_parameter_registration_hook(empty_parameter),
             register_module_buffer_registration_hook(empty_buffer)]
    try:
        with _disable_current_modes():
            built = factory()
    except Exception as error:
        if type(error) is type(first) and "meta" not in str(error).lower():
            raise  # not the fake tensors' nor the meta device's: the factory fails on real tensors too
        raise ValueError(
            f"the model's constructor can't run on fake tensors ({why}), and building it with its "
            f"parameters on the meta device failed too ({type(error).__name__}: {error}). Pass a model you built "
            "instead of a factory (nbmem copies it as fake tensors), or use mode='tracked', which runs it for real"
        ) from error
    finally:
        for hook in hooks:
            hook.remove()
    if not isinstance(built, nn.Module):
        raise ValueError(f"the model factory must return a torch.nn.Module, got {type(built).__name__}")
    # Inside the fake mode and the tracker again: each tensor is born here, as it would be in a fake build.
    materialize_meta(built, device)
    return built


def materialize_meta(model: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of ``model`` on "meta" a new tensor of its shape on ``device``, in place.

    Called inside the fake mode (and the tracker), each tensor is born there as
    in a fake build; tied weights stay tied. Used for constructors that can't
    run on fake tensors, and for PEFT's adapters (nbmem.estimation.finetune).

    >>> layer = nn.Linear(4, 2, device="meta")
    >>> materialize_meta(layer, torch.device("cpu"))
    >>> layer.weight.device, layer.weight.requires_grad
    (device(type='cpu'), True)
    """
    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:  # tied weights stay tied
            new = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
            made[id(tensor)] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        return made[id(tensor)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    table[name] = fake(tensor)  # type: ignore[assignment]


def _release_failed_build(error: BaseException | None) -> None:
    """Let go of what a failed fake build made: its fake parameters and buffers, and its frames' locals.

    The half-built modules sit in reference cycles (a PEFT model and the model
    it wraps point at each other) that only the garbage collector would break,
    and nbmem never runs it: until then the tracker would count their fake
    tensors. Only fake tensors are dropped (all made by this build); a real
    module the factory was given keeps everything.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    while error is not None:
        for frame, _ in traceback.walk_tb(error.__traceback__):
            for value in list(frame.f_locals.values()):
                if isinstance(value, nn.Module):
                    for module in value.modules():
                        for table in (module._parameters, module._buffers):
                            for name, tensor in list(table.items()):
                                if isinstance(tensor, FakeTensor):
                                    table[name] = None
        traceback.clear_frames(error.__traceback__)
        for frame, _ in traceback.walk_tb(error.__traceback__):
            frame.f_locals.clear()  # the dict f_locals cached on the frame when it was read above
        error = error.__cause__ or error.__context__


def _check_trainable(model: nn.Module) -> None:
    """A training step needs something to train: say so plainly rather than let torch fail inside the step."""
    parameters = list(model.parameters())
    if not parameters:
        raise ValueError(
            f"the model ({type(model).__name__}) has no parameters, so a training step has nothing to update: "
            "for the memory of a forward pass, run it under nbmem.track() (with torch.no_grad() for inference)"
        )
    if not any(parameter.requires_grad for parameter in parameters):
        raise ValueError(
            f"every parameter of the model ({type(model).__name__}) is frozen (requires_grad=False), so a training "
            "step has nothing to update: unfreeze what you train (e.g. model.head.requires_grad_(True)), or for "
            "inference run the forward pass under nbmem.track() with torch.no_grad()"
        )


def _is_download_error(error: BaseException) -> bool:
    """An error from fetching weights or configs: an OSError (Hugging Face wraps its hub errors in one) or an
    error of huggingface_hub or an HTTP library, anywhere in the chain of causes."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) or type(seen).__module__.split(".")[0] in _NETWORK_LIBRARIES:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_NETWORK_LIBRARIES = ("huggingface_hub", "requests", "httpx", "urllib3")


def fake_failure(error: BaseException) -> str:
    """What fake tensors could not do, and where: the op, the innermost module and the source line.

    The module comes from the frames of the error's traceback: the innermost
    ``self`` that is a module, named by its path from the outermost one.
    """
    op = getattr(error, "func", None)
    what = f"{type(error).__name__} in {op}" if op is not None else f"{type(error).__name__}: {error}"
    if "_local_scalar_dense" in str(op) or "tolist" in str(op):
        what += " (.item(), .tolist() or a Python bool of a tensor)"
    modules: list[nn.Module] = []
    line = None
    libraries = (os.path.dirname(torch.__file__), str(Path(__file__).parents[1]))  # torch's frames and nbmem's
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            modules.append(owner)
        if not frame.f_code.co_filename.startswith(libraries):
            line = f"{frame.f_code.co_filename}:{lineno}"
    if modules:
        names = {id(module): name for name, module in modules[0].named_modules()}
        inner = modules[-1]
        what += f", in module {names.get(id(inner)) or '(the model)'} ({type(inner).__name__})"
    if line is not None:
        what += f", at {line}"
    return what


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


#: Modules that hold blocks without being one: never the block nbmem checkpoints or shards.
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def repeated_blocks(model: nn.Module) -> type[nn.Module] | None:
    """The block type to checkpoint and to shard as FSDP units, chosen as a person would (issue 24).

    The type whose instances stand side by side in a container (a
    transformer's layers, a ResNet stage's bottlenecks), the outermost such,
    the most numerous on a tie; else the outermost module type with
    parameters and children that repeats, a bare container (``Sequential``,
    ``ModuleList``, ``ModuleDict``) only where nothing else repeats (a model
    made of Sequentials). torchvision's ViT keeps its head in a ``Sequential``
    above the encoder's, which made the whole encoder one block.

    >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64), 3, enable_nested_tensor=False)
    >>> repeated_blocks(encoder).__name__
    'TransformerEncoderLayer'
    """
    depths: dict[type, list[int]] = {}
    stacked: dict[type, int] = {}  # a block type -> the most instances of it side by side in one container

    def composite(module: nn.Module) -> bool:
        return any(True for _ in module.children()) and any(True for _ in module.parameters())

    for name, module in model.named_modules():
        if type(module) in CONTAINERS:
            counts: dict[type, int] = {}
            for child in module.children():
                if type(child) not in CONTAINERS and composite(child):
                    counts[type(child)] = counts.get(type(child), 0) + 1
            for kind, count in counts.items():
                stacked[kind] = max(stacked.get(kind, 0), count)
        if name and composite(module):
            depths.setdefault(type(module), []).append(name.count("."))
    side_by_side = [(min(depths[kind]), -count, kind) for kind, count in stacked.items() if count >= 2 and kind in depths]
    if side_by_side:
        return min(side_by_side, key=lambda item: item[:2])[2]
    repeated = [(kind in CONTAINERS, min(levels), kind) for kind, levels in depths.items() if len(levels) >= 2]
    return min(repeated, key=lambda item: item[:2])[2] if repeated else None


def block_rule(model: nn.Module, block: Any) -> tuple[Callable[[nn.Module], bool] | None, str]:
    """What ``block=`` names, as a test over modules, and the name a result gives it (None: no block found).

    ``block`` is a module class, a class name, a predicate over modules, or
    None (:func:`repeated_blocks` chooses). A name no module of the model has
    raises ValueError listing the candidates.
    """
    if block is None:
        kind = repeated_blocks(model)
        if kind is None:
            return None, "no repeated block"
        return (lambda module: isinstance(module, kind)), kind.__name__
    if isinstance(block, type):
        return (lambda module: isinstance(module, block)), block.__name__
    if isinstance(block, str):
        names = {type(module).__name__ for module in model.modules()}
        if block not in names:
            found = sorted({type(module).__name__ for module in model.modules()
                            if type(module) not in CONTAINERS and any(True for _ in module.children())})
            raise ValueError(f"block={block!r} names no module of this model; the types it has with submodules: "
                             f"{', '.join(found) or 'none'}")
        return (lambda module: type(module).__name__ == block), block
    return block, f"where {getattr(block, '__name__', 'your predicate')} says"


def check_block(block: Any) -> None:
    """block= must be None, an nn.Module class, a class name or a predicate: say what to pass otherwise."""
    if block is None or isinstance(block, str) or (isinstance(block, type) and issubclass(block, nn.Module)):
        return
    if callable(block) and not isinstance(block, type):
        return
    raise ValueError(f"block={block!r} can't name a block: pass a module class (LlamaDecoderLayer), its name "
                     "('LlamaDecoderLayer'), or a predicate over modules (lambda module: ...)")


def apply_precision_and_checkpointing(model: nn.Module, precision: str, checkpointing: Any, notes: list[str],
                                      block: Any = None, saves: Any = None) -> str:
    if precision.endswith("-weights"):
        # module.to() swaps fake tensors in place, which FakeTensorMode's own weak
        # references forbid: give nbmem's copy new parameters of the new dtype.
        # One new tensor per old one, so that tied weights (GPT-2's embedding and head) stay tied, as
        # module.to() keeps them; a new one per reference held the tied weight twice.
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        converted: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for name, parameter in module._parameters.items():
                if parameter is not None and parameter.is_floating_point():
                    if id(parameter) not in converted:
                        converted[id(parameter)] = nn.Parameter(parameter.detach().to(dtype), parameter.requires_grad)
                    module._parameters[name] = converted[id(parameter)]  # type: ignore[assignment]
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = converted.setdefault(id(buffer), buffer.to(dtype))
    if not checkpointing:
        return "off"
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None):
        # transformers' own reason for turning the KV cache off under checkpointing: the recomputed
        # forward appends to it a second time and the attention shapes stop matching (issue 11).
        # Off in a copy of the config: a factory may build every model from one config the user
        # keeps (`build = lambda: LlamaForCausalLM(config)`), whose next model (a sweep's next
        # configuration, the user's own) must keep its cache (notebook 08 found this).
        _own_config(model, config).use_cache = False
        notes.append("checkpointing: Hugging Face's KV cache turned off (use_cache=False), as transformers does")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    extra: dict[str, Any] = {}
    kept = ""
    if saves is not None:
        from .selective import context_factory, saves_label

        extra["context_fn"] = context_factory(saves)
        kept = f", keeping {saves_label(saves)}"
        notes.append(f"checkpointing: selective, each checkpointed block keeps the outputs of {saves_label(saves)} "
                     "and recomputes the rest (torch.utils.checkpoint.create_selective_checkpoint_contexts)")
    if callable(checkpointing):
        check, chosen = checkpointing, f"on (your predicate{kept})"
    else:
        own = _own_checkpointing(model, extra) if block is None else None
        if own is not None:
            notes.append(
                f"checkpointing: the model's own switch ({own}), as its library trains with it; "
                "block= (a class, its name or a predicate) chooses the blocks instead"
            )
            return f"on ({own}{kept})"
        rule, label = block_rule(model, block)
        if rule is None:
            notes.append("checkpointing: no repeated block with parameters found; name one with block= (a class, "
                         "its name or a predicate)")
            return "off (no repeated block)"
        check, chosen = rule, f"on ({label}{kept})"
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=check)
    return chosen


def _own_config(model: nn.Module, config: Any) -> Any:
    """A shallow copy of ``config`` for ``model`` and each of its submodules that shared it (a Hugging Face
    model's modules hold the one config object they were built from); the copy."""
    own = copy.copy(config)
    for module in model.modules():
        if module.__dict__.get("config") is config:
            module.config = own
    return own


def _own_checkpointing(model: nn.Module, extra: dict[str, Any] | None = None) -> str | None:
    """Turn on the model's library's own activation checkpointing, if it has one; say which (None: it has none).

    Hugging Face: ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
    before transformers 5), non-reentrant as transformers' default; the caller has
    turned the KV cache off (``config.use_cache = False``), as transformers does
    itself: under checkpointing the recomputed forward would append to the cache
    a second time (transformers' modeling_layers.GradientCheckpointingLayer). timm:
    ``set_grad_checkpointing()``. Their choice of blocks can save more than
    nbmem's repeated block (T5's stacks, timm's stages). A PEFT model passes
    these through to the model it wraps. ``extra`` (selective checkpointing's
    ``context_fn``) goes to ``torch.utils.checkpoint.checkpoint`` where the
    library passes keywords on (Hugging Face); timm's switch takes none, so
    then nbmem's own wrapper serves (None returned).
    """
    kwargs = {"use_reentrant": False, **(extra or {})}
    if getattr(model, "supports_gradient_checkpointing", False):
        enable = getattr(model, "activation_checkpointing_enable", None)
        if callable(enable):
            enable(activation_checkpointing_kwargs=kwargs)
            name = "activation_checkpointing_enable"
        else:
            getattr(model, "gradient_checkpointing_enable")(gradient_checkpointing_kwargs=kwargs)
            name = "gradient_checkpointing_enable"
        return f"Hugging Face {name}, use_cache=False"
    enable = getattr(model, "set_grad_checkpointing", None)
    if callable(enable) and not extra:
        enable(True)
        return "timm set_grad_checkpointing"
    return None


def default_device(device: torch.device) -> Any:
    """Factories called inside build on ``device`` (a measured run builds the model and batch there directly)."""
    return device if device.type != "cpu" else contextlib.nullcontext()
