"""The magics in a real IPython shell: what the user sees, and what is left behind."""

from __future__ import annotations

import re

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from torch.utils._python_dispatch import _get_current_dispatch_mode

import nbmem
from nbmem.frontend import display
from nbmem.core.results import MemoryResult
from nbmem.tracking.tracker import default_tracker

MiB = 1024**2
TWO_TENSORS = "a = torch.zeros(1024, 1024)\nb = torch.zeros(1024, 1024)\ndel a\n"


def run(shell, source):
    """Run a cell as a notebook would and return (ExecutionResult, captured output)."""
    with capture_output() as captured:
        result = shell.run_cell(source, store_history=True)
    return result, captured


def texts(captured):
    return [output.data.get("text/plain", "") for output in captured.outputs]


def test_cell_report_has_exact_figures_and_says_tracked(shell):
    shell.run_cell("import torch")
    result, captured = run(shell, "%%gpumem\n" + TWO_TENSORS)
    assert result.success
    (report,) = texts(captured)
    assert "tracked on cpu, no CUDA device used" in report
    assert "+8.00 MiB allocated above the start" in report
    assert "+4.00 MiB allocated" in report and "retained" in report
    (entry,) = nbmem.history(shell)
    assert (entry.peak, entry.retained, entry.label) == (8 * MiB, 4 * MiB, "a = torch.zeros(1024, 1024)")
    assert entry.execution_count == result.execution_count
    del shell.user_ns["b"]


def test_last_expression_still_displays_after_the_report(shell):
    shell.run_cell("import torch")
    result, captured = run(shell, "%%gpumem\nx = torch.ones(3)\nx.sum().item() + 4")
    assert result.result == 7.0
    assert captured.stdout.strip().endswith("7.0")  # Out[n]: 7.0 after the report


def test_output_flag_returns_the_result_object(shell):
    shell.run_cell("import torch")
    result, captured = run(shell, "%%gpumem -o\nkept = torch.zeros(256, 1024)")
    assert isinstance(result.result, MemoryResult)
    assert shell.user_ns["_"] is result.result
    assert result.result.retained == MiB
    assert captured.outputs == []  # the result shows once, as Out
    assert "retained" in captured.stdout


def test_output_flag_still_shows_the_cells_value(shell):
    result, captured = run(shell, "%%gpumem -o\n41 + 1")
    assert isinstance(result.result, MemoryResult)
    assert texts(captured) == ["42"]


def test_quiet_shows_nothing_but_records(shell):
    result, captured = run(shell, "%%gpumem -q\ny = 1")
    assert captured.outputs == [] and captured.stdout == ""
    assert len(nbmem.history(shell)) == 1


def test_text_flag_publishes_plain_text_only(shell):
    result, captured = run(shell, "%%gpumem --text\ny = 1")
    (output,) = captured.outputs
    assert set(output.data) == {"text/plain"}


def test_html_fallback_and_widget_bundle(shell, monkeypatch):
    shell.run_cell("import torch")
    result, captured = run(shell, "%%gpumem\nz = torch.zeros(1024)")
    (output,) = captured.outputs
    assert set(output.data) == {"text/plain", "text/html"}  # terminal: no widget
    assert 'class="nbmem-bar"' in output.data["text/html"]
    monkeypatch.setattr(display._env, "widgets_usable", lambda shell=None: True)
    result, captured = run(shell, "%%gpumem\nz = torch.zeros(1024)")
    (output,) = captured.outputs
    assert set(output.data) == {display.WIDGET_MIME, "text/plain", "text/html"}
    assert output.data[display.WIDGET_MIME]["model_id"]
    assert "+4.00 KiB allocated above the start" in output.data["text/plain"]


def test_failing_cell_reports_failed_and_propagates_with_user_traceback(shell):
    shell.run_cell("import torch")
    result, captured = run(shell, '%%gpumem\nkept = torch.zeros(10)\nraise ValueError("boom")')
    assert isinstance(result.error_in_exec, ValueError)
    assert "FAILED with ValueError" in texts(captured)[0]
    assert 'raise ValueError("boom")' in captured.stdout  # the user's line in the traceback
    assert "nbmem/frontend/magics.py" not in captured.stdout  # nbmem's frames are hidden
    assert shell.user_ns["kept"].shape == (10,)  # state before the failure is kept
    assert nbmem.history(shell)[-1].error == "ValueError"
    assert _get_current_dispatch_mode() is None


def test_keyboard_interrupt_leaves_no_mode_or_scope_behind(shell):
    result, captured = run(shell, "%%gpumem\nraise KeyboardInterrupt")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert _get_current_dispatch_mode() is None
    tracker = default_tracker("cpu")
    assert not tracker.active and len(tracker.scopes) == 0
    assert nbmem.history(shell)[-1].error == "KeyboardInterrupt"


@pytest.mark.parametrize("order", ["%%time\n%%gpumem\n", "%%gpumem\n%%time\n"])
def test_composes_with_time(shell, order):
    shell.run_cell("import torch")
    result, captured = run(shell, order + "w = torch.zeros(1024, 1024)\n5")
    assert result.success and result.result == 5
    assert "Wall time" in captured.stdout
    assert nbmem.history(shell)[-1].retained == 4 * MiB
    # labelled by its code, not by %%time (a newcomer's walk through the docs found "%%time" in the history)
    assert nbmem.history(shell)[-1].label == "w = torch.zeros(1024, 1024)"


def test_a_gpumem_cell_under_time_is_measured_once_under_gpumem_on(shell):
    """%%time's body starts with %%gpumem: that cell records itself, and %gpumem on leaves it alone (a review
    found it measured twice, two rows in the history)."""
    shell.run_cell("import torch")
    run(shell, "%gpumem on -q")
    try:
        before = len(nbmem.history(shell))
        result, captured = run(shell, "%%time\n%%gpumem -q\nw = torch.zeros(256, 1024)")
        assert result.success
        rows = nbmem.history(shell)[before:]
        assert len(rows) == 1 and rows[0].retained == MiB
    finally:
        run(shell, "%gpumem off")


def test_every_cell_on_off_history_reset(shell):
    shell.run_cell("import torch")
    result, captured = run(shell, "%gpumem on")
    assert "tracked on cpu" in captured.stdout
    result, captured = run(shell, "c = torch.zeros(256)")
    (line,) = texts(captured)
    assert line == f"gpumem [{result.execution_count}] peak +1.00 KiB allocated · retained +1.00 KiB · " + line.split(" · ")[2] + " · tracked on cpu"
    result, captured = run(shell, "raise RuntimeError('no')")
    assert "FAILED (RuntimeError)" in texts(captured)[-1]
    run(shell, "%gpumem off")
    result, captured = run(shell, "d = torch.zeros(256)")
    assert captured.outputs == []
    history = nbmem.history(shell)
    assert [entry.label for entry in history] == ["c = torch.zeros(256)", "raise RuntimeError('no')"]
    result, captured = run(shell, "%gpumem history")
    kinds = [set(output.data) for output in captured.outputs]
    assert {"text/plain", "text/html"} in kinds and {"image/png", "text/plain"} in kinds
    assert "c = torch.zeros(256)" in captured.outputs[0].data["text/plain"]
    result, captured = run(shell, "%gpumem history -o")
    assert result.result is history
    run(shell, "%gpumem reset")
    assert len(nbmem.history(shell)) == 0


def test_every_cell_does_not_double_count_gpumem_cells(shell):
    run(shell, "%gpumem on -q")
    run(shell, "%%gpumem -q\nq = 1")
    run(shell, "r = 2")
    assert [entry.label for entry in nbmem.history(shell)] == ["q = 1", "r = 2"]
    run(shell, "%gpumem off -q")


def test_nested_cell_inside_every_cell_keeps_both_right(shell):
    shell.run_cell("import torch, nbmem")
    run(shell, "%gpumem on -q")
    # a plain cell that measures a block inside itself
    result, _ = run(shell, "big = torch.zeros(1024, 1024)\ndel big\nwith nbmem.track('cpu') as inner:\n    small = torch.zeros(1024)")
    assert result.success
    run(shell, "%gpumem off -q")
    outer = nbmem.history(shell)[-1]
    assert (outer.peak, outer.retained) == (4 * MiB, 4096)
    assert (shell.user_ns["inner"].result.peak, shell.user_ns["inner"].result.retained) == (4096, 4096)


def test_loading_twice_registers_once_and_unload_removes_everything(shell):
    nbmem.load_ipython_extension(shell)
    callbacks = shell.events.callbacks
    pre = [cb for cb in callbacks["pre_run_cell"] if getattr(cb, "__self__", None).__class__.__name__ == "GpuMemMagics"]
    assert len(pre) == 1

    def transformers():
        return [t for t in shell.input_transformers_post if t.__class__.__name__ == "method"
                and t.__self__.__class__.__name__ == "GpuMemMagics"]

    assert len(transformers()) == 1
    nbmem.unload_ipython_extension(shell)
    for event in ("pre_run_cell", "post_run_cell"):
        assert not [cb for cb in callbacks[event] if getattr(cb, "__self__", None).__class__.__name__ == "GpuMemMagics"]
    assert "gpumem" not in shell.magics_manager.magics["line"]
    assert "gpumem" not in shell.magics_manager.magics["cell"]
    assert not transformers()
    result, captured = run(shell, "%%gpumem\n1")
    assert not result.success  # the magic is really gone
    nbmem.load_ipython_extension(shell)  # the fixture unloads again


def test_unload_while_every_cell_is_on_stops_tracking(shell):
    run(shell, "%gpumem on -q")
    run(shell, "%unload_ext nbmem")
    assert _get_current_dispatch_mode() is None
    run(shell, "%load_ext nbmem")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%%gpumem --backend bogus\n1", "use one of auto, measured, cuda, tracked"),
        ("%%gpumem --nonsense\n1", "unrecognized arguments"),
        ("%%gpumem on\n1", "takes only options"),
        ("%gpumem", "needs an action"),
        ("%gpumem sideways", "use one of on, off, history, reset"),
        ("%%gpumem --device tpu:0\n1", "device"),
        ("%%gpumem --device cuda:0\n1", "no CUDA device is available"),
        ("%%gpumem --backend cuda\n1", "needs a CUDA device"),
    ],
)
def test_bad_options_raise_usage_error_saying_what_is_allowed(shell, line, message):
    if "cuda" in line and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    result, captured = run(shell, line)
    assert not result.success
    assert "UsageError" in captured.stderr + captured.stdout
    assert message in captured.stderr + captured.stdout


def test_help_has_usage_options_and_examples(shell):
    doc = shell.find_line_magic("gpumem").__doc__
    for part in ("Usage", "Examples", "--backend", "--device", "-o", "-q", "--text", "%gpumem on", "%gpumem history"):
        assert part in doc


def test_history_needs_the_extension():
    from IPython.core.interactiveshell import InteractiveShell

    class Bare:
        magics_manager = type("M", (), {"registry": {}})()

    with pytest.raises(RuntimeError, match="%load_ext nbmem"):
        nbmem.history(Bare())
    assert InteractiveShell  # imported for the real shell type used elsewhere


def test_history_in_plain_python_says_what_to_do_instead(monkeypatch):
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: None)  # as in `python script.py`
    with pytest.raises(RuntimeError, match=r"this is plain Python .*nbmem\.History\(\[first\.result, second\.result\]\)"):
        nbmem.history()


def test_history_in_a_shell_without_the_extension_says_how_to_load_it(shell):
    nbmem.unload_ipython_extension(shell)
    try:
        with pytest.raises(RuntimeError, match="extension is not loaded in this shell: run `%load_ext nbmem`"):
            nbmem.history()
    finally:
        nbmem.load_ipython_extension(shell)


def test_history_is_the_sessions_measured_cells(shell):
    shell.run_cell("import torch")
    run(shell, "%%gpumem -q --backend tracked --device cpu\nc = torch.zeros(256)")
    cells = nbmem.history()
    assert len(cells) == 1 and cells[-1].label == "c = torch.zeros(256)"
    assert cells[-1].retained == 256 * 4  # 1024 bytes: two 512 B blocks, no rounding
    del shell.user_ns["c"]
    assert nbmem.history() is cells  # live: the session's own History


@pytest.mark.slow  # a fresh interpreter in a subprocess
def test_history_in_a_real_python_process_raises_the_advice():
    import subprocess
    import sys

    code = "import nbmem\ntry:\n    nbmem.history()\nexcept RuntimeError as error:\n    print(error)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "this is plain Python (no IPython shell is running)" in done.stdout


def test_profile_log_keeps_its_backend_whatever_the_notebook_turns_off(shell, tmp_path):
    from nbmem.frontend.magics import log_every_cell

    log = tmp_path / "cells.jsonl"
    log_every_cell(shell, str(log), backend="tracked")
    shell.run_cell("import torch")
    run(shell, "%gpumem on -q")
    run(shell, "%gpumem off -q")
    run(shell, "e = torch.zeros(256)")
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and '"mode": "tracked"' in lines[-1] and '"retained": 1024' in lines[-1]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        log_every_cell(shell, str(log), backend="cuda") if not torch.cuda.is_available() else pytest.skip()
    from nbmem.frontend.magics import _session

    _session(shell).log_path = None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # argparse took -5GB for an option: "expected one argument"
        ("%%gpumem --capacity -5GB\n1", "can't read '-5GB' as a capacity"),
        ("%gpumem on --capacity -5GB", "can't read '-5GB' as a capacity"),
        # shlex's bare ValueError("No closing quotation")
        ("%%gpumem --capacity '16 GiB\n1", "No closing quotation): close the quote, e.g. --capacity '16 GiB'"),
    ],
)
def test_option_values_are_read_as_a_shell_reads_them(shell, line, message):
    result, captured = run(shell, line)
    output = captured.stderr + captured.stdout
    assert isinstance(result.error_before_exec or result.error_in_exec, UsageError), output
    assert message in output and "expected one argument" not in output


def test_a_size_with_a_space_can_be_quoted(shell):
    # '16 GiB' is the form nbmem's own capacity error suggests ('512 MiB'). The capacity is the whole
    # virtual device, so what earlier tests left alive in this process counts too: a roomy one to fit
    result, captured = run(shell, "%%gpumem -o --capacity '16 GiB'\nimport torch\nsmall = torch.zeros(256)")
    assert result.success, captured.stderr
    assert result.result.capacity == 16 << 30 and result.result.peak == 256 * 4
    result, captured = run(shell, '%%gpumem -q --capacity "1 KiB"\nbig = torch.zeros(257)')  # 1028 > 1024 bytes
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)


def test_a_trailing_semicolon_hides_the_cells_value_as_ipython_does(shell):
    result, captured = run(shell, "%%gpumem --text\n40 + 2;")
    assert result.success and result.result is None  # nothing for Out
    shown = texts(captured)
    assert len(shown) == 1 and shown[0].startswith("gpumem 40 + 2;: tracked")  # the report alone
    assert "42" not in captured.stdout
    result, captured = run(shell, "%%gpumem --text\n40 + 2")
    assert result.result == 42  # without the `;`, the value is the cell's Out
    # with -o the result would have been Out; silenced, the report shows instead, and the value does not
    result, captured = run(shell, "%%gpumem -o --text\n40 + 2;")
    assert result.result is None
    assert [text.split(":")[0] for text in texts(captured)] == ["gpumem 40 + 2;"]
    result, captured = run(shell, "%gpumem history -o;")
    assert result.success and result.result is None


def _shown(captured) -> str:
    """What a cell printed, its cell number made neutral (two runs of the same code get different ones)."""
    return re.sub(r"In\[\d+\]", "In[N]", captured.stdout + captured.stderr)


NBMEM_FRAMES = ("nbmem/frontend/magics.py", "_measure_cell", "transform_ast", "run_cell_magic")


def _clean_and_measuring(shell, measured: int) -> None:
    """Nothing was measured or left installed by the failed cell, and the next %%gpumem cell is measured."""
    assert len(nbmem.history(shell)) == measured and _get_current_dispatch_mode() is None
    tracker = default_tracker("cpu")
    assert not tracker.active and len(tracker.scopes) == 0
    result, _ = run(shell, "%%gpumem -q\nafter = 1")
    assert result.success and len(nbmem.history(shell)) == measured + 1


@pytest.mark.parametrize(
    "code",
    [
        "x = (1,\ny = 2",  # the parser's error
        "def f(:\n    pass",
        "never_assigned = 1\nreturn 5",  # the compiler's: parses, but can't run at top level
        "yield 3",
    ],
)
def test_a_syntax_error_shows_as_ipython_shows_it_and_runs_nothing(shell, code):
    measured = len(nbmem.history(shell))
    result, captured = run(shell, "%%gpumem\n" + code)
    assert "never_assigned" not in shell.user_ns  # no line of a measured cell runs unmeasured
    plain, plain_captured = run(shell, code)
    shell.user_ns.pop("never_assigned", None)  # plain IPython ran the line before the `return`
    shown = _shown(captured)
    assert not any(frame in shown for frame in NBMEM_FRAMES), shown
    assert shown == _shown(plain_captured)  # only the cell's name, line and caret: no frames at all
    assert "Cell In[N], line" in shown and plain.error_before_exec.text.strip() in shown  # the user's line
    # a SyntaxError before the cell ran, as IPython has it
    assert type(result.error_before_exec) is type(plain.error_before_exec) is SyntaxError
    assert result.error_before_exec.msg == plain.error_before_exec.msg
    _clean_and_measuring(shell, measured)


def test_a_cell_that_awaits_at_top_level_is_refused_as_ipython_refuses_it(shell):
    measured = len(nbmem.history(shell))
    code = "import asyncio\nawait asyncio.sleep(0)"
    result, captured = run(shell, "%%gpumem\n" + code)
    shown = _shown(captured)
    assert not any(frame in shown for frame in NBMEM_FRAMES), shown
    assert isinstance(result.error_before_exec, SyntaxError)
    assert "asyncio" not in shell.user_ns  # the cell did not run in part
    autoawait, shell.autoawait = shell.autoawait, False  # IPython's own error for a top-level await it can't run
    try:
        plain, plain_captured = run(shell, code)
        location, message = _shown(plain_captured).rstrip().rsplit("\n", 1)
        assert message == "SyntaxError: 'await' outside function"
        # the same error, saying how to measure such a cell
        assert shown.startswith(f"{location}\n{message}: ") and "run `%gpumem on` before it" in shown
        result, captured = run(shell, "%%gpumem\n" + code)
        assert _shown(captured) == _shown(plain_captured)  # IPython can't await here either: nothing to add
    finally:
        shell.autoawait = autoawait
    _clean_and_measuring(shell, measured)


@pytest.mark.parametrize(
    ("action", "wrong", "takes", "right"),
    [
        ("on", "--timeline", "-q, --no-live, --capacity, --device, --backend, --engine", "-q --no-live --capacity T4"),
        ("off", "--text", "-q", "-q"),
        ("history", "--capacity T4", "-o, -q, --text", "-q --text"),
        ("reset", "--breakdown", "-q", "-q"),
        ("free", "--engine native", "-o, -q, --device", "-q --device cpu"),
    ],
)
def test_an_option_that_means_nothing_for_the_action_is_refused(shell, action, wrong, takes, right):
    from nbmem.frontend.magics import _session

    result, captured = run(shell, f"%gpumem {action} {wrong}")
    output = captured.stderr + captured.stdout
    assert isinstance(result.error_in_exec, UsageError), output
    option = wrong.split()[0]
    assert f"%gpumem {action} takes {takes}; {option} means nothing here" in output
    assert _session(shell).every_cell is None  # refused before doing anything
    result, captured = run(shell, f"%gpumem {action} {right}")
    assert result.success, captured.stderr + captured.stdout
    run(shell, "%gpumem off -q")


@pytest.mark.parametrize("line", ["%gpumem --help", "%gpumem on -h", "%%gpumem --help\nx = 1"])
def test_asking_for_help_shows_the_usage_and_where_the_rest_is(shell, line):
    result, captured = run(shell, line)
    assert isinstance(result.error_in_exec, UsageError)
    said = captured.stderr + captured.stdout
    assert "usage: %gpumem" in said and "%gpumem?" in said and "unrecognized arguments" not in said


def test_every_option_that_means_nothing_is_named(shell):
    result, captured = run(shell, "%gpumem reset -o --free-on-oom --backend tracked")
    assert isinstance(result.error_in_exec, UsageError)
    assert "%gpumem reset takes -q; -o, --free-on-oom, --backend mean nothing here" in captured.stderr + captured.stdout


def test_the_usage_in_the_help_lists_the_options_each_action_takes(shell):
    from nbmem.frontend.options import ACTION_OPTIONS, option_names

    doc = shell.find_line_magic("gpumem").__doc__
    parser = shell.find_line_magic("gpumem").parser
    for action, options in ACTION_OPTIONS.items():
        (usage,) = re.findall(rf"^\s*%gpumem {action} ((?:\[[^\]]+\]\s*)+)", doc, re.MULTILINE)
        written = [word.split()[0] for word in re.findall(r"\[([^\]]+)\]", usage)]
        assert written == option_names(parser, options), action
