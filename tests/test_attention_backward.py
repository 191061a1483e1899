"""The workspace an NVIDIA GPU's fused attention holds in backward (nbmem.estimation.attention.backward_workspace),
against an H100's allocations (benchmarks/results/2026-11-27-gpu/misses-first.json, section attention)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from nbmem.estimation.attention import FusedAttention, backward_workspace
from nbmem.estimation.estimate import estimate
from nbmem.tracking.scope import track

from _allocations import Allocations

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


def _encoders_attention_backward(nvidia: bool, grad_layout: tuple[int, ...]) -> list[int]:
    """The storages the transformer encoder's attention backward makes on fake tensors (8 x 4 heads x 64 tokens x
    64: 524,288 B an output), its query laid out as nn.MultiheadAttention's (sequence, batch, heads, head size)."""
    with FakeTensorMode(), FusedAttention() as attention:
        attention.nvidia = nvidia
        query, key, value = (torch.randn(64, 8, 4, 64).permute(1, 2, 0, 3).requires_grad_() for _ in range(3))
        output = nn.functional.scaled_dot_product_attention(query, key, value)
        grad = torch.randn([(8, 4, 64, 64)[axis] for axis in grad_layout]).permute(
            *[grad_layout.index(axis) for axis in range(4)])
        with Allocations() as backward:
            torch.autograd.grad(output, (query, key, value), grad)
    return backward.sizes


def test_fp32_backward_takes_what_cudas_memory_efficient_backward_takes_in_its_order() -> None:
    """fp32 attention runs on CUDA's memory-efficient kernel, whose backward (``_efficient_attention_backward``)
    copies the output's gradient where it is not contiguous as (batch, sequence, heads, head size), makes the three
    gradients, then a float32 row statistic in ATen (a product the size of the output, its sum, the sum's copy) and
    the kernel's workspace. The H100 allocated exactly these, in this order, in each of the transformer encoder's
    four layers' backward in both steps measured (its fp32 checkpointed step's history, misses.json), where the estimate made the three
    gradients only, the workspace taken before them."""
    output, row, workspace = 524288, 8 * 4 * 64 * 4, 524800
    assert backward_workspace(torch.empty(8, 4, 64, 64), torch.empty(8, 4, 64, 64)) == workspace
    sequence_major, as_query = (0, 2, 1, 3), (2, 0, 1, 3)  # the gradient MultiheadAttention gives: as its query
    cuda = [output, *[output] * 3, output, row, row, workspace]
    assert _encoders_attention_backward(True, as_query) == cuda
    assert _encoders_attention_backward(True, sequence_major) == cuda[1:]  # contiguous as the kernel wants: no copy
    assert _encoders_attention_backward(False, as_query) == [output] * 3  # PyTorch's CPU kernel's gradients only
    history = json.loads((RESULTS.parent / "misses.json").read_text())["items"][
        "trace.transformer encoder.fp32.True.sgd-momentum"]["value"]["events"]
    made = [size for action, _, size, *_ in history if action == "alloc"]
    starts = [at for at in range(len(made)) if made[at:at + len(cuda) - 1] == [*cuda[:5], row, row]]
    assert len(starts) == 8 and all(made[at + 7] == workspace for at in starts)  # 2 steps x 4 layers; the sum freed


def test_an_undefined_gradient_passes_the_fp32_backward_untouched() -> None:
    query = torch.randn(1, 2, 64, 16, requires_grad=True)
    with FusedAttention() as attention:
        attention.nvidia = True
        output = nn.functional.scaled_dot_product_attention(query, query, query)
        (grad,) = torch.autograd.grad(_Nothing.apply(output).sum() + query.sum(), (query,))
    assert torch.equal(grad, torch.ones_like(query))


def test_an_fp32_output_is_laid_out_as_cudas_and_multihead_attention_copies_it() -> None:
    """CUDA's memory-efficient kernel writes its output as (batch, sequence, heads, head size); the CPU's follows
    the query, which nn.MultiheadAttention lays out as (sequence, batch, heads, head size). For an NVIDIA GPU the
    output takes CUDA's strides (its own storage: no memory more), so ``permute(2, 0, 1, 3).contiguous()`` copies
    it, as on the GPU, and the output projection keeps the copy for backward: one output's bytes more after the
    forward (8 x 64 tokens of 256 fp32 values: 524,288 B), where the CPU's output was a view. bf16 and other GPUs
    keep the query's layout (cuDNN's and flash attention's outputs follow it)."""
    def forward(nvidia: bool, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
        torch.manual_seed(0)
        layer = nn.MultiheadAttention(256, 4, batch_first=True, dtype=dtype)
        x = torch.randn(8, 64, 256, dtype=dtype)
        with FusedAttention() as attention:
            attention.nvidia = nvidia
            with track("cpu") as tracked:
                output, _ = layer(x, x, x, need_weights=False)
            assert tracked.result is not None
            kept = tracked.result.allocated_after
            del output
        return kept, attention.relaid

    assert forward(True)[0] - forward(False)[0] == 524288
    assert (forward(True)[1], forward(False)[1]) == (1, 0)
    # bf16: cuDNN's output follows the query (no copy); its seed and offset kept for backward, a 512-byte block each
    assert forward(True, torch.bfloat16)[0] - forward(False, torch.bfloat16)[0] == 1024
    assert forward(True, torch.bfloat16)[1] == forward(False, torch.bfloat16)[1] == 0


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


def test_cudnns_seed_and_offset_are_held_until_the_calls_backward_has_run() -> None:
    """bf16 (cuDNN's attention): its random-number seed and offset (8 bytes each, a 512-byte block each) are kept
    from the forward to the end of the call's backward, as autograd keeps what it saved, though the output (and so
    the graph) lives on; an undefined output gradient takes nothing more and raises nothing."""
    def kept(backward: Any) -> int:
        """What the step leaves, with nbmem's cuDNN rules less without, the output still alive."""
        left = {}
        for nvidia in (False, True):
            torch.manual_seed(0)
            query = torch.randn(1, 2, 64, 16, dtype=torch.bfloat16, requires_grad=True)
            with FusedAttention() as attention:
                attention.nvidia = nvidia
                with track("cpu") as tracked:
                    output = nn.functional.scaled_dot_product_attention(query, query, query)
                    backward(output, query)
            assert tracked.result is not None and attention.with_workspace == nvidia
            left[nvidia] = tracked.result.allocated_after
            del output
        return left[True] - left[False]

    assert kept(lambda output, q: None) == 1024  # no backward yet: both held
    assert kept(lambda output, q: torch.autograd.grad(output.sum(), (q,))) == 0
    assert kept(lambda output, q: torch.autograd.grad(_Nothing.apply(output).sum() + q.sum(), (q,))) == 0


def test_fp64_attention_takes_no_workspace() -> None:
    """CUDA runs fp64 attention on PyTorch's math kernel: no fused kernel's workspace (the CPU's flash kernel takes
    fp64, so the rule is nbmem's)."""
    query = torch.randn(1, 2, 64, 16, dtype=torch.float64, requires_grad=True)
    with FusedAttention() as attention:
        attention.nvidia = True
        nn.functional.scaled_dot_product_attention(query, query, query)
    assert attention.calls == 1 and attention.with_workspace == 0


class _SelfAttend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attend = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x, x, x, need_weights=False)[0].sum(dim=(1, 2))


def test_an_estimate_for_an_nvidia_gpu_lays_multihead_attention_out_as_cuda_and_its_tracked_run_agrees() -> None:
    """The estimate and its tracked run (real CPU tensors, the output's storage seen with CUDA's strides) take the
    same bytes; the note says how many outputs were laid out so; a Mac's estimate keeps the CPU's layout."""
    def run(device: str, mode: str) -> Any:
        return estimate(_SelfAttend, lambda n: (torch.randn(n, 16, 32), torch.randn(n)), batch_size=2, device=device,
                        loss=lambda output, batch: nn.functional.mse_loss(output, batch[1]), mode=mode)

    nvidia, tracked, mac = run("H100-80GB", "estimated"), run("H100-80GB", "tracked"), run("Mac-16GB", "estimated")
    assert nvidia.peak == tracked.peak and nvidia.peak > mac.peak
    laid = [note for note in nvidia.notes if "laid out sequence-major" in note]
    assert laid and laid[0].startswith("attention: 1 fp32 outputs per step laid out sequence-major")
    assert not any("laid out sequence-major" in note for note in mac.notes)


@pytest.mark.parametrize("row", [row for row in ROWS if row["backend"] == "EFFICIENT_ATTENTION"],
                         ids=lambda row: f"L{row['length']}-D{row['head_size']}-{'mask' if row['masked'] else 'causal'}")
def test_fp32_backward_is_the_h100s_in_all_12_memory_efficient_calls_measured(row: dict[str, Any]) -> None:
    """The H100's memory-efficient attention (fp32; 4 x 8 heads, 128 to 2,048 long, head sizes 64 and 128, causal or
    with a mask; misses-first.json): every allocation of its backward, in order, to the kernel's workspace: the
    loss's gradient, the output gradient's copy (``.sum()``'s is expanded), the three gradients, the statistic's
    product, sum and copy, the workspace. On fake tensors the same, then autograd's sum of the key's and value's
    gradients (the probe passed the key as the value) and the leaves' gradients, which the probe's record left out."""
    batch, (heads, _), length, size = row["batch"], row["heads"], row["length"], row["head_size"]
    with FakeTensorMode(), FusedAttention() as attention:
        attention.nvidia = True
        query, key = (torch.randn(batch, heads, length, size, requires_grad=True) for _ in range(2))
        mask = torch.ones(length, length, dtype=torch.bool).tril() if row["masked"] else None
        loss = nn.functional.scaled_dot_product_attention(query, key, key, attn_mask=mask,
                                                          is_causal=not row["masked"]).sum()
        with Allocations() as backward:
            loss.backward()
    measured = [made for made, _ in row["backward"]]
    assert len(measured) == 9 and backward.sizes[:9] == measured
    assert backward.sizes[9:] == [batch * heads * length * size * 4] * 3


@pytest.mark.parametrize("row", [row for row in ROWS if row["backend"] == "CUDNN_ATTENTION"],
                         ids=lambda row: f"H{row['heads'][0]}-{row['heads'][1]}-L{row['length']}-D{row['head_size']}-"
                                         f"{'mask' if row['masked'] else 'causal'}")
def test_bf16_forward_and_backward_are_the_h100s_in_all_24_cudnn_calls_measured(row: dict[str, Any]) -> None:
    """The H100's cuDNN attention (bf16; 4 x 8 or 8/2 heads, 128 to 2,048 long, head sizes 64 and 128, causal or
    with a mask; misses-first.json). Forward: the seed and offset, the output, the log-sum-exp, a 256-byte
    workspace (a second one later in 4 of the 24 calls, not modelled). Backward to the
    workspace: the loss's gradient, the three gradients, the copy of the output's gradient (``.sum()``'s is
    expanded), the workspace. On fake tensors the same; then autograd's sum of the key's and value's gradients and
    the leaves', which the probe's record left out."""
    batch, (heads, groups), length, size = row["batch"], row["heads"], row["length"], row["head_size"]
    with FakeTensorMode(), FusedAttention() as attention:
        attention.nvidia = True
        query = torch.randn(batch, heads, length, size, dtype=torch.bfloat16, requires_grad=True)
        key = torch.randn(batch, groups, length, size, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(length, length, dtype=torch.bool).tril() if row["masked"] else None
        with Allocations() as forward:
            loss = nn.functional.scaled_dot_product_attention(query, key, key, attn_mask=mask, is_causal=not row["masked"],
                                                              enable_gqa=heads != groups).sum()
        with Allocations() as backward:
            loss.backward()
    made = [size for size, _ in row["forward"]]
    attention_made = made[made.index(8):made.index(8) + 5]  # seed, offset, output, log-sum-exp, workspace
    assert attention_made[:2] == [8, 8] and attention_made[4] == 256
    at = forward.sizes.index(8)
    assert forward.sizes[at:at + 5] == attention_made
    measured = [size for size, _ in row["backward"]]
    assert backward.sizes[:len(measured)] == measured


def test_cudnns_seeds_are_saved_as_autograd_saves_and_never_pass_to_another_call(monkeypatch: Any) -> None:
    """From a review: under non-reentrant checkpointing the seeds go through checkpoint's pack hook (freed after the
    forward, made again by the recomputation), as autograd's saved tensors do on the GPU; an exception between the
    kernel and the node (checkpoint's early stop, a pack hook raising) leaves none behind for the next call."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    made: list[weakref.ref[torch.Tensor]] = []
    flash = FusedAttention._flash

    def recorded(self: FusedAttention, *args: Any, **kwargs: Any) -> Any:
        out = flash(self, *args, **kwargs)
        made.extend(weakref.ref(seed) for seed in self._seeds)
        return out

    monkeypatch.setattr(FusedAttention, "_flash", recorded)

    def alive() -> int:
        gc.collect()
        return sum(ref() is not None for ref in made)

    def attend(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(x, x, x) * 2

    class Boom(Exception):
        pass

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        raise Boom

    with FakeTensorMode(), FusedAttention() as attention:
        attention.nvidia = True
        query = torch.randn(2, 4, 16, 8, dtype=torch.bfloat16, requires_grad=True)
        output = checkpoint(attend, checkpoint(attend, query, use_reentrant=False), use_reentrant=False)
        assert (len(made), alive()) == (4, 0)  # two layers' seeds, freed with the forward
        output.float().sum().backward()
        assert len(made) > 4 and alive() == 0 and attention._seeds == []  # made again, given back
        plain = attend(query)
        assert alive() == 2  # no hooks: held by the node
        del plain
        assert alive() == 0
        with pytest.raises(Boom), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            attend(query)
        assert attention._seeds == [] and alive() == 0


@pytest.mark.parametrize("nvidia", [False, True])
def test_a_double_backward_through_attention_raises_as_without_nbmem(nvidia: bool) -> None:
    """From a review: the CPU flash backward has no derivative (nor do CUDA's fused kernels); with the backward
    replaced, a gradient penalty through attention went on without its second-order term. Now PyTorch's own error."""
    query = torch.randn(1, 2, 8, 4, requires_grad=True)
    with FusedAttention() as attention:
        attention.nvidia = nvidia
        output = nn.functional.scaled_dot_product_attention(query, query, query) + query * query
        (grad,) = torch.autograd.grad(output.sum(), query, create_graph=True)
        with pytest.raises(RuntimeError, match="derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward"
                                               " is not implemented"):
            grad.pow(2).sum().backward()
