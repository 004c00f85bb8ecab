"""Failure atomicity: an exception anywhere inside ``step`` loses nothing.

Faults are injected at several points of a step that evicts (GPT with dropout, a budget just above
the minimum), in both modes: a ``KeyboardInterrupt`` between memory operations, one while an
asynchronous copy is in flight, an exception on the copy thread, a failure while gradients are
being stored. Each must leave the fp32 masters, the Adam states and the random number generator
as they were and no copy running; the next good steps then give, bit for bit, what an engine that
never saw the fault gives. Ctrl-C during the optimizer update (its commit) lets the update finish
and interrupts after it; any other failure inside the update stops the engine until a load.
"""

from __future__ import annotations

import signal

import pytest
import torch

import pscompile
from pscompile.graph.meta import get
from pscompile.graph.ops import MemKind
from conftest import make_batches, make_model

BATCHES = make_batches("gpt", 3)


def _config(mode: str, budget=None) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget,
                            chunk_size=2048 if mode == "hooks" else "auto")


def _pair(mode: str):
    """Two engines that should stay equal: one gets the faults, one does not."""
    least = pscompile.min_device_memory(make_model("gpt", dropout=0.1), BATCHES[0], _config(mode))
    budget = int(least * 1.05)
    engines = [pscompile.compile(make_model("gpt", dropout=0.1), BATCHES[0], config=_config(mode, budget))
               for _ in range(2)]
    for e in engines:
        torch.manual_seed(0)
        e.step(BATCHES[0])
        assert e.stats.num_evictions > 0
    return engines


def _state(engine) -> dict:
    sd = engine.state_dict()
    return {f"{k}.{f}": t.clone() for k in ("master", "exp_avg", "exp_avg_sq") for f, t in sd[k].items()} | \
        {"step": sd["step"]}


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        assert same, f"{what}: {k} differs"


def _assert_idle(engine) -> None:
    """No copy left queued or running, nothing in flight."""
    assert engine.copies.idle()
    moves = getattr(engine, "moves", None)          # (compiled mode's slots and their copies)
    assert moves is None or moves.idle()


def _continue_alike(faulty, clean) -> None:
    for i, b in enumerate(BATCHES[1:]):
        torch.manual_seed(10 + i)
        want = clean.step(b)
        torch.manual_seed(10 + i)
        assert faulty.step(b) == want, f"step {i + 1} after the fault differs"
    _assert_same(_state(faulty), _state(clean), "after the fault")


def _fails(engine, error) -> None:
    before, rng = _state(engine), torch.get_rng_state()
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    with pytest.raises(error):
        engine.step(BATCHES[1])
    assert torch.equal(torch.get_rng_state(), rng), "the failed step moved the random number generator"
    _assert_same(before, _state(engine), "the failed step")
    _assert_idle(engine)


# ------------------------------------------------------------------------------ compiled mode
def _after_region_stores(engine, nth: int, error: BaseException):
    """Raise ``error`` right after the eager region that runs the ``nth`` gradient store into a
    device slot (its copies done: the slots hold gradients). Returns what puts the region back."""
    real_for, broken = engine._executor_for, []

    def executor_for(key, sched, *args, **kw):
        ex = real_for(key, sched, *args, **kw)
        if ex.split == "regions" and not broken:
            seen = 0
            for r in ex.regions:
                seen += len(r.effects)
                if seen >= nth:
                    fn = r.fn

                    def failing(args, fn=fn):
                        fn(args)
                        raise error
                    r.fn = failing
                    broken.append((r, fn))
                    break
        return ex
    engine._executor_for = executor_for

    def restore():
        assert broken, "no region runs gradient stores"
        for r, fn in broken:
            r.fn = fn
        engine.__dict__.pop("_executor_for")
    return restore


def _on_memory_node(engine, kind: MemKind, nth: int, error: BaseException, *, after: bool = False):
    """Raise ``error`` at the ``nth`` memory node of ``kind`` (after performing it: ``after``)."""
    real, seen = engine.moves.run, [0]

    def run(mem, args, **kw):
        if mem.kind == kind:
            seen[0] += 1
            if seen[0] == nth:
                if after:
                    real(mem, args, **kw)
                raise error
        return real(mem, args, **kw)
    engine.moves.run = run
    return lambda: seen[0]


def _kinds(engine) -> list[MemKind]:
    return [get(n, "mem").kind for n in engine.schedule.gm.graph.nodes if get(n, "mem") is not None]


@pytest.mark.parametrize("point", ["interrupt between fetches", "interrupt with a writeback in flight",
                                   "failure storing gradients", "failure on the copy thread"])
def test_compiled_step_loses_nothing_wherever_it_fails(point):
    faulty, clean = _pair("compiled")
    kinds = _kinds(faulty)
    if point == "interrupt between fetches":
        _on_memory_node(faulty, MemKind.FETCH, kinds.count(MemKind.FETCH) // 2, KeyboardInterrupt())
        error = KeyboardInterrupt
    elif point == "interrupt with a writeback in flight":
        assert MemKind.WRITEBACK in kinds
        real_copy = faulty.link.copy
        slow = []

        def copy(dst, src, direction, activation=False, **kw):      # the copy thread is still at it...
            if direction == "d2h" and not activation and not slow:
                slow.append(1)
                import time
                time.sleep(0.2)
            return real_copy(dst, src, direction, activation, **kw)
        faulty.link.copy = copy
        _on_memory_node(faulty, MemKind.WRITEBACK, 1, KeyboardInterrupt(), after=True)   # ...when Ctrl-C lands
        error = KeyboardInterrupt
    elif point == "failure storing gradients":
        n = sum(k.name.startswith("STORE") for k in kinds)
        assert n >= 3
        restore = _after_region_stores(faulty, 3, RuntimeError("injected"))
        _fails(faulty, RuntimeError)
        restore()
        _continue_alike(faulty, clean)
        return
    else:
        real_copy, calls = faulty.link.copy, [0]

        def copy(dst, src, direction, activation=False, **kw):      # runs on a copy engine's thread
            calls[0] += 1
            if calls[0] == 4:
                raise RuntimeError("injected copy failure")
            return real_copy(dst, src, direction, activation, **kw)
        faulty.link.copy = copy
        error = RuntimeError
    _fails(faulty, error)
    faulty.moves.__dict__.pop("run", None)
    faulty.link.__dict__.pop("copy", None)
    _continue_alike(faulty, clean)


# ------------------------------------------------------------------------------ hooks mode
@pytest.mark.parametrize("point", ["interrupt between fetches", "failure evicting", "failure on a copy"])
def test_hooks_step_loses_nothing_wherever_it_fails(point):
    faulty, clean = _pair("hooks")
    target, name, nth, error = {
        "interrupt between fetches": (faulty.store, "fetch", 4, KeyboardInterrupt),
        "failure evicting": (faulty.store, "evict", 3, RuntimeError),
        "failure on a copy": (faulty.link, "copy", 6, RuntimeError),
    }[point]
    real, seen = getattr(target, name), [0]

    def inject(*args, **kwargs):
        seen[0] += 1
        if seen[0] == nth:
            raise error("injected")
        return real(*args, **kwargs)
    setattr(target, name, inject)
    _fails(faulty, error)
    assert seen[0] >= nth
    delattr(target, name)
    _continue_alike(faulty, clean)


# ------------------------------------------------------------------------------ the update
@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler, even where the shell started pytest with SIGINT ignored
    (a background job of a shell without job control inherits SIG_IGN, and so does CI)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_ctrl_c_during_the_update_finishes_it_then_interrupts(mode, python_sigint):
    faulty, clean = _pair(mode)
    real, calls = faulty.adam.update_chunk, [0]

    def update(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            signal.raise_signal(signal.SIGINT)     # Ctrl-C while the second chunk updates
        return real(*args, **kwargs)
    faulty.adam.update_chunk = update
    torch.manual_seed(5)
    with pytest.raises(KeyboardInterrupt):
        faulty.step(BATCHES[1])
    assert calls[0] > 2, "the update did not finish"
    torch.manual_seed(5)
    clean.step(BATCHES[1])
    _assert_same(_state(faulty), _state(clean), "the update Ctrl-C interrupted")
    del faulty.adam.update_chunk
    _assert_idle(faulty)
    torch.manual_seed(6)
    want = clean.step(BATCHES[2])
    torch.manual_seed(6)
    assert faulty.step(BATCHES[2]) == want


def test_a_failure_inside_the_update_stops_the_engine_until_a_load(tmp_path):
    faulty, clean = _pair("hooks")
    pscompile.save(faulty, tmp_path / "good.ckpt")
    real, calls = faulty.adam.update_chunk, [0]

    def update(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("injected")
        return real(*args, **kwargs)
    faulty.adam.update_chunk = update
    with pytest.raises(MemoryError):
        faulty.step(BATCHES[1])
    del faulty.adam.update_chunk
    with pytest.raises(RuntimeError, match="failed inside the optimizer update .* load a checkpoint"):
        faulty.step(BATCHES[1])
    with pytest.raises(RuntimeError, match="failed inside the optimizer update"):
        pscompile.save(faulty, tmp_path / "partial.ckpt")
    pscompile.load(faulty, tmp_path / "good.ckpt")
    _continue_alike(faulty, clean)
