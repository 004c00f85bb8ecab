"""The checkpoint file: a JSON header, every chunk's optimizer state streamed, a SHA-256 at the end.

    b"PSCKPT03"                        8 bytes: the format and its version
    n                                  8 bytes, little-endian: the header's length
    header                             n bytes of UTF-8 JSON: {"format", "version", "meta", "state"
                                       (the state dict's scalars), "layout", "shard" (ZeRO),
                                       "tensors": [[name, dtype, numel], ...]}
    data                               each tensor's bytes, in the header's order, no padding
    SHA-256 of everything above        32 bytes

Writing streams one chunk's buffer at a time straight from where it lives (a host buffer is written
from its own memory; a device or disk one through a buffer of one chunk), hashing on the way: a
save takes about one chunk of extra host memory and the file is the state's bytes plus a header.
Reading is two passes over the file: ``verify`` hashes it tensor by tensor through one reusable
buffer (and lets the caller check each tensor, e.g. finite masters) before anything changes;
``read_into`` then reads each tensor straight into its destination.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

import torch

MAGIC = b"PSCKPT03"
FORMAT = "pscompile.checkpoint"
VERSION = 3
_DIGEST = 32

# what a tensor of the file is: its name, dtype and element count, and how to get it (called once,
# when it is written: a host tensor itself, or a copy of one chunk)
TensorSource = tuple[str, torch.dtype, int, Callable[[], torch.Tensor]]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    t = t.detach().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def write_checkpoint(f: BinaryIO, header: dict, tensors: Iterable[TensorSource]) -> str:
    """Write the file to ``f``; the hex SHA-256 it ends with."""
    tensors = list(tensors)
    h = hashlib.sha256()

    def put(b) -> None:
        h.update(b)
        f.write(b)
    text = json.dumps({**header, "format": FORMAT, "version": VERSION,
                       "tensors": [[n, str(d).replace("torch.", ""), k] for n, d, k, _ in tensors]}).encode()
    put(MAGIC)
    put(struct.pack("<Q", len(text)))
    put(text)
    for name, dtype, numel, get in tensors:
        t = get()
        if t.dtype != dtype or t.numel() != numel:
            raise RuntimeError(f"checkpoint tensor {name}: {t.dtype} x {t.numel()} where {dtype} x {numel} was "
                               "announced")
        put(_raw(t))
    f.write(h.digest())
    return h.hexdigest()


@dataclass(frozen=True)
class Record:
    name: str
    dtype: torch.dtype
    numel: int
    offset: int              # in the file

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class CheckpointReader:
    """One checkpoint file, opened: its header read and its size checked; the data read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.f = open(self.path, "rb")
        try:
            self.header, self.records = self._read_header()
        except BaseException:
            self.f.close()
            raise

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def _bad(self, why: str) -> ValueError:
        return ValueError(f"pscompile.load: {self.path} {why}; nothing was loaded")

    def _read_header(self) -> tuple[dict, dict[str, Record]]:
        head = self.f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise self._bad("is not a complete pscompile checkpoint (no PSCKPT03 header: truncated, "
                            "corrupted or another kind of file)")
        (n,) = struct.unpack("<Q", head[8:])
        size = self.path.stat().st_size
        if 16 + n + _DIGEST > size:         # (checked before n bytes are read: a corrupted length)
            raise self._bad(f"has a corrupted header (its length {n} runs past the file's {size} bytes)")
        try:
            header = json.loads(self.f.read(n).decode())
            records, offset = {}, 16 + n
            for name, dtype, numel in header["tensors"]:
                if name in records:
                    raise ValueError(f"the tensor {name!r} is listed twice")
                if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
                    raise ValueError(f"the tensor {name!r} has {numel!r} elements")
                records[name] = Record(name, _dtype(dtype), numel, offset)
                offset += records[name].nbytes
            for key in ("meta", "state", "client"):
                if key in header and not isinstance(header[key], dict):
                    raise TypeError(f"its {key!r} is a {type(header[key]).__name__}, not a JSON object")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
            raise self._bad(f"has a corrupted header ({type(e).__name__}: {str(e)[:100]})") from e
        if size != offset + _DIGEST:
            raise self._bad(f"is not a complete pscompile checkpoint ({size} bytes where its header announces "
                            f"{offset + _DIGEST}: truncated, or bytes were added)")
        return header, records

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size

    def verify(self, check: Callable[[str, torch.Tensor], str | None] | None = None) -> tuple[str, list[str]]:
        """Pass one: hash the whole file, each tensor read into one reusable buffer and given to
        ``check`` (its problem, or None). Raises ``ValueError`` if the hash is not the one the file
        ends with; returns the hash and the problems ``check`` found."""
        h = hashlib.sha256()
        self.f.seek(0)
        first = min((r.offset for r in self.records.values()), default=self.nbytes - _DIGEST)
        h.update(self.f.read(first))
        largest = max((r.nbytes for r in self.records.values()), default=0)
        buf = torch.empty(largest, dtype=torch.uint8)
        problems = []
        for r in self.records.values():           # in file order (dicts keep insertion order)
            view = buf[:r.nbytes]
            self._fill(view)
            h.update(memoryview(view.numpy()))
            if check is not None and r.numel:
                problem = check(r.name, view.view(r.dtype))
                if problem is not None:
                    problems.append(problem)
        if self.f.read(_DIGEST) != h.digest():
            raise self._bad("is corrupted (the SHA-256 of its contents differs from the one written at its end)")
        return h.hexdigest(), problems

    def _fill(self, dst: torch.Tensor) -> None:
        mv = memoryview(dst.numpy()).cast("B")
        got = 0
        while got < len(mv):
            n = self.f.readinto(mv[got:])
            if not n:
                raise self._bad("ended early")
            got += n

    def read_into(self, name: str, dst: torch.Tensor, *, start: int = 0) -> None:
        """Pass two: elements ``start:start + dst.numel()`` of tensor ``name`` into ``dst`` (a
        contiguous CPU tensor of its dtype)."""
        r = self.records[name]
        if dst.dtype != r.dtype or start + dst.numel() > r.numel or not dst.is_contiguous():
            raise ValueError(f"checkpoint tensor {name} ({r.dtype} x {r.numel}) cannot fill {dst.dtype} x "
                             f"{dst.numel()} at {start}")
        if dst.numel() == 0:
            return
        self.f.seek(r.offset + start * r.dtype.itemsize)
        self._fill(dst.view(torch.uint8).reshape(-1))

    def read(self, name: str) -> torch.Tensor:
        out = torch.empty(self.records[name].numel, dtype=self.records[name].dtype)
        self.read_into(name, out)
        return out


def is_checkpoint_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == MAGIC
    except OSError:
        return False


def tensor_names(lists: Sequence[str], count: int) -> list[str]:
    """The names of the state tensors: every list of chunk 0, then of chunk 1, ..."""
    return [f"{key}.{c}" for c in range(count) for key in lists]
