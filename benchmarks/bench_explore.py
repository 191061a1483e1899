"""Seconds per change in nbmem.explore for the quickstart's model (issue target: under 1 s).

Run: python benchmarks/bench_explore.py [--json FILE]
Each change is a configuration not seen before (no cache hit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics

import torch
from torch import nn

import nbmem
from nbmem.explorer import Explorer


def build() -> nn.Module:  # notebooks/01-quickstart.ipynb's model
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make(n: int):
    return torch.randn(n, 784), torch.randint(0, 10, (n,))


CHANGES = [
    ("batch_size", 128), ("batch_size", 512), ("precision", "bf16"), ("checkpointing", True),
    ("optimizer", "sgd-momentum"), ("accumulation", 4), ("device", "A100-40GB"), ("precision", "bf16-weights"),
    ("batch_size", 1024), ("optimizer", "adam"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    panel = Explorer(build, make, batch_size=64, device="T4")
    seconds = []
    for name, value in CHANGES:
        panel.controls[name].value = value
        seconds.append(panel.seconds)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.platform()}",
        "torch": torch.__version__,
        "nbmem": nbmem.__version__,
        "changes": len(seconds),
        "median_s": statistics.median(seconds),
        "max_s": max(seconds),
        "per_change_s": seconds,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
