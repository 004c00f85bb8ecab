"""ANGEL-PTM's unified scheduler (Algorithm 1) as the comparison planner, ``Config(planner="angel")``:
moves first (every later chunk fetched as soon as there is room), the last move taken back when a
node needs room. Its plans keep every invariant the default planner's do, at every budget, and
train to the same bits; Belady's demand fetching never fetches more."""

from __future__ import annotations

import random

import pytest
import torch

import pscompile
from pscompile.graph.pipeline import BudgetSweep
from pscompile.kinds import MemKind
from pscompile.passes.plan_residency import GradStore, plan_residency
from pscompile.passes.prefetch_fetches import prefetch_fetches
from pscompile.testing import tiny_model
from conftest import make_batches, make_model, same_state, snapshot
from test_plan_residency import CASES, SLOT, check


def _both(reads, nonmodel, budget, **kw):
    return tuple(plan_residency(reads, nonmodel, num_chunks=1 + max(c for r in reads for c in r), slot_bytes=SLOT,
                                budget=budget, policy=p, **kw) for p in ("belady", "angel"))


@pytest.mark.parametrize("reads,nonmodel,budget", CASES)
def test_angel_plans_satisfy_the_invariants(reads, nonmodel, budget):
    belady, angel = _both(reads, nonmodel, budget, stores={})
    check(angel, reads, nonmodel, budget)
    assert angel.peak_device_bytes <= budget and angel.policy == "angel"
    assert belady.num_fetches <= angel.num_fetches


def _random_case(rng: random.Random):
    """A forward over ``n`` chunks and the backward in reverse, some nodes reading two chunks, with
    a non-model curve rising to the turn; the gradients go into their chunks in the backward."""
    n = rng.randint(3, 7)
    fwd = [sorted({c, min(n - 1, c + 1)}) if rng.random() < 0.3 else [c] for c in range(n)]
    reads = fwd + [list(r) for r in reversed(fwd)]
    nonmodel = [rng.randint(0, 2) * 40 for _ in reads]
    stores = {n + k: [GradStore(c, f"p{c}", 0, 40)] for k, c in enumerate(reversed(range(n)))}
    return reads, nonmodel, stores, n


@pytest.mark.parametrize("seed", range(40))
def test_random_graphs_at_every_budget(seed):
    """At every budget from the least that fits up to one that holds everything, both policies'
    plans replay (every read resident, capacity held at every node, bytes as counted) and Belady
    never fetches more; ANGEL's fetches start no later than Belady's in order of first use."""
    rng = random.Random(seed)
    reads, nonmodel, stores, n = _random_case(rng)
    least = max(len(set(r)) * SLOT + max(nonmodel[i - 1] if i else 0, nonmodel[i]) for i, r in enumerate(reads))
    for budget in range(least, n * SLOT + max(nonmodel) + 1, 20):
        belady, angel = _both(reads, nonmodel, budget, stores=stores)
        for plan in (belady, angel):
            check(plan, reads, nonmodel, None)         # reads resident, slots, bytes (capacity below)
            assert _peak(plan, nonmodel) == plan.peak_device_bytes <= budget
            early = prefetch_fetches(plan, nonmodel, budget=budget)[0]
            check(early, reads, nonmodel, None)
        assert belady.num_fetches <= angel.num_fetches, budget


def _peak(plan, nonmodel) -> int:
    """The most bytes resident while any node runs: its chunks next to ``max(N[i-1], N[i])`` (the
    chunks for node i arrive while node i-1's data is live), replayed from the actions."""
    resident, peak = len(plan.initial), 0
    for i in range(plan.num_nodes):
        for a in plan.actions:
            if a.before == i:
                resident += (a.kind is MemKind.FETCH) - (a.kind is MemKind.DROP)
        peak = max(peak, resident * SLOT + max(nonmodel[i - 1] if i else 0, nonmodel[i]))
    return peak


def test_the_last_move_is_taken_back_when_a_node_needs_room():
    """Node 0 fetches chunk 0 and, ahead, chunks 1 and 2; node 1 has room for two chunks, so the
    last move (chunk 2, not read yet) is taken back: its fetch is cancelled, nothing moves, and it
    is fetched again where there is room."""
    reads, nonmodel = [[0], [1], [2], [0]], [0, 100, 0, 0]
    belady, angel = _both(reads, nonmodel, 300, stores={})
    check(angel, reads, nonmodel, None)
    assert _peak(angel, nonmodel) == angel.peak_device_bytes == 300
    fetches = [(a.chunk, a.before) for a in angel.actions if a.kind is MemKind.FETCH]
    assert fetches == [(0, 0), (1, 0), (2, 2)]
    assert [a.before for a in angel.actions if a.kind is MemKind.DROP and a.chunk == 2] == [len(reads)], \
        "a move taken back moves nothing (chunk 2 leaves at the end only)"
    assert [(a.chunk, a.before) for a in belady.actions if a.kind is MemKind.FETCH] == [(0, 0), (1, 1), (2, 2)]
    ahead = [a for a in angel.actions if a.chunk == 1 and a.kind in (MemKind.FETCH, MemKind.WAIT)]
    assert [(a.kind, a.before, a.asynchronous) for a in ahead] == [(MemKind.FETCH, 0, True), (MemKind.WAIT, 1, False)], \
        "a chunk fetched ahead is waited for before its reader, not before the node that fetched it"


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy='lru'"):
        plan_residency([[0]], [0], stores={}, num_chunks=1, slot_bytes=SLOT, budget=None, policy="lru")


@pytest.mark.parametrize("arch", ["gpt", "bert", "llama"])
def test_every_budget_from_the_minimum_verifies_with_angel(arch):
    """The engine's layout and schedule with ``planner="angel"`` at budgets from the minimum to
    twice it; ``build_schedule`` runs ``verify_schedule``, so a broken schedule raises."""
    pytest.importorskip("transformers") if arch == "llama" else None
    model, batch = tiny_model(arch)
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32, planner="angel")
    minimum = pscompile.min_device_memory(model, batch, config)
    sweep = BudgetSweep(model, batch, config)
    for budget in sorted({minimum + 4096 * k for k in range(4)} | {int(minimum * (1 + 0.1 * k)) for k in range(11)}):
        sched = sweep.plan(budget)
        assert sched.plan.policy == "angel" and sched.plan.peak_device_bytes <= budget
    with pytest.raises(pscompile.BudgetError):
        sweep.plan(minimum - 1)


def _train(planner: str, budget: int | None, steps: int):
    batches = make_batches("gpt", steps)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=pscompile.AdamW(lr=1e-3, max_grad_norm=1.0),
                               config=pscompile.Config(mode="compiled", backend="eager", device="cpu",
                                                       dtype=torch.float32, device_memory=budget, planner=planner))
    losses, moved = [], []
    for b in batches:
        losses.append(engine.step(b))          # moved != planned raises inside the step
        moved.append(engine.stats.bytes_moved)
        assert budget is None or engine.stats.peak_device_bytes <= budget
    state = snapshot(engine)
    engine.close()
    return losses, moved, state


def test_angel_trains_to_the_bits_of_belady_and_moves_no_less(monkeypatch):
    """Where chunks move changes nothing the step computes: at a budget tight enough to evict on
    every step, the losses and the weights and optimizer states after 4 steps are the same bits
    with either planner, and Belady moves no more bytes per step. (Both engines weigh activations
    with the same rates, as one machine measures them when it is not busy.)"""
    from pscompile.compiled import engine as compiled_engine
    from pscompile.memory.rates import Rates
    monkeypatch.setattr(compiled_engine, "measure_rates", lambda *a, **k: Rates(1e10, 1e8))
    model, batch = make_model("gpt"), make_batches("gpt", 1)[0]
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32)
    budget = int(pscompile.min_device_memory(model, batch, config) * 1.1)
    runs = {p: _train(p, budget, 4) for p in ("belady", "angel")}
    (lb, mb, sb), (la, ma, sa) = runs["belady"], runs["angel"]
    assert la == lb
    assert same_state(sa, sb)
    assert all(b <= a for a, b in zip(ma[1:], mb[1:])), (ma, mb)    # after the measuring step
    assert sum(mb[1:]) > 0
