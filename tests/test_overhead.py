"""Tracked mode's hot path made cheaper (issue 12's overhead point) without changing one byte.

- PyTorch's ``torch._dynamo.disable`` wrapper around ``__torch_dispatch__``
  (about 5 us per op) is replaced by marking the code for Dynamo to skip: a
  ``torch.compile``'d function run in a tracked cell still has none of nbmem's
  frames traced.
"""

from __future__ import annotations

import pytest
import torch

from nbmem.dispatch import TrackingMode
from nbmem.tracking import Tracker


def test_dispatch_is_unwrapped_and_dynamo_traces_none_of_nbmems_frames():
    import torch._dynamo

    # PyTorch's wrapper carries __wrapped__ (functools.wraps); nbmem's own code runs unwrapped
    assert not hasattr(TrackingMode.__dict__["__torch_dispatch__"], "__wrapped__")

    @torch.compile(backend="eager")
    def scaled_sum(values: torch.Tensor) -> torch.Tensor:
        return (values.sin() * 2).sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tracker = Tracker("cpu")
    values = torch.ones(1024)  # 1024 * 4 bytes = 4096, a multiple of 512
    with tracker:
        total = scaled_sum(values)
    # Dynamo compiled no frame: not the function (it runs eagerly under a dispatch
    # mode, as with PyTorch's wrapper) and none of nbmem's, which without the skip
    # mark it traces and compiles (seconds with inductor, measured)
    assert sum(torch._dynamo.utils.counters["frames"].values()) == 0
    assert float(total) == pytest.approx(2 * 1024 * torch.sin(torch.tensor(1.0)).item(), rel=1e-5)
    # at mul: the adopted input 4096 + sin's output 4096 + mul's 4096; sin's is freed before sum's 512
    assert tracker.peak_allocated() == 3 * 4096
