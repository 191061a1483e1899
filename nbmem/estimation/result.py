"""What an estimate returns: :class:`Estimate`, a step's peaks, breakdown and notes, and how it reads.

Made by :func:`nbmem.estimate` (:mod:`nbmem.estimation.estimate`) for every
mode, by :func:`nbmem.launch` per rank and by :func:`nbmem.sweep` per
configuration.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import torch  # noqa: F401  # the doctests' names
from torch import nn  # noqa: F401

from ..core.results import Breakdown
from ..core.units import format_bytes
from .finetune import Trained
from .plan import Plan
from .tasks import task_lines
from .userstep import BUILT_IN
from .workspaces import Workspaces

__all__ = ["Estimate", "OVERHEADS"]

#: Memory outside PyTorch's tensors, listed beside an estimate and never added
#: to it: (what, bytes, why). DESIGN.md; c10/cuda/CUDACachingAllocator.cpp.
CUDA_CONTEXT = ("CUDA context", 512 * 1024**2,
                "300-700 MiB per process depending on GPU and CUDA version; outside PyTorch's allocator")
CUBLAS_WORKSPACE = ("cuBLAS workspace", 8 * 1024**2,
                    "per cuBLAS handle through the caching allocator; 32 MiB on Hopper (H100, H200)")
OVERHEADS = (CUDA_CONTEXT, CUBLAS_WORKSPACE)


@dataclass(frozen=True)
class Estimate:
    """What a training step would allocate, from a run on fake tensors.

    ``first_step`` is the first optimizer step's peak (no optimizer state
    before it), ``steady`` a later step's (the state exists); ``peak`` the
    larger. Bytes are CUDA-rounded allocated bytes of PyTorch tensors; the
    fixed overheads are listed separately in ``overheads``.

    Returned by :func:`estimate` (also for ``mode="tracked"`` and
    ``"measured"`` runs, which say so in ``mode``), one per rank by
    :func:`nbmem.launch`, one per configuration in :func:`nbmem.sweep`.
    ``fits`` compares with the capacity given as ``device``; ``breakdown``
    says what the memory at the peak was for; ``print()`` shows a report.

    >>> from nbmem.estimation.estimate import estimate
    >>> build = lambda: nn.Linear(256, 256)
    >>> make = lambda n: torch.randn(n, 256)
    >>> result = estimate(build, make, batch_size=32, optimizer="sgd", device="1GiB")
    >>> result.parameters, result.peak == max(result.first_step, result.steady), result.fits
    (65792, True, True)
    >>> result.breakdown.category("parameter")   # (256 * 256 + 256) * 4 bytes, in 512 B blocks
    263168
    """

    batch_size: int
    accumulation: int
    precision: str
    optimizer: str
    checkpointing: str
    parameters: int
    first_step: int
    steady: int
    breakdown: Breakdown
    #: The simulated caching allocator's reserved peak (see nbmem.core.allocator).
    reserved: int | None = None
    #: With a capacity: the first segment the simulated allocator could not
    #: reserve even after releasing its cache (None: every reservation fit).
    reserve_failed: int | None = None
    capacity: int | None = None
    capacity_label: str = ""
    mode: str = "estimated"
    #: Where the step ran: "cpu" for fake tensors and tracked runs, "cuda:N" when measured.
    device: str = "cpu"
    #: The data-parallel strategy (nbmem.estimation.parallel.STRATEGIES) and its GPUs; figures are per GPU (rank 0).
    parallel: str = "single"
    world_size: int = 1
    #: Which rank's view (ranks can differ a little: uneven shards, ZeRO's partition).
    rank: int = 0
    notes: tuple[str, ...] = ()
    #: Which training step ran: nbmem's built-in one (nbmem.estimation.step) or the user's (estimate(step=...)).
    step: str = BUILT_IN
    #: With trainable=: what trained and its own bytes (nbmem.estimation.finetune.Trained); None: the model as it came.
    trained: Trained | None = None
    #: What ran (nbmem.estimation.tasks): "train", "inference" or "generate"; the context length and tokens generated.
    task: str = "train"
    prompt_length: int | None = None
    new_tokens: int | None = None
    #: generate: the KV cache's bytes at the end, and per token of context (the whole batch's), unrounded.
    kv_cache: int | None = None
    kv_cache_per_token: int | None = None
    #: The knobs as asked for (nbmem.estimation.plan.Plan); the fields above say what they resolved to.
    plan: Plan | None = field(default=None, repr=False, compare=False)
    #: With estimate(timeline=True): the whole run (model built, then each step), for .to_snapshot() and plotting.
    timeline: Any = field(default=None, repr=False, compare=False)
    #: The simulated reserved peak with the cuBLAS workspaces the step's threads add (``workspaces``); None measured.
    reserved_with_workspaces: int | None = None
    workspaces: Workspaces | None = field(default=None, compare=False)
    #: A paged optimizer's state in CUDA managed memory, outside the allocator (nbmem.estimation.low_bit); None: none.
    managed: int | None = None
    #: What FSDP's CPU offload keeps in this rank's host memory between steps (parameter shards and optimizer state;
    #: nbmem.estimation.parallel.host_figures); None: nothing offloaded.
    host: int | None = None
    #: The NVIDIA GPU kernels whose own memory the estimate took and its tracked runs can't ("cuDNN's LSTM/GRU",
    #: "cuDNN's convolutions"): a tracked run on a CPU runs PyTorch's CPU kernels there. (CUDA's split reductions'
    #: buffers, exact, a tracked run of an estimate takes too.)
    cuda_kernels: tuple[str, ...] = ()

    def to_snapshot(self, path: str) -> None:
        """Write the estimated run as a PyTorch memory snapshot (pytorch.org/memory_viz, ``nbmem.load_snapshot``).

        Needs ``estimate(..., timeline=True)``. The segments are the allocator
        simulation's under the estimate's allocator settings (``alloc_conf``).
        """
        if self.timeline is None:
            raise ValueError("to_snapshot needs the run's allocations, which only a timeline keeps: "
                             "estimate(..., timeline=True)")
        from ..core.snapshot_export import snapshot_of, write_snapshot

        source = {"mode": self.mode, "device": self.device, "label": self.plan.describe() if self.plan else ""}
        settings = self.plan.allocator if self.plan is not None else None
        write_snapshot(snapshot_of(self.timeline.events, 0, source, settings), path)

    @property
    def overheads(self) -> tuple[tuple[str, int, str], ...]:
        """Memory outside the figures, listed and never added: (what, bytes, why).

        :data:`OVERHEADS`; where the estimate simulated the cuBLAS workspaces
        (its ``with workspaces`` line), their row gives those instead.

        >>> from nbmem.estimation.estimate import estimate
        >>> result = estimate(lambda: nn.Linear(256, 256), lambda n: torch.randn(n, 256), batch_size=32,
        ...                   optimizer="sgd", device="H100-80GB")
        >>> result.overheads[1]   # forward's thread and backward's: a handle and its workspace each
        ('cuBLAS workspace', 67108864, "2 of 32.0 MiB; in 'with workspaces' above")
        """
        if self.reserved_with_workspaces is None or self.workspaces is None:
            return OVERHEADS
        workspaces = self.workspaces
        return (CUDA_CONTEXT, (CUBLAS_WORKSPACE[0], workspaces.total,
                               f"{workspaces.count} of {format_bytes(workspaces.each)}; in 'with workspaces' above"))

    @property
    def peak(self) -> int:
        return max(self.first_step, self.steady)

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step on one GPU: the micro-batch times the accumulation steps."""
        return self.batch_size * self.accumulation

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step across all GPUs."""
        return self.effective_batch * self.world_size

    @property
    def fits(self) -> bool | None:
        """Whether the step fits the capacity (None without one): its allocated peak with any managed memory (a paged
        optimizer's), and every segment the simulated allocator reserved (after releasing its cache). Overheads not
        included."""
        if self.capacity is None:
            return None
        return self.peak + (self.managed or 0) <= self.capacity and self.reserve_failed is None

    def __str__(self) -> str:
        accumulate = f" x {self.accumulation} micro-batches = {self.effective_batch}" if self.accumulation > 1 else ""
        how = {
            "estimated": "estimate (estimated on fake tensors, no data, nothing allocated)",
            "tracked": f"step (tracked: run for real on the {self.device}, every tensor accounted)",
            "measured": f"step (measured: run for real on {self.device}, CUDA's caching allocator)",
        }[self.mode]
        scale = (
            f", {self.parallel} on {self.world_size} GPUs (figures per GPU, rank {self.rank}; global batch {self.global_batch})"
            if self.parallel != "single"
            else ""
        )
        lines = [
            f"gpumem {how}: "
            f"batch {self.batch_size}{accumulate}, {self.precision}, {self.optimizer}, checkpointing {self.checkpointing}"
            f"{scale}",
            f"  parameters       {self.parameters:,}",
            f"  first step peak  {format_bytes(self.first_step)} allocated (no optimizer state yet)",
            f"  steady peak      {format_bytes(self.steady)} allocated (from the second step on)",
            f"  step             {self.step}",
        ] if self.task == "train" else task_lines(self)
        if self.reserved is not None:
            source = "measured" if self.mode == "measured" else "simulated caching allocator"
            lines.append(
                f"  reserved peak    {format_bytes(self.reserved)} ({source}: cached blocks and "
                "segment tails included; roughly what nvidia-smi shows, less the CUDA context)"
            )
        if self.reserved_with_workspaces is not None and self.workspaces is not None:
            lines.append(f"  with workspaces  {format_bytes(self.reserved_with_workspaces)} reserved, with "
                         f"{self.workspaces.describe()}" + (
                             "; less than without them: the free rest of a workspace's segment holds tensors that "
                             "otherwise took a segment of their own" if self.reserved is not None
                             and self.reserved_with_workspaces < self.reserved else ""))
        if self.managed is not None:
            lines.append(f"  managed memory   {format_bytes(self.managed)} (paged optimizer state in CUDA managed memory, "
                         "outside PyTorch's allocator and the figures above; counted against the device)")
        if self.host is not None:
            lines.append(f"  host memory      {format_bytes(self.host)} (FSDP's CPU offload: shards and optimizer state "
                         "in this rank's host RAM between steps, outside the figures above)")
        if self.capacity is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            why = (
                f"; the allocator could not reserve a {format_bytes(self.reserve_failed)} segment even after "
                "releasing its cache"
                if self.reserve_failed is not None
                else ""
            )
            lines.append(
                f"  on {self.capacity_label or format_bytes(self.capacity)}  {verdict}: {format_bytes(self.peak)} of "
                f"{format_bytes(self.capacity)} ({self.peak / self.capacity:.0%}) allocated"
                f"{f' + {format_bytes(self.managed)} managed' if self.managed else ''}{why}; before the fixed overheads below"
            )
        lines += [f"  {name:<15}  {text}" for name, text in self.breakdown.rows()]
        lines += [f"  {name:<15}  {text}" for name, text in (self.trained.rows(self.mode) if self.trained else [])]
        for name, size, why in self.overheads:
            lines.append(f"  not included: {name} about {format_bytes(size)} ({why})")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return f"<pre class='nbmem-estimate' style='font-size:12px'>{html.escape(str(self))}</pre>"
