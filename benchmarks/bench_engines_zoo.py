"""Tracked figures against the CPU allocator's own, on the real-model zoo: what each engine sees.

Run: python benchmarks/bench_engines_zoo.py [--batch-size 8] [--threads N] [--json FILE]
(needs the zoo extra: pip install torch==2.13.0 -e ".[zoo]")

For each Hugging Face model of the zoo (tests/_zoo.py: GPT-2, Llama, BERT
twice, T5, ViT, Llama with LoRA; built from configs, random weights), nbmem's
own training step (nbmem.estimation.step.run_step: forward, default loss, backward,
AdamW step, zero_grad) runs once to create the optimizer state, then once
more inside each of:

- ``engine="native"``: the CPU allocator wrapped, every allocation counted
  while it lives (kernel scratch included). Its peak is the allocator's, to
  the byte (bench_overhead.py checks it against the profiler's allocator
  events): the truth on this CPU;
- ``engine="native"`` with an empty Python dispatch mode on the stack: what
  any Python mode changes in what PyTorch allocates (autograd and some
  backward formulas take out-of-place paths while one is on the stack,
  ``at::isTensorSubclassLike``), which the default engine and estimates
  (FakeTensorMode) inherit;
- the default engine (``engine="dispatch"``), which sees each op's outputs
  but no kernel's own scratch.

Each row gives the three peaks above the step's start and the differences
from the truth. One thread (``--threads 1`` by default), so that no
allocation happens on an OpenMP worker.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

import nbmem
from nbmem.estimation.step import run_step

from _environment import environment, write_json
from bench_overhead import EmptyMode  # a dispatch mode that only runs each op

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from _zoo import ZOO  # noqa: E402  (the tests' zoo: the same models and batches)

BATCH = 8  # the default; --batch-size sets another


def _peak(name: str, engine: str, empty_mode: bool, batch_size: int) -> int:
    build, make, _ = ZOO[name]
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], foreach=False)

    def step() -> None:
        run_step(model, make, batch_size, None, optimizer, None, "fp32", 1, torch.device("cpu"))

    step()  # the optimizer's state exists from here on, as in every step after the first
    with nbmem.measure("cpu", engine=engine) as scope:  # type: ignore[arg-type]
        if empty_mode:
            with EmptyMode():
                step()
        else:
            step()
    assert scope.result is not None
    return scope.result.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--batch-size", type=int, default=BATCH, help=f"the batch (default {BATCH})")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = environment("transformers", "peft")
    report["batch_size"] = args.batch_size
    report["models"] = {}
    print(" ".join(f"{key}={value}" for key, value in report.items() if key != "models"))
    print(f"{'model':16s} {'native (truth)':>15s} {'+ a Python mode':>16s} {'default engine':>15s}")
    for name, (_, _, vision) in ZOO.items():
        if vision:
            continue  # timm and torchvision need the torch pair Binder's environment has (tests/test_binder.py)
        truth = _peak(name, "native", False, args.batch_size)
        moded = _peak(name, "native", True, args.batch_size)
        dispatch = _peak(name, "dispatch", False, args.batch_size)
        report["models"][name] = {"native": truth, "native_with_python_mode": moded, "dispatch": dispatch}
        print(f"{name:16s} {truth:>15,d} {moded - truth:>+16,d} {dispatch - truth:>+15,d}  "
              f"({100 * (dispatch - truth) / truth:+.2f} %)", flush=True)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
