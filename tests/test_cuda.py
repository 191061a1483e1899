"""Measured mode against the CUDA allocator itself. Skipped without a GPU.

These compare nbmem's figures with ``torch.cuda.memory_stats()`` read directly,
check nesting on the real (single, global) peak counter, and check that
tracked mode's rounding reproduces the allocator's allocated bytes.
"""

from __future__ import annotations

import pytest
import torch

import nbmem
from nbmem.tracking.accelerators import device_counter

pytestmark = pytest.mark.cuda
MiB = 1024**2


@pytest.fixture
def device():
    torch.cuda.init()
    torch.cuda.synchronize()
    return torch.device("cuda", torch.cuda.current_device())


def test_measured_matches_allocator_statistics(device):
    with nbmem.measure(device) as scope:
        first = torch.empty(1024, 1024, device=device)  # 4 MiB
        second = torch.empty(1024, 1024, device=device)
        del first
    stats = torch.cuda.memory_stats(device)
    result = scope.result
    assert result.mode == "measured" and result.device == str(device)
    assert (result.peak, result.retained) == (8 * MiB, 4 * MiB)
    assert result.allocated_after == stats["allocated_bytes.all.current"]
    assert result.reserved_after == stats["reserved_bytes.all.current"]
    assert result.peak_reserved >= result.reserved_before
    free, total = torch.cuda.mem_get_info(device)
    assert result.capacity == total and result.device_name == torch.cuda.get_device_name(device)
    del second


def test_nested_scopes_on_the_real_counter(device):
    with nbmem.measure(device) as outer:
        big = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
        del big
        with nbmem.measure(device) as inner:
            small = torch.empty(MiB, dtype=torch.uint8, device=device)
    assert (inner.result.peak, inner.result.retained) == (MiB, MiB)
    assert (outer.result.peak, outer.result.retained) == (64 * MiB, MiB)
    # the global counter was reset by the inner scope, yet the outer kept its peak
    del small


def test_a_scope_does_not_initialise_cuda_by_itself():
    # run in a fresh process: this one has CUDA initialised already
    import subprocess
    import sys

    code = "import torch, nbmem\nwith nbmem.measure():\n    x = 1\nprint(torch.cuda.is_initialized())"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "False"


@pytest.mark.parametrize("shape", [(1,), (1000,), (257, 3), (1024, 1024)])
def test_tracked_rounding_equals_allocated_bytes(device, shape):
    with nbmem.measure(device) as measured:
        kept = torch.empty(shape, device=device)
    with nbmem.track(device) as tracked:
        also = torch.empty(shape, device=device)
    assert tracked.result.retained == measured.result.retained
    del kept, also


def test_training_step_tracked_vs_measured_peak(device):
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    batch = torch.randn(64, 512, device=device)

    def step():
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # optimizer state and cuBLAS workspace exist from here on
    with nbmem.measure(device) as measured:
        step()
    with nbmem.track(device) as tracked:
        step()
    assert tracked.result.peak == pytest.approx(measured.result.peak, rel=0.02)
    assert tracked.result.retained == measured.result.retained


def test_magic_reports_measured_in_a_shell(shell, device):
    from IPython.utils.capture import capture_output

    shell.run_cell("import torch")
    with capture_output() as captured:
        shell.run_cell(f"%%gpumem\nx = torch.empty(1024, 1024, device='{device}')", store_history=True)
    text = captured.outputs[0].data["text/plain"]
    assert f"measured on {device}" in text and "reserved" in text and "free of" in text
    assert nbmem.history(shell)[-1].retained == 4 * MiB
    assert len(device_counter(device).scopes) == 0


def quickstart_model(device):
    """The model and step of notebooks/01-quickstart.ipynb."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch_size=64):
        images = torch.randn(batch_size, 784, device=device)
        labels = torch.randint(0, 10, (batch_size,), device=device)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def test_breakdown_total_at_peak_within_2_percent_of_cuda_peak(device):
    """Issue 3's check: the tracked breakdown alongside a measured step."""
    step = quickstart_model(device)
    with nbmem.measure(device, breakdown=True) as scope:
        step()
    result = scope.result
    total = sum(size for _, size in result.breakdown.at_peak)
    assert total == pytest.approx(result.peak_allocated, rel=0.02)


def test_a_tracker_alongside_a_measurement_raises_its_peak_as_its_note_says(device):
    # h's gradient is the sum of mul's two (grad * h, twice), made in backward while h and both
    # halves live, above the forward's peak: autograd sums them in place, but out of place (one more
    # 256 KiB tensor) while a Python dispatch mode is on the stack (at::isTensorSubclassLike). On the
    # CPU the native engine measures +262,144 B for this step with an empty mode on the stack.
    x = torch.randn(256, 256, device=device)
    w = torch.randn(256, 256, device=device, requires_grad=True)

    def step():
        h = x @ w
        (h * h).sum().backward()
        w.grad = None

    step()  # cuBLAS's workspace exists from here on
    with nbmem.measure(device) as bare:
        step()
    with nbmem.measure(device, breakdown=True) as tracked:
        step()
    assert not any("dispatch mode" in note for note in bare.result.notes)
    assert any("dispatch mode was on the stack" in note for note in tracked.result.notes)
    assert tracked.result.peak_allocated - bare.result.peak_allocated == 256 * 256 * 4


def test_virtual_capacity_on_cuda_tensors(device):
    with pytest.raises(torch.OutOfMemoryError, match="virtual device"):
        with nbmem.measure(device, capacity="4MiB"):
            torch.empty(8 * MiB, dtype=torch.uint8, device=device)


# What-if on CUDA (issue 4): the same step measured, estimated and tracked.


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def mlp_batch(n):
    return torch.randn(n, 256), torch.randint(0, 10, (n,))  # made on the CPU, as a DataLoader's would be


def test_measured_step_runs_on_cuda_and_agrees_with_the_estimate(device):
    before = torch.cuda.memory_allocated(device)
    measured = nbmem.estimate(mlp, mlp_batch, batch_size=64, mode="measured")
    estimated = nbmem.estimate(mlp, mlp_batch, batch_size=64)
    assert measured.mode == "measured" and measured.device == str(device)
    assert str(measured).startswith(f"gpumem step (measured: run for real on {device}")
    assert measured.reserved is not None and measured.reserved >= measured.peak
    assert any("dispatch mode was on the stack" in note for note in measured.notes)  # the breakdown's tracker ran
    # cuBLAS's workspace goes through the allocator on the first matmul and the estimate lists it apart
    # (up to 32 MiB on Hopper), so the measured step may exceed the estimate by that much
    extra = measured.steady - estimated.steady
    assert -0.02 * estimated.steady <= extra <= 32 * MiB + 0.02 * estimated.steady
    assert torch.cuda.memory_allocated(device) - before <= 64 * MiB  # only the cuBLAS workspace stays


def test_measured_sweep_records_a_real_out_of_memory_error_and_goes_on(device):
    # a batch whose input alone is twice the card (256 float32 values, 1 KiB, a row); the first
    # version of this test asked for 1/128 of the card and fitted on an H100 (2026-11-25)
    huge = 2 * torch.cuda.get_device_properties(device).total_memory // (256 * 4)
    table = nbmem.sweep(mlp, lambda n: (torch.randn(n, 256, device=device), torch.randint(0, 10, (n,), device=device)),
                        batch_size=[8, huge, 8192], mode="measured")
    assert [row.error for row in table] == [None, "OOM", None]
    # a real measurement after the error: 8192 rows of 256 float32 are an 8 MiB input, alive at the
    # peak. (Not compared with the first row, which pays the one-time costs: cuBLAS's 32 MiB
    # workspace made it 70.9 MB against this row's 61.3 MB on an H100, 2026-11-25.)
    assert table.rows[2].result.peak >= 8 * MiB
    assert table.mode == "measured"


def test_max_batch_size_verified_on_cuda(device):
    build = lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))  # noqa: E731
    make = lambda n: (torch.randn(n, 256), torch.randn(n, 256))  # noqa: E731
    found = nbmem.max_batch_size(build, make, device="64MiB", optimizer="sgd", verify="measured")
    sizes = dict(found.trials)
    assert found.mode == "measured"
    assert sizes[found.batch_size] is not None and sizes[found.batch_size + 1] is None


_LAUNCH = """
import torch, nbmem
from torch import nn
build = lambda: nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
make = lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,)))
for parallel in ("ddp", "fsdp"):
    launched = nbmem.launch(build, make, batch_size=32, parallel=parallel, world_size=2, timeout=300)
    assert launched.mode == "measured", launched.mode
    estimated = nbmem.estimate(build, make, batch_size=32, parallel=parallel, world_size=2)
    for rank in launched.ranks:
        assert rank.device.startswith("cuda"), rank.device
        error = (rank.peak - estimated.peak) / rank.peak
        print(parallel, rank.rank, rank.peak, estimated.peak, f"{error:+.2%}")
        assert abs(error) <= 0.05, error
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL launch); untested so far")
def test_launch_measures_every_gpu_with_nccl():
    import subprocess
    import sys

    # a fresh process: forked ranks can't use CUDA once this one has initialised it
    done = subprocess.run([sys.executable, "-c", _LAUNCH], capture_output=True, text=True, timeout=900)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-4000:]
