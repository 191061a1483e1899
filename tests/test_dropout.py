"""Dropout as a GPU keeps it: a one-byte mask from the fused kernel (nbmem.estimation.dropout)."""

from __future__ import annotations

import torch
from torch import nn

from nbmem.estimation.building import without_onednn
from nbmem.estimation.dropout import FusedDropout
from nbmem.estimation.estimate import estimate
from nbmem.tracking.scope import track

MiB = 1024**2


def test_fused_dropout_keeps_a_bool_mask_where_the_cpu_keeps_one_of_the_inputs_dtype() -> None:
    x = torch.ones(1024, 1024, requires_grad=True)  # 4 MiB of fp32
    with without_onednn():
        with track("cpu") as fused, FusedDropout() as dropout:
            kept = nn.functional.dropout(x, 0.1)
        assert kept.grad_fn.name() == "NativeDropoutBackward0" and dropout.calls == 1
        del kept
        with track("cpu") as plain:
            kept = nn.functional.dropout(x, 0.1)
    assert fused.result is not None and plain.result is not None
    assert fused.result.retained == 4 * MiB + MiB  # the output and a bool mask
    assert plain.result.retained == 4 * MiB + 4 * MiB  # the output and the fp32 noise autograd saves
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::dropout", "AutogradCPU")  # gone after the block
    del kept


def test_where_a_gpu_drops_nothing_the_input_itself_comes_back() -> None:
    """Evaluation, p=0 and p=1 run PyTorch's own C++ kernel: the input itself, no copy (torch._decomp's Python
    dropout would copy it: 4 MiB here for nothing)."""
    x = torch.ones(1024, 1024, requires_grad=True)
    with without_onednn(), track("cpu") as tracked, FusedDropout() as dropout:
        same = [nn.functional.dropout(x, 0.1, training=False), nn.functional.dropout(x, 0.0)]
        zeroed = nn.functional.dropout(x, 1.0)  # the input times a zero scalar, which backward keeps (512 B)
    assert [t.untyped_storage().data_ptr() for t in same] == [x.untyped_storage().data_ptr()] * 2
    assert dropout.calls == 0 and tracked.result is not None and tracked.result.retained == 4 * MiB + 512
    assert zeroed.sum().item() == 0


def test_an_estimate_for_a_gpu_keeps_one_byte_masks_and_for_a_mac_the_inputs_dtype() -> None:
    """CUDA's fused dropout (and XPU's) keeps a bool mask; MPS, like the CPU, a mask of the input's dtype: at the
    peak, 4096 x 1024 elements of 1 byte against 4. (Without biases: a bias's gradient on a GPU is a reduction whose
    staging buffer, 32 MiB for this one, would set the GPU's peak: nbmem.estimation.cuda_reductions.)"""
    build = lambda: nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Dropout(0.1),  # noqa: E731
                                  nn.Linear(1024, 10, bias=False))
    make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))  # noqa: E731
    gpu, mac = (estimate(build, make, batch_size=4096, optimizer="sgd", device=device)
                for device in ("H100-80GB", "Mac-16GB"))
    assert mac.peak - gpu.peak == 4096 * 1024 * (4 - 1)
    assert any(note.startswith("dropout: 1 call per step (recomputed ones too) ran as a GPU's fused kernel") for note in gpu.notes)
    assert not any(note.startswith("dropout:") for note in mac.notes)
    tracked = estimate(build, make, batch_size=4096, optimizer="sgd", device="H100-80GB", mode="tracked")
    assert (tracked.first_step, tracked.steady) == (gpu.first_step, gpu.steady)  # real CPU tensors, the same bytes
