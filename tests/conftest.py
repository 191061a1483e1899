"""Shared fixtures: a real IPython shell with nbmem loaded; the cuda, slow and heavy markers.

Three tiers (issues 12 and 22):

- ``pytest -m "not slow"`` runs in one process: no kernel, subprocess, venv or
  browser. Mark a test ``@pytest.mark.slow`` when it starts a kernel or a
  process (ranks, a venv, a browser) or runs a notebook.
- ``pytest``, the README's test command, runs everything a laptop should: the
  slow tier too, but not the heavy one, which it skips saying how to run it.
- ``NBMEM_HEAVY=1 pytest`` (what ``.ci/run`` does) adds the tests marked
  ``heavy``: they download or install far beyond the test extras (Binder's
  environment, about 5.7 GB of CUDA libraries here), need a system browser,
  wait out long deadlines (launch and kernel timeouts), or run the what-if
  notebooks 03-06 (which Binder's test runs too); and the seeded interrupt
  sweeps take all their trials (:func:`seeded`).

Tests marked ``interrupts`` raise KeyboardInterrupt from trace functions and
real SIGINTs at seeded moments. Under ``coverage run`` one can land inside
coverage's own tracer while it holds its data lock (coverage/collector.py,
``lock_data``), and the next test deadlocks: CI hung there for its whole 90
minutes (2026-11-25). So they skip under coverage, and ``.ci/run`` runs them
again without it (``pytest -m interrupts``). And no test may hang a run: one
that outlasts ``NBMEM_TEST_HANG_S`` (default 1200 s) prints every thread's
traceback and ends the run.
"""

from __future__ import annotations

import builtins
import faulthandler
import gc
import os
import signal
import sys
from typing import Iterator

import pytest
import torch


# Doctests (--doctest-modules) that start processes: in the slow tier like the
# tests that do (issue 12). A doctest can't carry a marker, so it is named here.
SLOW_DOCTESTS = frozenset({"nbmem.whatif.launcher.launch"})  # forks 2 ranks in a gloo process group


#: set to 1 to run the tests marked heavy (.ci/run does)
HEAVY = "NBMEM_HEAVY"

#: tests/on_device loads a test accelerator that can't be unloaded: only tests/test_on_device.py's own process runs it
collect_ignore = [] if os.environ.get("NBMEM_ON_DEVICE") == "1" else ["on_device"]


#: The longest test modules, longest first, run before the rest: CI's two pytest-xdist workers (.ci/run) each take
#: whole modules in this order (--no-loadscope-reorder: by default xdist orders them by their number of tests), so one
#: starts Binder's (an install, every notebook, the vision tests: about 16
#: minutes) while the other takes the rest, and the last module either takes is a short one (in alphabetical order
#: the zoo's and the what-ifs', 100 s each, came last). The order is by each module's seconds in a run of the
#: README's test command on two workers (2026-11-28, this project's 2-core machine), heavy ones by CI's logs.
LONGEST = (
    "tests/test_binder.py",
    "tests/test_notebooks_whatif.py",
    "tests/test_site.py",
    "tests/test_compiled.py",
    "tests/test_whatif.py",
    "tests/test_zoo.py",
    "tests/test_interrupted_accounts.py",
    "tests/test_interrupted_estimates.py",
    "tests/test_interrupted_qlora.py",
    "tests/test_qlora.py",
    "tests/test_parallel.py",
    "tests/test_browser.py",
    "tests/test_progress.py",
    "tests/test_finetune.py",
    "tests/test_estimate.py",
    "tests/test_notebook_07.py",
    "tests/test_native.py",
    "tests/test_cli.py",
    "tests/test_reclaim.py",
)
_RANK = {module: rank for rank, module in enumerate(LONGEST)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: each module's tests keep their order, and the modules not named keep theirs after the longest
    items.sort(key=lambda item: _RANK.get(item.nodeid.split("::")[0], len(LONGEST)))
    for item in items:
        if isinstance(item, pytest.DoctestItem) and item.name in SLOW_DOCTESTS:
            item.add_marker(pytest.mark.slow)
    if _under_coverage():
        traced = pytest.mark.skip(reason="interrupts land inside coverage's tracer and can deadlock it: `pytest -m interrupts` without coverage runs them, as .ci/run does")
        for item in items:
            if "interrupts" in item.keywords:
                item.add_marker(traced)
    if os.environ.get(HEAVY) != "1":
        heavy = pytest.mark.skip(reason=f"heavy (downloads, a system browser, long waits): {HEAVY}=1 runs it, as .ci/run does")
        for item in items:
            if "heavy" in item.keywords:
                item.add_marker(heavy)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none here (untested on CUDA in this run)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def seeded(count: int) -> int:
    """How many seeded trials a sampling test runs: all of them in CI (NBMEM_HEAVY=1), a quarter on a laptop."""
    return count if os.environ.get(HEAVY) == "1" else max(count // 4, 5)


def _under_coverage() -> bool:
    coverage = sys.modules.get("coverage")
    return coverage is not None and coverage.Coverage.current() is not None


@pytest.fixture(autouse=True)
def _no_test_hangs_the_run() -> Iterator[None]:
    """A test that outlasts NBMEM_TEST_HANG_S dumps every thread's traceback and ends the run (exit 1)."""
    faulthandler.dump_traceback_later(float(os.environ.get("NBMEM_TEST_HANG_S", "1200")), exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _no_garbage_of_earlier_tests_is_young() -> None:
    """Earlier tests' garbage in the young generations is collected before each test (1 ms; a full collection,
    0.3 s, would add minutes to the suite).

    Left there, a young collection inside a later test's tracked block frees it: a free the test did not make, and
    its exact baseline or retained figure is off by it. Which garbage waits depends on which tests ran before in
    the same process, and with pytest-xdist (CI runs the suite on two workers) that differs from run to run. A test
    that needs the oldest generation empty too collects it itself (test_native's oracle tests); one that an earlier
    test's storage held by C++ alone can upset runs in a process of its own (test_track's exact Adam test)."""
    gc.collect(1)


@pytest.fixture
def shell():
    """IPython's test shell with nbmem loaded; unloaded and cleaned afterwards."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing.globalipapp import start_ipython

    import nbmem

    start_ipython()  # creates the test shell once per process; later calls return None
    ip = InteractiveShell.instance()
    # Doctests run through Python's own displayhook, which sets builtins._; while
    # it exists IPython's displayhook leaves the user's `_` alone.
    builtins.__dict__.pop("_", None)
    nbmem.load_ipython_extension(ip)
    names = set(ip.user_ns)
    yield ip
    nbmem.unload_ipython_extension(ip)
    # A cell that failed leaves its frames to IPython (sys.last_traceback, the execution result, %debug's
    # traceback), and with them its tensors: the one a virtual out-of-memory error refused, which no tracker
    # counts but test_interrupts' oracle (every tensor alive) does, broke the exact baselines of later files.
    # The shell is one per process, so what a test's cells failed with goes with the test.
    from nbmem.tracking.reclaim import _release_last_error

    _release_last_error(ip)
    # IPython's own _, __, _N, _iN stay: deleting them makes the displayhook
    # think the user took those names over, and it stops updating them.
    for name in set(ip.user_ns) - names:
        if not name.startswith("_"):
            del ip.user_ns[name]


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test, whatever pytest or a kernel installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
