"""What cuDNN's kernels hold on an NVIDIA GPU that nbmem's figures made on a CPU do not (issue 24).

Estimates and tracked runs execute PyTorch's own kernels. On an NVIDIA GPU,
recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) and convolutions run
cuDNN's instead, which allocate memory of their own through the caching
allocator: an RNN keeps a reserve buffer for backward and takes workspaces, a
convolution takes a workspace sized by the algorithm cuDNN picks. Estimates
for an NVIDIA GPU model cuDNN's LSTM and GRU kernel and its 2-D convolutions'
workspaces (nbmem.estimation.cudnn_rnn and cudnn_conv, a layer above this
one); tracked runs and the layers those leave out run PyTorch's kernels, and
their results say so, with what an
H100 measured beyond nbmem's figures (torch 2.11, cuDNN 9.19, 2026-11-25:
``benchmarks/results/2026-11-25-gpu/campaign-run4-zoo.json``, replayed by
``benchmarks/bench_campaign_replay.py``; ``tests/test_h100_figures.py``
checks the figures quoted).

>>> from torch import nn
>>> cudnn_kind(nn.GRU(4, 8)), cudnn_kind(nn.Conv1d(2, 2, 3)), cudnn_kind(nn.Linear(2, 2))
('rnn', 'conv', None)
>>> [note[:40] for note in notes_for({"conv"})]
['cuDNN: on an NVIDIA GPU, convolutions ta']
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["RNN_NOTE", "CONV_NOTE", "MIOPEN_NOTE", "cudnn_kind", "notes_for"]

_RNN = (
    "cuDNN: on an NVIDIA GPU, nn.LSTM/GRU/RNN run cuDNN's RNN kernels, which keep a reserve buffer for backward and "
    "take workspaces through the allocator; these figures come from PyTorch's own RNN kernels, which hold neither"
)
_CONV = (
    "cuDNN: on an NVIDIA GPU, convolutions take workspaces through the allocator, sized by the algorithm cuDNN picks "
    "(not in these figures)"
)
RNN_NOTE = (
    f"{_RNN}. On an H100 (cuDNN 9.19) a training step of a 2-layer, 256-wide LSTM over batch 8 x 32 steps allocated "
    "17-21 MiB more than PyTorch's kernels' figure, which was 51-60 % below the measured peak, and reserved 32-34 MiB "
    "more (an estimate for an NVIDIA GPU models cuDNN's kernel where it can: nbmem.estimation.cudnn_rnn). "
    "Measure it on the GPU before trusting this figure"
)
CONV_NOTE = (
    f"{_CONV}. On an H100 (cuDNN 9.19) a small CNN's fp32 training steps allocated 2.8 MiB more than PyTorch's "
    "kernels' figure (12-16 % below the measured peak), and its bf16 steps reserved 20 MiB more (an estimate for an "
    "NVIDIA GPU models cuDNN's convolution workspaces where it can: nbmem.estimation.cudnn_conv)"
)
_UNMEASURED = "; how much they add has been measured only for training steps so far"
#: On an AMD GPU (ROCm) PyTorch runs the same layers with MIOpen, which has memory of its own too; nbmem has measured
#: it on no AMD GPU, so the note quotes no figure.
MIOPEN_NOTE = (
    "MIOpen: on an AMD GPU (ROCm), nn.LSTM/GRU/RNN and convolutions run MIOpen's kernels, which take workspaces "
    "through the allocator (an RNN also a reserve buffer for backward); not in these figures, and not measured by "
    "nbmem on any AMD GPU"
)
_NOTES = {"rnn": (RNN_NOTE, _RNN + _UNMEASURED), "conv": (CONV_NOTE, _CONV + _UNMEASURED)}


def cudnn_kind(module: nn.Module) -> str | None:
    """``"rnn"`` or ``"conv"`` for a layer that runs cuDNN's kernels on an NVIDIA GPU; None for any other."""
    if isinstance(module, nn.RNNBase):
        return "rnn"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    return None


def notes_for(kinds: Iterable[str], training: bool = True, vendor: str = "NVIDIA") -> list[str]:
    """The notes for the kinds of layers that ran (RNN first), each once; with the H100's figures when ``training``
    (they are a training step's), without them otherwise (inference, generation). For an AMD GPU, one note on
    MIOpen (no figures: none measured).

    >>> notes_for({"rnn", "conv"}, vendor="AMD") == [MIOPEN_NOTE]
    True
    """
    found = set(kinds)
    if vendor == "AMD":
        return [MIOPEN_NOTE] if found & set(_NOTES) else []
    return [notes[0] if training else notes[1] for kind, notes in _NOTES.items() if kind in found]
