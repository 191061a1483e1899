"""Raw CUDA readings for the open issues that need a GPU's truth (issues 23, 25, 26, 27).

Run on a CUDA machine, after ``gpu_campaign.py`` (see benchmarks/README.md):

    python benchmarks/gpu_probes.py --out DIR [--budget 200] [--sections all]

Sections, each item guarded (an error is recorded, never fatal) and each item
that would start past the budget recorded as "not run: out of time":

- ``snapshot`` (issue 26): real ``torch.cuda.memory._snapshot()`` pickles of
  small training steps (MLP, CNN, with and without expandable segments, and
  one that ends in an out-of-memory error), for nbmem's importer and
  allocator-replay tests. Beside each: ``max_memory_allocated``/``reserved``.
- ``compile`` (issue 23): the peak of one training step (forward, backward,
  optimizer) of an MLP, a CNN with BatchNorm and a small GPT, eager vs
  ``aot_eager`` vs ``inductor`` vs ``inductor`` with ``reduce-overhead``, and
  what ``nbmem.measure()`` reports around the compiled step.
- ``bnb`` (issue 25): bitsandbytes' CUDA kernels: the bytes of a 4-bit and an
  8-bit layer's weights, the temporaries of their forward and backward at
  several token counts, and the state of 8-bit, paged and 32-bit optimizers
  (allocated by PyTorch and, for paged ones, the device memory taken outside it).
- ``accel`` (issue 27): which ``torch.accelerator`` memory functions exist and
  whether they agree with ``torch.cuda``'s.

Writes ``probes.json`` and the pickles into DIR. Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("accel", "snapshot", "compile", "bnb", "cudnn", "nbmem-compiled", "nbmem-snapshot")
MiB = 1 << 20


class Probes:
    """Collects each item's readings or error, and keeps to the time budget."""

    def __init__(self, out: Path, budget: float, name: str = "probes.json", indent: int | None = 1) -> None:
        self.out = out
        self.name, self.indent = name, indent
        self.deadline = time.monotonic() + budget
        self.results: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0),
            "capability": list(torch.cuda.get_device_capability(0)),
            "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
            "total_memory": torch.cuda.get_device_properties(0).total_memory,
            "items": {},
        }

    def item(self, name: str, fn: Callable[[], Any], reserve: float = 5.0) -> None:
        if time.monotonic() + reserve > self.deadline:
            self.results["items"][name] = {"status": "not run: out of time"}
            return
        started = time.monotonic()
        try:
            value = fn()
            self.results["items"][name] = {"status": "ok", "seconds": round(time.monotonic() - started, 2), "value": value}
        except Exception as error:  # a probe's failure is a reading too
            self.results["items"][name] = {
                "status": f"error: {type(error).__name__}: {error}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        finally:
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        print(f"{name}: {self.results['items'][name]['status'][:200]}", flush=True)
        self.save()

    def save(self) -> None:
        (self.out / self.name).write_text(json.dumps(self.results, indent=self.indent, default=str))


def stats() -> dict[str, int]:
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "free": torch.cuda.mem_get_info()[0],
    }


def reset() -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


# -- models ---------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1024))


def cnn(widths: tuple[int, ...] = (64, 128, 256)) -> nn.Module:
    """Conv + BatchNorm + ReLU blocks of ``widths`` channels, pooled to 10 classes (bench_compiled.py uses it too)."""
    layers: list[nn.Module] = []
    channels = 3
    for width in widths:
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def gpt() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=512, vocab_size=8192)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    "mlp": (mlp, lambda: (torch.randn(512, 1024, device="cuda"),)),
    "cnn": (cnn, lambda: (torch.randn(64, 3, 64, 64, device="cuda"),)),
    "gpt": (gpt, lambda: (torch.randint(0, 8192, (8, 256), device="cuda"),)),
}


def loss_of(name: str, model: Callable[..., Any], inputs: tuple[Any, ...]) -> torch.Tensor:
    if name == "gpt":
        return model(input_ids=inputs[0], labels=inputs[0]).loss
    out = model(*inputs)
    return out.float().pow(2).mean()


def timed_steps(make_loss: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, steps: int) -> list[dict[str, int]]:
    """Allocator readings around each phase of `steps` training steps (peaks reset per step)."""
    readings = []
    for _ in range(steps):
        reset()
        before = stats()
        loss = make_loss()
        torch.cuda.synchronize()
        after_forward = stats()
        loss.backward()
        torch.cuda.synchronize()
        after_backward = stats()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        torch.cuda.synchronize()
        readings.append({"before": before, "after_forward": after_forward, "after_backward": after_backward, "after": stats()})
    return readings


def train_steps(name: str, model: nn.Module, call: Callable[..., Any], steps: int) -> list[dict[str, int]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return timed_steps(lambda: loss_of(name, call, MODELS[name][1]()), optimizer, steps)


# -- accel ----------------------------------------------------------------------


def probe_accel() -> dict[str, Any]:
    acc = getattr(torch, "accelerator", None)
    names = ["current_accelerator", "memory_allocated", "max_memory_allocated", "memory_reserved",
             "max_memory_reserved", "reset_peak_memory_stats", "memory_stats", "empty_cache", "synchronize",
             "device_count", "get_memory_info"]
    present = {n: bool(acc is not None and hasattr(acc, n)) for n in names}
    x = torch.empty(3 * MiB + 5, dtype=torch.uint8, device="cuda")
    readings: dict[str, Any] = {"present": present, "cuda_allocated": torch.cuda.memory_allocated(),
                                "cuda_reserved": torch.cuda.memory_reserved()}
    for n in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        if present[n]:
            readings[f"accelerator_{n}"] = getattr(acc, n)()
    if present["current_accelerator"]:
        readings["current_accelerator"] = str(acc.current_accelerator())
    readings["cuda_stats_keys"] = sorted(torch.cuda.memory_stats())[:400]
    readings["allocator_backend"] = torch.cuda.get_allocator_backend()
    del x
    return readings


# -- snapshot -------------------------------------------------------------------


SNAPSHOT_CHILD = r"""
import pickle, sys, torch
from torch import nn
kind, path = sys.argv[1], sys.argv[2]
torch.cuda.memory._record_memory_history(max_entries=200000)
if kind == "oom":
    torch.cuda.set_per_process_memory_fraction(2 * (1 << 30) / torch.cuda.get_device_properties(0).total_memory)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).cuda()
    opt = torch.optim.Adam(model.parameters())
    n = 1024
    try:
        while True:
            x = torch.randn(n, 4096, device="cuda")
            model(x).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
            del x
            n *= 2
    except torch.OutOfMemoryError as error:
        print("oom at", n, str(error)[:200])
else:
    if kind.startswith("mlp"):
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
        make = lambda: torch.randn(256, 1024, device="cuda")
    else:
        layers, c = [], 3
        for w in (32, 64):
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]; c = w
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)).cuda()
        make = lambda: torch.randn(32, 3, 32, 32, device="cuda")
    opt = torch.optim.AdamW(model.parameters())
    for step in range(3):
        loss = model(make()).pow(2).mean()
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        del loss
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
with open(path, "wb") as f:
    pickle.dump(snap, f, protocol=4)
print("max_allocated", torch.cuda.max_memory_allocated(), "max_reserved", torch.cuda.max_memory_reserved(),
      "allocated", torch.cuda.memory_allocated(), "reserved", torch.cuda.memory_reserved())
"""


def probe_snapshot(out: Path, kind: str, conf: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    path = out / f"snapshot-{kind}{'-expandable' if conf else ''}.pickle"
    done = subprocess.run([sys.executable, "-c", SNAPSHOT_CHILD, kind, str(path)], env=env,
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-1500:])
    with open(path, "rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces", [[]])
    return {"file": path.name, "bytes": path.stat().st_size, "stdout": done.stdout[-500:], "keys": sorted(snap),
            "segments": len(snap.get("segments", [])),
            "segment_total": sum(s["total_size"] for s in snap.get("segments", [])),
            "trace_entries": len(traces[0]) if traces else 0,
            "actions": sorted({e["action"] for e in traces[0]}) if traces and traces[0] else [],
            "allocator_settings": snap.get("allocator_settings")}


# -- compile --------------------------------------------------------------------


def probe_compile(name: str, backend: str) -> dict[str, Any]:
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[name][0]().cuda()
    if backend == "eager":
        call: Any = model
    elif backend == "reduce-overhead":
        call = torch.compile(model, mode="reduce-overhead")
    else:
        call = torch.compile(model, backend=backend)
    started = time.monotonic()
    readings = train_steps(name, model, call, 3)
    result: dict[str, Any] = {"steps": readings, "seconds_three_steps": round(time.monotonic() - started, 2)}
    # What nbmem's measured mode says around one more step (fourth).
    import nbmem

    inputs = MODELS[name][1]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reset()
    with nbmem.measure("cuda") as scope:
        loss = loss_of(name, call, inputs)
        loss.backward()
        del loss
    r = scope.result
    result["nbmem_measure"] = {"peak_allocated": r.peak_allocated, "allocated_before": r.allocated_before,
                               "allocated_after": r.allocated_after, "peak_reserved": r.peak_reserved,
                               "torch_max_allocated": torch.cuda.max_memory_allocated()}
    # What nbmem's estimate (fake tensors, CPU) says of the eager step, for the same batch.
    try:
        shapes = [tuple(t.shape) for t in inputs]
        dtype = inputs[0].dtype

        def batch(n: int) -> Any:
            if dtype == torch.long:
                return torch.randint(0, 8192, (n, *shapes[0][1:]))
            return torch.randn(n, *shapes[0][1:])

        if name == "gpt":
            est = nbmem.estimate(MODELS[name][0], lambda n: {"input_ids": batch(n), "labels": batch(n)},
                                 batch_size=shapes[0][0], optimizer="adamw", device="H100-80GB")
        else:
            est = nbmem.estimate(MODELS[name][0], batch, batch_size=shapes[0][0], optimizer="adamw", device="H100-80GB",
                                 loss=lambda out, b: out.float().pow(2).mean())
        result["nbmem_estimate_eager"] = {"steady": est.steady, "first_step": est.first_step, "reserved": est.reserved}
    except Exception as error:
        result["nbmem_estimate_eager"] = f"error: {type(error).__name__}: {error}"[:1000]
    del model, call, optimizer, inputs
    torch._dynamo.reset()
    return result


def probe_nbmem_compiled(name: str) -> dict[str, Any]:
    """nbmem around an inductor-compiled step on CUDA: measured, with a breakdown (eager), tracked; compiled after?"""
    import nbmem
    import torch._dynamo.eval_frame as frames

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[name][0]().cuda()
    call = torch.compile(model)
    inputs = MODELS[name][1]()

    def one_step() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(name, call, inputs).backward()
        torch.cuda.synchronize()

    def raw_peak() -> int:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        reset()
        before = torch.cuda.memory_allocated()
        loss_of(name, call, inputs).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    one_step()
    one_step()
    result: dict[str, Any] = {"has_callback_from_stance": hasattr(frames, "_callback_from_stance"), "raw_before": raw_peak()}
    for label, options in (("measure", {}), ("measure_breakdown", {"breakdown": True}), ("track", {"backend": "tracked"})):
        model.zero_grad(set_to_none=True)
        with nbmem.measure("cuda", **options) as scope:  # type: ignore[arg-type]
            loss_of(name, call, inputs).backward()
        r = scope.result
        result[label] = {"peak": r.peak, "compiled": r.compiled, "calls": scope.compiled_calls, "engine": scope.engine,
                         "notes": [n[:160] for n in r.notes if "compile" in n]}
    result["raw_after"] = raw_peak()  # equal to raw_before: still compiled after the eager blocks
    del model, call, inputs
    torch._dynamo.reset()
    return result


def probe_nbmem_snapshot(out: Path) -> dict[str, Any]:
    """load_snapshot on a snapshot torch records now, against torch's counters; lines and to_snapshot on CUDA."""
    import nbmem

    torch.manual_seed(0)
    model = mlp().cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(512, 1024, device="cuda")
    torch.cuda.synchronize()
    reset()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    for _ in range(2):
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    path = out / "snapshot-live.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    truth = stats()
    loaded = nbmem.load_snapshot(path)
    r = loaded.result()
    replay = loaded.replay()
    result: dict[str, Any] = {
        "torch": truth, "loaded": {"peak_allocated": r.peak_allocated, "peak_reserved": r.peak_reserved,
                                   "allocated_after": r.allocated_after, "allocated_before": r.allocated_before},
        "replay_exact": replay.exact, "replay": str(replay), "by_category": loaded.by_category(),
    }
    with nbmem.measure("cuda", lines=True, timeline=True) as scope:
        model(batch).pow(2).mean().backward()
        optimizer.step()
    exported = out / "export-measured.pickle"
    scope.result.to_snapshot(str(exported))
    back = nbmem.load_snapshot(exported).result()
    result["measured_with_lines"] = {
        "peak": scope.result.peak, "peak_allocated": scope.result.peak_allocated,
        "lines": [(line.where, line.source, line.at_peak, line.allocated) for line in (scope.result.lines or ())][:6],
        "export_peak_allocated": back.peak_allocated, "notes": [n[:120] for n in scope.result.notes],
    }
    return result


# -- bitsandbytes ---------------------------------------------------------------


def probe_bnb_layer(kind: str, tokens_list: list[int], shape: tuple[int, int] = (4096, 11008)) -> dict[str, Any]:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    k, n = shape
    reset()
    base = stats()
    if kind == "nf4":
        layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
    else:
        layer = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=0.0)
    layer = layer.cuda()
    torch.cuda.synchronize()
    weights = stats()
    tensors = {}
    w = layer.weight
    tensors["weight"] = [list(w.shape), str(w.dtype), w.numel() * w.element_size()]
    qs = getattr(w, "quant_state", None)
    if qs is not None:
        tensors["absmax"] = [list(qs.absmax.shape), str(qs.absmax.dtype)]
        if getattr(qs, "state2", None) is not None:
            tensors["state2_absmax"] = [list(qs.state2.absmax.shape), str(qs.state2.absmax.dtype)]
    for attr in ("CB", "SCB"):
        t = getattr(w, attr, None)
        if t is not None:
            tensors[attr] = [list(t.shape), str(t.dtype)]
    per_tokens = []
    dtype = torch.bfloat16 if kind == "nf4" else torch.float16
    for tokens in tokens_list:
        x = torch.randn(tokens, k, device="cuda", dtype=dtype, requires_grad=True)
        reset()
        s0 = stats()
        y = layer(x)
        torch.cuda.synchronize()
        s1 = stats()
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
        s2 = stats()
        per_tokens.append({"tokens": tokens, "before": s0, "after_forward": s1, "after_backward": s2,
                           "output_bytes": y.numel() * y.element_size(), "input_bytes": x.numel() * x.element_size(),
                           "forward_extra": s1["max_allocated"] - s0["allocated"] - y.numel() * y.element_size(),
                           "backward_peak_over_forward_end": s2["max_allocated"] - s1["allocated"]})
        del x, y
    return {"base": base, "after_weights": weights, "weight_bytes": weights["allocated"] - base["allocated"],
            "tensors": tensors, "per_tokens": per_tokens}


def probe_optimizers() -> dict[str, Any]:
    import bitsandbytes as bnb

    names: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
        "adamw_torch": lambda p: torch.optim.AdamW(p, foreach=False),
        "adamw_torch_fused": lambda p: torch.optim.AdamW(p, fused=True),
        "adamw_bnb_8bit": lambda p: bnb.optim.AdamW8bit(p),
        "paged_adamw_8bit": lambda p: bnb.optim.PagedAdamW8bit(p),
        "paged_adamw_32bit": lambda p: bnb.optim.PagedAdamW32bit(p),
        "lion_8bit": lambda p: bnb.optim.Lion8bit(p),
        "paged_lion_8bit": lambda p: bnb.optim.PagedLion8bit(p),
    }
    try:
        import torchao.optim as tao

        names["adamw_torch_8bit"] = lambda p: tao.AdamW8bit(p)
        names["adamw_torch_4bit"] = lambda p: tao.AdamW4bit(p)
    except Exception as error:
        names_error = f"{type(error).__name__}: {error}"
    else:
        names_error = ""
    # Sizes: two big matrices, one just above bnb's 4096-element cutoff, one below it,
    # and one between 4096 and paging's 100,000-element threshold.
    sizes = [(2048, 2048), (1024, 4096), (4097,), (4095,), (50000,)]
    out: dict[str, Any] = {"sizes": sizes, "import_error": names_error, "by_name": {}}
    for name, make in names.items():
        try:
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(*s, device="cuda")) for s in sizes]
            for p in params:
                p.grad = torch.randn_like(p)
            torch.cuda.synchronize()
            reset()
            s0 = stats()
            opt = make(params)
            opt.step()
            torch.cuda.synchronize()
            s1 = stats()
            opt.step()
            torch.cuda.synchronize()
            s2 = stats()
            state: dict[str, Any] = {}
            for i, p in enumerate(params):
                for key, value in opt.state[p].items():
                    if torch.is_tensor(value):
                        state[f"{i}.{key}"] = [list(value.shape), str(value.dtype), value.numel() * value.element_size(),
                                               str(value.device), type(value).__name__]
            out["by_name"][name] = {"before": s0, "after_step1": s1, "after_step2": s2,
                                    "allocated_delta": s1["allocated"] - s0["allocated"],
                                    "free_delta": s0["free"] - s1["free"], "state": state}
            del opt, params
        except Exception as error:
            out["by_name"][name] = f"error: {type(error).__name__}: {error}"[:1000]
        gc.collect()
        torch.cuda.empty_cache()
    return out


def probe_bnb_heuristic() -> dict[str, Any]:
    """Which path bnb's 4-bit matmul takes, by its own rule, at each token count (read from its source)."""
    import inspect

    import bitsandbytes as bnb

    found = {}
    for name in ("matmul_4bit",):
        fn = getattr(bnb, name, None) or getattr(bnb.autograd._functions, name, None)
        if fn is not None:
            found[name] = inspect.getsource(fn)[:3000]
    return found


def build_qlora(device: str, layers: int = 4) -> tuple[nn.Module, dict[str, Any]]:
    """A small Llama, its decoder's Linear layers made nf4 by hand (as from_pretrained would), LoRA r=16 on top."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=torch.bfloat16,
                                          compress_statistics=True, quant_type="nf4")
                    q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                    setattr(parent, child_name, q)
    model = model.to(device)
    info: dict[str, Any] = {"config": config.to_dict()}
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    info["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    info["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, info


def probe_qlora(optim: str, tokens: int) -> dict[str, Any]:
    import bitsandbytes as bnb

    reset()
    s0 = stats()
    model, info = build_qlora("cuda")
    torch.cuda.synchronize()
    info["after_model"] = stats()
    info["model_bytes"] = info["after_model"]["allocated"] - s0["allocated"]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = bnb.optim.PagedAdamW8bit(params) if optim == "paged_adamw_8bit" else torch.optim.AdamW(params)
    def make_loss() -> torch.Tensor:
        ids = torch.randint(0, 32000, (1, tokens), device="cuda")
        return model(input_ids=ids, labels=ids).loss

    steps = timed_steps(make_loss, opt, 3)
    info["steps"] = steps
    del model, opt, params
    return info


def probe_cudnn_ops(name: str) -> dict[str, Any]:
    """The ops a CUDA step dispatches, with their outputs' bytes (what an estimate made on the CPU must model)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(HERE))
    from bench_accuracy import Recurrent, cnn as accuracy_cnn

    model = (Recurrent() if name == "lstm" else accuracy_cnn()).cuda()
    x = torch.randn(8, 32, 64, device="cuda") if name == "lstm" else torch.randn(8, 3, 32, 32, device="cuda")
    seen: list[tuple[str, list[int]]] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = out if isinstance(out, (tuple, list)) else [out]
            seen.append((str(func), [t.untyped_storage().nbytes() if torch.is_tensor(t) else -1 for t in flat]))
            return out

    for _ in range(2):
        model(x).float().pow(2).mean().backward()
    reset()
    s0 = stats()
    with Log():
        model(x).float().pow(2).mean().backward()
    torch.cuda.synchronize()
    s1 = stats()
    return {"before": s0, "after": s1, "peak_over_before": s1["max_allocated"] - s0["allocated"],
            "ops": [op for op in seen if "cudnn" in op[0] or "rnn" in op[0] or "lstm" in op[0] or "convolution" in op[0]],
            "op_count": len(seen)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_probes.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=200.0)
    parser.add_argument("--sections", default="all")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_probes.py: no CUDA device here; nothing to probe", file=sys.stderr)
        return 2
    sections = SECTIONS if args.sections == "all" else tuple(args.sections.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    probes = Probes(out, args.budget)
    if "accel" in sections:
        probes.item("accel", probe_accel)
    if "snapshot" in sections:
        for kind, conf in (("mlp", None), ("cnn", None), ("mlp", "expandable_segments:True"), ("oom", None)):
            probes.item(f"snapshot.{kind}{'.expandable' if conf else ''}", lambda k=kind, c=conf: probe_snapshot(out, k, c))
    if "bnb" in sections:
        probes.item("bnb.nf4", lambda: probe_bnb_layer("nf4", [1, 4, 16, 64, 512, 2048]))
        probes.item("bnb.int8", lambda: probe_bnb_layer("int8", [1, 64, 2048]))
        probes.item("bnb.optimizers", probe_optimizers)
        probes.item("bnb.heuristic", probe_bnb_heuristic)
        probes.item("bnb.qlora.paged_adamw_8bit.512", lambda: probe_qlora("paged_adamw_8bit", 512))
        probes.item("bnb.qlora.adamw.512", lambda: probe_qlora("adamw", 512))
    if "compile" in sections:
        for name in ("mlp", "cnn", "gpt"):
            for backend in ("eager", "aot_eager", "inductor", "reduce-overhead"):
                probes.item(f"compile.{name}.{backend}", lambda n=name, b=backend: probe_compile(n, b), reserve=30.0)
    if "cudnn" in sections:
        probes.item("cudnn.lstm", lambda: probe_cudnn_ops("lstm"))
        probes.item("cudnn.cnn", lambda: probe_cudnn_ops("cnn"))
    if "nbmem-snapshot" in sections:
        probes.item("nbmem-snapshot", lambda: probe_nbmem_snapshot(out), reserve=10.0)
    if "nbmem-compiled" in sections:
        for name in ("cnn", "gpt"):
            probes.item(f"nbmem-compiled.{name}", lambda n=name: probe_nbmem_compiled(n), reserve=30.0)
    probes.save()
    print(json.dumps({k: v["status"][:80] for k, v in probes.results["items"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
