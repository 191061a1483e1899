"""Selective activation checkpointing: which ops' outputs a checkpointed block keeps instead of recomputing.

Plain checkpointing keeps only a block's inputs and recomputes everything in
backward. PyTorch's selective checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) keeps the
outputs of the ops a policy names, so backward recomputes only the cheap
rest; large-scale trainers (torchtitan) keep the matmuls, or every other one.
``checkpoint_saves=`` on :func:`nbmem.estimate` takes:

- ``"matmuls"``: every matmul's output (``mm``, ``addmm``, ``bmm``, ``baddbmm``)
  and fused attention's (``scaled_dot_product_attention``'s kernels);
- ``"every-other-matmul"``: attention's, and every second matmul of each
  block's forward (torchtitan's "op" policy);
- a list of ops to keep (``torch.ops.aten.mm.default``, or an overload packet
  such as ``torch.ops.aten.mm``);
- a policy function, as PyTorch takes it: ``policy(ctx, op, *args, **kwargs)``
  returning a ``torch.utils.checkpoint.CheckpointPolicy``.

>>> policy = context_factory("matmuls")
>>> callable(policy)
True
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["context_factory", "check_saves", "saves_label", "PRESETS"]

_ATTENTION = [
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
]
_MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default]

#: The named policies.
PRESETS = ("matmuls", "every-other-matmul")


def _every_other_matmul() -> Callable[..., Any]:
    """torchtitan's "op" selective checkpointing: attention kept, every second matmul of a forward kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = set(_MATMULS)
    seen = {False: 0, True: 0}  # matmuls met in this checkpointed call's forward, and in its recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op in matmuls:
            seen[ctx.is_recompute] += 1  # PyTorch makes a new ctx per op: the count lives here
            return CheckpointPolicy.MUST_SAVE if seen[ctx.is_recompute] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _ops(saves: Any) -> list[Any]:
    """The overloads a list names (an overload packet stands for all its overloads)."""
    found = []
    for op in saves:
        if isinstance(op, torch._ops.OpOverloadPacket):
            found += [getattr(op, name) for name in op.overloads()]
        else:
            found.append(op)
    return found


def check_saves(saves: Any, checkpointing: Any) -> None:
    """Say what to pass when checkpoint_saves= can't work: no checkpointing, or not a policy."""
    if saves is None:
        return
    if checkpointing is False:
        raise ValueError("checkpoint_saves= says what checkpointed blocks keep, and checkpointing is off: "
                         "add checkpointing=True")
    if isinstance(saves, str):
        if saves not in PRESETS:
            raise ValueError(f"unknown checkpoint_saves {saves!r}: use {' or '.join(map(repr, PRESETS))}, a list of "
                             "ops (torch.ops.aten.mm.default, ...), or a policy function")
        return
    if isinstance(saves, (list, tuple, set)):
        bad = [op for op in saves if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
        if bad:
            raise ValueError(f"checkpoint_saves lists {bad[0]!r}, which is not an op: name ops as torch.ops.aten.mm "
                             "(every overload) or torch.ops.aten.mm.default")
        return
    if not callable(saves):
        raise ValueError(f"checkpoint_saves={saves!r} is not a policy: pass 'matmuls', 'every-other-matmul', a list "
                         "of ops, or a function (ctx, op, *args, **kwargs) -> CheckpointPolicy")


def context_factory(saves: Any) -> Callable[[], Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: a fresh pair of selective contexts per call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if saves == "matmuls":
        policy: Any = _MATMULS + _ATTENTION
    elif saves == "every-other-matmul":
        policy = None
    elif isinstance(saves, (list, tuple, set)):
        policy = _ops(saves)
    else:
        policy = saves
    if policy is None:  # a policy keeps per-call counts: a new one for each checkpointed call
        return lambda: create_selective_checkpoint_contexts(_every_other_matmul())
    return functools.partial(create_selective_checkpoint_contexts, policy)


def saves_label(saves: Any) -> str:
    """How a result names what checkpointed blocks keep."""
    if saves is None:
        return "inputs only"
    if isinstance(saves, str):
        return saves
    if isinstance(saves, (list, tuple, set)):
        return ", ".join(str(op).removeprefix("aten.") for op in saves)
    return getattr(saves, "__name__", "your policy")
