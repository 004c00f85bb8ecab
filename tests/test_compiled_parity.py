"""Compiled mode (eager backend) vs plain PyTorch and vs hooks mode, step by step."""

from __future__ import annotations

import os

import pytest
import torch

import pscompile
from pscompile.passes.verify_schedule import ScheduleError, verify_schedule
from pscompile.testing import ReferenceTrainer
from conftest import TRACKING_TOL, tracking_tol, TRACKING_TOL_INDUCTOR_BF16, fresh_masters, make_batches, make_model, max_weight_diff, worst_tracking

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def compiled_config(dtype, device_memory, **kw):
    return pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=dtype,
                            device_memory=device_memory, **kw)


def min_budget(kind, dtype, **batch_kw):
    """The compiled plan's own minimum, from an unlimited engine after its measuring step."""
    b = make_batches(kind, 1, **batch_kw)[0]
    engine = pscompile.compile(make_model(kind), b, config=compiled_config(dtype, None))
    engine.step(b)
    return engine.min_device_memory


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("budget", ["unlimited", "tight"])
def test_compiled_parity(kind, dtype, budget):
    device_memory = None if budget == "unlimited" else min_budget(kind, dtype) + (128 << 10)
    hp = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batches = make_batches(kind, 8)
    ref = ReferenceTrainer(make_model(kind), optimizer=hp, dtype=dtype)
    engine = pscompile.compile(make_model(kind), batches[0], optimizer=hp, config=compiled_config(dtype, device_memory))
    for i, b in enumerate(batches):
        torch.manual_seed(i)
        a = ref.step(b)
        torch.manual_seed(i)
        c = engine.step(b)
        assert abs(a - c) <= TOL[dtype] * abs(a), f"step {i}: plain {a} vs compiled {c}"
        s, plan = engine.stats, engine.last_plan
        assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (plan.h2d_bytes, plan.d2h_bytes), "moved != planned"
        if device_memory is not None:
            assert s.peak_device_bytes <= device_memory
            assert s.num_evictions > 0
    assert max_weight_diff(engine, ref) <= (1e-4 if dtype == torch.float32 else 5e-2)
    assert worst_tracking(engine, ref, fresh_masters(kind, dtype))[0] <= tracking_tol(dtype)


def test_compiled_moves_no_more_than_hooks_under_the_same_budget():
    kind, dtype = "gpt", torch.float32
    budget = min_budget(kind, dtype) + (256 << 10)
    batches = make_batches(kind, 3)
    compiled = pscompile.compile(make_model(kind), batches[0], config=compiled_config(dtype, budget))
    hooks = pscompile.compile(make_model(kind), batches[0], config=pscompile.Config(   # same chunks
        mode="hooks", device="cpu", dtype=dtype, device_memory=budget, chunk_size=compiled.layout.chunk_size))
    for b in batches:
        hooks.step(b)
        compiled.step(b)
    assert compiled.stats.bytes_moved <= hooks.stats.bytes_moved, (compiled.stats, hooks.stats)
    assert compiled.stats.peak_device_bytes <= budget and hooks.stats.peak_device_bytes <= budget


def test_verify_catches_a_deleted_fetch():
    kind, dtype = "gpt", torch.float32
    budget = min_budget(kind, dtype) + (128 << 10)
    engine = pscompile.compile(make_model(kind), make_batches(kind, 1)[0], config=compiled_config(dtype, budget))
    sched = engine.schedule
    gm = sched.gm
    fetches = [n for n in gm.graph.nodes if n.target is torch.ops.pscompile.fetch.default]
    assert fetches
    victim = fetches[len(fetches) // 2]
    gm.graph.erase_node(victim)
    os_dev = frozenset(c for c, k in sched.plan.initial)
    with pytest.raises(ScheduleError, match=r"reads .* from slot|fetch|holds"):
        verify_schedule(gm, engine.layout, slot_bytes=engine.store.param_chunk_bytes, budget=budget,
                        initial=dict(sched.plan.initial), os_device_chunks=os_dev,
                        os_device_bytes=engine.store.dev_os_pool.bytes_in_use)


def test_compiled_budget_error_names_a_node():
    with pytest.raises(ValueError, match=r"below the minimum .* at node"):
        pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0],
                          config=compiled_config(torch.float32, "1MiB"))


def test_scheduled_graph_runs_as_plain_fx():
    """The scheduled graph is an ordinary GraphModule: called directly on slot and host buffers
    it computes the same loss as the executor."""
    kind, dtype = "gpt", torch.float32
    budget = min_budget(kind, dtype) + (128 << 10)
    b = make_batches(kind, 1)[0]
    engine = pscompile.compile(make_model(kind), b, config=compiled_config(dtype, budget))
    sched = engine.schedule
    slots = [torch.empty_like(s) for s in engine.moves.slots[:sched.plan.num_slots]]
    for c, k in sched.plan.initial:
        engine.store.cast_master_into(c, slots[k])      # device-homed: the cast of its master
    hosts = [h.clone() for h in engine.store.host_param]
    (loss,) = sched.gm(*slots, *hosts, *sched.captured.flatten_batch(b))
    assert float(loss) == pytest.approx(engine.step(b), rel=1e-6)
    print(sched.gm.code[:200])


def test_min_device_memory_is_exactly_enough():
    """The measured minimum of one graph (every activation kept: recomputation would make another
    graph, with its own minimum) is enough, and 4 KiB less is refused."""
    b = make_batches("gpt", 2)
    minimum = min_budget("gpt", torch.float32)
    keep = dict(activations="keep")
    engine = pscompile.compile(make_model("gpt"), b[0], config=compiled_config(torch.float32, minimum, **keep))
    for x in b:
        engine.step(x)
        assert engine.stats.peak_device_bytes <= minimum
    with pytest.raises(ValueError, match="below the minimum"):
        pscompile.compile(make_model("gpt"), b[0], config=compiled_config(torch.float32, minimum - 4096, **keep))


@pytest.mark.copy_threads
def test_emulated_link_costs_bytes_over_bandwidth_and_prefetch_hides_some():
    """With link_bandwidth, transfers take bytes / bandwidth on the copy thread (within 20%), and
    because fetches start early the step is shorter than compute + transfers back to back."""
    import statistics
    threads = torch.get_num_threads()       # (put back as it was: bf16 rounds differently with more threads)
    torch.set_num_threads(1)
    try:
        batches = make_batches("gpt", 6, batch=8)
        minimum = min_budget("gpt", torch.float32, batch=8)
        budget = minimum + 6 * 17408 * 4
        bandwidth = 10e6
        steps = {}
        for bw in (None, bandwidth):
            engine = pscompile.compile(make_model("gpt"), batches[0], config=compiled_config(
                torch.float32, budget, link_bandwidth=bw))
            times, transfers, moved = [], [], []
            for b in batches:
                engine.step(b)
                times.append(engine.stats.time_s)
                transfers.append(engine.stats.transfer_s)
                moved.append(engine.stats.bytes_moved)
            steps[bw] = (statistics.median(times[2:]), statistics.median(transfers[2:]), moved[-1])
        t_link, transfer, moved = steps[bandwidth]
        expected = moved / bandwidth
        assert 0.8 * expected <= transfer <= 1.2 * expected, (transfer, expected)
        t_compute = steps[None][0]
        assert t_link < t_compute + transfer, (t_link, t_compute, transfer)   # part of it overlapped
    finally:
        torch.set_num_threads(threads)


def test_compiled_eager_matches_hooks_mode_to_1e_6():
    batches = make_batches("gpt", 4)
    budget = min_budget("gpt", torch.float32) + (128 << 10)
    compiled = pscompile.compile(make_model("gpt"), batches[0], config=compiled_config(torch.float32, budget))
    hooks = pscompile.compile(make_model("gpt"), batches[0], config=pscompile.Config(
        mode="hooks", device="cpu", dtype=torch.float32, device_memory=budget, chunk_size=compiled.layout.chunk_size))
    for b in batches:
        a, c = hooks.step(b), compiled.step(b)
        assert abs(a - c) <= 1e-6 * abs(a)


# each case is some 40 regions of cold Inductor compiles (25-50 s): CI runs one per model and dtype,
# the tight GPT in float32, the tight BERT in bfloat16 and the roomy GPT in bfloat16;
# PSCOMPILE_SLOW_TESTS=1 runs all eight
_SLOW = pytest.mark.skipif(not os.environ.get("PSCOMPILE_SLOW_TESTS"),
                           reason="25-50 s of cold Inductor compiles: set PSCOMPILE_SLOW_TESTS=1")
_IN_CI = {("gpt", torch.float32, "tight"), ("bert", torch.bfloat16, "tight"), ("gpt", torch.bfloat16, "roomy")}
INDUCTOR_CASES = [pytest.param(k, d, r, marks=() if (k, d, r) in _IN_CI else _SLOW,
                               id=f"{r}-{'fp32' if d == torch.float32 else 'bf16'}-{k}")
                  for r in ("tight", "roomy") for d in (torch.float32, torch.bfloat16) for k in ("gpt", "bert")]


@pytest.mark.parametrize("kind, dtype, room", INDUCTOR_CASES)
def test_inductor_backend_parity_under_eviction(kind, dtype, room):
    """backend='inductor': the first step runs eagerly (it measures), later steps run compiled
    regions; losses track plain PyTorch, bytes moved equal the plan, peak <= budget, where the peak
    includes what the compiled regions allocate inside (measured before they first run). At a
    tight budget, regions whose measured peaks do not fit are cut to fit; compiled regions run at
    both budgets."""
    hp = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batches = make_batches(kind, 4)
    minimum = min_budget(kind, dtype)
    budget = minimum + (128 << 10) if room == "tight" else int(minimum * 1.3)
    ref = ReferenceTrainer(make_model(kind), optimizer=hp, dtype=dtype)
    engine = pscompile.compile(make_model(kind), batches[0], optimizer=hp, config=pscompile.Config(
        mode="compiled", backend="inductor", device="cpu", dtype=dtype, device_memory=budget))
    for i, b in enumerate(batches):
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= TOL[dtype] * abs(a), f"step {i}: plain {a} vs inductor {c}"
        s, plan = engine.stats, engine.last_plan
        assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (plan.h2d_bytes, plan.d2h_bytes)
        assert s.peak_device_bytes <= budget and s.num_evictions > 0
    # later steps ran one compiled program; or, at a budget that cannot hold Inductor's buffers where
    # the plan needs them, compiled eager, said with the reason (compiled/lowering.py): at the tight
    # budget, and in bfloat16 (Inductor's decompositions keep some values in float32: its buffers
    # exceeded the 1.3x GPT's plan by more than a re-plan fits, 2026-11-29)
    if engine.stats.compiled_share < 1.0:
        assert (room == "tight" or dtype == torch.bfloat16) and any(
            "Inductor's buffers" in (c.eager_reason or "") for c in engine.captures()), \
            (engine.stats.compiled_share, engine.captures())
    elif room != "tight" and dtype == torch.float32:
        assert not [c for c in engine.captures() if c.eager_reason], engine.captures()
    assert max_weight_diff(engine, ref) <= (1e-4 if dtype == torch.float32 else 5e-2)
    tol = TRACKING_TOL if dtype == torch.float32 else TRACKING_TOL_INDUCTOR_BF16
    assert worst_tracking(engine, ref, fresh_masters(kind, dtype))[0] <= tol
