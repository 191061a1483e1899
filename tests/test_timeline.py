"""Timelines: exact points, the peak kept through downsampling, and the magic flags."""

from __future__ import annotations

import torch
from IPython.utils.capture import capture_output

from nbmem.tracking.scope import MemoryScope
from nbmem.tracking.tracker import Tracker, default_tracker

MiB = 1024**2


def test_points_are_live_bytes_just_after_each_op():
    with MemoryScope(tracker=Tracker("cpu"), timeline=True) as scope:
        first = torch.zeros(256, 1024)  # op 1: 1 MiB
        second = torch.zeros(256, 1024)  # op 2: 2 MiB
        del first  # freed after op 2: still counted at point 2
        third = torch.zeros(512, 1024)  # op 3: 1 + 2 MiB
    timeline = scope.result.timeline
    # point 0 is every tensor alive when the scope opened (the process's, this test's none)
    base = scope.result.allocated_before
    assert timeline.ops == 3 and timeline.steps == (0, 1, 2, 3)
    assert timeline.totals() == [base, base + MiB, base + 2 * MiB, base + 3 * MiB]
    assert dict(timeline.series)["other"][1:] == tuple(dict(timeline.series)["other"][0] + size for size in (MiB, 2 * MiB, 3 * MiB))
    assert (timeline.peak_step, timeline.peak_bytes, timeline.peak_op) == (3, base + 3 * MiB, "aten.zeros")
    assert timeline.peak_bytes == scope.result.peak_allocated
    del second, third


def test_categories_and_peak_of_a_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters())
    with MemoryScope(tracker=Tracker("cpu"), timeline=True) as scope:
        for _ in range(2):
            model(torch.randn(32, 256)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    timeline, result = scope.result.timeline, scope.result
    assert timeline.peak_bytes == result.peak_allocated
    assert dict(timeline.series)["optimizer state"][-1] == dict(result.breakdown.after)["optimizer state"]
    assert timeline.totals()[-1] == result.allocated_after


def test_long_blocks_are_downsampled_keeping_the_peak():
    with MemoryScope(tracker=Tracker("cpu"), timeline=True) as scope:
        counter = torch.zeros(10)
        for step in range(20000):
            counter.add_(1)
            if step == 12345:
                spike = torch.zeros(1024, 1024)  # the peak: 4 MiB for one moment
                del spike
    timeline = scope.result.timeline
    assert timeline.ops > 20000 and len(timeline.steps) <= 2001
    assert timeline.peak_step in timeline.steps
    assert timeline.peak_bytes == scope.result.peak_allocated == scope.result.allocated_before + 4 * MiB + 512
    assert len(timeline.plot().axes[0].collections) >= 1


def test_timeline_and_free_on_oom_flags(shell):
    shell.run_cell("import torch\ndef grow():\n    held = torch.zeros(1024, 1024)\n    more = torch.zeros(1024, 1024)\n")
    with capture_output() as captured:
        shell.run_cell("%%gpumem --timeline\nx = torch.zeros(1024)", store_history=True)
    assert any("image/png" in output.data for output in captured.outputs)
    assert "gpumem timeline:" in captured.outputs[-1].data["text/plain"]
    tracker = default_tracker("cpu")
    with MemoryScope(tracker=tracker) as empty:
        pass
    # the virtual device holds what is alive in the process already (issue 12), plus 6 MiB
    capacity = empty.result.allocated_after + 6 * MiB
    with capture_output() as captured:
        result = shell.run_cell(f"%%gpumem --text --capacity {capacity} --free-on-oom\ngrow()", store_history=True)
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    texts = [output.data["text/plain"] for output in captured.outputs]
    assert "4.00 MiB came back" in texts[-1]  # `held`, released before IPython keeps the frames
    assert "more = torch.zeros(1024, 1024)" in captured.stdout  # the traceback still shows the line
    # and hides nbmem's frames as without the flag: they are cleared after IPython has shown it (a review found
    # them shown, their __tracebackhide__ cleared with their locals)
    assert "skipping hidden" in captured.stdout and "nbmem/tracking/" not in captured.stdout
    assert "failed resolving arguments" not in captured.stdout
    from nbmem import history

    # everything the failed cell made is gone already, without %gpumem free
    assert tracker.allocated() == history(shell)[-1].allocated_before


def test_free_on_oom_from_code_that_catches_the_error_frees_at_once(shell):
    """run_cell_magic in a loop that catches the error: no traceback is shown, so the frames are cleared at once
    (deferred to the cell's end, the second attempt ran out of memory on what the first left, a review)."""
    shell.run_cell("import torch\ndef grow():\n    held = torch.zeros(1024, 1024)\n    more = torch.zeros(1024, 1024)\n")
    tracker = default_tracker("cpu")
    with MemoryScope(tracker=tracker) as empty:
        pass
    shell.user_ns["capacity"] = empty.result.allocated_after + 6 * MiB
    shell.user_ns.update(left=[], nbmem_tracker=tracker)
    left = shell.user_ns["left"]
    with capture_output():
        result = shell.run_cell(
            "for attempt in range(2):\n"
            "    try:\n"
            "        get_ipython().run_cell_magic('gpumem', f'-q --capacity {capacity} --free-on-oom', 'grow()')\n"
            "    except torch.OutOfMemoryError:\n"
            "        left.append(nbmem_tracker.allocated())\n",
            store_history=True)
    assert result.success
    assert left == [empty.result.allocated_after] * 2  # `held` gone after each attempt, before the next
    assert not [callback for callback in shell.events.callbacks["post_run_cell"] if "release" in callback.__qualname__]
