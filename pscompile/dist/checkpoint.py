"""Sharded state dicts of a ZeRO engine, and ``consolidate`` (shards -> one full state dict).

A rank's ``engine.state_dict()`` holds its own shard of every group (fp32 master, exp_avg,
exp_avg_sq) and the layout they are cut from, as plain data::

    {"format": "pscompile.zero-shard", "version": 1, "rank": r, "world_size": w,
     "layout": {"chunk_size": ..., "num_chunks": ..., "entries": [[fqn, shape, [[group, offset,
                tensor_offset, numel], ...]], ...]},
     "master": [shard of group 0, ...], "exp_avg": [...], "exp_avg_sq": [...],
     "step": ..., "loss_scale": ..., "loss_scale_good_steps": ...}

``consolidate`` puts the shards of all ranks back together into the state dict a one-process
engine returns (``{"master": {fqn: tensor}, ...}``), which ``load_state_dict`` accepts at any
world size.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from pscompile.dist.store import own_pieces
from pscompile.memory import nf4
from pscompile.memory.layout import ChunkLayout, Piece, TensorEntry
from pscompile.kinds import Collectives

FORMAT = "pscompile.zero-shard"
VERSION = 1
_LISTS = ("master", "exp_avg", "exp_avg_sq")


def layout_record(layout: ChunkLayout) -> dict:
    """The layout as JSON: each entry ``[fqn, shape, pieces]``, and ``False`` after a frozen one's."""
    return {"chunk_size": layout.chunk_size, "num_chunks": layout.num_chunks,
            "entries": [[e.fqn, list(e.shape), [[p.chunk, p.chunk_offset, p.tensor_offset, p.numel]
                                                for p in e.pieces]] + ([] if e.trainable else [False])
                        for e in layout.entries]}


def _layout_of(record: dict) -> ChunkLayout:
    entries = []
    for fqn, shape, pieces, *trainable in record["entries"]:
        ps = tuple(Piece(*map(int, p)) for p in pieces)
        entries.append(TensorEntry(fqn, tuple(shape), sum(p.numel for p in ps), ps, bool(trainable[0]) if trainable else True))
    return ChunkLayout(int(record["chunk_size"]), tuple(entries), int(record["num_chunks"]))


def is_shard(sd: Any) -> bool:
    return isinstance(sd, dict) and sd.get("format") == FORMAT


def _per_chunk(store) -> bool:
    return hasattr(store, "owner")


def shard_state_dict(store, layout: ChunkLayout, *, rank: int, world: int, extra: dict) -> dict:
    """A rank's shards (``collectives="per_chunk"``: its own chunks whole, empty tensors for the
    others) and what they were cut from."""
    sd = {"format": FORMAT, "version": VERSION, "rank": rank, "world_size": world, "layout": layout_record(layout),
          "collectives": (Collectives.PER_CHUNK if _per_chunk(store) else Collectives.GROUP).value}
    for i, key in enumerate(_LISTS):       # (a disk home's states through the disk tier's cache)
        sd[key] = [store._states(c)[i].detach().to("cpu", copy=True) for c in range(layout.num_chunks)]
    sd.update(extra)
    return sd


def shard_problems(store, layout: ChunkLayout, sd: dict, *, rank: int, world: int) -> list[str]:
    """What keeps a shard from loading here: another version, rank, world size or layout, or
    lists of the wrong length or shapes."""
    if sd.get("version") != VERSION:
        return [f"state_dict has shard format version {sd.get('version')!r}; this pscompile reads {VERSION}"]
    if (sd.get("world_size"), sd.get("rank")) != (world, rank):
        return [f"state_dict is rank {sd.get('rank')}'s shard of a {sd.get('world_size')}-rank run; this is rank "
                f"{rank} of {world}: load pscompile.consolidate(paths) instead, which fits any world size"]
    if sd.get("layout") != layout_record(layout) or sd.get("collectives", Collectives.GROUP) != (
            Collectives.PER_CHUNK if _per_chunk(store) else Collectives.GROUP):
        return ["state_dict's shard was cut from another chunk layout (a different model, chunk_size or "
                "budget); load pscompile.consolidate(paths) instead"]
    out = []
    n = layout.num_chunks
    for key in _LISTS:
        theirs = sd.get(key)
        if not isinstance(theirs, list) or len(theirs) != n:
            out.append(f"state_dict[{key!r}]: a list of {n} shards is needed")
            continue
        for g, src in enumerate(theirs):
            shape = store.state_shape(g)
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != shape or not src.is_floating_point():
                out.append(f"state_dict[{key!r}][{g}]: a float tensor of shape {shape} is needed, got "
                           f"{tuple(getattr(src, 'shape', ()))}")
            elif key == "master" and not bool(torch.isfinite(src).all()):
                out.append(f"state_dict['master'][{g}] holds inf or NaN")
    return out


def load_shard(store, layout: ChunkLayout, sd: dict, *, rank: int, world: int) -> None:
    """Load a shard written by the same rank of the same world size and layout."""
    problems = shard_problems(store, layout, sd, rank=rank, world=world)
    if problems:
        raise ValueError("; ".join(problems))
    for c in range(layout.num_chunks):
        for dst, key in zip(store._states(c, write=True), _LISTS):
            dst.copy_(sd[key][c])


def consolidate(shards: Iterable[Any]) -> dict:
    """One full state dict (``{"master": {fqn: fp32 tensor}, "exp_avg": ..., "exp_avg_sq": ...,
    "step", "loss_scale", ...}``) from every rank's ``engine.state_dict()``: the dicts themselves,
    or paths of files written with ``torch.save``. Loads into an engine of any world size."""
    sds = []
    for s in shards:
        if isinstance(s, (str, os.PathLike)):
            s = torch.load(s, map_location="cpu", weights_only=True)
        if not is_shard(s):
            raise ValueError("consolidate takes the state dicts (or their files) of a sharded run's ranks; got "
                             f"{type(s).__name__} without format={FORMAT!r}")
        sds.append(s)
    if not sds:
        raise ValueError("consolidate needs at least one shard")
    world = sds[0]["world_size"]
    ranks = sorted(s["rank"] for s in sds)
    if ranks != list(range(world)):
        raise ValueError(f"consolidate needs one shard of each of ranks 0..{world - 1}; got ranks {ranks}")
    if any(s["layout"] != sds[0]["layout"] or s["world_size"] != world
           or s.get("collectives") != sds[0].get("collectives") for s in sds):
        raise ValueError("the shards come from different runs (their layouts or world sizes differ)")
    steps = [s.get("step") for s in sorted(sds, key=lambda s: s["rank"])]
    if len(set(steps)) > 1:
        raise ValueError(f"the shards come from different steps (ranks 0..{world - 1}: steps {steps}): a "
                         "checkpoint mixed from two saves; consolidate the files of one pscompile.save")
    by_rank = {s["rank"]: s for s in sds}
    layout = _layout_of(sds[0]["layout"])
    per_chunk = world if sds[0].get("collectives") == Collectives.PER_CHUNK else 0
    shard = layout.chunk_size // world
    out: dict = {key: {} for key in _LISTS}
    for e in (e for e in layout.entries if e.kind.has_states):     # (a frozen parameter has no state)
        for key in _LISTS:
            flat = torch.empty(e.numel, dtype=torch.float32)
            for r in range(world):
                src = by_rank[r][key]
                for g, so, to, n in own_pieces(e, shard, r, per_chunk_world=per_chunk):
                    flat[to:to + n] = src[g][so:so + n]
            out[key][e.fqn] = flat.view(e.shape)
    for k, v in sds[0].items():
        if k not in out and k not in ("format", "version", "rank", "world_size", "layout", "collectives"):
            out[k] = v
    return out


def full_groups(store, comm) -> list[torch.Tensor]:
    """Every group's (per chunk: chunk's) fp32 master, whole, on every rank: one all-gather of the
    concatenated shards, or one broadcast per chunk from its owner."""
    n = len(store.master)
    if _per_chunk(store):
        out = []
        for c in range(n):
            buf = _weights(store, c).clone() if store.owns(c) else torch.empty(store.shard)
            comm.broadcast_plain(buf, store.owner(c))
            out.append(buf)
        return out
    mine = torch.cat([_weights(store, c) for c in range(n)]) if n else torch.empty(0)
    everyone = torch.empty(comm.world * mine.numel(), dtype=torch.float32)
    comm.all_gather_flat(everyone, mine)
    parts = everyone.view(comm.world, n, store.shard)
    return [parts[:, g].reshape(-1) for g in range(n)]


def full_packed(store, comm) -> dict[int, torch.Tensor]:
    """Every NF4 group's (per chunk: chunk's) packed bytes, whole and in one chunk's layout
    (``nf4.chunk_views``), on every rank: one all-gather of the concatenated shards, whose codes and
    absmax are then put end to end, or one broadcast per chunk from its owner."""
    chunks = sorted(store.layout.quantized_chunks)
    each = nf4.packed_bytes(store.home_numel)
    if _per_chunk(store):
        out = {}
        for c in chunks:
            buf = store.host_param[c].clone() if store.owns(c) else torch.empty(each, dtype=torch.uint8)
            comm.broadcast_plain(buf, store.owner(c))
            out[c] = buf
        return out
    mine = torch.cat([store.host_param[c] for c in chunks]) if chunks else torch.empty(0, dtype=torch.uint8)
    everyone = torch.empty(comm.world * mine.numel(), dtype=torch.uint8)
    comm.all_gather_flat(everyone, mine)
    parts = everyone.view(comm.world, len(chunks), each)
    out = {}
    for i, c in enumerate(chunks):
        whole = torch.empty(nf4.packed_bytes(store.layout.chunk_size), dtype=torch.uint8)
        shards = [nf4.chunk_views(parts[r, i], store.home_numel) for r in range(comm.world)]
        for dst, k in zip(nf4.chunk_views(whole, store.layout.chunk_size), (0, 1)):
            dst.copy_(torch.cat([s[k] for s in shards]))
        out[c] = whole
    return out


def _weights(store, c: int) -> torch.Tensor:
    """This rank's part of chunk ``c``'s weights in fp32: its master, or a frozen chunk's
    compute-dtype or NF4 home (it has no master)."""
    if store.packed(c):
        return nf4.read_piece(store.host_param[c], store.home_numel, 0, store.home_numel, torch.float32)
    return store.host_param[c].float() if not store.kind(c).master else store._states(c)[0]
