"""The bench harness every script in bench/ uses (bench/README.md is the index of the scripts).

- ``specs``: the named model sizes (one rule for a GPT's head count), their batches, the optimizer;
- ``runner``: run a spec in a fresh interpreter and read its result back;
- ``timing``: repetitions, warm-up, interleaved rounds and their ratios;
- ``host``: the machine (CPU, load, host peak) for a result's ``meta``;
- ``output``: the common flags, and JSON plus Markdown output;
- ``runs``: a CPU ``Config``, a run of steps, the median of a steady stat;
- ``systems``: the systems several scripts train (plain PyTorch counted tensor by tensor, with fused
  AdamW or ``torch.compile``; hooks and compiled mode) and the tables' cells.

A script runs as ``python bench/NAME.py`` (bench/ first on ``sys.path``) or ``pscompile bench NAME``.
"""
