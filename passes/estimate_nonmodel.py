"""estimate_nonmodel: static non-model bytes live while each node of the captured graph runs.

A pure analysis over FakeTensor ``meta["val"]`` (no real compute) that writes ``nonmodel``
metadata on every node. Tensors are grouped by untyped storage (``StorageWeakRef``), so views
cost nothing and a storage counts once, with its full ``nbytes``::

    storage S: created at node c(S)  (the first node whose value holds a tensor of S)
               last used at l(S)     (the last node that reads any tensor aliasing S; the output
                                      node when S is returned)
    N[i] = sum of nbytes(S) over storages with c(S) <= i <= l(S)       "live while node i runs"

- The value of an ``offload`` node (``offload_activations``) is a host copy: no device bytes.
- Parameter storages (placeholders and their views: ``uses`` from ``annotate_params``) are model
  data and excluded.
- Batch and buffer placeholders and constants (``get_attr``) are live throughout: the caller holds
  the batch and the model its buffers, whatever the graph's last use of them.
- A node whose value is never used is live only while it runs (as in the generated code, which
  drops such values at once).
- Gradient outputs (outputs 1..) stay live until the output node. ``outputs_bytes[i]`` is the part
  of ``N[i]`` that is live gradient outputs; ``without_outputs`` is the curve when each gradient
  dies right after its producing node and its last non-output use (the executor stores every
  gradient into its chunk as soon as it is computed), or later where ``grads_stored_at`` says so
  (e.g. not before the parameter's own last use, when the gradient takes the parameter's chunk
  space). The loss is kept live in both curves.

Scratch memory inside an op is invisible here (and to the runtime tracker).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pscompile.graph import meta as graph_meta
from pscompile.graph.ops import is_offload
from pscompile.graph.capture import CapturedGraph
from pscompile.passes.annotate_params import ParamUses, tensor_storages
from pscompile.units import format_bytes

log = logging.getLogger("pscompile")


@dataclass(frozen=True)
class NonModelCurve:
    bytes: tuple[int, ...]            # per node index: non-model bytes live while it runs
    outputs_bytes: tuple[int, ...]    # per node index: the part of ``bytes`` held by gradient outputs
    without_outputs: tuple[int, ...]  # per node index: ``bytes`` if gradients die after their last use
    peak: int                         # max(bytes)
    peak_index: int                   # first node index where ``bytes`` peaks
    peak_without_outputs: int         # max(without_outputs)
    peak_without_outputs_index: int
    num_storages: int                 # distinct non-model storages in the graph

    @property
    def curve_without_outputs(self) -> tuple[int, ...]:
        return self.without_outputs

    @property
    def summary(self) -> str:
        return (f"estimate_nonmodel: {self.num_storages} storages, peak {format_bytes(self.peak)} at node "
                f"{self.peak_index}, {format_bytes(self.peak_without_outputs)} at node "
                f"{self.peak_without_outputs_index} with gradients stored as computed")


@dataclass
class _Storage:
    nbytes: int
    created: int
    last: int
    last_nonoutput: int
    grad_output: bool = False


def estimate_nonmodel(captured: CapturedGraph, uses: ParamUses, *,
                      grads_stored_at: Mapping[str, int] | None = None) -> NonModelCurve:
    """The static non-model memory curve of ``captured`` (see the module docstring).

    ``grads_stored_at`` (fqn -> node index) says when the executor stores each gradient into its
    chunk, for ``without_outputs``: a gradient dies after ``max(its last non-output use, that
    index)``. Default: right after its last non-output use."""
    stored_at = grads_stored_at or {}
    unknown = set(stored_at) - set(captured.grad_fqns)
    if unknown:
        raise ValueError(f"grads_stored_at names {sorted(unknown)}, which have no gradient output; "
                         f"use fqns from captured.grad_fqns")
    graph = captured.gm.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    end = len(nodes) - 1
    model = {st for u in uses.params for st in tensor_storages(nodes[u.placeholder].meta.get("val"))}

    storages: dict[StorageWeakRef, _Storage] = {}
    for i, n in enumerate(nodes):
        if n.op == "output" or is_offload(n):
            continue                  # an offloaded activation's copy lives on the host
        last = max((index[u] for u in n.users), default=i)
        last_nonoutput = max((index[u] for u in n.users if u.op != "output"), default=i)
        born = 0 if n.op in ("placeholder", "get_attr") else i
        if n.op in ("placeholder", "get_attr"):   # the caller holds the batch, the model its buffers
            last = last_nonoutput = end            # and constants: live for the whole graph
        for st, nbytes in _storages_with_bytes(n.meta.get("val")):
            if st in model:
                continue
            s = storages.get(st)
            if s is None:
                s = storages[st] = _Storage(nbytes, born, last, last_nonoutput)
            s.last = max(s.last, last)
            s.last_nonoutput = max(s.last_nonoutput, last_nonoutput)
    outputs = graph.output_node().args[0]
    assert len(outputs) == 1 + len(captured.grad_fqns)
    for fqn, out in zip(captured.grad_fqns, outputs[1:]):
        for st in tensor_storages(out.meta.get("val")):
            if st in storages:
                s = storages[st]
                s.grad_output = True
                s.last_nonoutput = max(s.last_nonoutput, min(stored_at.get(fqn, 0), end))

    diff = [0] * (len(nodes) + 1)       # difference arrays: +nbytes at created, -nbytes after last
    diff_out = [0] * (len(nodes) + 1)
    diff_wo = [0] * (len(nodes) + 1)
    for s in storages.values():
        assert s.created <= s.last, s
        diff[s.created] += s.nbytes
        diff[s.last + 1] -= s.nbytes
        if s.grad_output:
            diff_out[s.created] += s.nbytes
            diff_out[s.last + 1] -= s.nbytes
            diff_wo[s.created] += s.nbytes
            diff_wo[s.last_nonoutput + 1] -= s.nbytes
        else:
            diff_wo[s.created] += s.nbytes
            diff_wo[s.last + 1] -= s.nbytes
    curve, curve_out, curve_wo = _prefix(diff), _prefix(diff_out), _prefix(diff_wo)
    peak = max(curve)
    peak_wo = max(curve_wo)
    for n, b in zip(nodes, curve):
        graph_meta.put(n, "nonmodel", b)
    assert curve[end] == sum(s.nbytes for s in storages.values() if s.last == end)
    result = NonModelCurve(tuple(curve), tuple(curve_out), tuple(curve_wo), peak, curve.index(peak),
                           peak_wo, curve_wo.index(peak_wo), len(storages))
    log.info(result.summary)
    return result


def _storages_with_bytes(value) -> list[tuple[StorageWeakRef, int]]:
    if isinstance(value, torch.Tensor):
        st = value.untyped_storage()
        return [(StorageWeakRef(st), st.nbytes())]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in _storages_with_bytes(v)]
    return []


def _prefix(diff: list[int]) -> list[int]:
    out, acc = [], 0
    for d in diff[:-1]:
        acc += d
        out.append(acc)
    return out
