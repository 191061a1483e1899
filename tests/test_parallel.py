"""Data parallelism: per-GPU estimates under DDP, ZeRO-1 and FSDP2, checked against real gloo ranks.

Tests that launch real ranks (forked processes) or a kernel are marked slow;
the estimates alone (fake process group, one process) are in the fast tier.
"""

from __future__ import annotations

import math
import os

import nbclient
import nbformat
import pytest
import torch
import torch.distributed as dist
from torch import nn

import nbmem
from nbmem.frontend.explorer import Explorer
from nbmem.whatif.launcher import RankError
from nbmem.core.units import round_allocation


class Block(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(x)


def build():
    return nn.Sequential(nn.Linear(128, 256), *[Block() for _ in range(3)], nn.Linear(256, 8))


def make(n):
    return torch.randn(n, 128), torch.randint(0, 8, (n,))


SHARDED = ["ddp", "zero1", "fsdp", "fsdp-no-reshard"]


@pytest.mark.slow  # launches real ranks (processes)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("parallel", SHARDED)
def test_estimates_agree_with_every_real_rank(parallel, world_size):
    launched = nbmem.launch(build, make, batch_size=16, parallel=parallel, world_size=world_size, optimizer="adam")
    assert launched.mode == "tracked" and len(launched.ranks) == world_size
    for rank, real in enumerate(launched.ranks):
        assert real.rank == rank and real.world_size == world_size and real.parallel == parallel
        estimated = nbmem.estimate(build, make, batch_size=16, parallel=parallel, world_size=world_size,
                                   optimizer="adam", rank=rank)
        assert real.peak == pytest.approx(estimated.peak, rel=0.02), (rank, real.peak, estimated.peak)
    assert f"{parallel} on {world_size} real ranks" in str(launched)


def _shard_bytes(model: nn.Module, world_size: int) -> int:
    """Rank 0's FSDP2 shards: every parameter split on its first dimension, rounded like CUDA."""
    return sum(
        round_allocation(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) * p.element_size())
        for p in model.parameters()
    )


def test_what_each_gpu_keeps_between_steps():
    kept = {
        (parallel, size): dict(
            nbmem.estimate(build, make, batch_size=16, parallel=parallel, world_size=size, optimizer="adam")
            .breakdown.after
        )
        for parallel, size in [("single", 1), ("ddp", 8), ("fsdp", 2), ("fsdp", 8)]
    }
    full = _shard_bytes(build(), 1)
    single = kept["single", 1]
    assert single["parameter"] == full and single["gradient"] == 0  # zero_grad(set_to_none) freed the gradients
    # DDP: a full replica at every world size, and its gradient buckets outlive the step
    ddp = kept["ddp", 8]
    assert ddp["parameter"] == full and ddp["optimizer state"] == single["optimizer state"]
    assert full - 512 * 10 < ddp["gradient"] <= full
    # FSDP: parameters and Adam's two moments sharded N ways
    steps = single["optimizer state"] - 2 * full  # Adam's step counters, the same in both
    for size in (2, 8):
        fsdp = kept["fsdp", size]
        assert fsdp["parameter"] == _shard_bytes(build(), size)
        assert fsdp["optimizer state"] == 2 * _shard_bytes(build(), size) + steps
        assert fsdp["gradient"] == 0


def test_any_world_size_is_estimated_and_fsdp_shrinks_what_ddp_does_not():
    table = nbmem.sweep(build, make, batch_size=16, parallel=["ddp", "fsdp"], world_size=[1, 4, 64, 1024],
                        device="12MiB")
    peaks = {(row.value("parallel"), row.value("world_size")): row.result.peak for row in table.rows}
    assert len({peaks["ddp", size] for size in (4, 64, 1024)}) == 1  # per-GPU memory independent of N
    assert peaks["fsdp", 4] < peaks["fsdp", 1] < peaks["ddp", 4]
    assert peaks["fsdp", 64] < peaks["fsdp", 4]
    records = table.to_records()
    assert {record["global_batch"] for record in records} == {16, 64, 1024, 16384}
    assert "per GPU" in str(table) and "64 (global batch 1024)" in str(table)
    axes = table.plot().axes[0]
    assert axes.get_xlabel() == "GPUs (world size)" and axes.get_xscale() == "log"
    assert "per GPU" in axes.get_ylabel()
    assert len(axes.get_lines()) == 3  # a line per strategy, and the capacity


@pytest.mark.slow  # launches real ranks (processes)
def test_a_tracked_sweep_launches_each_configuration():
    table = nbmem.sweep(build, make, batch_size=16, parallel=["single", "fsdp"], world_size=[1, 2], mode="tracked",
                        optimizer="sgd")
    assert [(row.value("parallel"), row.value("world_size")) for row in table.rows] == [
        ("single", 1), ("fsdp", 1), ("fsdp", 2)]
    real = {row.value("world_size"): row.result for row in table.rows if row.value("parallel") == "fsdp"}
    assert real[2].mode == "tracked" and real[2].world_size == 2
    estimated = nbmem.estimate(build, make, batch_size=16, parallel="fsdp", world_size=2, optimizer="sgd")
    assert real[2].peak == pytest.approx(estimated.peak, rel=0.02)


@pytest.mark.slow  # launches real ranks (processes)
def test_a_rank_out_of_memory_is_recorded_as_oom():
    table = nbmem.sweep(build, make, batch_size=16, parallel=["ddp", "fsdp"], world_size=2, mode="tracked",
                        device="12MiB")
    errors = {row.value("parallel"): row.error for row in table.rows}
    assert errors == {"ddp": "OOM", "fsdp": None}


@pytest.mark.slow  # launches real ranks (processes)
def test_max_batch_size_per_gpu_verified_by_launches():
    found = nbmem.max_batch_size(build, make, device="32MiB", parallel="fsdp", world_size=2, optimizer="adam")
    sizes = dict(found.trials)
    assert found.batch_size > 0 and sizes[found.batch_size] is not None and sizes[found.batch_size + 1] is None
    assert found.global_batch == 2 * found.batch_size and "fsdp on 2 GPUs" in str(found)
    assert sizes[found.batch_size] <= 32 * 2**20
    # the same device holds only a smaller batch with every GPU keeping a full replica
    assert nbmem.max_batch_size(build, make, device="32MiB", optimizer="adam").batch_size < found.batch_size


def test_global_batch_size_is_split_across_gpus_and_micro_batches():
    result = nbmem.estimate(build, make, global_batch_size=64, parallel="fsdp", world_size=4, accumulation=2)
    assert (result.batch_size, result.global_batch) == (8, 64)
    assert "fsdp on 4 GPUs (figures per GPU, rank 0; global batch 64)" in str(result)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(batch_size=8, parallel="ddp", world_size=0), "at least 1"),
        (dict(batch_size=8, parallel="ddp", world_size=2.0), "whole number"),
        (dict(batch_size=8, parallel="zero4", world_size=2), "single, ddp, zero1, fsdp, fsdp-no-reshard, zero2, zero3"),
        (dict(batch_size=8, parallel="single", world_size=4), "pick a strategy"),
        (dict(global_batch_size=50, parallel="ddp", world_size=4), "use a multiple of 4 .e.g. 48 or 52"),
        (dict(global_batch_size=64, batch_size=8, parallel="ddp", world_size=4), "exactly one of them"),
        (dict(batch_size=8, parallel="fsdp", world_size=4, rank=4), "0 to 3"),
        (dict(batch_size=8, parallel="ddp", world_size=2, mode="tracked"), r"nbmem.launch\(.*world_size=2\)"),
    ],
)
def test_bad_input_names_what_is_accepted(options, message):
    with pytest.raises(ValueError, match=message):
        nbmem.estimate(build, make, **options)


def test_bad_sweeps_and_searches_fail_before_anything_runs():
    with pytest.raises(ValueError, match="at least 1"):
        nbmem.sweep(build, make, batch_size=8, parallel="ddp", world_size=[2, 0])
    with pytest.raises(ValueError, match="unknown parallel strategy 'dp'"):
        nbmem.sweep(build, make, batch_size=8, parallel=["ddp", "dp"])
    with pytest.raises(ValueError, match="at most 8"):
        nbmem.sweep(build, make, batch_size=8, parallel="fsdp", world_size=[2, 16], mode="tracked")
    with pytest.raises(ValueError, match="at most 8"):
        nbmem.max_batch_size(build, make, device="T4", parallel="fsdp", world_size=16)
    with pytest.raises(ValueError, match="multiple of 6"):
        nbmem.launch(build, make, global_batch_size=8, parallel="ddp", world_size=3, accumulation=2)


def test_an_existing_process_group_is_left_alone(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already has one"):
            nbmem.estimate(build, make, batch_size=8, parallel="fsdp", world_size=8)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def _children() -> set[int]:
    """This process's live child processes (zombies included: a child not reaped is left behind too)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                found.add(int(entry))
    return found


@pytest.mark.slow  # launches real ranks (processes)
def test_a_failing_rank_ends_the_launch_with_its_error():
    before = _children()

    def make_on_one_rank(n):
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1's data loader broke")
        return make(n)

    with pytest.raises(RankError, match="rank 1 of 2 failed") as raised:
        nbmem.launch(build, make_on_one_rank, batch_size=8, parallel="ddp", world_size=2, timeout=600)
    assert raised.value.rank == 1 and "RuntimeError: rank 1's data loader broke" in str(raised.value)
    assert _children() == before
    assert not dist.is_initialized()


@pytest.mark.slow  # launches real ranks (processes)
def test_the_notebook_kernel_keeps_working_after_a_failed_launch():
    cells = [
        "import torch, nbmem\n"
        "from torch import nn\n"
        "build = lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))\n"
        "def make(n):\n"
        "    import torch.distributed as dist\n"
        "    if dist.get_rank() == 1:\n"
        "        raise RuntimeError('broken on rank 1')\n"
        "    return torch.randn(n, 64), torch.randint(0, 4, (n,))\n"
        "kept = 'state before the failure'",
        "nbmem.launch(build, make, batch_size=8, parallel='ddp', world_size=2, optimizer='sgd')",
        "make = lambda n: (torch.randn(n, 64), torch.randint(0, 4, (n,)))\n"
        "print(kept, len(nbmem.launch(build, make, batch_size=8, parallel='ddp', world_size=2).peaks))",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    nbclient.NotebookClient(notebook, timeout=600, allow_errors=True).execute()
    # each launch's progress widget (issue 15) comes first: a widget output without text, then what the cell gave
    failed = notebook.cells[1].outputs[-1]
    assert failed.output_type == "error" and failed.ename == "RankError" and "broken on rank 1" in failed.evalue
    assert [output.text for output in notebook.cells[2].outputs if "text" in output] == ["state before the failure 2\n"]


@pytest.mark.slow  # launches real ranks (processes)
def test_the_explorer_estimates_per_gpu_and_checks_small_worlds():
    panel = Explorer(build, make, batch_size=16, device="12MiB", optimizer="adam")
    assert panel.controls["world_size"].disabled
    panel.controls["parallel"].value = "fsdp"
    assert not panel.controls["world_size"].disabled
    panel.controls["world_size"].value = 8
    assert (panel.last.parallel, panel.last.world_size) == ("fsdp", 8)
    assert "per GPU, fsdp on 8 GPUs (global batch 128)" in panel.chart.value
    panel.button.click()  # 8 ranks: more than the button launches
    assert "at most 4" in panel.check.value and panel.measured is None
    panel.controls["world_size"].value = 2
    panel.button.click()
    assert panel.measured.world_size == 2 and panel.measured.mode == "tracked"
    assert panel.measured.peak == pytest.approx(panel.last.peak, rel=0.02)
    assert "2 real ranks tracked on this CPU" in panel.check.value
    panel.controls["parallel"].value = "single"
    assert panel.controls["world_size"].value == 1 and panel.last.world_size == 1


def test_an_estimate_leaves_the_excepthook_as_it_was():
    import sys

    # torch's init_process_group wraps sys.excepthook (tracebacks get "[rank0]: "), and its
    # destroy_process_group leaves the wrapper: before the fix, one more prefix per estimate
    before = sys.excepthook
    nbmem.estimate(build, make, batch_size=4, parallel="fsdp", world_size=2, optimizer="sgd")
    assert sys.excepthook is before


def test_fsdp_mixed_precision_gathers_and_computes_in_bf16_and_keeps_fp32_shards():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from test_blocks import VisionTransformer, tokens

    def run(policy):
        return nbmem.estimate(VisionTransformer, tokens, batch_size=8, parallel="fsdp", world_size=4, mp_policy=policy)

    plain, mixed = run(None), run("bf16")
    at_peak = lambda result, name: dict(result.breakdown.at_peak)[name]  # noqa: E731
    # the shards and AdamW's state on them stay fp32; the gathered parameters and the activations are bf16
    assert at_peak(mixed, "optimizer state") == at_peak(plain, "optimizer state")
    assert at_peak(mixed, "parameter") < at_peak(plain, "parameter")
    assert at_peak(mixed, "activation") < at_peak(plain, "activation") and mixed.steady < plain.steady
    given = run(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert (given.first_step, given.steady) == (mixed.first_step, mixed.steady)  # "bf16" is that policy
    assert "FSDP mixed precision bf16" in mixed.plan.describe()
    with pytest.raises(ValueError, match="mp_policy= is FSDP2's mixed precision, and parallel='ddp'"):
        nbmem.estimate(VisionTransformer, tokens, batch_size=2, parallel="ddp", world_size=2, mp_policy="bf16")
    with pytest.raises(ValueError, match="unknown mp_policy 'fp8'"):
        run("fp8")
