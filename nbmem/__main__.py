"""``python -m nbmem``: the same as the ``nbmem`` command."""

from .frontend.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
