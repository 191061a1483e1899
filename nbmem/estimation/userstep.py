"""The user's own training step: ``nbmem.estimate(model, batch, step=train_step)``.

How a step is written moves its peak: holding the logits through backward,
clipping gradients, an EMA copy, two optimizers, where ``zero_grad`` runs
(issue 11, point 2; +8 to +14 % on a small GPT for the logits alone). So
nbmem can run the user's step instead of its built-in one
(:func:`nbmem.estimation.step.run_step`), on fake tensors or for real, with the same
tracker. The contract:

- ``step(model, batch, optimizer)``, called twice (the first step, then the
  steady one), its return value ignored. ``model`` is nbmem's own copy
  (precision and checkpointing applied, wrapped for ``parallel``);
  ``batch`` is what the batch factory returned for ``batch_size``, its
  tensors moved to the device and, for ``"-weights"`` precisions, cast;
  ``optimizer`` is the one nbmem built from ``optimizer=``, or None with
  ``optimizer=None`` (the step then builds its own).
- nbmem keeps no reference to the batch while the step runs: it lives as long
  as the step holds it (a ``for batch in loader`` loop holds it until the
  step returns; a step that ``del``-s it after backward frees it there).
  That holds for a plain function or method; a ``functools.partial`` or an
  object with ``__call__`` is called through C, which keeps its arguments
  until the call returns.
- The step owns its loop shape: accumulation is the step's own (call
  backward N times inside it); ``accumulation`` must be 1 and ``loss`` unset.
- ``precision="bf16"``/``"fp16"``: nbmem enters ``torch.autocast`` on the run's
  device around the whole call, and empties autocast's cache of
  low-precision weights where the model's forward ends (see
  :func:`run_user_step`): the memory is that of autocast around forward and
  loss, as PyTorch's AMP recipe writes it. A ``torch.autocast("cuda")``
  inside the step does nothing on a CPU (PyTorch disables it without CUDA);
  nbmem's is what applies there. With ``"fp16"`` a step that takes a fourth parameter
  gets nbmem's ``GradScaler`` there; use it as usual
  (``scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()``).
- State the step creates (an EMA copy, a second optimizer) belongs on the
  ``model`` or ``optimizer`` it is given: both are fresh for every run, so
  the second call finds it and the tracker counts it. A closure would carry
  it from one configuration of a sweep into the next.
- On fake tensors nothing has a value: ``loss.item()``, ``float(loss)`` or
  ``if loss > 0`` fail, with an error that names the step's line. Guard
  logging with ``if not nbmem.estimating():``.

>>> import torch.nn.functional as F
>>> def train_step(model, batch, optimizer):
...     inputs, targets = batch
...     loss = F.cross_entropy(model(inputs), targets)
...     loss.backward()
...     if not estimating():
...         print(f"loss {loss.item():.2f}")
...     optimizer.step()
...     optimizer.zero_grad(set_to_none=True)
>>> import nbmem
>>> build = lambda: torch.nn.Linear(64, 1000)
>>> make = lambda n: (torch.randn(n, 64), torch.randint(0, 1000, (n,)))
>>> result = nbmem.estimate(build, make, batch_size=16, optimizer="sgd", step=train_step)
>>> result.step
'yours: train_step, run as written'
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import os
import traceback
from typing import Any, Callable

import torch
from torch import nn

from .building import _FakeDeepcopy
from .step import AUTOCAST_DTYPES, prepared_batch

__all__ = ["estimating", "check_step", "run_user_step", "step_name", "user_step_notes", "AlwaysSteppingScaler",
           "fake_error_message", "real_tensor_message", "BUILT_IN", "step_label"]

#: How an estimate names nbmem's built-in step (nbmem.estimation.step.run_step) and what it holds.
BUILT_IN = (
    "nbmem's built-in: batch, output and loss held until backward returns, then dropped; "
    "optimizer.step(), then zero_grad(set_to_none=True)"
)


def estimating() -> bool:
    """True while code runs on fake tensors (as in ``nbmem.estimate``): tensors have shapes, no values.

    For a training step handed to nbmem: skip what reads values (logging
    ``loss.item()``, early stopping) while estimating.

    >>> estimating()
    False
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     estimating()
    True
    """
    # FakeTensorMode is an "infra" dispatch mode with its own slot (torch/utils/_python_dispatch.py);
    # reading the slot keeps no state of nbmem's own
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class AlwaysSteppingScaler(torch.amp.GradScaler):
    """A GradScaler whose ``step()`` always runs the optimizer step.

    ``GradScaler._maybe_opt_step`` skips the step when a gradient overflowed,
    and finds out with ``.item()`` (torch/amp/grad_scaler.py), which fake
    tensors can't answer. nbmem wants the memory of a step: a skipped first
    step (likely at the initial scale of 65536) would hide the optimizer
    state it creates, so the tracked real run steps too, and the two agree.
    """

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> float | None:
        result: float | None = optimizer.step(*args, **kwargs)
        return result


def check_step(step: Any, *, accumulation: Any, loss: Any, optimizer: Any, parallel: str, precision: str) -> None:
    """ValueError, saying what to do, unless ``step`` can be a user's step with these knobs (None: the built-in)."""
    if step is None:
        if optimizer is None:
            raise ValueError(
                "optimizer=None means your own step brings its optimizer: pass step=your_step(model, batch, "
                "optimizer), or name an optimizer for nbmem's built-in step (e.g. optimizer='adamw')"
            )
        return
    if not callable(step):
        raise ValueError(
            f"step must be your training step, a function step(model, batch, optimizer), got {type(step).__name__}"
        )
    if not _accepts(step, 3) and not (precision == "fp16" and _accepts(step, 4)):
        raise ValueError(
            f"step={step_name(step)} must accept three positional arguments, (model, batch, optimizer); a fourth, "
            "scaler, gets nbmem's GradScaler with precision='fp16' (give it a default, scaler=None, for the others)"
        )
    if accumulation != 1:
        raise ValueError(
            f"accumulation={accumulation!r} with step=: your step owns its loop, so accumulation is its own: call "
            "backward N times inside it (on N micro-batches of the batch it gets) and leave accumulation at 1"
        )
    if loss is not None:
        raise ValueError("loss= is for nbmem's built-in step; your step computes its own loss: leave loss unset")
    if optimizer is None and parallel == "zero1":
        raise ValueError(
            "parallel='zero1' shards the optimizer nbmem builds (ZeroRedundancyOptimizer), and optimizer=None "
            "builds none: name the optimizer (e.g. optimizer='adamw'), or build the ZeroRedundancyOptimizer in your step"
        )


def _accepts(step: Callable[..., Any], count: int) -> bool:
    try:
        inspect.signature(step).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): let the call itself say
        return count == 3
    return True


def step_label(step: Any, zero_grad: str = "after_step", hold_output: bool = True) -> str:
    """What a result says about the step that ran: the built-in one (None), zeroing as it did and holding what it
    held through backward, or the user's, by name."""
    if step is not None:
        return f"yours: {step_name(step)}, run as written"
    if zero_grad == "after_step" and hold_output:
        return BUILT_IN
    from .step import ZERO_GRAD

    held, zeroed = BUILT_IN.split("; optimizer.step()")[0], ZERO_GRAD[zero_grad]
    if not hold_output:
        held = ("nbmem's built-in: output dropped once the loss is made (as Hugging Face's Trainer does), batch and "
                "loss held until backward returns")
    return held + "; " + zeroed


def step_name(step: Any) -> str:
    """How a step is named to the user: its function's name."""
    inner = inspect.unwrap(step.func if hasattr(step, "func") else step)
    return str(getattr(inner, "__name__", None) or type(step).__name__)


def run_user_step(
    step: Callable[..., Any],
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    batch_size: int,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    precision: str,
    device: torch.device,
    fake: bool,
    *,
    autocast_region: Callable[..., Any] = torch.autocast,
) -> None:
    """One call of the user's step, as the module docstring describes.

    ``autocast_region``: torch.autocast, or one that follows CUDA's op lists on the CPU (nbmem.estimation.autocast_policy).
    """
    dtype = AUTOCAST_DTYPES.get(precision)
    autocast = autocast_region(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    # copy.deepcopy of a fake module lands in a new fake mode and fails ("Mixing fake modes"): an EMA
    # copy made with deepcopy gets fresh fake tensors of the current mode, as a model factory does
    copies = _FakeDeepcopy() if fake else contextlib.nullcontext()
    # Autocast keeps each parameter's low-precision copy in a cache until the outermost autocast region
    # ends (torch/amp/autocast_mode.py, __exit__). Around the whole step, that would be through backward
    # and the optimizer step, 2 bytes per parameter more than a loop with autocast around forward and loss
    # (as PyTorch's AMP recipe writes it, and the built-in step does): the cache is emptied where the
    # model's forward ends instead. What autograd saved of those copies stays, as it does there. In
    # backward, a checkpointed block's recomputation is its own outermost region there (backward runs
    # outside autocast; torch/utils/checkpoint.py re-enters it): emptied where the block's forward ends
    # (nbmem's checkpointing), or, for a model that checkpoints itself, where each module's forward ends.
    emptied = [] if dtype is None else [model.register_forward_hook(_empty_autocast_cache, always_call=True)] + [
        module.register_forward_hook(_empty_in_backward, always_call=True) for module in _recomputed(model)
    ]
    try:
        # the batch goes straight into the call, not through a name or an argument tuple: nbmem's frame
        # holds no reference to it while a plain function runs (CPython moves the arguments into its frame)
        with copies, autocast:
            if scaler is not None and _accepts(step, 4):
                step(model, prepared_batch(batch_fn, batch_size, precision, device, checked=False), optimizer, scaler)
            else:
                step(model, prepared_batch(batch_fn, batch_size, precision, device, checked=False), optimizer)
    finally:
        for handle in emptied:
            handle.remove()


def _recomputed(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward a checkpointed backward recomputes as one piece."""
    wrapped = [inner for module in model.modules() if isinstance(
        inner := getattr(module, "_checkpoint_wrapped_module", None), nn.Module)]
    return wrapped or [module for module in model.modules() if module is not model]


def _empty_autocast_cache(module: nn.Module, inputs: Any, output: Any) -> None:
    torch.clear_autocast_cache()


def _empty_in_backward(module: nn.Module, inputs: Any, output: Any) -> None:
    if torch._C._current_graph_task_id() != -1:  # inside backward: as FSDP2 tells (fsdp/_fully_shard/_fsdp_common.py)
        torch.clear_autocast_cache()


def user_step_notes(step: Callable[..., Any], precision: str, device: torch.device) -> list[str]:
    """What nbmem did around the user's step, for the estimate's notes."""
    notes = []
    if precision in ("bf16", "fp16"):
        notes.append(f"precision {precision}: nbmem ran your step inside torch.autocast({device.type!r}, {precision})")
    if precision.endswith("-weights"):
        notes.append(f"precision {precision}: parameters and the batch's float tensors cast before your step")
    if precision == "fp16":
        notes.append(
            "fp16: your step got nbmem's GradScaler as its 4th argument (it always steps)" if _accepts(step, 4)
            else "fp16: your step takes no 4th argument (scaler), so no GradScaler ran (its memory is a few scalars)"
        )
    return notes


def fake_error_message(error: BaseException, step: Callable[..., Any]) -> str:
    """What to tell the user when their step read a value on fake tensors: the step's line that did it."""
    where = _user_lines(error)
    line = f" at {where}" if where else ""
    return (
        f"your step {step_name(step)} read a tensor's value{line}, and on fake tensors there is none "
        f"({type(error).__name__}: e.g. .item(), float(loss), or `if loss > 0`). Skip it while "
        "estimating, `if not nbmem.estimating(): ...`, or run the step for real: mode='tracked' (this CPU) or "
        "nbmem.track() around your own loop"
    )


#: How FakeTensorMode refuses a real tensor (torch/_subclasses/fake_tensor.py, validate_and_convert_non_fake_tensors).
_REAL_TENSOR = "Please convert all Tensors to FakeTensors"


def real_tensor_message(error: BaseException) -> str | None:
    """What to tell the user when a real tensor met fake ones (None: the error is another one)."""
    if not isinstance(error, AssertionError) or not str(error).startswith(_REAL_TENSOR):
        return None
    where = _user_lines(error)
    return (
        f"a real tensor, made before the estimate, met nbmem's fake ones{' at ' + where if where else ''}: "
        "an estimate makes every tensor itself (a closure's tensor, e.g. class weights for the loss, or a "
        "slice of a dataset, has data and can't mix with them). Make it where it is used, inside your step or "
        "the batch factory (e.g. torch.ones(10) there), or keep it on the model as a buffer; or run the step "
        "for real: mode='tracked'"
    )


def _user_lines(error: BaseException) -> str:
    """Where the user's code read the value: ``file:line (`source`)`` of the deepest frame outside torch,
    nbmem and the standard library, and of the step's own line that led there when that is another one."""
    libraries = tuple(
        os.path.dirname(module.__file__) + os.sep for module in (torch, contextlib) if module.__file__ is not None
    ) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
    outside = [
        frame for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith(libraries) and not frame.filename.startswith("<frozen")
    ]
    if not outside:
        return ""
    described = [_described(frame) for frame in (outside[-1], outside[0])]
    return described[0] if described[0] == described[1] else f"{described[0]}, reached from {described[1]}"


def _described(frame: traceback.FrameSummary) -> str:
    source = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f"{frame.filename}:{frame.lineno}" + (f" (`{source}`)" if source else "")
