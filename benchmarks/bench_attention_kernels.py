"""Which attention kernel the H100 ran: the campaign's Llama steps estimated with a fused kernel and with the math one.

nbmem estimates ``scaled_dot_product_attention`` as a fused kernel, which
keeps no attention matrix (``nbmem.estimation.attention``). With no mask,
Hugging Face's sdpa path passes ``enable_gqa=True`` for a grouped-query
model (transformers/integrations/sdpa_attention.py, ``use_gqa_in_sdpa``):
the small Llama of the GPU campaign has 8 query heads and 4 key/value
heads. With torch 2.11, in fp32, none of CUDA's fused kernels accepts that:
flash and cuDNN take no fp32, and memory-efficient attention took no
grouped-query input before pytorch/pytorch#191085 (July 2026); PyTorch then
runs its math kernel, which keeps the attention matrix and its softmax for
backward. In bf16, flash attention takes it.

This script estimates the campaign's Llama steps (2026-11-25, H100, torch
2.11: ``results/2026-11-25-gpu/campaign-run4-zoo.json``) twice, for the
``H100-80GB`` preset: as nbmem does, and with every fp32 attention call
run as PyTorch's math kernel (``aten._scaled_dot_product_attention_math``,
``is_causal`` and no mask, as on the GPU), and compares both with the
allocator's peak. Bytes, not times.

    python benchmarks/bench_attention_kernels.py [--json results/DATE-attention-kernels-cpu.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from _environment import environment, write_json

CAMPAIGN = Path(__file__).resolve().parent / "results" / "2026-11-25-gpu" / "campaign-run4-zoo.json"
MATH = torch.ops.aten._scaled_dot_product_attention_math.default


def _as_math(fused: Any) -> Any:
    """FusedAttention's kernel, with fp32 calls run as the math kernel, causal and without the mask."""

    def kernel(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args[0].dtype != torch.float32:
            return fused(self, *args, **kwargs)
        self.calls += 1
        query, key, value = args[:3]
        kwargs = {name: value for name, value in kwargs.items() if name in ("scale", "enable_gqa")}
        return MATH(query, key, value, None, 0.0, True, **kwargs)[0]

    return kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()

    from gpu_campaign import _zoo

    from nbmem.estimation.attention import FusedAttention
    from nbmem.estimation.estimate import estimate

    campaign = json.loads(CAMPAIGN.read_text())
    build, make = _zoo()["llama (4 layers, 512)"]
    rows = []
    for old in campaign["sections"]["zoo"]["rows"]:
        if not old["model"].startswith("llama"):
            continue
        knobs = dict(batch_size=old["batch"], precision=old["precision"], checkpointing=old["checkpointing"],
                     optimizer=old["optimizer"])
        fused = estimate(build, make, device="H100-80GB", **knobs).peak
        with mock.patch.object(FusedAttention, "_kernel", _as_math(FusedAttention._kernel)):
            math = estimate(build, make, device="H100-80GB", **knobs).peak
        row = {**knobs, "measured": old["measured"], "fused": fused, "math": math,
               "fused_error": round((fused - old["measured"]) / old["measured"], 4),
               "math_error": round((math - old["measured"]) / old["measured"], 4)}
        rows.append(row)
        print(f"llama {old['precision']:5} {old['optimizer']:12} measured {row['measured']:,} B  fused {fused:,} B "
              f"({row['fused_error']:+.2%})  math {math:,} B ({row['math_error']:+.2%})")
    write_json(args.json, {**environment("transformers"), "campaign": str(CAMPAIGN.name), "rows": rows})


if __name__ == "__main__":
    main()
