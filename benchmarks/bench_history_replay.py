"""The H100's allocator histories replayed: where an estimate's figure and the GPU's part (issue 24).

``results/2026-11-27-gpu/misses.json`` holds the CUDA caching allocator's history of 8 training steps on an H100
(torch 2.11; ``gpu_probes_misses.py``: every alloc, free and new segment, with its address, and the step's
``max_memory_allocated()`` less what was allocated before). For each, this script gives:

- ``measured``: that ``max_memory_allocated()``;
- ``asked``: the history's peak counting each request rounded up to 512 B (what a loaded snapshot reported before
  2026-11-27: the trace records the bytes asked for, CUDA counts the block);
- ``replay_in_order``: its events through nbmem's allocator simulation, segments ordered as they were made (as
  an estimate orders them);
- ``replay_at_addresses``: the same, each segment ordered at the address the H100 gave it (CUDA hands out the
  lowest address among equal free blocks), as ``nbmem.load_snapshot`` now counts a trace's blocks;
- ``estimate``: today's estimate of the step on this CPU for the ``H100-80GB`` preset (transformers' models where
  importable);
- ``same_at_peak``: whether the allocations alive at the estimate's peak are the history's at its own, size for
  size (bytes asked, rounded up to 512 B; the estimate's empty storages left out), read from the estimate's
  allocator simulation while it runs.

    python benchmarks/bench_history_replay.py [--json results/DATE-history-replay-cpu.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

from _environment import environment, write_json

HISTORIES = Path(__file__).resolve().parent / "results" / "2026-11-27-gpu" / "misses.json"


def replay(events: list[list[Any]], at_addresses: bool) -> int:
    from nbmem.core.allocator import CachingAllocatorSimulation

    simulation = CachingAllocatorSimulation()
    for action, address, size, *_ in events:
        if action == "alloc":
            simulation.malloc(address, size, address if at_addresses else None)
        elif action == "free_completed":
            simulation.free(address)
    return simulation.peak_allocated


def asked(events: list[list[Any]]) -> int:
    from nbmem.core.units import round_allocation

    now = peak = 0
    for action, _, size, *_ in events:
        now += {"alloc": 1, "free_completed": -1}.get(action, 0) * round_allocation(size)
        peak = max(peak, now)
    return peak


def live_at_peak(events: list[tuple[bool, object, int]]) -> dict[int, int]:
    """The sizes (rounded up to 512 B) alive where their sum peaks: size -> count, empty ones left out."""
    from nbmem.core.units import round_allocation

    live: collections.Counter[int] = collections.Counter()
    made: dict[object, int] = {}
    now, best = 0, (0, collections.Counter())
    for malloc, key, size in events:
        if malloc:
            made[key] = size = round_allocation(size)
            live[size] += 1
            now += size
        elif key in made:
            size = made.pop(key)
            live[size] -= 1
            now -= size
        if now > best[0]:
            best = (now, +live)
    return {size: count for size, count in best[1].items() if size}


def estimated_events(run: Any) -> tuple[Any, list[tuple[bool, object, int]]]:
    """``run()``'s result, and the allocations and frees of the first allocator simulation it made (the step's)."""
    from nbmem.core.allocator import CachingAllocatorSimulation

    events: list[tuple[bool, object, int, int]] = []
    malloc, free = CachingAllocatorSimulation.malloc, CachingAllocatorSimulation.free

    def recorded_malloc(self: Any, key: object, nbytes: int, address: int | None = None) -> int:
        events.append((True, key, nbytes, id(self)))
        return malloc(self, key, nbytes, address)

    def recorded_free(self: Any, key: object) -> None:
        events.append((False, key, 0, id(self)))
        free(self, key)

    CachingAllocatorSimulation.malloc, CachingAllocatorSimulation.free = recorded_malloc, recorded_free
    try:
        result = run()
    finally:
        CachingAllocatorSimulation.malloc, CachingAllocatorSimulation.free = malloc, free
    first = events[0][3]
    return result, [(made, key, size) for made, key, size, owner in events if owner == first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()

    from gpu_campaign import _zoo

    from nbmem.estimation.estimate import estimate

    source = json.loads(HISTORIES.read_text())
    report: dict[str, Any] = environment("transformers")
    report["histories"] = {"file": str(HISTORIES.relative_to(HISTORIES.parents[2])), "date": source["date"],
                           "device": source["device"], "torch": source["torch"]}
    zoo = _zoo()
    rows = []
    for key, item in source["items"].items():
        if not key.startswith("trace."):
            continue
        value = item["value"]
        model, precision, checkpointing, optimizer = key.removeprefix("trace.").rsplit(".", 3)
        build, make = zoo[model]
        result, events = estimated_events(lambda: estimate(build, make, device="H100-80GB", **value["knobs"]))
        history = [(action == "alloc", address, size) for action, address, size, *_ in value["events"]
                   if action in ("alloc", "free_completed")]
        row = {"model": model, "precision": precision, "checkpointing": checkpointing == "True",
               "optimizer": optimizer, "measured": value["max_memory_allocated"], "asked": asked(value["events"]),
               "replay_in_order": replay(value["events"], False), "replay_at_addresses": replay(value["events"], True),
               "estimate": result.peak, "same_at_peak": live_at_peak(events) == live_at_peak(history)}
        rows.append(row)
        print(f"{model:22} {precision:5} ckpt={checkpointing:5} {optimizer:12} measured {row['measured']:>12,}  "
              + "  ".join(f"{name} {row[name] - row['measured']:+,}"
                          for name in ("asked", "replay_in_order", "replay_at_addresses", "estimate"))
              + f"  same at the peak {row['same_at_peak']}", flush=True)
    report["rows"] = rows
    write_json(args.json, report)


if __name__ == "__main__":
    main()
