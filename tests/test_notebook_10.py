"""The snapshots notebook (10): real H100 snapshots read, replayed and tried under other settings, on a CPU.

It must run top to bottom without an error, be committed without outputs, and
print its figures from code: here they are checked against what the H100
printed (probes-run1.json) and against each other.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from _notebooks import assert_committed_clean, execute, failed_cells, output_of

pytestmark = pytest.mark.slow

PATH = Path(__file__).resolve().parent.parent / "notebooks" / "10-snapshots-and-the-allocator.ipynb"


@pytest.fixture(scope="module")
def nb10() -> nbformat.NotebookNode:
    notebook, _ = execute(PATH)
    return notebook


def test_committed_clean() -> None:
    assert_committed_clean(PATH)


def test_runs_and_reads_the_h100s_own_figures(nb10: nbformat.NotebookNode) -> None:
    assert failed_cells(nb10) == []
    printed, read = output_of(nb10, "import json").splitlines()
    # the same four figures, as torch.cuda printed them on the H100 and as read back from the snapshot
    assert printed.split(":", 1)[1].split() == read.split(":", 1)[1].split()
    assert "max_allocated 236032512 max_reserved 247463936" in read


def test_every_real_trace_replays_exactly_and_the_what_if_matches_the_other_run(nb10: nbformat.NotebookNode) -> None:
    replays = output_of(nb10, "for name in").splitlines()
    assert len(replays) == 4 and all(line.endswith(": exact") for line in replays), replays
    real, what_if = output_of(nb10, "real = ").splitlines()
    assert re.search(r"reserved ([\d,]+) B", real).group(1) == re.search(r"them: +([\d,]+) B", what_if).group(1)
    assert "262,144,000 B" in real  # 12 pages of 20 MiB and 5 of 2 MiB
    table = output_of(nb10, "table = ")
    assert "expandable_segments:True" in table and "as recorded (defaults)" in table and "(measured)" in table


def test_the_estimates_snapshot_holds_the_estimate(nb10: nbformat.NotebookNode) -> None:
    estimated, written = output_of(nb10, "build = ").splitlines()
    numbers = lambda line: re.findall(r"[\d,]{5,}", line)  # noqa: E731
    assert numbers(estimated) == numbers(written)
    settings = output_of(nb10, "for conf in").splitlines()
    assert [line.split()[0] for line in settings] == ["defaults", "expandable_segments:True", "max_split_size_mb:20",
                                                      "roundup_power2_divisions:4"]
    allocated = {re.search(r"peak +(.+?) allocated", line).group(1) for line in settings}
    assert len(allocated) == 1  # the settings change what is reserved, not what tensors hold
    cell = output_of(nb10, "cell = ")
    assert "tracked on cpu" in cell and "peak      +8.00 MiB" in cell
