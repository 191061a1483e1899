"""What else a model is used for: a forward pass for serving (``task="inference"``) and text generation
(``task="generate"``), run through the same tracker and fake mode as the training step (:mod:`nbmem.estimation.step`).

``"inference"``: one forward pass of the batch ``batch(batch_size)`` (or
``batch(batch_size, prompt_length)``), the model in eval mode, under
``torch.inference_mode()``: no gradient, nothing saved for backward.

``"generate"`` (a causal language model with a KV cache: a Hugging Face model whose
``can_generate()`` is true): nbmem makes the prompt itself, ``batch_size`` x
``prompt_length`` token ids drawn from the model's vocabulary, unpadded, and runs
greedy decoding as ``GenerationMixin._sample`` does (transformers
generation/utils.py), under ``torch.inference_mode()``: a prefill forward of the
whole prompt into a ``DynamicCache``, then ``new_tokens - 1`` forwards of one token
each through the model's own ``forward(input_ids=next, past_key_values=cache,
use_cache=True)``, which grows the cache (``torch.cat`` per layer,
cache_utils.DynamicLayer.update). Each step keeps only the last position's logits
(``logits_to_keep=1`` where the model takes it, as generate sets), copies them to
float32, takes the argmax and appends it to the ids. A fixed number of steps, no
stopping on an end-of-sequence token: on fake tensors there are no values to stop
on. ``new_tokens`` tokens come out of ``new_tokens`` forwards, so the cache ends
holding ``prompt_length + new_tokens - 1`` positions. No attention mask is passed
(an unpadded batch): a real run with an all-ones mask builds none either
(masking_utils._ignore_causal_mask_sdpa), while on fake tensors, whose values
transformers can't read, a mask would be built, so passing none keeps the estimate
and a real run the same.

The cache's tensors are labelled ``"kv cache"`` in the breakdown; its bytes per
token are measured from its storages' growth over the decode steps (per layer 2 x
kv_heads x head_dim x dtype bytes x batch for a plain attention cache).

>>> check_task("generate", prompt_length=None, new_tokens=8)
Traceback (most recent call last):
    ...
ValueError: task='generate' needs prompt_length (the prompt's tokens per sequence), a whole number >= 1, got None
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .step import AUTOCAST_DTYPES, _forward, prepared_batch

__all__ = ["TASKS", "CacheRecord", "check_task", "sized_batch", "run_inference", "run_generate", "check_generator",
           "standard_attention_path",
           "task_notes", "task_lines"]

#: What a step does: train (forward, backward, optimizer step), one inference forward pass, or generation.
TASKS = ("train", "inference", "generate")

_KV_CACHE = "kv cache"


@dataclass
class CacheRecord:
    """What a generate run measured of its KV cache: bytes at the end, and per token of context."""

    bytes: int = 0
    per_token: int = 0
    tokens: int = 0


def check_task(task: Any, *, prompt_length: Any = None, new_tokens: Any = None, checkpointing: Any = False,
               accumulation: Any = 1, parallel: Any = "single", step: Any = None) -> None:
    """A ValueError that says what to pass, for a task the knobs can't go with."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: use 'train' (the default), 'inference' or 'generate'")
    if prompt_length is not None or task == "generate":
        _whole("prompt_length", "the prompt's tokens per sequence", prompt_length, task)
    if task != "generate" and new_tokens is not None:
        raise ValueError(f"new_tokens is for task='generate' (tokens to generate); task={task!r} generates nothing")
    if task == "generate":
        _whole("new_tokens", "tokens to generate", new_tokens, task)
    if task == "train":
        return
    reasons = (
        (checkpointing is not False, "checkpointing", "it saves nothing for backward, so there is nothing to recompute"),
        (accumulation != 1, "accumulation", "it has no gradients to accumulate"),
        (parallel != "single", "parallel", "nbmem's strategies shard training state; estimate one device"),
        (step is not None, "step", "nbmem runs the forward pass (or the decode loop) itself"),
    )
    for wrong, name, why in reasons:
        if wrong:
            raise ValueError(f"{name}= is for training, not task={task!r}: {why}. Leave {name} unset")


def _whole(name: str, what: str, value: Any, task: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"task={task!r} needs {name} ({what}), a whole number >= 1, got {value!r}")


def sized_batch(batch: Callable[..., Any] | None, prompt_length: int | None) -> Callable[[int], Any]:
    """The batch factory as the step calls it, ``make(batch_size)``: with a context length,
    ``batch(batch_size, prompt_length)``, which the user's factory must accept. Without one
    (``task="generate"`` makes its own prompt), a factory that says so if called.

    >>> make = sized_batch(lambda n, length: torch.zeros(n, length), 128)
    >>> make(2).shape
    torch.Size([2, 128])
    """
    if batch is None:
        return _no_batch
    if not callable(batch):
        # a batch itself, where a function making one was meant (a newcomer's walk through the docs)
        raise TypeError(
            f"batch must be a function that takes a batch size and returns the model's input, got a "
            f"{type(batch).__name__}: nbmem makes a batch of each size it tries, e.g. "
            "batch=lambda n: torch.randn(n, 1024) (or lambda n: {'input_ids': ..., 'labels': ...})")
    if prompt_length is None:
        return batch
    try:
        inspect.signature(batch).bind(1, prompt_length)
    except TypeError as error:
        raise ValueError(
            f"prompt_length={prompt_length} sets the context length, so the batch factory is called as "
            "batch(batch_size, prompt_length); yours takes one argument: write it as "
            "lambda n, length: ... (tokens of that length)"
        ) from error
    except ValueError:  # a builtin without a signature: trust it
        pass
    return lambda size: batch(size, prompt_length)


def _no_batch(batch_size: int) -> Any:
    raise ValueError("this task needs batch, a function that takes a batch size and returns the model's input")


def run_inference(model: nn.Module, batch_fn: Callable[[int], Any], batch_size: int, precision: str,
                  device: torch.device, autocast_region: Callable[..., Any] = torch.autocast) -> None:
    """One forward pass, in eval mode, under ``torch.inference_mode()``; the output is dropped when it returns."""
    dtype = AUTOCAST_DTYPES.get(precision)
    model.eval()
    with torch.inference_mode():
        inputs = prepared_batch(batch_fn, batch_size, precision, device)
        with autocast_region(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            output = _forward(model, inputs)
        del output, inputs


def check_generator(model: nn.Module, prompt_length: int, new_tokens: int) -> None:
    """A ValueError for a model that can't generate with a cache, or a sequence past its positions."""
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        raise ValueError(
            f"task='generate' needs a causal language model with a KV cache (a Hugging Face model whose "
            f"can_generate() is true, e.g. AutoModelForCausalLM.from_config(config)); {type(model).__name__} "
            "is not one: use task='inference' for one forward pass"
        )
    config: Any = model.config
    config = config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_length + new_tokens > limit:
        raise ValueError(
            f"prompt_length + new_tokens = {prompt_length} + {new_tokens} = {prompt_length + new_tokens} tokens is "
            f"beyond the model's maximum position, {type(config).__name__}.max_position_embeddings = {limit}: "
            "shorten the prompt or generate fewer tokens"
        )


def run_generate(model: nn.Module, batch_size: int, prompt_length: int, new_tokens: int, precision: str,
                 device: torch.device, classify: Callable[[torch.Tensor, str], None], record: CacheRecord,
                 autocast_region: Callable[..., Any] = torch.autocast) -> None:
    """Greedy decoding with the model's own cache (see the module docstring); ``record`` gets the cache's bytes."""
    from transformers import DynamicCache

    dtype = AUTOCAST_DTYPES.get(precision)
    full_config: Any = model.config
    config = full_config.get_text_config(decoder=True)
    keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
    model.eval()
    with torch.inference_mode():
        cache = DynamicCache(config=full_config)
        with torch.device(device):
            ids = torch.randint(0, config.vocab_size, (batch_size, prompt_length))
        step_ids = ids
        after_prefill = 0
        for step in range(new_tokens):
            with autocast_region(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
                output = model(input_ids=step_ids, past_key_values=cache, use_cache=True,
                               **({"logits_to_keep": 1} if keep_last else {}))
            if output.past_key_values is not cache:
                raise ValueError(
                    f"task='generate': {type(model).__name__}'s forward did not fill the DynamicCache it was given "
                    "(past_key_values); nbmem can only estimate generation with the model's own KV cache"
                )
            held = _cache_bytes(cache, classify)
            if step == 0:
                after_prefill = held
            # generation/utils.py _sample: a float32 copy of the last logits, the argmax, the ids grown by one
            next_logits = output.logits[:, -1].to(copy=True, dtype=torch.float32)
            del output
            step_ids = torch.argmax(next_logits, dim=-1)[:, None]
            ids = torch.cat([ids, step_ids], dim=-1)
            del next_logits
        tokens = prompt_length + new_tokens - 1
        record.bytes, record.tokens = held, tokens
        # growth per decode step (one token each); with a single forward, the prefill's bytes over its tokens
        record.per_token = (held - after_prefill) // (new_tokens - 1) if new_tokens > 1 else held // prompt_length
        del cache, ids, step_ids


def _cache_bytes(cache: Any, classify: Callable[[torch.Tensor, str], None]) -> int:
    """The cache's tensors labelled "kv cache"; their storages' bytes (unrounded)."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                classify(tensor, _KV_CACHE)
                total += tensor.untyped_storage().nbytes()
    return total


def task_notes(task: str, prompt_length: int | None, new_tokens: int | None) -> list[str]:
    """What a task's estimate assumed, for its notes."""
    if task == "inference":
        return ["inference: one forward pass in eval mode under torch.inference_mode() (no gradients, nothing "
                "saved for backward); no optimizer"]
    if task == "generate":
        return [
            f"generate: greedy decoding as transformers' generate does it, a prefill of {prompt_length} tokens then "
            f"{(new_tokens or 1) - 1} one-token step{'' if new_tokens == 2 else 's'} through the model's own "
            "DynamicCache, under "
            "torch.inference_mode(); a fixed number of steps, no stopping at an end-of-sequence token; nbmem's own "
            "prompt of random token ids, unpadded and without an attention mask (a real run with an all-ones mask "
            "builds none either)",
        ]
    return []


def task_lines(result: Any) -> list[str]:
    """The first lines of an inference or generate estimate's report (:class:`nbmem.Estimate` ``__str__``)."""
    from ..core.units import format_bytes

    how = {
        "estimated": "estimate (estimated on fake tensors, no data, nothing allocated)",
        "tracked": f"run (tracked: run for real on the {result.device}, every tensor accounted)",
        "measured": f"run (measured: run for real on {result.device}, CUDA's caching allocator)",
    }[result.mode]
    context = f", prompt {result.prompt_length} tokens" if result.prompt_length is not None else ""
    generated = f", {result.new_tokens} new tokens" if result.task == "generate" else ""
    lines = [
        f"gpumem {result.task} {how}: batch {result.batch_size}{context}{generated}, {result.precision}",
        f"  parameters       {result.parameters:,}",
        f"  peak             {format_bytes(result.peak)} allocated",
    ]
    if result.task == "generate" and result.kv_cache is not None:
        lines.append(
            f"  KV cache         {format_bytes(result.kv_cache)} at the end, {result.prompt_length + result.new_tokens - 1} "
            f"positions x batch {result.batch_size}: {format_bytes(result.kv_cache_per_token)} per position for the whole "
            f"batch ({result.kv_cache_per_token:,} B, {format_bytes(result.kv_cache_per_token // result.batch_size)} a "
            "sequence)"
        )
    return lines


#: What an inference estimate says where nn.TransformerEncoder's or nn.MultiheadAttention's fast path was turned off
FASTPATH_NOTE = ("inference: PyTorch's fast path for nn.TransformerEncoder and nn.MultiheadAttention (fused kernels, "
                 "a nested tensor for a padding mask) turned off for the estimate, which fake tensors can't run: "
                 "estimated on the standard path, as in training; a real inference run on the fast path may take less")


class standard_attention_path:
    """nn.TransformerEncoder's and nn.MultiheadAttention's inference fast path turned off while an estimate runs, where
    the model has them: with a padding mask it makes a nested tensor, which neither fake tensors nor a tracked run
    can describe (a fuzz of estimates against tracked runs found it crash both). PyTorch's setting as it was after,
    put back by ``__exit__`` or, idempotent, by :meth:`release` (the estimate's own, after a Ctrl-C on
    ``__exit__``'s very entry, where nothing in it can catch one)."""

    def __init__(self, network: nn.Module, notes: list[str]) -> None:
        self._applies = any(isinstance(module, (nn.TransformerEncoderLayer, nn.MultiheadAttention))
                            for module in network.modules())
        self._notes = notes
        self._enabled: bool | None = None  # PyTorch's setting while this has it off

    def __enter__(self) -> None:
        if self._applies:
            self._enabled = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
            self._notes.append(FASTPATH_NOTE)

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        if self._enabled is not None:
            torch.backends.mha.set_fastpath_enabled(self._enabled)
            self._enabled = None
