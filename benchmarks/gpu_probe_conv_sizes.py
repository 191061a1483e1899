"""cuDNN's convolution workspaces over a wide grid (one CUDA GPU), for modelling them in estimates (issue 24).

For each (input channels, output channels, kernel, stride, image, batch, precision) of a seeded sample: one training
step of ``nn.Conv2d`` (input requiring grad, autocast for bf16 and fp16, ``cudnn.benchmark`` off as PyTorch's default)
recorded by the allocator's history: every allocation of forward and of backward, ``[bytes, freed in that phase]``,
and the outputs of ``convolution`` and ``convolution_backward``.

    python benchmarks/gpu_probe_conv_sizes.py --out DIR [--count 2000] [--budget 150]
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_probes_misses import _outputs, _phases  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def step(inputs, outputs, kernel, stride, image, batch, precision):
    model = nn.Conv2d(inputs, outputs, kernel, stride=stride, padding=kernel // 2).cuda()
    x = torch.randn(batch, inputs, image, image, device="cuda", requires_grad=True)
    dtype = DTYPES[precision]

    def run():
        with torch.autocast("cuda", dtype or torch.bfloat16, enabled=dtype is not None):
            return model(x).float().pow(2).mean()

    run().backward()  # warm: cuDNN's plans
    return {"ops": _outputs(run, ("convolution",)), **_phases(run)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=150)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    grid = list(itertools.product((3, 16, 32, 64, 128, 256, 512), (16, 32, 64, 128, 256, 512), (1, 3, 5, 7), (1, 2),
                                  (7, 14, 28, 32, 56, 64, 112, 224), (1, 4, 16, 32, 64), ("fp32", "bf16", "fp16")))
    random.Random(0).shuffle(grid)
    deadline = time.monotonic() + args.budget
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for point in grid[: args.count]:
        if time.monotonic() > deadline:
            break
        inputs, outputs, kernel, stride, image, batch, precision = point
        if batch * max(inputs, outputs) * image * image * 4 > 2**31:  # at most 2 GiB a tensor
            continue
        row = dict(zip(("inputs", "outputs", "kernel", "stride", "image", "batch", "precision"), point))
        try:
            row.update(step(*point))
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        rows.append(row)
        torch.cuda.empty_cache()
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "conv_sizes.json").write_text(json.dumps({**meta, "rows": rows}))
    print(len(rows), "rows;", sum("error" in r for r in rows), "errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
