"""nbmem's type hints pass mypy, as configured in pyproject.toml's [tool.mypy]."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_passes_on_nbmem():
    pytest.importorskip("mypy", reason="mypy is not installed: `pip install -e .[test]` (or `pip install mypy`) to check types")
    # From the repository root, so that mypy reads pyproject.toml; its cache
    # (.mypy_cache, git-ignored by mypy itself) makes a second run take a second or two.
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "nbmem"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"mypy found problems (exit {run.returncode}):\n{run.stdout}{run.stderr}"
