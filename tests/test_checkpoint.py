"""Checkpoints (``pscompile.save`` / ``pscompile.load``): exact resume, and nothing half-loaded.

- 2N steps == the same run saved after N steps + a new process + load + N steps, bit for bit
  (losses, fp32 masters, Adam states; saving changes nothing in the run that saves): GPT with dropout, both modes, fp32 and bf16, with a budget that evicts every step;
- a truncated, corrupted or foreign file, and a checkpoint of another dtype or model, are refused
  with an error that names the file or every difference, and the engine is left as it was;
- the file is replaced atomically (no temporary is left behind);
- a failed step leaves the random number generator where it was.
"""

from __future__ import annotations

import dataclasses
import os
import multiprocessing as mp

import pytest
import torch

import ckpt_worker
import pscompile
from pscompile.compiled import trust
from conftest import make_batches, make_model, rewrite_checkpoint, same_state, snapshot

N = 3
SETTLED = 3          # steps after which a compiled engine runs its program (the first measures)


def _spawn(*args, **kwargs) -> None:
    p = mp.get_context("spawn").Process(target=ckpt_worker.run, args=args, kwargs=kwargs)
    p.start()
    p.join(300)
    assert p.exitcode == 0, f"worker exited with {p.exitcode}"


def _budget(mode: str, dtype: str) -> int:
    """Between the minimum and what keeping everything resident needs: chunks move every step."""
    least = pscompile.min_device_memory(make_model("gpt", dropout=ckpt_worker.DROPOUT), make_batches("gpt", 1)[0],
                                        ckpt_worker.config(mode, dtype, None))
    return int(least * 1.1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_save_then_load_in_a_new_process_resumes_bit_for_bit(tmp_path, mode, dtype):
    budget = _budget(mode, dtype)
    ckpt = tmp_path / "run.ckpt"
    # the uninterrupted run, which saves after N steps, here; the resumed one in a new process
    ckpt_worker.run(mode, dtype, budget, 123, range(2 * N), str(tmp_path / "whole.pt"), save=str(ckpt), save_after=N)
    _spawn(mode, dtype, budget, 999, range(N, 2 * N), str(tmp_path / "second.pt"), load=str(ckpt))
    whole, second = (torch.load(tmp_path / f, weights_only=False) for f in ("whole.pt", "second.pt"))
    assert second["losses"] == whole["losses"][N:], (second["losses"], whole["losses"][N:])   # dropout included
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for f, t in whole["state"][key].items():
            assert torch.equal(second["state"][key][f], t), (key, f)
    assert second["state"]["step"] == whole["state"]["step"] == 2 * N
    assert min(whole["evictions"] + second["evictions"]) > 0, "the budget must evict every step"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left


def test_inductor_resume_is_exact_the_checkpoint_carries_the_measurements(tmp_path, monkeypatch):
    """A new engine would measure its first step node by node: the checkpoint carries the measured
    curves (with the re-plans for Inductor's buffers) and the optimizer-state placement, so the
    resumed engine plans and compiles the same program and runs it from its first step (the run
    starts warm, ``_warm_start``): bit for bit the uninterrupted run. Inductor's CPU embedding backward
    adds with atomics: two identical runs differ in the tied embedding unless deterministic
    algorithms are on, as for any bitwise reproducibility."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    from pscompile.compiled import engine as compiled_engine
    from pscompile.memory.rates import Rates
    # every engine here weighs activations with the same rates (measured ones differ on a busy
    # machine and may choose otherwise; a resumed engine takes the saved run's, the test below)
    monkeypatch.setattr(compiled_engine, "measure_rates", lambda *a, **k: Rates(1e10, 1e8))
    try:
        _inductor_resume(tmp_path)
    finally:
        torch.use_deterministic_algorithms(was)


def _inductor_resume(tmp_path):
    # saved after the program ran: the first step measures node by node, and where Inductor's buffers
    # do not fit the plan the capture is planned again (at most _MAX_PROGRAM_ROUNDS times), its run
    # then compiled eager; how many rounds depends on the measured curve, so the run settles first
    from pscompile.compiled.lowering import _MAX_PROGRAM_ROUNDS
    batches = make_batches("gpt", SETTLED + _MAX_PROGRAM_ROUNDS + N)

    def engine(budget=None):
        return pscompile.compile(make_model("gpt", dropout=0.1), batches[0], optimizer=ckpt_worker.HP,
                                 config=pscompile.Config(mode="compiled", backend="inductor", device="cpu",
                                                         dtype=torch.float32, device_memory=budget))
    budget = int(pscompile.min_device_memory(make_model("gpt", dropout=0.1), batches[0], engine().config) * 1.1)
    torch.manual_seed(0)
    first = engine(budget)
    settled = 0
    while settled < SETTLED or first.stats.compiled_share < 1.0:
        assert settled < SETTLED + _MAX_PROGRAM_ROUNDS and not any(c.eager_reason for c in first.captures()), \
            (settled, first.captures())
        first.step(batches[settled])
        settled += 1
    pscompile.save(first, tmp_path / "i.ckpt")
    # the uninterrupted run: the engine that saved goes on (saving changes nothing in it); then a new
    # engine loads (the random generator's state with it: dropout draws the same masks)
    rest = batches[settled:settled + N]
    losses = [first.step(b) for b in rest]
    resumed = engine(budget)
    pscompile.load(resumed, tmp_path / "i.ckpt")
    after = [resumed.step(b) for b in rest]
    # no measuring step (node by node) after the load: the curves came with the checkpoint, and the
    # same program runs from the first step on: bit for bit
    assert after == losses, (after, losses)
    assert resumed.stats.compiled_share == 1.0, resumed.captures()
    a, b = resumed.state_dict()["master"], first.state_dict()["master"]
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert first.stats.num_evictions > 0


def test_a_resumed_engine_chooses_activations_with_the_saved_rates(tmp_path, monkeypatch):
    """activations="auto" weighs recomputing against offloading with rates measured once per
    engine; on a busy machine a resumed engine could measure others and choose another way, whose
    kernels round differently (Inductor). The checkpoint carries the rates: the resumed engine plans
    the saved run's schedule even when its own measurement says otherwise."""
    from pscompile.compiled import engine as compiled_engine
    from pscompile.memory.rates import Rates
    from test_offload import DROPOUT, _config, _minimum
    fast, slow = Rates(flops_per_s=1e12, link_bytes_per_s=1e12), Rates(flops_per_s=1e12, link_bytes_per_s=1e6)
    keep, least = _minimum("bert", "keep"), _minimum("bert", "auto")
    config = dataclasses.replace(_config("auto"), device_memory=keep - (keep - least) // 3)
    batches = make_batches("bert", 2 * N)

    def engine(rates):
        monkeypatch.setattr(compiled_engine, "measure_rates", lambda *a, **k: rates)
        return pscompile.compile(make_model("bert", dropout=DROPOUT), batches[0], config=config)
    torch.manual_seed(0)
    first = engine(fast)
    for b in batches[:N]:
        first.step(b)
    assert "offloaded" in str(first.schedule).split("# activations")[1].splitlines()[0]
    pscompile.save(first, tmp_path / "r.ckpt")
    rng = torch.get_rng_state()                       # dropout draws from the global generator
    expected = [first.step(b) for b in batches[N:]]
    resumed = engine(slow)
    pscompile.load(resumed, tmp_path / "r.ckpt")
    assert resumed.rates == fast
    torch.set_rng_state(rng)
    assert [resumed.step(b) for b in batches[N:]] == expected
    assert str(resumed.schedule).split("# passes")[0] == str(first.schedule).split("# passes")[0]


def _engine(dtype=torch.float32, **model_kw):
    batch = make_batches("gpt", 1)[0]
    return pscompile.compile(make_model("gpt", **model_kw), batch, config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=dtype)), batch




def test_broken_or_foreign_checkpoints_are_refused_and_nothing_is_loaded(tmp_path):
    engine, batch = _engine()
    engine.step(batch)
    path = pscompile.save(engine, tmp_path / "a.ckpt")
    data = path.read_bytes()
    other, _ = _engine()
    before = snapshot(other)
    rng = torch.get_rng_state()
    cases = {
        "truncated": (data[: len(data) // 2], "not a complete pscompile checkpoint"),
        "corrupted": (data[:-200] + bytes(b ^ 0xFF for b in data[-200:-100]) + data[-100:], "corrupted|not a complete"),
        "empty": (b"", "not a complete pscompile checkpoint"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / f"{name}.ckpt"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message) as err:
            pscompile.load(other, bad)
        assert str(bad) in str(err.value) and "nothing was loaded" in str(err.value), name
    # one data byte flipped in an intact file: only the checksum can tell
    body = bytearray(data)
    body[len(body) // 2] ^= 0x01
    (tmp_path / "flipped.ckpt").write_bytes(bytes(body))
    with pytest.raises(ValueError, match="is corrupted \\(the SHA-256"):
        pscompile.load(other, tmp_path / "flipped.ckpt")
    torch.save(engine.state_dict(), tmp_path / "plain.pt")                 # a state dict, not a checkpoint
    with pytest.raises(ValueError, match="not a pscompile checkpoint"):
        pscompile.load(other, tmp_path / "plain.pt")
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        pscompile.load(other, tmp_path / "missing.ckpt")
    wide, _ = _engine(d_model=96)                                         # another model
    with pytest.raises(ValueError, match="does not fit this engine") as err:
        pscompile.load(wide, path)
    assert "shape of wte.weight: checkpoint (256, 64), engine (256, 96)" in str(err.value)
    bf16, _ = _engine(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute dtype: checkpoint 'float32', engine 'bfloat16'"):
        pscompile.load(bf16, path)
    assert same_state(snapshot(other), before) and torch.equal(torch.get_rng_state(), rng)
    pscompile.load(other, path)                                           # the good one loads
    assert same_state(snapshot(other), snapshot(engine))


def test_save_replaces_the_file_atomically(tmp_path):
    engine, batch = _engine()
    path = tmp_path / "run.ckpt"
    pscompile.save(engine, path)
    first = path.read_bytes()
    engine.step(batch)
    pscompile.save(engine, path)
    assert path.read_bytes() != first and sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_failed_step_leaves_the_random_numbers_where_they_were(mode):
    batch = make_batches("gpt", 1)[0]
    engine = pscompile.compile(make_model("gpt", dropout=0.1), batch, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32))
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    bad = (batch[0][:, :32], batch[1])             # the targets no longer match the tokens
    with pytest.raises(Exception):
        engine.step(bad)
    assert torch.equal(torch.get_rng_state(), rng)
    loss = engine.step(batch)
    fresh = pscompile.compile(make_model("gpt", dropout=0.1), batch, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32))
    torch.manual_seed(5)
    assert fresh.step(batch) == loss               # as if the failed step had never happened


def test_a_checkpoint_that_passes_its_checksum_is_still_checked_field_by_field(tmp_path):
    """Tampered files with a recomputed checksum (missing step, negative step, NaN masters, a
    wrong-size RNG state, a wrong-size chunk) are refused naming the field, the engine and the
    random numbers unchanged."""
    engine, batch = _engine()
    engine.step(batch)
    path = pscompile.save(engine, tmp_path / "a.ckpt")
    other, _ = _engine()
    before, rng = snapshot(other), torch.get_rng_state()

    def state(**changes):
        return lambda h: {**h, "state": {**{k: v for k, v in h["state"].items() if k not in changes},
                                         **{k: v for k, v in changes.items() if v is not None}}}

    def tensor(name, value):
        return lambda ts: {**ts, name: value(ts[name])}
    cases = {
        "no-step": (dict(header=state(step=None)), "state_dict\\['step'\\]"),
        "negative-step": (dict(header=state(step=-5)), "state_dict\\['step'\\].*got -5"),
        "nan-master": (dict(tensors=tensor("master.0", lambda t: torch.full_like(t, float("nan")))),
                       "master.0 \\(the fp32 master of chunk 0\\) holds inf or NaN"),
        "short-rng": (dict(tensors=tensor("rng.cpu", lambda t: t[:-8])), "rng\\['cpu'\\]: a torch.uint8 tensor"),
        "short-chunk": (dict(tensors=tensor("exp_avg.1", lambda t: t[:-1])), "does not fit|cannot fill"),
    }
    for name, (change, message) in cases.items():
        rewrite_checkpoint(path, tmp_path / f"{name}.ckpt", **change)
        with pytest.raises(ValueError, match=message):
            pscompile.load(other, tmp_path / f"{name}.ckpt")
    assert same_state(snapshot(other), before) and torch.equal(torch.get_rng_state(), rng)


def test_save_never_writes_through_a_planted_link_and_removes_what_a_killed_save_left(tmp_path):
    engine, _ = _engine()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in (f".run.ckpt.tmp{os.getpid()}", ".run.ckpt.tmp"):        # the old, predictable names
        (tmp_path / name).symlink_to(victim)
    (tmp_path / ".run.ckpt.abc123.pscompile-tmp").write_bytes(b"x" * 1000)   # a killed save's temporary
    pscompile.save(engine, tmp_path / "run.ckpt")
    assert victim.read_text() == "keep me"
    assert not (tmp_path / ".run.ckpt.abc123.pscompile-tmp").exists()
    other, _ = _engine()
    pscompile.load(other, tmp_path / "run.ckpt")


def test_a_version_1_checkpoint_still_loads(tmp_path):
    """The format before streaming (a torch.save envelope around a torch.save payload) loads."""
    from pscompile.saving import _meta
    from pscompile.checkpoint.legacy import envelope
    from pscompile.runtime.rng import rng_state
    engine, batch = _engine()
    engine.step(batch)
    payload = {"state": engine.state_dict(), "rng": rng_state(engine.device), "meta": _meta(engine)}
    (tmp_path / "v1.ckpt").write_bytes(envelope(payload))
    other, _ = _engine()
    pscompile.load(other, tmp_path / "v1.ckpt")
    assert same_state(snapshot(other), snapshot(engine))


@pytest.mark.parametrize("after_tensors", [0, 7])
def test_a_process_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path, after_tensors):
    """One process dies (no cleanup) while streaming its second save over the first: the file is
    still the first save, which loads; the killed save's temporary is removed by the next save."""
    path = tmp_path / "run.ckpt"
    p = mp.get_context("spawn").Process(target=ckpt_worker.killed_save,
                                        args=(str(path), str(tmp_path / "state1.pt"), after_tensors))
    p.start()
    p.join(300)
    assert p.exitcode == 0
    leftovers = [f for f in tmp_path.iterdir() if f.name.startswith(".run.ckpt.")]
    assert len(leftovers) == 1, "the killed save left no temporary: it did not die mid-write"
    engine = pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0], optimizer=ckpt_worker.HP,
                               config=ckpt_worker.config("hooks", "float32", None))
    pscompile.load(engine, path)
    want = torch.load(tmp_path / "state1.pt", weights_only=True)
    got = engine.state_dict()
    assert got["step"] == want["step"] == 1
    assert all(torch.equal(got["master"][f], want["master"][f]) for f in want["master"])
    pscompile.save(engine, path)
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".run.ckpt.")]


def test_measurements_in_a_checkpoint_are_planned_with_only_under_this_machines_tag(tmp_path, caplog, monkeypatch):
    """A checkpoint whose compiled-mode measurements were rewritten to nothing (checksum
    recomputed), one whose tag was removed, and an honest one read with another key: none of them
    is planned with; the engine measures again as a fresh one does, no step runs over the budget,
    and the losses are the uninterrupted run's (eager code: plans move bytes, not numbers). An
    honest checkpoint's measurements are kept (the resumed engine does not measure again)."""
    import logging
    batches = make_batches("gpt", 6, distinct=3)
    cfg = ckpt_worker.config("compiled", "float32", None)
    budget = int(pscompile.min_device_memory(make_model("gpt"), batches[0], cfg) * 1.1)
    cfg = ckpt_worker.config("compiled", "float32", budget)

    def engine():
        torch.manual_seed(0)
        return pscompile.compile(make_model("gpt"), batches[0], optimizer=ckpt_worker.HP, config=cfg)
    whole = engine()
    losses = [whole.step(b) for b in batches]
    first = engine()
    for b in batches[:2]:
        first.step(b)
    pscompile.save(first, tmp_path / "honest.ckpt")

    def understate(h):
        caps = h["state"]["compiled"]["captures"]
        assert caps, "no measurements saved: proves nothing"
        for c in caps.values():
            c["measured"], c["node"] = [0] * len(c["measured"]), [0] * len(c["node"])
        return h

    def untag(h):
        del h["state"]["compiled"]["tag"]
        return h
    def reseal(h):         # understated, and tagged with this user's key: the machine changed in
        compiled = understate(h)["state"]["compiled"]          # a way the tag does not see
        h["state"]["compiled"] = trust.seal({k: v for k, v in compiled.items() if k != "tag"}, first.device)
        return h
    rewrite_checkpoint(tmp_path / "honest.ckpt", tmp_path / "understated.ckpt", header=understate)
    rewrite_checkpoint(tmp_path / "honest.ckpt", tmp_path / "untagged.ckpt", header=untag)
    rewrite_checkpoint(tmp_path / "honest.ckpt", tmp_path / "resealed.ckpt", header=reseal)
    for name, key in (("honest", None), ("resealed", None), ("understated", None), ("untagged", None),
                      ("honest", "other")):
        if key is not None:
            monkeypatch.setenv("PSCOMPILE_KEY_FILE", str(tmp_path / f"{key}.key"))
        resumed = engine()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pscompile"):
            pscompile.load(resumed, tmp_path / f"{name}.ckpt")
        trusted = name in ("honest", "resealed") and key is None
        assert any("measures again" in m for m in caplog.messages) != trusted, (name, key, caplog.messages)
        measured = [c for c in resumed.captures() if c.stage != "static"]
        assert bool(measured or resumed._restored) == trusted, (name, key)
        got = []
        with caplog.at_level(logging.INFO, logger="pscompile"):
            for b in batches[2:]:        # every step within the budget, the first included: a run
                got.append(resumed.step(b))   # planned with understated figures stops and runs again
                assert resumed.stats.peak_device_bytes <= budget, (name, key)
        assert got == losses[2:], (name, key)
        dropped = any("understate" in m for m in caplog.messages)
        assert dropped == (name == "resealed"), (name, key, caplog.messages)
