"""What leaving the step counters on the host costs an estimate: with and without it, interleaved.

``nbmem.estimation.optimizers.HostStepCounters`` adds a global optimizer step
pre-hook while an estimate runs and a TorchFunctionMode around each
optimizer's ``_init_group``. This script estimates the same steps (the GPU
campaign's GPT-2 and BERT with AdamW, a 64-tensor MLP with Adam's per-tensor
loop) with it and with a do-nothing stand-in, alternating, and reports each
configuration's best-of-N wall time and the ratio. Only the ratio matters
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
        pass

    def __exit__(self, *exc: object) -> None:
        return None


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
                patch = (contextlib.nullcontext() if label == "hosted"
                         else mock.patch("nbmem.estimation.estimate.HostStepCounters", _Nothing))
                with patch:
                    started = time.perf_counter()
                    result = estimate(build, make, batch_size=8, **knobs)
                    times[label].append(time.perf_counter() - started)
                peaks[label] = result.peak
        row = {"model": name, **knobs, "seconds_hosted": round(min(times["hosted"]), 4),
               "seconds_counted": round(min(times["counted"]), 4),
               "ratio": round(min(times["hosted"]) / min(times["counted"]), 3),
               "peak_hosted": peaks["hosted"], "peak_counted": peaks["counted"],
               "counters_bytes": peaks["counted"] - peaks["hosted"]}
        rows.append(row)
        print(f"{name:26} hosted {row['seconds_hosted']:.3f} s  counted {row['seconds_counted']:.3f} s  "
              f"ratio {row['ratio']:.3f}  counters {row['counters_bytes']:,} B")
    write_json(options.json, {**environment("transformers"), "repeat": options.repeat, "rows": rows})


if __name__ == "__main__":
    main()
