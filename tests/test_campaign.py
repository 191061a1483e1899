"""benchmarks/gpu_campaign.py's CPU-only paths: its refusal without CUDA, its arguments, its time and its tables."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
import torch

from _benchmarks import benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_campaign.py"
MiB = 1 << 20


@pytest.fixture(scope="module")
def campaign() -> Iterator[ModuleType]:
    with benchmark("gpu_campaign") as module:
        yield module


needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal, which needs a machine without CUDA")


@needs_no_cuda
def test_without_cuda_it_refuses_in_one_line_and_touches_nothing(
    campaign: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results"
    assert campaign.main(["--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err.count("\n") == 1 and printed.err.startswith("gpu_campaign: no CUDA device here (torch ")
    assert "benchmarks/README.md" in printed.err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@needs_no_cuda
@pytest.mark.slow
def test_the_command_exits_2_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "no CUDA device here" in done.stderr
    assert not out.exists()


def test_arguments(campaign: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = campaign.parse_args(["--out", "d"])
    assert (args.out, args.budget, args.quick) == ("d", 480.0, False)
    assert args.sections == ["environment", "pytest", "fixed", "zoo", "magic", "max_batch"]
    args = campaign.parse_args(["--out", "d", "--budget", "300", "--sections", "zoo, fixed", "--quick"])
    assert (args.budget, args.sections, args.quick) == (300.0, ["zoo", "fixed"], True)
    with pytest.raises(SystemExit) as stopped:
        campaign.parse_args(["--out", "d", "--sections", "zoo,speed"])
    assert stopped.value.code == 2
    assert "unknown section(s) speed: use 'all' or some of environment" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        campaign.parse_args(["--out", "d", "--budget", "0"])
    assert "--budget must be a positive number of seconds, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        campaign.parse_args([])  # --out is required


def test_the_budget_is_shared_out_and_time_boxed(campaign: ModuleType) -> None:
    now = [100.0]
    budget = campaign.Budget(200.0, ["zoo", "fixed"], clock=lambda: now[0])
    # zoo's share 0.45 and fixed's 0.09 of 0.54: 200 * 0.45 / 0.54 = 166.67 s and 33.33 s
    assert budget.open("zoo") == pytest.approx(166.6667, abs=1e-3)
    now[0] += 50.0  # zoo finished 116.67 s early: that time goes to fixed, on top of its own 33.33 s
    assert budget.open("fixed") == pytest.approx(150.0)
    now[0] += 160.0
    assert budget.left() == pytest.approx(-10.0)  # past its share: the section's items stop
    budget = campaign.Budget(200.0, ["zoo", "fixed"], clock=lambda: now[0])
    budget.open("zoo")
    now[0] += 180.0  # zoo overran its share: fixed starts now with its own 33.33 s, cut at the campaign's end
    assert budget.open("fixed") == pytest.approx(20.0)
    late = campaign.Budget(10.0, ["zoo"], clock=lambda: now[0])
    now[0] += 9.0
    assert late.open("zoo") == pytest.approx(1.0)  # never past the campaign's end


def test_errors_and_summaries(campaign: ModuleType) -> None:
    assert campaign.relative(102, 100) == pytest.approx(0.02)
    assert campaign.relative(95, 100) == pytest.approx(-0.05)
    assert campaign.relative(None, 100) is None and campaign.relative(5, 0) is None
    assert campaign.error_summary([0.01, -0.06, None, 0.02, 0.03]) == {"configurations": 4, "median": 0.025, "worst": 0.06}
    assert campaign.error_summary([None]) == {"configurations": 0}


def test_the_tables_and_files_it_writes(campaign: ModuleType, tmp_path: Path) -> None:
    rows = [
        {"model": "mlp", "batch": 32, "estimated": 3 * MiB, "measured": 3 * MiB + 30 * 1024, "error": -0.00967,
         "problems": None},
        {"model": "lstm", "batch": 8, "estimated": None, "measured": 512 * 1024, "error": None, "problems": "a | b"},
    ]
    columns = ["model", "batch", "estimated", "measured", "error", "problems"]
    assert campaign.markdown_table(columns, rows).splitlines() == [
        "| model | batch | estimated | measured | error | problems |",
        "|---|---|---|---|---|---|",
        "| mlp | 32 | 3.00 MiB | 3.03 MiB | -0.97% | - |",  # 3 MiB + 30 KiB = 3.029 MiB
        "| lstm | 8 | - | 0.50 MiB | - | a / b |",
    ]
    results = {
        "date": "2026-11-23T00:00:00+00:00",
        "environment": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "note": "Every figure is relative."},
        "sections": {"zoo": {"columns": columns, "rows": rows, "seconds": 12.0, "not_run_out_of_time": 3}},
    }
    written = campaign.write_results(results, tmp_path / "out")
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["campaign.json", "campaign.md"]
    assert json.loads(written[0].read_text()) == results
    markdown = written[1].read_text()
    assert markdown.startswith("# nbmem GPU campaign, 2026-11-23T00:00:00+00:00\n\nDevice: device NVIDIA H100 80GB HBM3, "
                               "torch 2.13.0\n\nEvery figure is relative.\n")
    assert "## zoo (12 s)\n\n| model | batch |" in markdown and "- not_run_out_of_time: 3" in markdown


@pytest.fixture(scope="module")
def misses() -> Iterator[ModuleType]:
    with benchmark("gpu_probes_misses") as module:
        yield module


@needs_no_cuda
def test_the_misses_probe_refuses_without_cuda(misses: ModuleType, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert misses.main(["--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    assert capsys.readouterr().err == "gpu_probes_misses.py: no CUDA device here; nothing to probe\n"


def test_the_misses_probe_names_the_attention_kernel_pytorch_picks(misses: ModuleType) -> None:
    """sdpa_backend asks PyTorch's own chooser: on the CPU, its flash kernel, grouped-query input and a mask too."""
    query, key = torch.randn(2, 8, 16, 8), torch.randn(2, 2, 16, 8)
    assert misses.sdpa_backend(query, key, None, True) == "FLASH_ATTENTION"
    assert misses.sdpa_backend(query, query, torch.ones(16, 16, dtype=torch.bool).tril(), False) == "FLASH_ATTENTION"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        assert misses.sdpa_backend(query, key, None, True) == "MATH"
    assert "attention" in misses.SECTIONS and "grouped_mm" in misses.SECTIONS


def test_the_misses_probe_reduces_a_real_h100_history(misses: ModuleType) -> None:
    """compact() and allocations() on an allocator history an H100 recorded (an MLP's three AdamW steps)."""
    import pickle

    path = SCRIPT.parent / "results" / "2026-11-25-gpu" / "snapshot-mlp.pickle"
    with open(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    reduced = misses.compact({"device_traces": [trace]})
    events = reduced["events"]
    assert len(events) == 169 and len(json.dumps(reduced)) < 20_000  # small enough to come back from the device
    # the first allocation is the first layer's 16 MiB weight (4096 x 1024 fp32), made by Module._apply (.cuda())
    assert events[1][:1] + events[1][2:] == ["alloc", 16 * MiB, "module.py:1097 <lambda>"]
    allocated = sum(size if action == "alloc" else -size for action, _, size, *_ in events
                    if action in ("alloc", "free_completed"))
    assert allocated == sum(e["size"] for e in trace if e["action"] == "alloc") - sum(
        e["size"] for e in trace if e["action"] == "free_completed")
    assert reduced["peak_event"] >= 0 and events[reduced["peak_event"]][0] == "alloc"
    made = misses.allocations(trace)
    assert len(made) == sum(e["action"] == "alloc" for e in trace) == 84
    assert sum(freed for _, freed in made) == 69
    # the 15 left: 4 parameters and their 8 AdamW moments (the step counters live on the CPU), 2 cuBLAS workspaces
    # of 32 MiB (forward's thread and backward's), and one 1 MiB block
    kept = sorted(size for size, freed in made if not freed)
    assert kept == sorted([16 * MiB] * 6 + [16384] * 3 + [4096] * 3 + [32 * MiB] * 2 + [MiB])
    assert made[0] == [16 * MiB, False]


def test_the_gpu_sessions_script_names_files_that_exist_and_is_valid_bash() -> None:
    script = SCRIPT.parent / "gpu_session.sh"
    text = script.read_text()
    named = set(re.findall(r"\b((?:benchmarks|tests)/[\w./-]+\.py)\b", text))
    assert {"benchmarks/gpu_probes_misses.py", "benchmarks/gpu_probes.py", "tests/test_cuda.py"} <= named
    assert all((SCRIPT.parent.parent / path).is_file() for path in named), named
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # the sections it asks of the probes are ones they have
    with benchmark("gpu_probes") as probes:
        sections = re.findall(r"gpu_probes\.py .*--sections ([\w,-]+)", text)
        assert sections and set(sections[0].split(",")) <= set(probes.SECTIONS)
