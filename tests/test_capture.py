"""capture_joint: one flat FX graph of forward + loss + backward that computes exactly eager's numbers."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from conftest import bert_batches, gpt_batches, make_model
from pscompile.runtime.batching import call_model, extract_loss
from pscompile.graph.capture import CapturedGraph, capture_joint
from pscompile.models.gpt import GPT, gpt_config


def gpt_batch():
    return gpt_batches(1, batch=2, seq=32)[0]                 # small: the tests compare numbers


def bert_batch():
    return bert_batches(1, batch=2, seq=32)[0]


def canonical_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())          # remove_duplicate: tied weights once, first name


def capture(model: nn.Module, batch, **kw) -> CapturedGraph:
    return capture_joint(model, batch, params=canonical_params(model), **kw)


def run_captured(c: CapturedGraph, model: nn.Module, batch, *, dtype=None) -> tuple[torch.Tensor, ...]:
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    args = [params[f].detach().to(dtype or params[f].dtype) for f in c.param_fqns]
    args += [buffers[f] for f in c.buffer_fqns] + c.flatten_batch(batch)
    with torch.no_grad():
        return c.gm(*args)


def eager(model: nn.Module, batch, loss_fn=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = extract_loss(call_model(model, batch), batch, loss_fn)
    loss.backward()
    return loss.detach(), {f: p.grad for f, p in model.named_parameters() if p.grad is not None}


def max_grad_diff(c: CapturedGraph, out, grads) -> float:
    assert len(out) == 1 + len(c.grad_fqns)
    return max((g - grads[f]).abs().max().item() for f, g in zip(c.grad_fqns, out[1:]))


def as_dict(kind, batch):
    return {"idx": batch[0], "targets": batch[1]} if kind == "gpt" else batch


def as_tuple(kind, batch):
    return batch if kind == "gpt" else (batch["input_ids"], batch["labels"])


@pytest.mark.parametrize("kind,form", [("gpt", "tuple"), ("gpt", "dict"), ("bert", "dict"), ("bert", "tuple")])
def test_matches_eager_loss_and_grads(kind, form):
    model = make_model(kind)
    raw = gpt_batch() if kind == "gpt" else bert_batch()
    batch = as_dict(kind, raw) if form == "dict" else as_tuple(kind, raw)
    c = capture_joint(model, batch, params=canonical_params(model))
    out = run_captured(c, model, batch)
    loss, grads = eager(model, batch)
    print(f"{kind}/{form}: {len(c.gm.graph.nodes)} nodes, capture {c.capture_s:.2f} s, "
          f"loss diff {(out[0] - loss).abs().item()}, max grad diff {max_grad_diff(c, out, grads)}")
    assert (out[0] - loss).abs().item() <= 1e-6
    assert max_grad_diff(c, out, grads) <= 1e-6
    assert c.capture_s > 0


def test_tied_weights_one_placeholder_summed_grad():
    model = make_model("gpt")
    assert model.lm_head.weight is model.wte.weight
    batch = gpt_batch()
    c = capture_joint(model, batch, params=canonical_params(model))
    assert "lm_head.weight" not in c.param_fqns and c.param_fqns[0] == "wte.weight"
    assert len(c.param_fqns) == len(set(c.param_fqns)) == len(list(model.parameters()))
    # the tied weight is read by the embedding and by the LM head (both through the one placeholder)
    ph = c.placeholders()[0]
    targets = {str(n.target) for n in ph.users}
    assert "aten.embedding.default" in targets and "aten.t.default" in targets, targets
    out = run_captured(c, model, batch)
    _, grads = eager(model, batch)
    g = out[1 + c.grad_fqns.index("wte.weight")]
    assert (g - grads["wte.weight"]).abs().max().item() <= 1e-6


def test_dropout_same_seed_same_loss():
    model = make_model("gpt", dropout=0.1)
    batch = gpt_batch()
    c = capture_joint(model, batch, params=canonical_params(model))
    assert any("dropout" in str(n.target) or "bernoulli" in str(n.target) or "rand" in str(n.target)
               for n in c.gm.graph.nodes), "the dropout RNG must be inside the graph"
    torch.manual_seed(7)
    out = run_captured(c, model, batch)
    torch.manual_seed(7)
    loss, grads = eager(model, batch)
    assert (out[0] - loss).abs().item() <= 1e-6
    assert max_grad_diff(c, out, grads) <= 1e-6
    torch.manual_seed(8)
    other = run_captured(c, model, batch)
    assert (other[0] - loss).abs().item() > 1e-6        # the mask really is random


def test_flat_placeholders_readable_names_and_meta():
    model = make_model("gpt")
    batch = gpt_batch()
    c = capture_joint(model, batch, params=canonical_params(model))
    names = [n.name for n in c.placeholders()]
    assert names[:2] == ["p_wte_weight", "p_wpe_weight"]
    assert "p_h_0_attn_c_attn_weight" in names
    assert names[-2:] == ["in_0", "in_1"]
    assert len(names) == len(c.param_fqns) + len(c.buffer_fqns) + c.batch_spec.num_tensors
    assert type(c.gm.graph._codegen) is torch.fx.graph.CodeGen
    assert re.search(r"def forward\(self, p_wte_weight, p_wpe_weight, .*, in_0, in_1\)", c.gm.code)
    for n in c.gm.graph.nodes:
        if n.op != "output":
            assert "val" in n.meta, n.name
    outs = c.gm.graph.output_node().args[0]
    assert isinstance(outs, tuple) and len(outs) == 1 + len(c.grad_fqns)
    assert outs[0].meta["val"].shape == ()
    params = dict(model.named_parameters())
    for f, o in zip(c.grad_fqns, outs[1:]):
        assert o.meta["val"].shape == params[f].shape, f
    c.gm.graph.lint()

    bert = make_model("bert")
    cb = capture_joint(bert, bert_batch(), params=canonical_params(bert))
    assert [n.name for n in cb.placeholders()][-2:] == ["in_input_ids", "in_labels"]


def test_frozen_params_are_inputs_without_grads():
    model = make_model("gpt")
    frozen = {"wpe.weight", "h.0.attn.c_attn.weight", "ln_f.bias"}
    for f, p in model.named_parameters():
        p.requires_grad_(f not in frozen)
    batch = gpt_batch()
    c = capture_joint(model, batch, params=canonical_params(model))
    assert set(c.param_fqns) - set(c.grad_fqns) == frozen
    assert list(c.grad_fqns) == [f for f in c.param_fqns if f not in frozen]
    out = run_captured(c, model, batch)
    loss, grads = eager(model, batch)
    assert set(grads) == set(c.grad_fqns)
    assert (out[0] - loss).abs().item() <= 1e-6 and max_grad_diff(c, out, grads) <= 1e-6


def test_param_dtype_bf16():
    model = make_model("gpt")
    batch = gpt_batch()
    c = capture_joint(model, batch, params=canonical_params(model), param_dtype=torch.bfloat16)
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in c.placeholders()[:len(c.param_fqns)])
    outs = c.gm.graph.output_node().args[0]
    assert outs[0].meta["val"].dtype == torch.float32          # GPT computes the loss in fp32
    assert all(o.meta["val"].dtype == torch.bfloat16 for o in outs[1:])
    out = run_captured(c, model, batch, dtype=torch.bfloat16)
    loss, grads = eager(model.to(torch.bfloat16), batch)
    assert (out[0] - loss).abs().item() <= 1e-6 and max_grad_diff(c, out, grads) <= 1e-6


def test_capture_reads_shapes_only_swapped_data_and_meta_models():
    batch = gpt_batch()
    ref = make_model("gpt")
    c_ref = capture_joint(ref, batch, params=canonical_params(ref))
    # an engine swapped param.data for a dummy of the right shape (hooks mode does this)
    swapped = make_model("gpt")
    dummy = torch.zeros((), dtype=torch.float32)
    for p in swapped.parameters():
        p.data = dummy.expand(p.shape)
    c_swapped = capture_joint(swapped, batch, params=canonical_params(swapped))
    # a model built on the meta device
    with torch.device("meta"):
        meta = GPT(gpt_config("gpt-tiny"))
    c_meta = capture_joint(meta, batch, params=canonical_params(meta))
    code = c_ref.gm.code
    assert c_swapped.gm.code == code and c_meta.gm.code == code
    out = run_captured(c_meta, ref, batch)           # the graph runs on the real weights
    loss, grads = eager(ref, batch)
    assert (out[0] - loss).abs().item() <= 1e-6 and max_grad_diff(c_meta, out, grads) <= 1e-6


def test_loss_fn_and_output_with_loss_attribute():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 3)
            self.register_buffer("scale", torch.full((3,), 2.0))

        def forward(self, x, y):
            return self.lin(x) * self.scale                  # (B, 3); y is for the loss_fn

    torch.manual_seed(0)
    model = Net()
    batch = {"x": torch.randn(5, 8), "y": torch.randint(0, 3, (5,))}

    def loss_fn(out, b):
        return nn.functional.cross_entropy(out, b["y"])

    model_fwd = model.forward
    c = capture_joint(model, batch, params=canonical_params(model), loss_fn=loss_fn)
    assert c.buffer_fqns == ("scale",)
    assert [n.name for n in c.placeholders()] == ["p_lin_weight", "p_lin_bias", "b_scale", "in_x", "in_y"]
    out = run_captured(c, model, batch)
    loss, grads = eager(model, batch, loss_fn)
    assert (out[0] - loss).abs().item() <= 1e-6 and max_grad_diff(c, out, grads) <= 1e-6
    assert model.forward == model_fwd and not model._forward_hooks and not model._forward_pre_hooks

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return {"loss": self.lin(x).square().mean(), "aux": x}

    m2 = WithLoss()
    c2 = capture_joint(m2, (torch.randn(2, 4),), params=canonical_params(m2))
    assert len(c2.gm.graph.output_node().args[0]) == 3


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:                                       # data-dependent control flow
            return x * 2
        return x


class Normalize(nn.Module):
    def forward(self, x):
        return x / x.abs().max().item()                       # .item()


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.lin(x)).sum()


@pytest.mark.parametrize("inner", [Gate, Normalize])
def test_uncapturable_model_names_module_and_suggests_hooks(inner):
    model = Wrapper(inner())
    with pytest.raises(ValueError) as info:
        capture_joint(model, (torch.randn(2, 4),), params=canonical_params(model))
    msg = str(info.value)
    print(msg)
    assert f"module inner ({inner.__name__}" in msg
    assert "_local_scalar_dense" in msg and 'Config(mode="hooks")' in msg
    assert info.value.__cause__ is not None


def test_bad_loss_and_bad_params_are_value_errors():
    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    model = Logits()
    with pytest.raises(ValueError, match="loss must be a scalar"):
        capture_joint(model, (torch.randn(2, 4),), params=canonical_params(model))
    with pytest.raises(ValueError, match=r"lacks the model parameters \['lin.bias'\]"):
        capture_joint(model, (torch.randn(2, 4),), params={"lin.weight": model.lin.weight})
    with pytest.raises(ValueError, match="not the model's parameter"):
        capture_joint(model, (torch.randn(2, 4),), params={"lin.weight": model.lin.bias,
                                                           "lin.bias": model.lin.weight})


def test_flatten_batch_checks_the_signature():
    model = make_model("bert")
    batch = bert_batch()
    c = capture_joint(model, batch, params=canonical_params(model))
    flat = c.flatten_batch(batch)
    assert [t is batch[k] for t, k in zip(flat, ["input_ids", "labels"])] == [True, True]
    with pytest.raises(ValueError, match="structure"):
        c.flatten_batch((batch["input_ids"], batch["labels"]))
    with pytest.raises(ValueError, match="capture again"):
        c.flatten_batch({"input_ids": batch["input_ids"][:1], "labels": batch["labels"][:1]})


def test_buffers_updated_in_place_and_tensor_constants():
    """BatchNorm updates its running statistics in the graph (buffers are inputs that it mutates,
    as eager does); a plain tensor attribute becomes a graph constant."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)
            self.scale = torch.arange(4.0)                     # not a buffer: a constant

        def forward(self, x):
            return (self.bn(self.lin(x)) * self.scale).square().mean()

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(6, 4)
    c = capture(model, (x,))
    assert c.buffer_fqns == ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")
    assert any(n.op == "get_attr" for n in c.gm.graph.nodes)
    buffers = {f: b.clone() for f, b in model.named_buffers()}
    params = dict(model.named_parameters())
    with torch.no_grad():
        out = c.gm(*[params[f].detach() for f in c.param_fqns], *buffers.values(), x)
    loss, grads = eager(model, (x,))                          # updates model's own buffers
    assert (out[0] - loss).abs().item() <= 1e-6 and max_grad_diff(c, out, grads) <= 1e-6
    for f, b in model.named_buffers():
        assert torch.equal(buffers[f], b), f
    assert int(buffers["bn.num_batches_tracked"]) == 1
