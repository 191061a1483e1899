"""Each training batch's memory, from inside a Lightning ``Trainer``: ``callbacks=[nbmem.LightningMemoryCallback()]``.

The Lightning counterpart of :class:`nbmem.MemoryCallback`: one
:class:`~nbmem.MemoryResult` per training batch (``on_train_batch_start`` to
``on_train_batch_end``), measured on a GPU, tracked on a CPU, into
``callback.history`` and ``nbmem.history()``. Lightning tells callbacks of an
exception or Ctrl-C (``on_exception``): the open step is closed there.
lightning stays optional: this module is imported only when the name is used.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("nbmem.LightningMemoryCallback is a Lightning Callback: pip install lightning") from error

from ..core.results import History
from ..tracking.backends import Backend
from .step_meter import StepMeter

__all__ = ["LightningMemoryCallback"]


class LightningMemoryCallback(Callback):
    """Records each training batch's peak into ``self.history``; ``backend``/``device`` as for ``%%gpumem``.

    Example::

        callback = nbmem.LightningMemoryCallback()
        lightning.Trainer(max_steps=10, callbacks=[callback]).fit(module, loader)
        callback.history.plot()
    """

    def __init__(self, backend: Backend = "auto", device: Any = None, quiet: bool = False) -> None:
        self.quiet = quiet
        self.meter = StepMeter(backend, device, what="training batches")

    @property
    def history(self) -> History:
        return self.meter.history

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.meter.begin(f"training batch {batch_idx + 1}")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.meter.end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.meter.close()
        if not self.quiet and len(self.history):
            print(self.meter.summary())

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.meter.close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Lightning gives every callback the module's bound log/log_dict (callback_connector.py): a callback kept
        # to read its history would keep the whole model alive
        for name in ("log", "log_dict"):
            self.__dict__.pop(name, None)

    def summary(self) -> str:
        return self.meter.summary()

    def close(self) -> None:
        self.meter.close()
