"""The docs site (issue 28): every page in the navigation, every example run, and a strict build.

The pages' ``python`` blocks run as the README's do (``tests/test_readme.py``):
each page's in order in a fresh IPython of its own, as a reader who lands on
that page pastes them (a page defines and imports all it uses; until
2026-11-27 the pages ran one after another in one IPython, and a newcomer
starting at the snapshots page met a NameError). The figures a page prints
are that page's alone. The build is ``mkdocs build --strict``
(a broken link or reference fails it) when the docs extra is installed:
``NBMEM_REQUIRE_DOCS=1`` (CI) turns its absence into a failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import LANGUAGES, fenced_blocks, run_in_order

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def nav() -> list[str]:
    """The pages of mkdocs.yml's nav, in order (paths under docs/)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    section = text[text.index("\nnav:\n"):]
    section = section[: re.search(r"\n\S", section[1:]).start() + 1]  # up to the next top-level key
    return re.findall(r":\s*([\w./-]+\.(?:md|ipynb))\s*$", section, flags=re.M)


def test_every_page_and_notebook_is_in_the_navigation():
    pages = nav()
    assert pages[0] == "index.md" and len(pages) == len(set(pages))
    written = {path.name for path in DOCS.glob("*.md")}
    assert written == {page for page in pages if page.endswith(".md")}
    notebooks = {f"notebooks/{path.name}" for path in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks == {page for page in pages if page.endswith(".ipynb")}
    assert all((DOCS / page).exists() for page in pages)  # docs/notebooks is a link to the notebooks


def test_every_fence_on_the_site_says_what_it_is():
    for page in (page for page in nav() if page.endswith(".md")):
        blocks = fenced_blocks((DOCS / page).read_text(encoding="utf-8"))
        unknown = [(block.line - 1, block.language or "(none)") for block in blocks if block.language not in LANGUAGES]
        assert unknown == [], f"docs/{page}: fences must be one of {LANGUAGES} (line, fence): {unknown}"


def _examples(page: str) -> int:
    return sum(block.language == "python" for block in fenced_blocks((DOCS / page).read_text(encoding="utf-8")))


WITH_EXAMPLES = [page for page in nav() if page.endswith(".md") and _examples(page)]


def test_the_site_has_examples_on_most_pages():
    assert sum(map(_examples, WITH_EXAMPLES)) >= 20 and len(WITH_EXAMPLES) >= 9


@pytest.mark.slow
@pytest.mark.parametrize("page", WITH_EXAMPLES)
def test_each_pages_examples_run_in_order_in_a_fresh_ipython_of_its_own(page, tmp_path):
    run_in_order([(f"docs/{page}", (DOCS / page).read_text(encoding="utf-8"))], tmp_path)


def _executed_notebooks() -> Path | None:
    """The folder of executed notebooks Binder's test kept (NBMEM_EXECUTED_NOTEBOOKS), if it holds every one."""
    folder = os.environ.get("NBMEM_EXECUTED_NOTEBOOKS")
    if not folder:
        return None
    names = {path.name for path in (ROOT / "notebooks").glob("*.ipynb")}
    kept = {path.name for path in Path(folder).glob("*.ipynb")}
    if os.environ.get("NBMEM_HEAVY"):  # CI: Binder's test ran before this one and must have kept them all
        assert names <= kept, f"Binder's test kept no executed copy of {sorted(names - kept)} in {folder}"
    return Path(folder) if names <= kept else None


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocs_jupyter") is None:
        if os.environ.get("NBMEM_REQUIRE_DOCS"):
            pytest.fail("NBMEM_REQUIRE_DOCS is set and the docs extra is not installed: pip install -e '.[docs]'")
        pytest.skip("the docs extra is not installed (pip install -e '.[docs]')")
    config = ROOT / "mkdocs.yml"
    executed = _executed_notebooks()
    if executed is not None:  # the same pages, with the notebooks as Binder ran them: rendered with their outputs
        pages = tmp_path / "docs"
        shutil.copytree(DOCS, pages, symlinks=True, ignore=shutil.ignore_patterns("notebooks"))
        (pages / "notebooks").symlink_to(executed, target_is_directory=True)
        config = ROOT / ".mkdocs-executed.yml"  # beside mkdocs.yml: its relative paths (tools/) still hold
        config.write_text(f"INHERIT: mkdocs.yml\ndocs_dir: {pages}\n", encoding="utf-8")
    try:
        done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                               "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                              timeout=900, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    finally:
        if executed is not None:
            config.unlink()
    assert done.returncode == 0, done.stderr[-6000:]
    built = tmp_path / "site"
    assert (built / "estimate" / "index.html").exists() and (built / "reference" / "index.html").exists()
    reference = (built / "reference" / "index.html").read_text(encoding="utf-8")
    assert "max_batch_size" in reference and "estimate_trainer" in reference  # rendered from the docstrings
    notebook = (built / "notebooks" / "01-quickstart" / "index.html").read_text(encoding="utf-8")
    assert "%%gpumem" in notebook
    # mkdocs checks the Markdown pages' links; the notebooks' pages are HTML it doesn't read
    # (tools/mkdocs_notebook_links.py mends the two kinds that broke there)
    assert _broken_links(sorted((built / "notebooks").glob("*/index.html"))) == []
    if executed is not None:
        assert "tracked on cpu" in notebook  # an output of the quickstart's %%gpumem cells


def _broken_links(pages: list[Path]) -> list[tuple[str, str]]:
    """(page, link) for each relative link of ``pages`` to a file or an id that the built site doesn't have."""
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for link in re.findall(r'href="([^"]+)"', text):
            if re.match(r"[a-z]+:|//|/", link):
                continue  # another site, or the site's root (the 404 page's)
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append((page.parent.name, link))
            elif anchor and target.suffix == ".html" and f'id="{anchor}"' not in target.read_text(encoding="utf-8"):
                broken.append((page.parent.name, link))
    return broken
