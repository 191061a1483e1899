"""The workspace an NVIDIA GPU's fused attention holds in backward (nbmem.estimation.attention.backward_workspace),
against an H100's allocations (benchmarks/results/2026-11-27-gpu/misses-first.json, section attention)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nbmem.estimation.attention import FusedAttention, backward_workspace
from nbmem.estimation.estimate import estimate
from nbmem.tracking.scope import track

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-27-gpu/misses-first.json"
ROWS = [row for row in json.loads(RESULTS.read_text())["items"]["attention"]["value"]["rows"]
        if row["backend"] != "MATH"]


def test_the_workspace_is_the_h100s_in_every_fused_call_measured() -> None:
    """cuDNN's attention (bf16, PyTorch's pick on an H100) and memory-efficient attention (fp32): the one transient
    of backward larger than the query, to the byte, in all 36 calls (4 x 8 or 8/2 heads, 128 to 2,048 long, head
    sizes 64 and 128, with and without a mask)."""
    assert len(ROWS) == 36 and {row["backend"] for row in ROWS} == {"CUDNN_ATTENTION", "EFFICIENT_ATTENTION"}
    for row in ROWS:
        dtype = getattr(torch, row["dtype"])
        query = torch.empty(row["batch"], row["heads"][0], row["length"], row["head_size"], dtype=dtype)
        key = torch.empty(row["batch"], row["heads"][1], row["length"], row["head_size"], dtype=dtype)
        larger = [size for size, freed in row["backward"] if freed and size > query.nbytes]
        assert larger == [backward_workspace(query, key)], row


def test_backward_holds_the_workspace_beside_the_gradients() -> None:
    """Tracked on the CPU: the backward's peak grows by the workspace (8,224 B, one 8,704 B block), held while the
    inputs' gradients are made (autograd.grad: no .grad accumulated after the kernel), and nothing stays after it."""
    def peaks(workspaces: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        query, key, value = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
        with FusedAttention() as attention:
            attention.workspaces = workspaces
            output = nn.functional.scaled_dot_product_attention(query, key, value)
            with track("cpu") as backward:
                grads = torch.autograd.grad(output.sum(), (query, key, value))
            del grads
        assert attention.with_workspace == workspaces
        assert backward.result is not None
        return backward.result.peak_allocated, backward.result.allocated_after

    (plain, plain_after), (held, held_after) = peaks(False), peaks(True)
    assert backward_workspace(torch.empty(1, 2, 64, 16), torch.empty(1, 2, 64, 16)) == 8224
    assert held - plain == 8704 and held_after == plain_after


class Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(32, 3 * 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        query, key, value = self.project(x).view(x.size(0), x.size(1), 3, 4, 8).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(query, key, value).sum(dim=(1, 2))


@pytest.mark.parametrize(("device", "taken"), [("H100-80GB", True), (None, True), ("Mac-16GB", False)])
def test_estimates_for_an_nvidia_gpu_take_it_and_say_so(device: str | None, taken: bool) -> None:
    result = estimate(Attend, lambda n: (torch.randn(n, 64, 32), torch.randn(n, 8)), batch_size=2,
                      loss=lambda output, batch: nn.functional.mse_loss(output, batch[1]), device=device)
    noted = [note for note in result.notes if "take a workspace in backward" in note]
    assert len(noted) == taken
    if taken:
        assert noted[0].startswith("attention: 1 calls per step take a workspace in backward as an H100's")
    others = "cuBLAS's and attention's backward (noted above)" if taken else "cuBLAS's"
    assert f"kernel workspaces other than {others} are not included" in " ".join(result.notes)


class _Nothing(torch.autograd.Function):
    """Passes its input on, and gives it no gradient back."""

    @staticmethod
    def forward(ctx, tensor):  # type: ignore[no-untyped-def, override]
        return tensor * 1

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return None


def test_each_call_holds_its_workspace_only_while_its_backward_runs() -> None:
    """From a review: held from the node's start to its end, not until an input's gradient (the same query in four
    calls held four at once; gradients asked for the key and value only left one behind); an undefined output
    gradient takes none and raises nothing."""
    def step(backward: Any, calls: int = 1) -> tuple[int, int]:
        torch.manual_seed(0)
        query, key, value = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
        results = {}
        for workspaces in (False, True):
            with FusedAttention() as attention:
                attention.workspaces = workspaces
                outputs = [nn.functional.scaled_dot_product_attention(query, key, value) for _ in range(calls)]
                with track("cpu") as tracked:
                    kept = backward(outputs, query, key, value)
                del kept
            assert tracked.result is not None
            results[workspaces] = (tracked.result.peak_allocated, tracked.result.allocated_after)
        return results[True][0] - results[False][0], results[True][1] - results[False][1]

    four = step(lambda outputs, q, k, v: torch.autograd.grad(sum(o.sum() for o in outputs), (q, k, v)), calls=4)
    assert 0 < four[0] <= 8704 and four[1] == 0  # one call's workspace at a time (four at once: 33,792 B)
    key_and_value = step(lambda outputs, q, k, v: torch.autograd.grad(outputs[0].sum(), (k, v)))
    assert key_and_value == (8704, 0)  # nothing left behind
    undefined = step(lambda outputs, q, k, v: torch.autograd.grad(_Nothing.apply(outputs[0]).sum() + q.sum(), (q,)))
    assert undefined == (0, 0)


def test_fp64_attention_takes_no_workspace() -> None:
    """CUDA runs fp64 attention on PyTorch's math kernel: no fused kernel's workspace (the CPU's flash kernel takes
    fp64, so the rule is nbmem's)."""
    query = torch.randn(1, 2, 64, 16, dtype=torch.float64, requires_grad=True)
    with FusedAttention() as attention:
        attention.workspaces = True
        nn.functional.scaled_dot_product_attention(query, query, query)
    assert attention.calls == 1 and attention.with_workspace == 0
