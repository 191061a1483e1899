"""Kernel-level tests: notebooks run headlessly with nbclient, checked by what a user sees.

Each notebook starts a real ipykernel (about 3 s each), so the kernels are
shared: one runs the quickstart, one a small notebook built here with exact
byte counts and a failing cell.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import nbclient
import nbformat
import pytest
import torch
from _notebooks import HANG_TIMEOUT
from nbformat.v4 import new_code_cell, new_notebook

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# Where there is a GPU, `%%gpumem` measures it instead of tracking on the cpu.
SOURCE = "measured on cuda" if torch.cuda.is_available() else "tracked on cpu"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _execute(notebook: nbformat.NotebookNode, *, allow_errors: bool = False) -> nbformat.NotebookNode:
    """Run every cell in a fresh python3 kernel; cells get their outputs in place."""
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=HANG_TIMEOUT,  # hang protection, not a speed limit
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    return client.execute()


def _texts(cell: nbformat.NotebookNode, output_type: str | None = None) -> list[str]:
    """The text/plain of each rich output of a cell (optionally of one output type)."""
    return [
        output["data"]["text/plain"]
        for output in cell.outputs
        if "data" in output
        and "text/plain" in output["data"]
        and (output_type is None or output["output_type"] == output_type)
    ]


def _code_cells(notebook: nbformat.NotebookNode, first_line: str) -> list[nbformat.NotebookNode]:
    return [
        cell
        for cell in notebook.cells
        if cell.cell_type == "code" and cell.source.splitlines()[:1] == [first_line]
    ]


# -- the quickstart ------------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart() -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / "01-quickstart.ipynb", as_version=4)
    return _execute(notebook)


def test_quickstart_is_committed_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOKS / "01-quickstart.ipynb", as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source


def test_quickstart_runs_without_errors(quickstart: nbformat.NotebookNode) -> None:
    errors = [output for cell in quickstart.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert errors == []


def test_quickstart_reports_are_widgets_with_a_text_fallback(quickstart: nbformat.NotebookNode) -> None:
    cells = _code_cells(quickstart, "%%gpumem")
    assert len(cells) >= 2
    state = quickstart.metadata["widgets"][WIDGET_STATE]["state"]
    for cell in cells:
        reports = [output for output in cell.outputs if WIDGET_VIEW in output.get("data", {})]
        assert len(reports) == 1, cell.source
        (report,) = reports
        text = report["data"]["text/plain"]
        assert SOURCE in text and "peak" in text, text
        # nbclient saved the widget's model, so the view renders from the saved file.
        assert report["data"][WIDGET_VIEW]["model_id"] in state


def test_quickstart_history_has_a_chart(quickstart: nbformat.NotebookNode) -> None:
    (cell,) = _code_cells(quickstart, "%gpumem history")
    assert any("image/png" in output.get("data", {}) for output in cell.outputs)
    assert any(text.startswith("gpumem history") for text in _texts(cell))


# -- exact figures, the every-cell line and a failing cell, in one kernel ------


@pytest.fixture(scope="module")
def small() -> dict[str, Any]:
    """A notebook built here; returns its cells by name after running it."""
    cells = {
        "load": new_code_cell("%load_ext nbmem"),
        "setup": new_code_cell('import torch\ndevice = "cuda" if torch.cuda.is_available() else "cpu"'),
        # 1024 * 1024 * 4 bytes = 4 MiB each: both alive at the peak (8 MiB), one kept (4 MiB).
        "exact": new_code_cell(
            "%%gpumem\n"
            "a = torch.zeros(1024, 1024, device=device)\n"
            "b = torch.zeros(1024, 1024, device=device)\n"
            "del a\n"
            "7"
        ),
        "failing": new_code_cell('%%gpumem\nx = torch.zeros(10)\nraise ValueError("boom")'),
        "after_failure": new_code_cell("print(x.shape)"),
        "on": new_code_cell("%gpumem on"),
        # 256 * 4 bytes = 1 KiB, a multiple of the 512 B block.
        "every_cell": new_code_cell("c = torch.zeros(256, device=device)"),
        "off": new_code_cell("%gpumem off"),
    }
    notebook = new_notebook(
        cells=list(cells.values()),
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    _execute(notebook, allow_errors=True)
    return cells


def test_small_notebook_fails_only_where_expected(small: dict[str, Any]) -> None:
    failed = [name for name, cell in small.items() if any(o.output_type == "error" for o in cell.outputs)]
    assert failed == ["failing"]


def test_cell_magic_reports_exact_peak_and_retained(small: dict[str, Any]) -> None:
    cell = small["exact"]
    reports = [text for text in _texts(cell, "display_data") if text.startswith("gpumem")]
    assert len(reports) == 1
    (report,) = reports
    assert "+8.00 MiB" in report  # peak
    assert "+4.00 MiB" in report  # retained
    # The cell's last expression still displays as its Out.
    assert _texts(cell, "execute_result") == ["7"]


def test_every_cell_prints_one_line(small: dict[str, Any]) -> None:
    lines = [text for text in _texts(small["every_cell"]) if text.startswith("gpumem [")]
    assert len(lines) == 1
    (line,) = lines
    assert "\n" not in line
    assert "peak +1.00 KiB" in line and "retained +1.00 KiB" in line


def test_failing_cell_shows_the_users_error_and_a_failed_report(small: dict[str, Any]) -> None:
    cell = small["failing"]
    (error,) = [output for output in cell.outputs if output.output_type == "error"]
    assert error.ename == "ValueError" and error.evalue == "boom"
    traceback = _ANSI.sub("", "\n".join(error.traceback))
    assert 'raise ValueError("boom")' in traceback
    assert any("FAILED" in text for text in _texts(cell, "display_data"))


def test_failing_cell_keeps_the_users_state(small: dict[str, Any]) -> None:
    (output,) = small["after_failure"].outputs
    assert output.output_type == "stream" and output.text == "torch.Size([10])\n"
