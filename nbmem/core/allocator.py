"""A simulation of PyTorch's CUDA caching allocator: what a run would *reserve*.

Allocated bytes say what tensors hold; reserved bytes (what ``nvidia-smi``
mostly shows) also include freed blocks the allocator caches for reuse and the
unused tails of its segments. The rules, from c10/cuda/CUDACachingAllocator.cpp:

- every request is rounded up to a multiple of 512 B (kMinBlockSize), or with
  ``roundup_power2_divisions`` to the next of N steps between powers of two;
- requests of at most 1 MiB (kSmallSize) come from the small pool, whose
  segments are 2 MiB (kSmallBuffer); larger ones from the large pool, whose
  segments are 20 MiB (kLargeBuffer) for requests under 10 MiB (kMinLargeAlloc)
  and the request rounded up to 2 MiB (kRoundLarge) otherwise;
- a request takes the smallest cached free block of its pool that fits (best
  fit; of equal ones the lowest address: here the oldest segment's, or, where
  the real addresses are known, as in a snapshot's replay, the lowest), split
  when the rest is at least 512 B (small pool, or any pool with
  expandable segments) or more than 1 MiB (large pool) and the request is under
  ``max_split_size``; blocks of ``max_split_size`` or more serve only requests of
  that size or more, and only within ``max_non_split_rounding`` (20 MiB) of it;
  a freed block merges with free neighbours in its segment;
- with expandable segments there is one segment per pool, mapped in pages
  (2 MiB small, 20 MiB large) at its lowest free address as it grows;
- when no cached block fits: old cached segments are freed first if a
  ``garbage_collection_threshold`` and a per-process memory fraction are set;
  then a new segment; if the device (or the fraction) can't give it, cached
  oversize blocks are freed (release_available_cached_blocks), then every whole
  free segment and every free page (release_cached_blocks), and it is retried.

Settings come from :mod:`nbmem.core.allocator_settings`. Not simulated: streams
(one stream assumed), CUDA graph pools, the cudaMallocAsync backend.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

from .allocator_settings import UNLIMITED, AllocatorSettings
from .units import round_allocation

__all__ = ["CachingAllocatorSimulation", "segment_size", "round_request", "StepRecording", "settle"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
#: An expandable segment reserves address space, not memory: 1 1/8 of the device (64 TiB with no capacity given).
_NO_CAPACITY_ADDRESS_SPACE = 1 << 46


def segment_size(request: int) -> int:
    """The segment cudaMalloc'd for a request (already rounded) that no cached block fits.

    >>> segment_size(512), segment_size(1536 * 1024), segment_size(13 << 20)
    (2097152, 20971520, 14680064)
    """
    if request <= SMALL_SIZE:
        return SMALL_BUFFER
    if request < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-request // ROUND_LARGE) * ROUND_LARGE


def round_request(nbytes: int, settings: AllocatorSettings | None = None) -> int:
    """The block size the allocator gives a request of ``nbytes`` (round_size).

    >>> round_request(4), round_request(1200 << 20)      # 512 B steps by default
    (512, 1258291200)
    >>> from nbmem.core.allocator_settings import parse_alloc_conf
    >>> round_request(1200 << 20, parse_alloc_conf("roundup_power2_divisions:4")) >> 20   # 1024, 1280, 1536, 1792 MiB
    1280
    """
    divisions = settings.divisions(nbytes) if settings is not None and nbytes > 0 else 0
    if divisions > 1 and nbytes > MIN_BLOCK * divisions:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = nbytes & ~(step - 1)
        return nbytes if rounded == nbytes else rounded + step
    return round_allocation(nbytes)  # 512-B steps, 0 for nothing


@dataclass(eq=False)
class _Block:
    segment: "_Segment"
    offset: int
    size: int
    allocated: bool = False
    previous: "_Block | None" = None
    next: "_Block | None" = None
    #: False for the unmapped address space of an expandable segment
    mapped: bool = True
    #: the pool's free-block searches when this block was cached (its age, for garbage collection)
    age_base: int = 0
    #: bytes asked for by the allocation it holds (0 while free)
    requested: int = 0


@dataclass(eq=False)
class _Segment:
    #: bytes reserved: a cudaMalloc's size, or what an expandable segment has mapped
    size: int
    small: bool
    number: int
    first: _Block | None = None
    #: an expandable segment's page (bytes mapped at a time); 0 for a cudaMalloc segment
    page: int = 0
    #: the address space it takes: its size, or an expandable segment's whole reserved range
    span: int = 0
    #: where it lies: the real address of the request it was made for (malloc's ``address``), None where unknown
    address: int | None = None


@dataclass
class CachingAllocatorSimulation:
    """Replays allocations and frees (by key) and keeps allocated and reserved bytes, with peaks.

    >>> simulation = CachingAllocatorSimulation()
    >>> simulation.malloc("a", 4)            # one float: a 512 B block in a new 2 MiB segment
    512
    >>> simulation.allocated, simulation.reserved
    (512, 2097152)
    """

    capacity: int | None = None
    #: With a capacity: raise MemoryError when a segment can't be reserved
    #: (strict), or note it in ``overflow`` and reserve it anyway (to keep counting).
    strict: bool = True
    overflow: int | None = None
    settings: AllocatorSettings = field(default_factory=AllocatorSettings)
    #: torch.cuda.set_per_process_memory_fraction's cap, in bytes (None: not set); the
    #: garbage_collection_threshold acts only under it, as in PyTorch
    allowed_memory: int | None = None
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    _blocks: dict[object, _Block] = field(default_factory=dict)
    # small? -> sorted (size, segment number, offset, block): the cached free blocks
    _free: dict[bool, list[tuple[int, int, int, _Block]]] = field(default_factory=lambda: {True: [], False: []})
    # small? -> sorted (segment number, offset, block): expandable segments' unmapped address space
    _unmapped: dict[bool, list[tuple[int, int, _Block]]] = field(default_factory=lambda: {True: [], False: []})
    _segments: list[_Segment] = field(default_factory=list)
    _numbers: itertools.count[int] = field(default_factory=itertools.count)
    #: where the real allocator put the request being served (malloc's ``address``), None where unknown
    _address: int | None = None
    _searches: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    #: When a list: every change to what is reserved, as (action, segment, offset, bytes) with PyTorch's trace
    #: actions (segment_alloc, segment_free, segment_map, segment_unmap), for an exported snapshot.
    log: list[tuple[str, _Segment, int, int]] | None = None

    def malloc(self, key: object, nbytes: int, address: int | None = None) -> int:
        """Allocate ``nbytes`` (as requested) for ``key``: the block's bytes, which count as allocated (a cached block
        at most 1 MiB larger than asked is not split: CUDA counts it whole). MemoryError past ``capacity`` if strict.

        ``address``: where the real allocator put it, when replaying a recorded trace. CUDA gives a request the
        lowest-addressed of equal free blocks, and cudaMalloc's addresses follow no order a simulation can know; a
        segment made for a request with an address is ordered at that address, so that a replay hands out the
        blocks the real allocator did.
        """
        size = round_request(nbytes, self.settings)
        if size == 0:
            return 0
        self._address = address
        small = size <= SMALL_SIZE
        block = self._get_free_block(small, size)
        if block is None:
            if self.allowed_memory is not None and self.settings.garbage_collection_threshold > 0:
                self._garbage_collect()
            block = self._alloc_block(small, size)
            if block is None and self._release_available(small, size):
                block = self._alloc_block(small, size)
            if block is None:
                self.empty_cache()
                block = self._alloc_block(small, size)
            if block is None:
                wanted = segment_size(size)
                if self.strict:
                    raise MemoryError(
                        f"the simulated allocator needs a {wanted} B segment with {self.reserved} B reserved "
                        f"of {self.allowed_memory if self.allowed_memory is not None else self.capacity} B"
                    )
                if self.overflow is None:
                    self.overflow = wanted  # the first segment that could not be reserved
                block = self._alloc_block(small, size, force=True)
                assert block is not None
        remaining = block.size - size
        if small or self.settings.expandable_segments:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self.settings.max_split_size and remaining > SMALL_SIZE
        if split:
            rest = _Block(block.segment, block.offset + size, remaining, previous=block, next=block.next)
            if block.next is not None:
                block.next.previous = rest
            block.next, block.size = rest, size
            self._cache(rest)
        block.allocated, block.requested = True, nbytes
        self._blocks[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.size

    def block_size(self, key: object, default: int = 0) -> int:
        """Bytes of the block live under ``key`` (``default`` if there is none)."""
        block = self._blocks.get(key)
        return default if block is None else block.size

    def address(self, key: object) -> int | None:
        """Where the live allocation under ``key`` lies: its segment's address (that of the request the segment was
        made for, where malloc was given one) and its offset there; None where that is unknown."""
        block = self._blocks.get(key)
        if block is None or block.segment.address is None:
            return None
        return block.segment.address + block.offset

    def free(self, key: object) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        self._merge(block, block.previous)
        self._merge(block, block.next)
        self._cache(block)

    def requested(self, key: object) -> int:
        """Bytes the live allocation under ``key`` asked for (0 if there is none)."""
        block = self._blocks.get(key)
        return 0 if block is None else block.requested

    def relaid(self) -> CachingAllocatorSimulation:
        """A fresh simulation holding the same live allocations, made in the same order on an empty device.

        What a loader that puts tensors on the GPU in their final form would
        reserve (an estimate's ``"bf16-weights"``: real loaders never put the
        fp32 build on the GPU); peaks start there.
        """
        fresh = CachingAllocatorSimulation(capacity=self.capacity, strict=self.strict, settings=self.settings,
                                           allowed_memory=self.allowed_memory, log=self.log)
        for key, block in self._blocks.items():
            fresh.malloc(key, block.requested)
        return fresh

    def empty_cache(self) -> None:
        """Give back every whole free segment and every free page of expandable ones (release_cached_blocks)."""
        for small in (False, True):
            expandable = []
            for *_, block in list(self._free[small]):
                if block.segment.page:
                    expandable.append(block)
                elif block.previous is None and block.next is None:
                    self._release_segment(block)
            for block in expandable:
                self._unmap(block)
                if block.previous is None and block.next is None:  # nothing mapped: the segment goes
                    self._remove(self._unmapped[small], (block.segment.number, block.offset), block)
                    self._segments.remove(block.segment)

    # -- finding a block ---------------------------------------------------------

    def _get_free_block(self, small: bool, size: int) -> _Block | None:
        if self.allowed_memory is not None and self.settings.garbage_collection_threshold > 0:
            self._searches[small] += 1
        entries = self._free[small]
        index = bisect.bisect_left(entries, (size, -1, -1))
        if index == len(entries):
            return None
        block = entries[index][3]
        if block.segment.page:
            if self.settings.expandable_segments:
                # a block that can grow into unmapped space counts as that large for best fit
                while (block.segment.page and index + 1 < len(entries)
                       and _expandable_size(entries[index + 1][3]) < _expandable_size(block)):
                    index += 1
                    block = entries[index][3]
            else:  # expandable segments turned off since: only cudaMalloc'd blocks serve
                index += 1
                while index < len(entries) and entries[index][3].segment.page:
                    index += 1
                if index == len(entries):
                    return None
                block = entries[index][3]
        oversize = self.settings.max_split_size
        if size < oversize <= block.size:
            return None  # never an oversize block for a request under max_split_size
        if size >= oversize and block.size >= size + self.settings.max_non_split_rounding:
            return None  # an oversize block serves only requests near its size
        del entries[index]
        return block

    def _number(self) -> int:
        """A new segment's place among equal free blocks (CUDA's: the lowest address first): the order segments are
        made in, or the real address of the request it is made for (unique: the order made breaks a tie)."""
        made = next(self._numbers)
        return made if self._address is None else (self._address << 32) + made

    def _alloc_block(self, small: bool, size: int, force: bool = False) -> _Block | None:
        wanted = segment_size(size)
        if not force and self.allowed_memory is not None and self.reserved + wanted > self.allowed_memory:
            return None
        if self.settings.expandable_segments:
            return self._expandable_block(small, size, force)
        if not force and self.capacity is not None and self.reserved + wanted > self.capacity:
            return None
        segment = _Segment(wanted, small, self._number(), span=wanted, address=self._address)
        block = _Block(segment, 0, wanted)
        segment.first = block
        self._segments.append(segment)
        self._grow(wanted)
        self._note("segment_alloc", segment, 0, wanted)
        return block

    # -- expandable segments -----------------------------------------------------

    def _expandable_block(self, small: bool, size: int, force: bool) -> _Block | None:
        """try_allocate_expandable_block: map pages at the lowest address with room, merged into one free block."""
        candidate = self._find_expandable(small, size)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size), force):
            return None
        while candidate.size < size:
            following = candidate.next
            assert following is not None and not following.mapped
            if not self._map(following, min(size - candidate.size, following.size), force):
                return None
            candidate = following  # it absorbed the free block before it
        self._uncache(candidate)
        return candidate

    def _find_expandable(self, small: bool, size: int) -> _Block:
        walk: _Block | None
        for _, _, block in self._unmapped[small]:
            start = block.previous if block.previous is not None and not block.previous.allocated else block
            room, walk = 0, start
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return start
        page = SMALL_BUFFER if small else LARGE_BUFFER
        space = _NO_CAPACITY_ADDRESS_SPACE if self.capacity is None else self.capacity + self.capacity // 8
        segment = _Segment(0, small, self._number(), page=page, span=-(-space // page) * page,
                           address=self._address)
        block = _Block(segment, 0, segment.span, mapped=False)
        segment.first = block
        self._segments.append(segment)
        bisect.insort(self._unmapped[small], (segment.number, 0, block))
        return block

    def _map(self, block: _Block, size: int, force: bool) -> bool:
        page = block.segment.page
        mapped = min((-(-(block.offset + size) // page) - block.offset // page) * page, block.size)
        if not force and self.capacity is not None and self.reserved + mapped > self.capacity:
            return False
        self._note("segment_map", block.segment, block.offset, mapped)
        self._remove(self._unmapped[block.segment.small], (block.segment.number, block.offset), block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.segment, block.offset + mapped, block.size - mapped, mapped=False,
                          previous=block, next=block.next)
            if block.next is not None:
                block.next.previous = rest
            block.next, block.size = rest, mapped
            bisect.insort(self._unmapped[block.segment.small], (rest.segment.number, rest.offset, rest))
        self._merge(block, block.previous)
        self._merge(block, block.next)
        self._cache(block)
        block.segment.size += mapped
        self._grow(mapped)
        return True

    def _unmap(self, block: _Block) -> None:
        """unmap_block: give back the whole pages inside a free block; the ragged ends stay mapped and cached."""
        segment, page = block.segment, block.segment.page
        start = -(-block.offset // page) * page
        stop = (block.offset + block.size) // page * page
        if start >= stop:
            return
        self._uncache(block)
        if start > block.offset:
            before = _Block(segment, block.offset, start - block.offset, previous=block.previous, next=block)
            if block.previous is not None:
                block.previous.next = before
            else:
                segment.first = before
            block.previous = before
            self._cache(before)
        if stop < block.offset + block.size:
            after = _Block(segment, stop, block.offset + block.size - stop, previous=block, next=block.next)
            if block.next is not None:
                block.next.previous = after
            block.next = after
            self._cache(after)
        block.offset, block.size, block.mapped = start, stop - start, False
        self._merge(block, block.previous)
        self._merge(block, block.next)
        bisect.insort(self._unmapped[segment.small], (segment.number, block.offset, block))
        segment.size -= stop - start
        self.reserved -= stop - start
        self._note("segment_unmap", segment, start, stop - start)

    # -- giving memory back ------------------------------------------------------

    def _release_available(self, small: bool, size: int) -> bool:
        """release_available_cached_blocks: free cached oversize blocks (only with a max_split_size)."""
        oversize = self.settings.max_split_size
        if oversize == UNLIMITED:
            return False
        wanted = max(size, oversize)
        entries = self._free[small]
        index = bisect.bisect_left(entries, (wanted, -1, -1))
        if index < len(entries):
            return self._release_segment(entries[index][3])
        released, index = 0, index - 1
        while index >= 0 and released < wanted and entries[index][3].size >= oversize:
            block = entries[index][3]
            if self._release_segment(block):
                released += block.size
            index -= 1
        return released >= wanted

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: free whole cached large segments, oldest (least reused) first."""
        assert self.allowed_memory is not None
        threshold = int(self.settings.garbage_collection_threshold * self.allowed_memory)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0

        def freeable() -> list[_Block]:
            return [entry[3] for entry in self._free[False]
                    if not entry[3].segment.page and entry[3].previous is None and entry[3].next is None]

        ages = {id(block): self._searches[False] - block.age_base for block in freeable()}
        total, count = sum(ages.values()), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            average, freed = total / count, False
            for block in freeable():
                if ages[id(block)] >= average:
                    freed = True
                    reclaimed += block.size
                    total -= ages[id(block)]
                    count -= 1
                    self._release_segment(block)

    def _release_segment(self, block: _Block) -> bool:
        """cudaFree a cached block that is a whole cudaMalloc'd segment (release_block)."""
        if block.segment.page or block.previous is not None or block.next is not None:
            return False
        self._uncache(block)
        self._segments.remove(block.segment)
        self.reserved -= block.segment.size
        self._note("segment_free", block.segment, 0, block.segment.size)
        return True

    # -- pools -------------------------------------------------------------------

    def _note(self, action: str, segment: _Segment, offset: int, nbytes: int) -> None:
        if self.log is not None:
            self.log.append((action, segment, offset, nbytes))

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _merge(self, block: _Block, neighbour: _Block | None) -> None:
        """try_merge_blocks: ``block`` absorbs a free neighbour of the same kind (mapped or not)."""
        if neighbour is None or neighbour.allocated or neighbour.mapped != block.mapped:
            return
        if neighbour.mapped:
            self._uncache(neighbour)
        else:
            self._remove(self._unmapped[neighbour.segment.small], (neighbour.segment.number, neighbour.offset), neighbour)
        if neighbour is block.previous:
            block.offset, block.previous = neighbour.offset, neighbour.previous
            if block.previous is not None:
                block.previous.next = block
            else:
                block.segment.first = block
        else:
            block.next = neighbour.next
            if neighbour.next is not None:
                neighbour.next.previous = block
        block.size += neighbour.size

    def _cache(self, block: _Block) -> None:
        block.age_base = self._searches[block.segment.small]
        bisect.insort(self._free[block.segment.small], (block.size, block.segment.number, block.offset, block))

    def _uncache(self, block: _Block) -> None:
        self._remove(self._free[block.segment.small], (block.size, block.segment.number, block.offset), block)

    @staticmethod
    def _remove(entries: list[Any], prefix: tuple[int, ...], block: _Block) -> None:
        index = bisect.bisect_left(entries, prefix)
        while index < len(entries) and entries[index][-1] is not block:
            index += 1
        if index < len(entries):
            del entries[index]


def _expandable_size(block: _Block) -> int:
    """A cached block's size for best fit when expandable: with the unmapped space right after it."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


class StepRecording:
    """Passes allocations and frees on to ``inner`` and records them (with each freed block's bytes), to replay a
    steady step (:func:`settle`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.events: list[tuple[bool, object, int]] = []  # (malloc?, key, bytes asked for)

    def malloc(self, key: object, nbytes: int) -> int:
        self.events.append((True, key, nbytes))
        return int(self.inner.malloc(key, nbytes))

    def block_size(self, key: object, default: int = 0) -> int:
        return int(self.inner.block_size(key, default))

    def free(self, key: object) -> None:
        self.events.append((False, key, self.inner.requested(key)))
        self.inner.free(key)


def settle(simulation: CachingAllocatorSimulation, events: list[tuple[bool, object, int]], most: int = 20) -> int:
    """Replay a recorded steady step until the allocator's segments stop changing; the replays it took.

    A training step leaves the allocator's cache a little different each time
    until its layout repeats; two steps may not reach that. Each replay makes
    the step's allocations again under fresh keys (storages' addresses, which
    the recorded step reuses, name nothing across steps). Where the step
    freed something made before it (the last step's loss, say), a replay frees
    what the replay before left alive of that size, in order: the step's own
    leftovers, one step on; a free with no such match (something from before
    the first step) is not repeated.
    """
    from collections import deque

    def leftovers(made: dict[object, tuple[object, int]]) -> dict[int, deque[object]]:
        by_size: dict[int, deque[object]] = {}
        for alias, nbytes in made.values():
            by_size.setdefault(nbytes, deque()).append(alias)
        return by_size

    made: dict[object, tuple[object, int]] = {}  # the recorded step's own allocations alive at its end
    for was_malloc, key, nbytes in events:
        if was_malloc:
            made[key] = (key, nbytes)
        else:
            made.pop(key, None)
    carried = leftovers(made)

    def layout() -> tuple[int, tuple[tuple[int, bool], ...]]:
        return simulation.reserved, tuple(sorted((segment.size, segment.small) for segment in simulation._segments))

    before, fresh = layout(), itertools.count()
    for replay in range(1, most + 1):
        alive: dict[object, tuple[object, int]] = {}
        for was_malloc, key, nbytes in events:
            if was_malloc:
                alive[key] = (("replay", next(fresh)), nbytes)
                simulation.malloc(alive[key][0], nbytes)
            elif key in alive:
                simulation.free(alive.pop(key)[0])
            elif carried.get(nbytes):
                simulation.free(carried[nbytes].popleft())
        carried = leftovers(alive)
        after = layout()
        if after == before:
            return replay
        before = after
    return most
