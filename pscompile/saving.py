"""``pscompile.save`` / ``pscompile.load``: checkpoints that resume a run exactly.

A checkpoint holds what the next step depends on: every chunk's fp32 master and Adam states (under
ZeRO this rank's shards), the step count, the parameter groups, the loss scale and what the mode
measured (``engine.checkpoint_header`` / ``checkpoint_tensors``), the random number generators
(dropout draws the same numbers after a load) and metadata that must match (compute dtype,
parameter names and shapes, the chunk layout). One process writes one file at ``path``
(``checkpoint/file_format.py``: a JSON header, the tensors streamed chunk by chunk, a SHA-256 at the end)
through an exclusive temporary, fsync and rename (``files.py``), so a crash leaves the old
checkpoint or the new one. Under ZeRO ``path`` is a folder that every rank writes into and rank 0
commits with one atomic rename of its manifest (``checkpoint/sharded.py``).

``load`` checks everything before it changes anything: the file's size and SHA-256 (a truncated or
corrupted file is refused, naming it), its format, the metadata against the engine, the state's
scalars (``engine.state_problems``: the step, the parameter groups, the loss scale), every master
finite and the generators' sizes; every difference is listed in one ``ValueError``. Under ZeRO the
ranks then agree, and all load or none. A checkpoint of this engine's layout loads chunk by chunk
straight from the file; one of another chunk size or world size (saved on 2 ranks and loaded on 1,
or on 1 and loaded on 2) is read into the one-process state dict first. Version-1 files (a
``torch.save`` envelope) still load (``checkpoint/legacy.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from pscompile.checkpoint import legacy
from pscompile.checkpoint import sharded
from pscompile.dist import checkpoint as shard_ckpt
from pscompile.checkpoint.file_format import CheckpointReader, is_checkpoint_file, write_checkpoint
from pscompile.checkpoint.files import remove_stale, write_atomic
from pscompile.lazy import LazyEngine, built_engine
from pscompile.runtime import frozen_base
from pscompile.runtime.checkpoint_state import full_state_from
from pscompile.runtime.rng import rng_problems, rng_state, set_rng_state
from pscompile.runtime.state import state_fault

__all__ = ["save", "load", "consolidate"]


# ------------------------------------------------------------------------------ writing
def _meta(engine) -> dict:
    return {"mode": str(engine.config.mode), "dtype": str(engine.dtype).replace("torch.", ""),
            "world_size": engine.world, "rank": engine.rank,
            "params": {f: list(p.shape) for f, p in engine.params.items()},
            "chunk_size": engine.layout.chunk_size, "num_chunks": engine.layout.num_chunks,
            "step": engine.adam.step_count, "torch": str(torch.__version__), "frozen": frozen_base.record(engine)}


def _writer(engine, client_state: dict, ckpt_id: str | None = None, frozen_weights: bool = False):
    """The function that streams ``engine``'s checkpoint into an open file (returns its hash)."""
    engine._check_open()
    rng = rng_state(engine.device)
    header = {"meta": {**_meta(engine), "id": ckpt_id}, "rng": sorted(rng), "client": client_state,
              **engine.checkpoint_header()}
    tensors = [(f"rng.{k}", t.dtype, t.numel(), (lambda t=t: t)) for k, t in sorted(rng.items())]
    tensors += engine.checkpoint_tensors()
    tensors += frozen_base.tensors(engine) if frozen_weights else []
    return lambda f: write_checkpoint(f, header, tensors)


def save(engine, path: str | os.PathLike, *, client_state: dict | None = None, frozen_weights: bool = False) -> Path:
    """Write ``engine``'s checkpoint to ``path`` (one process: a file; ZeRO: a folder committed by
    its manifest; a collective, every rank calls it). Returns the path written.

    ``client_state``: the training script's own state, saved with the engine's and returned by
    ``load`` (a scheduler's ``state_dict()``, the data position): a dict of what JSON holds
    (numbers, strings, booleans, None, lists and dicts with string keys).

    Frozen parameters (``requires_grad=False``: a LoRA run's base) are not saved: the file records
    their names, shapes, dtype and a digest of their bytes, and ``load`` checks the engine's base is
    the same. ``frozen_weights=True`` saves them too, and ``load`` then puts them back."""
    path = Path(path)
    client_state = json_state(client_state, "pscompile.save: client_state")
    engine = built_engine(engine, "pscompile.save")
    with engine.exclusive("save"):
        if engine.world > 1:
            return sharded.save_sharded(engine, path,
                                        lambda ckpt_id: _writer(engine, client_state, ckpt_id, frozen_weights))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, _writer(engine, client_state, frozen_weights=frozen_weights))
        remove_stale(path.parent, path.name)          # what a killed save of this file left
        return path


# ------------------------------------------------------------------------------ reading
def _differences(meta: dict, engine, *, same_place: bool) -> list[str]:
    """What in ``meta`` does not fit ``engine`` (``same_place``: the world size and rank too)."""
    want = _meta(engine)
    out = []
    keys = (("dtype", "compute dtype"),) + ((("world_size", "world size"), ("rank", "rank")) if same_place else ())
    for key, what in keys:
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
    return out


def _state_tensor_problem(name: str, t: torch.Tensor, block: int = 1 << 16) -> str | None:
    """A master or Adam state of the file that ``state_fault`` refuses (checked in blocks:
    ``isfinite`` makes temporaries several times its input's size)."""
    kind = name.split(".")[0]
    if kind not in ("master", "exp_avg", "exp_avg_sq") or not t.is_floating_point():
        return None
    fault = state_fault(kind, (t[i:i + block] for i in range(0, t.numel(), block)))
    what = "the fp32 master" if kind == "master" else f"the Adam state {kind}"
    return None if fault is None else f"{name} ({what} of chunk {name.split('.')[1]}) {fault}"


def _rng_of(reader: CheckpointReader) -> dict:
    return {k: reader.read(f"rng.{k}") for k in reader.header.get("rng", [])}


def _file_problems(reader: CheckpointReader, manifest: dict | None) -> list[str]:
    """Pass one over a file (its SHA-256, finite masters; ``ValueError`` if corrupted), and
    whether it is the save ``manifest`` committed (its id and step)."""
    meta = reader.header["meta"]
    out = []
    if manifest is not None and (meta.get("id"), meta.get("step")) != (manifest["id"], manifest["step"]):
        out.append(f"{reader.path.name} belongs to checkpoint {meta.get('id')!r} at step {meta.get('step')!r}; the "
                   f"manifest committed {manifest['id']!r} at step {manifest['step']!r}")
    return out + reader.verify(_state_tensor_problem)[1]


def _prepare(engine, files: list[Path], manifest: dict | None) -> tuple:
    """Open and check the files for ``engine``: (how to load, what to load, readers, problems)."""
    readers: list[CheckpointReader] = []
    own = files[engine.rank] if len(files) == engine.world else None
    try:
        readers.append(CheckpointReader(own if own is not None else files[0]))
        direct = own is not None and engine.fits_directly(readers[0].header)
        if not direct:                  # every file, in rank order (the one open already reused)
            first, readers = readers[0], []
            for f in files:
                readers.append(first if f == first.path else CheckpointReader(f))
        problems = [p for r in readers for p in _file_problems(r, manifest)]
        problems += _differences(readers[0].header["meta"], engine, same_place=direct)
        problems += frozen_base.problems(readers[0].header["meta"].get("frozen"), engine, same_place=direct,
                                         weights=frozen_base.saved_weights(readers[0].header))
        problems += rng_problems(engine.device, _rng_of(readers[0]))
        if problems:                    # (another model: no state to read)
            return direct, None, readers, problems
        state = readers[0].header["state"] if direct else full_state_from(readers)
        problems += engine.scalar_problems(state) if direct else engine.state_problems(state)
        return direct, state, readers, problems
    except BaseException:
        for r in readers:
            r.f.close()
        raise


def load(engine, path: str | os.PathLike) -> dict:
    """Load the checkpoint at ``path`` into ``engine`` (built for the same model and dtype; any
    world size; a collective under ZeRO, where every rank loads or none). Nothing changes unless
    every check passes (a load is also how an engine a failed step left broken recovers).
    Returns the ``client_state`` it was saved with (``{}`` if none)."""
    if engine.closed:
        raise RuntimeError("pscompile.load: this engine was closed; load into a new one")
    if isinstance(engine, LazyEngine):
        if engine.built is None:        # checked now, loaded when the first step builds it
            client = client_state_of(Path(path))
            engine.defer_load(Path(path))
            return client
        engine = engine.built
    with engine.exclusive("load"):
        return _load(engine, Path(path))


def _load(engine, path: Path) -> dict:
    if not path.is_dir() and not is_checkpoint_file(path):
        return _load_legacy(engine, path)
    readers, problem, manifest = [], None, None
    try:
        if path.is_dir():
            manifest = sharded.read_manifest(path)
            if manifest["version"] == 1:
                return _load_legacy(engine, path)
            files = sharded.committed_files(path, manifest)
        else:
            files = [path]
        direct, state, readers, problems = _prepare(engine, files, manifest)
        if problems:
            problem = f"{path} does not fit this engine; nothing was loaded:\n  - " + "\n  - ".join(problems)
    except (OSError, ValueError, KeyError) as e:
        problem = str(e).replace("pscompile.load: ", "")
    except Exception as e:              # noqa: BLE001 -- any fault of the files: refused on every rank alike
        problem = f"{path} could not be read ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    try:
        if engine.comm is not None:
            sharded.agree(engine, problem, f"the checkpoint at {path}")
        elif problem is not None:
            raise ValueError(f"pscompile.load: {problem}" + ("" if "nothing was loaded" in problem else
                                                              "; nothing was loaded"))
        if direct:
            engine.load_checkpoint_tensors(readers[0])
            if frozen_base.saved_weights(readers[0].header):
                frozen_base.load(engine, readers[0])
        else:
            engine.load_state_dict(state)
        set_rng_state(engine.device, _rng_of(readers[0]))
        return dict(readers[0].header.get("client") or {})
    finally:
        for r in readers:
            r.f.close()


def client_state_of(path: Path) -> dict:
    """The client state of the checkpoint at ``path`` (this rank's file), after checking the
    file's size, SHA-256 and format (and under ZeRO that the manifest committed it)."""
    if not path.is_dir() and not is_checkpoint_file(path):
        legacy.read_envelope(path)
        return {}
    manifest = sharded.read_manifest(path) if path.is_dir() else None
    if manifest is not None and manifest["version"] == 1:
        return {}
    files = sharded.committed_files(path, manifest) if manifest is not None else [path]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with CheckpointReader(files[rank] if rank < len(files) else files[0]) as reader:
        problems = _file_problems(reader, manifest)
        if problems:
            raise ValueError(f"pscompile.load: {reader.path}: " + "; ".join(problems) + "; nothing was loaded")
        return dict(reader.header.get("client") or {})


def _load_legacy(engine, path: Path) -> dict:
    """A version-1 checkpoint: one envelope file, or a folder of them with a version-1 manifest."""
    def checked(file: Path) -> dict:
        payload = legacy.read_envelope(file)
        problems = _differences(payload["meta"], engine, same_place=True)
        problems += engine.state_problems(payload["state"]) + rng_problems(engine.device, payload["rng"])
        if problems:
            raise ValueError(f"pscompile.load: {file} does not fit this engine; nothing was loaded:\n  - "
                             + "\n  - ".join(problems))
        return payload
    if engine.world > 1:
        payload = sharded.read_rank_payload(engine, path, checked)
    elif path.is_dir():
        raise ValueError(f"pscompile.load: {path} is a version-1 folder of a sharded run; load it with its world "
                         "size, or pscompile.consolidate its rank files")
    else:
        payload = checked(path)
    engine.load_state_dict(payload["state"])
    set_rng_state(engine.device, payload["rng"])
    return {}


def json_state(value: Any, where: str) -> dict:
    """``value`` (None: ``{}``) if it is a dict JSON holds as it is; else ``ValueError`` naming the
    first entry that is not."""
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a dict, got {type(value).__name__}")
    bad = _not_json(value, where)
    if bad is not None:
        raise ValueError(f"{bad}; it holds numbers, strings, booleans, None, lists and dicts with string keys "
                         "(e.g. scheduler.state_dict(), a data position); save tensors in the model instead")
    return value


MAX_CLIENT_DEPTH = 100         # lists and dicts inside each other (JSON readers recurse on each level)


def _not_json(value: Any, where: str, depth: int = 0) -> str | None:
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if depth >= MAX_CLIENT_DEPTH:
        return f"{where.split('[')[0]} nests lists and dicts deeper than {MAX_CLIENT_DEPTH} levels"
    if isinstance(value, (list, tuple)):
        return next((b for i, v in enumerate(value) if (b := _not_json(v, f"{where}[{i}]", depth + 1)) is not None),
                    None)
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{where} has the key {k!r}, which is not a string"
            b = _not_json(v, f"{where}[{k!r}]", depth + 1)
            if b is not None:
                return b
        return None
    return f"{where} is a {type(value).__name__}, which JSON does not hold"


def consolidate(shards: Any) -> dict:
    """The one-process state dict (``{"master": {fqn: fp32 tensor}, "exp_avg": ..., "exp_avg_sq":
    ..., "step", ...}``), which ``load_state_dict`` takes at any world size, from a ZeRO run: the
    folder ``pscompile.save`` wrote (every file checked against its committed manifest: size,
    SHA-256, id and step; a folder mixing two saves is refused), or every rank's
    ``engine.state_dict()`` (the dicts, or files written with ``torch.save``)."""
    if isinstance(shards, (str, os.PathLike)) and Path(shards).is_dir():
        path = Path(shards)
        manifest = sharded.read_manifest(path)
        if manifest["version"] == 1:
            return shard_ckpt.consolidate([legacy.read_envelope(path / f)["state"] for f in manifest["files"]])
        readers = []
        try:
            for f in sharded.committed_files(path, manifest):
                readers.append(CheckpointReader(f))
                problems = _file_problems(readers[-1], manifest)
                if problems:
                    raise ValueError(f"pscompile.consolidate: {f}: " + "; ".join(problems))
            return full_state_from(readers)
        finally:
            for r in readers:
                r.f.close()
    return shard_ckpt.consolidate(shards)

