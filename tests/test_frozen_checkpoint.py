"""Checkpoints of a run with frozen weights (issue 61): the trainable state only, a record of the
base that ``load`` checks, the base itself on request; a LoRA run resumed through the Hugging Face
Trainer repeats the uninterrupted run exactly; the checkpoint is the size of the plain Trainer's
optimizer and adapter files."""

from __future__ import annotations

import pytest
import torch

import pscompile
from tests.conftest import make_batches
from tests.test_frozen import HP, build, config

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _engine(mode: str, model=None):
    batches = make_batches("gpt", 5)
    model = build("lora") if model is None else model
    minimum = pscompile.min_device_memory(build("lora"), batches[0], config(mode, torch.float32))
    return pscompile.compile(model, batches[0], optimizer=HP, config=config(mode, torch.float32, int(1.15 * minimum))), \
        batches


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_resume_is_exact_and_the_file_holds_the_trainable_state_only(mode, tmp_path):
    engine, batches = _engine(mode)
    for b in batches[:2]:
        engine.step(b)
    path = pscompile.save(engine, tmp_path / "run.ckpt")
    rest = [engine.step(b) for b in batches[2:]]
    layout = engine.layout
    resumed, _ = _engine(mode)                    # the base built again as it was built
    pscompile.load(resumed, path)
    assert [resumed.step(b) for b in batches[2:]] == rest
    assert all(torch.equal(v, resumed.full_state_dict()[k]) for k, v in engine.full_state_dict().items())
    # masters and two moments of the trainable elements (padding after each chunk's last
    # trainable piece not written), a header: nothing of the frozen chunks' bytes
    states = 12 * layout.trainable_numel
    frozen = 4 * (layout.total_numel - layout.trainable_numel)
    assert states < path.stat().st_size < states + 0.25 * frozen, (path.stat().st_size, states, frozen)


def test_a_different_base_or_other_frozen_parameters_are_refused_and_nothing_is_loaded(tmp_path):
    engine, batches = _engine("hooks")
    engine.step(batches[0])
    path = pscompile.save(engine, tmp_path / "run.ckpt")
    other = build("lora")
    with torch.no_grad():
        next(p for p in other.parameters() if not p.requires_grad).view(-1)[0] += 1.0
    changed, _ = _engine("hooks", other)
    before = changed.state_dict()["master"]
    with pytest.raises(ValueError, match="frozen base differs.*frozen_weights=True"):
        pscompile.load(changed, path)
    assert all(torch.equal(v, changed.state_dict()["master"][k]) for k, v in before.items())
    refrozen = build("lora")
    name = next(n for n, p in refrozen.named_parameters() if p.requires_grad)
    refrozen.get_parameter(name).requires_grad_(False)
    with pytest.raises(ValueError, match="froze other parameters.*" + name.replace(".", r"\.")):
        pscompile.load(_engine("hooks", refrozen)[0], path)


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_the_base_saved_on_request_comes_back_into_another_base(mode, tmp_path):
    engine, batches = _engine(mode)
    engine.step(batches[0])
    lean = pscompile.save(engine, tmp_path / "lean.ckpt")
    full = pscompile.save(engine, tmp_path / "full.ckpt", frozen_weights=True)
    base = 4 * (engine.layout.total_numel - engine.layout.trainable_numel)
    assert base <= full.stat().st_size - lean.stat().st_size <= 1.1 * base
    want = [engine.step(b) for b in batches[1:3]]
    other = build("lora")
    with torch.no_grad():
        for p in other.parameters():
            if not p.requires_grad:
                p.mul_(2)
    resumed, _ = _engine(mode, other)
    pscompile.load(resumed, full)                  # the saved base replaces this one
    assert [resumed.step(b) for b in batches[1:3]] == want
    pscompile.save(resumed, tmp_path / "again.ckpt")
    pscompile.load(resumed, tmp_path / "again.ckpt")     # its base's digest follows the loaded weights


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def test_the_issue_llama_checkpoint_is_the_size_of_the_plain_trainer_files(tmp_path):
    """The issue's LoRA Llama (28,672 trainable parameters, bf16 base of 3.98M): before, 47.8 MB
    at every save; the plain Trainer writes optimizer.pt (0.24 MB) and the adapter (0.12 MB)."""
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    model = _llama()
    engine = pscompile.compile(model, batch, optimizer=HP, config=config("hooks", torch.bfloat16, chunk_size="auto"))
    engine.step(batch)
    ours = pscompile.save(engine, tmp_path / "pscompile.ckpt").stat().st_size
    with_base = pscompile.save(engine, tmp_path / "base.ckpt", frozen_weights=True).stat().st_size
    plain = _llama()                               # plain PyTorch + peft: torch.optim.AdamW on the adapters
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-3)
    plain(**batch).loss.backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    plain.save_pretrained(tmp_path / "adapter")
    theirs = (tmp_path / "optimizer.pt").stat().st_size + (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    assert ours <= 1.1 * theirs, (ours, theirs)
    base_bytes = 2 * sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert with_base - ours <= 1.1 * base_bytes, (with_base - ours, base_bytes)
    engine.close()


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_a_lora_run_resumed_through_the_trainer_repeats_the_uninterrupted_run(mode, tmp_path):
    from pscompile.integrations.transformers import PscompileTrainer

    def tiny(seed):
        torch.manual_seed(seed)
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, use_cache=False))
        torch.manual_seed(1)
        return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))

    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 256, (12, 32), generator=torch.Generator().manual_seed(2))]

    def trainer(out, model):
        args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-3,
                                              max_steps=6, save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                                              seed=0, disable_tqdm=True)
        return PscompileTrainer(model=model, args=args, train_dataset=data,
                                pscompile_config=pscompile.Config(device="cpu", dtype=torch.float32, backend="eager",
                                                                  mode=mode, device_memory="2MiB"))

    whole = trainer(tmp_path / "whole", tiny(0))
    whole.train()
    logs = [h["loss"] for h in whole.state.log_history if "loss" in h]
    ckpt = tmp_path / "whole" / "checkpoint-3"
    assert (ckpt / "pscompile.ckpt").stat().st_size < 200_000      # (the adapters' state, not the base)
    again = trainer(tmp_path / "again", tiny(0))                    # the base built as it was built
    again.train(resume_from_checkpoint=str(ckpt))
    assert [h["loss"] for h in again.state.log_history if "loss" in h][-3:] == logs[3:]
    want, got = whole.engine.full_state_dict(), again.engine.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    whole.engine.close()
    again.engine.close()
