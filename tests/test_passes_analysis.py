"""annotate_params (view-aware parameter uses, fwd/bwd phase) and estimate_nonmodel (static
non-model memory), checked against the graph itself and against a measured run."""

from __future__ import annotations

import operator
import re

import pytest
import torch
from torch import fx, nn

from conftest import bert_batches, gpt_batches, make_model
from pscompile.graph import meta as graph_meta
from pscompile.graph.capture import CapturedGraph, capture_joint
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.passes.annotate_params import annotate_params
from pscompile.passes.estimate_nonmodel import estimate_nonmodel
from pscompile.memory.tracker import NonModelTracker


def capture(model: nn.Module, batch, **kw) -> CapturedGraph:
    return capture_joint(model, batch, params=dict(model.named_parameters()), **kw)


@pytest.fixture(scope="module")
def gpt():
    model = make_model("gpt")
    batch = gpt_batches(1, batch=2, seq=32)[0]
    return model, batch, capture(model, batch)


# ---------------------------------------------------------------------------------------------
# annotate_params
# ---------------------------------------------------------------------------------------------

def test_view_aware_last_use_of_a_linear_weight_is_in_the_backward():
    """The facts file: a Linear weight's only direct user is t(w) in the forward, but the backward
    keeps reading t(t(w)). Same shape as there: a 4-layer GPT (narrow, so it is fast)."""
    model = GPT(GPTConfig(n_layer=4, n_head=2, d_model=32, vocab_size=64, seq_len=16))
    batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    c = capture(model, batch)
    uses = annotate_params(c)
    n = len(c.gm.graph.nodes)
    w = uses["h.0.attn.c_attn.weight"]
    print(f"h.0.attn.c_attn.weight: direct last use {w.direct_last_use}, view-aware {w.last_use} of {n} nodes")
    assert uses.phase[w.direct_last_use] == "fwd" and uses.phase[w.last_use] == "bwd"
    assert w.direct_last_use < uses.loss_index < w.last_use
    assert w.last_use > 0.9 * n and w.direct_last_use < 0.2 * n
    nodes = list(c.gm.graph.nodes)
    assert str(nodes[w.direct_last_use].target) == "aten.t.default"
    last = nodes[w.last_use]
    assert str(last.target) == "aten.mm.default"
    assert any(graph_meta.get(a, "param") == w.fqn and a.args[0] is not nodes[w.placeholder]
               for a in last.all_input_nodes), "the last read goes through a view of a view"


def test_metadata_and_phases(gpt):
    model, batch, c = gpt
    uses = annotate_params(c)
    nodes = list(c.gm.graph.nodes)
    print(uses.summary, "| view ops:", uses.view_ops)
    assert re.fullmatch(r"annotate_params: 28 params, \d+ reads, fwd \d+ nodes, bwd \d+ nodes", uses.summary)
    assert [u.fqn for u in uses.params] == list(c.param_fqns)
    assert "aten.t.default" in uses.view_ops
    for u in uses.params:
        ph = nodes[u.placeholder]
        assert ph.op == "placeholder"
        assert graph_meta.get(ph, "param") == u.fqn
        assert graph_meta.get(ph, "last_use") == u.last_use
        assert u.reads and u.first_use <= u.last_use
        for i in u.views:
            assert graph_meta.get(nodes[i], "param") == u.fqn
            assert graph_meta.get(nodes[i], "reads") is None          # a view is not a read
        for i in u.reads:
            assert u.fqn in graph_meta.get(nodes[i], "reads")
    # every node reading a parameter (through any chain of views) is listed
    for i, n in enumerate(nodes):
        if n.op == "call_function" and graph_meta.get(n, "param") is None:
            touched = {graph_meta.get(a, "param") for a in n.all_input_nodes} - {None}
            assert set(graph_meta.get(n, "reads", ())) == touched, n.name
    # phases: placeholders/output none; the loss and everything it needs is the forward
    assert uses.phase[uses.loss_index] == "fwd"
    assert all(uses.phase[i] is None for i, n in enumerate(nodes) if n.op in ("placeholder", "output"))
    assert uses.num_fwd + uses.num_bwd == len(nodes) - len(c.placeholders()) - 1
    assert uses.fwd_is_prefix
    # the tied embedding / LM-head weight: read by the embedding (fwd), the head (fwd) and the
    # head's input gradient (bwd)
    wte = uses["wte.weight"]
    assert [uses.phase[i] for i in wte.reads] == ["fwd", "fwd", "bwd"]
    # linear weights are read through views, layer-norm weights directly
    assert uses["h.0.ln_1.weight"].views == () and uses["h.0.mlp.c_fc.weight"].views


def test_views_are_found_generically():
    """split / select / unsqueeze / expand / view / transpose of a parameter, chained."""
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 6))
            self.v = nn.Parameter(torch.randn(6))

        def forward(self, x):                                  # x: (B, 3)
            a, b = self.w.split(3, dim=1)                      # 2 x (4, 3)
            y = x @ a.T                                        # (B, 4)
            z = (x * b[0].unsqueeze(0).expand(x.shape[0], 3)).sum(1, keepdim=True)   # (B, 1)
            return (y + z).sum() + self.v.view(2, 3).transpose(0, 1).sum()

    torch.manual_seed(0)
    model = Toy()
    c = capture(model, (torch.randn(5, 3),))
    uses = annotate_params(c)
    nodes = list(c.gm.graph.nodes)
    print("view ops:", uses.view_ops)
    views_w = {str(nodes[i].target) if hasattr(nodes[i].target, "_schema") else nodes[i].target.__name__
               for i in uses["w"].views}
    assert {"aten.split.Tensor", "getitem", "aten.select.int", "aten.unsqueeze.default",
            "aten.expand.default"} <= views_w, views_w
    # every node recognised as a view is an aliasing op by its schema too
    for i in uses["w"].views + uses["v"].views:
        n = nodes[i]
        schema = getattr(n.target, "_schema", None)
        assert n.target is operator.getitem or schema.returns[0].alias_info is not None, n.format_node()
    # every read is a real computation on the memory (not a view)
    for u in uses.params:
        assert u.reads
        for i in u.reads:
            schema = getattr(nodes[i].target, "_schema", None)
            assert schema is None or schema.returns[0].alias_info is None, nodes[i].format_node()


def test_annotate_is_idempotent_and_leaves_the_graph_alone(gpt):
    _, _, c = gpt
    code = c.gm.code
    first = annotate_params(c)
    second = annotate_params(c)
    assert first == second and c.gm.code == code


# ---------------------------------------------------------------------------------------------
# estimate_nonmodel vs a measured run
# ---------------------------------------------------------------------------------------------

class MeasuredRun(fx.Interpreter):
    """Runs the captured graph on real tensors and samples the live non-model bytes (a
    ``NonModelTracker``, parameters excluded) while each node runs. The interpreter owns the only
    references to its inputs, so a batch tensor dies after its last use; an unused value dies at
    once (as in the generated code). With ``stored_at`` (fqn -> node index) a gradient output is
    dropped right after that node (as the executor will store it into its chunk)."""

    def __init__(self, c: CapturedGraph, feed: list[torch.Tensor], tracker: NonModelTracker,
                 *, stored_at: dict[str, int] | None = None):
        super().__init__(c.gm)
        self.feed, self.k, self.tracker, self.curve = feed, 0, tracker, []
        self.drop_after: dict[fx.Node, list[fx.Node]] = {}
        self.pending: list[fx.Node] = []
        nodes = list(c.gm.graph.nodes)
        for fqn, g in zip(c.grad_fqns, c.gm.graph.output_node().args[0][1:]):
            if stored_at is not None:
                self.drop_after.setdefault(nodes[stored_at[fqn]], []).append(g)

    def placeholder(self, target, args, kwargs):
        value, self.feed[self.k] = self.feed[self.k], None
        self.k += 1
        return value

    def run_node(self, n):
        for dead in self.pending:                      # values that died after the previous node
            self.env[dead] = None
        self.pending = list(self.drop_after.get(n, ()))
        with self.tracker:
            out = super().run_node(n)
        self.curve.append(self.tracker.current())
        if not n.users and n.op != "output":
            self.pending.append(n)
        return out


def asap(c: CapturedGraph) -> dict[str, int]:
    """Each gradient's last non-output use (its own node if the output is its only user)."""
    index = {n: i for i, n in enumerate(c.gm.graph.nodes)}
    return {fqn: max([index[u] for u in g.users if u.op != "output"], default=index[g])
            for fqn, g in zip(c.grad_fqns, c.gm.graph.output_node().args[0][1:])}


def measure(c: CapturedGraph, model: nn.Module, batch, *, dtype=None, stored_at=None) -> list[int]:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    ps = [params[f].detach().to(dtype or params[f].dtype) for f in c.param_fqns]
    ptrs = {p.untyped_storage().data_ptr() for p in ps}
    tracker = NonModelTracker(torch.device("cpu"), ptrs.__contains__, lambda: 0, exact_windows=True)
    feed = ps + [buffers[f].clone() for f in c.buffer_fqns] + [t.clone() for t in c.flatten_batch(batch)]
    for i in range(len(ps), len(feed)):               # batch and buffers exist from the start
        tracker.add_tensor(feed[i])
    held = feed[len(ps):]               # the caller holds the batch and the model its buffers throughout
    run = MeasuredRun(c, feed, tracker, stored_at=stored_at)
    del feed
    with torch.no_grad():
        run.run()
    del held
    return run.curve


def compare(static: tuple[int, ...], measured: list[int]) -> tuple[int, int]:
    assert len(static) == len(measured)
    diffs = [abs(a - b) for a, b in zip(static, measured)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    for a, b in zip(static, measured):
        assert abs(a - b) <= max(1024, 0.01 * b), (a, b)
    return diffs[worst], worst


def test_static_curve_matches_measured_gpt(gpt):
    model, batch, c = gpt
    uses = annotate_params(c)
    est = estimate_nonmodel(c, uses)
    measured = measure(c, model, batch)
    worst, at = compare(est.bytes, measured)
    print(f"{est.summary}\nGPT tiny: {len(measured)} nodes, max |static - measured| = {worst} B at node "
          f"{at}; peaks {est.peak} / {max(measured)} B")
    assert est.peak == max(measured)
    assert est.peak_index == measured.index(max(measured))
    nodes = list(c.gm.graph.nodes)
    assert [graph_meta.get(n, "nonmodel") for n in nodes] == list(est.bytes)
    # node 0 is a parameter placeholder: only the batch is live
    batch_bytes = sum(t.untyped_storage().nbytes() for t in c.flatten_batch(batch))
    assert est.bytes[0] == batch_bytes
    # at the output: the loss, every gradient, and the batch (its caller still holds it)
    grad_bytes = sum(p.numel() * p.element_size() for f, p in model.named_parameters() if f in c.grad_fqns)
    assert est.outputs_bytes[-1] == grad_bytes and est.bytes[-1] == grad_bytes + 4 + batch_bytes
    assert est.without_outputs[-1] == 4 + batch_bytes and est.curve_without_outputs is est.without_outputs
    assert all(w <= b and b - w <= o for b, w, o in zip(est.bytes, est.without_outputs, est.outputs_bytes))


def test_static_curve_without_outputs_matches_measured(gpt):
    model, batch, c = gpt
    uses = annotate_params(c)
    est = estimate_nonmodel(c, uses)
    measured = measure(c, model, batch, stored_at=asap(c))
    worst, at = compare(est.without_outputs, measured)
    print(f"GPT tiny, gradients stored as computed: max |static - measured| = {worst} B at node {at}")
    assert est.peak_without_outputs == max(measured)
    # stored no earlier than the parameter's own last use (the gradient takes its chunk space):
    # in these graphs that is never later than the gradient's own last use
    assert all(uses[f].last_use <= i for f, i in asap(c).items())
    # an executor that stores each gradient 20 nodes late
    end = len(c.gm.graph.nodes) - 1
    late = {f: min(i + 20, end) for f, i in asap(c).items()}
    est_late = estimate_nonmodel(c, uses, grads_stored_at=late)
    compare(est_late.without_outputs, measure(c, model, batch, stored_at=late))
    assert all(a <= b <= x for a, b, x in zip(est.without_outputs, est_late.without_outputs, est.bytes))
    assert est_late.without_outputs != est.without_outputs
    assert est_late.bytes == est.bytes
    with pytest.raises(ValueError, match="grads_stored_at names"):
        estimate_nonmodel(c, uses, grads_stored_at={"nope": 3})


@pytest.mark.parametrize("kind,dtype,dropout", [("bert", None, 0.1), ("gpt", torch.bfloat16, 0.1)])
def test_static_curve_matches_measured_other(kind, dtype, dropout):
    model = make_model(kind, dropout=dropout)
    batch = (gpt_batches if kind == "gpt" else bert_batches)(1, batch=2, seq=32)[0]
    c = capture(model, batch, param_dtype=dtype)
    est = estimate_nonmodel(c, annotate_params(c))
    torch.manual_seed(0)
    measured = measure(c, model, batch, dtype=dtype)
    worst, at = compare(est.bytes, measured)
    print(f"{kind} dtype={dtype} dropout={dropout}: {len(measured)} nodes, max diff {worst} B at {at}")
    assert est.peak == max(measured)
