"""What nbmem costs: the magic's fixed cost, and tracked mode's slowdown.

Run: python benchmarks/bench_overhead.py [--json results.json]

1. Fixed cost of ``%%gpumem -q`` on an empty cell, in a real IPython shell,
   above the same cell without the magic: for the measured code path (the
   CUDA counter replaced by a stand-in, so it runs on a CPU) and for tracked
   mode.
2. Tracked mode's slowdown of one training step (forward, loss, backward,
   AdamW step, zero_grad) of an MLP, a CNN and a small transformer, as the
   ratio of the median step time inside nbmem's tracker (breakdown on: the
   attribution hooks are part of every tracker) to the median without it.
   Side by side in the same interleaved rounds: PyTorch's MemTracker
   (torch.distributed._tools.mem_tracker, with track_external(model,
   optimizer)) and torch.profiler.profile(profile_memory=True), and an empty
   dispatch mode: what PyTorch itself charges for any Python dispatch mode,
   the floor for a tracker built on one. Only the steps are timed, never
   entering or leaving a tool (the profiler's post-processing happens at
   exit). Issue 12's target: at most 1.10x, and no slower than the profiler.
   A deliberately tiny MLP shows the worst case, where the fixed
   per-operation cost dominates.

   nbmem's native engine (``engine="native"``, nbmem.tracking.native_tracking: the CPU
   allocator wrapped, its blocks counted in C++, the same attribution hooks) runs in
   the same rounds, breakdown on, and its peak of one step is set beside the
   allocator events' (below) and the default engine's.

   Two more columns show the floors of the two designs considered: an empty
   dispatch mode as nbmem's runs (unwrapped, its code marked for Dynamo to
   skip, see nbmem.tracking.dispatch), and the profiler recording allocator events
   only (no ops: a non-CPU activity on this CPU-only torch), the cheapest way
   to see every CPU allocation without Python per op.
3. The allocator's events against both engines: one step recorded each way,
   the allocator's peak (each allocation rounded to 512 B as nbmem rounds a
   storage) against the default engine's tracked peak above what it adopted
   and the native engine's peak, and how many allocations no op returned (a
   kernel's own scratch, wrapped scalars), which the dispatch mode never sees
   and the native engine counts while they live.

Timings are medians of repeated runs; the machine, versions, date and load
average (os.getloadavg, the machine is shared) are printed with them; a
summary table ends the output. Run it with --skip-magic to time only the
training steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nbmem
from nbmem.tracking import counters; from nbmem.tracking import scope
from nbmem.tracking.accelerators import DeviceCounter
from nbmem.tracking.native_tracking import native_tracker

from _environment import environment, parse_with_threads, write_json


def median_seconds(run: Callable[[], object], repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class StandInCuda(DeviceCounter):
    """The measured code path without a GPU: fixed figures, no torch.cuda calls."""

    def __init__(self) -> None:
        self.device, self.index, self.cuda = torch.device("cuda", 0), 0, True
        self._missing = ()
        self.scopes = counters.PeakScopes(self)

    def allocated(self) -> int:
        return 1 << 30

    def reserved(self) -> int:
        return 2 << 30

    def peak_allocated(self) -> int:
        return 1 << 30

    def peak_reserved(self) -> int:
        return 2 << 30

    def reset_peak(self) -> None:
        pass

    def device_view(self):
        return "stand-in", 80 << 30, 70 << 30

    def synchronize(self) -> None:
        pass


def magic_fixed_cost(repeats: int) -> dict[str, float]:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing.globalipapp import start_ipython

    start_ipython()
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbmem")
    empty = median_seconds(lambda: shell.run_cell("pass"), repeats)
    tracked = median_seconds(lambda: shell.run_cell("%%gpumem -q --backend tracked\npass"), repeats)
    stand_in = StandInCuda()
    original_resolve, original_counter = scope.resolve_backend, scope.device_counter
    scope.resolve_backend = lambda backend="auto", device=None: ("measured", torch.device("cuda", 0))
    scope.device_counter = lambda device: stand_in
    try:
        measured = median_seconds(lambda: shell.run_cell("%%gpumem -q\npass"), repeats)
    finally:
        scope.resolve_backend, scope.device_counter = original_resolve, original_counter
    return {
        "empty_cell_ms": empty * 1e3,
        "measured_path_fixed_cost_ms": (measured - empty) * 1e3,
        "tracked_fixed_cost_ms": (tracked - empty) * 1e3,
    }


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class Transformer(nn.Module):
    """Embedding, 2 pre-norm encoder layers (width 256, 4 heads), a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(256, 1000)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)


def workloads() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        # MNIST-sized MLP, batch 128
        "mlp 784-1024-1024-10, batch 128": (
            nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)),
            torch.randn(128, 784),
            torch.randint(0, 10, (128,)),
        ),
        # CIFAR-sized CNN with BatchNorm, batch 64
        "cnn 2 conv+bn, 32x32, batch 64": (
            nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
            ),
            torch.randn(64, 3, 32, 32),
            torch.randint(0, 10, (64,)),
        ),
        "transformer 2 layers, width 256, 16 x 64 tokens": (
            Transformer(),
            torch.randint(0, 1000, (16, 64)),
            torch.randint(0, 1000, (16 * 64,)),
        ),
        # worst case: kernels of a few microseconds, the per-op cost dominates
        "tiny mlp 32-64-10, batch 8 (worst case)": (
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)),
            torch.randn(8, 32),
            torch.randint(0, 10, (8,)),
        ),
    }


class EmptyMode(TorchDispatchMode):
    """A dispatch mode that does nothing: PyTorch's own cost of any Python mode (its Dynamo wrapper included)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class EmptySkippedMode(TorchDispatchMode):
    """An empty mode run as nbmem runs its own: unwrapped, its code marked for Dynamo to skip."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_FrameExecStrategy = getattr(torch._C._dynamo.eval_frame, "_FrameExecStrategy")
_FrameAction = getattr(torch._C._dynamo.eval_frame, "_FrameAction")
torch._C._dynamo.eval_frame.set_code_exec_strategy(
    EmptySkippedMode.__torch_dispatch__.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
)


class AllocatorEvents:
    """The profiler recording CPU allocator events only: profile_memory, and no op recorded.

    torch.profiler always records ops for ProfilerActivity.CPU; asking for a
    device activity alone on this CPU-only torch records allocations and
    nothing else (checked: the event tree holds only allocation events). On a
    CUDA build the same call would also trace the GPU: the column is for CPU-only torch.
    """

    def __init__(self) -> None:
        from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, _ExperimentalConfig

        self.config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        self.activities = {ProfilerActivity.CUDA}
        self.events: list[tuple[int, int, int]] = []

    def __enter__(self) -> "AllocatorEvents":
        torch._C._autograd._prepare_profiler(self.config, self.activities)
        torch._C._autograd._enable_profiler(self.config, self.activities)
        return self

    def __exit__(self, *exc_info: object) -> None:
        from torch._C._profiler import _EventType

        result = torch._C._autograd._disable_profiler()
        pending = list(result.experimental_event_tree())
        while pending:
            event = pending.pop()
            if event.tag == _EventType.Allocation:
                fields = event.extra_fields
                self.events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            pending.extend(event.children)
        self.events.sort()

    def peak(self, block: int = 512) -> int:
        """The running maximum of live bytes, each allocation rounded up to ``block`` (as nbmem rounds a storage)."""
        live: dict[int, int] = {}
        current = peak = 0
        for _, pointer, nbytes in self.events:
            if nbytes > 0:
                live[pointer] = -(-nbytes // block) * block
                current += live[pointer]
                peak = max(peak, current)
            else:
                current -= live.pop(pointer, 0)
        return peak


class OutputStorages(TorchDispatchMode):
    """The data pointers of every storage an op returns: what a dispatch-mode tracker can see."""

    def __init__(self) -> None:
        super().__init__()
        self.pointers: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                self.pointers.add(value.untyped_storage().data_ptr())
        return out


def allocator_events_against_tracking(step: Callable[[], None]) -> dict[str, int]:
    """One step seen by nbmem's tracker and one by the allocator's events: the peaks, and what only the allocator saw."""
    tracker = nbmem.Tracker("cpu")
    with tracker:
        step()
    with nbmem.track("cpu", engine="native") as native:  # a scope: its baseline is every live storage
        step()
    with AllocatorEvents() as allocations:
        step()
    outputs = OutputStorages()
    with AllocatorEvents() as seen_together, outputs:
        step()
    unseen = [nbytes for _, pointer, nbytes in seen_together.events if nbytes > 0 and pointer not in outputs.pointers]
    return {
        "tracked_peak_above_adopted": tracker.peak_allocated() - tracker.adopted,
        "native_engine_peak": native.result.peak,
        "allocator_events_peak_rounded": allocations.peak(),
        "allocations": sum(1 for event in seen_together.events if event[2] > 0),
        "allocations_no_op_returned": len(unseen),
        "allocations_no_op_returned_bytes": sum(unseen),
        "largest_allocation_no_op_returned": max(unseen, default=0),
    }


def memtracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    from torch.distributed._tools.mem_tracker import MemTracker

    def make() -> object:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        return tracker

    return make


def profiler() -> object:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


def training_step(model: nn.Module, batch: torch.Tensor, labels: torch.Tensor, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """One step: forward, cross-entropy, backward, AdamW step, zero_grad."""

    def step() -> None:
        loss = nn.functional.cross_entropy(model(batch), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def training_step_slowdown(repeats: int) -> dict[str, dict[str, float]]:
    """Every tool's steps interleaved in rounds, so drift and the load of the machine hit all alike."""
    results = {}
    for name, (model, batch, labels) in workloads().items():
        optimizer = torch.optim.AdamW(model.parameters())
        step = training_step(model, batch, labels, optimizer)
        counter = OpCounter()
        with counter:
            step()
        contexts: dict[str, Callable[[], object]] = {
            "bare": contextlib.nullcontext,
            "empty_mode": EmptyMode,
            "empty_mode_skipped": EmptySkippedMode,
            "nbmem": lambda: nbmem.Tracker("cpu"),
            "nbmem_native": native_tracker,
            "memtracker": memtracker(model, optimizer),
            "profiler": profiler,
            "allocator_events": AllocatorEvents,
        }
        samples: dict[str, list[float]] = {key: [] for key in contexts}
        cpu: dict[str, list[float]] = {key: [] for key in contexts}  # process CPU time: steadier on a loaded machine
        steps_per_round = 5
        for _ in range(max(1, repeats // steps_per_round)):
            for key, make in contexts.items():
                with make() as tool:  # type: ignore[attr-defined]
                    # MemTracker refuses a module called twice unless its module stats are reset
                    between = getattr(tool, "reset_mod_stats", lambda: None)
                    step()  # warm
                    for _ in range(steps_per_round):
                        between()  # not timed
                        start, start_cpu = time.perf_counter(), time.process_time()
                        step()
                        samples[key].append(time.perf_counter() - start)
                        cpu[key].append(time.process_time() - start_cpu)
        medians = {key: statistics.median(values) for key, values in samples.items()}
        cpu_medians = {key: statistics.median(values) for key, values in cpu.items()}
        bare = medians["bare"]
        results[name] = {
            "ops_per_step": counter.ops,
            **{f"{key}_ms": value * 1e3 for key, value in medians.items()},
            **{f"{key}_slowdown": value / bare for key, value in medians.items() if key != "bare"},
            **{f"{key}_cpu_ms": value * 1e3 for key, value in cpu_medians.items()},
            **{f"{key}_cpu_slowdown": value / cpu_medians["bare"] for key, value in cpu_medians.items() if key != "bare"},
            "nbmem_us_per_op_beyond_empty_mode": (medians["nbmem"] - medians["empty_mode"]) / counter.ops * 1e6,
            "nbmem_us_per_op_beyond_empty_mode_skipped": (medians["nbmem"] - medians["empty_mode_skipped"]) / counter.ops * 1e6,
            "allocator_events_against_tracking": allocator_events_against_tracking(step),
            "load_average_1min": os.getloadavg()[0],
        }
    return results


COLUMNS = {  # key: heading
    "empty_mode": "empty",
    "empty_mode_skipped": "empty*",
    "nbmem": "nbmem",
    "nbmem_native": "native",
    "memtracker": "MemTracker",
    "profiler": "profiler",
    "allocator_events": "alloc-ev",
}


def summary(steps: dict[str, dict]) -> str:
    lines = [f"{'workload':<48}{'ops':>5}{'clock':>6}{'bare ms':>9}" + "".join(f"{head:>11}" for head in COLUMNS.values())]
    for name, row in steps.items():
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            lines.append(
                f"{name if clock == 'wall' else '':<48}{row['ops_per_step'] if clock == 'wall' else '':>5}{clock:>6}"
                f"{row[f'bare{suffix}_ms']:>9.2f}" + "".join(f"{row[f'{key}{suffix}_slowdown']:>10.2f}x" for key in COLUMNS)
            )
    lines.append("empty: an empty dispatch mode as PyTorch wraps it; empty*: as nbmem runs its own (nbmem.tracking.dispatch);")
    lines.append("nbmem: the default (dispatch) engine; native: engine='native' (both with the breakdown's hooks);")
    lines.append("alloc-ev: the profiler recording allocator events only. Allocator events against nbmem's tracking, one step:")
    for name, row in steps.items():
        events = row["allocator_events_against_tracking"]
        lines.append(
            f"  {name:<48} tracked peak {events['tracked_peak_above_adopted']:>11,} B, native engine's "
            f"{events['native_engine_peak']:>11,} B, allocator events' "
            f"{events['allocator_events_peak_rounded']:>11,} B; {events['allocations_no_op_returned']} of "
            f"{events['allocations']} allocations no op returned (largest {events['largest_allocation_no_op_returned']:,} B)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60, help="timed steps per tool and workload, in rounds of 5 (default 60)")
    parser.add_argument("--skip-magic", action="store_true", help="time the training steps only")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parse_with_threads(parser)
    load_before = os.getloadavg()[0]
    report = {
        **environment(),
        "magic": None if args.skip_magic else magic_fixed_cost(args.repeats),
        "training_step": training_step_slowdown(args.repeats),
        "load_average_1min_at_start": load_before,
    }
    print(json.dumps(report, indent=2))
    print(summary(report["training_step"]))
    print(f"slowdown = median step time inside the tool / bare; load average {load_before:.1f} at the start")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
