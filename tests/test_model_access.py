"""The model while it trains (pscompile/runtime/model_access.py): inside ``engine.materialize()``
a Hugging Face model generates exactly what the plain model with the same weights generates;
``save_pretrained`` gives a folder whose ``from_pretrained`` model has the engine's loss; ``export``
writes the weights as safetensors; training goes on afterwards as if nothing had happened. Both
modes, under a budget that evicts."""

from __future__ import annotations

import copy

import pytest
import torch

import pscompile
from pscompile.testing import tiny_model

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")


def _config(mode: str, budget=None) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget,
                            chunk_size=8192)


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_generate_save_pretrained_and_export_mid_run(mode, tmp_path):
    model, batch = tiny_model("hf-gpt2")
    twin = copy.deepcopy(model)                 # trains without interruptions: the reference
    budget = pscompile.min_device_memory(model, batch, _config(mode)) + (64 << 10)
    engine = pscompile.compile(model, batch, config=_config(mode, budget))
    other = pscompile.compile(twin, batch, config=_config(mode, budget))
    for _ in range(2):
        assert engine.step(batch) == other.step(batch)
    assert engine.stats.num_evictions > 0
    weights = engine.full_state_dict()
    plain = copy.deepcopy(tiny_model("hf-gpt2")[0]).eval()
    plain.load_state_dict(weights)
    prompt = batch["input_ids"][:1, :8]
    want = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)

    model.eval()
    with engine.materialize() as m:
        assert m is model
        got = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with pytest.raises(RuntimeError, match=r"step\(\) while this engine's materialize\(\) runs"):
            engine.step(batch)
    model.train()
    assert torch.equal(got, want) and got.shape[1] == 14
    assert all(bool(torch.isnan(p.reshape(-1)[0])) for p in model.parameters()), "weights left in the module"

    folder = engine.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    with torch.no_grad():
        assert loaded(**batch).loss.item() == pytest.approx(plain(**batch).loss.item(), rel=1e-6)
    exported = safetensors.load_file(str(engine.export(tmp_path / "w.safetensors")))
    assert set(exported) == set(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)

    for _ in range(2):                           # training goes on exactly as the twin's
        assert engine.step(batch) == other.step(batch)
    assert engine.stats.peak_device_bytes <= budget
    engine.close()
    other.close()


def test_save_pretrained_needs_a_hugging_face_model(tmp_path):
    from conftest import make_batches, make_model
    engine = pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0], config=_config("hooks"))
    with pytest.raises(ValueError, match="not a Hugging Face PreTrainedModel; engine.export"):
        engine.save_pretrained(tmp_path / "x")
    with pytest.raises(ValueError, match="materialize"):
        with engine.materialize(dtype=torch.int8):
            pass
