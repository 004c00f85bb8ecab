"""A range's schedule with Inductor (issue 60): its regions compiled once, for symbolic sizes.

The engine test trains the tiny GPT on changing lengths under an evicting budget with the default
backend and checks at every step the loss against plain PyTorch, the peak against the budget, that
compiled code ran once the range's regions were measured, and that no length after the range's
first compiled its regions again. The unit tests pin what makes that safe: a compile that assumes
a size is refused, the layout check reads the symbols off a region's inputs, and a region is
measured at the range's bound on its real values grown with zeros.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import fx

import pscompile
from pscompile.compiled.inductor import SymbolicMeta, bind, compile_inductor, grown
from pscompile.compiled.probe import Snapshot
from pscompile.compiled.regions import Region, TensorMeta
from pscompile.graph.dynamic import symbolic_leaf, symbolic_mode
from pscompile.testing import ReferenceTrainer

from test_dynamic_shapes import HP, batch, model

aten = torch.ops.aten
LENGTHS = [48, 30, 41, 17, 48, 25, 36, 44]


def test_inductor_compiles_a_range_once_and_runs_it_at_every_length(caplog):
    config = pscompile.Config(mode="compiled", backend="inductor", device="cpu", dtype=torch.float32)
    budget = int(pscompile.min_device_memory(model(), batch(max(LENGTHS), 0), config) * 1.3)
    engine = pscompile.compile(model(), optimizer=HP, config=dataclasses.replace(config, device_memory=budget))
    ref = ReferenceTrainer(model(), optimizer=HP, dtype=torch.float32)
    rows = []
    with caplog.at_level(logging.INFO, logger="pscompile"):
        caplog.clear()      # (only this block's records: another test may have left the logger at INFO)
        for i, n in enumerate(LENGTHS):
            loss = engine.step(batch(n, i))
            rows.append((n, loss, ref.step(batch(n, i)), engine.stats.peak_device_bytes,
                         engine.stats.compiled_share, engine._region_cache.misses))
    for n, loss, want, peak, _, _ in rows:
        assert loss == pytest.approx(want, abs=2e-5), f"length {n}"
        assert peak <= budget, f"length {n}: peak {peak} over the budget {budget}"
    # step 1 measures the first shape; step 2 the range, node by node (its regions are compiled
    # then); each of the range's schedules (cold, and warm: starting from the chunks the last step
    # left) first runs as a probing run (compiled regions checked, measured at the bound, run as
    # eager code): steps 3 and 5 here. From then on compiled code runs, at every length
    assert all(share > 0.5 for *_, share, _ in rows[5:]), [(r[0], r[4]) for r in rows]
    assert len({misses for *_, misses in rows[2:]}) == 1, "a length in the range compiled its regions again"
    eager = [r.getMessage() for r in caplog.records if "runs as eager code" in r.getMessage()]
    assert not eager, eager
    engine.close()


def _fake_input(length: int = 124):
    """A symbolic capture's fake (4, s, 8) input and its layout at the bound ``length``."""
    mode = symbolic_mode()
    x = symbolic_leaf(mode, (4, length, 8), torch.float32, torch.device("cpu"), {1})
    return x, TensorMeta((4, length, 8), (length * 8, 8, 1), torch.float32, torch.device("cpu"), True)


def _region_graph(view_size) -> fx.Graph:
    """x -> relu(view(x, [view_size, 8])) (view_size a number, or a second input)."""
    g = fx.Graph()
    x = g.placeholder("in_0")
    rows = g.placeholder("in_1") if view_size is None else view_size
    g.output((g.call_function(aten.relu.default, (g.call_function(aten.view.default, (x, [rows, 8])),)),))
    return g


def test_a_compile_that_assumes_a_size_is_refused():
    x, bound = _fake_input()
    with pytest.raises(RuntimeError, match="Inductor assumed"):     # the bound's 4*124 rows baked in
        compile_inductor(_region_graph(496), [SymbolicMeta(x, bound)])
    rows = x.shape[0] * x.shape[1]                                    # the rows read off the input: safe
    fn = compile_inductor(_region_graph(None), [SymbolicMeta(x, bound), SymbolicMeta(rows, 496)])
    for length in (30, 124, 77):
        t = torch.randn(4, length, 8)
        (out,) = fn([t, 4 * length])
        assert torch.equal(out, torch.relu(t.view(-1, 8)))


def test_the_layout_check_reads_the_symbols_off_the_inputs():
    x, bound = _fake_input()
    metas = [SymbolicMeta(x, bound), SymbolicMeta(x.shape[0] * x.shape[1], 496)]
    good = [torch.zeros(4, 30, 8), 120]
    values = bind(metas, good)
    assert list(values.values()) == [30]
    assert all(m.mismatch(v, values) is None for m, v in zip(metas, good))
    wrong = torch.zeros(4, 8, 30).transpose(1, 2)            # the same shape, other strides
    assert "stride" in metas[0].mismatch(wrong, bind(metas, [wrong, 120]))
    assert "size 124" in metas[1].mismatch(124, values)       # 4*s is 120 for these inputs


def test_a_region_is_measured_at_the_bound_on_its_real_values_grown_with_zeros():
    x, bound = _fake_input(10)
    r = Region(0, input_metas=[SymbolicMeta(x, bound), SymbolicMeta(x.shape[1], 10), 3])
    real = torch.arange(4 * 6 * 8, dtype=torch.float32).view(4, 6, 8)
    tensor, size, plain = grown(r, [Snapshot.of(real), 6, 3], Snapshot)
    big = tensor.restore()
    assert big.shape == (4, 10, 8) and torch.equal(big[:, :6], real) and not big[:, 6:].any()
    assert (size, plain) == (10, 3)
