"""Batches a DataLoader's worker processes made are counted (issue 12).

A worker collates its batch into shared memory and sends a file descriptor;
this process rebuilds the storage around that memory
(torch.multiprocessing.reductions.rebuild_storage_fd) and the tensor around the
storage. No allocator of this process gave that memory, and the storage can't
be resized: the trackers took it for memory like a NumPy array's, which no
device would hold, and a cell that kept its batches retained +0 B. On a GPU
the batches would be copied to the device: they are counted as made in the
block, exactly, in both engines.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbmem
from nbmem.tracking.native import available

MiB = 1024**2


@pytest.fixture(scope="module")
def loader() -> DataLoader:
    dataset = TensorDataset(torch.randn(256, 1024))  # 256 * 1024 * 4 bytes = 1 MiB
    return DataLoader(dataset, batch_size=64, num_workers=2)  # 4 batches of 64 * 1024 * 4 = 262,144 B


ENGINES = ["dispatch", pytest.param("native", marks=pytest.mark.skipif(not available(), reason="needs a C++ compiler"))]


@pytest.mark.parametrize("collected", [False, True], ids=["young", "collected"])
@pytest.mark.parametrize("engine", ENGINES)
def test_batches_from_worker_processes_are_retained(loader, engine, collected):
    gc.collect()  # earlier tests' garbage, which a collection inside the scope would free there
    with nbmem.track("cpu", engine=engine) as scope:
        batches = list(loader)
        if collected:
            gc.collect()  # the batches' tensors leave the young generations, where a scope's end looks
    storages = [batch.untyped_storage() for (batch,) in batches]
    assert all(storage.is_shared() and not storage.resizable() for storage in storages)  # what made them unseen
    assert scope.result.retained == 4 * 262_144 == MiB  # 512 B multiples already: rounding adds nothing
    assert scope.result.peak == MiB
    if engine == "native":  # it sees no allocation of theirs, and says where they were found
        assert any("no allocation of the block showed" in note for note in scope.result.notes)
    del batches, storages
    gc.collect()


@pytest.mark.parametrize("engine", ENGINES)
def test_batches_from_worker_processes_freed_in_the_next_cell_are_given_back(loader, engine):
    gc.collect()  # earlier tests' garbage, which a collection inside the scopes would free there
    with nbmem.track("cpu", engine=engine):
        batches = list(loader)
    with nbmem.track("cpu", engine=engine) as scope:
        del batches
    assert scope.result.retained == -MiB
