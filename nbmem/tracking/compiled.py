"""``torch.compile``'d code in a measured block: whether it ran, whether it will, and running it eagerly on purpose.

Dynamo runs a compiled frame only when no non-infra dispatch mode is on the
stack (``torch/_dynamo/convert_frame.py``: "non-infra torch dispatch mode
present"); under tracked mode's dispatch engine a compiled model therefore
runs its *eager* code, and the figures are the eager step's, with no word
from PyTorch. Inductor's own buffers come from ``empty_strided_cpu``, which no
dispatch mode sees either. The native engine counts the CPU allocator's blocks
and leaves the mode stack alone, so compiled code runs compiled under it and
every buffer is counted.

Three things here, each cheap:

- :func:`watch` / :func:`calls_since`: every compiled function or module
  enters through one Dynamo helper (``eval_frame._callback_from_stance``,
  which turns the compiled callback into the one the current stance wants);
  while a watch is on, a wrapper counts the calls that carry a compiler
  callback. Nothing per op. A torch without the helper is told apart
  (:data:`WATCHABLE`), and results then say they could not check.
- :func:`expects_compiled`: whether code about to run names compiled things
  (an ``OptimizedModule``, a compiled function, a module compiled in place
  with ``Module.compile()``, or ``compile`` itself), or compiled code already
  ran under a tracker in this process; a scope then picks the native engine.
- :func:`eager_stance`: ``torch.compiler.set_stance("force_eager")``, for
  estimates (fake tensors must never reach inductor's compiled kernels).

>>> owner = object()
>>> start = watch(owner)      # None here: nothing imported Dynamo yet
>>> calls_since(start) in (None, (0, 0))
True
>>> unwatch(owner)
"""

from __future__ import annotations

import contextlib
import sys
from types import CodeType
from typing import Any, Iterator, Mapping

import torch

__all__ = ["watch", "unwatch", "calls_since", "expects_compiled", "eager_stance", "remove_probe", "forget_watches", "probe_installed", "seen", "note_seen", "compiled_anywhere",
           "dynamo_saw_frames", "dynamo_codes", "past_recompile_limit", "RECOMPILE_LIMIT_NOTE"]

#: Compiled regions entered while any watch was on, and those of them run eagerly on purpose (only grow).
_entered = 0
_forced = 0
#: eager_stance()'s while entered: its force_eager regions are nbmem's, still counted as compiled calls
_OWN_STANCE: list[object] = []
#: ids of the open watches' owners (scopes); the probe is in while there is one.
_watches: set[int] = set()
#: the owners among them that run a dispatch mode: compiled code runs eagerly while one is open (_probe says why)
_eager: set[int] = set()
_original: Any = None
#: Compiled code ran under a tracker's dispatch mode in this process: later "auto" scopes pick the native engine.
_seen = False


def _eval_frame() -> Any:
    """Dynamo's eval_frame module if something imported it (importing it costs seconds: never here)."""
    return sys.modules.get("torch._dynamo.eval_frame")


def _probe(callback: Any) -> Any:
    global _entered, _forced
    if callback is not None and callback is not False:  # None: a disabled region; False: run-only mode
        if _eager:
            _entered += 1
            _forced += 1
            # Under a dispatch mode Dynamo would skip the frame, and mark its code skipped for good: the
            # compiled function then runs eagerly for the rest of the process, mode or not (seen with
            # torch 2.13). No callback, as torch.compiler.set_stance("force_eager") gives, runs it eagerly
            # this once and leaves it compiled.
            return None
        given = _original(callback)
        if given is not None or _OWN_STANCE:  # None: a force_eager stance; the user's own is no compiled call
            _entered += 1
        return given
    return _original(callback)


def watch(owner: object, *, eager: bool = False) -> tuple[int, int] | None:
    """Count compiled regions entered from now on, for ``owner``; the mark to give :func:`calls_since`.

    ``eager``: the owner runs a dispatch mode (tracked mode's dispatch
    engine, a tracker alongside a measurement): compiled code runs eagerly
    until its watch ends, without PyTorch's lasting skip (:func:`_probe`).
    None when nothing can be watched: Dynamo is not loaded yet (nothing was
    compiled before; code that compiles inside the block is not seen), or
    this torch has no ``_callback_from_stance``.
    """
    global _original
    _watches.add(id(owner))
    if eager:
        _eager.add(id(owner))
    frames = _eval_frame()
    current = getattr(frames, "_callback_from_stance", None)
    if current is not None and current is not _probe:
        _original = current
        frames._callback_from_stance = _probe
    return (_entered, _forced) if probe_installed() else None


def calls_since(mark: tuple[int, int] | None) -> tuple[int, int] | None:
    """Compiled regions entered since :func:`watch` gave ``mark``, and how many of them ran eagerly because a
    dispatch mode's scope (this one's or another's) was open; None if it could not watch."""
    return None if mark is None else (_entered - mark[0], _forced - mark[1])


def unwatch(owner: object) -> None:
    """End ``owner``'s watch; the last one out takes the probe out. Idempotent: a repeat finishes an interrupted one."""
    _eager.discard(id(owner))
    _watches.discard(id(owner))
    if not _watches:
        remove_probe()


def forget_watches() -> None:
    """End every watch and take the probe out: ``%unload_ext nbmem``, after scopes Ctrl-C cut off."""
    _eager.clear()
    _watches.clear()
    remove_probe()


def remove_probe() -> None:
    """Put Dynamo's own helper back, whatever watches think (``%unload_ext nbmem``, interrupted scopes)."""
    frames = _eval_frame()
    if frames is not None and getattr(frames, "_callback_from_stance", None) is _probe and _original is not None:
        frames._callback_from_stance = _original


def probe_installed() -> bool:
    frames = _eval_frame()
    return frames is not None and getattr(frames, "_callback_from_stance", None) is _probe


def seen() -> bool:
    """Whether compiled code ran under a tracker's dispatch mode (eagerly) earlier in this process."""
    return _seen


def note_seen() -> None:
    global _seen
    _seen = True


def compiled_anywhere() -> bool:
    """Whether anything could have been compiled in this process (Dynamo is loaded), or compiled code already ran."""
    return _seen or _eval_frame() is not None


def _names(code: CodeType) -> Iterator[str]:
    yield from code.co_names
    yield from code.co_varnames
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _names(const)


def _is_compiled(value: Any) -> bool:
    if callable(value) and getattr(value, "_torchdynamo_orig_callable", None) is not None:
        return True  # a compiled function, or OptimizedModule's forward
    if isinstance(value, torch.nn.Module):
        frames = _eval_frame()
        if frames is not None and isinstance(value, frames.OptimizedModule):
            return True
        return any(getattr(module, "_compiled_call_impl", None) is not None for module in value.modules())
    return False


def expects_compiled(code: CodeType | None, *namespaces: Mapping[str, Any]) -> bool:
    """Whether ``code`` (a cell's, or the function around a ``with`` block) will likely run compiled code.

    True when compiled code already ran under a tracker here, when the code
    names ``compile`` (``torch.compile(model)``, ``model.compile()``), or when
    a name it uses is bound in ``namespaces`` to something compiled. A guess
    from names, made before the code runs; :func:`calls_since` says after
    whether compiled code really ran.

    >>> expects_compiled(compile("model = torch.compile(net)", "<cell>", "exec"))
    True
    >>> expects_compiled(compile("y = net(x)", "<cell>", "exec"), {"net": torch.nn.Linear(1, 1)})
    False
    """
    if _seen:
        return True
    if code is None:
        return False
    names = set(_names(code))
    if "compile" in names:
        return True
    if _eval_frame() is None:  # nothing was ever compiled in this process
        return False
    for name in names:
        for namespace in namespaces:
            if name in namespace:
                if _is_compiled(namespace[name]):
                    return True
                break
    return False


@contextlib.contextmanager
def eager_stance() -> Iterator[None]:
    """Compiled code inside runs its original Python, eagerly (``torch.compiler.set_stance("force_eager")``).

    Only when Dynamo is loaded: otherwise nothing was compiled, and loading
    it would cost seconds.
    """
    if _eval_frame() is None:
        yield
        return
    token = object()
    try:
        _OWN_STANCE.append(token)  # the calls in it are counted (an estimate says it ran them eagerly)
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        if token in _OWN_STANCE:
            _OWN_STANCE.remove(token)


def dynamo_saw_frames() -> bool:
    """Whether Dynamo, loaded, has been handed a frame to compile (imported alone, by transformers or an estimate,
    it has not); True where its internals are not torch 2.13's (then compiled code may have run)."""
    if "torch._dynamo" not in sys.modules:
        return False
    seen = getattr(getattr(sys.modules.get("torch._dynamo.convert_frame"), "input_codes", None), "seen", None)
    return seen is None or bool(seen)


#: What a block says when compiled code it called may have run eagerly past Dynamo's recompile limit.
RECOMPILE_LIMIT_NOTE = (
    "torch.compile'd code in this process has reached Dynamo's recompile limit (torch._dynamo.config."
    "recompile_limit): its calls with inputs no compiled graph takes run their eager Python, so these figures may be "
    "the eager code's; torch._dynamo.reset() compiles afresh, dynamic=True compiles one graph for many shapes"
)


def dynamo_codes() -> list[Any]:
    """The code objects Dynamo has been handed or made, alive (torch 2.13's trackers; none where they differ)."""
    from torch._dynamo import convert_frame

    codes = []
    for tracker in (getattr(convert_frame, "input_codes", None), getattr(convert_frame, "output_codes", None)):
        for ref in getattr(tracker, "seen", ()):
            code = ref()
            if code is not None:
                codes.append(code)
    return codes


def past_recompile_limit() -> bool:
    """Whether some code Dynamo compiled holds exactly as many graphs as its recompile limit allows (new inputs run
    eagerly). Code compiled with the limit lifted (torchao's optimizer steps, under ``disable_cache_limit``) holds
    more, and is not counted; one that holds exactly the limit that way is (a false "unknown", never a false
    "compiled")."""
    if "torch._dynamo" not in sys.modules:
        return False
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo import config

        limit = config.recompile_limit
        return any(len(_debug_get_cache_entry_list(code)) == limit for code in dynamo_codes())
    except (ImportError, AttributeError):  # another torch's internals: nothing known
        return False

