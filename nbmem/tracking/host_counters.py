"""An optimizer's step counters live in host memory on a GPU: a tracker standing in for one keeps them out.

Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, Rprop and
Adafactor keep a step count per parameter tensor (NAdam also its
``mu_product``) as a CPU tensor, made by ``torch.tensor(0.0)`` or
``torch.zeros(())`` without a device, unless the group is ``fused`` or
``capturable``, where it is made on the parameter's device
(torch/optim/adam.py: "Deliberately host `step` on CPU if both capturable
and fused are off"). ASGD makes its own on the device. A tracker on the CPU
stands in for a GPU, so while :class:`HostStepCounters` is entered it is told:
the 0-dim tensors such an optimizer makes from a number in its
``_init_group`` (where its state is made, in its first step) are host memory,
never counted nor seen by an allocator simulation. Those made in a
constructor (Adagrad's) leave the figures before its first step. 512 B a
parameter tensor, measured on the test device (tests/on_device) and on an
H100: a residual MLP's and a transformer encoder's AdamW steps allocated
8,192 B and 26,112 B (16 and 51 parameter tensors) less than nbmem then
estimated, and now exactly what it estimates (tests/test_h100_figures.py).

Entered by every estimate (``nbmem.estimate``, estimated and tracked) and by
every tracked scope on the CPU (``%%gpumem``, ``nbmem.track()``), with either
engine: the dispatch engine's tracker keeps such storages in its ``outside``
table (nbmem.tracking.host_memory); the native engine lets the thread's
allocations pass uncounted meanwhile and keeps a table of its own, so that no
later walk adopts them. Several may be entered at once on a thread (a tracked cell around a
tracked estimate): each optimizer is patched once, and its counters are host
memory to every tracker entered on the thread that steps it. A global step
pre-hook finds the optimizers, the user's own too; it acts for the thread
that entered only (a notebook's training in a background thread is not the
scope's), and it and every patch go when the last one exits.

>>> import contextlib
>>> from nbmem.tracking.tracker import Tracker
>>> def first_step(host):
...     tracker, notes = Tracker("cpu"), []
...     layer = torch.nn.Linear(256, 256)                  # 2 parameter tensors
...     layer(torch.ones(1, 256)).sum().backward()
...     with tracker, (HostStepCounters(tracker, notes) if host else contextlib.nullcontext()):
...         adam = torch.optim.Adam(layer.parameters(), foreach=True)
...         adam.step()
...     return tracker.peak_allocated(), notes
>>> (counted, _), (hosted, notes) = first_step(False), first_step(True)
>>> counted - hosted                                       # 2 counters of 512 B
1024
>>> notes[0][:40]
"optimizer: Adam's step counters (a 0-dim"
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable

import torch
import torch.optim.optimizer as optimizer_module
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

__all__ = ["HostStepCounters", "NOTE", "remove_every"]

#: The note an estimate or a scope result gives, with the optimizer's class name.
NOTE = ("optimizer: {}'s step counters (a 0-dim float32 per parameter tensor) are CPU tensors on a GPU (neither fused "
        "nor capturable), outside the figures")

#: Every HostStepCounters entered now, on any thread, innermost last.
_ENTERED: list[HostStepCounters] = []
#: Optimizers whose _init_group is patched (an instance attribute), held weakly.
_PATCHED: weakref.WeakSet[Any] = weakref.WeakSet()
#: The state entries of torch.optim's that are step counters (NAdam's mu_product too); a 0-dim parameter's other
#: state (exp_avg, Adagrad's sum...) is 0-dim as well, and on the device.
_COUNTERS = ("step", "mu_product")


class HostStepCounters:
    """While entered on a thread, the optimizers it steps keep their step counters out of ``tracker`` (see above).

    ``notes`` gets the note, once, when some counters were kept out.
    """

    def __init__(self, tracker: Any, notes: list[str] | None = None) -> None:
        self.tracker = tracker
        self.notes = notes if notes is not None else []
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()
        self._thread: int | None = None  # the thread that entered

    def __enter__(self) -> HostStepCounters:
        self._thread = threading.get_ident()
        _ENTERED.append(self)
        register_optimizer_step_pre_hook(self._before_step)  # __exit__ finds it in torch's table
        return self

    def __exit__(self, *exc: object) -> None:
        """Idempotent, and it looks at torch's own table: what a Ctrl-C in :meth:`__enter__` left goes too."""
        _remove_hooks(lambda owner: owner is self)
        while self in _ENTERED:
            _ENTERED.remove(self)
        _remove_scalar_modes()  # one a Ctrl-C on the line that leaves it kept on this thread's stack
        _unpatch()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return  # inside a compiled optimizer step Dynamo traces this: nbmem's accounting stays out of its graph
        if threading.get_ident() != self._thread or optimizer in self._seen or not _counts_on_host(optimizer):
            return
        if not self.tracker.fake and _on_fake_tensors(optimizer):
            return  # an estimate's, run inside a tracked block: its own tracker keeps its counters out
        self._seen.add(optimizer)
        # made in its constructor (a user's Adagrad): out of the figures from now on. Not those alive before the
        # tracker saw them (an optimizer stepped before the block): they are in the block's baseline, and stay
        made = [state[key] for state in optimizer.state.values() for key in _COUNTERS
                if isinstance(state.get(key), torch.Tensor) and state[key].dim() == 0
                and not _adopted(self.tracker, state[key])]
        for counter in made:
            self.tracker.moved_to_host(counter)
        if made:
            self.say(optimizer)
        if hasattr(type(optimizer), "_init_group") and "_init_group" not in vars(optimizer):  # where state is made
            _PATCHED.add(optimizer)  # first: a Ctrl-C between the two leaves a patch that _unpatch() finds
            optimizer._init_group = functools.partial(_init_group_on_host, weakref.ref(optimizer),
                                                      type(optimizer)._init_group)

    def say(self, optimizer: Any) -> None:
        """The note, once (not once per parameter's optimizer, in backward)."""
        if not any("step counters" in note for note in self.notes):
            self.notes.append(NOTE.format(type(optimizer).__name__))


def remove_every() -> None:
    """Exit every HostStepCounters still entered, and take any of their hooks out of torch's table (``%unload_ext``).

    >>> remove_every(); _ENTERED, [hook for hook in optimizer_module._global_optimizer_pre_hooks.values()
    ...                            if isinstance(getattr(hook, "__self__", None), HostStepCounters)]
    ([], [])
    """
    for counters in list(_ENTERED):
        counters.__exit__()
    _remove_hooks(lambda owner: isinstance(owner, HostStepCounters))
    _remove_scalar_modes()
    _unpatch()


def _remove_hooks(belongs: Callable[[Any], bool]) -> None:
    """Take out of torch's global step pre-hooks those bound to a HostStepCounters ``belongs`` picks."""
    hooks = optimizer_module._global_optimizer_pre_hooks
    for key, hook in list(hooks.items()):
        if belongs(getattr(hook, "__self__", None)):
            hooks.pop(key, None)


def _unpatch() -> None:
    """With none entered any more: an optimizer that outlives them steps as it did before."""
    for ref in list(_PATCHED.data):  # type: ignore[attr-defined]  # its weak references, copied in one C step
        if _ENTERED:  # another thread entered meanwhile: it needs the patches
            return
        optimizer = ref()
        if optimizer is not None:
            optimizer.__dict__.pop("_init_group", None)
            _PATCHED.discard(optimizer)


def _remove_scalar_modes() -> None:
    """Take :class:`_HostScalars` modes off this thread's torch function mode stack, leaving the others in order."""
    from torch.overrides import _get_current_function_mode_stack

    def ours_left() -> bool:
        return any(isinstance(mode, _HostScalars) for mode in _get_current_function_mode_stack())

    if not ours_left():
        return
    above: list[Any] = []
    try:
        while torch._C._len_torch_function_stack():
            top = torch._C._pop_torch_function_stack()
            if not isinstance(top, _HostScalars):
                above.append(top)
            elif not ours_left():
                break
    finally:
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)


def _adopted(tracker: Any, tensor: torch.Tensor) -> bool:
    record = tracker.record_of(tensor)
    return record is not None and record.born == -1


def _here() -> list[HostStepCounters]:
    """The HostStepCounters entered on this thread."""
    thread = threading.get_ident()
    return [counters for counters in _ENTERED if counters._thread == thread]


_ON_DEVICE = ("ASGD",)  # torch.optim's that make their counters on the parameters' device


def _counts_on_host(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of torch.optim's that keeps its step counters on the host (see above)."""
    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and type(optimizer).__module__.startswith("torch.optim.")
        and type(optimizer).__name__ not in _ON_DEVICE
        and not any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    )


def _on_fake_tensors(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps fake tensors (an estimate's), which a real block's tracker never counts."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(getattr(parameter, "_local_tensor", parameter), FakeTensor)  # a DTensor's (FSDP): its shard
               for group in optimizer.param_groups for parameter in group["params"])


def _init_group_on_host(owner: weakref.ref[Any], init: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # the optimizer held weakly: optimizer -> this -> the optimizer would be a cycle, kept until a collection
    optimizer = owner()
    assert optimizer is not None, "an optimizer was let go before its own step"
    if torch.compiler.is_compiling():  # traced by Dynamo (a compiled step): the optimizer's own, nothing added
        return init(optimizer, *args, **kwargs)
    hosting = _here()
    if hosting and _on_fake_tensors(optimizer):  # an estimate's: only its own (fake) trackers keep them out
        hosting = [counters for counters in hosting if counters.tracker.fake]
    group = args[0] if args else kwargs.get("group")
    if not hosting or (isinstance(group, dict) and all(optimizer.state.get(p) for p in group["params"]
                                                       if p.grad is not None)):
        # no tracker here, or every parameter stepped now has its state (counters too) already
        return init(optimizer, *args, **kwargs)
    with _HostScalars(hosting) as making:
        result = init(optimizer, *args, **kwargs)
    if making.made:
        for counters in hosting:
            counters.say(optimizer)
    return result


class _HostScalars(TorchFunctionMode):
    """Inside: a 0-dim tensor made from a number (``torch.tensor(0.0)``, ``torch.zeros(())``) is host memory."""

    def __init__(self, hosting: list[HostStepCounters]) -> None:
        super().__init__()
        self.hosting = hosting
        self.made = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _makes_scalar(func, args, kwargs):
            return func(*args, **kwargs)
        self.made += 1
        trackers = list({id(counters.tracker): counters.tracker for counters in self.hosting}.values())
        with contextlib.ExitStack() as hosting:
            for tracker in trackers:
                hosting.enter_context(tracker.on_host())
            made = func(*args, **kwargs)
        for tracker in trackers:  # the native engine only passed its block through: a later walk must not adopt it
            tracker.keep_outside(made)
        return made


def _makes_scalar(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    if func is torch.tensor:
        data = args[0] if args else kwargs.get("data")
        return isinstance(data, (bool, int, float))
    if func is torch.zeros or func is torch.ones:
        size = args if args and not isinstance(args[0], (tuple, list, torch.Size)) else (args[0] if args else kwargs.get("size"))
        return size is not None and len(size) == 0
    return False
