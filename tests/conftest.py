"""Shared fixtures: a real IPython shell with nbmem loaded, and the cuda marker."""

from __future__ import annotations

import builtins

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none here (untested on CUDA in this run)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
    # IPython's own _, __, _N, _iN stay: deleting them makes the displayhook
    # think the user took those names over, and it stops updating them.
    for name in set(ip.user_ns) - names:
        if not name.startswith("_"):
            del ip.user_ns[name]
