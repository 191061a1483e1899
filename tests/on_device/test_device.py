"""The nbmemdev test device itself (tests/_testdevice/check.py): its statistics, ops, training and OOMs.

Run before nbmem's measured-mode tests trust it: each check asserts the
device's figures in bytes and its results against the CPU's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_the_test_device_keeps_exact_statistics_and_computes_what_the_cpu_does(capsys):
    path = Path(__file__).resolve().parents[1] / "_testdevice" / "check.py"
    spec = importlib.util.spec_from_file_location("_testdevice_check", path)
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    check.main()
    assert capsys.readouterr().out.rstrip().endswith("all checks passed")
