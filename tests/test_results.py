"""MemoryResult and History: derived figures, text, HTML, records, chart; import cost."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nbmem.core.results import History, MemoryResult

MiB = 1024**2
GiB = 1024**3


def measured(**fields) -> MemoryResult:
    values = dict(
        mode="measured",
        device="cuda:0",
        allocated_before=1 * GiB,
        peak_allocated=3 * GiB,
        allocated_after=int(1.5 * GiB),
        seconds=0.25,
        reserved_before=2 * GiB,
        peak_reserved=4 * GiB,
        reserved_after=4 * GiB,
        device_name="Stand-in GPU",
        capacity=80 * GiB,
        device_free=70 * GiB,
        label="loss.backward()",
        execution_count=7,
    )
    values.update(fields)
    return MemoryResult(**values)


def test_derived_figures():
    result = measured()
    assert result.peak == 2 * GiB  # 3 GiB at the peak - 1 GiB before
    assert result.retained == GiB // 2
    assert result.cached == 4 * GiB - int(1.5 * GiB)
    assert result.share == pytest.approx(2 / 80)
    assert not result.failed and measured(error="OutOfMemoryError").failed


def test_text_report_names_every_figure_and_its_source():
    text = str(measured())
    assert text.splitlines()[0] == "gpumem loss.backward(): measured on cuda:0 (Stand-in GPU) by the CUDA caching allocator"
    assert "+2.00 GiB allocated above the start (2.5% of 80.0 GiB); 3.00 GiB in use at the peak" in text
    assert "+512 MiB allocated (1.00 GiB before, 1.50 GiB after)" in text
    assert "4.00 GiB at the peak, 4.00 GiB after (2.50 GiB cached" in text
    assert "70.0 GiB free of 80.0 GiB (device view" in text


def test_tracked_text_says_no_cuda_and_no_reserved():
    result = MemoryResult(mode="tracked", device="cpu", allocated_before=0, peak_allocated=512, allocated_after=0, seconds=0.0)
    text = str(result)
    assert "tracked on cpu, no CUDA device used" in text
    assert "not known in tracked mode" in text
    assert result.share is None and "device" not in [line.split()[0] for line in text.splitlines()[1:]]


def test_capacity_bar_segments_sum_to_capacity():
    segments = dict(measured().bar_segments())
    assert segments == {"before": GiB, "cell peak": 2 * GiB, "cached": GiB, "free": 76 * GiB}
    html = measured()._repr_html_()
    assert html.count('class="nbmem-seg ') == 4 and "nbmem-report" in html


def test_failed_result_is_marked_in_every_rendering():
    result = measured(error="OutOfMemoryError")
    assert "FAILED with OutOfMemoryError" in str(result)
    assert "FAILED" in result._repr_html_()
    assert result.summary().endswith("FAILED (OutOfMemoryError)")


def test_history_records_dataframe_and_table():
    history = History([measured(), measured(execution_count=8, label="x" * 60, error="ValueError")])
    records = history.to_records()
    assert [record["peak"] for record in records] == [2 * GiB, 2 * GiB]
    assert records[1]["error"] == "ValueError" and records[0]["notes"] == []
    frame = history.to_dataframe()
    assert list(frame["execution_count"]) == [7, 8]
    text = str(history)
    assert "x" * 39 + "…" in text and "FAILED (ValueError)" in text
    assert history.peak == 3 * GiB
    assert "<table class='nbmem-history'>" in history._repr_html_()


def test_history_dataframe_without_pandas_says_how_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match="pip install pandas"):
        History([measured()]).to_dataframe()


def test_history_chart_has_one_stacked_bar_per_cell():
    figure = History([measured(), measured(execution_count=8)]).plot()
    axes = figure.axes[0]
    heights = sorted(patch.get_height() for patch in axes.patches)
    assert heights == [1, 1, 2, 2]  # GiB: before + cell peak, per cell
    assert axes.get_ylabel() == "allocated (GiB)"
    assert [label.get_text() for label in axes.get_xticklabels()] == ["[7] loss.backward()", "[8] loss.backward()"]


def test_empty_history_text():
    assert "no cells measured yet" in str(History())


@pytest.mark.slow  # a fresh interpreter, in a subprocess
def test_import_nbmem_is_light():
    code = (
        "import sys, nbmem\n"
        "heavy = [m for m in ('IPython', 'ipywidgets', 'matplotlib', 'torch', 'nbclient') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"


def test_lazy_names_resolve_and_unknown_names_raise():
    import nbmem

    assert nbmem.MemoryResult is MemoryResult
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        nbmem.nothing  # noqa: B018
