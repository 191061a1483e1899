"""A cell's code, as IPython compiles it, and what it names: for ``%%gpumem`` and ``%gpumem on``.

``%%gpumem`` runs its cell itself, so it compiles it exactly as IPython would
(its transforms, its cell file name for tracebacks, the last expression
kept apart so that its value displays); the same code says whether the cell
will run ``torch.compile``'d code (:mod:`nbmem.tracking.compiled`), which picks
the engine that measures it compiled.
"""

from __future__ import annotations

import ast
from types import CodeType
from typing import Any

from ..core.rendering import first_line
from ..tracking.compiled import compiled_anywhere, expects_compiled

__all__: list[str] = []  # the magics' own helpers


def _is_nbmem_cell(source: str) -> bool:
    r"""``%%gpumem`` cells record themselves, also under other cell magics (``%%time`` above it, whose body
    starts with it); ``%gpumem ...`` lines are nbmem's own commands.

    >>> _is_nbmem_cell("%%time\n%%gpumem -q\nx = 1"), _is_nbmem_cell("%%time\nx = 1\n%%gpumem")
    (True, False)
    """
    if first_line(source).startswith("%gpumem"):
        return True
    for line in (line.strip() for line in source.splitlines()):
        if not line:
            continue
        if not line.startswith("%%"):
            return False
        if line.startswith("%%gpumem"):
            return True
    return False


#: How IPython's static transforms write a ``%%gpumem`` cell (IPython.core.inputtransformer2.cell_magic).
_CELL_CALL = "get_ipython().run_cell_magic"


def _expects_compiled(body: CodeType, last: CodeType | None, namespace: dict[str, Any]) -> bool:
    """Whether a cell will run torch.compile'd code, guessed from the names it uses (tracking.compiled)."""
    return expects_compiled(body, namespace) or (last is not None and expects_compiled(last, namespace))


def _cell_expects_compiled(shell: Any, raw: str) -> bool:
    """:func:`_expects_compiled` for a cell ``%gpumem on`` is about to run (its source; IPython runs it after)."""
    if "compile" not in raw and not compiled_anywhere():
        return False  # the common case, without compiling the cell a second time
    try:
        code = compile(shell.transform_cell(raw), "<cell>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):  # IPython shows it when it runs the cell; nothing to guess from
        return False
    return expects_compiled(code, shell.user_ns)


def _compiled(shell: Any, cell: str, number: int) -> tuple[CodeType, CodeType | None]:
    """A cell's statements and last expression (None if it ends otherwise), compiled as IPython compiles a cell.

    Raises IPython's SyntaxError for the code; for an ``await`` IPython would run, saying how to measure it.
    """
    __tracebackhide__ = True
    source = shell.transform_cell(cell)
    # Cache the source under a cell name so tracebacks show the user's lines.
    filename = shell.compile.cache(source, number, raw_code=cell)
    try:
        tree = shell.transform_ast(shell.compile.ast_parse(source, filename=filename))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = shell.compile(ast.Expression(tree.body.pop().value), filename, "eval")
        return shell.compile(ast.Module(tree.body, type_ignores=[]), filename, "exec"), last
    except SyntaxError as error:
        if not (shell.autoawait and _awaits(source, filename, shell.compile.flags)):
            raise  # IPython refuses the same code, saying the same
        raise SyntaxError(
            f"{error.msg}: %%gpumem runs its cell synchronously, so it can't await at top level; to measure "
            "a cell that awaits, run `%gpumem on` before it (and `%gpumem off` after)",
            (error.filename, error.lineno, error.offset, error.text, error.end_lineno, error.end_offset),
        ) from None


def _awaits(source: str, filename: str, flags: int) -> bool:
    """Whether code that does not compile as a module compiles as IPython's autoawait runs a cell, as a coroutine.

    The magic can't run it so: IPython calls it synchronously, from a cell with no ``await`` of its own.
    """
    try:
        compile(source, filename, "exec", flags | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError:
        return False
    return True
