"""What each rank of the multi-process tests runs (spawned by ``tests/test_dist.py``).

Every function takes ``(rank, world, port, out_dir, ...)``, joins a gloo group on 127.0.0.1 with
one thread, and writes what the parent checks into ``out_dir`` (``torch.save``).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

import pscompile
from conftest import make_batches, make_model


def no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norms: the parameter group most training scripts exempt from weight decay."""
    return param.ndim < 2


# a parameter group as training scripts set it, so every sharded run here exercises groups
HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                     param_groups=[{"params": no_decay, "weight_decay": 0.0}])
STEPS = 3


def join(rank: int, world: int, port: int, timeout_s: float = 120.0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def leave() -> None:
    """Every rank is done with every collective before any tears its side of the group down; then
    the process ends at once. Its results are on disk by now, and the interpreter's own teardown
    after a gloo group once aborted a rank (``terminate called without an active exception``, a
    C++ thread of torch's destroyed while joinable; SIGABRT in 1 of many CI runs), which no part of
    the test is about."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def split(batch, rank: int, world: int):
    """This rank's part of a global batch (rows rank::world would do too; contiguous halves here)."""
    def part(t):
        n = t.shape[0] // world
        return t[rank * n:(rank + 1) * n]
    if isinstance(batch, dict):
        return {k: part(v) for k, v in batch.items()}
    return tuple(part(t) for t in batch)


def config(mode: str, device_memory=None, **kw) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32,
                            device_memory=device_memory, **kw)


def tight_budget(kind: str, mode: str, rank: int, world: int, **kw) -> int:
    """This model's sharded minimum plus one gathered group: every step must evict."""
    batch = split(make_batches(kind, 1)[0], rank, world)
    engine = pscompile.compile(make_model(kind), batch, optimizer=HP, config=config(mode, **kw))
    engine.step(batch)
    least = engine.min_device_memory + engine.store.param_chunk_bytes
    engine.close()
    return least


def parity(rank: int, world: int, port: int, out_dir: str, cases: list[tuple[str, str]]) -> None:
    """Train each (kind, mode) for STEPS steps on this rank's half of the global batches under a
    budget that evicts; save the losses, per-step stats and this rank's state dict."""
    join(rank, world, port)
    for kind, mode in cases:
        budget = tight_budget(kind, mode, rank, world)
        batches = make_batches(kind, STEPS)
        engine = pscompile.compile(make_model(kind), split(batches[0], rank, world), optimizer=HP,
                                   config=config(mode, budget))
        losses, stats = [], []
        for b in batches:
            losses.append(engine.step(split(b, rank, world)))
            stats.append(engine.stats.as_dict())
        plan = engine.last_plan if mode == "compiled" else None
        torch.save({"losses": losses, "stats": stats, "budget": budget, "state": engine.state_dict(),
                    "full": engine.full_state_dict(),
                    "planned": None if plan is None else (plan.allgather_bytes, plan.reduce_scatter_bytes),
                    "schedule": str(engine.schedule) if mode == "compiled" else None,
                    "layout": (engine.layout.chunk_size, engine.layout.num_chunks),
                    "host_model_bytes": engine.store.host_model_bytes()},
                   os.path.join(out_dir, f"{kind}-{mode}-rank{rank}.pt"))
        engine.close()
    leave()


def recompute(rank: int, world: int, port: int, out_dir: str, policy: str = "recompute") -> None:
    """Compiled mode with every activation segment recomputed (or offloaded: ``policy``), at this
    rank's minimum for that graph (``pscompile.min_device_memory`` with the group) plus one
    gathered group."""
    join(rank, world, port)
    batches = make_batches("gpt", STEPS)
    first = split(batches[0], rank, world)
    least = pscompile.min_device_memory(make_model("gpt"), first, config("compiled", activations=policy))
    engine = pscompile.compile(make_model("gpt"), first, optimizer=HP,
                               config=config("compiled", activations=policy))
    budget = least + engine.store.param_chunk_bytes
    engine.close()
    engine = pscompile.compile(make_model("gpt"), first, optimizer=HP,
                               config=config("compiled", budget, activations=policy))
    losses, stats = [], []
    for b in batches:
        losses.append(engine.step(split(b, rank, world)))
        stats.append(engine.stats.as_dict())
    plan = engine.last_plan
    torch.save({"losses": losses, "stats": stats, "budget": budget, "full": engine.full_state_dict(),
                "planned": (plan.allgather_bytes, plan.reduce_scatter_bytes),
                "recomputed": len(engine.schedule.scheduled.activations.recomputed),
                "offloaded": len(engine.schedule.scheduled.activations.offloaded),
                "offload_planned": engine.schedule.scheduled.offload_bytes},
               os.path.join(out_dir, f"{policy}-rank{rank}.pt"))
    engine.close()
    leave()


def accumulate_eval(rank: int, world: int, port: int, out_dir: str, modes: list[str]) -> None:
    """Two steps of 2 accumulated micro-batches per rank with clipping (the global norm), then
    ``evaluate``, under a budget that evicts; save the losses and the full weights."""
    join(rank, world, port)
    hp = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.05)
    for mode in modes:
        budget = tight_budget("gpt", mode, rank, world)
        batches = make_batches("gpt", 3, distinct=3)
        micro = [[split(b, 2 * rank + m, 2 * world) for m in range(2)] for b in batches[:2]]
        model = make_model("gpt")
        engine = pscompile.compile(model, micro[0][0], optimizer=hp, config=config(mode, budget))
        losses = [engine.step(mb) for mb in micro]
        evaluation = engine.evaluate(split(batches[2], rank, world))
        with engine.materialize():          # a collective: every rank gets the whole model
            seen = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine.export(os.path.join(out_dir, f"export-{mode}.safetensors"))   # (rank 0 writes)
        torch.save({"losses": losses, "eval": evaluation, "full": engine.full_state_dict(), "seen": seen},
                   os.path.join(out_dir, f"accum-{mode}-rank{rank}.pt"))
        engine.close()
    leave()


def resume(rank: int, world: int, port: int, out_dir: str, mode: str, loads: str | None | list, steps: int) -> None:
    """GPT under an evicting budget, for each of ``loads`` in turn (one process start for all): a
    fresh engine loads it (None: start fresh; "shard": this rank's file of a 2-rank run; "full":
    the consolidated dict; "pscompile": the ``pscompile.save`` folder; "psfolder": that folder on
    one rank; "psfile": a one-process ``pscompile.save`` file on two), runs ``steps`` steps, saves
    the losses; a fresh run also saves every rank's state dict and a ``pscompile.save``
    checkpoint after its first ``steps // 2`` steps."""
    join(rank, world, port)
    budget = tight_budget("gpt", mode, rank, world)
    batches = make_batches("gpt", steps, distinct=3)
    for load in loads if isinstance(loads, list) else [loads]:
        engine = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP,
                                   config=config(mode, budget))
        if load == "shard":
            engine.load_state_dict(torch.load(os.path.join(out_dir, f"ckpt-{mode}-rank{rank}.pt"), weights_only=True))
        elif load == "full":
            engine.load_state_dict(torch.load(os.path.join(out_dir, f"ckpt-{mode}-full.pt"), weights_only=True))
        elif load in ("pscompile", "psfolder"):             # psfolder: the 2-rank folder, on 1 rank
            pscompile.load(engine, os.path.join(out_dir, f"psckpt-{mode}"))
        elif load == "psfile":                               # a one-process file, on 2 ranks
            pscompile.load(engine, os.path.join(out_dir, f"psfile-{mode}.ckpt"))
        losses = []
        for i, b in enumerate(batches):
            if load is None and i == steps // 2:
                torch.save(engine.state_dict(), os.path.join(out_dir, f"ckpt-{mode}-rank{rank}.pt"))
                pscompile.save(engine, os.path.join(out_dir, f"psckpt-{mode}"))     # a folder: a file per rank
            if load is not None and i < steps // 2:
                continue
            losses.append(engine.step(split(b, rank, world)))
        torch.save(losses, os.path.join(out_dir, f"resume-{mode}-{load}-rank{rank}.pt"))
        engine.close()
    leave()


def dies(rank: int, world: int, port: int, out_dir: str, timeout_s: float, how: str) -> None:
    """Rank 1 exits (``how="exit"``) or stalls past the timeout (``"stall"``) after its first step;
    rank 0's next step must fail within the timeout, not hang. The engine's group has the short
    timeout; the ranks line up on the default group (a long timeout) before each step, so that
    only the step meant to fail can time out, however slowly this machine compiles."""
    import time
    join(rank, world, port)
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    batch = split(make_batches("gpt", 1)[0], rank, world)
    engine = pscompile.compile(make_model("gpt"), batch, optimizer=HP,
                               config=config("compiled", process_group=group))
    dist.barrier()
    engine.step(batch)
    dist.barrier()
    if rank == 1:
        if how == "stall":
            time.sleep(3 * timeout_s)
        os._exit(0)
    start = time.perf_counter()
    try:
        engine.step(batch)
        engine.step(batch)
        outcome = "no error"
    except Exception as e:            # what the user sees
        outcome = f"{type(e).__name__}: {e}"
    torch.save({"outcome": outcome, "seconds": time.perf_counter() - start}, os.path.join(out_dir, f"dies-{how}.pt"))
    os._exit(0)


def collectives(rank: int, world: int, port: int, out_dir: str, mode: str) -> None:
    """The same training with collectives="group" and "per_chunk" at one budget: losses, weights,
    the device bytes of one slot, and the largest communication buffer each needed."""
    join(rank, world, port)
    batches = make_batches("gpt", STEPS)
    out = {}
    for kind in ("group", "per_chunk"):          # chunks of 16,384 elements (the largest tensor) in both
        budget = tight_budget("gpt", mode, rank, world, collectives=kind, chunk_size=16384)
        engine = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP,
                                   config=config(mode, budget, collectives=kind, chunk_size=16384))
        losses = [engine.step(split(b, rank, world)) for b in batches]
        out[kind] = {"losses": losses, "full": engine.full_state_dict(), "budget": budget,
                     "slot_bytes": engine.store.param_chunk_bytes, "chunk_elements": engine.layout.chunk_size,
                     "peaks": engine.stats.peak_device_bytes, "min": engine.min_device_memory,
                     "stats": engine.stats.as_dict(), "state": engine.state_dict(),
                     "schedule": str(engine.schedule) if mode == "compiled" else None}
        engine.close()
    torch.save(out, os.path.join(out_dir, f"collectives-{mode}-rank{rank}.pt"))
    leave()


def inductor(rank: int, world: int, port: int, out_dir: str) -> None:
    """GPT in compiled mode with the Inductor backend under an evicting budget: the ranks measure
    and must agree on the curve they plan from (or the collectives would differ); the collectives
    run inside the compiled program."""
    join(rank, world, port)
    batches = make_batches("gpt", STEPS)
    budget = tight_budget("gpt", "compiled", rank, world)
    cfg = pscompile.Config(mode="compiled", backend="inductor", device="cpu", dtype=torch.float32,
                           device_memory=budget)
    engine = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP, config=cfg)
    losses, peaks, shares = [], [], []
    for b in batches:
        losses.append(engine.step(split(b, rank, world)))
        peaks.append(engine.stats.peak_device_bytes)
        shares.append(engine.stats.compiled_share)
    torch.save({"losses": losses, "peaks": peaks, "budget": budget, "full": engine.full_state_dict(),
                "plan": engine.last_plan.actions, "shares": shares, "eager": {c.capture: c.eager_reason for c in engine.captures() if c.eager_reason}},
               os.path.join(out_dir, f"inductor-rank{rank}.pt"))
    engine.close()
    leave()


def fp16_and_opt_out(rank: int, world: int, port: int, out_dir: str) -> None:
    """Hooks mode in float16 whose first loss scales overflow: every rank skips the same steps (the
    weights stay) and lowers the same scale until a step goes through; then ``process_group=False``
    under the initialized group gives a replicated one-rank engine."""
    join(rank, world, port)
    batches = make_batches("gpt", 8)
    cfg = pscompile.Config(mode="hooks", device="cpu", dtype=torch.float16, initial_loss_scale=2.0 ** 24)
    engine = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP, config=cfg)
    before = engine.full_state_dict()
    record, unchanged = [], None
    for b in batches:
        engine.step(split(b, rank, world))
        record.append((engine.stats.skipped, engine.stats.loss_scale))
        if len(record) == 1:
            after = engine.full_state_dict()
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
    engine.close()
    group = dist.new_group(ranks=list(range(world)))       # an explicit group shards like the default one
    named = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP,
                              config=config("compiled", process_group=group))
    named_loss = named.step(split(batches[0], rank, world))
    named_store = type(named.store).__name__
    named.close()
    solo = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP,
                             config=config("hooks", process_group=False))
    torch.save({"record": record, "unchanged": unchanged, "solo_world": solo.world,
                "solo_store": type(solo.store).__name__, "named_store": named_store, "named_loss": named_loss},
               os.path.join(out_dir, f"fp16-rank{rank}.pt"))
    solo.close()
    leave()


def killed_save(rank: int, world: int, port: int, out_dir: str, moment: str) -> None:
    """Hooks mode, two steps: a committed ``pscompile.save`` after the first, then a second save
    into the same folder during which one rank dies at ``moment``:

    - "rank1-before-file": rank 1 dies before writing its file (rank 0 has written its own);
    - "rank0-before-commit": every rank file is written, rank 0 dies before the manifest;
    - "rank0-after-commit": rank 0 dies after the manifest, before removing the old folder.

    Each rank keeps its state dict after each step (what a load must give back) and what the save
    raised on it."""
    import pscompile.checkpoint.sharded as sharded
    join(rank, world, port, timeout_s=30.0)
    batch = split(make_batches("gpt", 1)[0], rank, world)
    engine = pscompile.compile(make_model("gpt"), batch, optimizer=HP, config=config("hooks"))
    folder = os.path.join(out_dir, "ckpt")
    engine.step(batch)
    torch.save(engine.state_dict(), os.path.join(out_dir, f"state1-rank{rank}.pt"))
    pscompile.save(engine, folder)
    engine.step(batch)
    torch.save(engine.state_dict(), os.path.join(out_dir, f"state2-rank{rank}.pt"))
    write, remove = sharded.write_atomic, sharded._remove_uncommitted

    def dying_write(path, content):
        name = os.path.basename(str(path))
        if (moment == "rank1-before-file" and rank == 1 and name.startswith("rank")) or \
                (moment == "rank0-before-commit" and rank == 0 and name == sharded.MANIFEST):
            os._exit(0)
        return write(path, content)

    def dying_remove(path, keep):
        if moment == "rank0-after-commit":
            os._exit(0)
        return remove(path, keep)
    sharded.write_atomic, sharded._remove_uncommitted = dying_write, dying_remove
    try:
        pscompile.save(engine, folder)
        outcome = "saved"
    except Exception as e:          # the surviving rank: the other died mid-save
        outcome = f"{type(e).__name__}: {e}"
    torch.save(outcome, os.path.join(out_dir, f"outcome-rank{rank}.pt"))
    os._exit(0)


def load_checkpoint(rank: int, world: int, port: int, out_dir: str, names: str | list[str]) -> None:
    """A fresh hooks engine per rank loads ``out_dir/name`` for each of ``names`` in turn (each
    load refused, or the first accepted); each saves its state dict after the load, or what the
    load raised and whether its state dict stayed as it was before the attempt."""
    join(rank, world, port)
    batch = split(make_batches("gpt", 1)[0], rank, world)
    engine = pscompile.compile(make_model("gpt"), batch, optimizer=HP, config=config("hooks"))
    for name in [names] if isinstance(names, str) else names:
        before = engine.state_dict()
        try:
            pscompile.load(engine, os.path.join(out_dir, name))
            out = {"state": engine.state_dict(), "error": None}
        except Exception as e:
            out = {"error": f"{type(e).__name__}: {e}", "unchanged": _same(before, engine.state_dict())}
        torch.save(out, os.path.join(out_dir, f"loaded-{name}-rank{rank}.pt"))
    leave()


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["master"], b["master"])) and a["step"] == b["step"]


def load_and_save(rank: int, world: int, port: int, out_dir: str, name: str) -> None:
    """Load ``out_dir/name``, take a step and save into it again."""
    join(rank, world, port)
    batch = split(make_batches("gpt", 1)[0], rank, world)
    engine = pscompile.compile(make_model("gpt"), batch, optimizer=HP, config=config("hooks"))
    pscompile.load(engine, os.path.join(out_dir, name))
    engine.step(batch)
    pscompile.save(engine, os.path.join(out_dir, name))
    leave()


def disk_tier(rank: int, world: int, port: int, out_dir: str, cases: list[tuple[str, str]]) -> None:
    """Each (mode, collectives): a host budget that holds this rank's compute-dtype chunks but not
    every chunk's optimizer states, so the last ones live in this rank's own disk-tier file; train
    STEPS steps; save the losses, the disk bytes, the full weights and a state dict round trip."""
    join(rank, world, port)
    for mode, collectives in cases:
        folder = os.path.join(out_dir, f"disk-{mode}-{collectives}-rank{rank}")
        os.makedirs(folder)
        batches = make_batches("gpt", STEPS)
        numel = sum(p.numel() for p in make_model("gpt").parameters())
        host = numel * 4 // world + numel * 6 // world + 3 * 12 * 4096   # the copies, half the states, staging
        engine = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP, config=config(
            mode, None, collectives=collectives, chunk_size=2048, host_memory=host, disk_dir=folder))
        on_disk = sorted(engine.disk_chunks)
        losses = [engine.step(split(b, rank, world)) for b in batches]
        sd = engine.state_dict()
        engine.load_state_dict(sd)                   # (through the disk tier's cache)
        torch.save({"losses": losses, "on_disk": on_disk, "disk": engine._disk_bytes(),
                    "files": os.listdir(folder), "full": engine.full_state_dict(), "again": engine.state_dict()["master"],
                    "master": sd["master"]}, os.path.join(out_dir, f"disk-{mode}-{collectives}-rank{rank}.pt"))
        engine.close()
    leave()


def device_homes(rank: int, world: int, port: int, out_dir: str, cases: list[tuple[str, str]]) -> None:
    """Each (mode, collectives): a host budget that holds half of this rank's chunk homes, so the
    first ones live on its device (the shard's master, Adam states and an fp32 gradient buffer), a
    device budget that still evicts; train STEPS steps; save the losses, the device homes, the
    link bytes against the plan (compiled), the peaks and the full weights."""
    join(rank, world, port)
    for mode, collectives in cases:
        batches = make_batches("gpt", STEPS)
        probe = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP, config=config(
            mode, None, collectives=collectives, chunk_size=2048))
        homes = probe.store.home_numel * len([c for c in range(probe.layout.num_chunks) if probe.store.owns(c)])
        probe.close()
        budget = tight_budget("gpt", mode, rank, world, collectives=collectives, chunk_size=2048) + homes * 8 + 4 * 2048 * 16
        engine = pscompile.compile(make_model("gpt"), split(batches[0], rank, world), optimizer=HP, config=config(
            mode, budget, collectives=collectives, chunk_size=2048, host_memory=homes * 16 // 2))
        losses, moved, peaks = [], [], []
        for b in batches:
            losses.append(engine.step(split(b, rank, world)))
            s = engine.stats
            plan = engine.last_plan if mode == "compiled" else None
            moved.append(((s.chunk_h2d_bytes, s.chunk_d2h_bytes), (plan.h2d_bytes, plan.d2h_bytes) if plan else None))
            peaks.append((s.peak_device_bytes, s.peak_host_bytes, s.num_evictions))
        torch.save({"losses": losses, "homes": sorted(engine.device_homes), "moved": moved, "peaks": peaks,
                    "budget": budget, "host": homes * 16 // 2, "full": engine.full_state_dict()},
                   os.path.join(out_dir, f"homes-{mode}-{collectives}-rank{rank}.pt"))
        engine.close()
    leave()


# each rank's lengths, step by step: they differ every step; in the last, rank 0's was seen before and
# rank 1's is new (hooks mode: had the ranks kept plans per own shape, rank 1 alone would trace it)
RANK_LENGTHS = ((24, 17, 30, 17), (19, 24, 12, 30))


def rank_batch(full, length: int, rank: int, world: int):
    """Rank ``rank``'s rows of ``full``, cut to ``length`` tokens."""
    return split(tuple(t[:, :length] for t in full), rank, world)


def _lengths_config(mode: str, budget=None) -> pscompile.Config:
    """``mode``: "hooks", "compiled" (the eager backend) or "inductor" (compiled mode, Inductor)."""
    if mode == "inductor":
        return pscompile.Config(mode="compiled", backend="inductor", device="cpu", dtype=torch.float32,
                                device_memory=budget)
    return config(mode, budget)


def lengths(rank: int, world: int, port: int, out_dir: str, modes: list[str]) -> None:
    """Each mode, under a budget that evicts (this model's sharded minimum at the longest length
    plus one gathered group): steps where the ranks' lengths differ (``RANK_LENGTHS``) train; then a
    step where rank 1's tensors have one more dimension is refused on every rank, naming each
    rank's batches, before anything changes, and the engine trains on."""
    join(rank, world, port, timeout_s=60.0)
    full = make_batches("gpt", 1)[0]
    for mode in modes:
        longest = rank_batch(full, max(max(n) for n in RANK_LENGTHS), rank, world)
        least = pscompile.compile(make_model("gpt"), longest, optimizer=HP, config=_lengths_config(mode))
        least.step(longest)
        budget = least.min_device_memory + least.store.param_chunk_bytes
        least.close()
        engine = pscompile.compile(make_model("gpt"), optimizer=HP, config=_lengths_config(mode, budget))
        losses, stats = [], []
        for n in RANK_LENGTHS[rank]:
            losses.append(engine.step(rank_batch(full, n, rank, world)))
            stats.append({**engine.stats.as_dict(), "compiled_share": engine.stats.compiled_share})
        before = engine.full_state_dict()
        odd = rank_batch(full, 16, rank, world)
        try:
            engine.step(odd if rank == 0 else tuple(t[None] for t in odd))
            refused = None
        except ValueError as e:
            refused = str(e)
        unchanged = all(torch.equal(v, before[k]) for k, v in engine.full_state_dict().items())
        losses.append(engine.step(rank_batch(full, 16, rank, world)))
        symbolic = None if mode == "hooks" else engine.built.ranges.symbolic_count()
        torch.save({"losses": losses, "stats": stats, "budget": budget, "refused": refused, "unchanged": unchanged,
                    "symbolic": symbolic}, os.path.join(out_dir, f"lengths-{mode}-rank{rank}.pt"))
        engine.close()
    leave()
