"""Calling a model on a batch and turning its output into a scalar loss (shared by all modes)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import SUPPORTED_NODES, keystr, tree_flatten, tree_flatten_with_path, tree_map

LossFn = Callable[[Any, Any], torch.Tensor]

READABLE = ("a tensor (model(batch)), a tuple or list (model(*batch)), or a dict or other Mapping such as "
            "Hugging Face's BatchEncoding (model(**batch))")


def as_batch(batch: Any, call: str = "step") -> Any:
    """``batch`` as every part of pscompile reads it: each ``Mapping`` that is not a ``dict``
    (Hugging Face's ``BatchEncoding``, ``UserDict``), at any depth, becomes a ``dict`` of its items,
    so it is a keyword batch exactly as a dict is (capture, micro-batches, ranges, ZeRO's
    agreement, checkpoints, both modes). A batch of a type pscompile cannot read raises a
    ``TypeError`` naming the type and what works."""
    if not isinstance(batch, (torch.Tensor, tuple, list, Mapping)) and type(batch) not in SUPPORTED_NODES:
        raise TypeError(f"{call}(): a batch of type {type(batch).__module__}.{type(batch).__qualname__}; pscompile "
                        f"reads {READABLE}, and lists of those as micro-batches: convert it, e.g. dict(batch), "
                        "torch.as_tensor(batch) or a tuple of its tensors")
    return _plain_mappings(batch)


def _plain_mappings(x: Any) -> Any:
    """``x`` with every non-dict Mapping in it made a dict (``x`` itself where there is none)."""
    if isinstance(x, Mapping):
        items = {k: _plain_mappings(v) for k, v in x.items()}
        return x if type(x) is dict and all(items[k] is x[k] for k in x) else items
    if isinstance(x, (tuple, list)):
        items = [_plain_mappings(v) for v in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch's tensors on ``device``, each contiguous: compiled mode lowers its graph for the
    layout it captured, so a transposed view that plain PyTorch takes is copied into that layout
    here, as ``.contiguous()`` would. A tensor already there that is a view into a larger storage
    (a micro-batch sliced from a batch) is copied into its own memory, as a copy to the device
    would be: the device holds what the step reads, which is what the planner counts."""
    def move(t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return t                     # (a sparse tensor: tensor_problem names it)
        t = t.to(device, non_blocking=True)
        if not t.is_contiguous():
            t = t.contiguous()
        elif t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        return t
    return tree_map(move, batch)


def signature(batch: Any) -> tuple:
    """Shapes and dtypes of the batch's tensors: iterations with equal signatures share a plan."""
    leaves, spec = tree_flatten(batch)
    return (str(spec),) + tuple(
        (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves)


_SIZES = 128     # sizes each rank sends per step (``check_ranks_agree``); any beyond must agree exactly


@dataclass(frozen=True)
class RanksShapes:
    """What the ranks of a ZeRO step agreed on (``check_ranks_agree``): they pass batches of one
    family (structure, dtypes and ranks of every tensor, the number of micro-batches), whose sizes
    may differ. ``low`` and ``high`` hold, per (micro-)batch, this rank's signature with every size
    replaced by the smallest and the largest over the ranks (the same on every rank); ``ranks``
    each rank's digest of its shapes, in rank order, which names the step's shapes on all ranks."""

    low: tuple[tuple, ...]
    high: tuple[tuple, ...]
    ranks: tuple[int, ...]

    @property
    def uniform(self) -> bool:
        """Every rank passes the same shapes this step."""
        return len(set(self.ranks)) == 1

    def plan_key(self, sig: tuple, i: int) -> tuple:
        """What a plan made for (micro-)batch ``i`` of signature ``sig`` is kept under, the same
        decision on every rank: its signature when the ranks' shapes agree; else the signature
        with ``i`` and every rank's shapes, whose plan is traced on all ranks together (hooks mode:
        a plan's memory peaks are the maximum over the ranks that traced it)."""
        return sig if self.uniform else (sig, i, self.ranks)


def digest(obj: Any) -> int:
    """A non-negative 56-bit digest of ``repr(obj)`` (compared with one all-reduce of maxima)."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:7], "big")


def _sizes(sig: tuple) -> list[int]:
    return [s for leaf in sig[1:] if isinstance(leaf, tuple) for s in leaf[0]]


def family(sig: tuple) -> tuple:
    """``sig`` without its sizes: structure, each tensor's rank and dtype, other leaves' values
    (what the members of a batch family share: ``graph.dynamic``, ``compiled/ranges.py``)."""
    return (sig[0],) + tuple((len(leaf[0]), leaf[1]) if isinstance(leaf, tuple) else leaf for leaf in sig[1:])


def with_sizes(sig: tuple, sizes) -> tuple:
    """``sig`` with its sizes taken, in order, from the iterator ``sizes``."""
    return (sig[0],) + tuple((tuple(next(sizes) for _ in leaf[0]), leaf[1]) if isinstance(leaf, tuple) else leaf
                             for leaf in sig[1:])


def check_ranks_agree(batches: list, comm, call: str = "step") -> RanksShapes:
    """Under ZeRO (``comm``, a ``dist.comm.Comm``): what the ranks' (micro-)batches of this step
    agree on (``RanksShapes``), or a ``ValueError`` on every rank, naming each rank's shapes, when
    they differ in more than sizes (structure, dtypes, ranks, the number of micro-batches). Sizes
    may differ: the modes plan from the agreed ones, so every rank issues the same collectives.
    One all-reduce (of maxima) of a fixed length on every rank, whatever the batches: a digest of
    the family (and of any sizes past the first ``_SIZES``, which must agree), the sizes and their
    negations (maxima and minima), and each rank's digest of its shapes in its own slot."""
    sigs = [signature(b) for b in batches]
    sizes = [s for sig in sigs for s in _sizes(sig)]
    kept, pad = sizes[:_SIZES], [0] * max(0, _SIZES - len(sizes))
    form = digest(([family(sig) for sig in sigs], sizes[_SIZES:]))
    mine = [0] * comm.world
    mine[comm.rank] = digest([sig[1:] for sig in sigs])
    agreed = comm.agree_max([form, -form, *kept, *pad, *(-s for s in kept), *pad, *mine])
    if agreed[0] == -agreed[1]:
        high, low = agreed[2:2 + len(kept)], agreed[2 + _SIZES:2 + _SIZES + len(kept)]
        rest = sizes[_SIZES:]
        his, los = iter(list(high) + rest), iter([-s for s in low] + rest)
        return RanksShapes(tuple(with_sizes(sig, los) for sig in sigs), tuple(with_sizes(sig, his) for sig in sigs),
                           tuple(agreed[2 + 2 * _SIZES:]))
    everyone = comm.gather_objects([sig[1:] for sig in sigs])
    raise ValueError(f"{call}(): under ZeRO every rank must pass batches of one form in a step: the same structure, "
                     "number of micro-batches, and dtype and number of dimensions of every tensor (sizes may "
                     "differ: the ranks plan from the largest); got "
                     + "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
                     + ". Give every rank batches of the same form")


def structure(batch: Any) -> tuple[tuple[str, str], ...]:
    """Each leaf's place in the batch and its kind (a tensor's dtype, else its type): what must not
    change from step to step. Shapes may change (compiled mode serves a family of sizes with one
    symbolic capture, docs/dynamic-shapes.md); values of non-tensor leaves may too."""
    leaves, _ = tree_flatten_with_path(batch)
    return tuple((f"batch{keystr(path)}", _kind(leaf)) for path, leaf in leaves)


def _kind(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{str(leaf.dtype).replace('torch.', '')} tensor"
    return type(leaf).__name__


def structure_error(expected: tuple[tuple[str, str], ...], batch: Any) -> str | None:
    """Why ``batch`` does not have the ``expected`` structure (naming each argument that differs
    and both forms), or None when it has it (dict keys in another order are the same form)."""
    got = structure(batch)
    want, have = dict(expected), dict(got)
    if want == have:
        return None
    parts = [f"{p} is missing" for p in want if p not in have]
    parts += [f"{p} is new" for p in have if p not in want]
    parts += [f"{p} is {have[p]} where the compiled form has {want[p]}" for p in want
              if p in have and want[p] != have[p]]

    def show(form):
        return "(" + ", ".join(f"{p}: {k}" for p, k in form) + ")"
    cast = next((f" (cast a tensor whose dtype differs: {p}.to(torch.{want[p].split()[0]}))" for p in want
                 if p in have and want[p] != have[p] and " tensor" in want[p] and " tensor" in have[p]), "")
    return (f"{'; '.join(parts)}. Each batch is compared with the first batch, which the engine was compiled for: "
            "the same structure (arguments, dict keys) and the same dtype of every tensor; sizes may change "
            f"(docs/dynamic-shapes.md). The engine was compiled for batches of the form {show(expected)}, this one "
            f"is {show(got)}; pass batches with the first batch's structure and dtypes{cast}, or compile a new "
            "engine for this form")


def check_form(expected: tuple[tuple[str, str], ...], batch: Any, micro: list | None, call: str) -> list:
    """The batches of a step (``micro``, or ``[batch]``), each checked: a ``TypeError`` naming the
    argument when one is not of the ``expected`` form, a ``ValueError`` when one holds a tensor the
    engine cannot train on (``tensor_problem``)."""
    for i, b in enumerate(batches := [batch] if micro is None else micro):
        which = "" if micro is None else f" (micro-batch {i})"
        if (problem := structure_error(expected, b)) is not None:
            raise TypeError(f"{call}(){which}: {problem}")
        if (problem := tensor_problem(b)) is not None:
            raise ValueError(f"{call}(){which}: {problem}")
    return batches


def call_model(model: nn.Module, batch: Any) -> Any:
    """tuple/list -> model(*batch); dict or other Mapping -> model(**batch); anything else ->
    model(batch)."""
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


def extract_loss(output: Any, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """A scalar loss from the model output: ``loss_fn(output, batch)``, the output itself, or its
    ``loss`` entry / attribute."""
    if loss_fn is not None:
        loss = loss_fn(output, batch)
    elif isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, dict) and "loss" in output:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    else:
        raise ValueError(
            f"the model returned {type(output).__name__}, not a scalar loss; return the loss, an object "
            "or dict with a 'loss' entry, or pass loss_fn=lambda output, batch: ... to compile()")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) "
                         "in the model or in loss_fn")
    return loss.reshape(())


def micro_batches(batch: Any) -> list | None:
    """``batch`` as a list of micro-batches for gradient accumulation, or None for one batch.

    A list whose items are all tuples or dicts (or other Mappings) is a list of micro-batches
    (``engine.step([b1, b2, b3, b4])`` accumulates over four); any other batch, including a list of
    tensors, is one batch.
    """
    if isinstance(batch, list) and not batch:
        raise ValueError("step() got an empty list; pass one batch, or a list of micro-batches (tuples or "
                         "dicts) to accumulate over")
    if isinstance(batch, list) and all(isinstance(b, (tuple, Mapping)) for b in batch):
        return batch
    return None


def tensor_problem(batch: Any) -> str | None:
    """A batch tensor the engine cannot train on: a sparse one, an empty one (a NaN loss whose update
    would still run), one on the meta device (no data) or one that requires grad (pscompile
    differentiates the loss by the parameters only); naming it and what would work."""
    leaves, _ = tree_flatten_with_path(batch)
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        where = f"batch{keystr(path)}"
        if leaf.layout != torch.strided:
            return (f"{where} is a {leaf.layout} tensor; pscompile captures and moves dense tensors: pass "
                    "tensor.to_dense()")
        if leaf.numel() == 0:
            return (f"{where} has no elements (shape {tuple(leaf.shape)}): the loss of an empty batch is NaN "
                    "and its update would change the weights; skip empty batches")
        if leaf.is_meta:
            return (f"{where} is on the meta device (it has shapes but no data); give real tensors (a model "
                    "built on meta can be planned with pscompile.plan, not trained)")
        if leaf.requires_grad:
            return (f"{where} requires grad; pscompile computes the gradients of the parameters only: pass "
                    "it with requires_grad=False (tensor.detach())")
    return None

