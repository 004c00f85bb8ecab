"""Memory layer: where model data lives and how it moves.

``layout`` (the frozen chunk layout), ``tiers`` (tiers, slot pools, the counted link),
``transfers`` (the background copy queue), ``store`` (the chunk lists of one model and where each
chunk is now), ``tracker`` (measured non-model memory), ``belady`` (farthest-next-use eviction,
shared by both modes). Nothing here knows about graphs or engines.
"""
