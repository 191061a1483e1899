"""What a tracker holds now: the read-only questions about its records.

A mixin of :class:`~nbmem.tracking.tracker.Tracker`, which keeps the records
(one :class:`~nbmem.core.records.StorageRecord` per live storage) and the
counters per category and per module; each question first counts what died
since the last op (``drain``), so a storage freed a moment ago is not in the
answer.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import torch

from ..core.records import StorageRecord

__all__ = ["LiveView"]


class LiveView:
    """Live storages, bytes per category and per module (a mixin: it reads the tracker's tables)."""

    _storages: dict[int, StorageRecord]
    _categories: dict[str, int]
    _modules: dict[str | None, int]
    _adopted: int
    _op_index: int

    if TYPE_CHECKING:
        def drain(self) -> None: ...  # the tracker's

    @property
    def adopted(self) -> int:
        """Bytes found in use that were allocated before tracking saw them."""
        return self._adopted

    @property
    def op_count(self) -> int:
        """Operations this tracker has seen (its op index)."""
        return self._op_index

    @property
    def live_storages(self) -> int:
        self.drain()
        return len(self._storages)

    def by_category(self) -> dict[str, int]:
        """Live bytes per category now; the values sum to :meth:`allocated`."""
        self.drain()
        return dict(self._categories)

    def by_module(self) -> dict[str | None, int]:
        """Live bytes per top-level module now (None: made outside any module)."""
        self.drain()
        return {module: size for module, size in self._modules.items() if size}

    def largest(self, count: int = 10) -> list[tuple[int, StorageRecord]]:
        """The ``count`` largest live storages, as (storage key, record)."""
        self.drain()
        return heapq.nlargest(count, self._storages.items(), key=lambda item: item[1].size)

    def storage_key(self, tensor: torch.Tensor) -> int | None:
        """The key under which ``tensor``'s storage is tracked, None if it is not."""
        self.drain()  # a storage freed since the last op may have left its key to this one
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return None
        return key if key in self._storages else None

    def record_of(self, tensor: torch.Tensor) -> StorageRecord | None:
        key = self.storage_key(tensor)
        return None if key is None else self._storages[key]

    def module_of(self, tensor: torch.Tensor) -> str | None:
        """The module ``tensor``'s storage belongs to (None: outside modules, or not tracked)."""
        record = self.record_of(tensor)
        return None if record is None else record.module
