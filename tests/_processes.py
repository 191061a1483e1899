"""Helpers for tests that start processes and check that none is left running."""

from __future__ import annotations


def gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its parent to reap it (it runs nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # the state follows the command name, which is in parentheses and may hold spaces
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
