"""Fit and check cuDNN's convolution workspaces (nbmem/estimation/cudnn_conv.py) against an H100's 1,962 steps.

Reads ``results/2026-11-27-gpu/conv_sizes.json`` (``gpu_probe_conv_sizes.py``: every allocation of one training step
of ``nn.Conv2d(C, K, k, stride=s, padding=k // 2)``, ``model(x).float().pow(2).mean()`` then backward, torch 2.11,
cuDNN 9.19, ``cudnn.benchmark`` off). For each step it lays the allocations the step must make (autocast's casts,
the output, ``.float()``, ``pow``, the loss, their backward, the gradients and their casts) against the recorded
ones: what is left in the three places cuDNN runs (after the output; between the input's gradient and the
weight's; between the weight's and the bias's) is its workspace: forward, backward-data, backward-filter.

Then, on a 70/30 split (seed 0): for each class (kernel 1 or larger, stride, fp32 or autocast) and kernel, the rule
fitted on the 70 % (when none: 3 input channels, a threshold on log2 of the layer's work; its size: a median
multiple of the copies of the tensors it touches, backward-filter's split partial sums for a 1x1 kernel), printed
beside nbmem's table (``_RULES``: a helper session's hand-rounded fit of the same kind, which differs from this one
in three entries, the held-out figures the same with either); and on the other 30 %, how near nbmem's
workspaces come, each and at the step's peak. The probe recorded which allocations a phase freed, not when: the
step's peak is replayed in the order the step frees them (the forward's output after ``.float()``, ``pow``'s
gradients as its node ends, the casts' gradients once accumulated), with the parameters, the input and their
gradients alive throughout.

    python benchmarks/fit_cudnn_conv.py
"""
from __future__ import annotations

import collections
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SOURCE = ROOT / "benchmarks/results/2026-11-27-gpu/conv_sizes.json"
KERNELS = ("forward", "data", "filter")


def shapes(row: dict) -> dict[str, int]:
    n, c, k_out, h, k, s = row["batch"], row["inputs"], row["outputs"], row["image"], row["kernel"], row["stride"]
    ho = (h + 2 * (k // 2) - k) // s + 1
    e = 4 if row["precision"] == "fp32" else 2
    return dict(N=n, C=c, K=k_out, k=k, s=s, Ho=ho, x32=n * c * h * h * 4, w32=k_out * c * k * k * 4, b32=k_out * 4,
                x=n * c * h * h * e, w=k_out * c * k * k * e, b=k_out * e, y=n * k_out * ho * ho * e,
                y32=n * k_out * ho * ho * 4)


def extract(row: dict) -> dict[str, Any]:
    """The step's workspaces ([sizes] for forward, data, filter) and the loss's and bias's reduction buffers."""
    size = shapes(row)
    autocast = row["precision"] != "fp32"
    forward, backward = row["forward"], row["backward"]
    found: dict[str, Any] = {"clean": True}
    assert row["ops"][0][1][0] == size["y"] and row["ops"][1][1] == [size["x"], size["w"], size["b"]]
    i = 0
    for expected in ([[size["b"], True], [size["w"], False], [size["x"], False]] if autocast else []):
        found["clean"] &= forward[i] == expected
        i += 1
    found["clean"] &= forward[i] == [size["y"], autocast]
    i += 1
    after = [[size["y32"], False], [size["y32"], True]] if autocast else [[size["y32"], True]]
    j = i
    while j < len(forward) and not (forward[j:j + len(after)] == after and forward[j + len(after):j + len(after) + 1] == [[4, False]]):
        j += 1
    found["forward"], found["loss"] = forward[i:j], forward[j + len(after) + 1:]
    found["clean"] &= j < len(forward)
    i = 0
    for expected in [[4, True]] + [[size["y32"], True]] * 4 + ([[size["y"], True]] if autocast else []) + [[size["x"], True]]:
        found["clean"] &= i < len(backward) and backward[i] == expected
        i += 1
    j = i
    while j < len(backward) and backward[j] != [size["w"], True]:
        j += 1
    found["data"] = backward[i:j]
    i = j = j + 1
    while j < len(backward) and backward[j] != [size["b"], True]:
        j += 1
    found["filter"] = backward[i:j]
    found["bias"] = backward[j + 1:len(backward) - (3 if autocast else 0)]
    found["clean"] &= j < len(backward)
    for key in ("forward", "data", "filter", "loss", "bias"):
        found["clean"] &= all(freed for _, freed in found[key])
        found[key] = [nbytes for nbytes, _ in found[key]]
    return found


def _block(nbytes: int) -> int:
    return -(-nbytes // 512) * 512 if nbytes > 0 else 0


def peak(row: dict, found: dict, workspaces: dict[str, list[int]]) -> int:
    """The step's peak with these workspaces, the parameters, input and their gradients alive throughout."""
    size = shapes(row)
    autocast = row["precision"] != "fp32"
    live: dict[int, int] = {}
    keys = itertools.count()
    now = top = 2 * sum(_block(size[name]) for name in ("x32", "w32", "b32"))

    def take(nbytes: int) -> int:
        nonlocal now, top
        key = next(keys)
        live[key] = _block(nbytes)
        now += live[key]
        top = max(top, now)
        return key

    def free(key: int) -> None:
        nonlocal now
        now -= live.pop(key)

    def transient(sizes: list[int]) -> None:
        for nbytes in sizes:
            free(take(nbytes))

    casts = [take(size[name]) for name in ("b", "w", "x")] if autocast else []
    output = take(size["y"])
    transient(workspaces["forward"])
    upcast = take(size["y32"]) if autocast else output
    if autocast:
        free(output)
    squared, loss = take(size["y32"]), take(4)
    transient(found["loss"])
    free(squared)
    if autocast:
        free(casts[0])  # autocast's cache of the bias cast goes at its exit
    one = take(4)
    first = take(size["y32"])
    free(one)
    second, third = take(size["y32"]), take(size["y32"])
    free(second)
    fourth = take(size["y32"])
    free(third), free(first), free(upcast)  # pow's node done: its saved input goes
    incoming = take(size["y"]) if autocast else fourth
    if autocast:
        free(fourth)
    grads = [take(size["x"])]
    transient(workspaces["data"])
    grads.append(take(size["w"]))
    transient(workspaces["filter"])
    grads.append(take(size["b"]))
    transient(found["bias"])
    free(incoming)
    for index, grad in enumerate(grads):
        if autocast:
            if index == 0:
                free(casts[1]), free(casts[2])
            free(take(size[("x32", "w32", "b32")[index]]))  # the cast back, accumulated in place into .grad
        free(grad)
    free(loss)
    return top


def work(row: dict) -> int:
    size = shapes(row)
    return size["N"] * size["Ho"] ** 2 * size["C"] * size["K"] * size["k"] ** 2


def ours(row: dict) -> dict[str, list[int]]:
    from nbmem.estimation.cudnn_conv import workspaces

    size = shapes(row)
    found = workspaces(size["C"], size["K"], size["k"] ** 2, size["s"], x=size["x"], y=size["y"], w=size["w"],
                       work=work(row), rows=size["N"] * size["Ho"] ** 2, fp32=row["precision"] == "fp32")
    return {kernel: [nbytes] if nbytes else [] for kernel, nbytes in zip(KERNELS, found)}


def fit(rows: list[dict]) -> dict[tuple[bool, int, bool, str], tuple[bool, float, float]]:
    """Per class and kernel: (none with 3 input channels, log2-work threshold, median multiple of the copies: of the
    input, output and weight for a kernel larger than 1, of the input and output for a 1x1 one at stride 2, of the
    weight in fp32 for a 1x1 one's backward-filter at stride 1, the partial sums)."""
    groups: dict[tuple[bool, int, bool, str], list[dict]] = collections.defaultdict(list)
    for row in rows:
        for kernel in KERNELS:
            groups[row["kernel"] > 1, row["stride"], row["precision"] == "fp32", kernel].append(row)
    table = {}
    for key, members in sorted(groups.items()):
        kernel = key[3]
        none = np.array([sum(row["found"][kernel]) <= 4096 for row in members])
        three = np.array([row["inputs"] == 3 for row in members])
        logs = np.array([math.log2(work(row)) for row in members])
        by_three = bool(three.any() and none[three].mean() > 0.5)
        rest = ~three if by_three else np.ones(len(members), bool)
        threshold, misses = 0.0, int(none[rest].sum())  # no threshold: every one of them given a workspace
        for candidate in np.unique(logs[rest]):
            wrong = int(((logs[rest] < candidate) != none[rest]).sum())
            if wrong < misses:
                threshold, misses = float(candidate), wrong
        copies = ((lambda s: s["x"] + s["y"] + s["w"]) if key[0] else (lambda s: s["x"] + s["y"]) if key[1] == 2
                  else (lambda s: s["w32"] if kernel == "filter" else 0))
        kept = [row for row, is_none, is_three, log in zip(members, none, three, logs)
                if not ((by_three and is_three) or log < threshold) and copies(shapes(row)) > 0]
        multiple = float(np.median([sum(row["found"][kernel]) / copies(shapes(row)) for row in kept])) if kept else 0.0
        table[key] = (by_three, round(threshold, 1), round(multiple, 3))
    return table


def report(name: str, values: list[float]) -> str:
    q = np.percentile(np.array(values) * 100, [0, 5, 25, 50, 75, 95, 100])
    return f"{name}: " + ", ".join(f"{p} % {v:+.1f}" for p, v in zip(("min", 5, 25, 50, 75, 95, "max"), q))


def main() -> int:
    data = json.loads(SOURCE.read_text())
    rows = data["rows"]
    for row in rows:
        row["found"] = extract(row)
    clean = sum(row["found"]["clean"] for row in rows)
    print(f"{len(rows)} steps ({data['device']}, torch {data['torch']}, cuDNN {data['cudnn']}); laid out cleanly: {clean}")
    larger = [row for row in rows if row["kernel"] > 1]
    for kernel in KERNELS:  # the copies regime: one allocation of the input, output and weight, and under 512 B more
        copies = sum(len(row["found"][kernel]) == 1 and 0 <= row["found"][kernel][0] - sum(
            shapes(row)[name] for name in ("x", "y", "w")) < 512 for row in larger)
        print(f"{kernel}: {copies} of the {len(larger)} calls with a kernel larger than 1 took x + y + w (+ < 512 B)")
    order = np.random.default_rng(0).permutation(len(rows))
    cut = int(0.7 * len(rows))
    train, test = [rows[i] for i in order[:cut]], [rows[i] for i in order[cut:]]
    print("fitted on 70 % (kernel > 1, stride, fp32, kernel): (none with 3 channels, log2-work threshold, multiple)")
    from nbmem.estimation.cudnn_conv import _RULES

    for key, rule in fit(train).items():
        print(f"  {key}: {rule}; nbmem's: {_RULES[key[:3]][KERNELS.index(key[3])]}")
    for name, chosen in (("held out (30 %)", test), ("all", rows)):
        print(f"{name}: {len(chosen)} steps")
        for kernel in KERNELS:
            pairs = [(sum(ours(row)[kernel]), sum(row["found"][kernel])) for row in chosen]
            taken = [(mine, truth) for mine, truth in pairs if truth > 4096]
            near = sum(abs(mine - truth) <= 0.1 * truth for mine, truth in taken) / len(taken)
            none = [mine for mine, truth in pairs if truth <= 4096]
            print(f"  {kernel}: of {len(taken)} calls with a workspace, {near:.0%} within 10 %; "
                  f"of {len(none)} with none, {sum(m == 0 for m in none) / len(none):.0%} given none")
        truth = np.array([peak(row, row["found"], {k: row["found"][k] for k in KERNELS}) for row in chosen], float)
        without = np.array([peak(row, row["found"], {k: [] for k in KERNELS}) for row in chosen], float)
        mine = np.array([peak(row, row["found"], ours(row)) for row in chosen], float)
        print("  " + report("step's peak without workspaces", list(without / truth - 1)))
        print("  " + report("step's peak with nbmem's", list(mine / truth - 1)))
        print(f"  more than 5 % low: {np.mean(without / truth < 0.95):.1%} without, {np.mean(mine / truth < 0.95):.1%} "
              f"with; more than 5 % high with them: {np.mean(mine / truth > 1.05):.1%} (25 %: "
              f"{np.mean(mine / truth > 1.25):.1%}); within 5 %: {np.mean(abs(mine / truth - 1) <= 0.05):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
