"""Compiler passes over the captured training graph (one pass per file).

The compiled mode (joint-graph capture and memory-planning passes) lands with the compiler
issue; this package exists so the layout matches DESIGN.md from the start.
"""
