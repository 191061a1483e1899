"""pytorch_memlab's MemReporter beside nbmem after one AdamW step, on this CPU (docs site, issue 28).

pytorch_memlab is not a dependency (nor an extra): install it where this runs,
e.g. ``pip install --no-deps --target /tmp/memlab pytorch_memlab calmsize`` and
``PYTHONPATH=/tmp/memlab``. Its LineProfiler reads CUDA's statistics and needs a
GPU; its MemReporter lists the live tensors and their sizes. The truth here is
the sum of the live tensors' storage bytes, each storage once.

    python benchmarks/bench_memlab.py [--json results/DATE-memlab-cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import re
from typing import Any

import torch
from torch import nn

import nbmem
from _environment import environment, write_json

_UNITS = {"B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    from pytorch_memlab import MemReporter

    from importlib.metadata import version

    report: dict[str, Any] = {**environment(), "pytorch_memlab": version("pytorch_memlab")}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    optimizer = torch.optim.AdamW(model.parameters())
    inputs, targets = torch.randn(256, 1024), torch.randn(256, 1024)
    with nbmem.track("cpu") as scope:
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    gc.collect()
    storages = {obj.untyped_storage().data_ptr(): obj.untyped_storage().nbytes() for obj in gc.get_objects()
                if isinstance(obj, torch.Tensor)}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        MemReporter(model).report()
    used = re.search(r"Used Memory: ([0-9.]+)([BKMG])", printed.getvalue())
    assert used is not None, printed.getvalue()[-500:]
    report["rows"] = [{
        "workload": "MLP 1024-4096-1024, batch 256, one AdamW step",
        "storages_bytes": sum(storages.values()),
        "nbmem_allocated_after": scope.result.allocated_after,
        "memlab_used_memory": float(used.group(1)) * _UNITS[used.group(2)],
    }]
    print(report["rows"][0])
    write_json(args.json, report)


if __name__ == "__main__":
    main()
