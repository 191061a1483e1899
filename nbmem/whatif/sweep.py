"""What-if: the same workload over batch sizes, precisions, checkpointing, optimizers, accumulation.

``nbmem.sweep(build_model, make_batch, batch_size=[8, 16, 32], precision=["fp32",
"bf16"])`` runs every combination, each isolated (a fresh model and optimizer),
estimated on fake tensors, tracked for real on the CPU or measured on CUDA, and returns a
:class:`Comparison`: a table with one shared unit, its records, and charts.
"""

from __future__ import annotations

import gc
import itertools
import sys
from typing import Any, Callable, Iterable

import torch

from .comparison import AXES, Comparison, SweepRow
from ..estimation.estimate import Estimate, estimate_plan
from ..estimation.quantization import Quantization, quantization_label
from ..estimation.finetune import check_trainable, trainable_label
from .launcher import RankError, launch_plan
from ..estimation.parallel import check_parallel, fsdp_family
from .progress import Progress, check_progress
from ..core.units import format_bytes
from ..estimation.plan import Plan, compile_refusal, run_device
from ..tracking.accelerators import accelerator_type, current_device, device_counter

__all__ = ["sweep", "Comparison", "SweepRow", "AXES", "used_knobs", "real_mode", "run_configuration", "MAX_LAUNCH_RANKS"]

#: The most ranks a real data-parallel check launches on this machine (each a process).
MAX_LAUNCH_RANKS = 8


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
    trainable: Any = None,
    task: str | Iterable[str] = "train",
    prompt_length: int | None | Iterable[int] = None,
    new_tokens: int | None | Iterable[int] = None,
    alloc_conf: Any = None,
    block: Any = None,
    checkpoint_saves: Any = None,
    zero_grad: str = "after_step",
    hold_output: bool = True,
    optimizer_in_backward: bool = False,
    mp_policy: Any = None,
    cpu_offload: bool = False,
    attention: str | None = None,
    quantization: Any = None,
    compile: bool | Iterable[bool] = False,
    timeline: bool = False,
    progress: bool = True,
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

    ``trainable`` chooses what trains (:mod:`nbmem.estimation.finetune`); a list of
    choices, e.g. ``["all", "head", "lora"]``, is an axis like the others:
    full fine-tuning, a frozen backbone and LoRA side by side.
    ``task`` (``"train"``, ``"inference"``, ``"generate"``; :mod:`nbmem.estimation.tasks`),
    ``prompt_length`` (the context length) and ``new_tokens`` are axes too:
    with ``prompt_length`` the batch factory is called as
    ``batch(batch_size, prompt_length)`` for training and inference, and
    :meth:`Comparison.plot` draws the peak against the context length. Knobs
    a task does not use are left out of its rows (inference and generation
    build no optimizer and don't checkpoint; only generation takes
    ``new_tokens``), so each such configuration runs once.

    Every configuration is isolated: a fresh model and optimizer, all freed
    (``gc.collect()``) before the next; a measured sweep also returns the
    cached blocks to the device (``torch.cuda.empty_cache()``, or its accelerator's) between
    configurations, so each one's reserved peak is its own.

    ``alloc_conf`` (a PYTORCH_ALLOC_CONF string; see :func:`nbmem.estimate`)
    sets the allocator settings every simulated reserved figure follows;
    ``block`` names the block checkpointing wraps and FSDP shards,
    ``checkpoint_saves`` what checkpointed blocks keep, ``zero_grad``
    where the built-in step zeroes gradients, ``hold_output`` whether it holds the model's output through
    backward, ``optimizer_in_backward``
    steps each parameter inside backward, ``mp_policy`` is FSDP2's mixed
    precision and ``cpu_offload`` its CPU offload, for the FSDP configurations, and ``attention`` a Hugging Face
    model's attention implementation (see :func:`nbmem.estimate`).
    ``quantization`` is an axis too: ``[None, "nf4", "int8"]`` puts the
    weights as built beside QLoRA's 4-bit and 8-bit ones; and ``compile``:
    ``[False, True]`` puts the eager step beside the ``torch.compile``'d one
    (compiled only where it can be estimated: the combinations with
    ``parallel``, ``quantization`` or ``task="generate"`` are left out).
    ``timeline=True`` keeps each configuration's allocations (one process's:
    a launched data-parallel run keeps none): ``table.rows[i].result`` then
    plots them and writes them for PyTorch's memory viewer
    (``.to_snapshot(path)``).

    ``progress`` (True or False) shows which configuration runs, how many
    remain and what each finished one gave, where it can be seen: a widget in
    a notebook, a status line on a terminal (see :mod:`nbmem.whatif.progress`).
    Ctrl-C stops the sweep cleanly (the running configuration's trackers
    removed, its ranks killed and reaped) and returns the configurations
    that finished, marked incomplete (:attr:`Comparison.interrupted`); a
    second Ctrl-C, while that is cleaned up, interrupts for real.

    >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> make = lambda n: (torch.randn(n, 64), torch.randint(0, 4, (n,)))
    >>> table = sweep(build, make, batch_size=[8, 16], optimizer=["sgd", "adamw"])
    >>> [record["optimizer"] for record in table.to_records()]
    ['sgd', 'adamw', 'sgd', 'adamw']
    """
    check_progress(progress)
    run_device(mode)  # an unknown mode, or 'measured' without CUDA, fails before anything runs
    grid = {
        "batch_size": _values("batch_size", batch_size),
        "precision": _values("precision", precision),
        "checkpointing": _values("checkpointing", checkpointing),
        "optimizer": _values("optimizer", optimizer),
        "accumulation": _values("accumulation", accumulation),
        "parallel": _values("parallel", parallel),
        "world_size": _values("world_size", world_size),
        "trainable": _trainable_values(trainable),
        "quantization": _quantization_values(quantization),
        "compile": _values("compile", compile),
        "task": _values("task", task),
        "prompt_length": _values("prompt_length", prompt_length),
        "new_tokens": _values("new_tokens", new_tokens),
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
    capacity = label = None
    if device is not None:
        from ..core.devices import parse_capacity

        capacity, label = parse_capacity(device)
    planned: list[tuple[tuple[str, Any], ...]] = []  # each configuration's knobs, as its row shows them
    plans: list[Plan] = []  # and what it runs, every one checked before anything runs
    base = dict(loss=loss, foreach=foreach, device=device, step=step, mode=mode, alloc_conf=alloc_conf, block=block,
                checkpoint_saves=checkpoint_saves, zero_grad=zero_grad, hold_output=hold_output,
                optimizer_in_backward=optimizer_in_backward, mp_policy=mp_policy, cpu_offload=cpu_offload,
                attention=attention,
                **_enforced(mode, capacity))
    seen = set()
    uncompilable: dict[str, Any] | None = None
    for combination in itertools.product(*grid.values()):
        chosen = dict(zip(grid, combination))
        options = used_knobs(chosen)
        config = tuple(options.items())
        key = tuple((name, _shown(name, value)) for name, value in config)
        if options["compile"] and compile_refusal(options["parallel"], options["task"], options["quantization"]):
            uncompilable = options  # left out beside the configurations whose compiled step can be estimated
            continue
        if (options["parallel"] == "single" and options["world_size"] != 1) or key in seen:
            continue  # one device has no world size to vary; a task ran this configuration already
        seen.add(key)  # by label: a PEFT config is not hashable, and labels are unique (checked above)
        # the optimizer it names (a task that trains nothing shows 'none' and builds none)
        # what checkpointed blocks keep applies to the configurations that checkpoint
        kept: dict[str, Any] = {} if options["checkpointing"] is not False else {"checkpoint_saves": None}
        if not fsdp_family(options["parallel"]):  # FSDP2's mixed precision and offload, for the FSDP configurations
            kept["mp_policy"], kept["cpu_offload"] = None, False
        plans.append(Plan(**{**base, **kept}, **{**options, "optimizer": chosen["optimizer"]}))
        planned.append(config)
    if not plans and uncompilable is not None:
        Plan(**base, **{**uncompilable, "optimizer": chosen["optimizer"]})  # raises why compile=True can't be estimated
    shown_axes = [axis for axis in grid if len(grid[axis]) > 1] or ["batch_size"]
    title = f"gpumem sweep, {mode}" + (f" on {label}" if label else "")
    rows: list[SweepRow] = []
    interrupted = False
    with Progress(title, len(planned), enabled=progress) as shown:
        try:
            for config, plan in zip(planned, plans):
                options = dict(config)
                shown.begin(", ".join(f"{axis}={_shown(axis, options[axis])}" for axis in shown_axes))
                try:
                    with shown.attempt():
                        rows.append(SweepRow(config, run_configuration(model, batch, plan, on_rank=shown.ranks,
                                                                       timeline=timeline)))
                except torch.OutOfMemoryError:
                    rows.append(SweepRow(config, None, "OOM"))
                finally:
                    _isolate(mode)  # also after Ctrl-C: the interrupted configuration's leftovers go too
                shown.done(_outcome(rows[-1], mode))
        except KeyboardInterrupt as error:
            # issue 15: keep what finished; the running configuration's own `finally`s removed its trackers
            # and killed its ranks on the way here. A second Ctrl-C during that cleanup goes through.
            if not shown.first_interrupt(error):
                raise
            interrupted = True
    if interrupted:
        print(f"nbmem.sweep: interrupted (Ctrl-C) after {len(rows)} of {len(planned)} configurations; it returns "
              f"the {len(rows)} that finished, marked incomplete", file=sys.stderr)
    swept = tuple(axis for axis in AXES if len(grid[axis]) > 1)
    return Comparison(rows, swept, mode, capacity, label or "", planned=len(planned), interrupted=interrupted)


def _outcome(row: SweepRow, mode: str) -> str:
    """What a finished configuration gave, for the progress view: its peak and what kind of figure it is."""
    if row.result is None:
        return row.error or "failed"
    per_gpu = " per GPU (largest rank)" if row.result.world_size != 1 else ""
    fits = ", no fit" if row.result.fits is False else ""
    return f"peak {format_bytes(row.result.peak)} allocated{per_gpu}, {mode}{fits}"


def _shown(axis: str, value: Any) -> Any:
    """A knob's value as the progress view names it (a trainable choice or a quantization by its label)."""
    return trainable_label(value) if axis == "trainable" else quantization_label(value) if axis == "quantization" \
        else value


def _quantization_values(quantization: Any) -> list[Any]:
    """The quantization axis, each checked before anything runs and told apart by its label."""
    values = _values("quantization", quantization)
    for value in values:
        if value is not None:
            Quantization.of(value)
    labels = [quantization_label(value) for value in values]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two quantizations share a name ({', '.join(labels)}): sweep different ones")
    return values


def _trainable_values(trainable: Any) -> list[Any]:
    """The trainable axis: every choice checked before anything runs, each with a label of its own."""
    values = _values("trainable", trainable)
    for value in values:
        check_trainable(value)
    labels = [trainable_label(value) for value in values]
    if len(set(labels)) < len(labels):
        raise ValueError(
            f"two trainable choices share a name ({', '.join(labels)}), so the table can't tell them apart: "
            "give each predicate a name of its own (def head_and_pooler(name): ...)"
        )
    return values


def used_knobs(options: dict[str, Any]) -> dict[str, Any]:
    """A configuration's knobs with those its task does not use set to what it runs with.

    >>> used_knobs({"task": "inference", "optimizer": "adamw", "checkpointing": True, "accumulation": 4,
    ...             "new_tokens": 8})
    {'task': 'inference', 'optimizer': 'none', 'checkpointing': False, 'accumulation': 1, 'new_tokens': None}
    """
    task = options.get("task", "train")
    unused: dict[str, Any] = {} if task == "train" else {"optimizer": "none", "checkpointing": False, "accumulation": 1,
                                                      "trainable": None}
    if task != "generate":
        unused["new_tokens"] = None
    return {name: unused[name] if name in unused else value for name, value in options.items()}


def real_mode() -> str:
    """How a real check runs here: measured on the CUDA device when there is one, else tracked on this CPU."""
    return "measured" if accelerator_type() is not None else "tracked"


def run_configuration(model: Any, batch: Any, plan: Plan, on_rank: Callable[[int, int], None] | None = None,
                      timeline: bool = False) -> Estimate:
    """One configuration: an estimate, a real run here, or (data-parallel, real) a launch's largest rank.

    A rank that ran out of memory raises ``torch.OutOfMemoryError``, as a run in this process would;
    one that Ctrl-C stopped (a terminal's SIGINT reaches every rank too) raises KeyboardInterrupt.
    ``on_rank(finished, world_size)`` hears of every rank of a launch that ends well.
    """
    if plan.mode == "estimated" or plan.parallel == "single":
        return estimate_plan(model, batch, plan, timeline=timeline)
    try:
        return launch_plan(model, batch, plan, progress=False, on_rank=on_rank).worst
    except RankError as error:
        if "OutOfMemoryError" in error.kind:  # one rank ran out: the configuration does not fit
            raise torch.OutOfMemoryError(str(error)) from error
        if error.kind == "KeyboardInterrupt":
            raise KeyboardInterrupt(str(error)) from error
        raise


def _enforced(mode: str, capacity: int | None) -> dict[str, Any]:
    """A real run enforces the capacity (the op that crosses it raises); an estimate only compares."""
    return {"enforce_capacity": capacity is not None and mode != "estimated"}


def _isolate(mode: str) -> None:
    """Free what one configuration left, so the next starts from nothing of it."""
    gc.collect()
    if mode == "measured":
        device = current_device()
        if device is not None:
            device_counter(device).empty_cache()
