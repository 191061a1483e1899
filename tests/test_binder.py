"""Where learners are: binder/ in a fresh virtual environment, every notebook run there; the wheel and sdist.

mybinder.org installs ``binder/requirements.txt``, then runs ``binder/postBuild``
from the repository's root. This test does the same in a new virtual
environment, then executes every notebook under notebooks/ in that
environment's own kernel, and the tests marked ``vision`` (timm and
torchvision's models, notebook 08's figures), which need this environment's
torch pair. Then the built wheel and sdist are installed in turn into the same
environment and must import and run.

The PyTorch CPU index the file names can't be reached from here (pip is told
not to retry it), so pip takes torch 2.14.1 and torchvision 0.29.1 from this
machine's package index: CUDA builds, which run on the CPU but bring about
5 GB of CUDA libraries (3 minutes to install on this project's 2-core
machine, 8 with other work running; 5.7 GB on disk, removed after the module). Where that index can be
reached, the test asserts the CPU builds and no CUDA library, as on
mybinder.org.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # NBMEM_HEAVY=1 runs it (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(path.name for path in (REPO / "notebooks").glob("*.ipynb"))
# the environment takes 5.7 GB; pip unpacks each CUDA wheel beside it first
_NEEDS_BYTES = 9 * 10**9
_IGNORED = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")

# NBMEM_EXECUTED_NOTEBOOKS (.ci/run sets it): a folder that keeps each executed notebook, outputs and all, for the
# docs site to render (tests/test_site.py), so the notebooks are not run a second time for it
_EXECUTE = """
import os, sys, time, nbclient, nbformat
failed = []
keep = os.environ.get("NBMEM_EXECUTED_NOTEBOOKS")
for name in sys.argv[1:]:
    notebook = nbformat.read(name, as_version=4)
    started = time.perf_counter()
    try:
        nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600).execute()
    except Exception as error:  # report every notebook, then fail
        failed.append(f"{name}: {type(error).__name__}: {str(error)[-1500:]}")
    else:
        if keep:
            os.makedirs(keep, exist_ok=True)
            nbformat.write(notebook, os.path.join(keep, name))
    print(f"{name} {time.perf_counter() - started:.1f} s", flush=True)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""

_SMOKE = """
import torch, nbmem
from torch import nn
from IPython.core.interactiveshell import InteractiveShell
build = lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
make = lambda n: (torch.randn(n, 1024), torch.randint(0, 10, (n,)))
print(nbmem.__file__)
print(nbmem.estimate(build, make, batch_size=64, optimizer="sgd").breakdown.category("parameter"))
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "nbmem")
shell.run_cell("import torch")
shell.run_cell_magic("gpumem", "--quiet", "x = torch.empty(1024, 1024)")
print(nbmem.history()[-1].retained)
"""


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _cpu_index_reachable() -> bool:
    """Whether the PyTorch CPU index that binder/requirements.txt names resolves from here."""
    try:
        socket.getaddrinfo("download.pytorch.org", 443)
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def binder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A copy of the repository, installed the way mybinder.org installs it into a fresh environment."""
    root = tmp_path_factory.mktemp("binder")
    free = shutil.disk_usage(root).free
    if free < _NEEDS_BYTES:  # pip fails half-way with "No space left on device", and every later test that writes fails too
        pytest.fail(
            f"Binder's environment needs about {_NEEDS_BYTES / 1e9:.0f} GB free in {root.parent} and there are "
            f"{free / 1e9:.1f} GB: free some (old virtual environments, earlier runs' pytest-of-* folders) or point "
            "TMPDIR to a larger disk"
        )
    try:
        yield _install(root)
    finally:  # an install that failed half-way leaves gigabytes too
        # pytest keeps the last three runs' temporary folders: without this, three environments of 5.7 GB each
        shutil.rmtree(root, ignore_errors=True)


def _install(root: Path) -> dict[str, Any]:
    checkout = root / "repository"
    shutil.copytree(REPO, checkout, ignore=_IGNORED)
    env_dir = root / "env"
    subprocess.run([sys.executable, "-m", "venv", env_dir], check=True, timeout=300)
    environment = {
        **{key: value for key, value in os.environ.items() if not key.startswith(("VIRTUAL_ENV", "PYTHON"))},
        "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(env_dir),
        "PIP_RETRIES": "0",  # the PyTorch index is out of reach here: fail over to the local wheel at once
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "MPLBACKEND": "Agg",
    }
    started = time.perf_counter()
    _run(["python", "-m", "pip", "install", "--quiet", "-r", "binder/requirements.txt"], checkout, environment, 1200)
    _run(["bash", "binder/postBuild"], checkout, environment, 1200)
    print(f"\nbinder environment installed in {time.perf_counter() - started:.0f} s")
    return {"checkout": checkout, "env": env_dir, "environment": environment, "root": root}


def test_the_binder_environment_has_the_pinned_torch_pair_and_nbmem(binder: dict) -> None:
    listed = _run(["python", "-m", "pip", "list", "--format=freeze"], binder["checkout"], binder["environment"], 300)
    packages = dict(line.split("==", 1) for line in listed.splitlines() if "==" in line)
    # torch with the torchvision built for it (notebook 08's timm imports torchvision), in one install
    assert packages["torch"].startswith("2.14.1") and packages["torchvision"].startswith("0.29.1")
    assert packages["timm"] == "1.0.29" and packages["transformers"] == "5.23.0" and packages["nbmem"] == "0.1.0"
    assert "ipywidgets" in packages and "matplotlib" in packages
    cuda_libraries = sorted(name for name in packages if name.startswith("nvidia-"))
    if _cpu_index_reachable():  # as on mybinder.org: the CPU builds, no CUDA library pulled in
        assert packages["torch"].endswith("+cpu") and packages["torchvision"].endswith("+cpu")
        assert cuda_libraries == []
    else:
        print(f"\nPyTorch's CPU index is out of reach: {packages['torch']}, {len(cuda_libraries)} CUDA libraries")


def test_every_notebook_runs_in_the_binder_environment(binder: dict) -> None:
    assert len(NOTEBOOKS) >= 8 and "08-real-models.ipynb" in NOTEBOOKS, NOTEBOOKS
    output = _run(["python", "-c", _EXECUTE, *NOTEBOOKS], binder["checkout"] / "notebooks", binder["environment"], 3600)
    print(output)
    assert all(f"{name} " in output for name in NOTEBOOKS)


# The tests marked vision (timm and torchvision's models, notebook 08's figures), and the forked rank after an
# estimate that this torch build broke (tests/test_fakemode.py): Binder's environment has the one torch pair
# torchvision loads on (CI's own environment has the CPU torch 2.13.0), so they run here rather than in a third
# environment with the same 5 GB of CUDA libraries (stop 43's CI installed it twice)
_VISION = ["tests/test_zoo.py", "tests/test_notebook_08.py", "tests/test_finetune.py"]
_FORKED = "tests/test_fakemode.py::test_a_forked_child_can_run_backward_after_an_estimate"


def test_the_vision_tests_pass_in_the_binder_environment(binder: dict) -> None:
    _run(["python", "-m", "pip", "install", "--quiet", "pytest>=7.4"], binder["checkout"], binder["environment"], 600)
    environment = {
        # only transformers, peft, timm and torchvision must be there: Binder has none of the other extras
        **{key: value for key, value in binder["environment"].items() if not key.startswith("NBMEM_REQUIRE_")},
        "NBMEM_REQUIRE_ZOO": "1",
        "NBMEM_REQUIRE_VISION": "1",
    }
    command = ["python", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts="]
    vision = _run([*command, "-m", "vision", *_VISION], binder["checkout"], environment, 2400)
    print(vision[-2000:])
    # every vision test ran and none skipped: a skip here would hide a library Binder lost
    summary = vision.splitlines()[-1]
    assert not re.search(r"skipped|failed|error", summary) and int(re.match(r"(\d+) passed", summary)[1]) >= 38, summary
    forked = _run([*command, _FORKED], binder["checkout"], environment, 600).splitlines()[-1]
    assert re.match(r"1 passed", forked) and "skipped" not in forked, forked


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_the_wheel_and_sdist_install_and_work(binder: dict, kind: str) -> None:
    outdir = binder["root"] / "dist"
    if not outdir.exists():
        _run(["python", "-m", "pip", "install", "--quiet", "build"], binder["checkout"], binder["environment"], 600)
        _run(["python", "-m", "build", "--outdir", str(outdir), "."], binder["checkout"], binder["environment"], 900)
    built = next(outdir.glob("nbmem-0.1.0-py3-none-any.whl" if kind == "wheel" else "nbmem-0.1.0.tar.gz"))
    _run(["python", "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(built)],
         binder["root"], binder["environment"], 600)
    printed = _run(["python", "-c", _SMOKE], binder["root"], binder["environment"], 300).splitlines()
    assert printed[0].startswith(str(binder["env"]))  # the installed copy, not the checkout
    assert printed[1:] == ["4239872", "4194304"]  # (1024*1024 + 1024 + 10*1024 + 10) * 4, rounded; 4 MiB retained
    assert "usage: nbmem" in _run(["nbmem", "--help"], binder["root"], binder["environment"], 120)
