"""cuDNN's LSTM/GRU memory in estimates (nbmem/estimation/cudnn_rnn.py) against an H100's allocations (2026-11-27).

The H100's figures are the raw files under benchmarks/results/2026-11-27-gpu/: every allocation of 72 training steps
(``misses-first.json``, section rnn) and the reserve and workspace of 1,751 more (``rnn_sizes.json``).
"""

from __future__ import annotations

import ast
import contextlib
import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from nbmem.estimation.cuda_reductions import CudaReductions
from nbmem.estimation.cudnn_rnn import CudnnRNN, dropout_state_bytes, reserve_bytes, workspace
from nbmem.estimation.estimate import estimate
from nbmem.estimation.workspaces import RNN_NOTE

from _allocations import Allocations
from _benchmarks import benchmark

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-27-gpu"
with benchmark("fit_cudnn_rnn") as _fit:
    traced_workspace, fit_usable = _fit.traced_workspace, _fit.usable
TRACED = json.loads((RESULTS / "misses-first.json").read_text())["items"]["rnn"]["value"]["rows"]


def probe_step(row: dict, warm: bool = True) -> tuple[list[int], list[int]]:
    """gpu_probes_misses.probe_rnn's step on fake tensors with cuDNN's RNN and CUDA's reductions modelled: forward's
    and backward's bytes (after a first step, as the probe measured: cuDNN's dropout state is made once, by the
    first)."""
    with FakeTensorMode(), CudnnRNN() as rnn, CudaReductions():
        model = getattr(nn, row["kind"])(row.get("inputs", row["hidden"]), row["hidden"], num_layers=row["layers"],
                                         batch_first=True, dropout=row.get("dropout", 0.0),
                                         bidirectional=row.get("bidirectional", False),
                                         **({"proj_size": row["proj"]} if row.get("proj") else {}))
        x = torch.randn(row["batch"], row["steps"], row.get("inputs", row["hidden"]))

        def loss() -> torch.Tensor:
            with torch.autocast("cpu", torch.bfloat16, enabled=row["precision"] == "bf16"):
                return model(x)[0].float().pow(2).mean()
        if warm:
            loss().backward()
        with Allocations() as forward:
            value = loss()
        with Allocations() as backward:
            value.backward()
    assert rnn.calls == 1 + warm and not rnn.unmodelled
    return forward.sizes, backward.sizes


def compare(row: dict, forward: list[int], backward: list[int]) -> None:
    """The step's allocations are the H100's, byte for byte, but for the workspace (the fitted model's)."""
    itemsize = 4 if row["precision"] == "fp32" else 2
    # the probe's "bf16" steps ran under bf16 autocast, which runs cuDNN's RNN in fp16 (and the model does too)
    ours = workspace(row["kind"].lower(), row["layers"], row["steps"], row["batch"], row["hidden"], itemsize,
                     row.get("inputs", row["hidden"]), "fp32" if itemsize == 4 else "fp16",
                     directions=2 if row.get("bidirectional") else 1, proj=row.get("proj") or 0)
    theirs = traced_workspace(row["forward"], row["backward"], row["ops"][0][1][0])  # the H100's, as the fit reads it
    assert theirs is not None

    def kept(sizes: list[int]) -> list[int]:
        return sorted(ours if size == theirs else size for size in sizes)

    # the probe's loss (.float().pow(2).mean()) allocates as on the GPU (its reduction's staging buffer and
    # semaphores too), so every other byte compares
    assert kept(forward) == kept([size for size, _ in row["forward"]])
    assert sorted(backward) == sorted(ours if size == theirs else size for size, _ in row["backward"])


@pytest.mark.parametrize("row", TRACED[::3], ids=lambda r: f"{r['kind']}-{r['hidden']}x{r['layers']}-b{r['batch']}"
                                                              f"-t{r['steps']}-{r['precision']}")
def test_a_step_allocates_what_the_h100_allocated_workspace_aside(row: dict) -> None:
    forward, backward = probe_step(row)
    compare(row, forward, backward)
    itemsize = 4 if row["precision"] == "fp32" else 2
    assert reserve_bytes(row["kind"].lower(), row["layers"], row["steps"], row["batch"], row["hidden"],
                         itemsize) in forward


VARIANTS = json.loads((RESULTS / "rnn_variants.json").read_text())["rows"]


@pytest.mark.parametrize("row", [row for row in VARIANTS if not row["proj"]][::16],
                         ids=lambda r: f"{r['kind']}-{r['hidden']}x{r['layers']}-p{r['dropout']}-bi{r['bidirectional']}"
                                       f"-{r['precision']}")
def test_bidirectional_layers_and_dropout_between_layers_allocate_what_the_h100_allocated(row: dict) -> None:
    compare(row, *probe_step(row))


@pytest.mark.parametrize("row", [row for row in VARIANTS if row["proj"]][::4],
                         ids=lambda r: f"{r['kind']}-{r['hidden']}p{r['proj']}x{r['layers']}-b{r['batch']}"
                                       f"-t{r['steps']}-i{r['inputs']}-{r['precision']}")
def test_lstm_projections_allocate_what_the_h100_allocated(row: dict) -> None:
    """The output and last states in the projection's width, the cell in the hidden size, the projection's weights
    in the flat buffers and gradient, the reserve by its own rule; the workspace by its own fit."""
    compare(row, *probe_step(row))


def test_the_first_step_with_dropout_makes_cudnns_dropout_state_once() -> None:
    (first,) = [row for row in VARIANTS if "first" in row]
    forward, _ = probe_step(first, warm=False)
    assert dropout_state_bytes(None) == 6_488_064 == first["first"]["forward"][2][0]  # kept: not freed
    assert first["first"]["forward"][2][1] is False and forward.count(6_488_064) == 1
    # the later steps take none: compare() holds them to the H100's, which made none either
    assert all(6_488_064 not in (size for size, _ in row["forward"]) for row in VARIANTS if row["dropout"])


def test_only_a_one_layer_fp16_lstm_with_sizes_of_128_runs_the_persistent_kernel() -> None:
    """PyTorch's get_algo: cuDNN's persistent kernel for fp16 (not bf16), one direction and layer, hidden 256 to 1024
    (128 and below run the small-hidden kernel first) and input multiples of 128, batch a multiple of 8 up to 128
    on an H100; never for a GRU there; never on an RTX 3090 (sm_86)."""
    from nbmem.estimation.cudnn_rnn import persistent

    def runs(kind: str = "lstm", layers: int = 1, hidden: int = 512, inputs: int = 512, batch: int = 64,
             precision: str = "fp16", directions: int = 1, device: str | None = "H100-80GB") -> bool:
        return persistent(kind, layers, hidden, inputs, batch, 200, precision, directions, device)

    assert runs() and runs(device=None) and runs(hidden=256) and runs(hidden=1024, inputs=128, batch=128)
    assert not any([runs(kind="gru"), runs(layers=2), runs(hidden=128), runs(hidden=2048), runs(hidden=384 + 64),
                    runs(inputs=300), runs(batch=12), runs(batch=256), runs(precision="bf16"),
                    runs(precision="fp32"), runs(directions=2), runs(device="RTX-3090")])
    # both directions take twice one direction's standard workspace, not the persistent kernel's
    both = workspace("lstm", 1, 200, 64, 512, 2, 512, "fp16", "H100-80GB", directions=2)
    assert both == workspace("lstm", 1, 200, 64, 512, 2, 512, "fp16", "RTX-3090", directions=2)
    assert abs(both - 2 * workspace("lstm", 1, 200, 64, 512, 2, 512, "fp16", "RTX-3090")) <= 512  # rounded once
    assert both != 2 * workspace("lstm", 1, 200, 64, 512, 2, 512, "fp16", "H100-80GB")


def test_the_reserve_rule_holds_for_every_step_measured() -> None:
    rows = json.loads((RESULTS / "rnn_sizes.json").read_text())["rows"]
    # the sweep's "fp16" steps ran without autocast (benchmarks/fit_cudnn_rnn.py): fp32's 4 bytes an element
    found = [(reserve_bytes(r["kind"].lower(), r["layers"], r["steps"], r["batch"], r["hidden"],
                            2 if r["precision"] == "bf16" else 4), r["reserve"]) for r in rows]
    found += [(reserve_bytes(r["kind"].lower(), r["layers"], r["steps"], r["batch"], r["hidden"],
                             4 if r["precision"] == "fp32" else 2), r["ops"][0][1][3]) for r in TRACED]
    found += [(reserve_bytes(r["kind"].lower(), r["layers"], r["steps"], r["batch"], r["hidden"],
                             4 if r["precision"] == "fp32" else 2, 2 if r["bidirectional"] else 1, r["dropout"] > 0),
               r["reserve"]) for r in VARIANTS if not r["proj"]]
    found += [(reserve_bytes("lstm", r["layers"], r["steps"], r["batch"], r["hidden"],
                             4 if r["precision"] == "fp32" else 2, proj=r["proj"]), r["reserve"])
              for r in VARIANTS if r["proj"]]
    assert len(found) == 2207 + 64 and all(ours == theirs for ours, theirs in found)


def test_the_workspace_model_stays_near_the_h100s_sizes() -> None:
    rows = json.loads((RESULTS / "rnn_sizes.json").read_text())["rows"]
    usable = [r for r in rows if fit_usable(r)]
    # the sweep's "bf16" ran under bf16 autocast (cuDNN in fp16), its "fp16" without autocast (fp32)
    errors = sorted(workspace(r["kind"].lower(), r["layers"], r["steps"], r["batch"], r["hidden"],
                              2 if r["precision"] == "bf16" else 4, r["inputs"],
                              "fp16" if r["precision"] == "bf16" else "fp32") / r["workspace"] - 1 for r in usable)
    assert len(errors) == 1598
    assert abs(errors[len(errors) // 2]) < 0.005  # the median
    assert -0.09 < errors[len(errors) // 20] and errors[-len(errors) // 20] < 0.07  # 90 % of them
    assert -0.36 < errors[0] and errors[-1] < 0.21
    # LSTMs with projections, their own fit (64 steps, hidden 128 and 512, projection 64)
    errors = sorted(workspace("lstm", r["layers"], r["steps"], r["batch"], r["hidden"], 4 if r["precision"] == "fp32"
                              else 2, r["inputs"], "fp32" if r["precision"] == "fp32" else "fp16", proj=r["proj"])
                    / r["workspace"] - 1 for r in VARIANTS if r["proj"])
    assert len(errors) == 64 and -0.031 < errors[0] and errors[-1] < 0.029


def test_an_lstm_with_projections_is_modelled_in_an_estimate() -> None:
    """Its output in the projection's width (the head takes 32 features): an estimate that runs cuDNN's kernel."""
    projected = estimate(lambda: Sequence(proj_size=32), batch, batch_size=8, optimizer="sgd", device="H100-80GB")
    assert RNN_NOTE not in projected.notes and not any("not modelled" in note for note in projected.notes)
    assert any(note.startswith("cuDNN: 1 LSTM/GRU call per step") for note in projected.notes)
    plain = estimate(lambda: Sequence(proj_size=32), batch, batch_size=8, optimizer="sgd", device="Mac-16GB")
    # what cuDNN's reserve (a 2-layer LSTM, 8 x 32 x (2 x (7 x 256 + 32) - 256) x 4 bytes: 3,473,408 B) and workspace
    # add over PyTorch's kernels: more than 15 MiB, as for the LSTM without projections
    assert reserve_bytes("lstm", 2, 32, 8, 256, 4, proj=32) == 3_473_408 + 256
    assert projected.peak - plain.peak > 15 * 2**20


class Sequence(nn.Module):
    def __init__(self, **rnn: object) -> None:
        super().__init__()
        self.rnn = nn.LSTM(64, 256, num_layers=2, batch_first=True, **rnn)  # type: ignore[arg-type]
        width = int(rnn.get("proj_size") or 256)  # type: ignore[call-overload]
        self.head = nn.Linear(width * (2 if rnn.get("bidirectional") else 1), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 32, 64), torch.randint(0, 10, (n,))


def test_an_estimate_follows_cudnn_on_an_nvidia_gpu_and_says_so() -> None:
    on_h100 = estimate(Sequence, batch, batch_size=8, optimizer="sgd", device="H100-80GB")
    # the campaign's LSTM (benchmarks/bench_accuracy.py); its H100 figures are checked in test_h100_figures
    assert any(note.startswith("cuDNN: 1 LSTM/GRU call per step (recomputed") for note in on_h100.notes)
    assert RNN_NOTE not in on_h100.notes
    assert "kernel workspaces other than cuBLAS's and cuDNN's RNN (noted above) are not included" in str(on_h100)
    on_mac = estimate(Sequence, batch, batch_size=8, optimizer="sgd", device="Mac-16GB")
    assert not any(note.startswith("cuDNN") for note in on_mac.notes)
    # what cuDNN's reserve and workspace add over PyTorch's CPU kernels, for this LSTM: more than 15 MiB
    assert on_h100.peak - on_mac.peak > 15 * 2**20


def test_what_is_not_modelled_runs_pytorchs_kernels_and_keeps_the_note() -> None:
    projected = estimate(lambda: Sequence(proj_size=32, bidirectional=True), batch, batch_size=8, optimizer="sgd")
    assert RNN_NOTE in projected.notes
    assert ("cuDNN: not modelled for LSTM projections (proj_size) with both directions or dropout between layers: "
            "PyTorch's CPU RNN kernel ran there") in projected.notes

    class Mixed(nn.Module):  # a modelled LSTM beside a plain RNN, whose cuDNN kernel is not modelled
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.rnn = nn.LSTM(64, 32, batch_first=True), nn.RNN(32, 10, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(self.lstm(x)[0])[0][:, -1]

    mixed = estimate(Mixed, batch, batch_size=8, optimizer="sgd")
    assert RNN_NOTE in mixed.notes and any(note.startswith("cuDNN: 1 LSTM/GRU call per step") for note in mixed.notes)


def test_dropout_between_layers_and_both_directions_are_modelled() -> None:
    both = estimate(lambda: Sequence(bidirectional=True, dropout=0.1), batch, batch_size=8, optimizer="sgd",
                    device="T4")
    assert RNN_NOTE not in both.notes and not any("not modelled" in note for note in both.notes)
    # the dropout state: 40 SMs x 1,024 resident threads x 24 B on a T4 (scaled from the H100's; unmeasured there)
    assert "cuDNN: dropout between recurrent layers keeps a dropout state, 960 KiB made once" in "".join(both.notes)
    plain = estimate(lambda: Sequence(bidirectional=True), batch, batch_size=8, optimizer="sgd", device="T4")
    # the state, and the reserve's bit mask of the inner layer's output: 4 bits an element both ways (8 x 32 x 256)
    assert both.peak - plain.peak == 983040 + 4 * 8 * 32 * 256 // 8


def test_real_tensors_and_evaluation_keep_pytorchs_kernels() -> None:
    lstm = nn.LSTM(8, 16, batch_first=True)
    with CudnnRNN() as rnn:
        out, _ = lstm(torch.randn(2, 5, 8))  # a tracked run's real tensors: values, from PyTorch's kernel
        assert out.grad_fn is not None and "CudnnRNN" not in out.grad_fn.name()
        with FakeTensorMode():
            fake = nn.LSTM(8, 16).eval()
            out, _ = fake(torch.randn(5, 2, 8))
    assert rnn.calls == 0 and list(rnn.unmodelled) == ["evaluation mode (cuDNN's inference kernel)"]  # fake only
    expected = torch.nn.LSTM(8, 16, batch_first=True)  # and nothing is left registered
    expected.load_state_dict(lstm.state_dict())
    x = torch.randn(2, 5, 8)
    assert torch.equal(expected(x)[0], lstm(x)[0])


def _logged() -> dict[str, tuple[list[int], list[int]]]:
    """gpu_probe_rnn_autocast.py's H100 log: each case's forward allocations and backward allocations."""
    found = {}
    for line in (RESULTS / "rnn_autocast.log").read_text().splitlines():
        if " F [" in line:
            forward = ast.literal_eval(line[line.index(" F [") + 3:line.index("] B [") + 1])
            found[line.split()[0]] = ([size for size, action in forward if action == "a"],
                                      ast.literal_eval(line[line.index(" B [") + 3:]))
    return found


LOGGED = _logged()
#: case -> (the LSTM's options, autocast's dtype, the input's dtype); LSTM(64, 128, batch_first=True), input 8 x 32
CASES = {"bf16ac": ({}, torch.bfloat16, torch.float32), "fp16ac": ({}, torch.float16, torch.float32),
         "nobias": ({"bias": False}, None, torch.float32), "drop1": ({"dropout": 0.5}, None, torch.float32),
         "lin_bf16": ({}, torch.bfloat16, torch.float32), "bf16w": ({"dtype": torch.bfloat16}, None, torch.bfloat16)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_autocast_no_biases_one_layers_dropout_and_bf16_weights_allocate_what_the_h100_allocated(case: str) -> None:
    """Under autocast cuDNN's RNN runs in fp16 whatever autocast's dtype (the H100's output was fp16 under bf16),
    the weights cast into one flat buffer with room for biases; without biases each weight's gradient is copied out
    of the flat one; a one-layer LSTM with dropout still makes the dropout state; bf16 weights are copied into a flat
    buffer at every call. Every allocation is the H100's, but for the workspace (the fitted model's)."""
    from nbmem.estimation.autocast_policy import CudaAutocastPolicy

    options, autocast, dtype = CASES[case]
    with FakeTensorMode(), CudaAutocastPolicy() as policy, CudnnRNN() as rnn:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch's warning for dropout with one layer, which the case is
            lstm = nn.LSTM(64, 128, batch_first=True, **options)  # type: ignore[arg-type]
        model = nn.Sequential(nn.Linear(64, 64), lstm) if case == "lin_bf16" else lstm
        x = torch.randn(8, 32, 64, dtype=dtype)
        with policy.region("cpu", autocast) if autocast else contextlib.nullcontext(), Allocations() as forward:
            output = model(x)[0]
        with Allocations() as backward:
            output.float().sum().backward()
    assert output.dtype == (torch.float16 if autocast else dtype)
    assert rnn.calls == 1 and not rnn.unmodelled
    precision = "fp32" if output.dtype == torch.float32 else "fp16"
    ours = workspace("lstm", 1, 32, 8, 128, output.dtype.itemsize, 64, precision)
    h100_forward, h100_backward = LOGGED[case]
    theirs = max(Counter(h100_backward).items(), key=lambda item: (item[1] >= 2, item[0]))[0]
    # CUDA's own small buffers (8 B: dropout's seed), and cuBLAS's workspaces, which the process's first matmul made
    # (nbmem counts those in its workspaces' simulation)
    skipped = {8, 1048576, 33554432}

    def kept(sizes: list[int]) -> list[int]:
        return sorted(ours if size == theirs else size for size in sizes if size not in skipped)

    assert kept(forward.sizes) == kept(h100_forward)
    assert kept(backward.sizes) == kept(h100_backward)


def test_a_step_that_uses_only_the_last_state_makes_cudnns_zeros_for_the_output() -> None:
    """cuDNN's backward fills an undefined output gradient with zeros_like the (batch-first) output and copies them
    to its own layout: two output-sized buffers (here 8 x 32 x 128 fp32, 131,072 B), where autograd's own zeros
    would have been one, already in the kernel's layout."""
    with FakeTensorMode(), CudnnRNN():
        lstm = nn.LSTM(64, 128, batch_first=True)
        _, (last, _) = lstm(torch.randn(8, 32, 64))
        with Allocations() as backward:
            last.sum().backward()
    assert backward.sizes.count(8 * 32 * 128 * 4) == 2
    assert backward.sizes.count(8 * 32 * 64 * 4) == 3  # the input's gradient and its two copies in cuDNN's layout


def test_a_projected_lstm_never_takes_the_persistent_kernels_fit() -> None:
    """PyTorch's get_algo takes the standard algorithm for any projection: the projections' own fit, even where a
    plain LSTM of those sizes runs the persistent kernel."""
    from nbmem.estimation.cudnn_rnn import persistent

    assert persistent("lstm", 1, 512, 128, 32, 128, "fp16", 1, "H100-80GB")
    projected = workspace("lstm", 1, 128, 32, 512, 2, 128, "fp16", "H100-80GB", 1, proj=64)
    assert projected == workspace("lstm", 1, 128, 32, 512, 2, 128, "fp16", "RTX-3090", 1, proj=64)  # no persistence
    assert projected != workspace("lstm", 1, 128, 32, 512, 2, 128, "fp16", "H100-80GB", 1)


def test_an_estimate_puts_a_recurrent_layers_weights_into_one_buffer_as_cuda_does() -> None:
    """nn.RNNBase.flatten_parameters on CUDA: one buffer for the weights (an H100's LSTM(64, 256, 2 layers) took
    3,424,256 B, misses.json), their own storages freed; not for bf16 weights, which cuDNN does not take."""
    with FakeTensorMode():
        lstm, bare, half = nn.LSTM(64, 256, num_layers=2), nn.GRU(64, 256, bias=False), nn.LSTM(8, 8, dtype=torch.bfloat16)
        with Allocations() as made:
            assert CudnnRNN.flatten(nn.ModuleList([lstm, bare, half])) == 2
        # 4 x 256 x (64 + 256) + 2 x 4 x 256, then 4 x 256 x (256 + 256) + 2 x 4 x 256 elements, 4 bytes each; a GRU
        # without biases keeps room for them (2 x 3 x 256 elements), as cuDNN's buffers do
        assert made.sizes == [3_424_256, (3 * 256 * (64 + 256) + 2 * 3 * 256) * 4]
        assert len({weight.untyped_storage()._cdata for weight in lstm.parameters()}) == 1
        assert all(weight.is_leaf and weight.requires_grad for weight in lstm.parameters())
        assert lstm.weight_hh_l1.shape == (1024, 256) and lstm.weight_hh_l1.is_contiguous()
        assert len({weight.untyped_storage()._cdata for weight in half.parameters()}) == 4
    # the campaign's LSTM (fp32, AdamW): the reserve now fits in the rest of the flat buffer's 20 MiB segment, as on
    # the H100, whose reserved peak (campaign-run4-zoo.json: 54,525,952 B) it now equals; separate weights made 4 MiB more
    assert estimate(Sequence, batch, batch_size=8, optimizer="adamw", device="H100-80GB").reserved == 54_525_952


def test_an_inference_estimate_says_the_weights_lie_in_one_flat_buffer():
    """A bidirectional GRU's eight weights, 38,912 B rounded apart on the CPU, are one 38,400 B buffer on CUDA: the
    inference estimate is 512 B below the tracked run, and says why."""
    from torch import nn

    import nbmem

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru, self.head = nn.GRU(16, 32, batch_first=True, bidirectional=True), nn.Linear(64, 8)

        def forward(self, x):
            return self.head(self.gru(x)[0][:, -1])

    make = lambda n: (torch.randn(n, 12, 16), torch.randint(0, 8, (n,)))  # noqa: E731
    estimated = nbmem.estimate(Model, make, batch_size=2, task="inference")
    tracked = nbmem.estimate(Model, make, batch_size=2, task="inference", mode="tracked")
    # 2 directions x (3*32*16 + 3*32*32 + 2*3*32) floats = 9,600 x 4 B = 38,400 B in one buffer
    assert tracked.peak - estimated.peak == 512
    assert any("one flat buffer" in note for note in estimated.notes)
    assert not any("one flat buffer" in note for note in tracked.notes)
