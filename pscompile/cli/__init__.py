"""``python -m pscompile``: ``main`` (the train / inspect / bench commands) and ``data`` (the byte
corpus the demo trains on)."""
