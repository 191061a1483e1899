"""Real trials to find the largest batch that fits: nbmem.max_batch_size vs doubling-then-bisect.

Run: python benchmarks/bench_max_batch.py [--json FILE]

Lightning's batch size finder (mode="binsearch") starts at 2, doubles until a
trial runs out of memory, then bisects between the last success and the
failure. nbmem predicts from fake-tensor estimates and verifies around the
prediction. Both run their real trials the same way here: the training step
tracked on this CPU against a virtual device, so the answers can be compared
and only the number of real trials differs. Real trials are what cost time
(and, on a GPU, crashes).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform

import torch
from torch import nn

import nbmem
from nbmem.estimation.estimate import estimate

from _environment import write_json


def lightning_binsearch(fits, start: int = 2, limit: int = 1 << 16) -> tuple[int, int]:
    """(answer, trials) of doubling from ``start`` then bisecting, as Lightning's binsearch mode does."""
    trials = 0
    low, size = 0, start
    while size <= limit:
        trials += 1
        if not fits(size):
            break
        low, size = size, size * 2
    else:
        return low, trials
    high = size
    while high - low > 1:
        middle = (low + high) // 2
        trials += 1
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, trials


WORKLOADS = {
    "mlp 512-2048-512, cross-entropy, adamw, 256MiB": (
        lambda: nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)),
        lambda n: (torch.randn(n, 512), torch.randint(0, 512, (n,))),
        "256MiB",
    ),
    "mlp 512-2048-512, MSE (CPU kernel quirk), adamw, 256MiB": (
        lambda: nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512)),
        lambda n: (torch.randn(n, 512), torch.randn(n, 512)),
        "256MiB",
    ),
    "cnn 2 conv+bn 32x32, adamw, 256MiB": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 10),
        ),
        lambda n: (torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))),
        "256MiB",
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for name, (build, make, device) in WORKLOADS.items():
        found = nbmem.max_batch_size(build, make, device=device)

        def fits(size: int) -> bool:
            try:
                # as on a GPU: out of memory when the tensors exceed the device, or when
                # the caching allocator can't reserve a segment they need (simulated here)
                return bool(estimate(build, make, batch_size=size, mode="tracked", device=device,
                                     enforce_capacity=True).fits)
            except torch.OutOfMemoryError:
                return False
            finally:
                gc.collect()

        answer, trials = lightning_binsearch(fits)
        rows.append(
            {
                "workload": name,
                "nbmem_answer": found.batch_size,
                "nbmem_predicted": found.predicted,
                "nbmem_real_trials": found.real_trials,
                "nbmem_estimates": found.estimates,
                "binsearch_answer": answer,
                "binsearch_real_trials": trials,
            }
        )
        print(rows[-1])
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.platform()}",
        "torch": torch.__version__,
        "nbmem": nbmem.__version__,
        "rows": rows,
    }
    write_json(args.json, report)


if __name__ == "__main__":
    main()
