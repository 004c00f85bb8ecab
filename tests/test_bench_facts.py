"""bench/facts.py produces the measured facts of docs/benchmarks.md: the accumulation-precision figures must
show fp32 accumulation far more precise than bf16, and both matmul timings must be measured."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "facts.py"


def test_facts_quick(tmp_path):
    out = tmp_path / "facts.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    facts = json.loads(out.read_text())
    acc = facts["accumulation"]
    assert 1e-4 < acc["bf16_rel_error"] < 1e-1 and acc["fp32_rel_error"] < 1e-6
    assert facts["matmul_s"]["float32"] > 0 and facts["matmul_s"]["bfloat16"] > 0
