"""The myths-and-measurements notebook (07), run headlessly with nbclient in one kernel.

It must run top to bottom without an error, quickly, and each of its eleven
claims must print the verdict its measurement supports, with the numbers
behind it: exact bytes wherever the arithmetic is known (shapes times bytes
per element, CUDA's 512 B rounding), bounds where a figure is a ratio.
Timings are printed by the notebook, never compared here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import nbformat
import pytest
from _notebooks import assert_committed_clean, execute, failed_cells, text

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATH = NOTEBOOKS / "07-myths-and-measurements.ipynb"
_RUN: dict[str, Any] = {}


def _rounded(size: int) -> int:
    """CUDA's caching allocator rounds every block up to 512 bytes, and so does nbmem's tracker."""
    return -(-size // 512) * 512


def _run() -> dict[str, Any]:
    """The notebook after running it (once per session) and how long that took."""
    if not _RUN:
        notebook, seconds = execute(PATH)
        _RUN.update(notebook=notebook, seconds=seconds)
    return _RUN


@pytest.fixture(scope="module")
def nb07() -> nbformat.NotebookNode:
    return _run()["notebook"]


def _cell(notebook: nbformat.NotebookNode, start: str) -> nbformat.NotebookNode:
    """The one code cell whose source starts with ``start``."""
    cells = [cell for cell in notebook.cells if cell.cell_type == "code" and cell.source.startswith(start)]
    assert len(cells) == 1, start
    return cells[0]


_text = text


def _claim(notebook: nbformat.NotebookNode, start: str) -> str:
    return _text(_cell(notebook, start))


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _find(pattern: str, text: str) -> re.Match:
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{pattern!r} not in:\n{text}"
    return match


def _verdict(text: str) -> str:
    """The verdict word(s) of a section: what follows 'verdict: ' up to the next colon."""
    return _find(r"^verdict: ([^:]+):", text).group(1)


# -- the notebook as a whole ---------------------------------------------------------------------


def test_is_committed_clean() -> None:
    notebook = assert_committed_clean(PATH)
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    assert first.source.splitlines() == ["%load_ext nbmem", "%matplotlib inline"]


def test_runs_without_error() -> None:
    # No time limit (issue 12): execute() prints how long it took.
    run = _run()
    assert failed_cells(run["notebook"]) == []


def test_every_claim_has_a_markdown_statement_and_a_printed_verdict(nb07: nbformat.NotebookNode) -> None:
    headings = [cell.source for cell in nb07.cells if cell.cell_type == "markdown" and cell.source.startswith("## Claim ")]
    assert [int(re.match(r"## Claim (\d+):", heading).group(1)) for heading in headings] == list(range(1, 12))
    verdict_lines = [line for cell in nb07.cells if cell.cell_type == "code" for line in _text(cell).splitlines()
                     if line.startswith("verdict: ")]
    assert len(verdict_lines) == 11


# -- 1: dataset size --------------------------------------------------------------------------------


def test_01_dataset_size_does_not_change_the_peak(nb07: nbformat.NotebookNode) -> None:
    sizes = _claim(nb07, "# claim 1: the same training loop")
    # 256 float32 features and one int64 label per example: 1,032 bytes each, in host RAM
    assert re.search(r"small dataset:\s+1,000 examples,\s+1,032,000 bytes in host RAM \(computed", sizes), sizes
    assert re.search(r"large dataset:\s+10,000 examples,\s+10,320,000 bytes in host RAM \(computed", sizes), sizes
    magic = "%%gpumem --text --backend tracked --device cpu\n"
    reports = [cell for cell in nb07.cells if cell.cell_type == "code" and cell.source.startswith(magic)]
    assert len(reports) == 2
    peaks = []
    for cell in reports:
        report = _text(cell)
        assert "tracked on cpu" in report and "FAILED" not in report, report
        peaks.append(_find(r"^\s+peak\s+(.+)$", report).group(1))
    assert peaks[0] == peaks[1]  # the two %%gpumem reports show the same peak line
    printed = _claim(nb07, "# claim 1: the verdict")
    runs = re.findall(r"(\d+) steps, peak ([0-9,]+) bytes allocated above the start \(([0-9,]+) in use at the peak\), tracked on cpu",
                      printed)
    assert [int(steps) for steps, _, _ in runs] == [5, 50], printed  # batches of 200
    (_, small_peak, small_in_use), (_, large_peak, large_in_use) = runs
    assert small_peak == large_peak and small_in_use == large_in_use
    assert _number(small_peak) > 547_328  # more than the model's parameters alone
    assert _verdict(printed) == "FALSE"
    assert f"tracked peak {large_peak} vs {small_peak} bytes allocated on cpu" in printed


# -- 2: batch size ---------------------------------------------------------------------------------


def test_02_memory_grows_with_the_batch(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 2: a tracked sweep over batch sizes")
    assert printed.startswith("gpumem sweep: peak allocated in MiB, tracked")
    rows = [(int(size), _number(peak), _number(per)) for size, peak, per in re.findall(
        r"batch\s+(\d+): tracked peak\s+([0-9,]+) bytes allocated on cpu,\s+([0-9,]+) bytes per example", printed)]
    assert [size for size, _, _ in rows] == [64, 256, 1024, 4096], printed
    peaks = [peak for _, peak, _ in rows]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)  # strictly larger with every batch
    per_example = [per for _, _, per in rows]
    assert per_example == sorted(per_example, reverse=True)  # the grain of truth: per example it falls
    assert _verdict(printed) == "FALSE"
    assert any("image/png" in output.get("data", {}) for output in _cell(nb07, "table.plot()").outputs)


# -- 3: gradient accumulation --------------------------------------------------------------------------


def test_03_accumulation_trains_a_batch_larger_than_fits(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 3: the largest single batch")
    assert printed.startswith("gpumem max_batch_size on 64MiB: ")
    largest = _number(_find(r"largest single batch on 64MiB: ([0-9,]+) \(tracked trials", printed).group(1))
    # both sides of the boundary tried for real
    assert re.search(rf"[:,] {largest:,} ran\b", printed) and re.search(rf"[:,] {largest + 1:,} out of memory", printed), printed
    micro = largest // 2
    effective = _number(_find(rf"effective batch {micro:,} x 8 = ([0-9,]+) = 4\.0x the largest single batch", printed).group(1))
    assert effective == 8 * micro > largest
    assert re.search(rf"as one batch of {effective:,}:\s+estimated peak\s+[0-9,]+ bytes allocated -> does NOT fit 64MiB", printed)
    estimated = _number(_find(r"as 8 accumulated micro-batches: estimated peak\s+([0-9,]+) bytes allocated -> fits 64MiB",
                              printed).group(1))
    tracked = _number(_find(r"the same, run for real:\s+tracked peak\s+([0-9,]+) bytes allocated on cpu \(virtual 64MiB\)",
                            printed).group(1))
    assert tracked == estimated <= 64 * 2**20  # the real run peaks where the estimate said, within the device
    alone = _number(_find(rf"one micro-batch of {micro:,} alone:\s+estimated peak\s+([0-9,]+) bytes allocated", printed).group(1))
    added, at_peak, already, other = (_number(value.lstrip("+")) for value in _find(
        r"accumulation adds ([0-9,]+) bytes \(estimated\), at the peaks: gradients ([0-9,]+) against ([0-9,]+) in the "
        r"micro-batch's alone; other ([+-][0-9,]+)", printed).groups())
    # all of mlp()'s gradients: 256x512 + 512 + 512x10 + 10 float32, each rounded to 512 bytes
    gradients = _rounded(256 * 512 * 4) + _rounded(512 * 4) + _rounded(512 * 10 * 4) + _rounded(10 * 4)
    assert at_peak == gradients == 547_328
    # the micro-batch's peak is late in its backward, its gradients all made (the first bias's reduction buffer,
    # 4 x 512 x 48 x 32 x 4 bytes on an H100); what accumulation adds there: the next micro-batch's first weight
    # gradient (256 x 512 float32) and its bias's (512 float32), computed beside the kept ones
    assert already == gradients and added == estimated - alone == other == _rounded(256 * 512 * 4) + _rounded(512 * 4)
    assert _verdict(printed) == "TRUE"


# -- 4: checkpointing -------------------------------------------------------------------------------------


def test_04_checkpointing_trades_flops_for_memory(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 4: checkpointing off and on")
    steps = {mode: (_number(peak), _number(flops), float(seconds)) for mode, peak, flops, seconds in re.findall(
        r"checkpointing\s+(off|on): tracked peak\s+([0-9,]+) bytes allocated on cpu \(in use\),\s+([0-9,]+) FLOPs \(counted\),"
        r" ([0-9.]+) s per step \(wall, this CPU\)", printed)}
    assert set(steps) == {"off", "on"}, printed
    (plain_peak, plain_flops, _), (ckpt_peak, ckpt_flops, _) = steps["off"], steps["on"]
    batch, width, depth = 512, 128, 6
    up = 2 * batch * width * 4 * width  # one block's up-projection, forward
    forward = depth * 2 * up + 2 * batch * width * 10  # both projections of each block, and the head
    assert plain_flops == 3 * forward  # forward + backward (input and weight gradients) = 3 forwards
    assert ckpt_flops - plain_flops == depth * up  # early-stopping recompute: only each block's up-projection
    assert ckpt_peak < 0.7 * plain_peak
    ratio = _find(r"checkpointing: ([0-9.]+) x the memory, ([0-9.]+) x the FLOPs, ([0-9.]+) x the time", printed)
    assert float(ratio.group(1)) < 0.7 and ratio.group(2) == f"{ckpt_flops / plain_flops:.3f}"
    # the time ratio (group 3) is printed, not asserted: CPU timings are noisy
    assert _verdict(printed) == "TRUE"


# -- 5: pruning ------------------------------------------------------------------------------------------------


def test_05_masking_adds_memory_and_smaller_layers_save_it(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 5: unstructured (masking)")
    weight, bias = 1024 * 1024 * 4, 1024 * 4  # each of the two 1024 x 1024 layers
    dense = 2 * (weight + bias)
    assert _number(_find(r"dense model:\s+([0-9,]+) bytes of parameters", printed).group(1)) == dense == 8_396_800
    assert _number(_find(r"building it and its copy: ([0-9,]+) bytes allocated \(tracked on cpu\)", printed).group(1)) == 2 * dense
    retained, held, zeros = _find(
        r"unstructured, 50% masked:\s+\+([0-9,]+) bytes retained \(tracked on cpu\) -> ([0-9,]+) bytes held .*; ([0-9,]+) weights are zero",
        printed).groups()
    assert _number(retained) == 2 * (weight + weight)  # per layer: weight_mask (float32) and the recomputed weight
    assert _number(held) == dense + 2 * 2 * weight  # weight_orig, weight_mask, weight and the bias, per layer
    assert _number(zeros) == 2 * 1024 * 1024 // 2
    assert _number(_find(r"prune\.remove \(permanent\):\s+-([0-9,]+) bytes retained", printed).group(1)) == 4 * weight
    assert re.search(rf"-> {dense:,} bytes held: the dense size", printed)
    freed, smaller = _find(r"structured, 512 of 1024 units:\s+-([0-9,]+) bytes retained \(tracked on cpu\) -> ([0-9,]+) bytes held",
                           printed).groups()
    half = 1024 * 512 * 4 + 512 * 4 + 512 * 1024 * 4 + 1024 * 4  # 1024 -> 512 -> 1024
    assert _number(smaller) == half == 4_200_448
    assert _number(freed) == dense - half
    assert _verdict(printed) == "FALSE (unstructured) / TRUE (structured)"


# -- 6: channels-last ---------------------------------------------------------------------------------


def test_06_channels_last_takes_the_same_bytes(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 6: the same convolution")
    output, image = 8 * 64 * 112 * 112 * 4, 8 * 3 * 224 * 224 * 4
    layouts = dict(re.findall(r"^\s*(NCHW|channels_last): output \(8, 64, 112, 112\) strides (\([0-9, ]+\))", printed, re.MULTILINE))
    assert set(layouts) == {"NCHW", "channels_last"} and layouts["NCHW"] != layouts["channels_last"], printed
    sizes = re.findall(r": ([0-9,]+) bytes allocated \(tracked on cpu\); input storage ([0-9,]+) bytes", printed)
    assert [(_number(out), _number(inp)) for out, inp in sizes] == [(output, image)] * 2
    assert re.search(rf"converting the input to channels_last allocates {image:,} bytes \(tracked: a full copy\)", printed)
    assert _verdict(printed) == "FALSE"


# -- 7: sparse CSR ------------------------------------------------------------------------------------------


def test_07_csr_pays_off_below_a_third(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 7: CSR bytes against density")
    rows = [tuple(_number(value) if "," in value or value.isdigit() else float(value) for value in row)
            for row in re.findall(r"^\s+(0\.\d\d)\s+([0-9,]+)\s+([0-9,]+)\s+([0-9,]+)\s+([0-9,]+)\s+([0-9,]+)$", printed, re.MULTILINE)]
    assert [row[0] for row in rows] == [0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5], printed
    pointers = _rounded(1025 * 8)
    for density, nnz, made, parts, compact, formula in rows:
        assert abs(nnz / 2**20 - density) < 0.01
        assert made == parts  # nbmem counts a sparse tensor by its parts' storages
        # to_sparse_csr() on the CPU: col_indices is a view into a 2 x nnz int64 buffer
        assert made == _rounded(4 * nnz) + _rounded(16 * nnz) + pointers
        assert compact == formula == _rounded(4 * nnz) + _rounded(8 * nnz) + pointers
    made_even = float(_find(r"to_sparse_csr\(\) as made: 20\.00 bytes per non-zero, break-even at density ([0-9.]+)", printed).group(1))
    compact_even = float(_find(r"compact CSR:\s+12\.00 bytes per non-zero, break-even at density ([0-9.]+)", printed).group(1))
    assert 0.332 < compact_even < 0.334  # (4 MiB - 8,704) / 12 / 2**20 = 0.3326
    assert 0.199 < made_even < 0.201  # (4 MiB - 8,704) / 20 / 2**20 = 0.1996
    assert "nbmem counts a sparse tensor by its parts: True; compact CSR = the formula, byte for byte: True" in printed
    assert _verdict(printed) == "TRUE only below 33.3% density"


# -- 8: quantization ---------------------------------------------------------------------------------------


def test_08_int8_weights_are_a_quarter(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 8: dynamic int8 quantization")
    float_state, float_file = (_number(value) for value in _find(
        r"float32 model: state_dict tensors\s+([0-9,]+) bytes \(computed from their storages\), serialized\s+([0-9,]+) bytes",
        printed).groups())
    int8_state, int8_file = (_number(value) for value in _find(
        r"int8 model:\s+state_dict tensors\s+([0-9,]+) bytes \(computed; weights torch\.qint8, biases float32\), serialized\s+([0-9,]+)",
        printed).groups())
    weight, bias = 1024 * 1024, 1024 * 4
    assert float_state == 2 * (4 * weight + bias)
    assert int8_state == 2 * (weight + bias + 4 + 8)  # int8 weight, float32 bias, float32 scale, int64 zero point
    assert float_file > float_state and int8_file > int8_state  # torch.save adds a little
    assert int8_file / float_file < 0.26
    tracked = _number(_find(r"nbmem's tracker, quantized model: ([0-9,]+) bytes retained \(tracked on cpu\)", printed).group(1))
    assert tracked < weight  # not even one int8 weight matrix: packed parameters are invisible to the tracker
    assert _verdict(printed) == "TRUE"


# -- 9: depthwise separable convolutions -----------------------------------------------------------------


def test_09_fewer_parameters_more_activations(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 9: standard vs depthwise separable")
    rows = {name.strip(): (_number(parameters), _number(peak), _number(activations)) for name, parameters, peak, activations in re.findall(
        r"^\s*(standard 3x3|depthwise \+ pointwise):\s+([0-9,]+) parameters; forward \+ backward: tracked peak\s+([0-9,]+) bytes "
        r"allocated above the start on cpu, activations at the peak\s+([0-9,]+) bytes", printed, re.MULTILINE)}
    (std_params, std_peak, std_act), (sep_params, sep_peak, sep_act) = rows["standard 3x3"], rows["depthwise + pointwise"]
    assert std_params == 64 * 128 * 9 + 128
    assert sep_params == 64 * 9 + 64 + 64 * 128 + 128
    feature_map = 16 * 64 * 56 * 56 * 4
    assert std_act == feature_map and sep_act == 2 * feature_map  # the input; the input and the intermediate
    assert sep_peak > std_peak
    assert _verdict(printed) == "TRUE (parameters) / FALSE (activations)"


# -- 10: data parallelism -------------------------------------------------------------------------------------


def test_10_ddp_does_not_shrink_each_gpu_fsdp_does(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 10: per-GPU estimates")
    block = 2 * 4096 + 4096 * 16384 + 16384 + 16384 * 4096 + 4096
    assert f"{8 * block + 4096 * 10 + 10:,} parameters (counted on the meta device" in printed
    assert "gpumem sweep: peak allocated per GPU in GiB, estimated; capacity T4" in printed
    peaks = {(strategy, int(gpus)): (_number(peak), fits) for strategy, gpus, peak, fits in re.findall(
        r"(ddp|fsdp) on (\d) GPUs?\s*: estimated peak\s+([0-9,]+) bytes allocated per GPU \((fits|does NOT fit) a T4\)", printed)}
    assert set(peaks) == {("ddp", 1), ("ddp", 8), ("fsdp", 1), ("fsdp", 8)}, printed
    assert peaks["ddp", 8][0] >= peaks["ddp", 1][0] and peaks["ddp", 8][1] == "does NOT fit"
    assert peaks["fsdp", 8][0] < 0.5 * peaks["fsdp", 1][0] and peaks["fsdp", 8][1] == "fits"
    assert _verdict(printed) == "FALSE (DDP) / TRUE (FSDP)"


# -- 11: an epoch on the device ----------------------------------------------------------------------------


def test_11_a_batch_not_an_epoch(nb07: nbformat.NotebookNode) -> None:
    printed = _claim(nb07, "# claim 11: one epoch of CIFAR-sized data")
    assert "one epoch, 50,000 x 3 x 32 x 32 float32: 614,400,000 bytes = 614.4 MB" in printed
    assert "one batch, 128 x 3 x 32 x 32 float32:    1,572,864 bytes" in printed
    step = _number(_find(r"a training step at batch 128:\s+([0-9,]+) bytes allocated at the peak \(estimated\), fits 512MiB",
                         printed).group(1))
    assert step < 614_400_000
    assert re.search(r"the epoch alone on the 512MiB device:\s+does NOT fit", printed)
    assert _verdict(printed) == "FALSE"


# -- the summary table ---------------------------------------------------------------------------------------


def test_summary_collects_every_section_verdict(nb07: nbformat.NotebookNode) -> None:
    sections = {
        1: "# claim 1: the verdict", 2: "# claim 2:", 3: "# claim 3:", 4: "# claim 4:", 5: "# claim 5:", 6: "# claim 6:",
        7: "# claim 7:", 8: "# claim 8:", 9: "# claim 9:", 10: "# claim 10:", 11: "# claim 11:",
    }
    summary = _claim(nb07, "# summary: every claim's verdict")
    lines = {int(line[:2]): line for line in summary.splitlines() if re.match(r"^\s?\d+  ", line)}
    assert sorted(lines) == list(range(1, 12)), summary
    for number, start in sections.items():
        verdict = _verdict(_claim(nb07, start))
        assert re.match(rf"^\s?{number}  .{{56}} {re.escape(verdict)}\s", lines[number]), (verdict, lines[number])
    assert "11 claims measured" in summary
