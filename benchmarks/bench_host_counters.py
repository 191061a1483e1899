"""What leaving the step counters on the host costs an estimate and a tracked block: with and without it, interleaved.

``nbmem.tracking.host_counters.HostStepCounters`` adds a global optimizer step
pre-hook while an estimate or a tracked block on the CPU runs, and wraps each
optimizer's ``_init_group`` (a TorchFunctionMode around it while some state
is missing). This script estimates the same steps (the GPU campaign's GPT-2
and BERT with AdamW, a 64-tensor MLP with Adam's per-tensor loop) with it and
with a do-nothing stand-in, alternating; then tracks the user's own loop on
the same models (``nbmem.track()`` around five steps of a new optimizer, as
``%%gpumem`` would) both ways. It reports each configuration's best-of-N wall
time and the ratio. Only the ratio matters
(a busy 2-core machine moves both alike); the bytes are reported too, to show
what the counters were.

    python benchmarks/bench_host_counters.py [--repeat 5] [--json results/DATE-host-counters-cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any
from unittest import mock

import torch
from torch import nn

from _environment import environment, write_json


def _deep_mlp() -> nn.Module:
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(32)))  # 64 parameter tensors


def _configurations() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    from gpu_campaign import _zoo

    zoo = _zoo()
    found = {name: (*zoo[name], {"optimizer": "adamw"}) for name in ("gpt2 (6 layers, 512)", "bert (4 layers, 256)")
             if name in zoo}
    found["mlp (32 layers of 256)"] = (_deep_mlp, lambda n: (torch.randn(n, 256), torch.randn(n, 256)),
                                      {"optimizer": "adam", "foreach": False})
    return found


class _Nothing(contextlib.AbstractContextManager):
    def __init__(self, *args: Any) -> None:
        self.notes: list[str] = []

    def __exit__(self, *exc: object) -> None:
        return None


def _counters_hosted(hosted: bool) -> contextlib.AbstractContextManager[Any]:
    """As nbmem runs, or with a do-nothing stand-in for HostStepCounters: the estimate's own and its scope's (an
    estimate's tracked scope enters one too, with the same tracker)."""
    if hosted:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for where in ("nbmem.estimation.estimate.HostStepCounters", "nbmem.tracking.scope.HostStepCounters"):
        stack.enter_context(mock.patch(where, _Nothing))
    return stack


def _tracked_loops(repeat: int) -> list[dict[str, Any]]:
    """A tracked block around the user's own loop (``nbmem.track()``, as ``%%gpumem`` runs it): 5 steps of a new
    optimizer, the first making its state, with the counters hosted and with a do-nothing stand-in, interleaved."""
    import nbmem

    rows = []
    for name, (build, make, knobs) in _configurations().items():
        model = build()
        batch = make(8)
        optimizer_name = knobs["optimizer"]

        def loop() -> None:
            optimizer = (torch.optim.AdamW(model.parameters()) if optimizer_name == "adamw"
                         else torch.optim.Adam(model.parameters(), foreach=False))
            for _ in range(5):
                out = model(**batch) if isinstance(batch, dict) else model(batch[0])
                loss = out.loss if hasattr(out, "loss") else nn.functional.mse_loss(out, batch[1])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        times: dict[str, list[float]] = {"hosted": [], "counted": []}
        peaks: dict[str, int] = {}
        loop()  # warm
        for _ in range(repeat):
            for label in ("hosted", "counted"):
                with _counters_hosted(label == "hosted"):
                    started = time.perf_counter()
                    with nbmem.track("cpu", engine="dispatch") as scope:
                        loop()
                    times[label].append(time.perf_counter() - started)
                peaks[label] = scope.result.peak
        rows.append(_row(f"tracked {name}", times, peaks, {"block": "nbmem.track() around 5 steps", **knobs}))
    return rows


def _row(name: str, times: dict[str, list[float]], peaks: dict[str, int], knobs: dict[str, Any]) -> dict[str, Any]:
    """One configuration's best times, their ratio and the counters' bytes, printed as they come."""
    row = {"model": name.removeprefix("tracked "), **knobs, "seconds_hosted": round(min(times["hosted"]), 4),
           "seconds_counted": round(min(times["counted"]), 4),
           "ratio": round(min(times["hosted"]) / min(times["counted"]), 3),
           "peak_hosted": peaks["hosted"], "peak_counted": peaks["counted"],
           "counters_bytes": peaks["counted"] - peaks["hosted"]}
    print(f"{name:28} hosted {row['seconds_hosted']:.3f} s  counted {row['seconds_counted']:.3f} s  "
          f"ratio {row['ratio']:.3f}  counters {row['counters_bytes']:,} B")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    options = parser.parse_args()
    from nbmem.estimation.estimate import estimate

    rows = []
    for name, (build, make, knobs) in _configurations().items():
        times: dict[str, list[float]] = {"hosted": [], "counted": []}
        peaks: dict[str, int] = {}
        estimate(build, make, batch_size=8, **knobs)  # warm: imports, caches
        for _ in range(options.repeat):
            for label in ("hosted", "counted"):  # interleaved
                with _counters_hosted(label == "hosted"):
                    started = time.perf_counter()
                    result = estimate(build, make, batch_size=8, **knobs)
                    times[label].append(time.perf_counter() - started)
                peaks[label] = result.peak
        rows.append(_row(name, times, peaks, knobs))
    tracked = _tracked_loops(options.repeat)
    write_json(options.json, {**environment("transformers"), "repeat": options.repeat, "rows": rows,
                              "tracked": tracked})


if __name__ == "__main__":
    main()
