"""Issue 25's numbers: a 7B QLoRA estimate in <= 5 s and < 1 GiB of host memory on a 2-core machine; 70B in <= 30 s.

Each case runs in a fresh process (its peak resident memory is its own), three times; the median wall time and the
largest peak RSS are recorded, with the machine, versions and date, to benchmarks/results/ (a JSON file named on the
command line). The recipe: nf4 with double quantization, LoRA r=16 on every projection, checkpointing, batch 1 x
2,048 tokens, bf16 autocast, paged_adamw_8bit, on an A100-80GB preset.

    python benchmarks/bench_qlora.py benchmarks/results/2026-11-25-qlora-cpu.json
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

CASES = {
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=32000),
}

CHILD = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, peft, nbmem
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(**json.loads(sys.argv[1]))
build = lambda: LlamaForCausalLM(config)
make = lambda n: {"input_ids": torch.randint(0, config.vocab_size, (n, 2048)),
                  "labels": torch.randint(0, config.vocab_size, (n, 2048))}
lora = peft.LoraConfig(r=16, target_modules="all-linear")
started = time.perf_counter()
result = nbmem.estimate(build, make, batch_size=1, precision="bf16", checkpointing=True, quantization="nf4",
                        trainable=lora, optimizer="paged_adamw_8bit", device="A100-80GB")
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak": result.peak, "managed": result.managed, "parameters": result.parameters,
                  "parameter_bytes": result.breakdown.category("parameter")}))
"""


def run(name: str, repeats: int = 3) -> dict:
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES[name])], capture_output=True, text=True,
                              check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"median_seconds": statistics.median(run["seconds"] for run in runs),
            "max_rss_mib": max(run["max_rss_bytes"] for run in runs) / 2**20,
            "runs": runs}


def main() -> None:
    import bitsandbytes
    import peft
    import torch
    import transformers

    load = os.getloadavg()
    results = {name: run(name) for name in CASES}
    record = {
        "what": "nbmem.estimate of a QLoRA step (nf4 double quant, LoRA r=16 all-linear, checkpointing, batch 1 x "
                "2048, bf16, paged_adamw_8bit), each run in a fresh process",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {load}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "bitsandbytes": bitsandbytes.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__},
        "results": results,
    }
    text = json.dumps(record, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
