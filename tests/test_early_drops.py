"""passes/early_drops.py: a drop moves up to just after its chunk's last read, never past an
action on its slot or chunk; in a real schedule every drop sits there (tiny GPT, float32, a
budget that evicts; ~5 s)."""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.graph.analysis import node_reads
from pscompile.kinds import MemKind
from pscompile.passes.early_drops import early_drops
from pscompile.passes.plan_residency import Action, ResidencyPlan
from conftest import make_batches, make_model


def _plan(*actions: Action, num_nodes: int = 8) -> ResidencyPlan:
    return ResidencyPlan(actions=actions, num_nodes=num_nodes, num_slots=2, initial=(), final=(), slot_bytes=64,
                         peak_device_bytes=0, peak_node=0, h2d_bytes=0, d2h_bytes=0, num_fetches=0, num_evictions=0)


def test_a_drop_moves_up_to_the_last_read_and_no_further():
    fetch = Action(0, MemKind.FETCH, 0, 0, 64)
    other = Action(4, MemKind.FETCH, 1, 1, 64)                # another slot: no bound
    drop = Action(6, MemKind.DROP, 0, 0, 0)
    reads = [[0], [0], [0, 1], [], [1], [1], [1], []]          # chunk 0 last read by node 2
    plan, moved = early_drops(_plan(fetch, other, drop), reads)
    assert moved == 1
    assert [(a.kind, a.before) for a in plan.actions] == [(MemKind.FETCH, 0), (MemKind.DROP, 3), (MemKind.FETCH, 4)]


def test_a_drop_stays_after_its_writeback_and_where_it_already_is():
    wb = Action(5, MemKind.WRITEBACK, 0, 0, 64)
    drop = Action(6, MemKind.DROP, 0, 0, 0)
    reads = [[0], [0], [], [], [], [], [], []]
    plan, moved = early_drops(_plan(wb, drop), reads)
    assert moved == 1 and plan.actions[1].before == 5 and plan.actions[0] is wb
    same, none = early_drops(plan, reads)
    assert none == 0 and same is plan


@pytest.fixture(scope="module")
def tight():
    model, batch = make_model("gpt"), make_batches("gpt", 1)[0]
    cfg = dict(mode="compiled", backend="eager", device="cpu", dtype=torch.float32)
    least = pscompile.min_device_memory(model, batch, pscompile.Config(**cfg))
    engine = pscompile.compile(model, batch, config=pscompile.Config(**cfg, device_memory=least))
    engine.step(batch)
    yield engine
    engine.close()


def test_every_drop_of_a_schedule_follows_its_chunks_last_read(tight):
    """At the minimum the plan evicts; each drop comes right after the last node that reads its
    chunk, or after a later action on its slot or chunk (the pass removed, drops sit where their
    slot is next needed and this fails)."""
    s = tight.schedule
    reads = node_reads(s.captured, tight.layout)
    drops = 0
    for k, a in enumerate(s.plan.actions):
        if a.kind != MemKind.DROP:
            continue
        last = max((i for i in range(a.before) if a.chunk in reads[i]), default=-1)
        floor = max([last + 1] + [b.before for b in s.plan.actions[:k]
                                  if b.chunk == a.chunk or b.slot == a.slot])
        assert a.before == floor, f"drop of chunk {a.chunk} before node {a.before}; its chunk is done at {floor}"
        drops += 1
    assert drops > 0, "the budget evicts nothing"
