"""The will-it-fit notebook (09): a 7B-class Llama, never materialised, run headlessly with nbclient.

It must run top to bottom without an error, be committed without outputs, and
print its figures from code: the parameter counts and the KV cache's bytes
per token are checked here against their arithmetic, the verdicts against the
estimates the notebook printed. Its timings are printed, never compared here
(benchmarks/bench_notebook09.py measures them).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from _notebooks import assert_committed_clean, executed, failed_cells, output_of, text

from test_zoo import need

pytestmark = pytest.mark.slow

PATH = Path(__file__).resolve().parent.parent / "notebooks" / "09-will-it-fit.ipynb"
GiB = 1024**3
# 7B-class Llama: embeddings and head 2 x 32000 x 4096; per layer q, k, v, o 4 x 4096^2, the MLP 3 x 4096 x 11008,
# two norms 2 x 4096; 32 layers; the final norm 4096
PARAMETERS = 2 * 32000 * 4096 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096


@pytest.fixture(scope="module")
def nb09() -> nbformat.NotebookNode:
    need("transformers", "peft", env="NBMEM_REQUIRE_ZOO")
    return executed(PATH)


def test_committed_clean() -> None:
    assert_committed_clean(PATH)


def test_runs_and_prints_the_arithmetic(nb09: nbformat.NotebookNode) -> None:
    assert failed_cells(nb09) == []
    counts = output_of(nb09, 'with torch.device("meta")')
    assert f"parameters: {PARAMETERS:,}\n" in counts  # 6,738,415,616
    # rank-8 LoRA on q_proj and v_proj: 32 layers x 2 modules x 8 x (4096 in + 4096 out)
    assert f"LoRA trainable parameters: {32 * 2 * 8 * (4096 + 4096):,} " in counts  # 4,194,304
    cache = output_of(nb09, "generation = ")
    per_token = 32 * 2 * 32 * 128 * 2  # layers x (keys, values) x heads x head_dim x bf16 bytes = 524,288
    assert f"KV cache per token of context: {per_token:,} B" in cache
    assert f"per position for the whole batch ({per_token:,} B, " in cache and "gpumem generate estimate (estimated" in cache


def test_verdicts_follow_the_printed_estimates(nb09: nbformat.NotebookNode) -> None:
    table = output_of(nb09, "variants = ")
    capacities = {"RTX-4090": 23.64, "A100-80GB": 79.25}  # GiB, nbmem.PRESETS (as PyTorch reports them)
    rows = re.findall(r"^(\S.*?)\s+([\d.]+) GiB\s+([\d.]+) GiB\s+(\w+)\s+(\w+)$", table, re.MULTILINE)
    assert len(rows) == 8, table
    for label, allocated, reserved, small, large in rows:
        for capacity, answer in zip(capacities.values(), (small, large)):
            expected = "no" if float(allocated) > capacity else ("fits" if float(reserved) <= capacity else "tight")
            assert answer == expected, (label, answer)
    by_label = {row[0]: row for row in rows}
    assert by_label["full fine-tuning, fp32"][3] == "no"  # 16 bytes per parameter alone is 100 GiB
    assert by_label["inference, bf16 weights"][3] == "fits"
    formula = output_of(nb09, "formula = ")
    # 16 bytes per parameter for AdamW in fp32: 107,814,649,856 B = 100 GiB (3 significant figures)
    assert f"full fine-tuning, fp32: formula {16 * PARAMETERS / GiB:.3g} GiB" in formula


def test_context_length_chart(nb09: nbformat.NotebookNode) -> None:
    cells = [cell for cell in nb09.cells if cell.cell_type == "code" and "serving.plot()" in cell.source]
    assert len(cells) == 1
    assert any("image/png" in output.get("data", {}) for output in cells[0].outputs)
    assert "prompt_length  batch_size=1  batch_size=4" in text(cells[0])
