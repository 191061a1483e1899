"""Seconds of estimates in notebooks/09-will-it-fit.ipynb (issue 14: under 2 minutes on a CPU).

Run: python benchmarks/bench_notebook09.py [--json FILE] [--executed FILE.ipynb]

Runs the notebook top to bottom in a fresh python3 kernel (nbclient), then
reads the notebook's own ``estimate_seconds`` (wall-clock seconds of each
``nbmem.estimate`` and of the inference sweep, timed inside the kernel) and
reports them with their total, the whole run's seconds (kernel start and
imports included), the CPU count and the load average before and after
(os.getloadavg), so a run on a shared machine can be told from an idle one.
The figures are not asserted anywhere: tests/test_notebook_09.py checks the
notebook's content, this script its speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from _environment import write_json

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "09-will-it-fit.ipynb"
TARGET_SECONDS = 120


def run(executed: str | None = None) -> dict[str, Any]:
    import nbclient
    import nbformat

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # one cell more, at the end: the notebook's own timings, as JSON
    notebook.cells.append(nbformat.v4.new_code_cell("import json; print(json.dumps(estimate_seconds))"))
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=1200,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    started = time.perf_counter()
    client.execute()
    whole = time.perf_counter() - started
    printed = "".join(output.text for output in notebook.cells[-1].outputs if output.output_type == "stream")
    seconds: dict[str, float] = json.loads(printed)
    if executed:
        nbformat.write(notebook, executed)
    return {"estimates": seconds, "estimates_total": sum(seconds.values()), "notebook_total": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--executed", help="also save the executed notebook, outputs included, to this file")
    args = parser.parse_args()
    import torch
    import transformers

    load_before = os.getloadavg()
    figures = run(args.executed)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "target_seconds": TARGET_SECONDS,
        **figures,
    }
    for label, seconds in figures["estimates"].items():
        print(f"{label:55} {seconds:6.1f} s")
    print(f"{'estimates in all':55} {figures['estimates_total']:6.1f} s (target under {TARGET_SECONDS} s)")
    print(f"{'whole notebook, kernel start included':55} {figures['notebook_total']:6.1f} s")
    print(f"load average before {load_before[0]:.1f}, after {report['load_average_after'][0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
