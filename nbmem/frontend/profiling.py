"""Run a notebook headlessly in a real kernel and measure every cell: what ``nbmem profile`` prints.

The notebook runs cell by cell in a real Jupyter kernel (nbclient), the way
"Restart & Run All" would, and stops at the first cell that raises. A setup
cell, which is neither shown nor saved, turns on nbmem's every-cell log in
that kernel, so the figures are the ones ``%gpumem on`` reports: *measured* by
the CUDA caching allocator when the kernel has a GPU, *tracked* (bytes a GPU
would allocate for the same tensors) when it has none.

From Python::

    import nbmem
    profile = nbmem.profile_notebook("train.ipynb")
    print(profile)                  # the table
    profile.peak_allocated          # bytes in use at the highest cell

:mod:`nbmem.frontend.cli` is the command line around it (exit codes, signals).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..core.rendering import first_line, shorten, text_table
from ..core.results import CELL_COLUMNS, MemoryResult, cell_figures
from ..core.units import format_bytes

# Keep this module light: `nbmem --help` imports it and must not pay for
# torch, nbclient or a kernel. They are imported where a profile actually runs.

__all__ = [
    "profile_notebook",
    "NotebookProfile",
    "CellProfile",
    "CellFailure",
    "ProfileError",
    "Interrupted",
    "BACKEND_CHOICES",
    "SETUP_TIMEOUT",
]

#: Same names as nbmem.tracking.backends.BACKENDS, repeated so that parsing the command
#: line does not import torch (tests/test_cli.py checks that they agree).
BACKEND_CHOICES = ("auto", "measured", "cuda", "tracked")

#: Runs first in the kernel with store_history=False, so the user's cells keep
#: the execution counts 1, 2, ... that nbmem's log records. `__import__` leaves
#: no name behind in the user's namespace. The log is independent of the
#: notebook's own `%gpumem on`/`off`; a backend the kernel can't use raises a
#: ValueError that says how to fix it.
_SETUP_CELL = """\
# Added by `nbmem profile` for this run only; not saved with --output.
__import__("nbmem.frontend.magics").frontend.magics.log_every_cell(get_ipython(), {log_path!r}, backend={backend!r}, lines={lines!r}, snapshots={snapshots!r})
"""

# Kernels colour their tracebacks; a CI log or a pipe wants plain text.
#: Seconds nbmem's setup cell may take when --timeout is given (never less
#: than --timeout): it imports nbmem and torch in a fresh kernel, seconds on a
#: busy machine, and --timeout is meant for the notebook's own cells.
SETUP_TIMEOUT = 600

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

_FIRST_LINE_WIDTH = 40


class ProfileError(Exception):
    """The notebook could not be profiled at all; the message says how to fix it."""


class Interrupted(KeyboardInterrupt):
    """The run was stopped (Ctrl-C, or the signal :mod:`nbmem.frontend.cli` turns into one); the kernel is already dead.

    Still a KeyboardInterrupt, so code that catches one catches this; it adds
    which cell was running. ``cause`` is the KeyboardInterrupt that stopped it.

    >>> str(Interrupted(3, "time.sleep(60)", KeyboardInterrupt()))
    'cell [3] was running (first line: time.sleep(60))'
    >>> str(Interrupted(None, "", KeyboardInterrupt()))
    "nbmem's setup was running, before any cell of the notebook"
    """

    def __init__(self, cell: int | None, first_line: str, cause: KeyboardInterrupt) -> None:
        super().__init__(cell, first_line)
        #: The notebook's number of the code cell that was running; None: nbmem's setup or the kernel's start.
        self.cell = cell
        self.first_line = first_line
        self.cause = cause

    def __str__(self) -> str:
        if self.cell is None:
            return "nbmem's setup was running, before any cell of the notebook"
        return f"cell [{self.cell}] was running (first line: {self.first_line})"


@dataclass(frozen=True)
class CellFailure:
    """Why the run stopped at a cell: its exception, a timeout, or a dead kernel."""

    number: int
    ename: str
    evalue: str
    #: Plain text, colours removed; empty when the kernel sent none.
    traceback: str = ""

    def __str__(self) -> str:
        reason = f"{self.ename}: {self.evalue}" if self.evalue else self.ename
        return f"cell [{self.number}] failed: {reason}"


@dataclass(frozen=True)
class CellProfile:
    """One code cell that ran: its number in the notebook and what nbmem recorded for it.

    ``number`` counts the notebook's code cells from 1, as a reader counts
    them (markdown cells are not counted, empty code cells are). ``result`` is
    None for a cell nbmem did not measure: a ``%gpumem ...`` command, or a
    cell that never finished (timeout, dead kernel).

    >>> cell = CellProfile(number=2, first_line="a = torch.zeros(1024, 1024)", execution_count=2,
    ...                    result=MemoryResult(mode="tracked", device="cpu", allocated_before=0,
    ...                                        peak_allocated=4 << 20, allocated_after=4 << 20, seconds=0.5))
    >>> cell.row()[:5]
    ('[2]', 'a = torch.zeros(1024, 1024)', '+4.00 MiB', '4.00 MiB', '+4.00 MiB')
    """

    number: int
    first_line: str
    execution_count: int | None
    result: MemoryResult | None
    failed: bool = False

    @property
    def measured(self) -> bool:
        return self.result is not None

    def row(self) -> tuple[str, ...]:
        """The cell's table row: cell, first line, peak, in use at peak, retained, time, how."""
        first_line = shorten(self.first_line, _FIRST_LINE_WIDTH)
        result = self.result
        if result is None:
            how = "not measured" + (" · FAILED" if self.failed else "")
            return (f"[{self.number}]", first_line, "-", "-", "-", "-", how)
        *figures, how = cell_figures(result)
        if self.failed and not result.error:
            how += " · FAILED"
        return (f"[{self.number}]", first_line, *figures, how)


@dataclass(frozen=True)
class NotebookProfile:
    """What one ``nbmem profile`` run found: a row per code cell that ran.

    ``not_run`` numbers the code cells left unexecuted because an earlier one
    failed. ``notebook`` is the executed notebook without nbmem's setup cell,
    ready for ``nbformat.write``.

    >>> def cell(number, peak):
    ...     result = MemoryResult(mode="tracked", device="cpu", allocated_before=0,
    ...                           peak_allocated=peak, allocated_after=0, seconds=0.01)
    ...     return CellProfile(number, f"x{number} = ...", number, result)
    >>> profile = NotebookProfile("nb.ipynb", "python3", (cell(1, 512), cell(2, 3 << 20)))
    >>> profile.peak_allocated, profile.peak_cell.number
    (3145728, 2)
    >>> [c.number for c in profile.over_budget(1 << 20)]   # 3 MiB > 1 MiB
    [2]
    """

    path: str
    kernel: str
    cells: tuple[CellProfile, ...]
    failure: CellFailure | None = None
    not_run: tuple[int, ...] = ()
    notebook: Any = field(default=None, repr=False, compare=False)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    @property
    def peak_cell(self) -> CellProfile | None:
        """The measured cell with the most memory in use at its peak (None if none was measured)."""
        measured = [cell for cell in self.cells if cell.result is not None]
        return max(measured, key=lambda cell: cell.result.peak_allocated, default=None)  # type: ignore[union-attr]

    @property
    def peak_allocated(self) -> int | None:
        """Bytes in use at the highest peak of any measured cell (None if none was measured)."""
        cell = self.peak_cell
        return None if cell is None or cell.result is None else cell.result.peak_allocated

    def over_budget(self, budget: int) -> list[CellProfile]:
        """The measured cells whose in-use peak (``peak_allocated``) exceeds ``budget`` bytes."""
        return [cell for cell in self.cells if cell.result is not None and cell.result.peak_allocated > budget]

    def __str__(self) -> str:
        lines = [f"nbmem profile: {self.path} (kernel {self.kernel})"]
        if self.cells:
            lines += text_table(CELL_COLUMNS, [cell.row() for cell in self.cells])
        else:
            lines.append("no code cell ran")
        if self.not_run:
            lines.append(f"not run after the failure: {_cell_list(self.not_run)}")
        peak = self.peak_cell
        if peak is None or peak.result is None:
            lines.append("overall peak: no cell was measured")
        else:
            lines.append(
                f"overall peak: {format_bytes(peak.result.peak_allocated)} allocated"
                f" ({peak.result.peak_allocated} bytes) at cell [{peak.number}], {peak.result.mode}"
                f" on {peak.result.device}"
            )
        lines += _cell_lines(self.cells)
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _cell_lines(cells: Sequence[CellProfile], top: int = 3) -> list[str]:
    """Each cell's lines holding the most at its peak (``--lines``), under the table; none when not asked for."""
    rows = []
    for cell in cells:
        for line in (cell.result.lines or ())[:top] if cell.result is not None else ():
            if line.at_peak and line.where != "(alive before)":
                where = line.where.split(", ")[-1] if line.where.startswith("cell [") else line.where
                rows.append((f"[{cell.number}]", where, format_bytes(line.at_peak), line.source[:60]))
    if not rows:
        return []
    return ["lines holding the most at each cell's peak:"] + text_table(("cell", "line", "at the peak", "code"), rows)


def _cell_list(numbers: Sequence[int]) -> str:
    return ", ".join(f"[{number}]" for number in numbers)


def _read_log(path: str) -> dict[int, MemoryResult]:
    """The log's results by execution count; the first one wins if a count repeats."""
    results: dict[int, MemoryResult] = {}
    try:
        with open(path, encoding="utf-8") as log:
            lines = log.readlines()
    except FileNotFoundError:  # no cell was measured, so nothing was appended
        return results
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kernel that died while writing it
        count = record.get("execution_count")
        if isinstance(count, int) and count not in results:
            results[count] = MemoryResult.from_record(record)
    return results


def _error_output(cell: Any) -> tuple[str, str, str] | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            traceback = _ANSI_ESCAPE.sub("", "\n".join(output.get("traceback", [])))
            return output.get("ename", "Error"), output.get("evalue", ""), traceback
    return None


def _setup_problem(kernel: str, backend: str, error: Any, limit: int | None) -> ProfileError:
    """Turn a failed setup cell into a message that says how to fix it, blaming only what failed."""
    ename, evalue = getattr(error, "ename", type(error).__name__), getattr(error, "evalue", str(error))
    if ename in ("ModuleNotFoundError", "ImportError"):
        return ProfileError(
            f"kernel {kernel!r} can't import nbmem ({ename}: {evalue}): install nbmem into that kernel's "
            "environment (`python -m pip install nbmem` with the kernel's python), or pick a kernel that "
            "has it with --kernel NAME (`jupyter kernelspec list` shows them)"
        )
    if ename in ("UsageError", "ValueError"):
        return ProfileError(f"--backend {backend} can't be used in kernel {kernel!r}: {evalue}")
    if ename == "CellTimeoutError":
        return ProfileError(
            f"nbmem's setup in kernel {kernel!r} (importing nbmem and torch) did not finish within {limit} s: "
            "the machine may be very busy or the kernel stuck; try again, or without --timeout"
        )
    if ename == "DeadKernelError":
        return ProfileError(
            f"kernel {kernel!r} died while importing nbmem and torch (out of memory, or a crash in native "
            "code?): `python -c 'import nbmem.frontend.magics'` with the kernel's python shows the error"
        )
    if ename == "NameError":  # no get_ipython(): not an IPython kernel
        return ProfileError(
            f"kernel {kernel!r} is not an IPython kernel ({ename}: {evalue}); nbmem profile runs notebooks in "
            "ipykernel: pick one with --kernel NAME (`jupyter kernelspec list` shows them)"
        )
    return ProfileError(f"could not turn on nbmem's measuring in kernel {kernel!r} ({ename}: {evalue})")


def profile_notebook(
    path: str | os.PathLike[str],
    *,
    kernel: str | None = None,
    timeout: int | None = None,
    backend: str = "auto",
    lines: bool = False,
    snapshots: str | os.PathLike[str] | None = None,
) -> NotebookProfile:
    """Run every code cell of the notebook at ``path`` in a fresh kernel and measure each one.

    Stops at the first cell that raises, times out (``timeout`` seconds per
    cell) or kills the kernel; the profile then names it in ``failure`` and
    still holds every cell that ran. Relative paths in the notebook resolve
    against its own folder. ``kernel`` defaults to the notebook's kernelspec,
    else ``python3``. Raises :class:`ProfileError` when the notebook can't be
    profiled at all (no such file or kernel, nbmem missing in the kernel).
    ``lines=True`` also charges each cell's memory to its lines (the
    dispatch engine; ``nbmem profile --lines``), shown under the table;
    ``snapshots`` (a folder, made if missing) receives each measured cell as a
    PyTorch memory snapshot, ``cell-N.pickle`` (``nbmem profile --snapshot DIR``).
    ``timeout`` is for the notebook's cells; nbmem's own setup cell gets at
    least :data:`SETUP_TIMEOUT` seconds. On Ctrl-C (KeyboardInterrupt) the
    kernel is killed, the temporary log removed, and :class:`Interrupted`
    (a KeyboardInterrupt) raised, naming the cell that was running.

    Example::

        profile = profile_notebook("train.ipynb", timeout=600)
        if profile.failure:
            print(profile.failure.traceback)
        print(profile)
    """
    import nbformat
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    path = os.fspath(path)
    folder = None if snapshots is None else os.path.abspath(os.fspath(snapshots))
    if folder is not None:
        try:
            os.makedirs(folder, exist_ok=True)
            for stale in os.listdir(folder):  # an interrupted run's, named by its own execution counts
                if stale.startswith("exec-") and stale.endswith(".pickle"):
                    os.remove(os.path.join(folder, stale))
        except OSError as error:
            raise ProfileError(f"can't use the snapshot folder {folder!r}: {error}") from None
    if backend not in BACKEND_CHOICES:
        raise ProfileError(f"backend {backend!r} is not known: use one of {', '.join(BACKEND_CHOICES)}")
    if not os.path.exists(path):
        where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()!r})"
        raise ProfileError(f"no notebook at {path!r}{where}: check the path and the file name")
    if os.path.isdir(path):
        raise ProfileError(f"{path!r} is a folder: name one .ipynb file inside it")
    try:
        notebook = nbformat.read(path, as_version=4)
    except Exception as error:  # nbformat raises several unrelated types for a bad file
        raise ProfileError(
            f"can't read {path!r} as a Jupyter notebook ({type(error).__name__}: {error}); "
            "nbmem profile takes an .ipynb file"
        ) from error
    kernel_name = kernel or notebook.metadata.get("kernelspec", {}).get("name") or "python3"

    # The user's code cells in order, numbered as a reader counts them.
    numbered = [cell for cell in notebook.cells if cell.cell_type == "code"]
    numbers = {id(cell): number for number, cell in enumerate(numbered, start=1)}
    for cell in numbered:
        # Stale counts from an earlier run would map to the wrong log lines.
        cell.execution_count = None

    client = NotebookClient(
        notebook,
        kernel_name=kernel_name,
        timeout=timeout,
        resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}},
    )
    running: list[Any] = [None]  # the cell the kernel runs now (None: nbmem's setup), for an interruption
    started = False
    # nothing between making the log and the try that removes it, where an interruption could leave it
    log_fd, log_path = tempfile.mkstemp(prefix="nbmem-profile-", suffix=".jsonl")
    try:
        os.close(log_fd)
        setup = nbformat.v4.new_code_cell(_SETUP_CELL.format(
            log_path=log_path, backend=backend, lines=lines, snapshots=None if folder is None else str(folder)
        ))
        notebook.cells.insert(0, setup)
        try:
            with client.setup_kernel():
                started = True
                try:
                    ran, failure, failed_cell = _run_cells(client, setup, numbers, timeout, running)
                except (CellExecutionError, CellTimeoutError, DeadKernelError) as error:  # in nbmem's setup
                    client.shutdown_kernel = "immediate"  # a stuck or dead kernel: don't wait for it
                    raise _setup_problem(kernel_name, backend, error, client.timeout) from None
                except KeyboardInterrupt:
                    # the kernel is still running the cell: kill it rather than wait for a graceful shutdown
                    client.shutdown_kernel = "immediate"
                    raise
        except NoSuchKernel:
            raise ProfileError(f"no Jupyter kernel named {kernel_name!r}: {_known_kernels()}") from None
        except (RuntimeError, TimeoutError, OSError) as error:
            if started:
                raise
            raise ProfileError(
                f"kernel {kernel_name!r} did not start ({type(error).__name__}: {error}); "
                "`jupyter kernelspec list` shows the installed kernels"
            ) from error
        except KeyboardInterrupt as stop:
            _kill_kernel(client)
            cell = running[0]
            number = None if cell is None else numbers[id(cell)]
            raise Interrupted(number, "" if cell is None else first_line(cell.source), stop) from None
        results = _read_log(log_path)
    finally:
        if os.path.exists(log_path):
            os.remove(log_path)

    notebook.cells.remove(setup)
    cells = []
    for cell in ran:
        result = results.get(cell.execution_count) if cell.execution_count is not None else None
        cells.append(
            CellProfile(
                number=numbers[id(cell)],
                # a %%gpumem cell's result is labelled by the first line it measured
                first_line=result.label if result is not None and result.label else first_line(cell.source),
                execution_count=cell.execution_count,
                result=result,
                failed=cell is failed_cell,
            )
        )
    if folder is not None:  # named by the kernel's execution counts; renamed as a reader counts cells
        for cell in cells:
            written = os.path.join(folder, f"exec-{cell.execution_count}.pickle")
            if cell.execution_count is not None and os.path.exists(written):
                os.replace(written, os.path.join(folder, f"cell-{cell.number}.pickle"))
    not_run: tuple[int, ...] = ()
    if failed_cell is not None:
        after = numbered[numbered.index(failed_cell) + 1 :]
        not_run = tuple(numbers[id(cell)] for cell in after if cell.source.strip())
    return NotebookProfile(path, kernel_name, tuple(cells), failure, not_run, notebook)


def _run_cells(
    client: Any, setup: Any, numbers: dict[int, int], timeout: int | None, running: list[Any]
) -> tuple[list[Any], CellFailure | None, Any]:
    """Run nbmem's setup, then the notebook's code cells until one fails: (cells that ran, failure, failed cell).

    The setup's own errors propagate (the caller explains them); ``running[0]``
    is the cell being run, for a caller interrupted meanwhile.
    """
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    # --timeout is for the notebook's cells, not for nbmem's setup, which imports
    # torch in a fresh kernel (seconds on a busy machine): the setup gets at
    # least SETUP_TIMEOUT, and no limit without --timeout.
    client.timeout = None if timeout is None else max(timeout, SETUP_TIMEOUT)
    client.execute_cell(setup, 0, store_history=False)
    client.timeout = timeout
    _record_language_info(client)
    ran: list[Any] = []
    for index, cell in enumerate(client.nb.cells[1:], start=1):
        if cell.cell_type != "code":
            continue
        number = numbers[id(cell)]
        running[0] = cell
        failure = None
        try:
            client.execute_cell(cell, index)
        except CellExecutionError as error:
            ename, evalue, traceback = _error_output(cell) or (error.ename, error.evalue, str(error))
            failure = CellFailure(number, ename, evalue, traceback)
        except CellTimeoutError:
            failure = CellFailure(number, "Timeout", f"did not finish within --timeout {timeout} s")
            # The kernel is still busy: a graceful shutdown would only wait.
            client.shutdown_kernel = "immediate"
        except DeadKernelError:
            client.shutdown_kernel = "immediate"
            failure = CellFailure(
                number,
                "DeadKernelError",
                "the kernel died while running it (out of memory, or a crash in native code?)",
            )
        if failure is not None:
            ran.append(cell)
            return ran, failure, cell
        # nbclient skips empty cells and those tagged skip-execution.
        if cell.execution_count is not None:
            ran.append(cell)
    running[0] = None
    if hasattr(client, "set_widgets_metadata"):
        client.set_widgets_metadata()
    return ran, None, None


def _kill_kernel(client: Any) -> None:
    """Kill the kernel of an interrupted run, and remove its connection file.

    ``setup_kernel`` cleans up after an interruption of a cell, but not of the
    kernel's start (it was not inside its ``try`` yet); this covers both, and
    does nothing where nothing is left. nbclient's own cleanup
    (``_cleanup_kernel``, what ``setup_kernel`` calls) does the work.
    """
    if client.km is None:
        return
    client.shutdown_kernel = "immediate"
    try:
        client._cleanup_kernel()
    except Exception:  # the kernel is already gone: nothing to kill
        pass


def _record_language_info(client: Any) -> None:
    """Store the kernel's language_info in the notebook's metadata, as ``NotebookClient.execute`` does."""
    reply = client.wait_for_reply(client.kc.kernel_info())
    if reply is not None and "language_info" in reply["content"]:
        client.nb.metadata["language_info"] = reply["content"]["language_info"]


def _known_kernels() -> str:
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        names = sorted(KernelSpecManager().find_kernel_specs())
    except Exception:  # the list is only a hint in an error message
        names = []
    if not names:
        return "no kernels are installed; `python -m ipykernel install --user` installs one"
    return f"use one of {', '.join(names)} with --kernel (`jupyter kernelspec list` shows them)"
