"""Checkpoints of format version 1, still read: a ``torch.save`` envelope around a ``torch.save``
payload (``{"format", "version": 1, "sha256", "payload": <bytes>}``), one file per process, and
under ZeRO a folder of such files with a version-1 manifest. Writing them is kept for tests that
craft old or tampered files; ``pscompile.save`` writes version 3 (``checkpoint/file_format.py``)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch

from pscompile.checkpoint.file_format import VERSION as CURRENT

FORMAT = "pscompile.checkpoint"
VERSION = 1


def envelope(payload: dict) -> bytes:
    inner = io.BytesIO()
    torch.save(payload, inner)
    body = inner.getvalue()
    outer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "sha256": hashlib.sha256(body).hexdigest(), "payload": body},
               outer)
    return outer.getvalue()


def read_envelope(file: Path) -> dict:
    """The payload of a version-1 file, its envelope's SHA-256 checked; ``ValueError`` naming the
    file otherwise."""
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
    if env.get("version") != VERSION:
        raise ValueError(f"pscompile.load: {file} has checkpoint format version {env.get('version')!r}; this "
                         f"pscompile reads {VERSION} and {CURRENT}")
    body = env.get("payload")
    if not isinstance(body, bytes) or hashlib.sha256(body).hexdigest() != env.get("sha256"):
        raise ValueError(f"pscompile.load: {file} is corrupted (the SHA-256 of its payload differs from the one "
                         "written with it); nothing was loaded")
    return torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
