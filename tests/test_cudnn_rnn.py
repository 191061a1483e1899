"""cuDNN's LSTM/GRU memory in estimates (nbmem/estimation/cudnn_rnn.py) against an H100's allocations (2026-11-27).

The H100's figures are the raw files under benchmarks/results/2026-11-27-gpu/: every allocation of 72 training steps
(``misses-first.json``, section rnn) and the reserve and workspace of 1,751 more (``rnn_sizes.json``).
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

from nbmem.estimation.cudnn_rnn import CudnnRNN, reserve_bytes, workspace
from nbmem.estimation.estimate import estimate
from nbmem.estimation.workspaces import RNN_NOTE

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-11-27-gpu"
TRACED = json.loads((RESULTS / "misses-first.json").read_text())["items"]["rnn"]["value"]["rows"]


class Allocations(TorchDispatchMode):
    """The bytes of each storage an op makes (views make none)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self._seen: set[int] = set()
        self._kept: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self._seen:
                    storage = tensor.untyped_storage()
                    self._seen.add(storage._cdata)
                    self._kept.append(storage)
                    self.sizes.append(storage.nbytes())
        return out


def probe_step(row: dict) -> tuple[list[int], list[int]]:
    """gpu_probes_misses.probe_rnn's step on fake tensors with cuDNN's RNN modelled: forward's and backward's bytes."""
    with FakeTensorMode(), CudnnRNN() as rnn:
        model = getattr(nn, row["kind"])(row["hidden"], row["hidden"], num_layers=row["layers"], batch_first=True)
        x = torch.randn(row["batch"], row["steps"], row["hidden"])
        with torch.autocast("cpu", torch.bfloat16, enabled=row["precision"] == "bf16"), Allocations() as forward:
            loss = model(x)[0].float().pow(2).mean()
        with Allocations() as backward:
            loss.backward()
    assert rnn.calls == 1 and not rnn.unmodelled
    return forward.sizes, backward.sizes


@pytest.mark.parametrize("row", TRACED[::3], ids=lambda r: f"{r['kind']}-{r['hidden']}x{r['layers']}-b{r['batch']}"
                                                              f"-t{r['steps']}-{r['precision']}")
def test_a_step_allocates_what_the_h100_allocated_workspace_aside(row: dict) -> None:
    itemsize = 4 if row["precision"] == "fp32" else 2
    args = (row["kind"].lower(), row["layers"], row["steps"], row["batch"], row["hidden"], itemsize)
    forward, backward = probe_step(row)
    ours = workspace(*args)
    # the H100's workspace: the largest size forward freed that backward took twice (as gpu_probe_rnn_sizes.py)
    output = row["ops"][0][1][0]
    twice = Counter(size for size, _ in row["backward"])
    theirs = max(size for size, freed in row["forward"] if freed and twice[size] >= 2 and size not in (output, 2 * output))

    def kept(sizes: list[int]) -> list[int]:
        # the step up to its loss (the 4-byte mean): CUDA's reduction then takes small buffers of its own
        return sorted(ours if size == theirs else size for size in sizes[:sizes.index(4) + 1])

    # the probe's loss (.float().pow(2).mean()) allocates as on the GPU, so every other byte compares
    assert kept(forward) == kept([size for size, _ in row["forward"]])
    assert sorted(backward) == sorted(ours if size == theirs else size for size, _ in row["backward"])
    assert reserve_bytes(*args) in forward


def test_the_reserve_rule_holds_for_every_step_measured() -> None:
    rows = json.loads((RESULTS / "rnn_sizes.json").read_text())["rows"]
    # the sweep's "fp16" steps ran without autocast (benchmarks/fit_cudnn_rnn.py): fp32's 4 bytes an element
    found = [(reserve_bytes(r["kind"].lower(), r["layers"], r["steps"], r["batch"], r["hidden"],
                            2 if r["precision"] == "bf16" else 4), r["reserve"]) for r in rows]
    found += [(reserve_bytes(r["kind"].lower(), r["layers"], r["steps"], r["batch"], r["hidden"],
                             4 if r["precision"] == "fp32" else 2), r["ops"][0][1][3]) for r in TRACED]
    assert len(found) == 1823 and all(ours == theirs for ours, theirs in found)


def test_the_workspace_model_stays_near_the_h100s_sizes() -> None:
    rows = json.loads((RESULTS / "rnn_sizes.json").read_text())["rows"]
    usable = [r for r in rows if r["workspace"] > 32 * r["layers"] * r["batch"] * r["hidden"] and r["hidden"] != 192]
    errors = sorted(workspace(r["kind"].lower(), r["layers"], r["steps"], r["batch"], r["hidden"],
                              2 if r["precision"] == "bf16" else 4, r["inputs"],
                              "bf16" if r["precision"] == "bf16" else "fp32") / r["workspace"] - 1 for r in usable)
    assert len(errors) == 1598
    assert abs(errors[len(errors) // 2]) < 0.005  # the median
    assert -0.09 < errors[len(errors) // 20] and errors[-len(errors) // 20] < 0.07  # 90 % of them


class Sequence(nn.Module):
    def __init__(self, **rnn: object) -> None:
        super().__init__()
        self.rnn = nn.LSTM(64, 256, num_layers=2, batch_first=True, **rnn)  # type: ignore[arg-type]
        self.head = nn.Linear(256 * (2 if rnn.get("bidirectional") else 1), 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 32, 64), torch.randint(0, 10, (n,))


def test_an_estimate_follows_cudnn_on_an_nvidia_gpu_and_says_so() -> None:
    on_h100 = estimate(Sequence, batch, batch_size=8, optimizer="sgd", device="H100-80GB")
    # the campaign's LSTM (benchmarks/bench_accuracy.py); its H100 figures are checked in test_h100_figures
    assert any(note.startswith("cuDNN: 1 LSTM/GRU call per step modelled") for note in on_h100.notes)
    assert RNN_NOTE not in on_h100.notes
    on_mac = estimate(Sequence, batch, batch_size=8, optimizer="sgd", device="Mac-16GB")
    assert not any(note.startswith("cuDNN") for note in on_mac.notes)
    # what cuDNN's reserve and workspace add over PyTorch's CPU kernels, for this LSTM: more than 15 MiB
    assert on_h100.peak - on_mac.peak > 15 * 2**20


def test_what_is_not_modelled_runs_pytorchs_kernels_and_keeps_the_note() -> None:
    both_ways = estimate(lambda: Sequence(bidirectional=True), batch, batch_size=8, optimizer="sgd")
    assert RNN_NOTE in both_ways.notes
    assert "cuDNN: not modelled for bidirectional layers: PyTorch's CPU RNN kernel ran there" in both_ways.notes
    dropped = estimate(lambda: Sequence(dropout=0.1), batch, batch_size=8, optimizer="sgd")
    assert any("dropout between layers" in note for note in dropped.notes) and RNN_NOTE in dropped.notes


def test_real_tensors_and_evaluation_keep_pytorchs_kernels() -> None:
    lstm = nn.LSTM(8, 16, batch_first=True)
    with CudnnRNN() as rnn:
        out, _ = lstm(torch.randn(2, 5, 8))  # a tracked run's real tensors: values, from PyTorch's kernel
        assert out.grad_fn is not None and "CudnnRNN" not in out.grad_fn.name()
        with FakeTensorMode():
            fake = nn.LSTM(8, 16).eval()
            out, _ = fake(torch.randn(5, 2, 8))
    assert rnn.calls == 0 and not rnn.unmodelled
    expected = torch.nn.LSTM(8, 16, batch_first=True)  # and nothing is left registered
    expected.load_state_dict(lstm.state_dict())
    x = torch.randn(2, 5, 8)
    assert torch.equal(expected(x)[0], lstm(x)[0])
