"""Fit cuDNN's RNN workspace sizes measured on an H100 into nbmem/estimation/cudnn_rnn_fit.py (a generated table).

Reads ``results/2026-11-27-gpu/rnn_sizes.json`` (``gpu_probe_rnn_sizes.py``: 1,751 LSTM/GRU training steps, torch
2.11, cuDNN 9.19) and misses-first.json's 72 traced ones, each read in the precision cuDNN computed in (their
"bf16" ran under bf16 autocast, which runs cuDNN's RNN in fp16; the sweep's "fp16" ran without autocast, in fp32).
For each (kind, precision, hidden size) a linear model in the layers, batch, steps and input size, fitted for
relative error; an LSTM on cuDNN's persistent kernel a model of its own. Prints the errors of a 70/30 split (fitted
on 70 %, checked on the other 30 %) and of the whole, then writes the table fitted on all.

LSTMs with projections (``proj_size``) take another workspace: ``rnn_variants.json``'s 64 steps (``--variants``:
projection 64, hidden 128 and 512, one direction, no dropout) fitted alike for each (precision, hidden size), and
checked by leaving each step out in turn (16 steps a fit: a 70/30 split leaves too few).

    python benchmarks/fit_cudnn_rnn.py [--write]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SOURCE = ROOT / "benchmarks/results/2026-11-27-gpu/rnn_sizes.json"
TARGET = ROOT / "nbmem/estimation/cudnn_rnn_fit.py"


def traced_workspace(forward: list[list[Any]], backward: list[list[Any]], output: int) -> int | None:
    """cuDNN's RNN workspace in one traced step (``[bytes, freed]`` for each allocation of forward and of backward):
    the largest allocation forward freed that backward took twice (backward-data's and backward-weights'), other
    than the output's size or twice it (the loss's own buffers)."""
    twice = Counter(size for size, _ in backward)
    taken = [size for size, freed in forward if freed and twice[size] >= 2 and size not in (output, 2 * output)]
    return max(taken) if taken else None


def usable(row: dict) -> bool:
    """A workspace found: larger than a few hidden states (the probe took a state's copy for it where cuDNN took
    none it could tell apart, all hidden 192 and some batch-1 steps)."""
    return row["workspace"] > 8 * row["layers"] * row["batch"] * row["hidden"] * 4 and row["hidden"] != 192


def measured() -> list[dict]:
    """rnn_sizes.json's steps and misses-first.json's traced ones, each with the precision cuDNN computed in: the
    probes' "bf16" ran under bf16 autocast, which runs cuDNN's RNN in fp16 (AutocastRNN.cpp casts to fp16 whatever
    autocast's dtype: rnn_autocast.log); rnn_sizes.json's "fp16" ran without autocast, in fp32."""
    rows = json.loads(SOURCE.read_text())["rows"]
    for row in json.loads((SOURCE.parent / "misses-first.json").read_text())["items"]["rnn"]["value"]["rows"]:
        found = traced_workspace(row["forward"], row["backward"], row["ops"][0][1][0])
        rows.append({**{key: row[key] for key in ("kind", "hidden", "layers", "batch", "steps", "precision")},
                     "inputs": row["hidden"], "workspace": found, "traced": True})
    return [{**row, "kind": row["kind"].lower(),
             "precision": {"bf16": "fp16", "fp16": "fp32"}.get(row["precision"], row["precision"])
             if not row.get("traced") else {"bf16": "fp16"}.get(row["precision"], row["precision"])} for row in rows]


def projected() -> list[dict]:
    """rnn_variants.json's LSTM steps with projections, in the precision cuDNN computed in ("bf16": autocast, fp16)."""
    rows = json.loads((SOURCE.parent / "rnn_variants.json").read_text())["rows"]
    return [{**row, "kind": "lstm", "precision": {"bf16": "fp16"}.get(row["precision"], row["precision"])}
            for row in rows if row["proj"]]


def fit(rows: list[dict], features: Any) -> list[float]:
    x = np.array([features(r["layers"], r["steps"], r["batch"], r["hidden"], r["inputs"]) for r in rows], float)
    y = np.array([r["workspace"] for r in rows], float)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    return [round(float(c), 3) for c in coef]


def errors(rows: list[dict], coef: list[float], features: Any) -> list[float]:
    return [float(np.dot(features(r["layers"], r["steps"], r["batch"], r["hidden"], r["inputs"]), coef))
            / r["workspace"] - 1 for r in rows]


def report(name: str, values: list[float]) -> None:
    q = np.percentile(values, [0, 5, 50, 95, 100])
    print(f"{name}: {len(values)} steps; min {q[0]:+.1%}, 5 % {q[1]:+.1%}, median {q[2]:+.1%}, "
          f"95 % {q[3]:+.1%}, max {q[4]:+.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from nbmem.estimation.cudnn_rnn import features, persistent, persistent_features

    data = json.loads(SOURCE.read_text())
    groups: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    persists: list[dict] = []
    for row in filter(usable, measured()):
        if persistent(row["kind"], row["layers"], row["hidden"], row["inputs"], row["batch"], row["steps"],
                      row["precision"], 1, None):
            persists.append(row)  # cuDNN's persistent kernel: a fit of its own
        else:
            groups[row["kind"], row["precision"], row["hidden"]].append(row)
    held, whole, table = [], [], {}
    rng = random.Random(1)
    for key, rows in sorted(groups.items()):
        shuffled = rows[:]
        rng.shuffle(shuffled)
        cut = int(len(shuffled) * 0.7)
        held += errors(shuffled[cut:], fit(shuffled[:cut], features), features)
        table[key] = fit(rows, features)
        whole += errors(rows, table[key], features)
    report("held out (fitted on 70 %)", held)
    report("all, fitted on all", whole)
    persist = fit(persists, persistent_features)
    report("LSTM's persistent kernel (fp16, one layer), fitted on all", errors(persists, persist, persistent_features))
    projections: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for row in projected():
        projections[row["precision"], row["hidden"]].append(row)
    left_out, projection_table = [], {}
    for key, rows in sorted(projections.items()):
        left_out += [errors([row], fit(rows[:i] + rows[i + 1:], features), features)[0] for i, row in enumerate(rows)]
        projection_table[key] = fit(rows, features)
    report("LSTM projections, each step left out of its fit", left_out)
    report("LSTM projections, fitted on all",
           [e for key, rows in projections.items() for e in errors(rows, projection_table[key], features)])
    if args.write:
        device = data["device"]
        lines = [f'"""cuDNN RNN workspace model fitted by benchmarks/fit_cudnn_rnn.py to an H100\'s sizes ({device},',
                 f'torch {data["torch"]}, cuDNN {data["cudnn"]}, {data["date"]}). Generated: do not edit."""', "",
                 "#: (kind, precision, hidden) -> coefficients of nbmem.estimation.cudnn_rnn.features",
                 "WORKSPACE: dict[tuple[str, str, int], tuple[float, ...]] = {"]
        lines += [f"    {key!r}: {tuple(coef)!r}," for key, coef in table.items()]
        lines += ["}", "", "#: an LSTM's persistent kernel (fp16, one layer): coefficients of "
                  "nbmem.estimation.cudnn_rnn.persistent_features",
                  f"PERSISTENT: tuple[float, ...] = {tuple(persist)!r}", "",
                  "#: an LSTM with projections (measured with proj_size 64, one direction, no dropout): (precision,",
                  "#: hidden) -> coefficients of nbmem.estimation.cudnn_rnn.features",
                  "PROJECTED: dict[tuple[str, int], tuple[float, ...]] = {"]
        lines += [f"    {key!r}: {tuple(coef)!r}," for key, coef in projection_table.items()]
        lines += ["}"]
        TARGET.write_text("\n".join(lines) + "\n")
        print("wrote", TARGET.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
