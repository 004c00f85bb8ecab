"""One rank's ZeRO schedule, planned without a process group (meta-device models), at every budget
from the minimum up, and verify_schedule's collective invariants: each broken on purpose (and two
of one rank's: a fetch never waited for, a drop before its fetch's wait)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pscompile
from pscompile.errors import BudgetError, ScheduleError
from pscompile.graph import meta as gmeta
from pscompile.graph.minimum import minimum_budget
from pscompile.graph.pipeline import PlanRequest, plan_at_budget, plan_inputs
from pscompile.graph.ops import is_memory_node
from pscompile.kinds import MemKind, RunKind
from pscompile.models.bert import BertMLM, bert_config
from pscompile.models.gpt import GPT, gpt_config
from pscompile.passes.verify_schedule import verify_schedule
from conftest import make_batches

MODELS = {"gpt": (GPT, gpt_config("gpt-tiny")), "bert": (BertMLM, bert_config("bert-tiny"))}
WORLD = 2


def _inputs(kind, world=WORLD, kind_run=RunKind.TRAIN):
    cls, cfg = MODELS[kind]
    with torch.device("meta"):
        model = cls(cfg)
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32)
    return plan_inputs(model, make_batches(kind, 1)[0], config, world=world, kind=kind_run)


def _check(sched, layout, budget):
    plan = sched.plan
    kinds = [a.kind for a in plan.actions]
    assert MemKind.FETCH not in kinds and MemKind.DROP not in kinds and MemKind.WRITEBACK not in kinds
    grads = {c for f in sched.captured.grad_fqns for c in layout.entry(f).chunks}
    reduced = [a.chunk for a in plan.actions if a.kind == MemKind.REDUCE_SCATTER]
    assert sorted(reduced) == sorted(grads), "every group with gradients reduce-scattered exactly once"
    shard = layout.chunk_size * 4 // WORLD
    gathers = kinds.count(MemKind.ALLGATHER)
    assert plan.allgather_bytes == gathers * shard * (WORLD - 1)
    assert plan.h2d_bytes == gathers * shard            # only this rank's shard crosses its link
    assert plan.d2h_bytes == len(reduced) * shard
    assert kinds.count(MemKind.RELEASE_REMOTE) == gathers   # every gather released
    if budget is not None:
        assert plan.peak_device_bytes <= budget


@pytest.mark.parametrize("planner", ["belady", "angel"])
@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_every_budget_from_the_minimum_up_plans_and_verifies(kind, planner):
    layout, analyzed = _inputs(kind)
    slot = layout.chunk_size * 4
    least = minimum_budget(analyzed, layout, nonmodel=analyzed.nonmodel, slot_bytes=slot, world=WORLD).nbytes
    with pytest.raises(BudgetError):
        plan_at_budget(analyzed, layout, PlanRequest(budget=least - 1, dtype=torch.float32, world=WORLD, planner=planner))
    releases_seen = 0
    for budget in [least + k * slot // 3 for k in range(0, 3 * layout.num_chunks + 2)] + [None]:
        sched = plan_at_budget(analyzed, layout, PlanRequest(budget=budget, dtype=torch.float32, world=WORLD, planner=planner))
        assert sched.plan.policy == planner
        _check(sched, layout, budget)
        releases_seen += sum(a.kind == MemKind.RELEASE_REMOTE and a.before < sched.plan.num_nodes
                             for a in sched.plan.actions)
    assert releases_seen > 0, "tight budgets release groups mid-iteration (and gather them again)"


def test_the_minimum_counts_groups_held_for_their_gradients():
    layout, analyzed = _inputs("gpt")
    slot = layout.chunk_size * 4
    held = minimum_budget(analyzed, layout, nonmodel=analyzed.nonmodel, slot_bytes=slot, world=WORLD)
    free = minimum_budget(analyzed, layout, nonmodel=analyzed.nonmodel, slot_bytes=slot, world=1)
    assert held.nbytes >= free.nbytes
    assert held.chunks >= free.chunks


def test_accumulation_reduce_scatters_into_the_fp32_shards():
    layout, analyzed = _inputs("gpt", kind_run=RunKind.ACCUM)
    sched = plan_at_budget(analyzed, layout, PlanRequest(budget=None, dtype=torch.float32, kind=RunKind.ACCUM, world=WORLD))
    rs = [a for a in sched.plan.actions if a.kind == MemKind.REDUCE_SCATTER]
    assert rs and all(a.to_acc for a in rs)
    assert not any(a.kind == MemKind.ACCUMULATE_GRAD for a in sched.plan.actions)


def _verify(sched, layout, gm):
    return verify_schedule(gm, layout, slot_bytes=layout.chunk_size * 4, budget=None,
                           initial=dict(sched.plan.initial), world=WORLD, grad_fqns=sched.captured.grad_fqns)


def _memory_nodes(gm, kind):
    return [n for n in gm.graph.nodes if is_memory_node(n) and gmeta.get(n, "mem").kind == kind]


@pytest.fixture
def planned():
    layout, analyzed = _inputs("gpt")
    sched = plan_at_budget(analyzed, layout, PlanRequest(budget=None, dtype=torch.float32, world=WORLD))
    _verify(sched, layout, sched.gm)           # the real schedule passes
    return sched, layout


def test_verify_catches_a_group_never_reduced(planned):
    sched, layout = planned
    node = _memory_nodes(sched.gm, MemKind.REDUCE_SCATTER)[0]
    sched.gm.graph.erase_node(node)
    with pytest.raises(ScheduleError, match="loses gradients|never reduced"):
        _verify(sched, layout, sched.gm)


def test_verify_catches_a_group_reduced_twice(planned):
    sched, layout = planned
    node = _memory_nodes(sched.gm, MemKind.REDUCE_SCATTER)[0]
    with sched.gm.graph.inserting_after(node):
        twin = sched.gm.graph.call_function(node.target, node.args)
    twin.meta.update(node.meta)
    with pytest.raises(ScheduleError, match="twice"):
        _verify(sched, layout, sched.gm)


def test_verify_catches_a_read_after_release(planned):
    sched, layout = planned
    gm = sched.gm
    release = _memory_nodes(gm, MemKind.RELEASE_REMOTE)
    gathers = _memory_nodes(gm, MemKind.ALLGATHER)
    # release the first gathered group as soon as it has landed, before anything reads it
    first = gathers[0]
    mine = next(n for n in release if gmeta.get(n, "mem").chunk == gmeta.get(first, "mem").chunk)
    chunk = gmeta.get(first, "mem").chunk
    after = next((n for n in _memory_nodes(gm, MemKind.WAIT) if gmeta.get(n, "mem").chunk == chunk), first)
    with gm.graph.inserting_after(after):
        early = gm.graph.call_function(mine.target, mine.args)
    early.meta.update(mine.meta)
    gm.graph.erase_node(mine)
    with pytest.raises(ScheduleError, match="reads .* from slot"):
        _verify(sched, layout, gm)


def test_verify_catches_a_plain_fetch_in_a_sharded_schedule(planned):
    sched, layout = planned
    node = _memory_nodes(sched.gm, MemKind.ALLGATHER)[0]
    gmeta.put(node, "mem", dataclasses.replace(gmeta.get(node, "mem"), kind=MemKind.FETCH))
    with pytest.raises(ScheduleError, match="chunks arrive by allgather"):
        _verify(sched, layout, sched.gm)


@pytest.fixture
def one_rank():
    """A one-rank schedule that fetches asynchronously (a budget 1.2x its minimum)."""
    layout, analyzed = _inputs("gpt", world=1)
    least = minimum_budget(analyzed, layout, nonmodel=analyzed.nonmodel, slot_bytes=layout.chunk_size * 4).nbytes
    sched = plan_at_budget(analyzed, layout, PlanRequest(budget=int(least * 1.2), dtype=torch.float32))
    verify = lambda: verify_schedule(sched.gm, layout, slot_bytes=layout.chunk_size * 4,   # noqa: E731
                                     budget=int(least * 1.2), initial=dict(sched.plan.initial),
                                     grad_fqns=sched.captured.grad_fqns)
    verify()                                   # the real schedule passes
    return sched.gm, verify


def _slot_waits(gm):
    return [n for n in _memory_nodes(gm, MemKind.WAIT) if gmeta.get(n, "mem").slot is not None]


def test_verify_catches_a_fetch_never_waited_for(one_rank):
    gm, verify = one_rank
    gm.graph.erase_node(_slot_waits(gm)[-1])
    with pytest.raises(ScheduleError, match="before the wait for its asynchronous fetch|never waited for"):
        verify()


def test_verify_catches_a_drop_before_its_fetch_is_waited_for(one_rank):
    """A drop between a fetch and its wait: on a GPU the slot would go back while the copy still
    writes it."""
    gm, verify = one_rank
    drop = _memory_nodes(gm, MemKind.DROP)[0]
    chunk = gmeta.get(drop, "mem").chunk
    fetch = next(n for n in _memory_nodes(gm, MemKind.FETCH) if gmeta.get(n, "mem").chunk == chunk
                 and gmeta.get(n, "mem").asynchronous)
    with gm.graph.inserting_after(fetch):
        early = gm.graph.call_function(drop.target, drop.args)
    early.meta.update(drop.meta)
    with pytest.raises(ScheduleError, match=f"drop of chunk {chunk} from slot .* before the wait for its fetch"):
        verify()
