"""``pscompile.save`` / ``pscompile.load``: checkpoints that resume a run exactly.

A checkpoint holds what the next step depends on: the engine's ``state_dict()`` (fp32 masters,
Adam states, step count, loss-scaler state; under ZeRO this rank's shards and their layout), the
random number generators (dropout draws the same numbers after a load) and the configuration that
must match. It is written with ``torch.save`` and read with ``torch.load(weights_only=True)``,
inside an envelope that carries a format name, a version and the SHA-256 of the payload::

    {"format": "pscompile.checkpoint", "version": 1, "sha256": "<hex>", "payload": <bytes>}

The payload is itself a ``torch.save`` of ``{"state", "rng", "meta"}``. Writing is atomic: a
temporary file in the target folder, flushed and fsynced, then renamed over the target (and the
folder fsynced), so a crash leaves the old checkpoint or the new one, never half of one.

One process writes one file at ``path``. Under ZeRO ``path`` is a folder that every rank writes
into and rank 0 commits with one atomic rename of its manifest (``sharded_checkpoint.py``: a new
folder per save, the manifest naming the step, an id and every file's size and SHA-256; the ranks
agree before any of them loads).

``load`` checks everything before it changes anything: the envelope (a truncated or corrupted file
is refused, naming the file), the version, and the metadata against the engine (compute dtype, world
size and rank, parameter names and shapes, the chunk layout where shards depend on it), then the
state itself (``engine.state_problems``: every field, shape, the step, finite masters); every
difference is listed in one ``ValueError``. Only then does it load the state and the RNG.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import torch

from pscompile import sharded_checkpoint as sharded
from pscompile.files import remove_stale, write_atomic
from pscompile.runtime.rng import rng_state, rng_problems, set_rng_state

FORMAT = "pscompile.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"

__all__ = ["save", "load"]


# ------------------------------------------------------------------------------ writing
def _meta(engine) -> dict:
    cfg = engine.config
    return {"mode": str(cfg.mode), "dtype": str(engine.dtype).replace("torch.", ""), "world_size": engine.world,
            "rank": engine.rank, "params": {f: list(p.shape) for f, p in engine.params.items()},
            "chunk_size": engine.layout.chunk_size, "num_chunks": engine.layout.num_chunks,
            "step": engine.adam.step_count, "torch": str(torch.__version__)}


def _envelope(payload: dict) -> bytes:
    inner = io.BytesIO()
    torch.save(payload, inner)
    body = inner.getvalue()
    outer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "sha256": hashlib.sha256(body).hexdigest(), "payload": body},
               outer)
    return outer.getvalue()


def save(engine, path: str | os.PathLike) -> Path:
    """Write ``engine``'s checkpoint to ``path`` (one process: a file; ZeRO: a folder of one file
    per rank and a manifest; a collective, every rank calls it). Returns the path written."""
    path = Path(path)
    payload = {"state": engine.state_dict(), "rng": rng_state(engine.device), "meta": _meta(engine)}
    if engine.world > 1:
        return sharded.save_sharded(engine, path, {"format": FORMAT, "version": sharded.VERSION, **payload})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, _envelope(payload))
    remove_stale(path.parent, path.name)          # what a killed save of this file left
    return path


# ------------------------------------------------------------------------------ reading
def _read(file: Path) -> dict:
    """The payload of one checkpoint file, verified; ``ValueError`` naming the file otherwise. A
    one-process file is an envelope (its payload's SHA-256 inside); a rank file of a sharded
    checkpoint is the payload itself (its SHA-256 is in the manifest, checked before this)."""
    if not file.is_file():
        raise FileNotFoundError(f"pscompile.load: no checkpoint file at {file}")
    try:
        env = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:          # truncated, not a torch.save file, or not ours
        raise ValueError(f"pscompile.load: {file} is not a complete pscompile checkpoint (truncated or "
                         f"corrupted: {type(e).__name__}: {str(e)[:120]}); nothing was loaded") from e
    if not isinstance(env, dict) or env.get("format") != FORMAT:
        raise ValueError(f"pscompile.load: {file} is not a pscompile checkpoint (no format={FORMAT!r}; an "
                         "engine.state_dict() file loads with engine.load_state_dict(torch.load(...)))")
    if env.get("version") == sharded.VERSION and "state" in env:
        return env
    if env.get("version") != VERSION:
        raise ValueError(f"pscompile.load: {file} has checkpoint format version {env.get('version')!r}; this "
                         f"pscompile reads {VERSION} and {sharded.VERSION}")
    body = env.get("payload")
    if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != env.get("sha256"):
        raise ValueError(f"pscompile.load: {file} is corrupted (the SHA-256 of its payload differs from the one "
                         "written with it); nothing was loaded")
    return torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)


def _differences(meta: dict, engine) -> list[str]:
    want = _meta(engine)
    out = []
    for key, what in (("dtype", "compute dtype"), ("world_size", "world size"), ("rank", "rank")):
        if meta.get(key) != want[key]:
            out.append(f"{what}: checkpoint {meta.get(key)!r}, engine {want[key]!r}")
    saved, ours = meta.get("params", {}), want["params"]
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if missing:
        out.append(f"parameters the checkpoint lacks: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if extra:
        out.append(f"parameters the engine lacks: {extra[:4]}{' ...' if len(extra) > 4 else ''}")
    for f in sorted(set(saved) & set(ours)):
        if list(saved[f]) != list(ours[f]):
            out.append(f"shape of {f}: checkpoint {tuple(saved[f])}, engine {tuple(ours[f])}")
    if engine.world > 1 and (meta.get("chunk_size"), meta.get("num_chunks")) != (want["chunk_size"],
                                                                                 want["num_chunks"]):
        out.append(f"chunk layout (shards are cut from it): checkpoint {meta.get('num_chunks')} chunks of "
                   f"{meta.get('chunk_size')}, engine {want['num_chunks']} of {want['chunk_size']}")
    return out


def _checked(engine, file: Path) -> dict:
    """The payload of ``file`` if it fits ``engine`` and holds a state it can load."""
    payload = _read(file)
    if not isinstance(payload, dict) or not {"state", "rng", "meta"} <= set(payload):
        raise ValueError(f"pscompile.load: {file} lacks {sorted({'state', 'rng', 'meta'} - set(payload or {}))}; "
                         "nothing was loaded")
    problems = _differences(payload["meta"], engine)
    problems += engine.state_problems(payload["state"]) + rng_problems(engine.device, payload["rng"])
    if problems:
        raise ValueError(f"pscompile.load: {file} does not fit this engine; nothing was loaded:\n  - "
                         + "\n  - ".join(problems))
    return payload


def load(engine, path: str | os.PathLike) -> None:
    """Load the checkpoint at ``path`` into ``engine`` (built for the same model, dtype and world
    size; a collective under ZeRO, where every rank loads or none). Nothing changes unless every
    check passes."""
    path = Path(path)
    if engine.world > 1:
        payload = sharded.read_rank_payload(engine, path, lambda file: _checked(engine, file))
    else:
        if path.is_dir():
            manifest_file = path / MANIFEST
            ranks = json.loads(manifest_file.read_text()).get("world_size", "?") if manifest_file.is_file() else "?"
            raise ValueError(f"pscompile.load: {path} is a folder (a sharded checkpoint of {ranks} ranks); one "
                             "process loads a file")
        payload = _checked(engine, path)
    engine.load_state_dict(payload["state"])
    set_rng_state(engine.device, payload["rng"])
