"""Frozen weights under ZeRO (issue 61), two ranks: frozen chunks are sharded and gathered like
any chunk but never reduced, hold no optimizer state on any rank, and a LoRA run tracks plain
PyTorch accumulating the ranks' halves, in both modes and both ways of dealing chunks."""

from __future__ import annotations

import pytest
import torch

import pscompile
import frozen_worker
from test_dist import WORLD, spawn
from pscompile.testing import ReferenceTrainer
from tests.conftest import make_batches
from tests.test_frozen import HP, build

peft = pytest.importorskip("peft")
CASES = [("compiled", "group"), ("hooks", "group"), ("compiled", "per_chunk"), ("hooks", "per_chunk")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen-zero")
    spawn(frozen_worker.frozen, str(out), CASES)
    return {case: [torch.load(out / f"{case[0]}-{case[1]}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for case in CASES}


@pytest.fixture(scope="module")
def reference():
    batches = make_batches("gpt", frozen_worker.STEPS)
    ref = ReferenceTrainer(build("lora"), optimizer=HP, dtype=torch.float32)
    losses = [ref.step([frozen_worker.split(b, r, WORLD) for r in range(WORLD)]) for b in batches]
    return losses, ref


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_lora_under_zero_tracks_plain_pytorch_and_never_reduces_a_frozen_chunk(runs, reference, case):
    ranks = runs[case]
    want, ref = reference
    for r in ranks:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        assert r["evictions"] > 0                        # (the budget evicts)
        assert not set(r["reduced"]) & set(r["frozen"])  # frozen chunks: no reduce-scatter, no writeback
        assert r["host"] == r["expected"]                # this rank's homes: ModelBytes.host_bytes
        assert r["resumed"] == r["again"]                # the checkpoint round trip resumes exactly
    if case[0] == "compiled":
        assert ranks[0]["reduced"], "no gradient was reduced at all"
    theirs = ref.model.state_dict()
    full = ranks[0]["full"]
    base = build("lora")
    for name, p in base.named_parameters():
        if p.requires_grad:
            assert (full[name] - theirs[name]).abs().max().item() <= 1e-5, name
        else:
            assert torch.equal(full[name], p.detach()), name          # bit for bit
    merged = pscompile.consolidate([r["state"] for r in ranks])
    assert set(merged["master"]) == {n for n, p in base.named_parameters() if p.requires_grad}
