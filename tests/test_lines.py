"""Which line of the user's code holds the memory (issue 23, part 4): ``lines=True``, ``%%gpumem --lines``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nbmem
from nbmem.tracking.tracker import default_tracker

MiB = 1024**2


def by_where(result) -> dict[str, tuple[int, int]]:
    return {line.where: (line.at_peak, line.allocated) for line in result.lines}


def three_tensors():
    with nbmem.track("cpu", lines=True) as scope:
        kept = torch.zeros(256, 1024)  # +1: 1 MiB, alive at the peak
        dropped = torch.zeros(512, 1024)  # +2: 2 MiB, the peak
        del dropped
        late = torch.zeros(128, 1024)  # +4: 512 KiB, made after the peak
    return scope.result, kept, late


def test_each_line_is_charged_exactly_what_it_made():
    result, kept, late = three_tensors()
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
    assert default_tracker("cpu")._lines is None  # nothing left counting after the scope


def training_step(model, optimizer, batch):
    with nbmem.track("cpu", lines=True) as scope:
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
    return scope.result


def test_backward_and_the_optimizer_are_charged_to_the_lines_that_call_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = training_step(model, optimizer, torch.randn(32, 64))
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


def test_lines_need_the_dispatch_engine():
    with pytest.raises(ValueError, match="lines needs every op"):
        nbmem.track("cpu", engine="native", lines=True)
    assert nbmem.track("cpu", lines=True).engine == "dispatch"


def test_a_failing_block_still_has_its_lines_and_leaves_nothing_counting():
    scope = nbmem.track("cpu", lines=True)
    with pytest.raises(RuntimeError):
        with scope:
            made = torch.zeros(256, 1024)  # noqa: F841
            raise RuntimeError("out of patience")
    assert scope.result.error == "RuntimeError"
    assert [line.allocated for line in scope.result.lines if "torch.zeros(256, 1024)" in line.source] == [MiB]
    assert default_tracker("cpu")._lines is None


def test_results_with_lines_go_through_records():
    result, _, _ = three_tensors()
    again = nbmem.MemoryResult.from_record(nbmem.History([result]).to_records()[0])
    assert again.lines == result.lines


def test_a_second_lines_scope_never_charges_an_earlier_scopes_lines():
    # (found in review) records kept the line an earlier counter gave them: freeing one in a later scope made a
    # negative row, and the peak of a scope whose peak is its start was taken at its end
    with nbmem.track("cpu", lines=True):
        first = torch.zeros(256, 1024)  # 1 MiB, charged to this line by the first scope
    with nbmem.track("cpu", lines=True) as scope:
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
