"""Hooks mode: PatrickStar's runtime design on pscompile's chunks.

``engine`` (``HooksEngine``: module and autograd hooks, the warm-up trace, eviction at run time),
``access_plan`` (the recorded moments of one iteration), ``states`` (the paper's tensor states).
"""
