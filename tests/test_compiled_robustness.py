"""Compiled mode when things go wrong or change: a step that fails inside the graph, a batch of the
wrong kind, a second batch shape, and a Hugging Face model through Inductor, each under a budget
that evicts every step and checked against plain PyTorch."""

from __future__ import annotations

import dataclasses

import importlib.util

import pytest
import torch

import pscompile
from pscompile.graph.pipeline import plan_inputs
from pscompile.testing import ReferenceTrainer, tiny_model

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _tight(arch: str, backend: str = "eager", room: float = 1.0):
    """A budget that evicts every step: the minimum plus two chunks (times ``room``)."""
    model, batch = tiny_model(arch)
    config = pscompile.Config(mode="compiled", backend=backend, device="cpu", dtype=torch.float32)
    layout, _ = plan_inputs(model, batch, config)
    minimum = pscompile.min_device_memory(model, batch, config)
    budget = int((minimum + 2 * layout.chunk_size * 4) * room)
    return budget, pscompile.Config(mode="compiled", backend=backend, device="cpu", dtype=torch.float32,
                                    device_memory=budget)


def _state(engine) -> dict:
    sd = engine.state_dict()
    return {f"{k}.{n}": t.clone() for k in ("master", "exp_avg", "exp_avg_sq") for n, t in sd[k].items()} | \
        {"step": sd["step"]}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (a[k] == b[k]) if not isinstance(a[k], torch.Tensor) else torch.equal(a[k], b[k]) for k in a)


def test_a_step_that_fails_in_the_graph_changes_nothing():
    budget, config = _tight("gpt")
    model, batch = tiny_model("gpt")
    ref = ReferenceTrainer(tiny_model("gpt")[0], optimizer=HP, dtype=torch.float32)
    engine = pscompile.compile(model, batch, optimizer=HP, config=config)
    a, c = ref.step(batch), engine.step(batch)
    assert abs(a - c) <= 1e-5 * abs(a)
    before = _state(engine)
    idx, targets = batch
    bad = (idx.clone().fill_(10_000), targets)           # token ids out of the vocabulary: fails in embedding
    with pytest.raises((IndexError, RuntimeError)):
        engine.step(bad)
    assert _same(before, _state(engine)), "a failed step changed weights or optimizer states"
    for _ in range(2):                                   # and training goes on exactly as plain PyTorch's
        a, c = ref.step(batch), engine.step(batch)
        assert abs(a - c) <= 1e-5 * abs(a)
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_evictions > 0


@pytest.mark.parametrize("bad", ["float ids", "longer than the model allows", "extra argument"])
def test_a_bad_batch_is_refused_and_changes_nothing(bad):
    budget, config = _tight("gpt")
    model, batch = tiny_model("gpt")
    engine = pscompile.compile(model, batch, optimizer=HP, config=config)
    engine.step(batch)
    before = _state(engine)
    idx, targets = batch
    wrong = {"float ids": (idx.float(), targets),
             "longer than the model allows": (torch.cat([idx, idx, idx], 1), torch.cat([targets] * 3, 1)),
             "extra argument": (idx, targets, targets)}[bad]
    with pytest.raises(Exception):
        engine.step(wrong)
    assert _same(before, _state(engine))
    engine.step(batch)                                   # the engine still works
    assert engine.stats.peak_device_bytes <= budget


@pytest.mark.parametrize("dynamic", [None, False])
def test_a_second_batch_shape_gets_its_own_schedule(dynamic):
    """dynamic=False: each shape its own schedule, bytes exactly as planned. None (the default): the
    second shape makes the length symbolic, and both run one range's schedule planned at the longer
    length; a short batch moves the chunks' bytes exactly and fewer activation bytes."""
    budget, config = _tight("gpt", room=1.1)       # (every activation offloaded: bytes to count; at
    config = dataclasses.replace(config, dynamic=dynamic, activations="offload")   # room 1.0 the bound does not fit)
    model, long_batch = tiny_model("gpt")
    short = tuple(t[:, :16].contiguous() for t in long_batch)
    ref = ReferenceTrainer(tiny_model("gpt")[0], optimizer=HP, dtype=torch.float32)
    engine = pscompile.compile(model, long_batch, optimizer=HP, config=config)
    for b in (long_batch, short, long_batch, short, short):
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= 1e-5 * abs(a)
        assert engine.stats.peak_device_bytes <= budget
        assert (engine.stats.chunk_h2d_bytes, engine.stats.chunk_d2h_bytes) == \
            (engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes)
        planned = engine.book.cold(engine._last_key).offload_bytes
        if dynamic is False or b is long_batch:
            assert engine.stats.offload_bytes == engine.stats.reload_bytes == planned
        else:
            assert engine.stats.offload_bytes == engine.stats.reload_bytes < planned
    assert len({k.batch for k in engine.book.keys()}) == 2


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (hf extra)")
def test_hugging_face_gpt2_through_inductor():
    budget, config = _tight("hf-gpt2", backend="inductor", room=2.0)
    model, batch = tiny_model("hf-gpt2")
    ref = ReferenceTrainer(tiny_model("hf-gpt2")[0], optimizer=HP, dtype=torch.float32)
    engine = pscompile.compile(model, batch, optimizer=HP, config=config)
    for _ in range(3):                       # the measuring step, then the program
        a, c = ref.step(batch), engine.step(batch)
        assert abs(a - c) <= 1e-5 * abs(a)
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_evictions > 0
    assert engine.stats.compiled_share == 1.0 and any(ex.split == "program" for ex in engine._executors.values())
