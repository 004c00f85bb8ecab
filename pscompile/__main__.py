"""``python -m pscompile``: see ``pscompile.cli``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
