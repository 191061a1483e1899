"""``compile=True`` estimates: a compiled step's memory from inductor's own code, on fake tensors (issue 23).

Inductor turns a model's forward and backward into Python wrapper code that
allocates each buffer (``empty_strided_cpu``), calls fused kernels on them,
reuses and frees them in the order it planned, and returns the outputs and
the activations it saves for backward. That wrapper is the memory plan.
nbmem lets inductor do all of its work (Dynamo's capture, AOTAutograd's
partition into forward and backward, decompositions, lowering, fusion,
scheduling, buffer reuse, code generation) on the estimate's fake tensors, and
cuts it off at one point: the kernels are never compiled (a C++ or Triton
build, most of a real compile's time). The wrapper is loaded with each kernel
a call that does nothing, and its buffers are made through the dispatcher, so
the fake mode makes them and the estimate's tracker counts them as a real run
would. On this CPU the figures equal the allocator's own (torch.profiler's
events) to the byte for an MLP, a CNN with BatchNorm and a GPT-2
(benchmarks/bench_compiled.py).

What it rests on, as torch 2.13 has it (private APIs, checked at use; any
missing, the estimate runs eagerly and says so):

- ``torch._inductor.codecache.PyCodeCache.load_by_key_path``: where inductor
  loads a wrapper; nbmem's loader builds a fresh module, never cached, so no
  other compile can pick up kernels that do nothing;
- ``torch._inductor.compile_fx.compile_fx`` and ``compile_fx_inner``: every
  inductor compile in the estimate goes through them; while they run (tracing
  on the estimate's fake tensors) the tracker looks away;
- ``torch._inductor.async_compile.AsyncCompile``: what a wrapper asks for its
  kernels; a stand-in hands out calls that do nothing;
- the caches (FX graph, AOTAutograd) are off for the estimate, and inductor's
  compile workers are not started.

The plan is inductor's plan for the device the fake tensors are on, the CPU:
on a GPU inductor emits Triton kernels and may fuse differently (untested on
CUDA), and ``mode="reduce-overhead"`` (CUDA graphs) keeps its own pool, which
this plan does not show.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import types
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch

from ..tracking.compiled import dynamo_codes

__all__ = ["planned_inductor", "compile_for_estimate", "dynamo_shapes_left_as_found", "quiet_about_hooks", "missing_internals", "Planning", "PLAN_NOTE", "UNPLANNED_NOTE"]

#: What an estimate with compile=True says about its figures.
PLAN_NOTE = (
    "compiled: torch.compile (inductor) ran on the fake tensors up to its generated code, whose buffers, reuse and "
    "frees are counted (its kernels were not built or run); inductor's plan for the CPU, which equals the CPU "
    "allocator's own figures to the byte on an MLP, a CNN and a GPT-2 (benchmarks/bench_compiled.py); on a GPU "
    "Triton's fusion may differ (untested on CUDA)"
)


#: What it says when no compiled graph ran (Dynamo fell back to its eager Python).
UNPLANNED_NOTE = (
    "EAGER FIGURES: compile=True, but no compiled graph of the model ran, so these are the eager step's figures. "
    "Dynamo ran the model's Python: it stops compiling a function after torch._dynamo.config.recompile_limit "
    "recompiles (8), or once it skipped its code (a graph break in every frame, or a call under a dispatch mode); "
    "torch._dynamo.reset() in a fresh cell, or a fresh kernel, lets it compile again"
)

#: What a planned graph says if it is ever called outside its estimate (its kernels do nothing).
OUTSIDE_ESTIMATE = (
    "a graph planned by nbmem.estimate(compile=True) was called outside its estimate: its kernels do nothing, so "
    "it must not run on real tensors. Run torch._dynamo.reset() and call the compiled code again (it compiles for "
    "real)"
)


#: The plannings of the estimates running now (nested: the innermost last).
_ACTIVE: list["Planning"] = []


class Planning:
    """One estimate's planned compiles: how many planned graphs ran, and whether the estimate is still on."""

    def __init__(self, fake_mode: Any) -> None:
        self.fake_mode = weakref.ref(fake_mode)  # a lazily compiled backward keeps this object: not the mode
        self.calls = 0
        self.active = True


def missing_internals() -> str | None:
    """What this torch lacks of the inductor internals a compile=True estimate uses (None: it has them all)."""
    try:
        from torch._inductor import async_compile, codecache, compile_fx
    except ImportError as error:  # a torch built without inductor
        return f"torch._inductor can't be imported ({error})"
    needed = {
        "PyCodeCache.load_by_key_path": getattr(codecache.PyCodeCache, "load_by_key_path", None),
        "compile_fx.compile_fx": getattr(compile_fx, "compile_fx", None),
        "compile_fx.compile_fx_inner": getattr(compile_fx, "compile_fx_inner", None),
        "async_compile.AsyncCompile": getattr(async_compile, "AsyncCompile", None),
    }
    absent = [name for name, value in needed.items() if value is None]
    return f"this torch has no {', '.join(absent)} in torch._inductor" if absent else None


class _NoKernel:
    """A kernel that does nothing: called, or asked for ``.run`` (Triton's launcher) and then called."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return self


class _NoCompile:
    """``AsyncCompile`` for a planned wrapper: each kernel it asks for is one that does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, scope: dict[str, Any]) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., _NoKernel]:
        return lambda *args, **kwargs: _NoKernel()

    @staticmethod
    def warm_pool() -> None:
        pass


def _empty_strided(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    # inductor's C helpers make tensors below the dispatcher; this goes through it, so the fake mode makes them
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret_tensor(tensor: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
    return tensor.as_strided(size, stride, tensor.storage_offset() + offset)


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


_HELPERS: dict[str, Callable[..., Any]] = {
    **{f"empty_strided_{kind}": _empty_strided for kind in ("cpu", "cpu_pinned", "cuda", "xpu", "mtia", "mps")},
    "reinterpret_tensor": _reinterpret_tensor,
    "assert_size_stride": _ignore,
    "assert_alignment": _ignore,
}


def _collect_the_compiles_garbage() -> None:
    """Collect the reference cycles the compile just left, before its graph first runs.

    Dynamo's tracing structures (its output graph, the variables it built
    for the frame's locals) refer to each other, and to the step's own
    objects it traced past: a graph break's frame holds the model's output,
    its logits among them. Once the compile returns they are garbage that
    only Python's cyclic collector frees, whenever its thresholds next say
    so: the estimate's figures then depended on when that was
    (bench_compiled_replay's GPT-2: its steady step 523 MB, or 624 MB with
    no full collection during the estimate; its first step's peak 561 MB).
    Collected here, every estimate counts the step as it runs once its
    compile is done (523 MB for both steps; 455 MB above the model's
    resident bytes, where the H100 measured 457 MB). The collection scans
    only what the estimate made (``older_objects_unscanned`` set the rest
    aside), so it frees no garbage of the user's and costs little beside
    the compile.
    """
    if gc.isenabled():
        gc.collect()


def _load_planned(planning: Planning, key: str, path: str, linemap: Any = None, attrs: dict[str, Any] | None = None,
                  **_: Any) -> Any:
    """A wrapper module built afresh from inductor's generated code, its kernels doing nothing (never cached)."""
    from torch._inductor import async_compile

    with open(path, encoding="utf-8") as file:
        source = file.read()
    module = types.ModuleType(f"nbmem_planned_{key}")
    module.__file__ = path
    real = async_compile.AsyncCompile
    try:
        setattr(async_compile, "AsyncCompile", _NoCompile)  # what the wrapper imports while it loads
        exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102  # inductor's own generated code
    finally:
        setattr(async_compile, "AsyncCompile", real)
    for name, helper in _HELPERS.items():
        if name in module.__dict__:
            module.__dict__[name] = helper
    for name, value in (attrs or {}).items():
        setattr(module, name, value)
    run = module.__dict__["call"]
    compiled = [True]  # until its first call, which comes just after the compile that made it

    def call(*args: Any, **kwargs: Any) -> Any:
        # Dynamo keeps the graph: a later estimate's fake tensors of the same shapes pass its guards, and it plans
        # for that estimate (its buffers come from the fake mode then active); outside any estimate it refuses
        current = planning if planning.active else (_ACTIVE[-1] if _ACTIVE else None)
        if current is None:
            raise RuntimeError(OUTSIDE_ESTIMATE)
        if compiled[0]:
            compiled[0] = False
            _collect_the_compiles_garbage()
        current.calls += 1
        return run(*args, **kwargs)

    module.__dict__["call"] = call
    return module


def _unseen(planning: Planning, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with the fake mode's tracker looking away: a compile's tracing is not the step's memory."""

    @functools.wraps(run)
    def unseen(*args: Any, **kwargs: Any) -> Any:
        fake_mode = planning.fake_mode()
        if fake_mode is None:  # the estimate is over (a backward compiled later, outside it)
            return run(*args, **kwargs)
        carried = fake_mode._nbmem_tracker
        fake_mode._nbmem_tracker = None
        try:
            return run(*args, **kwargs)
        finally:
            fake_mode._nbmem_tracker = carried

    return unseen


#: Inductor settings a planned compile needs: no cache (a planned wrapper must never be stored or found), no compile
#: workers, Python wrapper code (a C++ wrapper would run real kernels on fake tensors), no freezing (it reads values).
_SETTINGS = (("fx_graph_cache", False), ("fx_graph_remote_cache", False), ("autotune_local_cache", False),
             ("compile_threads", 1), ("cpp_wrapper", False), ("freezing", False))


@contextlib.contextmanager
def planned_inductor(fake_mode: Any) -> Iterator[Planning]:
    """Inside, every inductor compile plans on fake tensors, unseen by the tracker, and builds no kernel.

    Yields the estimate's :class:`Planning`; once it ends, a planned graph called again raises.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor import compile_fx as compile_module, config as inductor_config
    from torch._inductor.codecache import PyCodeCache

    planning = Planning(fake_mode)
    real_load, real_compile, real_inner = (PyCodeCache.__dict__["load_by_key_path"], compile_module.compile_fx,
                                           compile_module.compile_fx_inner)
    settings = {name: value for name, value in _SETTINGS if hasattr(inductor_config, name)}

    def compile_fx(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("inner_compile", _unseen(planning, real_inner))  # the backward compiles later, lazily
        if kwargs.get("config_patches"):  # a compile's own options must not undo the settings above
            kwargs["config_patches"] = {key: value for key, value in kwargs["config_patches"].items()
                                        if key not in settings}
        return _unseen(planning, real_compile)(model, inputs, *args, **kwargs)

    functorch = {name: False for name in ("enable_autograd_cache", "enable_remote_autograd_cache")
                 if hasattr(functorch_config, name)}
    cached = _cache_sizes()
    with inductor_config.patch(settings), functorch_config.patch(functorch):
        try:
            _ACTIVE.append(planning)
            PyCodeCache.load_by_key_path = classmethod(  # type: ignore[method-assign, assignment]
                lambda cls, *args, **kwargs: _load_planned(planning, *args, **kwargs))
            compile_module.compile_fx = compile_fx  # type: ignore[assignment]
            yield planning
        finally:
            planning.active = False
            while planning in _ACTIVE:
                _ACTIVE.remove(planning)
            PyCodeCache.load_by_key_path = real_load  # type: ignore[method-assign]
            compile_module.compile_fx = real_compile
            _forget_planned(cached)


def _cache_sizes() -> dict[int, int]:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return {id(code): len(_debug_get_cache_entry_list(code)) for code in dynamo_codes()}


def _forget_planned(before: dict[int, int]) -> None:
    """Empty the Dynamo caches that hold only the estimate's planned graphs.

    The estimate enters through a fresh function (:func:`compile_for_estimate`),
    but past a graph break Dynamo compiles the frames it resumes in (a model's
    forward, transformers' loss function, torchao's optimizer step) in the
    caches of their own, shared code objects: after 8 estimates of other
    sizes the recompile limit made estimates, and the user's own compile of
    the model, run eagerly. A code object that held nothing before the
    estimate and holds graphs now loses them (``reset_code``). One that held
    graphs of the user's keeps everything (no API removes one entry, and the
    user's compiled code must stay compiled): the estimate's graphs there
    pass only fake tensors' guards, and a later estimate that hits one plans
    with it (see ``_load_planned``).
    """
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    from torch._dynamo import convert_frame

    with convert_frame.compile_lock:
        for code in dynamo_codes():
            if not before.get(id(code), 0) and _debug_get_cache_entry_list(code):
                reset_code(code)


def compile_for_estimate(model: torch.nn.Module, notes: list[str]) -> _EstimateCompiled:
    """The estimate's copy of the model, ``torch.compile``'d with inductor, static shapes (a model the user compiled:
    its module again, compiled with the defaults, said in ``notes``)."""
    inner = getattr(model, "_orig_mod", model)
    if inner is not model:
        notes.append("compile=True: your torch.compile'd model was compiled again with inductor's defaults (its own "
                     "mode, backend and options are not carried over)")
    # A wrapper, not Module.compile(): compiling _call_impl in place traces the tracker's global hooks too. And not
    # torch.compile(inner) either: Dynamo keeps each compile in the cache of the code object it entered (for a module,
    # code every module shares), and stops compiling a code object after 8 (its recompile limit): after 8 estimates
    # the 9th, and the user's own compile of that model class, would run eagerly. The estimate enters through a
    # function whose code object is its own, made for this estimate, which takes its cache with it when it goes.
    entry = _fresh_entry(inner)
    return _EstimateCompiled(inner, torch.compile(entry, dynamic=False), entry.__globals__)


def _enter(*args: Any, **kwargs: Any) -> Any:
    return _inner(*args, **kwargs)  # type: ignore[name-defined]  # noqa: F821  (a global of each fresh copy)


def _fresh_entry(inner: torch.nn.Module) -> Callable[..., Any]:
    """``inner``'s call through a function whose code object is new (Dynamo's caches and recompile count are per code
    object), its ``_inner`` held in the function's own globals."""
    return types.FunctionType(_enter.__code__.replace(), {"_inner": inner, "__builtins__": __builtins__}, "_enter")


class _EstimateCompiled(torch.nn.Module):
    """The estimate's model: ``_orig_mod`` (its parameters and buffers), called through the compiled entry."""

    def __init__(self, inner: torch.nn.Module, entry: Callable[..., Any], scope: dict[str, Any]) -> None:
        super().__init__()
        self._orig_mod = inner
        self._entry = entry
        self._scope = scope  # the entry's globals, which hold the model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._entry(*args, **kwargs)

    def release(self) -> None:
        """Let the estimate's model go when the estimate ends. Dynamo keeps the globals of code it compiled (its
        cleanup hooks hold them while it keeps the code), and with them the model: every compile=True estimate
        left its fake model alive before."""
        self._scope.pop("_inner", None)


@contextlib.contextmanager
def quiet_about_hooks() -> Iterator[None]:
    """Without PyTorch's warning that global module hooks (the tracker's attribution) fire on the compiled wrapper."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        yield


@contextlib.contextmanager
def dynamo_shapes_left_as_found() -> Iterator[None]:
    """What Dynamo learnt of shapes (``torch._dynamo.pgo``, which marks a dimension dynamic once it changed) put
    back as it was: an estimate's batch sizes must not make the user's later compile dynamic.

    The model's compiled graphs live in the cache of the estimate's own entry (:func:`compile_for_estimate`) and go
    with it; compiled functions of the user's that a ``step=`` calls keep theirs in their own code's cache, whose
    guards want fake tensors: called again, such a graph raises (:data:`OUTSIDE_ESTIMATE`).
    """
    from torch._dynamo import pgo

    state = {name: copy.deepcopy(getattr(pgo, name)) for name in ("_CODE_STATE", "_INIT_CODE_STATE")
             if hasattr(pgo, name)}
    try:
        yield
    finally:
        for name, value in state.items():
            setattr(pgo, name, value)
