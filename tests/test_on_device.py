"""Measured mode on a real non-CPU device, in a process of its own (issue 27): tests/on_device.

That folder's tests load the nbmemdev test device (tests/_testdevice, built
with the system C++ compiler), which stays this process's accelerator once
loaded; so they run in a child pytest, which coverage follows (pyproject's
``patch = ["subprocess"]``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import _testdevice

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def test_measured_mode_on_the_test_device():
    if not _testdevice.available() and os.environ.get("NBMEM_REQUIRE_NATIVE") != "1":
        pytest.skip("the nbmemdev test device needs a C++ compiler")
    environment = dict(os.environ, NBMEM_ON_DEVICE="1")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/on_device"],
            cwd=ROOT, env=environment, capture_output=True, text=True, timeout=1200,
        )
    except subprocess.TimeoutExpired as error:  # what the child printed before it was stopped
        pytest.fail(f"tests/on_device ran past 1200 s:\n{error.stdout!s:.6000}\n{error.stderr!s:.3000}")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
