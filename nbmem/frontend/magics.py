"""The ``%gpumem`` / ``%%gpumem`` magics, and loading them into a shell.

A thin shell: parse the arguments, run the cell inside a
:class:`~nbmem.tracking.scope.MemoryScope`, hand the result to :mod:`nbmem.frontend.display`
and to the session's history. ``%gpumem on`` and the every-cell hooks are
:mod:`nbmem.frontend.session`'s.
"""

from __future__ import annotations

import ast
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.magic import Magics, line_cell_magic, magics_class, output_can_be_silenced
from IPython.core.magic_arguments import argument, magic_arguments

from ..core import _env
from . import display
from .cell_snapshots import records_pytorch_history
from .cells import _CELL_CALL, _compiled, _expects_compiled
from ..tracking.diagnosis import diagnose, is_out_of_memory
from ..tracking.history import AllocatorHistory
from ..core.rendering import first_line
from ..core.results import History, MemoryResult
from ..tracking.backends import Backend, resolve_backend
from ..tracking.scope import MemoryScope
from .live_gauge import CELL_DELAY, LiveGauge, capacity_of, virtual_label
from .options import ACTIONS, read_options
from .session import EveryCell, EveryCellHooks, Session, stop_gauge
from ..tracking.tracker import default_tracker

__all__ = ["GpuMemMagics", "load", "unload", "history", "log_every_cell", "ACTIONS"]


@magics_class
class GpuMemMagics(Magics, EveryCellHooks):
    """Holds the session state; registered once per shell by :func:`load`."""

    #: Always the shell it was registered on (IPython's Magics allows None).
    shell: Any

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session = Session()

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        help="line form only: on, off, history, reset or free",
    )
    @argument("-o", "--output", action="store_true", help="return the result object (it lands in Out)")
    @argument("-q", "--quiet", action="store_true", help="show nothing; the result still goes to the history")
    @argument("--text", action="store_true", help="show the report as plain text, no widget or HTML")
    @argument(
        "--no-live",
        action="store_true",
        help="no live gauge while the cell runs (with `on`: no live line for long cells); "
        "it shows only in a frontend someone watches, such as JupyterLab",
    )
    @argument("--timeline", action="store_true", help="also plot live memory op by op, stacked by category, the peak named")
    @argument("--lines", action="store_true", help="also show which lines of your code made the memory alive at the peak")
    @argument("--snapshot", default=None, metavar="FILE", help="also write the cell as a PyTorch memory snapshot pickle (pytorch.org/memory_viz)")
    @argument("--free-on-oom", action="store_true", help="after an out-of-memory error, release the failed cell's frames at once (%%debug is then unavailable)")
    @argument("--breakdown", action="store_true", help="also show what the memory at the peak was for: by category and module")
    @argument(
        "--capacity",
        default=None,
        help="a virtual device: a size (16GiB, 512MiB) or a preset (T4, A100-40GB, ...); "
        "an allocation beyond it raises torch.OutOfMemoryError",
    )
    @argument("--device", default=None, help="device to measure: cuda:N, cuda, an accelerator's (mps, xpu:N) or cpu "
              "(default: the current accelerator device, else cpu)")
    @argument(
        "--backend",
        default="auto",
        help="auto (the allocator's statistics when there is a GPU or other accelerator, else tracked), measured "
        "(require an accelerator), cuda (require CUDA), or tracked (count tensors, any device)",
    )
    @argument(
        "--engine",
        default="auto",
        help="how tracked mode sees memory: dispatch (every op), native "
        "(the CPU allocator's blocks counted in C++: no slowdown per op, compiled code runs compiled; no --capacity "
        "or --timeline), or auto (the default: dispatch, or native where the cell runs torch.compile'd code)",
    )
    @output_can_be_silenced  # a trailing `;` hides the cell's value, as in any IPython cell
    @line_cell_magic
    def gpumem(self, line: str = "", cell: str | None = None) -> Any:
        """Measure the GPU memory a cell uses: peak, retained, reserved, time, share of the device.

        Usage, on a cell::

          %%gpumem [-o] [-q] [--text] [--no-live] [--breakdown] [--timeline] [--lines] [--snapshot FILE] [--capacity SIZE_OR_PRESET]
                   [--free-on-oom] [--device DEVICE] [--backend {auto,measured,cuda,tracked}] [--engine {auto,dispatch,native}]

        and as a line::

          %gpumem on [-q] [--no-live] [--capacity C] [--device D] [--backend B] [--engine E]   measure every following cell
          %gpumem off [-q]                                            stop measuring every cell
          %gpumem history [-o] [-q] [--text]                          table and chart of measured cells
          %gpumem reset [-q]                                          forget the history
          %gpumem free [-o] [-q] [--device D]                         release what failed cells and Out keep alive

        ``-o``/``--output`` returns the result (a :class:`~nbmem.MemoryResult`,
        the :class:`~nbmem.History`, or what ``free`` gave back), so it lands
        in ``Out``; ``-q``/``--quiet`` shows nothing (measured cells still go
        to the history); ``--text`` prints plain text instead of the widget.
        ``--device`` picks the device (``cuda:N``, ``cuda``, another
        accelerator's such as ``mps`` or ``xpu:N``, or ``cpu``; default: the
        current accelerator device, else the CPU) and ``--backend`` how to
        count (``auto``, ``measured``, ``cuda`` or ``tracked``). Tracked on the CPU,
        ``--engine native`` counts the CPU allocator's blocks in C++
        instead of seeing every op from Python: the cell runs at about its
        untracked speed (the ``dispatch`` engine costs 1.1-1.2x); it
        builds a small library with the system's C++ compiler once, and has
        no ``--capacity``, ``--timeline`` or op at the peak. The default,
        ``--engine auto``, is ``dispatch`` unless the cell uses
        ``torch.compile``'d code, which runs compiled only under ``native``
        (under ``dispatch`` it runs eagerly, and the report says so). Options are read as a
        shell reads words: quote a value with a space (``--capacity '16 GiB'``).
        A ``;`` ending the cell's last line hides its value, as IPython does
        (with ``-o``, the result too; the report then still shows).

        With a CUDA device the figures are *measured* by PyTorch's caching
        allocator (with another accelerator, MPS or XPU, by its allocator,
        through ``torch.accelerator``: a figure its backend does not keep is
        not shown, and the report says so). Without one (or with ``--backend tracked``) the cell still
        runs and nbmem *tracks* every tensor it makes, reporting the bytes a
        GPU would allocate for them. Each report says which.

        Live: in a frontend someone watches (JupyterLab, Notebook 7), a cell
        that runs longer than half a second shows a gauge while it runs:
        allocated now and the peak so far, against the device's capacity, and
        the time, updated twice a second; the report then takes its place.
        ``%gpumem on`` shows a compact live line for cells longer than about
        2 s. ``--no-live`` turns either off. A terminal, ``nbmem profile`` or
        nbclient shows nothing live.

        Figures: ``peak`` is the highest allocated memory while the cell ran,
        above what was allocated before it; ``retained`` is allocated after
        minus before; ``reserved`` includes the allocator's cache of freed
        blocks; ``device`` is the driver's view (with the CUDA context and
        other processes).

        ``--breakdown`` splits the memory at the peak into parameters,
        buffers, gradients, optimizer state, activations (what autograd saved
        for backward) and other, and by top-level module. ``--capacity T4``
        runs the cell as if on a smaller device: the op that would not fit
        raises ``torch.OutOfMemoryError``, as CUDA would. After any
        out-of-memory error the report explains it: the largest live tensors
        and what would help, with estimated savings; ``--free-on-oom`` then
        releases the failed cell's frames at once (``%debug`` can no longer
        inspect them). ``--timeline`` plots live memory op by op. ``--lines`` adds a
        table of the cell's lines (and those of your functions it calls): the bytes
        each made that were alive at the peak, and all it made; backward's go to
        the ``loss.backward()`` line, the optimizer's to ``step()``. ``--snapshot FILE`` writes
        the cell as a PyTorch memory snapshot (``MemoryResult.to_snapshot``).

        Examples::

          %%gpumem
          loss = model(x).sum(); loss.backward(); opt.step()

          %%gpumem --breakdown --capacity T4
          loss = model(x).sum(); loss.backward(); opt.step()

          %%gpumem -o --backend tracked
          y = model(x)

          %%gpumem --breakdown --engine native
          loss = model(x).sum(); loss.backward(); opt.step()

          report = _            # the MemoryResult, after -o

          %gpumem on --capacity 16GiB
          %gpumem history
          %gpumem off
          %gpumem free
        """
        __tracebackhide__ = True
        args = read_options(self.gpumem.parser, line, cell)
        if cell is not None:
            return self._measure_cell(cell, args)
        return getattr(self, f"_action_{args.action}")(args)

    # -- one cell ---------------------------------------------------------

    def _measure_cell(self, cell: str, args: Any) -> Any:
        __tracebackhide__ = True
        shell = self.shell
        count = self.session.cell_number
        checked, self.session.compiled = self.session.compiled, None
        ready = checked[1] if checked is not None and checked[0] == cell else None  # compiled by check_cell
        top = ready is not None  # IPython runs this cell itself (not run_cell_magic in code)
        body, last = ready if ready is not None else _compiled(shell, cell, count or 0)
        namespace = shell.user_ns
        # measured on CUDA, --snapshot writes what the allocator itself recorded; elsewhere, nbmem's storages
        history = args.snapshot is not None and records_pytorch_history(args.backend, args.device)

        scope = MemoryScope(
            args.backend,
            args.device,
            label=first_line(cell),
            execution_count=count,
            breakdown=args.breakdown,
            capacity=args.capacity,
            timeline=args.timeline or (args.snapshot is not None and not history),
            lines=args.lines,
            engine=args.engine,
            expect_compiled=args.engine == "auto" and _expects_compiled(body, last, namespace),
        )
        gauge: LiveGauge | None = None
        recorder = AllocatorHistory(args.snapshot) if history else None
        # start and stop inside the try: Ctrl-C between scope.start() returning and the try, or on
        # the line that calls stop(), would otherwise leave the tracker installed (issue 12)
        ran = False
        try:
            if recorder is not None:
                recorder.start()
            scope.start()
            gauge = self._live_gauge(scope, args)
            exec(body, namespace)
            value = eval(last, namespace) if last is not None else None
            result = scope.stop()
            ran = True
        except BaseException as error:
            if scope.running:
                failed = scope.stop(error)
                self._report(failed, args, scope, error, in_place=stop_gauge(gauge), top=top)
            if recorder is not None:
                recorder.finish(failed=True)  # the failed cell's snapshot (an OOM's is the one to read)
                if recorder.written and not args.quiet:
                    print(f"gpumem: the failed cell's snapshot written to {args.snapshot} (nbmem.load_snapshot)")
            raise
        finally:
            if gauge is not None:  # again after an interrupt in the lines above: stopping twice is harmless
                gauge.stop()
            if recorder is not None and not ran:
                recorder.stop()  # an interrupt anywhere above leaves PyTorch's recording as it found it
        # IPython drops what the magic returns after a trailing `;` (output_can_be_silenced): with -o
        # the report is then the only sign of the result, so it shows
        silenced = DisplayHook.semicolon_at_end_of_expression(cell)
        try:
            self._report(result, args, shown_as_out=args.output and not silenced, in_place=stop_gauge(gauge))
        finally:
            if recorder is not None:
                recorder.finish()
        written = True
        if recorder is None and args.snapshot is not None:
            try:
                result.to_snapshot(args.snapshot)
            except OSError as error:  # the folder went away, the disk filled: the cell ran, its value stands
                written = False
                print(f"gpumem: the snapshot could not be written to {args.snapshot} ({error}); the cell ran"
                      + ("" if args.quiet else " and its report is above"))
        if args.snapshot is not None and written:
            if not args.quiet:
                print(f"gpumem: snapshot written to {args.snapshot} (open it at pytorch.org/memory_viz, or nbmem.load_snapshot)")
        if args.output:
            # The result is the cell's Out and displays there; the cell's own
            # last value is shown above it instead.
            if value is not None and not silenced:
                display.show_value(value)
            return result
        return value

    def check_cell(self, lines: list[str]) -> list[str]:
        """An input transformer: a ``%%gpumem`` cell's SyntaxError raised before it runs, as a plain cell's is.

        From the magic, it would be an error *in* the cell, shown with every frame down to the compiler, nbmem's
        too; from here IPython shows its line and caret, and nothing runs. The magic then runs the code compiled here.
        """
        if len(lines) != 1 or not lines[0].startswith(f"{_CELL_CALL}('gpumem', "):
            return lines
        try:
            _, _, cell = ast.literal_eval(lines[0].strip()[len(_CELL_CALL):])
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # not as cell_magic writes it
            return lines
        # transformed before its cell runs, or (%%gpumem in %%time's cell) while it runs, as the magic numbers it
        number = self.shell.execution_count if self.session.cell_number is None else self.session.cell_number
        self.session.compiled = (cell, _compiled(self.shell, cell, number))
        return lines

    def _report(
        self,
        result: MemoryResult,
        args: Any,
        scope: MemoryScope | None = None,
        error: BaseException | None = None,
        *,
        shown_as_out: bool = False,
        in_place: str | None = None,
        top: bool = False,
    ) -> None:
        self.session.record(result)
        if not (args.quiet or shown_as_out):
            display.show_result(result, text=args.text, breakdown=args.breakdown, shell=self.shell, display_id=in_place)
        elif in_place is not None:  # the result is Out (-o): the gauge makes way for it
            display.clear_gauge(in_place)
        if not args.quiet and args.timeline and result.timeline is not None:
            display.show_timeline(result.timeline)
        if scope is not None and error is not None and is_out_of_memory(error):
            if not args.quiet:
                display.show_value(diagnose(result, scope.tracker, self.shell.user_ns, error))
            if args.free_on_oom:
                from ..tracking.reclaim import release_error, release_error_once_shown

                show = None if args.quiet else display.show_value
                if top:  # IPython shows the traceback next: cleared before, nbmem's frames would show in it
                    release_error_once_shown(self.shell, error, args.device, show)
                else:  # run_cell_magic from code that may catch the error: at once
                    reclaimed = release_error(error, device=args.device)
                    if show is not None:
                        show(reclaimed)

    def _live(self, quiet: bool, no_live: bool) -> bool:
        """Whether a gauge may show: asked for, and someone is watching (see _env.FrontendProbe)."""
        probe = self.session.frontend
        return not (quiet or no_live) and probe is not None and probe.watching(self.shell)

    def _live_gauge(self, scope: MemoryScope, args: Any) -> LiveGauge | None:
        """A running gauge for a ``%%gpumem`` cell, or None where nothing live may show."""
        if args.text or not self._live(args.quiet, args.no_live):
            return None
        return LiveGauge(
            scope, display.GaugeView(), capacity=capacity_of(scope), capacity_label=virtual_label(scope), delay=CELL_DELAY
        ).start()

    # -- line actions -------------------------------------------------------

    def _action_history(self, args: Any) -> History | None:
        if args.output:
            return self.session.history
        if not args.quiet:
            display.show_history(self.session.history, text=args.text)
        return None

    def _action_free(self, args: Any) -> Any:
        from ..tracking.reclaim import free

        reclaimed = free(self.shell, device=args.device)
        if args.output:
            return reclaimed
        if not args.quiet:
            display.show_value(reclaimed)
        return None

    def _action_reset(self, args: Any) -> None:
        self.session.history.clear()
        if not args.quiet:
            print("gpumem: history cleared")

def _registered(shell: Any) -> GpuMemMagics | None:
    magics = shell.magics_manager.registry.get(GpuMemMagics.__name__)
    return magics if isinstance(magics, GpuMemMagics) else None


def load(shell: Any, *, probe: bool = True) -> GpuMemMagics:
    """Register the magics and the two cell events; loading twice changes nothing.

    In a Jupyter kernel, ``probe`` asks whether a frontend is watching, for
    the live gauge (:class:`~nbmem.core._env.FrontendProbe`); ``nbmem profile``
    loads without asking, as nobody watches it.
    """
    magics = _registered(shell)
    if magics is None:
        magics = GpuMemMagics(shell)
        if probe and _env.frontend(shell) == "kernel":
            magics.session.frontend = _env.FrontendProbe()
        shell.register_magics(magics)
        shell.events.register("pre_run_cell", magics.pre_run_cell)
        shell.events.register("post_run_cell", magics.post_run_cell)
        shell.input_transformers_post.append(magics.check_cell)
    return magics


def unload(shell: Any) -> None:
    """Remove everything :func:`load` added and stop any scope still open."""
    magics = _registered(shell)
    if magics is None:
        return
    for event, callback in (("pre_run_cell", magics.pre_run_cell), ("post_run_cell", magics.post_run_cell)):
        try:
            shell.events.unregister(event, callback)
        except ValueError:
            pass
    if magics.check_cell in shell.input_transformers_post:
        shell.input_transformers_post.remove(magics.check_cell)
    from ..tracking.reclaim import forget_pending

    forget_pending(shell)
    stop_gauge(magics.session.pending_gauge)
    magics.session.pending_gauge = None
    if magics.session.pending_history is not None:
        magics.session.pending_history.stop()
        magics.session.pending_history = None
    if magics.session.frontend is not None:
        magics.session.frontend.close()
    if magics.session.pending is not None:
        if magics.session.pending.running:
            magics.session.pending.stop()
        magics.session.pending = None
    for kind in ("line", "cell"):
        if shell.magics_manager.magics[kind].get("gpumem") == getattr(magics, "gpumem"):
            del shell.magics_manager.magics[kind]["gpumem"]
    del shell.magics_manager.registry[GpuMemMagics.__name__]


def _session(shell: Any = None) -> Session:
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    magics = _registered(shell) if shell is not None else None
    if magics is None:
        raise RuntimeError("nbmem's extension is not loaded here: run `%load_ext nbmem` first")
    return magics.session


def history(shell: Any = None) -> History:
    """The measured cells of this IPython session (``%gpumem history -o`` returns the same).

    ``shell`` defaults to the running IPython shell, which must have loaded
    the extension (``%load_ext nbmem``). The :class:`~nbmem.History` is live:
    cells measured later are appended to it. Plain Python has no cells and no
    session: there, and in a shell without the extension, RuntimeError says
    what to do instead (build a ``nbmem.History`` of your own results).

    Example, in a notebook::

        %load_ext nbmem
        %gpumem on                       # or put %%gpumem on the cells
        ...
        cells = nbmem.history()
        cells[-1].peak                   # the last measured cell's peak, in bytes
        cells.to_dataframe()             # with pandas

    and in plain Python, where there is no session to read:

    >>> import nbmem, torch
    >>> with nbmem.track("cpu") as scope:
    ...     x = torch.ones(256)            # 256 * 4 bytes = 1024
    >>> nbmem.History([scope.result]).to_records()[0]["retained"]
    1024
    """
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            # A plain `python` process or script: no IPython shell, so no cells
            # were measured and no session exists to read them from.
            raise RuntimeError(
                "nbmem.history() lists the cells that %%gpumem and `%gpumem on` measured in IPython or "
                "Jupyter; this is plain Python (no IPython shell is running), so there are none. Keep the "
                "results you measure and make the same table yourself: `with nbmem.measure() as first: ...` "
                "then `nbmem.History([first.result, second.result])` (.to_records(), .to_dataframe(), .plot())"
            )
    if _registered(shell) is None:
        raise RuntimeError(
            "nbmem.history() lists the cells nbmem measured, and nbmem's extension is not loaded in this "
            "shell: run `%load_ext nbmem`, then put %%gpumem on a cell (or run `%gpumem on`)"
        )
    return _session(shell).history


def log_every_cell(
    shell: Any, path: str, backend: Backend = "auto", device: str | None = None, lines: bool = False,
    snapshots: str | None = None,
) -> None:
    """Measure every cell quietly and append each result to ``path`` as a JSON line.

    Used by ``nbmem profile``; independent of ``%gpumem on``/``off`` (a cell
    under ``%gpumem on`` is measured as that asks). Raises ValueError for a
    backend or device that can't be used here.
    """
    mode, resolved = resolve_backend(backend, device)
    if mode == "tracked":
        # The first tracker costs seconds (PyTorch imports torch._dynamo on the
        # first dispatch-mode call, see Tracker.__init__): paid here, in
        # `nbmem profile`'s setup, not in the notebook's first cell and its --timeout.
        default_tracker(resolved)
    load(shell, probe=False)
    session = _session(shell)
    session.log_path = path
    session.log_options = EveryCell(backend, device, quiet=True, lines=lines, snapshots=snapshots)
