"""Frozen weights under ZeRO (issue 61), two ranks: frozen chunks are sharded and gathered like
any chunk but never reduced, hold no optimizer state on any rank, and a LoRA run tracks plain
PyTorch accumulating the ranks' halves, in both modes and both ways of dealing chunks; with the
frozen base kept in NF4 (issue 72) too, each rank's homes and collectives then carrying its packed
bytes, and plain PyTorch training the round-tripped base."""

from __future__ import annotations

import pytest
import torch

import pscompile
import frozen_worker
from test_dist import WORLD, spawn
from pscompile.testing import ReferenceTrainer
from tests.conftest import make_batches
from tests.test_frozen import HP, build
from tests.test_nf4_base import round_trip

peft = pytest.importorskip("peft")
CASES = [(mode, collectives, fmt) for fmt in ("compute", "nf4") for collectives in ("group", "per_chunk")
         for mode in ("compiled", "hooks")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen-zero")
    spawn(frozen_worker.frozen, str(out), CASES)
    return {case: [torch.load(out / f"{'-'.join(case)}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for case in CASES}


def base(fmt: str):
    """The model plain PyTorch trains: the base as built, or its NF4 round trip."""
    return round_trip(build("lora"), torch.float32) if fmt == "nf4" else build("lora")


@pytest.fixture(scope="module")
def reference():
    out = {}
    for fmt in ("compute", "nf4"):
        batches = make_batches("gpt", frozen_worker.STEPS)
        ref = ReferenceTrainer(base(fmt), optimizer=HP, dtype=torch.float32)
        out[fmt] = [ref.step([frozen_worker.split(b, r, WORLD) for r in range(WORLD)]) for b in batches], ref
    return out


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_lora_under_zero_tracks_plain_pytorch_and_never_reduces_a_frozen_chunk(runs, reference, case):
    ranks = runs[case]
    want, ref = reference[case[2]]
    assert bool(ranks[0]["quantized"]) == (case[2] == "nf4")
    for r in ranks:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        assert r["evictions"] > 0                        # (the budget evicts)
        assert max(r["peaks"]) <= r["budget"]            # every step within it
        assert not set(r["reduced"]) & set(r["frozen"])  # frozen chunks: no reduce-scatter, no writeback
        assert r["host"] == r["expected"]                # this rank's homes: ModelBytes.host_bytes
        assert r["resumed"] == r["again"]                # the checkpoint round trip resumes exactly
    if case[0] == "compiled":
        assert ranks[0]["reduced"], "no gradient was reduced at all"
    theirs = ref.model.state_dict()
    full = ranks[0]["full"]
    for name, p in base(case[2]).named_parameters():
        if p.requires_grad:
            assert (full[name] - theirs[name]).abs().max().item() <= 1e-5, name
        else:
            assert torch.equal(full[name], p.detach()), name          # bit for bit
    merged = pscompile.consolidate([r["state"] for r in ranks])
    assert set(merged["master"]) == {n for n, p in base(case[2]).named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "nf4"], ids=["-".join(c[:2]) for c in CASES if c[2] == "nf4"])
def test_an_nf4_base_under_zero_gathers_its_packed_bytes(runs, case):
    """The same steps gather fewer bytes with the base in NF4: a frozen group's collective moves
    its packed shards (0.5625 bytes a weight), not its float32 elements."""
    nf4_run, plain_run = runs[case], runs[(case[0], case[1], "compute")]
    for mine, plain in zip(nf4_run, plain_run):
        assert 0 < mine["gathered"] < plain["gathered"], (mine["gathered"], plain["gathered"])
