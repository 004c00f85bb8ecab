"""Every tier holds model data: chunks the host cannot hold live on the device (fp32 master, Adam
states and the compute-dtype chunk there, no host copy), so a model trains when device and host
memory together hold it, in both modes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pscompile
from pscompile.testing import ReferenceTrainer
from conftest import make_batches, make_model

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
MiB = 2**20


def _config(mode, device_memory, host_memory):
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32,
                            device_memory=device_memory, host_memory=host_memory)


def _model_bytes() -> int:
    return sum(p.numel() for p in make_model("gpt").parameters()) * 16     # fp32: param + master + 2 states


def _train_and_check(mode, device_memory, host_memory, steps=3):
    batches = make_batches("gpt", steps)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP,
                               config=_config(mode, device_memory, host_memory))
    ref = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.float32)
    for i, b in enumerate(batches):
        ours, plain = engine.step(b), ref.step(b)
        assert abs(ours - plain) <= 1e-5 * abs(plain), f"step {i}: {ours} vs plain {plain}"
        assert engine.stats.peak_device_bytes <= device_memory
        assert engine.store.host_model_bytes() + engine.stats.offload_bytes <= host_memory   # activations too
        if mode == "compiled":
            assert (engine.stats.chunk_h2d_bytes, engine.stats.chunk_d2h_bytes) == \
                (engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes)
            assert engine.stats.offload_bytes == engine.stats.reload_bytes == engine.schedule.scheduled.offload_bytes
    n = engine.layout.num_chunks
    homed = sum(engine.store.device_homed(c) for c in range(n))
    data = engine.model_data()             # every chunk counted once, on its home tier
    cs, layout = engine.layout.chunk_size, engine.layout    # fp32: a host chunk's master is its param chunk,
    assert data["device"] + data["host"] == sum(             # its gradient has a home of its own
        4 * cs + 12 * layout.state_extent(c) if engine.store.device_homed(c) else 8 * cs + 8 * layout.state_extent(c)
        for c in range(n))
    assert data["host"] <= host_memory and f"{homed}/{n} chunks live on the device" in engine.describe()
    ours = engine.state_dict()["master"]
    theirs = ref.master_state()
    assert max((ours[k] - v).abs().max().item() for k, v in theirs.items()) <= 1e-4
    engine.close()
    return homed, n


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_host_smaller_than_the_model_is_enough_when_the_device_takes_the_rest(mode):
    """The issue's case in small: the host holds a quarter of the model data, the device the rest
    next to the activations. Before, compile refused: the host had to hold every chunk."""
    host = _model_bytes() // 4
    homed, n = _train_and_check(mode, 16 * MiB, host)
    assert homed >= n * 3 // 4 - 1


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_host_and_device_budgets_sweep(mode):
    """Host budgets from a tenth of the model data up, device budgets from tight up: a pair either
    trains in parity with plain PyTorch within both budgets, or is refused with an error naming the
    budgets; each host budget has a device budget that works, and some pairs split the chunks
    between the tiers."""
    total = _model_bytes()
    mixed = False
    for frac in (0.1, 0.4, 0.7, 1.0):
        host = int(total * frac)
        worked = False
        for device in [int(x * MiB) for x in (1.5, 2.0, 2.5, 3.0, 4.0, 6.0)]:
            try:
                homed, n = _train_and_check(mode, device, host, steps=2)
            except ValueError as e:          # BudgetError is one
                assert "device_memory" in str(e), str(e)
                continue
            worked = True
            mixed |= 0 < homed < n
        assert worked, f"no device budget up to 6 MiB trains with host_memory={host}"
    assert mixed, "no pair split the chunks between host and device"


def test_too_little_memory_in_both_tiers_names_both():
    with pytest.raises(ValueError, match="host_memory=.*device_memory"):
        pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0], optimizer=HP,
                          config=_config("hooks", 256 << 10, 64 << 10))


@pytest.mark.parametrize("frac", [0.2, 0.5, 0.8])
def test_compiled_minimum_counts_the_chunks_the_host_cannot_hold(frac):
    """``pscompile.min_device_memory`` with a host smaller than the model: compile accepts exactly
    that budget, and refuses one byte less."""
    model, batch = make_model("gpt"), make_batches("gpt", 1)[0]
    host = int(_model_bytes() * frac)
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                              host_memory=host, chunk_size=20480)
    least = pscompile.min_device_memory(model, batch, config)
    unlimited = pscompile.min_device_memory(model, batch, pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=torch.float32, chunk_size=20480))
    assert least > unlimited, "the chunks the host cannot hold must raise the minimum"
    engine = pscompile.compile(make_model("gpt"), batch, optimizer=HP,
                               config=dataclasses.replace(config, device_memory=least))
    assert engine.store.host_model_bytes() <= host
    engine.close()
    with pytest.raises(ValueError, match="device_memory"):
        pscompile.compile(make_model("gpt"), batch, optimizer=HP,
                          config=dataclasses.replace(config, device_memory=least - 1))
