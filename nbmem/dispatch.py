"""The dispatch mode behind tracked mode: every ATen op's inputs and outputs, reported to a tracker.

The per-op hot path of :class:`nbmem.tracking.Tracker`, kept on its own: it
changes nothing about the op, and costs as little as Python allows (a plain
tensor output skips the walk through ``Tracker._note``). It knows the tracker
only by the attributes it calls, so it sits below nbmem.tracking.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TrackingMode"]

_Tensor = torch.Tensor
# torch.tensor(data) builds its tensor outside the dispatcher and then hands it
# to lift_fresh: the storage is new although it is also the op's input.
_FRESH = {torch.ops.aten.lift_fresh.default}


class TrackingMode(TorchDispatchMode):
    """Reports every op's inputs and outputs to its tracker; changes nothing."""

    def __init__(self, tracker: Any) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # nbmem's frames stay out of tracebacks: a virtual out-of-memory error
        # should read like CUDA's, ending at the user's op
        __tracebackhide__ = True
        tracker = self.tracker
        if tracker._foreign:
            tracker.drain()
        tracker._op_index += 1
        tracker._op = func
        if tracker._recordings:
            for recording in tracker._recordings:
                recording.ops.append(func)
        if func not in _FRESH:
            tracker._adopt_all(args)
            if kwargs:
                tracker._adopt_all(kwargs.values())
        out = func(*args, **kwargs) if kwargs else func(*args)
        if tracker._foreign:  # freed while the op ran: before its outputs, which may reuse the storage's place
            tracker.drain()
        if isinstance(out, _Tensor):  # most ops: one tensor out, counted without the walk through _note
            tracker._count(out, False)
        elif isinstance(out, (tuple, list)):
            tracker._note(out)
        return out
