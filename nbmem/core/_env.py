"""Where nbmem is running: the one place that decides how a report can be shown.

A Jupyter kernel (JupyterLab, classic notebook, VS Code, Colab, nbclient) can
show widgets, and every widget nbmem publishes carries HTML and text fallbacks
for frontends without a widget manager. A terminal IPython or plain Python
gets text.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

__all__ = ["frontend", "widgets_usable", "FrontendProbe"]


def frontend(shell: Any = None) -> Literal["kernel", "terminal", "none"]:
    """``kernel`` inside a Jupyter kernel, ``terminal`` in IPython, ``none`` elsewhere."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return "none"
        shell = get_ipython()
    if shell is None:
        return "none"
    # ipykernel's shell; nbmem must not import ipykernel to find out.
    if any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__):
        return "kernel"
    return "terminal"


@functools.cache
def _ipywidgets_importable() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def widgets_usable(shell: Any = None) -> bool:
    """True where an ipywidgets view can reach a frontend (a kernel with ipywidgets)."""
    return frontend(shell) == "kernel" and _ipywidgets_importable()


class FrontendProbe:
    """Whether a live frontend (JupyterLab, Notebook 7) watches this kernel's cells.

    Only a person watching needs a live gauge; nbclient (``nbmem profile``,
    ``jupyter nbconvert --execute``) runs the same kernel with nobody
    watching, and what it saves must not change (issue 15). The kernel can't
    tell them apart by itself, so it opens a comm to a target no frontend
    has: JupyterLab's kernel connection refuses a comm whose target it does
    not know by closing it (``_handleCommOpen`` in @jupyterlab/services),
    while nbclient only logs it. The answer arrives once the kernel has run
    the requests queued before it, so probe early: at ``%load_ext nbmem``.
    "Run all" queues every cell before the answer; for it, a request sent by
    JupyterLab's notebook says so itself: its metadata carries
    ``deletedCells`` and ``recordTiming`` (``CodeCell.execute`` in
    @jupyterlab/cells), which nbclient's requests (``cellId`` only) don't.
    """

    TARGET = "nbmem.frontend-probe"

    def __init__(self) -> None:
        #: True once a frontend closed the probe's comm: someone is watching live.
        self.answered = False
        self._comm: Any = None
        try:
            from comm import create_comm

            self._comm = create_comm(target_name=self.TARGET)
            self._comm.on_close(self._closed)
        except Exception:  # no comm support here: no live frontend known, never an error
            self._comm = None

    def _closed(self, message: Any) -> None:
        self.answered = True

    def watching(self, shell: Any) -> bool:
        """True when someone watches: the probe was answered, or the running cell came from JupyterLab."""
        if self.answered:
            return True
        try:
            metadata = shell.kernel.get_parent().get("metadata", {})
        except Exception:  # not ipykernel's shell: nobody to ask
            return False
        return "deletedCells" in metadata and "recordTiming" in metadata

    def close(self) -> None:
        """Close the probe's comm (at ``%unload_ext``) if no frontend did."""
        comm, self._comm = self._comm, None
        if comm is not None and not self.answered:
            try:
                comm.close()
            except Exception:
                pass
