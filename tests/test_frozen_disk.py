"""Frozen weights with the disk tier (issue 61): a host too small for the model's compute-dtype
chunks keeps the last ones on disk; a frozen chunk there is read, never written, and holds no
optimizer state; the run tracks plain PyTorch in both modes."""

from __future__ import annotations

import pytest
import torch

import pscompile
from tests.conftest import make_batches
from tests.test_frozen import HP, build, config

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_frozen_chunks_on_disk_are_read_never_written(mode, tmp_path):
    batches = make_batches("gpt", 4)
    model = build("lora")
    numel = sum(p.numel() for p in model.parameters())
    minimum = pscompile.min_device_memory(build("lora"), batches[0], config(mode, torch.float32))
    cfg = config(mode, torch.float32, int(1.15 * minimum), host_memory=numel * 4 // 2, disk_dir=str(tmp_path))
    engine = pscompile.compile(model, batches[0], optimizer=HP, config=cfg)
    layout, store = engine.layout, engine.store
    on_disk = [c for c in range(layout.num_chunks) if store.disk_homed(c)]
    frozen_on_disk = [c for c in on_disk if layout.is_frozen(c)]
    assert frozen_on_disk, "no frozen chunk on disk: the host budget is too large for this test"
    assert not set(engine.disk_chunks) & layout.frozen_chunks or all(store.state_numel(c) == 0 for c in frozen_on_disk)
    ref = pscompile.testing.ReferenceTrainer(build("lora"), optimizer=HP, dtype=torch.float32)
    written = []
    for i, b in enumerate(batches):
        torch.manual_seed(i)
        want = ref.step(b)
        torch.manual_seed(i)
        assert engine.step(b) == pytest.approx(want, rel=1e-5)
        assert engine.stats.peak_host_bytes <= cfg.host_memory
        written.append(engine.stats.disk_write_bytes)
    # a step writes the trainable chunks' data at most (their parameters, states and gradients),
    # never a frozen chunk's
    trainable = [c for c in on_disk if not layout.is_frozen(c)]
    per_step = len(trainable) * layout.chunk_size * (4 + 4 + 12 + 4)
    assert max(written) <= per_step, (written, per_step, len(frozen_on_disk))
    weights, base = engine.full_state_dict(), build("lora")
    for name, p in base.named_parameters():
        if not p.requires_grad:
            assert torch.equal(weights[name], p.detach()), name
    ours, theirs = engine.state_dict()["master"], ref.master_state()
    assert all((ours[k] - theirs[k]).abs().max().item() <= 1e-5 for k in ours)
    engine.close()
