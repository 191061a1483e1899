"""A dispatch-mode recorder of the storages ops make, for tests that compare an estimate's allocations with a GPU's."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Allocations(TorchDispatchMode):
    """The bytes of each storage an op makes, in order (views and in-place ops make none; ``contiguous``, an alias
    by its schema, makes one where it copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self._seen: set[int] = set()
        self._kept: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        copied = (func is torch.ops.aten.contiguous.default
                  and out.untyped_storage()._cdata != args[0].untyped_storage()._cdata)
        if copied or (not func.is_view and not func._schema.is_mutable):
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self._seen:
                    storage = tensor.untyped_storage()
                    self._seen.add(storage._cdata)
                    self._kept.append(storage)
                    self.sizes.append(storage.nbytes())
        return out
