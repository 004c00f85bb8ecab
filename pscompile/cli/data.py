"""A byte-level text corpus built on the spot from the Python standard library's own sources.

No download and no cache: ``Corpus.from_stdlib()`` reads a sorted, size-capped subset of the
``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (about 0.1 s for 4 MB), so every
machine with Python has training text. The vocabulary is the 256 byte values. If no source file
can be read (a frozen or stripped interpreter) the corpus falls back to text generated from the
Zen of Python and the docstrings of the builtins, so building never fails.
"""

from __future__ import annotations

import builtins
import codecs
import contextlib
import io
import os
import sysconfig
from dataclasses import dataclass
from typing import ClassVar

import torch

VOCAB_SIZE = 256                 # byte-level: one token per byte value
DEFAULT_MAX_BYTES = 4 * 2**20    # read at most this much source text
_SPLITS = ("train", "val")


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Concatenate the stdlib's ``.py`` files in sorted path order until ``max_bytes``.

    Test suites and generated tables are skipped (they are large and repetitive); files that
    cannot be read are skipped. Returns ``b""`` when nothing is found.
    """
    root = sysconfig.get_paths().get("stdlib")
    if not root or not os.path.isdir(root):
        return b""
    parts, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__")
                             and not d.startswith(("test", "idle_test")))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read(max_bytes - total)
            except OSError:
                continue
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(parts)
    return b"".join(parts)


def fallback_text() -> bytes:
    """Deterministic English/Python text without any file: the Zen of Python + builtin docstrings."""
    with contextlib.redirect_stdout(io.StringIO()):   # importing `this` prints the Zen
        import this
    zen = codecs.decode(this.s, "rot13")
    docs = [f"{name}\n{getattr(builtins, name).__doc__}\n"
            for name in sorted(dir(builtins))
            if isinstance(getattr(builtins, name).__doc__, str)]
    return (zen + "\n\n" + "\n".join(docs)).encode("utf-8", errors="replace")


@dataclass(frozen=True)
class Corpus:
    """Byte tokens split 90/10 into ``train`` and ``val`` (int64 tensors, values in [0, 256))."""

    train: torch.Tensor   # (N_train,) int64 byte values
    val: torch.Tensor     # (N_val,) int64 byte values
    source: str           # where the text came from: "stdlib" or "fallback"

    vocab_size: ClassVar[int] = VOCAB_SIZE   # byte-level vocabulary

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "bytes", val_fraction: float = 0.1) -> "Corpus":
        """Split ``data`` into the first ``1 - val_fraction`` (train) and the rest (val)."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1), e.g. 0.1")
        if len(data) < 64:
            raise ValueError(f"corpus has {len(data)} bytes; need at least 64 to form train and val splits")
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)  # (N,)
        n_train = int(len(tokens) * (1.0 - val_fraction))
        return cls(train=tokens[:n_train], val=tokens[n_train:], source=source)

    @classmethod
    def from_stdlib(cls, max_bytes: int = DEFAULT_MAX_BYTES) -> "Corpus":
        """The stdlib corpus (up to ``max_bytes``), or the fallback text when none is readable."""
        if max_bytes < 64:
            raise ValueError(f"max_bytes={max_bytes!r} is too small; use at least 64 (default {DEFAULT_MAX_BYTES})")
        data = stdlib_sources(max_bytes)
        if len(data) >= 64:
            return cls.from_bytes(data, source="stdlib")
        return cls.from_bytes(fallback_text(), source="fallback")

    def split(self, name: str) -> torch.Tensor:
        if name not in _SPLITS:
            raise ValueError(f"split={name!r} is not a split; use one of {_SPLITS}")
        return self.train if name == "train" else self.val

    def batch(self, split: str, batch_size: int, seq_len: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of ``seq_len`` bytes: ``(idx, targets)``, both
        ``(batch_size, seq_len)`` int64, with ``targets[:, t] == idx[:, t + 1]`` within the text."""
        data = self.split(split)
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int")
        if not 0 < seq_len < len(data):
            raise ValueError(f"seq_len={seq_len!r} must be in [1, {len(data) - 1}] for the {split} split")
        starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)  # (B,)
        offsets = torch.arange(seq_len + 1)                                              # (T+1,)
        windows = data[starts[:, None] + offsets]                                        # (B, T+1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()                 # (B, T) x 2

    def describe(self) -> str:
        return (f"{self.source} corpus: {len(self.train) + len(self.val):,} bytes "
                f"({len(self.train):,} train / {len(self.val):,} val), vocab {self.vocab_size}")
