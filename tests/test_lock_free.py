"""Lock-free updating (``Config(lock_free=True, staleness=s)``, ANGEL-PTM's Algorithm 2).

- The staleness bound, exactly: the parameters step ``t`` reads hold every update up to
  ``t - 1 - s`` and none after. Checked against plain PyTorch applying AdamW to the gradients of
  step ``t - s`` (``ReferenceTrainer(staleness=s)``), step by step, in both modes, under budgets
  that evict, with clipping: the losses agree to 1e-5 and the weights after the last update track.
- Every update runs on its own thread, which never outlives a step that fails: a failed step
  queues nothing and the next good steps are bit for bit those of an engine that never failed.
- ``state_dict``, ``close`` and ``full_state_dict`` apply the queued updates first; a checkpoint
  resumes bit for bit; ``evaluate`` changes nothing.
- What it refuses, by name.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import pscompile
from pscompile.optim.native_kernel import unavailable_reason
from pscompile.testing import ReferenceTrainer
from conftest import TRACKING_TOL, TRACKING_TOL_BF16_ACCUMULATION, fresh_masters, make_batches, make_model, \
    tracking_of

HP = pscompile.AdamW(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)


def _config(mode: str, budget=None, dtype=torch.float32, **kw) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=dtype, device_memory=budget,
                            chunk_size=2048, lock_free=True, **kw)


def _budget(mode: str, dtype=torch.float32) -> int:
    """A budget two chunks above the minimum: every step evicts."""
    b = make_batches("gpt", 1)[0]
    return pscompile.min_device_memory(make_model("gpt"), b, _config(mode, dtype=dtype)) + 2 * 2048 * dtype.itemsize


def _update_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pscompile-update")]


@pytest.mark.parametrize("mode,staleness", [("compiled", 1), ("hooks", 1), ("compiled", 2), ("hooks", 3)])
def test_steps_read_exactly_the_updates_the_staleness_bound_allows(mode, staleness):
    steps = 7
    budget = _budget(mode)
    batches = make_batches("gpt", steps, distinct=3)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.float32, staleness=staleness)
    sync = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP,
                               config=_config(mode, budget, staleness=staleness))
    differs = False
    for t, b in enumerate(batches):
        want, got, now = ref.step(b), engine.step(b), sync.step(b)
        assert abs(want - got) <= 1e-5 * abs(want), f"step {t}: delayed-gradient PyTorch {want} vs lock-free {got}"
        differs |= abs(now - got) > 1e-4 * abs(now)       # synchronous training is another run
        s = engine.stats
        assert s.peak_device_bytes <= budget and s.num_evictions > 0
        if mode == "compiled":
            assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes)
        # the queue holds the steps whose update the next step may not see yet
        assert engine.queued_updates == min(t + 1, staleness)
    assert differs, "lock-free training gave the synchronous losses: the updates are not delayed"
    assert engine.updater.applied == steps - staleness        # published; the rest are queued
    ref.flush()
    masters = engine.state_dict()["master"]                    # applies the queued ones
    assert engine.adam.step_count == steps and engine.queued_updates == 0
    worst, name = tracking_of(masters, ref, fresh_masters("gpt", torch.float32))
    assert worst <= TRACKING_TOL, f"{name} tracks delayed-gradient PyTorch to {worst:.3g}"
    engine.close()
    assert not _update_threads()


@pytest.mark.parametrize("kernel", ["eager", pytest.param("native", marks=pytest.mark.skipif(
    unavailable_reason() is not None, reason=str(unavailable_reason()))), pytest.param("inductor", marks=pytest.mark.skipif(
        not os.environ.get("PSCOMPILE_SLOW_TESTS"), reason="a cold compile of the GIL-free kernel (~15 s): "
                                                           "set PSCOMPILE_SLOW_TESTS=1"))])
def test_bf16_tracks_delayed_gradient_pytorch(kernel):
    """Every host kernel (the C++ and Inductor ones write the next params' cast in their pass)."""
    steps, mode = 5, "hooks"
    batches = make_batches("gpt", steps)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.bfloat16, staleness=1)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP,
                               config=_config(mode, _budget(mode, torch.bfloat16), dtype=torch.bfloat16,
                                              optimizer_kernel=kernel))
    for t, b in enumerate(batches):
        want, got = ref.step(b), engine.step(b)
        assert abs(want - got) <= 2e-2 * abs(want), f"step {t}: {want} vs {got}"
    ref.flush()
    # the gradient reaches the fp32 buffer exactly (one micro-batch), as plain PyTorch upcasts it
    worst, name = tracking_of(engine.state_dict()["master"], ref, fresh_masters("gpt", torch.bfloat16))
    assert worst <= TRACKING_TOL_BF16_ACCUMULATION, f"{name}: {worst:.3g}"
    assert {k[0] for k in engine.adam.kernels.used} == ({kernel} if kernel != "eager" else set())


class _Boom(Exception):
    pass


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
@pytest.mark.parametrize("fault", [_Boom, KeyboardInterrupt])
def test_a_failed_step_queues_nothing_and_leaves_no_thread(mode, fault):
    batches = make_batches("gpt", 6, distinct=3)
    budget = _budget(mode)
    clean, faulty = (pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
                     for _ in range(2))
    update = faulty.updater._run

    def slow_update(job):                 # the update in flight outlasts the failing step's work
        if job.step == 2:
            time.sleep(0.3)
        update(job)
    faulty.updater._run = slow_update
    for b in batches[:3]:
        clean.step(b)
        faulty.step(b)
    assert faulty.queued_updates == 1
    run = faulty._run_micro
    calls = []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            run(*args, **kw)              # the forward and backward ran: the failure comes after them
            raise fault("injected")
        return run(*args, **kw)
    faulty._run_micro = failing
    with pytest.raises(fault):
        faulty.step(batches[3])
    assert not _update_threads(), "an update thread outlived the failed step"
    assert faulty.queued_updates == 1 and faulty.updater.applied == 2      # nothing new queued
    for b in batches[3:]:
        assert clean.step(b) == faulty.step(b)
    a, b = clean.state_dict(), faulty.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for f in a[key]:
            assert torch.equal(a[key][f], b[key][f]), f"{key}.{f}"
    for e in (clean, faulty):
        e.close()


def test_a_checkpoint_resumes_bit_for_bit_and_evaluate_changes_nothing(tmp_path):
    mode = "compiled"
    batches = make_batches("gpt", 6, distinct=3)
    budget = _budget(mode)
    a = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
    plain = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
    for b in batches[:3]:
        a.step(b)
        a.evaluate(batches[0])            # reads the published parameters; waits for nothing
        plain.step(b)
    assert a.stats.loss == plain.stats.loss
    path = tmp_path / "ckpt.pt"
    pscompile.save(a, path)               # applies the queued update
    assert a.queued_updates == 0
    b_ = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
    pscompile.load(b_, path)
    for b in batches[3:]:
        assert a.step(b) == b_.step(b)
    for e in (a, b_, plain):
        e.close()


def test_close_gives_the_model_every_update():
    mode = "hooks"
    batches = make_batches("gpt", 3)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.float32, staleness=2)
    model = make_model("gpt")
    engine = pscompile.compile(model, batches[0], optimizer=HP, config=_config(mode, staleness=2))
    for b in batches:
        ref.step(b)
        engine.step(b)
    assert engine.queued_updates == 2
    engine.close()
    ref.flush()
    ours = {f: p.detach() for f, p in model.named_parameters()}
    worst, name = tracking_of(ours, ref, fresh_masters("gpt", torch.float32))
    assert worst <= TRACKING_TOL, f"{name}: {worst:.3g}"


@pytest.mark.parametrize("kw,words", [
    (dict(staleness=0), ["staleness=0", ">= 1", "lock_free=False"]),
    (dict(dtype=torch.float16), ["float16", "bfloat16"]),
])
def test_what_lock_free_refuses_is_named(kw, words):
    with pytest.raises(ValueError) as e:
        pscompile.Config(device="cpu", lock_free=True, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_optimizer_states_on_disk_update_on_the_thread_like_delayed_gradient_pytorch(mode, tmp_path):
    """Lock-free updating with the disk tier: the update thread stages each disk home's states,
    updates them and writes them back while the next step computes. host_memory holds the chunks
    and the update thread's buffers but not most chunks' states; every step tracks
    delayed-gradient PyTorch, and every disk home is read and written once per update.""" 
    from pscompile.memory.tiers import Tier
    steps, model = 5, lambda: make_model("gpt", n_layer=4, d_model=128)
    batches = make_batches("gpt", steps, batch=2, seq=32, distinct=3)
    numel = sum(p.numel() for p in model().parameters())
    host = numel * (4 + 4 + 4 * 2) + 3 * 12 * 2048 + 3 * 12 * 2048    # params, next params, 2 grad sets, staging
    engine = pscompile.compile(model(), batches[0], optimizer=HP, config=_config(
        mode, _budget_of(model, mode), host_memory=host, disk_dir=str(tmp_path)))
    on_disk = [c for c, t in enumerate(engine.store.os_tier) if t is Tier.DISK]
    assert on_disk and len(on_disk) < engine.layout.num_chunks
    ref = ReferenceTrainer(model(), optimizer=HP, dtype=torch.float32, staleness=1)
    before = engine._disk_bytes()                      # (the initial masters went to disk at compile)
    for t, b in enumerate(batches):
        want, got = ref.step(b), engine.step(b)
        assert abs(want - got) <= 1e-5 * abs(want), (t, want, got)
    engine._apply_queued_updates()
    per_update = len(on_disk) * 3 * engine.layout.chunk_size * 4
    read, written = (now - then for now, then in zip(engine._disk_bytes(), before))
    assert read == written == per_update * steps, (read, written, per_update)
    ref.flush()
    worst, name = tracking_of(engine.state_dict()["master"], ref, fresh_masters("gpt", torch.float32, n_layer=4,
                                                                                d_model=128))
    assert worst <= TRACKING_TOL, f"{name} tracks delayed-gradient PyTorch to {worst:.3g}"
    engine.close()
    assert not _update_threads() and list(tmp_path.iterdir()) == []


def _budget_of(model, mode: str) -> int:
    b = make_batches("gpt", 1, batch=2, seq=32)[0]
    return pscompile.min_device_memory(model(), b, _config(mode)) + 2 * 2048 * 4


def test_a_host_too_small_for_the_gradient_buffers_is_named():
    b = make_batches("gpt", 1)[0]
    numel = sum(p.numel() for p in make_model("gpt").parameters())
    host = numel * 16 + 8 * 2048 * 4        # the chunks and their states fit; the buffer sets do not
    with pytest.raises(ValueError) as e:
        pscompile.compile(make_model("gpt"), b, config=_config("hooks", host_memory=host))
    assert "gradient buffer sets" in str(e.value) and "staleness" in str(e.value)
