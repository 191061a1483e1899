"""A formula calculator beside nbmem and the GPU: Hugging Face accelerate's ``estimate-memory`` (docs site, issue 28).

accelerate's estimator takes a model's parameter bytes and reports "Training
using Adam" as the largest of its parts (``estimate_training_usage``: for fp32,
4 x the model; for bf16/fp16 mixed precision, 2 x its fp32 size), whatever
the batch. Here it is computed, with accelerate's own function, for every
AdamW configuration of the H100 campaign's zoo
(``results/2026-11-25-gpu/campaign-run4-zoo.json``), beside nbmem's estimate
and the allocator's measured peak from that same run (batch 8 x 128 tokens
for the language models). The parameter bytes come from the same model
configurations built here (``gpu_campaign._zoo``): they depend on the
configuration only.

    python benchmarks/bench_formulas.py [--json results/DATE-formulas.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _environment import environment, write_json

RESULTS = Path(__file__).resolve().parent / "results" / "2026-11-25-gpu" / "campaign-run4-zoo.json"
MiB = 1024**2
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from gpu_campaign import _zoo

    report: dict[str, Any] = environment("accelerate", "transformers")
    models = _zoo()
    sizes: dict[str, int] = {}
    rows = []
    for row in json.loads(RESULTS.read_text())["sections"]["zoo"]["rows"]:
        if row["optimizer"] != "adamw" or not row.get("max_memory_allocated"):
            continue
        name = row["model"]
        if name not in sizes:
            sizes[name] = int(calculate_maximum_sizes(models[name][0]())[0])
        formula = max(estimate_training_usage(sizes[name], _DTYPES[row["precision"]]).values())
        measured = row["max_memory_allocated"]
        rows.append({"model": name, "precision": row["precision"], "checkpointing": row["checkpointing"],
                     "batch": row["batch"], "parameter_bytes": sizes[name], "accelerate": formula,
                     "nbmem": row["estimated"], "measured_h100": measured,
                     "accelerate_error": round(formula / measured - 1, 4),
                     "nbmem_error": round(row["estimated"] / measured - 1, 4)})
        print(f"{name:24} {row['precision']:5} ckpt={row['checkpointing']!s:5} measured {measured / MiB:8.1f} MiB | "
              f"nbmem {row['estimated'] / MiB:8.1f} ({rows[-1]['nbmem_error']:+.1%}) | accelerate "
              f"{formula / MiB:8.1f} ({rows[-1]['accelerate_error']:+.1%})")
    report["rows"] = rows

    def median(values: list[float]) -> float:
        ordered = sorted(abs(value) for value in values)
        return ordered[len(ordered) // 2]

    report["summary"] = {
        "configurations": len(rows),
        "nbmem_median_abs_error": median([row["nbmem_error"] for row in rows]),
        "accelerate_median_abs_error": median([row["accelerate_error"] for row in rows]),
        "nbmem_within_5_percent": sum(abs(row["nbmem_error"]) <= 0.05 for row in rows),
        "accelerate_within_5_percent": sum(abs(row["accelerate_error"]) <= 0.05 for row in rows),
    }
    print(report["summary"])
    write_json(args.json, report)


if __name__ == "__main__":
    main()
