"""The disk tier in both modes: a GPT whose model data exceeds device + host memory trains with
``Config(disk_dir=...)`` step by step like plain PyTorch, the disk bytes are counted in the stats,
and nothing is left in the folder.

Device and host each get 30% of the model data, in both modes: the host holds every fp32 param
chunk (25% of the model data) plus three chunks of staged optimizer states, which fits because
chunks are small (tensors larger than a chunk span several, in compiled mode too)."""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.memory.tiers import Tier
from pscompile.testing import ReferenceTrainer
from conftest import (a_failed_step_changes_nothing, resumes_alike, tracking_tol, initial_masters, make_batches,
                      make_model, max_weight_diff, worst_tracking)

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _config(mode: str, **kw) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32,
                            chunk_size=8192 if mode == "hooks" else "auto", **kw)


def _model():
    return make_model("gpt", n_layer=4, d_model=128)          # model data well above its activations


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_model_larger_than_device_and_host_trains_like_plain_pytorch(mode, tmp_path):
    batches = make_batches("gpt", 6, batch=2, seq=32)
    probe = pscompile.compile(_model(), batches[0], config=_config(mode))
    model_bytes = probe.layout.num_chunks * probe.layout.chunk_size * 16      # 4 + 12 bytes per element
    probe.close()
    least = pscompile.min_device_memory(_model(), batches[0], _config(mode))
    device, host = max(least, int(0.3 * model_bytes)), int(0.3 * model_bytes)
    assert device + host < model_bytes, (device, host, model_bytes)
    engine = pscompile.compile(_model(), batches[0], optimizer=HP, config=_config(
        mode, device_memory=device, host_memory=host, disk_dir=str(tmp_path)))
    on_disk = [c for c, t in enumerate(engine.store.os_tier) if t is Tier.DISK]
    assert on_disk and engine.store.host_model_bytes() <= host
    ref = ReferenceTrainer(_model(), optimizer=HP, dtype=torch.float32)
    for b in batches:
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= 1e-5 * abs(a)
        s = engine.stats
        assert s.peak_device_bytes <= device
        assert s.disk_read_bytes == s.disk_write_bytes == len(on_disk) * 3 * engine.layout.chunk_size * 4
    assert max_weight_diff(engine, ref) <= 1e-4
    assert list(tmp_path.iterdir()) == []          # the file was unlinked when it was made
    engine.close()
    assert list(tmp_path.iterdir()) == []


def test_disk_homes_save_load_and_undo_a_failed_step(tmp_path):
    """State dicts read and write disk homes through their cache; a failed step restores the param
    chunks from masters on disk; a checkpoint resumes exactly into another disk-tier engine."""
    batches = make_batches("gpt", 3, batch=2, seq=32)
    folder = tmp_path / "disk"
    folder.mkdir()

    def engine():
        return pscompile.compile(_model(), batches[0], optimizer=HP, config=_config(
            "hooks", host_memory=5 << 20, disk_dir=str(folder)))
    a = engine()
    assert sum(t is Tier.DISK for t in a.store.os_tier) > 0
    a.step(batches[0])
    a_failed_step_changes_nothing(a, batches[1])
    resumes_alike(a, engine, batches[1:], tmp_path / "d.ckpt")
    assert list(folder.iterdir()) == []


def test_a_disk_failure_in_the_update_stops_the_engine_and_leaves_no_thread(tmp_path):
    """A read failing on the I/O thread in the middle of the update: the step raises it, every
    transfer has ended and every staging buffer is back, the engine refuses to go on until a load
    (part of the states were written), and after ``close`` neither the thread nor the file remains."""
    batches = make_batches("gpt", 2, batch=2, seq=32)
    folder = tmp_path / "disk"
    folder.mkdir()
    engine = pscompile.compile(_model(), batches[0], optimizer=HP, config=_config(
        "hooks", host_memory=5 << 20, disk_dir=str(folder)))
    engine.step(batches[0])
    pscompile.save(engine, tmp_path / "good.ckpt")
    file, calls = engine.store.disk.queue.file, [0]
    real = file.read

    def read(slot, dst):
        calls[0] += 1
        if calls[0] == 7:                       # the third disk chunk's first buffer
            raise OSError(5, "injected I/O error")
        return real(slot, dst)
    file.read = read
    with pytest.raises(OSError, match="injected I/O error"):
        engine.step(batches[1])
    del file.read
    disk = engine.store.disk
    assert disk.queue._pending == [] and not disk._reading and not disk._writing
    assert engine.store.host_os_pool.in_use == sum(t is Tier.HOST for t in engine.store.os_tier) * 3
    with pytest.raises(RuntimeError, match="failed inside the optimizer update"):
        engine.step(batches[1])
    pscompile.load(engine, tmp_path / "good.ckpt")
    engine.step(batches[1])
    thread = disk.queue._thread
    engine.close()
    assert not thread.is_alive() and list(folder.iterdir()) == []


def test_bf16_with_states_on_disk_tracks_plain_pytorch(tmp_path):
    batches = make_batches("gpt", 4, batch=2, seq=32)
    engine = pscompile.compile(_model(), batches[0], optimizer=HP, config=pscompile.Config(
        mode="hooks", device="cpu", dtype=torch.bfloat16, chunk_size=8192, host_memory=4 << 20,
        disk_dir=str(tmp_path)))
    assert sum(t is Tier.DISK for t in engine.store.os_tier) > 0
    ref = ReferenceTrainer(_model(), optimizer=HP, dtype=torch.bfloat16)
    initial = initial_masters(ref)
    for b in batches:
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= 2e-2 * abs(a)
    assert worst_tracking(engine, ref, initial)[0] <= tracking_tol(torch.bfloat16)


@pytest.mark.parametrize("disk", [True, False], ids=["disk", "no-disk"])
@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_an_engine_dropped_without_close_after_a_failure_is_collected(tmp_path, mode, disk):
    """An engine never closed, dropped after a step that failed (its loss raised after the forward
    built a graph) and a good one, is garbage-collected: its I/O and copy threads end and its
    unlinked disk file is closed (and so freed); no thread, descriptor or byte outlives it. (Hooks
    mode's saved-tensor hooks once made that graph a cycle through C++ the collector cannot see.)"""
    import gc
    import os
    import threading
    import weakref

    def ours():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("pscompile"))

    def fds():
        return set(os.listdir("/proc/self/fd"))
    ids, targets = make_batches("gpt", 1, batch=2, seq=32)[0]
    gc.collect()                         # (what earlier tests left is not this engine's to release)
    threads, open_fds = ours(), fds()
    tier = dict(host_memory=5 << 20, disk_dir=str(tmp_path)) if disk else {}
    engine = pscompile.compile(_model(), (ids, targets), optimizer=HP, config=_config(mode, **tier))
    with pytest.raises(IndexError):      # a target out of the vocabulary: the loss raises
        engine.step((ids, torch.full_like(targets, -5)))
    engine.step((ids, targets))
    if disk:
        assert ours() != threads and len(fds() - open_fds) >= 1, "nothing to release: proves nothing"
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None, "something still holds the dropped engine"
    assert ours() == threads and fds() <= open_fds


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_accumulation_and_evaluation_with_states_on_disk(mode, tmp_path):
    """Micro-batch accumulation and evaluate() with disk homes: the accumulated update and the
    forward-only loss are plain PyTorch's; evaluation moves nothing on disk."""
    batches = make_batches("gpt", 5, batch=4, seq=32, distinct=3)
    engine = pscompile.compile(_model(), batches[0], optimizer=HP, config=_config(
        mode, host_memory=5 << 20, disk_dir=str(tmp_path)))
    assert any(t is Tier.DISK for t in engine.store.os_tier)
    ref = ReferenceTrainer(_model(), optimizer=HP, dtype=torch.float32)
    for b in batches[:4]:
        micro = [tuple(t[i:i + 2] for t in b) for i in (0, 2)]
        a, c = ref.step(micro), engine.step(micro)
        assert abs(a - c) <= 1e-5 * abs(a)
    before = engine._disk_bytes()
    from pscompile.runtime.batching import call_model, extract_loss
    with torch.no_grad():
        plain = float(extract_loss(call_model(ref.model, batches[4]), batches[4], None))
    assert abs(engine.evaluate(batches[4]) - plain) <= 1e-5 * abs(plain)
    assert engine._disk_bytes() == before, "evaluate read or wrote the disk tier"
    assert max_weight_diff(engine, ref) <= 1e-4
    engine.close()


def test_a_killed_process_leaves_nothing_in_the_disk_folder(tmp_path):
    """The disk tier's file is unlinked when it is made: a process killed (SIGKILL) while it
    trains leaves the folder empty, and its blocks go back with the process."""
    import signal
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import sys, torch, pscompile
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from conftest import make_batches, make_model
        b = make_batches("gpt", 1, batch=2, seq=32)[0]
        engine = pscompile.compile(make_model("gpt", n_layer=4, d_model=128), b, config=pscompile.Config(
            mode="hooks", backend="eager", device="cpu", dtype=torch.float32, chunk_size=8192,
            host_memory=5 << 20, disk_dir={str(tmp_path)!r}))
        assert engine.store.disk is not None
        engine.step(b)
        print("training", flush=True)
        while True:
            engine.step(b)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "training", proc.stderr.read()[-2000:]
        assert list(tmp_path.iterdir()) == []        # (unlinked at creation, while it trains)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and list(tmp_path.iterdir()) == []
