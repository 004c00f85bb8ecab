"""The frozen base in a checkpoint: what ``pscompile.save`` records of the frozen parameters, and
their weights when asked for.

A frozen parameter (``requires_grad=False``) never changes, so a checkpoint need not hold it: the
user builds the base model again as they built it. What the file keeps instead is a record of the
base (``record``): the frozen parameters' names and shapes, the compute dtype and a BLAKE2b digest
of the frozen chunks' bytes as this rank holds them (its shards under ZeRO). ``load`` compares the
record with the engine's and refuses a different base, naming what differs. With
``pscompile.save(..., frozen_weights=True)`` the file holds the frozen chunks too (``frozen.{c}``,
compute dtype), and ``load`` writes them into the engine's frozen chunks instead of comparing the
digest. A base kept in NF4 (``Config(frozen_format="nf4")``) is recorded with the names kept so
(``quantized``); its digest is over its packed bytes, and ``frozen_weights=True`` saves those bytes
(the 4-bit base, uint8), so a checkpoint of the other format is refused by name. The digest is computed once per engine (the chunks never change) and again after frozen
weights are loaded.
"""

from __future__ import annotations

import hashlib
from functools import partial

import torch

from pscompile.checkpoint.file_format import CheckpointReader, TensorSource
from pscompile.memory import nf4

PREFIX = "frozen."


def _owned_frozen(engine) -> list[int]:
    store = engine.store
    return [c for c in sorted(engine.layout.frozen_chunks) if store.owns(c)]


def _home(engine, c: int) -> torch.Tensor:
    """Frozen chunk ``c``'s home, compute-dtype or packed (a disk home is opened: ``close_home`` after)."""
    return engine.store.open_home(c)


def digest(engine) -> str:
    """The BLAKE2b digest of this rank's frozen chunks, in chunk order (cached on the engine)."""
    cached = getattr(engine, "_frozen_digest", None)
    if cached is not None:
        return cached
    h = hashlib.blake2b(digest_size=16)
    for c in _owned_frozen(engine):
        t = _home(engine, c)
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        engine.store.close_home(c)
    engine._frozen_digest = h.hexdigest()
    return engine._frozen_digest


def record(engine) -> dict | None:
    """What a checkpoint keeps of the frozen base (None: nothing is frozen)."""
    frozen = {e.fqn: list(e.shape) for e in engine.layout.entries if not e.trainable}
    if not frozen:
        return None
    out = {"params": frozen, "dtype": str(engine.dtype).replace("torch.", ""), "digest": digest(engine)}
    quantized = sorted(e.fqn for e in engine.layout.entries if e.quantized)
    return {**out, "quantized": quantized} if quantized else out


def tensors(engine) -> list[TensorSource]:
    """The frozen chunks as checkpoint tensors (``save(..., frozen_weights=True)``)."""
    store = engine.store
    return [(f"{PREFIX}{c}", *((torch.uint8, nf4.packed_bytes(store.home_numel)) if store.packed(c) else (engine.dtype, store.home_numel)),
             partial(_read, engine, c)) for c in _owned_frozen(engine)]


def _read(engine, c: int) -> torch.Tensor:
    out = _home(engine, c).clone()
    engine.store.close_home(c)
    return out


def saved_weights(header: dict) -> bool:
    return any(name.startswith(PREFIX) for name, _, _ in header.get("tensors", []))


def problems(saved: dict | None, engine, *, weights: bool, same_place: bool) -> list[str]:
    """What keeps a checkpoint's frozen base (``saved``: its record) from fitting ``engine``:
    other frozen parameters, or (base not saved, same rank and layout) other frozen weights."""
    ours = record(engine) if engine.layout.frozen_chunks else None
    theirs_params = (saved or {}).get("params", {})
    ours_params = (ours or {}).get("params", {})
    if theirs_params != ours_params:
        trained = sorted(set(ours_params) - set(theirs_params))
        unfrozen = sorted(set(theirs_params) - set(ours_params))
        what = [f"frozen here, trained in the checkpoint: {trained[:4]}"] if trained else []
        what += [f"frozen in the checkpoint, trained here: {unfrozen[:4]}"] if unfrozen else []
        return ["the checkpoint's run froze other parameters (requires_grad=False) than this engine's model ("
                + "; ".join(what or ["other shapes"]) + "): freeze the same parameters as the run that saved it"]
    theirs_nf4, ours_nf4 = (saved or {}).get("quantized", []), (ours or {}).get("quantized", [])
    if theirs_nf4 != ours_nf4:
        def said(names):
            return f"{len(names)} kept in NF4 ({names[:2]}...)" if names else "none kept in NF4"
        return [f"the checkpoint's frozen base is in another format: {said(theirs_nf4)} there, {said(ours_nf4)} "
                f"here; build the engine with Config(frozen_format={'nf4' if theirs_nf4 else 'compute'!r}) as the "
                "run that saved it"]
    if ours is None or weights or not same_place:
        return []
    if saved.get("dtype") != ours["dtype"] or saved.get("digest") != ours["digest"]:
        return [f"the frozen base differs from the one the checkpoint was saved with (digest {saved.get('digest')} "
                f"in {saved.get('dtype')}, this engine's {ours['digest']} in {ours['dtype']}): the checkpoint holds "
                "the trained parameters only, so build the base model exactly as that run did (the same weights, "
                "loaded in the same dtype), or save with pscompile.save(..., frozen_weights=True) to keep the base "
                "in the checkpoint"]
    return []


def load(engine, reader: CheckpointReader) -> None:
    """Write the checkpoint's frozen chunks into the engine's (``save(..., frozen_weights=True)``)."""
    store = engine.store
    for c in _owned_frozen(engine):
        store.drop(c)
        reader.read_into(f"{PREFIX}{c}", store.open_home(c, read=False))
        store.close_home(c, dirty=True)
    engine._frozen_digest = None
