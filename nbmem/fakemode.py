"""The fake-tensor mode estimates run in: PyTorch's ``FakeTensorMode``, with its cache key computed faster.

An estimate runs every op of a training step on fake tensors, and nearly
every op is answered from ``FakeTensorMode``'s dispatch cache. Profiled on
GPT-2 and BERT-base steps (torch 2.13), building the cache key took about
half of fake-tensor dispatch: for each tensor argument,
``extract_tensor_metadata`` fills a dataclass and ``_flatten_into`` walks its
fields with ``isinstance`` checks, and ``_prep_args_for_hash`` re-imports two
modules on every call. :class:`FastKeyFakeTensorMode` builds the *same* key
(the same values, in the same order: checked against PyTorch's own function
in tests/test_fakemode.py) directly for the common case, a dense tensor of
this mode without symbolic sizes, and leaves every other argument to PyTorch.
Equal keys mean equal cache hits, so estimates are unchanged to the byte.

Where PyTorch's metadata fields are not the ones this was written against
(another torch version), :func:`new_fake_mode` returns a plain
``FakeTensorMode``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, TensorMetadata
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["new_fake_mode", "FastKeyFakeTensorMode"]

#: TensorMetadata's fields in torch 2.13 (torch/_subclasses/fake_tensor.py): the
#: order _flatten_into appends them in, which _flatten_dense follows.
_FIELDS = (
    "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
    "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
    "dense_dim", "sparse_dim",
)
_SAME_FIELDS = tuple(field.name for field in dataclasses.fields(TensorMetadata)) == _FIELDS

#: Arguments _prep_args_for_hash keys as (type, value): none of its special cases applies to them.
_PLAIN_VALUES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


class FastKeyFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose dispatch-cache key for dense fake tensors takes fewer steps (same key).

    >>> mode = FastKeyFakeTensorMode()
    >>> with mode:
    ...     weight = torch.empty(64, 32)
    ...     hidden = torch.empty(8, 32) @ weight.t()
    >>> hidden.shape, type(hidden).__name__
    (torch.Size([8, 64]), 'FakeTensor')
    """

    def _prep_args_for_hash(
        self, result: list[object], args: Any, state: Any, id_hashed_objects: list[object]
    ) -> None:
        if isinstance(args, dict):
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)  # recurses into self for keys/values
            return
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        for arg in args:
            kind = type(arg)
            if (
                kind is FakeTensor
                and arg.fake_mode is self
                and arg.constant is None
                and arg.layout is torch.strided
                and not arg._has_symbolic_sizes_strides
            ):
                _flatten_dense(result, arg)
            elif kind in _PLAIN_VALUES:
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                # one argument, without a container's (type, length) prefix
                super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)


def _flatten_dense(result: list[object], tensor: Any) -> None:
    """What ``extract_tensor_metadata(tensor)._flatten_into(result, ...)`` appends for a dense, static-shape tensor."""
    shape = tensor.shape
    stride = tensor.stride()
    # suggest_memory_format answers contiguous_format for any tensor not 4-d or 5-d (channels_last, _3d)
    memory_format: torch.memory_format | None = (
        suggest_memory_format(tensor) if len(shape) in (4, 5) else torch.contiguous_format
    )
    if not tensor.is_contiguous(memory_format=memory_format):
        memory_format = None
    result.append(tensor.dtype)
    result.append(torch.Size)
    result.append(f"length_{len(shape)}")
    for size in shape:
        result.append(int)
        result.append(size)
    result.append(tuple)
    result.append(f"length_{len(stride)}")
    for step in stride:
        result.append(int)
        result.append(step)
    result += (
        tensor.device, torch.strided, memory_format, tensor.storage_offset(), tensor.untyped_storage().nbytes(),
        tensor.requires_grad, tensor.is_quantized, tensor.is_conj(), tensor.is_neg(), tensor.is_inference(),
        False, None, None, None,  # is_sparse, is_coalesced, dense_dim, sparse_dim: a strided tensor's
    )


def new_fake_mode() -> FakeTensorMode:
    """The fake mode an estimate runs in (a plain ``FakeTensorMode`` on a torch whose metadata differs).

    >>> type(new_fake_mode()).__name__
    'FastKeyFakeTensorMode'
    """
    _autograd_started_outside_fake_mode()
    return FastKeyFakeTensorMode() if _SAME_FIELDS else FakeTensorMode()


@functools.cache
def _autograd_started_outside_fake_mode() -> None:
    """One real, one-element backward on the CPU, once per process, before any backward on fake tensors.

    Autograd's engine decides once per process whether it needs device threads
    (``Engine::start_device_threads``, under a ``call_once``), and once it starts
    them, a forked child's backward fails ("Unable to handle autograd's threading
    in combination with fork-based multiprocessing"). Decided during a backward
    under ``FakeTensorMode``, torch 2.14.1's CUDA build starts them on a machine
    without a GPU (checked here; torch 2.13.0's CPU build does not), and then
    :func:`nbmem.launch`, which forks its ranks, failed after any estimate (notebook
    06 in an environment with that build). Decided by a real CPU backward, the
    engine starts none. Hidden from any dispatch mode open around the estimate
    (``%%gpumem``'s tracker): it is nbmem's, not the user's.
    """
    with _disable_current_modes():
        leaf = torch.zeros(1, requires_grad=True)
        leaf.sum().backward()
