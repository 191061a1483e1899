"""What the live gauge costs a tracked cell (issue 15: at most 1 %).

Run: python benchmarks/bench_gauge.py [--rounds 12] [--seconds 1.5] [--threads 1] [--json out.json]

Tracked training steps (forward, loss, backward, AdamW step, zero_grad) on
the MLP, the CNN and the transformer of ``bench_overhead.py`` (its
``workloads()``, the tiny worst case left out), inside ``nbmem.track("cpu")``
as a ``%%gpumem`` cell runs them. Rounds alternate: the same number of steps
(about ``--seconds`` each) with no gauge, then with a :class:`LiveGauge` at
its real interval (0.5 s), started at the round's start (no delay, so every
round has its readings). The gauge's ``show`` builds the text and HTML a
real one sends and serialises them as a kernel would (``json.dumps``); the
socket send itself (ipykernel's IOPub thread) is not in it.

Each round's whole time is measured, not a median step: the gauge costs a
few moments a second, which a median would hide. Reported per workload: the
ratio of the summed wall time with the gauge to without, the same for the
process's CPU time (all threads, the gauge's included), and the median of
the per-round ratios. The machine, versions, date and load average are
written with the figures (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nbmem  # noqa: E402
from _environment import environment, parse_with_threads, write_json  # noqa: E402
from bench_overhead import workloads  # noqa: E402  (the same workloads as the overhead benchmark)
from nbmem.frontend.live_gauge import INTERVAL, GaugeReading, LiveGauge  # noqa: E402


def show(reading: GaugeReading) -> None:
    """What a real gauge's display does, less the socket: the bundle, made and serialised."""
    json.dumps({"text/plain": reading.text(), "text/html": reading.html()})


def run_round(step, steps: int, gauge: bool) -> tuple[float, float, int]:
    """(wall s, CPU s, readings shown) of ``steps`` tracked steps, with or without the gauge."""
    with nbmem.track("cpu") as scope:
        live = LiveGauge(scope, show, delay=0.0).start() if gauge else None
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        shown = live.stop() if live is not None else 0
    return wall, cpu, shown


def tick_cost(repeats: int = 2000) -> dict[str, float]:
    """One tick's own work on the cell's thread, timed directly: read the scope, make the reading, show it.

    Its share of a second at the gauge's interval is the part of the cost that
    noise can't hide (the GIL hand-overs around it are not in it).
    """
    with nbmem.track("cpu") as scope:
        kept = torch.zeros(1024)
        gauge = LiveGauge(scope, show)
        start = time.perf_counter()
        for _ in range(repeats):
            allocated, peak, seconds = scope.so_far()  # type: ignore[misc]
            gauge.show(GaugeReading(scope.mode, str(scope.device), allocated, peak, None, seconds))
        per_tick = (time.perf_counter() - start) / repeats
    del kept
    return {"tick_us": per_tick * 1e6, "share_of_a_second_at_interval": per_tick / INTERVAL}


def measure(rounds: int, seconds: float) -> dict[str, dict[str, float]]:
    results = {}
    for name, (model, batch, labels) in workloads().items():
        if "worst case" in name:
            continue
        optimizer = torch.optim.AdamW(model.parameters())

        def step() -> None:
            loss = nn.functional.cross_entropy(model(batch), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        one, _, _ = run_round(step, 3, gauge=False)  # warm, and how long a step takes
        steps = max(1, round(seconds / (one / 3)))
        off_wall, on_wall, off_cpu, on_cpu, ratios, readings = [], [], [], [], [], 0
        for index in range(rounds):
            order = (False, True) if index % 2 == 0 else (True, False)  # neither always goes first
            pair = {}
            for gauge in order:
                pair[gauge] = run_round(step, steps, gauge)
            off_wall.append(pair[False][0]); off_cpu.append(pair[False][1])
            on_wall.append(pair[True][0]); on_cpu.append(pair[True][1])
            readings += pair[True][2]
            ratios.append(pair[True][0] / pair[False][0])
        results[name] = {
            "steps_per_round": steps,
            "rounds": rounds,
            "readings_shown": readings,
            "off_wall_s": sum(off_wall),
            "on_wall_s": sum(on_wall),
            "wall_ratio": sum(on_wall) / sum(off_wall),
            "cpu_ratio": sum(on_cpu) / sum(off_cpu),
            "median_round_ratio": statistics.median(ratios),
            "load_average_1min": os.getloadavg()[0],
        }
        row = results[name]
        print(f"{name:<50} wall {row['wall_ratio']:.4f}x  cpu {row['cpu_ratio']:.4f}x  "
              f"median round {row['median_round_ratio']:.4f}x  ({steps} steps x {rounds} rounds, "
              f"{readings} readings, load {row['load_average_1min']:.1f})", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="pairs of rounds (gauge off, on) per workload")
    parser.add_argument("--seconds", type=float, default=1.5, help="about how long one round runs")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parse_with_threads(parser)
    report = {
        **environment(),
        "gauge_interval_s": INTERVAL,
        "load_average_1min_at_start": os.getloadavg()[0],
        "tick": tick_cost(),
        "training_step": measure(args.rounds, args.seconds),
    }
    tick = report["tick"]
    print(f"one tick: {tick['tick_us']:.0f} us, {tick['share_of_a_second_at_interval']:.4%} of the time at one tick "
          f"per {INTERVAL} s; load average {report['load_average_1min_at_start']:.1f} at the start")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
