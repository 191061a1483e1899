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


@pytest.mark.parametrize("addresses, reserved", [(False, 36 << 20), (True, 24 << 20)])
def test_of_equal_free_blocks_the_lowest_address_serves_where_the_addresses_are_known(addresses, reserved):
    # two 12 MiB segments, the second made at a lower address, each with a 1.5 MiB free tail: a 1.25 MiB request
    # takes the oldest segment's tail, or (a replay of a real trace) the lower address's, as CUDA does; which one
    # decides whether freeing the first segment's 10.5 MiB leaves it whole for an 11.5 MiB request or a new one
    sim = CachingAllocatorSimulation()

    def at(address: int) -> int | None:
        return address if addresses else None

    half = 1 << 19
    assert sim.malloc("a", (10 << 20) + half, at(2 << 30)) == (10 << 20) + half  # a 12 MiB segment, split
    sim.malloc("b", (10 << 20) + half, at(1 << 30))
    assert sim.malloc("c", (1 << 20) + half // 2, at((1 << 30) + (10 << 20) + half)) == 3 * half  # rest not split
    sim.free("a")
    sim.malloc("d", (11 << 20) + half, at(2 << 30))
    assert sim.reserved == reserved


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


# -- PYTORCH_ALLOC_CONF (issue 24, part 5; issue 26, part 3) ------------------------------------------------

from nbmem.core.allocator import round_request  # noqa: E402
from nbmem.core.allocator_settings import (  # noqa: E402
    AllocatorSettings,
    parse_alloc_conf,
    settings_from_environment,
)


def simulate(conf: str = "", **keywords) -> CachingAllocatorSimulation:
    return CachingAllocatorSimulation(settings=parse_alloc_conf(conf) if conf else AllocatorSettings(), **keywords)


def test_roundup_power2_divisions_rounds_to_the_next_step_between_powers_of_two():
    four = parse_alloc_conf("roundup_power2_divisions:4")
    # 1200 MiB lies between 1024 and 2048 MiB; four steps: 1024, 1280, 1536, 1792 -> 1280 MiB
    assert round_request(1200 * MiB, four) == 1280 * MiB
    assert round_request(1024 * MiB, four) == 1024 * MiB  # a power of two stays
    two = parse_alloc_conf("roundup_power2_divisions:2")
    # 4700 B: above 512 * 2; between 4096 and 8192, steps of 2048 -> 6144 (512-B rounding would give 5120)
    assert (round_request(4700, two), round_request(4700)) == (6144, 5120)
    assert round_request(1000, two) == 1024  # not above 512 * 2: 512-B rounding
    simulation = simulate("roundup_power2_divisions:4")
    simulation.malloc("a", 1200 * MiB)
    assert (simulation.allocated, simulation.reserved) == (1280 * MiB, 1280 * MiB)


def test_roundup_power2_divisions_per_interval_as_pytorch_parses_them():
    settings = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    # intervals are named by their lower bound in MiB; the first entry also covers every interval below it, and
    # '>' fills from the last interval named on, that one included (parseRoundUpPower2Divisions: fill from last_index)
    assert [settings.divisions(size * MiB) for size in (1, 100, 300, 600, 1500, 40000)] == [1, 1, 1, 2, 8, 8]
    assert round_request(600 * MiB, settings) == 768 * MiB  # between 512 and 1024 MiB, two steps
    assert round_request(300 * MiB, settings) == 300 * MiB  # one division: no power-of-two rounding
    assert str(settings) == "roundup_power2_divisions:[1:1,2:1,4:1,8:1,16:1,32:1,64:1,128:1,256:1,512:2," \
        "1024:8,2048:8,4096:8,8192:8,16384:8,32768:8]"
    assert parse_alloc_conf(str(settings)).roundup_power2_divisions == settings.roundup_power2_divisions


def test_max_split_size_keeps_oversize_blocks_whole_and_for_large_requests_only():
    for conf, reserved_after in (("", 200 * MiB), ("max_split_size_mb:128", 230 * MiB)):
        simulation = simulate(conf)
        simulation.malloc("big", 200 * MiB)
        simulation.free("big")
        simulation.malloc("small", 30 * MiB)  # default: split from the cached 200 MiB; else a 30 MiB segment
        assert simulation.reserved == reserved_after, conf
    simulation = simulate("max_split_size_mb:128")
    simulation.malloc("big", 200 * MiB)
    simulation.free("big")
    simulation.malloc("150", 150 * MiB)  # 200 >= 150 + 20 (max_non_split_rounding): not served by it
    assert simulation.reserved == 350 * MiB
    simulation.malloc("190", 190 * MiB)  # 200 < 190 + 20: served, and not split
    assert (simulation.allocated, simulation.reserved) == (350 * MiB, 350 * MiB)


def test_max_split_size_frees_cached_oversize_blocks_before_failing():
    simulation = simulate("max_split_size_mb:128", capacity=250 * MiB)
    simulation.malloc("big", 200 * MiB)
    simulation.free("big")
    # 100 MiB may not use the oversize block; 200 + 100 > 250: release_available_cached_blocks frees it first
    simulation.malloc("small", 100 * MiB)
    assert (simulation.allocated, simulation.reserved, simulation.peak_reserved) == (100 * MiB, 100 * MiB, 200 * MiB)


def test_expandable_segments_map_20mib_pages_and_grow_one_segment():
    default, expandable = simulate(), simulate("expandable_segments:True")
    for simulation in (default, expandable):
        for name in "abc":
            simulation.malloc(name, 13 * MiB)
    # default: three segments of 14 MiB (13 MiB rounded up to 2 MiB); expandable: 39 MiB in two 20 MiB pages
    assert (default.reserved, len(default._segments)) == (42 * MiB, 3)
    assert (expandable.allocated, expandable.reserved, len(expandable._segments)) == (39 * MiB, 40 * MiB, 1)


def test_expandable_segments_absorb_a_slightly_larger_batch():
    # PyTorch's note on expandable segments: a run at batch N, then N + 1, leaves slivers in fixed segments
    default, expandable = simulate(), simulate("expandable_segments:True")
    for simulation in (default, expandable):
        for index in range(4):
            simulation.malloc(("N", index), 30 * MiB)
        for index in range(4):
            simulation.free(("N", index))
        for index in range(4):
            simulation.malloc(("N+1", index), 31 * MiB)
    # default: four cached 30 MiB segments fit no 31 MiB request: four new 32 MiB ones, 120 + 128
    assert default.reserved == 248 * MiB
    # expandable: 120 MiB mapped; 31 * 3 from it, the fourth takes the 27 MiB left and one more 20 MiB page
    assert expandable.reserved == 140 * MiB
    expandable.empty_cache()  # the free 16 MiB tail is no whole page: it stays
    assert expandable.reserved == 140 * MiB
    for index in range(4):
        expandable.free(("N+1", index))
    expandable.empty_cache()  # nothing allocated: every page unmapped, the segment gone
    assert (expandable.reserved, expandable._segments) == (0, [])


def test_expandable_segments_unmap_only_whole_free_pages():
    simulation = simulate("expandable_segments:True")
    simulation.malloc("a", 30 * MiB)  # pages 0-1 mapped (40 MiB)
    simulation.malloc("b", 30 * MiB)  # the 10 MiB left and page 2 (60 MiB)
    simulation.free("a")  # bytes 0-30 MiB free: page 0 whole, page 1 partly
    simulation.empty_cache()
    assert simulation.reserved == 40 * MiB  # page 0 unmapped
    simulation.malloc("c", 15 * MiB)  # the 10 MiB mapped rest of page 1 is too small: page 0 is mapped again
    assert simulation.reserved == 60 * MiB


def test_garbage_collection_frees_old_cached_segments_only_under_a_memory_fraction():
    def run(conf, allowed_memory):
        simulation = simulate(conf, allowed_memory=allowed_memory)
        simulation.malloc("a", 30 * MiB)  # large-pool searches: 1
        simulation.malloc("b", 40 * MiB)  # 2
        simulation.free("a")  # cached after 2 searches
        simulation.malloc("c", 35 * MiB)  # 3: a's 30 MiB does not fit; a 36 MiB segment (106 MiB reserved)
        simulation.free("b")  # cached after 3
        simulation.malloc("d", 50 * MiB)  # 4: nothing cached fits
        return simulation.reserved

    # Without collection: 106 + 50 = 156 MiB. With threshold 0.5 of 200 MiB allowed: 106 > 100, so whole cached
    # segments at least as old as the average age are freed: a (4 - 2 = 2 searches) >= 1.5 goes, b (1) stays;
    # 30 MiB reclaimed covers the 6 asked: 76 + 50 = 126 MiB.
    assert run("", 200 * MiB) == 156 * MiB
    assert run("garbage_collection_threshold:0.5", 200 * MiB) == 126 * MiB
    assert run("garbage_collection_threshold:0.5", None) == 156 * MiB  # no fraction set: PyTorch does not collect


@pytest.mark.parametrize(("conf", "message"), [
    ("max_split_size_mb:10", "at least 20"),
    ("expandable_segments:true", "only True or False"),
    ("garbage_collection_threshold:1.5", "between 0 and 1"),
    ("roundup_power2_divisions:3", "power of two"),
    ("roundup_power2_divisions:[300:4]", "must be a power"),
    ("roundup_power2_divisions:[256:4", "no closing"),
    ("expandable_segment:True", "not a setting PyTorch's allocator knows"),
    ("max_split_size_mb", "has no value"),
    ("backend:magic", "native and cudaMallocAsync"),
    ("expandable_segments:True max_split_size_mb:64", "only True or False"),
])
def test_a_setting_pytorch_would_refuse_is_refused_with_the_fix(conf, message):
    with pytest.raises(ValueError, match=message):
        parse_alloc_conf(conf)


def test_the_environment_is_read_as_pytorch_reads_it():
    assert settings_from_environment({}).is_default
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    settings = settings_from_environment(both)  # PYTORCH_ALLOC_CONF first
    assert (settings.expandable_segments, settings.max_split_size, settings.source) == (
        True, AllocatorSettings().max_split_size, "PYTORCH_ALLOC_CONF")
    cuda_only = settings_from_environment({"PYTORCH_CUDA_ALLOC_CONF": " max_split_size_mb : 64 ,release_lock_on_cudamalloc:True"})
    assert (cuda_only.max_split_size, cuda_only.ignored()) == (64 * MiB, ("release_lock_on_cudamalloc",))
    assert cuda_only.describe() == "max_split_size_mb:64 (from PYTORCH_CUDA_ALLOC_CONF)"


def test_a_steady_step_replayed_keeps_what_it_keeps_and_frees_what_it_frees():
    from nbmem.core.allocator import StepRecording, settle

    simulation = simulate()
    simulation.malloc("weights", 40 * MiB)
    simulation.malloc(("kept", 0), 12 * MiB)  # what the step before left alive (its loss, say)
    recording = StepRecording(simulation)
    # the recorded step: a key reused (storages' addresses are), the last step's kept tensor freed, a new one kept
    recording.malloc("a", 30 * MiB)
    recording.free("a")
    recording.malloc("a", 6 * MiB)
    recording.free(("kept", 0))
    recording.malloc("kept", 12 * MiB)
    recording.free("a")
    allocated, reserved = simulation.allocated, simulation.reserved
    replays = settle(simulation, recording.events)
    # each replay frees the kept tensor the one before made and keeps its own: allocated never grows
    assert simulation.allocated == allocated == (40 + 12) * MiB
    assert replays == 1 and simulation.reserved == reserved  # the layout repeated at once


def test_a_step_whose_kept_tensor_moves_settles_after_the_segments_stop_changing():
    from nbmem.core.allocator import StepRecording, settle

    simulation = simulate()
    simulation.malloc(("kept", 0), 30 * MiB)  # the last step's kept 30 MiB: one segment
    recording = StepRecording(simulation)
    recording.malloc("kept", 30 * MiB)  # a new one while the old lives: a second segment
    recording.free(("kept", 0))
    assert simulation.reserved == 60 * MiB
    replays = settle(simulation, recording.events)
    # the next steps alternate between the two cached segments: 60 MiB, and no more
    assert (replays, simulation.reserved, simulation.allocated) == (1, 60 * MiB, 30 * MiB)
