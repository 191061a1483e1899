"""Ctrl-C at any line of an estimate leaves nothing of it behind, and the next estimate is exact.

An estimate installs more than a tracked cell: a fake tensor mode and its own dispatch modes, autocast's CUDA
policy, stand-ins for fused kernels, patches of torch's and transformers' functions, a frozen collector
(``gc.freeze``), PyTorch's fast path turned off for inference, a virtual process group for data parallelism. A
KeyboardInterrupt is raised at a seeded line event inside nbmem (test_interrupts' machinery), and then Python's and
torch's own state is read, not nbmem's bookkeeping: modes, hooks, settings, and every attribute of every torch,
transformers and peft module and of the classes an estimate patches, each compared by identity with what it was
before.
"""

from __future__ import annotations

import collections
import gc
import os
import random
import sys
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import nbmem
from nbmem.estimation import quantized_kernels  # noqa: F401  (its class is one of OneAtATime's)
from nbmem.estimation.kernels import OneAtATime
from conftest import seeded
from nbmem.tracking.installed import remove_every_tracker
from test_interrupts import NBMEM, _interrupted_at, _Interrupter, run_traced
from test_interrupts import one_failure_fails_one_test  # noqa: F401  (a fixture: autouse here too)

pytestmark = pytest.mark.interrupts  # skipped under coverage; .ci/run runs them without it (tests/conftest.py)

#: the libraries whose module attributes an estimate may patch
PATCHED_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "torchao")
#: classes whose own attributes an estimate may patch
PATCHED_CLASSES = (torch.Tensor, torch.UntypedStorage, nn.Module, nn.MultiheadAttention, nn.TransformerEncoderLayer,
                   nn.TransformerEncoder, torch.optim.Optimizer, torch.optim.AdamW, torch.autograd.Function)


def _attributes() -> dict[tuple[str, str], tuple[Any, Any]]:
    """Every attribute of every module of the patched libraries, and of the patched classes: (owner, value)."""
    found: dict[tuple[str, str], tuple[Any, Any]] = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".")[0] in PATCHED_PACKAGES:
            for attribute, value in list(vars(module).items()):
                found[name, attribute] = module, value
    for owner in PATCHED_CLASSES:
        for attribute, value in vars(owner).items():
            found[f"{owner.__module__}.{owner.__qualname__}", attribute] = owner, value
    return found


def _kernel_classes() -> list[type]:
    """nbmem's stand-ins for kernels, each one at a time in a process (a lock each)."""
    found, todo = [], [OneAtATime]
    while todo:
        found += (classes := todo.pop().__subclasses__())
        todo += classes
    return found


MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                "_global_backward_pre_hooks", "_global_backward_hooks", "_global_module_registration_hooks",
                "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")


def _settings() -> dict[str, Any]:
    """What an estimate changes while it runs, read from Python's and torch's own state."""
    return {
        "dispatch modes": [type(mode).__name__ for mode in _get_current_dispatch_mode_stack()],
        "function modes": [type(mode).__name__ for mode in torch.overrides._get_current_function_mode_stack()],
        "collector frozen": gc.get_freeze_count(),
        "collector on": gc.isenabled(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "default dtype": torch.get_default_dtype(),
        "autocast": [torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda")],
        "fast path": torch.backends.mha.get_fastpath_enabled(),
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(True),
        "module hooks": {name: list(getattr(nn_module, name)) for name in MODULE_HOOKS},
        "kernels held": [kind.__name__ for kind in _kernel_classes() if kind._holder is not None],
    }


class Watch:
    """What changed since it was made: settings exactly, attributes by identity, less those a finished estimate
    changes too (caches and counters of torch's own, which ``noisy`` learns from an uninterrupted estimate)."""

    def __init__(self) -> None:
        self.settings, self.attributes = _settings(), _attributes()

    def changed(self, noisy: set[tuple[str, str]] = frozenset()) -> list[str]:  # type: ignore[assignment]
        found = [f"{key}: {was!r} -> {now!r}" for key, was in self.settings.items()
                 if (now := _settings()[key]) != was]
        now = _attributes()
        found += [f"{owner}.{name}" for (owner, name), (_, value) in self.attributes.items()
                  if (owner, name) in now and now[owner, name][1] is not value and (owner, name) not in noisy]
        return found

    def repair(self) -> None:
        """Put back what it saw, so that one interrupt that left something fails its own trial only."""
        now = _attributes()
        for key, (owner, value) in self.attributes.items():
            if key in now and now[key][1] is not value:
                setattr(owner, key[1], value)
        for name in MODULE_HOOKS:
            table = getattr(nn_module, name)
            for hook in set(table) - set(self.settings["module hooks"][name]):
                del table[hook]
        for kind in _kernel_classes():
            if kind._holder is not None and kind.__name__ not in self.settings["kernels held"]:
                kind._holder.release()
        if gc.get_freeze_count() > self.settings["collector frozen"]:
            gc.unfreeze()
        torch.backends.mha.set_fastpath_enabled(self.settings["fast path"])
        torch.set_default_dtype(self.settings["default dtype"])


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def mlp_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 64), torch.randint(0, 10, (n,))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 100)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 100, (n, 16)), torch.randint(0, 100, (n, 16))


#: estimates that install different things: autocast's policy and a compute dtype; checkpointing; the
#: inference path (PyTorch's fast path turned off); data parallelism's virtual process group (a quantized Hugging
#: Face model: tests/test_interrupted_qlora.py)
ESTIMATES: dict[str, Callable[[], Any]] = {
    "bf16 adamw": lambda: nbmem.estimate(mlp, mlp_batch, batch_size=8, precision="bf16"),
    "checkpointed encoder": lambda: nbmem.estimate(Encoder, tokens, batch_size=4, checkpointing=True),
    "inference": lambda: nbmem.estimate(Encoder, tokens, batch_size=4, task="inference"),
    "fsdp": lambda: nbmem.estimate(mlp, mlp_batch, batch_size=8, parallel="fsdp", world_size=2),
}


#: the functions that put in and take out what an estimate installs: each of their lines in nbmem/estimation and
#: tracking/live.py (the collector's freeze) is interrupted (test_interrupts sweeps the tracker's own)
ENTRIES_AND_EXITS = frozenset({"__enter__", "__exit__", "release", "_release", "_undo", "_take_place"})
ESTIMATION = (NBMEM + "estimation" + os.sep, NBMEM + "tracking" + os.sep + "live.py")


class _Lines(_Interrupter):
    """Counts nbmem's line events as the interrupter does, and notes each line's first event, how often it ran and
    in which function."""

    def __init__(self) -> None:
        super().__init__(-1)
        self.first: dict[tuple[str, int], int] = {}
        self.runs: collections.Counter[tuple[str, int]] = collections.Counter()
        self.function: dict[tuple[str, int], str] = {}

    def _line(self, frame: Any, event: str, arg: Any) -> Callable[..., Any] | None:
        traced = super()._line(frame, event, arg)
        if event == "line":
            where = frame.f_code.co_filename, frame.f_lineno
            self.first.setdefault(where, self.events)
            self.runs[where] += 1
            self.function[where] = frame.f_code.co_name
        return traced


def targets(run: Callable[[], Any], count: int, seed: str) -> dict[int, str]:
    """The line events to interrupt an estimate at, each a line of nbmem's first run, and that line: every line of
    the estimation's entries and exits (ENTRIES_AND_EXITS), and ``count`` lines more, three in four of them lines that ran once.

    Most of an estimate's line events (50,000 to 360,000 here) are its fake ops' few lines, run thousands of times;
    what it installs and removes runs once or twice (about 600 lines of the 1,400 to 1,900 each estimate runs)."""
    lines = _Lines()
    run_traced(lines, run)
    assert len(lines.first) > 500, len(lines.first)  # nbmem's lines ran under the trace function
    chosen = [event for where, event in lines.first.items()
              if lines.function[where] in ENTRIES_AND_EXITS and where[0].startswith(ESTIMATION)]
    assert len(chosen) > 10, len(chosen)
    once = sorted(event for where, event in lines.first.items() if lines.runs[where] == 1 and event not in chosen)
    others = sorted(event for where, event in lines.first.items() if lines.runs[where] > 1 and event not in chosen)
    rng = random.Random(seed)
    chosen += rng.sample(once, min(len(once), count * 3 // 4))
    chosen += rng.sample(others, min(len(others), count // 4))
    named = {event: f"{path.removeprefix(NBMEM)}:{line}" for (path, line), event in lines.first.items()}
    return {event: named[event] for event in sorted(chosen)}


def _interrupted_or_swallowed(target: int, run: Callable[[], Any]) -> bool:
    """Whether the interrupt at line event ``target`` ended the estimate, or went where Python itself drops an
    exception (a weak reference's callback, a finalizer: "Exception ignored in"), as a real Ctrl-C there would."""
    swallowed: list[type[BaseException]] = []
    previous, sys.unraisablehook = sys.unraisablehook, lambda unraisable: swallowed.append(unraisable.exc_type)
    try:
        return _interrupted_at(target, run) or KeyboardInterrupt in swallowed
    finally:
        sys.unraisablehook = previous


@pytest.mark.parametrize("name", list(ESTIMATES))
def test_an_interrupt_at_any_line_of_an_estimate_leaves_nothing_behind(name: str) -> None:
    check_interrupts(ESTIMATES[name], seeded(12), name)


def check_interrupts(run: Callable[[], Any], count: int, seed: str) -> None:
    """Interrupt ``run`` (an estimate) at the lines :func:`targets` chooses; nothing may be left after each."""
    expected = run()  # the first estimate imports and caches what later ones reuse
    before = _attributes()
    assert run() == expected
    after = _attributes()
    noisy = {key for key, (_, value) in before.items() if key in after and after[key][1] is not value}
    assert len(noisy) < 10, sorted(noisy)  # torch's own counters (meta_utils' DESCRIBER_NEXT_ID): not a patch
    left: dict[str, list[str]] = {}
    for target, line in targets(run, count, seed).items():
        watch = Watch()
        try:
            interrupted = _interrupted_or_swallowed(target, run)
        except Exception as error:  # an estimate refused: what an earlier interrupt left
            left[f"{line} (line event {target})"] = [f"{type(error).__name__}: {error}"]
            watch.repair()
            continue
        assert interrupted, f"no interrupt at {line} (line event {target})"
        if changed := watch.changed(noisy):
            left[f"{line} (line event {target})"] = changed
            watch.repair()
            remove_every_tracker()
    assert left == {}, "left behind by an interrupt at:\n" + "\n".join(f"{at}: {what}" for at, what in left.items())
    assert run() == expected  # and the next estimate is the same, to the byte
