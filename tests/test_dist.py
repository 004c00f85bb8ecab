"""ZeRO data parallelism by chunk with 2 processes (gloo on the CPU, one thread each).

Each test spawns its ranks (``tests/dist_worker.py``) and checks what they saved against plain
PyTorch on one process. The semantics are DDP's: each rank's loss is the mean over its part of the
batch, and gradients and the returned loss are means over ranks -- so the yardstick is plain
PyTorch accumulating the ranks' parts as micro-batches, ``(loss / k).backward()`` each.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import pscompile
from conftest import TRACKING_TOL, free_port, fresh_masters, make_batches, make_model, tracking_of
from pscompile.runtime.batching import call_model, extract_loss
from pscompile.testing import ReferenceTrainer

import dist_worker

WORLD = 2


def spawn(fn, *args, world: int = WORLD) -> None:
    mp.spawn(fn, args=(world, free_port(), *args), nprocs=world, join=True)


def reference(kind: str, batches, hp=dist_worker.HP, parts: int = WORLD) -> tuple[list[float], ReferenceTrainer]:
    ref = ReferenceTrainer(make_model(kind), optimizer=hp, dtype=torch.float32)
    losses = [ref.step([dist_worker.split(b, r, parts) for r in range(parts)]) for b in batches]
    return losses, ref


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def weight_error(full: dict[str, torch.Tensor], ref: ReferenceTrainer, kind: str = "gpt") -> float:
    """The whole model's relative error ||ours - plain|| / ||plain||, after checking every tensor
    tracks plain PyTorch (``tracking_of``: its error in units of how far plain PyTorch moved it)."""
    worst, name = tracking_of({k: full[k] for k in ref.master_state()}, ref, fresh_masters(kind, torch.float32))
    assert worst <= TRACKING_TOL, f"{name} tracks plain PyTorch only to {worst}"
    theirs = ref.master_state()
    diff = sum(((full[k] - v) ** 2).sum() for k, v in theirs.items()) ** 0.5
    return (diff / sum((v ** 2).sum() for v in theirs.values()) ** 0.5).item()


CASES = [("gpt", "compiled"), ("gpt", "hooks"), ("bert", "compiled"), ("bert", "hooks")]


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero")
    spawn(dist_worker.parity, str(out), CASES)
    return {(kind, mode): [torch.load(out / f"{kind}-{mode}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for kind, mode in CASES}


@pytest.mark.parametrize("kind,mode", CASES)
def test_two_ranks_track_plain_pytorch_under_eviction(parity_runs, kind, mode):
    ranks = parity_runs[(kind, mode)]
    ref_losses, ref = reference(kind, make_batches(kind, dist_worker.STEPS))
    for r, run in enumerate(ranks):
        for i, (ours, plain) in enumerate(zip(run["losses"], ref_losses)):
            assert rel(ours, plain) <= 1e-5, f"rank {r} step {i}: {ours} vs plain {plain}"
        for i, s in enumerate(run["stats"]):
            assert s["peak_device_bytes"] <= run["budget"], f"rank {r} step {i}: peak over its budget"
            assert s["num_evictions"] > 0 and s["allgather_bytes"] > 0 and s["reduce_scatter_bytes"] > 0
        if mode == "compiled":       # measured collective bytes == planned
            assert (run["stats"][-1]["allgather_bytes"], run["stats"][-1]["reduce_scatter_bytes"]) == run["planned"]
            assert "allgather" in run["schedule"] and "reduce_scatter" in run["schedule"]
    consolidated = pscompile.consolidate([run["state"] for run in ranks])
    assert weight_error(consolidated["master"], ref, kind) <= 1e-5
    assert weight_error(ranks[0]["full"], ref, kind) <= 1e-5          # full_state_dict gathers the same
    assert consolidated["step"] == dist_worker.STEPS


@pytest.mark.parametrize("kind,mode", CASES)
def test_each_rank_holds_a_world_size_share_of_the_model_data(parity_runs, kind, mode):
    single = pscompile.compile(make_model(kind), make_batches(kind, 1)[0], optimizer=dist_worker.HP,
                               config=dist_worker.config(mode, process_group=False))
    total = sum(single.model_data().values())     # every chunk, all 4 lists, on its home tier
    single.close()
    group, groups = parity_runs[(kind, mode)][0]["layout"]
    one_group = group * (4 + 12)               # compute dtype + master + exp_avg + exp_avg_sq
    for run in parity_runs[(kind, mode)]:
        assert run["host_model_bytes"] <= total / WORLD + one_group
        assert run["host_model_bytes"] == groups * group // WORLD * 16


@pytest.mark.parametrize("policy", ["recompute", "offload"])
def test_recomputation_and_offloading_under_zero_track_plain_pytorch(tmp_path, policy):
    """activations="recompute" with two ranks: the clones' parameter reads all-gather their groups
    again in the backward; "offload": each rank's activations go to its host and back, as planned.
    The training is plain PyTorch's over the global batch."""
    spawn(dist_worker.recompute, str(tmp_path), policy)
    ranks = [torch.load(tmp_path / f"{policy}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    ref_losses, ref = reference("gpt", make_batches("gpt", dist_worker.STEPS))
    for r, run in enumerate(ranks):
        assert run["recomputed" if policy == "recompute" else "offloaded"] > 0
        if policy == "offload":
            assert all(s["offload_bytes"] == s["reload_bytes"] == run["offload_planned"] > 0 for s in run["stats"])
        for i, (ours, plain) in enumerate(zip(run["losses"], ref_losses)):
            assert rel(ours, plain) <= 1e-5, f"rank {r} step {i}: {ours} vs plain {plain}"
        for s in run["stats"]:
            assert s["peak_device_bytes"] <= run["budget"] and s["num_evictions"] > 0
        assert (run["stats"][-1]["allgather_bytes"], run["stats"][-1]["reduce_scatter_bytes"]) == run["planned"]
    assert weight_error(ranks[0]["full"], ref) <= 1e-5


def test_accumulation_clipping_and_evaluate_are_global(tmp_path):
    """... and ``materialize`` gives every rank the whole model; ``export`` writes it once."""
    load_file = pytest.importorskip("safetensors.torch").load_file
    spawn(dist_worker.accumulate_eval, str(tmp_path), ["compiled", "hooks"])
    hp = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.05)
    batches = make_batches("gpt", 3, distinct=3)
    ref_losses, ref = reference("gpt", batches[:2], hp=hp, parts=2 * WORLD)
    with torch.no_grad():
        plain_eval = float(extract_loss(call_model(ref.model, batches[2]), batches[2], None))
    for mode in ("compiled", "hooks"):
        for r in range(WORLD):
            run = torch.load(tmp_path / f"accum-{mode}-rank{r}.pt", weights_only=False)
            for ours, plain in zip(run["losses"], ref_losses):
                assert rel(ours, plain) <= 1e-5, (mode, r, ours, plain)
            assert weight_error(run["full"], ref) <= 1e-5, mode
            assert rel(run["eval"], plain_eval) <= 1e-5, (mode, run["eval"], plain_eval)
            assert all(torch.equal(w, run["full"][n]) for n, w in run["seen"].items()), "materialize under ZeRO"
        exported = load_file(str(tmp_path / f"export-{mode}.safetensors"))
        assert exported.keys() == run["full"].keys() and all(torch.equal(exported[k], run["full"][k]) for k in exported)


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_two_rank_checkpoint_resumes_in_one_and_in_two_processes(tmp_path, mode):
    steps = 4
    spawn(dist_worker.resume, str(tmp_path), mode, None, steps)
    fresh = torch.load(tmp_path / f"resume-{mode}-None-rank0.pt")
    shards = [tmp_path / f"ckpt-{mode}-rank{r}.pt" for r in range(WORLD)]
    torch.save(pscompile.consolidate(shards), tmp_path / f"ckpt-{mode}-full.pt")
    folder = tmp_path / f"psckpt-{mode}"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(p.name for p in folder.iterdir()) == sorted(["manifest.json", manifest["folder"]])
    assert sorted(p.name for p in (folder / manifest["folder"]).iterdir()) == ["rank0.pt", "rank1.pt"]
    # resharded: one process loads the two-rank folder (the state consolidate gives), and saves it
    # as a one-process file that two ranks load again
    engine = pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0], optimizer=dist_worker.HP,
                               config=dist_worker.config(mode, None))
    pscompile.load(engine, folder)
    full, mine = pscompile.consolidate(shards), engine.state_dict()
    assert mine["step"] == full["step"] == steps // 2
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(mine[key][f], full[key][f]) for f in full[key]), key
    pscompile.save(engine, tmp_path / f"psfile-{mode}.ckpt")
    engine.close()
    folded = pscompile.consolidate(folder)                 # the folder itself, checked by its manifest
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(folded[key][f], full[key][f]) for f in full[key]), key
    # two processes resume from their state dict shards and from pscompile.save's folder exactly;
    # from the one-process file, and one process from the two-rank folder, within rounding
    # (the "full" load -- consolidate, then load_state_dict on one rank -- is what psfolder does inside)
    spawn(dist_worker.resume, str(tmp_path), mode, ["shard", "pscompile", "psfile"], steps)
    spawn(dist_worker.resume, str(tmp_path), mode, "psfolder", steps, world=1)
    for load in ("shard", "pscompile"):
        again = torch.load(tmp_path / f"resume-{mode}-{load}-rank0.pt")
        assert again == fresh[steps // 2:], f"two processes resumed from {load}"
    for load, world in (("psfolder", 1), ("psfile", WORLD)):
        again = torch.load(tmp_path / f"resume-{mode}-{load}-rank0.pt")
        assert len(again) == steps - steps // 2
        for a, b in zip(again, fresh[steps // 2:]):
            assert rel(a, b) <= 1e-5, f"{load} on {world} rank(s) resumed: {again} vs {fresh[steps // 2:]}"


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_a_dead_or_stalled_rank_surfaces_as_an_error_within_the_timeout(tmp_path, how):
    timeout = 4.0
    ctx = mp.spawn(dist_worker.dies, args=(WORLD, free_port(), str(tmp_path), timeout, how), nprocs=WORLD, join=False)
    while not ctx.join(timeout=120):
        pass
    result = torch.load(tmp_path / f"dies-{how}.pt")
    assert result["outcome"].startswith("CollectiveError: pscompile ZeRO:"), result
    assert "rank 0 of 2" in result["outcome"]
    assert result["seconds"] < timeout + 5, result


def test_consolidate_refuses_an_incomplete_set(parity_runs):
    ranks = parity_runs[("gpt", "compiled")]
    with pytest.raises(ValueError, match="one shard of each of ranks"):
        pscompile.consolidate([ranks[0]["state"]])
    with pytest.raises(ValueError, match="sharded run"):
        pscompile.consolidate([{"master": {}}])
    behind = dict(ranks[1]["state"], step=ranks[1]["state"]["step"] - 1)     # rank 1's file of an older save
    with pytest.raises(ValueError, match=r"different steps \(ranks 0..1: steps \[3, 2\]\)"):
        pscompile.consolidate([ranks[0]["state"], behind])


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_per_chunk_collectives_need_one_chunk_of_buffer_and_give_the_same_results(tmp_path, mode):
    """collectives="per_chunk" (broadcast from the owner, reduce to it) against "group" (all-gather,
    reduce-scatter) at the same chunk size: a collective's buffer is one chunk instead of a group of
    world_size chunks, and the training is the same."""
    spawn(dist_worker.collectives, str(tmp_path), mode)
    ranks = [torch.load(tmp_path / f"collectives-{mode}-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for run in ranks:
        group, per_chunk = run["group"], run["per_chunk"]
        assert per_chunk["slot_bytes"] * WORLD == group["slot_bytes"] == 16384 * 4 * WORLD
        assert per_chunk["losses"] == pytest.approx(group["losses"], rel=1e-6)
        for k, v in group["full"].items():
            assert torch.allclose(per_chunk["full"][k], v, rtol=1e-6, atol=1e-7), k
        assert per_chunk["stats"]["allgather_bytes"] > 0 and per_chunk["stats"]["reduce_scatter_bytes"] > 0
        if mode == "compiled":
            assert "pscompile.broadcast" in per_chunk["schedule"] and "pscompile.reduce(" in per_chunk["schedule"]
            assert "allgather" not in per_chunk["schedule"].split("def iteration")[1]
    full = pscompile.consolidate([run["per_chunk"]["state"] for run in ranks])
    for k, v in ranks[0]["per_chunk"]["full"].items():
        if k in full["master"]:
            assert torch.equal(full["master"][k], v), k


def test_readme_schedule_lines_are_real(parity_runs):
    """docs/zero.md's ZeRO schedule excerpt is what this run's rank 0 prints (GPT, 2 ranks, evicting)."""
    from pathlib import Path
    page = (Path(__file__).resolve().parents[1] / "docs" / "zero.md").read_text()
    block = page.split("# Data parallelism: ZeRO by chunk")[1].split("```text\n")[1].split("```")[0]
    schedule = parity_runs[("gpt", "compiled")][0]["schedule"].splitlines()
    for line in block.strip().splitlines():
        assert line in schedule, line


def test_inductor_backend_two_ranks_agree_and_track_plain_pytorch(tmp_path):
    spawn(dist_worker.inductor, str(tmp_path))
    ranks = [torch.load(tmp_path / f"inductor-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    ref_losses, ref = reference("gpt", make_batches("gpt", dist_worker.STEPS))
    assert ranks[0]["plan"] == ranks[1]["plan"], "the ranks planned different schedules"
    for run in ranks:
        for ours, plain in zip(run["losses"], ref_losses):
            assert rel(ours, plain) <= 1e-5, (run["losses"], ref_losses)
        assert max(run["peaks"]) <= run["budget"]
        # the steady steps ran the program, collectives inside, on both ranks
        assert run["shares"][-1] == 1.0 and not run["eager"], (run["shares"], run["eager"])
    assert ranks[0]["shares"] == ranks[1]["shares"]
    assert weight_error(ranks[0]["full"], ref) <= 1e-5


def test_fp16_overflow_is_agreed_a_named_group_shards_and_process_group_false_opts_out(tmp_path):
    spawn(dist_worker.fp16_and_opt_out, str(tmp_path))
    ranks = [torch.load(tmp_path / f"fp16-rank{r}.pt") for r in range(WORLD)]
    assert ranks[0]["record"] == ranks[1]["record"], "the ranks disagreed on an overflow"
    record = ranks[0]["record"]
    assert record[0] == (True, 2.0 ** 24), "the first step overflows at scale 2^24 and is skipped"
    assert ranks[0]["unchanged"] and ranks[1]["unchanged"], "a skipped step changed the weights"
    assert record[1][1] == 2.0 ** 23 and any(not skipped for skipped, _ in record), record
    for r in ranks:
        assert r["solo_world"] == 1 and r["solo_store"] == "ChunkStore"
        assert r["named_store"] == "ShardedStore"
    plain, _ = reference("gpt", make_batches("gpt", 1))
    assert ranks[0]["named_loss"] == ranks[1]["named_loss"] and rel(ranks[0]["named_loss"], plain[0]) <= 1e-5


def test_device_homes_under_zero_hold_what_each_rank_host_cannot(tmp_path):
    """ZeRO with a host budget for half of each rank's chunk homes, by group and per chunk: the
    first ones live on the rank's device (a shard's states and gradient buffer; its parameters are
    the master's cast, so its gathers and reductions cross no link). Training tracks plain PyTorch,
    every step evicts within the device budget, the host's model data stays within its budget,
    and compiled mode's link bytes are the plan's."""
    cases = [("compiled", "group"), ("hooks", "per_chunk")]
    spawn(dist_worker.device_homes, str(tmp_path), cases)
    ref_losses, ref = reference("gpt", make_batches("gpt", dist_worker.STEPS))
    for (mode, collectives), r, run in _saved_runs(tmp_path, "homes", cases):
        assert run["homes"], (mode, collectives, r)
        for ours, plain in zip(run["losses"], ref_losses):
            assert rel(ours, plain) <= 1e-5, (mode, collectives, r, ours, plain)
        for (device, host, evictions) in run["peaks"]:
            assert device <= run["budget"] and host <= run["host"] and evictions > 0, (mode, r, device, host)
        for measured, planned in run["moved"]:
            assert planned is None or measured == planned, (mode, r, measured, planned)
        assert weight_error(run["full"], ref) <= 1e-5, (mode, collectives)


def _saved_runs(tmp_path, prefix: str, cases):
    """((mode, collectives), rank, what the worker saved) for every case and rank."""
    for case in cases:
        for r in range(WORLD):
            yield case, r, torch.load(tmp_path / f"{prefix}-{case[0]}-{case[1]}-rank{r}.pt", weights_only=False)


def test_the_disk_tier_under_zero_each_rank_its_own_file(tmp_path):
    """ZeRO with optimizer states on the disk tier, by group and per chunk: each rank keeps the
    states its host cannot hold in its own (unlinked) file; training tracks plain PyTorch, and a
    state dict round trip through the disk tier changes nothing."""
    cases = [("compiled", "group"), ("hooks", "per_chunk")]
    spawn(dist_worker.disk_tier, str(tmp_path), cases)
    batches = make_batches("gpt", dist_worker.STEPS)
    ref_losses, ref = reference("gpt", batches)
    for mode, collectives in cases:
        for r in range(WORLD):
            run = torch.load(tmp_path / f"disk-{mode}-{collectives}-rank{r}.pt", weights_only=False)
            assert run["on_disk"] and run["disk"][0] > 0 and run["disk"][1] > 0, (mode, r, run["on_disk"])
            assert run["files"] == [], "the disk file was left visible"
            for ours, plain in zip(run["losses"], ref_losses):
                assert rel(ours, plain) <= 1e-5, (mode, collectives, r, ours, plain)
            assert weight_error(run["full"], ref) <= 1e-5, (mode, collectives)
            assert all(torch.equal(a, b) for a, b in zip(run["master"], run["again"]))


def test_ranks_with_different_lengths_in_a_step_train_and_other_ranks_are_refused(tmp_path):
    """Both modes (compiled with the eager backend and with Inductor), under a budget that evicts: rank 0 passes lengths 24, 17, 30, 17 and rank 1 19,
    24, 12, 30 in the same steps. They train (no wait on each other: the collectives match) and track plain
    PyTorch accumulating both ranks' batches; every step keeps its budget; compiled mode serves every
    length with one symbolic capture, and with Inductor each step after a measuring one runs the
    range's program compiled for symbolic sizes on each rank. A step whose tensors differ in rank (number of dimensions)
    across the ranks is refused on both with each rank's batches named, nothing changed, and training goes on."""
    modes = ["compiled", "hooks", "inductor"]
    spawn(dist_worker.lengths, str(tmp_path), modes)
    full = make_batches("gpt", 1)[0]
    steps = [[dist_worker.rank_batch(full, n, r, WORLD) for r, n in enumerate(ns)]
             for ns in [*zip(*dist_worker.RANK_LENGTHS), (16, 16)]]
    ref = ReferenceTrainer(make_model("gpt"), optimizer=dist_worker.HP, dtype=torch.float32)
    ref_losses = [ref.step(parts) for parts in steps]
    for mode in modes:
        for r in range(WORLD):
            run = torch.load(tmp_path / f"lengths-{mode}-rank{r}.pt", weights_only=False)
            assert run["refused"] is not None and "rank 0: [(((2, 16), torch.int64)" in run["refused"] \
                and "rank 1: [(((1, 2, 16), torch.int64)" in run["refused"], run["refused"]
            assert run["unchanged"], (mode, r)
            for i, (ours, plain) in enumerate(zip(run["losses"], ref_losses, strict=True)):
                assert rel(ours, plain) <= 1e-5, (mode, r, i, ours, plain)
            for i, s in enumerate(run["stats"]):
                assert s["peak_device_bytes"] <= run["budget"], (mode, r, i, s["peak_device_bytes"], run["budget"])
                assert s["num_evictions"] > 0, (mode, r, i)
            assert mode == "hooks" or run["symbolic"] == 1, (mode, r, run["symbolic"])
            if mode == "inductor":     # step 1: the ranks' lengths form a range, measured node by node;
                # step 2: its program; step 3: a length past the bound (30) plans the range again at the
                # new bound, measured; step 4: that range's program
                assert [s["compiled_share"] for s in run["stats"]] == [0.0, 1.0, 0.0, 1.0], (r, run["stats"])


