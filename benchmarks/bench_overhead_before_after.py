"""Tracked mode before and after issue 12's hot-path changes, interleaved in one process.

Run: python benchmarks/bench_overhead_before_after.py [--rounds 8] [--json out.json]

"Before" is nbmem's tracker as main had it (commit 318d938), rebuilt from
today's code by undoing the two changes: its dispatch mode wrapped by PyTorch
in ``torch._dynamo.disable`` (a subclass that asks for the wrapper; one extra
Python call per op beyond what main had), and the saved-tensors pack hook's
detach dispatched through the mode. Everything else is the same code, so the
difference is those two changes alone.

Per op: process CPU time of ``torch.add`` on 16 floats (one new storage per
op) and of ``torch.mul`` by a tensor that requires grad (one saved tensor per
op). Per step: the MLP, CNN and transformer steps of bench_overhead.py. One
torch thread and process CPU time: steadier than wall time on a shared,
loaded machine. Load average, machine, versions and date go with the figures.
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
from typing import Any, Callable, Iterator

import torch

import nbmem
from nbmem.tracking import categories, tracker as tracking
from nbmem.tracking.dispatch import TrackingMode

from _environment import write_json
from bench_overhead import EmptyMode, EmptySkippedMode, training_step, workloads


class WrappedMode(TrackingMode):
    """nbmem's mode with PyTorch's torch._dynamo.disable wrapper, as before."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return TrackingMode.__torch_dispatch__(self, func, types, args, kwargs)


@contextlib.contextmanager
def before() -> Iterator[None]:
    saved = tracking.TrackingMode, categories._NO_PYTHON_DISPATCH
    tracking.TrackingMode, categories._NO_PYTHON_DISPATCH = WrappedMode, contextlib.nullcontext
    try:
        with nbmem.Tracker("cpu"):
            yield
    finally:
        tracking.TrackingMode, categories._NO_PYTHON_DISPATCH = saved


TOOLS: dict[str, Callable[[], Any]] = {
    "bare": contextlib.nullcontext,
    "empty_mode": EmptyMode,
    "empty_mode_skipped": EmptySkippedMode,
    "nbmem_before": before,
    "nbmem_after": lambda: nbmem.Tracker("cpu"),
}


def per_op(rounds: int) -> dict[str, dict[str, float]]:
    values, other = torch.ones(16), torch.ones(16)
    weight = torch.ones(16, requires_grad=True)

    def add(count: int = 4000) -> float:
        start = time.process_time()
        for _ in range(count):
            torch.add(values, other)
        return (time.process_time() - start) / count * 1e6

    def saving(count: int = 2000) -> float:
        start = time.process_time()
        for _ in range(count):
            torch.mul(values, weight)
        return (time.process_time() - start) / count * 1e6

    samples: dict[str, dict[str, list[float]]] = {op.__name__: {tool: [] for tool in TOOLS} for op in (add, saving)}
    for make in TOOLS.values():  # warm, not timed: PyTorch's wrapper imports torch._dynamo at its first call
        with make():
            add(10), saving(10)
    for _ in range(rounds * 2):
        for tool, make in TOOLS.items():
            with make():
                for op in (add, saving):
                    samples[op.__name__][tool].append(op())
    return {op: {f"{tool}_us": statistics.median(times) for tool, times in by_tool.items()} for op, by_tool in samples.items()}


def per_step(rounds: int) -> dict[str, dict[str, float]]:
    results = {}
    for name, (model, batch, labels) in list(workloads().items())[:3]:
        step = training_step(model, batch, labels, torch.optim.AdamW(model.parameters()))

        samples: dict[str, list[float]] = {tool: [] for tool in TOOLS}
        for _ in range(rounds):
            for tool, make in TOOLS.items():
                with make():
                    step()  # warm
                    for _ in range(5):
                        start = time.process_time()
                        step()
                        samples[tool].append(time.process_time() - start)
        medians = {tool: statistics.median(times) for tool, times in samples.items()}
        results[name] = {
            "bare_cpu_ms": medians["bare"] * 1e3,
            **{f"{tool}_cpu_slowdown": medians[tool] / medians["bare"] for tool in TOOLS if tool != "bare"},
            "load_average_1min": os.getloadavg()[0],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": 1,
        "clock": "process CPU time",
        "load_average_1min_at_start": os.getloadavg()[0],
        "per_op": per_op(args.rounds),
        "per_step": per_step(args.rounds),
    }
    print(json.dumps(report, indent=2))
    print(f"{'per op (us, CPU)':<32}" + "".join(f"{tool:>20}" for tool in TOOLS))
    for op, row in report["per_op"].items():
        print(f"{op:<32}" + "".join(f"{row[f'{tool}_us']:>20.2f}" for tool in TOOLS))
    print(f"{'per step (slowdown, CPU)':<32}" + "".join(f"{tool:>20}" for tool in list(TOOLS)[1:]))
    for name, row in report["per_step"].items():
        print(f"{name[:31]:<32}" + "".join(f"{row[f'{tool}_cpu_slowdown']:>19.3f}x" for tool in list(TOOLS)[1:]))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
