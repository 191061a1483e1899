"""What a tracker keeps off the device: storages in host memory, never counted.

An estimate runs every tensor on the CPU (fake tensors say "cpu"), so where a
real run would move memory to the host, the estimate says so to its tracker:
FSDP's CPU offload keeps the sharded parameters, their gradients and the
optimizer's step and state there (:func:`nbmem.estimation.parallel.offload_to_host`).
Such storages go into the tracker's ``outside`` table, beside paged optimizer
state in CUDA managed memory (:mod:`nbmem.estimation.low_bit`), and an
optimizer's step counters (:class:`nbmem.tracking.host_counters.HostStepCounters`).
The table holds each weakly, and forgets it when it dies, so that a new
storage given the same key is counted: a tracker kept by a result (an
estimate's) keeps none of them alive.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..core.records import _parts, _wraps

__all__ = ["HostMemory", "keep_outside"]


class HostMemory:
    """The host-memory part of a :class:`~nbmem.tracking.tracker.Tracker` (a mixin: it uses the tracker's tables)."""

    outside: dict[int, weakref.ref[Any]]
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
            self.keep_outside(part)

    def keep_outside(self, tensor: torch.Tensor) -> None:
        """``tensor``'s storage is not the device allocator's: never counted, for as long as it lives.

        >>> from nbmem.tracking.tracker import Tracker
        >>> tracker = Tracker("cpu")
        >>> paged = torch.ones(256)
        >>> tracker.keep_outside(paged)
        >>> with tracker:
        ...     doubled = paged.mul_(2)          # in place: still outside
        >>> tracker.allocated(), len(tracker.outside)
        (0, 1)
        >>> del paged, doubled
        >>> len(tracker.outside)                  # forgotten with it: its key may be a new storage's
        0
        """
        keep_outside(self.outside, tensor)

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
        depth = self._on_host
        try:  # whatever line Ctrl-C lands on, the depth is put back (and an uninstall sets it to 0)
            self._on_host = depth + 1
            yield
        finally:
            self._on_host = depth


def keep_outside(outside: dict[int, weakref.ref[Any]], tensor: torch.Tensor) -> None:
    """Note ``tensor``'s storage in a tracker's ``outside`` table, held weakly and forgotten when it dies."""
    storage = tensor.untyped_storage()
    key = storage._cdata

    def forget(ref: weakref.ref[Any]) -> None:
        if outside.get(key) is ref:
            del outside[key]

    outside[key] = weakref.ref(storage, forget)
