"""Out-of-memory diagnosis: what filled the device, and what would make the cell fit.

Built from a failed cell's result (its breakdown at the peak), the tracker's
live storages and the user's namespace (for variable names). Every saving is
an estimate from the breakdown, and says so.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any

import torch

from .categories import BACKWARD
from ..core.rendering import text_table
from ..core.results import MemoryResult
from .tracker import Tracker
from ..core.units import format_bytes, parse_bytes

__all__ = ["Diagnosis", "LiveTensor", "Suggestion", "diagnose", "is_out_of_memory"]


@dataclass(frozen=True)
class LiveTensor:
    """One of the largest storages alive when the allocation failed."""

    size: int
    category: str
    shape: tuple[int, ...]
    dtype: str
    name: str | None = None
    module: str | None = None


@dataclass(frozen=True)
class Suggestion:
    """A change that would lower the peak, with its estimated saving in bytes."""

    action: str
    saving: int
    why: str


@dataclass(frozen=True)
class Diagnosis:
    """Why a cell ran out of memory, and what to try, largest estimated saving first."""

    device: str
    capacity: int | None
    in_use: int
    request: int | None
    virtual: bool
    largest: tuple[LiveTensor, ...]
    suggestions: tuple[Suggestion, ...]
    #: Where the failing op ran: "forward (Sequential.0)", "backward", "outside modules", or None if unknown.
    phase: str | None = None

    @property
    def missing(self) -> int | None:
        """Bytes the failed allocation lacked: in use + request - capacity."""
        if self.capacity is None or self.request is None:
            return None
        return max(self.in_use + self.request - self.capacity, 0)

    def __str__(self) -> str:
        lines = [f"gpumem out-of-memory diagnosis ({self.device})"]
        lines.append(
            f"  capacity {format_bytes(self.capacity)}; in use at the failure {format_bytes(self.in_use)};"
            f" the failed request {format_bytes(self.request)}"
            + (f"; missing {format_bytes(self.missing)}" if self.missing is not None else "")
        )
        if self.phase:
            lines.append(f"  failed in {self.phase}")
            if self.phase.startswith("forward"):
                lines.append(
                    "  note: backward (gradients) and an optimizer step (its state) never ran, so their memory is "
                    "in none of these figures: a fix that covers what was missing here may still fall short later"
                )
        if self.largest:
            lines.append("  largest live tensors:")
            rows = [
                (t.name or "(no variable)", "x".join(map(str, t.shape)) or "scalar", t.dtype, t.category, format_bytes(t.size))
                for t in self.largest
            ]
            lines += ["    " + line for line in text_table(("name", "shape", "dtype", "category", "bytes"), rows)]
        if self.suggestions:
            lines.append("  what would help (savings are estimates from the breakdown at the peak):")
            for suggestion in self.suggestions:
                enough = self.missing is not None and suggestion.saving >= self.missing
                lines.append(
                    f"    - {suggestion.action}: saves about {format_bytes(suggestion.saving)}"
                    f"{' (covers what was missing at the failure)' if enough else ''}; {suggestion.why}"
                )
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return f"<pre class='nbmem-diagnosis' style='font-size:12px'>{html.escape(str(self))}</pre>"


def is_out_of_memory(error: BaseException | type[BaseException] | None) -> bool:
    """True for torch.OutOfMemoryError (CUDA's or nbmem's virtual one)."""
    if error is None:
        return False
    kind = error if isinstance(error, type) else type(error)
    return issubclass(kind, torch.OutOfMemoryError)


_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB)")


def _request_from(error: BaseException | None) -> int | None:
    """The failed request, read from PyTorch's message ("Tried to allocate 20.00 MiB")."""
    match = _TRIED.search(str(error or ""))
    if match is None:
        return None
    number, unit = match.groups()
    return parse_bytes(f"{number}{'' if unit == 'bytes' else unit}")


def diagnose(
    result: MemoryResult,
    tracker: Tracker | None,
    namespace: dict[str, Any] | None = None,
    error: BaseException | None = None,
    *,
    count: int = 8,
) -> Diagnosis:
    """Explain ``result``, a block that failed with an out-of-memory error.

    ``tracker`` (the one behind the result, if any) gives the live tensors and
    the virtual device's figures; ``namespace`` (the user's variables) names them.
    ``error`` is the exception (its message gives the failed request on
    CUDA); ``count`` how many of the largest tensors to list. ``%%gpumem``
    shows this by itself after an out-of-memory error; call it for a
    ``with nbmem.measure(...)`` block that failed, with ``scope.result`` and
    ``scope.tracker``. ``print()`` shows the report.

    >>> from nbmem import MemoryScope
    >>> scope = MemoryScope(tracker=Tracker("cpu"), capacity="1MiB")   # a virtual 1 MiB device
    >>> try:
    ...     with scope:
    ...         kept = torch.zeros(128, 1024)      # 512 KiB
    ...         more = torch.zeros(256, 1024)      # 1 MiB more: past the capacity
    ... except torch.OutOfMemoryError as error:
    ...     report = diagnose(scope.result, scope.tracker, {"kept": kept}, error)
    >>> report.in_use, report.request, report.missing
    (524288, 1048576, 524288)
    >>> [(tensor.name, tensor.shape) for tensor in report.largest]
    [('kept', (128, 1024))]
    """
    oom = tracker.last_oom if tracker is not None else None
    virtual = oom is not None and oom.capacity == result.capacity
    phase = None
    capacity: int | None
    request: int | None
    if oom is not None and virtual:
        capacity, in_use, request = oom.capacity, oom.allocated, oom.request
        if oom.module == BACKWARD:
            phase = "backward"
        elif oom.module is not None:
            phase = f"forward ({oom.module})"
        else:
            phase = "code outside any module's forward (making a batch, an optimizer step, ...)"
    else:
        capacity, in_use, request = result.capacity, result.allocated_after, _request_from(error)
    largest: tuple[LiveTensor, ...] = ()
    if tracker is not None:
        names = _names(tracker, namespace or {})
        largest = tuple(
            LiveTensor(record.size, record.category, record.shape, str(record.dtype).replace("torch.", ""),
                       names.get(key), record.module)
            for key, record in tracker.largest(count)
        )
    return Diagnosis(
        device=result.device_name or result.device,
        capacity=capacity,
        in_use=in_use,
        request=request,
        virtual=virtual,
        largest=largest,
        suggestions=tuple(suggest(result, request, in_forward=phase.startswith("forward") if phase else None)),
        phase=phase,
    )


def suggest(result: MemoryResult, request: int | None = None, *, in_forward: bool | None = None) -> list[Suggestion]:
    """Changes that lower the peak, largest estimated saving first; only those that apply.

    ``request`` is the allocation that failed; inside a module's forward it is
    batch-sized too, so a smaller batch or lower precision shrinks it as well.
    ``in_forward`` says whether the failure was in a module's forward (known
    for virtual devices); otherwise the module at the peak decides.
    """
    if result.breakdown is None:
        return []
    at_peak = dict(result.breakdown.at_peak)
    activations, state = at_peak["activation"], at_peak["optimizer state"]
    # At a peak inside a module's forward or in backward, "other" is mostly
    # batch-sized temporaries; at a peak outside modules (an optimizer step)
    # it is parameter-sized and no batch change touches it.
    if in_forward is None:
        in_forward = result.breakdown.module is not None
    batch_sized = activations + ((at_peak["other"] + (request or 0)) if in_forward else 0)
    # what earlier cells left that the model itself does not need
    leftovers = result.allocated_before - at_peak["parameter"] - at_peak["buffer"] - state
    options = [
        Suggestion(
            "halve the batch and accumulate 2 micro-batches (same effective batch)",
            batch_sized // 2,
            "activations, the forward's temporaries and the failed request grow with the batch size; "
            "parameters, gradients and optimizer state don't",
        ),
        Suggestion(
            "bf16 autocast (torch.autocast('cuda', dtype=torch.bfloat16))",
            batch_sized // 2,
            "activations and temporaries are kept in 2 bytes instead of 4",
        ),
        Suggestion(
            "activation checkpointing on the repeated blocks",
            activations // 2,
            "only block inputs are kept and the rest recomputed in backward; half is a typical, rough figure",
        ),
        Suggestion(
            "an optimizer with less state (SGD with momentum: one tensor per parameter, not Adam's two)",
            state // 2,
            "Adam/AdamW keep two tensors the size of each parameter",
        ),
        Suggestion(
            "free what earlier cells left behind (`%gpumem free`, `del` tensors you no longer need)",
            max(leftovers, 0),
            "memory allocated before this cell that is not the model's parameters, buffers or optimizer state",
        ),
    ]
    return sorted((option for option in options if option.saving > 0), key=lambda option: -option.saving)


def _names(tracker: Tracker, namespace: dict[str, Any]) -> dict[int, str]:
    """Storage key -> the user's name for it: variables, module parameters and buffers, .grad, optimizer state."""
    names: dict[int, str] = {}

    def add(name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            key = tracker.storage_key(tensor)
            if key is not None:
                names.setdefault(key, name)
            # .grad of a non-leaf tensor warns (and is None) unless retain_grad() was called: don't ask
            if (tensor.is_leaf or tensor.retains_grad) and tensor.grad is not None:
                add(f"{name}.grad", tensor.grad)

    for variable, value in namespace.items():
        if variable.startswith("_"):
            continue
        if isinstance(value, torch.Tensor):
            add(variable, value)
        elif isinstance(value, torch.nn.Module):
            for name, tensor in (*value.named_parameters(), *value.named_buffers()):
                add(f"{variable}.{name}", tensor)
        elif isinstance(value, torch.optim.Optimizer):
            for index, state in enumerate(value.state.values()):
                for name, tensor in state.items():
                    add(f"{variable}.state[{index}][{name!r}]", tensor)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value[:100]):
                add(f"{variable}[{index}]", item)
        elif isinstance(value, dict):
            for key, item in list(value.items())[:100]:
                add(f"{variable}[{key!r}]", item)
    return names
