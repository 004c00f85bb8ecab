"""Compiler passes over the captured training graph, one pass per file (docs/design.md, section 3):

annotate_params -> estimate_nonmodel -> plan_residency -> prefetch_fetches (-> overlap_grad_copies,
-> plan_lookahead) -> insert_memory_ops -> verify_schedule, run in that order by
``pscompile.graph.pipeline``. Analyses are pure and return
frozen dataclasses; transforms return a new GraphModule. Metadata goes through
``pscompile.graph.meta``.
"""
