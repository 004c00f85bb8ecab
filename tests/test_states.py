"""PatrickStar Table 1: where a chunk may live given its tensors' states."""

import pytest

from pscompile.hooks.states import ChunkPlacement, TensorState, chunk_placement, is_hold_like

S = TensorState

TABLE = [
    ([S.FREE, S.FREE], ChunkPlacement.RELEASABLE),
    ([S.FREE, S.COMPUTE], ChunkPlacement.COMPUTE_DEVICE),
    ([S.HOLD, S.COMPUTE, S.HOLD_AFTER_BWD], ChunkPlacement.COMPUTE_DEVICE),
    ([S.HOLD, S.FREE], ChunkPlacement.ANYWHERE),
    ([S.HOLD_AFTER_FWD], ChunkPlacement.ANYWHERE),
    ([S.HOLD_AFTER_BWD, S.HOLD_AFTER_FWD], ChunkPlacement.ANYWHERE),
]


@pytest.mark.parametrize("states,placement", TABLE)
def test_placement_rules(states, placement):
    assert chunk_placement(states) is placement


def test_hold_like():
    assert [s for s in S if is_hold_like(s)] == [S.HOLD, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD]
