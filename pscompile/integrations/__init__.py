"""pscompile inside other libraries' training loops.

- ``pscompile.integrations.transformers``: ``PscompileTrainer``, the Hugging Face ``Trainer`` with
  pscompile's engine doing the forward, backward and AdamW update under a device budget.

Each module imports its library when it is imported, never before: ``import pscompile`` needs none
of them.
"""
