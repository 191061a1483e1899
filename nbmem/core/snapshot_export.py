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
from .allocator_settings import AllocatorSettings

__all__ = ["snapshot_of", "write_snapshot"]


#: Where exported segments start, and the gap between two segments' address ranges (no real address: the
#: simulation's segments, laid out below 2**53, which the viewer's JavaScript numbers hold exactly).
_BASE, _GAP = 0x7F0000000000, 1 << 30


def _frames(category: str, module: str | None, line: Any) -> list[dict[str, Any]]:
    """A storage's frames for the viewer: the user's line (if known), then what nbmem knows it was for."""
    frames = [{"filename": str(line[0]), "line": int(line[1]), "name": "(your code)"}] if line else []
    frames.append({"filename": "nbmem", "line": 0, "name": f"{category}" + (f" in {module}" if module else "")})
    return frames


def snapshot_of(events: Any, device: int = 0, source: dict[str, Any] | None = None,
                settings: AllocatorSettings | None = None) -> dict[str, Any]:
    """A snapshot dict, as ``torch.cuda.memory._snapshot()`` makes, from a timeline's storages (Timeline.events).

    Addresses and segments come from nbmem's caching-allocator simulation under
    ``settings`` (PyTorch's defaults if None; recorded as the snapshot's
    ``allocator_settings``, so a replay uses them too); time is the op count;
    each entry's ``category`` is nbmem's ("other" is the viewer's "unknown",
    which it needs to exist). Storages alive before the block are allocated
    first, at time 0; storages of 0 bytes, which no allocator gives a block,
    are left out. ``source`` (how nbmem measured it) goes under the key
    "nbmem", which :func:`nbmem.load_snapshot` reads.
    """
    settings = settings or AllocatorSettings()
    order = []
    for index, (born, ended, *_rest) in enumerate(events):
        order.append((born, 0, index))
        if ended is not None:
            order.append((ended - 1, 1, index))
    order.sort()
    simulation = CachingAllocatorSimulation(settings=settings, log=[])
    trace: list[dict[str, Any]] = []
    bases: dict[int, int] = {}
    next_base = _BASE

    def base(segment: Any) -> int:
        nonlocal next_base
        if segment.number not in bases:
            bases[segment.number] = next_base
            next_base += -(-segment.span // (2 << 20)) * (2 << 20) + _GAP
        return bases[segment.number]

    def address(key: int) -> int:
        block = simulation._blocks[key]
        return base(block.segment) + block.offset

    def reservations(time: int) -> None:  # what the allocator reserved or gave back for the last request
        assert simulation.log is not None
        for action, segment, offset, size in simulation.log:
            trace.append({"action": action, "addr": base(segment) + offset, "size": size, "stream": 0,
                          "time_us": time, "frames": [], "category": "unknown"})
        simulation.log.clear()

    for time, kind, index in order:
        _, _, size, category, module, line = events[index]
        if not size:
            continue
        named = "unknown" if category == "other" else category
        entry = {"size": size, "stream": 0, "time_us": time, "frames": _frames(category, module, line), "category": named}
        if kind == 0:
            simulation.malloc(index, size)
            reservations(time)
            trace.append({"action": "alloc", "addr": address(index), **entry})
        else:
            where = address(index)
            trace.append({"action": "free_requested", "addr": where, **entry})
            trace.append({"action": "free_completed", "addr": where, **entry})
            simulation.free(index)
    owners = {id(block): key for key, block in simulation._blocks.items()}
    segments: list[dict[str, Any]] = []
    for segment in simulation._segments:
        runs: list[list[Any]] = [[]]  # an expandable segment shows each mapped range as a segment, as PyTorch does
        block = segment.first
        while block is not None:
            if block.mapped:
                runs[-1].append(block)
            elif runs[-1]:
                runs.append([])
            block = block.next
        for run in (run for run in runs if run):
            blocks: list[dict[str, Any]] = []
            for block in run:
                key = owners.get(id(block))
                frames = _frames(*events[key][3:6]) if key is not None else []
                blocks.append({"address": base(segment) + block.offset, "size": block.size,
                               "requested_size": block.size, "frames": frames,
                               "state": "active_allocated" if block.allocated else "inactive"})
            allocated = sum(item["size"] for item in blocks if item["state"] == "active_allocated")
            segments.append({
                "device": device, "address": blocks[0]["address"], "total_size": sum(item["size"] for item in blocks),
                "allocated_size": allocated, "active_size": allocated, "requested_size": allocated, "stream": 0,
                "segment_type": "small" if segment.small else "large", "segment_pool_id": (0, 0),
                "is_expandable": bool(segment.page), "frames": [], "blocks": blocks,
            })
    data = {"segments": segments, "device_traces": [trace if index == device else [] for index in range(device + 1)],
            "allocator_settings": settings.as_snapshot()}
    if source:
        data["nbmem"] = dict(source)
    return data


def write_snapshot(data: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a snapshot dict as the viewer reads it: pickle protocol 4 (pytorch.org/memory_viz can't read 5)."""
    with open(path, "wb") as file:
        pickle.dump(data, file, protocol=4)
