"""benchmarks/ scripts loaded as modules by the tests that check them."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def benchmark(name: str) -> Iterator[ModuleType]:
    """benchmarks/``name``.py as a module, with its folder on the path while used (its imports may run late)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
