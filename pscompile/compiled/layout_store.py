"""Layout choices kept across processes: a second process that weighs the same candidate layouts
for the same capture takes the one the first chose, without planning each again.

With ``chunk_size="auto"`` and a budget, ``pipeline.engine_layout`` plans every candidate layout
on the first capture and keeps the one that moves the fewest bytes (``pick_layout``): 25 analyses,
2-3 s of a second process's start on an 8-layer GPT. The choice depends only on what the key
covers, so a process that finds it takes it:

- the captured graph's code and its placeholders' shapes and dtypes (parameters, buffers, batch);
- the candidates' chunk sizes, the budget weighed, the ranks, the resolved ``Config``;
- the versions of torch and of this format, and the source of pscompile itself (any change to
  the planner is a miss).

An entry is JSON beside Inductor's caches (``pscompile-layouts`` in ``$TORCHINDUCTOR_CACHE_DIR``),
written atomically. One that cannot be read, or names a chunk size no candidate has, is a miss said
once at WARNING; the layouts are weighed again and the entry written anew. Any candidate is a valid
layout, so an entry can only cost speed, never correctness. Caches off as for ``ProgramStore``:
nothing is kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import torch

from pscompile.compiled.program_store import cache_folder, caches_on
from pscompile.memory.layout import ChunkLayout

log = logging.getLogger("pscompile.compiled")

__all__ = ["LayoutStore"]

FORMAT = 1
_PACKAGE = Path(__file__).resolve().parents[2]     # the folder holding pscompile/ and passes/


class LayoutStore:
    """Layout choices by key (the module doc); ``root``: the folder of the entries (default:
    ``pscompile-layouts`` in Inductor's cache folder). ``hits`` counts the choices taken from it."""

    def __init__(self, root: str | os.PathLike | None = None):
        self._given = Path(root) if root is not None else None
        self._sources: str | None = None
        self.hits = 0

    @cached_property
    def root(self) -> Path:
        return self._given or cache_folder("pscompile-layouts")

    @staticmethod
    def enabled() -> bool:
        return caches_on()

    def key(self, gm: torch.fx.GraphModule, layouts: Sequence[ChunkLayout], facts: Any) -> str:
        """The key of weighing ``layouts`` on capture ``gm``; ``facts``: the budget, ranks and config
        (their ``repr`` is hashed)."""
        h = hashlib.sha256(repr((FORMAT, torch.__version__, self._source_hash(), facts,
                                 [c.chunk_size for c in layouts])).encode())
        h.update(gm.code.encode())
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta.get("val")
                h.update(repr((n.name, tuple(map(str, getattr(v, "shape", ()))), str(getattr(v, "dtype", "")),
                               getattr(v, "requires_grad", None))).encode())
        return "l" + h.hexdigest()

    def recall(self, key: str, layouts: Sequence[ChunkLayout]) -> tuple[ChunkLayout, tuple] | None:
        """The layout chosen under ``key`` and what was weighed (``LayoutChoice`` rows), or None."""
        from pscompile.graph.pipeline import LayoutChoice
        path = self.root / f"{key}.json"
        if not self.enabled() or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')}, this is {FORMAT}")
            layout = next((c for c in layouts if c.chunk_size == data["chunk_size"]), None)
            if layout is None:
                raise ValueError(f"chunk size {data['chunk_size']} is none of the candidates'")
            rows = tuple(LayoutChoice(int(a), int(b), float(c), int(d), None if e is None else int(e))
                         for a, b, c, d, e in data["rows"])
        except Exception as e:  # noqa: BLE001 - an entry that cannot be used is a miss: weighed again
            log.warning("pscompile: the stored layout choice %s cannot be used (%s: %s); the layouts are weighed "
                        "again", key[:16], type(e).__name__, str(e)[:200])
            return None
        self.hits += 1
        return layout, rows

    def keep(self, key: str, layout: ChunkLayout, rows: Sequence) -> None:
        """Keep the choice under ``key`` (said at INFO and skipped if it cannot be written)."""
        if not self.enabled():
            return
        data = {"format": FORMAT, "chunk_size": layout.chunk_size,
                "rows": [[r.chunk_size, r.spans, r.utilisation, r.least, r.moved] for r in rows]}
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.root / f"{key}.json")
        except OSError as e:
            log.info("pscompile: the layout choice was not stored (%s: %s)", type(e).__name__, e)

    def _source_hash(self) -> str:
        """A hash of pscompile's own source (``pscompile/`` and ``passes/``), read once."""
        if self._sources is None:
            h = hashlib.sha256()
            for p in sorted([*_PACKAGE.joinpath("pscompile").rglob("*.py"), *_PACKAGE.joinpath("passes").rglob("*.py")]):
                h.update(p.read_bytes())
            self._sources = h.hexdigest()
        return self._sources
