"""Attention as a GPU runs it: a fused kernel, which saves no attention matrix, also on the CPU.

On CUDA, ``scaled_dot_product_attention`` picks a fused kernel for training
wherever one applies: flash (bf16/fp16, head_dim <= 256, no arbitrary mask),
memory-efficient (fp32, or a mask) or cuDNN (aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp). Each saves the output and a float32 log-sum-exp per query
row for backward, never the L x L attention matrix, and with dropout it saves
no mask either: it regenerates it from the RNG seed. On the CPU PyTorch picks
its own flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
saves the same) unless dropout is on: then it falls back to the math kernel,
which saves the attention probabilities and the dropout mask, several times
what a GPU holds at long sequences.

:class:`FusedAttention` makes the CPU step do what the GPU would: while active
it replaces ``scaled_dot_product_attention``'s autograd kernel (CPU tensors;
the key where its composite kernel runs, so autograd records the fused op) by
one that runs PyTorch's own composite kernel with ``dropout_p=0``: same shapes
and saved tensors as CUDA's fused kernels, no dropout applied (an estimate has
no values; a tracked run's numbers differ, its memory does not). It counts the
calls and which CPU kernel ran, for the estimate's notes. For an NVIDIA GPU
(``nvidia``, set by the estimate) backward also holds the workspace the
GPU's fused kernel takes (:func:`backward_workspace`, as an H100 took it), and
an fp32 output is laid out as CUDA's memory-efficient kernel lays it out
(``_flash``: where the query is laid out otherwise, as in
``nn.MultiheadAttention``, the GPU copies the output where the CPU would not).
One call runs PyTorch's math kernel instead, as on CUDA: grouped-query attention (``enable_gqa=True``,
fewer key/value heads) in fp32, which no fused CUDA kernel takes (flash and
cuDNN take no fp32; memory-efficient attention no grouped-query input before
pytorch/pytorch#191085); it keeps the attention matrix for backward.

While active it also lets transformers see, on fake tensors, what it sees on
real ones: position ids a model made itself (``cache_position.unsqueeze(0)``,
an arange, then expanded over the batch) are one sequence per row, so no
packed-sequence mask is built for them (masking_utils.find_packed_sequence_indices
can't read fake values and answered "packed"). Without this, an estimate of a
Hugging Face causal LM built a (batch, 1, sequence, sequence) mask that a real
run without one skips, and a grouped-query model repeated its key/value heads
where a real run passes ``enable_gqa=True``: a 2-layer Llama over 4 x 512
tokens was estimated 4.9 % (bf16) and 8.4 % (fp32) above its tracked run.
Position ids the batch brings (a packing collator's; noted by
:func:`batch_positions` as the step makes its batch) are left to
transformers, as is an ``attention_mask``, whose padding fake tensors can't
show; where either made transformers build a mask that readable values might
have spared (``_ignore_causal_mask_sdpa`` would skip it without padding), a
note says so. Masks a real run builds too (a sliding window, a bias) get none.

>>> q = torch.randn(1, 2, 16, 8, requires_grad=True)
>>> with FusedAttention() as attention:
...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
>>> out.grad_fn.name(), attention.calls, attention.with_dropout
('ScaledDotProductFlashAttentionForCpuBackward0', 1, 1)
"""

from __future__ import annotations

import functools
import math
import sys
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .kernels import ScopedKernels

__all__ = ["FusedAttention", "set_attention", "check_attention", "batch_positions", "backward_workspace",
           "IMPLEMENTATIONS"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MATH = torch.ops.aten._scaled_dot_product_attention_math.default
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
#: the bytes cuDNN's attention forward took as its workspace on an H100 in all 24 bf16 calls measured (one more in 4)
_CUDNN_FORWARD_WORKSPACE = 256
# the schema: (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False)
_DROPOUT_AT = 4


class FusedAttention(ScopedKernels):
    """While active, CPU attention saves what CUDA's fused kernels save (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        #: calls that asked for dropout, run without it
        self.with_dropout = 0
        #: calls that needed a gradient and still ran PyTorch's math kernel (saves the attention matrix)
        self.math = 0
        #: fp32 grouped-query calls (enable_gqa=True), run as PyTorch's math kernel as on CUDA; their heads (query,
        #: key/value), each shape once in the order met (a model's layers may differ)
        self.grouped_math = 0
        self.grouped: dict[tuple[int, int], None] = {}
        #: calls given a mask on fake tensors, and whether the model is Hugging Face's (estimate_plan sets it)
        self.masked = 0
        self.hugging_face = False
        #: masks transformers built because it couldn't read a fake attention_mask or position_ids
        self.unread = 0
        #: whether the GPU is NVIDIA's (estimate_plan sets it): backward then takes the workspace its fused kernel
        #: takes, and an fp32 output is laid out as its memory-efficient kernel lays it out; the calls that took a
        #: workspace, and the fp32 outputs laid out so
        self.nvidia = False
        self.with_workspace = 0
        self.relaid = 0
        self._seeds: list[torch.Tensor] = []  # cuDNN's seed and offset from _flash, until _kernel hands them on
        self._masking: Any = None  # transformers.masking_utils, while its checks are wrapped
        self._skip_wrapped = False  # whether its padding check is one of them (a transformers that has it)

    def _undo(self) -> None:
        for name in _CHECKS:
            wrapped: Any = getattr(self._masking, name, None)
            if _ours(wrapped):
                setattr(self._masking, name, wrapped.args[1])
        self._masking = None
        self._seeds = []
        super()._undo()

    def register(self, library: torch.library.Library) -> None:
        masking: Any = sys.modules.get("transformers.masking_utils")  # imported by any model that uses it
        self._masking = masking  # first: _undo finds it whatever comes next
        for name, wrapper in _CHECKS.items():
            check = getattr(masking, name, None)
            if check is not None and not _ours(check):  # ours already: one an interrupted exit left
                setattr(masking, name, functools.partial(wrapper, self, check))
                self._skip_wrapped |= wrapper is _mask_skip
        library.impl("scaled_dot_product_attention", self._kernel, "AutogradCPU")
        # below autograd: the node it records saves the output as returned here
        library.impl("_scaled_dot_product_flash_attention_for_cpu", self._flash, "ADInplaceOrView")
        # not differentiable itself: its autograd kernel is where a backward node's call arrives
        library.impl("_scaled_dot_product_flash_attention_for_cpu_backward", self._flash_backward, "AutogradCPU")

    def _cuda_kernel(self, tensor: torch.Tensor) -> str | None:
        """The fused kernel an NVIDIA GPU runs a call on, as an H100 picks (torch 2.11, cuDNN 9.19):
        ``"efficient"`` (memory-efficient attention) for fp32, ``"cudnn"`` (cuDNN's) for bf16 and fp16; None for
        another GPU, fp64, or a trace (compile=True)."""
        if not self.nvidia or tensor.dim() != 4 or _tracing():
            return None
        if tensor.dtype == torch.float32:
            return "efficient"
        return "cudnn" if tensor.dtype in (torch.bfloat16, torch.float16) else None

    def _flash(self, *args: Any, **kwargs: Any) -> Any:
        """PyTorch's CPU flash kernel; for an NVIDIA GPU its fp32 output laid out as memory-efficient attention's.

        CUDA runs fp32 attention on its memory-efficient kernel, which writes a
        fresh (batch, sequence, heads, head size) tensor and returns it
        transposed to (batch, heads, sequence, head size)
        (``_efficient_attention_forward``); the CPU kernel lays its output out
        as the query is. They differ wherever the query is not laid out so:
        ``nn.MultiheadAttention``'s (sequence, batch, heads, head size)
        projection, or a contiguous (batch, heads, sequence, head size) query.
        In the first the GPU's ``permute(2, 0, 1, 3).contiguous()`` copies
        the output (and the output projection saves the copy) where the CPU's
        is a view. The output is the storage the kernel made, seen with CUDA's
        strides: no other memory, its numbers moved about (an estimate has
        none; a tracked run's differ, its memory does not). cuDNN's attention
        (bf16, fp16) writes its output as the query is, and takes a 256-byte
        workspace while it runs, after making its random-number seed and offset
        (8 bytes each, on the GPU, dropout or not), which autograd keeps for
        its backward.
        """
        with torch._C._AutoDispatchBelowADInplaceOrView():
            query = args[0] if args else kwargs["query"]
            kernel = self._cuda_kernel(query)
            if kernel == "cudnn":  # its random-number seed and offset, kept for backward (_hold)
                self._seeds = [query.new_empty((), dtype=torch.int64) for _ in range(2)]
            output, *rest = _FLASH(*args, **kwargs)
            if kernel == "efficient" and output.untyped_storage().nbytes() == output.nbytes:
                strides = _sequence_major(output)
                if any(size > 1 and stride != sequence_major
                       for size, stride, sequence_major in zip(output.shape, output.stride(), strides)):
                    output = output.as_strided(output.shape, strides)
                    self.relaid += 1
            elif kernel == "cudnn":  # its forward's workspace, freed as it returns
                output.new_empty(_CUDNN_FORWARD_WORKSPACE, dtype=torch.uint8)
        return (output, *rest)

    def _flash_backward(self, grad_out: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, *args: Any,
                        **kwargs: Any) -> Any:
        """PyTorch's CPU flash backward; for an NVIDIA GPU, what its fused kernel's backward takes beside it.

        Memory-efficient attention (fp32, ``_efficient_attention_backward``)
        makes the output's gradient contiguous as (batch, sequence, heads,
        head size) (a copy where it is not), makes the three gradients, then
        computes a float32 row statistic in ATen (``(grad_out *
        out).sum(-1).transpose(-2, -1).contiguous()``: a product the size of
        the output, a sum, its copy) and the kernel's workspace
        (:func:`backward_workspace`), freed as it returns: the statistic, the
        workspace, the copy. cuDNN's (bf16, fp16; ``run_cudnn_SDP_bprop``)
        makes the three gradients, copies the output's gradient where its last
        dimension is strided (into the output's layout), then takes its
        workspace. The CPU kernel computes the gradients; these buffers are
        taken beside them, in that order (CPU memory never touched, in a
        tracked run).
        """
        inputs = [tensor for tensor in (grad_out, query, key, *args) if isinstance(tensor, torch.Tensor)]
        # create_graph=True: the gradients are computed (no GPU buffers beside them), and differentiating them
        # raises, as without this kernel
        differentiable = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in inputs)
        with torch._C._AutoDispatchBelowAutograd():
            kernel = None if grad_out is None or differentiable else self._cuda_kernel(grad_out)
            if grad_out is None or kernel is None:  # None: an undefined gradient, passed on
                grads = _FLASH_BACKWARD(grad_out, query, key, *args, **kwargs)
                return tuple(_not_differentiable(grad, inputs) for grad in grads) if differentiable else grads
            if kernel == "cudnn":
                grads = _FLASH_BACKWARD(grad_out, query, key, *args, **kwargs)
                copied = grad_out.new_empty(grad_out.shape) if grad_out.stride(-1) != 1 else None
                workspace = grad_out.new_empty(backward_workspace(query, key), dtype=torch.uint8)
                del workspace, copied
                return grads
            rows = grad_out.transpose(1, 2)
            copied = rows.contiguous() if not rows.is_contiguous() else None
            grads = _FLASH_BACKWARD(grad_out, query, key, *args, **kwargs)
            batch, heads, length, size = grad_out.shape
            product = grad_out.new_empty((batch, length, heads, size), dtype=torch.float32)
            summed = product.new_empty((batch, length, heads))
            statistic = product.new_empty((batch, heads, length))
            del summed, product
            workspace = grad_out.new_empty(backward_workspace(query, key), dtype=torch.uint8)
            del statistic, workspace, copied
        return grads

    def _kernel(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        self.masked += isinstance(mask, FakeTensor)
        if len(args) > _DROPOUT_AT:
            dropout = args[_DROPOUT_AT]
            args = (*args[:_DROPOUT_AT], 0.0, *args[_DROPOUT_AT + 1:])
        else:
            dropout = kwargs.pop("dropout_p", 0.0)
        query, key = args[0], args[1]
        if query.dtype == torch.float32 and kwargs.get("enable_gqa") and query.size(-3) != key.size(-3):
            # CUDA's fused kernels take no grouped-query fp32 input (flash and cuDNN no fp32, memory-efficient
            # attention no grouping before pytorch/pytorch#191085): PyTorch runs its math kernel, with its
            # dropout (whose mask it keeps)
            self.grouped_math += 1
            self.grouped[query.size(-3), key.size(-3)] = None
            kwargs.pop("attn_mask", None)  # read above, passed on by position
            causal = args[5] if len(args) > 5 else kwargs.pop("is_causal", False)
            return _MATH(*args[:3], mask, dropout, causal, None, **kwargs)[0]
        if dropout:
            self.with_dropout += 1
        # PyTorch's own composite kernel (the one this replaces), which picks the CPU kernel
        try:
            output = _SDPA.decompose(*args, **kwargs)
        finally:  # cuDNN's, made by _flash: this call's, whatever raised after (a checkpoint's early stop)
            seeds, self._seeds = self._seeds, []
        if output.grad_fn is not None and "FlashAttention" not in output.grad_fn.name():
            self.math += 1
        elif output.grad_fn is not None and self._cuda_kernel(query) is not None:  # fp64: CUDA's math kernel
            self._hold(output, seeds)
        return output

    def _hold(self, output: torch.Tensor, seeds: list[torch.Tensor]) -> None:
        """Count a fused call whose backward takes a workspace (in :meth:`_flash_backward`), and keep ``seeds``
        (cuDNN's) until its backward node has run, as autograd keeps the tensors it saved."""
        self.with_workspace += 1
        node = output.grad_fn
        assert node is not None  # checked by the caller
        if seeds:
            # saved as autograd saves a tensor: through the saved-tensor hooks in force (non-reentrant checkpointing
            # frees them after the forward, and its recomputation makes them again), given back by unpacking
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
            kept: list[Any] = [hooks[0](seed) for seed in seeds] if hooks else seeds
            # the hooks go with the seeds: the node lives as long as the graph, and a checkpoint's unpack hook
            # holds its region's inputs
            held = [kept, hooks]
            del seeds, hooks

            def release(inputs: Any, grads: Any) -> None:
                if held:
                    packed, hooks = held
                    held.clear()
                    if hooks:  # a recomputed seed is handed back to its holder, and dropped with it
                        for each in packed:
                            hooks[1](each)

            node.register_hook(release)

    def notes(self, steps: int = 1) -> list[str]:
        """What the estimate assumed about attention in each of ``steps`` steps, for its notes (none without SDPA).

        ``steps`` 0: the calls were torch.compile's traces (compile=True), not a step's, and are not counted.
        """
        # unread: a check could not read fake values and a mask was built (also under inference mode, where no
        # kernel of this class runs, to count the calls or the masked ones)
        mask = [
            "Hugging Face builds a (batch, 1, sequence, sequence) attention mask on fake tensors, which can't show "
            "whether the batch's attention_mask has padding or its position_ids pack sequences: a real batch with "
            "neither skips it, and its bytes (but grouped-query attention in fp32 without a mask runs PyTorch's "
            "math kernel, which keeps the attention matrix: more)"
        ] if self.hugging_face and (self.unread or (self.masked and not self._skip_wrapped)) else []
        if not self.calls:
            return mask

        def per_step(count: int, what: str) -> str:
            return f"{count // steps} {what} per step" if steps else what

        notes = [
            f"attention: {per_step(self.calls, 'scaled_dot_product_attention calls')} modelled as a fused kernel (the output and "
            "a float32 log-sum-exp per row saved, no attention matrix), as CUDA's flash (bf16/fp16, head_dim <= 256), "
            "memory-efficient (fp32 or a mask) and cuDNN kernels do; which one the GPU picks is not checked here"
        ]
        if self.with_workspace:
            notes.append(
                f"attention: {per_step(self.with_workspace, 'calls')} take a workspace in backward as an H100's "
                "fused kernels took it (cuDNN's attention in bf16/fp16: an fp32 dQ and a row statistic, twice the dQ "
                "for grouped-query input; memory-efficient attention in fp32: an fp32 dQ over rows rounded to 64, "
                "after the gradients and a float32 row statistic, with a copy of the output's gradient where it is "
                "not sequence-major; cuDNN's also keeps an 8-byte seed and offset per call until its backward); "
                "other GPUs' kernels (flash on an A100) take about as much, not measured")
        if self.relaid:
            notes.append(
                f"attention: {per_step(self.relaid, 'fp32 outputs')} laid out sequence-major (batch, sequence, heads, "
                "head size), as CUDA's memory-efficient kernel writes them, where the query is laid out otherwise "
                "(nn.MultiheadAttention's): the model's contiguous() after it copies the output, as on the GPU")
        if self.with_dropout:
            notes.append(
                f"attention: {per_step(self.with_dropout, 'calls')} with dropout run without it, as CUDA's fused kernels save no "
                "dropout mask (they regenerate it)"
            )
        notes += mask
        if self.grouped_math:
            heads = "; ".join(f"{query} query heads, {key} key/value head{'s' if key > 1 else ''}"
                              for query, key in self.grouped)
            notes.append(
                f"attention: {per_step(self.grouped_math, 'grouped-query calls')} in fp32 ({heads}; Hugging "
                "Face passes enable_gqa=True "
                "without a mask) modelled as PyTorch's math kernel, which keeps the attention matrix: CUDA's fused "
                "kernels take no grouped-query fp32 input (memory-efficient attention takes it from "
                "pytorch/pytorch#191085 on: with a torch that has it, this is high). An H100 with torch 2.11 ran a "
                "small Llama's fp32 step so, 0.45 % above this estimate (benchmarks/bench_attention_kernels.py)"
            )
        if self.math:
            notes.append(
                f"attention: {self.math // steps} calls per step ran PyTorch's math kernel, which saves the attention matrix (CPU's "
                "flash kernel did not apply); a GPU's fused kernel may hold less there"
            )
        return notes


def backward_workspace(query: torch.Tensor, key: torch.Tensor) -> int:
    """The bytes an NVIDIA GPU's fused attention holds in backward beside the gradients, as an H100 took them (torch
    2.11, cuDNN 9.19, 2026-11-27: ``benchmarks/results/2026-11-27-gpu/misses-first.json``, exact in all 36 fused
    calls measured): cuDNN's attention, which PyTorch picks there for bf16 and fp16, an fp32 dQ (twice for
    grouped-query input) and a float32 statistic a row; memory-efficient attention, which it picks for fp32, an fp32
    dQ over rows rounded up to 64, and a quarter byte a row.

    >>> q = torch.empty(4, 8, 1000, 64, dtype=torch.bfloat16)
    >>> backward_workspace(q, q), backward_workspace(q, q[:, :2]), backward_workspace(q.float(), q.float())
    (8320256, 16512256, 8396800)
    """
    *batch, heads, length, size = query.shape
    rows = math.prod(batch) * heads
    if query.dtype == torch.float32:
        padded = -(-length // 64) * 64
        return rows * padded * size * 4 + rows * padded // 4
    grouped = 2 if key.size(-3) != heads else 1
    return grouped * rows * length * size * 4 + rows * length * 4 + 256


def _not_differentiable(grad: torch.Tensor | None, inputs: list[torch.Tensor]) -> torch.Tensor | None:
    """``grad`` (its storage) behind a node raising PyTorch's own error for a backward of the CPU flash backward, as
    without this kernel (autograd's DelayedError, given the call's inputs: its node is made where one needs a
    gradient)."""
    if grad is None:
        return None
    message = "derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"
    delayed: torch.Tensor = torch._C._functions.DelayedError(message, 1 + len(inputs))(grad, *inputs)[0]
    return delayed


def _sequence_major(output: torch.Tensor) -> tuple[int, ...]:
    """The strides of a (batch, heads, sequence, head size) tensor laid out as (batch, sequence, heads, head size).

    >>> _sequence_major(torch.empty(2, 4, 10, 8))
    (320, 8, 32, 1)
    """
    batch, heads, length, size = output.shape
    return (length * heads * size, size, heads * size, 1)


def _tracing() -> bool:
    """Whether Dynamo or AOTAutograd is tracing (the kernel then runs for a trace, not a step): a compile session's
    flag, which older torch releases cleared during AOTAutograd's joint trace, or a tracing context."""
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None


#: Hugging Face attention implementations an estimate can set (attn_implementation), and what each runs here.
IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


#: Position ids the batch brought (nbmem.estimation.step.prepared_batch): transformers' own check decides for them.
_BATCH_POSITIONS: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()


def batch_positions(batch: Any) -> None:
    """Note the ``position_ids`` a batch brings (a packing collator's): not the model's own arange."""
    if isinstance(batch, dict) and isinstance(batch.get("position_ids"), torch.Tensor):
        _BATCH_POSITIONS.add(batch["position_ids"])


def _ours(check: Any) -> bool:
    return isinstance(check, functools.partial) and check.func in _CHECKS.values()


def _packed_sequences(attention: FusedAttention, check: Any, position_ids: torch.Tensor) -> Any:
    """transformers' packing check, answered as on real tensors for fake position ids the model made (an arange)."""
    if not isinstance(position_ids, FakeTensor):
        return check(position_ids)
    base = position_ids._base
    if base is not None and base.dim() == 1:
        storage = position_ids.untyped_storage()._cdata
        if not any(brought.untyped_storage()._cdata == storage for brought in list(_BATCH_POSITIONS)):
            return None  # one sequence per row: what the check finds on the real arange
    packed = check(position_ids)
    attention.unread += packed is not None  # it can't read fake ids: "packed", a mask built
    return packed


def _mask_skip(attention: FusedAttention, check: Any, *args: Any, **kwargs: Any) -> bool:
    """transformers' checks whether a causal or bidirectional mask can be left to SDPA (is_causal, or none), counting
    the fake padding they couldn't read."""
    padding = args[0] if args else kwargs.get("padding_mask")
    skip: bool = check(*args, **kwargs)
    if not skip and isinstance(padding, FakeTensor):
        unpadded: tuple[tuple[Any, ...], dict[str, Any]] = (
            ((None, *args[1:]), kwargs) if args else ((), {**kwargs, "padding_mask": None}))
        # without padding it would skip the mask: what decided was that the values can't be read
        attention.unread += bool(check(*unpadded[0], **unpadded[1]))
    return skip


#: transformers.masking_utils' checks wrapped while a FusedAttention is active, by name.
_CHECKS = {"find_packed_sequence_indices": _packed_sequences, "_ignore_causal_mask_sdpa": _mask_skip,
           "_ignore_bidirectional_mask_sdpa": _mask_skip}  # the last: an encoder's (BERT's), found by a fuzz test


def check_attention(attention: Any) -> None:
    if attention is not None and attention not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention {attention!r}: use one of {', '.join(IMPLEMENTATIONS)} (Hugging Face's "
                         "attn_implementation), or leave it out for the model's own")


def set_attention(model: torch.nn.Module, attention: str | None, notes: list[str]) -> None:
    """Set a Hugging Face model's attention implementation, as ``attn_implementation=`` would load it.

    ``"eager"`` computes the L x L attention matrix in Python and autograd
    keeps it (and the softmax and dropout results) for backward; ``"sdpa"``
    calls ``scaled_dot_product_attention``, modelled as CUDA's fused kernels
    (:class:`FusedAttention`). FlashAttention 2 and 3 save what those kernels
    save (the output and a log-sum-exp per row) and can't run without their
    CUDA package, so they are estimated as ``"sdpa"``, and the notes say so.
    """
    if attention is None:
        return
    setter = getattr(model, "set_attn_implementation", None)
    if not callable(setter):
        raise ValueError(f"attention={attention!r} sets a Hugging Face model's attn_implementation, and "
                         f"{type(model).__name__} has none: leave attention out")
    if attention.startswith("flash_attention"):
        notes.append(f"attention: {attention} estimated as sdpa's fused kernels, which save what it saves (the output "
                     "and a log-sum-exp per row); its CUDA package can't run here")
        attention = "sdpa"
    setter(attention)
    if attention == "eager":
        notes.append("attention: eager (Hugging Face's attn_implementation): the attention matrix, its softmax and "
                     "dropout kept for backward, as that code keeps them")
