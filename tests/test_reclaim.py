"""nbmem.free(): the memory a failed cell left behind comes back (ipython 13103, 14129).

Tracked mode on the cpu (also where there is a GPU: cells are tracked with
``--backend tracked --device cpu`` and free() is asked for ``device="cpu"``),
exact bytes: 4096 * 1024 float32 = 16777216 bytes, a multiple of the
allocator's 512 B block, so tracked and requested sizes agree.
"""

from __future__ import annotations

import sys

import pytest
import torch

from nbmem.tracking.reclaim import Reclaimed, free
from nbmem.tracking.tracker import default_tracker

LEAK = 4096 * 1024 * 4  # 16777216 bytes, 16 MiB
OUTPUT = 1024 * 256 * 4  # 1048576 bytes, 1 MiB

FAILING_CELL = """
import torch
def work():
    activations = torch.zeros(4096, 1024)
    raise ValueError("out of patience")
work()
"""


@pytest.fixture
def tracked(shell):
    """The shell with every cell tracked on the cpu, and nothing left of earlier errors."""
    shell.run_cell("import torch")
    shell.run_cell("%gpumem on -q --backend tracked --device cpu")
    free(shell, device="cpu")  # errors earlier tests left behind must not count here
    yield shell
    shell.run_cell("%gpumem off -q")
    free(shell, device="cpu")


def test_failed_cell_leaks_until_free(tracked, capsys):
    tracker = default_tracker("cpu")
    baseline = tracker.allocated()

    failed = tracked.run_cell(FAILING_CELL)
    assert isinstance(failed.error_in_exec, ValueError)
    del failed
    # The leak this exists for: the frame of work() still holds its tensor.
    assert tracker.allocated() == baseline + LEAK

    result = free(tracked, device="cpu")

    assert tracker.allocated() == baseline
    assert result.freed == LEAK
    assert (result.mode, result.device) == ("tracked", "cpu")
    assert (result.allocated_before, result.allocated_after) == (baseline + LEAK, baseline)
    assert result.reserved_before is None and result.reserved_after is None
    # run_code, the cell's module frame and work(): all finished, all cleared
    assert result.released[0] == "the last traceback's 3 frames (ValueError)"
    assert result.debug_lost
    assert "16.0 MiB came back (tracked on cpu)" in str(result)
    assert str(result).endswith("%debug is no longer available for the last error")

    # Nothing IPython keeps points at the error's frames any more.
    assert not any(hasattr(sys, name) for name in ("last_type", "last_value", "last_traceback", "last_exc"))
    assert getattr(tracked.InteractiveTB, "tb", None) is None
    assert tracked.last_execution_result.error_in_exec.__traceback__ is None

    # The user's namespace is intact and the next cell runs.
    after = tracked.run_cell("ones = torch.ones(256); work")
    assert after.success
    assert tracked.user_ns["ones"].shape == (256,)
    # 256 * 4 bytes rounded to one 512 B block
    assert tracker.allocated() == baseline + 1024

    # A second free() finds the error without its frames: nothing left to report.
    assert free(tracked, device="cpu").released == ()


def test_debug_after_free_says_nothing_to_debug(tracked, caplog):
    tracked.run_cell(FAILING_CELL)
    free(tracked, device="cpu")
    tracked.run_line_magic("debug", "")
    assert "No traceback has been produced, nothing to debug." in caplog.text


def test_chained_error_frames_are_cleared(tracked):
    tracker = default_tracker("cpu")
    baseline = tracker.allocated()
    tracked.run_cell(
        """
def inner():
    first = torch.zeros(4096, 1024)
    raise KeyError("missing")
def outer():
    second = torch.zeros(4096, 1024)
    try:
        inner()
    except KeyError as error:
        raise RuntimeError("wrapped") from error
outer()
"""
    )
    assert tracker.allocated() == baseline + 2 * LEAK

    result = free(tracked, device="cpu")

    assert result.freed == 2 * LEAK
    # run_code, the cell, outer() and inner(); the chain's shared frames counted once
    assert result.released[0] == "the last traceback's 4 frames (RuntimeError)"


def test_frames_held_elsewhere_lose_their_locals(tracked):
    """A saved frame keeps nothing alive: clear() plus f_locals syncing empties it."""
    tracker = default_tracker("cpu")
    baseline = tracker.allocated()
    tracked.run_cell(FAILING_CELL)
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    kept_frame = tb.tb_frame  # as a debugger or a user's saved exception would
    del tb

    result = free(tracked, device="cpu")

    assert result.freed == LEAK
    assert tracker.allocated() == baseline
    assert kept_frame.f_locals == {}


def test_debugger_state_from_debug_is_released(tracked):
    """After %debug the debugger keeps botframe and curframe_locals (pdb.forget leaves them)."""
    tracker = default_tracker("cpu")
    baseline = tracker.allocated()
    tracked.run_cell(FAILING_CELL)
    debugger = tracked.InteractiveTB.debugger_cls()
    tracked.InteractiveTB.pdb = debugger
    # what %debug does before its prompt: frames from the traceback, locals copied
    debugger.reset()
    debugger.botframe = sys.last_traceback.tb_frame
    debugger.setup(None, sys.last_traceback)
    debugger.forget()

    result = free(tracked, device="cpu")

    assert result.freed == LEAK
    assert tracker.allocated() == baseline
    assert "the debugger's frames from the last %debug" in result.released
    assert debugger.botframe is None
    tracked.InteractiveTB.pdb = None


def test_output_holding_a_tensor_is_released(tracked):
    tracker = default_tracker("cpu")
    baseline = tracker.allocated()
    shown = tracked.run_cell("torch.ones(1024, 256)", store_history=True)
    number = shown.execution_count
    out = tracked.user_ns["Out"]
    assert isinstance(out[number], torch.Tensor)
    assert tracked.user_ns[f"_{number}"] is out[number] is tracked.user_ns["_"]
    del shown
    assert tracker.allocated() == baseline + OUTPUT

    result = free(tracked, device="cpu")

    assert result.released == (f"Out[{number}] (a Tensor)",)
    assert result.freed == OUTPUT
    assert tracker.allocated() == baseline
    assert number not in out
    assert f"_{number}" not in tracked.user_ns and f"_{number}" not in tracked.user_ns_hidden
    # as InteractiveShell.del_var: the names go, the display hook forgets the value
    assert "_" not in tracked.user_ns and tracked.displayhook._ is None
    assert tracked.last_execution_result.result is None
    assert not result.debug_lost
    assert "%debug" not in str(result)
    # the display hook still works: the next output is cached as usual
    next_shown = tracked.run_cell("40 + 2", store_history=True)
    assert out[next_shown.execution_count] == 42


def test_outputs_without_tensors_and_user_variables_stay(tracked):
    kept = tracked.run_cell("[1, 2, 3]", store_history=True).execution_count
    model = tracked.run_cell("torch.nn.Linear(16, 16)", store_history=True).execution_count
    batch = tracked.run_cell("{'x': torch.ones(4), 'y': 1}", store_history=True).execution_count
    tracked.run_cell("mine = torch.ones(1024, 256)")

    result = free(tracked, device="cpu")

    assert result.released == (f"Out[{model}] (a Linear module)", f"Out[{batch}] (a dict holding tensors)")
    assert tracked.user_ns["Out"][kept] == [1, 2, 3]
    assert isinstance(tracked.user_ns["mine"], torch.Tensor)


def test_nothing_to_release_frees_nothing(tracked):
    free(tracked, device="cpu")
    before = default_tracker("cpu").allocated()

    result = free(tracked, device="cpu")

    assert result.released == ()
    assert result.freed == 0
    assert result.allocated_before == result.allocated_after == before
    assert str(result).startswith("gpumem free: nothing came back (tracked on cpu)")
    assert "released: nothing" in str(result)


def test_outside_ipython_only_sys_last_is_cleared(shell, monkeypatch):
    """With no shell, the error in sys.last_* goes and IPython's output cache is untouched."""
    import IPython

    tracker = default_tracker("cpu")
    shell.run_cell("import torch")
    shown = shell.run_cell("torch.ones(1024, 256)", store_history=True).execution_count
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)

    def work() -> None:
        activations = torch.zeros(4096, 1024)  # noqa: F841
        raise ValueError("out of patience")

    baseline = tracker.allocated()
    with tracker:
        try:
            work()
        except ValueError:
            sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
    assert tracker.allocated() == baseline + LEAK

    result = free(device="cpu")

    assert result.freed == LEAK
    # this test's own frame is still running, so only work()'s is cleared
    assert result.released == ("the last traceback's 1 frame (ValueError)",)
    assert not hasattr(sys, "last_traceback")
    assert isinstance(shell.user_ns["Out"][shown], torch.Tensor)
    free(shell, device="cpu")


def test_result_renders_as_text_and_html():
    result = Reclaimed(
        device="cuda:0",
        mode="measured",
        allocated_before=96 << 20,
        allocated_after=32 << 20,
        reserved_before=128 << 20,
        reserved_after=32 << 20,
        released=("the last traceback's 3 frames (ValueError)", "Out[4] (a Tensor)"),
    )
    assert result.freed == 64 << 20  # 67108864 bytes
    assert str(result) == (
        "gpumem free: 64.0 MiB came back (measured on cuda:0): 96.0 MiB -> 32.0 MiB allocated;"
        " 128 MiB -> 32.0 MiB reserved;"
        " released: the last traceback's 3 frames (ValueError), Out[4] (a Tensor);"
        " %debug is no longer available for the last error"
    )
    page = result._repr_html_()
    assert "64.0 MiB came back" in page and "Out[4] (a Tensor)" in page


def test_result_pretty_prints_as_its_text(shell):
    from IPython.lib.pretty import pretty

    result = Reclaimed("cpu", "tracked", 0, 0, None, None, ())
    assert pretty(result) == str(result)


def test_default_device_is_cuda_when_there_is_one(shell):
    result = free(shell)
    if torch.cuda.is_available():
        assert result.mode == "measured" and result.device.startswith("cuda:")
        assert result.reserved_after is not None
    else:
        assert (result.mode, result.device, result.reserved_after) == ("tracked", "cpu", None)


@pytest.mark.cuda
def test_failed_cell_on_cuda_gives_back_allocated_and_reserved(shell):
    shell.run_cell("import torch")
    free(shell)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    shell.run_cell(FAILING_CELL.replace("torch.zeros(4096, 1024)", "torch.zeros(4096, 1024, device='cuda')"))
    # 16 MiB is a whole number of 2 MiB large-pool blocks: no rounding (CUDACachingAllocator.cpp)
    assert torch.cuda.memory_allocated() == baseline + LEAK

    result = free(shell)

    assert result.mode == "measured"
    assert result.freed == LEAK
    assert torch.cuda.memory_allocated() == baseline
    # empty_cache gave the freed segment back to the driver
    assert result.reserved_after == torch.cuda.memory_reserved()
    assert result.reserved_before - result.reserved_after >= LEAK


@pytest.mark.slow
def test_kernel_keeps_nothing_after_free():
    """In ipykernel (ZMQInteractiveShell) the same holders exist and free() empties them."""
    import nbclient
    from nbformat.v4 import new_code_cell, new_notebook

    cells = [
        "import torch, nbmem.tracking.reclaim\nfrom nbmem.tracking.tracker import default_tracker\n"
        "%load_ext nbmem\n%gpumem on -q --backend tracked --device cpu\n"
        "baseline = default_tracker('cpu').allocated()",
        FAILING_CELL,
        "torch.ones(1024, 256)",
        "print('leaked', default_tracker('cpu').allocated() - baseline)",
        "result = nbmem.tracking.reclaim.free(device='cpu')\n"
        "print('freed', result.freed, 'left', default_tracker('cpu').allocated() - baseline)\n"
        "print(result.released)",
    ]
    notebook = new_notebook(cells=[new_code_cell(source) for source in cells])
    nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600, allow_errors=True).execute()
    leaked, freed = (cell.outputs[0]["text"] for cell in notebook.cells[3:])

    assert leaked == f"leaked {LEAK + OUTPUT}\n"
    assert freed.startswith(f"freed {LEAK + OUTPUT} left 0\n")
    assert "the last traceback's 3 frames (ValueError)" in freed and "Out[3] (a Tensor)" in freed
