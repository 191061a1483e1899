"""The caching allocator simulation, rule by rule, with exact bytes."""

from __future__ import annotations

import pytest

from nbmem.core.allocator import CachingAllocatorSimulation, segment_size

KiB, MiB = 1024, 1024**2


def test_small_requests_share_2mib_segments():
    simulation = CachingAllocatorSimulation()
    simulation.malloc("a", 4)  # -> 512 B
    simulation.malloc("b", 1000)  # -> 1024 B, same segment
    assert (simulation.allocated, simulation.reserved) == (512 + 1024, 2 * MiB)
    simulation.malloc("c", 1 * MiB)  # exactly 1 MiB is still small: fits the rest of the segment
    assert simulation.reserved == 2 * MiB
    simulation.malloc("d", 1 * MiB)  # no room left: a second 2 MiB segment
    assert simulation.reserved == 4 * MiB


def test_large_requests_segment_sizes():
    assert segment_size(1 * MiB + 512) == 20 * MiB  # above kSmallSize, below 10 MiB
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB on: rounded up to 2 MiB
    assert segment_size(13 * MiB) == 14 * MiB
    simulation = CachingAllocatorSimulation()
    simulation.malloc("a", 1536 * KiB)
    simulation.malloc("b", 1536 * KiB)  # split from the same 20 MiB segment
    assert (simulation.allocated, simulation.reserved) == (3 * MiB, 20 * MiB)


def test_large_block_not_split_when_rest_is_at_most_1mib():
    simulation = CachingAllocatorSimulation()
    simulation.malloc("big", 12 * MiB)  # a 12 MiB segment
    simulation.free("big")
    simulation.malloc("smaller", 11 * MiB + 512)  # rest < 1 MiB: takes the whole 12 MiB block
    assert (simulation.allocated, simulation.reserved) == (12 * MiB, 12 * MiB)


def test_freed_blocks_are_cached_and_reused():
    simulation = CachingAllocatorSimulation()
    simulation.malloc("a", 4 * MiB)
    simulation.free("a")
    assert (simulation.allocated, simulation.reserved) == (0, 20 * MiB)  # reserved stays: the cache
    simulation.malloc("b", 4 * MiB)
    assert (simulation.reserved, simulation.peak_reserved, simulation.peak_allocated) == (20 * MiB, 20 * MiB, 4 * MiB)


def test_free_neighbours_merge():
    simulation = CachingAllocatorSimulation()
    for name in "abc":
        simulation.malloc(name, 4 * MiB)  # three 4 MiB blocks and an 8 MiB tail in one 20 MiB segment
    simulation.free("a")
    simulation.free("b")  # merges with a: one free 8 MiB block
    simulation.malloc("d", 8 * MiB)  # fits the merged block: no new segment
    assert simulation.reserved == 20 * MiB
    simulation.free("c")
    simulation.free("d")
    simulation.malloc("whole", 20 * MiB)  # everything merged back into the whole segment
    assert simulation.reserved == 20 * MiB


def test_a_cached_large_block_serves_a_larger_request_too():
    simulation = CachingAllocatorSimulation()
    simulation.malloc("a", 4 * MiB)  # a 20 MiB segment
    simulation.free("a")
    simulation.malloc("b", 12 * MiB)  # best fit: the cached 20 MiB block, split (8 MiB rest > 1 MiB)
    assert (simulation.allocated, simulation.reserved) == (12 * MiB, 20 * MiB)


def test_capacity_releases_free_segments_before_failing():
    simulation = CachingAllocatorSimulation(capacity=21 * MiB)
    simulation.malloc("small", 4)  # a 2 MiB small-pool segment
    simulation.free("small")
    simulation.malloc("large", 20 * MiB)  # 2 + 20 > 21: the free small segment is released first
    assert (simulation.allocated, simulation.reserved) == (20 * MiB, 20 * MiB)
    with pytest.raises(MemoryError, match="segment"):
        simulation.malloc("more", 4)  # 20 + 2 > 21 and nothing is free


def test_zero_bytes_and_unknown_frees_are_ignored():
    simulation = CachingAllocatorSimulation()
    simulation.malloc("empty", 0)
    simulation.free("never")
    assert (simulation.allocated, simulation.reserved) == (0, 0)
