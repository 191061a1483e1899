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

from ..core.results import History
from ..tracking.backends import Backend
from .step_meter import StepMeter

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
        self.quiet = quiet
        self.meter = StepMeter(backend, device)

    @property
    def history(self) -> History:
        return self.meter.history

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.begin(f"training step {state.global_step + 1}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.close()
        if not self.quiet and len(self.history):
            print(self.summary())

    def summary(self) -> str:
        return self.meter.summary()

    def close(self) -> None:
        """Stop a step's scope left open (training stopped mid-step), and stop watching cells."""
        self.meter.close()
