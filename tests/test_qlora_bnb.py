"""QLoRA as users build it (issue 72, part 2): a Llama that transformers loads in 4 bits through
bitsandbytes (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``) and ``peft``
wraps in LoRA, trained through ``pscompile.compile`` and ``PscompileTrainer`` in both modes.

The judge is the same model trained in plain PyTorch, bitsandbytes computing on the CPU: losses and
adapters step by step, under budgets that evict, in float32 and bfloat16, with batches of changing
length. The codes bitsandbytes loaded reach the chunks byte for byte, and come back at ``close``.
"""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.runtime.bnb4bit import Loaded4bitLinear, adopt
from pscompile.memory import nf4
from pscompile.testing import ReferenceTrainer
from tests.conftest import tracking_tol

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

HP = pscompile.AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
VOCAB, LENGTHS = 512, (16, 28, 20, 24)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved in each dtype, as a checkpoint on disk is (nothing is downloaded)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        out[dtype] = tmp_path_factory.mktemp(str(dtype).split(".")[-1])
        transformers.LlamaForCausalLM(cfg).to(dtype).save_pretrained(out[dtype])
    return out


def qlora(folder, dtype: torch.dtype, *, nested: bool = False, quant_type: str = "nf4", lora: bool = True,
          prepare: bool = False):
    """The model loaded in 4 bits on the CPU, LoRA (r=4, adapters not zero) on q_proj and v_proj, in
    training mode as a trainer puts it (in eval mode, a CPU with AVX512-BF16 makes bitsandbytes
    repack a layer at its first forward without gradients, its absmax rounded to bfloat16: a model
    that then computes differently on different machines); ``prepare``: after peft's
    ``prepare_model_for_kbit_training`` (the QLoRA recipe's step: norms in float32, activation
    checkpointing on, the embedding's output requiring grad)."""
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=dtype,
                                        bnb_4bit_use_double_quant=nested)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=q, device_map="cpu", dtype=dtype)
    if prepare:
        model = peft.prepare_model_for_kbit_training(model)
    if not lora:
        return model.train()
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0, init_lora_weights=False)).train()


def batches() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (2, n), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def config(mode: str, dtype: torch.dtype, budget=None) -> pscompile.Config:
    seq = pscompile.Dim("seq", max=max(LENGTHS))       # (one ranged plan in compiled mode: docs/dynamic-shapes.md)
    return pscompile.Config(mode=mode, device="cpu", dtype=dtype, backend="eager", chunk_size=2048,
                            device_memory=budget, dynamic={"input_ids": {1: seq}, "labels": {1: seq}})


def four_bit_layers(model) -> dict[str, torch.Tensor]:
    return {f"{n}.weight": m.weight.detach().clone() for n, m in model.named_modules()
            if isinstance(m, bnb.nn.Linear4bit)}


@pytest.mark.parametrize("dtype,nested", [(torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_tracks_plain_pytorch_with_bitsandbytes_under_an_evicting_budget(saved, mode, dtype, nested):
    """Losses and adapters against the same loaded model trained by plain PyTorch (bitsandbytes'
    Linear4bit computing on the CPU), at 1.15x the minimum, lengths changing every step."""
    data = batches()
    minimum = pscompile.min_device_memory(qlora(saved[dtype], dtype, nested=nested), data[1], config(mode, dtype))
    budget = int(1.15 * minimum)
    ref = ReferenceTrainer(qlora(saved[dtype], dtype, nested=nested), optimizer=HP, dtype=dtype)
    initial = {n: m.clone() for n, m in ref.master_state().items()}
    model = qlora(saved[dtype], dtype, nested=nested)
    engine = pscompile.compile(model, data[0], optimizer=HP, config=config(mode, dtype, budget))
    quantized = {e.fqn for e in engine.layout.entries if e.quantized}
    assert len(quantized) == 2 * 7 and all("lm_head" not in f for f in quantized)
    for i, b in enumerate(data):
        torch.manual_seed(i)
        want = ref.step(b)
        torch.manual_seed(i)
        got = engine.step(b)
        assert got == pytest.approx(want, rel=1e-6 if dtype == torch.float32 else 2e-3), (i, got, want)
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_fetches > 0
    ours, theirs = engine.state_dict()["master"], ref.master_state()
    assert ours and set(ours) <= set(theirs) and all("lora_" in n for n in ours)
    tol = 1e-6 if dtype == torch.float32 else tracking_tol(dtype)
    for n in ours:
        moved = max((theirs[n] - initial[n]).abs().mean().item(), 1e-5)
        assert (ours[n] - theirs[n]).abs().mean().item() <= tol * moved, n
    engine.close()


def test_the_loaded_codes_reach_the_chunks_byte_for_byte_and_come_back_at_close(saved):
    """Nothing is quantized again: each chunk holds bitsandbytes' own codes and absmax (a nested
    absmax dequantized as bitsandbytes dequantizes it); ``close`` gives them back, and the model
    then computes what the loaded model computed."""
    dtype = torch.float32
    loaded = qlora(saved[dtype], dtype, nested=True)
    codes = four_bit_layers(loaded)
    absmax = {f"{n}.weight": bnb.functional.dequantize_blockwise(m.weight.quant_state.absmax, m.weight.quant_state.state2)
              + m.weight.quant_state.offset for n, m in loaded.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    batch = batches()[0]
    with torch.no_grad():
        want = loaded(**batch).loss
    engine = pscompile.compile(loaded, batch, optimizer=HP, config=config("hooks", dtype))
    for name, code in codes.items():
        q = engine.store.codes(name)
        assert torch.equal(q.codes, code.reshape(-1)) and torch.equal(q.absmax, absmax[name]), name
    engine.close()
    adopted = [m for m in loaded.modules() if isinstance(m, Loaded4bitLinear)]
    assert len(adopted) == len(codes) and all(m.source is not None and m.weight.is_meta for m in adopted)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).loss, want)
    again = pscompile.compile(loaded, batch, optimizer=HP, config=config("hooks", dtype))     # (compiled again)
    assert all(torch.equal(again.store.codes(n).codes, c.reshape(-1)) for n, c in codes.items())
    again.close()


def test_a_4_bit_layer_pscompile_cannot_keep_as_loaded_is_refused_by_name_and_nothing_changes(saved):
    model = qlora(saved[torch.float32], torch.float32, quant_type="fp4")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"Linear4bit 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.base_layer'"
                                         r" is quantized as 'fp4'.*bnb_4bit_quant_type='nf4'"):
        pscompile.compile(model, batches()[0], config=config("hooks", torch.float32))
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_an_8_bit_base_is_refused_with_what_works(saved):
    q = transformers.BitsAndBytesConfig(load_in_8bit=True)
    try:
        model = transformers.LlamaForCausalLM.from_pretrained(saved[torch.float32], quantization_config=q, device_map="cpu")
    except Exception as e:  # noqa: BLE001 - (bitsandbytes builds without 8-bit CPU support refuse to load it)
        pytest.skip(f"bitsandbytes cannot load an 8-bit model here: {e}")
    with pytest.raises(ValueError, match="load_in_4bit=True"):
        pscompile.compile(model, batches()[0], config=config("hooks", torch.float32))


ZERO_CASES = [("hooks", "group"), ("compiled", "per_chunk")]


def test_under_zero_two_ranks_train_the_loaded_base_and_give_its_codes_back(saved, tmp_path):
    """Two gloo ranks, each keeping its shards of the loaded codes: losses and adapters track plain
    PyTorch + bitsandbytes accumulating the ranks' halves, every step within the budget, and at
    ``close`` every layer gets bitsandbytes' codes back, byte for byte, from both ranks' shards."""
    import frozen_worker
    from test_dist import WORLD, spawn
    spawn(frozen_worker.loaded, str(tmp_path), str(saved[torch.float32]), ZERO_CASES)
    data = [batches()[1]] * frozen_worker.STEPS
    ref = ReferenceTrainer(qlora(saved[torch.float32], torch.float32, nested=True), optimizer=frozen_worker.HP,
                           dtype=torch.float32)
    want = [ref.step([frozen_worker.split(b, r, WORLD) for r in range(WORLD)]) for b in data]
    theirs = ref.master_state()
    for mode, collectives in ZERO_CASES:
        for r in range(WORLD):
            run = torch.load(tmp_path / f"loaded-{mode}-{collectives}-rank{r}.pt", weights_only=False)
            assert run["losses"] == pytest.approx(want, rel=1e-5), (mode, collectives)
            assert max(run["peaks"]) <= run["budget"] and run["evictions"] > 0
            assert run["adopted"] and run["codes_back"], (mode, collectives)
            assert run["full"] and all("lora_" in n for n in run["full"])
            for n, w in run["full"].items():
                torch.testing.assert_close(w, theirs[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
def test_the_trainer_trains_a_qlora_model_as_the_plain_trainer_does(saved, mode, tmp_path):
    """``PscompileTrainer`` against transformers' own ``Trainer`` on the same loaded model, prepared
    as the QLoRA recipe prepares it (activation checkpointing on)."""
    from pscompile.integrations.transformers import PscompileTrainer
    data = [{"input_ids": x, "labels": x} for x in
            torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(2))]

    def args(out):
        return transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-2,
                                              max_steps=4, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                                              disable_tqdm=True, save_strategy="no")

    plain = transformers.Trainer(model=qlora(saved[torch.float32], torch.float32, prepare=True), args=args(tmp_path / "plain"),
                                 train_dataset=data)
    plain.train()
    want = [h["loss"] for h in plain.state.log_history if "loss" in h]
    budget = int(1.15 * pscompile.min_device_memory(qlora(saved[torch.float32], torch.float32, prepare=True),
                                                    {k: torch.stack([data[0][k], data[1][k]]) for k in data[0]},
                                                    pscompile.Config(mode=mode, device="cpu", dtype=torch.float32,
                                                                     backend="eager", chunk_size=2048)))
    trainer = PscompileTrainer(model=qlora(saved[torch.float32], torch.float32, prepare=True), args=args(tmp_path / "ours"),
                               train_dataset=data,
                               pscompile_config=pscompile.Config(mode=mode, device="cpu", dtype=torch.float32,
                                                                 backend="eager", chunk_size=2048, device_memory=budget))
    trainer.train()
    got = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-5)
    assert trainer.engine.stats.peak_device_bytes <= budget and trainer.engine.stats.num_fetches > 0
    theirs = {n: p.detach() for n, p in plain.model.named_parameters() if p.requires_grad}
    ours = trainer.engine.full_state_dict()
    for n, w in theirs.items():
        torch.testing.assert_close(ours[n], w, rtol=1e-5, atol=1e-6, msg=n)
    trainer.engine.close()


def test_a_layer_bitsandbytes_repacked_for_its_cpu_kernel_is_taken_as_it_computes(saved):
    """In eval mode on a CPU with AVX512-BF16, bitsandbytes repacks a layer at its first forward
    without gradients (tiles for its kernel, the absmax in bfloat16, a nested one dequantized).
    ``adopt`` takes such a layer as it now computes: the codes exactly as loaded, the absmax the
    bfloat16 values it holds (never quantized again). Repacked here by bitsandbytes' own
    conversion, whatever this CPU has."""
    convert = getattr(bnb.functional, "_convert_weight_packed_for_cpu", None)
    if convert is None:
        pytest.skip("this bitsandbytes has no CPU repacking")
    model = qlora(saved[torch.float32], torch.float32, nested=True, lora=False)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    codes = {n: m.weight.detach().reshape(-1).clone() for n, m in layers.items()}
    absmax = {n: bnb.functional.dequantize_blockwise(m.weight.quant_state.absmax, m.weight.quant_state.state2)
              + m.weight.quant_state.offset for n, m in layers.items()}
    for m in layers.values():
        m.weight.data, m.weight.quant_state = convert(m.weight.data, m.weight.quant_state)
        assert m.weight.shape != m.weight.quant_state.shape and m.weight.quant_state.absmax.dtype == torch.bfloat16
    assert adopt(model) == len(layers) == 14
    for n in layers:
        source = model.get_submodule(n).source
        assert torch.equal(source.codes, codes[n]), n
        assert torch.equal(source.absmax, absmax[n].to(torch.bfloat16).float()), n


def test_dequantized_as_bitsandbytes_dequantizes(saved):
    """The levels and the absmax give bitsandbytes' own weights: pscompile's ``dequantize`` of the
    loaded codes equals ``dequantize_4bit`` for every layer."""
    model = qlora(saved[torch.float32], torch.float32, nested=True, lora=False)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    want = {n: bnb.functional.dequantize_4bit(m.weight, m.weight.quant_state) for n, m in layers.items()}
    assert adopt(model) == len(layers) == 14
    for n, w in want.items():
        got = nf4.dequantize(model.get_submodule(n).source, torch.float32)
        assert torch.equal(got, w), n
