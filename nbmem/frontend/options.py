"""Reading ``%gpumem``'s options: words as a shell splits them, checked before anything runs.

The magic's one argparse parser knows every option of the cell form; a line
action (``%gpumem history``) uses a few of them. :data:`ACTION_OPTIONS` is
the one table of which, the usage block in the magic's help lists the same
(a test compares them), and :func:`refuse_unused` turns any other option
given with the action into a UsageError naming it. :func:`read_options`
does it all: every mistake is a UsageError saying how to fix it.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

from IPython.core.error import UsageError

from ..tracking.backends import BACKENDS, ENGINES, native_engine, resolve_backend

__all__ = ["ACTIONS", "ACTION_OPTIONS", "read_options", "parse_options", "unsilenced", "option_names", "refuse_unused",
           "check_snapshot_path"]

#: The options (argparse destinations) each line action reads, in the order its usage lists them.
ACTION_OPTIONS: dict[str, tuple[str, ...]] = {
    "on": ("quiet", "no_live", "capacity", "device", "backend", "engine"),
    "off": ("quiet",),
    "history": ("output", "quiet", "text"),
    "reset": ("quiet",),
    "free": ("output", "quiet", "device"),
}

ACTIONS = tuple(ACTION_OPTIONS)

_NEGATIVE = re.compile(r"-\.?[0-9]")


def read_options(parser: argparse.ArgumentParser, line: str, cell: str | None) -> argparse.Namespace:
    """The options of ``%%gpumem`` (``cell`` given) or of a ``%gpumem`` line, each one usable as given.

    Raises UsageError, saying how to fix it, for an action where there must
    be none or an unknown one, an option its action does not read, or a
    value that can't be used here (a backend, device or capacity); the
    native engine's library is built here, once, so that its failure is one.
    """
    args = parse_options(parser, line if cell is not None else unsilenced(line))
    # what the words mean first, then whether their values can be used
    if cell is not None and args.action is not None:
        raise UsageError(
            f"%%gpumem measures the cell below it and takes only options, not {args.action!r}; "
            "to turn on measuring every cell write `%gpumem on` as a line of its own"
        )
    if cell is None:
        if args.action is None:
            raise UsageError(
                f"%gpumem needs an action: {', '.join(ACTIONS)}; to measure a cell, put %%gpumem on its first line"
            )
        if args.action not in ACTIONS:
            raise UsageError(f"%gpumem {args.action!r} is not known: use one of {', '.join(ACTIONS)}")
        refuse_unused(parser, args)
    if args.backend not in BACKENDS:
        raise UsageError(f"--backend {args.backend!r} is not known: use one of {', '.join(BACKENDS)}")
    if args.engine not in ENGINES:
        raise UsageError(f"--engine {args.engine!r} is not known: use one of {', '.join(ENGINES)}")
    if getattr(args, "snapshot", None) is not None:
        args.snapshot = check_snapshot_path(args.snapshot)
    try:
        resolved = resolve_backend(args.backend, args.device)
        if args.capacity is not None:
            from ..core.devices import parse_capacity

            parse_capacity(args.capacity)
        if args.engine == "native" and (cell is not None or args.action == "on"):
            native_engine(  # builds the library once
                *resolved, args.capacity, args.timeline or getattr(args, "snapshot", None) is not None
            )
    except (ValueError, RuntimeError) as error:  # RuntimeError: NativeUnavailable, saying why
        raise UsageError(str(error)) from None
    return args


def check_snapshot_path(value: str) -> str:
    """The ``--snapshot`` file, ``~`` expanded; a UsageError, before the cell runs, for one that could not be
    written after it.

    >>> check_snapshot_path("/no/such/folder/cell.pickle")
    Traceback (most recent call last):
    ...
    IPython.core.error.UsageError: --snapshot /no/such/folder/cell.pickle: the folder /no/such/folder does not exist; create it, or name a file in one that does
    """
    path = Path(value).expanduser()
    if not value.strip():
        raise UsageError("--snapshot needs a file name, e.g. --snapshot cell.pickle")
    if path.is_dir():
        raise UsageError(f"--snapshot {value}: that is a folder; name a file in it, e.g. --snapshot {path / 'cell.pickle'}")
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"--snapshot {value}: the folder {folder} does not exist; create it, or name a file in one "
                         "that does")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--snapshot {value}: not writable here; name a file in a folder you can write to")
    return str(path)


def unsilenced(line: str) -> str:
    """The line form's options without a trailing ``;`` (which silences the output, not an option)."""
    stripped = line.rstrip()
    return stripped[:-1] if stripped.endswith(";") else line


def parse_options(parser: argparse.ArgumentParser, line: str) -> argparse.Namespace:
    """The magic's options, read as a shell reads words; a UsageError saying how to fix a bad line.

    IPython's own splitting keeps quotes inside the words (``'16 GiB'`` with
    its quotes, which no option reads) and lets ``shlex`` raise a bare
    ValueError on an unclosed quote; argparse takes a value starting with
    ``-`` (``--capacity -5GB``) for an option and says "expected one
    argument". Here quotes group words, and a value that looks like a
    negative number is kept with its option, to be refused for what it is.
    """
    try:
        words = shlex.split(line)
    except ValueError as error:  # "No closing quotation", "No escaped character"
        raise UsageError(
            f"can't read the options {line.strip()!r} ({error}): close the quote, e.g. --capacity '16 GiB'"
        ) from None
    if "--help" in words or "-h" in words:  # the magic's parser has no help option; IPython's ? shows its docstring
        usage = parser.format_usage().replace("::", "", 1).strip()  # IPython's parser writes it as a literal block
        raise UsageError(f"usage: {usage}\nEvery option and action, with examples: %gpumem? (or %%gpumem? for the "
                         "cell form)")
    # argparse has no public list of the options that take a value
    takes_value = {
        option for action in parser._actions if action.option_strings and action.nargs is None
        for option in action.option_strings
    }
    joined: list[str] = []
    for word in words:
        if joined and joined[-1] in takes_value and _NEGATIVE.match(word):
            joined[-1] = f"{joined[-1]}={word}"
        else:
            joined.append(word)
    return parser.parse_args(joined)


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's destination -> the flag the usage writes for it (``-o``, not ``--output``)."""
    # argparse has no public list of its options either
    return {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}


def option_names(parser: argparse.ArgumentParser, dests: tuple[str, ...]) -> list[str]:
    """The flags for ``dests``, in that order: ``("output", "quiet")`` -> ``["-o", "-q"]``."""
    flags = _flags(parser)
    return [flags[dest] for dest in dests]


def refuse_unused(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise a UsageError naming every option given with ``args.action`` that the action does not read.

    An option counts as given when its value differs from its default: an
    option silently ignored would let ``%gpumem history --capacity T4`` look
    as if it did something.
    """
    allowed = ACTION_OPTIONS[args.action]
    flags = _flags(parser)
    unused = [
        flag for dest, flag in flags.items() if dest not in allowed and getattr(args, dest) != parser.get_default(dest)
    ]
    if unused:
        verb = "means" if len(unused) == 1 else "mean"
        raise UsageError(
            f"%gpumem {args.action} takes {', '.join(option_names(parser, allowed))}; "
            f"{', '.join(unused)} {verb} nothing here"
        )
