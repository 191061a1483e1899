"""cuDNN's RNN reserve and workspace sizes over a wide grid (one CUDA GPU): what nbmem/estimation/cudnn_rnn.py fits.

For each (kind, input size, hidden, layers, batch, steps, precision) of a seeded sample: one training step of
``nn.LSTM``/``nn.GRU`` (batch-first, autocast for bf16; the run of 2026-11-27 also listed "fp16", which ran in fp32)
recorded by the allocator's history; the workspace is the
transient forward allocation that backward takes twice, the reserve ``_cudnn_rnn``'s fourth output.

    python benchmarks/gpu_probe_rnn_sizes.py --out DIR [--count 400] [--budget 150] [--variants]

``--variants``: dropout between layers, bidirectional layers and LSTM projections instead, every allocation of each
step (and of the process's first step with dropout, which makes cuDNN's dropout state).
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
from fit_cudnn_rnn import traced_workspace  # noqa: E402
from gpu_probes_misses import _outputs, _phases, _under  # noqa: E402


def sizes(kind, inputs, hidden, layers, batch, steps, precision, dropout=0.0, bidirectional=False, proj=0,
          first=False):
    options = {"proj_size": proj} if proj else {}
    model = getattr(nn, kind)(inputs, hidden, num_layers=layers, batch_first=True, dropout=dropout,
                              bidirectional=bidirectional, **options).cuda()
    x = torch.randn(batch, steps, inputs, device="cuda")
    run = _under(precision, lambda: model(x)[0])
    found = {}
    if first:  # the process's first call with dropout: cuDNN's dropout state is made then, once
        found["first"] = _phases(run)
    run().backward()
    ops = _outputs(run, ("_cudnn_rnn",))
    phases = _phases(run)
    out = ops[0][1][0]
    return {"reserve": ops[0][1][3], "workspace": traced_workspace(phases["forward"], phases["backward"], out),
            "output": out, "ops": ops, **phases, **found}


def variants(deadline: float) -> list[dict]:
    """Dropout between layers, bidirectional layers, LSTM projections: every allocation of each step."""
    grid = list(itertools.product(("LSTM", "GRU"), (64, 256), (128, 512), (2, 3), (8, 32), (32, 128), ("fp32", "bf16"),
                                  ((0.2, False, 0), (0.0, True, 0), (0.5, True, 0), (0.0, False, 64))))
    random.Random(1).shuffle(grid)
    rows = []
    first = True
    for kind, inputs, hidden, layers, batch, steps, precision, (dropout, both, proj) in grid:
        if time.monotonic() > deadline:
            break
        if proj and kind == "GRU":
            continue
        row = {"kind": kind, "inputs": inputs, "hidden": hidden, "layers": layers, "batch": batch, "steps": steps,
               "precision": precision, "dropout": dropout, "bidirectional": both, "proj": proj}
        try:
            row.update(sizes(kind, inputs, hidden, layers, batch, steps, precision, dropout, both, proj,
                             first=first and dropout > 0))
            first = first and not dropout
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--budget", type=float, default=150)
    parser.add_argument("--variants", action="store_true", help="dropout, bidirectional and projected layers instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.variants:
        rows = variants(time.monotonic() + args.budget)
        (out / "rnn_variants.json").write_text(json.dumps({**meta, "rows": rows}))
        print(len(rows), "rows;", sum("error" in r for r in rows), "errors")
        return 0
    hidden = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)
    grid = list(itertools.product(("LSTM", "GRU"), (None, 64, 300), hidden, (1, 2, 3), (1, 4, 16, 32, 64),
                                  (8, 16, 64, 200, 512), ("fp32", "bf16")))
    random.Random(0).shuffle(grid)
    deadline = time.monotonic() + args.budget
    rows = []
    for kind, inputs, hidden, layers, batch, steps, precision in grid[: args.count]:
        if time.monotonic() > deadline:
            break
        row = {"kind": kind, "inputs": inputs or hidden, "hidden": hidden, "layers": layers, "batch": batch,
               "steps": steps, "precision": precision}
        try:
            found = sizes(kind, inputs or hidden, hidden, layers, batch, steps, precision)
            row.update({key: found[key] for key in ("reserve", "workspace", "output")})
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {error}"[:200]
        rows.append(row)
        torch.cuda.empty_cache()
    (out / "rnn_sizes.json").write_text(json.dumps({**meta, "rows": rows}))
    print(len(rows), "rows;", sum("error" in r for r in rows), "errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
