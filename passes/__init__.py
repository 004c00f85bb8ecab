"""Compiler passes over the captured training graph, one pass per file (see DESIGN.md):

annotate_params -> estimate_nonmodel -> plan_residency -> prefetch_fetches -> insert_memory_ops
-> verify_schedule. Analyses are pure and return frozen dataclasses; transforms return a new
GraphModule. Metadata goes through ``pscompile.graph_meta``.
"""
