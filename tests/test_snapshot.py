"""Reading PyTorch's memory snapshots (issue 26): real H100 pickles, replay, and bad input.

The four pickles in benchmarks/results/2026-11-25-gpu/ were written on an NVIDIA
H100 (torch 2.11.0+cu130) by benchmarks/gpu_probes.py, which printed
``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` beside each
(probes-run1.json): those are the figures a loaded snapshot must give.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import nbmem
from nbmem.core.snapshot import SnapshotError, load_snapshot
from nbmem.core.units import format_bytes, round_allocation

MiB = 1024**2
SNAPSHOTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "2026-11-25-gpu"

# file: (max_memory_allocated, max_memory_reserved, memory_allocated, memory_reserved) printed on the H100
TRUTH = {
    "mlp": (236_032_512, 247_463_936, 168_882_176, 247_463_936),
    "cnn": (110_753_280, 132_120_576, 68_410_880, 132_120_576),
    "mlp-expandable": (236_032_512, 262_144_000, 168_882_176, 262_144_000),
    "oom": (2_081_522_688, 2_082_471_936, 739_344_384, 2_082_471_936),
}


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_a_real_snapshot_gives_the_allocators_own_figures(name):
    snapshot = nbmem.load_snapshot(SNAPSHOTS / f"snapshot-{name}.pickle")
    result = snapshot.result()
    assert (result.peak_allocated, result.peak_reserved, result.allocated_after, result.reserved_after) == TRUTH[name]
    assert result.allocated_before == 0  # recording began before the first allocation
    assert result.mode == "measured" and result.device == "cuda:0"
    assert sum(snapshot.by_category().values()) == result.allocated_after
    assert sum(block.size for block in snapshot.blocks()) == result.allocated_after


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_replaying_a_real_trace_through_the_simulation_reserves_the_same_segments(name):
    # under the settings each snapshot records: mlp-expandable ran with expandable_segments:True
    replay = load_snapshot(SNAPSHOTS / f"snapshot-{name}.pickle").replay()
    assert replay.exact and not replay.what_if, str(replay)
    assert replay.simulated_peak_reserved == TRUTH[name][1]


HISTORIES = SNAPSHOTS.parent / "2026-11-27-gpu" / "misses.json"


def _history(item: dict) -> io.BytesIO:
    """One of misses.json's H100 allocator histories (a training step's alloc/free/segment events, compacted by
    benchmarks/gpu_probes_misses.py) as the snapshot pickle it came from, less its segments."""
    trace = [{"action": action, "addr": address, "size": size} for action, address, size, *_ in item["events"]]
    return io.BytesIO(pickle.dumps({"segments": [], "device_traces": [trace]}))


def test_a_trace_counts_the_blocks_the_allocator_gave_not_the_bytes_asked_for():
    """The trace records the bytes asked for; CUDA counts the block, which is more where a free block's rest was
    too small to split (1 MiB or less). The 8 training steps of misses.json (H100, torch 2.11), each beside its
    ``max_memory_allocated()`` less what was allocated before: rounding each request up to 512 B fell short in 6 of
    them, by up to 9 MiB; the blocks nbmem's simulation gives at the trace's addresses are the H100's to the byte."""
    items = {key: item["value"] for key, item in json.loads(HISTORIES.read_text())["items"].items()
             if key.startswith("trace.")}
    assert len(items) == 8
    short = {}
    for key, item in items.items():
        snapshot = load_snapshot(_history(item))
        assert snapshot.peak_allocated == item["max_memory_allocated"], key
        assert snapshot.replay().simulated_peak_allocated == item["max_memory_allocated"], key
        asked = peak = 0
        for action, _, size, *_ in item["events"]:
            asked += {"alloc": 1, "free_completed": -1}.get(action, 0) * round_allocation(size)
            peak = max(peak, asked)
        short[key] = item["max_memory_allocated"] - peak
    assert sum(bytes_ > 0 for bytes_ in short.values()) == 6 and max(short.values()) == 9_175_040, short


def _trace_snapshot(trace: list[dict], segments: list[dict]) -> "nbmem.core.snapshot.Snapshot":
    return load_snapshot(io.BytesIO(pickle.dumps({"segments": segments, "device_traces": [trace]})))


def _entry(action: str, address: int, size: int, stream: int = 0) -> dict:
    return {"action": action, "addr": address, "size": size, "stream": stream}


def _segment(address: int, blocks: list[tuple[int, int, bool]], stream: int = 0) -> dict:
    return {"device": 0, "address": address, "total_size": 20 * MiB, "stream": stream, "segment_type": "large",
            "allocated_size": sum(size for _, size, alive in blocks if alive),
            "blocks": [{"address": at, "size": size, "state": "active_allocated" if alive else "inactive"}
                       for at, size, alive in blocks]}


FIRST, SECOND = 0x7F0000000000, 0x7F0040000000
LARGE, SMALLER = 18 * MiB + MiB // 2, MiB + MiB // 4  # a 1.5 MiB rest is split off; a 1.25 MiB request in it isn't


def test_a_request_the_replay_puts_elsewhere_than_the_allocator_counts_as_asked_and_says_so():
    """Found in review: where the replay can't put a request where the allocator did, its block is not known. Two
    streams (each has its own free blocks; the simulation has one), and a recording begun with blocks cached from
    before (the first request went into a segment the replay never saw): the 1.25 MiB request went into a new
    segment, where the replay would have given it the 1.5 MiB rest of the first whole. Counted as asked, the peak
    is the allocator's, and the result says how many were counted so."""
    streams = _trace_snapshot(
        [_entry("segment_alloc", FIRST, 20 * MiB), _entry("alloc", FIRST, LARGE),
         _entry("segment_alloc", SECOND, 20 * MiB, 1), _entry("alloc", SECOND, SMALLER, 1)],
        [_segment(FIRST, [(FIRST, LARGE, True), (FIRST + LARGE, 20 * MiB - LARGE, False)]),
         _segment(SECOND, [(SECOND, SMALLER, True), (SECOND + SMALLER, 20 * MiB - SMALLER, False)], 1)])
    result = streams.result()
    assert (result.peak_allocated, result.allocated_before) == (LARGE + SMALLER, 0)
    assert "it put 1 of 2 elsewhere (recording began with blocks cached from before, or several streams)" in str(result)
    cached = _trace_snapshot(
        [_entry("alloc", FIRST + 3 * MiB // 2, LARGE), _entry("segment_alloc", SECOND, 20 * MiB),
         _entry("alloc", SECOND, SMALLER), _entry("free_completed", SECOND, SMALLER)],
        [_segment(FIRST, [(FIRST, 3 * MiB // 2, True), (FIRST + 3 * MiB // 2, LARGE, True)]),
         _segment(SECOND, [(SECOND, 20 * MiB, False)])])
    assert (cached.peak_allocated, cached.allocated_at_start) == (3 * MiB // 2 + LARGE + SMALLER, 3 * MiB // 2)


def test_nbmems_own_file_reads_back_what_it_counted_not_the_allocators_blocks(tmp_path):
    """Found in review: a tracked block counts its storages; the file it writes places them with nbmem's
    simulation, which would give the 1.25 MiB storage a 1.5 MiB rest whole: read back, the figures are the
    block's own."""
    with nbmem.track("cpu", timeline=True) as scope:
        first = torch.empty(LARGE, dtype=torch.uint8)
        second = torch.empty(SMALLER, dtype=torch.uint8)
        del second, first
    scope.result.to_snapshot(str(tmp_path / "t.pickle"))
    back = load_snapshot(tmp_path / "t.pickle").result()
    assert back.peak_allocated == scope.result.peak_allocated and scope.result.peak == LARGE + SMALLER


def test_allocator_settings_it_cant_read_still_load_and_the_replay_says_how_to_go_on():
    snapshot = load_snapshot(io.BytesIO(pickle.dumps({
        "segments": [], "allocator_settings": {"max_split_size": "x"},
        "device_traces": [[_entry("segment_alloc", FIRST, 2 * MiB), _entry("alloc", FIRST, 600)]]})))
    assert snapshot.peak_allocated == 1024
    with pytest.raises(SnapshotError, match=r'can\'t be read .*snapshot.replay\("expandable_segments:True"\)'):
        snapshot.replay()
    what_if = snapshot.replay("expandable_segments:True")
    assert (what_if.real_settings, what_if.simulated_peak_reserved) == ("unreadable", 2 * MiB)


def test_a_what_if_on_one_real_trace_gives_what_the_other_setting_really_reserved():
    # the same MLP step ran twice on the H100, with and without expandable segments: each trace, replayed under
    # the other run's setting, reserves what the other run really did (262,144,000 B = 12 x 20 MiB + 5 x 2 MiB)
    plain = load_snapshot(SNAPSHOTS / "snapshot-mlp.pickle").replay("expandable_segments:True")
    assert plain.what_if and (plain.real_settings, plain.simulated_settings) == ("defaults", "expandable_segments:True")
    assert (plain.simulated_peak_reserved, plain.simulated_segments) == (TRUTH["mlp-expandable"][1], 2)
    expandable = load_snapshot(SNAPSHOTS / "snapshot-mlp-expandable.pickle").replay("")
    assert (expandable.simulated_peak_reserved, expandable.simulated_segments) == (TRUTH["mlp"][1], 16)
    assert "what if: the same allocations under expandable_segments:True (as recorded: defaults)" in str(plain)
    table = load_snapshot(SNAPSHOTS / "snapshot-mlp.pickle").try_settings("")
    assert "as recorded (defaults): 225 MiB allocated, 236 MiB reserved at the peak (measured)" in str(table)


def test_trying_settings_on_a_trace_is_a_table():
    table = load_snapshot(SNAPSHOTS / "snapshot-cnn.pickle").try_settings("", "expandable_segments:True",
                                                                          "garbage_collection_threshold:0.8")
    rows = {settings: (allocated, peak) for settings, allocated, peak, _, _ in table.rows()}
    assert rows["defaults"] == (TRUTH["cnn"][0], TRUTH["cnn"][1])  # the recorded settings: the real figures
    assert rows["expandable_segments:True"][1] == 6 * 20 * MiB + 1 * 2 * MiB  # 127,926,272 B in pages
    text = str(table)
    assert "peak reserved" in text and "acts only under torch.cuda.set_per_process_memory_fraction" in text
    with pytest.raises(ValueError, match="not a setting PyTorch's allocator knows"):
        load_snapshot(SNAPSHOTS / "snapshot-cnn.pickle").try_settings("expandable:True")
    with pytest.raises(ValueError, match="at least one"):
        load_snapshot(SNAPSHOTS / "snapshot-cnn.pickle").try_settings()


def test_an_out_of_memory_trace_is_a_failed_result_that_says_what_was_asked():
    snapshot = load_snapshot(SNAPSHOTS / "snapshot-oom.pickle")
    result = snapshot.result()
    assert result.error == "OutOfMemoryError"
    assert snapshot.oom["size"] == 256 * 1024**2
    assert any("256 MiB asked for" in note for note in result.notes)
    text = str(snapshot)
    assert "blocks alive at the snapshot" in text and "<string>:13 in <module>" in text


def test_frames_tell_the_optimizers_state_and_backwards_blocks():
    snapshot = load_snapshot(SNAPSHOTS / "snapshot-mlp.pickle")
    categories = snapshot.by_category()
    # what torch/optim's frames made (AdamW's exp_avg and exp_avg_sq), and backward's thread: cuBLAS's workspace
    assert categories["optimizer state"] == 67_149_824
    assert categories["backward"] == 32 * 1024**2
    assert set(categories) <= {"optimizer state", "backward", "unknown", "before the trace"}


def synthetic(trace, segments=()):
    return io.BytesIO(pickle.dumps({"segments": list(segments), "device_traces": [trace]}, protocol=4))


def test_what_existed_before_recording_is_the_start():
    trace = [{"action": "alloc", "addr": 4096, "size": 1000, "stream": 0, "time_us": 1, "frames": []}]
    segments = [{"device": 0, "address": 0, "total_size": 2 << 20, "allocated_size": 1536, "segment_type": "small",
                 "is_expandable": False, "blocks": [
                     {"address": 0, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []},
                     {"address": 4096, "size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []}]}]
    snapshot = load_snapshot(synthetic(trace, segments))
    result = snapshot.result()
    assert (result.allocated_before, result.peak_allocated, result.allocated_after) == (512, 1536, 1536)
    assert snapshot.by_category() == {"before the trace": 512, "unknown": 1024}


# -- bad input ------------------------------------------------------------------


class Explodes:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_pickle_that_names_any_class_or_function_is_refused_without_running_it():
    with pytest.raises(SnapshotError, match="names posix.system|names os.system"):
        load_snapshot(io.BytesIO(pickle.dumps(Explodes())))
    with pytest.raises(SnapshotError, match="names collections.OrderedDict"):
        load_snapshot(io.BytesIO(pickle.dumps({"segments": [], "device_traces": [], "x": __import__("collections").OrderedDict()})))


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not a pickle at all", "can't be read as a pickle"),
        (pickle.dumps([1, 2, 3]), "holds list, not a memory snapshot"),
        (pickle.dumps({"segments": []}), "not a memory snapshot"),
        (pickle.dumps({"segments": [], "device_traces": [[]]}), "neither segments nor allocator events"),
    ],
)
def test_what_is_not_a_snapshot_says_so(data, message):
    with pytest.raises(SnapshotError, match=message):
        load_snapshot(io.BytesIO(data))


def test_a_truncated_snapshot_says_so(tmp_path):
    whole = (SNAPSHOTS / "snapshot-cnn.pickle").read_bytes()
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SnapshotError, match="cut.pickle can't be read as a pickle"):
        load_snapshot(cut)


# -- export ---------------------------------------------------------------------


def tracked_step(**options):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(64, 256)
    with nbmem.track("cpu", timeline=True, **options) as scope:
        model(batch).pow(2).mean().backward()
        optimizer.step()
    return scope.result


def test_a_tracked_block_round_trips_through_a_snapshot(tmp_path):
    result = tracked_step(lines=True)
    path = tmp_path / "step.pickle"
    result.to_snapshot(str(path))
    assert path.read_bytes()[:2] == b"\x80\x04"  # protocol 4: pytorch.org's viewer can't read 5
    snapshot = load_snapshot(path)
    back = snapshot.result()
    assert (back.peak_allocated, back.allocated_after) == (result.peak_allocated, result.allocated_after)
    assert snapshot.replay().exact  # the segments written are the simulation's own
    # the categories nbmem gave each storage, "other" as the viewer's "unknown"
    after = {("unknown" if name == "other" else name): size for name, size in result.breakdown.after if size}
    assert snapshot.by_category() == after
    # the user's lines are the frames
    assert any(block.where.startswith("test_snapshot.py:") for block in snapshot.blocks())


def test_pytorchs_own_reader_reads_an_export(tmp_path):
    from torch.cuda import _memory_viz

    path = tmp_path / "step.pickle"
    tracked_step().to_snapshot(str(path))
    with open(path, "rb") as file:
        data = pickle.load(file)
    summary = _memory_viz.segsum(data)
    assert "total_reserved" in summary and f"segments: {len(data['segments'])}" in summary
    categories = {entry.get("category") for entry in data["device_traces"][0]}
    assert "unknown" in categories  # the viewer throws on categories without an "unknown" one


def test_to_snapshot_without_a_timeline_says_how_to_get_one(tmp_path):
    with nbmem.track("cpu") as scope:
        pass
    with pytest.raises(ValueError, match="timeline=True"):
        scope.result.to_snapshot(str(tmp_path / "x.pickle"))


def test_the_magic_writes_a_snapshot(shell, tmp_path):
    path = tmp_path / "cell.pickle"
    shell.run_cell("import torch")
    result = shell.run_cell(f"%%gpumem -o -q --backend tracked --device cpu --snapshot {path}\nkept = torch.zeros(256, 1024)")
    assert result.success
    assert load_snapshot(path).result().allocated_after == result.result.allocated_after
    shell.run_cell("del kept")


def test_a_snapshot_path_that_cant_be_written_is_refused_before_the_cell_runs(shell, tmp_path):
    """A missing folder, a folder itself, an empty name: a UsageError saying what to pass, and the cell not run
    (its training step would run for nothing, then fail on writing)."""
    shell.run_cell("import torch\nran = 0")
    for path, said in ((tmp_path / "missing" / "cell.pickle", "does not exist"), (tmp_path, "that is a folder"),
                       ("''", "needs a file name")):
        result = shell.run_cell(f"%%gpumem -q --backend tracked --device cpu --snapshot {path}\nran += 1")
        assert type(result.error_in_exec).__name__ == "UsageError" and said in str(result.error_in_exec)
    assert shell.user_ns["ran"] == 0


def test_a_snapshot_path_with_a_tilde_is_written_where_it_points(shell, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shell.run_cell("import torch")
    assert shell.run_cell("%%gpumem -q --backend tracked --device cpu --snapshot ~/cell.pickle\nx = torch.ones(4)").success
    assert (tmp_path / "cell.pickle").exists()
    shell.run_cell("del x")


def test_a_snapshot_the_disk_refuses_after_the_cell_keeps_the_cells_value(shell, tmp_path, monkeypatch, capsys):
    from nbmem.core.results import MemoryResult

    def refuse(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MemoryResult, "to_snapshot", refuse)
    shell.run_cell("import torch")
    result = shell.run_cell(f"%%gpumem --text --backend tracked --device cpu --snapshot {tmp_path / 'cell.pickle'}\n"
                            "kept = torch.ones(4)\n41 + 1")
    assert result.success and result.result == 42
    out = capsys.readouterr().out
    assert "the snapshot could not be written to" in out and "No space left on device" in out
    assert "snapshot written to" not in out.replace("could not be written to", "")
    shell.run_cell("del kept")


def test_a_loaded_snapshot_plots_its_trace_with_the_peak_where_the_allocator_had_it():
    snapshot = load_snapshot(SNAPSHOTS / "snapshot-oom.pickle")
    figure = snapshot.plot()
    axes = figure.axes[0]
    assert axes.get_title() == "gpumem timeline: live memory by category"
    assert "allocator event" in axes.get_xlabel()
    peak_label = [text.get_text() for text in axes.texts if text.get_text().startswith("peak")]
    assert peak_label == ["peak 1.94 GiB\n"]  # 2,081,522,688 B: torch.cuda.max_memory_allocated() on the H100
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert {"optimizer state", "unknown"} <= set(legend)


def test_an_out_of_memory_trace_is_diagnosed_from_the_snapshot():
    text = load_snapshot(SNAPSHOTS / "snapshot-oom.pickle").diagnose()
    # the probe capped the process at 2 GiB (set_per_process_memory_fraction) on an 80 GB card
    assert text.startswith("out of memory on cuda:0: 256 MiB asked for")
    assert "1.25 GiB of it cached in 7 free blocks (the largest 256 MiB)" in text
    assert "a cap stopped it" in text
    assert "256 MiB  unknown           <string>:13 in <module>" in text
    assert load_snapshot(SNAPSHOTS / "snapshot-mlp.pickle").diagnose() == "snapshot-mlp.pickle: no out-of-memory error in this trace"


def test_an_export_with_an_empty_storage_and_what_it_says_it_is(tmp_path):
    import torch

    with nbmem.track("cpu", timeline=True) as scope:
        empty = torch.empty(0)  # noqa: F841  (no allocator block: left out, it once crashed the export)
        kept = torch.ones(256, 1024)  # noqa: F841
    path = tmp_path / "block.pickle"
    scope.result.to_snapshot(str(path))
    result = load_snapshot(path).result()
    assert result.allocated_after == scope.result.allocated_after
    assert (result.mode, result.device) == ("tracked", "cpu")  # not a GPU's measurement
    assert "which nbmem wrote from a block tracked on cpu" in result.notes[0]


def test_a_measured_blocks_export_reads_back_as_what_its_tracker_saw(tmp_path):
    """A GPU block's timeline is the tracker's beside the measurement: the tensors, not what the allocator gave out
    beside them (an H100's probe: 573.8 MB measured, 505.6 MB in the file, read back as measured before)."""
    import dataclasses

    tracked = tracked_step()
    unseen = 8_519_680  # a cuBLAS workspace's size, say: allocated by the library, no tensor of nbmem's
    measured = dataclasses.replace(tracked, mode="measured", device="cuda:0",
                                   peak_allocated=tracked.peak_allocated + unseen)
    path = tmp_path / "measured.pickle"
    measured.to_snapshot(str(path))
    snapshot = load_snapshot(path)
    back = snapshot.result()
    assert (back.mode, back.device) == ("tracked", "cuda:0")
    assert back.peak_allocated == tracked.peak_allocated  # what the file holds: the tensors
    assert (f"the block's measured peak was {format_bytes(measured.peak_allocated)} allocated (the allocator's); this "
            f"file holds the tensors nbmem tracked beside it, {format_bytes(tracked.peak_allocated)} at their peak: "
            f"{format_bytes(unseen)} the allocator gave out beside them") in back.notes[1]
    assert "(tracked beside a measurement on cuda:0, placed by nbmem's simulation)" in str(snapshot.try_settings(""))


@pytest.mark.parametrize("contents", [{"segments": [1], "device_traces": [[]]},
                                      {"segments": [], "device_traces": [[{"action": "alloc", "size": "x"}]]}])
def test_a_snapshot_with_the_keys_but_not_the_contents_says_so(contents):
    with pytest.raises(SnapshotError, match="has a snapshot's keys but not its contents"):
        load_snapshot(io.BytesIO(pickle.dumps(contents)))


# -- measured on CUDA: PyTorch's own history (untested on CUDA hardware; PyTorch's calls stood in for) --------


class FakeHistory:
    """Stands in for torch.cuda.memory's history calls: records what nbmem asked, writes a one-event snapshot."""

    def __init__(self, monkeypatch, already_on=False, dump_fails=False):
        import torch

        self.calls, self.on, self.dump_fails = [], already_on, dump_fails
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.on, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self.dump)

    def record(self, enabled="all", **options):
        self.calls.append(("record", enabled))
        self.on = enabled is not None

    def dump(self, filename):
        self.calls.append(("dump", self.on))
        if self.dump_fails:
            raise OSError(f"can't write {filename}")
        trace = [{"action": "alloc", "addr": 0, "size": 512, "stream": 0, "time_us": 1, "frames": []}]
        with open(filename, "wb") as file:
            pickle.dump({"segments": [], "device_traces": [trace]}, file)


def test_the_allocator_history_is_dumped_before_recording_stops(monkeypatch, tmp_path):
    from nbmem.tracking.history import AllocatorHistory

    fake = FakeHistory(monkeypatch)
    with AllocatorHistory(tmp_path / "a.pickle") as history:
        assert fake.on
    # dumped while still recording (turning it off clears PyTorch's record), then turned off
    assert fake.calls == [("record", "all"), ("dump", True), ("record", None)] and not fake.on
    assert history.written and load_snapshot(tmp_path / "a.pickle").result().peak_allocated == 512

    fake = FakeHistory(monkeypatch, already_on=True)  # the user records already: nbmem leaves it on
    with AllocatorHistory(tmp_path / "b.pickle"):
        pass
    assert fake.calls == [("dump", True)] and fake.on


def test_a_failed_block_still_gets_its_snapshot_and_recording_stops(monkeypatch, tmp_path):
    from nbmem.tracking.history import AllocatorHistory

    fake = FakeHistory(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        with AllocatorHistory(tmp_path / "c.pickle"):
            raise KeyboardInterrupt
    assert fake.calls == [("record", "all"), ("dump", True), ("record", None)]
    fake = FakeHistory(monkeypatch, dump_fails=True)
    with pytest.raises(ZeroDivisionError):  # the block's error, not the dump's
        with AllocatorHistory(tmp_path / "d.pickle"):
            1 / 0
    assert not fake.on
    fake = FakeHistory(monkeypatch, dump_fails=True)
    with pytest.raises(OSError, match="can't write"):  # the block ran well: why its snapshot is missing
        with AllocatorHistory(tmp_path / "e.pickle"):
            pass
    assert not fake.on


@pytest.fixture
def measured_here(monkeypatch):
    """The magic decides it measures on CUDA (its scope still tracks here, on the CPU)."""
    import torch

    import nbmem.frontend.cell_snapshots as cell_snapshots
    import nbmem.frontend.magics as magics

    for module in (magics, cell_snapshots):
        monkeypatch.setattr(module, "resolve_backend", lambda backend, device: ("measured", torch.device("cuda", 0)))


def test_measured_the_magic_writes_pytorchs_own_snapshot(shell, monkeypatch, tmp_path, measured_here):
    fake = FakeHistory(monkeypatch)
    path = tmp_path / "cell.pickle"
    assert shell.run_cell(f"%%gpumem -q --snapshot {path}\nx = 1").success
    assert fake.calls == [("record", "all"), ("dump", True), ("record", None)]
    assert load_snapshot(path).source is None  # PyTorch's file, not nbmem's export


def test_measured_a_failing_cell_still_writes_its_snapshot(shell, monkeypatch, tmp_path, measured_here, capsys):
    fake = FakeHistory(monkeypatch)
    path = tmp_path / "failed.pickle"
    result = shell.run_cell(f"%%gpumem --snapshot {path}\nraise MemoryError('stand-in')")
    assert not result.success and isinstance(result.error_in_exec, MemoryError)
    assert fake.calls == [("record", "all"), ("dump", True), ("record", None)] and path.exists()
    assert "the failed cell's snapshot written to" in capsys.readouterr().out


def test_measured_every_cell_writes_each_cells_snapshot(shell, monkeypatch, tmp_path, measured_here):
    from nbmem.frontend.magics import log_every_cell

    fake = FakeHistory(monkeypatch)
    log_every_cell(shell, str(tmp_path / "log.jsonl"), backend="auto", snapshots=str(tmp_path))
    try:
        shell.run_cell("y = 2", store_history=True)
        count = shell.execution_count - 1
    finally:
        shell.run_cell("%gpumem off")
    assert (tmp_path / f"exec-{count}.pickle").exists()
    assert fake.calls[:3] == [("record", "all"), ("dump", True), ("record", None)] and not fake.on


# -- estimates exported, under allocator settings ------------------------------------------------------------


def estimated_run(**options):
    build = lambda: torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))  # noqa: E731
    make = lambda n: (torch.randn(n, 512), torch.randn(n, 512))  # noqa: E731
    return nbmem.estimate(build, make, batch_size=64, timeline=True, **options)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:20"])
def test_an_estimate_round_trips_through_a_snapshot_under_its_allocator_settings(tmp_path, conf):
    estimate = estimated_run(alloc_conf=conf)
    path = tmp_path / "estimate.pickle"
    estimate.to_snapshot(str(path))
    snapshot = load_snapshot(path)
    # the run from an empty device: the model built, then two steps; its peak is the estimate's
    assert (snapshot.peak_allocated, snapshot.peak_reserved) == (estimate.peak, estimate.reserved)
    assert snapshot.source["mode"] == "estimated"
    replay = snapshot.replay()  # under the settings the file records, which are the estimate's
    assert replay.exact and replay.simulated_settings == (conf or "defaults"), str(replay)
    expandable = [segment["is_expandable"] for segment in snapshot._segments]
    assert all(expandable) if conf.startswith("expandable") else not any(expandable)


def test_an_expandable_export_maps_pages_and_pytorchs_reader_reads_it(tmp_path):
    from torch.cuda import _memory_viz

    path = tmp_path / "expandable.pickle"
    estimated_run(alloc_conf="expandable_segments:True").to_snapshot(str(path))
    with open(path, "rb") as file:
        data = pickle.load(file)
    maps = [entry for entry in data["device_traces"][0] if entry["action"] == "segment_map"]
    assert maps and all(entry["size"] % (2 * MiB) == 0 for entry in maps)  # whole pages, 2 or 20 MiB
    assert sum(entry["size"] for entry in maps) == sum(segment["total_size"] for segment in data["segments"])
    assert "total_reserved" in _memory_viz.segsum(data)
    assert data["allocator_settings"]["expandable_segments"] is True


def test_an_estimate_without_a_timeline_says_how_to_get_one(tmp_path):
    build = lambda: torch.nn.Linear(4, 4)  # noqa: E731
    estimate = nbmem.estimate(build, lambda n: torch.randn(n, 4), batch_size=2)
    with pytest.raises(ValueError, match=r"estimate\(\.\.\., timeline=True\)"):
        estimate.to_snapshot(str(tmp_path / "x.pickle"))


def test_each_configuration_of_a_sweep_writes_its_own_snapshot(tmp_path):
    build = lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))  # noqa: E731
    make = lambda n: (torch.randn(n, 256), torch.randint(0, 4, (n,)))  # noqa: E731
    table = nbmem.sweep(build, make, batch_size=[8, 512], timeline=True, progress=False)
    peaks = []
    for index, row in enumerate(table.rows):
        row.result.to_snapshot(str(tmp_path / f"config-{index}.pickle"))
        peaks.append(load_snapshot(tmp_path / f"config-{index}.pickle").peak_allocated)
    assert peaks == [row.peak for row in table.rows] and peaks[0] < peaks[1]


def test_a_history_writes_one_snapshot_per_result_that_kept_its_allocations(tmp_path):
    with_timeline, without = tracked_step(), None
    with nbmem.track("cpu") as scope:
        torch.ones(1024)
    without = scope.result
    history = nbmem.History([with_timeline, without])
    written = history.to_snapshots(str(tmp_path / "cells"))
    assert [Path(path).name for path in written] == ["result-0.pickle"]
    assert load_snapshot(written[0]).result().peak_allocated == with_timeline.peak_allocated
    with pytest.raises(ValueError, match="--timeline"):
        nbmem.History([without]).to_snapshots(str(tmp_path / "none"))
