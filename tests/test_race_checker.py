"""The copy contract and its race checker (``memory/copies.py``, ``memory/strict_copies.py``).

The checker lands every copy at the latest moment the contract allows: destinations are poisoned
from the submit to the wait, sources read only at the wait, and memory freed or reused while a copy
owns it raises. The whole suite runs under it (tests/conftest.py); these tests pin down what it
does, and break the engine on purpose to show it catches what a real copy stream would get wrong.
"""

from __future__ import annotations

import pytest
import torch

import pscompile
from conftest import make_batches, make_model
from pscompile.kinds import MemKind
from pscompile.memory.copies import CopyRaceError, ThreadCopies
from pscompile.memory.copy_engines import make_copy_engine
from pscompile.memory.strict_copies import StrictCopies
from pscompile.memory.tiers import Link
from pscompile.testing import ReferenceTrainer


def test_a_destination_is_poison_until_its_wait_and_a_source_is_read_at_the_wait():
    q = StrictCopies(Link())
    src, dst = torch.ones(8), torch.zeros(8)
    copy = q.submit(dst, src, "h2d", node="fetch_3")
    assert torch.isnan(dst).all() and not copy.done()
    src.fill_(2.0)                                  # written after the submit: the copy sees it
    copy.wait()
    assert torch.equal(dst, torch.full((8,), 2.0)) and copy.done()
    assert (q.link.traffic.h2d_bytes, q.link.traffic.d2h_bytes) == (32, 0)
    ints = torch.zeros(4, dtype=torch.int64)
    q.submit(ints, torch.arange(4), "h2d")
    assert (ints != torch.arange(4)).all()           # integer data gets a pattern no copy writes
    q.flush()
    assert torch.equal(ints, torch.arange(4))


def test_copies_of_a_direction_land_in_order_and_after_orders_across_directions():
    q = StrictCopies(Link())
    x = torch.empty(4)
    q.submit(x, torch.full((4,), 1.0), "h2d")
    last = q.submit(x, torch.full((4,), 2.0), "h2d")     # same direction, same memory: ordered
    last.wait()
    assert x[0].item() == 2.0
    home, slot, fetched = torch.zeros(4), torch.full((4,), 7.0), torch.empty(4)
    wb = q.submit(home, slot, "d2h", node="writeback_1")
    q.submit(fetched, home, "h2d", after=wb, node="fetch_2").wait()   # lands the writeback first
    assert torch.equal(fetched, slot) and wb.done()


def test_a_compute_side_wait_does_not_show_a_device_to_host_copy_to_the_host():
    """On a GPU, compute waits on the copy's event while the host runs on: the host reads a d2h
    destination only after a host-side wait (on it, on a later copy of its direction or on one
    submitted after its compute-side wait) or ``sync_compute``."""
    q = StrictCopies(Link())
    home, slot = torch.zeros(4), torch.full((4,), 3.0)
    q.submit(home, slot, "d2h", node="writeback_1").wait()
    slot.fill_(9.0)                         # compute may reuse the source after its wait ...
    assert torch.isnan(home).all()          # ... but the host does not see the copy yet
    q.sync_compute()
    assert torch.equal(home, torch.full((4,), 3.0))
    a, b = torch.zeros(4), torch.zeros(4)
    q.submit(a, torch.ones(4), "d2h").wait()
    q.submit(b, torch.ones(4), "h2d").wait_host()       # submitted after a's compute-side wait
    assert torch.equal(a, torch.ones(4))


def test_the_host_may_not_write_a_host_to_device_source_before_it_knows_the_copy_landed():
    """A host write to an h2d copy's source after only a compute-side wait races the copy on a GPU
    (the first GPU run's hooks path zeroed the host gradient a device-side update was still
    reading); a copy ordered after it on the streams may overwrite it."""
    q = StrictCopies(Link())
    src, dst = torch.ones(8), torch.zeros(8)
    q.submit(dst, src, "h2d", node="fetch_1").wait()
    src.zero_()                                          # the host reuses the buffer too soon
    with pytest.raises(CopyRaceError, match="host wrote the source of the h2d copy of node fetch_1"):
        q.sync_compute()
    src.fill_(1.0)
    q.submit(dst, src, "h2d", node="fetch_2").wait_host()
    src.zero_()                                          # known landed: fine
    q.submit(dst, src, "h2d", node="fetch_3").wait()
    q.submit(src, torch.full((8,), 2.0), "d2h", node="grad_3").wait_host()    # ordered after fetch_3
    assert torch.equal(src, torch.full((8,), 2.0)) and torch.equal(dst, torch.zeros(8))
    q.flush()


def test_memory_a_copy_owns_may_not_be_freed_or_reused_before_its_wait():
    q = StrictCopies(Link())
    home, slot = torch.zeros(16), torch.ones(16)
    q.submit(home, slot, "d2h", node="writeback_5")
    with pytest.raises(CopyRaceError, match="node drop_5 frees memory the d2h copy of node writeback_5"):
        q.check_free(slot[4:8], node="drop_5")
    q.check_free(torch.ones(16), node="drop_6")       # other memory: fine
    with pytest.raises(CopyRaceError, match="fetch_9 uses memory that the d2h copy of node writeback_5"):
        q.submit(home[:4], torch.ones(4), "h2d", node="fetch_9")     # reads a home still being written
    q.flush()
    q.check_free(slot, node="drop_5")                # landed: free to go


def test_the_engine_picks_its_copy_engine_from_config_and_environment(monkeypatch):
    link = Link()
    monkeypatch.setenv("PSCOMPILE_STRICT_COPIES", "0")
    assert type(make_copy_engine(link, torch.device("cpu"))) is ThreadCopies
    assert type(make_copy_engine(link, torch.device("cpu"), strict=True)) is StrictCopies
    monkeypatch.setenv("PSCOMPILE_STRICT_COPIES", "1")
    assert type(make_copy_engine(link, torch.device("cpu"))) is StrictCopies
    with pytest.raises(ValueError, match="strict_copies='yes' must be True or False"):
        pscompile.Config(strict_copies="yes")


def _tight_engine(mode: str = "compiled"):
    """A GPT whose schedule prefetches, writes back and drops every step (2 chunks over the minimum)."""
    batch = make_batches("gpt", 1)[0]
    probe = pscompile.compile(make_model("gpt"), batch, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32, chunk_size=2048))
    probe.step(batch)
    budget = probe.min_device_memory + 2 * 2048 * 4
    probe.close()
    engine = pscompile.compile(make_model("gpt"), batch, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32, chunk_size=2048, device_memory=budget,
        strict_copies=True))
    assert isinstance(engine.copies, StrictCopies)
    return engine, batch


def test_a_correct_schedule_passes_the_checker_and_tracks_plain_pytorch():
    engine, batch = _tight_engine()
    ref = ReferenceTrainer(make_model("gpt"), optimizer=pscompile.AdamW(), dtype=torch.float32)
    for _ in range(3):
        ours, theirs = engine.step(batch), ref.step(batch)
        assert ours == pytest.approx(theirs, rel=1e-5)
    plan = engine.last_plan
    assert plan.h2d_bytes > 0 and plan.d2h_bytes > 0, "the budget must make chunks move both ways"
    assert engine.copies.copies_landed > 0


def test_a_dropped_wait_computes_on_poison(monkeypatch):
    """Break on purpose: the executor skips the step's last prefetch ``wait`` (a wait whose fetch no
    later wait of the same direction covers). Under the checker the backward reads the slot as NaN,
    and the step is refused before its update (a real stream might land the copy in time, or not)."""
    engine, batch = _tight_engine()
    ref = ReferenceTrainer(make_model("gpt"), optimizer=pscompile.AdamW(), dtype=torch.float32)
    run = engine.moves.run
    waits: list[str] = []
    drop: list[str] = []

    def without_one_wait(mem, args, at_end=False, node=None):
        if mem.kind == MemKind.WAIT and mem.slot is not None:
            waits.append(node)
            if node in drop:
                return None                          # the wait forgotten: the copy stays in flight
        return run(mem, args, at_end=at_end, node=node)
    monkeypatch.setattr(engine.moves, "run", without_one_wait)
    for _ in range(2):                               # measured, then the steady schedule
        waits.clear()
        assert engine.step(batch) == pytest.approx(ref.step(batch), rel=1e-5)
    drop.append(waits[-1])
    with pytest.raises(FloatingPointError, match="the gradients contain inf/NaN"):
        engine.step(batch)


def test_a_drop_before_its_writeback_landed_raises_naming_the_node(monkeypatch):
    """Break on purpose: a ``drop`` gives its slot back without waiting for the writeback reading
    it. The checker raises at the drop, naming it and the writeback."""
    engine, batch = _tight_engine()
    engine.step(batch)

    class Forgetful(dict):
        def pop(self, key, default=None):          # the drop no longer finds the writeback to wait for
            super().pop(key, default)
            return None
    monkeypatch.setattr(engine.moves, "_reading", Forgetful())
    with pytest.raises(CopyRaceError, match=r"node drop\w* frees memory the d2h copy of node writeback\w* still owns"):
        engine.step(batch)


def test_hooks_mode_moves_are_synchronous_and_pass_the_checker():
    engine, batch = _tight_engine("hooks")
    ref = ReferenceTrainer(make_model("gpt"), optimizer=pscompile.AdamW(), dtype=torch.float32)
    for _ in range(2):
        assert engine.step(batch) == pytest.approx(ref.step(batch), rel=1e-5)
    assert engine.stats.bytes_moved > 0 and engine.copies.copies_landed > 0
