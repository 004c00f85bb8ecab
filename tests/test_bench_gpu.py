"""The commands of a lent GPU, on the CPU: ``bench/gpu.py --dry-run`` (the acceptance run) and
``bench/gpu.py --lease`` (bench/cudabench/lease.py: its dry run, its deadline, a hung test). The third,
``--peers``, is tests/test_gpu_peers.py."""

import json
import subprocess
import sys
from pathlib import Path

from inprocess import in_process, load_script

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


def test_gpu_acceptance_dry_run(tmp_path):
    """bench/gpu.py, the GPU acceptance run, end to end on the CPU with tiny shapes (--dry-run): every
    section present, parity rows track plain PyTorch under a budget that evicts, peaks within it."""
    out = tmp_path / "gpu.json"
    proc = in_process(lambda: load_script(BENCH).main(["--dry-run", "--markdown", "--out", str(out)]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["dry_run"] and not res["failures"]
    sections = {r["section"] for r in res["rows"]}
    assert sections == {"parity", "speed"}
    parity = [r for r in res["rows"] if r["section"] == "parity"]
    assert {(r["system"], r["dtype"]) for r in parity} == {(s, d) for s in ("hooks", "compiled eager")
                                                           for d in ("float32", "bfloat16")}
    assert all(r["tracks"] and r["evicted"] and r["within_budget"] for r in parity)
    speed = [r for r in res["rows"] if r["section"] == "speed" and "step_s" in r]
    assert {r["budget_name"] for r in speed} == {"none", "mid", "tight"}
    assert all(r["overlap_ratio"] > 0 for r in speed if r["system"] in ("hooks", "compiled eager"))
    assert "| speed" in proc.stdout and "| parity" in proc.stdout


def _lease_module():
    """bench/cudabench/lease.py, imported as the script imports it (bench/ first on the path)."""
    bench = str(BENCH.parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from cudabench import lease
    return lease


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_gpu_lease_dry_run(tmp_path):
    """``bench/gpu.py --lease --dry-run``: tests/gpu runs (all skip on the CPU) and each test has its
    line; then a line per speed and parity row, each run, or skipped with the reason; peaks within
    their budgets; the operator counts recorded."""
    lease = _lease_module()
    out = tmp_path / "lease.jsonl"
    proc = subprocess.run([sys.executable, str(BENCH.parent / "gpu.py"), "--lease", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = _lines(out)
    assert [x["kind"] for x in lines][:2] == ["meta", "collected"] and lines[-1] == dict(kind="end", failures=[],
                                                                                         t_s=lines[-1]["t_s"])
    (collected,) = [x["tests"] for x in lines if x["kind"] == "collected"]
    tests = [x for x in lines if x["kind"] == "test"]
    assert len(collected) >= 10 and [t["test"] for t in tests] == collected
    assert all(t["outcome"] == "skipped" and t["error"] == "needs CUDA" for t in tests)
    rows = [x for x in lines if x["kind"] == "row"]
    speed = [r for r in rows if r["section"] == "speed"]
    assert [(r["system"], r["budget_name"]) for r in speed] == list(lease.SPEED)
    assert len(rows) == len(lease.SPEED) + 2 * len(lease.SYSTEMS)
    for r in rows:
        assert "error" not in r
        if r["system"] in lease.INDUCTOR:
            assert r["skipped"] == "dry run without --inductor"
        else:
            assert "skipped" not in r and "compiled_share" in r and r["step_s"] > 0
            assert r["budget"] is None or (r["over_budget_bytes"] == 0 and r["peak_max"] <= r["budget"])
    assert all(r["compute_ops"] > 0 for r in rows if r["system"] == "compiled eager")
    assert all(r["tracks"] and r["evicted"] for r in rows if r["section"] == "parity" and "skipped" not in r)


def test_gpu_lease_skips_rows_past_the_deadline(tmp_path):
    """A row whose estimate does not fit in the time left is written as skipped, with why, and not
    run; the estimates grow with the model and fall once a system's compile caches are warm."""
    lease_mod = _lease_module()
    lease = lease_mod.Lease(tmp_path / "lease.jsonl", "cpu", dict(lease_mod.DRY), inductor=True)
    lease.out.write_text("")
    rows = lease_mod.speed_phase(lease, lease_mod.Clock(1.0), rate=1e9)      # every row needs more
    assert len(rows) == len(lease_mod.SPEED) and not lease.warm
    for r, line in zip(rows, _lines(lease.out)):
        assert r["skipped"].startswith("deadline:") and f"~{r['estimate_s']:.0f} s" in r["skipped"]
        assert line["kind"] == "row" and line["skipped"] == r["skipped"]
    parity = lease_mod.parity_phase(lease, lease_mod.Clock(1.0))
    assert len(parity) == 2 * len(lease_mod.SYSTEMS) and all(r["skipped"].startswith("deadline:") for r in parity)
    assert len(_lines(lease.out)) == len(rows) + len(parity)
    s = lease_mod.LEASE
    cold = lease_mod.estimate_s("compiled inductor", s["speed"], s, True, warm=False)
    assert lease_mod.estimate_s("compiled inductor", s["parity"], s, True, warm=False) < cold
    assert lease_mod.estimate_s("compiled inductor", s["speed"], s, True, warm=True) < cold
    assert lease_mod.estimate_s("compiled eager", s["speed"], s, False, False) < cold


def test_gpu_lease_tests_phase_survives_a_hung_test(tmp_path):
    """The tests phase: a test that runs past its limit is stopped (faulthandler), written as failed
    with the reason, and pytest starts again on the tests after it; every test gets one line."""
    lease_mod = _lease_module()
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_x.py").write_text(
        "import time\n\ndef test_a():\n    pass\n\ndef test_hang():\n    time.sleep(60)\n\n"
        "def test_c():\n    assert 1 == 2, 'one is not two'\n")
    lease = lease_mod.Lease(tmp_path / "lease.jsonl", "cpu", dict(lease_mod.DRY), inductor=False)
    lease.out.write_text("")
    tests = lease_mod.tests_phase(lease, limit_s=60, test_s=1, targets=["t"], cwd=tmp_path)
    got = {t["test"].split("::")[1]: t for t in tests}
    assert [t["test"].split("::")[1] for t in tests] == ["test_a", "test_hang", "test_c"]
    assert got["test_a"]["outcome"] == "passed"
    assert got["test_hang"]["outcome"] == "failed" and "ran past its limit of 1 s" in got["test_hang"]["error"]
    assert got["test_c"]["outcome"] == "failed" and got["test_c"]["error"] == "AssertionError: one is not two"
    assert "test_hang" in lease.stacks.read_text()
    assert [x["kind"] for x in _lines(lease.out)] == ["collected", "test", "test", "collected", "test"]
