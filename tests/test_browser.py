"""A real browser: JupyterLab on localhost, driven by Playwright in Debian's Chromium.

Opens the quickstart notebook, runs every cell, and checks that nbmem's
widgets rendered as widgets (their DOM elements, not the text fallback);
then the what-if notebook's explorer panel, moved by its slider. Screenshots
of what rendered go to the test's folder, and to ``NBMEM_SCREENSHOTS`` when
set (the README's pictures come from there). The server runs only inside the
fixture and is stopped, and waited for, whatever happens.

Chromium is Debian's (``apt-get install chromium``, as ``.ci/run`` does):
without it these tests are skipped, unless ``NBMEM_REQUIRE_BROWSER=1`` (CI)
makes that a failure.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # NBMEM_HEAVY=1 runs it (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("NBMEM_CHROMIUM", "/usr/bin/chromium")


def _require() -> None:
    missing = [what for what, ok in [
        (f"Chromium at {CHROMIUM}", Path(CHROMIUM).exists()),
        ("the playwright package", _importable("playwright")),
        ("JupyterLab", _importable("jupyterlab")),
    ] if not ok]
    if missing:
        reason = f"needs {', '.join(missing)} (apt-get install chromium; pip install -e '.[test]')"
        if os.environ.get("NBMEM_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A JupyterLab server on localhost over a copy of the notebooks; stopped afterwards, whatever happens."""
    _require()
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(REPO / "notebooks", root / "notebooks")
    port, token = _free_port(), secrets.token_hex(16)
    # every cell in the page, not only those scrolled into view (JupyterLab 4 renders lazily by default)
    settings = root / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    # and no "get notified about Jupyter news?" toast over the screenshots
    notices = root / "settings" / "@jupyterlab" / "apputils-extension"
    notices.mkdir(parents=True)
    (notices / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ServerApp.port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root / 'notebooks'}", "--ServerApp.allow_root=True",
         "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={root / 'settings'}",
         f"--LabApp.workspaces_dir={root / 'workspaces'}", "--ServerApp.port_retries=0"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, env={**os.environ, "JUPYTER_PLATFORM_DIRS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise RuntimeError(f"JupyterLab did not start:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "root": root}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)
        log.close()


@pytest.fixture(scope="module")
def browser(lab: dict[str, Any]) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


def _shoot(element: Any, name: str, lab: dict[str, Any]) -> Path:
    path = lab["root"] / name
    element.screenshot(path=str(path))
    if os.environ.get("NBMEM_SCREENSHOTS"):
        shutil.copy(path, Path(os.environ["NBMEM_SCREENSHOTS"]) / name)
    return path


def _open_and_run(browser: Any, lab: dict[str, Any], name: str, *, until_done: bool = True) -> Any:
    """The notebook opened in a new page with every cell run; ``until_done=False`` returns as the run starts."""
    page = browser.new_page(viewport={"width": 1200, "height": 900}, device_scale_factor=2)
    page.set_default_timeout(float(os.environ.get("NBMEM_BROWSER_TIMEOUT", "180")) * 1000)
    # a workspace of its own, reset: only this notebook open, whatever the previous page left
    workspace = name.split(".")[0]
    page.goto(f"{lab['url']}/lab/workspaces/{workspace}/tree/{name}?reset&token={lab['token']}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
    page.wait_for_function("(name) => { const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                           " return panel && panel.context && panel.context.path === name"
                           " && panel.sessionContext && panel.sessionContext.session; }", arg=name)
    # evaluate waits for a returned promise: run-all's resolves when the last cell has run
    run = "window.jupyterapp.commands.execute('notebook:run-all-cells')"
    page.evaluate(f"() => {run}" if until_done else f"() => {{ {run}; }}")
    return page


def _wait_idle(page: Any) -> None:
    """Until the kernel has run every cell (no cell waiting or running: no '[*]' prompt)."""
    page.wait_for_function(
        "() => { const panel = window.jupyterapp.shell.currentWidget;"
        " return panel.sessionContext.session.kernel.status === 'idle'"
        " && !Array.from(document.querySelectorAll('.jp-InputPrompt')).some(p => p.textContent.includes('*')); }"
    )


def test_the_quickstart_renders_nbmem_widgets(browser: Any, lab: dict[str, Any]) -> None:
    page = _open_and_run(browser, lab, "01-quickstart.ipynb")
    try:
        page.wait_for_selector(".jp-OutputArea-output .nbmem-report-widget", state="attached")
        _wait_idle(page)
        assert _errors(page) == []
        reports = page.locator(".jp-OutputArea-output .nbmem-report-widget")
        assert reports.count() == 2  # two %%gpumem cells shown as live widgets (the -o one returns its result as Out)
        first = reports.first
        assert "jupyter-widgets" in (first.get_attribute("class") or "")  # rendered by ipywidgets, not text
        first.scroll_into_view_if_needed()
        assert first.locator(".nbmem-bar-widget").count() == 1
        assert "peak" in first.inner_text()
        assert page.locator(".jp-OutputArea-output:has-text('widget model not found')").count() == 0
        screenshot = _shoot(first, "browser-report.png", lab)
        assert screenshot.stat().st_size > 2000
        history = page.locator(".jp-OutputArea-output .nbmem-history").first
        history.scroll_into_view_if_needed()
        assert history.locator("tbody tr").count() >= 6
        chart = page.locator(".jp-Cell:has(.jp-InputArea:has-text('%gpumem history'))").locator(".jp-OutputArea").first
        assert chart.locator("img").count() == 1  # the history's bar chart
        _shoot(chart, "browser-history.png", lab)
    finally:
        page.close()


#: A tracked cell that runs about 10 s on a virtual 32 MiB device, holding 1 MiB more every half
#: second and letting 8 MiB go after 13 steps (issue 15's live gauge): the peak is 13 MiB.
LIVE_GAUGE_CELLS = [
    "%load_ext nbmem",
    "import time, torch",
    "%%gpumem --capacity 32MiB\nkept = []\nfor step in range(20):\n"
    "    kept.append(torch.zeros(256, 1024))  # 256 * 1024 * 4 B = 1 MiB a step\n"
    "    if step == 12:\n        del kept[:8]\n    time.sleep(0.5)\ndel kept",
]
GAUGE_TEXT = "() => { const g = document.querySelector('.jp-OutputArea-output .nbmem-gauge-text'); return g ? g.innerText : null; }"


def test_a_long_tracked_cell_shows_the_live_gauge_then_its_report(browser: Any, lab: dict[str, Any]) -> None:
    """Issue 15: while the cell runs, the gauge's figures change; at the end the report takes its place.

    The gauge lives only while the cell runs: it is read here, every tenth
    of a second, while the run goes on.
    """
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in LIVE_GAUGE_CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab["root"] / "notebooks" / "live-gauge.ipynb")
    page = _open_and_run(browser, lab, "live-gauge.ipynb", until_done=False)
    try:
        seen: list[str] = []
        screenshot = None
        for _ in range(6000):  # protection against a hang only (the cell runs about 10 s)
            text = page.evaluate(GAUGE_TEXT)
            if text is not None and text not in seen:
                seen.append(text)
                now, peak = re.findall(r"(?:now|so far) \+([0-9.]+) MiB", text) or ("", "")
                if now and now != peak and screenshot is None:  # after the drop: now below the peak so far
                    screenshot = _shoot(page.locator(".jp-Cell:has(.nbmem-gauge)").first, "browser-live-gauge.png", lab)
            if page.locator(".jp-OutputArea-output .nbmem-report-widget").count():
                break
            time.sleep(0.1)
        assert len(seen) >= 2, f"the gauge's text never changed while the cell ran: {seen}"
        assert all(text.startswith("gpumem live · tracked on cpu · allocated now") and "of virtual 32.0 MiB" in text for text in seen)
        assert screenshot is not None and screenshot.stat().st_size > 2000
        _wait_idle(page)
        assert _errors(page) == []
        # the report replaced the gauge in its output: one output, no gauge left
        outputs = page.locator(".jp-Cell:has(.nbmem-report-widget) .jp-OutputArea-output")
        assert outputs.count() == 1 and page.locator(".nbmem-gauge").count() == 0
        assert "peak +13.0 MiB allocated" in outputs.first.inner_text()  # 13 steps * 1 MiB before the drop
        # and the probe comm of %load_ext was refused (closed) by JupyterLab: the kernel knows it is watched
        answered = page.evaluate(
            "async () => { const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
            " let text = ''; const future = kernel.requestExecute({code: 'from nbmem.frontend import magics; "
            "print(magics._registered(get_ipython()).session.frontend.answered)', store_history: false});"
            " future.onIOPub = (msg) => { if (msg.header.msg_type === 'stream') text += msg.content.text; };"
            " await future.done; return text; }"
        )
        assert answered == "True\n"
    finally:
        page.close()


def _errors(page: Any) -> list[str]:
    """Tracebacks shown in the notebook's outputs."""
    shown = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all_inner_texts()
    return [text for text in shown if "Traceback" in text or "Error" in text]


def test_the_explorer_panel_answers_its_slider(browser: Any, lab: dict[str, Any]) -> None:
    page = _open_and_run(browser, lab, "03-batch-size-and-accumulation.ipynb")
    try:
        try:
            panel = page.wait_for_selector(".nbmem-explore", state="attached")
        except Exception:
            page.screenshot(path=str(lab["root"] / "explorer-failed.png"), full_page=True)
            raise AssertionError(f"no explorer panel; errors shown: {_errors(page)}; "
                                 f"page: {lab['root'] / 'explorer-failed.png'}") from None
        _wait_idle(page)
        panel.scroll_into_view_if_needed()
        chart = page.locator(".nbmem-explore .nbmem-explore-chart")
        before = chart.inner_text()
        assert "estimated peak on" in before and page.locator(".nbmem-explore .nbmem-explore-bar").count() == 1
        _shoot(page.locator(".nbmem-explore").first, "browser-explore.png", lab)
        # the rest of the what-if notebook: the sweep's table and plot, a breakdown widget
        sweep = page.locator(".jp-OutputArea-output .nbmem-sweep").first
        assert sweep.locator("table tr").count() >= 4
        _shoot(sweep, "browser-sweep.png", lab)
        plot = page.locator(".jp-Cell:has(.jp-InputArea:has-text('table.plot()'))").locator(".jp-OutputArea-output img")
        assert plot.count() == 1
        _shoot(plot, "browser-sweep-plot.png", lab)
        breakdown = page.locator(".jp-OutputArea-output .nbmem-report-widget:has(.nbmem-breakdown-widget)").first
        assert "parameter" in breakdown.inner_text()
        _shoot(breakdown, "browser-breakdown.png", lab)
        # move the batch size slider with the keyboard: the chart is estimated again
        handle = page.locator(".nbmem-explore .noUi-handle, .nbmem-explore .slider-handle, .nbmem-explore input[type=range]").first
        handle.focus()
        for _ in range(5):
            page.keyboard.press("ArrowRight")
        page.wait_for_function(
            "(old) => document.querySelector('.nbmem-explore .nbmem-explore-chart').innerText !== old", arg=before
        )
        assert "estimated peak on" in chart.inner_text()
    finally:
        page.close()


def test_a_long_sweep_shows_its_progress(browser: Any, lab: dict[str, Any]) -> None:
    """Issue 15: a sweep's progress widget, seen while it runs and when it is done."""
    import nbformat

    setup = ("import time, torch, nbmem\n"
             "build = lambda: torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))\n"
             "def make_batch(n):\n"
             "    time.sleep(1)  # a slow data pipeline: each configuration takes a moment, so the running line is seen\n"
             "    return torch.randn(n, 256), torch.randint(0, 10, (n,))")
    sweep = ("table = nbmem.sweep(build, make_batch, batch_size=[256, 1024, 4096], precision=['fp32', 'bf16'], "
             "mode='tracked', device='T4')\ntable")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(setup)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab["root"] / "notebooks" / "progress.ipynb")
    page = _open_and_run(browser, lab, "progress.ipynb")
    try:
        # the sweep in a cell of its own, not awaited: _open_and_run returns when its cells have run, and the
        # progress is to be seen while the sweep runs
        _wait_idle(page)
        page.evaluate("(source) => { const app = window.jupyterapp;"
                      " return app.commands.execute('notebook:insert-cell-below').then(() => {"
                      " app.shell.currentWidget.content.activeCell.model.sharedModel.setSource(source);"
                      " app.commands.execute('notebook:run-cell'); }); }", sweep)
        progress = page.locator(".jp-OutputArea-output .nbmem-progress").first
        progress.wait_for(state="attached")
        # while it runs: which configuration, how many remain, what the finished ones gave
        seen = page.wait_for_function("() => { const view = document.querySelector('.nbmem-progress');"
                                      " return view && view.innerText.includes('configuration 4 of 6')"
                                      " && view.innerText.includes('remaining') && view.innerText; }", polling=100)
        running = seen.json_value()
        assert "gpumem sweep, tracked on T4" in running and "3 done, 3 remaining" in running
        assert "batch_size=256, precision=fp32: peak 6.43 MiB allocated, tracked" in running  # as the table says
        progress.scroll_into_view_if_needed()
        screenshot = _shoot(progress, "browser-progress.png", lab)
        assert screenshot.stat().st_size > 2000
        _wait_idle(page)
        assert _errors(page) == []
        done = progress.inner_text()
        assert "done: 6 of 6 configurations in" in done and "jupyter-widgets" in (progress.get_attribute("class") or "")
        assert page.locator(".jp-OutputArea-output .nbmem-sweep").count() == 1  # and then the table
    finally:
        page.close()
