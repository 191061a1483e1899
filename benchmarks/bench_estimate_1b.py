"""Estimate a ~1-billion-parameter GPT-style model on fake tensors: time and RAM.

Run: python benchmarks/bench_estimate_1b.py [--json FILE]
Issue 4's target: under 30 s, under 2 GiB of RAM (peak resident set size of
this process, which includes importing torch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import time

import torch
from torch import nn

import nbmem

from _environment import write_json


class GPT(nn.Module):
    """Decoder-only, pre-norm: embedding, n x TransformerEncoderLayer (causal), head."""

    def __init__(self, vocab: int = 50304, width: int = 2048, layers: int = 20, heads: int = 16, context: int = 1024) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(hidden, mask=mask, is_causal=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--json")
    args = parser.parse_args()
    make = lambda n: (torch.randint(0, 50304, (n, args.sequence)), torch.randint(0, 50304, (n, args.sequence)))  # noqa: E731
    start = time.perf_counter()
    result = nbmem.estimate(GPT, make, batch_size=args.batch_size, precision="bf16", optimizer="adamw", device="24GiB")
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.platform()}",
        "torch": torch.__version__,
        "nbmem": nbmem.__version__,
        "parameters": result.parameters,
        "batch_size": args.batch_size,
        "sequence": args.sequence,
        "seconds": seconds,
        "max_rss_bytes": rss,
        "estimated_peak_bytes": result.peak,
        "first_step": result.first_step,
        "steady": result.steady,
        "breakdown": dict(result.breakdown.at_peak),
    }
    print(result)
    print(json.dumps(report, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
