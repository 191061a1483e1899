"""What-if: the same workload over batch sizes, precisions, checkpointing, optimizers, accumulation.

``nbmem.sweep(build_model, make_batch, batch_size=[8, 16, 32], precision=["fp32",
"bf16"])`` runs every combination, each isolated (a fresh model and optimizer),
estimated on fake tensors, tracked for real on the CPU or measured on CUDA, and returns a
:class:`Comparison`: a table with one shared unit, its records, and charts.
"""

from __future__ import annotations

import gc
import html
import itertools
import numbers
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .estimation import Estimate, _run_device, estimate
from .launcher import RankError, launch
from .parallel import check_parallel
from .userstep import BUILT_IN, check_step, step_label
from .results import CATEGORIES, text_table
from .units import format_bytes

__all__ = ["sweep", "Comparison", "SweepRow", "AXES", "max_batch_size", "BatchSizeResult"]

#: The most ranks a real data-parallel check launches on this machine (each a process).
MAX_LAUNCH_RANKS = 8

#: The knobs a sweep can vary, in the order a table shows them.
AXES = ("batch_size", "precision", "checkpointing", "optimizer", "accumulation", "parallel", "world_size")

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
        return dict(self.config)[axis]


class Comparison:
    """A sweep's results side by side: scenario rows, variant columns, one unit for all.

    Returned by :func:`sweep`; a notebook displays it as a table. ``len()``
    and iteration give its rows (:class:`SweepRow`: the knobs and the
    :class:`~nbmem.Estimate`, or the error such as ``"OOM"``);
    :meth:`to_records` gives one dict per configuration, :meth:`to_dataframe`
    the same as a pandas DataFrame, :meth:`plot` a matplotlib chart.

    >>> build = lambda: torch.nn.Linear(64, 4)
    >>> make = lambda n: torch.randn(n, 64)
    >>> table = sweep(build, make, batch_size=8, optimizer=["sgd", "adamw"])
    >>> print(table)
    gpumem sweep: peak allocated in KiB, estimated
    optimizer  peak
    ---------  ----
    sgd        7
    adamw      11
    >>> [row.peak for row in table]
    [7168, 11264]
    """

    def __init__(self, rows: list[SweepRow], axes: tuple[str, ...], mode: str, capacity: int | None, label: str) -> None:
        self.rows = rows
        self.axes = axes  # the axes that were swept (more than one value)
        self.mode = mode
        self.capacity = capacity
        self.capacity_label = label

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
        row_axis: str | None = next((axis for axis in ("batch_size", "world_size") if axis in self.axes), None)
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
        return ", ".join(f"{axis}={value}" for axis, value in zip(column_axes, key)) or "peak"

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
        return "\n".join([head, *text_table(header, body)])

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
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
        )

    def _step_label(self) -> str:
        """The user's own step, when it ran (the built-in one goes unsaid, as in every earlier table)."""
        first = next((row.result for row in self.rows if row.result is not None), None)
        return f"; step {first.step}" if first is not None and first.step != BUILT_IN else ""

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per configuration: its knobs, peaks (bytes), the breakdown at the peak, or the error."""
        records = []
        for row in self.rows:
            record: dict[str, Any] = dict(row.config)
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
        """``"lines"``: peak against batch size, one line per variant, the capacity as a line;
        ``"breakdown"``: stacked category bars at the peak, one per configuration."""
        from .charts import comparison_figure

        if kind not in ("lines", "breakdown"):
            raise ValueError(f"unknown plot kind {kind!r}: use 'lines' or 'breakdown'")
        return comparison_figure(self, kind)


def _values(name: str, value: Any) -> list[Any]:
    if isinstance(value, (list, tuple, range)):
        if not value:
            raise ValueError(f"{name} has no values to sweep over")
        return list(value)
    return [value]


def sweep(
    model: Any,
    batch: Any,
    *,
    batch_size: int | Iterable[int],
    precision: str | Iterable[str] = "fp32",
    checkpointing: Any = False,
    optimizer: Any = "adamw",
    accumulation: int | Iterable[int] = 1,
    parallel: str | Iterable[str] = "single",
    world_size: int | Iterable[int] = 1,
    mode: str = "estimated",
    device: int | str | None = None,
    loss: Any = None,
    foreach: bool | None = None,
    step: Any = None,
) -> Comparison:
    """Run every combination of the knobs and compare their peaks.

    Each knob takes one value or a list. ``mode`` is ``"estimated"`` (fake
    tensors: no memory, any size), ``"tracked"`` (the step really runs on
    this machine's CPU, each tensor accounted) or ``"measured"`` (it really
    runs on the current CUDA device). ``device`` (``"T4"``, ``"16GiB"``) adds
    a capacity: estimates past it are marked, and a real run that crosses it
    fails with an out-of-memory error, recorded as OOM, after which the sweep
    goes on (a real out-of-memory error on the GPU is recorded the same way).

    ``parallel`` and ``world_size`` compare data-parallel strategies
    (:data:`nbmem.STRATEGIES`) over GPU counts: figures are per GPU, the batch
    size per GPU (``"single"`` is only combined with a world size of 1).
    Estimated, any world size; tracked or measured, each configuration is a
    real :func:`nbmem.launch` of that many ranks, its largest rank shown.

    ``step`` is your own training step, ``step(model, batch, optimizer)``, run
    in every configuration instead of nbmem's built-in one (see
    :func:`nbmem.estimate`); its loop shape is its own, so ``accumulation``
    stays 1.

    Every configuration is isolated: a fresh model and optimizer, all freed
    (``gc.collect()``) before the next; a measured sweep also returns the
    cached blocks to CUDA (``torch.cuda.empty_cache()``) between
    configurations, so each one's reserved peak is its own.

    >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> make = lambda n: (torch.randn(n, 64), torch.randint(0, 4, (n,)))
    >>> table = sweep(build, make, batch_size=[8, 16], optimizer=["sgd", "adamw"])
    >>> [record["optimizer"] for record in table.to_records()]
    ['sgd', 'adamw', 'sgd', 'adamw']
    """
    _run_device(mode)  # an unknown mode, or 'measured' without CUDA, fails before anything runs
    grid = {
        "batch_size": _values("batch_size", batch_size),
        "precision": _values("precision", precision),
        "checkpointing": _values("checkpointing", checkpointing),
        "optimizer": _values("optimizer", optimizer),
        "accumulation": _values("accumulation", accumulation),
        "parallel": _values("parallel", parallel),
        "world_size": _values("world_size", world_size),
    }
    for size in grid["world_size"]:
        check_parallel("ddp", size)  # a world size that can't be fails before anything runs
        if mode != "estimated" and size > MAX_LAUNCH_RANKS:
            raise ValueError(
                f"a {mode} sweep launches world_size real ranks on this machine, at most {MAX_LAUNCH_RANKS}, and "
                f"world_size={size} was asked for: estimate larger worlds (mode='estimated')"
            )
    for name in grid["parallel"]:
        check_parallel(name, 1 if name == "single" else 2)
    for steps, chosen, strategy, kind in itertools.product(
        grid["accumulation"], grid["optimizer"], grid["parallel"], grid["precision"]
    ):
        check_step(step, accumulation=steps, loss=loss, optimizer=chosen, parallel=strategy, precision=kind)
    capacity = label = None
    if device is not None:
        from .devices import parse_capacity

        capacity, label = parse_capacity(device)
    rows = []
    for combination in itertools.product(*grid.values()):
        config = tuple(zip(grid, combination))
        options = dict(config)
        if options["parallel"] == "single" and options["world_size"] != 1:
            continue  # one device has no world size to vary
        try:
            rows.append(SweepRow(config, run_configuration(model, batch, mode, dict(loss=loss, foreach=foreach, device=device, step=step,
                                                                       **_enforced(mode, capacity), **options))))
        except torch.OutOfMemoryError:
            rows.append(SweepRow(config, None, "OOM"))
        finally:
            _isolate(mode)
    swept = tuple(axis for axis in AXES if len(grid[axis]) > 1)
    return Comparison(rows, swept, mode, capacity, label or "")


def real_mode() -> str:
    """How a real check runs here: measured on the CUDA device when there is one, else tracked on this CPU."""
    return "measured" if torch.cuda.is_available() else "tracked"


def run_configuration(model: Any, batch: Any, mode: str, options: dict[str, Any]) -> Estimate:
    """One configuration: an estimate, a real run here, or (data-parallel, real) a launch's largest rank.

    A rank that ran out of memory raises ``torch.OutOfMemoryError``, as a run in this process would.
    """
    if mode == "estimated" or options["parallel"] == "single":
        return estimate(model, batch, mode=mode, **options)
    try:
        return launch(model, batch, mode=mode, **options).worst
    except RankError as error:
        if "OutOfMemoryError" in error.kind:  # one rank ran out: the configuration does not fit
            raise torch.OutOfMemoryError(str(error)) from error
        raise


def _enforced(mode: str, capacity: int | None) -> dict[str, Any]:
    """A real run enforces the capacity (the op that crosses it raises); an estimate only compares."""
    return {"enforce_capacity": capacity is not None and mode != "estimated"}


def _isolate(mode: str) -> None:
    """Free what one configuration left, so the next starts from nothing of it."""
    gc.collect()
    if mode == "measured":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class BatchSizeResult:
    """The largest batch that fits a capacity: predicted from estimates, then verified for real."""

    batch_size: int  # the largest size a real trial ran within the capacity (0 if even 1 did not)
    predicted: int  # what the estimates predicted before any real trial
    capacity: int
    capacity_label: str
    mode: str
    trials: tuple[tuple[int, int | None], ...]  # (batch size, peak) per real trial; None: out of memory
    estimates: int  # fake-tensor estimates used for the prediction
    limit: int
    accumulation: int = 1  # micro-batches per optimizer step the search used
    parallel: str = "single"  # the data-parallel strategy; sizes are per GPU
    world_size: int = 1
    step: str = BUILT_IN  # which training step ran (Estimate.step)

    @property
    def real_trials(self) -> int:
        return len(self.trials)

    @property
    def limit_reached(self) -> bool:
        """True when the search stopped at ``limit`` with it still fitting: a lower bound, not a boundary."""
        return self.batch_size == self.limit

    @property
    def answer(self) -> str:
        """The size in words: the boundary found, or the search limit it stopped at (never passed off as one)."""
        if self.limit_reached:
            return (f"at least {self.batch_size} (reached the search limit {self.limit}; the true maximum may be "
                    f"larger: search again with a larger limit=)")
        return str(self.batch_size)

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.accumulation

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step across all GPUs."""
        return self.effective_batch * self.world_size

    def __str__(self) -> str:
        tried = ", ".join(f"{size} {'OOM' if peak is None else format_bytes(peak)}" for size, peak in self.trials)
        per_step = (
            f" x {self.accumulation} micro-batches = effective batch {self.effective_batch}"
            if self.accumulation > 1
            else ""
        )
        scale = (
            f" per GPU, {self.parallel} on {self.world_size} GPUs (global batch {self.global_batch}; the largest rank "
            "verified)"
            if self.parallel != "single"
            else ""
        )
        return (
            f"gpumem max_batch_size on {self.capacity_label or format_bytes(self.capacity)}: {self.answer}{per_step}"
            f"{scale}"
            f" (predicted {self.predicted} from {self.estimates} estimates; verified with {self.real_trials} real"
            f" {self.mode} trials: {tried})\n"
            f"  step: {self.step}\n"
            "  for a larger effective batch, search again with accumulation=N: gradients stay alive across "
            "micro-batches, so the largest micro-batch is smaller than the largest single batch"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _boundary(fits: Any, start: int, limit: int) -> int:
    """The largest size in 1..limit for which ``fits`` holds, searched outwards from ``start``.

    Steps away from ``start`` with a doubling stride until the answer changes,
    then bisects; every returned size was tried, and so was the one above it
    (unless it is ``limit``). 0 when even 1 does not fit.
    """
    if fits(start):
        low, step = start, 1
        while low < limit:
            probe = min(low + step, limit)
            if not fits(probe):
                high = probe
                break
            low, step = probe, step * 2
        else:
            return limit
    else:
        high, step = start, 1
        while True:
            probe = high - step
            if probe < 1:
                low = 0
                break
            if fits(probe):
                low = probe
                break
            high, step = probe, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def max_batch_size(
    model: Any,
    batch: Any,
    *,
    device: int | str,
    precision: str = "fp32",
    checkpointing: Any = False,
    optimizer: Any = "adamw",
    loss: Any = None,
    foreach: bool | None = None,
    accumulation: int = 1,
    limit: int = 1 << 16,
    verify: str = "auto",
    parallel: str = "single",
    world_size: int = 1,
    step: Any = None,
) -> BatchSizeResult:
    """The largest batch size whose training step fits ``device`` (``"T4"``, ``"16GiB"``).

    First predicted from fake-tensor estimates (fixed memory plus memory per
    sample, extrapolated, then refined on estimates), then verified for real
    (``verify``): ``"measured"`` runs the step on the current CUDA device,
    ``"tracked"`` on this CPU, each on a virtual device of that capacity (an
    allocation past it raises, as on the real card); ``"auto"`` measures
    where CUDA is available and tracks otherwise. A size fits as
    :attr:`Estimate.fits` says: its allocated peak within the capacity, and
    every segment the caching allocator must reserve for it (simulated on a
    CPU) available. The answer is always a size that ran, with the next size up seen to fail
    (or ``limit`` reached): memory is not always monotonic in batch size, so
    nothing untested is returned. With ``accumulation=N`` the size is the
    largest micro-batch of an N-micro-batch step (the gradients stay alive
    across micro-batches, so it can be smaller than the largest single batch).

    With ``parallel`` and ``world_size`` the size is per GPU: predicted from
    estimates of rank 0, verified by real launches (:func:`nbmem.launch`) of
    ``world_size`` ranks on this machine, the largest rank counting; real
    launches are limited to :data:`MAX_LAUNCH_RANKS` ranks.

    ``limit`` (a whole number, at least 1) caps the search. When ``limit``
    itself fits, the result's ``limit_reached`` is True and its text says
    the true maximum may be larger: ``batch_size`` is then a lower bound.

    ``step`` is your own training step, ``step(model, batch, optimizer)``
    (see :func:`nbmem.estimate`): the size is then the largest batch your
    step fits, estimated and verified with that step.

    >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    >>> make = lambda n: (torch.randn(n, 256), torch.randn(n, 256))
    >>> found = max_batch_size(build, make, device="8MiB", optimizer="sgd")
    >>> sizes = dict(found.trials)
    >>> sizes[found.batch_size] is not None and sizes[found.batch_size + 1] is None   # tested on both sides
    True
    """
    from .devices import parse_capacity

    # a bool is an integer to Python, and limit=True would search 1..1; numpy's integers are welcome
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise ValueError(
            f"limit={limit!r} can't cap a batch-size search: pass a whole number of samples, at least 1 "
            "(the default is 65536)"
        )
    limit = int(limit)
    if verify == "auto":
        verify = real_mode()
    if verify not in ("tracked", "measured"):
        raise ValueError(f"unknown verify mode {verify!r}: use 'auto', 'tracked' (this CPU) or 'measured' (CUDA)")
    _run_device(verify)
    check_parallel(parallel, world_size)
    if world_size > MAX_LAUNCH_RANKS:
        raise ValueError(
            f"max_batch_size verifies by launching world_size real ranks on this machine, at most "
            f"{MAX_LAUNCH_RANKS}, and world_size={world_size}: for larger worlds compare estimates with "
            f"nbmem.sweep(..., batch_size=[...], parallel={parallel!r}, world_size={world_size})"
        )
    capacity, label = parse_capacity(device)
    check_step(step, accumulation=accumulation, loss=loss, optimizer=optimizer, parallel=parallel, precision=precision)
    options = dict(precision=precision, checkpointing=checkpointing, optimizer=optimizer, loss=loss, foreach=foreach,
                   accumulation=accumulation, parallel=parallel, world_size=world_size, step=step)
    estimates = 0

    def estimated(size: int) -> Estimate:
        nonlocal estimates
        estimates += 1
        return estimate(model, batch, batch_size=size, device=capacity, **options)

    # memory = fixed + per_sample * batch, from two estimates, then the
    # boundary on estimates alone (cheap: no memory, no data)
    at_one, at_eight = estimated(1).peak, estimated(8).peak
    per_sample = max((at_eight - at_one) / 7, 1.0)
    guess = max(1, min(int((capacity - at_one) // per_sample) + 1, limit))
    # fits as Estimate.fits says: the allocated peak, and every segment the allocator must reserve
    predicted = _boundary(lambda size: bool(estimated(size).fits), guess, limit)

    trials: list[tuple[int, int | None]] = []

    def fits(size: int) -> bool:
        try:
            result = run_configuration(model, batch, verify,
                          dict(batch_size=size, device=capacity, enforce_capacity=True, **options))
        except torch.OutOfMemoryError:
            trials.append((size, None))
            return False
        finally:
            _isolate(verify)
        if result.fits is False:  # ran within the capacity, but a segment it needs could not be reserved
            trials.append((size, None))
            return False
        trials.append((size, result.peak))
        return True

    # verify for real around the prediction: both sides of the boundary are tried
    found = _boundary(fits, max(predicted, 1), limit)
    return BatchSizeResult(found, predicted, capacity, label, verify, tuple(trials), estimates, limit, accumulation,
                           parallel, world_size, step_label(step))
