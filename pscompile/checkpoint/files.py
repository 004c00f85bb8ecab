"""Files a checkpoint writes: atomic, exclusively created, hashed while they are written.

``write_atomic`` streams the bytes of a ``torch.save`` (or given bytes) into a temporary file that
only this call can have created (``tempfile.mkstemp`` in the target folder: ``O_CREAT | O_EXCL``,
so a planted file or symlink at a predictable name is never written through), hashes them on the
way, flushes and fsyncs, renames it over the target and fsyncs the folder. A crash leaves the old
file or the new one; the temporary file of a failed write is removed, and ``remove_stale``
removes those a killed process left.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TMP_SUFFIX = ".pscompile-tmp"


@dataclass(frozen=True)
class Digest:
    """A file's size and SHA-256, as a manifest records them."""

    nbytes: int
    sha256: str

    def record(self) -> dict:
        return {"bytes": self.nbytes, "sha256": self.sha256}


class _Hashing:
    """A writable file that hashes and counts what passes through it (``torch.save`` writes its
    zip archive sequentially through ``write``)."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` survive a crash (where the platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, content: Any) -> Digest:
    """Write ``content`` to ``path`` atomically; its digest. ``content``: bytes; a function that
    writes to the open file and returns the hex SHA-256 it computed itself (the digest is then its
    size and that hash, e.g. ``file_format.write_checkpoint``'s); or any object, streamed with
    ``torch.save``. Nothing is left behind if the write fails."""
    path = Path(path)
    # (the writer's pid in the name: remove_stale leaves the temporaries of live writers alone)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                sha = content(f)
                f.flush()
                done = Digest(f.tell(), sha)
            else:
                out = _Hashing(f)
                if isinstance(content, (bytes, bytearray)):
                    out.write(content)
                else:
                    torch.save(content, out)
                f.flush()
                done = Digest(out.n, out.h.hexdigest())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_folder(path.parent)
    return done


def remove_stale(folder: Path, name: str = "*") -> None:
    """Remove the temporary files killed writes of ``name`` (default: of any file) left in ``folder``:
    those of writers no longer alive. A live process's temporaries (another save of the same path
    running in another thread or process) are left alone."""
    for p in Path(folder).glob(f".{name}.*{TMP_SUFFIX}"):
        if _writer_alive(p.name):
            continue
        try:
            p.unlink()
        except OSError:
            pass


def _writer_alive(temp_name: str) -> bool:
    """Whether the process that made ``temp_name`` (``.<file>.<pid>.<random><TMP_SUFFIX>``) runs; a
    name without a pid (an older version's) is stale."""
    parts = temp_name[:-len(TMP_SUFFIX)].rsplit(".", 2)
    if len(parts) < 3 or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)                 # (signal 0: only asks whether the process exists)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):    # (it exists but is not ours to signal)
        pass
    return True
