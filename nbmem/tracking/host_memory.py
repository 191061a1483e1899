"""What a tracker keeps off the device: storages in host memory, never counted.

An estimate runs every tensor on the CPU (fake tensors say "cpu"), so where a
real run would move memory to the host, the estimate says so to its tracker:
FSDP's CPU offload keeps the sharded parameters, their gradients and the
optimizer's step and state there (:func:`nbmem.estimation.parallel.offload_to_host`).
Such storages go into the tracker's ``outside`` table (which holds them, so
their keys are never reused while they are listed), beside paged optimizer
state in CUDA managed memory (:mod:`nbmem.estimation.low_bit`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..core.records import _parts, _wraps

__all__ = ["HostMemory"]


class HostMemory:
    """The host-memory part of a :class:`~nbmem.tracking.tracker.Tracker` (a mixin: it uses the tracker's tables)."""

    outside: dict[int, torch.Tensor]
    _on_host: int
    _refs: dict[int, Any]

    if TYPE_CHECKING:
        def _release(self, key: int, ref: Any) -> None: ...  # the tracker's

    def moved_to_host(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage left the device (an offload's copy to the host): freed here, never counted again.

        >>> from nbmem.tracking.tracker import Tracker
        >>> tracker = Tracker("cpu")
        >>> with tracker:
        ...     shard = torch.ones(1024, 256)      # 1 MiB
        >>> tracker.allocated(); tracker.moved_to_host(shard); tracker.allocated(), tracker.peak_allocated()
        1048576
        (0, 1048576)
        """
        for part in _parts(tensor) if _wraps(type(tensor)) else (tensor,):
            key = part.untyped_storage()._cdata
            ref = self._refs.get(key)
            if ref is not None:
                self._release(key, ref)
            self.outside[key] = part

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """Storages made inside are host memory (an offloaded optimizer's step and state): never counted.

        >>> from nbmem.tracking.tracker import Tracker
        >>> tracker = Tracker("cpu")
        >>> with tracker, tracker.on_host():
        ...     state = torch.zeros(1024, 256)
        >>> tracker.allocated(), tracker.peak_allocated()
        (0, 0)
        """
        self._on_host += 1
        try:
            yield
        finally:
            self._on_host -= 1
