"""The schedule in a ``torch.profiler`` trace (``pscompile/profiling.py``): ``engine.profile`` writes
a Chrome trace in which, for one step, every memory node of the schedule that ran is a named range
on the compute thread's lane, every copy it issued a range on a copy thread's lane, and the
``wait`` ranges give the time the step waited on copies. No range is made while nothing records."""

from __future__ import annotations

import collections
import json

import pytest
import torch

import pscompile
from pscompile import profiling
from pscompile.compiled.listing import profiler_node_name
from pscompile.graph.ops import activation_move, mem_op
from conftest import make_batches, make_model

pytestmark = pytest.mark.copy_threads       # the copy threads' lanes, not the race checker


def _engine():
    batch = make_batches("gpt", 1)[0]
    config = pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32)
    budget = pscompile.min_device_memory(make_model("gpt"), batch, config)
    engine = pscompile.compile(make_model("gpt"), batch, config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=torch.float32, device_memory=budget,
        link_bandwidth="200MB/s"))                  # an emulated link: every copy runs on a copy thread
    return engine, batch


def _memory_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if mem_op(n) is not None or activation_move(n) is not None]


def test_a_profiled_step_shows_every_memory_node_its_copies_and_the_waits(tmp_path):
    engine, batch = _engine()
    engine.step(batch)                                     # the measuring step
    losses = engine.profile(tmp_path / "trace.json", batch, steps=1)
    assert len(losses) == 1 and engine.stats.h2d_bytes > 0
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    (step,) = [e for e in events if e["name"] == "pscompile step 0"]
    inside = [e for e in events if step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1]
    lane = [e for e in inside if e["tid"] == step["tid"]]
    copies = [e for e in inside if e["name"].startswith("copy ") and e["tid"] != step["tid"]]
    # a synchronous copy (a gradient stored to the host) runs on the step's own thread (``move``)
    inline = [e for e in lane if e["name"].startswith("copy ") and e["name"].endswith(" (inline)")]
    # the schedule that ran: the cold one, or a warm one starting from what the last run left
    ran = [engine.schedule.gm] + [w.gm for w in engine.book.warm_variants()]
    seen = collections.Counter(e["name"] for e in lane)
    inside_regions = {s for e in lane if e["name"].startswith("region ") and " + " in e["name"]
                      for s in e["name"].split(" + ")[1].split(", ")}     # stores a region runs inside
    matches = [gm for gm in ran if all(seen[profiler_node_name(n)] == 1 or n.name in inside_regions
                                       for n in _memory_nodes(gm))]
    assert matches, "no schedule whose every memory node is a range of the step"
    nodes = _memory_nodes(matches[0])
    assert len(nodes) > 10 and any(mem_op(n) is not None and mem_op(n).kind == "wait" for n in nodes)
    copied = {e["name"].split()[2] for e in copies + inline}
    for n in nodes:                  # every node that moves bytes between tiers issued a copy
        mem = mem_op(n)
        if mem is not None and mem.nbytes > 0 and mem.src != mem.dst:
            assert n.name in copied, f"{profiler_node_name(n)}: no copy, on a copy thread's lane or inline"
    assert any(e["name"].split()[2] == n.name for e in copies for n in nodes if mem_op(n) is not None
               and mem_op(n).kind == "fetch"), "the fetches copy on a copy thread"
    assert len({e["tid"] for e in copies}) == 2, "one copy thread per direction"
    regions = [e["name"] for e in lane if e["name"].startswith("region ")]
    assert any(name.startswith("region ") and "(h.0." in name for name in regions), regions[:5]   # its modules
    waited = sum(e["dur"] for e in lane if e["name"].startswith("wait "))        # microseconds
    assert 0 < waited < step["dur"]


def test_a_lazy_engine_profiles_from_its_first_step(tmp_path):
    """``compile(model)`` without a batch: ``profile`` builds it at its first step, like ``step``."""
    batch = make_batches("gpt", 1)[0]
    engine = pscompile.compile(make_model("gpt"), config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=torch.float32))
    assert len(engine.profile(tmp_path / "lazy.json", batch, steps=2)) == 2
    names = {e["name"] for e in json.loads((tmp_path / "lazy.json").read_text())["traceEvents"]}
    assert "pscompile step 1" in names and any(n.startswith("region ") for n in names)    # (the first
    # step measures node by node; the second runs regions)


def test_no_range_is_made_while_nothing_records(monkeypatch):
    engine, batch = _engine()
    made = []
    monkeypatch.setattr(profiling, "named", lambda name, cuda=False: made.append(name))
    engine.step(batch)
    engine.step(batch)
    assert not made
