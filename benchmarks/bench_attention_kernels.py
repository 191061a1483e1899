"""Which attention kernel the H100 ran: the campaign's Llama steps estimated as nbmem does and with a fused kernel.

Without a mask, Hugging Face's sdpa path passes ``enable_gqa=True`` for a
grouped-query model (transformers/integrations/sdpa_attention.py,
``use_gqa_in_sdpa``): the small Llama of the GPU campaign has 8 query heads
and 4 key/value heads. With torch 2.11, in fp32, none of CUDA's fused kernels
accepts that: flash and cuDNN take no fp32, and memory-efficient attention
took no grouped-query input before pytorch/pytorch#191085 (July 2026);
PyTorch then runs its math kernel, which keeps the attention matrix and its
softmax for backward. In bf16, flash attention takes it.

nbmem's estimate (``nbmem.estimation.attention.FusedAttention``) now runs such
calls as the math kernel, and sees on fake tensors the mask a real run sees
(none here: the position ids the model makes are not packed). This script
estimates the campaign's Llama steps (2026-11-25, H100, torch 2.11:
``results/2026-11-25-gpu/campaign-run4-zoo.json``) for the ``H100-80GB``
preset as nbmem does, and with every call run as a fused kernel (PyTorch's
composite SDPA on the CPU, as nbmem did before), and compares both with the
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


def _all_fused(self: Any, *args: Any, **kwargs: Any) -> Any:
    """FusedAttention's kernel as it was: every call PyTorch's composite SDPA (a fused CPU kernel), no dropout."""
    self.calls += 1
    args = (*args[:4], 0.0, *args[5:]) if len(args) > 4 else args
    kwargs.pop("dropout_p", None)
    return torch.ops.aten.scaled_dot_product_attention.default.decompose(*args, **kwargs)


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
        nbmem_today = estimate(build, make, device="H100-80GB", **knobs).peak
        with mock.patch.object(FusedAttention, "_kernel", _all_fused):
            fused = estimate(build, make, device="H100-80GB", **knobs).peak
        row = {**knobs, "measured": old["measured"], "nbmem": nbmem_today, "fused": fused,
               "nbmem_error": round((nbmem_today - old["measured"]) / old["measured"], 4),
               "fused_error": round((fused - old["measured"]) / old["measured"], 4)}
        rows.append(row)
        print(f"llama {old['precision']:5} {old['optimizer']:12} measured {row['measured']:,} B  nbmem "
              f"{nbmem_today:,} B ({row['nbmem_error']:+.2%})  all fused {fused:,} B ({row['fused_error']:+.2%})")
    write_json(args.json, {**environment("transformers"), "campaign": str(CAMPAIGN.name), "rows": rows})


if __name__ == "__main__":
    main()
