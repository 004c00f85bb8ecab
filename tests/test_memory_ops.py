"""Each memory op is declared once (``graph/ops.py``, ``OpDecl``): the declaration is complete, its
consumers read it, and nothing else names an op."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pscompile.compiled import buffer_plan
from pscompile.compiled.listing import _memory_comment, _tier
from pscompile.compiled.moves import ChunkMoves
from pscompile.graph.ops import DECLS, MemOp, decl_for, declare, runs_as_transfer
from pscompile.kinds import MemKind
from passes.verify_schedule import _Replay

ROOT = Path(__file__).resolve().parents[1]


def test_every_kind_has_a_declared_op_and_every_op_a_kind():
    kinds = {d.kind for d in DECLS.values()}
    assert kinds == set(MemKind)
    for d in DECLS.values():
        assert decl_for(d.kind, slot=None if d.name == "wait_grad" else 0,
                        activation=d.activation) is d, d.name


@pytest.mark.parametrize("name", list(DECLS))
def test_declared_handler_check_and_inductor_properties(name):
    d = DECLS[name]
    assert callable(getattr(ChunkMoves, d.handler, None)), f"{name}: ChunkMoves has no {d.handler}"
    if not d.activation:
        assert callable(getattr(_Replay, "_" + d.check, None)), f"{name}: verify_schedule has no check {d.check}"
    schema = d.op._schema
    assert (len(schema.returns) == 0) == (d.returns == "none")
    assert d.link in ("", "h2d", "d2h", "disk") and d.comm in ("", "alongside", "before")
    assert not (d.arrives and d.leaves)
    node = torch.fx.Graph().call_function(d.op, ())
    assert runs_as_transfer(node) and node.is_impure() == (d.returns == "none")   # (FX never drops a side effect)


def test_fakes_run_on_fake_tensors():
    with FakeTensorMode():
        v = torch.empty(4, 3)
        assert torch.ops.pscompile.offload(v).device.type == "cpu"
        assert torch.ops.pscompile.reload(v, torch.device("cpu")).shape == (4, 3)
        assert torch.ops.pscompile.fetch(torch.empty(8), torch.empty(8)) is None


@pytest.mark.parametrize("name", [n for n, d in DECLS.items() if not d.activation])
def test_listing_reads_the_declaration(name):
    d = DECLS[name]
    mem = MemOp(d.kind, 3, None if name in ("wait_grad", "disk_read", "update") else 1, "host", "device",
                0 if not d.link else 4096, "w" if name in ("wait_grad", "store_grad", "accumulate_grad") else None)
    assert mem.decl is d
    node = torch.fx.Graph().call_function(d.op, ())
    assert "3" in _memory_comment(mem, None, node)
    assert _tier(node, mem) == (d.tier or "host->device")


def test_a_wrong_declaration_is_refused_before_anything_is_defined():
    def body(slot: torch.Tensor) -> None:
        return None
    with pytest.raises(TypeError, match="returns='device' disagrees"):
        declare("never_defined", MemKind.FETCH, handler="_mem_fetch", returns="device",
                fake=lambda slot: slot)(body)
    assert "never_defined" not in DECLS and not hasattr(torch.ops.pscompile, "never_defined")


def test_no_file_but_the_declarations_and_the_inserting_passes_names_an_op():
    """An op is called by name only where it is declared and where a pass inserts it."""
    allowed = {"pscompile/graph/ops.py", "passes/offload_activations.py"}
    named = re.compile(r"torch\.ops\.pscompile\.\w+")
    found = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("pscompile/**/*.py"), *ROOT.glob("passes/*.py")]
                   if named.search(p.read_text()) and str(p.relative_to(ROOT)) not in allowed)
    assert found == []


class _Lines:
    def __init__(self, lines):
        self.wrapper_code = type("W", (), {"lines": lines})()
        self.sizevars = None


def test_an_unknown_inductor_wrapper_line_is_refused_not_skipped():
    from torch._inductor.codegen import wrapper as w

    class NewAllocatingLine(w.WrapperLine):
        pass
    assert buffer_plan.buffer_events(_Lines(["buf0 = kernel(...)", w.NullLine(None)])) == []
    with pytest.raises(buffer_plan.UnreadWrapperLine, match="NewAllocatingLine"):
        buffer_plan.buffer_events(_Lines([NewAllocatingLine()]))


def test_every_wrapper_line_class_of_this_torch_is_known():
    """When torch adds a wrapper line, this names it: read it in ``buffer_events`` or list it as
    allocating nothing."""
    from torch._inductor.codegen import wrapper as w
    known = buffer_plan._READ | buffer_plan._NO_ALLOCATION
    lines = {c.__name__ for c in vars(w).values() if isinstance(c, type) and issubclass(c, w.WrapperLine)}
    unknown = lines - known - {"WrapperLine", "MemoryPlanningLine"}
    assert unknown <= {"EnterSubgraphLine", "ExitSubgraphLine", "ConditionalLine"}, unknown
