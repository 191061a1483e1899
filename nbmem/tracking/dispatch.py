"""The dispatch mode behind tracked mode: every ATen op's inputs and outputs, reported to a tracker.

The per-op hot path of :class:`nbmem.tracking.tracker.Tracker`, kept on its own: it
changes nothing about the op, and costs as little as Python allows (a plain
tensor output skips the walk through ``Tracker._note``). It knows the tracker
only by the attributes it calls, so it sits below nbmem.tracking.tracker.

PyTorch wraps every dispatch mode's ``__torch_dispatch__`` in
``torch._dynamo.disable`` (``TorchDispatchMode.__init_subclass__``, torch
2.13), so that a ``torch.compile``'d function run under the mode never has
Dynamo trace the mode's own frames. That wrapper is Python, run for every op:
about 5 us of the 12 us any mode costs (measured here: an empty mode 14.5 us
per ``torch.add``, 9.7 us unwrapped, the bare op 2.8 us). nbmem gets the same
effect for free: it marks the code of its ``__torch_dispatch__`` for Dynamo to
skip, it and every frame it calls (``torch._dynamo.eval_frame.skip_code``'s
mechanism, recursive), which the interpreter checks only while Dynamo's frame
callback is set. A torch without that function keeps PyTorch's wrapper.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TrackingMode", "before_op", "after_op", "SKIPS_BY_CODE", "skip_dynamo"]

_Tensor = torch.Tensor
# torch.tensor(data) builds its tensor outside the dispatcher and then hands it
# to lift_fresh: the storage is new although it is also the op's input.
_FRESH = {torch.ops.aten.lift_fresh.default}
_DEVICE = torch.ops.prim.device.default

try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    SKIPS_BY_CODE = True
except ImportError:  # pragma: no cover - such a torch keeps its own (slower) wrapper
    SKIPS_BY_CODE = False


def skip_dynamo(function: Any) -> None:
    """Have Dynamo skip ``function``'s frames and, recursively, every frame they call (module docstring).

    For a mode whose ``_should_skip_dynamo()`` is ``not SKIPS_BY_CODE``: on a
    torch without the mechanism, PyTorch's own wrapper stays.
    """
    if SKIPS_BY_CODE:
        # SKIP, SKIP: this frame and, recursively, every frame it calls (the tracker's accounting, the hooks it runs)
        set_code_exec_strategy(function.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


class TrackingMode(TorchDispatchMode):
    """Reports every op's inputs and outputs to its tracker; changes nothing."""

    def __init__(self, tracker: Any) -> None:
        super().__init__()
        self.tracker = tracker

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: PyTorch leaves __torch_dispatch__ unwrapped; Dynamo skips it by its code (module docstring)
        return not SKIPS_BY_CODE

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # nbmem's frames stay out of tracebacks: a virtual out-of-memory error
        # should read like CUDA's, ending at the user's op
        __tracebackhide__ = True
        if func is _DEVICE:  # a fake tensor's or a DTensor's device query: a real tensor answers it in C++
            return func(*args, **kwargs) if kwargs else func(*args)
        if types and _seen_through(types):
            return NotImplemented  # the subclass runs the op, this mode sees the ops it runs (see _seen_through)
        tracker = self.tracker
        before_op(tracker, func, args, kwargs)
        out = func(*args, **kwargs) if kwargs else func(*args)
        after_op(tracker, out)
        return out


#: tensor subclass -> whether the mode sees through it (see _seen_through)
_SEEN_THROUGH: dict[type, bool] = {}


def _seen_through(types: Any) -> bool:
    """Whether an op on these tensor types is left to their own ``__torch_dispatch__``, the mode seeing its ops.

    A mode runs before a subclass and is off the stack while the subclass's
    ``__torch_dispatch__`` runs, so what the subclass allocates inside is not
    seen: torchao's low-bit optimizer states (``torchao.optim``'s
    OptimState8bit/4bit/Fp8) dequantize, compute and quantize again inside
    each update, and a tracked step missed those temporaries (a review: +3.8 MB
    of the real eager step's 9.7 MB peak not counted). Answered NotImplemented,
    the op goes to the subclass with the mode still on the stack, which then
    counts every tensor it makes, as FakeTensorMode does for them. Other
    subclasses (DTensor, torchao's weight tensors) are counted by their parts
    (nbmem.tracking.tracker).
    """
    for kind in types:
        seen = _SEEN_THROUGH.get(kind)
        if seen is None:
            seen = _SEEN_THROUGH[kind] = kind is not _Tensor and str(getattr(kind, "__module__", "")).startswith(
                "torchao.optim")
        if seen:
            return True
    return False


def before_op(tracker: Any, func: Any, args: Any, kwargs: Any) -> None:
    """The tracker's part before ``func`` runs: deaths so far counted, the op numbered, its inputs adopted."""
    __tracebackhide__ = True
    if tracker._foreign or tracker._unfinished:  # deaths to count, or an update Ctrl-C cut short to mend
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


def after_op(tracker: Any, out: Any) -> None:
    """The tracker's part after: what died while the op ran, then its outputs counted."""
    __tracebackhide__ = True
    if tracker._foreign or tracker._unfinished:  # freed while the op ran: before its outputs, which may reuse its place
        tracker.drain()
    if isinstance(out, _Tensor):  # most ops: one tensor out, counted without the walk through _note
        tracker._count(out, False)
    elif isinstance(out, (tuple, list)):
        tracker._note(out)


skip_dynamo(TrackingMode.__torch_dispatch__)
