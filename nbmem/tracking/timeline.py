"""Live memory through a block, op by op, stacked by category.

Each point is the moment just after an op allocated its outputs, before
anything was freed; the highest point is the block's peak.

The tracker records every storage alive during the block with the op that
made it and the op during which it was freed; a sweep over those intervals
gives the live bytes of each category after every op, by what each storage
turned out to be (as the breakdown does). Long blocks are downsampled to at
most ``points`` samples, each bucket represented by its highest moment, so
the peak is always kept.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from ..core.results import CATEGORIES
from .tracker import Recording

__all__ = ["Timeline", "build_timeline", "op_name"]


@dataclass(frozen=True)
class Timeline:
    """Live bytes per category after sampled ops of a block (``ops`` ops in all).

    Recorded when asked for: ``nbmem.measure(timeline=True)`` or
    ``%%gpumem --timeline``, then ``result.timeline``. ``steps`` are op
    numbers (0: before the first op), ``series`` each category's bytes at
    those steps, :meth:`totals` their sums; ``peak_op`` and ``peak_module``
    name where the peak was. :meth:`plot` draws it (matplotlib).

    >>> import torch
    >>> from nbmem import MemoryScope, Tracker
    >>> with MemoryScope(tracker=Tracker("cpu"), timeline=True) as scope:
    ...     a = torch.ones(1024, 128)     # 512 KiB
    ...     b = a * 2                     # 512 KiB more: the peak
    ...     del a
    >>> timeline = scope.result.timeline
    >>> timeline.totals(), timeline.peak_op
    ([0, 524288, 1048576], 'aten.mul.Tensor')
    >>> print(timeline)
    gpumem timeline: 2 ops, 3 points; peak 1.00 MiB after op 2 (aten.mul.Tensor)
    """

    steps: tuple[int, ...]  # op numbers, 1 = the block's first op
    series: tuple[tuple[str, tuple[int, ...]], ...]  # per category, aligned with steps
    ops: int
    peak_step: int
    peak_bytes: int
    peak_op: str | None
    peak_module: str | None
    #: Every storage of the block: (point it was made at, first point it was no longer alive at or None, bytes,
    #: category, module, the user's line or None); point 0 is before the first op. For result.to_snapshot().
    events: tuple[tuple[int, int | None, int, str, str | None, Any], ...] = field(default=(), compare=False, repr=False)

    def totals(self) -> list[int]:
        return [sum(values) for values in zip(*(values for _, values in self.series))]

    def plot(self) -> Any:
        """A matplotlib Figure: stacked areas per category, the peak marked and named."""
        from ..core.charts import timeline_figure

        return timeline_figure(self)

    def __str__(self) -> str:
        from ..core.units import format_bytes

        where = f" ({self.peak_op}{' in ' + self.peak_module if self.peak_module else ''})" if self.peak_op else ""
        return (
            f"gpumem timeline: {self.ops} ops, {len(self.steps)} points; peak {format_bytes(self.peak_bytes)}"
            f" after op {self.peak_step}{where}"
        )


def build_timeline(recording: Recording, end: int, *, points: int = 2000, module: str | None = None) -> Timeline:
    """The timeline of ``recording``, which ran until op index ``end`` (the tracker's count)."""
    start = recording.start
    count = max(end - start, 0)
    # one more slot than ops: index 0 is the moment before the first op
    deltas = {name: [0] * (count + 2) for name in CATEGORIES}
    events = []
    # Point k is the moment just after op k allocated its outputs, before
    # anything was freed: that is when the tracker's peak can be reached. A
    # storage freed during or after op k (died == k) was alive then.
    for record in recording.storages:
        born = max(record.born, start) - start
        died = count + 1 if record.died is None else max(record.died - start + 1, born + 1)
        deltas[record.category][born] += record.size
        deltas[record.category][died] -= record.size
        events.append((born, None if record.died is None else died, record.size, record.category, record.module, record.line))
    live = {name: list(itertools.accumulate(values[: count + 1])) for name, values in deltas.items()}
    totals = [sum(values) for values in zip(*live.values())]
    peak_index = max(range(len(totals)), key=totals.__getitem__) if totals else 0
    steps = _downsample(totals, points, peak_index)
    peak_op = recording.ops[peak_index - 1] if 0 < peak_index <= len(recording.ops) else None
    return Timeline(
        steps=tuple(steps),
        series=tuple((name, tuple(live[name][index] for index in steps)) for name in CATEGORIES),
        ops=count,
        peak_step=peak_index,
        peak_bytes=totals[peak_index] if totals else 0,
        peak_op=op_name(peak_op),
        peak_module=module,
        events=tuple(events),
    )


def _downsample(totals: list[int], points: int, peak_index: int) -> list[int]:
    """At most ``points`` indices: the highest of each equal bucket, the peak always among them."""
    if len(totals) <= points:
        return list(range(len(totals)))
    size = len(totals) / points
    chosen = set()
    for bucket in range(points):
        low, high = int(bucket * size), int((bucket + 1) * size)
        chosen.add(max(range(low, max(high, low + 1)), key=totals.__getitem__))
    chosen.add(peak_index)
    return sorted(chosen)


def op_name(op: Any) -> str | None:
    """``aten.addmm.default`` -> ``aten.addmm``: the op as a user would look it up."""
    if op is None:
        return None
    name = str(op)
    return name[: -len(".default")] if name.endswith(".default") else name
