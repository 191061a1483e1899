"""CUDA's split reductions' staging buffers, measured, beside nbmem's launch rule (issue 24; for the next GPU lent).

``nbmem/estimation/cuda_reductions.py`` sizes the staging buffer and semaphores
PyTorch's ``gpu_reduce_kernel`` takes when it splits a reduction across thread
blocks. The H100's histories of 2026-11-27 checked it at 1,024 rows (BERT,
GPT-2, Llama) and for convolutions' bias and loss sums; larger row counts
(where the blocks per output reach their cap), other widths, dtypes and the
Welford, extreme and norm families were not measured. This probe runs each
case on the GPU with the allocator's history on and records every allocation
the op made (its output first, then whatever the kernel took), beside what
``staging_bytes`` predicts for that GPU (its SM count and resident threads read
from the device).

    python benchmarks/gpu_probe_reductions.py --out DIR     # on a CUDA machine: DIR/reductions.json
    python benchmarks/gpu_probe_reductions.py --dry-run      # anywhere: the cases and the predictions (H100)

Without CUDA (and without --dry-run) it exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch._prims_common import make_contiguous_strides_for

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

#: (name, family, the input's shape, how to reduce it; what is reduced: shape, strides (None: contiguous), dims)
Case = tuple[str, str, tuple[int, ...], Callable[[torch.Tensor], Any], tuple[int, ...], Any, tuple[int, ...]]


def cases() -> list[Case]:
    found: list[Case] = []
    for rows in (512, 1024, 4096, 16384, 65536):
        for width in (10, 256, 1000, 1024, 4096):
            found.append((f"sum rows={rows} width={width}", "sum", (rows, width), lambda x: x.sum(0), (rows, width),
                          None, (0,)))
    found += [
        ("sum every element 2**24", "sum", (1 << 24,), lambda x: x.sum(), (1 << 24,), None, ()),
        ("mean over rows 8x128x512", "sum", (8, 128, 512), lambda x: x.mean((0, 1)), (8, 128, 512), None, (0, 1)),
        ("bias of NCHW 32x64x56x56", "sum", (32, 64, 56, 56), lambda x: x.sum((0, 2, 3)), (32, 64, 56, 56), None,
         (0, 2, 3)),
        ("var over rows 4096x1024", "welford", (4096, 1024), lambda x: x.var(0), (4096, 1024), None, (0,)),
        ("amax over rows 4096x1024", "extreme", (4096, 1024), lambda x: x.amax(0), (4096, 1024), None, (0,)),
        ("norm over rows 4096x1024", "sum", (4096, 1024), lambda x: torch.linalg.vector_norm(x, dim=0), (4096, 1024),
         None, (0,)),
        ("a transposed view over its dim 1", "sum", (4096, 1024), lambda x: x.t().sum(1), (1024, 4096), (1, 1024),
         (1,)),
    ]
    return found


def predicted(case: Case, dtype: torch.dtype, gpu: str) -> tuple[int, int]:
    from nbmem.estimation.cuda_reductions import staging_bytes

    _, family, _, _, shape, strides, dims = case
    strides = strides or make_contiguous_strides_for(shape)
    return staging_bytes(shape, strides, dims, dtype, family, gpu)


def measure(case: Case, dtype: torch.dtype) -> dict[str, Any]:
    """Every allocation the op made on the GPU, in order, with the output's bytes."""
    _, _, shape, reduce, *_ = case
    x = torch.randn(shape, device="cuda", dtype=dtype)
    reduce(x)  # a first call: lazy initialisation out of the record
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1000, context=None, stacks="python")
    try:
        out = reduce(x)
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    allocations = [entry["size"] for entry in trace if entry["action"] == "alloc"]
    return {"allocations": allocations, "output": out.untyped_storage().nbytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--dry-run prints the cases)", file=sys.stderr)
        sys.exit(2)
    from nbmem.core.devices import PRESETS, SM_COUNT

    gpu = "H100-80GB"
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M%z"), "torch": torch.__version__, "rows": []}
    if not args.dry_run:
        props = torch.cuda.get_device_properties(0)
        report.update(device=props.name, sm_count=props.multi_processor_count,
                      threads_per_sm=props.max_threads_per_multi_processor)
        # the preset with this SM count, for the prediction (the H100 if none matches)
        gpu = next((name for name, count in SM_COUNT.items() if count == props.multi_processor_count
                    and name in PRESETS), gpu)
    report["preset"] = gpu
    started = time.perf_counter()
    for case in cases():
        for dtype in (torch.float32, torch.bfloat16):
            if time.perf_counter() - started > args.budget:
                report["stopped"] = "budget"
                break
            name, family, _, _, shape, strides, dims = case
            row: dict[str, Any] = {"case": name, "dtype": str(dtype).removeprefix("torch."), "shape": list(shape),
                                   "strides": strides, "dims": list(dims), "family": family,
                                   "predicted": list(predicted(case, dtype, gpu))}
            if not args.dry_run:
                try:
                    row.update(measure(case, dtype))
                except Exception as error:  # a case that fails is recorded, the others still run
                    row["error"] = f"{type(error).__name__}: {error}"
            report["rows"].append(row)
            print(json.dumps(row))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "reductions.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
