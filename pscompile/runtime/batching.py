"""Calling a model on a batch and turning its output into a scalar loss (shared by all modes)."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

LossFn = Callable[[Any, Any], torch.Tensor]


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


def check_ranks_agree(batches: list, comm, call: str = "step") -> None:
    """Under ZeRO (``comm``, a ``dist.comm.Comm``): a ``ValueError`` on every rank, naming each
    rank's shapes, when the ranks' (micro-)batches of this step differ in shape. Each rank plans and
    runs the shapes it sees, so ranks with different shapes would issue different collectives and
    wait on each other until the group's timeout. One all-reduce of two integers (a digest of the
    shapes) when they agree; every rank takes the same path."""
    shapes = [signature(b)[1:] for b in batches]
    mine = int.from_bytes(hashlib.sha256(repr(shapes).encode()).digest()[:7], "big")
    high, low = comm.agree_max([mine, -mine])
    if high == -low:
        return
    everyone = comm.gather_objects(shapes)
    raise ValueError(f"{call}(): under ZeRO every rank must pass batches of the same shapes in a step (each rank "
                     "plans the shapes it sees, and the ranks' collectives must match); got "
                     + "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
                     + ". Pad every rank's batch to one length: a fixed max_length, or the longest over the ranks")


def structure(batch: Any) -> tuple[tuple[str, str], ...]:
    """Each leaf's place in the batch and its kind (a tensor's dtype, else its type): what must not
    change from step to step. Shapes may change (each gets its own schedule); values of
    non-tensor leaves may too."""
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
    return (f"{'; '.join(parts)}. The engine was compiled for batches of the form {show(expected)}, this one "
            f"is {show(got)}; pass batches of the compiled form (shapes may differ: each new shape gets its "
            "own schedule), or compile an engine for this form")


def call_model(model: nn.Module, batch: Any) -> Any:
    """tuple/list -> model(*batch); dict -> model(**batch); anything else -> model(batch)."""
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, dict):
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

    A list whose items are all tuples or dicts is a list of micro-batches (``engine.step([b1, b2,
    b3, b4])`` accumulates over four); any other batch, including a list of tensors, is one batch.
    """
    if isinstance(batch, list) and not batch:
        raise ValueError("step() got an empty list; pass one batch, or a list of micro-batches (tuples or "
                         "dicts) to accumulate over")
    if isinstance(batch, list) and all(isinstance(b, (tuple, dict)) for b in batch):
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

