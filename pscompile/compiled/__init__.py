"""Compiled mode: the engine that runs scheduled graphs. Its modules:

- ``engine`` (``CompiledEngine``: schedules per batch shape and run kind, slots, the step), built
  on ``state`` (its tables), ``planning`` (capture and plan), ``lowering`` (a schedule's life:
  measured, compiled, checked, planned again) and ``moves`` (the memory nodes performed);
- ``capture_life`` (what each capture has learned, and the one table of events that change it),
  ``keys`` (typed schedule and capture keys), ``ranges`` (a batch's dynamic sizes and their bound),
  ``trust`` (whether a checkpoint's measurements are planned with);
- ``whole`` (the schedule as one Inductor program, memory nodes inside), ``buffer_plan``
  (Inductor's buffers around each memory node), ``program_store`` (programs kept for later
  processes), ``choice_store`` (layout and activation choices kept for later processes);
- ``executor`` (node by node, or eager regions: compiled eager), ``steps`` (the steps it runs),
  ``regions`` (splitting at memory nodes);
- ``schedule`` and ``listing`` (the readable listing, table and timeline).
"""
