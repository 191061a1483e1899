"""The cuBLAS workspaces a training step takes from the caching allocator, beside its tensors (issue 24, part 4).

PyTorch gives each cuBLAS handle, one per thread that runs matmuls on a
device and stream, a workspace allocated through the caching allocator at
its first matmul and kept (aten/src/ATen/cuda/CublasHandlePool.cpp,
``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT``
pairs) if set, else 32 MiB on compute capability 9.0 (Hopper) and
``:4096:2:16:8`` = 8,519,680 B elsewhere. A training step runs matmuls on two
threads, its own (forward) and autograd's device thread (backward): two
workspaces. An H100's snapshot shows them: a 32 MiB block made by backward's
thread (benchmarks/results/2026-11-25-gpu/snapshot-mlp.pickle).

>>> workspace_size((8, 6), {})
8519680
>>> workspace_size((9, 0), {}), workspace_size(None, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
(33554432, 33554432)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..core.allocator import CachingAllocatorSimulation
from ..core.cudnn import CONV_NOTE, RNN_NOTE, cudnn_kind, notes_for
from ..core.devices import COMPUTE_CAPABILITY, PRESETS
from ..core.units import format_bytes

__all__ = ["Workspaces", "WithWorkspaces", "workspace_size", "workspaces_for", "cudnn_notes", "runs_cudnn", "RNN_NOTE", "CONV_NOTE"]

DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8"
HOPPER = 4096 * 8 * 1024  # 32 MiB on compute capability 9.0


def workspace_size(capability: tuple[int, int] | None, environment: Mapping[str, str] | None = None) -> int:
    """Bytes of one cuBLAS workspace, as PyTorch chooses it for a GPU of ``capability`` (None: not Hopper)."""
    environment = os.environ if environment is None else environment
    config = environment.get("CUBLAS_WORKSPACE_CONFIG")
    default = HOPPER if capability == (9, 0) else DEFAULT
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return default


@dataclass(frozen=True)
class Workspaces:
    """The workspaces a step's threads hold: how many, the bytes of each, and what that assumed."""

    count: int
    each: int
    assumed: str

    @property
    def total(self) -> int:
        return self.count * self.each

    def describe(self) -> str:
        return f"{self.count} cuBLAS workspace{'s' if self.count > 1 else ''} of {format_bytes(self.each)} ({self.assumed})"


def workspaces_for(device_label: str | None, task: str, environment: Mapping[str, str] | None = None) -> Workspaces:
    """The cuBLAS workspaces a step of ``task`` would hold on the device a capacity label names."""
    environment = os.environ if environment is None else environment
    capability = COMPUTE_CAPABILITY.get(device_label or "")
    count = 2 if task == "train" else 1
    threads = "forward's thread and autograd's backward thread" if count == 2 else "one thread"
    if environment.get("CUBLAS_WORKSPACE_CONFIG"):
        why = f"{threads}; CUBLAS_WORKSPACE_CONFIG={environment['CUBLAS_WORKSPACE_CONFIG']}"
    elif capability is not None:
        why = f"{threads}; PyTorch's default on compute capability {capability[0]}.{capability[1]}"
    else:
        why = f"{threads}; PyTorch's default below Hopper, 32 MiB each on H100/H200: pass device= for your GPU"
    return Workspaces(count, workspace_size(capability, environment), why)


class WithWorkspaces:
    """Feeds a step's allocations to the tensors' allocator simulation and to a second one that also holds the
    cuBLAS workspaces (added by :meth:`add`, before the first step, when the first matmuls would make them)."""

    def __init__(self, tensors: CachingAllocatorSimulation, whole: CachingAllocatorSimulation | None = None) -> None:
        self.tensors = tensors
        self.whole = whole if whole is not None else CachingAllocatorSimulation(
            capacity=tensors.capacity, strict=False, settings=tensors.settings, allowed_memory=tensors.allowed_memory)

    def add(self, workspaces: Workspaces) -> None:
        for index in range(workspaces.count):
            self.whole.malloc(("cuBLAS workspace", index), workspaces.each)

    def malloc(self, key: object, nbytes: int) -> int:
        """The tensors' block for ``key``: what the step's allocated figures count (workspaces are not the step's)."""
        size = self.tensors.malloc(key, nbytes)
        self.whole.malloc(key, nbytes)
        return size

    def block_size(self, key: object, default: int = 0) -> int:
        return self.tensors.block_size(key, default)

    def free(self, key: object) -> None:
        self.tensors.free(key)
        self.whole.free(key)

    def requested(self, key: object) -> int:
        return self.tensors.requested(key)

    def relaid(self) -> WithWorkspaces:
        return WithWorkspaces(self.tensors.relaid(), self.whole.relaid())


def runs_cudnn(device_label: str | None) -> bool:
    """Whether the GPU ``device_label`` names runs cuDNN (an NVIDIA preset, or none named: a CUDA GPU, as NVIDIA's).

    >>> runs_cudnn("H100-80GB"), runs_cudnn(None), runs_cudnn("RX-9070-XT"), runs_cudnn("Mac-16GB")
    (True, True, False, False)
    """
    known = PRESETS.get(device_label or "")
    return known is None or (known.backend == "cuda" and known.vendor == "NVIDIA")


def cudnn_notes(model: nn.Module, device_label: str | None, task: str = "train", rnn_modelled: bool = False,
                conv_modelled: bool = False) -> list[str]:
    """What cuDNN's kernels hold beyond an estimate of ``model`` for the GPU ``device_label`` names (none: not NVIDIA).

    An estimate runs PyTorch's own kernels on fake tensors; on an NVIDIA GPU
    recurrent layers and convolutions run cuDNN's, with memory of their own.
    Presets of other backends (MPS, XPU) get no note; AMD's (ROCm) one on
    MIOpen, which runs them there; unnamed devices cuDNN's, as NVIDIA's. The
    H100's figures they quote are a training step's: for another ``task`` the
    notes leave them out.

    >>> cudnn_notes(nn.LSTM(4, 8), "H100-80GB") == [RNN_NOTE]
    True
    >>> cudnn_notes(nn.LSTM(4, 8), "RX-9070-XT")[0].startswith("MIOpen: on an AMD GPU (ROCm)")
    True
    >>> cudnn_notes(nn.Conv2d(3, 8, 3), "Mac-16GB"), cudnn_notes(nn.Linear(4, 4), None)
    ([], [])
    """
    known = PRESETS.get(device_label or "")
    if known is not None and known.backend != "cuda":
        return []
    # rnn_modelled: cuDNN's kernel was modelled for every LSTM/GRU call (nbmem.estimation.cudnn_rnn); nn.RNN's is not;
    # conv_modelled: cuDNN's workspaces for every convolution seen (nbmem.estimation.cudnn_conv), which models 2-D
    # ones only: a transposed, 1-D or 3-D layer keeps the note, seen or not (an inference pass reports none)
    modelled = ((nn.LSTM, nn.GRU) if rnn_modelled else ()) + ((nn.Conv2d,) if conv_modelled else ())
    kinds = (kind for module in model.modules()
             if (kind := cudnn_kind(module)) is not None and not isinstance(module, modelled))
    return notes_for(kinds, task == "train",
                     known.vendor if known is not None else "NVIDIA")
