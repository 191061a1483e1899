"""The live gauge (issue 15): readings in exact bytes, the magic's live path, and where nothing live shows.

In-process tests force a watching frontend (``session.frontend`` answered),
as IPython's test shell is a terminal; the nbclient test runs a real kernel
that nobody watches. Cells wait for the gauge's own outputs, never for a
time: no wall-clock assertion anywhere.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch
from IPython.utils.capture import capture_output

import nbmem
from nbmem.core import _env
from nbmem.frontend import magics
from nbmem.frontend.live_gauge import THREAD_NAME, GaugeReading, LiveGauge

MiB = 1024**2


def gauge_threads() -> list[threading.Thread]:
    """nbmem's gauge threads still alive, after giving a stopping one a moment to end."""
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME:
            thread.join(2.0)  # told to stop (or its scope stopped): it ends within one tick
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME and thread.is_alive()]


def wait_for(readings: list, predicate) -> None:
    """Until a reading satisfies ``predicate`` (the gauge ticks every few ms in these tests)."""
    event = threading.Event()
    for _ in range(60000):  # protection against a hang only
        if any(predicate(reading) for reading in list(readings)):
            return
        event.wait(0.005)
    raise AssertionError("no reading satisfied the test")


# -- readings ----------------------------------------------------------------


def test_a_reading_says_mode_device_allocated_and_peak():
    reading = GaugeReading("measured", "cuda:0", allocated=MiB, peak=3 * MiB, capacity=None, seconds=12.34)
    assert reading.text() == "gpumem live · measured on cuda:0 · allocated now +1.00 MiB · peak so far +3.00 MiB · 12.3 s"
    # no capacity: the bar is scaled to the peak, and says so; allocated 1 of 3 MiB = 33.33 %
    html = reading.html()
    assert "width:33.33%" in html and "bar scaled to the peak so far" in html
    capped = GaugeReading("tracked", "cpu", allocated=MiB, peak=2 * MiB, capacity=8 * MiB, seconds=1.0)
    # 2 MiB / 8 MiB = 25.0 % (peak marker); 1 / 8 = 12.5 % (allocated now)
    assert "(25.0% of 8.00 MiB)" in capped.text()
    assert "width:12.50%" in capped.html() and "left:25.00%" in capped.html()
    assert "nbmem-gauge-bar" not in capped.html(compact=True)
    virtual = GaugeReading("tracked", "cpu", MiB, 2 * MiB, 8 * MiB, 1.0, capacity_label="virtual")
    assert "(25.0% of virtual 8.00 MiB)" in virtual.text()


def test_tracked_gauge_reads_exact_bytes_now_and_peak():
    readings: list[GaugeReading] = []
    with nbmem.track("cpu") as scope:
        gauge = LiveGauge(scope, readings.append, delay=0.0, interval=0.002).start()
        big = torch.zeros(1024, 1024)  # 1024 * 1024 * 4 B = 4 MiB
        wait_for(readings, lambda r: r.allocated == 4 * MiB)
        del big
        small = torch.zeros(256, 1024)  # 256 * 1024 * 4 B = 1 MiB; this op drains the freed 4 MiB first
        wait_for(readings, lambda r: r.allocated == MiB)
        gauge.stop()
    last = readings[-1]
    assert (last.allocated, last.peak, last.mode, last.device) == (MiB, 4 * MiB, "tracked", "cpu")
    assert scope.result.peak == 4 * MiB  # the gauge's peak so far is the report's peak
    assert gauge.usable and gauge_threads() == []
    del small


def test_the_gauge_ends_by_itself_when_its_scope_stops():
    """A Ctrl-C may skip LiveGauge.stop(); the stopped scope ends the thread anyway."""
    readings: list[GaugeReading] = []
    with nbmem.track("cpu") as scope:
        gauge = LiveGauge(scope, readings.append, delay=0.0, interval=0.002).start()
        wait_for(readings, lambda r: True)
    assert gauge.thread is not None
    gauge.thread.join(2.0)
    assert not gauge.thread.is_alive() and gauge_threads() == []


def test_a_failing_display_turns_the_gauge_off_with_one_warning_and_the_block_runs_on():
    calls = []

    def broken(reading: GaugeReading) -> None:
        calls.append(reading)
        raise ConnectionError("frontend went away")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nbmem.track("cpu") as scope:
            gauge = LiveGauge(scope, broken, delay=0.0, interval=0.002).start()
            assert gauge.thread is not None
            gauge.thread.join(5.0)  # it stops by itself after the first failure
            kept = torch.zeros(1024)  # 4 KiB: the block carries on
        gauge.stop()
    assert len(calls) == 1 and isinstance(gauge.failure, ConnectionError) and not gauge.usable
    (warning,) = [w for w in caught if "live gauge" in str(w.message)]
    assert warning.category is RuntimeWarning and "--no-live" in str(warning.message)
    assert scope.result.retained == 4096  # 1024 * 4 B, unaffected
    del kept


# -- the magic -----------------------------------------------------------------


@pytest.fixture
def watched(shell, monkeypatch):
    """The shell as if JupyterLab were watching (the probe answered), gauges ticking every few ms."""
    probe = _env.FrontendProbe()
    probe.answered = True
    magics._registered(shell).session.frontend = probe
    monkeypatch.setattr(magics, "CELL_DELAY", 0.0)
    monkeypatch.setattr("nbmem.frontend.session.LINE_DELAY", 0.0)  # %gpumem on's live line
    monkeypatch.setattr("nbmem.frontend.live_gauge.INTERVAL", 0.005)
    shell.user_ns["torch"] = torch
    yield shell
    assert gauge_threads() == []


# the cell waits until the gauge has shown the 4 MiB it holds: no sleeping, no timing
# (a bound on the number of waits, as protection against a hang only)
WAIT_FOR_GAUGE = (
    "kept = torch.zeros(1024, 1024)\n"  # 4 MiB
    "import threading\n"
    "for attempt in range(60000):\n"  # not `_`: IPython would stop setting it (test_magics reads it)
    "    if any('allocated now +4.00 MiB' in o['data']['text/plain'] for o in list(get_ipython().display_pub.outputs)):\n"
    "        break\n"
    "    threading.Event().wait(0.005)\n"
    "else:\n"
    "    raise AssertionError('the gauge never showed the 4 MiB')\n"
)


def published(captured) -> list[dict]:
    return list(captured._outputs)  # dicts with data, transient and update, as published


def test_a_long_cell_shows_the_gauge_then_the_report_in_its_place(watched):
    with capture_output() as captured:
        result = watched.run_cell("%%gpumem\n" + WAIT_FOR_GAUGE, store_history=True)
    assert result.success
    outputs = published(captured)
    first, last = outputs[0], outputs[-1]
    display_id = first["transient"]["display_id"]
    assert not first["update"] and first["data"]["text/plain"].startswith("gpumem live · tracked on cpu · allocated now ")
    assert "nbmem-gauge-bar" in first["data"]["text/html"]
    # every later output updates that one: the gauge, then the report in its place (no second output)
    assert all(o["update"] and o["transient"]["display_id"] == display_id for o in outputs[1:])
    report = nbmem.history(watched)[-1]
    assert last["data"]["text/plain"] == report.text() and report.retained == 4 * MiB  # 1024 * 1024 * 4 B
    del watched.user_ns["kept"]


@pytest.mark.parametrize("options", ["--no-live", "-q", "--text"])
def test_no_live_quiet_and_text_show_nothing_live(watched, options):
    with capture_output() as captured:
        watched.run_cell(f"%%gpumem {options}\nkept = torch.zeros(1024, 1024)\nimport time; time.sleep(0.05)")
    assert all(not o["transient"] for o in published(captured))
    assert len(published(captured)) == (0 if options == "-q" else 1)
    del watched.user_ns["kept"]


def test_nobody_watching_shows_exactly_what_it_showed_before(shell):
    """A terminal, or a kernel whose probe no frontend answered: one report, no display id, no thread."""
    shell.user_ns["torch"] = torch
    with capture_output() as captured:
        shell.run_cell("%%gpumem\nkept = torch.zeros(1024)\nimport time; time.sleep(0.05)")
    (output,) = published(captured)
    assert not output["transient"] and not output["update"] and "+4.00 KiB" in output["data"]["text/plain"]
    assert gauge_threads() == []
    del shell.user_ns["kept"]


def test_every_cell_shows_a_live_line_then_its_summary_in_place(watched):
    watched.run_cell("%gpumem on -q")  # -q: no "every cell from now on" message, and no live line
    with capture_output() as captured:
        watched.run_cell("kept = torch.zeros(1024)\nimport time; time.sleep(0.05)", store_history=True)
    assert published(captured) == []
    watched.run_cell("%gpumem on")
    with capture_output() as captured:
        watched.run_cell(WAIT_FOR_GAUGE.replace("kept", "again"), store_history=True)
    outputs = published(captured)
    display_id = outputs[0]["transient"]["display_id"]
    assert "nbmem-gauge-line" in outputs[0]["data"]["text/html"]  # compact: no bar
    assert outputs[-1]["update"] and outputs[-1]["transient"]["display_id"] == display_id
    assert outputs[-1]["data"]["text/plain"] == nbmem.history(watched)[-1].summary()
    watched.run_cell("%gpumem on --no-live")
    with capture_output() as captured:
        watched.run_cell("third = torch.zeros(1024)\nimport time; time.sleep(0.05)", store_history=True)
    (line,) = published(captured)
    assert not line["transient"] and line["data"]["text/plain"] == nbmem.history(watched)[-1].summary()
    watched.run_cell("%gpumem off -q")
    for name in ("kept", "again", "third"):
        watched.user_ns.pop(name, None)


def test_ctrl_c_in_a_watched_cell_leaves_no_thread_and_reports_failed_in_place(watched):
    with capture_output() as captured:
        result = watched.run_cell("%%gpumem\n" + WAIT_FOR_GAUGE + "raise KeyboardInterrupt\n", store_history=True)
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    outputs = published(captured)
    assert outputs[-1]["transient"]["display_id"] == outputs[0]["transient"]["display_id"]
    assert "FAILED" in outputs[-1]["data"]["text/plain"] and "KeyboardInterrupt" in outputs[-1]["data"]["text/plain"]
    assert gauge_threads() == []  # the fixture checks again
    watched.user_ns.pop("kept", None)


# -- a real kernel nobody watches --------------------------------------------------


LONG_CELL = "import time, torch\nkept = torch.zeros(1024, 1024)\ntime.sleep(1.5)\ndel kept"  # every cell starts alike


@pytest.mark.slow
def test_nbclient_outputs_are_unchanged_by_the_gauge(tmp_path: Path):
    """Under nbclient the probe goes unanswered: a long cell's outputs are those of the same cell with --no-live."""
    import nbformat

    from _notebooks import execute

    cells = [
        "%load_ext nbmem",
        "%%gpumem --text\n" + LONG_CELL,
        "%%gpumem --text --no-live\n" + LONG_CELL,
        "%%gpumem\n" + LONG_CELL,
        "%%gpumem --no-live\n" + LONG_CELL,
        "from nbmem.frontend import magics\nprint(magics._registered(get_ipython()).session.frontend.answered)",
    ]
    path = tmp_path / "long.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)
    ran, _ = execute(path)
    live_text, quiet_text, live_rich, quiet_rich, answered = ran.cells[1:]

    def plain(cell) -> list[str]:  # the report's lines, its time (which differs run to run) left out
        return [line for line in cell.outputs[0]["data"]["text/plain"].splitlines() if "time" not in line]

    assert [len(cell.outputs) for cell in (live_text, quiet_text, live_rich, quiet_rich)] == [1, 1, 1, 1]
    assert [o.output_type for o in live_rich.outputs] == ["display_data"]
    assert plain(live_text) == plain(quiet_text) and set(live_rich.outputs[0]["data"]) == set(quiet_rich.outputs[0]["data"])
    assert "gpumem live" not in nbformat.writes(ran)
    assert answered.outputs[0]["text"] == "False\n"
