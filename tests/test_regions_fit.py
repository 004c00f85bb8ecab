"""Compiled code at every budget: a compiled region whose measured peak does not fit the plan is cut
into smaller regions (compiled/lowering.py, ``_cut_regions``), never the whole capture run node by
node; the measurement of the compiled regions counts in the step's peak.

One engine (the tiny GPT of ``pscompile.testing`` at 1.15x its named minimum, the default
backend, float32) trains 7 steps beside plain PyTorch. Before regions were cut to fit, this budget
ran the whole capture node by node (docs/inductor.md). The CPU twins of tests/gpu/test_cuda_budget_kept.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

import pscompile
from pscompile.compiled import lowering
from pscompile.testing import ReferenceTrainer, tiny_model
from conftest import max_weight_diff

HP = pscompile.AdamW(lr=1e-3)
STEPS = 7


def _config(budget=None) -> pscompile.Config:
    return pscompile.Config(mode="compiled", device="cpu", dtype=torch.float32, device_memory=budget)


@pytest.fixture(scope="module")
def run():
    """(engine, budget, per-step stats, our losses, plain losses, measurements, warnings): trained."""
    model, batch = tiny_model("gpt")
    budget = int(pscompile.min_device_memory(model, batch, _config()) * 1.15)
    ref = ReferenceTrainer(tiny_model("gpt")[0], optimizer=HP, dtype=torch.float32)
    measured = []                       # (footprint, model bytes on the device then) of each measurement
    real = lowering.measure

    def measure(saved, device):
        found = real(saved, device)
        measured.append((found.footprint, engine._model_bytes(), dict(engine._residency())))
        return found

    handler = _Collect()
    logging.getLogger("pscompile").addHandler(handler)
    mp = pytest.MonkeyPatch()
    mp.setattr(lowering, "measure", measure)
    try:
        engine = pscompile.compile(model, batch, optimizer=HP, config=_config(budget))
        stats, ours, plain = [], [], []
        for _ in range(STEPS):
            ours.append(engine.step(batch))
            plain.append(ref.step(batch))
            stats.append(engine.stats)
            assert (engine.stats.chunk_h2d_bytes, engine.stats.chunk_d2h_bytes) == (
                engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes)
        weights = max_weight_diff(engine, ref)
    finally:
        mp.undo()
        logging.getLogger("pscompile").removeHandler(handler)
    yield engine, budget, stats, ours, plain, measured, handler.messages, weights
    engine.close()


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_tight_budget_runs_compiled_regions_cut_to_fit(run):
    engine, budget, stats, ours, plain, _, warnings, weights = run
    assert not engine._node_by_node and not any("node by node" in m for m in warnings), warnings
    # compiled code for most operators (99% here); every other one runs alone, as eager code,
    # because compiled it needs more than the plan leaves at its node (here: the split of the QKV
    # projection): no region runs as eager code for want of room
    assert stats[-1].compiled_share >= 0.9, [s.compiled_share for s in stats]
    ex = engine._executors[engine._schedules[engine._last_key].gm]
    alone = sum(r.ops for r in ex.regions if r.solo)
    assert stats[-1].compiled_ops + alone == stats[-1].compute_ops, ex.describe()
    assert stats[0].compiled_ops == 0            # the measuring step runs node by node
    cap = next(iter(engine._captures))
    assert engine._cuts.get(cap) or engine._solo.get(cap), "no region had to be cut at this budget"
    for s in stats:
        assert s.peak_device_bytes <= budget, (s.peak_device_bytes, budget)
    for a, b in zip(ours, plain):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, plain)
    assert weights <= 1e-5


def test_region_measurement_counts_in_the_steps_peak(run):
    """The compiled regions are measured between steps with only the chunks that live on the device
    there (the clean copies dropped first, no bytes moved), and what the measurement holds (its
    copies of the inputs and what the region allocates) is part of that step's peak, within the
    budget."""
    engine, budget, stats, *_ = run
    measured = run[5]
    assert measured, "nothing was measured"
    for footprint, model_bytes, resident in measured:
        assert footprint > 0 and footprint + model_bytes <= budget, (footprint, model_bytes, budget)
        assert all(engine.store.device_homed(c) for c in resident), resident
    assert max(s.peak_device_bytes for s in stats) >= max(f + m for f, m, _ in measured)


def test_flash_attentions_rng_outputs_are_described_on_the_host_on_cuda():
    """On CUDA, flash attention returns its RNG seed and offset as CPU tensors: a region that reads
    them is compiled for CPU inputs there (a GPU run saw such a region fall back to eager code)."""
    import operator
    from torch import fx
    from pscompile.compiled.program import _on_host
    g = fx.Graph()
    q = g.placeholder("q")
    flash = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention.default, (q, q, q))
    seed, offset, out = (g.call_function(operator.getitem, (flash, i)) for i in (6, 7, 0))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _on_host(seed, cuda) and _on_host(offset, cuda)
    assert not _on_host(out, cuda) and not _on_host(seed, cpu)


def test_outputs_that_view_an_input_hold_no_excess():
    """Inductor returns a split of a region's input as a view of it, as eager code does: such an
    output holds nothing beyond its eager value (counting the input's whole storage as "excess"
    made every later region of GPT-NeoX look over its room, and run alone as eager code)."""
    from types import SimpleNamespace
    from torch.fx.experimental.proxy_tensor import make_fx
    from pscompile.compiled.probe import _excess_bytes

    def f(x):
        a, b = x.split(2)
        return a, b.exp()

    x = torch.randn(4, 8)
    gm = make_fx(f)(x)
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    outputs = list(nodes[-1].args[0])
    r = SimpleNamespace(inputs=inputs, outputs=outputs)
    held = {x.untyped_storage().data_ptr()}
    a, b = x.split(2)
    assert _excess_bytes([a, b.exp()], r, held) == 0
    # an output made anew in a storage larger than its eager value's holds the difference
    wide = torch.empty(2, 16)[:, :8]
    assert _excess_bytes([a, wide], r, held) == 2 * 8 * 4
    # and an output eager code makes as a view of an input, compiled code anew, counts whole
    assert _excess_bytes([a.clone(), b.exp()], r, held) == 2 * 8 * 4


def test_a_regions_room_is_where_it_runs_not_where_its_getitems_were_planned():
    """The backward reads a forward attention's outputs through getitems that stay in the forward's
    region (with their multi-output op); the plan's room at their captured place (the backward,
    fewer chunks) is not the forward region's room (a Llama step overshot its budget by 0.4%)."""
    import operator
    from types import SimpleNamespace
    from torch import fx
    from pscompile.compiled.probe import room_of
    from pscompile.graph import meta
    g = fx.Graph()
    q = g.placeholder("q")
    attn = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q))
    out, lse = (g.call_function(operator.getitem, (attn, i)) for i in (0, 1))
    for n, room in ((attn, 1000), (out, 1000), (lse, 5000)):
        meta.put(n, "room", room)
    assert room_of(SimpleNamespace(nodes=[attn, out, lse])) == 1000
