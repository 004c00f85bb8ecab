"""A frozen base kept in NF4 (issue 72): ``Config(frozen_format="nf4")`` keeps every frozen
``nn.Linear`` weight in 4 bits with bitsandbytes' blocks and statistics, on the host and over the
link, and dequantizes it on the device as its fetch lands.

The judge is plain PyTorch training the same LoRA model whose frozen linear weights were replaced
by their NF4 round trip (``dequantize(quantize(w))``, what bitsandbytes' ``Linear4bit`` computes
with): losses and adapters step by step, both modes, float32 and bfloat16, budgets from the named
minimum up; every step within its budget, and (compiled mode checks it every step) bytes moved
equal to bytes planned, an NF4 chunk's fetch being its packed bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pscompile
from pscompile.graph.pipeline import _placed_memory
from pscompile.graph.schedule_passes import PlanRequest
from pscompile.kinds import MemKind
from pscompile.memory import nf4
from pscompile.memory.chunk_kinds import FROZEN_NF4
from pscompile.memory.model_bytes import ModelBytes
from pscompile.testing import ReferenceTrainer
from tests.conftest import make_batches, tracking_tol
from tests.test_frozen import HP, build

pytest.importorskip("peft")


def config(mode: str, dtype: torch.dtype, budget=None, **kw) -> pscompile.Config:
    return pscompile.Config(**{"mode": mode, "device": "cpu", "dtype": dtype, "device_memory": budget,
                               "backend": "eager", "chunk_size": 2048, "frozen_format": "nf4", **kw})


def nf4_names(model: nn.Module) -> set[str]:
    """The frozen weights of ``nn.Linear`` modules that no embedding shares (the tied lm_head is not)."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not m.weight.requires_grad and id(m.weight) not in tied}


def round_trip(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with each NF4 weight replaced by what its 4 bits stand for, in ``dtype``."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in nf4_names(model):
            params[n].copy_(nf4.dequantize(nf4.quantize(params[n]), dtype))
    return model


def _train(mode: str, dtype: torch.dtype, scale: float | None, steps: int = 4, **kw):
    batches = make_batches("gpt", steps)
    minimum = pscompile.min_device_memory(build("lora", dtype), batches[0], config(mode, dtype, **kw))
    budget = None if scale is None else int(minimum * scale)
    ref = ReferenceTrainer(round_trip(build("lora", dtype), dtype), optimizer=HP, dtype=dtype)
    initial = {n: m.clone() for n, m in ref.master_state().items()}
    engine = pscompile.compile(build("lora", dtype), batches[0], optimizer=HP, config=config(mode, dtype, budget, **kw))
    out = []
    for i, b in enumerate(batches):
        torch.manual_seed(i)
        want = ref.step(b)
        torch.manual_seed(i)
        out.append((want, engine.step(b), engine.stats))
    return engine, ref, initial, out, budget


def _check(engine, ref, initial, out, budget, dtype, evicts=True):
    for want, got, stats in out:
        assert got == pytest.approx(want, rel=1e-6 if dtype == torch.float32 else 2e-3)
        if budget is not None:
            assert stats.peak_device_bytes <= budget
        if evicts:
            assert stats.num_fetches > 0
    ours, theirs = engine.state_dict()["master"], ref.master_state()
    assert ours and set(ours) <= set(theirs)
    tol = 1e-6 if dtype == torch.float32 else tracking_tol(dtype)
    for n in ours:
        moved = max((theirs[n] - initial[n]).abs().mean().item(), 1e-5)
        assert (ours[n] - theirs[n]).abs().mean().item() <= tol * moved, n
    layout = engine.layout
    quantized = {e.fqn for e in layout.entries if e.quantized}
    assert quantized == nf4_names(build("lora", dtype)) and layout.quantized_chunks
    weights, want = engine.full_state_dict(), dict(ref.model.named_parameters())
    for n in quantized:                           # the 4-bit base reads back as its round trip, bit for bit
        assert torch.equal(weights[n].to(dtype), want[n].detach()), n
    if engine.config.mode.value == "compiled":    # an NF4 fetch moves the packed bytes (checked per step too)
        fetches = [a for a in engine.last_plan.actions if a.kind is MemKind.FETCH]
        packed = nf4.packed_bytes(layout.chunk_size)
        assert all(a.nbytes == (packed if a.chunk in layout.quantized_chunks else
                                layout.chunk_size * dtype.itemsize) for a in fetches)
        assert not evicts or any(a.chunk in layout.quantized_chunks for a in fetches)


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_with_plain_pytorch_on_the_round_tripped_base_at_an_evicting_budget(mode, dtype):
    _check(*_train(mode, dtype, 1.15), dtype)


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
@pytest.mark.parametrize("scale", [1.0, 1.5, None])
def test_parity_at_every_budget_from_the_minimum_up(mode, scale):
    _check(*_train(mode, torch.float32, scale, steps=3), torch.float32, evicts=scale == 1.0)


def test_parity_through_inductor():
    _check(*_train("compiled", torch.float32, 1.15, steps=2, backend="inductor"), torch.float32)


def test_nf4_chunks_hold_each_weight_block_aligned_in_bitsandbytes_blocks_and_the_host_holds_4_bits():
    model, batch = build("lora"), make_batches("gpt", 1)[0]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = pscompile.compile(model, batch, config=config("hooks", torch.float32))
    layout, store = engine.layout, engine.store
    for e in layout.entries:
        if not e.quantized:
            assert all(layout.kind(c) is not FROZEN_NF4 for c in e.chunks)        # the kinds are packed apart
            continue
        assert all(layout.kind(c) is FROZEN_NF4 and p.chunk_offset % 64 == 0 for c, p in zip(e.chunks, e.pieces))
        q = nf4.quantize(weights[e.fqn])
        for p in e.pieces:                          # each piece's codes and absmax are the tensor's own
            codes, absmax = nf4.chunk_views(store.host_param[p.chunk], layout.chunk_size)
            lo, n = p.tensor_offset, p.numel
            assert torch.equal(codes[p.chunk_offset // 2:(p.chunk_offset + n + 1) // 2], q.codes[lo // 2:(lo + n + 1) // 2])
            assert torch.equal(absmax[p.chunk_offset // 64:(p.chunk_offset + n + 63) // 64],
                               q.absmax[lo // 64:(lo + n + 63) // 64])
    packed = nf4.packed_bytes(layout.chunk_size)
    assert all(store.host_param[c].dtype == torch.uint8 and store.host_param[c].numel() == packed
               for c in layout.quantized_chunks)
    # the host holds what ModelBytes counts (one function), NF4 chunks at 0.5625 B per element
    frozen = sorted(layout.frozen_chunks)
    assert ModelBytes.of(torch.float32).host_bytes(layout, frozen) == sum(
        store.host_param[c].numel() * store.host_param[c].element_size() for c in frozen)
    assert packed == 0.5625 * layout.chunk_size
    engine.close()


def test_the_codes_are_bitsandbytes_codes():
    functional = pytest.importorskip("bitsandbytes.functional")
    model = build("lora")
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = pscompile.compile(model, make_batches("gpt", 1)[0], config=config("hooks", torch.float32))
    e = next(e for e in engine.layout.entries if e.quantized)
    w = weights[e.fqn]
    codes, state = functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    p = e.pieces[0]
    ours, absmax = nf4.chunk_views(engine.store.host_param[p.chunk], engine.layout.chunk_size)
    assert torch.equal(ours[p.chunk_offset // 2:(p.chunk_offset + p.numel) // 2], codes.reshape(-1)[:p.numel // 2])
    assert torch.equal(absmax[p.chunk_offset // 64:(p.chunk_offset + p.numel) // 64], state.absmax[:p.numel // 64])
    engine.close()


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match=r"frozen_format='int4'.*\('compute', 'nf4'\)"):
        pscompile.Config(frozen_format="int4")


def test_under_zero_a_shard_holds_whole_nf4_blocks():
    """Each rank's shard of a group kept in NF4 is whole blocks: an explicit chunk_size that would
    cut one is refused by name; "auto" rounds the group to ranks x blocks."""
    from pscompile.runtime.batching import call_model
    from pscompile.runtime.params import choose_layout, collect_params
    model, batch = build("lora"), make_batches("gpt", 1)[0]
    mp = collect_params(model, call_model, batch)
    with pytest.raises(ValueError, match=r"chunk_size=2016: .*multiple of 64"):
        choose_layout(mp, config("compiled", torch.float32, chunk_size=2016), None, world=2)
    assert choose_layout(mp, config("compiled", torch.float32), None, world=2).chunk_size == 2 * 2048
    auto = choose_layout(mp, config("compiled", torch.float32, chunk_size="auto"), None, world=3)
    assert auto.chunk_size % (3 * 64) == 0


def test_unfreezing_after_compile_is_refused_and_loses_nothing():
    model, batches = build("lora"), make_batches("gpt", 2)
    engine = pscompile.compile(model, batches[0], optimizer=HP, config=config("hooks", torch.float32))
    engine.step(batches[0])
    before = engine.state_dict()
    name = next(e.fqn for e in engine.layout.entries if e.quantized)
    dict(model.named_parameters())[name].requires_grad_(True)
    with pytest.raises(RuntimeError, match=name.replace(".", r"\.") + ".* is trainable now, frozen when compiled"):
        engine.step(batches[1])
    after = engine.state_dict()
    assert all(torch.equal(before["master"][n], after["master"][n]) for n in before["master"])
    engine.close()


@pytest.mark.parametrize("home", ["host", "disk"])
def test_a_checkpoint_keeps_the_4_bit_base_and_refuses_the_other_format(home, tmp_path):
    """``frozen_weights=True`` saves the packed base and loads it into another engine's NF4
    chunks, on the host or in disk homes (the saving and the loading engine alike)."""
    batches = make_batches("gpt", 3)
    kw = {"disk_dir": str(tmp_path), "host_memory": "130KB"} if home == "disk" else {}
    engine = pscompile.compile(build("lora"), batches[0], optimizer=HP, config=config("hooks", torch.float32, **kw))
    assert home == "host" or engine.param_disk_chunks & engine.layout.quantized_chunks
    engine.step(batches[0])
    path = pscompile.save(engine, tmp_path / "ckpt", frozen_weights=True)
    saved = {n: t for n, t in engine.full_state_dict().items()}
    want = engine.step(batches[1])
    # a fresh engine on a different base: the saved 4-bit base replaces it
    other = build("lora")
    with torch.no_grad():
        for p in other.parameters():
            if not p.requires_grad:
                p.mul_(1.5)
    fresh = pscompile.compile(other, batches[0], optimizer=HP, config=config("hooks", torch.float32, **kw))
    pscompile.load(fresh, path)
    assert all(torch.equal(fresh.full_state_dict()[n], saved[n]) for n in saved)
    assert fresh.step(batches[1]) == want
    # the compute-dtype format cannot take it: refused by name, the engine unchanged
    plain = pscompile.compile(build("lora"), batches[0], optimizer=HP,
                              config=config("hooks", torch.float32, frozen_format="compute"))
    before = plain.full_state_dict()
    with pytest.raises(ValueError, match="frozen_format='nf4'"):
        pscompile.load(plain, path)
    assert all(torch.equal(before[n], t) for n, t in plain.full_state_dict().items())
    for e in (engine, fresh, plain):
        e.close()


def test_the_issue_llama_holds_its_4_bit_base_and_adapter_states_within_a_tenth():
    """Issue 61's run (a 4-layer, 256-wide Llama, vocabulary 2048, LoRA r=8 on q_proj and v_proj,
    bf16) with its base in NF4: model data at most 1.1x (the linear weights' 4 bits and absmax, the
    rest of the base in bf16, 14 bytes per trainable parameter). The output head stays in bf16, as
    transformers' 4-bit loading keeps it."""
    transformers = pytest.importorskip("transformers")
    import peft
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg).to(torch.bfloat16),
                                peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    minimum = pscompile.min_device_memory(model, batch, config("hooks", torch.bfloat16, chunk_size="auto"))
    engine = pscompile.compile(model, batch, config=config("hooks", torch.bfloat16, minimum, chunk_size="auto"))
    entries = engine.layout.entries
    want = {f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not m.weight.requires_grad and not n.endswith("lm_head")}
    assert {e.fqn for e in entries if e.quantized} == want and len(want) == 4 * 7
    four_bit = sum(nf4.packed_bytes(e.numel) for e in entries if e.quantized)
    rest = sum(2 * e.numel for e in entries if not e.trainable and not e.quantized)
    trainable = sum(e.numel for e in entries if e.trainable)
    model_data = sum(engine.model_data().values())
    assert model_data <= 1.1 * (four_bit + rest + 14 * trainable), (model_data, four_bit + rest + 14 * trainable)
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_landing_in_place_takes_no_more_than_the_counted_workspace(dtype):
    """``dequantize_chunk`` turns a slot's packed bytes into its values in place; the device bytes
    it takes beside the slot, measured by the tracker every step uses, are at most
    ``workspace_bytes``, which the minimum, the planner and both engines count."""
    from pscompile.memory.tracker import NonModelTracker
    n = 65536
    w = torch.randn(n, generator=torch.Generator().manual_seed(0))
    home = torch.zeros(nf4.packed_bytes(n), dtype=torch.uint8)
    nf4.write_piece(home, n, 0, w)
    slot = torch.empty(n, dtype=dtype)
    slot.view(torch.uint8)[:home.numel()].copy_(home)
    ptr = slot.untyped_storage().data_ptr()
    tracker = NonModelTracker(torch.device("cpu"), lambda p: p == ptr, lambda: 0, exact_windows=True)
    with tracker:
        tracker.reset_peaks()
        nf4.dequantize_chunk(slot)
    assert torch.equal(slot, nf4.dequantize(nf4.quantize(w), dtype))
    assert nf4.packed_bytes(n) < tracker.peak_nonmodel <= nf4.workspace_bytes(n)


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
@pytest.mark.parametrize("host", ["180KB", "130KB"])
def test_with_the_disk_tier_nf4_chunks_live_on_disk_in_4_bits_and_the_run_is_the_same(mode, host, tmp_path):
    """A host too small for the chunks' homes: the disk takes the last chunks' (NF4 ones among
    them: their packed bytes), the engine-free pipeline's rule picks the same chunks, the disk holds
    and reads an NF4 chunk's packed bytes only, and the losses and the frozen weights are the run's
    without a disk, to the bit."""
    batches = make_batches("gpt", 3)

    def run(**kw):
        engine = pscompile.compile(build("lora"), batches[0], optimizer=HP, config=config(mode, torch.float32, **kw))
        losses = [engine.step(b) for b in batches]
        on_disk = set(engine.param_disk_chunks)
        # (the engine-free pipeline, which the planner runs, picks the same chunks for as many)
        request = PlanRequest(None, torch.float32, param_disk_chunks=len(on_disk))
        assert _placed_memory(engine.layout, request, peak_nonmodel=0).param_disk == on_disk
        frozen = {n: engine.store.gather("param", n) for n in nf4_names(build("lora"))}
        return engine, losses, on_disk, frozen
    _, plain, _, weights = run()
    engine, losses, on_disk, frozen = run(disk_dir=str(tmp_path), host_memory=host)
    assert losses == plain
    assert all(torch.equal(frozen[n], weights[n]) for n in weights)
    packed = on_disk & engine.layout.quantized_chunks
    assert packed and on_disk - packed           # both kinds' homes on disk
    store, cs = engine.store, engine.layout.chunk_size
    assert store.disk_model_bytes() == (len(on_disk - packed) * cs * 4 + len(packed) * nf4.packed_bytes(cs)
                                        + len(store.disk.slot_of) * store.os_chunk_bytes)
    for c in packed:
        assert store.open_home(c).numel() == nf4.packed_bytes(cs)
        store.close_home(c)
    engine.close()
