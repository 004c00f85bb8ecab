"""``python -m pscompile``: see ``pscompile.cli``."""

from pscompile.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
