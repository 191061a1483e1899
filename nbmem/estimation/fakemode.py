"""The fake-tensor mode estimates run in: PyTorch's ``FakeTensorMode``, with its cache key computed faster.

An estimate runs every op of a training step on fake tensors, and nearly
every op is answered from ``FakeTensorMode``'s dispatch cache. Profiled on
GPT-2 and BERT-base steps (torch 2.13), building the cache key took about
half of fake-tensor dispatch: for each tensor argument,
``extract_tensor_metadata`` fills a dataclass and ``_flatten_into`` walks its
fields with ``isinstance`` checks, and ``_prep_args_for_hash`` re-imports two
modules on every call. :class:`FastKeyFakeTensorMode` builds the *same* key
(the same values, in the same order: checked against PyTorch's own function
in tests/test_fakemode.py) directly for the common case, a dense tensor of
this mode without symbolic sizes, and leaves every other argument to PyTorch.
Equal keys mean equal cache hits, so estimates are unchanged to the byte.

Where PyTorch's meta functions make other outputs than the kernels, the
ops in :mod:`nbmem.estimation.kernel_outputs` make the kernels'.

Where PyTorch's metadata fields are not the ones this was written against
(another torch version), :func:`new_fake_mode` returns a plain
``FakeTensorMode``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode, TensorMetadata
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import _disable_current_modes

from ..tracking.dispatch import SKIPS_BY_CODE, after_op, before_op, skip_dynamo
from .kernel_outputs import KERNEL_OUTPUTS

__all__ = ["new_fake_mode", "FastKeyFakeTensorMode"]

#: TensorMetadata's fields in torch 2.13 (torch/_subclasses/fake_tensor.py): the
#: order _flatten_into appends them in, which _flatten_dense follows.
_FIELDS = (
    "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset", "storage_bytes",
    "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference", "is_sparse", "is_coalesced",
    "dense_dim", "sparse_dim",
)
_SAME_FIELDS = tuple(field.name for field in dataclasses.fields(TensorMetadata)) == _FIELDS

#: Arguments _prep_args_for_hash keys as (type, value): none of its special cases applies to them.
_PLAIN_VALUES = frozenset(
    {int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


#: The internals the short paths below read (torch 2.13's fake_tensor.py); any absent: PyTorch's own path.
_INTERNALS: dict[str, Any] = {
    name: getattr(fake_tensor, name, None)
    for name in ("_CacheKeyState", "_BypassDispatchCache", "_DispatchCacheValidEntry", "_DispatchCacheEntryOutputInfo",
                 "_DISPATCH_META_HANDLERS", "_DISPATCH_HANDLE_DIRECTLY", "extract_tensor_metadata", "log",
                 "_DispatchCacheKey", "evict_fake_tensor_cache_key")
}
_HIT_PATH = all(value is not None for value in _INTERNALS.values())
_CacheKeyState, _BypassDispatchCache, _ValidEntry, _OutputInfo = (
    _INTERNALS["_CacheKeyState"], _INTERNALS["_BypassDispatchCache"], _INTERNALS["_DispatchCacheValidEntry"],
    _INTERNALS["_DispatchCacheEntryOutputInfo"],
)
_META_HANDLERS, _HANDLE_DIRECTLY, _LOG = (
    _INTERNALS["_DISPATCH_META_HANDLERS"], _INTERNALS["_DISPATCH_HANDLE_DIRECTLY"], _INTERNALS["log"]
)
_DEVICE = torch.ops.prim.device.default
_SCALAR = torch.ops.aten._local_scalar_dense.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default
_META = torch.device("meta")
_get_dispatch_mode, _FAKE_KEY = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE


class FastKeyFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose dispatch-cache key for dense fake tensors takes fewer steps (same key),
    and whose cache hits and device queries take fewer steps (same outputs).

    >>> mode = FastKeyFakeTensorMode()
    >>> with mode:
    ...     weight = torch.empty(64, 32)
    ...     hidden = torch.empty(8, 32) @ weight.t()
    >>> hidden.shape, type(hidden).__name__
    (torch.Size([8, 64]), 'FakeTensor')
    """

    #: A weak reference to the tracker this mode reports each op to (see :meth:`carry`), and whether an op of
    #: it is being dispatched. Weak: ``copy.deepcopy`` of a fake tensor copies its mode, and with it this
    #: attribute (a weak reference is copied as it is; a tracker can't be copied).
    _nbmem_tracker: Any = None
    _nbmem_inside = False
    #: ``_grouped_mm`` calls made (see :mod:`nbmem.estimation.kernel_outputs`)
    _nbmem_grouped_mm = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: __torch_dispatch__ below stays unwrapped, and Dynamo skips it by its code (nbmem.tracking.dispatch)
        return not SKIPS_BY_CODE

    def carry(self, tracker: Any) -> None:
        """Report every op to ``tracker`` (None: stop), as its own ``TrackingMode`` would.

        A tracker's dispatch mode above this one costs every op a second
        trip from the dispatcher into Python (about 4 us of the 30 us an op
        that hits the cache costs): an estimate's tracker rides on the fake
        mode instead. Only the ops a mode above would see are reported: those
        this mode runs inside another op's dispatch (decompositions, meta
        functions) are not, nor are device queries (``prim.device``, 13,700
        of the 21,500 ops of a GPT-2 estimate with bf16 and checkpointing),
        which a real tensor answers in C++, out of a tracked run's sight.
        A tensor subclass this mode leaves to itself
        (NotImplemented: a DTensor) is seen through the ops it runs, not as
        its own output, so estimates of parallel runs keep a mode of their own.
        """
        self._nbmem_tracker = weakref.ref(tracker) if tracker is not None else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """PyTorch's ``FakeTensorMode.__torch_dispatch__`` without its two Python wrappers, and the tracker carried.

        PyTorch wraps it in ``torch._dynamo.disable`` (every dispatch mode's,
        see :mod:`nbmem.tracking.dispatch`) and in ``torch.utils._stats.count`` (a call
        counter for PyTorch's debugging): about 3 us of every op's fake
        dispatch. Dynamo skips this frame by its code instead; the counter is
        not kept.
        """
        __tracebackhide__ = True
        if func is _DEVICE and len(args) == 1 and type(args[0]) is FakeTensor:
            # a device query: the autograd engine and the foreach optimizers ask each fake tensor (60 % of an
            # estimate's ops). Answered as PyTorch's _device_handler answers, without the no_dispatch() it
            # enters around a debug log line first; nothing made, and nothing a tracked run's mode sees (a
            # real tensor answers it in C++), so not reported to the tracker either
            return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        if _get_dispatch_mode(_FAKE_KEY) is not None:
            raise AssertionError(f"FakeTensorMode should not be set when dispatching {func}")
        if kwargs is None:
            kwargs = {}
        carried = self._nbmem_tracker
        tracker = carried() if carried is not None else None
        if tracker is None or self._nbmem_inside:
            return self.dispatch(func, types, args, kwargs)
        # inside from before_op on: what the tracker asks of a tensor there (a sparse gradient's _indices() and
        # _values(), to count its parts) dispatches here again, and must not reach the tracker a second time
        self._nbmem_inside = True
        try:
            before_op(tracker, func, args, kwargs)
            out = self.dispatch(func, types, args, kwargs)
        finally:
            self._nbmem_inside = False
        if out is not NotImplemented:
            after_op(tracker, out)
        return out

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """PyTorch's ``FakeTensorMode.dispatch``, with shorter paths for the commonest cases of an estimate.

        (``prim.device`` never gets here: :meth:`__torch_dispatch__` answers
        it.) ``.item()`` of a constant (a tensor made by
        ``torch.tensor(number)``): the constant's value, as PyTorch's
        constant propagation gives it. A cache hit without a ShapeEnv (an
        estimate has none): the same key and the same cached entry as
        ``_cached_dispatch_impl``, the output made as
        ``_output_from_cache_entry`` makes it, without its per-value checks
        for symbolic sizes, which only a ShapeEnv creates. The ops whose
        meta functions make other outputs than their kernels: as the kernels
        make them (:mod:`nbmem.estimation.kernel_outputs`). A foreach op that
        returns new tensors, and bitsandbytes' ops: see :meth:`_kept`. Everything else (misses,
        bypasses, symbolic shapes, debug logging,
        cross-checking) goes to PyTorch's own method.
        """
        if (
            func is _SCALAR and len(args) == 1 and not kwargs and type(args[0]) is FakeTensor
            and args[0].fake_mode is self and args[0].constant is not None
            and not args[0]._has_symbolic_sizes_strides
        ):
            # .item() of a tensor made by torch.tensor(number) (Adam's step count, read once per parameter
            # per step): _dispatch_impl's constant propagation, which runs the op on the real constant
            with no_dispatch():
                return func(args[0].constant)
        if func is _LIFT_FRESH and len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor:
            lifted = self._lifted(args[0])
            if lifted is not None:
                return lifted
        if self.shape_env is None and (made_as_kernels := KERNEL_OUTPUTS.get(func)) is not None:
            return made_as_kernels(self, func, types, args, kwargs or {})
        if func is _UNSAFE_VIEW and self.shape_env is None:
            # fake_impls answers _unsafe_view with the very function it answers view with, but PyTorch's cache
            # refuses _unsafe_view ("unsafe view": 150 us each through _reshape_view_helper, 2,306 in a 7B QLoRA
            # estimate): asked as the view it is, it is a cache hit, with the same output (same storage)
            func = _VIEW
        if (
            _HIT_PATH
            and self.shape_env is None
            and self.cache_enabled
            and not self.cache_crosscheck_enabled
            and func not in _META_HANDLERS
            and func not in _HANDLE_DIRECTLY
            and not _LOG.isEnabledFor(logging.DEBUG)
        ):
            state = _CacheKeyState(None)
            try:
                key = self._cache_key(state, func, args, kwargs or {})
            except _BypassDispatchCache:
                key = None  # PyTorch's path counts the bypass
            if key is not None and not state.cache_on_shape_env():
                entry: Any = FakeTensorMode.cache.get(key)
                if type(entry) is _ValidEntry:
                    infos = entry.output_infos
                    output = (
                        tuple(self._from_cache(info, key, func, args) for info in infos)
                        if entry.is_output_tuple
                        else self._from_cache(infos[0], key, func, args)
                    )
                    FakeTensorMode.cache_hits += 1
                    return output
                if func.namespace in _KEPT_NAMESPACES or func.name().startswith("aten::_foreach_"):
                    return self._kept(key, func, types, args, kwargs)
        return super().dispatch(func, types, args, kwargs if kwargs is not None else {})

    def _lifted(self, real: torch.Tensor) -> FakeTensor | None:
        """``torch.tensor(number)`` under this mode: a fake tensor holding a copy of the real one as its constant.

        What ``_dispatch_impl``'s constant propagation makes of ``lift_fresh``
        (the op ``torch.tensor`` ends in), without the meta converter's general
        path: AdamW makes one such step count per parameter (200 for BERT,
        0.4 ms each, never cached). Only a small, dense, contiguous cpu tensor
        without autograd; the fake tensor is registered as PyTorch registers
        it (the converter's memos of the tensor and of its storage, and the
        constant's storage, so that writing to it in place updates or drops
        the constant). None: PyTorch's own path.
        """
        if not (
            _HIT_PATH and self.shape_env is None and not FakeTensorConfig.debug
            and real.device.type == "cpu" and real.layout is torch.strided and not real.requires_grad
            and real.is_contiguous() and real.storage_offset() == 0 and not real.is_quantized
            and not real.is_conj() and not real.is_neg() and not real.is_inference() and self.may_turn_const(real)
        ):
            return None
        with no_dispatch():
            constant = real.clone()
        # made as a cache entry's output is (no op: not a view of anything)
        fake: FakeTensor = self._from_cache(
            _OutputInfo(None, _INTERNALS["extract_tensor_metadata"](constant), None), None, None, ()
        )
        fake.constant = constant
        converter = self.fake_tensor_converter
        converter.set_tensor_memo(constant, fake)
        # the storage too: a view of the constant (unsqueeze) then shares the fake tensor's storage, as PyTorch's do
        describer = converter.meta_converter.describer
        converter.meta_converter.set_storage_memo(describer.describe_storage(constant.untyped_storage()),
                                                  fake.untyped_storage())
        converter.add_constant_storage_mapping(fake)
        return fake

    def _kept(self, key: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """An op PyTorch won't cache, answered from nbmem's own cache by the same key: foreach ops, bitsandbytes'.

        PyTorch caches no list output ("non-FakeTensor output": Adam's
        ``_foreach_sqrt``, a Python reference per tensor, about 5 % of a
        GPT-2 estimate) and no op outside its own libraries ("non-builtin":
        bitsandbytes' ``gemm_4bit``, ``dequantize_4bit`` and optimizer
        updates, 3,140 of them in a 7B QLoRA estimate, each through its
        Python fake function). bitsandbytes' fake functions make their
        outputs from their inputs' shapes and dtypes and the other arguments,
        all of which the key holds (an input with a constant has no key).
        The outputs' metadata is cached here under PyTorch's own key, and new
        tensors are made from it as from PyTorch's entries. Only when every
        output is a new dense tensor of this mode with a storage of its own,
        or None (an op that writes into its arguments returns nothing).
        """
        outputs = _KEPT_OUTPUTS.get(key)
        if outputs is not None:
            kind, infos = outputs
            made = [None if info is None else self._from_cache(info, key, func, args) for info in infos]
            return made[0] if kind is None else kind(made)
        result: Any = super().dispatch(func, types, args, kwargs if kwargs is not None else {})
        many = type(result) in (list, tuple)
        values: list[Any] = list(result) if many else [result]
        tensors = [value for value in values if value is not None]
        if func.namespace == "aten" and (not many or not values or len(tensors) < len(values)):
            return result  # PyTorch's own path for an in-place foreach op: it may drop constants it wrote over
        inputs = (*args, *(kwargs or {}).values())
        if (many and not values) or not all(_new_dense(self, tensor, inputs) for tensor in tensors):
            return result
        if len({tensor.untyped_storage()._cdata for tensor in tensors}) == len(tensors):
            if len(_KEPT_OUTPUTS) >= KEPT_LIMIT:  # bitsandbytes' optimizer updates key on the step count: no end
                _KEPT_OUTPUTS.clear()
            _KEPT_OUTPUTS[key] = (type(result) if many else None, tuple(
                None if value is None else _OutputInfo(None, _INTERNALS["extract_tensor_metadata"](value), None)
                for value in values
            ))
        return result

    def _cache_key(self, state: Any, func: Any, args: Any, kwargs: Any) -> Any:
        """PyTorch's ``FakeTensorMode._cache_key`` (the same key) in fewer steps, without a ShapeEnv.

        Without one there are no symbols, so the key's head is fixed: the op,
        the default dtype and device, inference mode, no ShapeEnv settings,
        whether a proxy mode traces. With one, or symbols already known:
        PyTorch's own.
        """
        if self.shape_env is not None or state.known_symbols or not _HIT_PATH:
            return super()._cache_key(state, func, args, kwargs)
        values = [func, torch.get_default_dtype(), torch._C._get_default_device(), torch.is_inference_mode_enabled(),
                  None, get_proxy_mode() is not None]
        hashed_by_id: list[object] = []
        if args:
            self._prep_args_for_hash(values, args, state, hashed_by_id)
        if kwargs:
            self._prep_args_for_hash(values, kwargs, state, hashed_by_id)
        key = _INTERNALS["_DispatchCacheKey"](tuple(values))
        for value in hashed_by_id:  # an entry keyed by an object's id goes with the object
            weakref.finalize(value, functools.partial(_INTERNALS["evict_fake_tensor_cache_key"], key=key))
        return key

    def _from_cache(self, info: Any, key: Any, func: Any, args: Any) -> Any:
        """``_get_output_tensor_from_cache_entry`` without a ShapeEnv: every cached size is a plain int."""
        if info.inplace_idx is not None:
            return args[info.inplace_idx]  # an in-place op: the argument itself
        metadata = info.metadata
        if metadata is None:
            return info.constant_value if info.view_idx is None else None
        if metadata.layout is not torch.strided:
            return self._get_output_tensor_from_cache_entry(_CacheKeyState(None), info, key, func, args)
        # PyTorch makes it inside in_kernel_invocation_manager, whose Meta dispatch key a factory given
        # device=meta, and set_ on the meta tensor it made, don't need (a generator context costs more than
        # the op); Python dispatch stays off for them, as it does there
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(
                metadata.shape, metadata.stride, dtype=metadata.dtype, layout=metadata.layout, device=_META,
                requires_grad=metadata.requires_grad,
            )
            if metadata.is_conj:
                torch._C._set_conj(empty, True)
            if metadata.is_neg:
                torch._C._set_neg(empty, True)
            if isinstance(func, torch._ops.OpOverload) and func.is_view:  # a view shares its input's storage
                view_arg = args[info.view_idx]
                empty.set_(view_arg.untyped_storage(), metadata.storage_offset, metadata.shape, metadata.stride)
        return self._fake_tensor(empty, metadata.device)

    def _fake_tensor(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """``FakeTensor(self, elem, device)`` for a cpu fake tensor, its attributes copied from one made so.

        ``FakeTensor.__new__`` checks its arguments and sets a dozen attributes
        one by one, five of them through descriptors (the memos of ``.item()``,
        ``nonzero()``...): the first fake tensor this mode makes that way gives
        the attributes, all the same for every new cpu tensor of the mode
        (tests/test_fakemode.py compares them), and later ones copy them.
        """
        template = self.__dict__.get("_nbmem_new_fake")
        if template is None or device.type != "cpu" or FakeTensorConfig.debug or torch.compiler.is_exporting():
            made = FakeTensor(self, elem, device)
            if template is None and device.type == "cpu" and not FakeTensorConfig.debug:
                self.__dict__["_nbmem_new_fake"] = dict(made.__dict__)
            return made
        made = torch.Tensor._make_subclass(
            FakeTensor, elem, elem.requires_grad, dispatch_device=True, device_for_backend_keys=device
        )
        if not self._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(made)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(made)
        made.__dict__.update(template)
        return made

    def _prep_args_for_hash(
        self, result: list[object], args: Any, state: Any, id_hashed_objects: list[object]
    ) -> None:
        if isinstance(args, dict):
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)  # recurses into self for keys/values
            return
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        for arg in args:
            kind = type(arg)
            if (
                kind is FakeTensor
                and arg.fake_mode is self
                and arg.constant is None
                and arg.layout is torch.strided
                and not arg._has_symbolic_sizes_strides
            ):
                _flatten_dense(result, arg)
            elif kind in _PLAIN_VALUES:
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                # one argument, without a container's (type, length) prefix
                super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)


skip_dynamo(FastKeyFakeTensorMode.__torch_dispatch__)

#: The outputs of ops PyTorch won't cache, by PyTorch's cache key: the container type (None: one value) and each
#: output's metadata (None: a None output), as PyTorch's own cache holds them (FakeTensorMode.cache).
_KEPT_OUTPUTS: dict[Any, tuple[Any, tuple[Any, ...]]] = {}
#: At most this many entries in _KEPT_OUTPUTS: the whole cache is dropped when full (refilled as ops recur).
KEPT_LIMIT = 4096
#: The libraries whose ops nbmem caches though PyTorch doesn't (their fake functions read only what the key holds).
_KEPT_NAMESPACES = frozenset({"bitsandbytes"})


def _new_dense(mode: FakeTensorMode, tensor: Any, args: Any) -> bool:
    """A dense fake tensor of ``mode`` on the cpu, not a view of an input, no constant: one a cache entry can make."""
    if not (type(tensor) is FakeTensor and tensor.fake_mode is mode and tensor.constant is None
            and tensor.layout is torch.strided and tensor.device.type == "cpu"
            and not tensor._has_symbolic_sizes_strides and tensor.storage_offset() == 0):
        return False
    key = tensor.untyped_storage()._cdata
    inputs = [item for arg in args for item in (arg if isinstance(arg, (list, tuple)) else (arg,))]
    return all(not isinstance(item, torch.Tensor) or item.untyped_storage()._cdata != key for item in inputs)


#: What _flatten_dense appends for a tensor's sizes and strides, and its memory format, by (sizes, strides):
#: a function of those alone (suggest_memory_format, is_contiguous), and a step repeats its shapes layer after layer
_SHAPES: dict[tuple[torch.Size, tuple[int, ...]], tuple[list[object], torch.memory_format | None]] = {}


def _memory_format(tensor: Any, suggested: torch.memory_format) -> torch.memory_format | None:
    """The suggested format if the tensor is contiguous in it, else None (extract_tensor_metadata's rule)."""
    return suggested if tensor.is_contiguous(memory_format=suggested) else None


def _flatten_dense(result: list[object], tensor: Any) -> None:
    """What ``extract_tensor_metadata(tensor)._flatten_into(result, ...)`` appends for a dense, static-shape tensor."""
    shape = tensor.shape
    stride = tensor.stride()
    known = _SHAPES.get((shape, stride))
    if known is None:
        part: list[object] = [torch.Size, f"length_{len(shape)}"]
        for size in shape:
            part += (int, size)
        part += (tuple, f"length_{len(stride)}")
        for step in stride:
            part += (int, step)
        # suggest_memory_format answers contiguous_format for any tensor not 4-d or 5-d (channels_last, _3d)
        suggested = suggest_memory_format(tensor) if len(shape) in (4, 5) else torch.contiguous_format
        if len(_SHAPES) >= 4096:
            _SHAPES.clear()
        known = _SHAPES[(shape, stride)] = (part, _memory_format(tensor, suggested))
    part, memory_format = known
    result.append(tensor.dtype)
    result += part
    result += (
        tensor.device, torch.strided, memory_format, tensor.storage_offset(), tensor.untyped_storage().nbytes(),
        tensor.requires_grad, tensor.is_quantized, tensor.is_conj(), tensor.is_neg(), tensor.is_inference(),
        False, None, None, None,  # is_sparse, is_coalesced, dense_dim, sparse_dim: a strided tensor's
    )


def new_fake_mode() -> FakeTensorMode:
    """The fake mode an estimate runs in (a plain ``FakeTensorMode`` on a torch whose metadata differs).

    >>> type(new_fake_mode()).__name__
    'FastKeyFakeTensorMode'
    """
    _autograd_started_outside_fake_mode()
    return FastKeyFakeTensorMode() if _SAME_FIELDS else FakeTensorMode()


@functools.cache
def _autograd_started_outside_fake_mode() -> None:
    """One real, one-element backward on the CPU, once per process, before any backward on fake tensors.

    Autograd's engine decides once per process whether it needs device threads
    (``Engine::start_device_threads``, under a ``call_once``), and once it starts
    them, a forked child's backward fails ("Unable to handle autograd's threading
    in combination with fork-based multiprocessing"). Decided during a backward
    under ``FakeTensorMode``, torch 2.14.1's CUDA build starts them on a machine
    without a GPU (checked here; torch 2.13.0's CPU build does not), and then
    :func:`nbmem.launch`, which forks its ranks, failed after any estimate (notebook
    06 in an environment with that build). Decided by a real CPU backward, the
    engine starts none. Hidden from any dispatch mode open around the estimate
    (``%%gpumem``'s tracker): it is nbmem's, not the user's.
    """
    with _disable_current_modes():
        leaf = torch.zeros(1, requires_grad=True)
        leaf.sum().backward()
