"""plan_residency on small tables of uses, all fed to one invariant checker (tinygrad style)."""

from __future__ import annotations

import itertools

import pytest

from pscompile.passes.plan_residency import GradStore, ResidencyError, plan_residency

SLOT = 100


def check(plan, reads, nonmodel, budget, os_device_chunks=frozenset(), os_bytes=0, final=None):
    """Replay the actions: every read is resident, slots never double-booked, capacity holds at
    every node, counts add up, the end state is what the optimizer expects."""
    resident = dict(plan.initial)
    dirty = set()
    by_node = {}
    for a in plan.actions:
        by_node.setdefault(a.before, []).append(a)
    h2d = d2h = 0
    T = len(reads)
    for i in range(T + 1):
        for a in by_node.get(i, []):
            if a.kind == "fetch":
                assert a.chunk not in resident and a.slot not in resident.values()
                resident[a.chunk] = a.slot
                h2d += a.nbytes
            elif a.kind == "writeback":
                assert resident[a.chunk] == a.slot and a.chunk in dirty
                dirty.discard(a.chunk)
                d2h += a.nbytes
            elif a.kind == "drop":
                assert resident.pop(a.chunk) == a.slot
                assert a.chunk not in dirty, "dropped a chunk with unsaved gradients"
            elif a.kind == "accumulate_grad":
                assert a.slot is None
                d2h += a.nbytes
            elif a.kind == "store_grad":
                if a.slot is None:
                    assert a.chunk not in resident
                    d2h += a.nbytes
                else:
                    assert resident[a.chunk] == a.slot
                    dirty.add(a.chunk)
        if i == T:
            break
        for c in reads[i]:
            assert c in resident, f"node {i} reads chunk {c} which is not on the device"
        if budget is not None:
            nxt = nonmodel[i + 1] if i + 1 < T else 0
            assert len(resident) * SLOT + os_bytes + max(nonmodel[i], nxt) <= budget
    if final is None:
        assert set(resident) == set(os_device_chunks)
    elif final == "any":
        assert set(os_device_chunks) <= set(resident)
    else:
        assert resident == dict(final) and set(os_device_chunks) <= set(resident)
    assert dict(plan.final) == resident
    assert not (dirty - set(os_device_chunks))
    assert (h2d, d2h) == (plan.h2d_bytes, plan.d2h_bytes)
    return plan


CASES = [
    # (reads per node, nonmodel per node, budget)
    ([[0], [1], [2], [0], [1], [2]], [0] * 6, 300),
    ([[0], [1], [2], [0], [1], [2]], [0] * 6, 200),
    ([[0], [1], [2], [3], [2], [1], [0]], [50] * 7, 250),
    ([[0, 1], [2], [1, 2], [0], [3], [0, 3]], [10, 20, 30, 40, 50, 60], 260),
    ([[0], [1], [0], [2], [0], [3], [0]], [0] * 7, 200),
    ([[c] for c in (0, 1, 2, 3, 4, 0, 1, 2, 3, 4)], [90] * 10, 290),
]


@pytest.mark.parametrize("reads,nonmodel,budget", CASES)
def test_plans_satisfy_invariants(reads, nonmodel, budget):
    plan = plan_residency(reads, nonmodel, stores={}, num_chunks=5, slot_bytes=SLOT, budget=budget)
    check(plan, reads, nonmodel, budget)
    assert plan.peak_device_bytes <= budget


def _brute_force_min_fetches(reads, k):
    """Fewest fetches with at most k resident chunks (exhaustive over eviction choices)."""
    best = [float("inf")]

    def go(i, resident, fetches):
        if fetches >= best[0]:
            return
        if i == len(reads):
            best[0] = fetches
            return
        need = set(reads[i])
        missing = need - resident
        if not missing:
            return go(i + 1, resident, fetches)
        spare = k - len(resident)
        if spare >= len(missing):
            return go(i + 1, resident | missing, fetches + len(missing))
        drop_n = len(missing) - spare
        for victims in itertools.combinations(sorted(resident - need), drop_n):
            go(i + 1, (resident - set(victims)) | missing, fetches + len(missing))

    go(0, frozenset(), 0)
    return best[0]


@pytest.mark.parametrize("seq", [
    [0, 1, 2, 0, 3, 1, 0, 2, 3, 1],
    [0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4],
    [3, 2, 1, 0, 1, 2, 3, 0, 2, 1],
])
def test_belady_is_optimal_for_single_reads(seq):
    reads = [[c] for c in seq]
    plan = plan_residency(reads, [0] * len(reads), stores={}, num_chunks=5, slot_bytes=SLOT, budget=2 * SLOT)
    check(plan, reads, [0] * len(reads), 2 * SLOT)
    assert plan.num_fetches == _brute_force_min_fetches(reads, 2)


def test_clean_chunks_are_evicted_for_free_and_gradients_go_home():
    reads = [[0], [1], [2], [2], [1], [0]]
    stores = {3: [GradStore(2, "c", 0, 40)], 4: [GradStore(1, "b", 0, 40)], 5: [GradStore(0, "a", 0, 40)]}
    plan = plan_residency(reads, [0] * 6, stores=stores, num_chunks=3, slot_bytes=SLOT, budget=2 * SLOT)
    check(plan, reads, [0] * 6, 2 * SLOT)
    kinds = [a.kind for a in plan.actions]
    assert "writeback" in kinds
    # forward evictions are of clean chunks: no writeback before the first gradient exists
    first_store = kinds.index("store_grad")
    assert "writeback" not in kinds[:first_store]


def test_device_optimizer_chunks_stay_resident():
    reads = [[0], [1], [0], [1]]
    plan = plan_residency(reads, [0] * 4, stores={2: [GradStore(0, "a", 0, 8)]}, num_chunks=2, slot_bytes=SLOT,
                          budget=1000, os_device_chunks=frozenset({0, 1}), os_device_bytes=600)
    check(plan, reads, [0] * 4, 1000, frozenset({0, 1}), 600)
    assert plan.num_fetches == 0 and plan.h2d_bytes == 0


def test_too_small_budget_names_the_node():
    reads = [[0], [0, 1, 2], [1]]
    with pytest.raises(ResidencyError, match="op-1") as info:
        plan_residency(reads, [0, 50, 0], stores={}, num_chunks=3, slot_bytes=SLOT, budget=300,
                       describe_node=lambda i: f"op-{i}")
    assert info.value.node == 1 and info.value.minimum == 350


def test_unlimited_budget_fetches_each_chunk_once():
    reads = [[0], [1], [0], [1], [2]]
    plan = plan_residency(reads, [0] * 5, stores={}, num_chunks=3, slot_bytes=SLOT, budget=None)
    check(plan, reads, [0] * 5, None)
    assert plan.num_fetches == 3


def test_prefetch_moves_fetches_earlier_within_capacity():
    from pscompile.passes.prefetch_fetches import prefetch_fetches
    reads = [[0], [], [], [1], [], [], [2], [], [0]]
    nonmodel = [0] * len(reads)
    plan = plan_residency(reads, nonmodel, stores={}, num_chunks=3, slot_bytes=SLOT, budget=2 * SLOT)
    early, report = prefetch_fetches(plan, nonmodel, budget=2 * SLOT)
    assert report.moved >= 1
    # same invariants, with waits: replay counting a prefetched chunk as resident from its fetch
    check(dataclasses_replace_without_waits(early), reads, nonmodel, 2 * SLOT)
    fetch_1 = next(a for a in early.actions if a.kind == "fetch" and a.chunk == 1)
    assert fetch_1.before < 3
    assert any(a.kind == "wait" and a.chunk == 1 and a.before == 3 for a in early.actions)


def test_prefetch_respects_a_full_device():
    from pscompile.passes.prefetch_fetches import prefetch_fetches
    reads = [[0], [0], [0], [1]]
    nonmodel = [0] * 4
    plan = plan_residency(reads, nonmodel, stores={}, num_chunks=2, slot_bytes=SLOT, budget=SLOT)
    early, report = prefetch_fetches(plan, nonmodel, budget=SLOT)
    assert report.moved == 0                          # chunk 0 holds the only slot until node 3


def dataclasses_replace_without_waits(plan):
    import dataclasses
    return dataclasses.replace(plan, actions=tuple(a for a in plan.actions if a.kind != "wait"))


WARM_READS = [[0], [1], [2], [3], [3], [2], [1], [0]]          # forward then backward, like a model


@pytest.mark.parametrize("budget", [200, 300, None])
def test_warm_runs_keep_clean_chunks_and_repeat(budget):
    """A loop of runs that update nothing (micro-batches, evaluations): the cold run leaves clean
    chunks resident, chosen by their first use in the next run; the warm plan starts from that
    residency and ends with it again, so it repeats, and moves no more than the cold one."""
    nonmodel = [0] * len(WARM_READS)
    cold = check(plan_residency(WARM_READS, nonmodel, stores={}, num_chunks=4, slot_bytes=SLOT, budget=budget,
                                keep_at_end=True), WARM_READS, nonmodel, budget, final="any")
    assert cold.final and all(a.kind != "writeback" for a in cold.actions)
    start = dict(cold.final)
    warm = plan_residency(WARM_READS, nonmodel, stores={}, num_chunks=4, slot_bytes=SLOT, budget=budget,
                          start=start, keep_at_end=True, end=start)
    check(warm, WARM_READS, nonmodel, budget, final=start)
    assert dict(warm.initial) == start
    assert warm.h2d_bytes <= cold.h2d_bytes
    if budget is None:
        assert warm.h2d_bytes == 0
    # the chunks kept are the ones the next run needs first (cyclic Belady): chunk 0 first
    assert 0 in start
    # four runs (cold + 3 warm) fetch exactly what Belady over the four runs as one sequence does
    once = plan_residency(WARM_READS * 4, nonmodel * 4, stores={}, num_chunks=4, slot_bytes=SLOT, budget=budget)
    assert cold.num_fetches + 3 * warm.num_fetches == once.num_fetches


def test_accumulation_adds_gradients_on_the_host_and_dirties_nothing():
    reads = [[0], [1], [1], [0]]
    stores = {2: [GradStore(1, "b", 0, 40)], 3: [GradStore(0, "a", 0, 40)]}
    plan = plan_residency(reads, [0] * 4, stores=stores, num_chunks=2, slot_bytes=SLOT, budget=200,
                          accumulate=True, keep_at_end=True)
    check(plan, reads, [0] * 4, 200, final="any")
    kinds = [a.kind for a in plan.actions]
    assert kinds.count("accumulate_grad") == 2 and "store_grad" not in kinds and "writeback" not in kinds
    assert plan.d2h_bytes == 80 and dict(plan.final) == {0: 0, 1: 1}


def test_a_chunk_goes_home_right_after_its_last_gradient_and_stays_resident():
    """A host-updated chunk whose gradients are complete is written back at once (while the
    backward goes on) and evicted later for free; a chunk still waiting for a gradient is not.
    The bytes are those of one writeback per dirty chunk, as before."""
    reads = [[0], [1], [1], [0], [0]]
    stores = {1: [GradStore(1, "b", 0, 40)], 2: [GradStore(1, "c", 40, 40)], 3: [GradStore(0, "a", 0, 40)]}
    plan = plan_residency(reads, [0] * 5, stores=stores, num_chunks=2, slot_bytes=SLOT, budget=None)
    check(plan, reads, [0] * 5, None)
    writebacks = [(a.before, a.chunk) for a in plan.actions if a.kind == "writeback"]
    assert writebacks == [(3, 1), (4, 0)]        # chunk 1 after its second gradient, not at the end
    drops = [(a.before, a.chunk) for a in plan.actions if a.kind == "drop"]
    assert drops == [(5, 0), (5, 1)]             # both stay until the end, clean
    assert plan.d2h_bytes == 2 * SLOT
    # a chunk whose optimizer states live on the device is updated there: never written back
    plan = plan_residency(reads, [0] * 5, stores=stores, num_chunks=2, slot_bytes=SLOT, budget=None,
                          os_device_chunks=frozenset({1}))
    assert [a.chunk for a in plan.actions if a.kind == "writeback"] == [0]
