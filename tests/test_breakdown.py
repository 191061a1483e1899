"""Breakdown by category and module, and the virtual capacity: exact bytes on a CPU."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

import nbmem
from nbmem.core.results import CATEGORIES
from nbmem.tracking.categories import hooks_disable_wrapped
from nbmem.tracking.scope import MemoryScope
from nbmem.tracking.tracker import Tracker

MiB = 1024**2
# Linear(1024, 1024): 1024*1024*4 + 1024*4 = 4198400; Linear(1024, 10): 40960 + 40 -> 512
MLP_PARAMETERS = 4198400 + 40960 + 512  # = 4239872


def fresh(**options) -> MemoryScope:
    """A scope on a tracker of its own, so absolute figures start from zero."""
    return MemoryScope(tracker=Tracker("cpu"), **options)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def test_mlp_with_adam_parameters_gradients_and_state_exact():
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    batch = torch.randn(64, 1024)
    with fresh() as scope:
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    result = scope.result
    at_peak = dict(result.breakdown.at_peak)
    assert at_peak["parameter"] == MLP_PARAMETERS
    assert at_peak["gradient"] == MLP_PARAMETERS
    # exp_avg and exp_avg_sq per parameter; the 4 step counters are CPU tensors on a GPU, outside the figures
    assert at_peak["optimizer state"] == 2 * MLP_PARAMETERS
    assert sum(at_peak.values()) == result.peak_allocated
    after = dict(result.breakdown.after)
    assert (after["gradient"], after["optimizer state"]) == (0, 2 * MLP_PARAMETERS)
    assert sum(after.values()) == result.allocated_after
    assert result.breakdown.category("parameter") == MLP_PARAMETERS


def test_activations_are_what_autograd_saves():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU())
    batch = torch.randn(64, 1024)  # 64 * 1024 * 4 = 262144
    with fresh() as scope:
        output = model(batch)
    after = dict(scope.result.breakdown.after)
    # addmm saves its input (the batch), relu saves its output; the Linear's
    # output is not saved and is freed
    assert after["activation"] == 2 * 262144
    assert after["parameter"] == 4198400 and after["other"] == 0
    assert scope.result.breakdown.op == "aten.relu" and scope.result.breakdown.module == "Sequential.1"
    del output


def test_buffers_and_modules():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    with fresh() as scope:
        model(torch.randn(2, 3, 8, 8))
    breakdown = scope.result.breakdown
    # running_mean, running_var (8 float32 each) and num_batches_tracked (one int64): 3 blocks
    assert dict(breakdown.after)["buffer"] == 3 * 512
    modules = dict(breakdown.modules_at_peak)
    assert set(modules) >= {"Sequential.0", "Sequential.1"}
    assert sum(modules.values()) == scope.result.peak_allocated


def test_parameters_made_inside_the_scope_are_parameters():
    with fresh() as scope:
        layer = nn.Linear(1024, 1024)
    assert dict(scope.result.breakdown.after)["parameter"] == 4198400
    del layer


class InvariantCheck(TorchDispatchMode):
    """After every op, the categories must add up to the tracker's total."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.checked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        assert sum(self.tracker.by_category().values()) == self.tracker.allocated()
        assert sum(self.tracker.by_module().values()) == self.tracker.allocated()
        self.checked += 1
        return out


def test_categories_sum_to_the_total_after_every_op():
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = Tracker("cpu")
    with MemoryScope(tracker=tracker):
        check = InvariantCheck(tracker)
        with check:  # above the tracker's mode: sees each op after the tracker counted it
            for _ in range(2):
                model(torch.randn(8, 1024)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert check.checked > 100


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_no_hook_or_mode_left_behind_even_after_an_error(error):
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error):
        with fresh(capacity="1GiB", timeline=True, breakdown=True):
            model(torch.randn(2, 1024)).sum().backward()
            optimizer.step()
            raise error()
    assert _get_current_dispatch_mode() is None
    assert not nn_module._global_forward_pre_hooks and not nn_module._global_forward_hooks
    assert not nn_module._global_parameter_registration_hooks and not nn_module._global_buffer_registration_hooks
    assert not optim_module._global_optimizer_pre_hooks and not optim_module._global_optimizer_post_hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not hooks_disable_wrapped()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


@pytest.mark.parametrize("engine", ["dispatch", "native"])
def test_torch_func_transforms_run_under_a_tracker_as_without(engine):
    """torch.func's grad refuses to run while saved-tensors hooks are pushed; nbmem's must not make it fail."""
    if engine == "native":
        pytest.importorskip("nbmem.tracking.native")
        from nbmem.tracking.native import available

        if not available():
            pytest.skip("no C++ compiler for the native engine")
    loss = lambda x: (x.sin() * x).sum()  # noqa: E731
    x = torch.randn(1024)
    expected = torch.func.grad(loss)(x)
    with nbmem.track(engine=engine) as scope:
        got = torch.func.grad(loss)(x)
        hessian = torch.func.jacrev(torch.func.grad(loss))(x[:8])
        with torch.autograd.graph.disable_saved_tensors_hooks("the user's own message"):
            plain = torch.ones(4, requires_grad=True)
            (plain * plain).sum().backward()
        assert hooks_disable_wrapped()
        y = torch.randn(256, 256, requires_grad=True)  # 256 * 256 * 4 = 262144
        product = y.sin() * y  # saves y and sin(y): both activations, the hooks on again
    assert torch.equal(got, expected) and hessian.shape == (8, 8)
    assert not hooks_disable_wrapped()
    if engine == "dispatch":
        assert dict(scope.result.breakdown.after)["activation"] == 2 * 262144  # y and sin(y), saved by the mul
    del product
    # a hook of the user's own still makes torch.func refuse, as it does untracked
    with nbmem.track(engine=engine):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
                torch.func.grad(loss)(x)


def test_virtual_capacity_raises_out_of_memory_in_pytorchs_words():
    tracker = Tracker("cpu")
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with MemoryScope(tracker=tracker, capacity="8MiB") as scope:
            first = torch.zeros(1024, 1024)  # 4 MiB
            second = torch.zeros(1024, 1024)  # 8 MiB in use: exactly full, still fits
            third = torch.zeros(1024, 1024)  # noqa: F841  # one more 4 MiB does not
    message = str(caught.value)
    assert message.startswith(
        "CUDA out of memory. Tried to allocate 4.00 MiB. GPU 0 has a total capacity of 8.00 MiB of which 0 bytes is free."
    )
    assert "virtual device (8MiB), tracked on cpu" in message and "aten.zeros" in message
    result = scope.result
    assert result.error == "OutOfMemoryError"
    assert (result.capacity, result.device_name) == (8 * MiB, "virtual 8MiB")
    assert result.peak_allocated == 8 * MiB  # the refused allocation was never counted
    assert tracker.capacity is None  # restored after the scope
    assert (tracker.last_oom.request, tracker.last_oom.allocated) == (4 * MiB, 8 * MiB)
    del first, second
    # the traceback's frames hold the refused 4 MiB tensor in a reference cycle (a frame's locals hold
    # the traceback): free it now, not at whichever later test's cell the garbage collector runs in
    traceback.clear_frames(caught.tb)


def test_capacity_presets_and_bad_capacities():
    with nbmem.track("cpu", capacity="T4") as scope:
        small = torch.zeros(10)
    assert scope.result.capacity == 15843721216 and scope.result.device_name == "virtual T4"
    assert scope.result.device_free == 15843721216 - scope.result.allocated_after
    del small
    for bad in ("lots", "T5000", "-1GiB"):
        with pytest.raises(ValueError, match="16GiB"):
            nbmem.track("cpu", capacity=bad)
    with pytest.raises(ValueError, match="more than 0 bytes"):
        nbmem.track("cpu", capacity=0)


def test_breakdown_categories_are_the_documented_ones():
    assert CATEGORIES == ("parameter", "buffer", "optimizer state", "gradient", "activation", "kv cache", "other")


def test_gradients_of_a_backward_in_a_scope_of_its_own_are_gradients():
    # issue 12: forward in one cell, backward in the next; no module runs in the second
    def on_device() -> dict[str, int]:  # bytes per category of everything alive (other tests' too)
        with nbmem.track("cpu") as empty:
            pass
        return dict(empty.result.breakdown.after)

    before = on_device()
    model = torch.nn.Linear(256, 256)  # weight 256 * 256 * 4 = 262144 B, bias 1024 B
    loss = model(torch.randn(8, 256)).sum()
    with nbmem.track("cpu") as scope:
        loss.backward()
    after = dict(scope.result.breakdown.after)
    assert after["gradient"] - before["gradient"] == 262144 + 1024
    assert after["parameter"] - before["parameter"] == 262144 + 1024
    with nbmem.track("cpu") as scope:
        model.weight.grad.mul_(2)  # a gradient made before the scope is still one
    assert dict(scope.result.breakdown.after)["gradient"] - before["gradient"] == 262144 + 1024
    del loss


def test_another_threads_module_calls_are_not_this_blocks_modules():
    """The module hooks are global: a background thread's forward, open while the block allocates, named the block's
    allocations after its own module (seen: a foreground step's activations charged to another thread's model)."""
    import threading

    entered, release = threading.Event(), threading.Event()

    class Background(nn.Module):
        def forward(self, x):
            entered.set()
            release.wait(timeout=60)
            return x

    background, its_input = Background(), torch.zeros(1)
    with fresh(breakdown=True) as scope:
        thread = threading.Thread(target=background, args=(its_input,))
        thread.start()
        assert entered.wait(timeout=60)
        made = torch.ones(256, 1024)  # 1 MiB, outside any module of this thread
        release.set()
        thread.join()
    assert dict(scope.result.breakdown.modules_at_peak) == {"(outside modules)": MiB}
    del made
