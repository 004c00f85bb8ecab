"""Compiled mode: the engine that runs scheduled graphs.

``engine`` (``CompiledEngine``: schedules per batch shape and run kind, slots, the step),
``keys`` (typed schedule and capture keys), ``executor`` (the one executor of a scheduled graph:
node by node or compiled regions), ``regions`` (splitting at memory nodes, the structural region
key, the compile cache), ``schedule`` (the readable listing, table and timeline).
"""
