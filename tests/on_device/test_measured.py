"""Measured mode on the nbmemdev test device, every figure against the device's own counters (issue 27).

The device rounds each request up to 512 bytes, as CUDA's caching allocator
does, and its ops run CPU kernels on its memory: so a tracked run on the CPU
(512-byte rounding) and a measured run on the device allocate the same bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import _testdevice
import nbmem
from nbmem.core.units import format_bytes
from nbmem.tracking.accelerators import DeviceCounter, device_counter
from nbmem.tracking.backends import resolve_backend

DEVICE = torch.device(_testdevice.NAME, 0)
accelerator = torch.accelerator


def rounded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def test_the_device_is_this_process_accelerator_and_auto_measures_on_it():
    assert accelerator.current_accelerator().type == "nbmemdev"
    assert resolve_backend() == ("measured", DEVICE)
    assert resolve_backend("measured", "nbmemdev") == ("measured", DEVICE)
    assert resolve_backend("auto", "cpu") == ("tracked", torch.device("cpu"))


def test_a_scope_reads_the_devices_own_counters_to_the_byte():
    before = accelerator.memory_allocated(0)
    with nbmem.measure() as scope:
        kept = torch.empty(1000, device=DEVICE)  # 4,000 B: 4,096 allocated
        dropped = torch.empty(100_000, device=DEVICE)  # 400,000 B: 400,384 allocated
        del dropped
        device_peak = accelerator.max_memory_allocated(0)
    result = scope.result
    assert (result.mode, result.device) == ("measured", "nbmemdev:0")
    assert result.allocated_before == before
    assert result.peak_allocated == device_peak == before + rounded(4000) + rounded(400_000)
    assert (result.peak, result.retained) == (4096 + 400_384, 4096)
    assert result.allocated_after == accelerator.memory_allocated(0)
    assert result.reserved_after == accelerator.memory_reserved(0) == result.allocated_after + 400_384  # cached
    assert result.peak_reserved == accelerator.max_memory_reserved(0)
    free, total = accelerator.get_memory_info(0)
    assert (result.capacity, result.device_free) == (total, free) == (1 << 30, (1 << 30) - result.reserved_after)
    assert "measured on nbmemdev:0" in str(result) and "the nbmemdev allocator" in str(result)
    del kept


def test_nested_scopes_across_the_devices_peak_reset_keep_each_their_own_peak():
    base = accelerator.memory_allocated(0)
    with nbmem.measure() as outer:
        big = torch.empty(1_000_000, device=DEVICE)
        del big
        with nbmem.measure() as inner:
            small = torch.empty(1000, device=DEVICE)
        assert accelerator.max_memory_allocated(0) == base + 4096  # the inner scope reset the device's peak
    assert (inner.result.peak, inner.result.retained) == (4096, 4096)
    assert (outer.result.peak, outer.result.retained) == (rounded(4_000_000), 4096)
    assert len(device_counter(DEVICE).scopes) == 0
    del small


def test_the_magic_measures_a_cell_and_gpumem_on_keeps_the_history(shell):
    from IPython.utils.capture import capture_output

    shell.run_cell("import torch")
    with capture_output() as captured:
        shell.run_cell("%%gpumem\nx = torch.empty(1000, device='nbmemdev')", store_history=True)
    text = captured.outputs[0].data["text/plain"]
    assert "measured on nbmemdev:0" in text and "reserved" in text
    assert nbmem.history(shell)[-1].retained == 4096
    shell.run_cell("%gpumem on -q")
    try:
        shell.run_cell("y = torch.empty(2000, device='nbmemdev')", store_history=True)
        shell.run_cell("del x, y", store_history=True)
    finally:
        shell.run_cell("%gpumem off -q")
    last = nbmem.history(shell)[-2:]
    assert [result.retained for result in last] == [8192, -4096 - 8192]
    assert all(result.mode == "measured" and result.device == "nbmemdev:0" for result in last)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))


def regression(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 256), torch.randn(n, 10)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_measured_estimate_runs_on_the_device_and_allocates_what_a_tracked_run_counts(optimizer):
    measured = nbmem.estimate(mlp, regression, batch_size=32, optimizer=optimizer, mode="measured")
    tracked = nbmem.estimate(mlp, regression, batch_size=32, optimizer=optimizer, mode="tracked")
    assert measured.mode == "measured" and "nbmemdev" in measured.device
    # AdamW keeps a step counter per parameter, torch.tensor(0.0): a CPU tensor beside a device's parameters
    # (unless fused or capturable), which the tracked run on the CPU keeps out of its figures, as the device does
    assert (measured.first_step, measured.steady) == (tracked.first_step, tracked.steady)
    assert any("step counters" in note for note in tracked.notes) == (optimizer == "adamw")
    assert measured.parameters == tracked.parameters
    assert accelerator.memory_allocated(0) == 0  # the run's model, batch and optimizer are gone


def test_a_measured_sweep_isolates_each_configuration_on_the_device():
    rows = nbmem.sweep(mlp, regression, batch_size=[8, 64], optimizer="sgd", mode="measured", progress=False).rows
    tracked = nbmem.sweep(mlp, regression, batch_size=[8, 64], optimizer="sgd", mode="tracked", progress=False).rows
    assert [row.peak for row in rows] == [row.peak for row in tracked]
    assert rows[1].peak > rows[0].peak
    assert accelerator.memory_reserved(0) == 0  # emptied between and after configurations


def test_max_batch_size_verifies_on_the_device():
    found = nbmem.max_batch_size(mlp, regression, device="4 MiB", optimizer="sgd", verify="measured", progress=False)
    assert found.mode == "measured" and found.batch_size >= 1 and found.real_trials >= 2
    fits = nbmem.estimate(mlp, regression, batch_size=found.batch_size, optimizer="sgd", mode="measured",
                          device="4 MiB")
    assert fits.steady <= 4 << 20


def test_gpumem_free_empties_the_devices_cache():
    kept = torch.empty(250_000, device=DEVICE)
    del kept  # 1,000,448 B cached
    assert accelerator.memory_reserved(0) - accelerator.memory_allocated(0) == rounded(1_000_000)
    reclaimed = nbmem.free()
    assert reclaimed.mode == "measured" and reclaimed.device == "nbmemdev:0"
    assert reclaimed.reserved_before - reclaimed.reserved_after == rounded(1_000_000)
    assert accelerator.memory_reserved(0) == accelerator.memory_allocated(0)


def test_the_gauge_reads_the_devices_capacity():
    from nbmem.frontend.live_gauge import capacity_of

    _testdevice.set_capacity(256 << 20)
    with nbmem.measure() as scope:
        assert capacity_of(scope) == 256 << 20


def test_an_out_of_memory_error_from_the_devices_allocator_is_measured_and_diagnosed(shell):
    from IPython.utils.capture import capture_output

    _testdevice.set_capacity(8 << 20)
    shell.run_cell("import torch")
    with capture_output() as captured:
        outcome = shell.run_cell("%%gpumem --text\nkept = torch.empty(1 << 20, device='nbmemdev')\n"
                                 "too_much = torch.empty(4 << 20, device='nbmemdev')", store_history=True)
    assert isinstance(outcome.error_in_exec, torch.OutOfMemoryError)
    result = nbmem.history(shell)[-1]
    assert result.error == "OutOfMemoryError" and result.retained == 4 << 20  # `kept` stays: the cell's state too
    why = nbmem.diagnose(result, None, error=outcome.error_in_exec)
    assert why.request == 16 << 20  # read from the device's own message, "Tried to allocate 16.00 MiB"
    assert "OutOfMemoryError" in captured.stdout or "out of memory" in captured.stdout
    shell.run_cell("del kept")
    assert torch.ones(10, device=DEVICE).sum().item() == 10.0  # the device goes on


def test_a_backend_that_keeps_no_peak_says_so_and_shows_none_it_did_not_measure(monkeypatch):
    def absent(*args: object) -> int:
        raise NotImplementedError("no peak statistics")

    monkeypatch.setattr(accelerator, "max_memory_allocated", absent)
    monkeypatch.setattr(accelerator, "max_memory_reserved", absent)
    counter = DeviceCounter(DEVICE)  # not the cached one: it asks the backend afresh
    assert counter.missing == ("peak allocated", "peak reserved")
    kept = torch.empty(1000, device=DEVICE)
    assert counter.peak_allocated() == counter.allocated() == accelerator.memory_allocated(0)
    assert counter.peak_reserved() is None
    assert counter.missing_note() == ("nbmemdev keeps no peak counter: the peak is the larger of the figures read at "
                                      "the block's start and end, and may miss a higher one between; no peak of "
                                      "reserved memory")
    del kept


def test_requests_this_machine_cant_serve_say_what_to_do():
    with pytest.raises(ValueError, match="backend 'cuda' needs a CUDA device and none is available"):
        nbmem.measure(backend="cuda")
    with pytest.raises(ValueError, match="this machine's accelerator is nbmemdev, so cuda:0 can't be measured"):
        nbmem.measure(device="cuda:0")
    with pytest.raises(ValueError, match="nbmemdev:3 does not exist: this machine has 1 nbmemdev device"):
        nbmem.measure(device="nbmemdev:3")


def test_a_snapshot_of_a_cell_measured_off_cuda_comes_from_nbmems_timeline(shell, tmp_path):
    """Only CUDA records PyTorch's allocator history: on another accelerator --snapshot writes nbmem's own."""
    path = tmp_path / "cell.pickle"
    shell.run_cell("import torch")
    assert shell.run_cell(f"%%gpumem -q --snapshot {path}\nx = torch.empty(1000, device='nbmemdev')").success
    loaded = nbmem.load_snapshot(path)
    measured = nbmem.history(shell)[-1]
    assert measured.mode == "measured"
    back = loaded.result()
    assert back.retained == 4096
    # the file holds the tensors the tracker beside the measurement saw: it reads back as tracked, and says so
    assert (back.mode, back.device) == ("tracked", "nbmemdev:0")
    assert back.notes[1].startswith(f"the block's measured peak was {format_bytes(measured.peak_allocated)} allocated")
    shell.run_cell("del x")


def test_backend_cuda_names_only_cuda_devices():
    with pytest.raises(ValueError, match="backend 'cuda' needs a CUDA device"):
        resolve_backend("cuda", "nbmemdev:0")
    with pytest.raises(ValueError, match="backend 'measured' measures an accelerator .*, not cpu"):
        resolve_backend("measured", "cpu")
