"""The whole-graph lowering experiment (bench/whole_graph.py): ordering barriers make Inductor
respect a memory op that overwrites a slot after a lazily computed read of it.

The graph below is the pattern that broke whole-graph lowering in the scheduled GPT: a value
computed from a parameter's slot (``x * w``) is used only after a ``store_grad`` has overwritten
that slot. Inductor inlines the product into its later user and so reads the new bytes, unless
the value is realized before the store; ``order_mutations`` puts the barrier that does it.
"""

import importlib.util
import sys
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import pscompile.graph.ops  # noqa: F401  (registers the memory ops)

_SPEC = importlib.util.spec_from_file_location(
    "whole_graph", Path(__file__).resolve().parents[1] / "bench" / "whole_graph.py")
wg = sys.modules.setdefault("whole_graph", importlib.util.module_from_spec(_SPEC))
if not hasattr(wg, "order_mutations"):
    _SPEC.loader.exec_module(wg)


def _read_then_overwrite(slot, x, g):
    w = slot[0:4]
    y = x * w                                        # read before the store ...
    torch.ops.pscompile.store_grad(slot, g, 0)       # ... which overwrites w's bytes
    return (y + 1, slot[4:8] * 2)                    # ... used after it; a read after it sees new bytes


def _compile(gm, inputs):
    from torch._inductor.compile_fx import compile_fx_inner
    wg._register_realize_lowering()
    with torch._inductor.config.patch(force_disable_caches=True):
        return compile_fx_inner(gm, [t.clone() for t in inputs])


def test_order_mutations_puts_a_barrier_over_values_read_before_an_overwrite():
    torch.manual_seed(0)
    inputs = [torch.randn(8), torch.randn(4), torch.randn(4)]
    gm = make_fx(_read_then_overwrite)(*[t.clone() for t in inputs])
    assert wg.order_mutations(gm) == 1
    barrier = next(n for n in gm.graph.nodes if n.target is torch.ops.pscompile_bench.realize.default)
    assert [v.target for v in barrier.args[0]] == [torch.ops.aten.mul.Tensor]     # y, not the view w
    assert barrier.next.target is torch.ops.pscompile.store_grad.default


def test_inductor_runs_the_ordered_graph_like_eager():
    torch.manual_seed(0)
    inputs = [torch.randn(8), torch.randn(4), torch.randn(4)]
    gm = make_fx(_read_then_overwrite)(*[t.clone() for t in inputs])
    wg.order_mutations(gm)
    fn = _compile(gm, inputs)
    eager_in = [t.clone() for t in inputs]
    comp_in = [t.clone() for t in inputs]
    ref = _read_then_overwrite(*eager_in)
    out = fn(list(comp_in))
    for r, o in zip(ref, out):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    torch.testing.assert_close(comp_in[0], eager_in[0], rtol=0, atol=0)    # the store happened
