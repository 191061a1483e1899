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
calls and which CPU kernel ran, for the estimate's notes.

>>> q = torch.randn(1, 2, 16, 8, requires_grad=True)
>>> with FusedAttention() as attention:
...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
>>> out.grad_fn.name(), attention.calls, attention.with_dropout
('ScaledDotProductFlashAttentionForCpuBackward0', 1, 1)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .kernels import ScopedKernels

__all__ = ["FusedAttention", "set_attention", "check_attention", "grouped_query", "IMPLEMENTATIONS"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
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
        #: calls in fp32, and the model's (query heads, key/value heads) where it groups them (grouped_query)
        self.fp32 = 0
        self.grouped: tuple[int, int] | None = None

    def __enter__(self) -> FusedAttention:
        entered: FusedAttention = super().__enter__()
        return entered

    def register(self, library: torch.library.Library) -> None:
        library.impl("scaled_dot_product_attention", self._kernel, "AutogradCPU")

    def _kernel(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.fp32 += args[0].dtype == torch.float32
        if len(args) > _DROPOUT_AT:
            dropout = args[_DROPOUT_AT]
            args = (*args[:_DROPOUT_AT], 0.0, *args[_DROPOUT_AT + 1:])
        else:
            dropout = kwargs.pop("dropout_p", 0.0)
        if dropout:
            self.with_dropout += 1
        # PyTorch's own composite kernel (the one this replaces), which picks the CPU kernel
        output = _SDPA.decompose(*args, **kwargs)
        if output.grad_fn is not None and "FlashAttention" not in output.grad_fn.name():
            self.math += 1
        return output

    def notes(self, steps: int = 1) -> list[str]:
        """What the estimate assumed about attention in each of ``steps`` steps, for its notes (none without SDPA)."""
        if not self.calls:
            return []
        notes = [
            f"attention: {self.calls // steps} scaled_dot_product_attention calls per step modelled as a fused kernel (the output and "
            "a float32 log-sum-exp per row saved, no attention matrix), as CUDA's flash (bf16/fp16, head_dim <= 256), "
            "memory-efficient (fp32 or a mask) and cuDNN kernels do; which one the GPU picks is not checked here"
        ]
        if self.with_dropout:
            notes.append(
                f"attention: {self.with_dropout // steps} calls per step with dropout run without it, as CUDA's fused kernels save no "
                "dropout mask (they regenerate it)"
            )
        if self.grouped and self.fp32:
            notes.append(
                f"attention: grouped-query attention ({self.grouped[0]} query heads, {self.grouped[1]} key/value "
                f"head{'s' if self.grouped[1] > 1 else ''}) in fp32: with no mask, Hugging Face passes enable_gqa=True, which torch 2.11's fused CUDA "
                "kernels refuse in fp32 (memory-efficient attention takes it from pytorch/pytorch#191085 on); the GPU "
                "then runs the math kernel, which keeps the attention matrix. An H100 (torch 2.11) allocated 4.5 % "
                "more than such an estimate of a small Llama (benchmarks/bench_attention_kernels.py); bf16 and fp16 "
                "run flash attention, as estimated"
            )
        if self.math:
            notes.append(
                f"attention: {self.math // steps} calls per step ran PyTorch's math kernel, which saves the attention matrix (CPU's "
                "flash kernel did not apply); a GPU's fused kernel may hold less there"
            )
        return notes


#: Hugging Face attention implementations an estimate can set (attn_implementation), and what each runs here.
IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


def grouped_query(model: nn.Module) -> tuple[int, int] | None:
    """A Hugging Face model's (query heads, key/value heads) where it groups them (Llama's), else None.

    >>> from types import SimpleNamespace
    >>> grouped_query(SimpleNamespace(config=SimpleNamespace(num_attention_heads=8, num_key_value_heads=4)))
    (8, 4)
    >>> grouped_query(nn.Linear(2, 2))
    """
    config = getattr(model, "config", None)
    heads, grouped = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(grouped, int) and 0 < grouped < heads:
        return heads, grouped
    return None


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
