"""The 'know why' features as a user meets them in a shell: --breakdown,
--capacity, the out-of-memory diagnosis and %gpumem free."""

from __future__ import annotations

import torch
from IPython.utils.capture import capture_output
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nbmem
from nbmem.core.units import format_bytes
from nbmem.tracking.tracker import default_tracker

MiB = 1024**2

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
opt = torch.optim.AdamW(model.parameters())
def train(batch):
    x = torch.randn(batch, 1024)
    model(x).sum().backward(); opt.step(); opt.zero_grad()
"""


def run(shell, source):
    with capture_output() as captured:
        result = shell.run_cell(source, store_history=True)
    return result, captured


def plain(captured) -> str:
    return "\n".join(output.data.get("text/plain", "") for output in captured.outputs)


def test_breakdown_flag_shows_categories_and_modules(shell):
    run(shell, SETUP)
    result, captured = run(shell, "%%gpumem --breakdown\ntrain(64)")
    assert result.success
    text = plain(captured)
    # Linear(1024, 4096) + Linear(4096, 1024): 2 x 16 MiB weights + biases
    for row in ("parameter", "gradient", "optimizer state", "activation", "peak at", "by module"):
        assert f"  {row}" in text
    assert "nbmem-breakdown" in captured.outputs[0].data["text/html"]
    breakdown = nbmem.history(shell)[-1].breakdown
    assert breakdown.category("parameter") == 2 * 16 * MiB + 16384 + 4096  # biases: 4096*4, 1024*4


def test_virtual_out_of_memory_diagnosis_free_and_the_fix(shell):
    run(shell, SETUP)
    tracker = default_tracker("cpu")
    result, captured = run(shell, "%%gpumem --text --capacity 100MiB\ntrain(4096)")
    # the model was built in an untracked cell: its parameters count from the cell's start
    baseline = nbmem.history(shell)[-1].allocated_before
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert "CUDA out of memory. Tried to allocate 64.00 MiB" in str(result.error_in_exec)
    report, diagnosis = (output.data["text/plain"] for output in captured.outputs)
    assert "FAILED with OutOfMemoryError" in report and "virtual 100MiB" in report
    # the model's 32 MiB of parameters (counted from the model's first call) and
    # the batch x (16 MiB) are in use when the first Linear's output (64 MiB) fails; so is whatever other tests
    # left alive in this process (a scope's baseline is every storage on the device), a few KiB, or none run alone
    assert 32 * MiB + 20 * 1024 <= baseline < 32 * MiB + 20 * 1024 + MiB  # the weights and biases, and what was left
    in_use = baseline + 16 * MiB
    assert (f"capacity 100 MiB; in use at the failure {format_bytes(in_use)}; the failed request 64.0 MiB; missing "
            f"{format_bytes(in_use + 64 * MiB - 100 * MiB)}") in diagnosis
    assert "model.0.weight  4096x1024  float32  parameter" in diagnosis
    assert (
        "halve the batch and accumulate 2 micro-batches (same effective batch): saves about 40.0 MiB"
        " (covers what was missing at the failure)" in diagnosis  # (16 MiB of x + the 64 MiB request) / 2
    )
    assert "failed in forward (Sequential.0)" in diagnosis and "backward (gradients) and an optimizer step" in diagnosis
    assert "train(batch)" in captured.stdout  # the traceback goes through the user's function
    # the failed cell's frames keep the batch x (4096 x 1024 float32 = 16 MiB) alive until %gpumem free
    assert tracker.allocated() - baseline == 16 * MiB
    result, captured = run(shell, "%gpumem free")
    assert "16.0 MiB came back" in plain(captured)
    assert tracker.allocated() == baseline
    # the next cell runs; the whole step needs more than 100 MiB whatever the
    # batch (AdamW's state alone is 64 MiB), which the forward-time diagnosis said it could not see
    result, captured = run(shell, "%%gpumem --text\ntrain(2048)")
    assert result.success, result.error_in_exec
    # AdamW's two moments of each parameter; its 4 step counters are CPU tensors on a GPU, outside the figures
    assert dict(nbmem.history(shell)[-1].breakdown.at_peak)["optimizer state"] == 2 * (32 * MiB + 20480)
    assert _get_current_dispatch_mode() is None and default_tracker("cpu").capacity is None


def test_every_cell_on_a_virtual_device(shell):
    run(shell, SETUP)
    run(shell, "%gpumem on -q --capacity 1MiB")
    result, captured = run(shell, "big = torch.zeros(1024, 1024)")  # 4 MiB
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    run(shell, "%gpumem off -q")
    result, captured = run(shell, "big = torch.zeros(1024, 1024)")
    assert result.success


def test_bad_capacity_is_a_usage_error(shell):
    result, captured = run(shell, "%%gpumem --capacity T5000\n1")
    message = captured.stderr + captured.stdout
    assert not result.success and "UsageError" in message
    assert "'16GiB'" in message and "A100-40GB" in message


def test_output_flag_keeps_the_breakdown_in_out(shell):
    run(shell, SETUP)
    result, captured = run(shell, "%%gpumem -o --breakdown\ntrain(8)")
    shown = str(result.result)
    assert "optimizer state" in shown and "by module" in shown
    assert "nbmem-breakdown" in result.result._repr_html_()
    assert "by module" not in str(nbmem.history(shell)[-1].__class__(**{**result.result.__dict__, "show_breakdown": False}))


def test_the_diagnosis_names_tensors_without_warning_about_non_leaf_grads(shell):
    import warnings

    run(shell, SETUP)
    # hidden is a non-leaf tensor (the output of a Linear) in the user's namespace, and kept.grad a retained one
    cell = (
        "%%gpumem --text --capacity 100MiB\n"
        "hidden = model[0](torch.randn(8, 1024))\n"
        "kept = model[0](torch.randn(8, 1024)); kept.retain_grad(); kept.sum().backward()\n"
        "train(4096)"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, captured = run(shell, cell)
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert [str(warning.message) for warning in caught] == []  # PyTorch's ".grad of a non-leaf tensor" warning
    assert "UserWarning" not in captured.stderr
    assert "gpumem out-of-memory diagnosis" in plain(captured) and "model.0.weight" in plain(captured)


def test_gpumem_on_with_a_virtual_capacity_diagnoses_an_out_of_memory_cell(shell):
    """As %%gpumem does after any out-of-memory error (a review found %gpumem on showing the FAILED line only)."""
    run(shell, SETUP)
    run(shell, "%gpumem on --capacity 100MiB")
    try:
        result, captured = run(shell, "train(4096)")
    finally:
        run(shell, "%gpumem off")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert "FAILED (OutOfMemoryError)" in plain(captured)
    assert "gpumem out-of-memory diagnosis (virtual 100MiB)" in plain(captured) and "model.0.weight" in plain(captured)
