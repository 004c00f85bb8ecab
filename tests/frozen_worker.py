"""Ranks of the frozen-weights ZeRO test (``tests/test_frozen_zero.py``): spawned by it, two
processes over gloo, one thread each."""

from __future__ import annotations

import os

import torch

import pscompile
from dist_worker import STEPS, join, leave, split
from pscompile.kinds import MemKind
from pscompile.memory.model_bytes import ModelBytes, owned_chunks
from tests.conftest import make_batches
from tests.test_frozen import HP, build


def frozen(rank: int, world: int, port: int, out_dir: str, cases: list[tuple[str, str, str]]) -> None:
    """Each (mode, collectives, frozen_format): LoRA on the tiny GPT under a budget that evicts,
    STEPS steps on this rank's half of each batch; save the losses, the weights, the collectives
    planned, the host bytes, and a checkpoint round trip."""
    join(rank, world, port)
    for mode, collectives, fmt in cases:
        batches = make_batches("gpt", STEPS)
        cfg = dict(mode=mode, backend="eager", device="cpu", dtype=torch.float32, chunk_size=2048,
                   collectives=collectives, frozen_format=fmt)
        probe = pscompile.compile(build("lora"), split(batches[0], rank, world), optimizer=HP,
                                  config=pscompile.Config(**cfg))
        probe.step(split(batches[0], rank, world))
        budget = probe.min_device_memory + probe.store.param_chunk_bytes
        probe.close()
        engine = pscompile.compile(build("lora"), split(batches[0], rank, world), optimizer=HP,
                                   config=pscompile.Config(device_memory=budget, **cfg))
        losses, peaks = [], []
        for b in batches:
            losses.append(engine.step(split(b, rank, world)))
            peaks.append(engine.stats.peak_device_bytes)
        layout, store = engine.layout, engine.store
        reduced = []
        if mode == "compiled":
            kinds = (MemKind.REDUCE_SCATTER, MemKind.REDUCE, MemKind.WRITEBACK, MemKind.STORE_GRAD)
            reduced = sorted({a.chunk for a in engine.last_plan.actions if a.kind in kinds})
        per_chunk = collectives == "per_chunk"
        owned = owned_chunks(layout.num_chunks, rank=rank, world=world, per_chunk=per_chunk)
        expected = ModelBytes.of(torch.float32).host_bytes(layout, owned, store.home_numel)
        folder = os.path.join(out_dir, f"ckpt-{mode}-{collectives}-{fmt}")
        pscompile.save(engine, folder)
        again = [engine.step(split(b, rank, world)) for b in batches[:1]]
        pscompile.load(engine, folder)
        torch.save({"losses": losses, "full": engine.full_state_dict(), "state": engine.state_dict(),
                    "reduced": reduced, "frozen": sorted(layout.frozen_chunks), "evictions": engine.stats.num_evictions,
                    "host": store.host_model_bytes() + store.dev_os_pool.bytes_in_use, "expected": expected,
                    "again": again, "resumed": [engine.step(split(b, rank, world)) for b in batches[:1]],
                    "quantized": sorted(layout.quantized_chunks), "peaks": peaks, "budget": budget, "gathered": engine.stats.allgather_bytes},
                   os.path.join(out_dir, f"{mode}-{collectives}-{fmt}-rank{rank}.pt"))
        engine.close()
    leave()


def loaded(rank: int, world: int, port: int, out_dir: str, folder: str, cases: list[tuple[str, str]]) -> None:
    """Each (mode, collectives): the tiny Llama bitsandbytes loads in 4 bits (double quantization)
    with peft's LoRA, STEPS steps on this rank's half of each batch under a budget that evicts;
    save the losses, the adapters, the peaks and the codes each layer holds after ``close``."""
    import bitsandbytes as bnb
    from pscompile.runtime.bnb4bit import Loaded4bitLinear
    from tests.test_qlora_bnb import batches, qlora

    join(rank, world, port)
    data = [batches()[1]] * STEPS          # (one length: the ranks' halves have the same shape)
    for mode, collectives in cases:
        cfg = dict(mode=mode, backend="eager", device="cpu", dtype=torch.float32, chunk_size=2048,
                   collectives=collectives)
        probe = pscompile.compile(qlora(folder, torch.float32, nested=True), split(data[0], rank, world),
                                  optimizer=HP, config=pscompile.Config(**cfg))
        probe.step(split(data[0], rank, world))
        budget = probe.min_device_memory + probe.store.param_chunk_bytes
        probe.close()
        model = qlora(folder, torch.float32, nested=True)
        codes = {n: m.weight.detach().reshape(-1).clone() for n, m in model.named_modules()
                 if isinstance(m, bnb.nn.Linear4bit)}
        engine = pscompile.compile(model, split(data[0], rank, world), optimizer=HP,
                                   config=pscompile.Config(device_memory=budget, **cfg))
        losses, peaks = [], []
        for b in data:
            losses.append(engine.step(split(b, rank, world)))
            peaks.append(engine.stats.peak_device_bytes)
        full = {n: t for n, t in engine.full_state_dict().items() if "lora_" in n}
        evictions = engine.stats.num_evictions
        engine.close()
        back = {n: model.get_submodule(n).source.codes for n in codes}
        torch.save({"losses": losses, "peaks": peaks, "budget": budget, "full": full, "evictions": evictions,
                    "codes_back": all(torch.equal(back[n], codes[n]) for n in codes),
                    "adopted": all(isinstance(model.get_submodule(n), Loaded4bitLinear) for n in codes)},
                   os.path.join(out_dir, f"loaded-{mode}-{collectives}-rank{rank}.pt"))
    leave()
