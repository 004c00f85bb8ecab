"""Every byte that crosses between the device and the host is counted: in a step's StepStats, or in
``engine.setup_traffic`` for what moves outside steps (placing optimizer states, filling the slots
of device-updated chunks, hooks mode's trace, undoing a failed step, state dicts)."""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.testing import tiny_model


def _engine(mode: str, budget=None):
    model, batch = tiny_model("gpt")
    return pscompile.compile(model, batch, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget)), batch


def test_compiled_placement_bytes_are_counted():
    """Unlimited budget: every chunk's optimizer states move to the device (3 fp32 buffers over its
    state extent), exactly those bytes are counted, host to device; its parameter chunk, now homed
    on the device, is cast from the master there and crosses nothing (its host copy is given back)."""
    engine, _ = _engine("compiled")
    assert engine.setup_traffic.h2d_bytes == 3 * 4 * engine.layout.state_numel
    assert engine.store.host_model_bytes() == 0
    assert engine.setup_traffic.d2h_bytes == 0


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_state_dict_of_device_states_crosses_the_link(mode):
    engine, batch = _engine(mode)
    engine.step(batch)
    before = engine.setup_traffic.d2h_bytes
    engine.state_dict()
    assert engine.setup_traffic.d2h_bytes - before == 3 * engine.layout.total_numel * 4


def test_step_traffic_is_not_setup_traffic():
    """A step's own bytes go to its StepStats and equal the plan; setup traffic does not move."""
    engine, batch = _engine("compiled")
    minimum = engine.min_device_memory
    engine.close()
    engine, batch = _engine("compiled", minimum + 2 * engine.store.param_chunk_bytes)
    setup = engine.setup_traffic.h2d_bytes + engine.setup_traffic.d2h_bytes
    engine.step(batch)                  # measuring step; may re-place states afterwards
    setup = engine.setup_traffic.h2d_bytes + engine.setup_traffic.d2h_bytes
    engine.step(batch)
    s = engine.stats
    assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes) != (0, 0)
    assert engine.setup_traffic.h2d_bytes + engine.setup_traffic.d2h_bytes == setup


def test_a_copy_holds_no_tensor_once_it_is_waited_on():
    """After ``wait()`` nothing of the queue still references the copied tensors: a gradient
    stored to the host or an offloaded activation dies where the plan says. (The pool's work item
    outlived the result for a moment on the worker thread: in a CI run the tracker saw an
    activation alive past its death, 64 KiB over the budget; with the old submit this loop found
    37 of 2,000 sources still alive.)"""
    import sys
    from torch.multiprocessing.reductions import StorageWeakRef
    from pscompile.memory.tiers import Link
    from pscompile.memory.copies import ThreadCopies
    q = ThreadCopies(Link())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)            # switch threads often: the window is a few bytecodes wide
    try:
        alive = 0
        for _ in range(2000):
            src, dst = torch.ones(64), torch.empty(64)
            ref = StorageWeakRef(src.untyped_storage())
            fut = q.submit(dst, src, "d2h")
            del src
            fut.wait()
            alive += not ref.expired()
        assert alive == 0, f"{alive} sources outlived their copy's wait()"
    finally:
        sys.setswitchinterval(interval)
        q.close()


def test_the_two_copy_engines_overlap_and_keep_their_order():
    """One copy engine per direction, like PCIe: over a 10 MB/s emulated link a 1 MB host->device
    copy and a 1 MB device->host copy take ~0.1 s together, not 0.2 s; copies of one direction
    keep their order; ``after`` holds a copy until one of the other direction has landed."""
    import time
    from pscompile.memory.tiers import Link
    from pscompile.memory.copies import ThreadCopies
    link = Link(bandwidth=10e6)
    q = ThreadCopies(link)
    a, b = torch.ones(250_000), torch.empty(250_000)        # 1 MB each
    c, d = torch.full((250_000,), 2.0), torch.empty(250_000)
    t = time.perf_counter()
    q.submit(b, a, "h2d")
    q.submit(d, c, "d2h")
    q.flush()
    both = time.perf_counter() - t
    assert 0.095 < both < 0.17, both
    assert (link.traffic.h2d_bytes, link.traffic.d2h_bytes) == (1_000_000, 1_000_000)
    # a writeback lands in `home`; the fetch that reads `home` after it must see its bytes
    home, slot, fetched = torch.zeros(250_000), torch.full((250_000,), 7.0), torch.empty(250_000)
    wb = q.submit(home, slot, "d2h")
    q.submit(fetched, home, "h2d", after=wb).wait()
    assert torch.equal(fetched, slot)
    order = []
    x = torch.empty(10)
    for k in range(5):
        q.submit(x, torch.full((10,), float(k)), "h2d").future.add_done_callback(lambda f, k=k: order.append(k))
    q.flush()
    assert order == list(range(5)) and x[0].item() == 4.0
    q.close()
