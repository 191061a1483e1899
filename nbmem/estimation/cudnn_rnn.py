"""LSTM and GRU as an NVIDIA GPU runs them: cuDNN's RNN kernel, its reserve buffer and workspace, in an estimate.

On CUDA, ``nn.LSTM`` and ``nn.GRU`` run one cuDNN kernel for the whole
sequence (``_cudnn_rnn``, aten/src/ATen/native/cudnn/RNN.cpp). In training it
keeps a *reserve* buffer for backward and takes a *workspace* while it runs,
forward and backward; PyTorch's CPU kernels, which an estimate otherwise runs
on fake tensors, loop over the time steps and save other tensors. An H100
(torch 2.11, cuDNN 9.19, 2026-11-27, ``benchmarks/results/2026-11-27-gpu/
misses-first.json``, ``rnn_sizes.json`` and ``rnn_variants.json``: 72, 1,751
and 448 LSTM and GRU training steps, hidden 32 to 2048, 1 to 3 layers, batch
1 to 64, 8 to 512 steps, input sizes 64, 300 and the hidden size, fp32 and
autocast, one and both directions, dropout between layers) showed:

- under autocast cuDNN's RNN runs in fp16, whatever autocast's dtype
  (``_cudnn_rnn_cast_reflatten`` in aten/src/ATen/cudnn/AutocastRNN.cpp; the
  H100 returned an fp16 output under bf16 autocast: ``rnn_autocast.log``):
  the weights are cast into one flat fp16 buffer (with room for biases, kept
  for backward), the input and states cast beside it, and backward's flat
  gradient is cast back to each fp32 weight's. bf16 weights without autocast
  (cuDNN 9.13 and later) run in bf16: not measured, fp16's sizes stand in;

- the reserve is ``(g * layers + layers - 1) * steps * batch * hidden``
  elements of the compute dtype for each direction, plus 256 bytes, with
  ``g`` 5 for an LSTM and 6 for a GRU, and with dropout between layers a bit
  mask of each inner layer's output (four bits an element both ways): exact
  in all 2,207 steps;
- the first call with dropout makes cuDNN's dropout state, kept for the
  process: 6,488,064 B on the H100, 24 bytes a resident thread
  (:func:`dropout_state_bytes` scales it to other GPUs: not measured);
- the workspace is the same size forward and backward (allocated three times:
  forward, backward-data, backward-weights; one at a time). It is cuDNN's own
  choice, with no rule to read: :func:`workspace` interpolates a model fitted
  to the H100's sizes for each hidden size (``benchmarks/fit_cudnn_rnn.py``):
  on 1,649 steps, half of them within 0.1 %, 90 % within -7.9 .. +6.4 %,
  worst -35 .. +20 %; fitted on 70 % of them, the other 30 %: 90 % within
  -9.3 .. +8.6 %. An LSTM on cuDNN's persistent kernel (fp16, one layer:
  :func:`persistent`) has its own fit (21 steps, -5 .. +7 %). Both directions
  take twice one direction's (median -0.2 %, -30 .. +28 % in 128 steps). At
  hidden sizes 129 to 192 cuDNN's forward runs another kernel than its
  backward (``use_rnn_persist_small_h``) and the probe could not read the
  workspace: interpolated there, and noted. Other GPUs and cuDNN versions may
  take other sizes;
- forward copies a batch-first input to the kernel's (steps, batch) layout
  while it runs; backward copies the incoming gradient and the input again,
  makes the zeros of gradients autograd left undefined, the input's and the
  initial states' gradients (always: cuDNN's backward-weights needs
  backward-data first) and the weights' gradients as one flat buffer with
  room for biases (without biases, each weight's gradient is copied out);
- an LSTM with projections (``proj_size``; ``rnn_variants.json``'s 64 steps,
  projection 64, hidden 128 and 512, one direction, no dropout) returns its
  output and last hidden states in the projection's width and keeps the
  projection's weights in the flat buffers; its reserve has a rule of its own
  (:func:`reserve_bytes`, exact in all 64) and its workspace a fit of its own
  (each step within -4.5 .. +4.5 % when left out of it). Every other
  allocation of the 64 steps is the H100's, byte for byte.

:class:`CudnnRNN` makes an estimate allocate exactly that, on fake tensors
only: while active, ``lstm`` and ``gru`` on fake CPU tensors in a training
module run :class:`_CudnnRNNFunction` (no values: an estimate has none). What
cuDNN runs that was not measured keeps PyTorch's CPU kernels and the note that
says cuDNN's memory is missing: LSTM projections with both directions or
dropout between layers (not measured), ``nn.RNN``, evaluation mode, packed
sequences, fp64. Tracked runs (real
tensors) keep the CPU's kernels too. Not modelled either: ``retain_graph=True``
(backward then copies the reserve).

>>> from torch._subclasses.fake_tensor import FakeTensorMode
>>> with FakeTensorMode(), CudnnRNN() as rnn:
...     lstm = torch.nn.LSTM(128, 128)
...     out, _ = lstm(torch.randn(32, 8, 128))
>>> out.grad_fn.name(), rnn.calls, reserve_bytes("lstm", 1, 32, 8, 128, 4)
('_CudnnRNNFunctionBackward', 1, 655616)
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..core.devices import COMPUTE_CAPABILITY, SM_COUNT, gpu_or_h100, threads_per_sm
from ..core.units import format_bytes
from .cudnn_rnn_fit import PERSISTENT, PROJECTED, WORKSPACE
from .kernels import ScopedKernels, calls_per_step

__all__ = ["CudnnRNN", "reserve_bytes", "dropout_state_bytes", "workspace", "persistent"]

_LSTM = torch.ops.aten.lstm.input
_GRU = torch.ops.aten.gru.input
_LSTM_PACKED = torch.ops.aten.lstm.data
_GRU_PACKED = torch.ops.aten.gru.data
_GATES = {"lstm": 4, "gru": 3}
#: what the reserve keeps per layer, in (steps x batch x hidden) elements (measured: 2,207 H100 steps)
_RESERVED = {"lstm": 5, "gru": 6}
_COMPUTED = (torch.float32, torch.bfloat16, torch.float16)


def reserve_bytes(kind: str, layers: int, steps: int, batch: int, hidden: int, itemsize: int, directions: int = 1,
                  dropout: bool = False, proj: int = 0) -> int:
    """cuDNN's reserve for ``kind`` ("lstm", "gru") in training (see the module's docstring): each direction's
    gates and layer outputs, and with dropout between layers a bit mask of each inner layer's output (four bits a
    bidirectional one). An LSTM with projections (``proj``, one direction, no dropout) keeps ``7 * hidden + proj``
    elements a layer less one ``hidden`` (exact in the H100's 64 steps, all with ``proj`` 64: how the term in
    ``proj`` grows, cuDNN's layout read as a layer's projected output, was not measured).

    >>> reserve_bytes("lstm", 2, 128, 64, 1024, 4), reserve_bytes("gru", 2, 32, 8, 256, 2)
    (369099008, 1704192)
    >>> reserve_bytes("lstm", 3, 32, 8, 512, 4, directions=2, dropout=True)  # as the H100's
    17957120
    >>> reserve_bytes("lstm", 2, 32, 8, 512, 4, proj=64)  # as the H100's
    6947072
    """
    if proj:
        return ((7 * hidden + proj) * layers - hidden) * steps * batch * itemsize + 256
    elements = (_RESERVED[kind] * layers + layers - 1) * steps * batch * hidden
    mask = (layers - 1) * steps * batch * hidden * (4 if directions == 2 else 1) // 8 if dropout else 0
    return directions * elements * itemsize + mask + 256


def dropout_state_bytes(device_label: str | None) -> int:
    """cuDNN's dropout state on the GPU ``device_label`` names (the H100's where none is): 24 bytes a thread the
    GPU can keep resident, as an H100 took it (132 SMs x 2,048 threads: 6,488,064 B). cuDNN does not say how it
    sizes it: 48 bytes (curand's XORWOW state) for 1,024 threads an SM fits the H100 as well, and gives the same
    on every GPU with 2,048 (V100, A100, H100, H200), up to twice this on the others; none of them measured.

    >>> dropout_state_bytes("H100-80GB"), dropout_state_bytes("T4"), dropout_state_bytes(None)
    (6488064, 983040, 6488064)
    """
    label = gpu_or_h100(device_label)
    return SM_COUNT[label] * threads_per_sm(label) * 24


def features(layers: int, steps: int, batch: int, hidden: int, inputs: float) -> tuple[float, ...]:
    """What the workspace model is linear in, for one hidden size: a part per call and per layer, per layer and
    batch row, per element of the sequence, per input element, per layer and element."""
    return (1.0, layers, layers * batch, batch * steps, batch * steps * inputs / hidden, layers * batch * steps)


def persistent_features(layers: int, steps: int, batch: int, hidden: int, inputs: float) -> tuple[float, ...]:
    """What the persistent kernel's workspace model is linear in (one layer): a part per call, per hidden unit, per
    element of the sequence and per batch row's state."""
    return (1.0, hidden, batch * steps * hidden, batch * hidden)


def persistent(kind: str, layers: int, hidden: int, inputs: int, batch: int, steps: int, precision: str,
               directions: int, device_label: str | None) -> bool:
    """Whether PyTorch runs cuDNN's persistent RNN kernel here (``get_algo`` in aten/src/ATen/native/cudnn/RNN.cpp:
    fp16, one unidirectional layer, hidden at most 1024 and a multiple of 128, input size a multiple of 128, and
    the GPU's rule: on Ampere and later with 98 SMs or more, but not sm_86, LSTMs only, batch a multiple of 8 up to
    128; on Volta a rule of batch and steps; never on Turing), on the GPU ``device_label`` names (an H100 if none).

    >>> persistent("lstm", 1, 1024, 1024, 64, 200, "fp16", 1, "H100-80GB"), persistent("gru", 1, 1024, 1024, 64, 200,
    ...     "fp16", 1, None), persistent("lstm", 1, 1024, 1024, 64, 200, "fp16", 1, "RTX-3090")
    (True, False, False)
    """
    if precision != "fp16" or layers != 1 or directions != 1 or hidden > 1024 or hidden % 128 or inputs % 128:
        return False
    if hidden <= 128:  # use_rnn_persist_small_h comes first: its kernel, forward and backward, up to 128
        return False
    label = gpu_or_h100(device_label)
    major, minor = COMPUTE_CAPABILITY[label]
    if major == 7:
        return minor != 5 and ((batch % 16 == 0 and batch not in (80, 112)) or batch == 8) and (
            (steps >= 40 and batch <= 128) or (steps >= 20 and batch <= 96) or (steps >= 10 and batch <= 32))
    return major >= 8 and SM_COUNT[label] >= 98 and minor != 6 and kind == "lstm" and batch % 8 == 0 and batch <= 128


def workspace(kind: str, layers: int, steps: int, batch: int, hidden: int, itemsize: int, inputs: int | None = None,
              precision: str | None = None, device_label: str | None = None, directions: int = 1, proj: int = 0) -> int:
    """cuDNN's RNN workspace in bytes, as an H100 (cuDNN 9.19) took it (:mod:`nbmem.estimation.cudnn_rnn_fit`).

    ``precision`` is the one cuDNN computes in, "fp32" or "fp16" (autocast's, whatever its dtype; bf16 weights
    without autocast, not measured, take fp16's). The model is fitted for each hidden size measured (32 to 2048);
    between two of them it interpolates, below the smallest it takes the smallest's, above the largest it scales
    the largest's with ``hidden``. An LSTM on cuDNN's persistent kernel (:func:`persistent`) has a fit of its own.
    Both directions take twice one direction's (128 H100 steps: median -0.2 %, -30 .. +28 %). An LSTM with
    projections (``proj``) has its own fits, at hidden 128 and 512 with ``proj`` 64 (64 steps, each within -4.5 ..
    +4.5 % when left out of its fit); ``proj`` itself is not in them.

    >>> workspace("lstm", 2, 32, 8, 256, 4)  # the H100 took 22,724,928 B
    22576128
    >>> workspace("lstm", 2, 32, 8, 512, 4, 64, proj=64)  # the H100 took 22,159,680 B
    22784512
    """
    precision = precision or ("fp32" if itemsize >= 4 else "fp16")
    inputs = inputs if inputs is not None else hidden
    # PyTorch's get_algo takes the standard algorithm for any projection
    if kind == "lstm" and not proj and persistent(kind, layers, hidden, inputs, batch, steps, precision, directions,
                                                  device_label):
        values = persistent_features(layers, steps, batch, hidden, inputs)
        return int(max(sum(c * v for c, v in zip(PERSISTENT, values)), 0.0)) // 512 * 512
    precision = "fp16" if precision == "bf16" else precision  # bf16's not measured: fp16's stands in
    if proj:
        table = {size: coefficients for (kind_precision, size), coefficients in PROJECTED.items()
                 if kind_precision == precision}
    else:
        table = {size: coefficients for (name, kind_precision, size), coefficients in WORKSPACE.items()
                 if name == kind and kind_precision == precision}
    sizes = sorted(table)

    def at(size: int, scale: float = 1.0) -> float:
        values = features(layers, steps, batch, size, inputs * size / hidden)
        return scale * max(sum(c * v for c, v in zip(table[size], values)), 0.0)

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
    return directions * int(found) // 512 * 512


#: the precision cuDNN computes in, by dtype: bf16's (cuDNN 9.13 and later, bf16 weights without autocast) was not
#: measured, fp16's stands in for it
_PRECISIONS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class _Call:
    """What one call is, for _CudnnRNNFunction (its shapes come from the tensors)."""

    #: cast: the weights go into one flat buffer at this call, in the input's dtype (autocast's fp16 cast, or bf16
    #: weights cuDNN copies), kept for backward; backward casts the flat gradient back to each weight's dtype.
    #: bias_space: the room for biases a flat buffer has that the weights lack (cuDNN's own buffers have it;
    #: autocast's cast leaves it out). copied: without biases each weight's gradient is copied out of the flat one
    def __init__(self, kind: str, layers: int, directions: int, dropout: bool, cast: bool, bias_space: int,
                 copied: bool, batch_first: bool, device_label: str | None, proj: int = 0) -> None:
        self.kind, self.layers, self.directions, self.dropout, self.proj = kind, layers, directions, dropout, proj
        self.cast, self.bias_space, self.copied = cast, bias_space, copied
        self.batch_first, self.device_label = batch_first, device_label

    def workspace(self, x: torch.Tensor, hidden: int) -> int:
        """Both directions take twice one direction's workspace (128 H100 steps: median -0.2 %, -30 .. +28 %)."""
        steps, batch, inputs = x.shape
        return workspace(self.kind, self.layers, steps, batch, hidden, x.dtype.itemsize, inputs, _PRECISIONS[x.dtype],
                         self.device_label, self.directions, self.proj)


class _CudnnRNNFunction(torch.autograd.Function):
    """cuDNN's RNN kernel's memory, forward and backward, on fake tensors (the module's docstring lists it)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, x: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None,
                *weights: torch.Tensor) -> Any:
        steps, batch, _ = x.shape
        hidden = (cx if cx is not None else hx).size(-1)  # an LSTM's cell: its hidden size, projected or not
        dtype = x.dtype
        flat = None
        if call.cast:  # the weights cast (or copied) into one flat buffer, kept
            flat = x.new_empty(sum(w.numel() for w in weights) + call.bias_space, dtype=dtype)
        copied = x.contiguous()  # the kernel's (steps, batch) layout: a copy of a batch-first input while it runs
        output = x.new_empty(steps, batch, call.directions * hx.size(-1))  # the projection's width, if any
        hy = hx.new_empty(hx.shape)
        cy = cx.new_empty(cx.shape) if cx is not None else None
        scratch = x.new_empty(call.workspace(x, hidden), dtype=torch.uint8)
        reserve = x.new_empty(reserve_bytes(call.kind, call.layers, steps, batch, hidden, dtype.itemsize,
                                            call.directions, call.dropout, call.proj), dtype=torch.uint8)
        del scratch, copied
        ctx.call = call
        ctx.shapes = [(w.shape, w.dtype) for w in weights]
        ctx.set_materialize_grads(False)  # cuDNN's backward makes the zeros itself, in its own layout
        ctx.save_for_backward(x, hx, cx, output, reserve, flat, *(() if call.cast else weights))
        return (output, hy, cy) if cy is not None else (output, hy)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor | None, grad_hy: torch.Tensor | None,
                 *grad_cy: torch.Tensor | None) -> Any:
        call: _Call = ctx.call
        if grad_output is None and grad_hy is None and (not grad_cy or grad_cy[0] is None):
            return (None,) * (_WEIGHTS + len(ctx.shapes))  # _cudnn_rnn_backward: nothing to do, nothing made
        x, hx, cx, output, *_ = ctx.saved_tensors  # the reserve and cast weights stay saved until it returns
        scratch_size = call.workspace(x, (cx if cx is not None else hx).size(-1))
        transient = []
        if grad_output is None:  # zeros_like the batch-first output, then the kernel's layout's copy of them
            zeros = output.new_zeros(output.transpose(0, 1).shape if call.batch_first else output.shape)
            grad_output = zeros.transpose(0, 1) if call.batch_first else zeros
            transient.append(zeros)
        # the states' gradients: zeros where undefined, contiguous copies (of a sum's expanded one, say) where not;
        # held until backward returns
        held = [hx.new_zeros(hx.shape) if grad_hy is None else grad_hy.contiguous()]
        if cx is not None:
            held.append(cx.new_zeros(cx.shape) if not grad_cy or grad_cy[0] is None else grad_cy[0].contiguous())
        # backward-data: runs whatever needs a gradient (backward-weights needs it first)
        transient.append(grad_output.contiguous())  # the incoming gradient in the kernel's layout, while it runs
        grad_x = x.new_empty(x.shape)
        transient.append(x.contiguous())
        grad_hx = hx.new_empty(hx.shape)
        grad_cx = cx.new_empty(cx.shape) if cx is not None else None
        transient.append(x.new_empty(scratch_size, dtype=torch.uint8))
        del transient
        grads: list[torch.Tensor | None] = [None] * len(ctx.shapes)
        if any(ctx.needs_input_grad[_WEIGHTS:]):
            transient = [x.contiguous()]  # backward-weights: the input in the kernel's layout, and its workspace
            flat_grad = x.new_zeros(sum(shape.numel() for shape, _ in ctx.shapes) + call.bias_space)
            transient.append(x.new_empty(scratch_size, dtype=torch.uint8))
            offset = 0
            for index, (shape, _) in enumerate(ctx.shapes):
                part = flat_grad[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()
                if ctx.needs_input_grad[_WEIGHTS + index]:
                    # views of the flat gradient; without biases each copied out, before the workspace goes
                    grads[index] = part.clone() if call.copied else part
            del transient, flat_grad, part
            # the cast back to each weight's dtype: its own backward, after cuDNN's has returned
            grads = [grad.to(dtype) if grad is not None else None for grad, (_, dtype) in zip(grads, ctx.shapes)]
        del held
        return (None, grad_x, grad_hx, grad_cx, *grads)


#: where the weights start among _CudnnRNNFunction.forward's arguments (call, x, hx, cx)
_WEIGHTS = 4


class CudnnRNN(ScopedKernels):
    """While active, LSTMs and GRUs on fake tensors in training allocate what cuDNN's kernel allocates on an NVIDIA
    GPU (see the module's docstring); ``calls`` counts them, ``unmodelled`` the ones left to PyTorch's kernels."""

    def __init__(self, device_label: str | None = None) -> None:
        super().__init__()
        self.device_label = device_label
        self.calls = 0
        #: cuDNN's dropout state, made by the first call with dropout and kept (PyTorch caches it per device), and
        #: its bytes (kept for the notes when the state is gone)
        self.dropout_state: torch.Tensor | None = None
        self.dropout_state_size = 0
        #: whether a call had a hidden size where cuDNN's forward and backward kernels differ (129-192)
        self.small_hidden = False
        #: calls on fake tensors that cuDNN would run and this does not model, with why (each reason once)
        self.unmodelled: dict[str, None] = {}

    def _undo(self) -> None:
        self.dropout_state = None  # the estimate's process is over: so is its dropout state
        super()._undo()

    def register(self, library: torch.library.Library) -> None:
        library.impl("lstm.input", self._lstm, "AutogradCPU")
        library.impl("gru.input", self._gru, "AutogradCPU")
        library.impl("lstm.data", functools.partial(self._packed, _LSTM_PACKED), "AutogradCPU")
        library.impl("gru.data", functools.partial(self._packed, _GRU_PACKED), "AutogradCPU")

    @staticmethod
    def flatten(model: torch.nn.Module) -> int:
        """Put each recurrent layer's weights into one flat buffer, as ``nn.RNNBase.flatten_parameters`` does on CUDA
        (when the layer is made or moved there): the buffer made, the weights made views of it and their own storages
        freed. Only where PyTorch does it: fake weights of one dtype cuDNN takes (not bf16), none shared. The buffer
        has room for biases where the layer has none, as cuDNN's own. The layers flattened.

        The memory is the same as the weights' own; where it lies is not: an LSTM's flat buffer of a few MiB takes a
        large segment whose rest the reserve then fits in (an H100, 2026-11-27: 4 MiB less reserved than separate
        weights gave).
        """
        flattened = 0
        for module in model.modules():
            weights = getattr(module, "_flat_weights", None)
            if not isinstance(module, torch.nn.RNNBase) or not weights or not all(
                    isinstance(weight, FakeTensor) and weight.dtype == weights[0].dtype for weight in weights):
                continue
            if weights[0].dtype not in (torch.float32, torch.float16, torch.float64) or len(
                    {weight.untyped_storage()._cdata for weight in weights}) != len(weights):
                continue  # cudnn.is_acceptable takes no bf16; aliased weights take PyTorch's copying path
            directions = 2 if module.bidirectional else 1
            room = 0 if module.bias else (module.num_layers * directions * 2 * _GATES.get(module.mode.lower(), 1)
                                          * module.hidden_size)
            with torch.no_grad():
                flat = weights[0].new_empty(sum(weight.numel() for weight in weights) + room)
                offset = 0
                for weight in weights:
                    weight.set_(flat[offset:offset + weight.numel()].view(weight.shape))
                    offset += weight.numel()
            del flat
            flattened += 1
        return flattened

    def _lstm(self, input: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor], *rest: Any) -> Any:
        return self._run("lstm", _LSTM, input, list(hx), params, *rest)

    def _gru(self, input: torch.Tensor, hx: torch.Tensor, params: list[torch.Tensor], *rest: Any) -> Any:
        return self._run("gru", _GRU, input, [hx], params, *rest)

    def _packed(self, op: Any, data: torch.Tensor, *args: Any) -> Any:
        """A packed sequence's call: PyTorch's kernel, and a note (cuDNN's kernel for them is not modelled)."""
        if isinstance(data, FakeTensor):
            self.unmodelled["packed sequences"] = None
        return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, data, *args)

    def _run(self, kind: str, op: Any, input: torch.Tensor, states: list[torch.Tensor], params: list[torch.Tensor],
             has_biases: bool, layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> Any:
        why = self._unmodelled(kind, input, states, params, has_biases, layers, train, bidirectional, dropout)
        if why is not None:
            if isinstance(input, FakeTensor) and why:
                self.unmodelled[why] = None
            hx: Any = states if kind == "lstm" else states[0]
            return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, input, hx, params, has_biases, layers,
                             dropout, train, bidirectional, batch_first)
        self.calls += 1
        hidden = states[-1].size(-1)  # an LSTM's cell state: its hidden size, projected or not
        self.small_hidden |= 128 < hidden <= 192
        if dropout and self.dropout_state is None:
            self.dropout_state_size = dropout_state_bytes(self.device_label)
            self.dropout_state = input.new_empty(self.dropout_state_size, dtype=torch.uint8)
        flattened = None  # who puts the weights into one flat buffer at this call, if anyone does
        if torch.is_autocast_enabled("cpu"):
            # AutocastRNN.cpp (_cudnn_rnn_cast_reflatten): cuDNN's RNN under autocast runs in fp16, whatever
            # autocast's dtype (an H100 returned an fp16 output under bf16 autocast), the weights cast into one flat
            # fp16 buffer unless they are fp16, the input and states cast unless they are
            flattened = "autocast" if params[0].dtype in (torch.float32, torch.bfloat16) else None
            input, states = _half(input), [_half(state) for state in states]
        elif params[0].dtype == torch.bfloat16:
            # bf16 weights are never flattened (cudnn.is_acceptable takes no bf16): cuDNN copies them into one
            # flat buffer at every call, kept for backward (an H100 did so: rnn_autocast.log)
            flattened = "cudnn"
        directions = 2 if bidirectional else 1
        # cuDNN's own flat buffers have room for biases; autocast's cast flattens without it (include_bias=false)
        bias_space = 0 if has_biases or flattened == "autocast" else layers * directions * 2 * _GATES[kind] * hidden
        proj = states[0].size(-1) if states[0].size(-1) != hidden else 0
        call = _Call(kind, layers, directions, bool(dropout), flattened is not None, bias_space, not has_biases,
                     batch_first, self.device_label, proj)
        x = input.transpose(0, 1) if batch_first else input
        cell = states[1] if kind == "lstm" else None
        outputs = _CudnnRNNFunction.apply(call, x, states[0], cell, *params)
        output = outputs[0].transpose(0, 1) if batch_first else outputs[0]
        return (output, *outputs[1:])

    @staticmethod
    def _unmodelled(kind: str, input: torch.Tensor, states: list[torch.Tensor], params: list[torch.Tensor],
                    has_biases: bool, layers: int, train: bool, bidirectional: bool, dropout: float) -> str | None:
        """Why cuDNN's memory is not modelled for this call ("" where nothing is to say); None: it is."""
        if not isinstance(input, FakeTensor):
            return ""  # a tracked run's real tensors: PyTorch's kernels compute them
        if not train:
            return "evaluation mode (cuDNN's inference kernel)"
        projected = kind == "lstm" and states[0].size(-1) != states[-1].size(-1)
        per_layer = (4 if has_biases else 2) + projected  # and the projection's weight
        if len(params) != per_layer * layers * (2 if bidirectional else 1):
            return f"{kind.upper()} weights other than PyTorch's"
        if projected and (bidirectional or (dropout and layers > 1)):
            # measured with one direction and without dropout between layers only (one layer has none between)
            return "LSTM projections (proj_size) with both directions or dropout between layers"
        if input.dtype not in _COMPUTED:
            return f"{input.dtype} input"
        if input.dim() != 3:
            return ""  # nn.LSTM and nn.GRU batch an unbatched input themselves: another caller's, left alone
        return None

    def notes(self, steps: int = 1) -> list[str]:
        """What the estimate assumed about recurrent layers in each of ``steps`` steps."""
        notes = []
        if self.calls:
            notes.append(
                f"cuDNN: {calls_per_step(self.calls, steps, 'LSTM/GRU')} modelled as cuDNN's RNN kernel on an NVIDIA GPU: its reserve buffer kept for "
                "backward (cuDNN's size, exact in 2,207 H100 steps) and its workspace while it runs (fitted to an "
                "H100's with cuDNN 9.19; other GPUs and cuDNN versions may take other sizes); under autocast in fp16, "
                "whatever autocast's dtype, as cuDNN runs it")
            if self.small_hidden:
                notes.append(
                    "cuDNN: at hidden sizes 129-192 cuDNN runs a different forward kernel from its backward's "
                    "(persist small-h forward only), whose workspace the H100's probe could not read: interpolated")
            if self.dropout_state_size:
                notes.append(
                    f"cuDNN: dropout between recurrent layers keeps a dropout state, "
                    f"{format_bytes(self.dropout_state_size)} made once for the process (24 "
                    "bytes a resident thread, as an H100 took it; other GPUs not measured, and on those with fewer "
                    "than 2,048 threads an SM it may be up to twice this)")
        if self.unmodelled:
            notes.append(f"cuDNN: not modelled for {', '.join(self.unmodelled)}: PyTorch's CPU RNN kernel ran there")
        return notes


def _half(tensor: torch.Tensor) -> torch.Tensor:
    """autocast's cast for cuDNN's RNN: a floating tensor to fp16 (fp64 left alone)."""
    return tensor.to(torch.float16) if tensor.dtype in (torch.float32, torch.bfloat16) else tensor
