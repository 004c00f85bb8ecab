"""memory/belady.py: the one eviction rule of both modes, as small tables of uses."""

from pscompile.hooks.access_plan import AccessPlan, Moment
from pscompile.memory.belady import NextUse, farthest

USES = [(0,), (1,), (2,), (0,), (1,), ()]       # chunk ids used at steps 0..5


def test_next_use_at_or_after():
    nu = NextUse(USES)
    assert nu.at_or_after(0, 0, cyclic=False) == 0
    assert nu.at_or_after(0, 1, cyclic=False) == 3
    assert nu.at_or_after(2, 3, cyclic=False) == float("inf")
    assert nu.at_or_after(2, 3, cyclic=True) == 6 + 2        # its first use in the next iteration
    assert nu.at_or_after(7, 0, cyclic=True) == float("inf")  # never used


def test_farthest_prefers_the_farthest_then_clean_then_higher_id():
    nu = NextUse(USES)
    assert farthest([0, 1, 2], nu, 3, cyclic=False) == 2            # 2 is never used again
    assert farthest([0, 1], nu, 5, cyclic=False) == 1               # both inf: the higher id
    assert farthest([0, 1], nu, 5, cyclic=False, dirty={1}) == 0    # ... unless it is dirty
    assert farthest([0, 1, 2], nu, 3, cyclic=True) == 2             # 0 -> 3, 1 -> 4, 2 -> 8


def test_hooks_access_plan_uses_the_same_rule():
    m = lambda *need: Moment("fwd", "x", need, 0, 0)  # noqa: E731
    plan = AccessPlan(tuple(m(*u) for u in USES))
    # after moment 4 chunks 0 and 2 are next used at 6+0=6 and 6+2=8 (cyclic)
    assert plan.farthest([0, 2], 4) == 2
    assert plan.farthest([5, 6], 4) == 6 and plan.farthest([5, 6], 4, dirty={6}) == 5
