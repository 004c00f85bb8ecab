"""The planner with frozen weights (issue 61): ``plan(..., lora=LoRA(r, targets))`` plans a LoRA
run of a base, counts frozen chunks at their compute-dtype bytes as the engine holds them, and
says a base several times larger fine-tunes with LoRA than trains fully on the same machine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pscompile
from pscompile.models.gpt import GPTConfig
from pscompile.planner import LoRA, hardware_preset, plan
from pscompile.planner.lora import add_lora
from tests.conftest import make_batches, make_model

GiB = 2**30


def test_the_planned_host_bytes_are_what_the_engine_holds():
    batch = make_batches("gpt", 1)[0]
    lora = LoRA(4, ("c_attn", "c_fc"))
    config = pscompile.Config(device="cpu", dtype=torch.bfloat16, chunk_size=2048, backend="eager")
    engine = pscompile.compile(add_lora(make_model("gpt"), lora), batch, config=dataclasses.replace(
        config, device_memory=pscompile.min_device_memory(add_lora(make_model("gpt"), lora), batch, config)))
    hw = dataclasses.replace(hardware_preset("yard"), gpu_memory=engine.budget + 1 * GiB, gpus=1)
    report = plan(make_model("gpt"), batch, hardware=hw, config=config, lora=lora)
    assert engine.layout.frozen_chunks and report.num_chunks == engine.layout.num_chunks
    assert report.host_model_bytes == engine.store.host_model_bytes()
    engine.close()


def test_a_base_three_times_larger_fine_tunes_with_lora_than_trains_fully():
    """The same machine (1 GPU with 64 MiB for the plan, 250 MB of CPU memory): full fine-tuning
    needs 14 bytes a parameter on the host, LoRA 2 bytes a frozen parameter."""
    hw = dataclasses.replace(hardware_preset("yard"), gpus=1, gpu_memory=GiB + 64 * 2**20, cpu_memory=250 * 10**6)
    config = pscompile.Config(device="cpu", dtype=torch.bfloat16)

    def fits(layers: int, lora: LoRA | None) -> tuple[bool, int]:
        r = plan(GPTConfig(n_layer=layers, n_head=8, d_model=512, vocab_size=256, seq_len=128), (2, 128),
                 hardware=hw, config=config, lora=lora)
        return r.fits, r.params

    full_fits, full_params = fits(4, None)
    assert full_fits and not fits(8, None)[0]                  # full fine-tuning: 4 layers fit, 8 do not
    lora_fits, lora_params = fits(16, LoRA(8, ("c_attn",)))
    assert lora_fits and lora_params >= 3 * full_params


def test_lora_targets_that_name_no_layer_are_refused_naming_the_layers():
    with pytest.raises(ValueError, match="q_proj.*c_attn"):
        add_lora(make_model("gpt"), LoRA(8, ("q_proj",)))
    with pytest.raises(ValueError, match="rank"):
        LoRA(0, ("c_attn",))
