"""The pass pipeline as a function of data: a model built on the meta device (no weights, no chunk
store) gets the same layout and the same schedule as the compiled engine builds for the same
model with real weights (before its first step, i.e. from the static non-model estimate)."""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.graph.pipeline import schedule_model
from pscompile.kinds import MemKind
from pscompile.models.bert import BertMLM, bert_config
from pscompile.models.gpt import GPT, gpt_config
from conftest import make_batches

MODELS = {"gpt": (GPT, gpt_config("gpt-tiny")), "bert": (BertMLM, bert_config("bert-tiny"))}


def _config(budget, backend="eager"):
    return pscompile.Config(mode="compiled", backend=backend, device="cpu", dtype=torch.float32,
                            device_memory=budget)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("budget", ["unlimited", "tight"])
def test_meta_device_pipeline_equals_engine_plan(kind, budget, backend):
    """``schedule_model`` plans what the engine starts with, without an engine; with Inductor both
    keep its headroom (``minimum.program_headroom``): the layout weighed and the plan made at the
    budget less it."""
    cls, cfg = MODELS[kind]
    batch = make_batches(kind, 1)[0]
    torch.manual_seed(0)
    probe = pscompile.compile(cls(cfg), batch, config=_config(None))
    device_memory = None if budget == "unlimited" else probe.min_device_memory + 2 * probe.store.param_chunk_bytes
    probe.close()

    torch.manual_seed(0)
    engine = pscompile.compile(cls(cfg), batch, config=_config(device_memory, backend))
    expected = engine.schedule
    with torch.device("meta"):
        meta_model = cls(cfg)
    layout, got = schedule_model(meta_model, batch, _config(device_memory, backend))

    assert all(p.is_meta for p in meta_model.parameters()), "the pipeline materialized parameters"
    assert layout == engine.layout
    plan, want = got.plan, expected.plan
    assert plan.actions == want.actions
    assert (plan.h2d_bytes, plan.d2h_bytes, plan.num_slots, plan.initial, plan.final) == \
        (want.h2d_bytes, want.d2h_bytes, want.num_slots, want.initial, want.final)
    assert plan.peak_device_bytes == want.peak_device_bytes
    assert got.os_device == expected.scheduled.os_device
    assert str(got.gm.graph) == str(expected.gm.graph)
    if budget == "tight":     # the case is only worth something if the plan moves chunks
        assert any(a.kind == MemKind.DROP for a in plan.actions)
        assert (got.request.budget < device_memory) == (backend == "inductor")     # (the headroom)
    engine.close()


class _DeclaredBackwards(torch.nn.Module):
    """Parameters declared in the reverse of their first use (as Phi-3 and Gemma declare theirs in
    another order than their forward reads them), sized so that the two orders pack differently."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(96, 256, bias=False)     # used last
        self.mid = torch.nn.Linear(64, 96)
        self.norm = torch.nn.LayerNorm(64)
        self.emb = torch.nn.Embedding(256, 64)                # used first

    def forward(self, idx, targets):
        logits = self.head(torch.relu(self.mid(self.norm(self.emb(idx)))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_the_engine_lays_out_chunks_in_first_use_order_as_the_pipeline_does():
    """The engines, ``min_device_memory`` and ``schedule_model`` take the parameters in one order
    (first use), so the minimum names a layout the engine builds: compile accepts it and trains
    within it. (The engine once passed ``collect_params`` its arguments swapped, its fake forward
    failed and it fell back to construction order, unlike the minimum: Phi-3 was refused at its
    own minimum.)"""
    from pscompile.runtime.batching import call_model
    from pscompile.runtime.params import collect_params
    batch = make_batches("gpt", 1)[0]
    minimum = pscompile.min_device_memory(_DeclaredBackwards(), batch, _config(None))
    torch.manual_seed(0)
    engine = pscompile.compile(_DeclaredBackwards(), batch, config=_config(minimum))
    assert engine.order_source.startswith("first use"), engine.order_source
    assert list(engine.params) == ["emb.weight", "norm.weight", "norm.bias", "mid.weight", "mid.bias", "head.weight"]
    with torch.device("meta"):
        meta_model = _DeclaredBackwards()
    layout, _ = schedule_model(meta_model, batch, _config(minimum))
    assert layout == engine.layout
    for _ in range(2):
        engine.step(batch)
        assert engine.stats.peak_device_bytes <= minimum
    engine.close()
    with pytest.raises(TypeError, match="run must be callable"):   # the swapped call is refused, not guessed at
        collect_params(_DeclaredBackwards(), batch, call_model)


def test_plan_within_keeps_the_headroom_where_it_can():
    """``plan_within``: at the budget less the headroom where that fits; else at the least budget
    the plan names, where it lies between (the rest stays headroom); else at the whole budget."""
    from pscompile.graph.pipeline import plan_within

    def planner(least):
        def plan(b):
            if b < least:
                raise pscompile.BudgetError("below", minimum=least)
            return b
        return plan
    assert plan_within(planner(800), 1000, 100) == 900
    assert plan_within(planner(950), 1000, 100) == 950
    assert plan_within(planner(1000), 1000, 100) == 1000
    assert plan_within(planner(800), 1000, 0) == 1000
    with pytest.raises(pscompile.BudgetError):
        plan_within(planner(1200), 1000, 100)
