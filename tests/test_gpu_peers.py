"""bench/cudabench/versus.py (``bench/gpu.py --peers``): pscompile against FSDP2 + CPU offload, DeepSpeed
ZeRO-3 offload and plain torch.compile. The command runs end to end on the CPU (``--dry-run``); its
verdicts, peaks and loss checks are tested on rows made here, so a wrong row cannot pass."""

import json
import sys
from pathlib import Path

import pytest
import torch

from inprocess import in_process, load_script

BENCH = Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from cudabench import peers  # noqa: E402
from cudabench import versus  # noqa: E402


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "peers.jsonl"
    proc = in_process(lambda: load_script(BENCH / "gpu.py").main(["--peers", "--dry-run", "--out", str(out),
                                                                  "--wheels", str(out.parent / "none")]))
    return proc, _lines(out)


def test_the_dry_run_runs_every_row_in_order_and_each_tracks_plain_pytorch(dry_run):
    proc, lines = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[0]["kind"] == "meta" and lines[-1]["kind"] == "end" and lines[-1]["failures"] == []
    rows = [x for x in lines if x["kind"] == "row" and x["section"] == "speed"]
    plan = [("compiled eager" if s == "main" else s, b, e or None) for s, b, e in versus.PLAN + versus.AB]
    assert [(r["system"], r["budget_name"], r["variant"]) for r in rows] == plan
    ran = [r for r in rows if "skipped" not in r]
    assert {r["system"] for r in ran} >= {"plain PyTorch", "compiled eager", versus.FSDP2}
    for r in rows:
        assert "error" not in r, r
        if r["system"] == "plain torch.compile":
            assert r["skipped"] == "dry run without --inductor"
        if r["system"] == versus.DEEPSPEED and "skipped" in r:      # not installed in CI
            assert r["skipped"].startswith("import deepspeed failed")
    derived = {(d["system"], d["budget_name"]): d for d in lines if d["kind"] == "derived"}
    assert len(derived) == len(ran)
    for d in derived.values():
        assert d["tracks"] and d["max_rel_loss"] <= 1e-4 and d["tokens_per_s"] > 0 and d["tflops"] > 0
        assert d["host_peak_bytes"] > 0 and d["peak_fraction"] is None          # no GPU peak on a CPU


def test_the_dry_run_holds_every_system_to_one_cap(dry_run):
    _, lines = dry_run
    capped = [x for x in lines if x["kind"] == "row" and x.get("budget_name") == "cap" and "skipped" not in x]
    caps = {x["cap_parts"]["cap"] for x in capped}
    assert len(caps) == 1
    (cap,) = caps
    parts = capped[0]["cap_parts"]
    assert cap == max(int(parts["minimum"] * 1.15), parts["quarter_of_model_data"])
    for r in capped:
        if r["system"] in (versus.FSDP2, versus.DEEPSPEED):      # (DeepSpeed: where it is installed)
            assert r["cap"] == cap and r["cap_enforced"] is False       # the CPU has no allocator limit
        else:
            assert r["budget"] == cap and r["over_budget_bytes"] == 0 and r["peak_max"] <= cap
            assert r["busier_bytes"] > 0                                 # the cap moved chunks
    overlap = [x for x in lines if x["kind"] == "overlap"]
    assert {x["system"] for x in overlap} >= {"compiled eager", "compiled eager, overlap_update=True"}
    assert all(x["overlap_ratio"] > 0 for x in overlap)


def test_the_dry_run_decides_nothing_and_climbs_pscompiles_ladder(dry_run):
    _, lines = dry_run
    decisions = [x for x in lines if x["kind"] == "decision"]
    assert [d["variant"] for d in decisions] == [e for _, _, e in versus.AB]
    assert all(d["verdict"] == "dry run: times mean nothing" and d["step_ratio"] > 0 for d in decisions)
    caps = {x["system"]: x for x in lines if x["kind"] == "row" and x["section"] == "capacity"}
    ours = caps["compiled eager"]
    assert ours["largest"]["size"] == [2, 128] and ours["stopped_by"].startswith("BudgetError")
    assert caps[versus.FSDP2]["skipped"] == caps["plain PyTorch"]["skipped"] == "the CPU cannot cap a peer's memory"


def _row(system, step_s, variant=None, losses=(5.0, 4.0), **kw):
    return dict(section="speed", system=system, budget_name="cap", variant=variant, step_s=step_s,
                steps=[dict(loss=x) for x in losses], first_s=1.0, **kw)


def test_an_a_b_verdict_follows_the_step_ratio():
    rows = [_row("compiled inductor", 1.0), _row("compiled inductor", 0.9, {"overlap_update": True}),
            _row("compiled inductor", 1.1, {"pinned_host": False}),
            _row("compiled inductor", 1.01, {"optimizer_threads": "one less"}),
            dict(section="speed", system="compiled inductor", budget_name="cap", variant={"x": 1}, skipped="deadline")]
    got = [(d["verdict"], d.get("why")) for d in versus.decisions(rows, dry_run=False)]
    assert got == [("the variant wins", None), ("the default wins", None), ("no difference", None),
                   ("not measured", "deadline")]


def test_a_row_whose_losses_leave_plain_pytorchs_fails_the_run():
    class _Lease:
        device, s = "cpu", dict(versus.DRY)
    ref = _row("plain PyTorch", 0.01)
    close, far = _row(versus.FSDP2, 0.02, losses=(5.0, 4.001)), _row(versus.FSDP2, 0.02, losses=(5.0, 4.4))
    for r in (close, far):
        versus.derive(r, _Lease, ref, torch.float32)
    assert close["tracks"] is False and far["tracks"] is False                    # fp32: within 1e-4
    versus.derive(close, _Lease, ref, torch.bfloat16)
    assert close["tracks"] is True and close["max_rel_loss"] == pytest.approx(2.5e-4)
    versus.derive(far, _Lease, ref, torch.bfloat16)
    assert far["tracks"] is False and any("from plain PyTorch" in f for f in versus.failures([far]))


def test_the_overlap_ratio_is_against_the_slower_of_compute_and_the_link():
    alone = dict(_row("compiled eager", 1.0), budget_name="none", busier_bytes=0, rate=1e9)
    link_bound = _row("compiled eager", 4.0, busier_bytes=3e9, rate=1e9)       # 3 s of copies
    compute_bound = _row("compiled eager", 2.0, busier_bytes=1e8, rate=1e9)    # 0.1 s of copies
    versus.overlap_ratios([alone, link_bound, compute_bound])
    assert (alone["overlap_ratio"], link_bound["overlap_ratio"], compute_bound["overlap_ratio"]) == (1.0, 4 / 3, 2.0)


def test_a_gpus_bf16_peak_is_read_from_its_name():
    assert peers.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peers.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peers.peak_flops("NVIDIA H200") == 989e12
    assert peers.peak_flops("Some Future GPU") is None
    assert peers.step_flops(10, 100) == 6000


def test_deepspeed_missing_and_no_wheels_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)              # import deepspeed raises ImportError
    with pytest.raises(peers.Unavailable, match="pip install deepspeed, or --wheels DIR"):
        peers.deepspeed_module(tmp_path / "absent")
    (tmp_path / "w").mkdir()
    with pytest.raises(peers.Unavailable, match="no wheel there"):
        peers.deepspeed_module(tmp_path / "w")
