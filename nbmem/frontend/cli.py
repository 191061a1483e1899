"""``nbmem profile``: run a notebook headlessly and report every cell's memory.

Usage::

    nbmem profile train.ipynb                        # table of every cell
    nbmem profile train.ipynb --max-peak 6GiB        # CI: fail when a cell needs more
    nbmem profile train.ipynb --output ran.ipynb     # keep the executed notebook
    nbmem --version

The notebook runs cell by cell in a real Jupyter kernel (nbclient);
:mod:`nbmem.frontend.profiling` does that part and is the Python API. This module is
the command line around it: arguments, the verdict, exit codes, and signals.
Ctrl-C or SIGTERM stops the run in one line: the kernel is killed, nbmem's
temporary files are removed, and the message says which cell was running.

Exit status: 0 every cell ran (and fit the budget); 1 a cell failed; 2 the
notebook could not be profiled (bad arguments, no such notebook or kernel,
nbmem missing in the kernel); 3 a cell went over ``--max-peak``; 130
interrupted (Ctrl-C, SIGINT); 143 terminated (SIGTERM). 130 and 143 are
128 + the signal's number, what a shell reports for a process the signal killed.

The same from Python, without the exit codes::

    import nbmem
    profile = nbmem.profile_notebook("train.ipynb")
    print(profile)                  # the table
    profile.peak_allocated          # bytes in use at the highest cell
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator, Sequence

from .profiling import (  # noqa: F401  (the classes stay importable from here, as before the split)
    BACKEND_CHOICES,
    CellFailure,
    CellProfile,
    Interrupted,
    NotebookProfile,
    ProfileError,
    _cell_list,
    profile_notebook,
)
from ..core.units import format_bytes

# Keep this module light: `nbmem --help` and `nbmem --version` must not pay
# for torch, nbclient or a kernel. They are imported where a profile runs.

__all__ = [
    "main",
    "build_parser",
    "version",
    "profile_notebook",  # nbmem.profile_notebook, here too (this module runs it)
    "EXIT_OK",
    "EXIT_CELL_FAILED",
    "EXIT_USAGE",
    "EXIT_OVER_BUDGET",
    "EXIT_INTERRUPTED",
    "EXIT_TERMINATED",
]

EXIT_OK = 0
EXIT_CELL_FAILED = 1
#: argparse also exits with 2 for a malformed command line.
EXIT_USAGE = 2
EXIT_OVER_BUDGET = 3
#: 128 + SIGINT (2): Ctrl-C, as a shell reports it.
EXIT_INTERRUPTED = 128 + signal.SIGINT
#: 128 + SIGTERM (15).
EXIT_TERMINATED = 128 + signal.SIGTERM


def version() -> str:
    """The installed nbmem's version: the package metadata's, else ``nbmem.__version__`` (a source checkout).

    >>> import nbmem
    >>> version() == nbmem.__version__
    True
    """
    from importlib import metadata

    try:
        return metadata.version("nbmem")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        from .. import __version__

        return __version__


# -- command line -------------------------------------------------------------


def _size(text: str) -> int:
    # the same forms as --capacity everywhere in nbmem: a size or a GPU preset
    from ..core.devices import parse_capacity

    try:
        return parse_capacity(text)[0]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds(text: str) -> int:
    # nbclient's timeout is whole seconds (an Integer trait).
    try:
        seconds = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"can't read {text!r} as seconds: write a whole number, e.g. 600") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"the timeout must be at least 1 second, got {seconds}")
    return seconds


_EPILOG = """\
exit status:
  0  every cell ran (and stayed within --max-peak)
  1  a cell failed (raised, timed out or killed the kernel); the table shows what ran
  2  the notebook could not be profiled (bad arguments, no such notebook or kernel)
  3  a cell's in-use peak went over --max-peak
  130  interrupted (Ctrl-C); 143  terminated (SIGTERM): the kernel is killed either way
"""


class _VersionAction(argparse.Action):
    """``--version``: like argparse's own, but reads the version only when the flag is given."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        print(f"nbmem {version()}")
        parser.exit(EXIT_OK)


def build_parser() -> argparse.ArgumentParser:
    """The ``nbmem`` command line; ``profile`` is its one subcommand.

    >>> args = build_parser().parse_args(["profile", "train.ipynb", "--max-peak", "2GiB"])
    >>> args.notebook, args.max_peak, args.backend
    ('train.ipynb', 2147483648, 'auto')
    >>> build_parser().parse_args(["profile", "train.ipynb", "--max-peak", "T4"]).max_peak
    15843721216
    """
    parser = argparse.ArgumentParser(
        prog="nbmem",
        description="How much GPU memory does each notebook cell take? Run a notebook and find out.",
        epilog="Inside Jupyter, use `%load_ext nbmem` and `%%gpumem` instead. `nbmem profile --help` for details.",
    )
    # lazy: the version is looked up only when asked for (argparse formats it then)
    parser.add_argument("--version", action=_VersionAction, help="print nbmem's version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    profile = commands.add_parser(
        "profile",
        help="run a notebook in a fresh kernel and report each cell's peak memory",
        # Wrapped by hand: RawDescriptionHelpFormatter keeps the epilog's columns and this text as written.
        description=(
            "Run NOTEBOOK cell by cell in a fresh Jupyter kernel, measure every code cell's\n"
            "memory as `%%gpumem` would, and print a table: cell, first line, peak (above the\n"
            "cell's start), in use at the peak, retained, time, and how it was measured.\n"
            "Stops at the first failing cell. Without a GPU in the kernel the figures are\n"
            "tracked: the bytes a GPU would allocate for the same tensors."
        ),
        epilog=_EPILOG
        + """
examples:
  nbmem profile train.ipynb
  nbmem profile train.ipynb --max-peak 6GiB                  # memory regression check in CI
  nbmem profile train.ipynb --output ran.ipynb --timeout 600
""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    profile.add_argument("notebook", metavar="NOTEBOOK", help="the .ipynb file to run")
    profile.add_argument(
        "--max-peak",
        metavar="SIZE",
        type=_size,
        default=None,
        help=(
            "fail (exit 3) when any cell has more than SIZE in use at its peak, e.g. 2GiB, 512MiB, "
            "1.5GB or 4096 (bytes; binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB), or a GPU "
            "preset such as T4 or A100-40GB (its total memory)"
        ),
    )
    profile.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        default=None,
        help="write the executed notebook to FILE, also when a cell fails",
    )
    profile.add_argument(
        "--kernel", metavar="NAME", default=None, help="kernel to run in (default: the notebook's own, else python3)"
    )
    profile.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_seconds,
        default=None,
        help="fail a notebook cell that runs longer than SECONDS (nbmem's own setup in the kernel is not "
        "held to it; default: no limit)",
    )
    profile.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        default="auto",
        help=(
            "auto: measure with the allocator's statistics when the kernel has a GPU (or another accelerator), "
            "else track; measured: require an accelerator; cuda: require a CUDA GPU; "
            "tracked: count tensors on any device (default: auto). Cells the notebook itself measures "
            "with %%%%gpumem or under `%%gpumem on --backend ...` use the backend they ask for."
        ),
    )
    profile.add_argument(
        "--lines",
        action="store_true",
        help="also show, under the table, the lines of each cell that held the most at its peak (tracked cells)",
    )
    profile.add_argument(
        "--snapshot",
        metavar="DIR",
        default=None,
        help="also write each measured cell to DIR as a PyTorch memory snapshot, cell-N.pickle (pytorch.org/memory_viz)",
    )
    return parser


def _error(message: str) -> None:
    sys.stdout.flush()  # keep the table above the verdict when both go to one terminal
    print(f"nbmem profile: {message}", file=sys.stderr)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so that every ``finally`` runs (Python's default just dies)."""


@contextlib.contextmanager
def _signals_stop_the_run() -> Iterator[None]:
    """SIGINT and SIGTERM raise a KeyboardInterrupt (:class:`_Terminated` for SIGTERM), once.

    A second signal, while the first one's cleanup kills the kernel and
    removes nbmem's temporary files, is ignored rather than cutting that
    cleanup short; the previous handlers come back afterwards. Outside the
    main thread (where Python allows no handlers) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}

    def stop(number: int, frame: Any) -> None:
        for each in previous:
            signal.signal(each, signal.SIG_IGN)
        raise _Terminated() if number == signal.SIGTERM else KeyboardInterrupt()

    for number in previous:
        signal.signal(number, stop)
    try:
        yield
    finally:
        for number, handler in previous.items():
            # None: a handler not installed from Python; the default is the closest
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``nbmem`` command line and return its exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        parser.exit(EXIT_USAGE, "\nnbmem: name a command, e.g. `nbmem profile NOTEBOOK.ipynb`\n")
    if args.output is not None:
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            # Checked before the run, not after minutes of it.
            _error(f"error: can't write --output {args.output!r}: the folder {folder!r} does not exist")
            return EXIT_USAGE
    with _signals_stop_the_run():
        try:
            return _profile(args)
        except KeyboardInterrupt as stop:
            # one line, not asyncio's traceback: the user stopped it, and knows why
            cause = stop.cause if isinstance(stop, Interrupted) else stop
            terminated = isinstance(cause, _Terminated)
            where = f": {stop}; the kernel was killed" if isinstance(stop, Interrupted) else ""
            _error(f"{'terminated (SIGTERM)' if terminated else 'interrupted'}{where}")
            return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED


def _profile(args: argparse.Namespace) -> int:
    """Profile, print the table and the verdict; the exit status."""
    try:
        profile = profile_notebook(
            args.notebook, kernel=args.kernel, timeout=args.timeout, backend=args.backend, lines=args.lines,
            snapshots=args.snapshot,
        )
    except ProfileError as error:
        _error(f"error: {error}")
        return EXIT_USAGE

    print(profile)
    status = EXIT_OK
    if profile.failure is not None:
        if profile.failure.traceback:
            _error(f"cell [{profile.failure.number}] raised:\n{profile.failure.traceback}")
        cell = next(c for c in profile.cells if c.number == profile.failure.number)
        _error(f"{profile.failure} (first line: {cell.first_line})")
        status = EXIT_CELL_FAILED

    if args.max_peak is not None:
        over = profile.over_budget(args.max_peak)
        budget = f"--max-peak {format_bytes(args.max_peak)} ({args.max_peak} bytes)"
        for cell in over:
            assert cell.result is not None
            _error(
                f"cell [{cell.number}] is over budget: {format_bytes(cell.result.peak_allocated)} in use at its peak"
                f" ({cell.result.peak_allocated} bytes) > {budget}; first line: {cell.first_line}"
            )
        if over:
            _error(f"over budget: {_cell_list([cell.number for cell in over])} exceed {budget}")
            # A failed cell is the bigger problem; its exit status wins.
            status = status or EXIT_OVER_BUDGET
        elif profile.peak_cell is None:
            _error(f"note: no cell was measured, so {budget} checked nothing")
        elif status == EXIT_OK:
            print(f"within budget: every measured cell stayed at or below {budget}")

    if args.output is not None:
        import nbformat

        try:
            nbformat.write(profile.notebook, args.output)
        except OSError as error:
            _error(f"error: can't write --output {args.output!r}: {error}")
            return status or EXIT_USAGE
        print(f"executed notebook written to {args.output}")
    return status


if __name__ == "__main__":
    sys.exit(main())
