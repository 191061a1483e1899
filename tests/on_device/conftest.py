"""The tests that run nbmem's measured mode on a real non-CPU device: the nbmemdev test device (issue 27).

A process that loads a PrivateUse1 backend has an accelerator for good (its
name and registration can't be undone), and nbmem measures on it by default:
so these tests run in a process of their own, which tests/test_on_device.py
starts (``NBMEM_ON_DEVICE=1 pytest tests/on_device``); the main run leaves
this folder out (tests/conftest.py). Every figure is asserted in bytes
against the device's own counters (``torch.accelerator``).
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

import _testdevice

if not _testdevice.available():
    if os.environ.get("NBMEM_REQUIRE_NATIVE") == "1":
        raise RuntimeError("the nbmemdev test device can't be built here, and NBMEM_REQUIRE_NATIVE=1 requires it")
    pytest.skip("the nbmemdev test device needs a C++ compiler", allow_module_level=True)

_testdevice.load()
DEVICE = torch.device(_testdevice.NAME, 0)


@pytest.fixture(autouse=True)
def empty_device() -> Iterator[None]:
    """Each test starts from an empty device cache and a 1 GiB capacity, and leaves nothing behind."""
    torch.accelerator.empty_cache()
    _testdevice.set_capacity(1 << 30)
    yield
    _testdevice.set_capacity(1 << 30)
    torch.accelerator.empty_cache()
