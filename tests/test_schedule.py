"""pscompile.compiled.schedule: the listing, table, timeline and files of a compiled engine's schedule
(tiny GPT, float32, a budget that forces evictions; ~10 s)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

import pscompile
from pscompile.graph.meta import get
from pscompile.graph.ops import is_memory_node
from pscompile.compiled.schedule import Schedule
from pscompile.units import format_bytes
from conftest import make_batches, make_model

PASSES = ("capture_joint", "annotate_params", "estimate_nonmodel", "plan_residency", "insert_memory_ops",
          "verify_schedule")


def compiled(device_memory):
    return pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0], config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=torch.float32, device_memory=device_memory))


@pytest.fixture(scope="module")
def tight():
    """(engine, schedule) under the plan's minimum budget + 128 KiB: chunks are evicted."""
    unlimited = compiled(None)
    budget = unlimited.min_device_memory + (128 << 10)
    unlimited.close()
    engine = compiled(budget)
    schedule = engine.schedule
    assert any(r.mem is not None and r.mem.kind == "drop" for r in schedule.rows), "budget evicts nothing"
    yield engine, schedule
    engine.close()


def plan_axis_peak(s: Schedule) -> int:
    """Independent replay of the final plan on the captured graph's nodes: resident chunks (after
    the actions before node i) * slot bytes + optimizer states on the device + the non-model bytes
    live then. The actions before node i run right after the last node that executes before it
    (parameter views are rebuilt at their readers and the output runs nothing), so they see that
    node's bytes, and node i its own."""
    resident, by_node, peak, last = len(s.plan.initial), {}, 0, 0
    for a in s.plan.actions:
        by_node.setdefault(a.before, []).append(a)
    nodes = list(s.captured.gm.graph.nodes)
    for i in range(s.plan.num_nodes):
        for a in by_node.get(i, ()):
            resident += {"fetch": 1, "drop": -1}.get(a.kind, 0)
        peak = max(peak, resident * s.slot_bytes + s.os_device_bytes + last)
        if nodes[i].op != "output" and get(nodes[i], "param") is None:
            last = s.nonmodel[i]
            peak = max(peak, resident * s.slot_bytes + s.os_device_bytes + last)
    return peak


# ------------------------------------------------------------------ listing
def test_listing_has_a_provenance_header(tight):
    engine, s = tight
    text = str(s)
    header = [line for line in text.splitlines() if line.startswith("# ")]
    head = "\n".join(header)
    assert text.startswith("# pscompile schedule")
    for name in PASSES + tuple(p.name for p in s.passes):
        assert any(line.startswith(f"#   {name} ") for line in header), name
    for p in s.passes:     # each pass's one-line summary, without its repeated name
        assert p.summary.split(": ", 1)[-1] in head
    assert "model:  GPT(n_layer=2" in head and engine.layout.describe() in head
    assert f"device_memory {format_bytes(engine.budget)}" in head
    assert "# non-model memory: static estimate" in head
    assert f"h2d {format_bytes(s.plan.h2d_bytes)}" in head and f"d2h {format_bytes(s.plan.d2h_bytes)}" in head
    assert "def iteration(slot_0.." in text


def test_every_memory_node_is_listed_with_its_comment(tight):
    _, s = tight
    lines = {line.strip().split(" = ", 1)[0]: line for line in str(s).splitlines() if " = " in line}
    nodes = [n for n in s.gm.graph.nodes if is_memory_node(n)]
    assert {get(n, "mem").kind for n in nodes} >= {"fetch", "drop", "writeback", "store_grad"}
    for n in nodes:
        mem = get(n, "mem")
        line = lines[n.name]
        code, _, comment = line.partition("  # ")
        assert code.strip().startswith(f"{n.name} = pscompile.{mem.kind}("), line
        assert f"chunk {mem.chunk}" in comment, line
        if mem.slot is not None:
            assert f"slot {mem.slot}" in comment, line
        assert format_bytes(mem.nbytes) in comment, line
        if mem.kind in ("fetch", "writeback"):
            assert f"({mem.src}->{mem.dst})" in comment, line
    fetch = next(get(n, "mem") for n in nodes if get(n, "mem").kind == "fetch")
    assert any(f"# fetch chunk {fetch.chunk} -> slot {fetch.slot} (host->device), {format_bytes(fetch.nbytes)}"
               in line for line in lines.values())


def test_parameter_views_name_the_parameter_they_read(tight):
    _, s = tight
    lines = {line.strip().split(" = ", 1)[0]: line for line in str(s).splitlines() if " = " in line}
    views = [n for n in s.gm.graph.nodes if get(n, "param") is not None and not is_memory_node(n)]
    assert views
    for n in views:
        if get(n, "gather") is not None:        # the pages of a tensor spanning chunks, concatenated
            assert f"# gathers the {len(n.args[0])} pages of {get(n, 'param')} (chunks " in lines[n.name]
        else:
            assert f"# param {get(n, 'param')} (chunk" in lines[n.name], lines[n.name]


def test_listing_lines_stay_readable(tight):
    _, s = tight
    body = str(s).split("def iteration(", 1)[1].splitlines()[1:]
    assert len([line for line in body if not line.strip().startswith("#")]) == \
        sum(1 for n in s.gm.graph.nodes if n.op != "placeholder")
    for line in body:
        code = line.partition("  # ")[0]
        if " = " in code and "(" in code:                     # name = op(args): args cut at 100 chars
            assert len(code.split("(", 1)[1].rsplit(")", 1)[0]) <= 100, line


# ------------------------------------------------------------------ table and timeline
def test_table_has_one_row_per_node_or_memory_node(tight):
    _, s = tight
    full = s.table().splitlines()
    assert full[0].split() == ["idx", "name", "op", "chunk", "tier", "bytes", "live", "device", "source"]
    assert len(full) - 2 == len(s.gm.graph.nodes)
    mem = s.table(memory_only=True).splitlines()
    n_mem = sum(1 for n in s.gm.graph.nodes if is_memory_node(n))
    assert len(mem) - 2 == n_mem == len(s.memory_rows())
    fetch = next(line for line in mem if "pscompile.fetch" in line)
    assert "host->device" in fetch and format_bytes(s.slot_bytes) in fetch
    short = s.table(memory_only=True, limit=3).splitlines()
    assert len(short) == 2 + 3 + 1 and short[-1] == f"... {n_mem - 3} more row(s)"


def test_timeline_stays_within_the_budget_and_peaks_where_the_plan_does(tight):
    engine, s = tight
    tl = s.timeline()
    nodes = list(s.gm.graph.nodes)
    assert len(tl) == len(nodes)
    assert all(t["total_bytes"] == t["model_bytes"] + t["nonmodel_bytes"] for t in tl)
    assert all(t["budget"] == engine.budget for t in tl)
    peak = max(t["total_bytes"] for t in tl)
    assert peak <= engine.budget
    # the peak of the final plan (after prefetch_fetches moved fetches earlier), replayed on the
    # captured graph; plan_residency's own peak_device_bytes is the one before prefetching
    assert peak == plan_axis_peak(s) == s.peak_device_bytes
    assert peak >= s.plan.peak_device_bytes
    # model bytes: the replayed residency; non-model bytes of a captured node: its curve entry
    holds = {k for _, k in s.plan.initial}
    for n, t in zip(nodes, tl):
        mem = get(n, "mem") if is_memory_node(n) else None
        if mem is not None and mem.kind == "fetch":
            holds.add(mem.slot)
        elif mem is not None and mem.kind == "drop":
            holds.discard(mem.slot)
        assert t["model_bytes"] == len(holds) * s.slot_bytes + s.os_device_bytes, n.name
        if mem is None and get(n, "src_index") is not None and get(n, "param") is None:
            assert t["nonmodel_bytes"] == s.nonmodel[get(n, "src_index")], n.name
    assert {t["mem"] for t in tl} >= {"fetch", "drop", None}


# ------------------------------------------------------------------ files
def test_save_writes_the_listing_table_timeline_and_plot(tight, tmp_path):
    _, s = tight
    written = s.save(tmp_path / "sched")
    names = [p.name for p in written]
    assert names[:3] == ["schedule.txt", "schedule_table.txt", "timeline.json"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in written)
    assert (tmp_path / "sched" / "schedule.txt").read_text() == str(s) + "\n"
    data = json.loads((tmp_path / "sched" / "timeline.json").read_text())
    assert len(data["nodes"]) == len(s.gm.graph.nodes) and data["peak_device_bytes"] == s.peak_device_bytes
    if importlib.util.find_spec("matplotlib") is not None:
        assert names[3:] == ["timeline.png"]
        assert (tmp_path / "sched" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_without_matplotlib_skips_the_plot(tight, tmp_path, monkeypatch):
    _, s = tight
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, mod, None)          # import matplotlib... raises ImportError
    written = s.save(tmp_path)
    assert [p.name for p in written] == ["schedule.txt", "schedule_table.txt", "timeline.json"]
    assert not (tmp_path / "timeline.png").exists()


# ------------------------------------------------------------------ measured curve, no budget
def test_unlimited_budget_after_the_measuring_step():
    batch = make_batches("gpt", 1)[0]
    engine = compiled(None)
    try:
        before = engine.schedule
        engine.step(batch)
        after = engine.schedule
    finally:
        engine.close()
    assert not before.measured and after.measured
    head = after.header()
    assert "measured in the warm-up step" in head and "device_memory unlimited" in head
    last_compute = max(r.idx for r in after.rows if r.kind == "compute")
    drops = [r for r in after.rows if r.mem is not None and r.mem.kind == "drop"]
    assert all(r.idx > last_compute for r in drops), "without a budget chunks leave only at the end"
    assert all(t["budget"] is None for t in after.timeline())
    assert after.gm is after.scheduled.gm and after.plan is after.scheduled.plan
    assert "Schedule" in repr(after) and "unlimited" in repr(after)
