"""A simulation of PyTorch's CUDA caching allocator: what a run would *reserve*.

Allocated bytes say what tensors hold; reserved bytes (what ``nvidia-smi``
mostly shows) also include freed blocks the allocator caches for reuse and the
unused tails of its segments. The rules, from c10/cuda/CUDACachingAllocator.cpp:

- every request is rounded up to a multiple of 512 B (kMinBlockSize);
- requests of at most 1 MiB (kSmallSize) come from the small pool, whose
  segments are 2 MiB (kSmallBuffer); larger ones from the large pool, whose
  segments are 20 MiB (kLargeBuffer) for requests under 10 MiB (kMinLargeAlloc)
  and the request rounded up to 2 MiB (kRoundLarge) otherwise;
- a request takes the smallest cached free block of its pool that fits (best
  fit), split when the rest is at least 512 B (small pool) or more than 1 MiB
  (large pool); a freed block merges with free neighbours in its segment;
- when a new segment would not fit the device, whole free segments are
  released first (release_cached_blocks) and the request retried.

Not simulated: streams (one stream assumed), expandable segments, the
max_split_size and garbage-collection settings of PYTORCH_CUDA_ALLOC_CONF.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from .units import round_allocation

__all__ = ["CachingAllocatorSimulation", "segment_size"]

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


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


@dataclass(eq=False)
class _Block:
    segment: "_Segment"
    offset: int
    size: int
    allocated: bool = False
    previous: "_Block | None" = None
    next: "_Block | None" = None


@dataclass(eq=False)
class _Segment:
    size: int
    small: bool
    number: int
    first: _Block | None = None


@dataclass
class CachingAllocatorSimulation:
    """Replays allocations and frees (by key) and keeps allocated and reserved bytes, with peaks.

    >>> simulation = CachingAllocatorSimulation()
    >>> simulation.malloc("a", 4)            # one float: a 512 B block in a new 2 MiB segment
    >>> simulation.allocated, simulation.reserved
    (512, 2097152)
    """

    capacity: int | None = None
    #: With a capacity: raise MemoryError when a segment can't be reserved
    #: (strict), or note it in ``overflow`` and reserve it anyway (to keep counting).
    strict: bool = True
    overflow: int | None = None
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    _blocks: dict[object, _Block] = field(default_factory=dict)
    # small? -> sorted (size, segment number, offset, block)
    _free: dict[bool, list[tuple[int, int, int, _Block]]] = field(default_factory=lambda: {True: [], False: []})
    _segments: list[_Segment] = field(default_factory=list)
    _numbers: itertools.count[int] = field(default_factory=itertools.count)

    def malloc(self, key: object, nbytes: int) -> None:
        """Allocate ``nbytes`` for ``key``; raises MemoryError past ``capacity``."""
        size = round_allocation(nbytes)
        if size == 0:
            return
        small = size <= SMALL_SIZE
        block = self._best_fit(small, size)
        if block is None:
            block = self._new_segment(small, size)
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, remaining, previous=block, next=block.next)
            if block.next is not None:
                block.next.previous = rest
            block.next, block.size = rest, size
            self._cache(rest)
        block.allocated = True
        self._blocks[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.previous, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._uncache(neighbour)
        # merge with free neighbours (as free_block / try_merge_blocks)
        while block.previous is not None and not block.previous.allocated:
            previous = block.previous
            previous.size += block.size
            previous.next = block.next
            if block.next is not None:
                block.next.previous = previous
            block = previous
        while block.next is not None and not block.next.allocated:
            following = block.next
            block.size += following.size
            block.next = following.next
            if following.next is not None:
                following.next.previous = block
        self._cache(block)

    # -- pools -----------------------------------------------------------------

    def _cache(self, block: _Block) -> None:
        bisect.insort(self._free[block.segment.small], (block.size, block.segment.number, block.offset, block))

    def _uncache(self, block: _Block) -> None:
        entries = self._free[block.segment.small]
        index = bisect.bisect_left(entries, (block.size, block.segment.number, block.offset))
        while index < len(entries) and entries[index][3] is not block:
            index += 1
        if index < len(entries):
            del entries[index]

    def _best_fit(self, small: bool, size: int) -> _Block | None:
        entries = self._free[small]
        index = bisect.bisect_left(entries, (size, -1, -1))
        if index == len(entries):
            return None
        return entries.pop(index)[3]

    def _new_segment(self, small: bool, size: int) -> _Block:
        wanted = segment_size(size)
        if self.capacity is not None and self.reserved + wanted > self.capacity:
            self._release_free_segments()
            if self.reserved + wanted > self.capacity:
                if self.strict:
                    raise MemoryError(
                        f"the simulated allocator needs a {wanted} B segment with {self.reserved} B reserved "
                        f"of {self.capacity} B"
                    )
                if self.overflow is None:
                    self.overflow = wanted  # the first segment that could not be reserved
        segment = _Segment(wanted, small, next(self._numbers))
        block = _Block(segment, 0, wanted)
        segment.first = block
        self._segments.append(segment)
        self.reserved += wanted
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _release_free_segments(self) -> None:
        for segment in list(self._segments):
            block = segment.first
            if block is not None and not block.allocated and block.next is None and block.size == segment.size:
                self._uncache(block)
                self._segments.remove(segment)
                self.reserved -= segment.size
