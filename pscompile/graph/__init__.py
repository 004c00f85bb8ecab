"""Graph layer: the captured iteration and the compiler pipeline over it.

``capture`` (forward + loss + backward as one FX graph), ``ops`` (the ``pscompile::`` memory ops
and their ``MemOp`` records), ``meta`` (pscompile's node metadata) and ``pipeline`` (the passes of
``passes/`` in order, from a captured graph, a layout, a budget and a non-model curve to a
schedule; no engine, no real tensors).
"""
