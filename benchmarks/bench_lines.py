"""What charging memory to lines costs: a tracked training step with and without ``lines=True`` (issue 23).

The three workloads of ``bench_overhead.py`` (MLP, CNN, transformer; AdamW),
interleaved in rounds so that the machine's load hits every column alike:
bare, ``nbmem.track(engine="dispatch")`` and the same with ``lines=True``,
``nbmem.track(engine="native")`` and the same with ``lines=True``, and the
peer that also names lines, ``torch.profiler`` with ``profile_memory`` and
``with_stack``. Process CPU time per step, median; the goals: lines within
6 % of the dispatch engine without them, and within 2 % of the native engine
without them.

    python benchmarks/bench_lines.py [--repeats 60] [--json results/DATE-lines-cpu.json] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any, Callable

import torch

import nbmem
from _environment import environment, parse_with_threads, write_json
from bench_overhead import training_step, workloads


def stack_profiler() -> object:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, with_stack=True)


CONTEXTS: dict[str, Callable[[], Any]] = {
    "bare": contextlib.nullcontext,
    "tracked": lambda: nbmem.track("cpu", engine="dispatch"),
    "tracked_lines": lambda: nbmem.track("cpu", engine="dispatch", lines=True),
    "native": lambda: nbmem.track("cpu", engine="native"),
    "native_lines": lambda: nbmem.track("cpu", engine="native", lines=True),
    "profiler_with_stack": stack_profiler,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--json")
    args = parse_with_threads(parser)
    report: dict[str, Any] = environment()
    rows = {}
    for name, (model, batch, labels) in workloads().items():
        optimizer = torch.optim.AdamW(model.parameters())
        step = training_step(model, batch, labels, optimizer)
        cpu: dict[str, list[float]] = {key: [] for key in CONTEXTS}
        steps_per_round = 5
        for _ in range(max(1, args.repeats // steps_per_round)):
            for key, make in CONTEXTS.items():
                with make():
                    step()  # warm
                    for _ in range(steps_per_round):
                        start = time.process_time()
                        step()
                        cpu[key].append(time.process_time() - start)
        medians = {key: statistics.median(values) for key, values in cpu.items()}
        rows[name] = {
            **{f"{key}_cpu_ms": round(value * 1e3, 3) for key, value in medians.items()},
            "lines_over_tracked": round(medians["tracked_lines"] / medians["tracked"], 4),
            "native_lines_over_native": round(medians["native_lines"] / medians["native"], 4),
            "native_over_bare": round(medians["native"] / medians["bare"], 4),
            "tracked_over_bare": round(medians["tracked"] / medians["bare"], 4),
            "profiler_with_stack_over_bare": round(medians["profiler_with_stack"] / medians["bare"], 4),
            "load_average_1min": os.getloadavg()[0],
        }
        print(f"{name:48} lines/tracked {rows[name]['lines_over_tracked']:.3f}  native lines/native "
              f"{rows[name]['native_lines_over_native']:.3f}  tracked/bare "
              f"{rows[name]['tracked_over_bare']:.3f}  profiler+stack/bare {rows[name]['profiler_with_stack_over_bare']:.3f}",
              flush=True)
    report["steps"] = rows
    write_json(args.json, report)


if __name__ == "__main__":
    main()
