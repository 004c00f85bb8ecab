"""Chunk kinds (``pscompile/memory/chunk_kinds.py``): each kind says what it holds and where it may
live, the layout names each chunk's kind, the byte counts follow the kind, and ``verify_schedule``
refuses a schedule that moves a chunk as its kind does not allow."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pscompile
from pscompile.errors import ScheduleError
from pscompile.graph.ops import mem_op
from pscompile.memory.chunk_kinds import FROZEN, KINDS, TRAINABLE
from pscompile.memory.layout import build_layout
from pscompile.memory.model_bytes import STATE_BYTES, ModelBytes, device_homable, state_chunks
from pscompile.memory.tiers import Tier
from pscompile.passes.verify_schedule import verify_schedule
from conftest import make_batches, make_model


def test_each_kind_declares_what_it_holds_and_where_it_lives():
    assert (TRAINABLE.master, TRAINABLE.moments, TRAINABLE.grad, TRAINABLE.updated) == (True,) * 4
    assert TRAINABLE.state_bytes == STATE_BYTES == 12 and TRAINABLE.tiers == {Tier.HOST, Tier.DISK, Tier.DEVICE}
    assert (FROZEN.master, FROZEN.moments, FROZEN.grad, FROZEN.updated, FROZEN.has_states) == (False,) * 5
    assert FROZEN.state_bytes == 0 and not FROZEN.homed_on(Tier.DEVICE)
    assert len({k.name for k in KINDS}) == len(KINDS)


def test_the_layout_names_each_chunks_kind_and_the_bytes_follow_it():
    layout = build_layout([("a", (100,)), ("b", (300,)), ("c", (50,))], 256, frozen=["b"])
    kinds = [layout.kind(c) for c in range(layout.num_chunks)]
    frozen = [c for c, k in enumerate(kinds) if k is FROZEN]
    assert frozen and set(frozen) == set(layout.frozen_chunks) == set(layout.entry("b").chunks)
    assert state_chunks(layout) == device_homable(layout) == [c for c, k in enumerate(kinds) if k is TRAINABLE]
    mb = ModelBytes.of(torch.bfloat16)
    for c, k in enumerate(kinds):       # a frozen chunk is its compute copy alone; a trainable one adds
        want = 256 * 2 + (layout.state_extent(c) * 12 if k is TRAINABLE else 0)    # states over its extent
        assert mb.host_bytes(layout, [c]) == want, (c, k)


def test_verify_refuses_a_gradient_or_writeback_for_a_chunk_whose_kind_has_none():
    """A tight schedule of the tiny GPT verifies against its own layout; against the same layout
    with one trainable chunk relabeled frozen, its store_grad (and writeback) there is refused,
    naming the chunk and its kind."""
    batch = make_batches("gpt", 1)[0]
    largest = max(p.numel() for p in make_model("gpt").parameters())     # (whole tensors: no page spans two chunks)
    cfg = dict(mode="compiled", backend="eager", device="cpu", dtype=torch.float32, chunk_size=largest)
    least = pscompile.min_device_memory(make_model("gpt"), batch, pscompile.Config(**cfg))
    engine = pscompile.compile(make_model("gpt"), batch, config=pscompile.Config(**cfg, device_memory=least))
    sched, layout = engine.schedule, engine.layout

    def verify(layout):
        verify_schedule(sched.gm, layout, slot_bytes=engine.store.param_chunk_bytes, budget=engine.budget,
                        initial=dict(sched.plan.initial), os_device_chunks=frozenset(c for c, _ in sched.plan.initial),
                        os_device_bytes=engine.store.dev_os_pool.bytes_in_use, grad_fqns=sched.captured.grad_fqns)
    verify(layout)
    stored = {mem_op(n).chunk for n in sched.gm.graph.nodes if n.target is torch.ops.pscompile.store_grad.default}
    alone = [c for c in sorted(stored) if all(set(e.chunks) == {c} for e, _ in layout.chunk_members(c))]
    assert alone, "no chunk holds only tensors of its own"
    c = alone[0]
    relabeled = replace(layout, entries=tuple(replace(e, trainable=False) if c in e.chunks else e
                                              for e in layout.entries))
    assert relabeled.kind(c) is FROZEN
    with pytest.raises(ScheduleError, match=f"into chunk {c}, a frozen chunk, which has no gradient"):
        verify(relabeled)
