"""cuDNN's convolution workspaces: nbmem's estimate beside a CUDA GPU's measured training step of whole CNNs.

nbmem/estimation/cudnn_conv.py gives each 2-D convolution the workspaces an H100 took for one such layer
(``fit_cudnn_conv.py``, 2026-11-27). This checks whole networks, where a layer's workspace stacks on the saved
activations of the others: the campaign's small CNN, a VGG-like stack at 64x64, a ResNet-like one at 224x224 with a
7x7 stride-2 stem and 1x1 projections, in fp32 and bf16, AdamW and SGD. On a CUDA machine each configuration is
measured (``estimate(mode="measured")``: the allocator's peak) and estimated (fake tensors, ``device="H100-80GB"``)
beside it, and estimated for an Intel GPU too (no cuDNN: what the estimate was before); without CUDA only the
estimates run (to check the script).

    python benchmarks/bench_cudnn_conv.py --out DIR
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


def block(inputs: int, outputs: int, stride: int = 1) -> nn.Module:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(outputs),
                         nn.ReLU())


class Residual(nn.Module):
    """A ResNet basic block: two 3x3 convolutions, a 1x1 stride-2 projection where the width changes."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(block(inputs, outputs, stride), nn.Conv2d(outputs, outputs, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(outputs))
        self.skip = (nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs))
                     if stride != 1 or inputs != outputs else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.body(x) + self.skip(x)).relu()


def campaign() -> nn.Module:  # bench_accuracy.py's cnn(): 3->64, then three 64-wide blocks
    return nn.Sequential(block(3, 64), *[block(64, 64) for _ in range(3)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))


def vgg() -> nn.Module:
    return nn.Sequential(block(3, 64), block(64, 64), nn.MaxPool2d(2), block(64, 128), block(128, 128), nn.MaxPool2d(2),
                         block(128, 256), block(256, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))


def resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), Residual(64, 64, 1), Residual(64, 128, 2), Residual(128, 256, 2),
                         Residual(256, 512, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10))


MODELS = {"campaign CNN": (campaign, 32), "VGG-like": (vgg, 64), "ResNet-like": (resnet, 224)}
#: model, batch, precision, optimizer
GRID = [
    ("campaign CNN", 8, "fp32", "adamw"), ("campaign CNN", 64, "fp32", "sgd"), ("campaign CNN", 64, "bf16", "adamw"),
    ("VGG-like", 16, "fp32", "adamw"), ("VGG-like", 64, "bf16", "sgd"), ("VGG-like", 64, "fp32", "sgd"),
    ("ResNet-like", 8, "fp32", "adamw"), ("ResNet-like", 32, "bf16", "adamw"), ("ResNet-like", 32, "fp32", "sgd"),
]


def row(model: str, batch: int, precision: str, optimizer: str, *, measure: bool) -> dict[str, Any]:
    build, image = MODELS[model]

    def make(n: int) -> Any:
        return torch.randn(n, 3, image, image), torch.randint(0, 10, (n,))

    knobs = dict(batch_size=batch, precision=precision, optimizer=optimizer)
    out: dict[str, Any] = {"model": model, "image": image, "batch": batch, "precision": precision,
                           "optimizer": optimizer}
    started = time.perf_counter()
    estimated = estimate(build, make, device="H100-80GB", **knobs)
    without = estimate(build, make, device="Arc-A770-16GB", **knobs)  # no cuDNN: PyTorch's kernels' figure
    out.update(estimate=estimated.peak, estimate_reserved=estimated.reserved, without_cudnn=without.peak,
               calls=next((note.split(" convolution call")[0].split()[-1] for note in estimated.notes
                           if " convolution call" in note), None),
               seconds=round(time.perf_counter() - started, 2))
    if measure:
        out.update(measured_beside(build, make, knobs, estimated))
        out.update(error_without_cudnn=round(without.peak / out["measured"] - 1, 4))
    return out


if __name__ == "__main__":
    sys.exit(main(GRID, row, "cudnn_conv.json", __doc__))
