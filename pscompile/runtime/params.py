"""A model's parameters as pscompile manages them: named, ordered by first use, and laid out.

Both modes and the engine-free pipeline start here. Nothing is allocated: the order comes from a
forward on fake tensors and the layout from shapes, so a model built on the meta device gives the
same parameters and the same layout as the same model with real weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pscompile.config import Config
from pscompile.runtime import bnb4bit
from pscompile.memory.disk_homes import disk_staging_bytes
from pscompile.kinds import FrozenFormat
from pscompile.memory.layout import NF4_ALIGN, ChunkLayout, build_layout, search_chunk_size
from pscompile.runtime.order import first_use_order


def check_model(model: nn.Module) -> None:
    """Refuse a model pscompile cannot take, naming the parameter: one an open engine holds (its
    parameters are placeholders until ``close()``), or parameters on several devices."""
    devices: dict[str, str] = {}
    for name, p in model.named_parameters():
        if p.numel() > 1 and all(s == 0 for s in p.stride()) and p.device.type != "meta" \
                and p.untyped_storage().nbytes() == p.element_size() and bool(torch.isnan(p.reshape(-1)[0])):
            raise ValueError(f"model is held by an open pscompile engine (parameter {name!r} is its placeholder); "
                             "call that engine's close(), which gives the model its trained weights back, "
                             "before compiling the model again, or compile another model")
        devices.setdefault(p.device.type if p.device.type in ("meta", "cpu") else str(p.device), name)
    if devices and not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameter (requires_grad is False for all "
                         f"{sum(1 for _ in model.parameters())}); pscompile trains parameters: unfreeze those to "
                         "train (p.requires_grad_(True)), or run the frozen model without pscompile")
    real = {d: n for d, n in devices.items() if d != "meta"}
    if len(real) > 1:
        raise ValueError("model has parameters on several devices (" + ", ".join(
            f"{n!r} on {d}" for d, n in real.items()) + "); pscompile places every parameter itself: move the "
                         "model to one device (model.to('cpu')) or build it on the meta device, and name the "
                         "compute device in Config(device=...)")


def check_frozen(layout: ChunkLayout, params: dict[str, nn.Parameter]) -> None:
    """Refuse a run after a parameter was frozen or unfrozen since ``compile``: the layout put
    frozen parameters in chunks of their own, without optimizer states."""
    changed = [f for f, p in params.items() if p.requires_grad != layout.entry(f).trainable]
    if changed:
        now = "trainable" if params[changed[0]].requires_grad else "frozen"
        raise RuntimeError(
            f"{len(changed)} parameter(s) changed requires_grad after pscompile.compile ({changed[0]!r} is {now} now, "
            f"{'trainable' if now == 'frozen' else 'frozen'} when compiled); pscompile lays frozen parameters out in "
            "chunks of their own, without master weights or Adam states, when it compiles: set requires_grad back, "
            "or close() this engine (the model gets its weights back) and compile the model again")


@dataclass(frozen=True)
class ModelParams:
    """Every distinct parameter once, under its canonical (first) name, in first-use order."""

    params: dict[str, nn.Parameter]      # canonical fqn -> parameter
    aliases: dict[str, str]              # other names of tied parameters -> canonical fqn
    order_source: str                    # how the order was found
    linear: frozenset[str] = frozenset()  # canonical fqns that are nn.Linear weights under every name
    loaded_4bit: frozenset[str] = frozenset()  # canonical fqns of weights bitsandbytes loaded in 4 bits

    def fqn_of(self) -> dict[int, str]:
        """id(parameter) -> canonical fqn."""
        return {id(p): f for f, p in self.params.items()}


def collect_params(model: nn.Module, run: Callable[[nn.Module, Any], Any], batch: Any) -> ModelParams:
    """The parameters of ``model`` in the order ``run(model, batch)`` first uses them (the arguments
    in ``first_use_order``'s order). The engines and the engine-free pipeline (``min_device_memory``,
    ``schedule_model``) must get the same order, or they lay the chunks out differently: a ``run``
    that is not callable is refused here, not taken as a failed forward (construction order)."""
    if not callable(run):
        raise TypeError(f"collect_params(model, run, batch): run must be callable, got {type(run).__name__}")
    bnb4bit.adopt(model)
    for fqn, p in model.named_parameters():       # (before the forward, which such a parameter may break)
        if not p.dtype.is_floating_point:
            raise ValueError(_not_floating(model, fqn, p))
    in_order, how = first_use_order(model, run, batch)
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    params: dict[str, nn.Parameter] = {}
    aliases: dict[str, str] = {}
    for p in in_order:
        canonical, *others = names[id(p)]
        params[canonical] = p
        aliases.update({o: canonical for o in others})
    if not params:
        raise ValueError("the model has no parameters; pscompile manages parameters in chunks")
    loaded = {id(m.weight) for m in model.modules() if isinstance(m, bnb4bit.Loaded4bitLinear)}
    return ModelParams(params, aliases, how, _linear_weights(model, names, params),
                       frozenset(f for f, p in params.items() if id(p) in loaded))


def _linear_weights(model: nn.Module, names: dict[int, list[str]], params: dict[str, nn.Parameter]) -> frozenset[str]:
    """The parameters that are the ``weight`` of an ``nn.Linear`` wherever they appear, except the
    output head (``get_output_embeddings()``, where the model has it) and a weight tied to an
    embedding: those ``Config(frozen_format="nf4")`` keeps in NF4, the modules transformers'
    ``BitsAndBytesConfig(load_in_4bit=True)`` makes ``Linear4bit``."""
    linear = {f"{m_name}.weight" if m_name else "weight" for m_name, m in model.named_modules(remove_duplicate=False)
              if isinstance(m, nn.Linear)}
    try:
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    except (NotImplementedError, AttributeError):
        head = None
    skip = id(head.weight) if isinstance(head, nn.Linear) else None
    return frozenset(f for f, p in params.items() if id(p) != skip and all(n in linear for n in names[id(p)]))


def _not_floating(model: nn.Module, fqn: str, p: nn.Parameter) -> str:
    """Why ``model``'s parameter ``fqn`` (integer, bool or complex: a quantized weight, an index
    table) cannot go into the chunks, and what would work."""
    owner, _, name = fqn.rpartition(".")
    kind = "" if type(p) is nn.Parameter else f" (a {type(p).__name__})"
    where = f"{type(model.get_submodule(owner)).__name__}.__init__" + (f" (module {owner!r})" if owner else "")
    return (f"parameter {fqn!r}{kind} has dtype {p.dtype}, shape {tuple(p.shape)}; pscompile keeps parameters in "
            "floating-point chunks (fp32 masters, compute-dtype copies), so it takes floating-point parameters "
            "only. If the model only reads it (an index table, a mask, a count), make it a buffer: in "
            f"{where}, self.register_buffer({name!r}, tensor) instead of nn.Parameter(tensor); if it "
            "is a weight to keep fixed, give it a floating-point dtype with requires_grad=False (frozen "
            "parameters get chunks of their own, without optimizer states). A base bitsandbytes loaded in 8 "
            "bits is not taken: load it in 4 bits, BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type='nf4') as QLoRA does, which pscompile keeps as loaded, or in bfloat16 and "
            "frozen with Config(frozen_format='nf4'), which quantizes it to the same NF4")


def _host_cap(config: Config, elsize: int) -> int | None:
    """With a disk tier and a host budget, the largest chunk whose disk staging buffers (parameters
    on disk: ``disk_staging_bytes``) take at most half of ``host_memory``, the rest left for chunks
    the host keeps; None otherwise."""
    if config.disk_dir is None or config.host_memory is None:
        return None
    return max(1024, config.host_memory // (2 * disk_staging_bytes(1, elsize)))


def choose_layout(mp: ModelParams, config: Config, budget: int | None, *, world: int = 1,
                  pages: bool = True, fraction: int = 8, host_staging: bool = False) -> ChunkLayout:
    """The chunk layout: ``config.chunk_size``, or with "auto" the least-waste size, at most
    1/``fraction`` of the budget, a quarter of the model and (``host_staging``: hooks mode, which
    takes the one size; compiled mode weighs several) ``_host_cap``; a tensor larger than a chunk spans
    several (pages). ``pages=False`` ("auto" only): the least-waste size no smaller than the largest
    tensor, whatever the budget (compiled mode weighs several, ``pipeline.engine_layout``).

    ZeRO (``world > 1``): the layout's unit is a communication group of ``world`` chunks, one per
    rank; an explicit ``chunk_size`` is per chunk (the group has ``world`` times as many elements),
    and "auto" searches the group size (what the device holds at once) and rounds it up to a
    multiple of ``world``."""
    frozen = [f for f, p in mp.params.items() if not p.requires_grad]
    quantized = frozenset(quantized_params(mp, config))
    # (an NF4 tensor's footprint: whole blocks, ``layout.NF4_ALIGN``)
    numels = [-(-p.numel() // NF4_ALIGN) * NF4_ALIGN if f in quantized else p.numel() for f, p in mp.params.items()]
    streams = ([2 if f in quantized else int(not p.requires_grad) for f, p in mp.params.items()]
               if frozen else None)
    cs = config.chunk_size
    elsize = torch.empty((), dtype=config.dtype).element_size()
    if cs == "auto":
        cap = None if budget is None else max(1024, budget // (elsize * fraction))
        host = _host_cap(config, elsize) if host_staging else None
        cap = host if cap is None else cap if host is None else min(cap, host)
        cs = search_chunk_size(numels, max_chunk_size=cap, keep_tensors_whole=not pages, streams=streams).chunk_size
        unit = world * (NF4_ALIGN if quantized and world > 1 else 1)     # (each rank's shard whole NF4 blocks)
        cs = -(-cs // unit) * unit
    else:
        if quantized and world > 1 and cs % NF4_ALIGN:
            raise ValueError(f"chunk_size={cs}: under ZeRO each rank's shard of a group kept in NF4 holds whole "
                             f"blocks of {NF4_ALIGN} elements; give a chunk_size that is a multiple of {NF4_ALIGN}")
        cs = cs * world
    return build_layout(((f, tuple(p.shape)) for f, p in mp.params.items()), cs, mp.aliases, frozen, quantized)


def quantized_params(mp: ModelParams, config: Config) -> list[str]:
    """The frozen parameters kept in NF4: those bitsandbytes loaded in 4 bits (kept as loaded,
    whatever the format), and with ``config.frozen_format`` "nf4" every other frozen ``nn.Linear``
    weight."""
    for f in mp.loaded_4bit:
        if mp.params[f].requires_grad:
            raise ValueError(f"parameter {f!r} was loaded in 4 bits by bitsandbytes and has requires_grad=True; "
                             "a 4-bit weight stays frozen (train adapters on it: peft's LoRA)")
    nf4 = config.frozen_format == FrozenFormat.NF4
    return [f for f, p in mp.params.items()
            if f in mp.loaded_4bit or (nf4 and not p.requires_grad and f in mp.linear)]
