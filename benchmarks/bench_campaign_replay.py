"""Today's estimates against the H100's measured peaks (issue 24's acceptance, as far as real CUDA figures go).

The GPU campaign of 2026-11-25 (``results/2026-11-25-gpu/campaign-run4-zoo.json``)
measured 31 training steps of its model zoo on an H100 (torch 2.11,
transformers 5.17): the allocator's own peak allocated and peak reserved.
Those figures don't move; nbmem's estimates do. This script estimates every
one of those configurations again, with today's code on this CPU, for the
``H100-80GB`` preset, and compares:

- allocated: the estimate's ``peak`` against ``torch.cuda.max_memory_allocated``
  (relative to what was allocated before the step);
- reserved: the estimate's ``reserved`` against the allocator's reserved peak.

The campaign's own estimate (made on the GPU that day) is shown beside
today's. Versions differ from the campaign's (torch, transformers): the
report says which ran here.

    python benchmarks/bench_campaign_replay.py [--json results/DATE-campaign-replay-cpu.json] [--only lstm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from _environment import environment, write_json

CAMPAIGN = Path(__file__).resolve().parent / "results" / "2026-11-25-gpu" / "campaign-run4-zoo.json"
MiB = 1024**2


def relative(found: int | None, truth: int | None) -> float | None:
    return None if found is None or not truth else (found - truth) / truth


def summary(errors: list[float | None]) -> dict[str, Any]:
    known = [abs(e) for e in errors if e is not None]
    if not known:
        return {"n": 0}
    return {"n": len(known), "median": round(statistics.median(known), 4), "worst": round(max(known), 4),
            "within 5 %": sum(e <= 0.05 for e in known), "within 2 %": sum(e <= 0.02 for e in known)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--only", help="only the models whose name contains this")
    args = parser.parse_args()

    from gpu_campaign import _zoo

    from nbmem.estimation.estimate import estimate

    campaign = json.loads(CAMPAIGN.read_text())
    report: dict[str, Any] = environment("transformers")
    report["campaign"] = {"file": str(CAMPAIGN.relative_to(CAMPAIGN.parents[2])), "date": campaign["date"],
                          "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "transformers": "5.17.0"}
    models = _zoo()
    rows = []
    for old in campaign["sections"]["zoo"]["rows"]:
        if args.only and args.only not in old["model"]:
            continue
        build, make = models[old["model"]]
        knobs = dict(batch_size=old["batch"], precision=old["precision"], checkpointing=old["checkpointing"],
                     optimizer=old["optimizer"])
        started = time.perf_counter()
        result = estimate(build, make, device="H100-80GB", **knobs)
        row = {**{key: old[key] for key in ("model", "batch", "precision", "checkpointing", "optimizer")},
               "measured": old["measured"], "measured_reserved": old["measured_reserved"],
               "campaign_estimate": old["estimated"], "estimate": result.peak,
               "reserved_with_workspaces": result.reserved_with_workspaces,
               "campaign_estimate_reserved": old["estimated_reserved"], "estimate_reserved": result.reserved,
               "seconds": round(time.perf_counter() - started, 2)}
        row["error"] = relative(row["estimate"], row["measured"])
        row["campaign_error"] = relative(row["campaign_estimate"], row["measured"])
        row["reserved_error"] = relative(row["estimate_reserved"], row["measured_reserved"])
        row["campaign_reserved_error"] = relative(row["campaign_estimate_reserved"], row["measured_reserved"])
        rows.append(row)
        print(f"{row['model']:24} b{row['batch']} {row['precision']:5} ckpt={row['checkpointing']!s:5} "
              f"{row['optimizer']:12} measured {row['measured'] / MiB:8.2f} MiB  estimate {row['estimate'] / MiB:8.2f} "
              f"({row['error']:+.2%}, campaign {row['campaign_error']:+.2%})  reserved "
              f"{row['estimate_reserved'] / MiB:7.1f} vs {row['measured_reserved'] / MiB:7.1f} "
              f"({row['reserved_error']:+.2%}, campaign {row['campaign_estimate_reserved'] / MiB:.1f})", flush=True)
    report["rows"] = rows
    moved = [f"{row['model']} {row['precision']} checkpointing={row['checkpointing']} {row['optimizer']}: allocated "
             f"{row['estimate'] - row['campaign_estimate']:+,} B, reserved "
             f"{row['estimate_reserved'] - row['campaign_estimate_reserved']:+,} B" for row in rows
             if (row["estimate"], row["estimate_reserved"]) != (row["campaign_estimate"], row["campaign_estimate_reserved"])]
    report["moved since the campaign"] = moved
    print(f"{len(rows) - len(moved)} of {len(rows)} estimates equal the campaign's to the byte; moved:", *moved, sep="\n  ")
    for label, key in (("allocated, today", "error"), ("allocated, campaign", "campaign_error"),
                       ("reserved, today", "reserved_error"), ("reserved, campaign", "campaign_reserved_error")):
        report[label] = summary([row[key] for row in rows])
        print(label, report[label])
    write_json(args.json, report)


if __name__ == "__main__":
    main()
