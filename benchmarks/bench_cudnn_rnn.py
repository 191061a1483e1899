"""cuDNN's LSTM/GRU memory: nbmem's estimate beside a CUDA GPU's measured training step, on sizes the fit never saw.

nbmem/estimation/cudnn_rnn.py models cuDNN's RNN kernel (reserve buffer, workspace) from an H100's sizes of
2026-11-27 (input size equal to hidden, hidden 128-1024, 1-2 layers). This checks it out of that sample: other input
sizes, 3 layers, hidden 64/384/2048, fp16, longer sequences, AdamW and SGD. On a CUDA machine each configuration is
measured (``estimate(mode="measured")``: the allocator's peak) and estimated (fake tensors, ``device="H100-80GB"``);
without CUDA only the estimates run (to check the script).

    python benchmarks/bench_cudnn_rnn.py --out DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbmem.estimation.estimate import estimate  # noqa: E402

from _beside import main, measured_beside  # noqa: E402

#: kind, input size, hidden, layers, batch, steps, precision, optimizer[, the layer's options]
GRID = [
    ("LSTM", 64, 256, 2, 8, 32, "fp32", "adamw"),  # the campaign's zoo LSTM
    ("LSTM", 64, 384, 3, 32, 64, "fp32", "adamw"),
    ("LSTM", 64, 384, 3, 32, 64, "bf16", "adamw"),
    ("LSTM", 300, 512, 1, 16, 200, "fp32", "sgd"),
    ("LSTM", 300, 512, 1, 16, 200, "bf16", "sgd"),
    ("LSTM", 32, 64, 2, 128, 50, "fp32", "adamw"),
    ("LSTM", 128, 256, 2, 32, 64, "fp16", "adamw"),
    ("LSTM", 256, 2048, 1, 8, 32, "fp32", "sgd"),
    ("GRU", 128, 512, 1, 32, 64, "fp32", "adamw"),
    ("GRU", 128, 512, 1, 32, 64, "bf16", "adamw"),
    ("GRU", 64, 256, 3, 16, 100, "fp32", "sgd"),
    ("GRU", 64, 768, 2, 24, 48, "bf16", "sgd"),
    # the paths added after the first run (dropout between layers, both directions, no biases, the persistent kernel)
    ("LSTM", 128, 256, 3, 32, 64, "fp32", "adamw", {"dropout": 0.3}),
    ("LSTM", 128, 256, 2, 32, 64, "bf16", "adamw", {"bidirectional": True, "dropout": 0.2}),
    ("GRU", 300, 384, 2, 16, 100, "fp32", "sgd", {"bidirectional": True}),
    ("LSTM", 512, 512, 1, 64, 200, "fp16", "adamw", {}),  # cuDNN's persistent kernel (fp16, sizes of 128)
    ("LSTM", 128, 256, 2, 32, 64, "bf16", "sgd", {"bias": False}),
]


class Sequence(nn.Module):
    def __init__(self, kind: str, inputs: int, hidden: int, layers: int, **options: Any) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(inputs, hidden, num_layers=layers, batch_first=True, **options)
        self.head = nn.Linear(hidden * (2 if options.get("bidirectional") else 1), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def row(kind: str, inputs: int, hidden: int, layers: int, batch: int, steps: int, precision: str, optimizer: str,
        options: dict[str, Any] | None = None, *, measure: bool) -> dict[str, Any]:
    def build() -> nn.Module:
        return Sequence(kind, inputs, hidden, layers, **(options or {}))

    def make(n: int) -> Any:
        return torch.randn(n, steps, inputs), torch.randint(0, 10, (n,))

    knobs = dict(batch_size=batch, precision=precision, optimizer=optimizer)
    out: dict[str, Any] = {"kind": kind, "inputs": inputs, "hidden": hidden, "layers": layers, "batch": batch,
                           "steps": steps, "precision": precision, "optimizer": optimizer, **(options or {})}
    started = time.perf_counter()
    estimated = estimate(build, make, device="H100-80GB", **knobs)
    out.update(estimate=estimated.peak, estimate_reserved=estimated.reserved,
               modelled=any(note.startswith("cuDNN: ") and "modelled as" in note for note in estimated.notes),
               seconds=round(time.perf_counter() - started, 2))
    if measure:
        out.update(measured_beside(build, make, knobs, estimated))
    return out


if __name__ == "__main__":
    sys.exit(main(GRID, row, "cudnn_rnn.json", __doc__))
