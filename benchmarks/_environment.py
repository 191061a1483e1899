"""The keys a benchmark's JSON report starts with, and how the report is written.

``environment()`` gives the date, the machine, the versions and torch's
thread count with the names and formats of the results already in
``results/``, so that a new run's file can be compared with theirs key for
key. ``write_json`` writes a report where ``--json`` asked for one;
``parse_with_threads`` gives the scripts their common ``--threads`` option.

The scripts are run as ``python benchmarks/bench_x.py``, which puts this
folder on ``sys.path``: they import this module as ``_environment``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
from typing import Any


def environment(*libraries: str) -> dict[str, Any]:
    """date (UTC, to the minute), machine, python, torch, each of ``libraries``, torch_threads, nbmem: in that order.

    Each library (``"transformers"``) is imported and given as its ``__version__``.
    torch_threads is read now: call this after any ``torch.set_num_threads``.
    """
    import torch

    import nbmem

    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    for library in libraries:
        report[library] = importlib.import_module(library).__version__
    report["torch_threads"] = torch.get_num_threads()
    report["nbmem"] = nbmem.__version__
    return report


def parse_with_threads(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser``'s arguments, with ``--threads`` added and applied (``torch.set_num_threads``) before any timing."""
    import torch

    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's); 1 is steadier on a loaded machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def write_json(path: str | None, report: dict[str, Any], indent: int = 2) -> None:
    """Write ``report`` to ``path`` as indented JSON; nothing when no path was given (``--json`` left out)."""
    if not path:
        return
    with open(path, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=indent)
