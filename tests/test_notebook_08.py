"""The real-models notebook (08): a Hugging Face Llama and a timm ResNet, run headlessly with nbclient.

It needs transformers and timm, and timm imports torchvision, which CI has in
the Binder environment only (binder/requirements.txt): elsewhere the notebook
skips its ResNet parts and the tests that run it skip, unless
NBMEM_REQUIRE_ZOO=1 / NBMEM_REQUIRE_VISION=1 make a missing library a failure.
In CI, Binder's test (tests/test_binder.py) runs every notebook in that
environment, then these tests there too, reading that run's outputs; here
every figure the notebook prints is checked: the estimate equal to the tracked
run to the byte, and the bytes a Hugging Face loop holds by the arithmetic of
its shapes. Timings are never compared.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import nbformat
import pytest
from _notebooks import assert_committed_clean, executed, failed_cells, output_of, text
from _zoo import need

pytestmark = pytest.mark.slow

PATH = Path(__file__).resolve().parent.parent / "notebooks" / "08-real-models.ipynb"
# The notebook's Llama and its batches (LlamaConfig in its setup cell)
VOCAB, SEQUENCE, WIDTH, LAYERS, HEADS, KV_HEADS, MLP = 8192, 64, 256, 4, 4, 2, 1024
_RUN: dict[str, Any] = {}


@pytest.fixture(scope="module")
def nb08() -> nbformat.NotebookNode:
    """The notebook after running it, once per session."""
    need("transformers", env="NBMEM_REQUIRE_ZOO")
    need("timm", "torchvision", env="NBMEM_REQUIRE_VISION")
    if not _RUN:
        _RUN["notebook"] = executed(PATH)
    return _RUN["notebook"]


def _bytes(pattern: str, output: str) -> list[int]:
    """Every byte count that ``pattern``'s one group matches, as integers."""
    found = [int(match.replace(",", "")) for match in re.findall(pattern, output, re.MULTILINE)]
    assert found, f"{pattern!r} not in:\n{output}"
    return found


def _peaks(output: str) -> dict[tuple[str, str], tuple[int, int]]:
    """``compare()``'s lines: (model, estimated|tracked) -> (first step, steady) bytes."""
    lines = re.findall(r"^(\S+)\s+(estimated|tracked)\s+first step\s+([\d,]+) B\s+steady\s+([\d,]+) B", output, re.M)
    return {(model, how): (int(first.replace(",", "")), int(steady.replace(",", "")))
            for model, how, first, steady in lines}


def test_is_committed_clean() -> None:
    notebook = assert_committed_clean(PATH)
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    assert first.source.splitlines() == ["%load_ext nbmem", "%matplotlib inline"]


@pytest.mark.vision
def test_runs_without_an_error(nb08: nbformat.NotebookNode) -> None:
    assert failed_cells(nb08) == []


@pytest.mark.vision
def test_the_models_are_the_ones_described(nb08: nbformat.NotebookNode) -> None:
    output = output_of(nb08, "import torch")
    assert "timm can't be imported" not in output  # the ResNet parts ran: this environment has timm
    # embeddings and the untied head 2 x 8192 x 256; per layer q and o 256 x 256, k and v 256 x 128 (2 of 4 heads'
    # worth), gate, up and down 3 x 256 x 1024, two RMSNorms 2 x 256; the final norm 256
    layer = 2 * WIDTH * WIDTH + 2 * WIDTH * (WIDTH * KV_HEADS // HEADS) + 3 * WIDTH * MLP + 2 * WIDTH
    assert _bytes(r"^Llama:\s+([\d,]+) parameters", output) == [2 * VOCAB * WIDTH + LAYERS * layer + WIDTH]
    # ResNet-18's 11,689,512 for 1000 classes, less 990 classes' rows of the 512-wide head and their biases
    assert _bytes(r"^ResNet-18:\s+([\d,]+) parameters", output) == [11_689_512 - 990 * 512 - 990]


@pytest.mark.vision
def test_the_estimate_is_the_tracked_run_to_the_byte(nb08: nbformat.NotebookNode) -> None:
    output = output_of(nb08, "def compare(")
    peaks = _peaks(output)
    for model in ("Llama", "ResNet-18"):
        assert peaks[(model, "estimated")] == peaks[(model, "tracked")]
        first_step, steady = peaks[(model, "estimated")]
        assert 0 < first_step <= steady  # AdamW's state is born in the first step
    assert _bytes(r"difference: ([\d,]+) B", output) == [0, 0]
    assert "peak at aten._log_softmax_backward_data" in output  # the Llama's peak: the loss's backward
    # the padded batch builds the 4-D mask both ways; the estimate says it assumes one
    assert "note: Hugging Face builds a (batch, 1, sequence, sequence) attention mask" in output_of(nb08, "for note in")


@pytest.mark.vision
def test_the_hugging_face_loop_holds_its_logits_and_kv_cache_at_the_optimizer_step(
    nb08: nbformat.NotebookNode,
) -> None:
    output = output_of(nb08, "def train_step(")
    built_in, yours, tracked = (_bytes(rf"^{label}\s+([\d,]+) B", output)[0]
                                for label in ("built-in step:", "your step, estimated:", "your step, tracked:"))
    assert yours == tracked and "(difference 0 B)" in output
    assert "peak at aten._foreach_sqrt" in output  # AdamW's update: after backward, the outputs still held
    batch = 2
    logits = batch * SEQUENCE * VOCAB * 4  # 4,194,304
    # keys and values of every layer: 4 x 2 x batch 2 x 2 key/value heads x 64 tokens x head size 64 x 4 B = 524,288
    kv_cache = LAYERS * 2 * batch * KV_HEADS * SEQUENCE * (WIDTH // HEADS) * 4
    inputs = 3 * batch * SEQUENCE * 8  # input_ids, attention_mask, labels in int64: 3,072
    loss = 512  # one float32, in one 512 B block
    assert yours - built_in == logits + kv_cache + inputs + loss == 4_722_176
    assert _bytes(r"your step holds ([\d,]+) B more", output) == [yours - built_in]
    # the notebook's own arithmetic prints the same sum
    assert _bytes(r"= ([\d,]+) B$", output_of(nb08, "BATCH = 2")) == [yours - built_in]
    # keeping only the loss: the batch and the loss are what is left at the update
    assert _bytes(r"^lean step: [\d,]+ B, ([\d,]+) B against", output_of(nb08, "def lean_step(")) == [inputs + loss]


@pytest.mark.vision
def test_checkpointing_is_hugging_faces_own_and_the_tracked_run_agrees(nb08: nbformat.NotebookNode) -> None:
    output = output_of(nb08, "plain = ")
    assert "checkpointing: on (Hugging Face activation_checkpointing_enable, use_cache=False)" in output
    assert "KV cache turned off (use_cache=False)" in output
    peaks = _peaks(output)
    assert peaks[("Llama", "estimated")] == peaks[("Llama", "tracked")]
    assert _bytes(r"difference: ([\d,]+) B", output) == [0]
    table = output_of(nb08, "MiB = 2**20")
    rows = {name: (float(off), float(on)) for name, off, on in
            re.findall(r"^(parameter|optimizer state|activation|peak)\s+([\d.]+)\s+([\d.]+)$", table, re.M)}
    assert rows["parameter"][0] == rows["parameter"][1] and rows["optimizer state"][0] == rows["optimizer state"][1]
    assert rows["activation"][1] < rows["activation"][0] / 2 and rows["peak"][1] < rows["peak"][0]
    saved = _bytes(r"checkpointing saves ([\d,]+) B", table)[0]
    assert abs(saved / 2**20 - (rows["peak"][0] - rows["peak"][1])) <= 0.01  # the table's MiB, to 2 decimals
    assert abs(peaks[("Llama", "estimated")][1] / 2**20 - rows["peak"][1]) <= 0.005  # the same checkpointed step


@pytest.mark.vision
def test_one_sweep_over_batch_sizes_with_and_without_checkpointing(nb08: nbformat.NotebookNode) -> None:
    cells = [cell for cell in nb08.cells if cell.cell_type == "code" and cell.source.startswith("table = nbmem.sweep(")]
    (cell,) = cells
    output = text(cell)
    assert "estimated; step yours: train_step, run as written" in output
    rows = {int(size): (int(off), int(on)) for size, off, on in re.findall(r"^(\d+)\s+(\d+)\s+(\d+)$", output, re.M)}
    assert sorted(rows) == [2, 4, 8, 16]
    assert all(on <= off for off, on in rows.values())
    assert rows[16][0] - rows[16][1] > rows[2][0] - rows[2][1]  # the saving grows with the batch
    (plot,) = [cell for cell in nb08.cells if cell.cell_type == "code" and cell.source == "table.plot()"]
    assert any("image/png" in output.get("data", {}) for output in plot.outputs)
