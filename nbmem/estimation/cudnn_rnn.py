"""LSTM and GRU as an NVIDIA GPU runs them: cuDNN's RNN kernel, its reserve buffer and workspace, in an estimate.

On CUDA, ``nn.LSTM`` and ``nn.GRU`` run one cuDNN kernel for the whole
sequence (``_cudnn_rnn``, aten/src/ATen/native/cudnn/RNN.cpp). In training it
keeps a *reserve* buffer for backward and takes a *workspace* while it runs,
forward and backward; PyTorch's CPU kernels, which an estimate otherwise runs
on fake tensors, loop over the time steps and save other tensors. An H100
(torch 2.11, cuDNN 9.19, 2026-11-27, ``benchmarks/results/2026-11-27-gpu/
misses-first.json`` and ``rnn_sizes.json``: 72 and 1,751 LSTM and GRU training
steps, hidden 32 to 2048, 1 to 3 layers, batch 1 to 64, 8 to 512 steps, input
sizes 64, 300 and the hidden size, fp32 and bf16 autocast; fp16 autocast not
measured, bf16's sizes stand in for it) showed:

- the reserve is ``(g * layers + layers - 1) * steps * batch * hidden``
  elements of the compute dtype, plus 256 bytes, with ``g`` 5 for an LSTM and
  6 for a GRU: exact in all 1,823 steps;
- the workspace is the same size forward and backward (allocated three times:
  forward, backward-data, backward-weights; one at a time). It is cuDNN's own
  choice, with no rule to read: :func:`workspace` interpolates a model fitted
  to the H100's sizes for each hidden size (``benchmarks/fit_cudnn_rnn.py``):
  on 1,598 steps, half of them within 0.1 %, 90 % within -8.4 .. +6.9 %,
  worst -65 .. +20 %; fitted on 70 % of them, the other 30 %: 90 % within
  -12.7 .. +9.1 %. Other GPUs and cuDNN versions may take other sizes;
- forward copies a batch-first input to the kernel's (steps, batch) layout
  while it runs; backward copies the incoming gradient and the input again,
  makes the input's and the initial states' gradients (always: cuDNN's
  backward-weights needs backward-data first) and the weights' gradients as one
  flat buffer;
- under autocast, the weights are cast into one flat buffer of the autocast
  dtype (kept for backward), the input and states cast beside it; backward's
  flat gradient is cast back to each fp32 weight's.

:class:`CudnnRNN` makes an estimate allocate exactly that, on fake tensors
only: while active, ``lstm`` and ``gru`` on fake CPU tensors in a training
module run :class:`_CudnnRNNFunction` (no values: an estimate has none). What
cuDNN runs that was not measured keeps PyTorch's CPU kernels and the note that
says cuDNN's memory is missing: bidirectional layers, LSTM projections,
dropout between layers (cuDNN's dropout state), evaluation mode, packed
sequences, fp64. Tracked runs (real tensors) keep the CPU's kernels too.

>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> with FakeTensorMode(), CudnnRNN() as rnn:
...     lstm = torch.nn.LSTM(128, 128)
...     out, _ = lstm(torch.randn(32, 8, 128))
>>> out.grad_fn.name(), rnn.calls, reserve_bytes("lstm", 1, 32, 8, 128, 4)
('_CudnnRNNFunctionBackward', 1, 655616)
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .cudnn_rnn_fit import WORKSPACE
from .kernels import ScopedKernels

__all__ = ["CudnnRNN", "reserve_bytes", "workspace"]

_LSTM = torch.ops.aten.lstm.input
_GRU = torch.ops.aten.gru.input
_GATES = {"lstm": 4, "gru": 3}
#: what the reserve keeps per layer, in (steps x batch x hidden) elements: the gates and the cell (an LSTM's 4 + 1)
_RESERVED = {"lstm": 5, "gru": 6}
_COMPUTED = (torch.float32, torch.bfloat16, torch.float16)


def reserve_bytes(kind: str, layers: int, steps: int, batch: int, hidden: int, itemsize: int) -> int:
    """cuDNN's reserve for a unidirectional ``kind`` ("lstm", "gru") in training (see the module's docstring).

    >>> reserve_bytes("lstm", 2, 128, 64, 1024, 4), reserve_bytes("gru", 2, 32, 8, 256, 2)
    (369099008, 1704192)
    """
    return (_RESERVED[kind] * layers + layers - 1) * steps * batch * hidden * itemsize + 256


def features(layers: int, steps: int, batch: int, hidden: int, inputs: float) -> tuple[float, ...]:
    """What the workspace model is linear in, for one hidden size: a part per call and per layer, per layer and
    batch row, per element of the sequence, per input element, per layer and element."""
    return (1.0, layers, layers * batch, batch * steps, batch * steps * inputs / hidden, layers * batch * steps)


def workspace(kind: str, layers: int, steps: int, batch: int, hidden: int, itemsize: int, inputs: int | None = None,
              precision: str | None = None) -> int:
    """cuDNN's RNN workspace in bytes, as an H100 (cuDNN 9.19) took it (:mod:`nbmem.estimation.cudnn_rnn_fit`).

    The model is fitted for each hidden size measured (32 to 2048); between two of them it interpolates, below
    the smallest it takes the smallest's, above the largest it scales the largest's with ``hidden``.

    >>> workspace("lstm", 2, 32, 8, 256, 4)  # the H100 took 22,724,928 B
    22559232
    """
    precision = precision or ("fp32" if itemsize >= 4 else "bf16")
    inputs = inputs if inputs is not None else hidden
    sizes = sorted(size for (name, kind_precision, size) in WORKSPACE if name == kind and kind_precision == precision)

    def at(size: int, scale: float = 1.0) -> float:
        coefficients = WORKSPACE[kind, precision, size]
        values = features(layers, steps, batch, size, inputs * size / hidden)
        return scale * max(sum(c * v for c, v in zip(coefficients, values)), 0.0)

    below = [size for size in sizes if size <= hidden]
    above = [size for size in sizes if size >= hidden]
    if not below:
        found = at(sizes[0])
    elif not above:
        found = at(sizes[-1], hidden / sizes[-1])
    elif below[-1] == above[0]:
        found = at(hidden)
    else:
        low, high = below[-1], above[0]
        share = (hidden - low) / (high - low)
        found = (1 - share) * at(low) + share * at(high)
    return int(found) // 512 * 512


_PRECISIONS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _workspace(kind: str, layers: int, x: torch.Tensor, hidden: int) -> int:
    steps, batch, inputs = x.shape
    return workspace(kind, layers, steps, batch, hidden, x.dtype.itemsize, inputs, _PRECISIONS[x.dtype])


#: fp16 was not measured (the probe's "fp16" steps ran in fp32): bf16's sizes stand in for it
_PRECISIONS[torch.float16] = "bf16"


class _CudnnRNNFunction(torch.autograd.Function):
    """cuDNN's RNN kernel's memory, forward and backward, on fake tensors (the module's docstring lists it)."""

    @staticmethod
    def forward(ctx: Any, kind: str, layers: int, cast: Any, x: torch.Tensor, hx: torch.Tensor,
                cx: torch.Tensor | None, *weights: torch.Tensor) -> Any:
        steps, batch, _ = x.shape
        hidden = hx.size(-1)
        dtype = x.dtype
        flat = None
        if cast is not None:  # autocast: the weights cast into one flat buffer, kept for backward
            flat = x.new_empty(sum(w.numel() for w in weights), dtype=dtype)
        copied = x.contiguous()  # the kernel's (steps, batch) layout: a copy of a batch-first input while it runs
        output = x.new_empty(steps, batch, hidden)
        hy = hx.new_empty(hx.shape)
        cy = cx.new_empty(cx.shape) if cx is not None else None
        scratch = x.new_empty(_workspace(kind, layers, x, hidden), dtype=torch.uint8)
        reserve = x.new_empty(reserve_bytes(kind, layers, steps, batch, hidden, dtype.itemsize), dtype=torch.uint8)
        del scratch, copied
        ctx.kind, ctx.layers, ctx.cast = kind, layers, cast
        ctx.shapes = [(w.shape, w.dtype) for w in weights]
        ctx.save_for_backward(x, hx, cx, output, reserve, flat, *(() if cast is not None else weights))
        return (output, hy, cy) if cy is not None else (output, hy)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, grad_hy: torch.Tensor, *grad_cy: torch.Tensor) -> Any:
        x, hx, cx, *_ = ctx.saved_tensors  # the output, reserve and cast weights stay saved until it returns
        scratch_size = _workspace(ctx.kind, ctx.layers, x, hx.size(-1))
        # backward-data: runs whatever needs a gradient (backward-weights needs it first)
        transient = [grad_output.contiguous()]  # the incoming gradient in the kernel's layout, while it runs
        grad_x = x.new_empty(x.shape)
        transient.append(x.contiguous())
        grad_hx = hx.new_empty(hx.shape)
        grad_cx = cx.new_empty(cx.shape) if cx is not None else None
        transient.append(x.new_empty(scratch_size, dtype=torch.uint8))
        del transient
        grads: list[torch.Tensor | None] = [None] * len(ctx.shapes)
        if any(ctx.needs_input_grad[6:]):
            transient = [x.contiguous()]  # backward-weights: the input in the kernel's layout, and its workspace
            flat_grad = x.new_empty(sum(shape.numel() for shape, _ in ctx.shapes))
            transient.append(x.new_empty(scratch_size, dtype=torch.uint8))
            del transient
            offset = 0
            for index, (shape, dtype) in enumerate(ctx.shapes):
                part = flat_grad[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()
                if ctx.needs_input_grad[6 + index]:
                    grads[index] = part.to(dtype) if ctx.cast is not None else part
            del flat_grad, part
        return (None, None, None, grad_x, grad_hx, grad_cx, *grads)


class CudnnRNN(ScopedKernels):
    """While active, LSTMs and GRUs on fake tensors in training allocate what cuDNN's kernel allocates on an NVIDIA
    GPU (see the module's docstring); ``calls`` counts them, ``unmodelled`` the ones left to PyTorch's kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        #: calls on fake tensors that cuDNN would run and this does not model, with why (each reason once)
        self.unmodelled: dict[str, None] = {}

    def register(self, library: torch.library.Library) -> None:
        library.impl("lstm.input", self._lstm, "AutogradCPU")
        library.impl("gru.input", self._gru, "AutogradCPU")

    def _lstm(self, input: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor], *rest: Any) -> Any:
        return self._run("lstm", _LSTM, input, list(hx), params, *rest)

    def _gru(self, input: torch.Tensor, hx: torch.Tensor, params: list[torch.Tensor], *rest: Any) -> Any:
        return self._run("gru", _GRU, input, [hx], params, *rest)

    def _run(self, kind: str, op: Any, input: torch.Tensor, states: list[torch.Tensor], params: list[torch.Tensor],
             has_biases: bool, layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> Any:
        why = self._unmodelled(kind, input, states, params, has_biases, layers, dropout, train, bidirectional)
        if why is not None:
            if isinstance(input, FakeTensor) and why:
                self.unmodelled[why] = None
            hx: Any = states if kind == "lstm" else states[0]
            return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, input, hx, params, has_biases, layers,
                             dropout, train, bidirectional, batch_first)
        self.calls += 1
        cast = None
        if torch.is_autocast_enabled("cpu") and input.dtype == torch.float32:  # cuDNN's autocast: cast and reflatten
            cast = torch.get_autocast_dtype("cpu")
            input, states = input.to(cast), [state.to(cast) for state in states]
        x = input.transpose(0, 1) if batch_first else input
        cell = states[1] if kind == "lstm" else None
        outputs = _CudnnRNNFunction.apply(kind, layers, cast, x, states[0], cell, *params)
        output = outputs[0].transpose(0, 1) if batch_first else outputs[0]
        return (output, *outputs[1:])

    @staticmethod
    def _unmodelled(kind: str, input: torch.Tensor, states: list[torch.Tensor], params: list[torch.Tensor],
                    has_biases: bool, layers: int, dropout: float, train: bool, bidirectional: bool) -> str | None:
        """Why cuDNN's memory is not modelled for this call ("" where nothing is to say); None: it is."""
        if not isinstance(input, FakeTensor) or not train:
            return ""  # a tracked run's real tensors; evaluation (cuDNN's inference kernel, not measured)
        per_layer = 4 if has_biases else 2
        if bidirectional:
            return "bidirectional layers"
        if len(params) != per_layer * layers or states[0].size(-1) * _GATES[kind] != params[0].size(0):
            return "LSTM projections (proj_size)"
        if dropout and layers > 1:
            return "dropout between layers (cuDNN keeps a dropout state)"
        if input.dtype not in _COMPUTED or input.dim() != 3:
            return f"{input.dtype} input" if input.dtype not in _COMPUTED else ""
        return None

    def notes(self, steps: int = 1) -> list[str]:
        """What the estimate assumed about recurrent layers in each of ``steps`` steps."""
        notes = []
        if self.calls:
            calls = self.calls // steps
            notes.append(
                f"cuDNN: {calls} LSTM/GRU call{'s' if calls != 1 else ''} per step modelled as cuDNN's RNN kernel on "
                "an NVIDIA GPU: its reserve buffer kept for backward (cuDNN's size, exact on an H100 in 72 steps) and "
                "its workspace while it runs (fitted to an H100's with cuDNN 9.19, within 0.7 % for 64 LSTMs; other "
                "GPUs and cuDNN versions may take other sizes)")
        if self.unmodelled:
            notes.append(f"cuDNN: not modelled for {', '.join(self.unmodelled)}: PyTorch's CPU RNN kernel ran there")
        return notes
