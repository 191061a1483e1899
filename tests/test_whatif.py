"""nbmem.sweep: every combination, isolated, in a comparison table with one unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbmem
from nbmem.whatif.comparison import Comparison

MiB = 1024**2


def build():
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


def make(n):
    return torch.randn(n, 256), torch.randn(n, 256)


def test_grid_isolated_and_equal_to_single_estimates():
    table = nbmem.sweep(build, make, batch_size=[8, 32], optimizer=["sgd", "adamw"])
    assert isinstance(table, Comparison) and len(table) == 4 and table.axes == ("batch_size", "optimizer")
    for row in table.rows:
        alone = nbmem.estimate(build, make, **dict(row.config))
        assert row.result.peak == alone.peak  # isolated: nothing carried over between configurations
    records = table.to_records()
    assert [(r["batch_size"], r["optimizer"]) for r in records] == [(8, "sgd"), (8, "adamw"), (32, "sgd"), (32, "adamw")]
    assert all(r["peak"] == r["peak_parameter"] + r["peak_buffer"] + r["peak_optimizer_state"] + r["peak_gradient"]
               + r["peak_activation"] + r["peak_kv_cache"] + r["peak_other"] for r in records)
    frame = table.to_dataframe()
    assert list(frame.columns[:5]) == ["batch_size", "precision", "checkpointing", "optimizer", "accumulation"]


def test_table_has_one_shared_unit_and_marks_what_does_not_fit():
    table = nbmem.sweep(build, make, batch_size=[8, 64], precision=["fp32", "bf16-weights"], device="2MiB")
    text = str(table)
    assert text.splitlines()[0] == (
        "gpumem sweep: peak allocated in MiB, estimated; capacity 2MiB (no fit: the peak, or a segment the allocator "
        "must reserve, is past it)"
    )
    assert "precision=fp32" in text and "precision=bf16-weights" in text and "(no fit)" in text
    assert "<table>" in table._repr_html_()


def test_tracked_sweep_records_oom_and_goes_on():
    # parameters alone are 2 x 1 MiB; batch 4096 needs more than 8 MiB, batch 8 does not
    table = nbmem.sweep(build, make, batch_size=[4096, 8], mode="tracked", optimizer="sgd", device="8MiB")
    first, second = table.rows
    assert (first.error, first.result) == ("OOM", None)
    assert second.error is None and second.result.mode == "tracked" and second.result.peak < 8 * MiB
    assert "OOM" in str(table)


def test_plots():
    table = nbmem.sweep(build, make, batch_size=[8, 16, 32], precision=["fp32", "bf16"], device="4MiB")
    lines = table.plot()
    axes = lines.axes[0]
    assert len(axes.get_lines()) == 3  # two variants and the capacity line
    assert axes.get_xscale() == "log"
    bars = table.plot("breakdown")
    assert len(bars.axes[0].get_xticklabels()) == 6
    with pytest.raises(ValueError, match="'lines' or 'breakdown'"):
        table.plot("pie")


def test_bad_input():
    with pytest.raises(ValueError, match="unknown mode 'fast'.*'estimated'.*'tracked'.*'measured'"):
        nbmem.sweep(build, make, batch_size=8, mode="fast")
    with pytest.raises(ValueError, match="unknown verify mode 'cuda'"):
        nbmem.max_batch_size(build, make, device="1MiB", verify="cuda")
    with pytest.raises(ValueError, match="no values"):
        nbmem.sweep(build, make, batch_size=[])
    with pytest.raises(ValueError, match="positive whole number"):
        nbmem.sweep(build, make, batch_size=[8, -1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_measured_without_cuda_says_what_to_use_instead():
    for call in (
        lambda: nbmem.sweep(build, make, batch_size=8, mode="measured"),
        lambda: nbmem.estimate(build, make, batch_size=8, mode="measured"),
        lambda: nbmem.max_batch_size(build, make, device="1MiB", verify="measured"),
    ):
        with pytest.raises(ValueError, match="none is available here: use mode='tracked'"):
            call()


def classify_build():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))


def classify_make(n):
    return torch.randn(n, 256), torch.randint(0, 256, (n,))


def test_max_batch_size_is_verified_on_both_sides():
    found = nbmem.max_batch_size(classify_build, classify_make, device="8MiB")
    trials = dict(found.trials)
    assert trials[found.batch_size] is not None and trials[found.batch_size] <= 8 * MiB
    assert trials[found.batch_size + 1] is None  # the next size up was tried and did not fit
    assert found.predicted == found.batch_size and found.real_trials == 2  # estimates were exact here
    assert f"verified with {found.real_trials} real tracked trials" in str(found)
    accumulated = nbmem.max_batch_size(classify_build, classify_make, device="8MiB", accumulation=4)
    trials = dict(accumulated.trials)
    assert trials[accumulated.batch_size] is not None and trials[accumulated.batch_size + 1] is None
    # gradients stay alive across micro-batches: the largest micro-batch is smaller
    assert accumulated.batch_size < found.batch_size and accumulated.effective_batch == 4 * accumulated.batch_size


def test_max_batch_size_verifies_its_prediction_with_real_trials():
    found = nbmem.max_batch_size(classify_build, make, device="8MiB")
    trials = dict(found.trials)
    assert trials[found.batch_size] is not None and trials[found.batch_size + 1] is None
    assert found.batch_size <= found.predicted


def test_max_batch_size_says_what_its_tracked_trials_leave_out_of_an_nvidia_gpus_kernels():
    """The estimates take cuDNN's convolution workspaces for an NVIDIA GPU (or none named); tracked trials on this
    CPU run PyTorch's kernels, which take none: the answer says so. A preset of another vendor's GPU is used as
    itself (it was passed on as a bare capacity: an Intel GPU's estimates followed NVIDIA's kernels)."""

    def build() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                             nn.Flatten(), nn.Linear(16 * 16 * 16, 10))

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 16, 16), torch.randint(0, 10, (n,))

    nvidia = nbmem.max_batch_size(build, make, device="32MiB", optimizer="sgd", progress=False)
    assert nvidia.kernels_not_tracked is not None and nvidia.predicted is not None
    assert nvidia.predicted < nvidia.batch_size  # the workspaces the trials did not take
    assert (f"note: the estimates took the memory cuDNN's convolutions take on an NVIDIA GPU, which the tracked trials "
            f"on this CPU (PyTorch's CPU kernels) don't: on that GPU the largest batch may be smaller than "
            f"{nvidia.batch_size}, nearer the estimates' {nvidia.predicted}") in str(nvidia)
    intel = nbmem.max_batch_size(build, make, device="Arc-A770-16GB", optimizer="sgd", limit=16, progress=False)
    assert intel.kernels_not_tracked is None and intel.capacity_label == "Arc-A770-16GB"


def test_max_batch_size_when_nothing_fits():
    found = nbmem.max_batch_size(classify_build, classify_make, device="64KiB")
    assert found.batch_size == 0 and dict(found.trials)[1] is None


def test_plots_display_without_pyplot_registered():
    table = nbmem.sweep(build, make, batch_size=[8, 16])
    figure = table.plot()
    assert figure._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = [label.get_text() for label in table.plot("breakdown").axes[0].get_xticklabels()]
    assert labels == ["batch_size=8", "batch_size=16"]


def test_max_batch_size_says_when_it_stopped_at_the_search_limit():
    # 3 samples of this model fit 8 MiB with room to spare (the boundary is far above), so the search stops at 3
    found = nbmem.max_batch_size(classify_build, classify_make, device="8MiB", limit=3)
    assert found.batch_size == 3 and found.limit_reached
    assert dict(found.trials)[3] is not None  # the limit itself ran; nothing above it was tried
    assert "at least 3 (reached the search limit 3; the true maximum may be larger" in str(found)
    boundary = nbmem.max_batch_size(classify_build, classify_make, device="64KiB", limit=3)
    assert boundary.batch_size == 0 and not boundary.limit_reached and "search limit" not in str(boundary)


@pytest.mark.parametrize("limit", [-5, 0, 2.5, True])
def test_max_batch_size_rejects_a_limit_that_is_not_a_positive_whole_number(limit):
    with pytest.raises(ValueError, match=r"limit=.* pass a whole number of samples, at least 1"):
        nbmem.max_batch_size(classify_build, classify_make, device="8MiB", limit=limit)
