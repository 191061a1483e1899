"""CUDA's split reductions' staging buffers in estimates (nbmem/estimation/cuda_reductions.py) against an H100's.

The H100's figures are raw files under benchmarks/results/2026-11-27-gpu/: every allocation of 1,962 one-layer
convolution training steps (``conv_sizes.json``: the loss's mean and the bias gradient's sum take one each where
they split), and the allocator's history of whole training steps (``misses.json``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from nbmem.estimation.cuda_reductions import CudaReductions, staging_bytes
from nbmem.estimation.estimate import estimate

from _benchmarks import benchmark
from test_cudnn_rnn import Allocations

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-27-gpu"
H100 = "H100-80GB"


class Bytes(TorchDispatchMode):
    """The sizes of the byte buffers (uint8) ops make: what the reductions' staging buffers and semaphores are."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and not func.is_view:
            self.sizes.append(out.untyped_storage().nbytes())
        return out


def _blocks(*sizes: int) -> list[int]:
    return sorted(-(-size // 512) * 512 for size in sizes if size)


def test_the_loss_and_bias_reductions_of_1962_h100_convolution_steps() -> None:
    """Each step's loss (``y.float().pow(2).mean()``, every element) and its bias's gradient (a sum over batch and
    image) took the staging buffer and semaphores, or none, the launch rule gives: all 1,961 steps whose record
    separates them (in one, a 1x1 stride-2 layer without a backward-filter workspace, the extraction takes the bias's
    own gradient for them)."""
    with benchmark("fit_cudnn_conv") as fit:
        rows = json.loads((RESULTS / "conv_sizes.json").read_text())["rows"]
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        agree, splits, misread = 0, 0, []
        for row in rows:
            found = fit.extract(row)
            n, c, k, s = row["batch"], row["outputs"], row["kernel"], row["stride"]
            side = (row["image"] + 2 * (k // 2) - k) // s + 1
            shape, strides = (n, c, side, side), (c * side * side, side * side, side, 1)
            loss = staging_bytes(shape, strides, (), torch.float32, "sum", H100)
            bias = staging_bytes(shape, strides, (0, 2, 3), dtypes[row["precision"]], "sum", H100)
            if _blocks(*found["loss"]) == _blocks(*loss) and _blocks(*found["bias"]) == _blocks(*bias):
                agree += 1
                splits += bool(loss[0]) + bool(bias[0])
            else:
                misread.append((row["inputs"], c, k, s, row["image"], n, row["precision"], found["bias"]))
    assert agree == 1961 and misread == [(512, 512, 1, 2, 14, 4, "fp32", [2048])]
    assert splits > 1500  # most of them split: the rule is what is checked, not its "none"


@pytest.mark.parametrize("rows, outputs, dtype, staging, semaphores", [
    (1024, 1024, torch.bfloat16, 8_388_608, 32),    # BERT's intermediate bias (misses.json: 4 a step)
    (1024, 256, torch.bfloat16, 2_097_152, 8),      # its other biases (20 a step)
    (1024, 2048, torch.float32, 16_777_216, 64),    # GPT-2's MLP bias, fp32 and bf16 alike (float accumulators)
    (1024, 2048, torch.bfloat16, 16_777_216, 64),
    (1024, 1536, torch.bfloat16, 12_582_912, 48),   # its fused q/k/v bias
    (1024, 512, torch.float32, 4_194_304, 16),      # Llama's RMSNorm weights, GPT-2's 512-wide biases
])
def test_a_bias_gradient_is_a_column_sum_whose_buffer_the_h100_took(rows: int, outputs: int, dtype: torch.dtype,
                                                                     staging: int, semaphores: int) -> None:
    # outputs / 4 (vectors of 4) in rows of 32 lanes, 4 warps; 16 blocks a column group (256 values a thread / 16):
    # 4-byte accumulators x outputs x 16 blocks x 32 lanes x 4; a semaphore (int) per block of 128 outputs
    assert staging_bytes((rows, outputs), (outputs, 1), (0,), dtype, "sum", H100) == (staging, semaphores)
    assert staging == 4 * outputs * 16 * 32 * 4 and semaphores == 4 * outputs // 128


def test_what_takes_none_and_what_the_gpu_changes() -> None:
    assert staging_bytes((1024, 4096), (4096, 1), (1,), torch.float32, "sum", H100) == (0, 0)  # along rows
    assert staging_bytes((64, 256), (256, 1), (0,), torch.float32, "sum", H100) == (0, 0)  # too few rows to split
    assert staging_bytes((0, 256), (256, 1), (0,), torch.float32, "sum", H100) == (0, 0)  # nothing to reduce
    # every element of a 4 MiB tensor: 512 threads a block reduce across lanes, min(528 blocks, 2048 / 16) = 128 of
    # them, one 4-byte partial each
    assert staging_bytes((1 << 20,), (1,), (), torch.float32, "sum", H100) == (512, 4)
    # a T4 keeps 1,024 threads an SM (2 blocks of 512) on 40 SMs: 80 blocks, not 128
    assert staging_bytes((1 << 20,), (1,), (), torch.float32, "sum", "T4") == (320, 4)
    # var's Welford partials are 16 bytes and it loads 2 values at once; amax keeps the input's own type
    assert staging_bytes((1024, 256), (256, 1), (0,), torch.float32, "welford", H100) == (8_388_608, 8)
    assert staging_bytes((1024, 256), (256, 1), (0,), torch.bfloat16, "extreme", H100) == (1_048_576, 8)
    # a transposed input reduces along its fastest dimension: no split
    assert staging_bytes((1024, 256), (1, 1024), (0,), torch.float32, "sum", H100) == (0, 0)
    # an output row count not a multiple of 4 gives vectors of 2: blocks of 32 x 8 lanes, 5 groups of 64 outputs
    assert staging_bytes((4096, 258), (258, 1), (0,), torch.float32, "sum", H100) == (2_113_536, 4 * 5)


def test_an_estimate_takes_them_where_an_nvidia_gpu_would_and_says_so() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 256), torch.randn(n, 256)

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        x, y = batch
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    on_h100 = estimate(build, make, batch_size=1024, step=step, optimizer="sgd", device=H100, timeline=True)
    note = next(note for note in on_h100.notes if note.startswith("CUDA reductions: "))
    assert note.startswith("CUDA reductions: 3 reductions per step") and "132 SMs" in note
    # taken and freed at once (the semaphores one op after the buffers), in both steps: the two biases' gradients
    # (fp32: 4 x 1024 x 16 x 32 x 4 and 4 x 256 x 16 x 32 x 4 bytes), and the loss's mean (every element of
    # 1024 x 256: 32 blocks of 512 lanes, a 4-byte partial each: 128 B, a 512-byte block), with their semaphores
    transient = Counter(size for made, freed, size, *_ in on_h100.timeline.events
                        if freed is not None and freed - made <= 2)
    assert transient == Counter({8_388_608: 2, 2_097_152: 2, 512: 8})
    on_arc = estimate(build, make, batch_size=1024, step=step, optimizer="sgd", device="Arc-A770-16GB")
    assert not any(note.startswith("CUDA reductions") for note in on_arc.notes)


def test_cpu_tensors_take_them_too_and_a_double_backward_keeps_its_graph() -> None:
    """A tracked run's CPU tensors take the same buffers (untouched CPU memory), as an estimate's fake ones do."""
    weight = torch.randn(256, requires_grad=True)
    with CudaReductions() as reductions, Allocations() as made:
        (torch.randn(1024, 256) * weight).sum(0).pow(2).sum().backward()
    # the forward's column sum over 1,024 rows and the weight's gradient (another), 4 x 256 x 16 x 32 x 4 bytes each
    assert reductions.calls == 2 and made.sizes.count(2_097_152) == 2
    with FakeTensorMode(), CudaReductions() as reductions:
        x = torch.randn(1024, 256, requires_grad=True)
        with Bytes() as made:
            (grad,) = torch.autograd.grad((x * x).sum(0).pow(2).sum(), x, create_graph=True)
        assert grad.grad_fn is not None  # the node autograd records above the kernel
        assert made.sizes == [2_097_152, 8]  # the column sum's buffer and semaphores, once
        with Bytes() as made:
            grad.sum().backward()  # differentiates the graph the first backward made
        assert x.grad is not None and x.grad.shape == x.shape
        # the every-element sum (262,144 elements: 4-byte partials of min(528, 512 / 16) = 32 blocks of 512 lanes),
        # then the double backward's own column sum over the 1,024 rows
        assert made.sizes == [128, 4, 2_097_152, 8]
        with torch.inference_mode():  # a limitation, pinned: no kernel below autograd runs there, none is taken
            calls = reductions.calls
            torch.randn(1024, 256).sum(0)
            assert reductions.calls == calls


def test_the_accumulator_follows_the_compute_dtype_and_other_review_findings() -> None:
    # sum(dtype=float64) of float32 accumulates in double; an int32 sum into int32 in int32
    assert staging_bytes((1024, 256), (256, 1), (0,), torch.float32, "sum", H100, out_dtype=torch.float64) == (
        2 * 2_097_152, 8)
    assert staging_bytes((1024, 256), (256, 1), (0,), torch.int32, "sum", H100, out_dtype=torch.int32) == (2_097_152, 8)
    # complex128 runs 256 threads a block (mnt_wrapper): blocks of 32 x 2 lanes, so 32 blocks an output group of
    # 128 (512 values a thread / 16), 16-byte partials, x 32 lanes x 4
    assert staging_bytes((1024, 256), (256, 1), (0,), torch.complex128, "sum", H100) == (16 * 256 * 32 * 32 * 4, 8)
    with pytest.raises(ValueError, match="op must be one of sum, welford, extreme"):
        staging_bytes((1024, 256), (256, 1), (0,), torch.float32, "mean", H100)


def test_rms_norms_fused_kernel_takes_none_and_every_convolutions_bias_does() -> None:
    """On CUDA ``rms_norm`` with the weight in the input's dtype runs ``_fused_rms_norm`` (layer_norm.cpp), whose
    backward computes the weight's gradient itself: no split reduction. A convolution's bias's gradient sums every
    dimension but the channels, whether cuDNN's workspaces are modelled for the layer or not (a grouped one here)."""
    from nbmem.estimation.cudnn_conv import CudnnConv

    with FakeTensorMode(), CudaReductions() as reductions, CudnnConv(reductions) as conv:
        norm, x = nn.RMSNorm(1024), torch.randn(4096, 1024, requires_grad=True)
        expected = norm(x)
        norm(x).sum().backward()
        # the loss's every-element sum alone (4,096 x 1,024: 4-byte partials of 128 blocks), not the weight's
        assert reductions.calls == 1 and norm.weight.grad is not None and expected.shape == x.shape
        depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        with Bytes() as made:
            depthwise(torch.randn(8, 8, 128, 128)).pow(2).sum().backward()
        assert "grouped (depthwise) convolutions" in conv.unmodelled
        # the loss's every-element sum (1,048,576: 4-byte partials of 128 blocks of 512 lanes), then the bias's: 8
        # outputs of 8 x 128 x 128 inputs, reduced along the image in blocks of 64 x 8 lanes, 16 blocks an output
        bias = staging_bytes((8, 8, 128, 128), (131072, 16384, 128, 1), (0, 2, 3), torch.float32, "sum", H100)
        assert bias == (4 * 8 * 16, 4 * 8) and made.sizes == [512, 4, *bias]
    with FakeTensorMode(), CudaReductions() as reductions:  # a weight of another dtype: PyTorch's composite, summed
        norm, x = nn.RMSNorm(1024, dtype=torch.bfloat16), torch.randn(4096, 1024, requires_grad=True)
        with pytest.warns(UserWarning, match="Cannot dispatch to fused implementation"):  # PyTorch says so itself
            norm(x).sum().backward()
        assert reductions.calls == 2  # the weight's gradient, and the loss's sum


def test_an_estimates_tracked_run_takes_what_the_estimate_takes() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 10))

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 256), torch.randint(0, 10, (n,))

    estimated = estimate(build, make, batch_size=4096, optimizer="sgd", device=H100)
    tracked = estimate(build, make, batch_size=4096, optimizer="sgd", device=H100, mode="tracked")
    assert (tracked.first_step, tracked.steady) == (estimated.first_step, estimated.steady)
    assert estimated.cuda_kernels == () and any(
        note.startswith("CUDA reductions: 1 reduction per step") for note in tracked.notes)  # the first bias's gradient


def test_the_h100s_training_steps_took_them_as_the_estimate_does() -> None:
    """misses.json's allocator history of BERT's step (bf16 autocast): the buffers (a staging buffer and a 512-byte
    semaphore block, both freed) the H100 took per step are those its reductions take here, by size and count (the
    one 2,048-byte pair a step beside them is no reduction's: the estimate's own step makes it too)."""
    transformers = pytest.importorskip("transformers")
    history = json.loads((RESULTS / "misses.json").read_text())["items"]["trace.bert (4 layers, 256).bf16.False.adamw"]
    events = [(kind[0], size) for kind, _, size, *_ in history["value"]["events"] if kind in ("alloc", "free_completed")]

    def pairs(sequence: list[tuple[str, int]]) -> Counter[int]:
        found: Counter[int] = Counter()
        for (a, big), (b, small), (c, small_freed), (d, big_freed) in zip(sequence, sequence[1:], sequence[2:],
                                                                          sequence[3:]):
            if (a, b, c, d) == ("a", "a", "f", "f") and big > 512 >= small and (small_freed, big_freed) == (small, big):
                found[big] += 1
        return found

    theirs = pairs(events)
    assert theirs == Counter({2_097_152: 40, 8_388_608: 8, 2048: 2})  # two steps: 20, 4 (and 1) a step
    config = transformers.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024)
    with FakeTensorMode(), CudaReductions() as reductions:
        model = transformers.BertForSequenceClassification(config)
        ids, labels = torch.randint(0, config.vocab_size, (8, 128)), torch.randint(0, 2, (8,))
        with Bytes() as made:
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
    staged = Counter(size for size in made.sizes if size > 512)
    # q, k, v, the attention's output and the feed-forward's output biases (256 wide), the intermediate's (1,024)
    assert reductions.calls == 24 and staged == Counter({2_097_152: 20, 8_388_608: 4})


def test_the_gpu_probe_predicts_what_the_h100_took_where_it_was_measured() -> None:
    """benchmarks/gpu_probe_reductions.py (in gpu_session.sh for the next GPU): without CUDA it lists its cases and
    the launch rule's sizes; at 1,024 rows they are the H100's (misses.json), a transposed view's its contiguous twin's."""
    with benchmark("gpu_probe_reductions") as probe:
        by_name = {(case[0], dtype): probe.predicted(case, dtype, H100) for case in probe.cases()
                   for dtype in (torch.float32, torch.bfloat16)}
    assert by_name["sum rows=1024 width=1024", torch.bfloat16] == (8_388_608, 32)
    assert by_name["sum rows=1024 width=256", torch.bfloat16] == (2_097_152, 8)
    assert by_name["a transposed view over its dim 1", torch.float32] == by_name["sum rows=4096 width=1024",
                                                                                  torch.float32] == (33_554_432, 32)
