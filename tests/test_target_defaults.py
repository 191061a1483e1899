"""An estimate for a GPU uses the GPU's defaults: foreach optimizers, fused attention kernels (issue 13, points 4-5)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbmem.estimation.attention import FusedAttention
from nbmem.estimation.building import without_onednn
from nbmem.estimation.estimate import estimate
from nbmem.tracking.scope import track


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 256), torch.randint(0, 10, (n,))


# P: the parameters in 512 B blocks: 256 * 512 * 4 = 524288, 512 * 4 = 2048, 512 * 10 * 4 = 20480, 10 * 4 -> 512
P = 524288 + 2048 + 20480 + 512  # 547328


def test_adamw_defaults_to_foreach_as_on_cuda() -> None:
    default = estimate(mlp, batch, batch_size=32, optimizer="adamw")
    foreach = estimate(mlp, batch, batch_size=32, optimizer="adamw", foreach=True)
    loop = estimate(mlp, batch, batch_size=32, optimizer="adamw", foreach=False)
    # foreach peaks at _foreach_sqrt: parameters P, two moments 2P, gradients P, and the square roots of all second
    # moments at once, P (AdamW's step counters are CPU tensors on a GPU: not counted)
    assert default.steady == foreach.steady == P + 2 * P + P + P == 2736640
    # the per-tensor loop peaks in the largest tensor's update: its sqrt and the sqrt / bias correction,
    # 2 * 524288, instead of a whole group's sqrt (this small model has one big tensor; a deep one, many)
    assert loop.steady == P + 2 * P + P + 2 * 524288 == 3237888
    assert any("adamw with the foreach implementation, CUDA's default" in note for note in default.notes)
    assert any("foreach=False, as asked" in note for note in loop.notes)


def test_a_fused_kernel_saves_no_attention_matrix_even_with_dropout() -> None:
    # B=1, H=2, L=256, D=16: the output 1 * 2 * 256 * 16 * 4 = 32768 and the float32 log-sum-exp 2 * 256 * 4 = 2048
    query = torch.randn(1, 2, 256, 16, requires_grad=True)
    with without_onednn():
        with track("cpu") as fused, FusedAttention() as attention:
            kept = nn.functional.scaled_dot_product_attention(query, query, query, dropout_p=0.1)
        assert fused.result is not None and fused.result.retained == 32768 + 2048
        assert (attention.calls, attention.with_dropout, attention.math) == (1, 1, 0)
        del kept
        with track("cpu") as math:  # PyTorch's own CPU choice with dropout: the math kernel
            kept = nn.functional.scaled_dot_product_attention(query, query, query, dropout_p=0.1)
    assert math.result is not None and math.result.retained >= 2 * (2 * 256 * 256 * 4)  # attention matrices
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::scaled_dot_product_attention", "AutogradCPU")


def test_grouped_query_calls_in_fp32_keep_the_attention_matrix_and_name_every_head_shape() -> None:
    """Two layers with different grouping: the math kernel's attention matrix kept for each, both shapes named."""
    query, wide, narrow = (torch.randn(1, heads, 64, 16, requires_grad=True) for heads in (4, 2, 1))
    def attend() -> list[torch.Tensor]:
        return [nn.functional.scaled_dot_product_attention(query, key, key, enable_gqa=True) for key in (wide, narrow)]

    with without_onednn():
        with track("cpu") as tracked, FusedAttention() as attention:
            kept = attend()
        del kept
        with track("cpu") as math, torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            kept = attend()
        del kept
        with track("cpu") as fused:  # PyTorch's CPU flash kernel: no attention matrix
            kept = attend()
    assert len(kept) == 2 and attention.grouped_math == 2 and attention.math == 0
    assert tracked.result is not None and math.result is not None and fused.result is not None
    # a fused kernel keeps each call's output (1, 4, 64, 16) fp32, 16384 B, and its log-sum-exp, 4 * 64 * 4 B; the
    # math kernel also its softmax, (1, 4, 64, 64) fp32, 65536 B, and the key and value repeated over the query heads
    assert fused.result.peak == 2 * (16384 + 1024)
    assert tracked.result.peak == math.result.peak > fused.result.peak + 2 * 65536
    (note,) = [note for note in attention.notes() if "grouped-query" in note]
    assert "(4 query heads, 2 key/value heads; 4 query heads, 1 key/value head; Hugging Face" in note


def test_the_notes_name_the_attention_kernel() -> None:
    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.project = nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.project(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    result = estimate(Attend, lambda n: torch.randn(n, 32, 16), batch_size=4, optimizer="sgd")
    notes = "\n".join(result.notes)
    assert "attention: 1 scaled_dot_product_attention calls per step modelled as a fused kernel" in notes
    assert "attention: 1 calls per step with dropout run without it" in notes
    assert "math kernel" not in notes
    plain = estimate(mlp, batch, batch_size=4, optimizer="sgd")
    assert not any(note.startswith("attention") for note in plain.notes)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_and_tracked_run_agree_under_the_gpu_rules(precision: str) -> None:
    build = lambda: nn.TransformerEncoder(  # noqa: E731
        nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.1), 2, enable_nested_tensor=False
    )
    make = lambda n: torch.randn(n, 24, 64)  # noqa: E731
    torch.manual_seed(0)
    estimated = estimate(build, make, batch_size=8, precision=precision)
    torch.manual_seed(0)
    tracked = estimate(build, make, batch_size=8, precision=precision, mode="tracked")
    assert estimated.peak == pytest.approx(tracked.peak, rel=0.01)
    assert [note for note in estimated.notes if "attention" in note] == [n for n in tracked.notes if "attention" in n]
