"""Each training step's memory, from inside a Hugging Face ``Trainer``: ``callbacks=[nbmem.MemoryCallback()]``.

Each optimizer step (``on_step_begin`` to ``on_step_end``: every micro-batch
of it, the optimizer step, the zeroing) is one :class:`~nbmem.MemoryResult`,
measured on a GPU (the caching allocator's own counters, nothing installed)
or tracked on a CPU (nbmem's tracker, as ``%%gpumem`` does). The results
collect in ``callback.history`` (a :class:`~nbmem.History`: a table, a chart,
records) and, in a notebook that loaded the extension, in
``nbmem.history()`` too; when training ends, one line says the peak step.

A training run stopped by an error or Ctrl-C never reaches ``on_step_end``:
in IPython the cell's end stops the step's scope (nothing stays installed),
elsewhere ``callback.close()`` does. transformers stays optional: this module
is imported only when ``nbmem.MemoryCallback`` is used.

Example::

    callback = nbmem.MemoryCallback()
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    callback.history.plot()
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("nbmem.MemoryCallback is a transformers TrainerCallback: pip install transformers "
                      "(or nbmem[zoo])") from error

from ..core.results import History, MemoryResult
from ..core.units import format_bytes
from ..tracking.scope import Backend, MemoryScope

__all__ = ["MemoryCallback"]


class MemoryCallback(TrainerCallback):
    """Records each optimizer step's peak into ``self.history``; ``backend``/``device`` as for ``%%gpumem``.

    ``quiet=True`` leaves out the line printed when training ends; ``summary()``
    gives it; ``close()`` stops a step left open by an interrupted run.

    Example::

        callback = nbmem.MemoryCallback()
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
        print(callback.history)          # each step: peak, retained, time, how it was measured
    """

    def __init__(self, backend: Backend = "auto", device: Any = None, quiet: bool = False) -> None:
        self.backend, self.device, self.quiet = backend, device, quiet
        self.history = History()
        self._scope: MemoryScope | None = None
        self._shell: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()  # a step that never ended (it can't, unless something stopped training mid-step)
        scope = MemoryScope(self.backend, self.device, label=f"training step {state.global_step + 1}")
        self._watch_cell()
        self._scope = scope.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scope, self._scope = self._scope, None
        if scope is None or not scope.running:
            return
        result = scope.stop()
        self.history.append(result)
        _record_in_session(result)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()
        if not self.quiet and len(self.history):
            print(self.summary())

    def summary(self) -> str:
        """One line: how many steps, how measured, and the step that rose highest above its start."""
        results = list(self.history)
        if not results:
            return "gpumem: no training step recorded"
        highest = max(results, key=lambda result: result.peak)
        return (f"gpumem: {len(results)} training steps {highest.mode} on {highest.device}; the highest, {highest.label}, "
                f"peaked {format_bytes(highest.peak)} above its start ({format_bytes(highest.peak_allocated)} in use); "
                "callback.history has each")

    def close(self) -> None:
        """Stop a step's scope that is still open (training stopped mid-step) and stop watching cells."""
        scope, self._scope = self._scope, None
        if scope is not None and scope.running:
            scope.stop()
        if self._shell is not None:
            try:
                self._shell.events.unregister("post_run_cell", self._cell_ended)
            except ValueError:
                pass
            self._shell = None

    # -- IPython: the cell's end closes what an interrupted training left open ----------------------

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
