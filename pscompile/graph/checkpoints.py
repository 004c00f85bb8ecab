"""Fold a model's own activation checkpointing back into the captured graph.

A model that calls ``torch.utils.checkpoint`` (non-reentrant; Hugging Face's
``gradient_checkpointing_enable()`` does) is captured through autograd (``capture.capture_joint``
falls back to it: ``torch.func.grad`` refuses saved-tensor hooks), and autograd runs the
checkpointed regions again while tracing the backward. The graph then holds each region twice:
the forward, and its replay right before the backward needs it, including a second draw of every
random op (at run time that would be a different dropout mask; eager PyTorch restores the RNG
state for the replay so that the masks agree).

``fold_recomputation`` maps every replayed node onto the forward node it repeats and removes it,
so the graph is the plain joint graph, as if the model had not checkpointed; whether and where to
recompute is then the planner's decision (``Config.activations``, ``passes/recompute_activations``),
made for the budget. A replayed node is one in the backward whose inputs are all forward values
(or replayed ones): it repeats the forward node with the same op and the same (mapped) arguments.
Where several forward nodes qualify (ops without tensor inputs, like ``empty`` before a dropout's
``bernoulli``), the replay follows the forward's order: the first one after the forward node the
previous replayed node matched. A ``detach`` of a forward value in the backward (reentrant checkpoint
replays from detached inputs) stands for that value.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx

log = logging.getLogger("pscompile")


def _key(n: fx.Node, mapped: dict[fx.Node, fx.Node]) -> tuple:
    def norm(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", mapped.get(a, a).name)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        return ("const", repr(a))
    return (n.op, str(n.target), norm(n.args), norm(n.kwargs))


def fold_recomputation(gm: fx.GraphModule) -> int:
    """Remove the replays of forward nodes from the backward of ``gm`` (in place; see the module
    docstring). The first output must be the loss. Returns the number of nodes removed."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    loss = nodes[-1].args[0][0]
    end = index[loss]
    forward: dict[tuple, list[fx.Node]] = {}
    for n in nodes[:end + 1]:
        if n.op == "call_function":
            forward.setdefault(_key(n, {}), []).append(n)
    mapped: dict[fx.Node, fx.Node] = {}
    last = -1                                  # forward index the previous replayed node matched
    for n in nodes[end + 1:]:
        if n.op != "call_function":
            continue
        if not all(index[a] <= end or a in mapped for a in n.all_input_nodes):
            continue
        if n.target is torch.ops.aten.detach.default:       # reentrant checkpoint replays from detached
            source = n.args[0]                              # inputs: the same values, as far as the
            mapped[n] = mapped.get(source, source)          # graph is concerned (it runs without autograd)
            continue
        candidates = forward.get(_key(n, mapped), [])
        if not candidates:
            continue
        after = [c for c in candidates if index[c] > last]
        match = after[0] if after else candidates[0]
        mapped[n] = match
        last = index[match]
    for n in reversed(nodes[end + 1:]):
        if n in mapped:
            n.replace_all_uses_with(mapped[n])
            gm.graph.erase_node(n)
    if mapped:
        gm.graph.lint()
        gm.recompile()
        log.info(f"fold_recomputation: {len(mapped)} replayed nodes folded into the forward")
    return len(mapped)
