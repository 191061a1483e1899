"""Each configuration of a grid estimated and, on a CUDA machine, measured beside it; written as JSON as it goes.

Used by ``bench_cudnn_rnn.py`` and ``bench_cudnn_conv.py``: ``row(*point, measure=...)`` returns one configuration's
figures (an ``error`` for the estimate against the measured peak, where measured).
"""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path
from typing import Any, Callable

import torch


def measured_beside(build: Callable[[], Any], make: Callable[[int], Any], knobs: dict[str, Any],
                    estimated: Any) -> dict[str, Any]:
    """The step measured on this CUDA GPU (after a warm run: cuDNN's plans, cuBLAS's workspace) beside ``estimated``."""
    from nbmem.estimation.estimate import estimate

    estimate(build, make, mode="measured", **knobs)
    measured = estimate(build, make, mode="measured", **knobs)
    return dict(measured=measured.peak, measured_reserved=measured.reserved,
                error=round(estimated.peak / measured.peak - 1, 4),
                reserved_error=round(estimated.reserved / measured.reserved - 1, 4) if measured.reserved else None)


def main(grid: list[tuple[Any, ...]], row: Callable[..., dict[str, Any]], name: str, doc: str,
         argv: list[str] | None = None) -> int:
    """A script's command line: ``--out DIR``, then :func:`run_grid` into DIR/``name``."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    run_grid(grid, row, args.out, name)
    return 0


def run_grid(grid: list[tuple[Any, ...]], row: Callable[..., dict[str, Any]], out: str, name: str) -> dict[str, Any]:
    """``row`` for each point of ``grid`` (a failure recorded, the rest run), into ``out``/``name``; the report."""
    measure = torch.cuda.is_available()
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if measure else None,
        "device": torch.cuda.get_device_name() if measure else "none (estimates only)", "rows": []}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for point in grid:
        try:
            found = row(*point, measure=measure)
        except Exception as error:  # noqa: BLE001 - one configuration's failure is recorded, the rest run
            found = {"config": [str(part) for part in point], "error": f"{type(error).__name__}: {error}"[:300]}
        result["rows"].append(found)
        print(json.dumps(found), flush=True)
        (folder / name).write_text(json.dumps(result, indent=1))
    errors = [abs(r["error"]) for r in result["rows"] if isinstance(r.get("error"), float)]
    if errors:
        print(f"allocated: median {sorted(errors)[len(errors) // 2]:.2%}, worst {max(errors):.2%} of {len(errors)}")
    return result
