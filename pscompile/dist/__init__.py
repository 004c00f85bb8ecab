"""ZeRO data parallelism by chunk: the process group (comm), the sharded chunk store, checkpoints."""
