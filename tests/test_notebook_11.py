"""The QLoRA will-it-fit notebook (11): Llamas of 7B to 70B, full, LoRA, QLoRA and 8-bit, run headlessly with nbclient.

It must run top to bottom without an error, be committed without outputs, and print its figures from code: the
parameter counts are checked here against their arithmetic, the formula column against parameters x bytes, and every
card's verdict against the needs and capacities the notebook printed. Its timings are printed, never compared here
(benchmarks/bench_qlora.py measures the estimates).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from _notebooks import assert_committed_clean, executed, failed_cells, output_of

from test_zoo import need

pytestmark = pytest.mark.slow

PATH = Path(__file__).resolve().parent.parent / "notebooks" / "11-qlora-will-it-fit.ipynb"
GiB = 1024**3


def llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocabulary: int) -> int:
    # embeddings and head; per layer q and o (hidden^2 each), k and v (hidden x kv width), the MLP's three, two norms
    kv = hidden // heads * kv_heads
    return 2 * vocabulary * hidden + layers * (2 * hidden**2 + 2 * hidden * kv + 3 * hidden * intermediate + 2 * hidden) + hidden


PARAMETERS = {
    "Llama-2-7B": llama(4096, 11008, 32, 32, 32, 32000),
    "Llama-3-8B": llama(4096, 14336, 32, 32, 8, 128256),
    "Llama-2-13B": llama(5120, 13824, 40, 40, 40, 32000),
    "Llama-2-70B": llama(8192, 28672, 80, 64, 8, 32000),
}


@pytest.fixture(scope="module")
def nb11() -> nbformat.NotebookNode:
    need("transformers", "peft", env="NBMEM_REQUIRE_ZOO")
    need("bitsandbytes", env="NBMEM_REQUIRE_QUANT")
    return executed(PATH)


def test_committed_clean() -> None:
    assert_committed_clean(PATH)


def test_runs_and_counts_the_parameters(nb11: nbformat.NotebookNode) -> None:
    assert failed_cells(nb11) == []
    counts = output_of(nb11, "import copy")
    for name, count in PARAMETERS.items():
        assert f"{name}: {count:,} parameters\n" in counts  # 6,738,415,616 for the 7B
    report = output_of(nb11, "LORA = ")
    assert "gpumem estimate (estimated on fake tensors" in report and "managed memory" in report


def test_the_formula_is_the_parameters_times_their_bytes(nb11: nbformat.NotebookNode) -> None:
    table = output_of(nb11, "BYTES_PER_WEIGHT = ")
    rows = re.findall(r"^(Llama\S+)\s+(full|LoRA|QLoRA|8-bit LoRA)\s+([\d.]+) GiB\s+([\d.]+) GiB\s+([\d.]+) GiB", table,
                      re.MULTILINE)
    assert len(rows) == 11, table
    bytes_per_weight = {"full": 16, "LoRA": 2, "QLoRA": 0.5, "8-bit LoRA": 1}
    for name, recipe, formula, estimate, reserved in rows:
        assert formula == f"{PARAMETERS[name] * bytes_per_weight[recipe] / GiB:.1f}"
        assert float(estimate) > float(formula) and float(reserved) >= float(estimate)


def test_verdicts_follow_the_printed_needs(nb11: nbformat.NotebookNode) -> None:
    table = output_of(nb11, "CARDS = ")
    capacities = dict(re.findall(r"(\S+) ([\d.]+) GiB", table.split("capacities: ")[1]))
    cards = list(capacities)
    rows = re.findall(r"^(Llama\S+)\s+(full|LoRA|QLoRA|8-bit LoRA)\s+([\d.]+) GiB\s+(.*)$", table, re.MULTILINE)
    assert len(rows) == 11, table
    for name, recipe, needs, verdicts in rows:
        for card, verdict in zip(cards, verdicts.split()):
            # the printed figures are rounded to 0.1 and 0.01 GiB: a verdict within rounding of the line is not checked
            if abs(float(needs) - float(capacities[card])) > 0.06:
                assert verdict == ("fits" if float(needs) <= float(capacities[card]) else "-"), (name, recipe, card)
    qlora_70b = next(row for row in rows if row[0] == "Llama-2-70B")
    assert qlora_70b[1] == "QLoRA" and qlora_70b[3].split()[cards.index("A100-80GB")] == "fits"
