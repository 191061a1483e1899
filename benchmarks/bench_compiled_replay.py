"""``estimate(..., compile=True)`` against what an H100 measured of the same compiled steps (issue 23, on CUDA).

The GPU probes of 2026-11-25 (``results/2026-11-25-gpu/probes-run5-nbmem-compiled.json``)
measured one training step (forward and backward, gradients set to None
before) of ``gpu_probes.py``'s CNN (3 conv+BN blocks, batch 64 x 3 x 64 x 64)
and small GPT-2 (4 layers, width 512, 8 x 256 tokens), compiled by
``torch.compile`` (inductor, Triton kernels on an H100, torch 2.11): the
allocator's peak above what was allocated before it, and the same step eager
(measured with nbmem's tracker alongside, a dispatch mode, under which the
compiled model runs eagerly). Here the same steps are estimated on this CPU,
``compile=True`` planning with inductor's CPU code generation, and eagerly,
for the ``H100-80GB`` preset; the estimate's parameters and batch, which the
measured peak starts above, are taken off.

    python benchmarks/bench_compiled_replay.py [--json results/DATE-compiled-replay-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from _environment import environment, write_json

PROBES = Path(__file__).resolve().parent / "results" / "2026-11-25-gpu" / "probes-run5-nbmem-compiled.json"
BATCHES = {"cnn": lambda: (torch.randn(64, 3, 64, 64),), "gpt": lambda: (torch.randint(0, 8192, (8, 256)),)}


def measured() -> dict[str, dict[str, int]]:
    """name -> the H100's compiled and eager peaks of the step, from the probes' file."""
    items = json.loads(PROBES.read_text())["items"]
    return {name: {"compiled": items[f"nbmem-compiled.{name}"]["value"]["raw_before"],
                   "eager": items[f"nbmem-compiled.{name}"]["value"]["measure_breakdown"]["peak"]}
            for name in BATCHES}


def estimated(name: str, compile: bool) -> int:
    """The step's estimated peak above the parameters, buffers and batch (what the measured peak starts above)."""
    import nbmem
    from gpu_probes import MODELS, loss_of
    from nbmem.core.units import round_allocation

    build = MODELS[name][0]

    def step(model: Any, inputs: Any, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of(name, model, inputs).backward()

    result = nbmem.estimate(build, lambda n: BATCHES[name](), batch_size=1, optimizer="sgd", step=step,
                            compile=compile, device="H100-80GB")
    model = build()
    resident = sum(round_allocation(t.numel() * t.element_size())
                   for t in [*model.parameters(), *model.buffers(), *BATCHES[name]()])
    return result.steady - resident


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    report: dict[str, Any] = environment("transformers")
    report["measured on"] = "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-25 (" + PROBES.name + ")"
    truth = measured()
    rows = {}
    for name in BATCHES:
        for compile in (True, False):
            started = time.perf_counter()
            found = estimated(name, compile)
            key = "compiled" if compile else "eager"
            rows[f"{name} {key}"] = row = {"estimated": found, "measured": truth[name][key],
                                           "error": round((found - truth[name][key]) / truth[name][key], 5),
                                           "seconds": round(time.perf_counter() - started, 1)}
            print(f"{name:4} {key:9} estimated {found:>13,} B  H100 {truth[name][key]:>13,} B  {row['error']:+.2%}  "
                  f"({row['seconds']} s)", flush=True)
    report["steps"] = rows
    write_json(args.json, report)


if __name__ == "__main__":
    main()
