"""Across the step boundary: the next step's first chunks are fetched as soon as they are updated
(``plan_lookahead``), the optimizer step starts while the last writebacks land, and the results
are the bits of the step without any of it."""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.compiled.engine import CompiledEngine
from pscompile.kinds import MemKind
from pscompile.passes.plan_lookahead import plan_lookahead, resident_at_end
from pscompile.passes.plan_residency import GradStore, plan_residency
from pscompile.passes.prefetch_fetches import prefetch_fetches
from conftest import make_batches, make_model

SLOT = 100
READS = [[0], [1], [2], [3], [3], [2], [1], [0]]            # forward then backward, like a model
STORES = {4: [GradStore(3, "d", 0, 40)], 5: [GradStore(2, "c", 0, 40)], 6: [GradStore(1, "b", 0, 40)],
          7: [GradStore(0, "a", 0, 40)]}


def _plan(budget, **kw):
    nonmodel = [0] * len(READS)
    plan = plan_residency(READS, nonmodel, stores=STORES, num_chunks=4, slot_bytes=SLOT, budget=budget, **kw)
    return prefetch_fetches(plan, nonmodel, budget=budget)[0]


@pytest.mark.parametrize("budget", [200, 300, 400, None])
def test_the_lookahead_is_the_first_fetches_and_fits_next_to_the_end(budget):
    cold = _plan(budget)
    windows = [0] * len(READS)
    ahead = plan_lookahead(cold, windows, budget=budget)
    first = [a for a in cold.actions if a.kind is MemKind.FETCH]
    assert ahead.fetches, "the first chunk read is always fetched ahead"
    assert ahead.chunks[0] == first[0].chunk == 0
    end = resident_at_end(cold)
    if budget is not None:                 # the chunks resident at the end and the lookahead fit together
        assert len(set(end) | set(ahead.chunks)) * SLOT <= budget
    assert not {k for _, k in ahead.fetches} & set(end.values()), "a lookahead slot is held at the end"
    # the next step starts with them in flight: a wait before the first reader of each, and it
    # fetches the same chunks ahead again (one plan repeats)
    start = dict(ahead.fetches)
    warm = _plan(budget, start=start, start_in_flight=True)
    waits = {a.chunk: a.before for a in warm.actions if a.kind is MemKind.WAIT and a.chunk in start}
    assert set(waits) == set(start)
    for c, at in waits.items():
        assert at <= min(i for i, r in enumerate(READS) if c in r)
    assert warm.h2d_bytes + ahead.nbytes == cold.h2d_bytes, "a step moves what the cold one did"
    again = plan_lookahead(warm, windows, budget=budget, fixed=ahead.fetches)
    assert again.fetches == ahead.fetches


def test_a_lookahead_that_does_not_fit_is_cut_from_the_end():
    reads = [[0], [1], [2], [3], [3], [2]]            # the backward ends on chunks the forward reads last
    stores = {4: [GradStore(3, "d", 0, 40)], 5: [GradStore(2, "c", 0, 40)]}
    plan = plan_residency(reads, [0] * 6, stores=stores, num_chunks=4, slot_bytes=SLOT, budget=200)
    plan = prefetch_fetches(plan, [0] * 6, budget=200)[0]
    assert set(resident_at_end(plan)) == {2, 3}
    whole = plan_lookahead(plan, [0] * 6, budget=400)
    assert whole.chunks == (0, 1)
    cut = plan_lookahead(plan, [0] * 6, budget=300)             # 2, 3 still landing + 0: three slots
    assert cut.chunks == (0,) and cut.peak_device_bytes == 300
    assert plan_lookahead(plan, [0] * 6, budget=200).fetches == ()
    assert plan_lookahead(plan, [0] * 6, budget=300, fixed=whole.fetches).fetches == ()   # kept whole or not


# ------------------------------------------------------------------------------ the engine
def _engine(budget, **hp):
    batches = make_batches("gpt", 6)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=pscompile.AdamW(lr=1e-3, **hp),
                               config=pscompile.Config(mode="compiled", backend="eager", device="cpu",
                                                       dtype=torch.float32, device_memory=budget))
    return engine, batches


def _tight():
    engine, batches = _engine(None)
    engine.step(batches[0])
    return engine.min_device_memory + (128 << 10)


def test_steps_across_the_boundary_give_the_same_bits(monkeypatch):
    """Clipped AdamW at a tight budget: the engine that fetches ahead and updates as writebacks land
    ends every step with the weights and losses of the one that does neither, its steps after the
    first measured one run the warm plan (chunks arriving), and every step moves what its plan says."""
    budget = _tight()
    runs = {}
    for overlap in (False, True):
        with monkeypatch.context() as m:
            if not overlap:
                m.setattr(CompiledEngine, "_overlaps_update", property(lambda self: False))
            engine, batches = _engine(budget, max_grad_norm=0.05)
            losses, warm = [], []
            for i, b in enumerate(batches):
                torch.manual_seed(i)
                losses.append(engine.step(b))
                s, plan = engine.stats, engine.last_plan
                assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (plan.h2d_bytes, plan.d2h_bytes), f"step {i}"
                assert s.peak_device_bytes <= budget and s.num_evictions > 0
                warm.append(any(c not in engine.book.cold(engine._last_key).os_device for c, _ in plan.initial))
            runs[overlap] = (losses, engine.state_dict(), warm)
            engine.close()
    (l0, sd0, warm0), (l1, sd1, warm1) = runs[False], runs[True]
    assert not any(warm0)
    assert warm1[2:] == [True] * (len(warm1) - 2), f"warm plans ran at steps {warm1}"
    assert l0 == l1
    for which in ("master", "exp_avg", "exp_avg_sq"):
        for k in sd0[which]:
            assert torch.equal(sd0[which][k], sd1[which][k]), f"{which} {k}"


def test_a_step_that_fails_after_a_lookahead_loses_nothing():
    """The step after a lookahead fails inside its graph: the chunks that arrived for it are let go,
    weights stay, and the next step (a cold one) trains on as if nothing happened."""
    budget = _tight()
    engine, batches = _engine(budget)
    clean, _ = _engine(budget)
    for b in batches[:3]:
        engine.step(b)
        clean.step(b)
    assert not engine.moves.idle() or any(engine.store.resident(c) for c in range(engine.layout.num_chunks))
    before = {k: v.clone() for k, v in engine.state_dict()["master"].items()}
    real = engine.moves.run

    def fail(mem, args, **kw):
        if mem.kind is MemKind.WRITEBACK:
            raise RuntimeError("injected")
        return real(mem, args, **kw)
    engine.moves.run = fail
    with pytest.raises(RuntimeError, match="injected"):
        engine.step(batches[3])
    del engine.moves.run
    assert engine.moves.idle()
    after = engine.state_dict()["master"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    for b in batches[3:]:
        assert engine.step(b) == clean.step(b)


class _Landing:
    """A writeback's handle: lands when the test says so."""

    def __init__(self):
        self.landed = False

    def done(self) -> bool:
        return self.landed


def test_chunks_are_updated_as_their_writebacks_land():
    """The step's update order: the next step's first chunks first among those whose writeback has
    landed; while none has, the one whose writeback was issued first (it lands first on a link
    that carries each direction in order), not the first of the order, which may land last."""
    engine, _ = _engine(None)
    n = engine.layout.num_chunks
    assert n >= 4
    copies = {c: _Landing() for c in range(n)}
    engine.moves.ahead = [(c, 100 + c) for c in range(n)]            # the next step needs 0, 1, 2, ...
    engine.moves.still_landing = lambda: {c for c in range(n) if not copies[c].landed}
    engine.moves.issued = lambda c: n - c                            # the backward wrote n-1 first
    copies[1].landed = True
    order = engine._update_order()
    assert next(order) == 1                                          # landed: before the rest
    assert next(order) == n - 1                                      # none landed: the first issued
    copies[0].landed = True
    assert next(order) == 0                                          # landed: first of the order
    assert list(order) == list(range(n - 2, 1, -1))                  # then in issue order again
