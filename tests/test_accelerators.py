"""What a measured scope reads off accelerators this machine lacks: MPS's limit (issue 27), with a stand-in module."""

from __future__ import annotations

import torch

from nbmem.core.devices import PRESETS
from nbmem.tracking.accelerators import DeviceCounter, mps_limit

GIB = 2**30


class SixteenGigabyteMac:
    """torch.mps as a 16 GB Mac answers (Metal recommends 2/3 of its memory), 4 GiB held by MPS's driver."""

    def recommended_max_memory(self) -> int:
        return 16 * GIB * 2 // 3

    def driver_allocated_memory(self) -> int:
        return 4 * GIB


def mps_counter() -> DeviceCounter:
    counter = DeviceCounter(torch.device("mps"))  # never initialises anything: nothing is read until asked
    counter._module = SixteenGigabyteMac()
    counter._used = lambda: True  # type: ignore[method-assign]
    return counter


def test_the_capacity_of_mps_is_its_limit_not_the_macs_memory(monkeypatch):
    monkeypatch.delenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", raising=False)
    name, total, free = mps_counter().device_view()
    limit = int(1.7 * (16 * GIB * 2 // 3))
    assert (name, total, free) == ("mps", limit, limit - 4 * GIB)
    # the preset for that Mac is the same limit, as its out-of-memory message prints it
    assert f"{total / GIB:.2f}" == f"{PRESETS['Mac-16GB'].capacity / GIB:.2f}" == "18.13"
    assert mps_counter().total_memory() == limit


def test_the_watermark_ratio_moves_the_limit_and_zero_lifts_it(monkeypatch):
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "1.0")
    assert mps_limit(SixteenGigabyteMac()) == 16 * GIB * 2 // 3
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "0.0")
    assert mps_limit(SixteenGigabyteMac()) is None
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "lots")
    assert mps_limit(SixteenGigabyteMac()) is None  # PyTorch would refuse it: nothing to say
