"""fp32 compute: a host-homed chunk's param chunk is its fp32 master, and its gradients go home
into a buffer of their own, so the update leaves no cast to copy back. Where the chunks are not
fp32, are updated by another thread (lock-free) or live on the device, the two stay apart."""

import pytest
import torch

import pscompile
from pscompile.config import AdamW
from pscompile.memory.tiers import Tier
from pscompile.optim.adamw import ChunkAdamW
from conftest import make_batches, make_model


def test_the_shared_update_equals_the_cast_back_bit_for_bit():
    torch.manual_seed(0)
    hp = AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    master = torch.randn(1000)
    shared, ea, eas = master.clone(), torch.zeros(1000), torch.zeros(1000)
    apart, ea2, eas2 = master.clone(), torch.zeros(1000), torch.zeros(1000)
    param = master.clone()
    a, b = ChunkAdamW(hp), ChunkAdamW(hp)
    for _ in range(4):
        grad = torch.randn(1000)
        a.begin_step()
        b.begin_step()
        a.update_chunk(None, shared, ea, eas, grad_factor=0.5, gradless=[(100, 50)], grad=grad.clone())
        param.copy_(grad)                               # the gradient over the param chunk
        b.update_chunk(param, apart, ea2, eas2, grad_factor=0.5, gradless=[(100, 50)])
        assert torch.equal(shared, apart) and torch.equal(shared, param)
        assert torch.equal(ea, ea2) and torch.equal(eas, eas2)


def _engine(mode, **config):
    torch.manual_seed(0)
    model = make_model("gpt")
    batches = make_batches("gpt", 3)
    config = {"dtype": torch.float32, "chunk_size": 2048, **config}
    eng = pscompile.compile(model, batches[0], config=pscompile.Config(mode=mode, **config),
                            optimizer=pscompile.AdamW(lr=1e-2))
    return eng, batches


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_fp32_chunks_share_their_master(mode, tight_budget):
    eng, batches = _engine(mode, device_memory=tight_budget("gpt", torch.float32))
    store = eng.store
    host = [c for c in range(eng.layout.num_chunks) if store.os_tier[c] is Tier.HOST]
    assert host, "no host-homed chunk to check"
    before = [store.master[c].clone() for c in host]
    for b in batches:
        eng.step(b)
    for c, m0 in zip(host, before):
        assert store.shares_master(c) and store.master[c] is store.host_param[c]
        assert store.grad_home(c) is not store.host_param[c]
        assert not torch.equal(store.master[c], m0), f"chunk {c} was not updated"


def test_placement_round_trip_keeps_values_and_sharing():
    eng, batches = _engine("hooks")
    eng.step(batches[0])
    store = eng.store
    values = [store.master[c].clone() for c in range(eng.layout.num_chunks)]
    store.place_optimizer_states([0])
    assert not store.shares_master(0) and store.os_tier[0] is Tier.DEVICE
    store.place_optimizer_states([])
    assert all(store.shares_master(c) for c in range(eng.layout.num_chunks))
    for c, v in enumerate(values):       # (over the chunk's state extent: a shared master is the whole param chunk)
        n = eng.layout.state_extent(c)
        assert torch.equal(store.master[c][:n], v[:n]) and torch.equal(store.host_param[c][:n], v[:n])


@pytest.mark.parametrize("config", [dict(dtype=torch.bfloat16), dict(lock_free=True, staleness=1)],
                         ids=["bfloat16", "lock-free"])
def test_other_chunks_keep_a_master_of_their_own(config):
    eng, _ = _engine("hooks", **config)
    assert not any(eng.store.shares_master(c) for c in range(eng.layout.num_chunks))


@pytest.mark.parametrize("mode,device_mib", [("compiled", 2), ("hooks", 4)])
def test_gradients_home_before_a_later_fetch_survive_it(mode, device_mib):
    """A schedule that stores a gradient straight home and then fetches the same chunk again (its
    other parameters are still needed) must write the chunk back without losing that gradient:
    the home copy moves into the gradient buffer, and the fetch reads it from there."""
    from pscompile.graph import meta as gmeta
    from pscompile.graph.ops import MemKind
    from pscompile.testing import ReferenceTrainer

    hp = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model_bytes = sum(p.numel() for p in make_model("gpt").parameters()) * 16
    batches = make_batches("gpt", 3)
    eng = pscompile.compile(make_model("gpt"), batches[0], optimizer=hp, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=device_mib * 2**20,
        host_memory=model_bytes))
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    if mode == "compiled":
        home, again = set(), set()
        for n in eng.schedule.gm.graph.nodes:
            mem = gmeta.get(n, "mem")
            if mem is not None and mem.kind == MemKind.STORE_GRAD and mem.slot is None:
                home.add(mem.chunk)
            elif mem is not None and mem.kind == MemKind.FETCH and mem.chunk in home:
                again.add(mem.chunk)
        assert again and all(eng.store.shares_master(c) for c in again), (home, again)
    for i, b in enumerate(batches):
        ours, plain = eng.step(b), ref.step(b)
        assert abs(ours - plain) <= 1e-5 * abs(plain), f"step {i}: {ours} vs plain {plain}"
