"""bitsandbytes' CUDA kernels' own temporaries, while a CPU step runs: what a GPU holds inside each quantized matmul.

bitsandbytes' 4-bit matmul is one operator (``bitsandbytes::gemm_4bit``), and
its CUDA implementation (backends/cuda/ops.py) chooses between a fused kernel,
which reads the packed weight as it multiplies, and a fallback that
dequantizes the whole weight first: an (out, in) copy in the compute dtype,
and with double quantization two fp32 absmax arrays, alive while the matmul
runs (``_dequant_linear_fallback``). Which one runs depends on the rows of
the input (M), the layer's shape and the GPU: past 1,536 rows always the
fallback, at 4 rows or fewer always the fused kernel, in between bitsandbytes'
own heuristic (``_gemm_4bit_use_custom_cuda``) by the GPU's SM count and
compute capability. Training a language model puts batch x sequence rows
through each layer, so the fallback is the rule there: a 7B ``gate_proj``
(11008 x 4096) holds 90 MB more while it runs. Backward dequantizes in
Python (``F.dequantize_4bit``), which the step already runs and counts.

bitsandbytes' int8 matmul (``int8_scaled_mm``) is an int32 matmul of
output's size, then its fp16 dequantization: the int32 buffer is alive when
the output is made.

:class:`QuantizedKernels`, while active, stands in front of bitsandbytes'
two matmul functions as its layers call them (``bitsandbytes.matmul_4bit``,
whose only allocation is the operator's output, and ``bitsandbytes.matmul``):
it makes the temporaries a GPU's kernels make, runs bitsandbytes' own
function, and frees them, so the step's peak includes them as a GPU's would,
in training and under ``inference_mode`` alike (a dispatcher kernel would
miss the latter). The int8 one runs the autograd function CUDA runs
(``MatMul8bitLt``; on a CPU bitsandbytes picks ``MatMul8bitFp``, which
dequantizes the weight instead). Leaving restores both. The heuristic is bitsandbytes' own function, read
from the installed bitsandbytes' source (it can't be imported without CUDA)
and given the target GPU's SM count and compute capability
(:data:`nbmem.core.devices.SM_COUNT`, ``COMPUTE_CAPABILITY``). Without a
GPU named, every matmul of more than 4 rows is taken to dequantize. Untested
on CUDA.

>>> kernels = QuantizedKernels("H100-80GB")
>>> kernels.fused(torch.bfloat16, rows=2048, out_features=11008, in_features=4096, blocksize=64)
False
>>> kernels.fused(torch.bfloat16, rows=1, out_features=11008, in_features=4096, blocksize=64)
True
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import os
from typing import Any, Callable

import torch

from ..core.devices import COMPUTE_CAPABILITY, SM_COUNT
from .kernels import OneAtATime

__all__ = ["QuantizedKernels"]

#: bitsandbytes' bounds around its heuristic (backends/cuda/ops.py): the fused kernel at 4 rows or fewer, the
#: dequantize fallback past 1,536 rows; used when its source can't be read.
FUSED_UP_TO = 4
DEQUANTIZED_PAST = 1536


class QuantizedKernels(OneAtATime):
    """While active, bitsandbytes' 4-bit and int8 matmuls on CPU tensors hold what their CUDA kernels hold (one
    active at a time in a process: the operators it stands in front of are process-wide)."""

    def __init__(self, gpu: str | None) -> None:
        self.gpu = gpu if gpu in SM_COUNT else None
        self.dequantized = 0  # 4-bit matmuls that took the dequantize fallback
        self.fused_calls = 0
        self.int8 = 0
        self._choose, self._floor, self._ceiling = _heuristic(self.gpu)

    def fused(self, dtype: torch.dtype, rows: int, out_features: int, in_features: int, blocksize: int) -> bool:
        """Whether bitsandbytes' CUDA dispatch would run the fused kernel for this matmul (its ``gemm_4bit``)."""
        if rows > self._ceiling or in_features % blocksize:
            return False
        if self._choose is None:
            return rows <= self._floor
        return bool(self._choose(0, dtype, rows, out_features, in_features))

    @property
    def installed(self) -> bool:
        return getattr(self, "_matmul", None) is not None or getattr(self, "_level", None) is not None

    def __enter__(self) -> QuantizedKernels:
        self._take_place()
        try:
            bitsandbytes: Any = importlib.import_module("bitsandbytes")  # untyped: its attributes are replaced
            self._module = bitsandbytes
            self._int8_function = bitsandbytes.autograd._functions.MatMul8bitLt
            # bitsandbytes logs a warning at every int8 matmul whose input is not fp16 (it casts it): once per layer
            # per step here, where the cast is counted; its logger is quiet while the step runs
            self._logger = logging.getLogger("bitsandbytes.autograd._functions")
            self._level: int | None = self._logger.level
            self._matmul_4bit, self._matmul = bitsandbytes.matmul_4bit, bitsandbytes.matmul
            # both stand-ins in one statement: Ctrl-C finds both or neither
            bitsandbytes.matmul_4bit, bitsandbytes.matmul = self._4bit, self._int8
            self._logger.setLevel(logging.ERROR)
            return self  # inside the try: Ctrl-C on this line leaves nothing either (no __exit__ will come)
        except BaseException:  # Ctrl-C while entering: nothing of it stays
            self.release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _undo(self) -> None:
        if getattr(self, "_matmul", None) is not None:
            self._module.matmul_4bit, self._module.matmul = self._matmul_4bit, self._matmul
            self._matmul = None
        level = getattr(self, "_level", None)
        if level is not None:
            self._logger.setLevel(level)
            self._level = None
        super()._undo()

    def _4bit(self, A: torch.Tensor, B: torch.Tensor, quant_state: Any, out: Any = None, bias: Any = None) -> Any:
        in_features = A.shape[-1]
        rows = A.numel() // in_features
        temporaries = []
        if self.fused(A.dtype, rows, quant_state.shape[0], in_features, quant_state.blocksize):
            self.fused_calls += 1
        else:  # bitsandbytes' _dequant_linear_fallback: the absmax dequantized, plus its offset; the weight
            self.dequantized += 1
            if quant_state.nested:
                temporaries += [torch.empty_like(quant_state.absmax, dtype=torch.float32) for _ in range(2)]
            temporaries.append(torch.empty(tuple(quant_state.shape), dtype=A.dtype, device=A.device))
        output = self._matmul_4bit(A, B, quant_state, out=out, bias=bias)
        del temporaries
        return output

    def _int8(self, A: torch.Tensor, B: torch.Tensor, out: Any = None, state: Any = None, threshold: float = 0.0,
              bias: Any = None) -> Any:
        # CUDA's path (bitsandbytes.matmul with threshold 0), and int8_scaled_mm's composite kernel: int8_linear_matmul's
        # int32 (M, N), then int8_mm_dequant's fp16 output
        self.int8 += 1
        int32 = torch.empty((*A.shape[:-1], B.shape[0]), dtype=torch.int32, device=A.device)
        output = self._int8_function.apply(A, B, out, bias, state)
        del int32
        return output

    def notes(self, steps: int) -> list[str]:
        """What the estimate assumed about bitsandbytes' CUDA kernels in each of ``steps`` steps (none without calls)."""
        notes = []
        if self.dequantized or self.fused_calls:
            where = (f"bitsandbytes' own heuristic for the {self.gpu} ({SM_COUNT[self.gpu]} SMs, compute capability "
                     f"{'.'.join(map(str, COMPUTE_CAPABILITY[self.gpu]))})" if self.gpu and self._choose else
                     f"the fallback for more than {self._floor} rows (name a GPU with device= for bitsandbytes' own "
                     "choice)" if not self.gpu else
                     f"bitsandbytes' bounds (its heuristic could not be read here: fused up to {self._floor} rows)")
            notes.append(
                f"bitsandbytes' CUDA kernels: of {(self.dequantized + self.fused_calls) // steps} 4-bit matmuls per "
                f"step, {self.dequantized // steps} dequantize the weight to a compute-dtype copy while they run (and "
                f"{self.fused_calls // steps} run fused), by {where}; backward dequantizes each weight again, as "
                "bitsandbytes' Python does (untested on CUDA)")
        if self.int8:
            notes.append(f"bitsandbytes' CUDA kernels: each of the {self.int8 // steps} int8 matmuls per step holds an "
                         "int32 buffer of its output's size while it runs, counted from the matmul's start (CUDA makes "
                         "it after quantizing the input: at most that quantization's temporaries early; untested on CUDA)")
        return notes


def _heuristic(gpu: str | None) -> tuple[Callable[..., bool] | None, int, int]:
    """bitsandbytes' ``_gemm_4bit_use_custom_cuda`` for ``gpu``, and its floor and ceiling (None: not readable)."""
    if gpu is None:
        return None, FUSED_UP_TO, DEQUANTIZED_PAST
    try:
        return _read_heuristic(SM_COUNT[gpu], COMPUTE_CAPABILITY[gpu])
    except (OSError, SyntaxError, KeyError, ValueError, TypeError):
        return None, FUSED_UP_TO, DEQUANTIZED_PAST


@functools.lru_cache(maxsize=None)  # one parse of bitsandbytes' source per GPU and process, not one per estimate
def _read_heuristic(sms: int, capability: tuple[int, int]) -> tuple[Callable[..., bool], int, int]:
    # backends/cuda/ops.py loads bitsandbytes' CUDA library when imported, so its function is read from the source
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("bitsandbytes is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "backends", "cuda", "ops.py")
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                    and node.name == "_gemm_4bit_use_custom_cuda")
    function.decorator_list = []
    floor = _constant(tree, "_GEMM_4BIT_CUSTOM_FLOOR_M")
    ceiling = _constant(tree, "_gemm_4bit_custom_max_m")  # the CUDA branch's, the first assigned
    namespace: dict[str, Any] = {"torch": torch, "_GEMM_4BIT_CUSTOM_FLOOR_M": floor,
                                 "_gpu_dispatch_props": lambda index: (sms, *capability)}
    exec(compile(ast.Module(body=[function], type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    return namespace["_gemm_4bit_use_custom_cuda"], floor, ceiling


def _constant(tree: ast.Module, name: str) -> int:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == name
                                                for target in node.targets):
            value = ast.literal_eval(node.value)
            if isinstance(value, int):
                return value
    raise KeyError(name)
