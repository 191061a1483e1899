"""PyTorch kernels replaced for the length of a ``with`` block: how nbmem makes a CPU step follow a GPU's rules.

``torch.library`` registrations are process-wide, so a :class:`ScopedKernels`
subclass registers its kernels on entering, removes every one on leaving (an
exception or Ctrl-C included: the dispatcher then uses PyTorch's own kernels
again), and allows one active instance of itself at a time. Used by
:mod:`nbmem.estimation.autocast_policy`, :mod:`nbmem.estimation.attention` and
:mod:`nbmem.estimation.dropout`.

>>> class Nothing(ScopedKernels):
...     def register(self, library):
...         pass
>>> with Nothing() as active:
...     active.registered
True
>>> active.registered
False
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, ClassVar

import torch

__all__ = ["OneAtATime", "ScopedKernels", "calls_per_step"]


def calls_per_step(calls: int, steps: int, what: str) -> str:
    """How a kernel rule's note counts its calls: ``what`` calls per step, recomputed ones and micro-batches too.

    >>> calls_per_step(6, 2, "convolution")
    '3 convolution calls per step (recomputed ones and micro-batches too)'
    """
    per_step = calls // steps
    return f"{per_step} {what} call{'s' if per_step != 1 else ''} per step (recomputed ones and micro-batches too)"


#: held for the instant a context checks and takes its class's place, never across an estimate
_TAKING = threading.Lock()


class OneAtATime:
    """A context that changes process-wide state while it is active: one instance of each subclass at a time.

    Ctrl-C can't leave one installed, or its class refused for the rest of the session: :meth:`release` undoes
    everything idempotently and, cut short, finishes before it lets the interrupt through; an instance that holds
    its class's place with nothing in (an entry cut short before its ``try``) is taken over by the next on its
    thread; and the one window nothing inside can close, an interrupt on the very entry of ``__exit__``, is closed
    by the estimate that entered it, which releases every context again on its way out
    (:func:`nbmem.estimation.estimate.estimate_plan`).
    """

    #: the instance that holds each subclass's place (set in __init_subclass__)
    _holder: ClassVar[OneAtATime | None] = None
    _thread = 0  # the thread that took the place

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._holder = None

    @property
    def installed(self) -> bool:
        """Whether any of this context's changes are in."""
        raise NotImplementedError

    def _take_place(self) -> None:
        with _TAKING:
            holder, thread = type(self)._holder, threading.get_ident()
            # another thread's holder may be half-way into its entry: only this thread's own can be a Ctrl-C's leftover
            if holder is not None and holder is not self and (holder.installed or holder._thread != thread):
                raise RuntimeError(f"nbmem's {type(self).__name__} is already active in this process: one at a time")
            self._thread = thread
            type(self)._holder = self

    def _undo(self) -> None:
        """Each change undone, each step idempotent: a subclass undoes its own, then calls this, which gives the
        place up."""
        if type(self)._holder is self:
            type(self)._holder = None

    def release(self) -> None:
        """Undo what entering did; idempotent. Ctrl-C while it runs: it finishes, then the interrupt goes on."""
        try:
            self._undo()
        except BaseException:
            self._undo()
            raise


class ScopedKernels(OneAtATime):
    """Kernels registered in ``register(library)`` while the context is active (see the module's docstring)."""

    def __init__(self) -> None:
        self._library: Any = None

    @property
    def registered(self) -> bool:
        return self._library is not None

    @property
    def installed(self) -> bool:
        return self.registered

    def register(self, library: torch.library.Library) -> None:
        """Register this context's kernels in ``library`` (aten, IMPL)."""
        raise NotImplementedError

    def __enter__(self) -> Any:
        self._take_place()
        try:
            self._library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": that is the point, and it is undone on exit
                warnings.simplefilter("ignore", UserWarning)
                self.register(self._library)
            return self  # inside the try: Ctrl-C on this line leaves nothing either (no __exit__ will come)
        except BaseException:
            self.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _undo(self) -> None:
        if self._library is not None:
            self._library._destroy()  # every registration undone, PyTorch's own kernels again (idempotent)
            self._library = None
        super()._undo()
