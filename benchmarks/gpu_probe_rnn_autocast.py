"""cuDNN's LSTM under autocast, without biases, with one layer's dropout, after a Linear, in bf16 weights (one CUDA
GPU): the output's dtype and every allocation of forward and backward, printed one line a case.

From a review of nbmem/estimation/cudnn_rnn.py (2026-11-27), which read in AutocastRNN.cpp that
``_cudnn_rnn_cast_reflatten`` casts to fp16 whatever autocast's dtype; the H100 agreed
(``results/2026-11-27-gpu/rnn_autocast.log``, read by tests/test_cudnn_rnn.py).

    python benchmarks/gpu_probe_rnn_autocast.py > rnn_autocast.log
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.cuda.memory import _record_memory_history, _snapshot


def trace(name: str, build: Callable[[], nn.Module], autocast: torch.dtype | None = None,
          dtype: torch.dtype = torch.float32) -> None:
    try:
        model = build().cuda()
        x = torch.randn(8, 32, 64, device="cuda", dtype=dtype)
        torch.cuda.synchronize()
        start = len(_snapshot()["device_traces"][0])
        with torch.autocast("cuda", autocast or torch.float16, enabled=autocast is not None):
            output = model(x)[0]
        middle = len(_snapshot()["device_traces"][0])
        output.float().sum().backward()
        torch.cuda.synchronize()
        events: list[dict[str, Any]] = _snapshot()["device_traces"][0]
        forward = [(e["size"], e["action"][0]) for e in events[start:middle]
                   if e["action"] in ("alloc", "free_requested")]
        backward = [e["size"] for e in events[middle:] if e["action"] == "alloc"]
        before = output.grad_fn.next_functions[0][0] if output.grad_fn.next_functions else None
        print(name, output.dtype, output.grad_fn.name(), getattr(before, "name", lambda: "")(), "F", forward,
              "B", backward, flush=True)
    except Exception as error:  # noqa: BLE001 - one case's failure is printed, the rest run
        print(name, "ERR", repr(error)[:300], flush=True)


def main() -> None:
    print(torch.__version__, torch.backends.cudnn.version(), flush=True)
    _record_memory_history(max_entries=200_000)

    def lstm(**options: Any) -> nn.Module:
        return nn.LSTM(64, 128, batch_first=True, **options)

    trace("bf16ac", lstm, torch.bfloat16)
    trace("fp16ac", lstm, torch.float16)
    trace("nobias", lambda: lstm(bias=False))
    trace("drop1", lambda: lstm(dropout=0.5))
    trace("lin_bf16", lambda: nn.Sequential(nn.Linear(64, 64), lstm()), torch.bfloat16)
    trace("bf16w", lambda: lstm().bfloat16(), None, torch.bfloat16)


if __name__ == "__main__":
    main()
