"""What the notebook tests share: run a notebook headlessly, check it is committed clean, read its outputs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbclient
import nbformat


# nbclient's per-cell timeout, as protection against a hang only: never a speed
# limit (issue 12: a loaded 2-core machine is slow, not broken).
HANG_TIMEOUT = 600


def execute(
    path: Path, *, allow_errors: bool = False, timeout: int = HANG_TIMEOUT
) -> tuple[nbformat.NotebookNode, float]:
    """The notebook run top to bottom in a fresh ``python3`` kernel (in its own folder), and the seconds it took.

    The seconds are printed for whoever reads the log, and never asserted.
    """
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=timeout,
        allow_errors=allow_errors,  # False: any failing cell fails the run
        resources={"metadata": {"path": str(path.parent)}},
    )
    started = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - started
    print(f"\n{path.name} executed in {seconds:.1f} s (kernel start included)")
    return notebook, seconds


def executed(path: Path) -> nbformat.NotebookNode:
    """The notebook run top to bottom: the copy Binder's test kept, where CI kept one, else run here.

    .ci/run runs every notebook once, in Binder's environment (tests/test_binder.py), and keeps each executed copy in
    ``NBMEM_EXECUTED_NOTEBOOKS``: a notebook test that only reads outputs checks that run instead of a second one.
    """
    kept = os.environ.get("NBMEM_EXECUTED_NOTEBOOKS")
    if kept and (Path(kept) / path.name).exists():
        print(f"\n{path.name}: the outputs of Binder's run ({kept})")
        return nbformat.read(Path(kept) / path.name, as_version=4)
    return execute(path)[0]


def assert_committed_clean(path: Path) -> nbformat.NotebookNode:
    """A valid notebook for the python3 kernel, saved without outputs or execution counts."""
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source
    return notebook


def text(cell: nbformat.NotebookNode) -> str:
    """Everything a cell printed or displayed as text. A stream's consecutive outputs are one text, as Jupyter shows
    them: the kernel sends what was printed in as many messages as its flushes made, more on a busy machine (CI of
    2026-11-27 read an empty line in the middle of a loop's lines, which only a newline joining two parts makes)."""
    parts: list[str] = []
    stream = None
    for output in cell.outputs:
        if output.output_type == "stream":
            if stream == output.name:
                parts[-1] += output.text
            else:
                parts.append(output.text)
            stream = output.name
        elif "text/plain" in output.get("data", {}):
            parts.append(output["data"]["text/plain"])
            stream = None
    return "\n".join(parts)


def failed_cells(notebook: nbformat.NotebookNode) -> list[str]:
    """The sources of the code cells that show an error."""
    return [
        cell.source
        for cell in notebook.cells
        if cell.cell_type == "code" and any(output.output_type == "error" for output in cell.outputs)
    ]


def output_of(notebook: nbformat.NotebookNode, start: str) -> str:
    """Everything the one code cell that starts with ``start`` printed or displayed as text."""
    cells = [cell for cell in notebook.cells if cell.cell_type == "code" and cell.source.startswith(start)]
    assert len(cells) == 1, start
    return text(cells[0])
