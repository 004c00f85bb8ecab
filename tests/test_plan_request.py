"""The one planning entry point: ``PlanRequest``, the scheduling passes run from a list with their
provenance, and the explicit checkpoint name of a capture. Planned on the meta device (no engine,
no compile)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pscompile
from conftest import make_batches
from pscompile.compiled.keys import ScheduleKey
from pscompile.errors import ScheduleError
from pscompile.graph.analysis import DeviceMemory
from pscompile.graph.ops import is_memory_node
from pscompile.graph.pipeline import SCHEDULE_PASSES, PlanRequest, SchedulePass, build_schedule, plan_at_budget, \
    plan_inputs
from pscompile.graph.schedule_passes import ScheduleState
from pscompile.kinds import Activations, Policy, RunKind
from pscompile.models.gpt import GPT, gpt_config


def _planned(budget_factor: float = 1.3):
    batch = make_batches("gpt", 1)[0]
    config = pscompile.Config(dtype=torch.float32, activations="keep")
    with torch.device("meta"):
        model = GPT(gpt_config("gpt-tiny"))
    layout, analyzed = plan_inputs(model, batch, config)
    least = pscompile.min_device_memory(GPT(gpt_config("gpt-tiny")), batch, config)
    return analyzed, layout, int(least * budget_factor)


def test_a_request_holds_its_choices_as_members_and_is_hashable():
    r = PlanRequest(1 << 20, torch.float32, kind="accum", activations="offload", planner="angel", start={3: 1, 0: 0})
    assert r.kind is RunKind.ACCUM and r.activations is Activations.OFFLOAD and r.planner is Policy.ANGEL
    assert r.start == ((0, 0), (3, 1)) and r.start_slots == {0: 0, 3: 1}
    assert hash(r) == hash(dataclasses.replace(r))
    with pytest.raises(ValueError):
        PlanRequest(None, torch.float32, kind="backward")
    cfg = pscompile.Config(dtype=torch.float32, collectives="per_chunk", planner="angel")
    assert PlanRequest.for_config(cfg, budget=5, world=2).per_chunk
    assert not PlanRequest.for_config(cfg, budget=5, world=1).per_chunk      # one rank: nothing to gather
    assert PlanRequest.for_config(cfg, budget=5).planner is Policy.ANGEL


def test_every_pass_that_ran_is_stamped_in_order_with_its_summary():
    analyzed, layout, budget = _planned()
    sched = plan_at_budget(analyzed, layout, PlanRequest(budget, torch.float32))
    names = [t.name for t in sched.passes]
    assert names[:3] == ["capture_joint", "annotate_params", "estimate_nonmodel"]
    # a training step without lookahead: no gradient overlap, no lookahead
    assert names[3:] == ["plan_residency", "early_drops", "prefetch_fetches", "insert_memory_ops", "verify_schedule"]
    assert all(t.seconds >= 0 and t.summary for t in sched.passes)
    count = sum(1 for n in sched.gm.graph.nodes if is_memory_node(n))
    assert f"{count} memory nodes" in sched.passes[-2].summary and f"{count} memory nodes ok" in sched.passes[-1].summary
    assert sched.request == PlanRequest(budget, torch.float32)
    only = plan_at_budget(analyzed, layout, PlanRequest(budget, torch.float32, plan_only=True, lookahead=True))
    assert only.gm is None and [t.name for t in only.passes][3:] == ["plan_residency", "early_drops",
                                                                     "prefetch_fetches", "plan_lookahead"]


def test_a_pass_added_to_the_list_runs_in_its_place_and_the_verifier_catches_what_it_breaks():
    """A pass between ``insert_memory_ops`` and ``verify_schedule`` that deletes the graph's first
    wait: the list runs it where it stands, and the verifier (after it) refuses the schedule."""
    analyzed, layout, budget = _planned()
    request = PlanRequest(budget, torch.float32)
    device = DeviceMemory(budget, layout.chunk_size * 4)      # float32 slots, no optimizer state on the device

    def drop_first_wait(inputs, state: ScheduleState):
        gm = state.gm
        wait = next(n for n in gm.graph.nodes if is_memory_node(n) and n.name.startswith("wait"))
        for user in list(wait.users):
            user.replace_input_with(wait, wait.args[0])
        gm.graph.erase_node(wait)
        gm.recompile()
        return state, f"dropped {wait.name}"
    names = [p.name for p in SCHEDULE_PASSES]
    broken = list(SCHEDULE_PASSES)
    broken.insert(names.index("verify_schedule"), SchedulePass("drop_first_wait", drop_first_wait))
    with pytest.raises(ScheduleError, match="verify_schedule: node"):
        build_schedule(analyzed, layout, request, nonmodel=analyzed.nonmodel, memory=device, passes=broken)
    # the same list with the breaking pass told not to apply: planned and verified
    skipped = [dataclasses.replace(p, applies=lambda r: False) if p.name == "drop_first_wait" else p for p in broken]
    ok = build_schedule(analyzed, layout, request, nonmodel=analyzed.nonmodel, memory=device, passes=skipped)
    assert [t.name for t in ok.passes][-2:] == ["insert_memory_ops", "verify_schedule"]


def test_a_capture_is_checkpointed_under_an_explicit_stable_name():
    a, b = make_batches("gpt", 2)
    key = ScheduleKey.of(a, RunKind.TRAIN, True).capture
    assert key.token == ScheduleKey.of(b, RunKind.ACCUM, True).capture.token     # same shapes: one capture
    assert key.token.startswith("fwd+bwd/train|") and "int64" in key.token
    assert ScheduleKey.of(a, RunKind.EVAL, True).capture.token.startswith("fwd/train|")
    assert ScheduleKey.of(a, RunKind.TRAIN, False).capture.token != key.token
    shorter = {k: v[:, :-1] if isinstance(v, torch.Tensor) else v for k, v in a.items()} if isinstance(a, dict) \
        else tuple(v[:, :-1] for v in a)
    assert ScheduleKey.of(shorter, RunKind.TRAIN, True).capture.token != key.token
