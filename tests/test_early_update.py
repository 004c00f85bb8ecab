"""Updates in the backward (``Config.overlap_update``; passes/plan_early_updates.py,
runtime/early_update.py): the schedule shows where each chunk's update starts, the results are
bit-identical to updating after the backward -- clipped or not, fp16 loss scaling included, under
the race checker too -- and a step that fails after some chunks were updated leaves every weight,
moment and the step counter as they were."""

from __future__ import annotations

import threading

import pytest
import torch

import pscompile
from conftest import make_batches, make_model, same_state, snapshot
from pscompile.graph.meta import get
from pscompile.graph.ops import is_memory_node
from pscompile.kinds import MemKind
from pscompile.optim.adamw import ChunkAdamW
from pscompile.optim.native_kernel import unavailable_reason
from pscompile.runtime import early_update
from pscompile.passes.verify_schedule import ScheduleError, verify_schedule

BATCHES = make_batches("gpt", 5, distinct=3)


def _engine(dtype=torch.float32, overlap=True, clip=None, **kw):
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=dtype, chunk_size=2048, **kw)
    least = pscompile.min_device_memory(make_model("gpt"), BATCHES[0], config)
    hp = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=clip)
    return pscompile.compile(make_model("gpt"), BATCHES[0], optimizer=hp, config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=dtype, chunk_size=2048,
        device_memory=least + 2 * 2048 * dtype.itemsize, overlap_update=overlap, **kw))


def _updates(engine) -> list:
    return [n for n in engine.schedule.scheduled.gm.graph.nodes
            if is_memory_node(n) and get(n, "mem").kind == MemKind.UPDATE]


# (dtype, clip, kernel): no clipping; a clip that never bites; one that bites every step (the early
# updates are dropped and made again); float16's loss scaling (inverse scale known before the
# backward); fp32 with the compiled host kernel asked for (each path must pick the same kernel)
CASES = [(torch.float32, None, "auto"), (torch.bfloat16, 100.0, "auto"), (torch.bfloat16, 0.05, "auto"),
         (torch.float16, None, "auto"), (torch.float32, None, "inductor"),
         pytest.param(torch.bfloat16, 100.0, "native", marks=pytest.mark.skipif(
             unavailable_reason() is not None, reason=str(unavailable_reason())))]


@pytest.mark.parametrize("dtype,clip,kernel", CASES,
                         ids=["fp32", "bf16-clip-idle", "bf16-clip-bites", "fp16", "fp32-inductor", "bf16-native"])
def test_bit_identical_to_updating_after_the_backward(dtype, clip, kernel):
    runs = []
    for overlap in (False, True):
        engine = _engine(dtype, overlap, clip, optimizer_kernel=kernel)
        losses, early = [], []
        for i, b in enumerate(BATCHES):
            torch.manual_seed(i)
            losses.append(engine.step(b))
            early.append(engine.early.last_count)
        runs.append((losses, snapshot(engine), early, engine))
    (l0, s0, e0, plain), (l1, s1, e1, over) = runs
    assert l0 == l1 and same_state(s0, s1)
    if kernel == "native":                         # the C++ kernel ran, in place and out of place
        assert {k[:2] for k in over.adam.kernels.used} >= {("native", "into"), ("native", "out_to")}
    assert not _updates(plain) and len(_updates(over)) > 0
    if clip == 0.05:
        assert sum(e1) == 0            # each step clipped: dropped, then none guessed while it clips
    else:
        assert min(e1[1:]) > 0 and sum(e0) == 0


def test_the_schedule_lists_each_update_after_its_final_writeback():
    engine = _engine()
    engine.step(BATCHES[0])
    text = str(engine.schedule)
    nodes = list(engine.schedule.scheduled.gm.graph.nodes)
    for u in _updates(engine):
        c = get(u, "mem").chunk
        line = next(x for x in text.splitlines() if x.strip().startswith(f"{u.name} = pscompile.update("))
        assert f"update chunk {c}: its AdamW step starts on a host thread" in line
        before = [get(n, "mem") for n in nodes[:nodes.index(u)] if is_memory_node(n) and get(n, "mem").chunk == c]
        after = [get(n, "mem") for n in nodes[nodes.index(u) + 1:] if is_memory_node(n) and get(n, "mem").chunk == c]
        assert before[-1].kind == MemKind.WRITEBACK and all(m.decl.leaves for m in after)
    assert "chunks updated while the backward goes on" in text        # the pass's line in the header


def test_the_verifier_refuses_an_update_before_the_gradients_are_home():
    engine = _engine()
    engine.step(BATCHES[0])
    sched = engine.schedule.scheduled
    gm = sched.gm
    u = _updates(engine)[0]
    c = get(u, "mem").chunk
    wb = next(n for n in gm.graph.nodes if is_memory_node(n) and get(n, "mem").kind == MemKind.WRITEBACK
              and get(n, "mem").chunk == c)
    wb.prepend(u)                                    # the update before the chunk's writeback
    with pytest.raises(ScheduleError, match=f"update of chunk {c} while its gradients are on the device"):
        verify_schedule(gm, engine.layout, slot_bytes=engine.store.param_chunk_bytes, budget=None,
                        initial=dict(sched.plan.initial), grad_fqns=sched.captured.grad_fqns)


def test_race_checker_passes_with_updates_in_the_backward():
    """Every copy lands at the latest moment its contract allows (Config.strict_copies): the
    update thread reads each chunk's gradients only once its writeback has landed."""
    runs = []
    for overlap in (False, True):
        engine = _engine(torch.bfloat16, overlap, strict_copies=True)
        runs.append(([engine.step(b) for b in BATCHES[:3]], snapshot(engine), engine.early.last_count))
    assert runs[0][0] == runs[1][0] and same_state(runs[0][1], runs[1][1]) and runs[1][2] > 0


class _Boom(Exception):
    pass


def _fails_on_call(n: int, real):
    """``real``, raising _Boom on its ``n``-th call instead; the calls so far in ``.calls[0]``."""
    calls = [0]

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            raise _Boom()
        return real(*a, **k)
    failing.calls = calls
    return failing


@pytest.mark.parametrize("where", ["backward", "update thread", "norm"])
def test_a_failed_step_drops_the_updates_already_made(where, monkeypatch):
    """(``update thread``: the thread fails before the step knows its factor, in a chunk's norm)"""
    """A failure after some chunks' updates ran leaves every weight, moment and the step counter
    as before the step, and the next step matches an engine that never failed."""
    faulty, clean = _engine(), _engine()
    for e in (faulty, clean):
        torch.manual_seed(0)
        e.step(BATCHES[0])
    before = snapshot(faulty)
    if where == "backward":                     # a memory node after the third update node fails
        run, count = faulty.moves.run, [0]

        def failing(mem, *a, **k):
            count[0] += mem.kind == MemKind.UPDATE
            if count[0] >= 3 and mem.kind == MemKind.WRITEBACK:
                faulty.early.wait()             # (the updates so far have really run)
                raise _Boom()
            return run(mem, *a, **k)
        monkeypatch.setattr(faulty.moves, "run", failing)
    elif where == "update thread":              # the fourth early chunk's norm fails on its thread
        monkeypatch.setattr(early_update, "grad_norm", _fails_on_call(4, early_update.grad_norm))
    else:                                       # the global norm fails after every early update
        monkeypatch.setattr(faulty, "_unscale_and_clip", lambda *a, **k: (_ for _ in ()).throw(_Boom()))
    torch.manual_seed(1)
    with pytest.raises(_Boom):
        faulty.step(BATCHES[1])
    assert same_state(snapshot(faulty), before)
    monkeypatch.undo()
    for i, b in enumerate(BATCHES[1:3]):
        torch.manual_seed(10 + i)
        want = clean.step(b)
        torch.manual_seed(10 + i)
        assert faulty.step(b) == want
    assert same_state(snapshot(faulty), snapshot(clean))


def test_an_update_that_fails_after_its_norm_is_made_in_place(monkeypatch):
    """The fourth early update fails on its thread once the step may already be committing other
    chunks: that chunk is updated in place at its turn (its buffers were never touched), and the
    step ends where an engine whose updates never failed ends, bit for bit."""
    faulty, clean = _engine(), _engine()
    failing = _fails_on_call(4, faulty._early_update)
    monkeypatch.setattr(faulty.early, "_update", failing)
    for i, b in enumerate(BATCHES[:3]):
        torch.manual_seed(i)
        got = faulty.step(b)
        torch.manual_seed(i)
        assert got == clean.step(b)
    assert failing.calls[0] > 4                 # (early updates ran after the one that failed)
    assert same_state(snapshot(faulty), snapshot(clean))


def test_spares_count_as_host_memory_and_go_back_on_close():
    engine = _engine()
    engine.step(BATCHES[0])
    engine.step(BATCHES[1])
    on = engine.stats.peak_host_bytes
    plain = _engine(overlap=False)
    plain.step(BATCHES[0])
    plain.step(BATCHES[1])
    per_set = engine.store.os_chunk_bytes        # fp32: master (the param chunk) and moments
    assert on >= plain.stats.peak_host_bytes + engine.early.last_count * per_set
    assert engine.early._free                  # kept between steps
    engine.close()
    assert not engine.early._free


def test_every_new_param_chunk_has_zero_padding(uninitialized_is_nan):
    """A new param chunk (an early update's spare, lock-free's next params) is written over its
    state extent only; its padding must be zero like every param chunk's, since a device slot that
    held the params later holds the gradients, whose norm covers the whole chunk. In CI the
    allocator once left NaN there and the gradients were NaN -- only where a padded chunk's early
    update had started before its commit, which thread timing decides, so this checks the buffers
    themselves, with every fresh buffer NaN."""
    engine = _engine(lock_free=True)
    store = engine.store
    padded = [c for c in range(engine.layout.num_chunks) if 0 < store.state_numel(c) < store.host_param[c].numel()]
    assert padded
    for c in padded:
        n = store.state_numel(c)
        spare = early_update.spare_home(store, c)
        params = spare[0] if store.shares_master(c) else spare[3]
        assert bool((params[n:] == 0).all()) and bool((engine._next_params[c][n:] == 0).all()), f"chunk {c}"
        early_update.release_spare(store, store.shares_master(c), spare)
    engine.close()


class _Pool:
    def acquire(self, zero=False, numel=None):
        return torch.zeros(4 if numel is None else numel)

    def release(self, t):
        pass


class _Store:
    """What ``EarlyUpdates`` reads of a chunk store: two chunks whose masters are their params."""

    def __init__(self):
        self.host_param_pool = self.host_os_pool = _Pool()
        self.master, self.exp_avg, self.exp_avg_sq, self.host_param = ([torch.ones(4) for _ in range(2)]
                                                                        for _ in range(4))

    def shares_master(self, c):
        return True

    def grad_home(self, c):
        return torch.ones(4)


def test_a_chunk_takes_only_spares_of_its_own_extent():
    """The last chunk's states stop at its last parameter (a shorter extent than the others').
    The spare sets kept between steps come from every chunk; one of another extent, taken by the
    last chunk, left its old values past the last parameter, which the commit made that chunk's
    states and the next fetch carried into its gradient's padding: the gradient norm was off, and
    NaN where the memory had held NaN (in CI, a race checker's poison freed by another test). Each
    chunk's states stay its extent long, its param chunk's padding zero, and the norm is the one
    updating after the backward computes, step after step."""
    norms = {}
    for overlap in (False, True):
        engine = _engine(torch.bfloat16, overlap)
        store = engine.store
        norms[overlap] = []
        for i, b in enumerate(BATCHES):
            torch.manual_seed(i)
            engine.step(b)
            norms[overlap].append(engine.stats.grad_norm)
            for c in range(engine.layout.num_chunks):
                n = store.state_numel(c)
                assert [t.numel() for t in (store.master[c], store.exp_avg[c], store.exp_avg_sq[c])] == [n] * 3, c
                assert bool((store.host_param[c][n:] == 0).all()), f"chunk {c}: nonzero padding after step {i}"
        padded = [c for c in range(engine.layout.num_chunks) if 0 < store.state_numel(c) < engine.layout.chunk_size]
        assert padded and (not overlap or engine.early.last_count > 0)
        engine.close()
    assert norms[True] == norms[False]


def test_a_commit_takes_over_an_update_that_has_not_started():
    """One update thread: chunk 1's update waits behind chunk 0's. Committing chunk 1 then cancels
    it (the main thread updates it in place, quicker than waiting), and chunk 0's commit waits for
    its own update and takes its buffers."""
    gate, ran = threading.Event(), []

    def update(c, factor, gradless, groups, spare):
        if c == 0:
            gate.wait(10)
        ran.append(c)
        spare[0].fill_(c + 2)
    adam = ChunkAdamW(pscompile.AdamW())
    store = _Store()
    early = early_update.EarlyUpdates(adam, store, update=update)
    early.begin(1.0)
    early.submit(0, None, [], None)
    early.submit(1, None, [], None)
    assert 1 in early.running()
    assert early.commit(1) is False                # queued: cancelled, left to the main thread
    gate.set()
    assert early.commit(0) is True and torch.equal(store.master[0], torch.full((4,), 2.0))
    assert ran == [0] and torch.equal(store.master[1], torch.ones(4))
    early.end_step()
    early.close()
