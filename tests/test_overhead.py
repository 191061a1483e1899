"""Tracked mode's hot path made cheaper (issue 12's overhead point) without changing one byte.

Two costs were cut, each tested here for what it must not change:

- PyTorch's ``torch._dynamo.disable`` wrapper around ``__torch_dispatch__``
  (about 5 us per op) is replaced by marking the code for Dynamo to skip: a
  ``torch.compile``'d function run in a tracked cell still has none of nbmem's
  frames traced.
- The saved-tensors pack hook detaches a plain tensor past the dispatch mode
  (a whole op per saved tensor before): every figure stays the same.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from nbmem.tracking import categories
from nbmem.tracking.dispatch import TrackingMode
from nbmem.tracking.tracker import Tracker


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


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)), torch.randn(32, 64), torch.randint(0, 10, (32,))


def _cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )
    return model, torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))


def _transformer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.Sequential(nn.Embedding(50, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 50))
    return model, torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12))


def _figures(make: object, monkeypatch: pytest.MonkeyPatch, through_the_mode: bool) -> tuple[object, ...]:
    with monkeypatch.context() as patch:
        if through_the_mode:  # the pack hook as it was: its detach dispatched through the tracker's mode
            patch.setattr(categories, "_NO_PYTHON_DISPATCH", contextlib.nullcontext)
        torch.manual_seed(0)
        model, batch, labels = make()  # type: ignore[operator]
        tracker = Tracker("cpu")
        with tracker:
            optimizer = torch.optim.AdamW(model.parameters())
            for _ in range(2):  # the second step frees the first's gradients and reuses the state
                loss = nn.functional.cross_entropy(model(batch).reshape(-1, model(batch).shape[-1]), labels.reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            del loss
        detail = tracker.peak_detail()
        return (tracker.peak_allocated(), tracker.allocated(), tracker.by_category(), detail.categories,
                detail.modules, tracker.by_module(), tracker.op_count)


@pytest.mark.parametrize("make", [_mlp, _cnn, _transformer], ids=["mlp", "cnn", "transformer"])
def test_the_pack_hook_past_the_mode_changes_no_figure(make, monkeypatch):
    *fast, fast_ops = _figures(make, monkeypatch, through_the_mode=False)
    *slow, slow_ops = _figures(make, monkeypatch, through_the_mode=True)
    assert fast == slow  # peak, now, categories now and at the peak, modules: equal to the byte
    assert fast[0] > 0 and sum(fast[2].values()) == fast[1]
    # the patch took effect: through the mode, every saved tensor's detach was one more op
    assert slow_ops > fast_ops
