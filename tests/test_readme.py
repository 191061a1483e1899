"""README.md's examples, pasted in order into one fresh IPython (issue 12).

The convention for fenced blocks in README.md, checked by
``test_every_fence_says_what_it_is``:

- ```` ```python ````: code a reader pastes into IPython. Every such block runs,
  in order, as one cell each, in one fresh shell with nothing defined: imports
  included. IPython syntax is allowed (``%load_ext``, a ``%%gpumem`` cell).
- ```` ```text ````: what the reader sees, never run. A text block that follows a
  python block with nothing but blank lines between is *that block's output*:
  each of its lines must appear in what the block printed, with wall times
  masked (they differ from run to run) and a line of ``...`` standing for
  lines left out.
- ```` ```bash ````: commands for a shell, never run here (they install
  things; ``.ci/run`` runs the test one).

Any other fence (none, ``py``, ``console``, ...) fails the test, so that no
block is skipped by accident.

Why IPython's terminal shell in a subprocess rather than a Jupyter kernel:
"pasted into a fresh IPython" is exactly ``TerminalInteractiveShell``, the
shell the ``ipython`` command starts, so displays take the terminal's path
(text, no widgets) as they would for the reader. A subprocess gives it a
fresh interpreter (nothing the test process imported or defined); each block
goes through ``run_cell`` like a paste, and the driver reports the failing
block's number, README line and traceback directly instead of parsing them
out of notebook outputs. The notebook path (a kernel, widgets) is covered by
``tests/test_notebooks.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
LANGUAGES = ("python", "text", "bash")
_FENCE = re.compile(r"^```(\S*)[ \t]*$")

# Runs the blocks in a fresh TerminalInteractiveShell, one cell each, and
# writes what each printed to the JSON file named by argv[2]. Stops at the
# first failing block: the later ones may need what it defines.
_DRIVER = """
import contextlib, io, json, sys
from IPython.terminal.interactiveshell import TerminalInteractiveShell

blocks = json.load(open(sys.argv[1], encoding="utf-8"))
shell = TerminalInteractiveShell.instance()
printed = []
for block in blocks:
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        result = shell.run_cell(block["source"], store_history=True)
    printed.append(captured.getvalue())
    if not result.success:
        error = result.error_in_exec or result.error_before_exec
        print(f"README block {block['number']} (README.md line {block['line']}) failed:"
              f" {type(error).__name__}: {error}\\n{captured.getvalue()}", file=sys.stderr)
        break
json.dump(printed, open(sys.argv[2], "w", encoding="utf-8"))
sys.exit(0 if len(printed) == len(blocks) and result.success else 1)
"""


@dataclass(frozen=True)
class Block:
    """One fenced block: its number among all fences (from 1), language, first line in README.md, text."""

    number: int
    language: str
    line: int
    source: str


def fenced_blocks(markdown: str) -> list[Block]:
    """Every fenced block of ``markdown``, in order.

    >>> [(b.number, b.language, b.source) for b in fenced_blocks("a\\n```python\\nx = 1\\n```\\n```text\\n1\\n```\\n")]
    [(1, 'python', 'x = 1\\n'), (2, 'text', '1\\n')]
    """
    blocks: list[Block] = []
    opened: tuple[str, int] | None = None
    body: list[str] = []
    for number, line in enumerate(markdown.splitlines(), start=1):
        fence = _FENCE.match(line)
        if fence is None:
            if opened is not None:
                body.append(line + "\n")
        elif opened is None:
            opened, body = (fence.group(1), number + 1), []
        else:
            blocks.append(Block(len(blocks) + 1, opened[0], opened[1], "".join(body)))
            opened = None
    assert opened is None, f"README.md: the fence opened on line {opened[1] - 1} is never closed"
    return blocks


def expected_outputs(markdown: str, blocks: list[Block]) -> dict[int, Block]:
    """Python block number -> the text block right after it (only blank lines between)."""
    lines = markdown.splitlines()
    outputs = {}
    for previous, block in zip(blocks, blocks[1:]):
        if previous.language != "python" or block.language != "text":
            continue
        # 0-based: the line after previous's closing fence, up to the line before block's opening one
        between = lines[previous.line + previous.source.count("\n") : block.line - 2]
        if all(not line.strip() for line in between):
            outputs[previous.number] = block
    return outputs


def _masked(line: str) -> str:
    # Wall times differ from run to run: "0.00951 s wall", "0.373 s".
    return re.sub(r"\b\d+(\.\d+)?(e-?\d+)? s\b", "<seconds> s", line.rstrip())


def test_every_fence_says_what_it_is():
    blocks = fenced_blocks(README.read_text(encoding="utf-8"))
    unknown = [(block.number, block.line - 1, block.language or "(none)") for block in blocks if block.language not in LANGUAGES]
    assert unknown == [], f"README.md fences must be one of {LANGUAGES} (block, line, fence): {unknown}"
    assert sum(block.language == "python" for block in blocks) >= 4


def test_fenced_blocks_finds_output_after_code_only():
    markdown = "```python\nprint(1)\n```\n\n```text\n1\n```\nprose\n```text\nother\n```\n"
    blocks = fenced_blocks(markdown)
    assert [(b.number, b.language, b.line) for b in blocks] == [(1, "python", 2), (2, "text", 6), (3, "text", 10)]
    assert expected_outputs(markdown, blocks) == {1: blocks[1]}
    assert _masked("  time      0.00951 s wall") == "  time      <seconds> s wall"
    assert _masked("[1]   x  0 B  0.00195 s   tracked") == "[1]   x  0 B  <seconds> s   tracked"


def run_in_order(pages: list[tuple[str, str]], tmp_path: Path) -> None:
    """Every python block of ``pages`` ((name, markdown), in order) pasted into one fresh IPython; each text block
    right after one must match what it printed (wall times masked, ``...`` for lines left out)."""
    blocks_of = [(name, markdown, fenced_blocks(markdown)) for name, markdown in pages]
    code = [block for _, _, blocks in blocks_of for block in blocks if block.language == "python"]
    source = tmp_path / "blocks.json"
    source.write_text(json.dumps([block.__dict__ for block in code]), encoding="utf-8")
    printed_file = tmp_path / "printed.json"
    env = dict(os.environ, MPLBACKEND="agg")  # a terminal without a display, as on a server
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(source), str(printed_file)],
        cwd=tmp_path,  # nothing of the repository's folder on the path but what PYTHONPATH says
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,  # hang protection only; it takes a few minutes on a busy 2-core machine
    )
    names = [name for name, _, blocks in blocks_of for block in blocks if block.language == "python"]
    assert done.returncode == 0, f"(blocks in order: {sorted(set(names), key=names.index)})\n" + done.stderr[-6000:] \
        + done.stdout[-2000:]

    printed = json.loads(printed_file.read_text(encoding="utf-8"))
    at = 0
    for name, markdown, blocks in blocks_of:
        ran = [block for block in blocks if block.language == "python"]
        mine = dict(zip((block.number for block in ran), printed[at : at + len(ran)]))
        at += len(ran)
        for number, output in expected_outputs(markdown, blocks).items():
            shown = [_masked(line) for line in mine[number].splitlines()]
            for line in output.source.splitlines():
                if line.strip() == "...":
                    continue
                assert _masked(line) in shown, (
                    f"{name} block {output.number} (line {output.line}) shows a line that python block {number} "
                    f"did not print:\n{line}\nit printed:\n{mine[number]}"
                )


@pytest.mark.slow
def test_readme_python_blocks_run_in_order_in_a_fresh_ipython(tmp_path):
    run_in_order([("README.md", README.read_text(encoding="utf-8"))], tmp_path)


def test_the_readme_is_a_landing_page():
    """Issue 28: at most 15 KB; the rest lives on the site, which it links to."""
    markdown = README.read_text(encoding="utf-8")
    assert len(markdown.encode("utf-8")) <= 15 * 1024
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", markdown))
    pages = {path.name for path in (README.parent / "docs").glob("*.md")}
    assert pages - {"index.md"} <= linked, f"pages the README does not link to: {sorted(pages - linked)}"
