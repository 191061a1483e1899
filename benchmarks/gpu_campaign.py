"""One command for a lent GPU: every CUDA figure nbmem gives, checked in about 8 minutes (issue 13).

Run on a CUDA machine (see benchmarks/README.md for carrying the wheels):

    python benchmarks/gpu_campaign.py --out DIR [--budget 480] [--sections all]

Sections, in this order, each with its own share of the time budget (an item
that would start past its section's share is recorded as "not run: out of
time", never silently dropped):

- ``environment``: device, capability, memory, driver, CUDA, cuDNN, torch,
  nbmem, date; and what was already in use on the device (every figure below
  is relative to it, and the report says so).
- ``pytest``: ``pytest -m cuda`` on the files that hold CUDA tests; its outcome.
- ``fixed``: the fixed costs an estimate lists beside its figure, each in a
  fresh process: the CUDA context (device memory in use after initialising,
  less what was in use before and what PyTorch's allocator holds), the cuBLAS
  workspace (allocated by the first matmul beyond its output), cuDNN's
  workspace (a convolution step's peak with ``cudnn.benchmark`` off and on,
  against nbmem's estimate of the same step).
- ``zoo``: models x batch sizes x fp32/bf16/fp16 x checkpointing x two
  optimizers, each as ``estimate`` (fake tensors on the CPU), ``tracked`` (a
  real CPU run, small configurations only) and ``measured`` (the GPU). It
  records allocated peak, reserved peak, ``max_memory_allocated`` read
  directly, the estimate's simulated reserved figure, and the errors. The plain
  torch models are those of benchmarks/bench_accuracy.py; GPT-2, BERT and
  Llama configurations are added when transformers is importable.
- ``magic``: ``%%gpumem``'s fixed cost on the real counter (IPython), and
  ``nbmem profile`` on a generated notebook with a known allocation and a
  nested ``nbmem.measure()`` (needs ipykernel, nbclient, nbformat).
- ``max_batch``: ``max_batch_size(verify="measured")`` on a GPU capped with
  ``torch.cuda.set_per_process_memory_fraction``, against the real
  out-of-memory boundary found by running the step for real.

Writes ``campaign.json`` and ``campaign.md`` (one table per section) in DIR.
Without CUDA it exits 2 at once with a one-line reason and touches nothing.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout: its own nbmem
    sys.path.insert(0, str(ROOT))

import nbmem  # noqa: E402

#: The sections and their shares of the budget (they sum to 1).
SECTIONS = {"environment": 0.01, "pytest": 0.25, "fixed": 0.09, "zoo": 0.45, "magic": 0.10, "max_batch": 0.10}
MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_campaign.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for campaign.json and campaign.md (created)")
    parser.add_argument("--budget", type=float, default=480.0, help="total seconds, about 8 minutes by default")
    parser.add_argument("--sections", default="all", help=f"comma-separated, from: {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="the smallest grid: one batch size, fp32 and bf16")
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    chosen = list(SECTIONS) if args.sections == "all" else [name.strip() for name in args.sections.split(",")]
    unknown = [name for name in chosen if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}: use 'all' or some of {', '.join(SECTIONS)}")
    args.sections = chosen
    return args


def refusal() -> str | None:
    """Why the campaign can't run here (one line), or None on a CUDA machine."""
    if torch.cuda.is_available():
        return None
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    return (f"gpu_campaign: no CUDA device here (torch {torch.__version__}, {build}); nothing was run or written. "
            "Run it on a GPU machine: see benchmarks/README.md")


class Budget:
    """The campaign's time: a total, shared out between sections; ``clock`` is injectable for tests."""

    def __init__(self, seconds: float, sections: Iterable[str], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.start = clock()
        self.end = self.start + seconds
        chosen = list(sections)
        total = sum(SECTIONS[name] for name in chosen)
        self.shares = {name: seconds * SECTIONS[name] / total for name in chosen}
        self.section_end = self.start

    def open(self, name: str) -> float:
        """Start a section: its deadline, its share after what earlier sections left over, never past the end."""
        self.section_end = min(self.end, max(self.clock(), self.section_end) + self.shares[name])
        return self.section_end - self.clock()

    def left(self) -> float:
        return self.section_end - self.clock()


def relative(estimated: int | None, truth: int | None) -> float | None:
    """(estimated - truth) / truth, signed; None where either is missing."""
    if estimated is None or truth is None or truth == 0:
        return None
    return (estimated - truth) / truth


def error_summary(errors: Iterable[float | None]) -> dict[str, Any]:
    """Median and worst absolute relative error, over the configurations that have one.

    >>> error_summary([0.01, -0.03, None, 0.02])
    {'configurations': 3, 'median': 0.02, 'worst': 0.03}
    """
    values = sorted(abs(error) for error in errors if error is not None)
    if not values:
        return {"configurations": 0}
    return {"configurations": len(values), "median": round(statistics.median(values), 5), "worst": round(values[-1], 5)}


def markdown_table(columns: list[str], rows: list[dict[str, Any]]) -> str:
    """A markdown table: bytes as MiB with two decimals, ratios as signed percentages, None as a dash.

    >>> print(markdown_table(["model", "peak", "error"], [{"model": "mlp", "peak": 3 * MiB, "error": -0.0125}]))
    | model | peak | error |
    |---|---|---|
    | mlp | 3.00 MiB | -1.25% |
    """
    def cell(column: str, value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float) and (column == "error" or column.endswith("_error")):
            return f"{value:+.2%}"
        if isinstance(value, int) and not isinstance(value, bool) and column not in ("batch", "batch_size"):
            return f"{value / MiB:.2f} MiB"
        return str(value).replace("|", "/").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(column, row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(results: dict[str, Any], out: Path) -> list[Path]:
    """campaign.json (everything) and campaign.md (the tables) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "campaign.json", out / "campaign.md"]
    written[0].write_text(json.dumps(results, indent=1, default=str))
    environment = results.get("environment", {})
    lines = [
        f"# nbmem GPU campaign, {results['date']}",
        "",
        "Device: " + ", ".join(f"{key} {value}" for key, value in environment.items() if key != "note"),
        "",
        environment.get("note", ""),
        "",
    ]
    for name, section in results["sections"].items():
        lines += [f"## {name} ({section.get('seconds', 0):.0f} s)", ""]
        if section.get("columns") and section.get("rows"):
            lines += [markdown_table(section["columns"], section["rows"]), ""]
        for key, value in section.items():
            if key not in ("columns", "rows", "seconds"):
                lines.append(f"- {key}: {json.dumps(value, default=str)}")
        lines.append("")
    written[1].write_text("\n".join(lines))
    return written


# ---------------------------------------------------------------- the sections (CUDA only below this line)


def _run_python(code: str, timeout: float, *args: str) -> dict[str, Any]:
    """A fresh Python process (its own CUDA context); the last line it prints is JSON."""
    try:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=max(timeout, 1), cwd=ROOT, env=_env_with_nbmem())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _benchmarks_importable() -> None:
    """The other benchmark scripts, whose models and timers the campaign reuses, importable by name."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))


def _env_with_nbmem() -> dict[str, str]:
    """This process's environment, with this checkout's nbmem importable (kernels and subprocesses)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _device_used() -> int | None:
    """Bytes in use on GPU 0 by every process, from NVML (no CUDA context needed), or None."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML: the context figure is then not separated from other processes' use
        return None


def environment(budget: Budget) -> dict[str, Any]:
    used_before = _device_used()  # before this process makes a CUDA context
    properties = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown (no nvidia-smi)"
    free, total = torch.cuda.mem_get_info(0)
    return {
        "device": properties.name, "capability": f"{properties.major}.{properties.minor}", "memory": total,
        "driver": driver, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "torch": torch.__version__, "nbmem": nbmem.__version__, "python": platform.python_version(),
        "used_before": used_before, "free_at_start": free,
        "note": ("Every figure is relative to what was in use when it was taken: "
                 f"{(used_before or 0) / MiB:.0f} MiB were in use on the device before the campaign "
                 "(NVML; other processes included)" + ("" if used_before is not None else ", unknown: no NVML")),
    }


def pytest_cuda(budget: Budget) -> dict[str, Any]:
    files = ["tests/test_cuda.py", "tests/test_reclaim.py"]  # the files that hold @pytest.mark.cuda tests
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfEs", *files]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=max(budget.left(), 1))
    except subprocess.TimeoutExpired as stopped:
        tail = (stopped.stdout or b"")[-3000:]
        return {"outcome": f"timed out after {budget.left():.0f} s", "tail": str(tail)}
    lines = done.stdout.strip().splitlines()
    return {"outcome": lines[-1] if lines else "no output", "exit": done.returncode,
            "seconds_run": round(time.monotonic() - started, 1), "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))],
            "tail": "\n".join(lines[-40:])}


_FIXED_COSTS = r"""
import json, sys, torch
from torch import nn
used_before = int(sys.argv[1]) if sys.argv[1] != "None" else None
torch.zeros(1, device="cuda")                      # the context, and the allocator's first segment
free, total = torch.cuda.mem_get_info()
context = (total - free) - torch.cuda.memory_reserved() - (used_before or 0)
found = {"context": context if used_before is not None else None, "device_used_after_init": total - free}
for dtype in (torch.float32, torch.bfloat16):
    a = torch.randn(256, 256, device="cuda", dtype=dtype)
    before = torch.cuda.memory_allocated()
    out = a @ a
    found[f"cublas_workspace_{str(dtype)[6:]}"] = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    del a, out
conv = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).cuda()
x = torch.randn(32, 64, 56, 56, device="cuda")
for benchmark in (False, True):
    torch.backends.cudnn.benchmark = benchmark
    for _ in range(2):                               # the second run is recorded: algorithms chosen, workspaces sized
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); before = torch.cuda.memory_allocated()
        out = conv(x); loss = out.float().mean(); loss.backward()   # nbmem's default step: out held through backward
        del out, loss
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        conv.zero_grad(set_to_none=True)
    found[f"conv_step_peak_benchmark_{benchmark}"] = peak
print(json.dumps(found))
"""


def fixed_costs(budget: Budget) -> dict[str, Any]:
    found = _run_python(_FIXED_COSTS, budget.left(), str(_device_used()))
    if "error" not in found:
        from nbmem.estimation.estimate import estimate

        build = lambda: nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1))  # noqa: E731
        estimated = estimate(build, lambda n: torch.randn(n, 64, 56, 56), batch_size=32, optimizer="sgd")
        # the measured step's parameters and input exist before it: compare with the estimate's first step (SGD,
        # no state) less its parameters and its batch, 32 * 64 * 56 * 56 * 4 bytes
        step = estimated.first_step - estimated.breakdown.category("parameter") - 32 * 64 * 56 * 56 * 4
        found["conv_step_estimated"] = step
        for benchmark in (False, True):
            found[f"cudnn_workspace_benchmark_{benchmark}"] = found[f"conv_step_peak_benchmark_{benchmark}"] - step
    return found


def _zoo() -> dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]]:
    """name -> (build, make batch): bench_accuracy's plain torch models; transformers' where importable."""
    _benchmarks_importable()
    from bench_accuracy import FAMILIES

    zoo: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]] = dict(FAMILIES)
    try:
        import transformers
    except ImportError:
        return zoo

    def causal(config: Any) -> tuple[Callable[[], nn.Module], Callable[[int], Any]]:
        def make(n: int) -> dict[str, torch.Tensor]:
            tokens = torch.randint(0, config.vocab_size, (n, 128))
            return {"input_ids": tokens, "labels": tokens}

        return (lambda: transformers.AutoModelForCausalLM.from_config(config)), make

    # use_cache=False: a KV cache breaks under activation checkpointing (DESIGN.md), as Hugging Face's own
    # gradient_checkpointing_enable() knows
    zoo["gpt2 (6 layers, 512)"] = causal(transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=8192,
                                                                 bos_token_id=0, eos_token_id=0, use_cache=False))
    zoo["llama (4 layers, 512)"] = causal(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=8192, use_cache=False))
    bert = transformers.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, intermediate_size=1024)
    zoo["bert (4 layers, 256)"] = (
        lambda: transformers.BertForSequenceClassification(bert),
        lambda n: {"input_ids": torch.randint(0, bert.vocab_size, (n, 128)), "labels": torch.randint(0, 2, (n,))},
    )
    return zoo


def _one(mode: str, build: Any, make: Any, knobs: dict[str, Any]) -> dict[str, Any]:
    from nbmem.estimation.estimate import estimate

    try:
        if mode == "measured":
            estimate(build, make, mode=mode, **knobs)  # unrecorded: cuBLAS/cuDNN workspaces and lazy init happen here
            gc.collect()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        result = estimate(build, make, mode=mode, **knobs)
        found = {"peak": result.peak, "steady": result.steady, "reserved": result.reserved}
        if mode == "measured":
            found["max_memory_allocated"] = torch.cuda.max_memory_allocated() - before  # read directly, not via nbmem
        return found
    except torch.OutOfMemoryError:
        return {"error": "OOM"}
    except Exception as error:  # recorded, not hidden: this mode can't run this configuration
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"}
    finally:
        gc.collect()
        if mode == "measured":
            torch.cuda.empty_cache()  # configurations isolated from each other's cached blocks


def zoo(budget: Budget, quick: bool) -> dict[str, Any]:
    models = _zoo()
    batches = (8,) if quick else (8, 32)
    precisions = ("fp32", "bf16") if quick else ("fp32", "bf16", "fp16")
    grid = list(itertools.product(models, batches, precisions, (False, True), ("adamw", "sgd-momentum")))
    random.Random(13).shuffle(grid)  # out of time, what did run still covers every knob
    rows, not_run = [], 0
    for name, batch_size, precision, checkpointing, optimizer in grid:
        if budget.left() < 5:
            not_run += 1
            continue
        build, make = models[name]
        knobs = dict(batch_size=batch_size, precision=precision, checkpointing=checkpointing, optimizer=optimizer)
        row: dict[str, Any] = {"model": name, "batch": batch_size, "precision": precision,
                               "checkpointing": checkpointing, "optimizer": optimizer}
        estimated, measured = _one("estimated", build, make, knobs), _one("measured", build, make, knobs)
        # tracked: a real CPU run, minutes for a large step; only where it is small and time is left
        # (a 1 GiB step tracked on the device machine's CPU took minutes and cut a campaign off, 2026-11-25)
        small = "error" not in estimated and estimated["peak"] < 256 * MiB and budget.left() > 30
        tracked = _one("tracked", build, make, knobs) if small else {"error": "not run (too large or out of time)"}
        row.update({
            "estimated": estimated.get("peak"), "tracked": tracked.get("peak"), "measured": measured.get("peak"),
            "max_memory_allocated": measured.get("max_memory_allocated"),
            "estimated_reserved": estimated.get("reserved"), "measured_reserved": measured.get("reserved"),
            "error": relative(estimated.get("peak"), measured.get("peak")),
            "reserved_error": relative(estimated.get("reserved"), measured.get("reserved")),
            "problems": "; ".join(f"{mode}: {found['error']}" for mode, found in
                                  (("estimated", estimated), ("tracked", tracked), ("measured", measured))
                                  if "error" in found and not found["error"].startswith("not run")) or None,
        })
        rows.append(row)
        print(json.dumps(row), flush=True)  # a run cut off mid-section still shows its rows in the log
    return {
        "columns": ["model", "batch", "precision", "checkpointing", "optimizer", "estimated", "tracked", "measured",
                    "max_memory_allocated", "error", "estimated_reserved", "measured_reserved", "reserved_error",
                    "problems"],
        "rows": rows,
        "not_run_out_of_time": not_run,
        "allocated (target: median <= 2%, worst <= 5%)": error_summary(row["error"] for row in rows),
        "reserved (target: median <= 5%)": error_summary(row["reserved_error"] for row in rows),
    }


_NOTEBOOK_CELLS = [
    "import torch, nbmem",
    "block = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')   # 64 MiB, kept",
    "with nbmem.measure() as inner:\n    scratch = torch.empty(32 * 2**20, dtype=torch.uint8, device='cuda')\n"
    "    del scratch\nprint('inner peak', inner.result.peak)",
    "pass",
]


def magic(budget: Budget) -> dict[str, Any]:
    found: dict[str, Any] = {}
    _benchmarks_importable()
    try:
        from bench_overhead import median_seconds
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.testing.globalipapp import start_ipython

        start_ipython()
        shell = InteractiveShell.instance()
        shell.run_cell("%load_ext nbmem")
        empty = median_seconds(lambda: shell.run_cell("pass"), 200)
        measured = median_seconds(lambda: shell.run_cell("%%gpumem -q\npass"), 200)
        found["gpumem_fixed_cost_ms (measured, real counter)"] = round((measured - empty) * 1e3, 4)
    except ImportError as missing:
        found["gpumem_fixed_cost"] = f"not run: {missing} (carry the wheels, benchmarks/README.md)"
    try:
        import nbformat

        from nbmem.frontend.cli import profile_notebook
    except ImportError as missing:
        found["profile"] = f"not run: {missing} (carry the wheels, benchmarks/README.md)"
        return found
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "campaign.ipynb"
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in _NOTEBOOK_CELLS])
        nbformat.write(notebook, path)
        os.environ["PYTHONPATH"] = _env_with_nbmem()["PYTHONPATH"]  # the kernel imports this checkout's nbmem
        profile = profile_notebook(str(path), timeout=max(int(budget.left()), 10))
        found["profile"] = str(profile)
        found["profile_failure"] = str(profile.failure) if profile.failure else None
        # expected: cell 2 retains exactly 64 MiB; cell 3 peaks 32 MiB, its nested scope printing the same
        found["cell_peaks"] = {cell.number: (cell.result.peak if cell.result else None) for cell in profile.cells}
    return found


def max_batch(budget: Budget) -> dict[str, Any]:
    from nbmem.estimation.estimate import estimate
    from nbmem.whatif.batchsize import max_batch_size

    build = lambda: nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10))  # noqa: E731
    make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))  # noqa: E731
    total = torch.cuda.mem_get_info(0)[1]
    cap = 2 << 30
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)  # a 2 GiB GPU, enforced by the allocator
    try:
        found = max_batch_size(build, make, device="2GiB", optimizer="adamw", verify="measured")
        boundary: dict[int, bool] = {}
        for n in (found.batch_size, found.batch_size + 1):  # the truth: the step run for real under the cap
            try:
                estimate(build, make, batch_size=n, optimizer="adamw", mode="measured")
                boundary[n] = True
            except torch.OutOfMemoryError:
                boundary[n] = False
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            if budget.left() < 5:
                break
        return {"capacity": cap, "max_batch_size": found.batch_size, "trials": dict(found.trials),
                "real run at that size fits": boundary.get(found.batch_size),
                "real run one larger fits": boundary.get(found.batch_size + 1),
                "agrees": boundary.get(found.batch_size) is True and boundary.get(found.batch_size + 1) is False}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = refusal()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    budget = Budget(args.budget, args.sections)
    results: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "budget_seconds": args.budget, "sections": {}}
    runners: dict[str, Callable[[Budget], dict[str, Any]]] = {
        "environment": environment, "pytest": pytest_cuda, "fixed": fixed_costs,
        "zoo": lambda budget: zoo(budget, args.quick), "magic": magic, "max_batch": max_batch,
    }
    for name in args.sections:
        budget.open(name)
        started = time.monotonic()
        try:
            section = runners[name](budget)
        except Exception as error:  # one broken section must not cost the others their half hour
            section = {"error": f"{type(error).__name__}: {error}"}
        section["seconds"] = round(time.monotonic() - started, 1)
        if name == "environment":
            results["environment"] = {key: value for key, value in section.items() if key != "seconds"}
        results["sections"][name] = section
        print(f"{name}: {section['seconds']} s", flush=True)
        write_results(results, Path(args.out))  # after each section: a cut-off run keeps what it measured
    print(f"wrote {Path(args.out) / 'campaign.json'} and campaign.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
