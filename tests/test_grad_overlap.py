"""overlap_grad_copies: a micro-batch's gradients cross to the host while the backward goes on,
each held on the device until its wait, and the plan counts it there. At every budget the plan
replays within the budget, every started copy is waited for once, nothing moves that did not
before; the engine trains to the same bits as with every copy waited for at once, and its measured
peak stays within the budget at every budget swept."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

import pscompile
from pscompile.errors import ScheduleError
from pscompile.graph.meta import get
from pscompile.graph.ops import is_memory_node
from pscompile.graph.pipeline import BudgetSweep
from pscompile.kinds import MemKind, RunKind
from pscompile.passes.overlap_grad_copies import overlap_grad_copies
from pscompile.passes.plan_residency import GradStore, arrival_windows, plan_residency
from pscompile.passes.prefetch_fetches import resident_counts
from pscompile.passes.verify_schedule import verify_schedule
from pscompile.testing import ReferenceTrainer, tiny_model
from conftest import gpt_batches, make_model, max_weight_diff
from test_compiled_parity import compiled_config, min_budget

SLOT = 100


def _case(rng: random.Random):
    """A forward over ``n`` chunks and the backward in reverse (some nodes read two chunks), a
    non-model curve, and one gradient (of 20-60 bytes) added into its chunk's host buffer after
    each backward node; a few parameters span two chunks (two pages stored together)."""
    n = rng.randint(3, 7)
    fwd = [sorted({c, min(n - 1, c + 1)}) if rng.random() < 0.3 else [c] for c in range(n)]
    reads = fwd + [list(r) for r in reversed(fwd)]
    nonmodel = [rng.randint(0, 3) * 30 for _ in reads]
    stores, sizes = {}, {}
    for k, c in enumerate(reversed(range(n))):
        size = rng.randint(2, 6) * 10
        pages = [GradStore(c, f"p{c}", 0, size)]
        if c + 1 < n and rng.random() < 0.3:        # the gradient spans chunks c and c + 1: two pages
            pages = [GradStore(c, f"p{c}", 0, size // 2, 0, size // 2),
                     GradStore(c + 1, f"p{c}", 0, size - size // 2, size // 2, size - size // 2)]
        stores[n + k] = pages
        sizes[f"p{c}"] = size
    return reads, nonmodel, stores, sizes, n


def _replay(plan, windows, sizes) -> tuple[int, dict]:
    """The most bytes any node holds (resident chunks, its window, the gradients whose copy is in
    flight: each whole, once) and, per gradient, its (start, wait) nodes."""
    resident, inflight, spans, peak = len(plan.initial), {}, {}, 0
    by_node = {}
    for a in plan.actions:
        by_node.setdefault(a.before, []).append(a)
    for i in range(plan.num_nodes + 1):
        for a in by_node.get(i, ()):
            resident += a.decl.arrives - a.decl.leaves
            if a.kind is MemKind.ACCUMULATE_GRAD and a.asynchronous:
                inflight.setdefault(a.grad.fqn, set()).add(a.chunk)
                spans.setdefault(a.grad.fqn, [i, None])
            elif a.kind is MemKind.WAIT and a.slot is None:
                inflight[a.grad.fqn].remove(a.chunk)       # (KeyError: a wait with no copy started)
                if not inflight[a.grad.fqn]:
                    del inflight[a.grad.fqn]
                    spans[a.grad.fqn][1] = i
        if i < plan.num_nodes:
            peak = max(peak, resident * SLOT + windows[i] + sum(sizes[f] for f in inflight))
    assert not inflight, f"copies never waited for: {inflight}"
    return peak, spans


@pytest.mark.parametrize("seed", range(40))
def test_random_accumulation_plans_at_every_budget(seed):
    """From the least budget that fits to one with room for every gradient: the replayed peak
    (held gradients included) equals the plan's and is within the budget, every copy started is
    waited for once after it starts, the bytes are the plan's before, and a gradient's pages start
    and wait together; with no budget every copy overlaps."""
    rng = random.Random(seed)
    reads, nonmodel, stores, sizes, n = _case(rng)
    windows = arrival_windows(nonmodel, [True] * len(reads))
    least = max(len(set(r)) * SLOT + windows[i] for i, r in enumerate(reads))
    most = n * SLOT + max(windows) + sum(sizes.values())
    overlapped = []
    for budget in [*range(least, most + 1, 10), None]:
        base = plan_residency(reads, nonmodel, stores=stores, num_chunks=n, slot_bytes=SLOT, budget=budget,
                              accumulate=True, windows=windows)
        plan, report = overlap_grad_copies(base, windows, budget=budget, grad_bytes=sizes)
        peak, spans = _replay(plan, windows, sizes)
        assert peak == plan.peak_device_bytes
        assert budget is None or peak <= budget, budget
        assert (plan.h2d_bytes, plan.d2h_bytes, plan.num_fetches) == (base.h2d_bytes, base.d2h_bytes, base.num_fetches)
        assert [a for a in plan.actions if a.kind is not MemKind.WAIT or a.slot is not None] == \
            [dataclasses.replace(a, asynchronous=True) if a.kind is MemKind.ACCUMULATE_GRAD and a.grad.fqn in spans
             else a for a in base.actions], "only the accumulate_grad actions changed"
        for f, (start, wait) in spans.items():
            assert start < wait <= len(reads)
        assert report.overlapped == sum(1 for a in plan.actions if a.kind is MemKind.ACCUMULATE_GRAD
                                        and a.asynchronous)
        overlapped.append(len(spans))
    last = stores[len(reads) - 1][0].fqn            # stored after the last node: nothing left to overlap
    assert overlapped[-1] == len(sizes) - 1 and last not in spans, "with no budget every other copy overlaps"
    assert overlapped[0] <= overlapped[-1]


def test_a_wait_goes_to_the_latest_boundary_that_fits():
    """Four backward nodes, one gradient after each; memory actions (the gradient stores) cut
    boundaries before nodes 1..4. With room for one 50-byte gradient next to the chunk, each waits
    at the next boundary (held while one node runs); with room for all, every wait goes to the end."""
    reads = [[0], [0], [0], [0]]
    stores = {k: [GradStore(0, f"p{k}", 0, 50)] for k in range(4)}
    nonmodel = [0, 0, 0, 0]
    windows = arrival_windows(nonmodel, [True] * 4)
    base = plan_residency(reads, nonmodel, stores=stores, num_chunks=1, slot_bytes=SLOT, budget=150,
                          accumulate=True, windows=windows)
    plan, _ = overlap_grad_copies(base, windows, budget=150)
    waits = {a.grad.fqn: a.before for a in plan.actions if a.kind is MemKind.WAIT}
    assert waits == {"p0": 2, "p1": 3, "p2": 4}, "p3 is stored at the end: nothing left to overlap"
    assert plan.peak_device_bytes == 150
    roomy, _ = overlap_grad_copies(base, windows, budget=SLOT + 200)
    assert {a.grad.fqn: a.before for a in roomy.actions if a.kind is MemKind.WAIT} == {"p0": 4, "p1": 4, "p2": 4}
    tight, _ = overlap_grad_copies(base, windows, budget=149)
    assert not any(a.asynchronous for a in tight.actions), "no room for a held gradient: all synchronous"
    assert resident_counts(tight) == resident_counts(base)


def _accum_engine(budget, backend="eager"):
    micro = gpt_batches(8, batch=2)
    engine = pscompile.compile(make_model("gpt"), micro[0], optimizer=pscompile.AdamW(lr=1e-3, max_grad_norm=1.0),
                               config=dataclasses.replace(compiled_config(torch.float32, budget), backend=backend))
    return engine, micro


def test_accumulation_overlaps_its_copies_and_trains_to_the_same_bits(monkeypatch):
    """The measured accumulation schedule starts copies and waits for them later (the schedule
    shows both); the weights, states and losses are bit-identical to the same engine with every
    copy waited for at once, and each step's measured peak is within the budget."""
    budget = min_budget("gpt", torch.float32, batch=2) + (256 << 10)
    engine, micro = _accum_engine(budget)
    losses = []
    for step in range(3):
        losses.append(engine.step(micro[4 * (step % 2):4 * (step % 2) + 4]))
        assert engine.stats.peak_device_bytes <= budget
    sched = engine.schedule_of(micro[0], "accum")
    mems = [get(n, "mem") for n in sched.gm.graph.nodes if is_memory_node(n)]
    started = [m for m in mems if m.kind is MemKind.ACCUMULATE_GRAD and m.asynchronous]
    assert started and sum(1 for m in mems if m.kind is MemKind.WAIT and m.slot is None) == len(started)
    text = str(sched)
    assert "wait_grad" in text and "copied while compute goes on" in text and "overlap_grad_copies" in text
    state = engine.state_dict()
    engine.close()

    import pscompile.graph.schedule_passes as schedule_passes
    monkeypatch.setattr(schedule_passes, "overlap_grad_copies",
                        lambda plan, *a, **k: (plan, SimpleNamespace(summary="off")))
    sync, micro = _accum_engine(budget)
    sync_losses = [sync.step(micro[4 * (s % 2):4 * (s % 2) + 4]) for s in range(3)]
    mems = [get(n, "mem") for n in sync.schedule_of(micro[0], "accum").gm.graph.nodes if is_memory_node(n)]
    assert not any(m.asynchronous for m in mems if m.kind is MemKind.ACCUMULATE_GRAD)
    assert sync_losses == losses
    other = sync.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(state[key][f], other[key][f]) for f in state[key]), key
    sync.close()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_accumulation_at_every_budget_from_the_minimum(backend):
    """Accumulation steps at budgets from the micro-batch minimum up to where every gradient can be
    held: each step's measured peak is within the budget, and the losses and weights are plain
    PyTorch's."""
    minimum = min_budget("gpt", torch.float32, batch=2)
    micro = gpt_batches(4, batch=2)
    hp = pscompile.AdamW(lr=1e-3, max_grad_norm=1.0)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    expected = [ref.step(micro), ref.step(micro)]
    steps = 2
    fractions = (0, 0.05, 0.15, 0.4) if backend == "eager" else (0,)     # (Inductor: some 40 cold compiles each)
    for frac in fractions:
        budget = int(minimum * (1 + frac))
        engine, _ = _accum_engine(budget, backend)
        for want in expected:
            got = engine.step(micro)
            assert got == pytest.approx(want, rel=1e-5), budget
            assert engine.stats.peak_device_bytes <= budget, budget
            assert frac > 0 or engine.stats.num_evictions > 0, "the minimum must evict"
        assert max_weight_diff(engine, ref) < 1e-5, budget      # every gradient was added, once
        assert engine.state_dict()["step"] == steps
        engine.close()


def test_verify_schedule_refuses_a_copy_never_waited_for():
    """Dropping the wait of one overlapped gradient (or pointing it at another gradient) is caught."""
    budget = min_budget("gpt", torch.float32, batch=2) + (256 << 10)
    engine, micro = _accum_engine(budget)
    engine.step(micro[:4])
    engine.step(micro[:4])
    sched = engine.schedule_of(micro[0], "accum")
    gm = sched.gm
    kw = dict(slot_bytes=engine.store.param_chunk_bytes, budget=budget, initial=dict(sched.plan.initial),
              final=dict(sched.plan.final))
    verify_schedule(gm, engine.layout, **kw)
    wait = next(n for n in gm.graph.nodes if is_memory_node(n) and get(n, "mem").kind is MemKind.WAIT
                and get(n, "mem").slot is None)
    other = next(n for n in gm.graph.nodes if is_memory_node(n) and get(n, "mem").kind is MemKind.ACCUMULATE_GRAD
                 and n.args[1] is not wait.args[0])
    grad = wait.args[0]
    wait.args = (other.args[1],)
    with pytest.raises(ScheduleError, match="without an asynchronous accumulate_grad"):
        verify_schedule(gm, engine.layout, **kw)
    wait.args = (grad,)
    gm.graph.erase_node(wait)
    with pytest.raises(ScheduleError, match="never waited for"):
        verify_schedule(gm, engine.layout, **kw)
    engine.close()


@pytest.mark.parametrize("arch", ["gpt", "bert", "llama", "t5"])
def test_every_accumulation_budget_from_the_minimum_verifies(arch):
    """The engine's accumulation schedule, planned as after its measuring step (so with the
    gradient copies overlapped), at budgets from the training minimum to twice it: each verifies
    (``build_schedule`` runs ``verify_schedule``, which counts the held gradients), its planned peak
    is within the budget, and where the budget has room some copies overlap."""
    if arch in ("llama", "t5"):
        pytest.importorskip("transformers")
    model, batch = tiny_model(arch)
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32)
    minimum = pscompile.min_device_memory(model, batch, config)
    sweep = BudgetSweep(model, batch, config)
    overlapped = {}
    for budget in sorted({minimum + 4096 * k for k in range(6)} | {int(minimum * (1 + 0.1 * k)) for k in range(11)}):
        sched = sweep.plan(budget, kind=RunKind.ACCUM, measured=True)
        assert sched.plan.peak_device_bytes <= budget
        assert any(p.name == "overlap_grad_copies" for p in sched.passes)
        overlapped[budget] = sum(1 for a in sched.plan.actions if a.kind is MemKind.ACCUMULATE_GRAD and a.asynchronous)
    assert overlapped[max(overlapped)] > 0, overlapped
