"""Planning choices kept across processes: a second process that makes the same choice on the same
capture takes the one the first made instead of working it out again. Two choices are kept:

- **the layout** (``pipeline.engine_layout``): with ``chunk_size="auto"`` and a budget, every
  candidate layout is planned on the first capture and the one moving the fewest bytes kept
  (``pick_layout``): 25 analyses, 2-3 s of a second process's start on an 8-layer GPT;
- **the activations** (``minimum.choose_activations``): under ``activations="auto"`` the fewest
  segments that let the schedule fit, found by bisection over rewritten graphs, each analyzed: 8
  rewrites, 1.5-2 s on the same GPT. An entry names the segments and how each leaves the device.

Each depends only on what its key covers, so a process that finds it takes it:

- the captured graph's code and its placeholders' shapes and dtypes (parameters, buffers, batch);
- the facts the choice weighs: for the layout, the candidates' chunk sizes, the budget weighed, the
  ranks and the resolved ``Config``; for the activations, the policy, the budget, the layout, the
  slot and state bytes, the ranks, the non-model curve, whether the host has room for every
  offload, and the way "auto" takes each segment by the measured rates and free host memory (not
  those themselves: two processes measure them a little apart and still choose alike);
- the versions of torch and of this format, and the source of pscompile itself (any change to
  the planner is a miss).

An entry is JSON beside Inductor's caches (``pscompile-choices`` in ``$TORCHINDUCTOR_CACHE_DIR``),
written atomically. One that cannot be read, names a chunk size no candidate has, or an activation
choice that does not hold for this graph (a segment it does not have, a fit that differs) is a miss
said once at WARNING: the choice is made again and the entry written anew. Any candidate layout is
a valid layout and any activation choice is checked against the budget before it is taken, so an
entry can only cost speed, never correctness. Caches off as for ``ProgramStore``: nothing is kept.
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
from pscompile.graph.minimum import ActivationChoice
from pscompile.memory.layout import ChunkLayout

log = logging.getLogger("pscompile.compiled")

__all__ = ["ChoiceStore"]

FORMAT = 2
_PACKAGE = Path(__file__).resolve().parents[2]     # the folder holding pscompile/ and passes/


class ChoiceStore:
    """Choices by key (the module doc); ``root``: the folder of the entries (default:
    ``pscompile-choices`` in Inductor's cache folder). ``hits`` counts the choices taken from it,
    by kind ("layout", "activations")."""

    def __init__(self, root: str | os.PathLike | None = None):
        self._given = Path(root) if root is not None else None
        self._sources: str | None = None
        self.hits = {"layout": 0, "activations": 0}

    @cached_property
    def root(self) -> Path:
        return self._given or cache_folder("pscompile-choices")

    @staticmethod
    def enabled() -> bool:
        return caches_on()

    # -- the layout ---------------------------------------------------------------------------

    def key(self, gm: torch.fx.GraphModule, layouts: Sequence[ChunkLayout], facts: Any) -> str:
        """The key of weighing ``layouts`` on capture ``gm``; ``facts``: the budget, ranks and config
        (their ``repr`` is hashed)."""
        return "l" + self._digest(gm, (facts, [c.chunk_size for c in layouts]))

    def recall(self, key: str, layouts: Sequence[ChunkLayout]) -> tuple[ChunkLayout, tuple] | None:
        """The layout chosen under ``key`` and what was weighed (``LayoutChoice`` rows), or None."""
        from pscompile.graph.pipeline import LayoutChoice

        def read(data: dict) -> tuple[ChunkLayout, tuple]:
            layout = next((c for c in layouts if c.chunk_size == data["chunk_size"]), None)
            if layout is None:
                raise ValueError(f"chunk size {data['chunk_size']} is none of the candidates'")
            return layout, tuple(LayoutChoice(int(a), int(b), float(c), int(d), None if e is None else int(e))
                                 for a, b, c, d, e in data["rows"])
        return self._recall("layout", key, read)

    def keep(self, key: str, layout: ChunkLayout, rows: Sequence) -> None:
        """Keep the layout choice under ``key`` (said at INFO and skipped if it cannot be written)."""
        self._keep("layout", key, {"chunk_size": layout.chunk_size,
                                   "rows": [[r.chunk_size, r.spans, r.utilisation, r.least, r.moved] for r in rows]})

    # -- the activations (``minimum.choose_activations``'s ``kept``) ---------------------------

    def recall_activations(self, gm: torch.fx.GraphModule, facts: Any, check) -> ActivationChoice | None:
        """The activation choice kept for capture ``gm`` and ``facts``, if ``check(choice)`` says it
        holds for this graph (it raises ValueError saying why not), else None."""
        def read(data: dict) -> ActivationChoice:
            choice = ActivationChoice(int(data["segments"]), tuple(map(str, data["ways"])), bool(data["overlap"]),
                                      bool(data["fits"]))
            check(choice)
            return choice
        return self._recall("activations", "a" + self._digest(gm, facts), read)

    def keep_activations(self, gm: torch.fx.GraphModule, facts: Any, choice: ActivationChoice) -> None:
        self._keep("activations", "a" + self._digest(gm, facts),
                   {"segments": choice.segments, "ways": list(choice.ways), "overlap": choice.overlap,
                    "fits": choice.fits})

    # -- entries ------------------------------------------------------------------------------

    def _recall(self, kind: str, key: str, read) -> Any:
        path = self.root / f"{key}.json"
        if not self.enabled() or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("kind") != kind:
                raise ValueError(f"format {data.get('format')} of {data.get('kind')}, this is {FORMAT} of {kind}")
            got = read(data)
        except Exception as e:  # noqa: BLE001 - an entry that cannot be used is a miss: chosen again
            log.warning("pscompile: the stored %s choice %s cannot be used (%s: %s); it is made again",
                        kind, key[:16], type(e).__name__, str(e)[:200])
            return None
        self.hits[kind] += 1
        return got

    def _keep(self, kind: str, key: str, data: dict) -> None:
        if not self.enabled():
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "kind": kind, **data}, f)
            os.replace(tmp, self.root / f"{key}.json")
        except OSError as e:
            log.info("pscompile: the %s choice was not stored (%s: %s)", kind, type(e).__name__, e)

    def _digest(self, gm: torch.fx.GraphModule, facts: Any) -> str:
        """A hash of capture ``gm`` (its code and placeholders) with ``facts``' ``repr``."""
        h = hashlib.sha256(repr((FORMAT, torch.__version__, self._source_hash(), facts)).encode())
        h.update(gm.code.encode())
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                v = n.meta.get("val")
                h.update(repr((n.name, tuple(map(str, getattr(v, "shape", ()))), str(getattr(v, "dtype", "")),
                               getattr(v, "requires_grad", None))).encode())
        return h.hexdigest()

    def _source_hash(self) -> str:
        """A hash of pscompile's own source (``pscompile/`` and ``passes/``), read once."""
        if self._sources is None:
            h = hashlib.sha256()
            for p in sorted([*_PACKAGE.joinpath("pscompile").rglob("*.py"), *_PACKAGE.joinpath("passes").rglob("*.py")]):
                h.update(p.read_bytes())
            self._sources = h.hexdigest()
        return self._sources
