"""A block nbmem tracked, written as a PyTorch memory snapshot (``MemoryResult.to_snapshot``).

The file is what ``torch.cuda.memory._dump_snapshot`` writes (the format is
described in :mod:`nbmem.core.snapshot`, which reads it back), so
pytorch.org/memory_viz and ``torch.cuda._memory_viz`` open it: each storage of
the block's timeline is an allocation, placed by nbmem's caching-allocator
simulation, with the user's line and nbmem's category and module as its frames.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from .allocator import CachingAllocatorSimulation

__all__ = ["snapshot_of", "write_snapshot"]


#: Where exported segments start, and how far apart (no real address: the simulation's segments, laid out).
_BASE, _SPACING = 0x7F0000000000, 1 << 36


def _frames(category: str, module: str | None, line: Any) -> list[dict[str, Any]]:
    """A storage's frames for the viewer: the user's line (if known), then what nbmem knows it was for."""
    frames = [{"filename": str(line[0]), "line": int(line[1]), "name": "(your code)"}] if line else []
    frames.append({"filename": "nbmem", "line": 0, "name": f"{category}" + (f" in {module}" if module else "")})
    return frames


def snapshot_of(events: Any, device: int = 0, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A snapshot dict, as ``torch.cuda.memory._snapshot()`` makes, from a timeline's storages (Timeline.events).

    Addresses and segments come from nbmem's caching-allocator simulation;
    time is the op count; each entry's ``category`` is nbmem's ("other" is
    the viewer's "unknown", which it needs to exist). Storages alive before
    the block are allocated first, at time 0; storages of 0 bytes, which
    no allocator gives a block, are left out. ``source`` (how nbmem measured
    it) goes under the key "nbmem", which :func:`nbmem.load_snapshot` reads.
    """
    order = []
    for index, (born, ended, *_rest) in enumerate(events):
        order.append((born, 0, index))
        if ended is not None:
            order.append((ended - 1, 1, index))
    order.sort()
    simulation = CachingAllocatorSimulation()
    trace: list[dict[str, Any]] = []
    bases: dict[int, int] = {}

    def address(key: int) -> int:
        block = simulation._blocks[key]
        return bases[block.segment.number] + block.offset

    for time, kind, index in order:
        _, _, size, category, module, line = events[index]
        if not size:
            continue
        named = "unknown" if category == "other" else category
        entry = {"size": size, "stream": 0, "time_us": time, "frames": _frames(category, module, line), "category": named}
        if kind == 0:
            had = len(simulation._segments)
            simulation.malloc(index, size)
            if len(simulation._segments) > had:
                segment = simulation._segments[-1]
                bases[segment.number] = _BASE + segment.number * _SPACING
                trace.append({"action": "segment_alloc", "addr": bases[segment.number], "size": segment.size, "stream": 0,
                              "time_us": time, "frames": [], "category": "unknown"})
            trace.append({"action": "alloc", "addr": address(index), **entry})
        else:
            where = address(index)
            trace.append({"action": "free_requested", "addr": where, **entry})
            trace.append({"action": "free_completed", "addr": where, **entry})
            simulation.free(index)
    owners = {id(block): key for key, block in simulation._blocks.items()}
    segments: list[dict[str, Any]] = []
    for segment in simulation._segments:
        blocks: list[dict[str, Any]] = []
        block = segment.first
        while block is not None:
            key = owners.get(id(block))
            frames = _frames(*events[key][3:6]) if key is not None else []
            blocks.append({"address": bases[segment.number] + block.offset, "size": block.size, "requested_size": block.size,
                           "state": "active_allocated" if block.allocated else "inactive", "frames": frames})
            block = block.next
        allocated = sum(item["size"] for item in blocks if item["state"] == "active_allocated")
        segments.append({
            "device": device, "address": bases[segment.number], "total_size": segment.size, "allocated_size": allocated,
            "active_size": allocated, "requested_size": allocated, "stream": 0,
            "segment_type": "small" if segment.small else "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": blocks,
        })
    data = {"segments": segments, "device_traces": [trace if index == device else [] for index in range(device + 1)]}
    if source:
        data["nbmem"] = dict(source)
    return data


def write_snapshot(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a snapshot dict as the viewer reads it: pickle protocol 4 (pytorch.org/memory_viz can't read 5)."""
    with open(path, "wb") as file:
        pickle.dump(data, file, protocol=4)
