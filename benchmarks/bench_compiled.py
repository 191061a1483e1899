"""Compiled code against the allocator's truth: what each engine reports for a torch.compile'd step (issue 23).

For an MLP, a CNN with BatchNorm and a small GPT-2 (transformers), each run
eagerly and compiled with ``aot_eager`` and ``inductor``, one forward and
backward step (gradients set to None before it) is measured four ways, after
two warm-up steps:

- truth: torch.profiler's CPU allocator events (``bench_overhead.AllocatorEvents``),
  every allocation rounded to 512 B as nbmem rounds a storage, peak above the start;
- native: ``nbmem.track(engine="native")``;
- dispatch: ``nbmem.track(engine="dispatch")``, under whose dispatch mode
  PyTorch runs no compiled frame (the result says "eager");
- auto: ``nbmem.track()`` (the default), which names the compiled model here and
  so takes the native engine;
- planned (inductor rows): ``nbmem.estimate(..., compile=True)`` of the same
  step on fake tensors, less what the measured block starts with (parameters,
  buffers and the input, each rounded to 512 B), and the seconds it took
  beside the real compile's warm-up.

A fourth model, "transformer", is a small decoder built from PyTorch's own
``nn.TransformerEncoder`` (the README's GPT, smaller), beside GPT-2 from
transformers.

    python benchmarks/bench_compiled.py [--json results/DATE-compiled-cpu.json] [--threads 1] [--models mlp,cnn,gpt]

Bytes, not times: the figures don't depend on the machine's load.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from torch import nn

import nbmem
from _environment import environment, parse_with_threads, write_json
from bench_overhead import AllocatorEvents
from gpu_probes import cnn as conv_bn_blocks

MiB = 1024**2


def mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 512))
    return model, (torch.randn(512, 512),)


def cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return conv_bn_blocks((32, 64, 128)), (torch.randn(32, 3, 32, 32),)


def gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=256, vocab_size=4096)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config), (torch.randint(0, 4096, (4, 128)),)


class Decoder(nn.Module):
    """Token embeddings, causal nn.TransformerEncoder blocks, a head: the README's GPT, smaller."""

    def __init__(self, vocab: int = 4096, width: int = 256, layers: int = 2, heads: int = 4, context: int = 128) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        return self.head(self.blocks(self.tokens(ids), mask=self.mask[:n, :n], is_causal=True))


def transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Decoder(), (torch.randint(0, 4096, (8, 128)),)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": mlp, "cnn": cnn, "gpt": gpt, "transformer": transformer}
BACKENDS = ("none", "aot_eager", "inductor")

#: The model a step runs: a global, so that nbmem.track()'s "auto" engine sees its name bound to compiled code.
RUNNING: Any = None


def loss_of(model: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if getattr(model, "config", None) is not None:  # a Hugging Face model: its own loss
        return model(input_ids=inputs[0], labels=inputs[0]).loss
    return model(*inputs).float().pow(2).mean()


def step(inputs: tuple[torch.Tensor, ...]) -> None:
    loss_of(RUNNING, inputs).backward()


def estimated_step(model: Any, inputs: tuple[torch.Tensor, ...], optimizer: Any) -> None:
    """The same step, as nbmem.estimate's step= (gradients set to None first, as measured)."""
    optimizer.zero_grad(set_to_none=True)
    loss_of(model, inputs).backward()


def resident(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """What the measured block starts with: parameters, buffers and the inputs, each storage rounded to 512 B."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in (*model.parameters(), *model.buffers(), *inputs)}
    return sum(-(-size // 512) * 512 for size in storages.values())


def planned(name: str) -> tuple[int, float]:
    """nbmem.estimate(..., compile=True) of the step, above what the block starts with; and its seconds."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    started = time.perf_counter()
    shapes = [(tensor.shape, tensor.dtype) for tensor in inputs]  # the inputs made again, without a model beside them
    result = nbmem.estimate(lambda: MODELS[name]()[0], lambda n: tuple(torch.zeros(shape, dtype=dtype) for shape, dtype
                                                                       in shapes),
                            batch_size=len(inputs[0]), optimizer="sgd", step=estimated_step, compile=True)
    seconds = time.perf_counter() - started
    assert any(note.startswith("compiled: torch.compile (inductor) ran") for note in result.notes), result.notes
    return result.steady - resident(model, inputs), seconds


def measure(name: str, backend: str) -> dict[str, Any]:
    global RUNNING
    torch._dynamo.reset()  # each row compiles afresh (the models share code objects: Sequential.forward)
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    RUNNING = model if backend == "none" else torch.compile(model, backend=backend)
    started = time.perf_counter()
    for _ in range(2):  # compiled (and recompiled for the second step's grads) here, outside any measurement
        model.zero_grad(set_to_none=True)
        step(inputs)
    warmup = time.perf_counter() - started
    row: dict[str, Any] = {"model": name, "backend": backend, "warmup_seconds": round(warmup, 1)}
    model.zero_grad(set_to_none=True)
    with AllocatorEvents() as events:
        step(inputs)
    row["truth"] = events.peak()
    for engine in ("native", "dispatch", "auto"):
        model.zero_grad(set_to_none=True)
        with nbmem.track("cpu", engine=engine) as scope:  # type: ignore[arg-type]
            step(inputs)
        row[engine] = scope.result.peak
        row[f"{engine}_engine"] = scope.engine
        row[f"{engine}_compiled"] = scope.result.compiled
    nbmem.tracking.compiled._seen = False  # each row decides its "auto" engine afresh
    RUNNING = None
    if backend == "inductor":
        row["planned"], row["planned_seconds"] = planned(name)
        row["planned_seconds"] = round(row["planned_seconds"], 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parse_with_threads(parser)
    report: dict[str, Any] = environment("transformers")
    rows = []
    for name in args.models.split(","):
        for backend in BACKENDS:
            row = measure(name, backend)
            rows.append(row)
            print(
                f"{name:4} {backend:9} truth {row['truth'] / MiB:8.2f} MiB | native {row['native'] / MiB:8.2f}"
                f" | dispatch {row['dispatch'] / MiB:8.2f} ({row['dispatch_compiled']}) | auto {row['auto'] / MiB:8.2f}"
                f" ({row['auto_engine']}, {row['auto_compiled']}) | warm-up {row['warmup_seconds']} s"
                + (f" | planned {row['planned'] / MiB:8.2f} in {row['planned_seconds']} s" if "planned" in row else ""),
                flush=True,
            )
    report["rows"] = rows
    eager = {row["model"]: row["truth"] for row in rows if row["backend"] == "none"}
    report["summary"] = {
        "native_equals_truth": sum(row["native"] == row["truth"] for row in rows),
        "auto_equals_truth": sum(row["auto"] == row["truth"] for row in rows),
        "planned_equals_truth": f"{sum(row['planned'] == row['truth'] for row in rows if 'planned' in row)} of "
                                f"{sum('planned' in row for row in rows)}",
        "planned_vs_truth": {row["model"]: round(row["planned"] / row["truth"] - 1, 4) for row in rows if "planned" in row},
        "rows": len(rows),
        "compiled_vs_eager_truth": {
            f"{row['model']} {row['backend']}": round(row["truth"] / eager[row["model"]] - 1, 4)
            for row in rows
            if row["backend"] != "none" and row["model"] in eager
        },
    }
    print(report["summary"])
    write_json(args.json, report)


if __name__ == "__main__":
    main()
