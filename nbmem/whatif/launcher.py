"""Real ranks on this machine: :func:`launch` runs the training step as N ranks and returns every rank's figures.

:func:`run_ranks` does the work, for :func:`launch` and nothing else: it forks N processes, joins them into
one process group and collects each rank's answer, to verify a data-parallel estimate. The ranks are
forked, so a model and batch factory defined in a notebook work as they are
(nothing is pickled on the way in); each rank's answer comes back pickled
through a file. The guarantees:

- a rank that fails ends the whole launch: the others are killed, and the
  error raised in the caller carries that rank's traceback;
- the error names the rank that failed first: a rank that dies without a
  Python error (``os._exit``, SIGKILL, a segfault) is named with its exit
  code or signal, not the healthy peer that then lost its connection;
- no rank outlives the launch: every process is killed and reaped on error,
  on timeout, on KeyboardInterrupt and on SIGTERM (which then ends the
  process as before, the launch folder removed); each rank also asks the
  kernel to kill it if its parent dies (Linux ``PR_SET_PDEATHSIG``);
- the folder of a launch killed with SIGKILL (no cleanup runs) is removed by
  the next launch (:mod:`nbmem.whatif.launch_folders`);
- a rank's prints go to a log file, never to the notebook's (forked) output
  machinery; the last lines of a failing rank's log come with its error;
- a rank that reported its error but does not exit still ends the launch
  (after ``_REPORTED_EXIT_GRACE`` seconds), and a timeout says where each rank
  still running was stuck: its stack, which faulthandler writes on SIGUSR1.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..estimation.estimate import Estimate, estimate_plan
from ..estimation.plan import Plan
from ..estimation.parallel import collectives_on_copies
from .launch_folders import launch_folder
from .rank_files import _failure, _finished_at, _load, _log_size, _log_tail, _read_log, _reported, _stacks
from .progress import Progress, check_progress
from ..core.units import format_bytes

__all__ = ["launch", "launch_plan", "Launch", "run_ranks", "RankError"]


class RankError(RuntimeError):
    """A rank of a launch failed; the message has its traceback, or how it died.

    ``exitcode`` is the rank's, as :mod:`multiprocessing` gives it: negative
    for a signal (-9 SIGKILL, -11 SIGSEGV), None if it had not ended yet.
    """

    def __init__(self, rank: int, message: str, exitcode: int | None = None, *, reported: bool = True) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        last = message.rstrip().splitlines()[-1] if message.strip() and reported else ""
        #: The failing rank's exception type, as its traceback names it ("torch.OutOfMemoryError");
        #: empty for a rank that died without reporting one (its message ends with its log, not a traceback).
        self.kind = last.split(":", 1)[0] if ":" in last else ""


def run_ranks(
    target: Callable[[int, int], Any], world_size: int, *, backend: str = "gloo", timeout: float = 300.0,
    on_rank: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Run ``target(rank, world_size)`` in ``world_size`` forked processes, in one process group.

    The process group (``backend``, rendezvous through a file) exists around
    the call in each rank and is destroyed after it returns (a rank whose call
    raises leaves it by exiting). Returns each rank's
    return value, in rank order. Raises :class:`RankError` for the first rank
    that fails, TimeoutError after ``timeout`` seconds (with the stack of each
    rank still running: where it was stuck). ``on_rank(finished,
    world_size)`` is called (in this process) each time another rank has
    ended well: a progress view's hook.
    """
    context = multiprocessing.get_context("fork")
    with _cleanup_before_sigterm(), _Interrupts() as interrupts, \
            launch_folder() as folder:
        processes = [
            context.Process(target=_rank_main, args=(target, rank, world_size, backend, folder), daemon=True)
            for rank in range(world_size)
        ]
        try:
            interrupts.held = True  # a fork interrupted before its pid is known would leave an orphan
            for process in processes:
                process.start()
            interrupts.release()
            _wait(processes, folder, timeout, on_rank)
            return [_load(folder, rank) for rank in range(world_size)]
        finally:
            interrupts.held = True  # a second Ctrl-C (or each rank's own) must not cut the reaping short
            _stop(processes)


class _Interrupts:
    """Ctrl-C during a launch, held back while ranks are forked and while they are killed and reaped.

    Between those, SIGINT raises KeyboardInterrupt as Python's default does.
    While ``held``, it is only remembered: :meth:`release` raises it, and so
    does leaving the ``with`` block normally; leaving it with an exception
    already on its way (the first Ctrl-C, an error) drops it, as one
    interrupt is enough. Only in the main thread, and only where SIGINT has
    Python's default handler (where it is ignored or handled by the user,
    nothing changes).
    """

    def __init__(self) -> None:
        self.held = False
        self.pending = False
        self._previous: Any = None

    def __enter__(self) -> "_Interrupts":
        previous = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread() and previous is signal.default_int_handler:
            self._previous = previous
            try:
                signal.signal(signal.SIGINT, self._interrupt)
            except BaseException:  # a Ctrl-C right after: the with block never starts, so __exit__ won't run
                signal.signal(signal.SIGINT, previous)
                raise
        return self

    def _interrupt(self, number: int, frame: Any) -> None:
        if self.held:
            self.pending = True
        else:
            raise KeyboardInterrupt

    def release(self) -> None:
        self.held = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if kind is None and self.pending:
            raise KeyboardInterrupt


class _Terminated(BaseException):
    """SIGTERM during a launch, raised so that its cleanup runs; the signal is then sent again."""


@contextlib.contextmanager
def _cleanup_before_sigterm() -> Iterator[None]:
    """SIGTERM stops the launch as it stops the process, but only after the ranks and the launch folder are gone.

    Python's default for SIGTERM ends the process at once: no ``finally``
    runs, and the launch folder stayed in /tmp. Here the signal raises inside
    the launch; once its cleanup has run, the previous handler is restored and
    the signal sent again, so the process ends (or its own handler runs) as it
    would have. Only in the main thread (Python allows handlers nowhere else),
    and not where SIGTERM is ignored.
    """
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous is signal.SIG_IGN:
        yield
        return

    def terminate(number: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
        raise _Terminated()

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except _Terminated:
        pass  # cleaned up on the way here; now let the signal do what it does
    else:
        return
    finally:
        # None: a handler set outside Python; the default is the closest
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    os.kill(os.getpid(), signal.SIGTERM)
    raise RuntimeError("the launch was stopped by SIGTERM")  # reached only if a handler let the process go on


#: Seconds to wait, after a rank reported an error, for a rank that died without one (see _first_failure).
_SILENT_DEATH_GRACE = 3.0
#: Seconds a rank that reported an error may take to exit before the launch stops without it.
_REPORTED_EXIT_GRACE = 10.0


def _wait(processes: list[Any], folder: str, timeout: float, on_rank: Callable[[int, int], None] | None) -> None:
    deadline = time.monotonic() + timeout
    told = 0  # ranks on_rank has heard of
    reported: dict[int, float] = {}  # a rank still running that has reported its error: when it was seen
    while True:
        finished = sum(p.exitcode == 0 for p in processes)
        if on_rank is not None and finished != told:
            told = finished
            on_rank(finished, len(processes))
        now = time.monotonic()
        for rank, process in enumerate(processes):
            if process.exitcode is None and rank not in reported and _reported(folder, rank):
                reported[rank] = now
        # a failed rank ends the launch when it exits, when it has not exited long after reporting,
        # and at the deadline: its error, not the timeout, is the cause
        if any(p.exitcode not in (None, 0) for p in processes) or (reported and (
            now > deadline or any(now - seen > _REPORTED_EXIT_GRACE for seen in reported.values())
        )):
            rank = _first_failure(processes, folder)
            code = processes[rank].exitcode
            hung = ""
            if code is None:  # it reported its error and never exited: where it hung since
                hung = (f"\n(it reported the error below, then had not exited {now - reported.get(rank, now):.0f} s later"
                        f"{_where_stuck(processes, folder, [rank])})")
            raise RankError(rank, _failure(folder, rank, code, len(processes), hung), code,
                            reported=_reported(folder, rank))
        if all(p.exitcode == 0 for p in processes):
            return
        running = [rank for rank, p in enumerate(processes) if p.exitcode is None]
        if now > deadline and running:
            raise TimeoutError(
                f"the launch took longer than {timeout:g} s: rank(s) {running} still running were killed. "
                f"Pass a larger timeout= if the step is slow.{_where_stuck(processes, folder, running)}"
            )
        processes[0].join(0.05)


def _where_stuck(processes: list[Any], folder: str, running: list[int]) -> str:
    """Where ranks still running were stuck: the stacks SIGUSR1 makes them write to their logs (up to 2 s).

    Each rank registers faulthandler for SIGUSR1 as it starts (``_rank_main``);
    one that had not got that far yet dies of the signal, as it would be killed anyway.
    """
    sizes = {rank: _log_size(folder, rank) for rank in running}
    for rank in running:
        with contextlib.suppress(OSError):
            os.kill(processes[rank].pid, signal.SIGUSR1)
    dumps = {rank: "" for rank in running}
    settle = time.monotonic() + 2.0
    while time.monotonic() < settle:
        time.sleep(0.1)
        grown = {rank: _read_log(folder, rank, sizes[rank]) for rank in running}
        # every dump begun, and none still growing
        if all("(most recent call first)" in text for text in grown.values()) and grown == dumps:
            break
        dumps = grown
    told = []
    for rank in running:
        stacks = _stacks(dumps[rank])
        told.append(f"\nwhere rank {rank} was stuck (innermost call first):\n{stacks}" if stacks else
                    f"\nrank {rank} wrote no stack: it was stuck before its Python code started (while being forked), "
                    f"or died meanwhile.{_log_tail(folder, rank)}")
    return "".join(told)


def _first_failure(processes: list[Any], folder: str) -> int:
    """The rank whose failure caused the others'.

    A rank that died without reporting an error (``os._exit``, SIGKILL from
    the kernel's out-of-memory killer, a segfault) is the cause when there is
    one: its peers fail *because* it vanished, with gloo's "Connection reset
    by peer", and report that. It may still be dying (a crash takes a moment)
    when a peer's report arrives, so the others get a moment to end too.
    Otherwise the first rank to report, which may still be leaving the group
    when a peer it broke has exited.
    """
    grace = time.monotonic() + _SILENT_DEATH_GRACE
    while True:
        silent = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0) and not _reported(folder, rank)]
        if silent:
            return silent[0]
        if all(p.exitcode is not None for p in processes) or time.monotonic() > grace:
            break
        next(p for p in processes if p.exitcode is None).join(0.02)
    failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0) or _reported(folder, rank)]
    return min(failed, key=lambda rank: (_finished_at(folder, rank), rank))


def _stop(processes: list[Any]) -> None:
    """Kill whatever still runs, and reap every process (no zombies, no orphans)."""
    for process in processes:
        if process.pid is not None and process.exitcode is None:
            with contextlib.suppress(OSError):
                process.kill()
    for process in processes:
        if process.pid is not None:
            process.join(10)


def _rank_main(target: Callable[[int, int], Any], rank: int, world_size: int, backend: str, folder: str) -> None:
    code = 1
    try:
        log = open(os.path.join(folder, f"rank{rank}.log"), "w", buffering=1)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        import sys

        sys.stdout = sys.stderr = log  # not the notebook's output streams, which the fork copied
        # a crash in native code (SIGSEGV, SIGABRT) writes the Python stack to the log, so the error
        # shows where it happened; a handler inherited from the parent would write to the parent's stderr
        faulthandler.enable(file=log)
        # and SIGUSR1, which a launch that timed out sends, writes every thread's stack there: where it
        # hung (first thing, so that even a hang in _die_with_parent's dlopen shows)
        faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
        _die_with_parent()
        # the parent's SIGTERM handler (see _cleanup_before_sigterm) came with the fork; a rank dies of SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # and its SIGINT handler, which holds a Ctrl-C while ranks are forked (_Interrupts): Python's own here
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import torch.distributed as dist

        dist.init_process_group(
            backend, init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank, world_size=world_size
        )
        try:
            value = target(rank, world_size)
        except BaseException:
            # reported now, and the group left by exiting, not destroyed: os._exit closes this rank's
            # connections, so its peers fail (the first error is the cause), and no teardown that
            # waits on a peer stuck in a collective can hold the exit back
            _report(folder, rank)
            raise
        dist.destroy_process_group()
        with open(os.path.join(folder, f"rank{rank}.result.tmp"), "wb") as file:
            pickle.dump(value, file)
        os.replace(os.path.join(folder, f"rank{rank}.result.tmp"), os.path.join(folder, f"rank{rank}.result"))
        code = 0
    except BaseException:
        if not os.path.exists(os.path.join(folder, f"rank{rank}.error")):
            _report(folder, rank)
    finally:
        os._exit(code)  # no atexit handlers: they belong to the parent (the notebook's kernel)


def _report(folder: str, rank: int) -> None:
    """Write when this rank failed and the exception being handled, for the parent to raise."""
    failed = time.monotonic_ns()
    with contextlib.suppress(OSError):
        path = os.path.join(folder, f"rank{rank}.error")
        with open(f"{path}.tmp", "w") as file:
            file.write(f"{failed}\n{traceback.format_exc()}")
        os.replace(f"{path}.tmp", path)  # whole: the parent may read it at any moment


def _die_with_parent() -> None:
    """Linux: the kernel sends this rank SIGKILL when its parent dies, so no rank is orphaned."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


@dataclass(frozen=True)
class Launch:
    """Every rank's figures from a real launch (:func:`launch`).

    ``ranks`` holds one :class:`~nbmem.Estimate` per rank, in rank order
    (``mode`` ``"tracked"`` or ``"measured"``); ``peaks`` their allocated
    peaks, ``peak`` the largest (what the fullest GPU must hold), ``worst``
    that rank's estimate; ``print()`` shows one line per rank.

    Example (not run as a doctest: a launch starts processes and takes
    seconds; :func:`launch`'s own example runs one)::

        ranks = nbmem.launch(build, make, batch_size=8, parallel="zero1", world_size=2)
        ranks.peaks                  # [120832, 67072]: ZeRO-1's rank 0 holds more optimizer state
        ranks.worst.breakdown        # what the fullest rank's memory was for
        print(ranks)                 # gpumem launch: zero1 on 2 real ranks (tracked, gloo on the CPU), ...
    """

    parallel: str
    world_size: int
    mode: str  # "tracked" (gloo on the CPU) or "measured" (NCCL on CUDA)
    ranks: tuple[Estimate, ...]  # one per rank, in rank order

    @property
    def peaks(self) -> list[int]:
        return [rank.peak for rank in self.ranks]

    @property
    def peak(self) -> int:
        """The largest rank's peak: what the largest GPU must hold."""
        return max(self.peaks)

    @property
    def worst(self) -> Estimate:
        """The rank with the largest peak (its nbmem.Estimate)."""
        return max(self.ranks, key=lambda rank: rank.peak)

    def __str__(self) -> str:
        first = self.ranks[0]
        lines = [
            f"gpumem launch: {self.parallel} on {self.world_size} real ranks ({self.mode}, "
            f"{'gloo on the CPU' if self.mode == 'tracked' else 'NCCL on CUDA'}), batch {first.batch_size} per rank, "
            f"global batch {first.global_batch}"
        ]
        for index, rank in enumerate(self.ranks):
            parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in rank.breakdown.at_peak if size)
            lines.append(f"  rank {index}  peak {format_bytes(rank.peak)} allocated ({parts})")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def launch(
    model: Any,
    batch: Callable[[int], Any],
    *,
    parallel: str,
    world_size: int,
    batch_size: int | None = None,
    global_batch_size: int | None = None,
    timeout: float = 600.0,
    mode: str = "auto",
    progress: bool = True,
    on_rank: Callable[[int, int], None] | None = None,
    **knobs: Any,
) -> Launch:
    """Run the training step for real as ``world_size`` ranks on this machine; every rank's peak.

    On a CPU the ranks are forked processes joined with the gloo backend, each
    tracked (the same accounting as ``mode="tracked"``); on a machine with
    enough CUDA devices, NCCL, each rank measured on its own GPU (untested so
    far); ``mode="tracked"`` keeps to the CPU either way. The knobs are
    :func:`nbmem.estimate`'s, ``step=`` (your own training step) included. A rank that fails stops the
    launch: the others are killed and its error is raised here; nothing is
    left running, and this process (the notebook's kernel) is not touched.
    ``progress`` (True or False) shows how many ranks have finished, where it
    can be seen (see :mod:`nbmem.whatif.progress`); ``on_rank(finished, world_size)``,
    if given, is called each time another rank has ended well (a sweep's own
    progress view passes its hook and ``progress=False``).

    >>> import torch
    >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> make = lambda n: (torch.randn(n, 64), torch.randint(0, 4, (n,)))
    >>> ranks = launch(build, make, batch_size=8, parallel="ddp", world_size=2, optimizer="sgd")
    >>> len(ranks.peaks), ranks.mode, ranks.ranks[1].rank
    (2, 'tracked', 1)
    """
    check_progress(progress)
    if mode not in ("auto", "tracked", "measured"):
        raise ValueError(f"unknown mode {mode!r} for a launch: use 'auto', 'tracked' (gloo, CPU) or 'measured' (NCCL, CUDA)")
    cuda = torch.cuda.is_available() and mode != "tracked"
    if mode == "measured" and not cuda:
        raise ValueError("mode 'measured' launches on CUDA devices and none is available here: use mode='tracked'")
    # every knob checked here, before any process starts (a TypeError names a knob that doesn't exist)
    plan = Plan(batch_size=batch_size, global_batch_size=global_batch_size, parallel=parallel, world_size=world_size,
                mode="measured" if cuda else "tracked", **knobs)
    return launch_plan(model, batch, plan, timeout=timeout, progress=progress, on_rank=on_rank)


def launch_plan(
    model: Any,
    batch: Any,
    plan: Plan,
    *,
    timeout: float = 600.0,
    progress: bool = True,
    on_rank: Callable[[int, int], None] | None = None,
) -> Launch:
    """:func:`launch` for a plan already made (a sweep's): ``plan.mode`` "measured" runs NCCL ranks, "tracked" gloo."""
    cuda, parallel, world_size = plan.mode == "measured", plan.parallel, plan.world_size
    if cuda:
        if torch.cuda.is_initialized():
            raise ValueError(
                "CUDA is already initialised in this process, and forked ranks can't use it: call nbmem.launch "
                "before anything touches the GPU (e.g. at the top of a fresh kernel), or from a script"
            )
        if world_size > torch.cuda.device_count():
            raise ValueError(
                f"world_size={world_size} needs {world_size} CUDA devices and this machine has "
                f"{torch.cuda.device_count()}: estimate larger worlds with nbmem.estimate(parallel=...)"
            )

    def rank_step(rank: int, world: int) -> Any:
        # one thread per rank: a forked child must not start OpenMP threads once
        # its parent has used them (libgomp would hang), and the ranks share the cores
        torch.set_num_threads(1)
        if cuda:
            torch.cuda.set_device(rank)
        with contextlib.nullcontext() if cuda else collectives_on_copies():
            return estimate_plan(model, batch, plan)

    with Progress(f"gpumem launch: {parallel} on {world_size} real ranks", None, enabled=progress) as shown:
        shown.begin("running the step", unit="")

        def heard(finished: int, world: int) -> None:
            shown.ranks(finished, world)
            if on_rank is not None:
                on_rank(finished, world)

        ranks = run_ranks(rank_step, world_size, backend="nccl" if cuda else "gloo", timeout=timeout, on_rank=heard)
        launched = Launch(parallel, world_size, "measured" if cuda else "tracked", tuple(ranks))
        shown.done(f"peak {format_bytes(launched.peak)} allocated on the largest rank, {launched.mode}")
    return launched
