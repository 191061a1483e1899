"""nbmem: how much GPU memory does this notebook cell take, why, and what would fit?

Load it in IPython or Jupyter with ``%load_ext nbmem`` and put ``%%gpumem`` on
a cell, or use it from Python::

    import nbmem
    with nbmem.measure() as scope:      # measured on CUDA, tracked on a CPU
        loss = model(x).sum(); loss.backward()
    print(scope.result)

``import nbmem`` is light: torch, IPython, ipywidgets and matplotlib are
imported only when something that needs them runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "measure",
    "track",
    "MemoryScope",
    "MemoryResult",
    "History",
    "Tracker",
    "history",
    "estimate",
    "estimating",
    "Estimate",
    "sweep",
    "Comparison",
    "max_batch_size",
    "explore",
    "launch",
    "Launch",
    "STRATEGIES",
    "free",
    "Reclaimed",
    "diagnose",
    "Breakdown",
    "Timeline",
    "PRESETS",
    "format_bytes",
    "parse_bytes",
    "profile_notebook",
    "load_snapshot",
    "Snapshot",
    "estimate_trainer",
    "MemoryCallback",
    "estimate_lightning",
    "LightningMemoryCallback",
    "Quantization",
    "load_ipython_extension",
    "unload_ipython_extension",
]

# name -> module that defines it; loaded on first use (PEP 562).
_LAZY = {
    "measure": "tracking.scope",
    "track": "tracking.scope",
    "MemoryScope": "tracking.scope",
    "MemoryResult": "core.results",
    "History": "core.results",
    "Tracker": "tracking.tracker",
    "history": "frontend.magics",
    "estimate": "estimation.estimate",
    "estimating": "estimation.userstep",
    "sweep": "whatif.sweep",
    "max_batch_size": "whatif.batchsize",
    "explore": "frontend.explorer",
    "launch": "whatif.launcher",
    "Launch": "whatif.launcher",
    "STRATEGIES": "estimation.parallel",
    "Comparison": "whatif.comparison",
    "Estimate": "estimation.estimate",
    "free": "tracking.reclaim",
    "Reclaimed": "tracking.reclaim",
    "diagnose": "tracking.diagnosis",
    "Breakdown": "core.results",
    "Timeline": "tracking.timeline",
    "PRESETS": "core.devices",
    "format_bytes": "core.units",
    "parse_bytes": "core.units",
    "profile_notebook": "frontend.profiling",
    "load_snapshot": "core.snapshot",
    "Snapshot": "core.snapshot",
    "estimate_trainer": "whatif.training_arguments",
    "MemoryCallback": "frontend.trainer_callback",
    "estimate_lightning": "whatif.lightning_trainer",
    "LightningMemoryCallback": "frontend.lightning_callback",
    "Quantization": "estimation.quantization",
}

if TYPE_CHECKING:  # pragma: no cover
    from .core.devices import PRESETS
    from .tracking.diagnosis import diagnose
    from .estimation.estimate import Estimate, estimate
    from .frontend.explorer import explore
    from .whatif.launcher import Launch, launch
    from .estimation.parallel import STRATEGIES
    from .whatif.batchsize import max_batch_size
    from .whatif.comparison import Comparison
    from .whatif.sweep import sweep
    from .frontend.magics import history
    from .tracking.reclaim import Reclaimed, free
    from .core.results import Breakdown
    from .tracking.timeline import Timeline
    from .core.results import History, MemoryResult
    from .tracking.scope import MemoryScope, measure, track
    from .tracking.tracker import Tracker
    from .estimation.userstep import estimating
    from .core.units import format_bytes, parse_bytes
    from .frontend.profiling import profile_notebook
    from .core.snapshot import Snapshot, load_snapshot
    from .whatif.training_arguments import estimate_trainer
    from .frontend.trainer_callback import MemoryCallback
    from .whatif.lightning_trainer import estimate_lightning
    from .frontend.lightning_callback import LightningMemoryCallback
    from .estimation.quantization import Quantization


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nbmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext nbmem``: registers ``%gpumem`` and ``%%gpumem``.

    Loading twice changes nothing. ``%gpumem?`` then shows the magics' usage.

    Example, in IPython or a notebook: load it once, in a cell of its own,
    then put ``%%gpumem`` on the first line of any cell to measure::

        %load_ext nbmem

        %%gpumem
        y = model(x)

    or from code, with the shell: ``nbmem.load_ipython_extension(get_ipython())``.
    """
    from .frontend.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Called by ``%unload_ext nbmem``: removes every magic and hook nbmem added.

    A scope still open (``%gpumem on`` in the middle of a cell) is stopped.

    Example, in IPython or a notebook (``%reload_ext`` unloads, then loads
    again, e.g. after upgrading nbmem)::

        %unload_ext nbmem
        %reload_ext nbmem
    """
    from .frontend.magics import unload
    from .tracking.tracker import remove_every_tracker

    try:
        unload(ipython)
    finally:
        remove_every_tracker()  # even one a Ctrl-C cut off from its scope's stop() (issue 12)
