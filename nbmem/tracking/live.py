"""Every tensor alive in the process: the baseline of a tracked scope (issue 12).

The GPU allocator counts every block in use when a cell starts, whether or not
the cell touches it, so a tracked cell must too: ``held = torch.ones(2048, 1024)``
in one cell and ``c = torch.ones(256, 1024); del held`` in the next retains
1 MiB - 8 MiB = -7 MiB. A dispatch mode only sees tensors an op uses, so the
tracker finds the rest here when a scope opens.

Two ways were measured (2-core machine shared with 5 other jobs, load 3-5,
torch 2.13.0+cpu, Python 3.11.7, 2026-11-22):

- walking ``gc.get_objects()`` when a scope opens: 30-60 ms for a session of
  167,000 objects, 140-210 ms for 1.2 million objects (100,000 tensors among
  them); paid once per scope opened while no tracker is active;
- tracking from the moment the extension loads: 48 us more on every op of every
  cell (56.5 us against 8.2 us for a bare ``add``), measured or not: 48 ms per
  1,000-op step, paid on every step of every cell, and still blind to tensors
  made before ``%load_ext``.

Walking the objects is chosen, and made cheap for the common case of one
small cell after another: tensors the tracker adopted stay known while they
live, so only objects made since the last walk need looking at. New objects
start in the garbage collector's youngest generation and reach the oldest
only through a collection of generation 1 or 2; while neither has run since
the last walk, generations 0 and 1 hold every new tensor (CPython 3.11-3.13's
generational collector, Modules/gcmodule.c). Walking those took under 1 ms
(an empty scope: 0.7 ms) where the whole walk took 200-470 ms for 284,000
objects (the same session, load 10-11). Python 3.14's incremental collector moves objects
differently: there every walk is whole.

Tensors are found by their type in C
(``map``/``itertools.compress``), never with ``isinstance``: ``isinstance``
asks unrelated objects for ``__class__`` (a lazy module attribute warns on it)
and was 2x slower. The list ``gc.get_objects()`` returns is dropped before this
returns, so no user tensor is held; nothing here calls ``gc.collect()``.
Storages held only by C++ (what autograd saved for a backward not run yet)
are not Python objects: the tracker finds those when an op uses them. A
gradient is made in C++ too, but it hangs off a Python object: each walk
asks every leaf that requires grad it has met for its ``.grad``.

A DataLoader's worker processes collate their batches into shared memory and
send a file descriptor (or a file name); this process rebuilds a storage
around that memory (``torch.multiprocessing.reductions.rebuild_storage_fd``).
No allocator of this process gave it and it can't be resized, like a NumPy
array's; but a GPU would hold a copy, so trackers count it (issue 12: a cell
that kept its batches retained +0 B). The native engine sees no allocation
of it and the default engine may not see the op that wrapped it (another
thread's), so every walk also asks torch's own cache of storages rebuilt from
shared memory (``reductions.shared_cache``, weak references) for those still
alive: found there even when a collection moved their tensors out of the
young generations.

>>> import torch
>>> kept = torch.ones(3)
>>> any(tensor is kept for tensor in live_tensors())
True
"""

from __future__ import annotations

import gc
import itertools
import sys
import weakref
from typing import Any
import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["live_tensors", "shared_memory_tensors", "collections_stamp", "walk", "older_objects_unscanned"]


#: Whether the youngest generations are sure to hold every object made since a stamp (see above).
_GENERATIONAL = sys.version_info < (3, 14)


#: How many times :func:`older_objects_unscanned` gave frozen objects back (into the oldest generation).
_THAWS = 0


def collections_stamp() -> tuple[int, int, int] | None:
    """How many collections of generations 1 and 2 have run, and thaws: take it just before a walk.

    None where the young generations can't be trusted (Python 3.14+).
    """
    if not _GENERATIONAL:
        return None
    stats = gc.get_stats()
    return stats[1]["collections"], stats[2]["collections"], _THAWS


class older_objects_unscanned:
    """Python's cyclic garbage collector leaves the objects that existed before alone until the block ends.

    An estimate makes hundreds of thousands of small objects (fake tensors,
    cache keys), enough to start a full collection, which scans every
    object of the process: about 0.3 s of a 7B QLoRA estimate, scanning the
    500,000 objects that torch, transformers and the notebook had made
    before it. ``gc.freeze()`` sets those aside for the block and
    ``gc.unfreeze()`` gives them back: nothing is collected that would not
    be, the objects the block makes are collected as always (a fake
    tensor's lifetime is unchanged), and no collection is forced. Given
    back, every one of them is in the oldest generation, young ones too
    (a tensor made since the last walk): the thaw counts in
    :func:`collections_stamp`, so the next walk is whole. Where something
    has frozen objects already (a caller, an enclosing estimate), or the
    collector is off, this does nothing.

    A class, not a generator: ``gc.freeze()`` is the last thing ``__enter__``
    does, so no Ctrl-C can land between it and the ``with`` statement taking
    on ``__exit__`` (a generator's ``__enter__`` runs more Python after its
    ``yield``, where one could, and the freeze would outlive the block).
    """

    _froze = False  # whether __enter__ froze: until it did, release() does nothing

    def __enter__(self) -> None:
        if gc.get_freeze_count() == 0 and gc.isenabled():
            self._froze = True
            gc.freeze()

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Give back what ``__enter__`` froze; idempotent, so that the estimate that entered it can release it again
        after a Ctrl-C on ``__exit__``'s very entry, where nothing in it can catch one."""
        global _THAWS
        if self._froze:
            try:
                _THAWS += 1  # first: a walk must never trust the young generations once the thaw began
            finally:
                gc.unfreeze()
                self._froze = False  # last: cut short before it, a second release thaws (nothing) again


def live_tensors(young: bool = False) -> list[torch.Tensor]:
    """Every ``torch.Tensor`` (subclasses included) the garbage collector knows of now.

    ``young``: look only in generations 0 and 1 (see above: all of them when
    no older generation was collected since an earlier walk). The caller must
    drop the list when done: it holds the tensors.
    """
    objects = gc.get_objects(0) + gc.get_objects(1) if young else gc.get_objects()
    try:
        kinds = {kind for kind in set(map(type, objects)) if issubclass(kind, torch.Tensor)}
        return list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    finally:
        del objects


def shared_memory_tensors() -> list[torch.Tensor]:
    """A byte tensor over each live storage rebuilt here from another process's shared memory (see above).

    Read from torch's cache, never imported here (torch imports it with
    ``torch.multiprocessing``); the views are made with Python dispatch off, so
    no tracker's mode counts them as an op. The caller must drop the list.
    """
    reductions = sys.modules.get("torch.multiprocessing.reductions")
    cache = getattr(reductions, "shared_cache", None)
    if not cache:
        return []
    views = []
    with torch._C._DisableTorchDispatch():
        for ref in list(cache.values()):  # a C-level copy: a worker thread may add to the cache meanwhile
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)  # None once it died
            if storage is not None and storage.device.type == "cpu":
                views.append(torch.empty(0, dtype=torch.uint8).set_(storage))
    return views


def walk(tracker: Any, adopt: bool, young: bool = False) -> None:
    """Show ``tracker`` every live tensor on its device: adopted into the baseline, or counted as made now.

    Parameters found while adopting get their gradient hooks (see
    ``Attribution.adopt_parameter``). Only the young generations are walked
    when the tracker's last whole walk still covers the rest, or when asked
    (``young``, bounded cost; then what a collection moved on is left to the
    next whole walk).
    """
    # stamped before the walk; a walk cut short (Ctrl-C) leaves no stamp, so the next one is whole
    stamp = collections_stamp()
    covered = stamp is not None and tracker._walked == stamp
    tensors = live_tensors(young=young or covered) + shared_memory_tensors()
    tracker._walked = None
    refused = tracker._refused
    for key in [key for key, ref in refused.items() if ref() is None]:
        del refused[key]
    try:
        for tensor in tensors:
            if isinstance(tensor, FakeTensor):
                continue  # first: asking a fake tensor anything (.is_meta, .device) is an op (prim.device)
                # that reaches an active tracker's mode, which adopted it: every fake tensor alive was counted
            try:
                if tensor.is_meta:
                    continue
                if tensor.layout is torch.strided:
                    storage = tensor.untyped_storage()
                    if storage.device.type == "meta":
                        continue  # a fake tensor (an estimate's): it says "cpu", its storage holds nothing
                    if storage._cdata in refused:
                        continue  # a virtual out-of-memory error refused it: it is on no device
            except (RuntimeError, NotImplementedError):
                pass  # no storage of its own (sparse): _count counts its parts
            if not tracker._on_device(tensor):
                continue
            tracker._count(tensor, adopt=adopt)
            if tensor.requires_grad and tensor.is_leaf:
                tracker._leaves[id(tensor)] = weakref.ref(tensor)  # no callback: no Python for Ctrl-C to land in
            if adopt and isinstance(tensor, torch.nn.Parameter) and tracker._attribution is not None:
                tracker._attribution.adopt_parameter(tensor)
    finally:
        del tensors
    _count_gradients(tracker, adopt)
    tracker._walked = stamp if covered or not young else None


def _count_gradients(tracker: Any, adopt: bool) -> None:
    """The ``.grad`` of every leaf that requires grad a walk has met, as the walk counts a tensor.

    Autograd makes a gradient in C++ (AccumulateGrad): it has no Python object
    until someone asks for ``.grad``, so no walk of Python's objects finds it,
    and a young walk never looks at an old leaf again. Without this, a
    backward run between two scopes left its gradients out of the second
    one's baseline, and their freeing (``zero_grad``) out of what it retained.
    """
    attribution = tracker._attribution
    leaves = tracker._leaves
    for key, ref in list(leaves.items()):
        leaf = ref()
        if leaf is None:
            del leaves[key]  # dead: its id may be a new object's
            continue
        gradient = leaf.grad
        if gradient is None or not tracker._on_device(gradient):
            continue
        tracker._count(gradient, adopt=adopt)
        # classified every time (a no-op once it is): the walk may have met the gradient itself first,
        # as "other" (one whose Python object someone asked for), where its old leaf was not walked
        if adopt and attribution is not None:
            owner = tracker.module_of(leaf) if isinstance(leaf, torch.nn.Parameter) else None
            tracker.classify(gradient, "gradient", owner)
