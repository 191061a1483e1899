"""What nbmem costs: the magic's fixed cost, and tracked mode's slowdown.

Run: python benchmarks/bench_overhead.py [--json results.json]

1. Fixed cost of ``%%gpumem -q`` on an empty cell, in a real IPython shell,
   above the same cell without the magic: for the measured code path (the
   CUDA counter replaced by a stand-in, so it runs on a CPU) and for tracked
   mode.
2. Tracked mode's slowdown of one training step (forward, loss, backward,
   AdamW step, zero_grad) of a small MLP and a small CNN, as the ratio of the
   median step time inside ``nbmem.track()`` to the median without it. The
   issue's target is at most 1.3x. A deliberately tiny MLP shows the worst
   case, where the fixed per-operation cost dominates. An empty dispatch
   mode is timed alongside: it is what PyTorch itself charges for any Python
   dispatch mode, the floor for a tracker built on one.

Timings are medians of repeated runs; the machine, versions and date are
printed with them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nbmem
from nbmem import counters, scope


def median_seconds(run: Callable[[], object], repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class StandInCuda(counters.CudaCounter):
    """The measured code path without a GPU: fixed figures, no torch.cuda calls."""

    def __init__(self) -> None:
        self.index = 0
        self.scopes = counters.PeakScopes(self)

    def allocated(self) -> int:
        return 1 << 30

    def reserved(self) -> int:
        return 2 << 30

    def peak_allocated(self) -> int:
        return 1 << 30

    def peak_reserved(self) -> int:
        return 2 << 30

    def reset_peak(self) -> None:
        pass

    def device_view(self):
        return "stand-in", 80 << 30, 70 << 30

    def synchronize(self) -> None:
        pass


def magic_fixed_cost(repeats: int) -> dict[str, float]:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing.globalipapp import start_ipython

    start_ipython()
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbmem")
    empty = median_seconds(lambda: shell.run_cell("pass"), repeats)
    tracked = median_seconds(lambda: shell.run_cell("%%gpumem -q --backend tracked\npass"), repeats)
    stand_in = StandInCuda()
    original_resolve, original_counter = scope.resolve_backend, scope.cuda_counter
    scope.resolve_backend = lambda backend="auto", device=None: ("measured", torch.device("cuda", 0))
    scope.cuda_counter = lambda index: stand_in
    try:
        measured = median_seconds(lambda: shell.run_cell("%%gpumem -q\npass"), repeats)
    finally:
        scope.resolve_backend, scope.cuda_counter = original_resolve, original_counter
    return {
        "empty_cell_ms": empty * 1e3,
        "measured_path_fixed_cost_ms": (measured - empty) * 1e3,
        "tracked_fixed_cost_ms": (tracked - empty) * 1e3,
    }


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def workloads() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        # MNIST-sized MLP, batch 128
        "mlp 784-1024-1024-10, batch 128": (
            nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)),
            torch.randn(128, 784),
            torch.randint(0, 10, (128,)),
        ),
        # CIFAR-sized CNN with BatchNorm, batch 64
        "cnn 2 conv+bn, 32x32, batch 64": (
            nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
            ),
            torch.randn(64, 3, 32, 32),
            torch.randint(0, 10, (64,)),
        ),
        # worst case: kernels of a few microseconds, the per-op cost dominates
        "tiny mlp 32-64-10, batch 8 (worst case)": (
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
            torch.randn(8, 32),
            torch.randint(0, 10, (8,)),
        ),
    }


class EmptyMode(TorchDispatchMode):
    """A dispatch mode that does nothing: PyTorch's own cost of any Python mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def training_step_slowdown(repeats: int) -> dict[str, dict[str, float]]:
    """Bare, empty-mode and tracked steps interleaved in rounds, so drift hits all three alike."""
    results = {}
    for name, (model, batch, labels) in workloads().items():
        optimizer = torch.optim.AdamW(model.parameters())

        def step() -> None:
            loss = nn.functional.cross_entropy(model(batch), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        counter = OpCounter()
        with counter:
            step()
        contexts = {"bare": contextlib.nullcontext, "empty_mode": EmptyMode, "tracked": lambda: nbmem.Tracker("cpu")}
        samples: dict[str, list[float]] = {key: [] for key in contexts}
        steps_per_round = 5
        for _ in range(max(1, repeats // steps_per_round)):
            for key, make in contexts.items():
                with make():
                    step()  # warm
                    start = time.perf_counter()
                    for _ in range(steps_per_round):
                        step()
                    samples[key].append((time.perf_counter() - start) / steps_per_round)
        bare, empty, tracked = (statistics.median(samples[key]) for key in contexts)
        results[name] = {
            "ops_per_step": counter.ops,
            "bare_ms": bare * 1e3,
            "empty_mode_ms": empty * 1e3,
            "tracked_ms": tracked * 1e3,
            "slowdown": tracked / bare,
            "slowdown_of_an_empty_dispatch_mode": empty / bare,
            "nbmem_us_per_op_beyond_empty_mode": (tracked - empty) / counter.ops * 1e6,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "nbmem": nbmem.__version__,
        "magic": magic_fixed_cost(args.repeats),
        "training_step": training_step_slowdown(args.repeats),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
