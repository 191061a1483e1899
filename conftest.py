"""The repository root's pytest configuration: what ``--doctest-modules`` may import from ``nbmem/``.

The integrations with an optional library import it at the top (a Trainer
callback must subclass the library's class): where the library is not
installed (``nbmem[zoo]``, ``nbmem[lightning]``), their modules are not
collected, as their tests skip (tests/_zoo.py ``need``).
"""

import importlib.util

collect_ignore = [
    path
    for library, path in (("transformers", "nbmem/frontend/trainer_callback.py"),
                          ("lightning", "nbmem/frontend/lightning_callback.py"))
    if importlib.util.find_spec(library) is None
]
