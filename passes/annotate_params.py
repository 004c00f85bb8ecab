"""annotate_params: where the captured graph reads each parameter, following views; fwd/bwd phase.

A pure analysis of a ``CapturedGraph`` (the graph is not changed) that also writes metadata through
``pscompile.graph.meta``::

    p_h_0_attn_c_attn_weight            param="h.0.attn.c_attn.weight", last_use=211
    t = aten.t(p_h_0_attn_c_attn_weight)          param="h.0.attn.c_attn.weight"   (a view)
    addmm = aten.addmm(p_..._bias, view, t)       reads=("h.0.attn.c_attn.bias", "h.0.attn.c_attn.weight")
    ...
    t_30 = aten.t(t)                              param="h.0.attn.c_attn.weight"   (a view of a view)
    mm_7 = aten.mm(view_40, t_30)                 reads=("h.0.attn.c_attn.weight",)  <- the last use

**Views** are recognised generically, not from a list of op names: a node is a view of parameter P
when its FakeTensor ``meta["val"]`` (or one of its tensors, for ``split``-like ops) shares P's
untyped storage (``StorageWeakRef``) — the same test that ``estimate_nonmodel`` uses for memory.
A node without a tensor value falls back to its schema: an output with a non-writing
``alias_info`` aliases its first argument. Ops recognised this way in a GPT: ``aten.t``,
``aten.view``, ``aten.transpose``, ``aten.split`` + ``getitem`` (listed in ``ParamUses.view_ops``).

**Reads**: every node that is not a view and consumes a parameter or one of its views reads
that parameter (``reads`` metadata: fqns in parameter order). ``last_use`` on the placeholder is the
index (position in ``graph.nodes``) of the last reading node, so a Linear weight stays needed until
its backward ``mm`` through ``t(t(w))`` — far later than its only direct user ``t(w)``.

**Phase**: "fwd" for the loss node, its ancestors, the ``getitem``s of forward multi-output ops
(the statistics a forward op saves for the backward, e.g. layer-norm mean/rstd, are produced by
that forward op even though the loss does not depend on them), and nodes before the loss computed
from forward values only (a recomputed graph's bool copy of a dropout mask); "bwd" for every other node except
placeholders and the output. Defined by data dependence, not by position (``fwd_is_prefix`` says
whether the two also form a prefix/suffix of the node order; they do for GPT and BERT).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from pscompile.graph import meta as graph_meta
from pscompile.graph.capture import CapturedGraph
from pscompile.kinds import Phase

log = logging.getLogger("pscompile")


@dataclass(frozen=True)
class ParamUse:
    fqn: str
    placeholder: int                 # index of the parameter's placeholder
    views: tuple[int, ...]           # indices of the nodes that are views of it
    reads: tuple[int, ...]           # indices of the (non-view) nodes that read it, ascending
    direct_last_use: int | None      # index of the placeholder's last direct user (views not followed)

    @property
    def first_use(self) -> int | None:
        return self.reads[0] if self.reads else None

    @property
    def last_use(self) -> int | None:
        return self.reads[-1] if self.reads else None


@dataclass(frozen=True)
class ParamUses:
    params: tuple[ParamUse, ...]     # in parameter (placeholder) order
    phase: tuple[Phase | None, ...]  # per node index: FWD, BWD, or None (placeholders, output)
    loss_index: int                  # index of the node computing the loss (the first output)
    view_ops: tuple[str, ...]        # the distinct ops recognised as views of parameters

    def __getitem__(self, fqn: str) -> ParamUse:
        for use in self.params:
            if use.fqn == fqn:
                return use
        raise KeyError(fqn)

    @property
    def num_reads(self) -> int:
        return sum(len(u.reads) for u in self.params)

    @property
    def num_fwd(self) -> int:
        return sum(1 for p in self.phase if p == Phase.FWD)

    @property
    def num_bwd(self) -> int:
        return sum(1 for p in self.phase if p == Phase.BWD)

    @property
    def fwd_is_prefix(self) -> bool:
        """True when every forward node comes before every backward node."""
        last_fwd = max((i for i, p in enumerate(self.phase) if p == Phase.FWD), default=-1)
        first_bwd = min((i for i, p in enumerate(self.phase) if p == Phase.BWD), default=len(self.phase))
        return last_fwd < first_bwd

    @property
    def summary(self) -> str:
        return (f"annotate_params: {len(self.params)} params, {self.num_reads} reads, "
                f"fwd {self.num_fwd} nodes, bwd {self.num_bwd} nodes")


def tensor_storages(value) -> list[StorageWeakRef]:
    """The untyped storages of the tensors in a node value (a tensor or a nested tuple/list)."""
    if isinstance(value, torch.Tensor):
        return [StorageWeakRef(value.untyped_storage())]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in tensor_storages(v)]
    return []


def _schema_aliases_input(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return node.target is operator.getitem   # an element of a multi-output view (split)
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def annotate_params(captured: CapturedGraph) -> ParamUses:
    """Annotate ``param``/``reads``/``last_use``/``phase`` metadata and return the uses per parameter.

    Long on purpose: one walk over the graph whose closures share what it has learned of each
    parameter's views and readers.
    """
    graph = captured.gm.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    assert len(placeholders) >= len(captured.param_fqns)
    for n in nodes:
        for key in ("param", "reads", "last_use", "phase"):
            graph_meta.meta(n).pop(key, None)

    # -- which parameter each node aliases -------------------------------------------------------
    owner: dict[fx.Node, str] = {}            # param placeholder or view -> fqn
    by_storage: dict[StorageWeakRef, str] = {}
    for fqn, ph in zip(captured.param_fqns, placeholders):
        owner[ph] = fqn
        for st in tensor_storages(ph.meta.get("val")):
            by_storage[st] = fqn
    view_ops: set[str] = set()
    views: dict[str, list[int]] = {f: [] for f in captured.param_fqns}
    for n in nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        storages = tensor_storages(n.meta.get("val"))
        if storages:
            hits = {by_storage[s] for s in storages if s in by_storage}
        elif _schema_aliases_input(n) and n.args and isinstance(n.args[0], fx.Node) and n.args[0] in owner:
            hits = {owner[n.args[0]]}
        else:
            hits = set()
        assert len(hits) <= 1, f"{n.name} aliases several parameters: {hits}"
        if hits:
            owner[n] = hits.pop()
            views[owner[n]].append(index[n])
            view_ops.add(str(n.target) if hasattr(n.target, "_schema")
                         else getattr(n.target, "__name__", str(n.target)))
    for n, fqn in owner.items():
        graph_meta.put(n, "param", fqn)

    # -- reads and last uses ---------------------------------------------------------------------
    order = {f: k for k, f in enumerate(captured.param_fqns)}
    reads: dict[str, list[int]] = {f: [] for f in captured.param_fqns}
    for n in nodes:
        if n in owner or n.op in ("placeholder", "output", "get_attr"):
            continue
        fqns = sorted({owner[a] for a in n.all_input_nodes if a in owner}, key=order.__getitem__)
        if fqns:
            graph_meta.put(n, "reads", tuple(fqns))
            for f in fqns:
                reads[f].append(index[n])
    uses = []
    for fqn, ph in zip(captured.param_fqns, placeholders):
        direct = max((index[u] for u in ph.users), default=None)
        use = ParamUse(fqn, index[ph], tuple(views[fqn]), tuple(reads[fqn]), direct)
        graph_meta.put(ph, "last_use", use.last_use)
        uses.append(use)

    # -- phases: the loss and its ancestors are the forward --------------------------------------
    outputs = graph.output_node().args[0]
    loss = outputs[0]
    assert isinstance(loss, fx.Node), "the first output must be the loss node"
    fwd = {loss}
    stack = [loss]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in fwd:
                fwd.add(a)
                stack.append(a)
    for n in nodes:   # the other outputs of a forward op (layer-norm mean/rstd, dropout mask)
        if n.target is operator.getitem and n.args[0] in fwd:
            fwd.add(n)
    for n in nodes[:index[loss]]:   # what the forward computes for the backward only (a kept mask's bool)
        if n.op not in ("placeholder", "get_attr") and all(a in fwd or a.op == "placeholder" for a in n.all_input_nodes):
            fwd.add(n)
    phase: list[str | None] = []
    for n in nodes:
        p = None if n.op in ("placeholder", "output") else (Phase.FWD if n in fwd else Phase.BWD)
        if p is not None:
            graph_meta.put(n, "phase", p)
        phase.append(p)

    result = ParamUses(tuple(uses), tuple(phase), index[loss], tuple(sorted(view_ops)))
    log.info(result.summary)
    return result
