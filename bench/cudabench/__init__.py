"""The runs of a lent GPU behind ``bench/gpu.py`` (docs/gpu.md); each module imports only those above it.

- ``rows``: the settings, the systems, and one timed row (plain PyTorch, or pscompile) with its peaks;
- ``acceptance``: the acceptance run (parity, step time, overlap ratio);
- ``lease_pytest``: the pytest plugin of the lease's tests phase; ``gputests``: that phase;
- ``lease``: ``--lease``, a short lease's one command, and the timed frame every lease command shares;
- ``peers``: FSDP2 and DeepSpeed, what a user would run instead; ``versus``: ``--peers``, pscompile
  against them.
"""
