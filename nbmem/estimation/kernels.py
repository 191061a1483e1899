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

__all__ = ["ScopedKernels", "calls_per_step"]


def calls_per_step(calls: int, steps: int, what: str) -> str:
    """How a kernel rule's note counts its calls: ``what`` calls per step, recomputed ones and micro-batches too.

    >>> calls_per_step(6, 2, "convolution")
    '3 convolution calls per step (recomputed ones and micro-batches too)'
    """
    per_step = calls // steps
    return f"{per_step} {what} call{'s' if per_step != 1 else ''} per step (recomputed ones and micro-batches too)"


class ScopedKernels:
    """Kernels registered in ``register(library)`` while the context is active (see the module's docstring)."""

    #: One lock per subclass (made in __init_subclass__): one active instance of each at a time.
    _active: ClassVar[threading.Lock] = threading.Lock()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._active = threading.Lock()

    def __init__(self) -> None:
        self._library: Any = None

    @property
    def registered(self) -> bool:
        return self._library is not None

    def register(self, library: torch.library.Library) -> None:
        """Register this context's kernels in ``library`` (aten, IMPL)."""
        raise NotImplementedError

    def __enter__(self) -> Any:
        if not type(self)._active.acquire(blocking=False):
            raise RuntimeError(f"nbmem's {type(self).__name__} is already active in this process: one at a time")
        try:
            self._library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": that is the point, and it is undone on exit
                warnings.simplefilter("ignore", UserWarning)
                self.register(self._library)
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        try:
            if self._library is not None:
                self._library._destroy()  # every registration undone: PyTorch's own kernels again
        finally:
            self._library = None
            type(self)._active.release()
