"""Compiled programs kept across processes: a second process that schedules the same graph loads
its code instead of compiling it again.

Inductor's FX graph cache does not take a program on its own: the ordering edges that pin the
program's order (``control_deps``, ``compiled/whole.py``) make it bypass the cache. The
``ProgramStore`` keys each program itself and keeps it in two parts, both beside Inductor's own
caches (``$TORCHINDUCTOR_CACHE_DIR``):

- **the code**: Inductor's compiled graph, saved and loaded with its FX graph cache's own entry
  functions (``FxGraphCache._save_graph`` and ``load_with_key``) under this store's key, so that
  loading does what a cache hit of Inductor's does (its generated module reloaded, its kernels
  found in Inductor's kernel cache or built again, its guards checked);
- **what the compile learned** and a cache hit does not give back, as JSON in ``pscompile-programs``:
  Inductor's buffer plan (``buffer_plan.buffer_events``), the guards it assumed of a range's size
  symbols, and the hash of the generated code they belong to.

The key is a SHA-256 over what determines both: the scheduled graph's code (what Inductor is given
is traced from it), the inputs' shapes, strides and dtypes, the constants' shapes, the size symbols,
Inductor's configuration, the device type, the versions of torch and of this format, and the source
of the code that prepares a graph for Inductor and reads its buffer plan (``whole.py``,
``buffer_plan.py``). A loaded
program is used only if its code's hash is the one the JSON names.

Anything else (no entry, an unreadable or foreign one, code of another hash, a failed load) is a
miss: the program is compiled afresh and stored again. A miss other than "no entry" is said once at
WARNING. The JSON part is read with ``json``; the code part is Inductor's, trusted as Inductor
trusts its cache folder. Set ``torch._inductor.config.force_disable_caches`` (or
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``) or turn off ``fx_graph_cache`` to keep nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Sequence

import sympy
import torch
from torch import fx

log = logging.getLogger("pscompile.compiled")

__all__ = ["Learned", "ProgramStore"]

FORMAT = 1


@dataclass(frozen=True)
class Learned:
    """What one lowering learned: Inductor's buffer events (``buffer_plan.buffer_events``) and the
    guards it assumed of the program's size symbols."""

    events: tuple[tuple, ...]
    guards: tuple[sympy.Expr, ...]
    pinned: int = 0          # the ordering edges its graph was pinned with (``whole._pin``)


class ProgramStore:
    """Programs by key (see the module doc); ``root``: the folder of the JSON part (default:
    ``pscompile-programs`` in Inductor's cache folder). ``warned`` lists the entries said at WARNING."""

    def __init__(self, root: str | os.PathLike | None = None):
        self._given = Path(root) if root is not None else None
        self.warned: list[str] = []

    @cached_property
    def root(self) -> Path:
        return self._given or cache_folder("pscompile-programs")

    @staticmethod
    def enabled() -> bool:
        """Whether programs are kept: Inductor's FX graph cache is on and caches are not disabled."""
        return caches_on()

    @staticmethod
    def key(gm: fx.GraphModule, examples: Sequence[torch.Tensor], symbols: Sequence[sympy.Symbol],
            device: torch.device) -> str:
        """The key of ``gm``'s program for ``examples`` (see the module doc). A load skips tracing
        the graph for Inductor, so the key is the scheduled graph's, not the traced one's."""
        h = hashlib.sha256(repr((FORMAT, torch.__version__, _readers_text(), device.type, [str(s) for s in symbols],
                                 _config_text())).encode())
        for name, m in gm.named_modules():
            if isinstance(m, fx.GraphModule):
                h.update(repr((name, m.code)).encode())
        for x in examples:
            h.update(repr((tuple(map(str, x.shape)), tuple(map(str, x.stride())), str(x.dtype))).encode())
        for name, t in sorted(gm.state_dict(keep_vars=True).items()):
            h.update(repr((name, tuple(t.shape), str(t.dtype))).encode())
        return "p" + h.hexdigest()

    def load(self, key: str, gm: fx.GraphModule, examples: Sequence[torch.Tensor],
             symbols: Sequence[sympy.Symbol]) -> tuple[Callable, Learned] | None:
        """The program of ``key`` (its callable, as ``compile_fx_inner`` returns it, and what its
        compile learned), or None (a miss; see the module doc). Runs under the fake mode and
        tracing context of ``examples``."""
        path = self.root / f"{key}.json"
        if not self.enabled() or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("torch") != torch.__version__:
                raise ValueError(f"written by format {data.get('format')} and torch {data.get('torch')}, this is "
                                 f"format {FORMAT} and torch {torch.__version__}")
            learned = _learned(data, symbols)
            fn = _load_code(key, gm, examples)
            if fn is None:
                raise ValueError("Inductor's cache holds no code for it")
            if getattr(fn, "cache_key", None) != data["code"]:
                raise ValueError(f"its code's hash is {getattr(fn, 'cache_key', None)}, the entry's {data['code']}")
        except Exception as e:  # noqa: BLE001 - any entry that cannot be used is a miss: compiled afresh
            self.warned.append(key)
            log.warning("pscompile: the stored program %s cannot be used (%s: %s); it is compiled afresh", key[:16],
                        type(e).__name__, str(e)[:200])
            return None
        return fn, learned

    def save(self, key: str, fn: Any, examples: Sequence[torch.Tensor], symbols: Sequence[sympy.Symbol],
             learned: Learned) -> None:
        """Keep ``fn`` (``compile_fx_inner``'s result) and ``learned`` under ``key``: the code
        first, then the JSON (written atomically), so an entry's JSON never names code that is not
        there. A store that cannot be written is said at INFO and skipped."""
        if not self.enabled():
            return
        from torch._inductor.codecache import FxGraphCache
        data = {"format": FORMAT, "torch": torch.__version__, "code": getattr(fn, "cache_key", None),
                "symbols": [str(s) for s in symbols],
                "events": [[_json_value(x) for x in ev] for ev in learned.events],
                "guards": [sympy.srepr(g) for g in learned.guards], "pinned": learned.pinned}
        try:
            FxGraphCache._save_graph(key, fn, examples, local=True, remote_cache=None)
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.root / f"{key}.json")
        except Exception as e:  # noqa: BLE001 - not kept: the next process compiles it again
            log.info("pscompile: the program was not stored (%s: %s)", type(e).__name__, e)


def cache_folder(name: str) -> Path:
    """Folder ``name`` in Inductor's cache folder (``$TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return Path(cache_dir()) / name


def caches_on() -> bool:
    """Inductor's FX graph cache is on and caches are not disabled: pscompile keeps what it may."""
    cfg = torch._inductor.config
    return bool(cfg.fx_graph_cache) and not cfg.force_disable_caches


def _load_code(key: str, gm: fx.GraphModule, examples: Sequence[torch.Tensor]) -> Any:
    """Inductor's compiled graph of ``key``, loaded as its FX graph cache loads a hit (None: none)."""
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.output_code import CompiledFxGraphConstantsWithGm
    from torch._inductor.utils import BoxedBool
    constants = CompiledFxGraphConstantsWithGm(gm)
    fn, _ = FxGraphCache.load_with_key(key, [], examples, True, None, False, constants)
    if fn is not None:
        fn.post_compile(examples, constants, {"cudagraphs": BoxedBool(False), "is_backward": False,
                                              "static_input_idxs": ()})
    return fn


def _sympy_functions() -> dict:
    """torch's own sympy functions by name (``FloorDiv``, ``CeilDiv``, ``ModularIndexing``...), which
    Inductor's sizes and guards use: their text reads back as them, not as unknown functions."""
    from torch.utils._sympy import functions
    return {name: f for name, f in vars(functions).items()
            if isinstance(f, type) and issubclass(f, sympy.Basic) and f.__module__ == functions.__name__}


def _json_value(x: Any) -> Any:
    """An event's field as JSON: a number as an int (read back without sympy), an expression as its
    ``srepr`` (read back to an equal expression)."""
    if isinstance(x, sympy.Integer):
        return int(x)
    return sympy.srepr(x) if isinstance(x, sympy.Basic) else x


def _learned(data: dict, symbols: Sequence[sympy.Symbol]) -> Learned:
    """The JSON part back, its expressions (``srepr``) in ``symbols`` (the stored names, in order: a
    symbol reads back as the one of this compile)."""
    ours = {name: s for name, s in zip(data["symbols"], symbols, strict=True)}
    functions = _sympy_functions()

    def expr(text: str) -> sympy.Expr:
        e = sympy.sympify(text, locals=functions)
        unknown = {s.name for s in e.free_symbols} - ours.keys()
        if unknown:
            raise ValueError(f"the entry names symbols {sorted(unknown)}, the program has {sorted(ours)}")
        return e.xreplace({s: ours[s.name] for s in e.free_symbols})
    events = []
    for ev in data["events"]:
        kind = ev[0]
        if kind == "new":
            events.append(("new", str(ev[1]), ev[2] if isinstance(ev[2], int) else expr(ev[2])))
        elif kind == "alias":
            events.append(("alias", str(ev[1]), str(ev[2])))
        elif kind == "release":
            events.append(("release", str(ev[1])))
        elif kind in ("before", "memory") and len(ev) == 1:
            events.append((kind,))
        else:
            raise ValueError(f"unknown event {ev[:3]!r}")
    return Learned(tuple(events), tuple(expr(g) for g in data["guards"]), int(data["pinned"]))


def _readers_text() -> str:
    """The source of the code that reads a lowering (``buffer_plan.py``) and prepares it (``whole.py``):
    an entry made by another version of them is another key."""
    here = Path(__file__).parent
    return hashlib.sha256("".join((here / m).read_text() for m in ("buffer_plan.py", "whole.py")).encode()).hexdigest()


def _config_text() -> str:
    """Inductor's configuration, as text (a changed option is another program); objects shown by
    their address (a custom pass) are left out."""
    cfg = torch._inductor.config.get_config_copy()
    shown = ((k, repr(v)) for k, v in cfg.items() if not callable(v))
    return repr(sorted((k, v) for k, v in shown if " at 0x" not in v))
