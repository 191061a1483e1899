"""PyTorch's memory snapshots read back: ``torch.cuda.memory._snapshot()`` pickles, as pytorch.org/memory_viz loads them.

A snapshot is plain data (torch 2.x): ``{"segments": [...], "device_traces":
[[...], ...]}``, newer ones with ``allocator_settings`` and
``external_annotations``. A segment is one cudaMalloc (or, with expandable
segments, one mapped range): ``address``, ``total_size``, ``allocated_size``,
``segment_type`` ("small"/"large"), ``is_expandable`` and its ``blocks``
(``address``, ``size``, ``requested_size``, ``state``: active_allocated,
active_pending_free, inactive; ``frames``). A trace entry records one allocator
event since ``torch.cuda.memory._record_memory_history()``: ``action`` (alloc,
free_requested, free_completed, segment_alloc, segment_free, segment_map,
segment_unmap, oom, snapshot), ``addr``, ``size`` (bytes asked for; a
block is that rounded up to 512 B, or more where the rest was too small to split),
``stream``, ``time_us`` and ``frames`` (``filename``, ``line``, ``name``;
C++ frames too).

:func:`load_snapshot` reads one with an unpickler that builds nothing but
dicts, lists, strings and numbers (a pickle can run code: this one can't),
checks its shape, and gives a :class:`Snapshot`: the trace's figures as a
:class:`~nbmem.MemoryResult` (``measured``, by the real allocator; the trace
records the bytes asked for, and a block's, which the allocator counts, is what
nbmem's simulation gives at the trace's addresses: CUDA hands out the lowest
address among equal free blocks. ``max_memory_allocated()`` to the byte in the
12 H100 traces at hand, where rounding each request up to 512 B was up to
9.2 MB short in 6 of them; a request the simulation can't put where the
allocator did, from a recording begun with blocks cached or on several
streams, counts as asked, and the result says how many), the blocks alive
with the line of Python that made each, what they were for where the
frames tell, fragmentation, the out-of-memory error the trace ends with, and
:meth:`Snapshot.replay` through nbmem's allocator simulation, compared
segment for segment with the real one.

>>> import io, pickle
>>> data = {"segments": [], "device_traces": [[
...     {"action": "segment_alloc", "addr": 0, "size": 2097152, "stream": 0, "time_us": 0, "frames": []},
...     {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 5, "frames": []},
...     {"action": "free_completed", "addr": 0, "size": 512, "stream": 0, "time_us": 9, "frames": []}]]}
>>> snapshot = load_snapshot(io.BytesIO(pickle.dumps(data)))
>>> snapshot.result().peak, snapshot.peak_reserved
(512, 2097152)
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass
from typing import IO, Any

from .allocator import SMALL_SIZE, CachingAllocatorSimulation
from .allocator_settings import AllocatorSettings, resolve_alloc_conf, settings_from_snapshot
from .results import MemoryResult
from .units import format_bytes, round_allocation

__all__ = ["load_snapshot", "Snapshot", "SnapshotBlock", "Replay", "SettingsTable", "SnapshotError"]

_PLAIN = (dict, list, str, int, float, bool, type(None))


class SnapshotError(ValueError):
    """The file is no memory snapshot nbmem can read; the message says what it is instead and what to do."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds only the plain types a snapshot holds: any class or function named in the pickle is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(
            f"this pickle names {module}.{name}, and a memory snapshot holds only dicts, lists, strings and numbers: "
            "it is not one torch.cuda.memory._snapshot() wrote (nbmem builds no object a pickle names, so a "
            "pickle from an untrusted source can run no code here)"
        )


@dataclass(frozen=True)
class SnapshotBlock:
    """A block alive when the snapshot was taken: its address and bytes, what made it, and what it was for."""

    address: int
    size: int
    where: str  # the innermost Python frame that is not PyTorch's: "train.py:14 in step", or "(no Python frame)"
    category: str


@dataclass(frozen=True)
class Replay:
    """The trace run through nbmem's allocator simulation, beside what the real allocator reserved."""

    real_segments: int
    simulated_segments: int
    real_reserved: int
    simulated_reserved: int
    real_peak_reserved: int
    simulated_peak_reserved: int
    notes: tuple[str, ...] = ()
    #: the allocator settings of the real run (as the snapshot records them) and of the simulation
    real_settings: str = "defaults"
    simulated_settings: str = "defaults"
    #: the simulation's allocated peak (blocks as its settings round them; the real one is the snapshot's)
    simulated_peak_allocated: int = 0

    @property
    def what_if(self) -> bool:
        """Whether the simulation ran under other settings than the real allocator (a what-if, not a check)."""
        return self.real_settings != self.simulated_settings

    @property
    def exact(self) -> bool:
        """Whether the simulation reserved the same segments, in count and bytes, now and at the peak."""
        return (self.real_segments, self.real_reserved, self.real_peak_reserved) == (
            self.simulated_segments, self.simulated_reserved, self.simulated_peak_reserved
        )

    def __str__(self) -> str:
        if self.what_if:
            head = (f"what if: the same allocations under {self.simulated_settings} "
                    f"(as recorded: {self.real_settings})\n")
        else:
            head = f"replay through nbmem's allocator simulation: {'the same' if self.exact else 'different'}\n"
        return (
            head +
            f"  segments now   real {self.real_segments}, simulated {self.simulated_segments}\n"
            f"  reserved now   real {format_bytes(self.real_reserved)}, simulated {format_bytes(self.simulated_reserved)}\n"
            f"  reserved peak  real {format_bytes(self.real_peak_reserved)}, simulated {format_bytes(self.simulated_peak_reserved)}"
            + "".join(f"\n  note: {note}" for note in self.notes)
        )


@dataclass(frozen=True)
class SettingsTable:
    """One trace replayed under several allocator settings: peak and final reserved, segments, beside the recorded run."""

    name: str
    peak_allocated: int
    real_peak_reserved: int
    real_settings: str
    replays: tuple[Replay, ...]
    #: how the recorded figures were obtained: "measured" (PyTorch's own record) or how nbmem made the file
    recorded_as: str = "measured"

    def rows(self) -> list[tuple[str, int, int, int, int]]:
        """Per setting tried: (settings, peak allocated, peak reserved, reserved at the end, segments at the end)."""
        return [(replay.simulated_settings, replay.simulated_peak_allocated, replay.simulated_peak_reserved,
                 replay.simulated_reserved, replay.simulated_segments) for replay in self.replays]

    def __str__(self) -> str:
        width = max(len("settings"), *(len(row[0]) for row in self.rows()))
        lines = [
            f"{self.name}: the same allocations under other allocator settings (simulated by nbmem)",
            f"  {'settings':<{width}}  {'peak allocated':>14}  {'peak reserved':>13}  {'at the end':>10}  segments",
        ]
        lines += [f"  {settings:<{width}}  {format_bytes(allocated):>14}  {format_bytes(peak):>13}  {format_bytes(end):>10}  "
                  f"{segments:>8}" for settings, allocated, peak, end, segments in self.rows()]
        lines.append(f"  as recorded ({self.real_settings or 'defaults'}): {format_bytes(self.peak_allocated)} allocated, "
                     f"{format_bytes(self.real_peak_reserved)} reserved at the peak ({self.recorded_as})")
        notes = dict.fromkeys(note for replay in self.replays for note in replay.notes)
        lines += [f"  note: {note}" for note in notes]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def load_snapshot(source: str | os.PathLike[str] | IO[bytes], device: int | None = None) -> "Snapshot":
    """Read a ``torch.cuda.memory._snapshot()`` pickle (a path or a binary file); ``device``: which device's trace.

    The default device is the one whose trace has events (the first, if several do).
    Nothing the pickle names is built (a pickle can run code; this one can't):
    a file that is not a snapshot, or is cut short, raises :class:`SnapshotError`
    saying what it is.

    >>> import io, pickle
    >>> load_snapshot(io.BytesIO(pickle.dumps([1, 2])))
    Traceback (most recent call last):
    ...
    nbmem.core.snapshot.SnapshotError: snapshot holds list, not a memory snapshot (a dict with 'segments' and 'device_traces', as torch.cuda.memory._snapshot() returns): record one with torch.cuda.memory._record_memory_history() and torch.cuda.memory._dump_snapshot(path)
    """
    name = "snapshot"
    try:
        if isinstance(source, (str, os.PathLike)):
            name = os.path.basename(os.fspath(source))
            with open(source, "rb") as file:
                data = _PlainUnpickler(io.BytesIO(file.read())).load()
        else:
            data = _PlainUnpickler(source).load()
    except SnapshotError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as error:
        raise SnapshotError(
            f"{name} can't be read as a pickle ({type(error).__name__}: {error}): a truncated file, or not a snapshot. "
            "Write one on the GPU with torch.cuda.memory._dump_snapshot('file.pickle') after "
            "torch.cuda.memory._record_memory_history()"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list) or not isinstance(data.get("device_traces"), list):
        kind = type(data).__name__ if not isinstance(data, dict) else f"a dict with keys {sorted(map(str, data))[:6]}"
        raise SnapshotError(
            f"{name} holds {kind}, not a memory snapshot (a dict with 'segments' and 'device_traces', as "
            "torch.cuda.memory._snapshot() returns): record one with torch.cuda.memory._record_memory_history() "
            "and torch.cuda.memory._dump_snapshot(path)"
        )
    traces = data["device_traces"]
    if device is None:
        device = next((index for index, trace in enumerate(traces) if trace), 0)
    trace = traces[device] if device < len(traces) else []
    if not isinstance(trace, list) or not all(isinstance(item, dict) for item in [*trace, *data["segments"]]):
        raise SnapshotError(
            f"{name} has a snapshot's keys but not its contents: its segments and trace entries must be dicts, as "
            "torch.cuda.memory._snapshot() writes them"
        )
    segments = [segment for segment in data["segments"] if segment.get("device", device) == device]
    if not trace and not segments:
        raise SnapshotError(
            f"{name} has neither segments nor allocator events on device {device}: nothing was recorded (was "
            "torch.cuda.memory._record_memory_history() called before the work, on this device?)"
        )
    try:
        written_by = data.get("nbmem")
        snapshot = Snapshot(name, device, segments, trace, dict(data.get("allocator_settings") or {}),
                            dict(written_by) if isinstance(written_by, dict) else None)
        snapshot.blocks()
    except (AttributeError, TypeError, ValueError, KeyError) as error:
        raise SnapshotError(
            f"{name} has a snapshot's keys but not its contents ({type(error).__name__}: {error}): segments and trace "
            "entries must be dicts with numeric sizes, as torch.cuda.memory._snapshot() writes them"
        ) from None
    return snapshot


def _written_as(source: dict[str, Any]) -> str:
    """What an nbmem-written snapshot's storages are: a measured block's are the tracker's beside the measurement."""
    mode = str(source.get("mode", "tracked"))
    return "tracked beside a measurement" if mode == "measured" else mode


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost Python frame outside PyTorch (a snapshot lists C++ frames too, innermost first)."""
    for frame in frames:
        filename = str(frame.get("filename", ""))
        python = filename.endswith(".py") or (filename.startswith("<") and int(frame.get("line", 0) or 0) > 0)
        if python and "/torch/" not in filename and "site-packages" not in filename:
            return f"{os.path.basename(filename)}:{frame.get('line', 0)} in {frame.get('name', '?')}"
    return "(no Python frame)"


def _category(frames: list[dict[str, Any]]) -> str:
    """What a block was for, where its frames say it; "unknown" otherwise (never guessed)."""
    names = [(str(frame.get("filename", "")), str(frame.get("name", ""))) for frame in frames]
    if any("/torch/optim/" in filename for filename, _ in names):
        return "optimizer state"
    if any("backward" in name.lower() or "/torch/autograd/" in filename for filename, name in names):
        return "backward"
    return "unknown"


class Snapshot:
    """One device's part of a memory snapshot: figures, blocks, fragmentation, its out-of-memory error, a replay.

    Made by :func:`load_snapshot`. ``result()`` is the trace as a
    :class:`~nbmem.MemoryResult` (measured: the real allocator's figures from
    the start of recording to the snapshot); ``blocks()`` the blocks alive,
    largest first, with the line of Python that made each and what it was for
    where its frames tell (``by_category()`` sums them); ``fragmentation()``
    what is reserved but free; ``oom`` the out-of-memory event the trace ends
    with (None if none); ``replay()`` the trace through nbmem's allocator
    simulation. ``print(snapshot)`` shows it all.

    Example, with a pickle written on a GPU::

        torch.cuda.memory._record_memory_history()
        train_step()
        torch.cuda.memory._dump_snapshot("step.pickle")

        snapshot = nbmem.load_snapshot("step.pickle")
        print(snapshot)                     # figures, largest blocks, fragmentation
        print(snapshot.replay())            # the simulation against the real segments
    """

    def __init__(self, name: str, device: int, segments: list[dict[str, Any]], trace: list[dict[str, Any]],
                 settings: dict[str, Any], source: dict[str, Any] | None = None) -> None:
        self.name, self.device, self.settings = name, device, settings
        #: how nbmem measured a block it wrote itself (result.to_snapshot): mode, device, label; None for PyTorch's
        self.source = source
        self._segments, self._trace = segments, trace
        self.reserved = sum(int(segment.get("total_size", 0)) for segment in segments)
        self.allocated = sum(int(segment.get("allocated_size", 0)) for segment in segments)
        allocated = reserved = peak_allocated = peak_reserved = 0
        born: set[int] = set()
        self._named: dict[int, str] = {}  # address -> the category its alloc entry names (nbmem's exports do)
        # an alloc's size is what was asked for; the allocator counts the block it gave, which is that rounded up to
        # 512 B, or more where the rest of a free block was too small to split: the replay's, where it put the request
        # where the allocator did (not so where recording began with blocks cached, or with several streams: those
        # count as rounded, and the result says how many). nbmem's own files hold what they counted, as written.
        self._block_sizes: dict[int, int] = {}
        self._misplaced = 0
        try:
            recorded = settings_from_snapshot(settings) if source is None else None
        except (TypeError, ValueError):
            recorded = None  # settings it can't read: requests counted as asked (replay() says so)
        if recorded is not None:
            for index, (block, where) in self._replayed(recorded)[1].items():
                # a small pool's block, or any with expandable segments, is split down to the rounded request
                # wherever it lies; a large pool's rest of 1 MiB or less is not, so there the place matters
                if (where == trace[index].get("addr") or recorded.expandable_segments
                        or block <= SMALL_SIZE):
                    self._block_sizes[index] = block
                else:
                    self._misplaced += 1
        made: dict[Any, int] = {}
        for index, entry in enumerate(trace):
            action, size = entry.get("action"), round_allocation(int(entry.get("size", 0)))
            if action == "alloc":
                made[entry.get("addr", 0)] = size = self._block_sizes.get(index, size)
                allocated += size
                born.add(entry.get("addr", 0))
                if isinstance(entry.get("category"), str):
                    self._named[entry.get("addr", 0)] = entry["category"]
            elif action == "free_completed":
                allocated -= made.pop(entry.get("addr", 0), size)
            elif action in ("segment_alloc", "segment_map"):
                reserved += size
            elif action in ("segment_free", "segment_unmap"):
                reserved -= size
            peak_allocated, peak_reserved = max(peak_allocated, allocated), max(peak_reserved, reserved)
        # the blocks alive at the snapshot say what the allocator really gave: where the replay gave one otherwise,
        # its peak may be off (the result says so)
        real = {block.get("address"): int(block.get("size", 0)) for segment in segments
                for block in segment.get("blocks", []) if block.get("state") == "active_allocated"}
        self._unlike = sum(1 for address, size in made.items() if address in real and real[address] != size)
        # what the trace's events don't explain was there before recording began
        self.allocated_at_start = self.allocated - allocated if segments else 0
        self.reserved_at_start = self.reserved - reserved if segments else 0
        self.peak_allocated = self.allocated_at_start + peak_allocated
        self.peak_reserved = self.reserved_at_start + peak_reserved
        self._born = born
        ooms = [entry for entry in trace if entry.get("action") == "oom"]
        self.oom: dict[str, Any] | None = ooms[-1] if ooms else None

    def blocks(self) -> list[SnapshotBlock]:
        """The blocks alive at the snapshot, largest first; those made before recording began say so."""
        found = []
        for segment in self._segments:
            for block in segment.get("blocks", []):
                if block.get("state") == "active_allocated":
                    frames = block.get("frames") or []
                    address = block.get("address")
                    category = (self._named.get(address) or _category(frames)) if address in self._born else "before the trace"
                    found.append(SnapshotBlock(int(block.get("address", 0)), int(block.get("size", 0)), _where(frames), category))
        return sorted(found, key=lambda block: -block.size)

    def by_category(self) -> dict[str, int]:
        """Bytes alive at the snapshot by what they were for, as far as the frames tell."""
        totals: dict[str, int] = {}
        for block in self.blocks():
            totals[block.category] = totals.get(block.category, 0) + block.size
        return totals

    def fragmentation(self) -> dict[str, int]:
        """Reserved but not allocated at the snapshot: its bytes, free blocks, and the largest one."""
        free = [int(block.get("size", 0)) for segment in self._segments for block in segment.get("blocks", [])
                if block.get("state") == "inactive"]
        return {"cached_bytes": self.reserved - self.allocated, "free_blocks": len(free), "largest_free_block": max(free, default=0)}

    def result(self) -> MemoryResult:
        """The trace's figures as a result: measured by the real allocator, from the start of recording to the snapshot."""
        times = [entry["time_us"] for entry in self._trace if isinstance(entry.get("time_us"), (int, float))]
        source = self.source
        if source is None:
            mode, device = "measured", f"cuda:{self.device}"
            notes = [f"read from {self.name}, a torch.cuda.memory._snapshot() of cuda:{self.device}: figures from its "
                     "allocator events, \"before\" is what was allocated when recording began"]
        else:
            mode, device = str(source.get("mode", "tracked")), str(source.get("device", "cpu"))
            notes = [f"read from {self.name}, which nbmem wrote from a block {mode} on {device}: its storages, placed by "
                     "nbmem's allocator simulation; times are op counts, and what was alive before the block is "
                     "allocated at its start"]
            if mode == "measured":
                # the storages are those the tracker beside the measurement saw: tracked figures, not the allocator's
                mode = "tracked"
                measured = source.get("peak_allocated")
                if isinstance(measured, int):
                    seen = self.peak_allocated
                    notes.append(
                        f"the block's measured peak was {format_bytes(measured)} allocated (the allocator's); this file "
                        f"holds the tensors nbmem tracked beside it, {format_bytes(seen)} at their peak"
                        + (f": {format_bytes(measured - seen)} the allocator gave out beside them (library "
                           "workspaces, buffers outside tensors) is not in it" if measured > seen else ""))
        if self._misplaced or self._unlike:
            allocs = sum(1 for entry in self._trace if entry.get("action") == "alloc")
            notes.append(
                "the trace records the bytes asked for; the blocks counted are those nbmem's allocator simulation gives "
                "where it put a request as the allocator did"
                + (f"; it put {self._misplaced} of {allocs} elsewhere (recording began with blocks cached from before, "
                   "or several streams), counted as their bytes rounded up to 512 B, which may be less than their "
                   "blocks" if self._misplaced else "")
                + (f"; {self._unlike} blocks alive at the end differ from the snapshot's own" if self._unlike else "")
                + ": the peak may be off by the difference")
        if self.oom is not None:
            notes.append(
                f"the trace ends in an out-of-memory error: {format_bytes(int(self.oom.get('size', 0)))} asked for with "
                f"{format_bytes(int(self.oom.get('device_free', 0)))} free on the device ({_where(self.oom.get('frames') or [])})"
            )
        return MemoryResult(
            mode=mode, device=device, allocated_before=self.allocated_at_start,  # type: ignore[arg-type]
            peak_allocated=self.peak_allocated, allocated_after=self.allocated,
            seconds=(max(times) - min(times)) / 1e6 if times and source is None else float("nan"),
            reserved_before=self.reserved_at_start, peak_reserved=self.peak_reserved, reserved_after=self.reserved,
            error="OutOfMemoryError" if self.oom is not None else None, label=self.name, notes=tuple(notes),
        )

    def diagnose(self, top: int = 5) -> str:
        """Why the trace ended in an out-of-memory error, from what the snapshot holds, and what could help."""
        if self.oom is None:
            return f"{self.name}: no out-of-memory error in this trace"
        asked = round_allocation(int(self.oom.get("size", 0)))
        spare = self.fragmentation()
        lines = [
            f"out of memory on cuda:{self.device}: {format_bytes(asked)} asked for at {_where(self.oom.get('frames') or [])}, "
            f"with {format_bytes(int(self.oom.get('device_free', 0)))} free on the device as the driver saw it",
            f"at the snapshot: {format_bytes(self.allocated)} allocated, {format_bytes(self.reserved)} reserved, "
            f"{format_bytes(spare['cached_bytes'])} of it cached in {spare['free_blocks']} free blocks "
            f"(the largest {format_bytes(spare['largest_free_block'])})",
        ]
        if spare["cached_bytes"] >= asked > spare["largest_free_block"]:
            lines.append(
                "fragmentation: enough is cached, but in no one block of that size; "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow instead of splitting"
            )
        if int(self.oom.get("device_free", 0)) >= asked:
            lines.append(
                "the device itself had room: a cap stopped it (torch.cuda.set_per_process_memory_fraction, "
                "or another process's reservation)"
            )
        lines.append("largest blocks alive (what they were for, where they were made):")
        lines += [f"  {format_bytes(block.size):>10}  {block.category:<17} {block.where}" for block in self.blocks()[:top]]
        totals = sorted(self.by_category().items(), key=lambda item: -item[1])
        lines.append("by what they were for: " + ", ".join(f"{name} {format_bytes(size)}" for name, size in totals))
        return "\n".join(lines)

    def plot(self, points: int = 2000) -> Any:
        """A matplotlib Figure: live bytes through the trace, stacked by what frames say they were for, the peak marked."""
        from types import SimpleNamespace

        from .charts import COLOURS, timeline_figure

        live = {"before the trace": self.allocated_at_start}
        made: dict[Any, tuple[str, int]] = {}
        rows = [dict(live)]
        for index, entry in enumerate(self._trace):
            action = entry.get("action")
            if action == "alloc":
                named = entry.get("category")
                category = named if isinstance(named, str) else _category(entry.get("frames") or [])
                category = category if category in COLOURS else "unknown"
                size = self._block_sizes.get(index, round_allocation(int(entry.get("size", 0))))
                made[entry.get("addr")] = (category, size)
                live[category] = live.get(category, 0) + size
            elif action == "free_completed" and entry.get("addr") in made:
                category, size = made.pop(entry.get("addr"))
                live[category] -= size
            else:
                continue
            rows.append(dict(live))
        names = list(live)
        totals = [sum(row.values()) for row in rows]
        peak = max(range(len(totals)), key=totals.__getitem__)
        stride = max(1, len(rows) // points)
        steps = sorted(set(range(0, len(rows), stride)) | {peak, len(rows) - 1})
        view = SimpleNamespace(
            steps=steps, series=[(name, [rows[step].get(name, 0) for step in steps]) for name in names],
            peak_step=peak, peak_bytes=totals[peak], peak_op=None, peak_module=None, ops=len(rows) - 1,
        )
        figure = timeline_figure(view)
        figure.axes[0].set_xlabel(f"allocator event ({len(rows) - 1} allocations and frees)")
        return figure

    def replay(self, alloc_conf: str | AllocatorSettings | None = None) -> Replay:
        """Run the trace's allocations and frees through :class:`~nbmem.core.allocator.CachingAllocatorSimulation`.

        With no ``alloc_conf``, under the settings the snapshot recorded (how
        exactly the simulation reproduces the real allocator); with one (a
        PYTORCH_ALLOC_CONF string such as ``"expandable_segments:True"``), what
        the same allocations would have reserved under those settings instead.
        """
        recorded: AllocatorSettings | None = None
        try:
            recorded = settings_from_snapshot(self.settings)
        except (TypeError, ValueError) as error:
            if alloc_conf is None:
                raise SnapshotError(
                    f"{self.name}'s allocator_settings can't be read ({error}): they are not what PyTorch writes. "
                    "Replay under the settings the run used, as a string: snapshot.replay(\"expandable_segments:True\")"
                ) from None
        settings = resolve_alloc_conf(alloc_conf) if alloc_conf is not None else recorded
        assert settings is not None
        notes = []
        if self.allocated_at_start:
            notes.append(f"{format_bytes(self.allocated_at_start)} was allocated before recording began: not replayed")
        notes += settings.caveats()
        simulation = self._replayed(settings)[0]
        return Replay(
            real_segments=len(self._segments), simulated_segments=sum(1 for segment in simulation._segments if segment.size),
            real_reserved=self.reserved, simulated_reserved=simulation.reserved,
            real_peak_reserved=self.peak_reserved, simulated_peak_reserved=simulation.peak_reserved, notes=tuple(notes),
            real_settings="unreadable" if recorded is None else (str(recorded) or "defaults"),
            simulated_settings=str(settings) or "defaults",
            simulated_peak_allocated=simulation.peak_allocated,
        )

    def _replayed(self, settings: AllocatorSettings) -> tuple[CachingAllocatorSimulation,
                                                              dict[int, tuple[int, int | None]]]:
        """The trace through the simulation, each request at the address the real allocator gave it (which of equal
        free blocks CUDA hands out follows the addresses); and for each alloc entry, by its index, the block it got
        and where the simulation put it."""
        simulation = CachingAllocatorSimulation(settings=settings)
        blocks = {}
        for index, entry in enumerate(self._trace):
            action, address = entry.get("action"), entry.get("addr")
            if action == "alloc":
                block = simulation.malloc(address, int(entry.get("size", 0)),
                                          address if isinstance(address, int) and address >= 0 else None)
                blocks[index] = (block, simulation.address(address))
            elif action == "free_completed":
                simulation.free(address)
            elif action in ("segment_free", "segment_unmap"):
                simulation.empty_cache()  # emptied cache (empty_cache, or an OOM's retry): the real one gave back
        return simulation, blocks

    def try_settings(self, *alloc_confs: str) -> SettingsTable:
        """This trace replayed under each of several allocator settings, side by side ("" is PyTorch's defaults).

        Example::

            print(snapshot.try_settings("", "expandable_segments:True", "max_split_size_mb:64"))
        """
        if not alloc_confs:
            raise ValueError('try_settings needs at least one PYTORCH_ALLOC_CONF string, e.g. '
                             'snapshot.try_settings("", "expandable_segments:True")')
        replays = [self.replay(text) for text in alloc_confs]
        recorded_as = "measured" if self.source is None else \
            f"{_written_as(self.source)} on {self.source.get('device', 'cpu')}, placed by nbmem's simulation"
        return SettingsTable(self.name, self.peak_allocated, self.peak_reserved, str(settings_from_snapshot(self.settings)),
                             tuple(replays), recorded_as)

    def __str__(self) -> str:
        lines = [str(self.result())]
        lines.append("  blocks alive at the snapshot, largest first:")
        lines += [f"    {format_bytes(block.size):>10}  {block.category:<17} {block.where}" for block in self.blocks()[:8]]
        spare = self.fragmentation()
        lines.append(f"  cached, not allocated: {format_bytes(spare['cached_bytes'])} in {spare['free_blocks']} free blocks, "
                     f"the largest {format_bytes(spare['largest_free_block'])}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))
