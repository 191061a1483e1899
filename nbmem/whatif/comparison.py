"""A sweep's result: one row per configuration, a table with one shared unit, its records and charts."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Iterable

from ..estimation.estimate import Estimate
from ..estimation.finetune import trainable_label
from ..estimation.quantization import quantization_label
from ..estimation.userstep import BUILT_IN
from ..core.rendering import text_table
from ..core.units import format_bytes

__all__ = ["Comparison", "SweepRow", "AXES"]

#: The knobs a sweep can vary, in the order a table shows them.
AXES = ("batch_size", "precision", "checkpointing", "optimizer", "accumulation", "parallel", "world_size", "trainable",
        "quantization", "compile", "task", "prompt_length", "new_tokens")

#: The axes a table's rows (and a chart's x axis) take first, when swept: the context length, then sizes.
_ROW_AXES = ("prompt_length", "batch_size", "world_size")

_UNITS = (("B", 1), ("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3), ("TiB", 1024**4))


@dataclass(frozen=True)
class SweepRow:
    """One configuration of a sweep and what it gave: an estimate, or the error that stopped it."""

    config: tuple[tuple[str, Any], ...]
    result: Estimate | None
    error: str | None = None

    @property
    def peak(self) -> int | None:
        return None if self.result is None else self.result.peak

    def value(self, axis: str) -> Any:
        """The knob's value; what trains by its label (a predicate or a PEFT config has no readable value)."""
        value = dict(self.config)[axis]
        return trainable_label(value) if axis == "trainable" else quantization_label(value) if axis == "quantization" \
            else value


class Comparison:
    """A sweep's results side by side: scenario rows, variant columns, one unit for all.

    Returned by :func:`sweep`; a notebook displays it as a table. ``len()``
    and iteration give its rows (:class:`SweepRow`: the knobs and the
    :class:`~nbmem.Estimate`, or the error such as ``"OOM"``);
    :meth:`to_records` gives one dict per configuration, :meth:`to_dataframe`
    the same as a pandas DataFrame, :meth:`plot` a matplotlib chart.
    ``planned`` is the number of configurations the sweep set out to run;
    ``interrupted`` is True when Ctrl-C stopped it first: the rows are then
    the configurations that finished, and the text says so (issue 15).

    >>> build = lambda: torch.nn.Linear(64, 4)
    >>> make = lambda n: torch.randn(n, 64)
    >>> import torch
    >>> from nbmem import sweep
    >>> table = sweep(build, make, batch_size=8, optimizer=["sgd", "adamw"])
    >>> print(table)
    gpumem sweep: peak allocated in KiB, estimated
    optimizer  peak
    ---------  ----
    sgd        7
    adamw      10
    >>> [row.peak for row in table]
    [7168, 10240]
    """

    def __init__(self, rows: list[SweepRow], axes: tuple[str, ...], mode: str, capacity: int | None, label: str,
                 *, planned: int | None = None, interrupted: bool = False) -> None:
        self.rows = rows
        self.axes = axes  # the axes that were swept (more than one value)
        self.mode = mode
        self.capacity = capacity
        self.capacity_label = label
        self.planned = len(rows) if planned is None else planned  # configurations the sweep set out to run
        self.interrupted = interrupted  # Ctrl-C stopped the sweep: the rows are those that finished

    @property
    def complete(self) -> bool:
        """Every planned configuration has its row (False after Ctrl-C)."""
        return not self.interrupted and len(self.rows) == self.planned

    def _incomplete_line(self) -> str:
        """The line an interrupted sweep's text and HTML carry; empty for a complete one."""
        if self.complete:
            return ""
        return (f"interrupted after {len(self.rows)} of {self.planned} configurations (Ctrl-C): the table holds the "
                f"{len(self.rows)} that finished; run the sweep again for the rest")

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterable[SweepRow]:
        return iter(self.rows)

    @property
    def unit(self) -> tuple[str, int]:
        """The one unit of the whole table: the largest peak's."""
        top = max((row.peak or 0 for row in self.rows), default=0)
        name, size = _UNITS[0]
        for candidate, candidate_size in _UNITS:
            if top >= candidate_size:
                name, size = candidate, candidate_size
        return name, size

    def _grid(self) -> tuple[str | None, list[Any], list[tuple[Any, ...]], dict[tuple[Any, tuple[Any, ...]], SweepRow]]:
        """(row axis, row values, column keys, {(row value, column key): SweepRow})."""
        row_axis: str | None = next((axis for axis in _ROW_AXES if axis in self.axes), None)
        row_axis = row_axis or (self.axes[0] if self.axes else None)
        column_axes = [axis for axis in self.axes if axis != row_axis]
        row_values = list(dict.fromkeys(row.value(row_axis) for row in self.rows)) if row_axis else [None]
        columns = list(dict.fromkeys(tuple(row.value(axis) for axis in column_axes) for row in self.rows))
        cells = {
            (row.value(row_axis) if row_axis else None, tuple(row.value(axis) for axis in column_axes)): row
            for row in self.rows
        }
        return row_axis, row_values, columns, cells

    def _column_name(self, key: tuple[Any, ...]) -> str:
        column_axes = [axis for axis in self.axes if axis != self._grid()[0]]
        # a knob its task does not use (inference's new_tokens) is None: left out of the name
        return ", ".join(f"{axis}={value}" for axis, value in zip(column_axes, key) if value is not None) or "peak"

    def _cell(self, row: SweepRow | None) -> str:
        if row is None:
            return ""
        if row.error:
            return row.error
        result = row.result
        assert result is not None  # a row without an error has its result
        unit, size = self.unit
        text = f"{result.peak / size:.3g}"
        if result.fits is False:  # Estimate.fits: the allocated peak, and every segment reserved (None: no capacity)
            text += " (no fit)"
        return text

    def table_rows(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        row_axis, row_values, columns, cells = self._grid()
        header = (row_axis or "", *(self._column_name(key) for key in columns))
        body = [(self._row_label(row_axis, value), *(self._cell(cells.get((value, key))) for key in columns))
                for value in row_values]
        return header, body

    def _row_label(self, axis: str | None, value: Any) -> str:
        """A world size also says the global batch it trains (when one batch size was swept)."""
        if axis == "world_size" and "batch_size" not in self.axes and self.rows:
            first = next((row.result for row in self.rows if row.result is not None), None)
            if first is not None:
                return f"{value} (global batch {first.effective_batch * value})"
        return str(value)

    def __str__(self) -> str:
        unit, _ = self.unit
        header, body = self.table_rows()
        fits = (
            f"; capacity {self.capacity_label or format_bytes(self.capacity)} (no fit: the peak, or a segment the "
            "allocator must reserve, is past it)"
            if self.capacity is not None
            else ""
        )
        per_gpu = " per GPU" if any(row.value("world_size") != 1 for row in self.rows) else ""
        head = f"gpumem sweep: peak allocated{per_gpu} in {unit}, {self.mode}{fits}{self._step_label()}"
        incomplete = [self._incomplete_line()] if not self.complete else []
        return "\n".join([head, *incomplete, *text_table(header, body)])

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        unit, _ = self.unit
        header, body = self.table_rows()
        head = "".join(f"<th style='text-align:right'>{html.escape(name)}</th>" for name in header)
        rows = "".join(
            "<tr>" + "".join(f"<td style='text-align:right'>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in body
        )
        return (
            f"<div class='nbmem-sweep'><b>gpumem sweep</b>: peak allocated in {unit}, {html.escape(self.mode)}"
            f"{html.escape(self._step_label())}"
            + (f"<div class='nbmem-incomplete' style='color:#b00020'>{html.escape(self._incomplete_line())}</div>"
               if not self.complete else "")
            + f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
        )

    def _step_label(self) -> str:
        """The user's own step, when it ran (the built-in one goes unsaid, as in every earlier table)."""
        first = next((row.result for row in self.rows if row.result is not None), None)
        return f"; step {first.step}" if first is not None and first.step != BUILT_IN else ""

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per configuration: its knobs, peaks (bytes), the breakdown at the peak, or the error."""
        records = []
        for row in self.rows:
            record: dict[str, Any] = {axis: row.value(axis) for axis, _ in row.config}
            record["mode"] = self.mode
            record["error"] = row.error
            if row.result is not None:
                record.update(first_step=row.result.first_step, steady=row.result.steady, peak=row.result.peak,
                              reserved=row.result.reserved, global_batch=row.result.global_batch)
                record.update({f"peak_{name.replace(' ', '_')}": size for name, size in row.result.breakdown.at_peak})
            records.append(record)
        return records

    def to_dataframe(self) -> Any:
        try:
            import pandas
        except ImportError as error:
            raise ImportError("Comparison.to_dataframe() needs pandas: `pip install pandas`, or use to_records()") from error
        return pandas.DataFrame.from_records(self.to_records())

    def plot(self, kind: str = "lines") -> Any:
        """``"lines"``: peak against the context length (``prompt_length``) when swept, else the batch
        size, one line per variant, the capacity as a line; ``"breakdown"``: stacked category bars at the peak, one per configuration."""
        from ..core.charts import comparison_figure

        if kind not in ("lines", "breakdown"):
            raise ValueError(f"unknown plot kind {kind!r}: use 'lines' or 'breakdown'")
        return comparison_figure(self, kind)
