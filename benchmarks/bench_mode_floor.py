"""What any Python dispatch mode costs a CPU training step, per op, and how OpenMP's waiting policy moves it (issue 12).

Run: python benchmarks/bench_mode_floor.py [--rounds 15] [--threads N] [--json FILE]
     and again under OMP_WAIT_POLICY=ACTIVE or PASSIVE (read once, when torch starts its OpenMP threads)

For each of bench_overhead.py's workloads: the ops one step dispatches
(counted by a mode), then the step bare and under an empty dispatch mode
(``func(*args)`` and nothing else, unwrapped as nbmem's own mode is),
alternating, medians of ``--rounds``. The extra time per op is what a mode
costs before it does anything; micro-benchmarks of one small op give 5-11 us,
while a step with real kernels between the ops pays more when OpenMP's worker
threads have gone to sleep in the gap the mode adds. nbmem's tracked mode
cannot cost less than this floor; the profiler, which records in C++, adds
about 1 us per op.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _environment import environment, parse_with_threads, write_json
from bench_overhead import training_step, workloads


class CountingMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class EmptyMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no Dynamo wrapper, as nbmem's own mode (nbmem/tracking/dispatch.py)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def floor(rounds: int) -> dict[str, dict[str, float]]:
    figures = {}
    for name, (model, batch, labels) in workloads().items():
        optimizer = torch.optim.AdamW(model.parameters())
        step = training_step(model, batch, labels, optimizer)
        for _ in range(3):
            step()
        counting = CountingMode()
        with counting:
            step()
        bare, empty = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            step()
            bare.append(time.perf_counter() - started)
            with EmptyMode():
                started = time.perf_counter()
                step()
                empty.append(time.perf_counter() - started)
        b, e = statistics.median(bare), statistics.median(empty)
        figures[name] = {"ops": counting.ops, "bare_ms": b * 1e3, "empty_mode_ms": e * 1e3, "ratio": e / b,
                         "extra_us_per_op": (e - b) / counting.ops * 1e6}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="bare/empty-mode pairs per workload")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parse_with_threads(parser)
    report = environment()
    report["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    report["load_average_1min_at_start"] = os.getloadavg()[0]
    report["steps"] = floor(args.rounds)
    print(f"threads {report['torch_threads']}, OMP_WAIT_POLICY {report['OMP_WAIT_POLICY']}, "
          f"load {report['load_average_1min_at_start']:.1f}")
    for name, row in report["steps"].items():
        print(f"{name[:40]:40s} {row['ops']:4d} ops  bare {row['bare_ms']:7.2f} ms  empty mode {row['empty_mode_ms']:7.2f} ms"
              f"  {row['ratio']:.3f}x  {row['extra_us_per_op']:5.1f} us/op")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
