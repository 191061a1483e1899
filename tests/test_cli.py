"""``nbmem profile``: real notebooks run in real kernels, checked the way a user reads the output.

Every figure is tracked on the CPU, so it is exact:
``torch.zeros(1024, 1024)`` is 1024 * 1024 * 4 bytes = 4194304 (4.00 MiB) and
``torch.zeros(256)`` is 256 * 4 bytes = 1024, already a multiple of the 512 B
block. Each kernel start costs a few seconds, so one test checks several
things where one run can show them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from _processes import gone
from nbmem.frontend import cli

pytestmark = pytest.mark.slow

FOUR_MIB = 1024 * 1024 * 4  # torch.zeros(1024, 1024), float32
ONE_KIB = 256 * 4  # torch.zeros(256), float32


def write_notebook(path: Path, *sources: str, markdown: str = "# A notebook") -> Path:
    """A notebook with one markdown cell, then one code cell per source."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell(markdown)]
    notebook.cells += [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(notebook, path)
    return path


def table_row(out: str, number: int) -> str:
    """The table line of notebook code cell ``number``."""
    rows = [line for line in out.splitlines() if line.startswith(f"[{number}] ")]
    assert len(rows) == 1, f"expected one row for cell [{number}] in:\n{out}"
    return rows[0]


# -- runs a kernel ----------------------------------------------------------------


def test_profile_lines_names_the_lines_that_hold_each_cells_peak(tmp_path, capsys):
    notebook = write_notebook(
        tmp_path / "lines.ipynb",
        "import torch",
        "small = torch.zeros(256)\nbig = torch.zeros(1024, 1024)\ndel small",
    )
    status = cli.main(["profile", str(notebook), "--lines", "--backend", "tracked"])
    out, err = capsys.readouterr()
    assert status == cli.EXIT_OK, out + err
    table = out.split("lines holding the most at each cell's peak:")[1].splitlines()
    rows = [row.split() for row in table if row.startswith("[2]")]
    # cell [2]'s second line made the 4 MiB alive at its peak; its first, 1 KiB (one 1 KiB block)
    assert rows[0][:5] == ["[2]", "line", "2", "4.00", "MiB"] and rows[0][5:] == ["big", "=", "torch.zeros(1024,", "1024)"]
    assert rows[1][:5] == ["[2]", "line", "1", "1.00", "KiB"]


def test_profile_snapshot_writes_each_measured_cell(tmp_path, capsys):
    import nbmem

    notebook = write_notebook(tmp_path / "snap.ipynb", "import torch", "big = torch.zeros(1024, 1024)", "big.mul_(2)")
    status = cli.main(["profile", str(notebook), "--snapshot", str(tmp_path / "snaps"), "--backend", "tracked"])
    out, err = capsys.readouterr()
    assert status == cli.EXIT_OK, out + err
    written = sorted(path.name for path in (tmp_path / "snaps").iterdir())
    assert written == ["cell-2.pickle", "cell-3.pickle"]  # cell 1 held nothing: no snapshot to write
    second = nbmem.load_snapshot(tmp_path / "snaps" / "cell-2.pickle").result()
    assert second.allocated_after - second.allocated_before == FOUR_MIB


def test_profile_lists_every_cell_writes_output_and_fits_budget(tmp_path, monkeypatch, capsys):
    (tmp_path / "data.txt").write_text("read next to the notebook\n")
    notebook = write_notebook(
        tmp_path / "ok.ipynb",
        "import torch",
        "a = torch.zeros(1024, 1024)",
        "%%gpumem -q\nb = torch.zeros(256)",
        "",  # empty: nbclient does not run it, so it is numbered but not listed
        "%gpumem history --text",
        'print(open("data.txt").read())',
    )
    output = tmp_path / "out" / "ran.ipynb"
    output.parent.mkdir()
    # Run from elsewhere: relative paths in the notebook resolve against its folder.
    monkeypatch.chdir(output.parent)

    status = cli.main(["profile", str(notebook), "--max-peak", "1GiB", "--output", str(output)])

    out, err = capsys.readouterr()
    assert status == cli.EXIT_OK, out + err
    assert "[1] " in out and "import torch" in table_row(out, 1)
    # cell: peak, in use at peak, retained
    assert "+4.00 MiB  4.00 MiB        +4.00 MiB" in table_row(out, 2)
    assert "+1.00 KiB  4.00 MiB        +1.00 KiB" in table_row(out, 3)  # the %%gpumem cell
    assert "[4] " not in out
    assert table_row(out, 5).split()[-2:] == ["not", "measured"]  # a %gpumem command
    assert "tracked on cpu" in table_row(out, 6)
    # 4194304 + 1024 = 4195328 bytes in use after cell [3]
    assert f"overall peak: 4.00 MiB allocated ({FOUR_MIB + ONE_KIB} bytes) at cell [3]" in out
    assert "within budget" in out and "1073741824 bytes" in out
    assert err.count("nbmem profile:") == 0

    ran = nbformat.read(output, as_version=4)
    original = nbformat.read(notebook, as_version=4)
    assert [cell.source for cell in ran.cells] == [cell.source for cell in original.cells]
    code = [cell for cell in ran.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == [1, 2, 3, None, 4, 5]
    assert code[5].outputs[0]["text"] == "read next to the notebook\n\n"  # the file's newline, then print's
    # The %%gpumem cell is in the session's history once: it records itself and
    # the every-cell log leaves it alone.
    history = code[4].outputs[0]["data"]["text/plain"]
    assert history.count("b = torch.zeros(256)") == 1
    assert "log_every_cell" not in output.read_text()
    assert ran.metadata["language_info"]["name"] == "python"


def test_failing_cell_exits_1_names_it_and_still_reports(tmp_path, capsys):
    notebook = write_notebook(
        tmp_path / "bad.ipynb",
        "import torch",
        "a = torch.zeros(1024, 1024)\nratio = 1 / 0",
        "b = torch.zeros(256)",
    )
    output = tmp_path / "ran.ipynb"

    status = cli.main(["profile", str(notebook), "--output", str(output)])

    out, err = capsys.readouterr()
    assert status == cli.EXIT_CELL_FAILED
    # The failed cell's figures cover it up to the exception.
    assert "+4.00 MiB" in table_row(out, 2)
    assert "FAILED (ZeroDivisionError)" in table_row(out, 2)
    assert "not run after the failure: [3]" in out
    assert f"overall peak: 4.00 MiB allocated ({FOUR_MIB} bytes) at cell [2]" in out
    assert "cell [2] failed: ZeroDivisionError: division by zero (first line: a = torch.zeros(1024, 1024))" in err
    assert "----> 2 ratio = 1 / 0" in err  # the traceback, without terminal colours
    assert "\x1b[" not in err

    ran = nbformat.read(output, as_version=4)
    code = [cell for cell in ran.cells if cell.cell_type == "code"]
    assert len(ran.cells) == 4  # markdown + 3 code cells, no setup cell
    assert code[1].outputs[0]["output_type"] == "error"
    assert code[2].execution_count is None


def test_max_peak_exceeded_exits_3_naming_the_cell(tmp_path, capsys):
    notebook = write_notebook(
        tmp_path / "budget.ipynb",
        "import torch",
        "a = torch.zeros(1024, 1024)\ndel a",  # 4 MiB at its peak, nothing kept
        "b = torch.zeros(256)",
    )

    status = cli.main(["profile", str(notebook), "--max-peak", "1MiB"])

    out, err = capsys.readouterr()
    assert status == cli.EXIT_OVER_BUDGET
    assert "+4.00 MiB  4.00 MiB        0 B" in table_row(out, 2)
    assert "+1.00 KiB  1.00 KiB        +1.00 KiB" in table_row(out, 3)
    assert (
        f"cell [2] is over budget: 4.00 MiB in use at its peak ({FOUR_MIB} bytes)"
        " > --max-peak 1.00 MiB (1048576 bytes); first line: a = torch.zeros(1024, 1024)"
    ) in err
    assert "over budget: [2] exceed" in err
    assert "cell [3]" not in err


@pytest.mark.heavy  # waits out a deadline (20 s or more): CI runs it, a laptop's test command skips it
def test_timeout_fails_the_cell_and_lists_what_ran(tmp_path, capsys):
    # The second cell never finishes, so the timeout, not the machine's speed,
    # decides where the run stops. --timeout applies to the notebook's cells,
    # not nbmem's setup cell (next test), so it only has to exceed how long
    # `x = 1` and its measurement take on a busy machine (this test waits it out).
    notebook = write_notebook(tmp_path / "slow.ipynb", "x = 1", "import time\ntime.sleep(10**6)", "y = 2")

    status = cli.main(["profile", str(notebook), "--timeout", "15"])

    out, err = capsys.readouterr()
    assert status == cli.EXIT_CELL_FAILED, out + err
    assert "tracked on cpu" in table_row(out, 1)  # x = 1 ran and was measured
    assert "not measured · FAILED" in table_row(out, 2)  # it never finished, so nbmem logged nothing
    assert "not run after the failure: [3]" in out
    assert "cell [2] failed: Timeout: did not finish within --timeout 15 s" in err


def test_timeout_is_for_the_notebooks_cells_not_nbmems_setup(tmp_path, capsys):
    # nbmem's setup cell imports nbmem and torch in the fresh kernel (seconds):
    # with --timeout 1 applied to it, the run exited 2 and blamed the install
    notebook = write_notebook(tmp_path / "fast.ipynb", "x = 1")

    status = cli.main(["profile", str(notebook), "--timeout", "1"])

    out, err = capsys.readouterr()
    assert status == cli.EXIT_OK, out + err
    assert "x = 1" in table_row(out, 1) and "installed" not in err


@pytest.mark.parametrize(
    "signal_number, status, says",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
)
def test_a_signal_stops_the_run_in_one_line_kills_the_kernel_and_cleans_up(tmp_path, signal_number, status, says):
    pid_file = tmp_path / "kernel.pid"
    notebook = write_notebook(
        tmp_path / "long.ipynb",
        "x = 1",
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(300)",
    )
    temporary = tmp_path / "tmp"  # nbmem's log goes to TMPDIR: this one is the test's own
    temporary.mkdir()
    run = subprocess.Popen(
        [sys.executable, "-m", "nbmem.frontend.cli", "profile", str(notebook)],
        env={**os.environ, "TMPDIR": str(temporary)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(1200):  # the kernel starts and reaches cell [2] (a wait, not a timing assertion)
            if pid_file.exists() and pid_file.read_text() or run.poll() is not None:
                break
            time.sleep(0.1)
        assert run.poll() is None and list(temporary.glob("nbmem-profile-*.jsonl")), "cell [2] never started"
        run.send_signal(signal_number)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == status, out + err
    lines = [line for line in err.splitlines() if line.startswith("nbmem profile:")]
    assert lines == [f"nbmem profile: {says}: cell [2] was running (first line: import os, time); the kernel was killed"]
    assert "Traceback" not in err
    assert not list(temporary.glob("nbmem-profile-*"))  # the log is removed
    assert gone(int(pid_file.read_text()))


def test_console_script_runs_as_a_module(tmp_path):
    notebook = write_notebook(tmp_path / "ok.ipynb", "import torch", "a = torch.zeros(1024, 1024)")

    done = subprocess.run(
        [sys.executable, "-m", "nbmem.frontend.cli", "profile", str(notebook), "--backend", "tracked", "--max-peak", "4MiB"],
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "+4.00 MiB" in table_row(done.stdout, 2)
    # 4 MiB is at the budget, not over it
    assert f"overall peak: 4.00 MiB allocated ({FOUR_MIB} bytes) at cell [2], tracked on cpu" in done.stdout


def test_backend_cuda_without_a_gpu_is_a_usage_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device, so --backend cuda is valid here")
    notebook = write_notebook(tmp_path / "ok.ipynb", "x = 1")
    output = tmp_path / "ran.ipynb"

    status = cli.main(["profile", str(notebook), "--backend", "cuda", "--output", str(output)])

    out, err = capsys.readouterr()
    assert status == cli.EXIT_USAGE
    assert "--backend cuda can't be used in kernel 'python3'" in err
    assert "needs a CUDA device" in err
    assert not output.exists()


# -- no kernel ------------------------------------------------------------------


def test_bad_arguments_and_paths_exit_2_with_a_fix(tmp_path, capsys):
    notebook = write_notebook(tmp_path / "ok.ipynb", "x = 1")

    with pytest.raises(SystemExit) as exited:
        cli.main(["profile", str(notebook), "--max-peak", "lots"])
    assert exited.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--max-peak" in err and "can't read 'lots' as a capacity" in err and "'16GiB'" in err and "A100-40GB" in err

    with pytest.raises(SystemExit) as exited:
        cli.main(["profile", str(notebook), "--timeout", "soon"])
    assert exited.value.code == cli.EXIT_USAGE
    assert "write a whole number" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exited:
        cli.main([])
    assert exited.value.code == cli.EXIT_USAGE
    assert "nbmem profile NOTEBOOK.ipynb" in capsys.readouterr().err

    missing = tmp_path / "nope.ipynb"
    assert cli.main(["profile", str(missing)]) == cli.EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == ""
    assert f"error: no notebook at {str(missing)!r}: check the path and the file name" in err

    assert cli.main(["profile", str(notebook), "--output", str(tmp_path / "no" / "such" / "x.ipynb")]) == 2
    assert "does not exist" in capsys.readouterr().err

    (tmp_path / "broken.ipynb").write_text("{not json")
    assert cli.main(["profile", str(tmp_path / "broken.ipynb")]) == cli.EXIT_USAGE
    assert "as a Jupyter notebook" in capsys.readouterr().err

    # An unknown kernel is refused before anything is launched.
    assert cli.main(["profile", str(notebook), "--kernel", "no-such-kernel"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "no Jupyter kernel named 'no-such-kernel'" in err and "python3" in err


def test_help_explains_the_command(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    assert "profile" in capsys.readouterr().out

    with pytest.raises(SystemExit):
        cli.main(["profile", "--help"])
    text = capsys.readouterr().out
    for phrase in ("--max-peak SIZE", "--output FILE", "--kernel NAME", "--timeout SECONDS", "{auto,measured,cuda,tracked}"):
        assert phrase in text
    assert "exit status" in text and "3  a cell's in-use peak went over --max-peak" in text


def test_version_prints_the_package_version(capsys):
    import nbmem

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == cli.EXIT_OK
    assert capsys.readouterr().out == f"nbmem {nbmem.__version__}\n"
    # the version nbmem says is the one the package is built with
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert f'version = "{nbmem.__version__}"' in pyproject
    # and asking for it stays light: no torch, no Jupyter stack
    code = (
        "import sys, nbmem\n"
        "assert nbmem.__version__\n"
        "try:\n    __import__('nbmem.frontend.cli').frontend.cli.main(['--version'])\n"
        "except SystemExit:\n    pass\n"
        "print(sorted({'torch', 'nbclient', 'nbformat', 'IPython'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"nbmem {nbmem.__version__}", "[]"]


def test_backend_choices_match_the_scope():
    from nbmem.tracking.backends import BACKENDS

    assert cli.BACKEND_CHOICES == BACKENDS


def test_import_is_light():
    # `nbmem --help` must not wait for torch or the Jupyter stack.
    code = "import sys, nbmem.frontend.cli; print(sorted({'torch', 'nbclient', 'nbformat', 'IPython'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
