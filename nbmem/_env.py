"""Where nbmem is running: the one place that decides how a report can be shown.

A Jupyter kernel (JupyterLab, classic notebook, VS Code, Colab, nbclient) can
show widgets, and every widget nbmem publishes carries HTML and text fallbacks
for frontends without a widget manager. A terminal IPython or plain Python
gets text.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

__all__ = ["frontend", "widgets_usable"]


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
