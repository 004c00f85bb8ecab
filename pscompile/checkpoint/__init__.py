"""Checkpoint files: the layers under ``pscompile.save`` / ``pscompile.load`` (``pscompile/saving.py``).

``files.py``        durable writes: an exclusive temporary, hashed while written, fsync, rename,
                    fsync of the folder; ``remove_stale`` clears the temporaries of dead writers.
``file_format.py``  one checkpoint file (format 3): a JSON header, each chunk's optimizer state
                    streamed from where it lives, a SHA-256 at the end; ``CheckpointReader``
                    checks the length and the hash before anything is read into an engine.
``sharded.py``      a ZeRO checkpoint: a folder every rank writes into, committed by one atomic
                    rename of its manifest; ``agree`` makes every rank refuse if any rank must.
``../saving.py``    ``save``, ``load``, ``consolidate``: the checks of every value against the
                    engine and the rules (``runtime/state.py``: ``state_problems``,
                    ``state_fault``; ``runtime/rng.py``: ``rng_problems``), one list of problems,
                    the ranks' agreement, then the load, which changes nothing until all passed.
``legacy.py``       format 1 (a ``torch.save`` envelope), still read.

What the engine puts into a checkpoint and takes out of it is the engine's own
(``runtime/checkpoint_state.py``: the header, the tensors, the direct load and the resharding).
The public names are ``pscompile.save``, ``pscompile.load`` and ``pscompile.consolidate``
(``saving.py``, a floor above the engines). This package imports nothing of pscompile: it is the
file format, on the floor under the runtime, which reads and writes through it.
"""
