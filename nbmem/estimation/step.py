"""The training step nbmem runs when the user gives none: forward, loss, backward, step, zero_grad.

What it holds, in order, for each of ``accumulation`` micro-batches: it asks
the batch factory for a batch, runs forward and the loss (inside
``torch.autocast`` for ``"bf16"``/``"fp16"``: forward and loss only, as
PyTorch's AMP recipe writes it), and holds the batch, the model's output and
the loss until ``backward()`` returns; then they are dropped (the output is
not kept through the optimizer step). ``hold_output=False`` drops the
output once the loss is made, as Hugging Face's Trainer does
(``compute_loss`` returns the loss alone): only what autograd saved of it,
the batch and the loss live through backward. Gradients accumulate across the
micro-batches. After the last one: ``optimizer.step()`` (with fp16, the
GradScaler's unscale/step/update), then ``zero_grad(set_to_none=True)``, so
gradients do not live between steps. Where real loops zero differently,
``zero_grad=`` says so (:data:`ZERO_GRAD`): ``"keep"``, as
``zero_grad(set_to_none=False)`` does, keeps them allocated (zero-filled)
through the next forward; ``"before_backward"``, a loop that calls
``zero_grad()`` between the loss and ``backward()``, keeps the last step's
gradients alive through the next forward.

A user's loop that differs (holds the output longer, clips, keeps an EMA,
zeroes elsewhere) moves the peak: ``nbmem.estimate(..., step=train_step)``
runs the user's own step instead (:mod:`nbmem.estimation.userstep`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from .attention import batch_positions
from .building import default_device

__all__ = ["run_step", "prepared_batch", "checked_batch", "cast_floats", "moved_to", "AUTOCAST_DTYPES", "ZERO_GRAD"]

#: Where the built-in step zeroes the gradients, and what each loop writes.
ZERO_GRAD = {
    "after_step": "optimizer.step(), then zero_grad(set_to_none=True)",
    "keep": "optimizer.step(), then zero_grad(set_to_none=False): the gradients stay allocated, zero-filled",
    "before_backward": "zero_grad() between the loss and backward(): the last step's gradients live through the forward",
}

#: The autocast dtype of each mixed precision (the others run without autocast).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def run_step(
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    batch_size: int,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    precision: str,
    accumulation: int,
    device: torch.device,
    autocast_region: Callable[..., Any] = torch.autocast,
    zero_grad: str = "after_step",
    hold_output: bool = True,
) -> None:
    dtype = AUTOCAST_DTYPES.get(precision)
    for micro_batch in range(accumulation):
        inputs = prepared_batch(batch_fn, batch_size, precision, device)
        # autocast_region: torch.autocast, or one that follows CUDA's op lists on the CPU (nbmem.estimation.autocast_policy)
        autocast = autocast_region(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with autocast:
            output = _forward(model, inputs)
            value = loss_fn(output, inputs) if loss_fn is not None else _default_loss(output, inputs)
        if not hold_output:  # the output goes once the loss is made: Hugging Face's Trainer, `model(**batch).loss`
            del output
        if zero_grad == "before_backward" and micro_batch == 0:
            optimizer.zero_grad(set_to_none=True)
        (scaler.scale(value) if scaler is not None else value).backward()
        del value, inputs
        if hold_output:
            del output
    if scaler is not None:
        # GradScaler.step reads the found-inf flag with .item(), which fake
        # tensors can't answer; the memory is the same: unscale, step, update.
        scaler.unscale_(optimizer)
        optimizer.step()
        scaler.update()
    else:
        optimizer.step()
    if zero_grad != "before_backward":
        optimizer.zero_grad(set_to_none=zero_grad == "after_step")


def prepared_batch(
    batch_fn: Callable[[int], Any], batch_size: int, precision: str, device: torch.device, *, checked: bool = True
) -> Any:
    """The factory's batch for ``batch_size``, on the run's device, floats cast for a "-weights" precision.

    ``checked``: in a shape the built-in step can feed to the model (see :func:`checked_batch`);
    a user's own step takes the batch as the factory made it.
    """
    with default_device(device):
        batch = batch_fn(batch_size)
        if checked:
            batch = checked_batch(batch, batch_size)
    if device.type != "cpu":
        batch = moved_to(batch, device)
    if precision.endswith("-weights"):
        batch = cast_floats(batch, torch.bfloat16 if precision.startswith("bf16") else torch.float16)
    batch_positions(batch)  # the batch's own position ids: transformers decides whether they are packed
    return batch


def checked_batch(value: Any, batch_size: int) -> Any:
    """The batch as the step uses it: a tensor, a tuple/list of tensors, or a plain dict of keyword arguments.

    A mapping that is not a dict (Hugging Face's ``BatchEncoding``, a tokenizer's
    output, is a ``UserDict``) becomes a dict, so that it is passed as keyword
    arguments like one. A dict's values are tensors, with plain values beside
    them passed as they are (CLIP's ``return_loss=True``).

    >>> from collections import UserDict
    >>> checked_batch(UserDict(input_ids=torch.zeros(2, 3)), 2)["input_ids"].shape
    torch.Size([2, 3])
    """
    if isinstance(value, Mapping) and not isinstance(value, dict):
        value = dict(value)
    if isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and value and all(isinstance(item, torch.Tensor) for item in value)
    ) or (isinstance(value, dict) and any(isinstance(item, torch.Tensor) for item in value.values())
          and all(isinstance(item, (torch.Tensor, *_PLAIN)) for item in value.values())):
        return value
    raise ValueError(
        f"the batch factory returned {type(value).__name__} for batch_size={batch_size}: it must return a tensor, "
        "a tuple (inputs, targets) of tensors, or a dict of tensors (and plain values such as return_loss=True) "
        "passed to the model as keyword arguments"
    )


#: Values a batch dict may hold beside its tensors, passed to the model as they are.
_PLAIN = (bool, int, float, str, type(None))


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    return _each_tensor(value, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


def moved_to(value: Any, device: torch.device) -> Any:
    """A batch the factory made elsewhere (e.g. on the CPU, as a DataLoader does), moved to ``device``."""
    return _each_tensor(value, lambda tensor: tensor.to(device))


def _each_tensor(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor in it cast, through dicts, lists and (named) tuples; anything else as it is
    (a user's step may get strings or numbers in its batch beside the tensors)."""
    if isinstance(value, torch.Tensor):
        return cast(value)
    if isinstance(value, dict):
        return {key: _each_tensor(item, cast) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        items = [_each_tensor(item, cast) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs[0])


def _default_loss(output: Any, inputs: Any) -> torch.Tensor:
    """The loss nbmem assumes when the user passes none (see :func:`nbmem.estimate`).

    A model's own loss first (Hugging Face's ``output.loss`` when the batch
    has labels); else the main output (``logits``, a dict's ``"out"`` as
    torchvision's segmentation models return, a tuple's first item) against
    the targets: cross-entropy for integer targets, with the classes last
    (a language model's logits) or second (a segmentation map); MSE for float
    targets of the output's shape; the output's mean without targets.

    >>> logits = torch.zeros(2, 5, 10)              # (batch, sequence, vocabulary)
    >>> round(_default_loss({"logits": logits}, (None, torch.zeros(2, 5, dtype=torch.long))).item(), 4)
    2.3026
    """
    own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    output = _main_output(output)
    targets = inputs[1] if isinstance(inputs, (tuple, list)) and len(inputs) > 1 else None
    if targets is not None and not targets.is_floating_point() and output.dim() >= 2:
        if output.shape[:-1] == targets.shape:  # classes last: (batch, classes), (batch, sequence, vocabulary)
            return nn.functional.cross_entropy(output.float().flatten(0, -2), targets.flatten())
        if output.shape[:1] + output.shape[2:] == targets.shape:  # classes second: (batch, classes, height, width)
            return nn.functional.cross_entropy(output.float(), targets)
        raise ValueError(
            f"nbmem's default loss can't pair the model's output of shape {tuple(output.shape)} with integer targets "
            f"of shape {tuple(targets.shape)} (it expects the classes in the last or the second dimension): pass "
            "loss=lambda output, batch: ... that returns the loss"
        )
    if targets is not None and targets.is_floating_point() and targets.shape == output.shape:
        return nn.functional.mse_loss(output.float(), targets.float())
    mean: torch.Tensor = output.float().mean()
    return mean


def _main_output(output: Any) -> torch.Tensor:
    """The tensor the default loss is taken from, or the model's own loss; ValueError when there is none."""
    if isinstance(output, Mapping):  # a dict, or Hugging Face's ModelOutput (an OrderedDict without its None fields)
        for key in ("logits", "out"):
            if isinstance(output.get(key), torch.Tensor):
                return output[key]  # type: ignore[no-any-return]
        tensors = [key for key, value in output.items() if isinstance(value, torch.Tensor)]
        if len(tensors) == 1:
            return output[tensors[0]]  # type: ignore[no-any-return]
        raise ValueError(
            f"the model returned {type(output).__name__} with keys {list(output)}: nbmem's default loss looks for "
            "'loss', 'logits' or 'out', or a single tensor; pass loss=lambda output, batch: ... that returns "
            "the loss (or step= with your own training step)"
        )
    if isinstance(output, (tuple, list)) and output:  # e.g. an LSTM's (output, (h, c)); a tuple (loss, logits)
        output = output[0]
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise ValueError(
            f"the model returned {_described(output)}, not a floating-point tensor nbmem's default loss can use: "
            "pass loss=lambda output, batch: ... that returns the loss (or step= with your own training step)"
        )
    return output


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return "None" if value is None else f"a {type(value).__name__}"
