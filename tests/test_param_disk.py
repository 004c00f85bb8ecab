"""Parameters on the disk tier (``memory/disk_homes.py``): when the host cannot hold even the
compute-dtype chunks, the last chunks keep their parameters and gradients on disk with every
optimizer state, and both modes still train like plain PyTorch.

The model's data is at least 5x ``device_memory + host_memory``: the device gets the mode's
minimum, the host what is left of a fifth of the model data (it holds the first chunks' parameters
and the staging buffers). Every step: the loss within 1e-5 (fp32) of plain PyTorch, the peak
device bytes within the device budget, the peak host bytes of model data within ``host_memory``,
the same disk bytes as every other step (the staging cache decides nothing by timing), and at
least every disk chunk's parameters and optimizer states read and written once.
"""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.memory.disk import DiskQueue, SlotFile
from pscompile.memory.disk_homes import DiskHomes, disk_staging_bytes
from pscompile.memory.tiers import HostMeter, SlotPool, Tier
from pscompile.testing import ReferenceTrainer
from conftest import (a_failed_step_changes_nothing, initial_masters, resumes_alike, make_batches, make_model,
                      max_weight_diff, tracking_tol, worst_tracking)

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
CHUNK = 8192


def _config(mode: str, dtype=torch.float32, **kw) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=dtype, chunk_size=CHUNK, **kw)


def _model(n_layer: int = 8):
    return make_model("gpt", n_layer=n_layer, d_model=128)


def _budgets(mode: str, batch, *, n_layer: int = 8, dtype=torch.float32, ratio: float | None = 5.0) -> tuple[int, int]:
    """(device, host): the mode's minimum device budget, and for the host what is left of ``model
    bytes / ratio`` (None: the staging buffers and 8 chunks' parameters)."""
    probe = pscompile.compile(_model(n_layer), batch, config=_config(mode, dtype))
    model_bytes = probe.layout.num_chunks * CHUNK * (dtype.itemsize + 12)
    probe.close()
    device = pscompile.min_device_memory(_model(n_layer), batch, _config(mode, dtype))
    if ratio is None:
        return device, disk_staging_bytes(CHUNK, dtype.itemsize) + 8 * CHUNK * dtype.itemsize
    host = int(model_bytes / ratio) - device
    assert model_bytes >= ratio * (device + host) and host > 0, (device, host, model_bytes)
    return device, host


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_model_5x_device_plus_host_trains_like_plain_pytorch_with_parameters_on_disk(mode, tmp_path):
    batches = make_batches("gpt", 3, batch=1, seq=16)       # (small activations: a small minimum)
    device, host = _budgets(mode, batches[0])
    engine = pscompile.compile(_model(), batches[0], optimizer=HP, config=_config(
        mode, device_memory=device, host_memory=host, disk_dir=str(tmp_path)))
    store = engine.store
    on_disk = sorted(engine.param_disk_chunks)
    assert len(on_disk) >= engine.layout.num_chunks // 3 and all(t is Tier.DISK for t in store.os_tier)
    assert all(store.host_param[c].numel() == 0 for c in on_disk)      # no host copy of their parameters
    # every chunk's states, and the disk chunks' parameters, read and written at least once a step
    least = engine.layout.num_chunks * 3 * CHUNK * 4 + len(on_disk) * CHUNK * 4
    ref = ReferenceTrainer(_model(), optimizer=HP, dtype=torch.float32)
    moved = set()
    for i, b in enumerate(batches):
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= 1e-5 * abs(a), (i, a, c)
        s = engine.stats
        assert s.peak_device_bytes <= device, (i, s.peak_device_bytes, device)
        assert 0 < s.peak_host_bytes <= host, (i, s.peak_host_bytes, host)
        assert s.disk_read_bytes >= least and s.disk_write_bytes >= least, (s.disk_read_bytes, s.disk_write_bytes, least)
        moved.add((s.disk_read_bytes, s.disk_write_bytes))
        if mode == "compiled":
            assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes)
    assert len(moved) == 1, f"the disk bytes changed from step to step: {moved}"
    assert max_weight_diff(engine, ref) <= 1e-4
    engine.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_bf16_with_parameters_on_disk_tracks_plain_pytorch(mode, tmp_path):
    batches = make_batches("gpt", 4, batch=2, seq=32)
    device, host = _budgets(mode, batches[0], n_layer=4, dtype=torch.bfloat16, ratio=None)
    engine = pscompile.compile(_model(4), batches[0], optimizer=HP, config=_config(
        mode, torch.bfloat16, device_memory=device, host_memory=host, disk_dir=str(tmp_path)))
    assert engine.param_disk_chunks
    ref = ReferenceTrainer(_model(4), optimizer=HP, dtype=torch.bfloat16)
    initial = initial_masters(ref)
    for b in batches:
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= 2e-2 * abs(a)
        assert engine.stats.peak_host_bytes <= host and engine.stats.peak_device_bytes <= device
    assert worst_tracking(engine, ref, initial)[0] <= tracking_tol(torch.bfloat16)
    engine.close()


def test_evaluate_checkpoints_and_a_failed_step_with_parameters_on_disk(tmp_path):
    """evaluate() reads the disk homes (plain PyTorch's loss); a failed step leaves every weight
    and state as it was; a checkpoint resumes exactly into another such engine."""
    batches = make_batches("gpt", 4, batch=2, seq=32)
    folder = tmp_path / "disk"
    folder.mkdir()
    device, host = _budgets("hooks", batches[0], n_layer=4, ratio=None)

    def engine():
        return pscompile.compile(_model(4), batches[0], optimizer=HP, config=_config(
            "hooks", device_memory=device, host_memory=host, disk_dir=str(folder)))
    a, ref = engine(), ReferenceTrainer(_model(4), optimizer=HP, dtype=torch.float32)
    assert a.param_disk_chunks
    a.step(batches[0])
    ref.step(batches[0])
    from pscompile.runtime.batching import call_model, extract_loss
    with torch.no_grad():
        plain = float(extract_loss(call_model(ref.model, batches[3]), batches[3], None))
    assert abs(a.evaluate(batches[3]) - plain) <= 1e-5 * abs(plain)
    a_failed_step_changes_nothing(a, batches[1])
    resumes_alike(a, engine, batches[1:], tmp_path / "d.ckpt")
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_accumulation_with_parameters_on_disk_tracks_plain_pytorch(mode, tmp_path):
    """Micro-batch accumulation with the parameters on disk: the fp32 accumulation buffers live on
    disk too (one slot per chunk, staged through their own four host buffers), the accumulated
    update is plain PyTorch's, and the host's model data stays within host_memory."""
    batches = make_batches("gpt", 3, batch=4, seq=32, distinct=3)
    micro = [[tuple(t[i:i + 2] for t in b) for i in (0, 2)] for b in batches]
    device, host = _budgets(mode, micro[0][0], n_layer=4, ratio=None)
    engine = pscompile.compile(_model(4), micro[0][0], optimizer=HP, config=_config(
        mode, device_memory=device, host_memory=host, disk_dir=str(tmp_path)))
    assert engine.param_disk_chunks and engine.store.acc_disk is not None
    ref = ReferenceTrainer(_model(4), optimizer=HP, dtype=torch.float32)
    for m in micro:
        a, c = ref.step(m), engine.step(m)
        assert abs(a - c) <= 1e-5 * abs(a), (a, c)
        assert engine.stats.peak_host_bytes <= host and engine.stats.peak_device_bytes <= device
    assert max_weight_diff(engine, ref) <= 1e-4
    engine.close()


def test_a_meta_device_model_is_materialized_module_by_module_onto_disk(tmp_path):
    """A model built on the meta device is materialized one module at a time as the chunks fill:
    the host never holds the whole model, and it trains with its parameters on disk."""
    from pscompile.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=128, vocab_size=256, seq_len=64)
    with torch.device("meta"):
        model = GPT(cfg)
    batches = make_batches("gpt", 3, batch=2, seq=32)
    engine = pscompile.compile(model, batches[0], optimizer=HP, config=_config(
        "hooks", host_memory=1 << 20, disk_dir=str(tmp_path)))
    assert engine.materialized == len(list(model.parameters())) and engine.param_disk_chunks
    assert model.lm_head.weight is model.wte.weight
    weights = engine.full_state_dict()                     # GPT's own _init_weights ran: std 0.02
    assert 0.015 < float(weights["h.0.mlp.c_fc.weight"].std()) < 0.025, float(weights["h.0.mlp.c_fc.weight"].std())
    losses = [engine.step(batches[0]) for _ in range(3)]
    assert losses[-1] < losses[0] and engine.stats.peak_host_bytes <= 1 << 20
    engine.close()


def test_the_staging_cache_writes_back_lazily_and_never_holds_more_than_its_buffers(tmp_path):
    """DiskHomes on its own: an open for a whole overwrite reads nothing, a dirty buffer reaches the
    file only when its buffer is needed or at flush, read-ahead fills free buffers in the expected
    order, and at most ``capacity`` buffers ever exist."""
    n, size = 6, 1024
    queue = DiskQueue(SlotFile(tmp_path, num_slots=n, slot_bytes=4 * size))
    meter = HostMeter()
    pool = SlotPool(Tier.HOST, torch.device("cpu"), torch.float32, size, meter=meter)
    homes = DiskHomes(queue, {c: c for c in range(n)}, pool, capacity=3)
    for c in range(n):                                   # write every home, no read first
        homes.open(c, read=False).fill_(c)
        homes.close(c, dirty=True)
        assert pool.in_use <= 3
    assert queue.traffic.read_bytes == 0
    homes.flush()
    assert pool.in_use == 0 and meter.in_use == 0 and meter.peak == 3 * 4 * size
    assert queue.traffic.write_bytes == n * 4 * size
    homes.expect([4, 2, 5])
    assert pool.in_use == 1                              # capacity - 2 chunks read ahead: chunk 4
    for c in (4, 2, 5):
        assert torch.equal(homes.open(c), torch.full((size,), float(c)))
        homes.close(c)
    written = queue.traffic.write_bytes
    homes.flush()
    assert queue.traffic.write_bytes == written          # clean buffers are not written back
    assert queue.traffic.read_bytes == 3 * 4 * size
    queue.close()


def test_compiled_schedules_read_each_disk_chunk_ahead_of_its_fetch(tmp_path):
    """Compiled mode plans the disk reads: a ``disk_read`` node for every fetch of a chunk homed on
    disk, ``READ_AHEAD`` disk fetches ahead of it, printed in the schedule. The verifier rejects a
    schedule that fetches such a chunk without its read, or stages more reads than the host holds."""
    import copy

    from pscompile.graph.ops import is_memory_node, mem_op
    from pscompile.kinds import MemKind
    from pscompile.memory.disk_homes import READ_AHEAD
    from pscompile.passes.verify_schedule import ScheduleError, verify_schedule
    batches = make_batches("gpt", 1, batch=2, seq=32)
    device, host = _budgets("compiled", batches[0], n_layer=4, ratio=None)
    engine = pscompile.compile(_model(4), batches[0], optimizer=HP, config=_config(
        "compiled", device_memory=device, host_memory=host, disk_dir=str(tmp_path)))
    disk, sched = engine.param_disk_chunks, engine.schedule
    mems = [(n, mem_op(n)) for n in sched.gm.graph.nodes if is_memory_node(n)]
    order = [(m.kind, m.chunk) for _, m in mems if m.kind in (MemKind.DISK_READ, MemKind.FETCH) and m.chunk in disk]
    fetched = [c for k, c in order if k == MemKind.FETCH]
    assert [c for k, c in order if k == MemKind.DISK_READ] == fetched and len(fetched) > READ_AHEAD
    reads = [i for i, (k, _) in enumerate(order) if k == MemKind.DISK_READ]     # (in the fetches' order)
    fetches = [i for i, (k, _) in enumerate(order) if k == MemKind.FETCH]
    for k, (r, f) in enumerate(zip(reads, fetches)):   # before its fetch, after the one READ_AHEAD disk fetches back
        assert r < f and (k < READ_AHEAD or r > fetches[k - READ_AHEAD]), (k, r, f)
    assert "pscompile.disk_read(" in str(sched)
    args = dict(slot_bytes=engine.store.param_chunk_bytes, budget=device, initial=dict(sched.plan.initial),
                disk_chunks=frozenset(disk))
    verify_schedule(sched.gm, engine.layout, disk_depth=READ_AHEAD, **args)
    with pytest.raises(ScheduleError, match="the host stages at most 1"):
        verify_schedule(sched.gm, engine.layout, disk_depth=1, **args)
    gm = copy.deepcopy(sched.gm)
    gm.graph.erase_node(next(n for n in gm.graph.nodes if is_memory_node(n) and mem_op(n).kind == MemKind.DISK_READ))
    with pytest.raises(ScheduleError, match="without a disk_read of it since its last fetch"):
        verify_schedule(gm, engine.layout, disk_depth=READ_AHEAD, **args)
    engine.step(batches[0])
    engine.close()


def test_hooks_mode_auto_chunks_fit_the_disk_tiers_staging(tmp_path):
    """With a disk tier and a small ``host_memory``, hooks mode's ``chunk_size="auto"`` picks chunks
    whose staging buffers fit the host (it used to pick the budget's size and refuse at build,
    naming a staging larger than ``host_memory``); it trains like plain PyTorch within it."""
    from pscompile.models.gpt import GPT, GPTConfig

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=2, n_head=2, d_model=256, vocab_size=256, seq_len=32))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g))
               for _ in range(2)]
    engine = pscompile.compile(model(), batches[0], config=pscompile.Config(
        mode="hooks", device="cpu", dtype=torch.float32, disk_dir=str(tmp_path), host_memory=6_000_000,
        device_memory="7MiB"))
    ref = ReferenceTrainer(model(), optimizer=pscompile.AdamW(), dtype=torch.float32)
    for b in batches:
        assert abs(engine.step(b) - ref.step(b)) < 1e-5
        assert engine.stats.peak_host_bytes <= 6_000_000
    assert engine.param_disk_chunks                # the host could not keep every chunk: some live on disk
    engine.close()
