"""ZeRO checkpoints: a folder every rank writes into, committed in one atomic step.

    path/
      manifest.json                 the commit: format, version 3, world size, step, id, the
                                    folder of this checkpoint and every file's size and SHA-256
      step00000004-3f9c.../         one folder per save (its step and a fresh id)
        rank0.pt  rank1.pt          each rank's checkpoint file (file_format.py), streamed

A save writes a *new* folder beside the committed one, so nothing the committed checkpoint reads is
touched: every rank writes its file (exclusive temporary, fsync, rename), the ranks exchange their
files' digests (which is also the barrier: every file is durable), then rank 0 writes
``manifest.json`` atomically. That rename is the commit. Only after a second barrier does rank 0
remove the folders the new manifest does not name (the previous checkpoint, and any folder a
killed save left). A kill of any rank at any moment leaves the previous manifest, which names the
previous folder, whole.

A load (``checkpoint.load``) reads the manifest, checks every file it reads against the recorded
size and hash and the id and step in its header, checks it against the engine, and then the ranks
agree (``agree``): if any rank found a problem, every rank raises (listing each rank's problem) and
no rank changes anything.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Callable

from pscompile.checkpoint.files import remove_stale, write_atomic

MANIFEST = "manifest.json"
FORMAT = "pscompile.checkpoint"
VERSION = 3                     # the manifest of version-3 files (version 1: the old layout)


def _folder_name(step: int, ckpt_id: str) -> str:
    return f"step{step:08d}-{ckpt_id}"


def save_sharded(engine, path: Path, writer: Callable[[str], Callable]) -> Path:
    """Write this rank's file of a new checkpoint under ``path`` and commit it (a collective: every
    rank calls it). ``writer(id)``: what streams this rank's file (returning its SHA-256)."""
    comm = engine.comm
    step = int(engine.adam.step_count)
    ckpt_id = comm.gather_objects(uuid.uuid4().hex[:16])[0]      # rank 0's id, on every rank
    path.mkdir(parents=True, exist_ok=True)
    folder = path / _folder_name(step, ckpt_id)
    folder.mkdir(exist_ok=True)
    mine = write_atomic(folder / f"rank{engine.rank}.pt", writer(ckpt_id))
    digests = comm.gather_objects(mine.record())                # every rank's file is durable now
    if engine.rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "world_size": engine.world, "step": step,
                    "id": ckpt_id, "folder": folder.name,
                    "files": {f"rank{r}.pt": d for r, d in enumerate(digests)}}
        write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())     # the commit
    comm.barrier()
    if engine.rank == 0:
        _remove_uncommitted(path, keep=folder.name)
    return path


def _remove_uncommitted(path: Path, keep: str) -> None:
    """After a commit: the folders (and files of the version-1 layout) the manifest does not name."""
    for p in path.iterdir():
        if p.is_dir() and p.name.startswith("step") and p.name != keep:
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and p.name.startswith("rank") and p.suffix == ".pt":
            p.unlink(missing_ok=True)
    remove_stale(path)


def read_manifest(path: Path, world: int | None = None) -> dict:
    """The committed manifest of the ZeRO checkpoint at ``path`` (``FileNotFoundError`` or
    ``ValueError`` naming what is wrong)."""
    file = path / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"pscompile.load: {path} has no {MANIFEST}: not a committed sharded checkpoint "
                                "(written by pscompile.save under torch.distributed; a save killed before its "
                                "commit leaves none)")
    try:
        manifest = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"pscompile.load: {file} is not valid JSON ({e}); nothing was loaded") from e
    if not isinstance(manifest, dict) or manifest.get("version") not in (1, VERSION) or not isinstance(
            manifest.get("files"), (dict, list)):
        raise ValueError(f"pscompile.load: {file} has manifest version "
                         f"{manifest.get('version') if isinstance(manifest, dict) else None!r}; this pscompile "
                         f"reads 1 and {VERSION}")
    if world is not None and manifest.get("world_size") != world:
        raise ValueError(f"pscompile.load: {path} was written by {manifest.get('world_size')} ranks, this run "
                         f"has {world}; load pscompile.consolidate of its state dicts instead")
    return manifest


def committed_files(path: Path, manifest: dict) -> list[Path]:
    """The rank files of the committed checkpoint, each checked against the manifest's size and
    hash. ``ValueError`` naming the first file that is missing or differs."""
    if manifest["version"] == 1:
        return [path / f for f in manifest["files"]]
    out = []
    for name, want in sorted(manifest["files"].items(), key=lambda kv: int(kv[0][4:-3])):
        out.append(check_file(path / manifest["folder"] / name, want))
    return out


def check_file(file: Path, want: dict) -> Path:
    """``file`` if it has the size and the SHA-256 (written at its end) a manifest recorded;
    ``file_format.CheckpointReader.verify`` then checks that hash against its bytes."""
    if not file.is_file():
        raise ValueError(f"pscompile.load: {file} is missing: the checkpoint is incomplete; nothing was loaded")
    size = file.stat().st_size
    with open(file, "rb") as f:
        f.seek(max(0, size - 32))
        end = f.read(32).hex()
    if (size, end) != (int(want["bytes"]), str(want["sha256"])):
        raise ValueError(f"pscompile.load: {file} is not the file its manifest committed ({size} bytes, "
                         f"SHA-256 {end[:12]}...; the manifest says {want['bytes']} bytes, "
                         f"{str(want['sha256'])[:12]}...): corrupted or from another save; nothing was loaded")
    return file


def agree(engine, problem: str | None, what: str) -> None:
    """Every rank raises if any rank found a problem (a collective), so all ranks load or none."""
    problems = engine.comm.gather_objects(problem)
    bad = [(r, p) for r, p in enumerate(problems) if p is not None]
    if bad:
        raise ValueError(f"pscompile.load: {what} refused on every rank; nothing was loaded on any rank:\n  - "
                         + "\n  - ".join(f"rank {r}: {p}" for r, p in bad))


def read_rank_payload(engine, path: Path, read: Callable[[Path], dict]) -> dict:
    """This rank's payload of a version-1 ZeRO checkpoint at ``path`` (rank files beside a
    version-1 manifest, which records no step or hash), after every rank checked its own
    (``read``) and the ranks found they all hold the same step."""
    problem, payload = None, None
    try:
        read_manifest(path, engine.world)
        payload = read(path / f"rank{engine.rank}.pt")
    except (OSError, ValueError) as e:
        problem = str(e)
    steps = engine.comm.gather_objects(None if payload is None else payload.get("state", {}).get("step"))
    if problem is None and len({s for s in steps if s is not None}) > 1:
        problem = f"the ranks' files hold different steps {steps}: they come from different saves"
    agree(engine, problem, f"the checkpoint at {path}")
    return payload
