"""Compiled mode: the engine that runs scheduled graphs.

``engine`` (``CompiledEngine``: schedules per batch shape and run kind, slots, the step),
``keys`` (typed schedule and capture keys), ``lowering`` (a schedule's life: measured, compiled,
checked, planned again), ``whole`` (the schedule as one Inductor program, memory nodes inside),
``executor`` (node by node, or eager regions: compiled eager), ``regions`` (splitting at memory
nodes), ``schedule`` (the readable listing, table and timeline).
"""
