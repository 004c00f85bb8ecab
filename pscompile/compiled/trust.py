"""Which saved measurements a resumed compiled engine may plan with.

Compiled mode saves what it measured (non-model curves, region allocations, rates) so a resumed
engine plans and lowers exactly as the saved one did. A plan made from measurements that understate
what the graph takes runs over the budget, so a checkpoint's measurements are planned with only if
this user's pscompile measured them on this kind of machine: ``seal`` adds an HMAC-SHA256 tag, keyed
by a random secret kept in a file only this user can read, over the measurements and the machine
they were taken on (``machine``: the torch version and the device's kind, name and memory).
``verified`` checks it. A checkpoint without a valid tag (edited, crafted, from another user or
machine, or written before tags existed) is not an error: its measurements are ignored and the
engine measures again at its first step, as a fresh engine does.

The key file is ``$PSCOMPILE_KEY_FILE`` or ``<cache>/pscompile/measurements.key`` (``<cache>``:
``$XDG_CACHE_HOME`` or ``~/.cache``). It is made once, exclusively (a temporary file linked into
place: two processes starting together read the same key) and readable by its owner only. Where it
cannot be made (a read-only home), saves carry no tag and resumes measure again.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("pscompile.compiled")

KEY_ENV = "PSCOMPILE_KEY_FILE"
KEY_BYTES = 32


def key_path() -> Path:
    explicit = os.environ.get(KEY_ENV)
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pscompile" / "measurements.key"


def _read_key(path: Path) -> bytes | None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        key = f.read(KEY_BYTES + 1)
    return key if len(key) == KEY_BYTES else None


def _make_key(path: Path) -> None:
    """Write a new key beside ``path`` and link it into place; a key already there wins."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")   # mode 0600, O_EXCL
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)             # fails if another process linked its key first
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def machine_key(*, create: bool) -> bytes | None:
    """This user's key (made if ``create`` and missing); None where there is none to use."""
    path = key_path()
    try:
        if create and not path.exists():
            _make_key(path)
        return _read_key(path)
    except OSError as e:
        if create:
            log.info("pscompile: no measurement key at %s (%s): checkpoints carry no measurement tag, "
                     "and a resumed engine measures again", path, e)
        return None


def machine(device: torch.device) -> dict:
    """What a measurement depends on besides the graph: the software and the device."""
    out = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(name=props.name, memory=int(props.total_memory))
    return out


def _tag(key: bytes, measurements: dict, device: torch.device) -> str:
    body = json.dumps({"measurements": measurements, "machine": machine(device)},
                      sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def seal(measurements: dict, device: torch.device) -> dict:
    """``measurements`` with its tag (none where no key can be made)."""
    key = machine_key(create=True)
    return {**measurements, "tag": None if key is None else _tag(key, measurements, device)}


def verified(sealed: dict, device: torch.device) -> bool:
    """Whether ``sealed`` carries this user's tag for this machine over exactly these measurements."""
    tag = sealed.get("tag")
    key = machine_key(create=False)
    if not isinstance(tag, str) or key is None:
        return False
    body = {k: v for k, v in sealed.items() if k != "tag"}
    try:
        return hmac.compare_digest(tag, _tag(key, body, device))
    except (TypeError, ValueError):       # not JSON-shaped: not what ``seal`` wrote
        return False
