"""Capture one training iteration (forward + loss + backward) as a single flat FX graph.

Route (measured on torch 2.13 to give exactly eager's loss and gradients, tied weights merged,
dropout RNG inside the graph)::

    make_fx(grad_and_value(lambda params: loss(functional_call(model, params + buffers, batch))),
            tracing_mode="fake")

The inputs are fake tensors made from shapes and dtypes only, so nothing is read from (or
allocated for) the real parameters: an engine may have swapped ``param.data`` for chunk memory,
and the model may live on the meta device. The captured ``GraphModule`` takes flat positional
placeholders and returns a flat tuple::

    forward(self, p_wte_weight, p_wpe_weight, ..., b_<buffer>..., in_0, in_1)
        ...
        return (loss, grad_p_wte_weight, grad_p_wpe_weight, ...)   # one grad per trainable param

A model that checkpoints itself (``torch.utils.checkpoint``, Hugging Face's gradient
checkpointing), which ``torch.func.grad`` refuses, is traced a second way: the model and
``loss.backward()`` inside one ``functional_call``, so autograd's replay of each checkpointed
region lands in the backward; ``graph.checkpoints.fold_recomputation`` then folds the replays back
into the forward, and the result has the same form as above.

See ``pscompile.graph.meta`` for the conventions the passes rely on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from pscompile.graph import dynamic as symbolic
from pscompile.graph import meta as graph_meta
from pscompile.graph.checkpoints import fold_recomputation
from pscompile.runtime.batching import LossFn, extract_loss

log = logging.getLogger("pscompile")
# torch.func.grad's refusals that tracing through autograd does not have: saved-tensor hooks
# (non-reentrant torch.utils.checkpoint), autograd.Function without setup_context (reentrant
# checkpoint), requires_grad_() inside the transform (Hugging Face's gradient checkpointing)
_NEEDS_AUTOGRAD = ("saved tensor hooks", "functorch transform", "setup_context")
_MODULE_PY = nn.modules.module.__file__


@dataclass(frozen=True)
class BatchSpec:
    """How a batch maps onto the graph's batch placeholders.

    ``tree`` is the batch's pytree structure; ``leaves`` describes every leaf in flattening order:
    ``("tensor", shape, dtype)`` for a tensor (a placeholder, in order) or ``("const", value)`` for
    anything else (baked into the graph as a constant, so later batches must repeat it).
    """
    tree: TreeSpec
    leaves: tuple[tuple, ...]

    @property
    def num_tensors(self) -> int:
        return sum(1 for leaf in self.leaves if leaf[0] == "tensor")


@dataclass(frozen=True)
class CapturedGraph:
    gm: fx.GraphModule                # flat placeholders: params, buffers, batch tensor leaves; output: (loss, *grads)
    param_fqns: tuple[str, ...]       # canonical fqns, in placeholder order (tied parameters once)
    grad_fqns: tuple[str, ...]        # trainable params in param order; their grads are outputs 1..len
    buffer_fqns: tuple[str, ...]      # buffers, placeholders right after the params
    batch_spec: BatchSpec             # the batch's structure: which leaves are tensor placeholders
    capture_s: float                  # seconds taken by the capture
    param_dtype: torch.dtype | None = None   # dtype the parameters were captured in (None: their own)
    backward: bool = True             # False: forward and loss only (evaluation), output (loss,)
    symbolic: symbolic.SymbolicCapture | None = None   # traced with dynamic sizes (graph/dynamic.py)

    @property
    def num_params(self) -> int:
        return len(self.param_fqns)

    @property
    def summary(self) -> str:
        what = "capture_joint" if self.backward else "capture_forward"
        return (f"{what}: {len(self.gm.graph.nodes)} nodes, {len(self.param_fqns)} params "
                f"({len(self.grad_fqns)} trainable), {len(self.buffer_fqns)} buffers, "
                f"{self.batch_spec.num_tensors} batch tensors, {self.capture_s:.2f} s")

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    # Read once per capture, on first use, which comes after the analysis passes annotated the
    # graph (``pipeline.capture_and_analyze``); a rewritten graph is a new CapturedGraph. Planning
    # reads them for every layout and budget it weighs.
    @cached_property
    def param_reads(self) -> tuple[tuple[str, ...], ...]:
        """Per node, the fqns of the parameters it reads (its ``reads`` metadata)."""
        return tuple(tuple(graph_meta.get(n, "reads", ())) for n in self.gm.graph.nodes)

    @cached_property
    def executed(self) -> tuple[bool, ...]:
        """Per node, whether it executes at its place in a scheduled graph (parameter views are
        rebuilt right before each reader; the output runs nothing)."""
        return tuple(n.op != "output" and graph_meta.get(n, "param") is None for n in self.gm.graph.nodes)

    def flatten_batch(self, batch: Any) -> list[torch.Tensor]:
        """The batch's tensor leaves, in placeholder order; raises ``ValueError`` if the batch does
        not have the captured structure (then capture again for this batch)."""
        leaves, tree = tree_flatten(batch)
        if tree != self.batch_spec.tree:
            raise ValueError(f"the batch has structure {tree}, but the graph was captured for "
                             f"{self.batch_spec.tree}; capture again for this batch structure")
        out: list[torch.Tensor] = []
        for i, (leaf, want) in enumerate(zip(leaves, self.batch_spec.leaves)):
            if want[0] == "tensor":
                if not isinstance(leaf, torch.Tensor) or leaf.dtype != want[2] or leaf.dim() != len(want[1]) or any(
                        w is not None and w != s for w, s in zip(want[1], leaf.shape)):
                    got = (f"{tuple(leaf.shape)} {leaf.dtype}" if isinstance(leaf, torch.Tensor)
                           else type(leaf).__name__)
                    raise ValueError(f"batch leaf {i} is {got}, but the graph was captured for "
                                     f"{want[1]} {want[2]}; capture again for this batch signature")
                out.append(leaf)
            elif isinstance(leaf, torch.Tensor) or leaf != want[1]:
                raise ValueError(f"batch leaf {i} is {leaf!r}, but the graph was captured with the "
                                 f"constant {want[1]!r}; capture again for this batch")
        return out


def capture_joint(model: nn.Module, batch: Any, *, params: dict[str, nn.Parameter],
                  loss_fn: LossFn | None = None, param_dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, backward: bool = True,
                  loss_scale: bool = False, sources: bool = False, dynamic: symbolic.Dims = ()) -> CapturedGraph:
    """Trace ``loss = loss_fn(model(batch))`` and the gradients of all trainable parameters.

    With ``backward=False`` only the forward and the loss are traced (for evaluation): the graph
    returns ``(loss,)`` and ``grad_fqns`` is empty.

    ``params`` maps each parameter's canonical fqn to the parameter, in first-use order; that
    order is the placeholder order. Tied parameters appear once (any of their names). Frozen
    parameters (``requires_grad=False``) are inputs without a gradient output. ``param_dtype``
    captures floating-point parameters in that dtype (the compute dtype) instead of their own.
    ``device`` is where the graph computes (default: the batch's device, else the CPU).
    ``loss_scale`` (float16's dynamic loss scaling): the graph takes one more input after the
    batch, a 0-dim float32 scale ``s``, and differentiates ``loss * s`` computed as eager computes a
    loss times a Python float (in float32, rounded to the loss's dtype), so the gradients are
    scaled exactly as ``(loss * s).backward()`` scales them; it still returns the unscaled loss.
    ``sources``: record the model source line of every forward node (``source_line(node)``,
    ``file.py:12 in fn: code``) for messages about compiled regions; it makes the capture slower
    (about 2x on small models). ``dynamic``: (tensor leaf, dimension) pairs traced as symbols
    (``graph/dynamic.py``), through autograd (``torch.func.grad`` specializes a linear layer's
    sizes); the graph's fake values are then symbolic (``dynamic.at_bound`` makes them plain).

    Long on purpose: the steps of one trace (parameter views, the joint loss-and-gradients function,
    the traced graph's outputs named and checked) share one fake mode and the parameters' fake values.
    """
    t0 = time.perf_counter()
    names_of: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(fqn)
    for fqn, p in params.items():
        if fqn not in names_of.get(id(p), ()):
            raise ValueError(f"params[{fqn!r}] is not the model's parameter of that name; pass "
                             "params as {fqn: parameter} from model.named_parameters()")
    given = {id(p) for p in params.values()}
    missing = [names[0] for pid, names in names_of.items() if pid not in given]
    if missing:
        raise ValueError(f"params lacks the model parameters {missing}; pass every parameter once "
                         "(tied parameters under one name)")
    if len(given) != len(params):
        raise ValueError("params holds the same (tied) parameter under two names; pass it once")

    param_fqns = tuple(params)
    grad_fqns = tuple(f for f, p in params.items() if p.requires_grad) if backward else ()
    aliases = {fqn: names_of[id(p)] for fqn, p in params.items()}
    buffers = dict(model.named_buffers())
    buffer_fqns = tuple(buffers)

    path_leaves, tree = tree_flatten_with_path(batch)
    spec_leaves: list[tuple] = []
    batch_names: list[str] = []
    for path, leaf in path_leaves:
        if isinstance(leaf, torch.Tensor):
            t = sum(1 for x in spec_leaves if x[0] == "tensor")       # a dynamic size is None here
            spec_leaves.append(("tensor", tuple(None if (t, d) in dynamic else s for d, s in enumerate(leaf.shape)),
                                leaf.dtype))
            batch_names.append("in_" + (_ident(keystr(path)) if path else "0"))
        else:
            spec_leaves.append(("const", leaf))
    batch_spec = BatchSpec(tree, tuple(spec_leaves))
    if device is None:
        device = next((leaf.device for _, leaf in path_leaves if isinstance(leaf, torch.Tensor)),
                      torch.device("cpu"))
    device = torch.device(device)

    def dtype_of(p: torch.Tensor) -> torch.dtype:
        return param_dtype if param_dtype is not None and p.dtype.is_floating_point else p.dtype

    # plain tensor attributes become constants
    mode = symbolic.symbolic_mode() if dynamic else FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_params = [torch.empty(p.shape, dtype=dtype_of(p), device=device) for p in params.values()]
        fake_buffers = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in buffers.values()]
    tensor_leaves = [leaf for _, leaf in path_leaves if isinstance(leaf, torch.Tensor)]
    fake_batch = [symbolic.symbolic_leaf(mode, leaf.shape, leaf.dtype, device, {d for j, d in dynamic if j == i})
                  for i, leaf in enumerate(tensor_leaves)]
    with mode:
        if loss_scale and backward:
            fake_batch.append(torch.empty((), dtype=torch.float32, device=device))
            batch_names = [*batch_names, "loss_scale"]
    n_p, n_b = len(param_fqns), len(buffer_fqns)

    def joint(*flat):
        p_vals = dict(zip(param_fqns, flat[:n_p]))
        b_vals = dict(zip(buffer_fqns, flat[n_p:n_p + n_b]))
        tensors = iter(flat[n_p + n_b:])
        b = tree_unflatten([next(tensors) if s[0] == "tensor" else s[1] for s in spec_leaves], tree)
        scale = next(tensors) if loss_scale and backward else None
        frozen_vals = {f: v for f, v in p_vals.items() if f not in grad_fqns}

        def loss_of(trainable: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor],
                    b_vals: dict[str, torch.Tensor]) -> torch.Tensor:
            # frozen params and buffers are arguments too (not captured), so that the model may
            # update buffers in place (BatchNorm running statistics)
            state = {alias: t for fqn, t in {**trainable, **frozen}.items() for alias in aliases[fqn]}
            state.update(b_vals)
            output = torch.func.functional_call(model, state, _args(b), _kwargs(b), tie_weights=True,
                                                strict=True)
            try:
                return extract_loss(output, b, loss_fn)
            except ValueError as e:
                raise _LossError(e) from e

        trainable = {f: p_vals[f] for f in grad_fqns}
        if not backward:
            return (loss_of(trainable, frozen_vals, b_vals),)
        if route == "autograd":
            state = {"model." + alias: t for fqn, t in {**trainable, **frozen_vals}.items() for alias in aliases[fqn]}
            state.update({"model." + k: v for k, v in b_vals.items()})
            return torch.func.functional_call(_Differentiated(model, b, loss_fn, list(trainable.values()), scale),
                                              state, (), {}, tie_weights=True, strict=True)
        if scale is None:
            grads, loss = torch.func.grad_and_value(loss_of)(trainable, frozen_vals, b_vals)
            return (loss, *(grads[f] for f in grad_fqns))

        def scaled_loss_of(*args):
            loss = loss_of(*args)
            return scaled(loss, scale), loss
        grads, (_, loss) = torch.func.grad_and_value(scaled_loss_of, has_aux=True)(trainable, frozen_vals, b_vals)
        return (loss, *(grads[f] for f in grad_fqns))

    def trace() -> fx.GraphModule:
        with torch.random.fork_rng(devices=[]), _compiling_flag():
            return make_fx(joint, tracing_mode="symbolic" if dynamic else "fake", record_stack_traces=sources)(
                *fake_params, *fake_buffers, *fake_batch)

    def through_autograd() -> list[torch.Tensor]:
        with mode:
            return [p.detach().requires_grad_(f in grad_fqns) if p.is_floating_point() else p
                    for f, p in zip(param_fqns, fake_params)]

    route = "autograd" if dynamic and backward else "functorch"
    if route == "autograd":
        fake_params = through_autograd()
    try:
        try:
            traced = trace()
        except RuntimeError as e:
            if route == "autograd" or not any(m in str(e) for m in _NEEDS_AUTOGRAD):
                raise
            # the model checkpoints itself (or otherwise needs autograd, not torch.func): trace
            # through autograd, which replays checkpointed regions in the backward, then fold the
            # replays back into the forward
            route = "autograd"
            fake_params = through_autograd()
            traced = trace()
        if route == "autograd":
            fold_recomputation(traced)
    except _LossError as e:
        raise e.error from None   # extract_loss's own message already says what would work
    except Exception as e:  # noqa: BLE001 - a tracing failure: the batch's fault, or this model needs hooks mode
        rejected = _model_rejects(model, params, aliases, buffers, batch, loss_fn, dtype_of, device)
        if rejected is not None:
            raise rejected     # the model refuses this batch: its own exception, as eager PyTorch raises it
        raise _capture_error(model, e) from e

    gm = _flatten(traced, [f"p_{_ident(f)}" for f in param_fqns] + [f"b_{_ident(f)}" for f in buffer_fqns]
                  + batch_names)
    if sources:
        _keep_sources(gm)
    sym = None
    if dynamic:
        sym = symbolic.SymbolicCapture(tuple(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"),
                                       mode.shape_env, tuple(dynamic))
    captured = CapturedGraph(gm, param_fqns, grad_fqns, buffer_fqns, batch_spec,
                             time.perf_counter() - t0, param_dtype, backward, sym)
    log.info(captured.summary)
    return captured


def _keep_sources(gm: fx.GraphModule) -> None:
    """Trim each node's stack trace to the model line that made it (``File "...", line 12, in fn``
    and the code): its innermost frame outside torch (``nn.Linear.forward`` says less than the
    model line that called it), else its innermost. Graph rewrites carry FX's ``stack_trace``
    along, and ``source_line`` reads it."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    for n in gm.graph.nodes:
        trace = n.meta.get("stack_trace")
        if not trace:
            continue
        lines = [ln.strip() for ln in trace.strip().splitlines()]
        frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
        if not frames:
            continue
        model = [i for i in frames if not lines[i][6:].startswith(torch_dir)]
        at = (model or frames)[-1]
        code = lines[at + 1] if at + 1 < len(lines) and not lines[at + 1].startswith("File ") else ""
        n.meta["stack_trace"] = "\n".join(x for x in (lines[at], code) if x)


def source_line(n: fx.Node) -> str | None:
    """``file.py:12 in fn: code`` of the model line that made ``n`` (captured with ``sources``)."""
    trace = n.meta.get("stack_trace")
    m = re.match(r'File "(.*)", line (\d+), in (.*)', trace.strip()) if trace else None
    if m is None:
        return None
    code = trace.strip().splitlines()[1].strip() if len(trace.strip().splitlines()) > 1 else ""
    return f"{os.path.basename(m.group(1))}:{m.group(2)} in {m.group(3)}" + (f": {code}" if code else "")


@contextlib.contextmanager
def _compiling_flag():
    """``torch.compiler.is_compiling()`` is True while tracing, as under ``torch.export``
    (non-strict export traces the same way and sets the same flag): model code that checks it
    takes its shape-only path instead of branching on data (e.g. Hugging Face's attention-mask
    builders skip their ``mask.all()`` shortcut and always build the mask)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


class _Differentiated(nn.Module):
    """The model's loss and its gradients with respect to ``wrt`` (leaves) in one forward, so that under
    ``functional_call`` autograd's replay of a checkpointed region (which runs during the
    backward) still sees the substituted parameters. Gradients of unused parameters are zeros,
    as ``torch.func.grad`` gives them."""

    def __init__(self, model: nn.Module, batch: Any, loss_fn: LossFn | None, wrt: list[torch.Tensor],
                 scale: torch.Tensor | None = None):
        super().__init__()
        self.model = model
        self.batch, self.loss_fn, self.wrt, self.scale = batch, loss_fn, wrt, scale

    def forward(self) -> tuple:
        output = self.model(*_args(self.batch), **_kwargs(self.batch))
        try:
            loss = extract_loss(output, self.batch, self.loss_fn)
        except ValueError as e:
            raise _LossError(e) from e
        for p in self.wrt:
            p.grad = None
        (loss if self.scale is None else scaled(loss, self.scale)).backward()   # not autograd.grad: reentrant
                                 # checkpoint refuses it
        return (loss, *(torch.zeros_like(p) if p.grad is None else p.grad for p in self.wrt))


def scaled(loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``loss * scale`` as eager computes a tensor times a Python float: in float32, rounded to the
    loss's dtype (so a float16 loss that overflows becomes inf here as it does there)."""
    return (loss.float() * scale).to(loss.dtype)


class _LossError(Exception):
    """Carries extract_loss's ValueError out of the trace unchanged."""
    def __init__(self, error: ValueError):
        super().__init__(str(error))
        self.error = error


def _args(batch: Any) -> tuple:
    """Positional arguments exactly as ``batching.call_model`` passes them (tuple/list -> *batch,
    dict or other Mapping -> **batch, anything else -> one argument)."""
    if isinstance(batch, (tuple, list)):
        return tuple(batch)
    return () if isinstance(batch, Mapping) else (batch,)


def _kwargs(batch: Any) -> dict:
    return dict(batch) if isinstance(batch, Mapping) else {}



def _ident(name: str) -> str:
    """A readable Python identifier from an fqn or a pytree key path."""
    s = re.sub(r"\W+", "_", name).strip("_")
    return s or "x"


def _flatten(traced: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """A copy of ``traced`` with plain flat placeholders named ``names`` and a flat tuple output."""
    old = traced.graph
    placeholders = [n for n in old.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(names), (len(placeholders), len(names))
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    for node, name in zip(placeholders, names):
        new = graph.placeholder(name)
        new.meta = dict(node.meta)
        val_map[node] = new
    outputs = graph.graph_copy(old, val_map)
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    new_out = graph.output(outputs)
    new_out.meta = dict(old.output_node().meta)
    graph._codegen = fx.graph.CodeGen()
    graph.lint()
    gm = fx.GraphModule(traced, graph)
    gm.recompile()
    return gm


# what fake tensors cannot do (values that only exist at run time): the capture's limits, not the batch's
_FAKE_LIMITS = tuple(getattr(torch._subclasses.fake_tensor, name) for name in (
    "DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException",
    "UnsupportedFakeTensorException") if hasattr(torch._subclasses.fake_tensor, name))


def _model_rejects(model: nn.Module, params: dict[str, nn.Parameter], aliases: dict[str, list[str]],
                   buffers: dict[str, torch.Tensor], batch: Any, loss_fn: LossFn | None, dtype_of,
                   device: torch.device) -> BaseException | None:
    """After a failed trace: run the model's forward once more on fake tensors, without tracing.
    If it raises something other than a fake tensor's limit (a shape mismatch, a wrong argument, a
    wrong dtype), the model rejects this batch and that exception is what the user must see, as
    eager PyTorch would show it; None when the forward runs (the trace itself is the problem)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, _compiling_flag(), torch.random.fork_rng(devices=[]):
            fakes = {fqn: torch.empty(p.shape, dtype=dtype_of(p), device=device) for fqn, p in params.items()}
            state = {alias: fakes[fqn] for fqn in params for alias in aliases[fqn]}   # tied: one tensor
            state.update({k: torch.empty(b.shape, dtype=b.dtype, device=device) for k, b in buffers.items()})
            fake_batch = tree_unflatten([torch.empty(t.shape, dtype=t.dtype, device=device)
                                         if isinstance(t, torch.Tensor) else t for t in tree_flatten(batch)[0]],
                                        tree_flatten(batch)[1])
            output = torch.func.functional_call(model, state, _args(fake_batch), _kwargs(fake_batch),
                                                tie_weights=True, strict=True)
            extract_loss(output, fake_batch, loss_fn)
    except _FAKE_LIMITS:
        return None
    except Exception as err:  # noqa: BLE001 - whatever the model raises is the answer
        return err
    return None


def _capture_error(model: nn.Module, e: Exception) -> ValueError:
    """A ValueError naming the op and the innermost module where tracing failed."""
    where = ""
    modules = {id(m): name for name, m in model.named_modules()}
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        owner = frame.f_locals.get("self")
        if (isinstance(owner, nn.Module) and id(owner) in modules
                and frame.f_code.co_filename != _MODULE_PY):        # not Module.__call__ itself
            name = modules[id(owner)] or "<root>"
            where = (f" in module {name} ({type(owner).__name__}, "
                     f"{os.path.basename(frame.f_code.co_filename)}:{lineno})")
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    return ValueError(
        f"cannot capture the model as one graph{where}: {type(e).__name__}: {first[:300]} "
        "(data-dependent control flow, .item()/.tolist() and similar cannot be traced); train this "
        "model with Config(mode=\"hooks\"), or change that code so that it depends on shapes only")
