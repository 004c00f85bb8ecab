"""The planner with frozen weights (issue 61): ``plan(..., lora=LoRA(r, targets))`` plans a LoRA
run of a base, counts frozen chunks at their compute-dtype bytes as the engine holds them, and
says a base several times larger fine-tunes with LoRA than trains fully on the same machine."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import pscompile
from pscompile.models.gpt import GPTConfig
from pscompile.planner import LoRA, hardware_preset, plan
from pscompile.planner.lora import add_lora
from tests.conftest import make_batches, make_model

GiB = 2**30


@pytest.mark.parametrize("frozen_format", ["compute", "nf4"])
def test_the_planned_host_bytes_are_what_the_engine_holds(frozen_format):
    """(``nf4``: the frozen linear weights at their packed bytes, issue 72.)"""
    batch = make_batches("gpt", 1)[0]
    lora = LoRA(4, ("c_attn", "c_fc"))
    config = pscompile.Config(device="cpu", dtype=torch.bfloat16, chunk_size=2048, backend="eager",
                              frozen_format=frozen_format)
    engine = pscompile.compile(add_lora(make_model("gpt"), lora), batch, config=dataclasses.replace(
        config, device_memory=pscompile.min_device_memory(add_lora(make_model("gpt"), lora), batch, config)))
    hw = dataclasses.replace(hardware_preset("yard"), gpu_memory=engine.budget + 1 * GiB, gpus=1)
    report = plan(make_model("gpt"), batch, hardware=hw, config=config, lora=lora)
    assert engine.layout.frozen_chunks and report.num_chunks == engine.layout.num_chunks
    assert bool(engine.layout.quantized_chunks) == (frozen_format == "nf4")
    assert report.host_model_bytes == engine.store.host_model_bytes()
    engine.close()


def test_a_4_bit_base_moves_and_holds_less_and_its_plan_is_no_slower():
    """The same LoRA run planned with its base in bf16 and in NF4, on a machine where the link binds:
    NF4 holds the frozen linear weights at 0.5625 of a byte a weight and moves them so, and the
    estimate is no slower (the dequantization costs the GPU's memory bandwidth)."""
    hw = dataclasses.replace(hardware_preset("yard"), gpus=1, gpu_memory=GiB + 16 * 2**20)
    cfg = GPTConfig(n_layer=4, n_head=8, d_model=512, vocab_size=256, seq_len=128)
    reports = {f: plan(cfg, (2, 128), hardware=hw, lora=LoRA(8, ("c_attn",)), config=pscompile.Config(
        device="cpu", dtype=torch.bfloat16, frozen_format=f)) for f in ("compute", "nf4")}
    bf16, nf4 = reports["compute"], reports["nf4"]
    assert bf16.fits and nf4.fits and "NF4" in nf4.model
    assert nf4.host_model_bytes < 0.5 * bf16.host_model_bytes
    assert nf4.h2d_bytes < 0.5 * bf16.h2d_bytes
    assert nf4.iteration_s <= bf16.iteration_s


def test_a_base_three_times_larger_fine_tunes_with_lora_than_trains_fully():
    """The same machine (1 GPU with 64 MiB for the plan, 250 MB of CPU memory): full fine-tuning
    needs 14 bytes a parameter on the host, LoRA 2 bytes a frozen parameter. Full fine-tuning's
    capacity lies below the 8 layers that do not fit; a LoRA base of 3x that many parameters fits."""
    hw = dataclasses.replace(hardware_preset("yard"), gpus=1, gpu_memory=GiB + 64 * 2**20, cpu_memory=250 * 10**6)
    config = pscompile.Config(device="cpu", dtype=torch.bfloat16)

    def fits(layers: int, lora: LoRA | None) -> tuple[bool, int]:
        r = plan(GPTConfig(n_layer=layers, n_head=8, d_model=512, vocab_size=256, seq_len=128), (2, 128),
                 hardware=hw, config=config, lora=lora)
        return r.fits, r.params

    assert fits(4, None)[0]                                    # full fine-tuning: 4 layers fit...
    too_large, above_full_capacity = fits(8, None)
    assert not too_large                                       # ...8 do not
    lora_fits, lora_params = fits(26, LoRA(8, ("c_attn",)))
    assert lora_fits and lora_params >= 3 * above_full_capacity


def test_the_planned_host_bytes_of_peft_lora_are_what_the_engine_holds():
    """peft's LoRA Llama (bench/lora.py's model, frozen by peft, planned as it is): the planner's
    host bytes equal the engine's (tolerance 0 bytes), within 1.1x of bf16 base + 14 B per
    trainable parameter."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")

    def model():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    config = pscompile.Config(device="cpu", dtype=torch.bfloat16, backend="eager")
    budget = pscompile.min_device_memory(model(), batch, config)
    engine = pscompile.compile(model(), batch, config=dataclasses.replace(config, device_memory=budget))
    hw = dataclasses.replace(hardware_preset("yard"), gpu_memory=engine.budget + GiB, gpus=1)
    m = model()
    report = plan(m, batch, hardware=hw, config=config)
    params, trainable = (sum(p.numel() for p in m.parameters() if p.requires_grad or not only) for only in (False, True))
    assert trainable == 28_672 and engine.layout.frozen_chunks
    assert report.num_chunks == engine.layout.num_chunks
    assert report.host_model_bytes == engine.store.host_model_bytes() <= 1.1 * (2 * params + 14 * trainable)
    engine.close()


def test_the_plan_command_plans_lora(tmp_path, capsys):
    """``pscompile plan --lora-rank 8 --lora-targets c_attn``: the model line names the adapters,
    the host holds the bf16 base and the adapters' 14 B per parameter (4 layers x 8 x (256 + 768)
    of them), far less than full fine-tuning's model data (on this preset partly on the GPU)."""
    from pscompile.cli.main import main as cli_main
    shape = ["plan", "--d-model", "256", "--n-layer", "4", "--n-head", "4", "--vocab-size", "256", "--seq-len", "64",
             "--batch-size", "2", "--hardware", "pc700"]
    assert cli_main(shape + ["--json", str(tmp_path / "full.json")]) == 0
    assert cli_main(shape + ["--lora-rank", "8", "--lora-targets", "c_attn", "--json", str(tmp_path / "lora.json")]) == 0
    assert "LoRA r=8 on c_attn" in capsys.readouterr().out
    full, lora = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("full", "lora"))
    adapters = 4 * 8 * (256 + 768)
    assert lora["fits"] and lora["host_model_bytes"] <= 1.1 * (2 * lora["params"] + 14 * adapters)
    assert lora["host_model_bytes"] < (full["host_model_bytes"] + full["device_model_bytes"]) / 4


def test_lora_targets_that_name_no_layer_are_refused_naming_the_layers():
    with pytest.raises(ValueError, match="q_proj.*c_attn"):
        add_lora(make_model("gpt"), LoRA(8, ("q_proj",)))
    with pytest.raises(ValueError, match="rank"):
        LoRA(0, ("c_attn",))
