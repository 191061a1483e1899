"""Fit cuDNN's RNN workspace sizes measured on an H100 into nbmem/estimation/cudnn_rnn_fit.py (a generated table).

Reads ``results/2026-11-27-gpu/rnn_sizes.json`` (``gpu_probe_rnn_sizes.py``: 1,751 LSTM/GRU training steps, torch
2.11, cuDNN 9.19; its "fp16" steps ran in fp32, autocast being on for bf16 only, and are read as fp32). For each (kind, precision, hidden size) a linear model in the layers, batch, steps and input size,
fitted for relative error; prints the errors of a 70/30 split (fitted on 70 %, checked on the other 30 %) and of the
whole, then writes the table fitted on all.

    python benchmarks/fit_cudnn_rnn.py [--write]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SOURCE = ROOT / "benchmarks/results/2026-11-27-gpu/rnn_sizes.json"
TARGET = ROOT / "nbmem/estimation/cudnn_rnn_fit.py"


def usable(row: dict) -> bool:
    """A workspace found: larger than a few hidden states (the probe took a state's copy for it where cuDNN took
    none it could tell apart, all hidden 192 and some batch-1 steps)."""
    return row["workspace"] > 8 * row["layers"] * row["batch"] * row["hidden"] * 4 and row["hidden"] != 192


def fit(rows: list[dict]) -> list[float]:
    from nbmem.estimation.cudnn_rnn import features

    x = np.array([features(r["layers"], r["steps"], r["batch"], r["hidden"], r["inputs"]) for r in rows], float)
    y = np.array([r["workspace"] for r in rows], float)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    return [round(float(c), 3) for c in coef]


def errors(rows: list[dict], coef: list[float]) -> list[float]:
    from nbmem.estimation.cudnn_rnn import features

    return [float(np.dot(features(r["layers"], r["steps"], r["batch"], r["hidden"], r["inputs"]), coef))
            / r["workspace"] - 1 for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    data = json.loads(SOURCE.read_text())
    groups: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for row in filter(usable, data["rows"]):
        # the probe's "fp16" steps ran without autocast (it enabled autocast for bf16 only): fp32 steps
        precision = "fp32" if row["precision"] == "fp16" else row["precision"]
        groups[row["kind"].lower(), precision, row["hidden"]].append(row)
    held, whole, table = [], [], {}
    rng = random.Random(1)
    for key, rows in sorted(groups.items()):
        shuffled = rows[:]
        rng.shuffle(shuffled)
        cut = int(len(shuffled) * 0.7)
        held += errors(shuffled[cut:], fit(shuffled[:cut]))
        table[key] = fit(rows)
        whole += errors(rows, table[key])
    for name, values in (("held out (fitted on 70 %)", held), ("all, fitted on all", whole)):
        q = np.percentile(values, [0, 5, 50, 95, 100])
        print(f"{name}: {len(values)} steps; min {q[0]:+.1%}, 5 % {q[1]:+.1%}, median {q[2]:+.1%}, "
              f"95 % {q[3]:+.1%}, max {q[4]:+.1%}")
    if args.write:
        lines = [f'"""cuDNN RNN workspace model fitted by benchmarks/fit_cudnn_rnn.py to an H100\'s sizes ({data["device"]},',
                 f'torch {data["torch"]}, cuDNN {data["cudnn"]}, {data["date"]}). Generated: do not edit."""', "",
                 "#: (kind, precision, hidden) -> coefficients of nbmem.estimation.cudnn_rnn.features",
                 "WORKSPACE: dict[tuple[str, str, int], tuple[float, ...]] = {"]
        lines += [f"    {key!r}: {tuple(coef)!r}," for key, coef in table.items()]
        lines.append("}")
        TARGET.write_text("\n".join(lines) + "\n")
        print("wrote", TARGET.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
