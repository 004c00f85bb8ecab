"""bench/facts.py produces the measured facts of docs/benchmarks.md: the accumulation-precision figures must
show fp32 accumulation far more precise than bf16, both matmul timings must be measured, and a call of a
memory op must cost under half a ``torch.library.custom_op``'s."""

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
    # the memory ops are Library.define ops: a call costs a fraction of a torch.library.custom_op's
    # (a compiled program makes one per memory node; docs/design.md, "Memory ops")
    calls = facts["op_call"]
    assert calls["library_us"] < 0.5 * calls["custom_op_us"], calls
