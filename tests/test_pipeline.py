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


def _config(budget):
    return pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                            device_memory=budget)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("budget", ["unlimited", "tight"])
def test_meta_device_pipeline_equals_engine_plan(kind, budget):
    cls, cfg = MODELS[kind]
    batch = make_batches(kind, 1)[0]
    torch.manual_seed(0)
    probe = pscompile.compile(cls(cfg), batch, config=_config(None))
    device_memory = None if budget == "unlimited" else probe.min_device_memory + 2 * probe.store.param_chunk_bytes
    probe.close()

    torch.manual_seed(0)
    engine = pscompile.compile(cls(cfg), batch, config=_config(device_memory))
    expected = engine.schedule
    with torch.device("meta"):
        meta_model = cls(cfg)
    layout, got = schedule_model(meta_model, batch, _config(device_memory))

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
    engine.close()
