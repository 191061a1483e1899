"""Seconds per change in nbmem.explore (issue 11: at most 1 s per change on BERT-base and GPT-2).

Run: python benchmarks/bench_explore.py [--json FILE] [--models gpt2,bert-base,mlp]

Each workload opens an ``Explorer`` (ipywidgets, no frontend needed) and
moves its controls through a sequence a user would try: batch size,
precision, activation checkpointing, optimizer, and back across them. Every
change is a configuration not seen before, so none is answered from the
panel's per-configuration cache; each is a whole estimate on fake tensors
(building the model included) and the chart's redraw. Reported per change:
wall seconds (``Explorer.seconds``) and this process's CPU seconds (steadier
on a shared machine), the median and the maximum, the estimate's peak bytes
(so that two versions of nbmem can be checked equal), and the 1-minute load
average before and after (os.getloadavg). Hugging Face models are built from
their configs (benchmarks/bench_estimate_models.py), batch x 128 tokens. The
quickstart MLP (notebooks/01) is the small case. Runs in about a minute on
an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch import nn

import nbmem
from nbmem.frontend.explorer import Explorer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _environment import environment, write_json  # noqa: E402
from bench_estimate_models import models  # noqa: E402  (the same configs as the estimate benchmark)

#: The controls moved, in order, from batch 8, fp32, AdamW, no checkpointing: each a new configuration.
CHANGES: list[tuple[str, Any]] = [
    ("batch_size", 16), ("precision", "bf16"), ("checkpointing", True), ("optimizer", "sgd-momentum"),
    ("batch_size", 4), ("precision", "fp32"), ("checkpointing", False), ("optimizer", "adam"),
]


def quickstart_mlp() -> tuple[Callable[[], nn.Module], Callable[[int], Any]]:  # notebooks/01-quickstart.ipynb's model
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    return build, lambda n: (torch.randn(n, 784), torch.randint(0, 10, (n,)))


def changes(build: Callable[[], nn.Module], make: Callable[[int], Any]) -> list[dict[str, Any]]:
    panel = Explorer(build, make, batch_size=8, device="A100-40GB")
    rows = []
    for name, value in CHANGES:
        started = time.process_time()
        panel.controls[name].value = value
        assert panel.last is not None
        rows.append({"change": f"{name}={value}", "wall_s": panel.seconds, "cpu_s": time.process_time() - started,
                     "peak_bytes": panel.last.peak})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--models", default="gpt2,bert-base,mlp", help="comma-separated: gpt2, bert-base, mlp")
    args = parser.parse_args()
    workloads = {name: (build, make) for name, (build, make, _) in models().items() if not name.startswith("llama")}
    workloads["mlp"] = quickstart_mlp()
    loads = [os.getloadavg()[0]]
    figures: dict[str, Any] = {}
    for name in args.models.split(","):
        build, make = workloads[name]
        nbmem.estimate(build, make, batch_size=2)  # warm: imports, first-use costs, fake-tensor cache
        rows = changes(build, make)
        loads.append(os.getloadavg()[0])
        figures[name] = {
            "median_wall_s": statistics.median(row["wall_s"] for row in rows),
            "max_wall_s": max(row["wall_s"] for row in rows),
            "median_cpu_s": statistics.median(row["cpu_s"] for row in rows),
            "changes": rows,
        }
    report = {
        **environment("transformers"),
        "load_average_1min": {"min": min(loads), "max": max(loads), "each": loads},
        "explorer": figures,
    }
    print(f"{'workload':<12}{'median s':>10}{'(cpu)':>8}{'max s':>8}   per change (wall s)")
    for name, row in figures.items():
        each = " ".join(f"{change['wall_s']:.2f}" for change in row["changes"])
        print(f"{name:<12}{row['median_wall_s']:>10.2f}{row['median_cpu_s']:>8.2f}{row['max_wall_s']:>8.2f}   {each}")
    print("changes: " + ", ".join(f"{name}={value}" for name, value in CHANGES)
          + f"; load {min(loads):.1f}-{max(loads):.1f}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
