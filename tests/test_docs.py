"""Every public function and class, and ``%gpumem?``, documents its usage with an example.

The ``>>>`` examples themselves run as doctests (``--doctest-modules``); this
checks that they, or a plain ``Example::`` block where one can't run here,
exist at all.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping
from typing import Any

import pytest

import nbmem
from nbmem.frontend import magics


def _public(name: str) -> Any:
    try:
        return getattr(nbmem, name)
    except ImportError:  # an integration whose optional library is not installed (nbmem[zoo], nbmem[lightning])
        return None


PUBLIC = {name: value for name in nbmem.__all__ if (value := _public(name)) is not None}
DOCUMENTED = sorted(name for name, value in PUBLIC.items() if inspect.isfunction(value) or inspect.isclass(value))
# A plain code block: "Example::", "Examples, in a notebook::", "Example (not run ...)::".
_EXAMPLE_BLOCK = re.compile(r"\bExamples?\b[^\n]*(?:\n[^\n]+)*?::\n")


def _own_docstring(value: Any) -> str:
    # Not inspect.getdoc: that falls back to a base class's docstring, and a
    # dataclass without one gets its signature as __doc__ (no example in it).
    return inspect.cleandoc(vars(value).get("__doc__") or "") if inspect.isclass(value) else inspect.cleandoc(value.__doc__ or "")


def test_no_submodule_shadows_a_public_name():
    # importing nbmem.<name> sets that attribute on the package: a submodule named
    # like a public function would replace the function once anything imported it
    import pkgutil

    for module in pkgutil.iter_modules(nbmem.__path__):
        importlib.import_module(f"nbmem.{module.name}")
        assert module.name not in nbmem.__all__, f"nbmem/{module.name}.py shadows nbmem.{module.name}"
    assert all(not inspect.ismodule(getattr(nbmem, name)) for name in nbmem.__all__)
    assert callable(nbmem.diagnose) and callable(nbmem.estimate) and callable(nbmem.launch)


def test_the_public_names_are_found():
    assert {"measure", "track", "MemoryScope", "estimate", "Estimate", "diagnose", "load_ipython_extension"} <= set(DOCUMENTED)
    # only data (the STRATEGIES and PRESETS tables) is left out, never a module or anything callable
    left_out = {name: type(value).__name__ for name, value in PUBLIC.items() if name not in DOCUMENTED}
    assert all(isinstance(PUBLIC[name], Mapping) for name in left_out), left_out


@pytest.mark.parametrize("name", DOCUMENTED)
def test_public_docstring_has_usage_and_example(name: str):
    doc = _own_docstring(PUBLIC[name])
    assert doc, f"nbmem.{name} has no docstring"
    assert len(doc.splitlines()) > 1, f"nbmem.{name}'s docstring is only a summary line: say how to use it\n{doc}"
    assert ">>>" in doc or _EXAMPLE_BLOCK.search(doc), (
        f"nbmem.{name}'s docstring has no example (a >>> doctest, or an 'Example::' block where "
        f"it can't run as a test)\n{doc}"
    )


def _mentions(text: str, option: str) -> bool:
    # "-o" must appear as itself, not as part of "--output"
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_gpumem_help_shows_every_option_and_examples(shell):
    magic = shell.find_line_magic("gpumem")
    assert magic is not None and shell.find_cell_magic("gpumem") is not None
    shown = shell.object_inspect_text("%gpumem")  # what `%gpumem?` and `%%gpumem?` print
    assert magic.__doc__ in shown
    written = magic.parser.description  # the docstring as written, before argparse adds its own help
    options = [option for action in magic.parser._actions for option in action.option_strings]
    assert {"--output", "--quiet", "--backend", "--device", "--capacity", "--breakdown"} <= set(options)
    for text in (shown, written):
        missing = [option for option in options if not _mentions(text, option)]
        assert not missing, f"%gpumem? does not mention {missing}:\n{text}"
    # the hand-written usage covers both forms: the cell magic and every line action
    assert "%%gpumem [" in written
    missing = [action for action in magics.ACTIONS if f"%gpumem {action}" not in written]
    assert not missing, f"%gpumem? does not show the line actions {missing}"
    examples = written.split("Examples::", 1)
    assert len(examples) == 2 and "%%gpumem" in examples[1] and "%gpumem " in examples[1], written
