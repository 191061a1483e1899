"""A tracked scope on the CPU stands in for a GPU: torch.optim's step counters are host memory there, as on a GPU.

Adam's and AdamW's ``state["step"]`` is a CPU tensor on a GPU unless the group
is fused or capturable (torch/optim/adam.py); the H100 of 2026-11-25 allocated
exactly the estimate without them (tests/test_h100_figures.py). These tests
track the user's own loop, as ``%%gpumem`` and ``nbmem.track()`` do, with both
engines, and assert the optimizer state's bytes exactly.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

import nbmem
from nbmem.tracking.host_counters import _ENTERED, HostStepCounters
from nbmem.tracking.native import available as native_available
from test_interrupts import leftovers

ENGINES = ["dispatch", pytest.param("native", marks=pytest.mark.skipif(
    not native_available(), reason="the native engine needs a C++ compiler"))]

#: Two Linear(256, 256) layers: each weight 256 KiB, each bias 1 KiB (two 512 B blocks)
LAYER = 256 * 256 * 4 + 256 * 4
PARAMETERS = 2 * LAYER
TENSORS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))


def _first_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(8, 256)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _left_nothing(optimizer: torch.optim.Optimizer) -> bool:
    return not optimizer_module._global_optimizer_pre_hooks and "_init_group" not in vars(optimizer) and not _ENTERED


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tracked_adamw_step_keeps_exp_avg_and_exp_avg_sq_not_its_counters(engine):
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    with nbmem.track("cpu", engine=engine) as scope:
        _first_step(model, adamw)
    result = scope.result
    # the gradients were made and dropped in the block; what it kept is the two states of each parameter
    assert result.retained == 2 * PARAMETERS
    assert any("AdamW's step counters" in note for note in result.notes)
    assert float(adamw.state[model[0].weight]["step"]) == 1.0  # the optimizer itself is as it was
    assert _left_nothing(adamw)


@pytest.mark.parametrize("engine", ENGINES)
def test_fused_adam_makes_its_counters_on_the_device_so_they_are_counted(engine):
    model = _model()
    fused = torch.optim.Adam(model.parameters(), fused=True)
    with nbmem.track("cpu", engine=engine) as scope:
        _first_step(model, fused)
    assert scope.result.retained == 2 * PARAMETERS + TENSORS * 512
    assert not any("step counters" in note for note in scope.result.notes)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_later_scope_does_not_adopt_counters_an_earlier_one_kept_out(engine):
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    with nbmem.track("cpu", engine=engine):
        _first_step(model, adamw)
    with nbmem.track("cpu", engine=engine) as later:
        kept = torch.ones(256)  # 1 KiB
    # the walk at its start found the parameters and both states alive, and not the 4 counters beside them
    owned = PARAMETERS + 2 * PARAMETERS
    if engine == "dispatch":
        # the shared tracker also holds what earlier tests left alive: compare with a walk of this test's tensors
        found = sum(later.tracker.record_of(state).size for state in _tensors(model, adamw))
        assert found == owned and all(later.tracker.record_of(adamw.state[p]["step"]) is None
                                      for p in model.parameters())
    else:
        assert all(later.tracker.record_of(adamw.state[p]["step"]) is None for p in model.parameters())
        assert sum(later.tracker.record_of(state).size for state in _tensors(model, adamw)) == owned
    assert later.result.retained == 1024 and kept.numel() == 256


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    states = [value for state in optimizer.state.values() for key, value in state.items() if key != "step"]
    return [*model.parameters(), *states]


def test_adagrad_makes_its_counters_in_its_constructor_and_they_leave_at_its_first_step():
    model = _model()
    with nbmem.track("cpu", engine="dispatch") as scope:
        adagrad = torch.optim.Adagrad(model.parameters())  # state_sum (4 tensors) and the 4 counters, made here
        _first_step(model, adagrad)
    assert scope.result.retained == PARAMETERS  # the sums only
    assert any("Adagrad's step counters" in note for note in scope.result.notes)


def test_nested_scopes_and_an_estimate_inside_share_the_patch_and_leave_nothing():
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    with nbmem.track("cpu") as outer:
        with nbmem.track("cpu") as inner:
            _first_step(model, adamw)
        assert "_init_group" in vars(adamw) and len(_ENTERED) == 1  # the outer scope's is still in
        estimated = nbmem.estimate(_model, lambda n: torch.ones(n, 256), batch_size=8, optimizer="adamw")
    assert inner.result.retained == outer.result.retained == 2 * PARAMETERS
    # the estimate's own: its parameters and AdamW's two states, no counter (8 tensors' worth of blocks)
    assert dict(estimated.breakdown.after)["optimizer state"] == 2 * PARAMETERS
    assert _left_nothing(adamw)


def test_an_estimate_inside_a_block_that_steps_no_optimizer_leaves_its_note_out_of_the_block():
    """The estimate's AdamW steps fake tensors: its own tracker keeps its counters out and says so; the block
    around it, which made no optimizer, says nothing about step counters (a review found the note in it)."""
    for knobs in ({}, {"parallel": "fsdp", "world_size": 2}):  # FSDP's parameters are DTensors over fake shards
        with nbmem.track("cpu") as block:
            estimated = nbmem.estimate(_model, lambda n: torch.ones(n, 256), batch_size=8, optimizer="adamw", **knobs)
        assert any("step counters" in note for note in estimated.notes)
        assert not any("step counters" in note for note in block.result.notes), knobs


def test_a_failing_cell_leaves_no_hook_and_an_interrupted_exit_can_be_repeated():
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="the cell failed"):
        with nbmem.track("cpu"):
            _first_step(model, adamw)
            raise RuntimeError("the cell failed")
    assert _left_nothing(adamw)
    counters = HostStepCounters(nbmem.Tracker("cpu"))
    counters.__enter__()
    counters.__exit__()
    counters.__exit__()  # a repeat (an exit Ctrl-C cut short, done again) finds nothing and raises nothing
    assert not optimizer_module._global_optimizer_pre_hooks and not _ENTERED


def test_another_threads_optimizer_is_not_the_scopes():
    model, other = _model(), _model()
    adamw, theirs = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(other.parameters())
    with nbmem.track("cpu", engine="dispatch") as scope:
        worker = threading.Thread(target=_first_step, args=(other, theirs))
        worker.start()
        worker.join()
        assert "_init_group" not in vars(theirs)  # the hook acts for the scope's thread only
        _first_step(model, adamw)
    assert float(theirs.state[other[0].weight]["step"]) == 1.0
    assert _left_nothing(adamw)
    # this thread's counters are not the device's; its states are
    assert all(scope.tracker.record_of(adamw.state[p]["step"]) is None for p in model.parameters())
    assert sum(scope.tracker.record_of(adamw.state[p][key]).size for p in model.parameters()
               for key in ("exp_avg", "exp_avg_sq")) == 2 * PARAMETERS


def test_a_zero_dim_parameters_state_is_device_memory_and_stays_counted():
    """Only the ``step`` entries (and NAdam's ``mu_product``) are counters: a scalar parameter (CLIP's logit_scale)
    has 0-dim moments too, and those are the device's."""
    scale = nn.Parameter(torch.tensor(2.0))
    adam = torch.optim.Adam([scale])
    with nbmem.track("cpu") as first:
        (scale * 3).backward()
        adam.step()
    assert first.result.retained == 512 + 2 * 512  # its gradient, exp_avg and exp_avg_sq; the counter left out
    with nbmem.track("cpu") as second:  # the optimizer seen again by a new block: its state stays where it is
        adam.step()
    assert second.result.retained == 0
    with nbmem.track("cpu") as built_inside:
        adagrad = torch.optim.Adagrad([scale])  # state_sum and the step, made in its constructor
        adagrad.step()
    assert built_inside.result.retained == 512  # the sum, not the counter


def _cell(engine: str, model: nn.Module) -> Callable[[], None]:
    def cell() -> None:
        optimizer = torch.optim.AdamW(model.parameters())  # a new one each time: its first step makes the counters
        with nbmem.track("cpu", engine=engine):
            _first_step(model, optimizer)
        cell.optimizer = optimizer  # type: ignore[attr-defined]

    return cell


def _what_is_left(model: nn.Module, optimizer: Any, engine: str) -> list[str]:
    from torch.overrides import _get_current_function_mode_stack

    from nbmem.tracking.host_counters import _PATCHED, _HostScalars
    from nbmem.tracking.tracker import default_tracker

    found = leftovers(model)
    if any(isinstance(mode, _HostScalars) for mode in _get_current_function_mode_stack()):
        found.append("a _HostScalars mode")
    if _ENTERED or list(_PATCHED) or (optimizer is not None and "_init_group" in vars(optimizer)):
        found.append("a HostStepCounters or its patch")
    if default_tracker("cpu")._on_host:
        found.append("the dispatch tracker on the host")
    if engine == "native":
        from nbmem.tracking.native_tracking import native_tracker

        native_tracker()._lib.nbmem_install()
        try:
            made = torch.ones(256)  # counted unless the thread is left making host memory
            counted = native_tracker().record_of(made) is not None
        finally:
            native_tracker()._lib.nbmem_uninstall()
        if not counted:
            found.append("the native engine's thread on the host")
    return found


@pytest.mark.interrupts
@pytest.mark.parametrize("engine", ENGINES)
def test_an_interrupt_at_every_line_of_the_host_counters_leaves_nothing(engine):
    from test_interrupts import _interrupt_at_line, _lines_run

    model = _model()
    cell = _cell(engine, model)
    cell()
    files = ("host_counters.py", "host_memory.py", "native_tracking.py")
    names = {"on_host", "keep_outside", "moved_to_host"}
    lines = _lines_run(cell, lambda code: code.co_filename.endswith(files[0]) or (
        code.co_filename.endswith(files[1:]) and code.co_name in names))
    assert len(lines) > 40
    for where in lines:
        cell.optimizer = None  # type: ignore[attr-defined]
        _interrupt_at_line(where, cell)
        left = _what_is_left(model, cell.optimizer, engine)  # type: ignore[attr-defined]
        assert left == [], f"after an interrupt at {where}: {left}"
    adamw = torch.optim.AdamW(model.parameters())
    with nbmem.track("cpu", engine=engine) as scope:  # and the next block is exact, counters left out
        _first_step(model, adamw)
    assert scope.result.retained == 2 * PARAMETERS


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stale_entry_in_the_outside_table_hides_no_other_storage(engine):
    """The table forgets a storage from a weak reference's callback, Python code that a Ctrl-C can cut short; an
    entry left behind then names a dead storage's key, which a new storage may get: only the storage itself counts."""
    import weakref

    from nbmem.tracking.native_tracking import native_tracker

    tracker = nbmem.Tracker("cpu") if engine == "dispatch" else native_tracker()
    kept, hosted, other = torch.ones(1024), torch.ones(1024), torch.ones(1)  # 4 KiB each
    tracker.outside[kept.untyped_storage()._cdata] = weakref.ref(other.untyped_storage())  # as if left behind
    tracker.keep_outside(hosted)
    tracker.adopt_live()
    assert tracker.record_of(kept) is not None and tracker.record_of(kept).size == 4096
    assert tracker.record_of(hosted) is None
