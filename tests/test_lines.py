"""Which line of the user's code holds the memory (issue 23, part 4): ``lines=True``, ``%%gpumem --lines``."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import nbmem
from nbmem.tracking.lines import _is_users
from nbmem.tracking.native import available
from nbmem.tracking.tracker import default_tracker
from test_compiled import needs_native  # skipped without a C++ compiler, unless CI requires the native engine

MiB = 1024**2
ENGINES = ["dispatch", pytest.param("native", marks=needs_native)]


def lines_left(engine: str):
    """The lines the engine's tracker still counts (None: nothing left counting)."""
    if engine == "native":
        from nbmem.tracking.native_tracking import native_tracker

        return native_tracker()._lines
    return default_tracker("cpu")._lines


def by_where(result) -> dict[str, tuple[int, int]]:
    return {line.where: (line.at_peak, line.allocated) for line in result.lines}


def three_tensors(engine: str = "dispatch"):
    with nbmem.track("cpu", lines=True, engine=engine) as scope:
        kept = torch.zeros(256, 1024)  # +1: 1 MiB, alive at the peak
        dropped = torch.zeros(512, 1024)  # +2: 2 MiB, the peak
        del dropped
        late = torch.zeros(128, 1024)  # +4: 512 KiB, made after the peak
    return scope.result, kept, late


@pytest.mark.parametrize("engine", ENGINES)
def test_each_line_is_charged_exactly_what_it_made(engine):
    result, kept, late = three_tensors(engine)
    first = three_tensors.__code__.co_firstlineno
    here = f"test_lines.py:{first + 2}", f"test_lines.py:{first + 3}", f"test_lines.py:{first + 5}"
    lines = by_where(result)
    assert lines[here[0]] == (MiB, MiB)
    assert lines[here[1]] == (2 * MiB, 2 * MiB)
    assert lines[here[2]] == (0, MiB // 2)
    assert [line.source for line in result.lines if line.where == here[1]] == ["dropped = torch.zeros(512, 1024)  # +2: 2 MiB, the peak"]
    # every byte in use at the peak is some line's, or was alive before
    assert sum(line.at_peak for line in result.lines) == result.peak_allocated
    assert lines.get("(alive before)", (0, 0))[0] == result.allocated_before
    assert lines_left(engine) is None  # nothing left counting after the scope


def training_step(model, optimizer, batch, engine="dispatch"):
    with nbmem.track("cpu", lines=True, engine=engine) as scope:
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
    return scope.result


@pytest.mark.parametrize("engine", ENGINES)
def test_backward_and_the_optimizer_are_charged_to_the_lines_that_call_them(engine):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = training_step(model, optimizer, torch.randn(32, 64), engine)
    sources = {line.source: line for line in result.lines}
    assert set(sources) == {"", "loss = model(batch).sum()", "loss.backward()", "optimizer.step()"}
    # gradients: weight 64*256*4 + bias 256*4 + weight 256*8*4 + bias 8*4, each rounded to 512 B
    gradients = 65536 + 1024 + 8192 + 512
    assert sources["loss.backward()"].allocated >= gradients
    # SGD's momentum buffers, one per parameter, the gradients' sizes: the peak is the step's, with them made
    assert sources["optimizer.step()"].at_peak == sources["optimizer.step()"].allocated == gradients
    assert sum(line.at_peak for line in result.lines) == result.peak_allocated


def test_the_magic_shows_the_cells_lines(shell):
    shell.run_cell("import torch")
    result = shell.run_cell("%%gpumem -o -q --lines --backend tracked --device cpu\na = torch.zeros(256, 1024)\nb = torch.ones(64, 1024)")
    lines = by_where(result.result)
    count = result.execution_count
    assert lines[f"cell [{count}], line 1"] == (MiB, MiB)
    assert lines[f"cell [{count}], line 2"] == (MiB // 4, MiB // 4)
    assert "by line of your code" in result.result.text()
    assert "<table class='nbmem-lines'" in result.result._repr_html_()
    shell.run_cell("del a, b")


def test_lines_take_the_dispatch_engine_unless_compiled_code_or_asked():
    assert nbmem.track("cpu", lines=True).engine == "dispatch"
    if available():
        assert nbmem.track("cpu", lines=True, engine="native").engine == "native"


@needs_native
def test_the_native_engine_charges_the_same_lines_as_the_dispatch_engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = torch.randn(32, 64)
    training_step(model, optimizer, batch)  # the momentum buffers exist from here on: two alike steps follow
    dispatch = training_step(model, optimizer, batch, "dispatch")
    native = training_step(model, optimizer, batch, "native")
    assert native.peak_allocated == dispatch.peak_allocated
    # (the native engine also lists the lines whose kernels' scratch came and went: 0 B at the peak)
    at_peak = lambda result: {line.source: line.at_peak for line in result.lines if line.at_peak}  # noqa: E731
    assert at_peak(native) == at_peak(dispatch)


@needs_native
def test_another_threads_allocations_go_to_the_line_the_asking_thread_is_at():
    # the native engine sees every thread's allocations as they happen (a dispatch mode is the thread's own: the
    # dispatch engine finds the worker's tensor at the block's end, and charges it to the line that ends the block)
    made = []
    worker = threading.Thread(target=lambda: made.append(torch.zeros(512, 1024)))  # 2 MiB, made on the worker
    with nbmem.track("cpu", lines=True, engine="native") as scope:
        worker.start(); worker.join()  # noqa: E702  (one line: the worker allocates while this one waits in it)
    rows = {line.source: line.allocated for line in scope.result.lines if line.allocated}
    assert rows == {"worker.start(); worker.join()  # noqa: E702  (one line: the worker allocates while this one waits in it)": 2 * MiB}


def test_generated_code_is_never_the_users():
    user = compile("x = 1", "/home/someone/train.py", "exec")
    assert _is_users(user)
    for generated in ("<eval_with_key>.3", "/tmp/torchinductor_someone/ab/cabcdef.py", "<frozen runpy>"):
        assert not _is_users(compile("x = 1", generated, "exec")), generated


@needs_native
def test_a_compiled_models_lines_are_measured_compiled_and_charged_to_the_line_that_calls_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    fast = torch.compile(model, backend="aot_eager")  # FX code runs (<eval_with_key>), no C++ kernels to build
    batch = torch.randn(32, 64)
    fast(batch).sum().backward()  # compiled once, before the block
    model.zero_grad(set_to_none=True)
    without = nbmem.track("cpu", engine="native")
    with without:
        out = fast(batch).sum()
        out.backward()
    model.zero_grad(set_to_none=True)
    del out
    with nbmem.track("cpu", lines=True) as scope:
        out = fast(batch).sum()
        out.backward()
    result = scope.result
    assert (scope.engine, result.compiled) == ("native", "compiled")
    assert result.peak_allocated == without.result.peak_allocated  # asking for lines changes nothing measured
    assert sum(line.at_peak for line in result.lines) == result.peak_allocated
    assert {line.source for line in result.lines} == {"", "out = fast(batch).sum()", "out.backward()"}
    gradients = 64 * 256 * 4 + 256 * 4 + 256 * 8 * 4 + 512
    assert {line.source: line.allocated for line in result.lines}["out.backward()"] >= gradients


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failing_block_still_has_its_lines_and_leaves_nothing_counting(engine):
    scope = nbmem.track("cpu", lines=True, engine=engine)
    with pytest.raises(RuntimeError):
        with scope:
            made = torch.zeros(256, 1024)  # noqa: F841
            raise RuntimeError("out of patience")
    assert scope.result.error == "RuntimeError"
    assert [line.allocated for line in scope.result.lines if "torch.zeros(256, 1024)" in line.source] == [MiB]
    assert lines_left(engine) is None


def test_results_with_lines_go_through_records():
    result, _, _ = three_tensors()
    again = nbmem.MemoryResult.from_record(nbmem.History([result]).to_records()[0])
    assert again.lines == result.lines


@pytest.mark.parametrize("engine", ENGINES)
def test_a_second_lines_scope_never_charges_an_earlier_scopes_lines(engine):
    # (found in review) records kept the line an earlier counter gave them: freeing one in a later scope made a
    # negative row, and the peak of a scope whose peak is its start was taken at its end
    with nbmem.track("cpu", lines=True, engine=engine):
        first = torch.zeros(256, 1024)  # 1 MiB, charged to this line by the first scope
    with nbmem.track("cpu", lines=True, engine=engine) as scope:
        del first  # the peak is the start: 1 MiB more than anything after
        later = torch.zeros(64, 1024)  # noqa: F841
    result = scope.result
    assert all(line.at_peak >= 0 and line.allocated >= 0 for line in result.lines)
    assert sum(line.at_peak for line in result.lines) == result.peak_allocated == result.allocated_before
    assert by_where(result)["(alive before)"][0] == result.allocated_before


def test_unloading_detaches_the_lines_of_a_scope_that_never_stopped():
    from nbmem.tracking.tracker import remove_every_tracker

    scope = nbmem.track("cpu", lines=True).start()  # as if Ctrl-C cut it off from its stop()
    assert default_tracker("cpu")._lines is not None
    remove_every_tracker()  # what %unload_ext nbmem does
    assert default_tracker("cpu")._lines is None
    scope.stop()
    assert default_tracker("cpu")._lines is None


@needs_native
def test_lines_follow_the_newest_scope_when_the_first_ones_thread_has_ended():
    # (found in review) the native engine kept the first scope's thread: once that thread ended, each allocation
    # read a thread state Python had freed (SIGSEGV)
    opened, done = threading.Event(), threading.Event()

    def other_thread() -> None:
        scope = nbmem.track("cpu", lines=True, engine="native").start()
        opened.set()
        done.wait()
        scope.stop()

    worker = threading.Thread(target=other_thread)
    worker.start()
    opened.wait()
    scope = nbmem.track("cpu", lines=True, engine="native").start()
    done.set()
    worker.join()
    for _ in range(20):  # new threads, which may be given the ended thread's memory
        churn = threading.Thread(target=lambda: sum(range(1000)))
        churn.start()
        churn.join()
    kept = torch.zeros(1024, 1024)  # 4 MiB
    result = scope.stop()
    assert {line.source: line.allocated for line in result.lines if line.allocated} == {"kept = torch.zeros(1024, 1024)  # 4 MiB": 4 * MiB}
    del kept


@needs_native
def test_reading_the_stack_never_runs_a_garbage_collection_inside_an_allocation():
    # (found in review) making frame objects may start a collection, which runs any finalizer inside the
    # allocation, with PyTorch's locks held: seen as collections starting inside autograd's C++ backward, where
    # the last Python frame on the stack is the one that called the engine. (Python hooks run inside backward too,
    # nbmem's saved-tensor hooks among them: a collection may start there, as anywhere Python runs.)
    import gc
    import sys

    weight = torch.randn(256, 256, requires_grad=True)
    from_the_engine = []

    def started(phase, info) -> None:
        if phase == "start" and torch._C._current_graph_task_id() != -1:
            from_the_engine.append(sys._getframe(1).f_code.co_name == "_engine_run_backward")

    threshold = gc.get_threshold()
    for _ in range(5):
        with nbmem.track("cpu", lines=True, engine="native"):
            gc.set_threshold(1)
            gc.callbacks.append(started)
            try:
                (weight @ weight).sum().backward()
            finally:
                gc.callbacks.remove(started)
                gc.set_threshold(*threshold)
    assert not any(from_the_engine)


_NO_USER_FRAME = compile(  # a file name no rule calls the user's: a block whose every frame is nbmem's, torch's or this
    "with nbmem.track('cpu', lines=True, engine=engine) as scope:\n"
    "    made = torch.zeros(256, 1024)\n"
    "found.update(result=scope.result, made=made)\n",
    "<frozen no user here>", "exec")


@pytest.mark.parametrize("engine", ENGINES)
def test_an_allocation_charged_to_no_line_counts_as_made_before_the_lines_as_at_its_peak(engine):
    # (found last session) with no frame of the user's on the stack, and no line charged yet, an allocation goes to
    # "(alive before)"; the native engine counted it there at the peak but not as made, the dispatch engine as both
    found: dict = {}
    worker = threading.Thread(target=exec, args=(_NO_USER_FRAME, {"nbmem": nbmem, "torch": torch, "engine": engine,
                                                                  "found": found}))
    worker.start()
    worker.join()
    result = found["result"]
    assert result.peak == MiB
    assert by_where(result) == {"(alive before)": (result.allocated_before + MiB, MiB)}
