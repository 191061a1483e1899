"""Seconds per estimate on real models: nbmem.estimate beside PyTorch's MemTracker under FakeTensorMode (issue 11).

Run: python benchmarks/bench_estimate_models.py [--rounds 3] [--memtracker-llama] [--json FILE]

Models (Hugging Face transformers, built from their configs, never
materialised): BERT-base (BertForMaskedLM), GPT-2 (GPT2LMHeadModel), batch 8
x 128 tokens; a Llama-2-7B-sized LlamaForCausalLM (hidden 4096, 32 layers,
32 heads, MLP 11008, vocabulary 32000), batch 1 x 128 tokens. Each
estimate is nbmem's whole job: build the model under fake tensors, run two
AdamW training steps (first and steady), fp32.

The same job under MemTracker (torch.distributed._tools.mem_tracker): build
under FakeTensorMode, track_external(model, optimizer), two steps inside
``with MemTracker()``. nbmem and MemTracker alternate in rounds, so the load
of this shared machine hits both alike; medians, their ratio and the load
average (os.getloadavg) are reported. MemTracker on the 7B config takes
over a minute, so it is timed once, and only with --memtracker-llama.

Also this process's peak RSS after the 7B estimates (Linux ru_maxrss; it
includes importing torch and transformers). Targets (issue 11): <= 2 s for
BERT-base and GPT-2, 7B in <= 3 s and < 1 GiB RSS. The explorer's target
(<= 1 s per change on those models) is benchmarks/bench_explore.py's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any, Callable

import torch

import nbmem

from _environment import environment, parse_with_threads, write_json


def models() -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], Any], int]]:
    import transformers
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()

    def tokens(vocabulary: int) -> Callable[[int], dict[str, torch.Tensor]]:
        return lambda n: {"input_ids": torch.randint(0, vocabulary, (n, 128)),
                          "labels": torch.randint(0, vocabulary, (n, 128))}

    llama = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32, vocab_size=32000, use_cache=False)
    return {
        "bert-base": (lambda: BertForMaskedLM(BertConfig()), tokens(30522), 8),
        "gpt2": (lambda: GPT2LMHeadModel(GPT2Config()), tokens(50257), 8),
        "llama-2-7b config": (lambda: LlamaForCausalLM(llama), tokens(32000), 1),
    }


def timed(run: Callable[[], Any], cpu: list[float]) -> tuple[float, Any]:
    """Wall seconds and the result; this process's CPU seconds appended to ``cpu`` (steadier under load)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    result = run()
    cpu.append(time.process_time() - start_cpu)
    return time.perf_counter() - start, result


def nbmem_estimate(build: Callable[[], torch.nn.Module], make: Callable[[int], Any], batch_size: int) -> nbmem.Estimate:
    return nbmem.estimate(build, make, batch_size=batch_size, optimizer="adamw")


def memtracker_estimate(build: Callable[[], torch.nn.Module], make: Callable[[int], Any], batch_size: int) -> int:
    """The same job under MemTracker: build fake, two AdamW steps; its peak (bytes, all categories)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        model = build()
        optimizer = torch.optim.AdamW(model.parameters())
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            for _ in range(2):
                tracker.reset_mod_stats()  # MemTracker refuses a second step otherwise; the peak is kept
                model(**make(batch_size)).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
    return max(snapshot["Total"] for snapshot in peak.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="nbmem/MemTracker pairs per model (BERT, GPT-2)")
    parser.add_argument("--memtracker-llama", action="store_true", help="also time MemTracker on the 7B config (~1.5 min)")
    parser.add_argument("--no-memtracker", action="store_true", help="time nbmem alone (e.g. to compare two nbmem versions)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parse_with_threads(parser)
    loads = [os.getloadavg()[0]]
    figures: dict[str, dict[str, Any]] = {}
    for name, (build, make, batch_size) in models().items():
        large = name.startswith("llama")
        rounds = 2 if large else args.rounds
        nbmem_seconds, memtracker_seconds, nbmem_cpu, memtracker_cpu = [], [], [], []  # type: ignore[var-annotated]
        nbmem_estimate(build, make, batch_size)  # warm: imports, first-use costs
        for _ in range(rounds):
            seconds, result = timed(lambda: nbmem_estimate(build, make, batch_size), nbmem_cpu)
            nbmem_seconds.append(seconds)
            if not args.no_memtracker and (not large or args.memtracker_llama):
                seconds, memtracker_peak = timed(lambda: memtracker_estimate(build, make, batch_size), memtracker_cpu)
                memtracker_seconds.append(seconds)
                args.memtracker_llama = args.memtracker_llama and not large  # the 7B: once
            loads.append(os.getloadavg()[0])
        row: dict[str, Any] = {
            "batch": f"{batch_size} x 128 tokens",
            "parameters": result.parameters,
            "nbmem_s": statistics.median(nbmem_seconds),
            "nbmem_samples_s": nbmem_seconds,
            "nbmem_cpu_s": statistics.median(nbmem_cpu),
            "nbmem_peak_bytes": result.peak,
            "nbmem_first_step_bytes": result.first_step,
            "nbmem_steady_bytes": result.steady,
        }
        if memtracker_seconds:
            row.update(memtracker_s=statistics.median(memtracker_seconds), memtracker_samples_s=memtracker_seconds,
                       memtracker_cpu_s=statistics.median(memtracker_cpu),
                       memtracker_peak_bytes=memtracker_peak,
                       memtracker_over_nbmem=statistics.median(memtracker_seconds) / row["nbmem_s"])
        if large:
            row["max_rss_bytes_after"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        figures[name] = row
    report = {
        **environment("transformers"),
        "load_average_1min": {"min": min(loads), "max": max(loads), "each": loads},
        "estimate": figures,
    }
    print(f"{'model':<20}{'nbmem s':>9}{'(cpu)':>7}{'MemTracker s':>14}{'(cpu)':>7}{'ratio':>8}{'nbmem peak':>14}"
          f"{'MemTracker peak':>17}")
    for name, row in figures.items():
        other = f"{row['memtracker_s']:.2f}{row['memtracker_cpu_s']:>7.2f}" if "memtracker_s" in row else "-      -"
        ratio = f"{row['memtracker_over_nbmem']:.1f}x" if "memtracker_s" in row else "-"
        other_peak = f"{row['memtracker_peak_bytes'] / 2**30:.2f} GiB" if "memtracker_s" in row else "-"
        print(f"{name:<20}{row['nbmem_s']:>9.2f}{row['nbmem_cpu_s']:>7.2f}{other:>21}{ratio:>8}{row['nbmem_peak_bytes'] / 2**30:>10.2f} GiB"
              f"{other_peak:>17}")
    rss = figures["llama-2-7b config"]["max_rss_bytes_after"]
    print(f"peak RSS after the 7B estimates {rss / 2**20:.0f} MiB; load {min(loads):.1f}-{max(loads):.1f}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
