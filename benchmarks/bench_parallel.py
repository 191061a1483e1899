"""Data parallelism: do the one-process estimates match real ranks? And how fast is any world size?

Run: python benchmarks/bench_parallel.py [--json FILE] [--quick]

Agreement: 2 model families (a residual MLP, a transformer encoder) x the 4
strategies (ddp, zero1, fsdp, fsdp-no-reshard) x 2 and 4 ranks x fp32 and bf16
autocast x activation checkpointing off/on. Each configuration is launched
for real (nbmem.launch: forked processes, gloo, each rank tracked) and every
rank's peak is compared with the estimate for that rank (fake tensors, the
fake process group, in this process), and the largest real rank with the
rank-0 estimate. Issue 5's target: within 2% for every strategy. The fp32
configurations without checkpointing are launched three times, to show that
the real peaks do not change from launch to launch.

Speed: estimating ddp, zero1 and fsdp for 1 to 1024 GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import statistics
import time

import torch
from torch import nn

import nbmem
from _environment import write_json
from bench_accuracy import Transformer


class Block(nn.Module):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(x)


def residual_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), *[Block() for _ in range(4)], nn.Linear(512, 10))


FAMILIES = {
    "residual-mlp": (residual_mlp, lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))), 32),
    "transformer": (Transformer, lambda n: (torch.randint(0, 1000, (n, 64)), torch.randint(0, 1000, (n, 64))), 8),
}
STRATEGIES = ["ddp", "zero1", "fsdp", "fsdp-no-reshard"]


def agreement(quick: bool) -> list[dict]:
    records = []
    worlds = [2] if quick else [2, 4]
    precisions = ["fp32"] if quick else ["fp32", "bf16"]
    for (family, (build, make, batch)), parallel, world, precision, checkpointing in itertools.product(
        FAMILIES.items(), STRATEGIES, worlds, precisions, [False, True]
    ):
        knobs = dict(batch_size=batch, parallel=parallel, world_size=world, precision=precision,
                     checkpointing=checkpointing, optimizer="adamw")
        started = time.perf_counter()
        estimated = [nbmem.estimate(build, make, rank=rank, **knobs).peak for rank in range(world)]
        estimate_seconds = time.perf_counter() - started
        launches = 3 if (precision == "fp32" and not checkpointing) else 1
        real, launch_seconds = [], []
        for _ in range(launches):
            started = time.perf_counter()
            real.append(nbmem.launch(build, make, **knobs).peaks)
            launch_seconds.append(time.perf_counter() - started)
        errors = [(peak - estimated[rank]) / peak for peaks in real for rank, peak in enumerate(peaks)]
        record = dict(family=family, parallel=parallel, world_size=world, precision=precision,
                      checkpointing=checkpointing, batch_size=batch, estimated=estimated, real=real,
                      max_abs_error=max(abs(error) for error in errors),
                      largest_rank_error=(estimated[0] - max(real[0])) / max(real[0]),
                      same_every_launch=all(peaks == real[0] for peaks in real),
                      estimate_seconds=estimate_seconds, launch_seconds=launch_seconds)
        records.append(record)
        print(f"{family:13} {parallel:16} N={world} {precision} ckpt={checkpointing!s:5} "
              f"estimated {[nbmem.format_bytes(p) for p in estimated]} real {[nbmem.format_bytes(p) for p in real[0]]} "
              f"max error {record['max_abs_error']:.2%} same every launch {record['same_every_launch']}", flush=True)
    return records


def speed() -> dict:
    build, make, batch = FAMILIES["residual-mlp"]
    started = time.perf_counter()
    table = nbmem.sweep(build, make, batch_size=batch, parallel=["ddp", "zero1", "fsdp"],
                        world_size=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    seconds = time.perf_counter() - started
    print(table)
    print(f"{len(table.rows)} estimates in {seconds:.1f} s")
    return dict(configurations=len(table.rows), seconds=seconds, records=table.to_records())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="2 ranks, fp32 only")
    options = parser.parse_args()
    records = agreement(options.quick)
    errors = [record["max_abs_error"] for record in records]
    summary = dict(
        configurations=len(records),
        median_max_abs_error=statistics.median(errors),
        max_abs_error=max(errors),
        every_launch_the_same=all(record["same_every_launch"] for record in records),
    )
    print(summary)
    result = dict(
        date=datetime.date.today().isoformat(),
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        cores=__import__("os").cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda="untested: no GPU here; real ranks are gloo on the CPU, each tracked",
        summary=summary,
        speed=speed(),
        agreement=records,
    )
    write_json(options.json, result, indent=1)


if __name__ == "__main__":
    main()
