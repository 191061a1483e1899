"""Today's estimates against what an H100 measured (issue 24's acceptance, as far as real CUDA figures go).

The GPU campaign of 2026-11-25 measured 31 training steps of its model zoo
on an H100 (``benchmarks/results/2026-11-25-gpu/campaign-run4-zoo.json``): the
allocator's peak allocated and reserved. Those figures don't move. Here every
configuration is estimated again with today's code for the ``H100-80GB``
preset (``benchmarks/bench_campaign_replay.py`` prints the same table), and:

- where PyTorch's own kernels run on the GPU too (MLP, transformer encoder,
  BERT, GPT-2, Llama): each allocated peak within 5 % of the H100's, the
  median within 2 %, the reserved median within 5 % (issue 24's targets);
- where cuDNN's kernels run instead (LSTM, convolutions), which the estimate
  does not model: the estimate says so, and the figures its note quotes are
  the measured ones.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from _benchmarks import benchmark
from _zoo import need
from nbmem.estimation.estimate import estimate
from nbmem.estimation.workspaces import CONV_NOTE, RNN_NOTE

ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = ROOT / "benchmarks" / "results" / "2026-11-25-gpu" / "campaign-run4-zoo.json"
MiB = 1 << 20
CUDNN = ("lstm", "cnn (conv+BN blocks)")


@pytest.fixture(scope="module")
def replayed() -> list[dict[str, Any]]:
    need("transformers", env="NBMEM_REQUIRE_ZOO")
    rows = json.loads(CAMPAIGN.read_text())["sections"]["zoo"]["rows"]
    with benchmark("gpu_campaign") as campaign:  # the zoo's plain models live in bench_accuracy, beside it
        zoo = campaign._zoo()
        out = []
        for row in rows:
            build, make = zoo[row["model"]]
            result = estimate(build, make, device="H100-80GB", batch_size=row["batch"], precision=row["precision"],
                              checkpointing=row["checkpointing"], optimizer=row["optimizer"])
            out.append({**row, "today": result.peak, "today_reserved": result.reserved, "notes": result.notes})
    return out


def _error(found: int, truth: int) -> float:
    return (found - truth) / truth


def test_the_campaign_covers_every_family_and_knob(replayed: list[dict[str, Any]]) -> None:
    assert len(replayed) == 31
    assert {row["model"] for row in replayed} == {
        "mlp (residual blocks)", "transformer encoder", "bert (4 layers, 256)", "gpt2 (6 layers, 512)",
        "llama (4 layers, 512)", *CUDNN}
    assert {(row["precision"], row["checkpointing"], row["optimizer"]) for row in replayed} >= {
        ("fp32", False, "adamw"), ("bf16", True, "sgd-momentum")}


def test_where_pytorchs_kernels_run_estimates_meet_issue_24s_targets(replayed: list[dict[str, Any]]) -> None:
    plain = [row for row in replayed if row["model"] not in CUDNN]
    assert len(plain) == 21
    allocated = {(row["model"], row["precision"], row["checkpointing"], row["optimizer"]):
                 round(_error(row["today"], row["measured"]), 4) for row in plain}
    assert max(map(abs, allocated.values())) <= 0.05, allocated
    assert statistics.median(map(abs, allocated.values())) <= 0.02, allocated
    reserved = [abs(_error(row["today_reserved"], row["measured_reserved"])) for row in plain]
    assert statistics.median(reserved) <= 0.05
    assert not any(note in (RNN_NOTE, CONV_NOTE) for row in plain for note in row["notes"])


def test_counting_blocks_and_one_byte_dropout_masks_as_the_gpu_does_brings_all_21_within_1_percent(
        replayed: list[dict[str, Any]]) -> None:
    """Each tensor counted as the block the simulated allocator gives it (CUDA counts blocks: a block at most
    1 MiB larger than asked is not split) and dropout's mask one byte an element, as CUDA's fused kernel keeps
    it: the 21 steps went from a median of 0.57 % and a worst of 2.2 % to these (2026-11-26)."""
    plain = [row for row in replayed if row["model"] not in CUDNN]
    errors = {(row["model"], row["precision"], row["checkpointing"], row["optimizer"]):
              round(_error(row["today"], row["measured"]), 4) for row in plain}
    assert max(map(abs, errors.values())) <= 0.01, errors
    assert statistics.median(map(abs, errors.values())) <= 0.005, errors
    assert sum(row["today"] == row["measured"] for row in plain) >= 6, errors  # the MLP's and encoder's, at least
    reserved = [abs(_error(row["today_reserved"], row["measured_reserved"])) for row in plain]
    assert statistics.median(reserved) <= 0.01


def test_cuda_reductions_staging_buffers_bring_berts_reserved_to_the_h100s(replayed: list[dict[str, Any]]) -> None:
    """A bias's gradient on CUDA is a reduction split across thread blocks, which takes a staging buffer
    (nbmem/estimation/cuda_reductions.py): BERT's bf16 AdamW step reserved 20 MiB (7.5 %) less than the H100's
    before, as its 8 MiB ones made the allocator reserve one more segment; now the H100's to the byte. Of the 21
    steps where PyTorch's kernels run, one reserved figure is left more than 3 % off: a GPT-2 step's, 7.5 % low,
    which the same step's allocator history (misses.json, another process) reserved as the estimate does."""
    plain = [row for row in replayed if row["model"] not in CUDNN]
    reserved = {(row["model"], row["precision"], row["checkpointing"], row["optimizer"]):
                round(_error(row["today_reserved"], row["measured_reserved"]), 4) for row in plain}
    assert reserved["bert (4 layers, 256)", "bf16", False, "adamw"] == 0
    assert {key: error for key, error in reserved.items() if abs(error) > 0.03} == {
        ("gpt2 (6 layers, 512)", "bf16", True, "sgd-momentum"): -0.0755}
    history = json.loads((CAMPAIGN.parent.parent / "2026-11-27-gpu" / "misses.json").read_text())["items"]
    again = history["trace.gpt2 (6 layers, 512).bf16.True.sgd-momentum"]["value"]["reserved"]
    (gpt2,) = [row for row in plain if (row["model"], row["precision"], row["checkpointing"], row["optimizer"]) ==
               ("gpt2 (6 layers, 512)", "bf16", True, "sgd-momentum")]
    assert abs(gpt2["today_reserved"] - again) <= 512 and gpt2["measured_reserved"] - gpt2["today_reserved"] == 32 * MiB


def test_adamws_steps_on_plain_layers_are_the_h100s_to_the_byte(replayed: list[dict[str, Any]]) -> None:
    """The MLP's and the transformer encoder's AdamW steps: what the H100's allocator allocated, to the byte.

    Before AdamW's step counters were left on the host (CPU tensors on a GPU:
    nbmem.tracking.host_counters.HostStepCounters), these four estimates were
    8,192 B (the MLP's 16 parameter tensors) and 26,112 B (the encoder's 51)
    above the H100's; the SGD steps of the same models already matched."""
    exact = [row for row in replayed if row["optimizer"] == "adamw"
             and row["model"] in ("mlp (residual blocks)", "transformer encoder")]
    assert len(exact) == 4
    assert [row["today"] - row["measured"] for row in exact] == [0, 0, 0, 0]
    assert {row["estimated"] - row["measured"] for row in exact} == {8192, 26112}  # the campaign's own estimates


def test_the_encoders_fp32_attention_is_laid_out_as_the_h100s(replayed: list[dict[str, Any]]) -> None:
    """The transformer encoder's fp32 checkpointed step was 512 KiB (0.96 %) and 2 MiB (2.9 %) reserved below the
    H100's: CUDA's memory-efficient attention writes its output sequence-major, so nn.MultiheadAttention's
    ``permute(2, 0, 1, 3).contiguous()`` copies it (and the output projection keeps the copy), where the CPU's
    kernel wrote it as the query was and the permute was a view; and its backward takes a copy of the output's
    gradient, a row statistic and its workspace in an order of its own (nbmem.estimation.attention, 2026-11-27).
    Both figures are the H100's now, to the byte; GPT-2's fp32 steps (sequence-major already) moved by the backward
    only: SGD's allocated -0.30 % to the byte, AdamW's reserved +2.6 % to the byte and its allocated 0 to -0.40 %."""
    fp32 = {(row["model"], row["checkpointing"], row["optimizer"]): row for row in replayed
            if row["precision"] == "fp32" and row["model"] in ("transformer encoder", "gpt2 (6 layers, 512)")}
    encoder = fp32["transformer encoder", True, "sgd-momentum"]
    assert (encoder["today"], encoder["today_reserved"]) == (encoder["measured"], encoder["measured_reserved"])
    assert encoder["measured"] - encoder["estimated"] == 512 * 1024  # the campaign's own estimate: the copy short
    sgd, adamw = fp32["gpt2 (6 layers, 512)", False, "sgd-momentum"], fp32["gpt2 (6 layers, 512)", False, "adamw"]
    assert sgd["today"] == sgd["measured"] and adamw["today_reserved"] == adamw["measured_reserved"]
    assert round(_error(adamw["today"], adamw["measured"]), 4) == -0.004


def test_cudnns_attention_keeps_its_seed_and_offset_as_the_h100s(replayed: list[dict[str, Any]]) -> None:
    """cuDNN's attention (bf16 on an H100) keeps a random-number seed and offset on the GPU for backward (8 bytes
    each, a 512-byte block each), takes a 256-byte workspace in forward and its backward workspace after the
    gradients (nbmem.estimation.attention, 2026-11-27, as the H100's 24 cuDNN calls measured): the encoder's two bf16
    SGD steps, 4,096 B and 1,024 B low, are the H100's to the byte; 12 of the 21 steps where PyTorch's kernels run
    are now, the median error 0."""
    plain = [row for row in replayed if row["model"] not in CUDNN]
    encoder = {row["checkpointing"]: row for row in plain if row["model"] == "transformer encoder"
               and row["precision"] == "bf16" and row["optimizer"] == "sgd-momentum"}
    assert [encoder[ckpt]["today"] - encoder[ckpt]["measured"] for ckpt in (False, True)] == [0, 0]
    assert sum(row["today"] == row["measured"] for row in plain) == 12
    assert statistics.median(abs(_error(row["today"], row["measured"])) for row in plain) == 0


def test_where_cudnn_runs_the_estimate_says_so_with_the_measured_gap(replayed: list[dict[str, Any]]) -> None:
    lstm = [row for row in replayed if row["model"] == "lstm"]
    cnn = [row for row in replayed if row["model"] == CUDNN[1]]
    assert len(lstm) == 7 and len(cnn) == 3
    # an LSTM's estimate follows cuDNN's RNN kernel (nbmem/estimation/cudnn_rnn.py, 2026-11-27): within 2.5 % of
    # the H100's peaks, where PyTorch's kernels (the campaign's estimates) were 51-60 % below
    assert all(RNN_NOTE not in row["notes"] and CONV_NOTE not in row["notes"] for row in lstm)
    assert all(any(note.startswith("cuDNN: 1 LSTM/GRU call per step (recomputed") for note in row["notes"])
               for row in lstm)
    errors = [_error(row["today"], row["measured"]) for row in lstm]
    assert -0.005 <= min(errors) and max(errors) <= 0.025, errors
    # reserved the H100's to the byte since the weights lie in one flat buffer, as CUDA puts them (CudnnRNN.flatten:
    # the reserve fits in the rest of its segment); separate weights made 2-4 MiB (4.2-8.3 %) more
    assert [row["today_reserved"] - row["measured_reserved"] for row in lstm] == [0] * 7
    # a CNN's estimate takes cuDNN's convolution workspaces (nbmem/estimation/cudnn_conv.py, 2026-11-27): its bf16
    # steps within 1.5 % of the H100's, where they were 1.2-1.7 % low, its fp32 one 11.5 % low, where it was 15.3 %;
    # reserved equal to the H100's in all three, where the bf16 steps' were 20 MiB (62-67 %) low
    assert all(CONV_NOTE not in row["notes"] and RNN_NOTE not in row["notes"] for row in cnn)
    # 4 convolutions, and with checkpointing the 3 blocks' again
    assert sorted(next(note.split(" convolution calls")[0] for note in row["notes"] if " convolution calls per step (" in note)
                  for row in cnn) == ["cuDNN: 4", "cuDNN: 7", "cuDNN: 7"]
    assert sorted(round(_error(row["today"], row["measured"]), 3) for row in cnn) == [-0.115, 0.01, 0.013]
    assert [row["today_reserved"] - row["measured_reserved"] for row in cnn] == [0, 0, 0]
    # the figures RNN_NOTE quotes (for PyTorch's kernels: a tracked run, or an RNN cuDNN's model leaves out) are the
    # campaign's estimates beside the H100's: 17-21 MiB (51-60 %) allocated and 32-34 MiB reserved more
    more = [(row["measured"] - row["estimated"]) / MiB for row in lstm]
    assert 17 <= min(more) and max(more) < 21, more
    share = [1 - row["estimated"] / row["measured"] for row in lstm]
    assert 0.51 <= min(share) and max(share) < 0.61, share
    assert {(row["measured_reserved"] - row["estimated_reserved"]) // MiB for row in lstm} == {32, 34}
    # the figures CONV_NOTE quotes (for PyTorch's kernels) are the campaign's estimates beside the H100's: a CNN's
    # fp32 steps allocated 2.8 MiB more (12-16 %: this run's one, 15 %, and the quick run's four,
    # results/2026-11-25-gpu/campaign-run3-quick.json, 12.5-15.7 %); its bf16 steps reserved 20 MiB more
    (fp32,) = [row for row in cnn if row["precision"] == "fp32"]
    assert round((fp32["measured"] - fp32["estimated"]) / MiB, 1) == 2.8
    assert round(1 - fp32["estimated"] / fp32["measured"], 2) == 0.15
    quick = json.loads((CAMPAIGN.parent / "campaign-run3-quick.json").read_text())["sections"]["zoo"]["rows"]
    quick_fp32 = [row for row in quick if row["model"] == CUDNN[1] and row["precision"] == "fp32"]
    assert len(quick_fp32) == 4
    assert {round((row["measured"] - row["estimated"]) / MiB, 1) for row in quick_fp32} == {2.8}
    assert 0.12 <= min(1 - row["estimated"] / row["measured"] for row in quick_fp32)
    assert max(1 - row["estimated"] / row["measured"] for row in quick_fp32) < 0.16
    assert {(row["measured_reserved"] - row["estimated_reserved"]) // MiB for row in cnn if row["precision"] == "bf16"} == {20}


def test_compile_estimates_meet_what_the_h100_measured_of_the_same_compiled_steps() -> None:
    """compile=True plans with inductor's CPU code; the H100 ran Triton's. The same steps, estimated here
    (benchmarks/bench_compiled_replay.py), against the allocator's peaks there (probes-run5-nbmem-compiled.json)."""
    need("transformers", env="NBMEM_REQUIRE_ZOO")
    with benchmark("bench_compiled_replay") as replay:
        truth = replay.measured()
        assert truth == {"cnn": {"compiled": 945_219_584, "eager": 1_476_410_880},
                         "gpt": {"compiled": 457_035_776, "eager": 722_881_536}}
        cnn_compiled, gpt_compiled = replay.estimated("cnn", True), replay.estimated("gpt", True)
        cnn_eager = replay.estimated("cnn", False)
    # within 0.5 % of Triton's compiled step (the plan: 944,238,592 B and 454,946,816 B)
    assert abs(_error(cnn_compiled, truth["cnn"]["compiled"])) < 0.005
    assert abs(_error(gpt_compiled, truth["gpt"]["compiled"])) < 0.005
    # the CNN's eager step, to the byte (measured with the tracker alongside, so eagerly)
    assert cnn_eager == truth["cnn"]["eager"]


def test_where_an_estimate_differs_from_its_steps_allocator_history_the_h100_chose_other_equal_blocks(
        replayed: list[dict[str, Any]]) -> None:
    """misses.json holds the H100's allocator history of 6 of these steps (recorded in another process than the
    campaign's). Replayed through nbmem's allocator simulation with segments ordered as they were made (as an
    estimate orders them: it can't know the addresses), each history's events give the estimate's peak to the byte
    (benchmarks/bench_history_replay.py: at their peaks the same allocations, size for size). Against the history's own max_memory_allocated, 3 differ (bf16 Llama
    -0.28 %, GPT-2's checkpointed steps +0.56 % and +1.35 %): of equal free blocks CUDA hands out the lowest
    address, and cudaMalloc's addresses are not in the order the segments were made (the process had freed others
    before); at the H100's own addresses the replay gives its figure (test_snapshot)."""
    from nbmem.core.allocator import CachingAllocatorSimulation

    histories = json.loads((CAMPAIGN.parent.parent / "2026-11-27-gpu" / "misses.json").read_text())["items"]
    today = {(row["model"], row["precision"], str(row["checkpointing"]), row["optimizer"]): row["today"]
             for row in replayed}
    apart = {}
    for key, item in histories.items():
        if not key.startswith("trace."):
            continue
        model, precision, checkpointing, optimizer = key.removeprefix("trace.").rsplit(".", 3)
        if model in CUDNN:
            continue
        simulation = CachingAllocatorSimulation()
        for action, address, size, *_ in item["value"]["events"]:
            if action == "alloc":
                simulation.malloc(address, size)
            elif action == "free_completed":
                simulation.free(address)
        assert today[model, precision, checkpointing, optimizer] == simulation.peak_allocated, key
        apart[model, precision, checkpointing] = round(_error(simulation.peak_allocated,
                                                              item["value"]["max_memory_allocated"]), 4)
    assert len(apart) == 6
    assert {key: error for key, error in apart.items() if error} == {
        ("llama (4 layers, 512)", "bf16", "False"): -0.0028, ("gpt2 (6 layers, 512)", "bf16", "True"): 0.0056,
        ("gpt2 (6 layers, 512)", "fp32", "True"): 0.0135}
