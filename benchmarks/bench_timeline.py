"""How long a timeline takes for a long cell (issue target: 100k ops render in under 2 s).

Run: python benchmarks/bench_timeline.py [--ops 100000] [--json FILE]

Times, for a block of ``--ops`` small in-place ops plus a few allocations:
running it tracked with the timeline recording (for reference), building the
Timeline from the recording (sweep + downsampling), and rendering it to a PNG
(matplotlib Agg), which is what ``%%gpumem --timeline`` shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import matplotlib
import torch

import nbmem
from nbmem.core.charts import figure_png, timeline_figure
from nbmem.tracking.scope import MemoryScope
from nbmem.tracking.timeline import build_timeline
from nbmem.tracking.tracker import Tracker

from _environment import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    tracker = Tracker("cpu")
    recording = None
    run, build, render = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        with MemoryScope(tracker=tracker) as scope:
            recording = tracker.start_recording()
            counter = torch.zeros(16)
            keep = []
            for step in range(args.ops):
                counter.add_(1)
                if step % 10_000 == 0:
                    keep.append(torch.zeros(256, 256))  # steps up the memory now and then
            tracker.stop_recording(recording)
        run.append(time.perf_counter() - start)
        start = time.perf_counter()
        timeline = build_timeline(recording, tracker.op_count)
        build.append(time.perf_counter() - start)
        start = time.perf_counter()
        png = figure_png(timeline_figure(timeline))
        render.append(time.perf_counter() - start)
        assert timeline.peak_bytes == scope.result.peak_allocated and len(png) > 1000
        del keep
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "matplotlib": matplotlib.__version__,
        "nbmem": nbmem.__version__,
        "ops": timeline.ops,
        "points": len(timeline.steps),
        "median_s": {
            "run_tracked_with_recording": statistics.median(run),
            "build_timeline": statistics.median(build),
            "render_png": statistics.median(render),
            "build_plus_render": statistics.median(b + r for b, r in zip(build, render)),
        },
    }
    print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
