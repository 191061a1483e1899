"""One measurement per training step, for a training framework's callback (Hugging Face's, Lightning's).

A :class:`StepMeter` opens a :class:`~nbmem.MemoryScope` when a step begins and
closes it when the step ends: measured on a GPU (the allocator's counters,
nothing installed), tracked on a CPU (nbmem's tracker). Each step is a
:class:`~nbmem.MemoryResult` in ``history`` and, in a notebook that loaded the
extension, in ``nbmem.history()``. A run stopped mid-step by an error or Ctrl-C
never reaches the step's end: in IPython the cell's end closes it, elsewhere
:meth:`StepMeter.close` does, so nothing stays installed.

>>> meter = StepMeter(backend="tracked", device="cpu")
>>> import torch
>>> meter.begin("step 1"); x = torch.ones(256); meter.end()   # 256 * 4 bytes = 1024
>>> meter.history[0].retained
1024
>>> meter.close(); del x
"""

from __future__ import annotations

from typing import Any

from ..core.results import History, MemoryResult
from ..core.units import format_bytes
from ..tracking.backends import Backend
from ..tracking.scope import MemoryScope

__all__ = ["StepMeter"]


class StepMeter:
    """Steps measured one by one into ``history``; ``backend``/``device`` as for ``%%gpumem``."""

    def __init__(self, backend: Backend = "auto", device: Any = None, what: str = "training steps") -> None:
        self.backend, self.device, self.what = backend, device, what
        self.history = History()
        self._scope: MemoryScope | None = None
        self._shell: Any = None

    def begin(self, label: str) -> None:
        self.close()  # a step that never ended (training stopped mid-step)
        scope = MemoryScope(self.backend, self.device, label=label)
        self._watch_cell()
        self._scope = scope.start()

    def end(self) -> None:
        scope, self._scope = self._scope, None
        if scope is None or not scope.running:
            return
        result = scope.stop()
        self.history.append(result)
        _record_in_session(result)

    def summary(self) -> str:
        """One line: how many steps, how measured, the step with the most in use at its peak, and the one that rose
        highest above its start (often the first, which makes the optimizer's state; the others alike named)."""
        results = list(self.history)
        if not results:
            return f"gpumem: no {self.what} recorded"
        most = max(results, key=lambda result: result.peak_allocated)
        highest = max(results, key=lambda result: result.peak)
        alike = sum(result.peak == highest.peak for result in results) - 1
        return (f"gpumem: {len(results)} {self.what} {most.mode} on {most.device}; the highest peak, "
                f"{format_bytes(most.peak_allocated)} allocated, at {most.label}; the largest rise above a step's start, "
                f"{format_bytes(highest.peak)} allocated, at {highest.label}" + (f" (as in {alike} more)" if alike else "")
                + "; callback.history has each")

    def close(self) -> None:
        """Stop a step's scope that is still open and stop watching cells."""
        scope, self._scope = self._scope, None
        if scope is not None and scope.running:
            scope.stop()
        if self._shell is not None:
            try:
                self._shell.events.unregister("post_run_cell", self._cell_ended)
            except ValueError:
                pass
            self._shell = None

    def _watch_cell(self) -> None:
        if self._shell is not None:
            return
        try:
            from IPython import get_ipython
        except ImportError:  # pragma: no cover - IPython is a dependency
            return
        shell = get_ipython()
        if shell is not None:
            shell.events.register("post_run_cell", self._cell_ended)
            self._shell = shell

    def _cell_ended(self, result: Any = None) -> None:
        self.close()


def _record_in_session(result: MemoryResult) -> None:
    """Add the step to ``nbmem.history()`` where a notebook loaded the extension; nowhere else."""
    try:
        from .magics import _session

        _session().record(result)
    except (RuntimeError, ImportError):
        pass
