"""The largest batch size that fits a capacity: a search over estimates, then verified by a real run."""

from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..estimation.estimate import Estimate, estimate_plan
from ..estimation.plan import Plan, run_device
from ..estimation.parallel import check_parallel
from .progress import Progress, check_progress
from ..core.units import format_bytes
from ..estimation.userstep import BUILT_IN, step_label
from .sweep import MAX_LAUNCH_RANKS, _isolate, real_mode, run_configuration

__all__ = ["max_batch_size", "BatchSizeResult"]


@dataclass(frozen=True)
class BatchSizeResult:
    """The largest batch that fits a capacity: predicted from estimates, then verified for real."""

    batch_size: int  # the largest size a real trial ran within the capacity (0 if even 1 did not)
    predicted: int | None  # what the estimates predicted before any real trial (None: interrupted before that)
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
    interrupted: bool = False  # Ctrl-C stopped the search: batch_size is what the real trials established so far
    #: the estimates took memory cuDNN's kernels take (an RNN's reserve and workspace, convolutions' workspaces) that
    #: tracked trials on a CPU, which run PyTorch's CPU kernels, don't: what the answer leaves out for an NVIDIA GPU
    #: (None: nothing)
    kernels_not_tracked: str | None = None

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
        if self.interrupted:
            return self._established()
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

    def _established(self) -> str:
        """What an interrupted search knows: the largest size that ran within the capacity, the smallest above
        it that did not."""
        above = min((size for size, peak in self.trials if peak is None and size > self.batch_size), default=None)
        failed = f"; {above} did not" if above is not None else ""
        if self.batch_size == 0:
            known = (f"unknown: no real trial fitted before the interruption{failed}" if self.trials
                     else "unknown: interrupted before any real trial")
        else:
            known = f"at least {self.batch_size} ({self.batch_size} ran within the capacity{failed})"
        return f"{known}; interrupted (Ctrl-C) before the search ended: search again for the boundary"

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
            f" ({'no prediction yet' if self.predicted is None else f'predicted {self.predicted}'} from {self.estimates} "
            f"estimates; verified with {self.real_trials} real"
            f" {self.mode} trials{': ' + tried if tried else ''})\n"
            f"  step: {self.step}\n"
            + (f"  note: {self.kernels_not_tracked}\n" if self.kernels_not_tracked else "")
            + "  for a larger effective batch, search again with accumulation=N: gradients stay alive across "
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
    trainable: Any = None,
    alloc_conf: Any = None,
    block: Any = None,
    checkpoint_saves: Any = None,
    zero_grad: str = "after_step",
    hold_output: bool = True,
    optimizer_in_backward: bool = False,
    mp_policy: Any = None,
    cpu_offload: bool = False,
    compile: bool = False,
    attention: str | None = None,
    quantization: Any = None,
    progress: bool = True,
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

    ``trainable`` (``"all"``, ``"head"``, ``"lora"``, a PEFT config or a
    predicate over parameter names; see :func:`nbmem.estimate`) chooses what
    trains: the largest batch for that kind of fine-tuning.

    ``alloc_conf`` (``"expandable_segments:True"``, ...; see
    :func:`nbmem.estimate`) sets the allocator settings the simulated
    segments follow; by default this process's PYTORCH_ALLOC_CONF. ``block``
    names the block checkpointing wraps and FSDP shards,
    ``checkpoint_saves`` what checkpointed blocks keep, ``zero_grad`` where
    the built-in step zeroes gradients, ``hold_output`` whether it holds the model's output through backward,
    ``optimizer_in_backward`` steps each
    parameter inside backward, ``mp_policy`` is FSDP2's mixed precision
    (``cpu_offload`` its CPU offload),
    ``attention`` a Hugging Face model's attention implementation, ``quantization``
    the weights' (``"nf4"``, ``"int8"``, a BitsAndBytesConfig; see :func:`nbmem.estimate`).

    ``progress`` (True or False) shows each estimate and real trial as it
    runs and what it gave (fits or OOM, and its peak), where it can be seen
    (see :mod:`nbmem.whatif.progress`). Ctrl-C stops the search cleanly and returns
    what the real trials established so far, marked ``interrupted``: the
    largest size that ran within the capacity ("at least N"), and the
    smallest above it that did not.

    >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    >>> make = lambda n: (torch.randn(n, 256), torch.randn(n, 256))
    >>> found = max_batch_size(build, make, device="8MiB", optimizer="sgd")
    >>> sizes = dict(found.trials)
    >>> sizes[found.batch_size] is not None and sizes[found.batch_size + 1] is None   # tested on both sides
    True
    """
    from ..core.devices import parse_capacity

    check_progress(progress)
    # a bool is an integer to Python, and limit=True would search 1..1; numpy's integers are welcome
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise ValueError(
            f"limit={limit!r} can't cap a batch-size search: pass a whole number of samples, at least 1 "
            "(the default is 65536)"
        )
    limit = int(limit)
    if compile:
        raise ValueError(
            "max_batch_size checks its answer by running the step for real, and a tracked or measured run can't run "
            "compiled code compiled (its dispatch mode makes PyTorch run it eagerly): estimate the compiled step at "
            "several sizes with nbmem.sweep(..., batch_size=[...], compile=True), or leave compile out")
    if verify == "auto":
        verify = real_mode()
    if verify not in ("tracked", "measured"):
        raise ValueError(f"unknown verify mode {verify!r}: use 'auto', 'tracked' (this CPU) or 'measured' (CUDA)")
    run_device(verify)
    check_parallel(parallel, world_size)
    if world_size > MAX_LAUNCH_RANKS:
        raise ValueError(
            f"max_batch_size verifies by launching world_size real ranks on this machine, at most "
            f"{MAX_LAUNCH_RANKS}, and world_size={world_size}: for larger worlds compare estimates with "
            f"nbmem.sweep(..., batch_size=[...], parallel={parallel!r}, world_size={world_size})"
        )
    capacity, label = parse_capacity(device)
    # one plan, checked once; each estimate and trial varies its batch size (a search starts at 1)
    plan = Plan(batch_size=1, precision=precision, checkpointing=checkpointing, optimizer=optimizer, loss=loss,
                foreach=foreach, accumulation=accumulation, parallel=parallel, world_size=world_size, step=step,
                trainable=trainable, device=device, alloc_conf=alloc_conf, block=block,
                checkpoint_saves=checkpoint_saves, zero_grad=zero_grad, hold_output=hold_output,
                optimizer_in_backward=optimizer_in_backward, mp_policy=mp_policy, cpu_offload=cpu_offload,
                compile=compile, attention=attention,
                quantization=quantization)
    estimates = 0
    kernels: set[str] = set()  # the NVIDIA kernels whose own memory the estimates took (Estimate.cuda_kernels)
    shown = Progress(f"gpumem max_batch_size on {label}, verified {verify}", None, unit="estimate", enabled=progress)

    def estimated(size: int) -> Estimate:
        nonlocal estimates
        estimates += 1
        shown.begin(f"batch_size={size}")
        result = estimate_plan(model, batch, plan.varied(batch_size=size))
        kernels.update(result.cuda_kernels)
        shown.done(f"{'fits' if result.fits else 'no fit'}, peak {format_bytes(result.peak)} allocated, estimated")
        return result

    trials: list[tuple[int, int | None]] = []

    def fits(size: int) -> bool:
        shown.begin(f"batch_size={size}", unit="real trial")
        try:
            with shown.attempt():
                # a measured trial runs under the process's own allocator settings (alloc_conf only simulates)
                trial = plan.varied(batch_size=size, mode=verify, enforce_capacity=True,
                                    alloc_conf=None if verify == "measured" else alloc_conf)
                result = run_configuration(model, batch, trial, on_rank=shown.ranks)
        except torch.OutOfMemoryError:
            trials.append((size, None))
            shown.done(f"OOM, {verify}")
            return False
        finally:
            _isolate(verify)
        if result.fits is False:  # ran within the capacity, but a segment it needs could not be reserved
            trials.append((size, None))
            shown.done(f"no fit: a segment it needs could not be reserved, {verify}")
            return False
        trials.append((size, result.peak))
        shown.done(f"fits, peak {format_bytes(result.peak)} allocated, {verify}")
        return True

    predicted: int | None = None
    with shown:
        try:
            # memory = fixed + per_sample * batch, from two estimates, then the
            # boundary on estimates alone (cheap: no memory, no data)
            at_one, at_eight = estimated(1).peak, estimated(8).peak
            per_sample = max((at_eight - at_one) / 7, 1.0)
            guess = max(1, min(int((capacity - at_one) // per_sample) + 1, limit))
            # fits as Estimate.fits says: the allocated peak, and every segment the allocator must reserve
            predicted = _boundary(lambda size: bool(estimated(size).fits), guess, limit)
            # verify for real around the prediction: both sides of the boundary are tried
            found = _boundary(fits, max(predicted, 1), limit)
        except KeyboardInterrupt as error:
            # issue 15: keep what the real trials established (the running one's trackers and ranks are gone);
            # a second Ctrl-C during that cleanup goes through
            if not shown.first_interrupt(error):
                raise
            found = max((size for size, peak in trials if peak is not None), default=0)
    untracked = None
    if verify == "tracked" and kernels:
        named = sorted(kernels)
        kinds = ", ".join(named[:-1]) + (" and " if len(named) > 1 else "") + named[-1]
        if predicted is not None and predicted < found:
            where = f"smaller than {found}, nearer the estimates' {predicted}"
        else:
            where = f"other than {found}" + (f" (the estimates': {predicted})" if predicted is not None else "")
        untracked = (f"the estimates took the memory {kinds} take on an NVIDIA GPU, which the tracked trials on this "
                     f"CPU (PyTorch's CPU kernels) don't: on that GPU the largest batch may be {where}")
    result = BatchSizeResult(found, predicted, capacity, label, verify, tuple(trials), estimates, limit, accumulation,
                             parallel, world_size, step_label(step), shown.interrupted, untracked)
    if result.interrupted:
        print(f"nbmem.max_batch_size: interrupted (Ctrl-C); it returns what was established: {result.answer}",
              file=sys.stderr)
    return result
