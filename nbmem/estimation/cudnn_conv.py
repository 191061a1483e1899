"""Convolutions as an NVIDIA GPU runs them: cuDNN's workspaces, in an estimate.

On CUDA, ``nn.Conv2d`` runs cuDNN, which takes a *workspace* through the
caching allocator while each of its three kernels runs: forward, backward-data
(the input's gradient) and backward-filter (the weight's), each freed when the
kernel ends. PyTorch's CPU kernels, which an estimate runs on fake tensors,
take none. Its size is that of the algorithm cuDNN's heuristics pick, which no
API states ahead. An H100 (torch 2.11, cuDNN 9.19, ``cudnn.benchmark`` off as
PyTorch's default; 2026-11-27, ``benchmarks/results/2026-11-27-gpu/
conv_sizes.json``: every allocation of 1,962 ``nn.Conv2d`` training steps,
channels 3-512, kernels 1-7, strides 1 and 2, images 7-224, batch 1-64, fp32
and autocast) showed three regimes:

- none (a few hundred bytes), mostly for 1x1 kernels at stride 1 (forward and
  backward-data), for 3 input channels and for small layers;
- **copies of the tensors the kernel touches**: the input, the output and the
  weight in the compute dtype (``x + y + w``; ``x + y`` for a 1x1 kernel at
  stride 2), plus under 512 bytes: exactly so in 957 of the 1,444 forward
  calls with a kernel larger than 1, 987 of their backward-data calls and 363
  of their backward-filter calls (more of which take a split reduction's fp32
  partial sums beside the copies);
- for a 1x1 kernel at stride 1, backward-filter's partial sums alone: ``m``
  copies of the weight in fp32, ``m`` one of 1, 4, 16, 32 or 64;
- and a few larger ones with no formula found (FFT-like, fp32 kernels of 5 or
  7 on small images: tens of times ``x + y + w``).

:func:`workspaces` gives each call the regime its class (kernel of 1 or more,
stride, fp32 or autocast) takes when the layer's work (``N * Ho * Wo * C * K *
kh * kw``) is past a threshold fitted to the H100's steps, and none below it
(``benchmarks/fit_cudnn_conv.py`` fits and checks it). Fitted on 70 % of the
steps, on the other 30 %: each workspace within 10 % of the H100's in 78 % of
the forward calls that took one (backward-data 88 %, backward-filter 54 %); the
step's peak within 5 % of the H100's in 83 % of the steps; without workspaces it
was more than 5 % low in 35 % of them, with them in 14 %, and more than 5 %
high in 3.6 % (1.7 % more than 25 % high).

:class:`CudnnConv` makes an estimate allocate them, on fake tensors only: while
active, ``conv2d`` on fake CPU tensors takes the forward workspace right after
its output, and ``convolution_backward`` computes the input's gradient, takes
backward-data's workspace, then the weight's and bias's gradients and
backward-filter's, then the bias's gradient, each workspace freed at once
(registered below autograd's own kernel, which still records a double
backward's node); an output selective checkpointing kept, returned again on
recompute, takes none; under ``torch.inference_mode()``, where
no autograd kernel runs, an ``nn.Conv2d``'s forward hook takes the forward's (a
functional ``F.conv2d`` call there takes none). Not modelled (PyTorch's kernels, and a
note): grouped (depthwise) and dilated convolutions, strides other than 1 and
2, 1-D and 3-D ones, transposed ones, fp64. Channels-last tensors and other
GPUs or cuDNN versions were not measured: the same sizes stand in.

>>> workspaces(64, 64, 9, 1, x=8 * 64 * 32 * 32 * 4, y=8 * 64 * 32 * 32 * 4, w=64 * 64 * 9 * 4,
...            work=8 * 32 * 32 * 64 * 64 * 9, rows=8 * 32 * 32, fp32=True)  # the H100: 2,244,624, 4,341,776, 6,963,655
(4342016, 4342016, 4776192)
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .cuda_reductions import CudaReductions
from .kernels import ScopedKernels, calls_per_step

__all__ = ["CudnnConv", "workspaces"]

_CONV2D = torch.ops.aten.conv2d.default
_CONV2D_PADDING = torch.ops.aten.conv2d.padding
_BACKWARD = torch.ops.aten.convolution_backward.default
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd

#: (kernel larger than 1x1, stride, fp32) -> for forward, backward-data and backward-filter: None (no workspace), or
#: (none with 3 input channels, the smallest log2 of the layer's work with one, what it is, a factor). What it is:
#: "xyw" the input, output and weight in the compute dtype; "xy" the input and output; "split" backward-filter's
#: partial sums, min(factor, rows / 49) fp32 copies of the weight. Fitted to an H100's steps (the module's docstring)
_RULES: dict[tuple[bool, int, bool], tuple[tuple[bool, int, str, float] | None, ...]] = {
    (False, 1, True): (None, None, (False, 0, "split", 32)),
    (False, 1, False): (None, None, (False, 19, "split", 16)),
    (False, 2, True): ((True, 32, "xy", 1.0), (True, 32, "xy", 1.0), (False, 26, "xy", 1.0)),
    (False, 2, False): ((True, 0, "xy", 1.0), (False, 14, "xy", 1.0), (True, 21, "xy", 1.0)),
    (True, 1, True): ((True, 0, "xyw", 1.0), (True, 27, "xyw", 1.0), (True, 24, "xyw", 1.1)),
    (True, 2, True): ((True, 21, "xyw", 1.0), (True, 27, "xyw", 1.0), (False, 23, "xyw", 1.1)),
    (True, 1, False): ((True, 0, "xyw", 1.0), (False, 19, "xyw", 1.0), (False, 21, "xyw", 1.05)),
    (True, 2, False): ((True, 0, "xyw", 1.0), (False, 17, "xyw", 1.0), (False, 21, "xyw", 1.0)),
}
#: what a workspace of copies takes beyond them (the H100's: 16 to 147 bytes; any of them rounds to one more block)
_EXTRA = 256


def workspaces(in_channels: int, out_channels: int, kernel: int, stride: int, *, x: int, y: int, w: int, work: int,
               rows: int, fp32: bool) -> tuple[int, int, int]:
    """cuDNN's workspaces (forward, backward-data, backward-filter) in bytes for one 2-D convolution, as an H100 took
    them (the module's docstring): ``kernel`` its elements (kh * kw), ``x``, ``y``, ``w`` the input's, output's and
    weight's bytes in the compute dtype, ``work`` N * Ho * Wo * C * K * kh * kw, ``rows`` N * Ho * Wo.

    >>> workspaces(64, 64, 1, 1, x=2**21, y=2**21, w=2**14, work=2**27, rows=8192, fp32=True)  # a 1x1 kernel
    (0, 0, 524288)
    >>> workspaces(3, 64, 49, 2, x=2**20, y=2**21, w=37632, work=2**30, rows=2**15, fp32=False)  # a stem: 3 channels
    (0, 3183616, 3183616)
    """
    log_work = math.log2(max(work, 1))
    found = []
    for rule in _RULES[kernel > 1, stride, fp32]:
        if rule is None:
            found.append(0)
            continue
        none_with_three, smallest, kind, factor = rule
        if (none_with_three and in_channels == 3) or log_work < smallest:
            found.append(0)
        elif kind == "split":
            found.append(int(min(factor, rows / 49) * out_channels * in_channels * 4))
        else:
            found.append(int(factor * (x + y + (w if kind == "xyw" else 0))) + _EXTRA)
    forward, data, weight = found
    return forward, data, weight


class CudnnConv(ScopedKernels):
    """While active, 2-D convolutions on fake tensors take cuDNN's workspaces as an NVIDIA GPU's (the module's
    docstring); ``calls`` counts the modelled forward calls, ``unmodelled`` says why others were not."""

    def __init__(self, reductions: CudaReductions | None = None) -> None:
        super().__init__()
        #: where the bias's gradient (a sum over all but the channels, after cuDNN's calls) takes its staging buffer
        self.reductions = reductions
        self._hook: Any = None
        #: the storages of the outputs a workspace was taken for, weakly (see _forward)
        self._outputs: dict[int, weakref.ref[Any]] = {}
        self.calls = 0
        #: why a convolution on fake tensors was left without workspaces (each reason once)
        self.unmodelled: dict[str, None] = {}

    def register(self, library: torch.library.Library) -> None:
        library.impl("conv2d", self._conv2d, "AutogradCPU")
        library.impl("conv2d.padding", self._conv2d_padding, "AutogradCPU")
        # below autograd's own kernel, which still records the node a double backward (create_graph=True) needs
        library.impl("convolution_backward", self._backward, "ADInplaceOrView")
        # under torch.inference_mode() no autograd kernel runs: a convolution module's forward hook takes it there
        self._hook = torch.nn.modules.module.register_module_forward_hook(self._inference_forward)

    def _undo(self) -> None:
        # here, not in __exit__: a Ctrl-C after register() and before __enter__ returns releases too
        if self._hook is not None:
            self._hook.remove()  # idempotent
            self._hook = None
        super()._undo()

    def _inference_forward(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if isinstance(module, torch.nn.Conv2d) and torch.is_inference_mode_enabled() and args:
            self._forward(args[0], module.weight, out, module.stride, module.dilation, module.groups)

    # the dispatcher passes the arguments the caller gave: the schema's defaults here
    def _conv2d(self, input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = (1, 1),
                padding: Any = (0, 0), dilation: Any = (1, 1), groups: int = 1) -> torch.Tensor:
        out: torch.Tensor = _CONV2D._op_dk(_COMPOSITE, input, weight, bias, stride, padding, dilation, groups)
        self._forward(input, weight, out, stride, dilation, groups)
        return out

    def _conv2d_padding(self, input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = (1, 1),
                        padding: str = "valid", dilation: Any = (1, 1), groups: int = 1) -> torch.Tensor:
        out: torch.Tensor = _CONV2D_PADDING._op_dk(_COMPOSITE, input, weight, bias, stride, padding, dilation, groups)
        self._forward(input, weight, out, stride, dilation, groups)
        return out

    def _forward(self, input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, stride: Any, dilation: Any,
                 groups: int) -> None:
        sizes = self._sizes(input, weight, out, stride, dilation, groups, False)
        if sizes is None:
            return
        storage = out.untyped_storage()
        seen = self._outputs.get(storage._cdata)
        if seen is not None and seen() is storage:
            return  # an output selective checkpointing kept returned again on recompute: no kernel ran
        if len(self._outputs) > 4096:  # the dead go now and then
            self._outputs = {key: ref for key, ref in self._outputs.items() if ref() is not None}
        self._outputs[storage._cdata] = weakref.ref(storage)  # weakly: nbmem keeps no tensor alive
        self.calls += 1
        _transient(out, sizes[0])

    def _backward(self, grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias_sizes: Any,
                  stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int,
                  mask: list[bool]) -> Any:
        args = (bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
        sizes = self._sizes(input, weight, grad_output, stride, dilation, groups, transposed)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            found: list[torch.Tensor | None] = [None, None, None]
            if sizes is None:
                found = list(_BACKWARD(grad_output, input, weight, *args, mask))
            else:
                # as PyTorch runs them on CUDA: backward-data and its workspace, backward-filter and its own, then
                # the bias's gradient (a sum, after cuDNN's calls)
                for index, workspace in ((0, sizes[1]), (1, sizes[2]), (2, 0)):
                    if mask[index]:
                        only = [False, False, False]
                        only[index] = True
                        found[index] = _BACKWARD(grad_output, input, weight, *args, only)[index]
                        _transient(grad_output, workspace)
            depthwise_3d = weight.dim() == 5 and groups > 1 and groups == input.size(1)
            if found[2] is not None and self.reductions is not None and isinstance(grad_output, FakeTensor) and (
                    not depthwise_3d):
                # the bias's gradient: convolution_backward sums the incoming gradient, as it comes, over every
                # dimension but the channels (Convolution.cpp), for every backend but those computing it themselves
                # (CUDA's 3-D depthwise kernel, MIOpen's, MPS's)
                self.reductions.stage(grad_output, (0, *range(2, grad_output.dim())), "sum", found[2])
        return tuple(found)

    def _sizes(self, input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, stride: Any, dilation: Any,
               groups: int, transposed: bool) -> tuple[int, int, int] | None:
        """This call's three workspaces, or None where they are not modelled (saying why, on fake tensors)."""
        if not isinstance(input, FakeTensor):
            return None  # a tracked run's real tensors: PyTorch's kernels compute them
        why = None
        if transposed:
            why = "transposed convolutions"
        elif weight.dim() != 4:
            why = "1-D and 3-D convolutions"
        elif groups != 1:
            why = "grouped (depthwise) convolutions"
        elif any(d != 1 for d in dilation):
            why = "dilated convolutions"
        elif len(set(stride)) != 1:
            why = "unequal strides"
        elif stride[0] not in (1, 2):
            why = "strides above 2"
        elif out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            why = f"{out.dtype} convolutions"
        if why is not None:
            self.unmodelled[why] = None
            return None
        out_channels, in_channels, kh, kw = weight.shape
        # the compute dtype's: the output's (an inference hook sees the module's input before autocast casts it)
        itemsize = out.element_size()
        rows = out.numel() // out_channels
        return workspaces(in_channels, out_channels, kh * kw, stride[0], x=input.numel() * itemsize,
                          y=out.numel() * itemsize, w=weight.numel() * itemsize,
                          work=rows * in_channels * out_channels * kh * kw, rows=rows, fp32=itemsize == 4)

    def notes(self, steps: int = 1) -> list[str]:
        """What the estimate assumed about convolutions in each of ``steps`` steps."""
        notes = []
        if self.calls:
            notes.append(
                f"cuDNN: {calls_per_step(self.calls, steps, 'convolution')} took cuDNN's workspaces (forward, "
                "backward-data, backward-filter), sized as an H100 with cuDNN 9.19 took them for such a layer (its "
                "heuristics' algorithm: none, or copies of the input, output and weight); fitted to 1,962 H100 "
                "steps of one layer, the step's peak within 5 % in 83 % of those held out, some layers' far larger "
                "(FFT-like algorithms, split reductions). "
                "Other GPUs and cuDNN versions may differ: measure on the GPU")
        if self.unmodelled:
            notes.append(f"cuDNN: convolution workspaces not modelled for {', '.join(self.unmodelled)}")
        return notes


def _transient(like: torch.Tensor, size: int) -> None:
    """A workspace of ``size`` bytes taken and freed at once (the tracker counts it at the running peak)."""
    if size:
        like.new_empty(size, dtype=torch.uint8)  # dropped at once: the tracker counts it made, then freed
