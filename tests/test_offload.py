"""Activation offloading in compiled mode (``passes/offload_activations.py``, ``Config.activations``).

- the rewritten graph computes exactly what the captured one does (dropout included) and its
  static non-model peak is lower; the host copies cost no device bytes;
- training with offloaded activations tracks plain PyTorch step by step (GPT and BERT, dropout on)
  under budgets below what keeping every activation needs, so every step evicts chunks as well;
  on every step the peak is within the budget, and the activation bytes moved (out and back) equal
  what the schedule planned;
- every budget from the offload minimum up plans, verifies and (sampled) trains;
- "auto" picks per segment by the rates: offload over a fast link, recompute over a slow one, and
  recompute what the host has no room for; "offload" refuses a host without room;
- the schedule shows every offload and reload.
"""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.graph.capture import capture_joint
from pscompile.graph.meta import get
from pscompile.graph.analysis import _analyze, _Passes
from pscompile.graph.pipeline import PlanRequest, choose_activations, plan_at_budget, plan_inputs
from pscompile.memory.rates import Rates
from pscompile.passes.offload_activations import find_offloads, offload_activations
from pscompile.passes.recompute_activations import find_segments
from pscompile.testing import ReferenceTrainer
from conftest import (TRACKING_TOL, tracking_tol, activations_config, assert_graphs_agree, fresh_masters, make_batches,
                      make_model, tracking_of)

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
DROPOUT = 0.1
OFFLOAD, RELOAD = torch.ops.pscompile.offload.default, torch.ops.pscompile.reload.default
FAST_LINK = Rates(flops_per_s=1e12, link_bytes_per_s=1e12)     # offloading costs less than any recompute
SLOW_LINK = Rates(flops_per_s=1e12, link_bytes_per_s=1e6)


_config = activations_config


def _minimum(kind: str, policy: str) -> int:
    return pscompile.min_device_memory(make_model(kind, dropout=DROPOUT), make_batches(kind, 1)[0], _config(policy))


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_the_offloaded_graph_computes_the_same_values_with_less_device_memory(kind):
    model = make_model(kind, dropout=DROPOUT)
    batch = make_batches(kind, 1)[0]
    params = dict(model.named_parameters())
    captured = capture_joint(model, batch, params=params)
    segments = find_segments(captured)
    offloads = find_offloads(captured, segments)
    moves = [o for s in segments for o in offloads.get(s.index, ())]
    assert len(offloads) == len(segments) and len(moves) >= 8
    for s in segments:                    # a storage is offloaded once, and never more than was saved
        assert 0 < sum(o.nbytes for o in offloads[s.index]) <= s.saved_bytes
    rewritten = offload_activations(captured, moves)
    assert_graphs_agree(captured, rewritten, params, batch)       # the backward reads bit-identical copies
    nodes = list(rewritten.gm.graph.nodes)
    out_nodes = [n for n in nodes if n.target is OFFLOAD]
    back_nodes = [n for n in nodes if n.target is RELOAD]
    assert len(out_nodes) == len(back_nodes) == len(moves)
    where = {n: i for i, n in enumerate(nodes)}
    loss = where[nodes[-1].args[0][0]]
    for n in back_nodes:                   # out in the forward, back in the backward, before its readers
        out = n.args[0]
        assert where[out] <= loss + 1 < where[n] < min(where[u] for u in n.users)
        assert get(n, "moves").nbytes == get(out, "moves").nbytes == out.meta["val"].untyped_storage().nbytes()
        root = out.args[0]                 # offloaded after the forward's last read of it
        assert all(where[u] < where[out] for u in root.users if u is not out)
    assert len(list(captured.gm.graph.nodes)) < len(nodes)          # the input graph is left as it was
    before = _analyze(captured, _Passes()).nonmodel
    after = _analyze(rewritten, _Passes()).nonmodel
    assert max(after) < 0.8 * max(before), (max(after), max(before))


def _train(kind: str, policy: str, budget: int | None, steps: int = 6, dtype=torch.float32, **kw):
    ref = ReferenceTrainer(make_model(kind, dropout=DROPOUT), optimizer=HP, dtype=dtype)
    initial = fresh_masters(kind, dtype, dropout=DROPOUT)
    batches = make_batches(kind, steps)
    engine = pscompile.compile(make_model(kind, dropout=DROPOUT), batches[0], optimizer=HP,
                               config=_config(policy, budget, dtype, **kw))
    planned = engine.schedule.scheduled.offload_bytes
    worst_loss = 0.0
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)
        want = ref.step(b)
        torch.manual_seed(100 + i)
        got = engine.step(b)
        worst_loss = max(worst_loss, abs(got - want) / abs(want))
        s = engine.stats
        planned = engine.schedule.scheduled.offload_bytes
        assert s.offload_bytes == s.reload_bytes == planned, (i, s.offload_bytes, s.reload_bytes, planned)
        if budget is not None:
            assert s.peak_device_bytes <= budget, (i, s.peak_device_bytes, budget)
            assert s.h2d_bytes > s.reload_bytes and s.num_evictions > 0, "the budget must evict chunks too"
    tracking = tracking_of(engine.state_dict()["master"], ref, initial)
    return engine, worst_loss, tracking


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_training_with_offloaded_activations_tracks_plain_pytorch_below_the_keep_minimum(kind):
    keep, least = _minimum(kind, "keep"), _minimum(kind, "offload")
    assert least < 0.8 * keep, (least, keep)
    budget = least + (keep - least) // 4          # only taking activations off the device reaches it
    engine, worst_loss, (tracking, name) = _train(kind, "offload", budget)
    assert worst_loss <= 1e-5
    assert tracking <= TRACKING_TOL, name
    plan = engine.schedule.scheduled.activations
    assert plan.offloaded and not plan.recomputed and engine.stats.offload_bytes == plan.offload_bytes > 0


def test_bfloat16_training_with_offloaded_activations_tracks_plain_pytorch():
    least = pscompile.min_device_memory(make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0],
                                        _config("offload", dtype=torch.bfloat16))
    engine, worst_loss, (tracking, name) = _train("gpt", "offload", least, steps=4, dtype=torch.bfloat16)
    assert worst_loss <= 2e-2 and tracking <= tracking_tol(torch.bfloat16), (worst_loss, tracking, name)
    assert engine.schedule.scheduled.activations.offloaded


def test_a_slow_link_keeps_the_budget_and_the_bytes():
    """Offloads and reloads over the emulated 20 MB/s link: the forward's copy dies only after it
    reached the host, the reload is complete before the backward reads it."""
    least = _minimum("gpt", "offload")
    engine, worst_loss, _ = _train("gpt", "offload", least, steps=2, link_bandwidth="20MB/s")
    assert worst_loss <= 1e-5 and engine.stats.transfer_s > 2 * engine.stats.offload_bytes / 20e6


def test_every_budget_from_the_offload_minimum_plans_and_verifies():
    model, batch = make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0]
    config = _config("offload")
    least, keep = _minimum("gpt", "offload"), _minimum("gpt", "keep")
    layout, analyzed = plan_inputs(model, batch, config)
    variants: dict = {}
    for budget in sorted({least + 2048 * k for k in range(12)} | {least + (keep - least) * k // 16 for k in range(17)}):
        sched = plan_at_budget(analyzed, layout, PlanRequest(budget=budget, dtype=torch.float32, activations="offload"),
                               variants=variants)          # verify_schedule runs inside: a broken plan raises
        assert sched.plan.peak_device_bytes <= budget and sched.offload_bytes > 0
    with pytest.raises(pscompile.BudgetError, match=f"give device_memory >= {least}"):
        plan_at_budget(analyzed, layout, PlanRequest(budget=least - 1, dtype=torch.float32, activations="offload"))
    for budget in (least, least + (keep - least) // 2):
        _train("gpt", "offload", budget, steps=2)


def test_auto_offloads_over_a_fast_link_and_recomputes_over_a_slow_one():
    model, batch = make_model("bert", dropout=DROPOUT), make_batches("bert", 1)[0]
    layout, analyzed = plan_inputs(model, batch, _config("auto"))
    keep, least = _minimum("bert", "keep"), _minimum("bert", "auto")
    assert least == min(_minimum("bert", "recompute"), _minimum("bert", "offload"))
    slot = layout.chunk_size * 4
    budget = keep - (keep - least) // 3
    fast = choose_activations(analyzed, layout, policy="auto", budget=budget, slot_bytes=slot, rates=FAST_LINK)
    slow = choose_activations(analyzed, layout, policy="auto", budget=budget, slot_bytes=slot, rates=SLOW_LINK)
    assert fast.activations.offloaded and not fast.activations.recomputed
    assert slow.activations.recomputed and not slow.activations.offloaded
    assert len(fast.activations.offloaded) < len(fast.activations.segments)     # only what the budget needs
    none = choose_activations(analyzed, layout, policy="auto", budget=keep, slot_bytes=slot, rates=FAST_LINK)
    assert not none.activations.offloaded and not none.activations.recomputed
    # the host's room runs out: the rest is recomputed
    one = max(sum(o.nbytes for o in v) for v in find_offloads(analyzed.captured,
                                                              find_segments(analyzed.captured)).values())
    tight = choose_activations(analyzed, layout, policy="auto", budget=least, slot_bytes=slot, rates=FAST_LINK,
                               host_room=one)
    assert len(tight.activations.offloaded) <= 1 and tight.activations.recomputed
    assert tight.activations.offload_bytes <= one
    for chosen in (fast, slow, tight):
        plan_at_budget(chosen, layout, PlanRequest(budget=budget if chosen is not tight else least, dtype=torch.float32))


def test_offload_refuses_a_host_without_room_and_hooks_mode():
    model, batch = make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0]
    layout, analyzed = plan_inputs(model, batch, _config("offload"))
    with pytest.raises(ValueError, match="activations='offload': the saved activations need .* host_memory leaves"):
        choose_activations(analyzed, layout, policy="offload", budget=None, slot_bytes=layout.chunk_size * 4,
                           host_room=1024)
    with pytest.raises(ValueError, match="activations='offload' is planned in compiled mode"):
        pscompile.Config(mode="hooks", activations="offload")


def test_the_schedule_shows_every_offload_and_reload():
    budget = _minimum("gpt", "offload")
    engine = pscompile.compile(make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0],
                               config=_config("offload", budget))
    text = str(engine.schedule)
    plan = engine.schedule.scheduled.activations
    assert "# activations offload: 5 of 5 segments offloaded" in text
    forward, backward = text.split("def iteration")[1].split("# ---- backward ----")
    moves = sum(1 for n in engine.schedule.scheduled.gm.graph.nodes if n.target is OFFLOAD)
    assert moves >= 8 and sum(get(n, "moves").nbytes for n in engine.schedule.scheduled.gm.graph.nodes
                              if n.target is OFFLOAD) == plan.offload_bytes
    assert forward.count("# offload activation ") == moves and "reload" not in forward
    assert backward.count("# reload activation ") == moves and "pscompile.offload(" not in backward
    assert "offload_activations" in text.split("def iteration")[0]        # the pass in the provenance
    assert "offloaded and reloaded" in text                              # the planned traffic line


def test_inductor_regions_run_the_offloaded_graph_and_track_plain_pytorch():
    """backend="inductor": one program with each offload, reload and wait inside; the losses track plain
    PyTorch step by step (no dropout: Inductor draws its own random numbers) and the activation
    bytes moved are the schedule's."""
    batches = make_batches("gpt", 3)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.float32)
    config = pscompile.Config(mode="compiled", backend="inductor", device="cpu", dtype=torch.float32,
                              activations="offload")
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=config)
    for b in batches:
        want, got = ref.step(b), engine.step(b)
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
        assert engine.stats.offload_bytes == engine.stats.reload_bytes == engine.schedule.scheduled.offload_bytes > 0
    ex = engine._executor_for(engine._last_key, engine.schedule.scheduled)
    assert ex.split == "program" and engine.stats.compiled_share == 1.0


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("rates", [FAST_LINK, SLOW_LINK], ids=["fast-link", "slow-link"])
def test_auto_plans_and_verifies_at_every_budget_from_its_minimum(kind, rates):
    """The least budget ``min_device_memory`` names for "auto" holds whatever the rates make it
    mix: every budget from there up plans a schedule that verifies; 1 byte below is refused."""
    model, batch = make_model(kind, dropout=DROPOUT), make_batches(kind, 1)[0]
    layout, analyzed = plan_inputs(model, batch, _config("auto"))
    least, keep = _minimum(kind, "auto"), _minimum(kind, "keep")
    variants: dict = {}
    mixes = set()
    for budget in sorted({least + 1024 * k for k in range(8)} | {least + (keep - least) * k // 24 for k in range(26)}):
        sched = plan_at_budget(analyzed, layout, PlanRequest(budget=budget, dtype=torch.float32, activations="auto"),
                               variants=variants, rates=rates)
        assert sched.plan.peak_device_bytes <= budget
        mixes.add((sched.activations.recomputed, sched.activations.offloaded))
    assert len(mixes) >= 3, mixes
    with pytest.raises(pscompile.BudgetError, match=f"give device_memory >= {least}"):
        plan_at_budget(analyzed, layout, PlanRequest(budget=least - 1, dtype=torch.float32, activations="auto"),
                       rates=rates)


def test_copies_overlap_compute_where_the_budget_allows():
    """Unlimited: every offload and reload but the first reload is asynchronous, with its
    ``wait_copy`` after its issue and before its first reader (an offload's wait also holds its
    device value, so the memory the plan counts is what the copy needs); trained over a slow link
    it still tracks plain PyTorch and moves the planned bytes. At the least budget the copies that
    do not fit overlapped are waited for where they are."""
    engine, worst_loss, _ = _train("gpt", "offload", None, steps=2, link_bandwidth="50MB/s")
    assert worst_loss <= 1e-5
    sched = engine.schedule.scheduled
    assert sched.activations.overlapped
    nodes = list(sched.gm.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    waits = {n.args[0]: n for n in nodes if n.target is torch.ops.pscompile.wait_copy.default}
    copies = [n for n in nodes if n.target in (OFFLOAD, RELOAD)]
    assert len(waits) == len(copies) - 1
    for c in copies:
        if c not in waits:                 # the first reload is read at once
            assert c.target is RELOAD and not get(c, "moves").asynchronous
            continue
        w = waits[c]
        assert get(c, "moves").asynchronous and where[c] < where[w]
        assert all(where[w] < where[u] for u in c.users if u is not w)
        if c.target is OFFLOAD:
            assert w.args[1] is c.args[0]       # the source lives until its copy landed
    least = _minimum("gpt", "offload")
    tight = pscompile.compile(make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0],
                              config=_config("offload", least))
    assert not tight.schedule.scheduled.activations.overlapped
    assert "copies waited for" in str(tight.schedule)
